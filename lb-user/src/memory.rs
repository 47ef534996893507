//! lb's heap allocator: what it is and how it is configured.
//!
//! Builds against glibc (`target_env = "gnu"`) allocate with jemalloc (the `tikv-jemallocator`
//! crate, set as the `lb` binary's global allocator) under [`MALLOC_CONF`]. Builds against
//! musl, such as the packages' static binaries, keep musl's allocator, which unmaps freed
//! memory itself.
//!
//! Why not glibc's malloc: a node daemon's resident memory should follow what it holds, so that
//! a rise that stays is a leak. glibc keeps freed blocks in per-thread arenas, and even
//! `malloc_trim(0)` gives a page back only once no live block is left on it. Under connection
//! churn the few blocks that outlive each burst land on new pages, so lb's RSS with the splice
//! crept up round after round while its live heap stayed the same (heaptrack: 1.41 MB live
//! after one and after four rounds of 4,000 streams and 120,000 short connections). jemalloc
//! keeps blocks of one size together and, configured as below, gives every page back as soon
//! as it is empty. The churn soak (`cargo xtask bench --only soak`) checks the result.
//!
//! [`MALLOC_CONF`], option by option (jemalloc's `opt.*` names):
//! - `narenas:1`: one arena for every thread. lb allocates per connection and per control-plane
//!   event, never per byte forwarded, so one arena's lock costs little, and there are no
//!   per-thread arenas to hold memory apart;
//! - `tcache:false`: no per-thread caches of freed blocks;
//! - `dirty_decay_ms:0` and `muzzy_decay_ms:0`: an empty page goes back to the kernel at once
//!   (`madvise`), with no background thread and no delay.
//!
//! An operator can add to or override these when lb starts with the environment variable
//! `_RJEM_MALLOC_CONF` (jemalloc's `MALLOC_CONF` under the `_rjem_` prefix the crate gives its
//! symbols), for example `_RJEM_MALLOC_CONF=stats_print:true` to print the allocator's
//! statistics at exit.

/// jemalloc's options for lb, NUL-terminated (jemalloc reads it as a C string before `main`).
/// The `lb` binary exports its first byte as `_rjem_malloc_conf`.
pub const MALLOC_CONF: &[u8] = b"narenas:1,tcache:false,dirty_decay_ms:0,muzzy_decay_ms:0\0";
