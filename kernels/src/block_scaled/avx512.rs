//! AVX-512 block sums: FP4 by `vpdpbusd` (VNNI), FP8 in f64 lanes. The sums
//! are exact, so the order in which lanes are added is free.

use std::arch::x86_64::*;

use super::{FP4_OFFSET_BYTES, GROUP_COLS, GROUP_DIGIT_BYTES};
use crate::act_quant::ACT_BLOCK;

/// Rounded block sums of one FP4 row (`codes`: `cols / 2` bytes) with each x
/// row's digits, minus its offsets, times both block scales: row `i` at
/// `sums[i * stride..]`, 16 blocks (four groups) at a time.
///
/// # Safety
/// The CPU must support AVX-512F, BW and VNNI; each `digits[i]` holds
/// `ceil(cols / 128)` groups rounded up to 4, each `offsets[i]`, each
/// `a_scales[i]` and each row of `sums` (with `stride`) the blocks rounded up
/// to 16, `w_scales` the blocks; at most 4 rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn fp4_block_sums(
    codes: &[u8],
    digits: &[Vec<i8>],
    offsets: &[Vec<i32>],
    a_scales: &[Vec<f32>],
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    let scales = BlockScales { a: a_scales, w: w_scales };
    match digits.len() {
        1 => fp4_rows::<1>(codes, digits, offsets, &scales, sums, stride),
        2 => fp4_rows::<2>(codes, digits, offsets, &scales, sums, stride),
        3 => fp4_rows::<3>(codes, digits, offsets, &scales, sums, stride),
        4 => fp4_rows::<4>(codes, digits, offsets, &scales, sums, stride),
        m => unreachable!("{m} rows at once"),
    }
}

/// The scalar `group_digits` of `values` (e4m3 values: `A = a · 2^9` is whole)
/// and `12 · Σ A` per block, padded to whole vectors, 32 columns at a time:
/// the same digits and offsets as the scalar steps.
///
/// # Safety
/// The CPU must support AVX-512F and BW; `values.len()` is a multiple of 32.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn fp4_digits(values: &[f32]) -> (Vec<i8>, Vec<i32>) {
    let cols = values.len();
    assert!(cols.is_multiple_of(ACT_BLOCK), "whole blocks");
    let groups = cols.div_ceil(GROUP_COLS).next_multiple_of(4);
    let mut digits = vec![0i8; groups * GROUP_DIGIT_BYTES];
    let mut offsets = vec![0i32; (cols / ACT_BLOCK).next_multiple_of(16)];
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let (bias, byte) = (_mm512_set1_epi32(128), _mm512_set1_epi32(255));
    // `a = d + 2^8 · rest` with `d` in -128..128.
    let split = |a: __m512i| {
        let d = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(a, bias), byte), bias);
        (d, _mm512_srai_epi32::<8>(_mm512_sub_epi32(a, d)))
    };
    for (b, block) in values.chunks_exact(ACT_BLOCK).enumerate() {
        let whole = |h: usize| {
            _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_loadu_ps(block.as_ptr().add(16 * h)), _mm512_set1_ps(512.0)))
        };
        let (first, second) = (whole(0), whole(1));
        offsets[b] = super::FP4_BYTE_OFFSET * _mm512_reduce_add_epi32(_mm512_add_epi32(first, second));
        let (c, g) = (b * ACT_BLOCK, b * ACT_BLOCK / GROUP_COLS);
        let at = g * GROUP_DIGIT_BYTES + (c % GROUP_COLS) / 2;
        for (half, index) in [even, odd].into_iter().enumerate() {
            let (d0, rest) = split(_mm512_permutex2var_epi32(first, index, second));
            let (d1, d2) = split(rest);
            for (k, d) in [d0, d1, d2].into_iter().enumerate() {
                let out = digits.as_mut_ptr().add(at + (2 * k + half) * 64);
                _mm_storeu_si128(out.cast(), _mm512_cvtepi32_epi8(d));
            }
        }
    }
    (digits, offsets)
}

/// Each x row's block scales (padded to whole vectors) and the weight row's.
struct BlockScales<'a> {
    a: &'a [Vec<f32>],
    w: &'a [f32],
}

