//! The bytes the tests send and check: a deterministic pseudo-random stream and a digest that
//! does not depend on how the stream is chunked.

/// Streaming 64-bit digest of a byte stream, independent of how it is chunked.
#[derive(Clone, Debug)]
pub struct Digest {
    h: u64,
    n: u64,
    pending: [u8; 8],
    plen: usize,
}

impl Default for Digest {
    fn default() -> Self {
        Digest {
            h: 0xcbf2_9ce4_8422_2325,
            n: 0,
            pending: [0; 8],
            plen: 0,
        }
    }
}

impl Digest {
    fn mix(&mut self, w: u64) {
        self.h = (self.h ^ w)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }

    /// Feed bytes.
    pub fn update(&mut self, mut data: &[u8]) {
        self.n += data.len() as u64;
        while self.plen > 0 && !data.is_empty() {
            self.pending[self.plen] = data[0];
            self.plen += 1;
            data = &data[1..];
            if self.plen == 8 {
                self.mix(u64::from_le_bytes(self.pending));
                self.plen = 0;
            }
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            self.mix(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.pending[self.plen] = b;
            self.plen += 1;
        }
    }

    /// Bytes fed so far.
    pub fn count(&self) -> u64 {
        self.n
    }

    /// The digest.
    pub fn finish(&self) -> u64 {
        let mut d = self.clone();
        let mut tail = [0u8; 8];
        tail[..d.plen].copy_from_slice(&d.pending[..d.plen]);
        d.mix(u64::from_le_bytes(tail) ^ (d.plen as u64) << 56);
        d.mix(d.n);
        d.h
    }
}

/// Deterministic pseudo-random byte stream (xorshift64*), the same for any chunking.
#[derive(Clone, Debug)]
pub struct PatternStream {
    state: u64,
    word: [u8; 8],
    used: usize,
}

impl PatternStream {
    /// New stream from a seed.
    pub fn new(seed: u64) -> PatternStream {
        PatternStream {
            state: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            word: [0; 8],
            used: 8,
        }
    }

    fn next_word(&mut self) -> [u8; 8] {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes()
    }

    /// Fill `buf` with the next bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        let mut i = 0;
        while i < buf.len() && self.used < 8 {
            buf[i] = self.word[self.used];
            self.used += 1;
            i += 1;
        }
        let rest = &mut buf[i..];
        let mut chunks = rest.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_word());
        }
        let rem = chunks.into_remainder();
        if !rem.is_empty() {
            self.word = self.next_word();
            let k = rem.len();
            rem.copy_from_slice(&self.word[..k]);
            self.used = k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_ignores_chunking() {
        let mut src = PatternStream::new(5);
        let mut data = vec![0u8; 100_003];
        src.fill(&mut data);
        let mut a = Digest::default();
        a.update(&data);
        let mut b = Digest::default();
        for c in data.chunks(7) {
            b.update(c);
        }
        assert_eq!(a.finish(), b.finish());
        assert_eq!(a.count(), 100_003);
        let mut c = Digest::default();
        data[500] ^= 1;
        c.update(&data);
        assert_ne!(a.finish(), c.finish());
    }

    #[test]
    fn pattern_ignores_chunking() {
        let mut a = PatternStream::new(9);
        let mut whole = vec![0u8; 1000];
        a.fill(&mut whole);
        let mut b = PatternStream::new(9);
        let mut parts = vec![0u8; 1000];
        for c in parts.chunks_mut(13) {
            b.fill(c);
        }
        assert_eq!(whole, parts);
    }
}
