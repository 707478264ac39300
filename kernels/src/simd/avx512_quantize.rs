//! V4.1's FP8 activation quantisation on 16 lanes, with the bits of the
//! scalar definition ([`crate::act_quant::fp8_quantize_row`]): every step is
//! element-wise, and a block's largest magnitude is the same whichever order
//! finds it.

use std::arch::x86_64::*;

use crate::act_quant::{power_of_two_scale, ACT_BLOCK};
use crate::dtype::FP8_E4M3_MAX;

/// Quantises the whole blocks of `x` whose values are all finite into
/// `values` and `scales` (as the definition does), leaving the others'
/// entries untouched; returns whether each block was done.
///
/// # Safety
/// The CPU must support AVX-512F; `x.len()` is a multiple of 32, `values`
/// as long as `x`, `scales` one per block.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fp8_quantize_blocks(x: &[f32], values: &mut [f32], scales: &mut [f32]) -> Vec<bool> {
    assert!(x.len().is_multiple_of(ACT_BLOCK) && values.len() == x.len() && scales.len() == x.len() / ACT_BLOCK);
    let magnitude_bits = _mm512_set1_epi32(0x7fff_ffff);
    let (max, min) = (_mm512_set1_ps(FP8_E4M3_MAX), _mm512_set1_ps(-FP8_E4M3_MAX));
    let infinity = _mm512_set1_ps(f32::INFINITY);
    let mut done = Vec::with_capacity(scales.len());
    for (b, block) in x.chunks_exact(ACT_BLOCK).enumerate() {
        let halves = [_mm512_loadu_ps(block.as_ptr()), _mm512_loadu_ps(block.as_ptr().add(16))];
        let magnitudes = halves.map(|h| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(h), magnitude_bits)));
        // NaN compares false: a block with NaN or ±inf takes the definition's loop.
        let finite = magnitudes.iter().all(|m| _mm512_cmp_ps_mask::<_CMP_LT_OQ>(*m, infinity) == 0xffff);
        done.push(finite);
        if !finite {
            continue;
        }
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(magnitudes[0], magnitudes[1])).max(1e-4);
        let s = power_of_two_scale(amax, 1.0f32 / FP8_E4M3_MAX);
        scales[b] = s;
        let s = _mm512_set1_ps(s);
        for (i, half) in halves.iter().enumerate() {
            let clamped = _mm512_max_ps(_mm512_min_ps(_mm512_div_ps(*half, s), max), min);
            _mm512_storeu_ps(values.as_mut_ptr().add(b * ACT_BLOCK + 16 * i), e4m3_round16(clamped));
        }
    }
    done
}

/// [`crate::act_quant::e4m3_round`] of 16 values already within ±448.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn e4m3_round16(x: __m512) -> __m512 {
    let sign = _mm512_set1_epi32(i32::MIN);
    let bits = _mm512_castps_si512(x);
    let magnitude_bits = _mm512_andnot_si512(sign, bits);
    let magnitude = _mm512_castsi512_ps(magnitude_bits);
    // Subnormals: multiples of 2^-9, rounded by adding and taking off 2^23.
    let rounder = _mm512_set1_ps(8_388_608.0);
    let scaled = _mm512_mul_ps(magnitude, _mm512_set1_ps(512.0));
    let whole = _mm512_sub_ps(_mm512_add_ps(scaled, rounder), rounder);
    let subnormal = _mm512_div_ps(whole, _mm512_set1_ps(512.0));
    // Normals: three mantissa bits kept, the 20 dropped rounded to nearest even.
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<20>(magnitude_bits), _mm512_set1_epi32(1));
    let biased = _mm512_add_epi32(_mm512_add_epi32(magnitude_bits, _mm512_set1_epi32(0x7_ffff)), lsb);
    let normal = _mm512_castsi512_ps(_mm512_and_si512(biased, _mm512_set1_epi32(!0xf_ffff)));
    let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(magnitude, _mm512_set1_ps(2f32.powi(-6)));
    let rounded = _mm512_mask_blend_ps(small, normal, subnormal);
    // The sign of x, as `copysign` puts it back.
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(rounded), _mm512_and_si512(bits, sign)))
}
