//! `exp` with the same bits on every path and every machine.
//!
//! The C library's `expf` is a scalar call (a quarter of attention's softmax
//! and most of SwiGLU's time) whose last bit may differ between library
//! versions and CPUs. This one is a fixed sequence of IEEE operations: the
//! portable function below defines it, and the AVX-512 loop performs the same
//! operations on 16 lanes, so both give the same bits. Error under 2 ulp
//! (tested against f64).

/// `log2(e)`.
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2` split so that `n · LN2_HI` is exact for every `|n| ≤ 150`.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// Above this `exp` overflows to +inf.
const INPUT_MAX: f32 = 88.722_83;
/// Below this `exp` is below the smallest subnormal: 0.
const INPUT_MIN: f32 = -103.972_08;
/// Minimax polynomial for `(exp(r) − 1 − r) / r²` on `|r| ≤ ln 2 / 2`, highest
/// power first.
const POLY: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5];

/// `e^x`: +inf above [`INPUT_MAX`], 0 below [`INPUT_MIN`] (and for −inf), NaN
/// for NaN.
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > INPUT_MAX {
        return f32::INFINITY;
    }
    if x < INPUT_MIN {
        return 0.0;
    }
    // x = n·ln2 + r with |r| ≤ ln2/2 (two steps keep r exact to ~2^-40).
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, x));
    let p = POLY[1..].iter().fold(POLY[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^n in two factors, each a normal number for n in [-150, 128].
    let n = n as i32;
    let (n1, n2) = (n >> 1, n - (n >> 1));
    y * pow2(n1) * pow2(n2)
}

/// `2^n` for `n` in the normal exponent range.
#[inline]
fn pow2(n: i32) -> f32 {
    f32::from_bits(((n + 127) as u32) << 23)
}

/// `xs[i] = exp(xs[i])`, with the bits of [`exp`].
pub fn exp_in_place(xs: &mut [f32]) {
    // SAFETY: `Isa::detect` only returns paths this CPU supports.
    unsafe { exp_in_place_on(crate::Isa::detect(), xs) }
}

/// [`exp_in_place`] on a chosen path (for tests). Panics if this CPU lacks `isa`.
pub fn exp_in_place_with(isa: crate::Isa, xs: &mut [f32]) {
    assert!(isa.is_available(), "{isa:?} is not available");
    // SAFETY: checked just above.
    unsafe { exp_in_place_on(isa, xs) }
}

/// # Safety
/// The CPU must support `isa`.
unsafe fn exp_in_place_on(isa: crate::Isa, xs: &mut [f32]) {
    match isa {
        // SAFETY: the caller guarantees AVX-512F.
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx512 => unsafe { avx512::exp_in_place(xs) },
        // SAFETY: the caller guarantees AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx2 => unsafe { exp_in_place_fma(xs) },
        _ => xs.iter_mut().for_each(|x| *x = exp(*x)),
    }
}

/// The portable loop with the multiply-adds as instructions rather than
/// calls to the C library's `fmaf` (the same operations, so the same bits).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_in_place_fma(xs: &mut [f32]) {
    xs.iter_mut().for_each(|x| *x = exp(*x));
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use super::{INPUT_MAX, INPUT_MIN, LN2_HI, LN2_LO, LOG2E, POLY};

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn exp_in_place(xs: &mut [f32]) {
        let p = xs.as_mut_ptr();
        let mut i = 0;
        while i < xs.len() {
            let m: __mmask16 = if xs.len() - i >= 16 { 0xffff } else { (1u16 << (xs.len() - i)) - 1 };
            let x = _mm512_maskz_loadu_ps(m, p.add(i));
            _mm512_mask_storeu_ps(p.add(i), m, exp16(x));
            i += 16;
        }
    }

    /// `xs[i] = exp(xs[i] − shift)` (the difference rounded first, as a
    /// plain loop subtracting then calling [`super::exp`]), returning the
    /// 16 lane sums of the results in `ops::sum_lanes`' order: element `i`
    /// added into lane `i % 16` from +0.0. One pass where a softmax made three.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn exp_shifted_lane_sums(xs: &mut [f32], shift: f32) -> [f32; 16] {
        let p = xs.as_mut_ptr();
        let shift = _mm512_set1_ps(shift);
        let mut sums = _mm512_setzero_ps();
        let mut i = 0;
        while i < xs.len() {
            let m: __mmask16 = if xs.len() - i >= 16 { 0xffff } else { (1u16 << (xs.len() - i)) - 1 };
            let y = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.add(i)), shift));
            _mm512_mask_storeu_ps(p.add(i), m, y);
            sums = _mm512_mask_add_ps(sums, m, sums, y);
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
        lanes
    }

    /// [`super::exp`] of 16 lanes, operation for operation.
    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let high = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(INPUT_MAX));
        let low = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(INPUT_MIN));
        // Lanes outside the range compute on 0 and are replaced below.
        let x_in = _mm512_mask_mov_ps(x, nan | high | low, _mm512_setzero_ps());
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x_in,
            _mm512_set1_ps(LOG2E),
        ));
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x_in);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
        let mut poly = _mm512_set1_ps(POLY[0]);
        for &c in &POLY[1..] {
            poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0));
        let n = _mm512_cvtps_epi32(n);
        let n1 = _mm512_srai_epi32::<1>(n);
        let n2 = _mm512_sub_epi32(n, n1);
        let bias = _mm512_set1_epi32(127);
        let pow2 = |k: __m512i| _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(k, bias)));
        let out = _mm512_mul_ps(_mm512_mul_ps(y, pow2(n1)), pow2(n2));
        let out = _mm512_mask_mov_ps(out, high, _mm512_set1_ps(f32::INFINITY));
        let out = _mm512_mask_mov_ps(out, low, _mm512_setzero_ps());
        _mm512_mask_mov_ps(out, nan, x)
    }
}
