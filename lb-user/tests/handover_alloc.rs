//! The hand-over's frame reader allocates what arrives, not what a header announces: found by
//! the `handover` fuzz target (a 12-byte header announcing a 704 MiB raw part made `recv`
//! allocate it before reading a byte). Its own test binary, so its allocator sees no other test.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    io::Write as _,
    os::unix::net::UnixStream,
    sync::atomic::{AtomicUsize, Ordering},
};

use lb::handover::{HandoverError, recv};

/// The system allocator, recording the largest single allocation.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call goes to `System` unchanged; only the size is recorded.
#[expect(
    unsafe_code,
    reason = "a GlobalAlloc is an unsafe trait; this one passes every call to System"
)]
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as for `alloc`; `ptr` and `layout` come from this allocator, which is System's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by System with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[test]
fn a_header_announcing_more_than_arrives_costs_what_arrived() {
    let (old, new) = UnixStream::pair().unwrap();
    let json = br#"{"type":"stopped"}"#;
    let mut frame = Vec::new();
    frame.extend_from_slice(&u32::try_from(json.len()).unwrap().to_le_bytes());
    // 704 MiB of raw bytes announced, 9 sent.
    frame.extend_from_slice(&(704u32 << 20).to_le_bytes());
    frame.extend_from_slice(&0u32.to_le_bytes());
    frame.extend_from_slice(json);
    frame.extend_from_slice(b"unwritten");
    (&old).write_all(&frame).unwrap();
    drop(old);
    LARGEST.store(0, Ordering::Relaxed);
    let got = recv(&new);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(matches!(got, Err(HandoverError::Closed)), "{got:?}");
    assert!(
        largest < 1 << 20,
        "recv allocated {largest} bytes at once for 39 bytes received"
    );
}
