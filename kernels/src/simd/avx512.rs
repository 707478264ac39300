//! AVX-512F loops. One zmm register is exactly the 16 reference lanes, so each
//! `vfmadd` performs the reference's 16 `mul_add`s at once.
//!
//! Every function here is `unsafe` only because it needs AVX-512F at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice.

use std::arch::x86_64::*;

use crate::dtype::{FP4_E2M1_VALUES, FP8_E4M3_TO_F32};

use super::reduce16;

/// Lanes `0..n` of a 16-lane mask (`n < 16`).
#[inline(always)]
fn tail_mask(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// # Safety
/// The CPU must support AVX-512F, and `a.len() == b.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = _mm512_setzero_ps();
    let mut c = 0;
    while c + 16 <= len {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(c)), _mm512_loadu_ps(pb.add(c)), acc);
        c += 16;
    }
    if c < len {
        // Masked-off lanes keep their accumulator untouched (adding a zero product
        // would turn a -0.0 accumulator into +0.0).
        let m = tail_mask(len - c);
        let va = _mm512_maskz_loadu_ps(m, pa.add(c));
        let vb = _mm512_maskz_loadu_ps(m, pb.add(c));
        acc = _mm512_mask3_fmadd_ps(va, vb, acc, m);
    }
    let mut lanes = [0.0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), acc);
    reduce16(&lanes)
}

/// See `Backend::micro`.
///
/// # Safety
/// The CPU must support AVX-512F; every slice of `xs` and `ws` has the same length
/// and `acc.len() >= (MR - 1) * acc_stride + NR * 16`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn micro<const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    ws: &[&[f32]; NR],
    acc: &mut [f32],
    acc_stride: usize,
) {
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    let mut a = [[_mm512_setzero_ps(); NR]; MR];
    for (i, ai) in a.iter_mut().enumerate() {
        for (j, aij) in ai.iter_mut().enumerate() {
            *aij = _mm512_loadu_ps(pacc.add(i * acc_stride + j * 16));
        }
    }
    let mut c = 0;
    while c + 16 <= len {
        let mut wv = [_mm512_setzero_ps(); NR];
        for (v, w) in wv.iter_mut().zip(ws) {
            *v = _mm512_loadu_ps(w.as_ptr().add(c));
        }
        for (ai, x) in a.iter_mut().zip(xs) {
            let xv = _mm512_loadu_ps(x.as_ptr().add(c));
            for (aij, w) in ai.iter_mut().zip(&wv) {
                *aij = _mm512_fmadd_ps(xv, *w, *aij);
            }
        }
        c += 16;
    }
    if c < len {
        let m = tail_mask(len - c);
        let mut wv = [_mm512_setzero_ps(); NR];
        for (v, w) in wv.iter_mut().zip(ws) {
            *v = _mm512_maskz_loadu_ps(m, w.as_ptr().add(c));
        }
        for (ai, x) in a.iter_mut().zip(xs) {
            let xv = _mm512_maskz_loadu_ps(m, x.as_ptr().add(c));
            for (aij, w) in ai.iter_mut().zip(&wv) {
                *aij = _mm512_mask3_fmadd_ps(xv, *w, *aij, m);
            }
        }
    }
    for (i, ai) in a.iter().enumerate() {
        for (j, aij) in ai.iter().enumerate() {
            _mm512_storeu_ps(pacc.add(i * acc_stride + j * 16), *aij);
        }
    }
}

/// # Safety
/// The CPU must support AVX-512F, and `src.len() == 2 * dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn bf16_span(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let mut c = 0;
    while c + 16 <= n {
        let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.as_ptr().add(2 * c).cast()));
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)));
        c += 16;
    }
    super::portable::bf16_span(&src[2 * c..], &mut dst[c..]);
}

/// # Safety
/// The CPU must support AVX-512F, and `src.len() == dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fp8_span(src: &[u8], scale: f32, dst: &mut [f32]) {
    let n = dst.len();
    let scale_v = _mm512_set1_ps(scale);
    // e4m3 magnitude bits placed under the f32 exponent/mantissa fields read as
    // value · 2^-120 for normals and subnormals alike; the power-of-two multiply is exact.
    let pow2_120 = _mm512_set1_ps(f32::from_bits((127 + 120) << 23));
    let low7 = _mm512_set1_epi32(0x7f);
    let sign_bit = _mm512_set1_epi32(0x80);
    let nan_pos = _mm512_set1_ps(FP8_E4M3_TO_F32[0x7f]);
    let nan_neg = _mm512_set1_ps(FP8_E4M3_TO_F32[0xff]);
    let code_nan_neg = _mm512_set1_epi32(0xff);
    let mut c = 0;
    while c + 16 <= n {
        let code = _mm512_cvtepu8_epi32(_mm_loadu_si128(src.as_ptr().add(c).cast()));
        let mag = _mm512_and_si512(code, low7);
        let v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<20>(mag)), pow2_120);
        let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(code, sign_bit));
        let mut v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
        // 0x7f and 0xff are NaN; take the table's exact bits for them.
        if _mm512_cmpeq_epi32_mask(mag, low7) != 0 {
            v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(code, low7), nan_pos);
            v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(code, code_nan_neg), nan_neg);
        }
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), _mm512_mul_ps(v, scale_v));
        c += 16;
    }
    super::portable::fp8_span(&src[c..], scale, &mut dst[c..]);
}

/// # Safety
/// The CPU must support AVX-512F, and `2 * src.len() == dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fp4_span(src: &[u8], scale: f32, dst: &mut [f32]) {
    let n = dst.len();
    let scale_v = _mm512_set1_ps(scale);
    let table = _mm512_loadu_ps(FP4_E2M1_VALUES.as_ptr());
    let low4 = _mm_set1_epi8(0x0f);
    let mut c = 0;
    while c + 16 <= n {
        // 8 bytes hold columns c..c+16; interleave low/high nibbles into column order.
        let bytes = _mm_loadl_epi64(src.as_ptr().add(c / 2).cast());
        let lo = _mm_and_si128(bytes, low4);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
        let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        let v = _mm512_permutexvar_ps(idx, table);
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), _mm512_mul_ps(v, scale_v));
        c += 16;
    }
    super::portable::fp4_span(&src[c / 2..], scale, &mut dst[c..]);
}

