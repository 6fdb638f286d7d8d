//! Stable, portable hashing: content hashes for cache keys and checkpoint
//! manifests, and the seed mixing of data order and sampling.

/// FNV-1a, 64 bit: a stable content hash.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// SplitMix64's output function applied to `x + golden gamma`: a fixed
/// mixing of 64-bit seeds. Calling it on `s, s + gamma, s + 2 gamma, ...`
/// gives the SplitMix64 stream of seed `s` ([`SplitMix64`]).
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(GAMMA);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 random stream: reproducible draws without a dependency.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let z = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GAMMA);
        z
    }

    /// A uniform draw in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // Reference values of FNV-1a 64 and of SplitMix64 seeded with 0.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let mut rng = SplitMix64(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        let u = SplitMix64(7).uniform();
        assert!((0.0..1.0).contains(&u));
    }
}
