//! Where the FP4 codes of a weight row sit in memory.
//!
//! Checkpoints store FP4 e2m1 codes in pairs: two columns per byte, the even
//! one in the low nibble. The AVX-512 kernels read a row faster when each
//! 128-column group (one 64-byte cache line) is interleaved so that one
//! 16-bit table lookup (`vpermw`) yields a whole 32-column scale block in
//! lane order: shifting the line right by `4k` bits puts block `k` under the
//! low nibble of every word. Which layout a matrix uses changes no bit of
//! any result, only the instructions that decode it.

use crate::simd::Isa;

/// Columns per interleaved group: 64 bytes of codes, one cache line.
pub const GROUP_COLS: usize = 128;
/// Columns of one table lookup: the scale block the lookup's table carries.
pub(crate) const LOOKUP_COLS: usize = 32;

/// How the codes of each row are arranged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp4Layout {
    /// As published: two columns per byte, the even one in the low nibble.
    Pairs,
    /// Each row's 128-column groups as 32 little-endian 16-bit words, nibble
    /// `k` of word `i` holding column `32k + i / 2` when `i` is odd and
    /// `32k + 16 + i / 2` when it is even (see [`interleaved_column`]). Needs
    /// `cols` a multiple of 128, scale blocks a multiple of 32 columns, and
    /// every scale a power of two that [`scale_fits_bf16_table`] accepts.
    Interleaved,
}

impl Fp4Layout {
    /// The layout the kernels of `isa` read fastest for a `cols`-wide matrix
    /// with these scales (one per `block_cols` columns).
    pub fn preferred(isa: Isa, cols: usize, block_cols: usize, scales: &[f32]) -> Fp4Layout {
        let fast = matches!(isa, Isa::Avx512 | Isa::Avx512Vbmi);
        if fast && Self::interleavable(cols, block_cols, scales) {
            Fp4Layout::Interleaved
        } else {
            Fp4Layout::Pairs
        }
    }

    /// Whether a matrix meets [`Fp4Layout::Interleaved`]'s conditions.
    pub fn interleavable(cols: usize, block_cols: usize, scales: &[f32]) -> bool {
        cols > 0
            && cols.is_multiple_of(GROUP_COLS)
            && block_cols > 0
            && block_cols.is_multiple_of(LOOKUP_COLS)
            && scales.iter().all(|&s| scale_fits_bf16_table(s))
    }

    /// The code of column `c` of a row stored as `row` (the row's bytes).
    #[inline]
    pub fn code(self, row: &[u8], c: usize) -> u8 {
        let (byte, shift) = match self {
            Fp4Layout::Pairs => (c / 2, 4 * (c % 2)),
            Fp4Layout::Interleaved => {
                let (group, within) = (c / GROUP_COLS, c % GROUP_COLS);
                let (block, lane) = (within / LOOKUP_COLS, within % LOOKUP_COLS);
                let word = if lane < 16 { 2 * lane + 1 } else { 2 * (lane - 16) };
                (group * 64 + 2 * word + block / 2, 4 * (block % 2))
            }
        };
        (row[byte] >> shift) & 0xf
    }
}

/// Column (within its 128-column group) held by nibble `nibble` of word `word`
/// in [`Fp4Layout::Interleaved`]: odd words feed the high halves of the f32
/// lanes (columns 0..16 of the block), even words the low halves (16..32).
pub fn interleaved_column(word: usize, nibble: usize) -> usize {
    assert!(word < 32 && nibble < 4, "word {word}, nibble {nibble}");
    LOOKUP_COLS * nibble + if word % 2 == 1 { word / 2 } else { 16 + word / 2 }
}

/// Pairs-layout codes (whole rows, each a multiple of 128 columns) rearranged
/// into [`Fp4Layout::Interleaved`].
pub fn interleave(pairs: &[u8]) -> Vec<u8> {
    assert!(pairs.len().is_multiple_of(GROUP_COLS / 2), "FP4 rows of whole 128-column groups");
    let mut out = vec![0u8; pairs.len()];
    for (src, dst) in pairs.chunks_exact(64).zip(out.chunks_exact_mut(64)) {
        for word in 0..32 {
            for nibble in 0..4 {
                let code = Fp4Layout::Pairs.code(src, interleaved_column(word, nibble));
                dst[2 * word + nibble / 2] |= code << (4 * (nibble % 2));
            }
        }
    }
    out
}

/// [`interleave`] undone: one row (or group run) back to pairs.
pub fn deinterleave(interleaved: &[u8]) -> Vec<u8> {
    assert!(interleaved.len().is_multiple_of(GROUP_COLS / 2), "FP4 rows of whole 128-column groups");
    let mut out = vec![0u8; interleaved.len()];
    for (c, pair) in (0..2 * interleaved.len()).step_by(2).zip(out.iter_mut()) {
        let lo = Fp4Layout::Interleaved.code(interleaved, c);
        let hi = Fp4Layout::Interleaved.code(interleaved, c + 1);
        *pair = lo | (hi << 4);
    }
    out
}

/// Whether `scale` can be added to the exponents of a bf16 table of the FP4
/// values (0.5 to 6): a positive power of two whose products with every value
/// stay normal and finite, so the table holds them exactly.
pub fn scale_fits_bf16_table(scale: f32) -> bool {
    let bits = scale.to_bits();
    let exponent = bits >> 23;
    // No sign, no mantissa; 0.5 · scale normal (exponent ≥ 2) and 6 · scale finite (≤ 252).
    bits & 0x807f_ffff == 0 && (2..=252).contains(&exponent)
}
