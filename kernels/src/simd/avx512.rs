//! AVX-512F loops. One zmm register is exactly the 16 reference lanes, so each
//! `vfmadd` performs the reference's 16 `mul_add`s at once.
//!
//! Every function here is `unsafe` only because it needs AVX-512F at run time;
//! the slice-length preconditions are checked by `Backend` before the call and
//! every load and store below stays inside its slice.

use std::arch::x86_64::*;

use crate::dtype::{FP4_E2M1_VALUES, FP8_E4M3_TO_F32};

use super::{reduce16, ScaleRow};

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

/// Encodings of [`micro_encoded`].
pub(super) const BF16: u8 = 0;
pub(super) const FP8: u8 = 1;
pub(super) const FP4: u8 = 2;

/// See `Backend::micro_encoded`.
///
/// # Safety
/// The CPU must support AVX-512F; every slice of `xs` has length `len`, every
/// `codes[j]` holds `len` columns in encoding `ENC`, and for FP8/FP4 every
/// `scales[j]` covers columns `..k0 + len` in blocks that are multiples of 16 wide
/// (all the same); `k0 % 16 == 0`; `acc.len() >= (MR - 1) * acc_stride + NR * 16`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn micro_encoded<const ENC: u8, const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    codes: &[&[u8]; NR],
    scales: &[ScaleRow; NR],
    k0: usize,
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
    // Scale block of the current chunk and the columns left in it; blocks are
    // multiples of 16 wide, so a chunk never straddles two.
    let block = if ENC == BF16 { usize::MAX } else { scales[0].block };
    let mut index = k0 / block;
    let mut left = block - k0 % block;
    let mut c = 0;
    while c + 16 <= len {
        let mut wv = [_mm512_setzero_ps(); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let p = codes[j].as_ptr();
            *v = match ENC {
                BF16 => bf16_decode16(p.add(2 * c)),
                FP8 => _mm512_mul_ps(fp8_decode16(p.add(c)), _mm512_set1_ps(scales[j].row[index])),
                _ => _mm512_mul_ps(fp4_decode16(p.add(c / 2)), _mm512_set1_ps(scales[j].row[index])),
            };
        }
        for (ai, x) in a.iter_mut().zip(xs) {
            let xv = _mm512_loadu_ps(x.as_ptr().add(c));
            for (aij, w) in ai.iter_mut().zip(&wv) {
                *aij = _mm512_fmadd_ps(xv, *w, *aij);
            }
        }
        left -= 16;
        if left == 0 {
            index += 1;
            left = block;
        }
        c += 16;
    }
    if c < len {
        // Decode the last partial chunk through a zero-padded buffer.
        let (t, m) = (len - c, tail_mask(len - c));
        let mut wv = [_mm512_setzero_ps(); NR];
        for (j, v) in wv.iter_mut().enumerate() {
            let mut tmp = [0.0f32; 16];
            match ENC {
                BF16 => super::portable::bf16_span(&codes[j][2 * c..], &mut tmp[..t]),
                FP8 => super::portable::fp8_span(&codes[j][c..], k0 + c, scales[j], &mut tmp[..t]),
                _ => super::portable::fp4_span(&codes[j][c / 2..], k0 + c, scales[j], &mut tmp[..t]),
            }
            *v = _mm512_loadu_ps(tmp.as_ptr());
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

/// bf16 bits `p[..32]` (little-endian) to 16 f32 values.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 32 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bf16_decode16(p: *const u8) -> __m512 {
    let bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits))
}

/// # Safety
/// The CPU must support AVX-512F, and `src.len() == 2 * dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn bf16_span(src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let mut c = 0;
    while c + 16 <= n {
        _mm512_storeu_ps(dst.as_mut_ptr().add(c), bf16_decode16(src.as_ptr().add(2 * c)));
        c += 16;
    }
    super::portable::bf16_span(&src[2 * c..], &mut dst[c..]);
}

/// FP8 e4m3 codes `p[..16]` to f32, bit-identical to `FP8_E4M3_TO_F32`.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 16 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fp8_decode16(p: *const u8) -> __m512 {
    let code = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
    let low7 = _mm512_set1_epi32(0x7f);
    let mag = _mm512_and_si512(code, low7);
    // e4m3 magnitude bits placed under the f32 exponent/mantissa fields read as
    // value · 2^-120 for normals and subnormals alike; the power-of-two multiply is exact.
    let pow2_120 = _mm512_set1_ps(f32::from_bits((127 + 120) << 23));
    let v = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32::<20>(mag)), pow2_120);
    let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(code, _mm512_set1_epi32(0x80)));
    let mut v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
    // 0x7f and 0xff are NaN; take the table's exact bits for them.
    if _mm512_cmpeq_epi32_mask(mag, low7) != 0 {
        let nan_pos = _mm512_set1_ps(FP8_E4M3_TO_F32[0x7f]);
        let nan_neg = _mm512_set1_ps(FP8_E4M3_TO_F32[0xff]);
        v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(code, low7), nan_pos);
        v = _mm512_mask_mov_ps(v, _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(0xff)), nan_neg);
    }
    v
}

/// FP4 e2m1 pairs `p[..8]` (columns in nibble order) to 16 f32 values.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 8 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fp4_decode16(p: *const u8) -> __m512 {
    let low4 = _mm_set1_epi8(0x0f);
    let bytes = _mm_loadl_epi64(p.cast());
    // Interleave low and high nibbles into column order.
    let lo = _mm_and_si128(bytes, low4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
    let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    _mm512_permutexvar_ps(idx, _mm512_loadu_ps(FP4_E2M1_VALUES.as_ptr()))
}

/// # Safety
/// The CPU must support AVX-512F, and `src.len() == dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fp8_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 16 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 16 {
            let scale = _mm512_set1_ps(scale);
            let stop = c + (run.min(n - c) & !15);
            while c < stop {
                _mm512_storeu_ps(pd.add(c), _mm512_mul_ps(fp8_decode16(ps.add(c)), scale));
                c += 16;
            }
        } else {
            let lanes = _mm512_loadu_ps(scales.lanes(k0 + c, 16).as_ptr());
            _mm512_storeu_ps(pd.add(c), _mm512_mul_ps(fp8_decode16(ps.add(c)), lanes));
            c += 16;
        }
    }
    super::portable::fp8_span(&src[c..], k0 + c, scales, &mut dst[c..]);
}

/// # Safety
/// The CPU must support AVX-512F, and `2 * src.len() == dst.len()`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fp4_span(src: &[u8], k0: usize, scales: ScaleRow, dst: &mut [f32]) {
    let n = dst.len();
    let (ps, pd) = (src.as_ptr(), dst.as_mut_ptr());
    let mut c = 0;
    while c + 16 <= n {
        let (scale, run) = scales.run(k0 + c);
        if run >= 16 {
            let scale = _mm512_set1_ps(scale);
            let stop = c + (run.min(n - c) & !15);
            while c < stop {
                _mm512_storeu_ps(pd.add(c), _mm512_mul_ps(fp4_decode16(ps.add(c / 2)), scale));
                c += 16;
            }
        } else {
            let lanes = _mm512_loadu_ps(scales.lanes(k0 + c, 16).as_ptr());
            _mm512_storeu_ps(pd.add(c), _mm512_mul_ps(fp4_decode16(ps.add(c / 2)), lanes));
            c += 16;
        }
    }
    super::portable::fp4_span(&src[c / 2..], k0 + c, scales, &mut dst[c..]);
}
