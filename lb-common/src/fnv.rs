//! 64-bit FNV-1a, the one hash of lb-common: of a balancer's name (`balancer_name_hash`) and,
//! in `build.rs`, of the source the pin layout is derived from. Constants from
//! <http://www.isthe.com/chongo/tech/comp/fnv/>.

/// The offset basis: the hash of nothing.
pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// The 64-bit FNV prime.
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// `hash` (FNV-1a so far, [`FNV_OFFSET`] to start) continued over `bytes`.
pub(crate) const fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    hash
}