impl BlockScales<'_> {
    /// `sums` (blocks `first..first + 16`, x row `row`) times the x row's and
    /// the weight's scales, in the definition's order; blocks past the end
    /// are multiplied by zero.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn apply16(&self, sums: __m512, row: usize, first: usize) -> __m512 {
        apply16(sums, &self.a[row], self.w, first)
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn fp4_rows<const M: usize>(
    codes: &[u8],
    digits: &[Vec<i8>],
    offsets: &[Vec<i32>],
    scales: &BlockScales,
    sums: &mut [f32],
    stride: usize,
) {
    let cols = codes.len() * 2;
    let groups = cols.div_ceil(GROUP_COLS);
    let blocks = cols / ACT_BLOCK;
    assert!(digits.iter().all(|d| d.len() >= groups.next_multiple_of(4) * GROUP_DIGIT_BYTES), "digits");
    let padded = blocks.next_multiple_of(16);
    assert!(offsets.iter().all(|o| o.len() >= padded) && sums.len() >= (M - 1) * stride + padded, "sums");
    assert!(scales.a.iter().all(|a| a.len() >= padded) && scales.w.len() == blocks, "scales");
    let table = _mm512_broadcast_i32x4(_mm_loadu_si128(FP4_OFFSET_BYTES.as_ptr().cast()));
    let nibble = _mm512_set1_epi8(0x0f);
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let scale = _mm512_set1_ps(1.0 / 1024.0);
    for first in (0..groups).step_by(4) {
        // The weight's rows follow one another: one stream, fetched ahead.
        crate::simd::fetch_ahead(codes.as_ptr().wrapping_add(first * 64), 4);
        // Per x row, four groups' lanes: lanes 4b..4b + 4 of a group hold its block b.
        let mut lanes = [[_mm512_setzero_si512(); 4]; M];
        for q in 0..4 {
            // Groups past the end load no codes and meet zero digits.
            let g = first + q;
            let bytes = codes.len().saturating_sub(g * 64).min(64);
            let mask: __mmask64 = if bytes == 64 { !0 } else { (1u64 << bytes) - 1 };
            let packed = _mm512_maskz_loadu_epi8(mask, codes.as_ptr().add(g * 64).cast());
            let low = _mm512_shuffle_epi8(table, _mm512_and_si512(packed, nibble));
            let high = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(packed), nibble));
            for (row, lane) in lanes.iter_mut().enumerate() {
                let d = digits[row].as_ptr().add(g * GROUP_DIGIT_BYTES);
                let digit = |k: usize| _mm512_loadu_si512(d.add(k * 64).cast());
                let zero = _mm512_setzero_si512();
                let d0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, digit(0)), high, digit(1));
                let d1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, digit(2)), high, digit(3));
                let d2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, digit(4)), high, digit(5));
                let shifted = _mm512_add_epi32(_mm512_slli_epi32::<8>(d1), _mm512_slli_epi32::<16>(d2));
                lane[q] = _mm512_add_epi32(d0, shifted);
            }
        }
        for (row, lane) in lanes.iter().enumerate() {
            // Adjacent lanes added twice: 16 block sums in K order.
            let pairs =
                |a, b| _mm512_add_epi32(_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b));
            let block_sums = pairs(pairs(lane[0], lane[1]), pairs(lane[2], lane[3]));
            let offset = _mm512_loadu_si512(offsets[row].as_ptr().add(first * 4).cast());
            let exact = _mm512_sub_epi32(block_sums, offset);
            // Rounding then scaling by 2^-10 is scaling then rounding.
            let rounded = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale);
            let scaled = scales.apply16(rounded, row, first * 4);
            _mm512_storeu_ps(sums.as_mut_ptr().add(row * stride + first * 4), scaled);
        }
    }
}

/// Columns of one FP8 chunk: one 64-byte load of codes, eight f64 vectors.
const CHUNK_COLS: usize = 64;
/// Chunks summed side by side: eight independent FMA chains, 16 blocks.
const CHUNKS_AT_ONCE: usize = 8;

/// One x row's values in f64 times `scale`, laid out as [`fp8_block_sums_vbmi`]
/// reads them: per 64-column chunk, vector `k` lane `j` holds column
/// `8j + k` (the code `vpmultishiftqb` puts there), zero past the row and
/// up to whole groups of [`CHUNKS_AT_ONCE`] chunks.
pub(super) fn lane_bytes_x(values: &[f32], scale: f64) -> Vec<f64> {
    let padded = values.len().div_ceil(CHUNK_COLS).next_multiple_of(CHUNKS_AT_ONCE) * CHUNK_COLS;
    let mut out = vec![0.0; padded];
    for (c, &v) in values.iter().enumerate() {
        let (chunk, within) = (c / CHUNK_COLS, c % CHUNK_COLS);
        let (lane, byte) = (within / 8, within % 8);
        out[chunk * CHUNK_COLS + byte * 8 + lane] = v as f64 * scale;
    }
    out
}

