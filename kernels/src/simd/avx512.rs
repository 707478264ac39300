//! AVX-512F loops. One zmm register is exactly the 16 reference lanes, so each
//! `vfmadd` performs the reference's 16 `mul_add`s at once.
//!
//! Every function here is `unsafe` only because it needs AVX-512F at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice.

use std::arch::x86_64::*;

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
/// With `FRESH` the accumulators start at zero instead of `acc`'s values.
///
/// # Safety
/// The CPU must support AVX-512F; every slice of `xs` and `ws` has the same length
/// and `acc.len() >= (MR - 1) * acc_stride + NR * 16`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn micro<const MR: usize, const NR: usize, const FRESH: bool>(
    xs: &[&[f32]; MR],
    ws: &[&[f32]; NR],
    acc: &mut [f32],
    acc_stride: usize,
) {
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    // Fresh accumulators start at +0.0, the bits a zeroed buffer would load.
    let mut a = [[_mm512_setzero_ps(); NR]; MR];
    if !FRESH {
        for (i, ai) in a.iter_mut().enumerate() {
            for (j, aij) in ai.iter_mut().enumerate() {
                *aij = _mm512_loadu_ps(pacc.add(i * acc_stride + j * 16));
            }
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

/// `reduce16` of 16 rows at once: each level of the tree adds the lower half
/// of every row's live lanes to its upper half for two (then four, eight,
/// sixteen) rows in one register, so every sum is the tree's own.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn reduce_tile(acc: &[f32; 256]) -> [f32; 16] {
    let p = acc.as_ptr();
    reduce_rows(std::array::from_fn(|j| _mm512_loadu_ps(p.add(16 * j))))
}

/// [`reduce_tile`] of 16 rows held in registers.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline(always)]
unsafe fn reduce_rows(rows: [__m512; 16]) -> [f32; 16] {
    let row = |j: usize| rows[j];
    // Lanes +8: rows 2k and 2k + 1, eight sums each.
    let b: [__m512; 8] = std::array::from_fn(|k| {
        let (lo, hi) = (row(2 * k), row(2 * k + 1));
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(lo, hi), _mm512_shuffle_f32x4::<0xee>(lo, hi))
    });
    // Lanes +4: 128-bit block r of c[m] is row 4m + r.
    let c: [__m512; 4] = std::array::from_fn(|m| {
        let (lo, hi) = (b[2 * m], b[2 * m + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(lo, hi), _mm512_shuffle_f32x4::<0xdd>(lo, hi))
    });
    // Lanes +2: block r of d[q] holds rows 8q + r and 8q + 4 + r, two sums each.
    let d: [__m512; 2] = std::array::from_fn(|q| {
        let (lo, hi) = (c[2 * q], c[2 * q + 1]);
        _mm512_add_ps(_mm512_shuffle_ps::<0x44>(lo, hi), _mm512_shuffle_ps::<0xee>(lo, hi))
    });
    // Lane +1: lane 4r + q of e is row r + 4q.
    let e = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(d[0], d[1]), _mm512_shuffle_ps::<0xdd>(d[0], d[1]));
    let rows_in_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let mut out = [0.0f32; 16];
    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutexvar_ps(rows_in_order, e));
    out
}
