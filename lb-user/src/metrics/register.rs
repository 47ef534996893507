//! The registration of lb's families, by group (state and traffic, kernel events, the data
//! path's state, dials and discovery): each family's name, help text and metric, in the order
//! `/metrics` lists them.

use super::{Listed, Metrics};

impl Metrics {
    /// Register lb's families of server state, connections, dials, checks, kills and bytes in `r`.
    pub(super) fn register_state_and_traffic(&self, r: &mut Listed) {
        r.register(
            "server_state",
            "Server state: 0 INVALID, 1 FAILED, 2 STANDBY, 3 UNCHECKED, 4 RECOVERING, 5 HEALTHY, 6 PREFERRED, 7 ACTIVE",
            self.server_state.clone(),
        );
        r.register(
            "server_connections",
            "Open client connections per server",
            self.server_connections.clone(),
        );
        r.register(
            "dial_duration_seconds",
            "Time to dial a server, in seconds",
            self.dial_duration.clone(),
        );
        r.register(
            "health_checks",
            "Health checks run, by result",
            self.health_checks.clone(),
        );
        r.register(
            "health_check_duration_seconds",
            "Duration of one health check, in seconds",
            self.health_check_duration.clone(),
        );
        r.register(
            "connections_killed",
            "Connections lb reset, by reason",
            self.connections_killed.clone(),
        );
        r.register(
            "spliced_connections",
            "Connections whose client-to-server bytes the kernel splices now",
            self.spliced_connections.clone(),
        );
        r.register(
            "spliced_bytes",
            "Bytes carried by the kernel splice, by direction",
            self.spliced_bytes.clone(),
        );
        r.register(
            "copied_bytes",
            "Bytes lb copied in userspace, by direction",
            self.copied_bytes.clone(),
        );
        r.register(
            "splice_fallbacks",
            "Client sends that took the copy path instead of the splice, by reason",
            self.splice_fallbacks.clone(),
        );
    }

    /// Register lb's families of kernel counters, runtime tasks, in-flight checks and
    /// connect-time pins in `r`.
    pub(super) fn register_kernel_events(&self, r: &mut Listed) {
        r.register(
            "splice_blocking_redirects",
            "Sends of blocking clients spliced past the credit; each waits in the kernel if the server socket has no room, as on a direct connection",
            self.splice_blocking_redirects.clone(),
        );
        r.register(
            "splice_credit_refreshes",
            "Times the kernel program asked lb to recompute a connection's credit from its server socket's queue",
            self.splice_credit_refreshes.clone(),
        );
        r.register(
            "passive_events",
            "Connect-time sockets' reports about their server: connect_failed (a rewritten connect never got established) or rto (an established socket's first retransmission timeout)",
            self.passive_events.clone(),
        );
        r.register(
            "passive_event_drops",
            "Connect-time events the kernel dropped because lb's ring buffer was full",
            self.passive_event_drops.clone(),
        );
        r.register(
            "connect_kill_netns_failures",
            "Connect-time sockets a kill or abort could not reach because their process's network namespace could not be opened (process gone, or no CAP_SYS_PTRACE) or entered (no CAP_SYS_ADMIN); each process is logged with its pid",
            self.connect_kill_netns_failures.clone(),
        );
        r.register(
            "connect_suspect",
            "Times the kernel marked a server suspect because a connect-time connect's SYN went unanswered suspect_after times; new connects avoid it until a check passes",
            self.connect_suspect.clone(),
        );
        r.register(
            "netns_skipped",
            "Sockets of another network namespace than lb's that dialed a listener's address and were left alone (namespaces = \"own\"): connect (not rewritten) or sockops (not registered for the splice)",
            self.netns_skipped.clone(),
        );
        r.register(
            "sockops_register_failures",
            "Client sockets the sockops program could not register for the splice, so none of their bytes is spliced (they take the copy path): flows_map or netns_map (an entry could not be written), sockhash (the sockhash is full or refused the socket)",
            self.sockops_register_failures.clone(),
        );
        r.register(
            "connect_unrewritten",
            "Connects to a connect-time listener the connect programs left as they were, so the client reaches lb's listener: orphaned (lb's heartbeat older than datapath.orphan_timeout), no_servers (no usable server in the connect table), family (no route between the socket's and the server's address family), record_map (the socket's record could not be written)",
            self.connect_unrewritten.clone(),
        );
        r.register(
            "runtime_alive_tasks",
            "Tasks alive in lb's runtime: one per connection lb carries, one per health-check loop and discovery source, and lb's own (admin connections run on a runtime of their own)",
            self.runtime_tasks.clone(),
        );
        r.register(
            "inflight_checks",
            "Health checks running now, on-demand ones included",
            self.inflight_checks.clone(),
        );
        r.register(
            "connect_heartbeat_age_seconds",
            "Age of lb's last heartbeat as the connect-time programs see it; past datapath.orphan_timeout they stop rewriting",
            self.connect_heartbeat_age.clone(),
        );
        r.register(
            "connect_pins_adopted",
            "Connect-time pin directory in use: 1 when this lb adopted the programs an earlier lb left pinned, 0 when it pinned its own",
            self.connect_pins_adopted.clone(),
        );
    }