/// Rounded block sums of one FP8 row (`codes`, no NaN) with one x row in
/// [`lane_bytes_x`]'s layout (times 2^1000), times both block scales, into
/// `sums`: 16 blocks at a time. Two or more x rows take the wide tiles,
/// which decode a column once for all of them.
///
/// A chunk's 64 codes are loaded once; `vpmultishiftqb` moves byte `k` of
/// every quadword under the f64 exponent and a mask keeps its bits, two
/// operations for eight weights. Lanes 0..4 of a chunk's sums are its first
/// block's, lanes 4..8 its second's.
///
/// # Safety
/// The CPU must support AVX-512F, VL, BW and VBMI; `x` holds [`lane_bytes_x`]'s
/// padded row for `codes.len()` columns, `a_scales` and `sums` the blocks
/// rounded up to 16, `w_scales` the blocks.
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512vbmi")]
pub(super) unsafe fn fp8_block_sums_vbmi(
    codes: &[u8],
    x: &[f64],
    a_scales: &[f32],
    w_scales: &[f32],
    sums: &mut [f32],
) {
    fp8_block_sums::<true>(codes, x, a_scales, w_scales, sums)
}

/// [`fp8_block_sums_vbmi`] without VBMI: each byte is shifted into place
/// and back with its sign (three operations for eight weights).
///
/// # Safety
/// The CPU must support AVX-512F, VL and BW; the slices as for [`fp8_block_sums_vbmi`].
#[target_feature(enable = "avx512f,avx512vl,avx512bw")]
pub(super) unsafe fn fp8_block_sums_shifts(
    codes: &[u8],
    x: &[f64],
    a_scales: &[f32],
    w_scales: &[f32],
    sums: &mut [f32],
) {
    fp8_block_sums::<false>(codes, x, a_scales, w_scales, sums)
}

#[inline(always)]
unsafe fn fp8_block_sums<const VBMI: bool>(
    codes: &[u8],
    x: &[f64],
    a_scales: &[f32],
    w_scales: &[f32],
    sums: &mut [f32],
) {
    let cols = codes.len();
    let blocks = cols / ACT_BLOCK;
    let groups = cols.div_ceil(CHUNK_COLS).div_ceil(CHUNKS_AT_ONCE);
    assert!(x.len() == groups * CHUNKS_AT_ONCE * CHUNK_COLS, "x in lane-byte layout");
    assert!(sums.len() >= blocks.next_multiple_of(16) && a_scales.len() >= blocks.next_multiple_of(16), "sums");
    assert!(w_scales.len() == blocks, "weight scales");
    let restore = _mm512_set1_pd(RESTORE);
    let control = multishift_controls();
    // Blocks come out of `reduce_chunks` as 0, 2, 1, 3, …; this swaps them back.
    let order = _mm512_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for group in 0..groups {
        let first = group * CHUNKS_AT_ONCE;
        crate::simd::fetch_ahead(codes.as_ptr().wrapping_add(first * CHUNK_COLS), CHUNKS_AT_ONCE);
        let packed: [__m512i; CHUNKS_AT_ONCE] = std::array::from_fn(|i| {
            let start = (first + i) * CHUNK_COLS;
            let bytes = cols.saturating_sub(start).min(CHUNK_COLS);
            if bytes == CHUNK_COLS {
                _mm512_loadu_si512(codes.as_ptr().add(start).cast())
            } else {
                // Columns past the row meet zeros in x; no code is read there.
                let mask: __mmask64 = (1u64 << bytes) - 1;
                _mm512_maskz_loadu_epi8(mask, codes.as_ptr().wrapping_add(start).cast())
            }
        });
        let mut acc = [_mm512_setzero_pd(); CHUNKS_AT_ONCE];
        // Byte by byte across the chunks: eight independent chains in flight.
        for (k, control) in control.iter().enumerate() {
            for (i, acc) in acc.iter_mut().enumerate() {
                let weights = if VBMI { lane_byte_vbmi(packed[i], *control) } else { lane_byte_shifts(packed[i], k) };
                let xs = _mm512_loadu_pd(x.as_ptr().add((first + i) * CHUNK_COLS + 8 * k));
                *acc = _mm512_fmadd_pd(xs, weights, *acc);
            }
        }
        let low = _mm512_cvtpd_ps(_mm512_mul_pd(reduce_chunks(&acc[..4]), restore));
        let high = _mm512_cvtpd_ps(_mm512_mul_pd(reduce_chunks(&acc[4..]), restore));
        let rounded = _mm512_permutexvar_ps(order, join_halves(low, high));
        let scaled = apply16(rounded, a_scales, w_scales, 2 * first);
        _mm512_storeu_ps(sums.as_mut_ptr().add(2 * first), scaled);
    }
}

