//! AVX2 + FMA loops. The 16 reference lanes live in two ymm registers: lanes
//! 0..8 in the first, 8..16 in the second, so the per-lane order is unchanged.
//!
//! Every function here is `unsafe` only because it needs AVX2 and FMA at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice.

use std::arch::x86_64::*;

use crate::dtype::{FP4_E2M1_VALUES, FP8_E4M3_TO_F32};

use super::{reduce16, ScaleRow};

/// All-ones in lanes `0..n` (`n <= 8`), for masked loads and blends.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lanes_below(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
}

/// # Safety
/// The CPU must support AVX2 and FMA, and `a.len() == b.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut c = 0;
    while c + 16 <= len {
        for (h, acc) in acc.iter_mut().enumerate() {
            let (va, vb) = (_mm256_loadu_ps(pa.add(c + 8 * h)), _mm256_loadu_ps(pb.add(c + 8 * h)));
            *acc = _mm256_fmadd_ps(va, vb, *acc);
        }
        c += 16;
    }
    for (h, acc) in acc.iter_mut().enumerate() {
        let k = (len - c).saturating_sub(8 * h).min(8);
        if k == 0 {
            break;
        }
        // Masked-off lanes keep their accumulator untouched (adding a zero product
        // would turn a -0.0 accumulator into +0.0).
        let m = lanes_below(k);
        let va = _mm256_maskload_ps(pa.add(c + 8 * h), m);
        let vb = _mm256_maskload_ps(pb.add(c + 8 * h), m);
        *acc = _mm256_blendv_ps(*acc, _mm256_fmadd_ps(va, vb, *acc), _mm256_castsi256_ps(m));
    }
    let mut lanes = [0.0f32; 16];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc[0]);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), acc[1]);
    reduce16(&lanes)
}

/// See `Backend::micro`.
///
/// # Safety
/// The CPU must support AVX2 and FMA; every slice of `xs` and `ws` has the same
/// length and `acc.len() >= (MR - 1) * acc_stride + NR * 16`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn micro<const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    ws: &[&[f32]; NR],
    acc: &mut [f32],
    acc_stride: usize,
) {
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    let mut a = [[[_mm256_setzero_ps(); 2]; NR]; MR];
    for (i, ai) in a.iter_mut().enumerate() {
        for (j, aij) in ai.iter_mut().enumerate() {
            for (h, v) in aij.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(pacc.add(i * acc_stride + j * 16 + 8 * h));
            }
        }
    }
    let mut c = 0;
    while c + 16 <= len {
        for h in 0..2 {
            let mut wv = [_mm256_setzero_ps(); NR];
            for (v, w) in wv.iter_mut().zip(ws) {
                *v = _mm256_loadu_ps(w.as_ptr().add(c + 8 * h));
            }
            for (ai, x) in a.iter_mut().zip(xs) {
                let xv = _mm256_loadu_ps(x.as_ptr().add(c + 8 * h));
                for (aij, w) in ai.iter_mut().zip(&wv) {
                    aij[h] = _mm256_fmadd_ps(xv, *w, aij[h]);
                }
            }
        }
        c += 16;
    }
    for h in 0..2 {
        let k = (len - c).saturating_sub(8 * h).min(8);
        if k == 0 {
            break;
        }
        let m = lanes_below(k);
        let mf = _mm256_castsi256_ps(m);
        let mut wv = [_mm256_setzero_ps(); NR];
        for (v, w) in wv.iter_mut().zip(ws) {
            *v = _mm256_maskload_ps(w.as_ptr().add(c + 8 * h), m);
        }
        for (ai, x) in a.iter_mut().zip(xs) {
            let xv = _mm256_maskload_ps(x.as_ptr().add(c + 8 * h), m);
            for (aij, w) in ai.iter_mut().zip(&wv) {
                aij[h] = _mm256_blendv_ps(aij[h], _mm256_fmadd_ps(xv, *w, aij[h]), mf);
            }
        }
    }
    for (i, ai) in a.iter().enumerate() {
        for (j, aij) in ai.iter().enumerate() {
            for (h, v) in aij.iter().enumerate() {
                _mm256_storeu_ps(pacc.add(i * acc_stride + j * 16 + 8 * h), *v);
            }
        }
    }
}

/// # Safety
/// The CPU must support AVX2, and `src.len() == 2 * dst.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn bf16_span(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let mut c = 0;
    while c + 8 <= n {
        let bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.as_ptr().add(2 * c).cast()));
        _mm256_storeu_ps(dst.as_mut_ptr().add(c), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(bits)));
        c += 8;
    }
    super::portable::bf16_span(&src[2 * c..], &mut dst[c..]);
}

