//! AVX-512 loops over FP4 codes in `Fp4Layout::Interleaved`.
//!
//! One 64-byte load holds 128 columns of a row. Shifting it right by `4k`
//! bits leaves scale block `k`'s 32 codes under the low nibble of the 32
//! words, and one `vpermw` looks them all up in a table of bf16 values that
//! already carry the block's scale (an FP4 value times a power of two has at
//! most two significant bits, so bf16 holds it exactly). An f32 is its bf16
//! bits followed by 16 zero bits: masking the odd words gives columns 0..16
//! of the block in lane order, shifting the even words up gives 16..32. Per
//! 32 weights that is one shuffle, where the pairs layout needs four.
//!
//! The products and sums are the pairs kernel's, in the same order: lane `l`
//! takes column `c + l`, then `c + 16 + l`, block after block.

use std::arch::x86_64::*;

use crate::dtype::FP4_E2M1_VALUES;

use super::avx512::{prefetch_ahead, EncodedTile};
use super::ScaleRow;

/// Word lanes of the table that hold a nonzero value (codes 0 and 8 are ±0,
/// and the table is repeated: the index's fifth bit belongs to the next code).
const NONZERO_WORDS: __mmask32 = 0xfefe_fefe;

/// The FP4 values as bf16, each nonzero one with 127 taken off its exponent
/// field, so that adding a scale's exponent field gives value · scale.
#[inline(always)]
unsafe fn unscaled_table() -> __m512i {
    let words: [u16; 32] = std::array::from_fn(|i| {
        let bits = (FP4_E2M1_VALUES[i % 16].to_bits() >> 16) as u16;
        if i % 8 == 0 {
            bits
        } else {
            bits.wrapping_sub(127 << 7)
        }
    });
    _mm512_loadu_si512(words.as_ptr().cast())
}

/// The table of block `index` of `scales`: a power of two's f32 bits are its
/// exponent field, whose upper 16 bits are the bf16 exponent field.
///
/// # Safety
/// The CPU must support AVX-512BW, and `index` must be inside `scales.row`.
#[inline(always)]
unsafe fn scaled_table(table: __m512i, scales: &ScaleRow, index: usize) -> __m512i {
    let high_word = (scales.row.as_ptr().add(index).read().to_bits() >> 16) as i16;
    _mm512_mask_add_epi16(table, NONZERO_WORDS, table, _mm512_set1_epi16(high_word))
}

/// Block `K` (0..4) of a 128-column group `group` as two f32 vectors:
/// columns `32K..32K + 16` and `32K + 16..32K + 32`.
#[inline(always)]
unsafe fn decode_block<const SHIFT: u32>(group: __m512i, table: __m512i) -> (__m512, __m512) {
    let words = _mm512_permutexvar_epi16(_mm512_srli_epi16::<SHIFT>(group), table);
    let low_columns = _mm512_and_si512(words, _mm512_set1_epi32(0xffff_0000u32 as i32));
    let high_columns = _mm512_slli_epi32::<16>(words);
    (_mm512_castsi512_ps(low_columns), _mm512_castsi512_ps(high_columns))
}

/// `micro_encoded` for [`super::Encoding::Fp4Interleaved`].
///
/// # Safety
/// As `avx512::micro_encoded`, and further: `k0` and the length of `xs` are
/// multiples of 128, scale blocks are multiples of 32 columns, and every
/// scale passes `scale_fits_bf16_table`.
#[inline(always)]
pub(super) unsafe fn micro<const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    tile: EncodedTile<NR>,
    acc: &mut [f32],
    acc_stride: usize,
) {
    let EncodedTile { codes, scales, k0, ahead, .. } = tile;
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    let mut a = [[_mm512_setzero_ps(); NR]; MR];
    for (i, ai) in a.iter_mut().enumerate() {
        for (j, aij) in ai.iter_mut().enumerate() {
            *aij = _mm512_loadu_ps(pacc.add(i * acc_stride + j * 16));
        }
    }
    let table = unscaled_table();
    let block = scales[0].block;
    let block_shift = block.is_power_of_two().then(|| block.trailing_zeros());
    let mut c = 0;
    while c < len {
        prefetch_ahead(ahead, c / 2);
        macro_rules! block {
            ($k:literal) => {{
                let column = k0 + c + 32 * $k;
                let index = match block_shift {
                    Some(shift) => column >> shift,
                    None => column / block,
                };
                for j in 0..NR {
                    let group = _mm512_loadu_si512(codes[j].as_ptr().add(c / 2).cast());
                    let (low, high) = decode_block::<{ 4 * $k }>(group, scaled_table(table, &scales[j], index));
                    for (ai, x) in a.iter_mut().zip(xs) {
                        let p = x.as_ptr().add(c + 32 * $k);
                        ai[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p), low, ai[j]);
                        ai[j] = _mm512_fmadd_ps(_mm512_loadu_ps(p.add(16)), high, ai[j]);
                    }
                }
            }};
        }
        block!(0);
        block!(1);
        block!(2);
        block!(3);
        c += 128;
    }
    for (i, ai) in a.iter().enumerate() {
        for (j, aij) in ai.iter().enumerate() {
            _mm512_storeu_ps(pacc.add(i * acc_stride + j * 16), *aij);
        }
    }
}

/// Interleaved codes of columns `k0..k0 + dst.len()` to f32 values.
///
/// # Safety
/// The CPU must support AVX-512F and BW; `2 * src.len() == dst.len()`, `k0`
/// and `dst.len()` are multiples of 128, scale blocks are multiples of 32
/// columns covering the span, and every scale passes `scale_fits_bf16_table`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn interleaved_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let table = unscaled_table();
    let pd = dst.as_mut_ptr();
    for (g, codes) in src.chunks_exact(64).enumerate() {
        let group = _mm512_loadu_si512(codes.as_ptr().cast());
        let c = 128 * g;
        macro_rules! block {
            ($k:literal) => {{
                let column = c + 32 * $k;
                let table = scaled_table(table, &scales, (k0 + column) / scales.block);
                let (low, high) = decode_block::<{ 4 * $k }>(group, table);
                _mm512_storeu_ps(pd.add(column), low);
                _mm512_storeu_ps(pd.add(column + 16), high);
            }};
        }
        block!(0);
        block!(1);
        block!(2);
        block!(3);
    }
}
