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

/// [`reduce16`] of each of up to 16 accumulators (x row `i`, weight row `j`)
/// with one [`reduce_tile`]: the tree's own sums, a few shuffles instead of
/// a scalar tree per accumulator.
///
/// # Safety
/// The CPU must support AVX-512F.
#[inline(always)]
pub(super) unsafe fn reduce_accumulators<const MR: usize, const RP: usize>(
    acc: &[[__m512; RP]; MR],
) -> [[f32; RP]; MR] {
    const { assert!(MR * RP <= 16, "one tile of accumulators") };
    let mut rows = [_mm512_setzero_ps(); 16];
    for (row, v) in rows.iter_mut().zip(acc.iter().flatten()) {
        *row = *v;
    }
    let sums = reduce_rows(rows);
    std::array::from_fn(|i| std::array::from_fn(|j| sums[i * RP + j]))
}

/// Encodings of [`micro_encoded`].
pub(super) const BF16: u8 = 0;
pub(super) const FP8: u8 = 1;
pub(super) const FP4: u8 = 2;

/// See `Backend::micro_encoded`.
///
/// # Safety
/// The CPU must support AVX-512F; every slice of `xs` has length `len`, every
/// `codes[j]` and `ahead[j]` holds `len` columns in encoding `ENC`, and for
/// FP8/FP4 every `scales[j]` covers columns `..k0 + len` in blocks that are
/// multiples of 16 wide (all the same); `k0 % 16 == 0`;
/// `acc.len() >= (MR - 1) * acc_stride + NR * 16`; no `|x|` in `xs` exceeds
/// `x_abs_max`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn micro_encoded<const ENC: u8, const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    tile: EncodedTile<NR>,
    acc: &mut [f32],
    acc_stride: usize,
) {
    micro_encoded_body::<ENC, MR, NR, false>(xs, tile, acc, acc_stride)
}

/// [`micro_encoded`] with FP4 nibbles picked by `vpmultishiftqb`.
///
/// # Safety
/// As [`micro_encoded`], and the CPU must support AVX-512 VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
pub(super) unsafe fn micro_encoded_vbmi<const ENC: u8, const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    tile: EncodedTile<NR>,
    acc: &mut [f32],
    acc_stride: usize,
) {
    micro_encoded_body::<ENC, MR, NR, true>(xs, tile, acc, acc_stride)
}

/// The weight rows of one [`micro_encoded`] call: `codes[j]` and `scales[j]`
/// per row, the first column `k0`, the rows to prefetch, a bound on `|x|`, and
/// whether the codes are known to hold no FP8 NaN.
pub(super) struct EncodedTile<'a, const NR: usize> {
    pub codes: &'a [&'a [u8]; NR],
    pub scales: &'a [ScaleRow<'a>; NR],
    pub k0: usize,
    pub ahead: &'a [&'a [u8]],
    pub x_abs_max: f32,
    pub codes_nan_free: bool,
}

/// 2^120: e4m3 magnitude bits under the f32 exponent field read as value · 2^-120.
pub(super) const POW2_120: f32 = f32::from_bits((127 + 120) << 23);
/// Largest scale whose product with 2^120 stays finite with room to spare.
const FOLDABLE_SCALE_MAX: f32 = f32::from_bits((127 + 6) << 23);

