//! Reading the sending client's `struct tcp_sock` from the sk_msg program (and, for a failed
//! connect's error, from connect-time's sockops program): `bpf_skc_to_tcp_sock` (5.9) and
//! `bpf_probe_read_kernel` (5.5) at field offsets lb reads from the running kernel's BTF and
//! sets as globals at load time. A global lb leaves at 0 turns a read off; the globals are
//! frozen, so the verifier drops what they turn off.

use aya_ebpf::{
    cty::c_void,
    helpers::{bpf_probe_read_kernel, bpf_skc_to_tcp_sock},
    programs::SkMsgContext,
};
use lb_common::{FlowState, MAX_SCHEDULE_TIMEOUT, O_NONBLOCK};

// Kernel struct field offsets (bytes), set by lb at load time from the running kernel's BTF
// (names in lb_common::GLOBAL_OFF_*); read with read_volatile so the placeholders never fold.
#[unsafe(no_mangle)]
static LB_OFF_SK_SOCKET: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_SOCKET_FILE: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_F_FLAGS: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_SNDTIMEO: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_WRITE_SEQ: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_ULP_OPS: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_MSG_SK_REDIR: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_WMEM_QUEUED: u32 = 0;
#[unsafe(no_mangle)]
static LB_OFF_SNDBUF: u32 = 0;
// 1 when blocking clients may splice past the credit (lb_common::GLOBAL_BLOCKING_SPLICE).
#[unsafe(no_mangle)]
static LB_BLOCKING_SPLICE: u32 = 0;
// 1 when this program may read the client's socket (lb_common::GLOBAL_KERNEL_READS); lb pairs
// nothing otherwise.
#[unsafe(no_mangle)]
static LB_KERNEL_READS: u32 = 0;

/// Read a `T` at `base + off` in kernel memory; `None` when the read faults.
#[inline(always)]
pub(crate) fn read_kernel<T>(base: *const u8, off: u32) -> Option<T> {
    // SAFETY: bpf_probe_read_kernel checks the address and fails instead of faulting.
    unsafe { bpf_probe_read_kernel(base.wrapping_add(off as usize).cast::<T>()) }.ok()
}

/// The sending client's `struct tcp_sock`, for [`read_kernel`]; `None` when lb turned kernel
/// reads off (`LB_KERNEL_READS` 0: a frozen global, so the verifier sees a constant and drops
/// the helper calls below, which such kernels refuse) or the socket is not TCP.
#[inline(always)]
pub(crate) fn client_tcp_sock(ctx: &SkMsgContext) -> Option<*const u8> {
    // SAFETY: reading a global lb set at load time.
    if unsafe { core::ptr::read_volatile(&LB_KERNEL_READS) } == 0 {
        return None;
    }
    // SAFETY: one 8-byte load of sk_msg_md.sk, which the verifier types as the sending socket.
    let sk =
        unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*ctx.msg).__bindgen_anon_3.sk)) };
    if sk.is_null() {
        return None;
    }
    // SAFETY: sk is the sending socket, alive for this call; the helper returns null for
    // anything but a TCP socket.
    let tp = unsafe { bpf_skc_to_tcp_sock(sk.cast::<c_void>()) } as *const u8;
    (!tp.is_null()).then_some(tp)
}

/// The address of the socket the message being judged was just redirected to (`msg->sk_redir`,
/// set by `bpf_msg_redirect_hash`); `None` when lb left the offset at 0 or the read fails.
#[inline(always)]
pub(crate) fn redirect_target(ctx: &SkMsgContext) -> Option<u64> {
    // SAFETY: reading a global lb set at load time.
    let off = unsafe { core::ptr::read_volatile(&LB_OFF_MSG_SK_REDIR) };
    if off == 0 {
        return None;
    }
    // The context is the kernel's `struct sk_msg` of this send.
    read_kernel::<u64>(ctx.msg.cast::<u8>(), off).filter(|&sk| sk != 0)
}