/// For byte `k` of a quadword (0..8), the `vpmultishiftqb` control that
/// puts bits `8k - 1..8k + 7` under byte 6 (the lowest is masked off) and
/// bits `8k..8k + 8` under byte 7: the code's magnitude at bits 49..56, its
/// sign at 63, as [`fp8_decode8`] places them.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn multishift_controls() -> [__m512i; 8] {
    std::array::from_fn(|k| _mm512_set1_epi64((((8 * k) as i64) << 56) | ((((8 * k + 63) % 64) as i64) << 48)))
}

/// The e4m3 codes at one byte of every quadword of `packed`, decoded to
/// f64 times 2^-1016 (as [`fp8_decode8`]) by `control` from
/// [`multishift_controls`] and a mask: two operations for eight weights.
#[inline]
#[target_feature(enable = "avx512f,avx512vbmi")]
pub(crate) unsafe fn lane_byte_vbmi(packed: __m512i, control: __m512i) -> __m512d {
    let bits = _mm512_and_si512(_mm512_multishift_epi64_epi8(control, packed), _mm512_set1_epi64(FP8_F64_BITS));
    _mm512_castsi512_pd(bits)
}

/// [`lane_byte_vbmi`] for byte `k` (0..8) by shifts, on AVX-512F alone.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn lane_byte_shifts(packed: __m512i, k: usize) -> __m512d {
    match k {
        0 => fp8_lane_byte::<56>(packed),
        1 => fp8_lane_byte::<48>(packed),
        2 => fp8_lane_byte::<40>(packed),
        3 => fp8_lane_byte::<32>(packed),
        4 => fp8_lane_byte::<24>(packed),
        5 => fp8_lane_byte::<16>(packed),
        6 => fp8_lane_byte::<8>(packed),
        _ => fp8_lane_byte::<0>(packed),
    }
}

/// `low` in lanes 0..8, `high` in lanes 8..16 (AVX-512F alone).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn join_halves(low: __m256, high: __m256) -> __m512 {
    let low = _mm512_castsi256_si512(_mm256_castps_si256(low));
    _mm512_castsi512_ps(_mm512_inserti64x4::<1>(low, _mm256_castps_si256(high)))
}

/// The eight block sums of four chunks' lanes (`acc[i]`: lanes 0..4 block
/// `2i`, lanes 4..8 block `2i + 1`), as blocks 0, 2, 1, 3, 4, 6, 5, 7.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn reduce_chunks(acc: &[__m512d]) -> __m512d {
    assert!(acc.len() == 4);
    // Adjacent lanes: s[m] = a01, b01, a23, b23, a45, b45, a67, b67 for a, b = acc[2m], acc[2m + 1].
    let s: [__m512d; 2] = std::array::from_fn(|m| {
        let (a, b) = (acc[2 * m], acc[2 * m + 1]);
        _mm512_add_pd(_mm512_unpacklo_pd(a, b), _mm512_unpackhi_pd(a, b))
    });
    // 128-bit lanes 0 + 1 and 2 + 3 of each: a block's four lanes.
    _mm512_add_pd(_mm512_shuffle_f64x2::<0x88>(s[0], s[1]), _mm512_shuffle_f64x2::<0xdd>(s[0], s[1]))
}

/// `sums` (blocks `first..first + 16`) times the x row's and the weight's
/// block scales, in the definition's order; blocks past the end are
/// multiplied by zero.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn apply16(sums: __m512, a_scales: &[f32], w_scales: &[f32], first: usize) -> __m512 {
    let valid = w_scales.len().saturating_sub(first).min(16);
    let mask: __mmask16 = ((1u32 << valid) - 1) as u16;
    let a = _mm512_loadu_ps(a_scales.as_ptr().add(first));
    let w = _mm512_maskz_loadu_ps(mask, w_scales.as_ptr().add(first));
    _mm512_mul_ps(_mm512_mul_ps(sums, a), w)
}

