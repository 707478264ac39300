//! NumPy's `default_rng(seed).integers(0, high, size, dtype=int64)`, bit for
//! bit: SeedSequence entropy mixing, the PCG64 (XSL-RR 128/64) generator and
//! Lemire's bounded integers. DeepSeek-V4.1 derives its Engram hash
//! multipliers this way at load time; the checkpoint does not store them.

const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;
const POOL_SIZE: usize = 4;
const PCG_MULTIPLIER: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

fn hashmix(value: u32, hash_const: &mut u32) -> u32 {
    let mut v = value ^ *hash_const;
    *hash_const = hash_const.wrapping_mul(MULT_A);
    v = v.wrapping_mul(*hash_const);
    v ^ (v >> XSHIFT)
}

fn mix(x: u32, y: u32) -> u32 {
    let r = MIX_MULT_L.wrapping_mul(x).wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    r ^ (r >> XSHIFT)
}

/// SeedSequence(seed).generate_state(words32) for a non-negative integer seed.
fn seed_sequence_state(seed: u64, words32: usize) -> Vec<u32> {
    let mut entropy = vec![seed as u32];
    if seed >> 32 != 0 {
        entropy.push((seed >> 32) as u32);
    }
    let mut pool = [0u32; POOL_SIZE];
    let mut hash_const = INIT_A;
    for (i, slot) in pool.iter_mut().enumerate() {
        *slot = hashmix(entropy.get(i).copied().unwrap_or(0), &mut hash_const);
    }
    for src in 0..POOL_SIZE {
        for dst in 0..POOL_SIZE {
            if src != dst {
                let h = hashmix(pool[src], &mut hash_const);
                pool[dst] = mix(pool[dst], h);
            }
        }
    }
    for &word in entropy.iter().skip(POOL_SIZE) {
        for slot in pool.iter_mut() {
            let h = hashmix(word, &mut hash_const);
            *slot = mix(*slot, h);
        }
    }
    let mut hash_const = INIT_B;
    (0..words32)
        .map(|i| {
            let mut v = pool[i % POOL_SIZE] ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_B);
            v = v.wrapping_mul(hash_const);
            v ^ (v >> XSHIFT)
        })
        .collect()
}

/// NumPy's PCG64 bit generator.
pub struct Pcg64 {
    state: u128,
    inc: u128,
}

impl Pcg64 {
    /// `np.random.default_rng(seed)`'s generator.
    pub fn from_seed(seed: u64) -> Self {
        let words = seed_sequence_state(seed, 8);
        let word64 = |i: usize| words[2 * i] as u64 | (words[2 * i + 1] as u64) << 32;
        let initstate = (word64(0) as u128) << 64 | word64(1) as u128;
        let initseq = (word64(2) as u128) << 64 | word64(3) as u128;
        let mut rng = Self { state: 0, inc: (initseq << 1) | 1 };
        rng.step();
        rng.state = rng.state.wrapping_add(initstate);
        rng.step();
        rng
    }

    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULTIPLIER).wrapping_add(self.inc);
    }

    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        ((s >> 64) as u64 ^ s as u64).rotate_right((s >> 122) as u32)
    }

    /// `integers(0, high)` for one int64 value; `high − 1` must exceed u32::MAX
    /// (NumPy takes a different, buffered path below that).
    pub fn integer_below(&mut self, high: u64) -> u64 {
        let range = high - 1;
        assert!(range > u32::MAX as u64, "the 32-bit bounded path is not implemented");
        let excl = range + 1;
        let mut m = self.next_u64() as u128 * excl as u128;
        let mut leftover = m as u64;
        if leftover < excl {
            let threshold = (u64::MAX - range) % excl;
            while leftover < threshold {
                m = self.next_u64() as u128 * excl as u128;
                leftover = m as u64;
            }
        }
        (m >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values printed by NumPy 2.4: `default_rng(0).bit_generator.random_raw(2)` and
    /// `default_rng(seed).integers(0, high, size=3, dtype=np.int64)`.
    #[test]
    fn matches_numpy() {
        let mut g = Pcg64::from_seed(0);
        assert_eq!([g.next_u64(), g.next_u64()], [0xa30f_ebcf_d9c2_825f, 0x4510_bdf8_82d9_d721]);
        let draw = |seed: u64, high: u64| {
            let mut g = Pcg64::from_seed(seed);
            [g.integer_below(high), g.integer_below(high), g.integer_below(high)]
        };
        assert_eq!(draw(10007 * 3, 46_541_580_589_203), [13_764_121_585_847, 40_831_500_088_214, 5_439_215_962_450]);
        assert_eq!(draw(0, 46_541_580_589_203), [29_645_203_702_706, 12_556_300_080_537, 1_906_972_566_300]);
        assert_eq!(
            draw((1 << 40) + 5, 1 << 62),
            [21_856_898_532_244_346, 1_718_243_109_387_391_173, 2_708_117_736_711_237_533]
        );
    }
}