/// The server socket at `server` (an address from [`redirect_target`]) as the redirect rule
/// sees it: its queued memory (`sk_wmem_queued`, the truesize of its write queue) and the limit
/// a redirect must keep it within, three quarters of its send buffer (`sk_sndbuf`), in bytes.
/// Read at this send, so the room is never older than the send. The quarter left is the margin
/// that keeps a non-blocking redirect from meeting a full socket (`EAGAIN`, while the client's
/// own socket stays writable). `None` when lb left the offsets at 0, before the first redirect
/// (`server` 0) or when a read fails: the program then goes by the credit lb granted.
#[inline(always)]
pub(crate) fn server_fill(server: u64) -> Option<(u64, u64)> {
    // SAFETY: reading the globals lb set at load time.
    let (off_queued, off_sndbuf) = unsafe {
        (
            core::ptr::read_volatile(&LB_OFF_WMEM_QUEUED),
            core::ptr::read_volatile(&LB_OFF_SNDBUF),
        )
    };
    if off_queued == 0 || off_sndbuf == 0 || server == 0 {
        return None;
    }
    let sk = server as *const u8;
    let queued = read_kernel::<i32>(sk, off_queued)?.max(0) as u64;
    let sndbuf = read_kernel::<i32>(sk, off_sndbuf)?.max(0) as u64;
    Some((queued, sndbuf - sndbuf / 4))
}

/// Bring `flow.passed` up to the client socket's `write_seq` (`tp`): every byte the kernel
/// queued on it went the normal way (redirected ones never touch it), including sends the
/// kernel pushed without running this program. The 32-bit sequence wraps; the difference since
/// the last send does not. False when the read fails (`passed` then proves nothing).
#[inline(always)]
pub(crate) fn sync_passed(tp: *const u8, flow: &mut FlowState) -> bool {
    // SAFETY: reading a global lb set at load time.
    let off = unsafe { core::ptr::read_volatile(&LB_OFF_WRITE_SEQ) };
    let Some(seq) = read_kernel::<u32>(tp, off) else {
        return false;
    };
    flow.passed += u64::from(seq.wrapping_sub(flow.seq));
    flow.seq = seq;
    true
}

/// Whether the client socket (`tp`) has an upper layer protocol (`icsk_ulp_ops` set, as kTLS
/// does): the kernel then runs this program on what the application wrote, before the ULP
/// transforms it, so a redirect would send plaintext to the server. The kernel lets a socket
/// already in a sockhash take a ULP (only the other order is refused). A failed read counts as
/// a ULP.
#[inline(always)]
pub(crate) fn has_ulp(tp: *const u8) -> bool {
    // SAFETY: reading a global lb set at load time.
    let off = unsafe { core::ptr::read_volatile(&LB_OFF_ULP_OPS) };
    read_kernel::<u64>(tp, off) != Some(0)
}

/// Whether the sending client's socket (`tp`) blocks without a time limit: its file lacks
/// `O_NONBLOCK` (`sock->sk_socket->file->f_flags`) and its `sk_sndtimeo` is
/// `MAX_SCHEDULE_TIMEOUT` (offsets from the kernel's BTF). Such a client may be redirected into
/// a full server socket, where the kernel makes it wait for room. Any read that fails counts as
/// non-blocking (the safe answer: the send takes the copy path). Always false when lb turned
/// the feature off.
#[inline(always)]
pub(crate) fn client_blocks(tp: *const u8) -> bool {
    // SAFETY: reading a global lb set at load time (frozen, so the verifier sees a constant and
    // drops everything below when it is 0).
    if unsafe { core::ptr::read_volatile(&LB_BLOCKING_SPLICE) } == 0 {
        return false;
    }
    // SAFETY: reading the globals lb set at load time.
    let (off_socket, off_file, off_flags, off_timeo) = unsafe {
        (
            core::ptr::read_volatile(&LB_OFF_SK_SOCKET),
            core::ptr::read_volatile(&LB_OFF_SOCKET_FILE),
            core::ptr::read_volatile(&LB_OFF_F_FLAGS),
            core::ptr::read_volatile(&LB_OFF_SNDTIMEO),
        )
    };
    // A send timeout would not apply: the wait happens on lb's server socket.
    if read_kernel::<i64>(tp, off_timeo) != Some(MAX_SCHEDULE_TIMEOUT) {
        return false;
    }
    let Some(socket) = read_kernel::<u64>(tp, off_socket).filter(|&p| p != 0) else {
        return false;
    };
    let Some(file) = read_kernel::<u64>(socket as *const u8, off_file).filter(|&p| p != 0) else {
        return false;
    };
    read_kernel::<u32>(file as *const u8, off_flags).is_some_and(|f| f & O_NONBLOCK == 0)
}
