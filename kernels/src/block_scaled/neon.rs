//! NEON block sums (aarch64): FP4 by `sdot` (the dot-product extension), FP8
//! in f64 pairs. The sums are exact, so the order in which lanes are added is
//! free; the rounding and scaling are the portable path's, lane for lane.

use std::arch::aarch64::*;

use super::{scaled, BLOCK_DIGIT_BYTES, FP4_DOUBLED};
use crate::act_quant::ACT_BLOCK;

/// Code bytes of one FP4 block (two codes a byte).
const FP4_BLOCK_BYTES: usize = ACT_BLOCK / 2;
/// Twice the e2m1 value of each FP4 code as a signed byte: the weights `W`
/// that `sdot` multiplies the activation digits by.
const FP4_DOUBLED_BYTES: [i8; 16] = {
    let mut bytes = [0; 16];
    let mut code = 0;
    while code < 16 {
        bytes[code] = FP4_DOUBLED[code] as i8;
        code += 1;
    }
    bytes
};

/// `acc` plus, in each 32-bit lane, the four products of the bytes of `a` and
/// `b` at that lane (signed), as the `sdot` instruction computes them.
///
/// # Safety
/// The CPU must support NEON and the dot-product extension.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // The intrinsic (`vdotq_s32`) is not stable; the instruction is.
    std::arch::asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack)
    );
    acc
}

/// Rounded block sums of one FP4 row (`codes`: `cols / 2` bytes) with each x
/// row's digits ([`super::block_digits`]), times both block scales: row `i`
/// at `sums[i * stride..]`. Each block's weights are decoded once for all rows.
///
/// # Safety
/// The CPU must support NEON and the dot-product extension; 1 to 4 rows.
/// Every length is asserted.
#[target_feature(enable = "neon,dotprod")]
pub(super) unsafe fn fp4_block_sums(
    codes: &[u8],
    digits: &[Vec<i8>],
    a_scales: &[Vec<f32>],
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    match digits.len() {
        1 => fp4_rows::<1>(codes, digits, a_scales, w_scales, sums, stride),
        2 => fp4_rows::<2>(codes, digits, a_scales, w_scales, sums, stride),
        3 => fp4_rows::<3>(codes, digits, a_scales, w_scales, sums, stride),
        4 => fp4_rows::<4>(codes, digits, a_scales, w_scales, sums, stride),
        m => unreachable!("{m} rows at once"),
    }
}

#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn fp4_rows<const M: usize>(
    codes: &[u8],
    digits: &[Vec<i8>],
    a_scales: &[Vec<f32>],
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    let blocks = codes.len() / FP4_BLOCK_BYTES;
    assert!(codes.len() == blocks * FP4_BLOCK_BYTES && w_scales.len() == blocks, "codes and weight scales");
    assert!(digits.len() == M && digits.iter().all(|d| d.len() >= blocks * BLOCK_DIGIT_BYTES), "digits");
    assert!(a_scales.len() == M && a_scales.iter().all(|a| a.len() >= blocks), "x scales");
    assert!(sums.len() >= (M - 1) * stride + blocks, "sums");
    let table = vld1q_s8(FP4_DOUBLED_BYTES.as_ptr());
    let digits_at = |row: usize, b: usize| digits[row].as_ptr().add(b * BLOCK_DIGIT_BYTES);
    // Four blocks at a time: their lanes fold into one vector of block sums,
    // converted and scaled together.
    let whole = blocks / 4 * 4;
    for first in (0..whole).step_by(4) {
        let weights: [[int8x16_t; 2]; 4] =
            std::array::from_fn(|q| fp4_weights(table, codes.as_ptr().add((first + q) * FP4_BLOCK_BYTES)));
        for (row, row_scales) in a_scales.iter().enumerate() {
            let lanes: [int32x4_t; 4] = std::array::from_fn(|q| block_lanes(&weights[q], digits_at(row, first + q)));
            // Lane q: block `first + q`'s exact sum.
            let exact = vpaddq_s32(vpaddq_s32(lanes[0], lanes[1]), vpaddq_s32(lanes[2], lanes[3]));
            // Rounding then scaling by 2^-10 is scaling then rounding.
            let rounded = vmulq_n_f32(vcvtq_f32_s32(exact), 1.0 / 1024.0);
            // The definition's order: times x's scale, then the weight's.
            let a = vld1q_f32(row_scales.as_ptr().add(first));
            let w = vld1q_f32(w_scales.as_ptr().add(first));
            vst1q_f32(sums.as_mut_ptr().add(row * stride + first), vmulq_f32(vmulq_f32(rounded, a), w));
        }
    }
    for b in whole..blocks {
        let weights = fp4_weights(table, codes.as_ptr().add(b * FP4_BLOCK_BYTES));
        for (row, row_scales) in a_scales.iter().enumerate() {
            let exact = vaddvq_s32(block_lanes(&weights, digits_at(row, b)));
            sums[row * stride + b] = scaled(exact as f32 / 1024.0, row_scales[b], w_scales[b]);
        }
    }
}