/// The weights decode as value · 2^-1016 and the activations arrive as value
/// · 2^1000 ([`super::WIDE_SCALE`]): their products are the true ones times
/// 2^-16, normal and exact; this restores them.
pub(super) const RESTORE: f64 = 65536.0;

/// Rows [`transpose_block`] reads at once: the f64 lanes of one vector.
const TILE_ROWS: usize = 8;

/// The 32 codes at column `c` of eight rows, as four vectors of eight
/// quadwords: quadword `i` of vector `g` is row `i`'s codes `c + 8g..`.
///
/// # Safety
/// AVX-512F; every row holds 32 bytes from `c`.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_block(rows: &[*const u8; TILE_ROWS], c: usize) -> [__m512i; 4] {
    let load = |i: usize| _mm256_loadu_si256(rows[i].add(c).cast());
    // Rows k and k + 4 side by side, then quadwords paired across rows.
    let z: [__m512i; 4] =
        std::array::from_fn(|k| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load(k)), load(k + 4)));
    let (t0, t1) = (_mm512_unpacklo_epi64(z[0], z[1]), _mm512_unpackhi_epi64(z[0], z[1]));
    let (t2, t3) = (_mm512_unpacklo_epi64(z[2], z[3]), _mm512_unpackhi_epi64(z[2], z[3]));
    let low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    let high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    [
        _mm512_permutex2var_epi64(t0, low, t2),
        _mm512_permutex2var_epi64(t1, low, t3),
        _mm512_permutex2var_epi64(t0, high, t2),
        _mm512_permutex2var_epi64(t1, high, t3),
    ]
}

/// The f64 bits an e4m3 code keeps once shifted under the exponent: the
/// sign, and its seven magnitude bits at 49..56.
const FP8_F64_BITS: i64 = 0x80fe_0000_0000_0000u64 as i64;

/// Byte `(56 - SHL) / 8` of every lane of `packed` as an e4m3 code decoded to
/// f64 times 2^-1016, as [`fp8_decode8`] does: shifted to the top of its
/// lane, then down by 7 with its sign, masked to the sign and the magnitude.
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fp8_lane_byte<const SHL: u32>(packed: __m512i) -> __m512d {
    let top = _mm512_slli_epi64::<SHL>(packed);
    let bits = _mm512_and_si512(_mm512_srai_epi64::<7>(top), _mm512_set1_epi64(FP8_F64_BITS));
    _mm512_castsi512_pd(bits)
}

/// Eight e4m3 codes (no NaN) at `p` as f64 values times 2^-1016: the
/// sign-extended codes shifted by 49 put the magnitude under the f64 exponent
/// and mantissa (exponent field 0, e4m3's subnormals, reads as an f64
/// subnormal of the same value); the mask keeps one sign bit. Exact.
///
/// # Safety
/// The CPU must support AVX-512F; `p` points at 8 readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fp8_decode8(p: *const u8) -> __m512d {
    let code = _mm512_cvtepi8_epi64(_mm_loadl_epi64(p.cast()));
    let bits = _mm512_and_si512(_mm512_slli_epi64::<49>(code), _mm512_set1_epi64(FP8_F64_BITS));
    _mm512_castsi512_pd(bits)
}

