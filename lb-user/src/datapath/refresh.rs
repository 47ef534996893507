//! `LB_REFRESH`, the ring buffer through which the sk_msg program asks lb for redirect credit:
//! its reader and the decoding of its records.

use std::os::fd::{AsFd, BorrowedFd};

use aya::maps::{MapData, RingBuf};
use lb_common::{RefreshRequest, SockKey};

/// `LB_REFRESH`: the ring buffer of credit requests from sk_msg. Read by one thread.
pub(super) struct RefreshRing(RingBuf<MapData>);

impl From<RingBuf<MapData>> for RefreshRing {
    fn from(ring: RingBuf<MapData>) -> RefreshRing {
        RefreshRing(ring)
    }
}

impl RefreshRing {
    /// The next request, skipping records that do not decode; `None` when the ring is empty.
    pub(super) fn next_request(&mut self) -> Option<RefreshRequest> {
        loop {
            let item = self.0.next()?;
            if let Some(req) = decode_request(&item) {
                return Some(req);
            }
        }
    }
}

impl AsFd for RefreshRing {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Decode one ring buffer record: a [`RefreshRequest`] as the kernel laid it out (`#[repr(C)]`,
/// native byte order), read field by field at its offsets so no unaligned or unsafe read is
/// needed. `None` when the record is shorter than the struct.
pub(super) fn decode_request(bytes: &[u8]) -> Option<RefreshRequest> {
    use core::mem::offset_of;
    let u64_at = |i: usize| -> Option<u64> {
        Some(u64::from_ne_bytes(bytes.get(i..i + 8)?.try_into().ok()?))
    };
    let u32_at = |i: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    let k = offset_of!(RefreshRequest, key);
    let mut key = SockKey::default();
    for (n, w) in key.client_ip_be.iter_mut().enumerate() {
        *w = u32_at(k + offset_of!(SockKey, client_ip_be) + n * 4)?;
    }
    for (n, w) in key.lb_ip_be.iter_mut().enumerate() {
        *w = u32_at(k + offset_of!(SockKey, lb_ip_be) + n * 4)?;
    }
    key.client_port = u32_at(k + offset_of!(SockKey, client_port))?;
    key.lb_port = u32_at(k + offset_of!(SockKey, lb_port))?;
    key.netns_cookie = u64_at(k + offset_of!(SockKey, netns_cookie))?;
    key.family = u32_at(k + offset_of!(SockKey, family))?;
    key._pad = u32_at(k + offset_of!(SockKey, _pad))?;
    Some(RefreshRequest {
        key,
        redirected: u64_at(offset_of!(RefreshRequest, redirected))?,
    })
}

#[cfg(test)]
mod tests {
    use lb_common::AF_INET6;

    use super::*;

    /// A ring buffer record as `lb_sk_msg` writes it (`bpf_ringbuf_output` of a
    /// `RefreshRequest`: the `#[repr(C)]` struct's bytes, native order), laid out here by hand
    /// from the C layout (16 + 16 address bytes, two u32 ports, u64 cookie, u32 family, u32
    /// padding, u64 count), decodes to every field.
    #[test]
    fn ring_buffer_record_round_trips() {
        let mut rec = Vec::new();
        for w in [0x0a00_0001u32, 0x0a00_0002, 0x0a00_0003, 0x0a00_0004] {
            rec.extend_from_slice(&w.to_ne_bytes());
        }
        for w in [0x7f00_0001u32, 0x7f00_0002, 0x7f00_0003, 0x7f00_0004] {
            rec.extend_from_slice(&w.to_ne_bytes());
        }
        rec.extend_from_slice(&40_000u32.to_ne_bytes());
        rec.extend_from_slice(&6_443u32.to_ne_bytes());
        rec.extend_from_slice(&0x1122_3344_5566_7788u64.to_ne_bytes());
        rec.extend_from_slice(&AF_INET6.to_ne_bytes());
        rec.extend_from_slice(&0u32.to_ne_bytes());
        rec.extend_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(rec.len(), size_of::<RefreshRequest>());

        let req = decode_request(&rec).expect("decodes");
        assert_eq!(
            req.key.client_ip_be,
            [0x0a00_0001, 0x0a00_0002, 0x0a00_0003, 0x0a00_0004]
        );
        assert_eq!(
            req.key.lb_ip_be,
            [0x7f00_0001, 0x7f00_0002, 0x7f00_0003, 0x7f00_0004]
        );
        assert_eq!(req.key.client_port, 40_000);
        assert_eq!(req.key.lb_port, 6_443);
        assert_eq!(req.key.netns_cookie, 0x1122_3344_5566_7788);
        assert_eq!(req.key.family, AF_INET6);
        assert_eq!(req.key._pad, 0);
        assert_eq!(req.redirected, 0x0102_0304_0506_0708);

        // The ring buffer rounds records up to 8 bytes; a longer record still decodes, a
        // shorter one does not.
        rec.extend_from_slice(&[0xff; 8]);
        assert_eq!(decode_request(&rec), Some(req));
        assert_eq!(
            decode_request(&rec[..size_of::<RefreshRequest>() - 1]),
            None
        );
    }
}
