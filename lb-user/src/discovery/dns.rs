//! `kind = "dns"`: every A and AAAA record of a name, each `address:port` one server, and the
//! answer's TTL, which brings the next query forward when it is shorter than the interval.
//! Every run asks the DNS servers afresh (a new resolver, so no cache answers for them); the
//! hosts file is not read: an entry there has no TTL and would hide what DNS says. The same
//! query resolves the host names of server lists ([`super::names`]), hosts file included.

use std::{collections::BTreeSet, net::SocketAddr, time::Instant};

use hickory_resolver::{
    TokioResolver,
    config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig},
    name_server::TokioConnectionProvider,
    proto::xfer::Protocol,
};

use super::{DiscoveryError, Found};
use crate::{addr::ServerAddr, config::DnsDiscovery};

/// What one query asks and where: the name, the port its servers listen on, the DNS servers
/// (the system's when empty), the bound on the query with its retries, and whether the hosts
/// file answers first (names of a server list, as the system resolver does) or not (the `dns`
/// source, whose answer must be DNS's own).
pub(crate) struct Query<'a> {
    pub name: &'a str,
    pub port: u16,
    pub nameservers: &'a [String],
    pub timeout: std::time::Duration,
    pub hosts_file: bool,
}

fn resolver(q: &Query<'_>) -> Result<TokioResolver, DiscoveryError> {
    let failed = |reason: String| DiscoveryError::Resolve {
        name: q.name.to_string(),
        reason,
    };
    let mut builder = if q.nameservers.is_empty() {
        TokioResolver::builder_tokio()
            .map_err(|e| failed(format!("cannot read the system resolver config: {e}")))?
    } else {
        let mut config = ResolverConfig::new();
        for ns in q.nameservers {
            let addr: SocketAddr =
                crate::config::nameserver(ns).map_err(|e| failed(e.to_string()))?;
            config.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
            config.add_name_server(NameServerConfig::new(addr, Protocol::Tcp));
        }
        TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
    };
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.use_hosts_file = if q.hosts_file {
        ResolveHosts::Always
    } else {
        ResolveHosts::Never
    };
    opts.timeout = q.timeout / 2;
    opts.attempts = 2;
    Ok(builder.build())
}

/// Resolve `d.name` once.
///
/// # Errors
/// [`DiscoveryError::Resolve`]: no DNS server answered, or the name has no A/AAAA record.
pub(super) async fn resolve(d: &DnsDiscovery) -> Result<Found, DiscoveryError> {
    lookup(&Query {
        name: &d.name,
        port: d.port,
        nameservers: &d.nameservers,
        timeout: d.timeout.0,
        hosts_file: false,
    })
    .await
}

/// Ask for every A and AAAA record of `q.name` once, with a new resolver (no cache): each
/// address with `q.port` is one server, sorted (a rotated answer is the same answer), and the
/// answer's TTL.
///
/// # Errors
/// [`DiscoveryError::Resolve`]: no DNS server answered, or the name has no A/AAAA record.
pub(crate) async fn lookup(q: &Query<'_>) -> Result<Found, DiscoveryError> {
    let lookup = resolver(q)?
        .lookup_ip(q.name)
        .await
        .map_err(|e| DiscoveryError::Resolve {
            name: q.name.to_string(),
            reason: e.to_string(),
        })?;
    let ttl = lookup
        .valid_until()
        .saturating_duration_since(Instant::now());
    // Sorted, so a rotated answer is the same answer.
    let ips: BTreeSet<std::net::IpAddr> = lookup.iter().collect();
    let servers = ips
        .into_iter()
        .filter_map(|ip| ServerAddr::from_socket_addr(SocketAddr::new(ip, q.port)).ok())
        .collect();
    Ok(Found {
        servers,
        default: None,
        ttl: Some(ttl),
    })
}