/// The 32 weights `W = 2 · e2m1` of one block's 16 code bytes at `codes`, in
/// column order: a byte's low nibble is the even column, its high the odd.
///
/// # Safety
/// NEON; `codes` points at 16 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp4_weights(table: int8x16_t, codes: *const u8) -> [int8x16_t; 2] {
    let packed = vld1q_u8(codes);
    let even = vqtbl1q_s8(table, vandq_u8(packed, vdupq_n_u8(0x0f)));
    let odd = vqtbl1q_s8(table, vshrq_n_u8::<4>(packed));
    [vzip1q_s8(even, odd), vzip2q_s8(even, odd)]
}

/// Four lanes adding up to a block's exact `Σ A·W`, from its weights and the
/// x row's 96 digit bytes at `digits`: the products of d2, shifted by 8 bits,
/// plus d1's, shifted again, plus d0's. A lane holds eight columns' sum
/// (below 2^25 in magnitude), so nothing overflows.
///
/// # Safety
/// NEON and the dot-product extension; `digits` points at
/// [`BLOCK_DIGIT_BYTES`] readable bytes.
#[inline]
#[target_feature(enable = "neon,dotprod")]
unsafe fn block_lanes(weights: &[int8x16_t; 2], digits: *const i8) -> int32x4_t {
    let digit = |k: usize, half: usize| vld1q_s8(digits.add(k * ACT_BLOCK + half * 16));
    let dot = |acc: int32x4_t, k: usize| sdot(sdot(acc, weights[0], digit(k, 0)), weights[1], digit(k, 1));
    let high = dot(vdupq_n_s32(0), 2);
    let middle = dot(vshlq_n_s32::<8>(high), 1);
    dot(vshlq_n_s32::<8>(middle), 0)
}

/// 2^120: [`fp8_decode8`]'s weights are the true ones times 2^-120, and so
/// is every block sum made from them (exact: the products stay normal f64).
const RESTORE: f64 = (1u128 << 120) as f64;

/// Rounded block sums of one FP8 row (`codes`, no NaN) with each x row's
/// values in f64 (`wide`, unscaled), times both block scales: row `i` at
/// `sums[i * stride..]`. Each block's weights are decoded once for all rows.
///
/// # Safety
/// The CPU must support NEON; no code is NaN; 1 to 4 rows. Every length is
/// asserted.
#[target_feature(enable = "neon")]
pub(super) unsafe fn fp8_block_sums(
    codes: &[u8],
    wide: &[Vec<f64>],
    a_scales: &[Vec<f32>],
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    match wide.len() {
        1 => fp8_rows::<1>(codes, wide, a_scales, w_scales, sums, stride),
        2 => fp8_rows::<2>(codes, wide, a_scales, w_scales, sums, stride),
        3 => fp8_rows::<3>(codes, wide, a_scales, w_scales, sums, stride),
        4 => fp8_rows::<4>(codes, wide, a_scales, w_scales, sums, stride),
        m => unreachable!("{m} rows at once"),
    }
}

