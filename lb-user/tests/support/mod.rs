//! What lb-user's in-process integration tests share: a balancer's server states read from
//! [`Balancer::status`] and waited for (the in-process counterpart of the privileged suites'
//! `lb_tests::wait_server_state`, which reads `/status` of an lb process).

use std::time::{Duration, Instant};

use lb::balancer::{Balancer, ServerState};

/// `server`'s state in `b`; panics when `b` has no such server.
pub fn state(b: &Balancer, server: &str) -> ServerState {
    b.status()
        .into_iter()
        .find(|s| s.address == server)
        .unwrap_or_else(|| panic!("no server {server}"))
        .state
}

/// Poll (every 5 ms) until `server` is in `want`; panics once `limit` passes. Returns how
/// long it took.
pub async fn wait_server_state(
    b: &Balancer,
    server: &str,
    want: ServerState,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    while state(b, server) != want {
        assert!(
            start.elapsed() < limit,
            "{server} still {} after {limit:?}, want {want}",
            state(b, server)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}
