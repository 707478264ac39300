//! AArch64 NEON loops. The 16 reference lanes live in four 4-lane registers,
//! lane `l` in register `l / 4`, so the per-lane order is unchanged; a fused
//! multiply-add (`vfmaq_f32`) rounds once, as `f32::mul_add` does.
//!
//! Every function here is `unsafe` only because it needs NEON at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice. Columns past the last
//! whole 16 go through the portable loop on the same lanes.

use std::arch::aarch64::*;

use crate::dtype::{FP4_E2M1_VALUES, FP8_E4M3_TO_F32};

use super::{reduce16, ScaleRow};

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

/// # Safety
/// The CPU must support NEON, and `src.len() == 2 * dst.len()`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn bf16_span(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let mut c = 0;
    while c + 8 <= n {
        let bits = vld1q_u16(src.as_ptr().add(2 * c).cast());
        // A bf16 is the high half of its f32.
        let low = vshll_n_u16::<16>(vget_low_u16(bits));
        let high = vshll_high_n_u16::<16>(bits);
        vst1q_f32(dst.as_mut_ptr().add(c), vreinterpretq_f32_u32(low));
        vst1q_f32(dst.as_mut_ptr().add(c + 4), vreinterpretq_f32_u32(high));
        c += 8;
    }
    super::portable::bf16_span(&src[2 * c..], &mut dst[c..]);
}

/// FP8 e4m3 codes `p[..8]` to f32, bit-identical to `FP8_E4M3_TO_F32`.
///
/// # Safety
/// The CPU must support NEON and `p` must point at 8 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp8_decode8(p: *const u8) -> [float32x4_t; 2] {
    let wide = vmovl_u8(vld1_u8(p));
    let codes = [vmovl_u16(vget_low_u16(wide)), vmovl_high_u16(wide)];
    let low7 = vdupq_n_u32(0x7f);
    // e4m3 magnitude bits placed under the f32 exponent/mantissa fields read as
    // value · 2^-120 for normals and subnormals alike; the power-of-two multiply is exact.
    let pow2_120 = vdupq_n_f32(f32::from_bits((127 + 120) << 23));
    codes.map(|code| {
        let mag = vandq_u32(code, low7);
        let value = vmulq_f32(vreinterpretq_f32_u32(vshlq_n_u32::<20>(mag)), pow2_120);
        let sign = vshlq_n_u32::<24>(vandq_u32(code, vdupq_n_u32(0x80)));
        let mut v = vorrq_u32(vreinterpretq_u32_f32(value), sign);
        // 0x7f and 0xff are NaN; take the table's exact bits for them.
        let nan = vceqq_u32(mag, low7);
        if vmaxvq_u32(nan) != 0 {
            let nan_bits = vbslq_u32(
                vceqq_u32(code, low7),
                vdupq_n_u32(FP8_E4M3_TO_F32[0x7f].to_bits()),
                vdupq_n_u32(FP8_E4M3_TO_F32[0xff].to_bits()),
            );
            v = vbslq_u32(nan, nan_bits, v);
        }
        vreinterpretq_f32_u32(v)
    })
}

/// The high 16 bits of each FP4 e2m1 value's f32 (its low 16 are zero), as
/// byte tables: `.0` the low byte of those 16 bits, `.1` the high one.
const FP4_HIGH_HALF_BYTES: ([u8; 16], [u8; 16]) = {
    let (mut low, mut high) = ([0u8; 16], [0u8; 16]);
    let mut code = 0;
    while code < 16 {
        let bits = FP4_E2M1_VALUES[code].to_bits();
        assert!(bits & 0xffff == 0, "an e2m1 value has at most two significant bits");
        low[code] = (bits >> 16) as u8;
        high[code] = (bits >> 24) as u8;
        code += 1;
    }
    (low, high)
};

/// FP4 e2m1 pairs `p[..8]` to 16 f32 values (four registers, column order).
///
/// # Safety
/// The CPU must support NEON and `p` must point at 8 readable bytes.
#[inline]
#[target_feature(enable = "neon")]
unsafe fn fp4_decode16(p: *const u8) -> [float32x4_t; 4] {
    let bytes = vld1_u8(p);
    // Even columns sit in the low nibbles.
    let (even, odd) = (vand_u8(bytes, vdup_n_u8(0x0f)), vshr_n_u8::<4>(bytes));
    let nibbles = vcombine_u8(vzip1_u8(even, odd), vzip2_u8(even, odd));
    let low = vqtbl1q_u8(vld1q_u8(FP4_HIGH_HALF_BYTES.0.as_ptr()), nibbles);
    let high = vqtbl1q_u8(vld1q_u8(FP4_HIGH_HALF_BYTES.1.as_ptr()), nibbles);
    let halves = [vreinterpretq_u16_u8(vzip1q_u8(low, high)), vreinterpretq_u16_u8(vzip2q_u8(low, high))];
    let f = |bits: uint32x4_t| vreinterpretq_f32_u32(bits);
    [
        f(vshll_n_u16::<16>(vget_low_u16(halves[0]))),
        f(vshll_high_n_u16::<16>(halves[0])),
        f(vshll_n_u16::<16>(vget_low_u16(halves[1]))),
        f(vshll_high_n_u16::<16>(halves[1])),
    ]
}

/// # Safety
/// The CPU must support NEON, and `src.len() == dst.len()`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn fp8_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 8 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 8 {
            let scale = vdupq_n_f32(scale);
            let stop = c + (run.min(n - c) & !7);
            while c < stop {
                let [v0, v1] = fp8_decode8(ps.add(c));
                vst1q_f32(pd.add(c), vmulq_f32(v0, scale));
                vst1q_f32(pd.add(c + 4), vmulq_f32(v1, scale));
                c += 8;
            }
        } else {
            let lanes = scales.lanes(k0 + c, 8);
            let [v0, v1] = fp8_decode8(ps.add(c));
            vst1q_f32(pd.add(c), vmulq_f32(v0, vld1q_f32(lanes.as_ptr())));
            vst1q_f32(pd.add(c + 4), vmulq_f32(v1, vld1q_f32(lanes.as_ptr().add(4))));
            c += 8;
        }
    }
    super::portable::fp8_span(&src[c..], k0 + c, scales, &mut dst[c..]);
}

/// # Safety
/// The CPU must support NEON, and `2 * src.len() == dst.len()`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn fp4_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 16 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 16 {
            let scale = vdupq_n_f32(scale);
            let stop = c + (run.min(n - c) & !15);
            while c < stop {
                for (q, v) in fp4_decode16(ps.add(c / 2)).into_iter().enumerate() {
                    vst1q_f32(pd.add(c + 4 * q), vmulq_f32(v, scale));
                }
                c += 16;
            }
        } else {
            let lanes = scales.lanes(k0 + c, 16);
            for (q, v) in fp4_decode16(ps.add(c / 2)).into_iter().enumerate() {
                vst1q_f32(pd.add(c + 4 * q), vmulq_f32(v, vld1q_f32(lanes.as_ptr().add(4 * q))));
            }
            c += 16;
        }
    }
    super::portable::fp4_span(&src[c / 2..], k0 + c, scales, &mut dst[c..]);
}