#[inline(always)]
unsafe fn micro_encoded_body<const ENC: u8, const MR: usize, const NR: usize, const VBMI: bool>(
    xs: &[&[f32]; MR],
    tile: EncodedTile<NR>,
    acc: &mut [f32],
    acc_stride: usize,
) {
    let EncodedTile { codes, scales, k0, ahead, x_abs_max, codes_nan_free } = tile;
    let len = xs[0].len();
    let pacc = acc.as_mut_ptr();
    // Bytes of one row's codes per 16-column chunk.
    let chunk_bytes = match ENC {
        BF16 => 32,
        FP8 => 16,
        _ => 8,
    };
    let mut a = [[_mm512_setzero_ps(); NR]; MR];
    for (i, ai) in a.iter_mut().enumerate() {
        for (j, aij) in ai.iter_mut().enumerate() {
            *aij = _mm512_loadu_ps(pacc.add(i * acc_stride + j * 16));
        }
    }
    let fp4_table = _mm512_loadu_ps(FP4_E2M1_VALUES.as_ptr());
    // FP8 NaN codes are known absent from the whole matrix (found at load) or
    // looked for once per call rather than per chunk (they do not occur in
    // trained weights; when they do, every chunk is checked).
    let nan_free = ENC != FP8 || codes_nan_free || codes.iter().all(|row| !fp8_has_nan(&row[..len & !15]));
    // Scale block of the current chunk and the columns left in it; blocks are
    // multiples of 16 wide, so a chunk never straddles two.
    let block = if ENC == BF16 { usize::MAX } else { scales[0].block };
    let mut index = k0 / block;
    let mut c = 0;
    while c + 16 <= len {
        let stop = if ENC == BF16 { len & !15 } else { (c + block - (k0 + c) % block).min(len & !15) };
        // FP8 rows that share the block's scale (every row of a tile, in the
        // published 128×128 and 32×32 blocks) can move it onto x instead: one
        // multiply per x row rather than per weight row (see `scale_on_x`).
        let x_factor = match ENC {
            FP8 if nan_free => shared_scale(scales, index).and_then(|scale| scale_on_x(scale, x_abs_max)),
            _ => None,
        };
        if let Some(x_factor) = x_factor {
            let x_factor = _mm512_set1_ps(x_factor);
            while c < stop {
                prefetch_ahead(ahead, c / 16 * chunk_bytes);
                let mut wv = [_mm512_setzero_ps(); NR];
                for (j, v) in wv.iter_mut().enumerate() {
                    *v = fp8_bits16_finite(codes[j].as_ptr().add(c));
                }
                for (ai, x) in a.iter_mut().zip(xs) {
                    let xv = _mm512_mul_ps(_mm512_loadu_ps(x.as_ptr().add(c)), x_factor);
                    for (aij, w) in ai.iter_mut().zip(&wv) {
                        *aij = _mm512_fmadd_ps(xv, *w, *aij);
                    }
                }
                c += 16;
            }
            index += 1;
            continue;
        }
        // Per row of the tile, what turns this block's codes into values: the
        // FP4 table times the block's scale (a power of two, so every entry is
        // exact), or the FP8 scale times 2^120 (exact too, and folds the
        // decode's own power of two into the one multiply).
        let mut factor = [_mm512_setzero_ps(); NR];
        let mut folded = true;
        for (j, f) in factor.iter_mut().enumerate() {
            let scale = if ENC == BF16 { 1.0 } else { scales[j].row[index] };
            *f = match ENC {
                FP8 => {
                    folded &= scale.abs() < FOLDABLE_SCALE_MAX;
                    _mm512_set1_ps(scale)
                }
                FP4 => _mm512_mul_ps(fp4_table, _mm512_set1_ps(scale)),
                _ => _mm512_setzero_ps(),
            };
        }
        if ENC == FP8 && folded {
            factor.iter_mut().for_each(|f| *f = _mm512_mul_ps(*f, _mm512_set1_ps(POW2_120)));
        }
        while c < stop {
            prefetch_ahead(ahead, c / 16 * chunk_bytes);
            let mut wv = [_mm512_setzero_ps(); NR];
            for (j, v) in wv.iter_mut().enumerate() {
                let p = codes[j].as_ptr();
                *v = match ENC {
                    BF16 => bf16_decode16(p.add(2 * c)),
                    FP8 if folded && nan_free => _mm512_mul_ps(fp8_bits16_finite(p.add(c)), factor[j]),
                    FP8 if folded => _mm512_mul_ps(fp8_bits16(p.add(c)), factor[j]),
                    FP8 => _mm512_mul_ps(fp8_decode16(p.add(c)), factor[j]),
                    _ if VBMI => fp4_lookup16_vbmi(p.add(c / 2), factor[j]),
                    _ => fp4_lookup16(p.add(c / 2), factor[j]),
                };
            }
            for (ai, x) in a.iter_mut().zip(xs) {
                let xv = _mm512_loadu_ps(x.as_ptr().add(c));
                for (aij, w) in ai.iter_mut().zip(&wv) {
                    *aij = _mm512_fmadd_ps(xv, *w, *aij);
                }
            }
            c += 16;
        }
        index += 1;
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

/// Prefetches the rows computed next at byte `offset`, once per cache line.
///
/// # Safety
/// `offset` is inside every row of `ahead`.
#[inline(always)]
unsafe fn prefetch_ahead(ahead: &[&[u8]], offset: usize) {
    if offset.is_multiple_of(64) {
        for row in ahead {
            _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().add(offset).cast());
        }
    }
}

/// The scale of block `index` when every row of the tile has the same one.
#[inline(always)]
fn shared_scale<const NR: usize>(scales: &[ScaleRow; NR], index: usize) -> Option<f32> {
    let first = scales[0].row[index];
    scales.iter().all(|s| s.row[index].to_bits() == first.to_bits()).then_some(first)
}

/// The factor that moves an FP8 block's `scale` (and the decode's 2^120) onto
/// x, if that changes no bit: `fma(x · f, bits, acc)` equals
/// `fma(x, bits · f, acc)` when `x · f` is exact, which holds when `f` is a
/// power of two at least 1 and no `|x| · f` overflows (UE8M0 scales are
/// powers of two). The product `x · bits` is exact in the FMA either way.
#[inline(always)]
pub(super) fn scale_on_x(scale: f32, x_abs_max: f32) -> Option<f32> {
    let exponent = (scale.to_bits() >> 23) & 0xff;
    let power_of_two = scale.to_bits() & 0x7f_ffff == 0;
    // Biased exponent 7 is 2^-120; below `FOLDABLE_SCALE_MAX` the factor is finite.
    let in_range = (7..254).contains(&exponent) && scale.abs() < FOLDABLE_SCALE_MAX;
    let factor = scale * POW2_120;
    let no_overflow = (x_abs_max as f64) * (factor.abs() as f64) < f32::MAX as f64;
    (power_of_two && in_range && no_overflow).then_some(factor)
}

/// bf16 bits `p[..32]` (little-endian) to 16 f32 values.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 32 readable bytes.
#[inline(always)]
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

/// FP8 e4m3 codes `p[..16]` as f32 bits worth value · 2^-120 (sign, then the
/// magnitude under the exponent field; normals and subnormals alike), with the
/// two NaN codes already NaN.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 16 readable bytes.
#[inline(always)]
unsafe fn fp8_bits16(p: *const u8) -> __m512 {
    let code = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
    let v = fp8_bits16_finite(p);
    let bits = _mm512_castps_si512(v);
    // 0x7f and 0xff are NaN; take the table's exact bits for them (a NaN stays
    // NaN, with its payload, through the scale multiply).
    let mag = _mm512_set1_epi32(0x07f0_0000);
    let nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, mag), mag);
    if nan == 0 {
        return v;
    }
    let positive = _mm512_cmpge_epi32_mask(code, _mm512_setzero_si512());
    let v = _mm512_mask_mov_ps(v, nan & positive, _mm512_set1_ps(FP8_E4M3_TO_F32[0x7f]));
    _mm512_mask_mov_ps(v, nan & !positive, _mm512_set1_ps(FP8_E4M3_TO_F32[0xff]))
}

