//! lb: a client-side TCP load balancer whose kernel programs send clients' connects straight to
//! a server (connect-time, [`connect`]) or splice client sockets to server sockets ([`proxy`]). The binary (`main.rs`) parses the command line and calls into these modules.
//!
//! Minimum kernel for the `bpf` data path: 5.8 for connect-time, 5.15 for the splice; the
//! userspace path runs anywhere Linux runs.

// Every `unsafe` block carries an `#[expect(unsafe_code, reason = ...)]` and a `// SAFETY:`
// comment; a new one without them does not compile (clippy).
#![deny(unsafe_code)]
#![warn(clippy::too_many_lines, clippy::undocumented_unsafe_blocks)]

pub mod addr;
pub mod admin;
pub mod balancer;
pub mod cli;
pub mod config;
pub mod connect;
pub mod daemon;
pub mod datapath;
pub mod discovery;
pub mod errors;
pub mod files;
#[cfg(feature = "fuzz")]
#[doc(hidden)]
pub mod fuzz;
pub mod handover;
pub mod health;
pub mod http1;
pub mod kill;
pub mod memory;
pub mod metrics;
pub mod net;
pub mod netns;
pub mod proxy;
pub mod server_state;
pub mod singleflight;
pub mod sock_diag;
