//! Test support for lb's privileged integration tests and the benchmark: test hosts in network
//! namespaces (198.18.0.0/15 only), a child cgroup for clients, an `lb` process (also one
//! followed across `lb upgrade`), the `lbt` client/server, and the servers server discovery is
//! tested against: an etcd cluster with a supervisor beside each member, and a DNS server whose
//! answers a test changes. Everything made here is removed on drop, also when a test fails.
//!
//! One module per concern; everything the tests, `lbt` and xtask use is re-exported here.

mod cgroup;
mod cgroup_programs;
mod client;
mod cmd;
mod connect;
mod deploy;
mod dns;
mod etcd;
mod fallback;
mod fixture;
mod fleet;
mod host;
mod http;
mod lb;
mod maps;
mod pinned;
mod pins;
mod procfs;
mod skip;
mod stream;
mod timing;
mod tmp;
mod upgrading;

pub use cgroup::{RttCallbacks, TestCgroup, cgroup2_root};
pub use cgroup_programs::cgroup_programs;
pub use client::{Holder, Place, client_command, placed_command, run_client};
pub use cmd::{first_stdout_line, lb_bin, lbt_bin, output_within, set_bin_dir, sh, sibling_bin};
pub use connect::ConnectLb;
pub use deploy::{
    configmap_entry, container_args, repo_file, setpriv_as, unit_values, yaml_scalar,
};
pub use dns::{DNS_PORT, DnsAnswer, DnsServer, RecordType, dns_query};
pub use etcd::{
    ETCD_CLIENT_PORT, ETCD_PEER_PORT, EtcdCluster, EtcdMember, EtcdWatch, MemberInfo,
    SUPERVISOR_PORT, WatchEvent, etcdctl, etcdctl_output,
};
pub use fallback::{NO_SPLICE_REASON, splice_fallback_asserted};
pub use fixture::{Fixture, Toml};
pub use fleet::{LAYOUT_SERVERS, Layout, Supervisor, TestPki, https_ping, layout, layout_from};
pub use host::{ClientNs, Host, serving_hosts, toml_addrs};
pub use http::{http_get, http_request, http_request_with, unix_request};
pub use lb::{Lb, free_port, wait_server_state, wait_until};
pub use maps::lb_map_entries;
pub use pinned::{
    CONNECT_PROGRAMS, all_connected, all_reset, pinned_connect_lb, pinned_health, pinned_links,
    pinned_map, pinned_test_ready, pinned_u64,
};
pub use pins::{bpffs_mount, private_bpffs, remove_pins, unique_pin_dir};
pub use procfs::{open_fds, raise_nofile, rss_anon_kib, rss_kib, threads};
pub use skip::{
    NEEDS_ROOT, SKIP_LOG_ENV, is_root, kernel_version, skip, skip_line, skip_unless_kernel,
    skip_unless_root, splice_kernel, test_name,
};
pub use stream::{Digest, PatternStream};
pub use timing::{NO_TIMING_ENV, VM_ENV, timed};
pub use tmp::TempDir;
pub use upgrading::{Answer, UpLb};