/// [`fp8_bits16`] for codes known not to be NaN.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 16 readable bytes.
#[inline(always)]
pub(super) unsafe fn fp8_bits16_finite(p: *const u8) -> __m512 {
    // Sign-extended codes shifted by 20: bits 31..27 all hold the sign, the
    // magnitude lands on bits 26..20; the mask keeps one sign bit.
    let code = _mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()));
    let bits = _mm512_and_si512(_mm512_slli_epi32::<20>(code), _mm512_set1_epi32(0x87f0_0000u32 as i32));
    _mm512_castsi512_ps(bits)
}

/// Whether any of `codes` is an FP8 e4m3 NaN (0x7f or 0xff).
///
/// # Safety
/// The CPU must support AVX-512F and AVX-512BW.
#[inline(always)]
unsafe fn fp8_has_nan(codes: &[u8]) -> bool {
    let (high, ones) = (_mm512_set1_epi8(0x80u8 as i8), _mm512_set1_epi8(-1));
    let p = codes.as_ptr();
    let mut found: __mmask64 = 0;
    let mut c = 0;
    while c + 64 <= codes.len() {
        let v = _mm512_loadu_si512(p.add(c).cast());
        found |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(v, high), ones);
        c += 64;
    }
    if c < codes.len() {
        // Masked-off bytes read as zero, which is not NaN.
        let v = _mm512_maskz_loadu_epi8(u64::MAX >> (64 - (codes.len() - c)), p.add(c).cast());
        found |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(v, high), ones);
    }
    found != 0
}