/// See `chain_sums` in the parent: 16 rows of products, each summed in order.
///
/// # Safety
/// The CPU must support AVX-512F; `products` holds 16 rows of `stride`
/// values, `stride` a multiple of 16 and at least `blocks`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn chain_sums(products: &[f32], stride: usize, blocks: usize) -> [f32; 16] {
    let mut acc = _mm512_setzero_ps();
    for b0 in (0..blocks).step_by(16) {
        let rows: [__m512; 16] = std::array::from_fn(|k| _mm512_loadu_ps(products.as_ptr().add(k * stride + b0)));
        let columns = transpose16(&rows);
        for column in &columns[..(blocks - b0).min(16)] {
            acc = _mm512_add_ps(acc, *column);
        }
    }
    let mut out = [0.0f32; 16];
    _mm512_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// A 16 × 16 transpose: lane `k` of `columns[c]` is lane `c` of `rows[k]`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved: a[2i] and a[2i + 1] per 128-bit lane L hold
    // rows 2i, 2i + 1 at columns 4L, 4L + 1 and 4L + 2, 4L + 3.
    let a: [__m512; 16] = std::array::from_fn(|x| {
        let (i, high) = (x / 2, x % 2 == 1);
        let (p, q) = (r[2 * i], r[2 * i + 1]);
        if high {
            _mm512_unpackhi_ps(p, q)
        } else {
            _mm512_unpacklo_ps(p, q)
        }
    });
    // b[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i + 4.
    let b: [__m512; 16] = std::array::from_fn(|x| {
        let (i, c) = (x / 4, x % 4);
        let (p, q) = (a[4 * i + c / 2], a[4 * i + 2 + c / 2]);
        if c % 2 == 0 {
            _mm512_shuffle_ps::<0x44>(p, q)
        } else {
            _mm512_shuffle_ps::<0xee>(p, q)
        }
    });
    // Gather lane L of b[c], b[4 + c], b[8 + c], b[12 + c]: column 4L + c.
    let mut columns = [_mm512_setzero_ps(); 16];
    for c in 0..4 {
        let d0 = _mm512_shuffle_f32x4::<0x88>(b[c], b[4 + c]);
        let d1 = _mm512_shuffle_f32x4::<0xdd>(b[c], b[4 + c]);
        let e0 = _mm512_shuffle_f32x4::<0x88>(b[8 + c], b[12 + c]);
        let e1 = _mm512_shuffle_f32x4::<0xdd>(b[8 + c], b[12 + c]);
        columns[c] = _mm512_shuffle_f32x4::<0x88>(d0, e0);
        columns[8 + c] = _mm512_shuffle_f32x4::<0xdd>(d0, e0);
        columns[4 + c] = _mm512_shuffle_f32x4::<0x88>(d1, e1);
        columns[12 + c] = _mm512_shuffle_f32x4::<0xdd>(d1, e1);
    }
    columns
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector digits and offsets are the scalar steps' for every e4m3
    /// value, in whole and partial groups of columns.
    #[test]
    fn fp4_digits_are_the_scalar_ones() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            return;
        }
        let every: Vec<f32> = (0..=255u8).filter(|&c| c & 0x7f != 0x7f).map(crate::dtype::fp8_e4m3_to_f32).collect();
        for cols in [32, 96, 128, 160, 512, 2080] {
            let values: Vec<f32> = (0..cols).map(|c| every[(c * 37 + cols) % every.len()]).collect();
            let ints: Vec<i32> = values.iter().map(|&v| (v * 512.0) as i32).collect();
            let mut offsets: Vec<i32> =
                ints.chunks_exact(ACT_BLOCK).map(|b| super::super::FP4_BYTE_OFFSET * b.iter().sum::<i32>()).collect();
            offsets.resize((cols / ACT_BLOCK).next_multiple_of(16), 0);
            // SAFETY: the features were checked; `cols` is whole blocks.
            let got = unsafe { fp4_digits(&values) };
            assert_eq!(got, (super::super::group_digits(&ints, cols), offsets), "{cols} columns");
        }
    }

    /// Every code at every byte of a quadword decodes to the same bits by
    /// `vpmultishiftqb` and by shifts, and both to [`fp8_decode8`]'s.
    #[test]
    fn lane_byte_decodes_agree() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vbmi")) {
            return;
        }
        for code in 0..=255u8 {
            // The code at byte `k` of lane `k`, its neighbours all ones to
            // catch a stray bit.
            let mut bytes = [0xffu8; 64];
            (0..8).for_each(|k| bytes[8 * k + k] = code);
            // SAFETY: the features were checked; every pointer covers its reads.
            let (by_multishift, by_shifts, reference) = unsafe {
                let packed = _mm512_loadu_si512(bytes.as_ptr().cast());
                let control = multishift_controls();
                let lanes = |v: __m512d| {
                    let mut out = [0u64; 8];
                    _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_castpd_si512(v));
                    out
                };
                let pick = |f: &dyn Fn(usize) -> __m512d| -> [u64; 8] { std::array::from_fn(|k| lanes(f(k))[k]) };
                (
                    pick(&|k| lane_byte_vbmi(packed, control[k])),
                    pick(&|k| lane_byte_shifts(packed, k)),
                    lanes(fp8_decode8([code; 8].as_ptr()))[0],
                )
            };
            assert_eq!(by_multishift, [reference; 8], "code {code:#04x} by vpmultishiftqb");
            assert_eq!(by_shifts, [reference; 8], "code {code:#04x} by shifts");
        }
    }
}