/// FP8 e4m3 codes `p[..8]` to f32, bit-identical to `FP8_E4M3_TO_F32`.
///
/// # Safety
/// The CPU must support AVX2 and `p` must point at 8 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fp8_decode8(p: *const u8) -> __m256 {
    let code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
    let low7 = _mm256_set1_epi32(0x7f);
    let mag = _mm256_and_si256(code, low7);
    // e4m3 magnitude bits placed under the f32 exponent/mantissa fields read as
    // value · 2^-120 for normals and subnormals alike; the power-of-two multiply is exact.
    let pow2_120 = _mm256_set1_ps(f32::from_bits((127 + 120) << 23));
    let v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32::<20>(mag)), pow2_120);
    let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(code, _mm256_set1_epi32(0x80)));
    let mut v = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(v), sign));
    // 0x7f and 0xff are NaN; take the table's exact bits for them.
    if _mm256_movemask_epi8(_mm256_cmpeq_epi32(mag, low7)) != 0 {
        let nan_pos = _mm256_set1_ps(FP8_E4M3_TO_F32[0x7f]);
        let nan_neg = _mm256_set1_ps(FP8_E4M3_TO_F32[0xff]);
        let pos = _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, low7));
        let neg = _mm256_castsi256_ps(_mm256_cmpeq_epi32(code, _mm256_set1_epi32(0xff)));
        v = _mm256_blendv_ps(_mm256_blendv_ps(v, nan_pos, pos), nan_neg, neg);
    }
    v
}

/// FP4 e2m1 pairs `p[..8]` to 16 f32 values (two registers, column order).
///
/// # Safety
/// The CPU must support AVX2 and `p` must point at 8 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fp4_decode16(p: *const u8) -> [__m256; 2] {
    let low4 = _mm_set1_epi8(0x0f);
    let bytes = _mm_loadl_epi64(p.cast());
    let lo = _mm_and_si128(bytes, low4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
    let nibbles = _mm_unpacklo_epi8(lo, hi);
    // Magnitudes of codes 0..8; codes 8..16 are their exact negations, so bit 3 of
    // the code is moved straight into the f32 sign bit.
    let table = _mm256_loadu_ps(FP4_E2M1_VALUES.as_ptr());
    let decode = |part: __m128i| {
        let idx = _mm256_cvtepu8_epi32(part);
        let mag = _mm256_permutevar8x32_ps(table, idx);
        let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(idx, _mm256_set1_epi32(8)));
        _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign))
    };
    [decode(nibbles), decode(_mm_srli_si128::<8>(nibbles))]
}

/// # Safety
/// The CPU must support AVX2, and `src.len() == dst.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fp8_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 8 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 8 {
            let scale = _mm256_set1_ps(scale);
            let stop = c + (run.min(n - c) & !7);
            while c < stop {
                _mm256_storeu_ps(pd.add(c), _mm256_mul_ps(fp8_decode8(ps.add(c)), scale));
                c += 8;
            }
        } else {
            let lanes = _mm256_loadu_ps(scales.lanes(k0 + c, 8).as_ptr());
            _mm256_storeu_ps(pd.add(c), _mm256_mul_ps(fp8_decode8(ps.add(c)), lanes));
            c += 8;
        }
    }
    super::portable::fp8_span(&src[c..], k0 + c, scales, &mut dst[c..]);
}

/// # Safety
/// The CPU must support AVX2, and `2 * src.len() == dst.len()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fp4_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 16 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 16 {
            let scale = _mm256_set1_ps(scale);
            let stop = c + (run.min(n - c) & !15);
            while c < stop {
                let [v0, v1] = fp4_decode16(ps.add(c / 2));
                _mm256_storeu_ps(pd.add(c), _mm256_mul_ps(v0, scale));
                _mm256_storeu_ps(pd.add(c + 8), _mm256_mul_ps(v1, scale));
                c += 16;
            }
        } else {
            let lanes = scales.lanes(k0 + c, 16);
            let [v0, v1] = fp4_decode16(ps.add(c / 2));
            _mm256_storeu_ps(pd.add(c), _mm256_mul_ps(v0, _mm256_loadu_ps(lanes.as_ptr())));
            _mm256_storeu_ps(pd.add(c + 8), _mm256_mul_ps(v1, _mm256_loadu_ps(lanes.as_ptr().add(8))));
            c += 16;
        }
    }
    super::portable::fp4_span(&src[c / 2..], k0 + c, scales, &mut dst[c..]);
}