    /// Register the families that say which data path and forwarding lb runs, and why not the
    /// one asked for, in `r`.
    pub(super) fn register_datapath_state(&self, r: &mut Listed) {
        r.register(
            "datapath_info",
            "Data path in use (value 1)",
            self.datapath_info.clone(),
        );
        r.register(
            "datapath_fallback_info",
            "Why datapath.mode = auto runs the userspace copy path instead of the kernel data path: 1 for the reason (not_privileged, cgroup, kernel_feature, load_failed, other), 0 for the others; all 0 while the kernel data path runs",
            self.datapath_fallback.clone(),
        );
        r.register(
            "balancer_forwarding_info",
            "Forwarding in effect per balancer: splice (through lb) or connect (kernel sends clients straight to the server) (value 1)",
            self.balancer_forwarding.clone(),
        );
        r.register(
            "balancer_forwarding_fallback_info",
            "Why a balancer that asked for connect-time forwarding (connect or auto) forwards through lb instead: 1 for the reason (datapath_off, kernel_feature, proxy), 0 for the others; all 0 while it forwards as asked",
            self.forwarding_fallback.clone(),
        );
    }

    /// Register lb's families of raced dials, discovery and refused clients in `r`.
    pub(super) fn register_dials_and_discovery(&self, r: &mut Listed) {
        r.register(
            "connections",
            "Client connections accepted",
            self.connections_total.clone(),
        );
        r.register(
            "dials_abandoned",
            "Dials given up because their server turned FAILED, was removed or held meanwhile",
            self.dials_abandoned.clone(),
        );
        r.register(
            "dials_raced",
            "Dials made at once to every server because all were FAILED",
            self.dials_raced.clone(),
        );
        r.register(
            "discovery_runs",
            "Discovery runs, by result: ok gave a usable list, error failed or found no server (the last good set stayed)",
            self.discovery_runs.clone(),
        );
        r.register(
            "discovery_last_success_timestamp_seconds",
            "When discovery last gave a usable list, in seconds since the Unix epoch",
            self.discovery_last_success.clone(),
        );
        r.register(
            "discovery_servers",
            "Servers in the last usable list discovery gave",
            self.discovery_servers.clone(),
        );
        r.register(
            "clients_refused",
            "Clients reset without reaching a server",
            self.clients_refused.clone(),
        );
        r.register(
            "connections_rejected",
            "Clients reset at accept by a limit (max_connections)",
            self.connections_rejected.clone(),
        );
        r.register(
            "accept_errors",
            "Failed accepts on a balancer's listeners, by error (EMFILE, ENFILE: out of descriptors)",
            self.accept_errors.clone(),
        );
    }
}
