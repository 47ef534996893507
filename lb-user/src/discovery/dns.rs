//! `kind = "dns"`: every A and AAAA record of a name, each `address:port` one server, and the
//! answer's TTL, which brings the next query forward when it is shorter than the interval.
//! Every run asks the DNS servers afresh (a new resolver, so no cache answers for them); the
//! hosts file is not read: an entry there has no TTL and would hide what DNS says.

use std::{collections::BTreeSet, net::SocketAddr, time::Instant};

use hickory_resolver::{
    TokioResolver,
    config::{LookupIpStrategy, NameServerConfig, ResolveHosts, ResolverConfig},
    name_server::TokioConnectionProvider,
    proto::xfer::Protocol,
};

use super::{DiscoveryError, Found};
use crate::{addr::ServerAddr, config::DnsDiscovery};

fn resolver(d: &DnsDiscovery) -> Result<TokioResolver, DiscoveryError> {
    let failed = |reason: String| DiscoveryError::Resolve {
        name: d.name.clone(),
        reason,
    };
    let mut builder = if d.nameservers.is_empty() {
        TokioResolver::builder_tokio()
            .map_err(|e| failed(format!("cannot read the system resolver config: {e}")))?
    } else {
        let mut config = ResolverConfig::new();
        for ns in &d.nameservers {
            let addr: SocketAddr = crate::config::nameserver(ns).map_err(failed)?;
            config.add_name_server(NameServerConfig::new(addr, Protocol::Udp));
            config.add_name_server(NameServerConfig::new(addr, Protocol::Tcp));
        }
        TokioResolver::builder_with_config(config, TokioConnectionProvider::default())
    };
    let opts = builder.options_mut();
    opts.ip_strategy = LookupIpStrategy::Ipv4AndIpv6;
    opts.use_hosts_file = ResolveHosts::Never;
    opts.timeout = d.timeout.0 / 2;
    opts.attempts = 2;
    Ok(builder.build())
}

/// Resolve `d.name` once.
///
/// # Errors
/// [`DiscoveryError::Resolve`]: no DNS server answered, or the name has no A/AAAA record.
pub(super) async fn resolve(d: &DnsDiscovery) -> Result<Found, DiscoveryError> {
    let lookup =
        resolver(d)?
            .lookup_ip(d.name.as_str())
            .await
            .map_err(|e| DiscoveryError::Resolve {
                name: d.name.clone(),
                reason: e.to_string(),
            })?;
    let ttl = lookup
        .valid_until()
        .saturating_duration_since(Instant::now());
    // Sorted, so a rotated answer is the same answer.
    let ips: BTreeSet<std::net::IpAddr> = lookup.iter().collect();
    let servers = ips
        .into_iter()
        .filter_map(|ip| ServerAddr::from_socket_addr(SocketAddr::new(ip, d.port)).ok())
        .collect();
    Ok(Found {
        servers,
        default: None,
        ttl: Some(ttl),
    })
}