/// FP8 e4m3 codes `p[..16]` to f32, bit-identical to `FP8_E4M3_TO_F32`.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 16 readable bytes.
#[inline(always)]
unsafe fn fp8_decode16(p: *const u8) -> __m512 {
    // The power-of-two multiply is exact, and keeps a NaN a NaN.
    _mm512_mul_ps(fp8_bits16(p), _mm512_set1_ps(POW2_120))
}

/// FP4 e2m1 pairs `p[..8]` (columns in nibble order) looked up in `table`
/// (16 entries, one per code).
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 8 readable bytes.
#[inline(always)]
unsafe fn fp4_lookup16(p: *const u8, table: __m512) -> __m512 {
    let low4 = _mm_set1_epi8(0x0f);
    let bytes = _mm_loadl_epi64(p.cast());
    // Interleave low and high nibbles into column order.
    let lo = _mm_and_si128(bytes, low4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), low4);
    let idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    _mm512_permutexvar_ps(idx, table)
}

/// [`fp4_lookup16`] without unpacking: the 8 bytes broadcast to every
/// quadword, and `vpmultishiftqb` moves nibble `l` to the low bits of lane
/// `l` (the table lookup reads only those four bits).
///
/// # Safety
/// The CPU must support AVX-512F and VBMI, and `p` must point at 8 readable bytes.
#[inline(always)]
unsafe fn fp4_lookup16_vbmi(p: *const u8, table: __m512) -> __m512 {
    // Quadword q holds lanes 2q (nibble at bit 8q) and 2q + 1 (bit 8q + 4).
    let shifts = _mm512_set_epi64(
        (60 << 32) | 56,
        (52 << 32) | 48,
        (44 << 32) | 40,
        (36 << 32) | 32,
        (28 << 32) | 24,
        (20 << 32) | 16,
        (12 << 32) | 8,
        4 << 32,
    );
    let packed = _mm512_set1_epi64(p.cast::<i64>().read_unaligned());
    _mm512_permutexvar_ps(_mm512_multishift_epi64_epi8(shifts, packed), table)
}

/// FP4 e2m1 pairs `p[..8]` (columns in nibble order) to 16 f32 values.
///
/// # Safety
/// The CPU must support AVX-512F and `p` must point at 8 readable bytes.
#[inline(always)]
unsafe fn fp4_decode16(p: *const u8) -> __m512 {
    fp4_lookup16(p, _mm512_loadu_ps(FP4_E2M1_VALUES.as_ptr()))
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
