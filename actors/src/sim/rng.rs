//! Seeded randomness: one root seed, split into named, independent streams
//! (fabric jitter, fault plans, replica choice…), so adding a consumer of
//! randomness does not shift what the others draw.

/// SplitMix64's output function: a bijective mix with full avalanche.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// FNV-1a over a name: stable across platforms and releases (unlike `std`'s hashers).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// A root seed from which named streams are derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seed(pub u64);

impl Seed {
    /// The stream called `name`; the same (seed, name) always gives the same stream.
    pub fn stream(self, name: &str) -> Rng {
        Rng { state: mix64(self.0 ^ mix64(name_hash(name))) }
    }

    /// A child seed, for a component that splits further.
    pub fn child(self, name: &str) -> Seed {
        Seed(mix64(self.0.wrapping_add(GAMMA) ^ name_hash(name)))
    }
}

/// SplitMix64: small, fast, and reproducible everywhere.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n` (`n > 0`), by Lemire's multiply-shift; the tiny bias is irrelevant here.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.uniform() < p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_independent() {
        let a: Vec<u64> = (0..4)
            .map({
                let mut r = Seed(7).stream("fabric");
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..4)
            .map({
                let mut r = Seed(7).stream("fabric");
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(Seed(7).stream("faults").next_u64(), a[0]);
        assert_ne!(Seed(8).stream("fabric").next_u64(), a[0]);
        assert_ne!(Seed(7).child("x"), Seed(7).child("y"));
        let mut r = Seed(1).stream("below");
        assert!((0..1000).all(|_| r.below(6) < 6));
    }
}
