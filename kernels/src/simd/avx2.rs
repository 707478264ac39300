//! AVX2 + FMA loops. The 16 reference lanes live in two ymm registers: lanes
//! 0..8 in the first, 8..16 in the second, so the per-lane order is unchanged.
//!
//! Every function here is `unsafe` only because it needs AVX2 and FMA at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice.

use std::arch::x86_64::*;

use super::reduce16;

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
