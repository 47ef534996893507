//! The DNS test support itself: dnsmasq on a test host answers A and AAAA records for a name
//! with the chosen TTL, and a rewrite of its answers shows in the next queries. (The discovery
//! tests that point lb at it live with the discovery code.)

use std::net::IpAddr;

use anyhow::{Result, ensure};
use lb_tests::{DnsServer, Host, RecordType, skip_unless_root};

#[test]
fn dns_answers_change_after_a_rewrite() -> Result<()> {
    if skip_unless_root() {
        return Ok(());
    }
    // Two test hosts for the records to point at (nothing dials them here).
    let (a, b) = (Host::new()?, Host::new()?);
    let mut dns = DnsServer::start(5)?;
    let name = "etcd.lb.test";
    let mapped = |h: &Host| -> IpAddr { IpAddr::V6(h.ip.to_ipv6_mapped()) };

    let took = dns.set_records(name, &[IpAddr::V4(a.ip), mapped(&a)])?;
    let ans = dns.query(name, RecordType::A)?;
    ensure!(ans.rcode == 0, "{ans:?}");
    ensure!(ans.records == vec![(IpAddr::V4(a.ip), 5)], "A: {ans:?}");
    let ans6 = dns.query(name, RecordType::Aaaa)?;
    ensure!(ans6.records == vec![(mapped(&a), 5)], "AAAA: {ans6:?}");
    eprintln!(
        "{name} at {}: A {ans:?}, AAAA {ans6:?} ({took:?} after the write)",
        dns.addr()
    );

    let took = dns.set_records(name, &[IpAddr::V4(a.ip), IpAddr::V4(b.ip)])?;
    let ans = dns.query(name, RecordType::A)?;
    let mut want = vec![IpAddr::V4(a.ip), IpAddr::V4(b.ip)];
    want.sort_unstable();
    ensure!(ans.addrs() == want, "A after the rewrite: {ans:?}");
    ensure!(
        dns.query(name, RecordType::Aaaa)?.records.is_empty(),
        "AAAA should be gone"
    );
    eprintln!("rewritten: A {ans:?} ({took:?} after the write)");

    dns.set_records(name, &[])?;
    let gone = dns.query(name, RecordType::A)?;
    ensure!(
        gone.rcode == 3 && gone.records.is_empty(),
        "{name} should be NXDOMAIN: {gone:?}"
    );
    eprintln!("removed: {gone:?}");
    Ok(())
}
