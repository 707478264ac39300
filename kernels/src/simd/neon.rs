//! AArch64 NEON loops. The 16 reference lanes live in four 4-lane registers,
//! lane `l` in register `l / 4`, so the per-lane order is unchanged; a fused
//! multiply-add (`vfmaq_f32`) rounds once, as `f32::mul_add` does.
//!
//! Every function here is `unsafe` only because it needs NEON at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice. Columns past the last
//! whole 16 go through the portable loop on the same lanes.

use std::arch::aarch64::*;

use super::reduce16;

/// Registers per 16 lanes.
const QUADS: usize = 4;

/// The 16 lanes of `acc` as an array, lane `4q + i` from register `q`.
///
/// # Safety
/// The CPU must support NEON.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn store_lanes(acc: &[float32x4_t; QUADS]) -> [f32; 16] {
    let mut lanes = [0.0f32; 16];
    for (q, v) in acc.iter().enumerate() {
        vst1q_f32(lanes.as_mut_ptr().add(4 * q), *v);
    }
    lanes
}

/// # Safety
/// The CPU must support NEON, and `a.len() == b.len()`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let len = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); QUADS];
    let mut c = 0;
    while c + 16 <= len {
        for (q, acc) in acc.iter_mut().enumerate() {
            *acc = vfmaq_f32(*acc, vld1q_f32(pa.add(c + 4 * q)), vld1q_f32(pb.add(c + 4 * q)));
        }
        c += 16;
    }
    let mut lanes = store_lanes(&acc);
    for ((lane, &x), &y) in lanes.iter_mut().zip(&a[c..]).zip(&b[c..]) {
        *lane = x.mul_add(y, *lane);
    }
    reduce16(&lanes)
}

/// See `Backend::micro`.
///
/// # Safety
/// The CPU must support NEON; every slice of `xs` and `ws` has the same
/// length and `acc.len() >= (MR - 1) * acc_stride + NR * 16`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn micro<const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    ws: &[&[f32]; NR],
    acc: &mut [f32],
    acc_stride: usize,
) {
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    let mut a = [[[vdupq_n_f32(0.0); QUADS]; NR]; MR];
    for (i, ai) in a.iter_mut().enumerate() {
        for (j, aij) in ai.iter_mut().enumerate() {
            for (q, v) in aij.iter_mut().enumerate() {
                *v = vld1q_f32(pacc.add(i * acc_stride + j * 16 + 4 * q));
            }
        }
    }
    let whole = len / 16 * 16;
    for c in (0..whole).step_by(16) {
        for q in 0..QUADS {
            let mut wv = [vdupq_n_f32(0.0); NR];
            for (v, w) in wv.iter_mut().zip(ws) {
                *v = vld1q_f32(w.as_ptr().add(c + 4 * q));
            }
            for (ai, x) in a.iter_mut().zip(xs) {
                let xv = vld1q_f32(x.as_ptr().add(c + 4 * q));
                for (aij, w) in ai.iter_mut().zip(&wv) {
                    aij[q] = vfmaq_f32(aij[q], xv, *w);
                }
            }
        }
    }
    for (i, (ai, x)) in a.iter().zip(xs).enumerate() {
        for (j, (aij, w)) in ai.iter().zip(ws).enumerate() {
            let mut lanes = store_lanes(aij);
            for ((lane, &xc), &wc) in lanes.iter_mut().zip(&x[whole..]).zip(&w[whole..]) {
                *lane = xc.mul_add(wc, *lane);
            }
            acc[i * acc_stride + j * 16..][..16].copy_from_slice(&lanes);
        }
    }
}