#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp8_rows<const M: usize>(
    codes: &[u8],
    wide: &[Vec<f64>],
    a_scales: &[Vec<f32>],
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    let cols = codes.len();
    let blocks = cols / ACT_BLOCK;
    assert!(cols == blocks * ACT_BLOCK && w_scales.len() == blocks, "codes and weight scales");
    assert!(wide.len() == M && wide.iter().all(|w| w.len() == cols), "wide rows");
    assert!(a_scales.len() == M && a_scales.iter().all(|a| a.len() >= blocks), "x scales");
    assert!(sums.len() >= (M - 1) * stride + blocks, "sums");
    // Each row's slices cut to length up front: a bounds check between a
    // block's FMAs and its stores would have the FMAs sunk past it, keeping
    // the whole decoded block live across the rows (spilled registers).
    let x_rows: [&[f64]; M] = std::array::from_fn(|t| wide[t].as_slice());
    let x_scales: [&[f32]; M] = std::array::from_fn(|t| &a_scales[t][..blocks]);
    let mut rows = sums.chunks_mut(stride);
    let out: [&mut [f32]; M] = std::array::from_fn(|_| &mut rows.next().expect("sums")[..blocks]);
    for b in 0..blocks {
        // Four independent chains per row hide the FMA latency.
        let mut acc = [[vdupq_n_f64(0.0); 4]; M];
        for part in 0..4 {
            let c = b * ACT_BLOCK + part * 8;
            let weights = fp8_decode8(codes.as_ptr().add(c));
            for (acc, x) in acc.iter_mut().zip(&x_rows) {
                for (j, (acc, &w)) in acc.iter_mut().zip(&weights).enumerate() {
                    *acc = vfmaq_f64(*acc, vld1q_f64(x.as_ptr().add(c + 2 * j)), w);
                }
            }
        }
        for t in 0..M {
            let [a0, a1, a2, a3] = acc[t];
            let exact = vaddvq_f64(vaddq_f64(vaddq_f64(a0, a1), vaddq_f64(a2, a3))) * RESTORE;
            out[t][b] = scaled(exact as f32, x_scales[t][b], w_scales[b]);
        }
    }
}

/// The f32 bits an e4m3 code keeps in its top half once sign-extended to 16
/// bits and shifted left by 4: the sign, and its seven magnitude bits at 4..11.
const FP8_F32_HIGH_BITS: u16 = 0x87f0;

/// Eight e4m3 codes (no NaN) at `p` as f64 values times 2^-120, in order.
/// A code's magnitude bits under the f32 sign sit in the low four exponent
/// bits and the top three mantissa bits: e4m3's exponent bias is 120 below
/// f32's, and its subnormals (exponent field 0) read as f32 subnormals of the
/// same value times 2^-120. Widening to f64 is exact.
///
/// # Safety
/// NEON; `p` points at 8 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp8_decode8(p: *const u8) -> [float64x2_t; 4] {
    let shifted = vreinterpretq_u16_s16(vshll_n_s8::<4>(vld1_s8(p.cast())));
    let high_halves = vandq_u16(shifted, vdupq_n_u16(FP8_F32_HIGH_BITS));
    let low = vreinterpretq_f32_u32(vshll_n_u16::<16>(vget_low_u16(high_halves)));
    let high = vreinterpretq_f32_u32(vshll_high_n_u16::<16>(high_halves));
    [vcvt_f64_f32(vget_low_f32(low)), vcvt_high_f64_f32(low), vcvt_f64_f32(vget_low_f32(high)), vcvt_high_f64_f32(high)]
}
