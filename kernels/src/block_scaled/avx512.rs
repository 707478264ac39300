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
        let valid = self.w.len().saturating_sub(first).min(16);
        let mask: __mmask16 = ((1u32 << valid) - 1) as u16;
        let a = _mm512_loadu_ps(self.a[row].as_ptr().add(first));
        let w = _mm512_maskz_loadu_ps(mask, self.w.as_ptr().add(first));
        _mm512_mul_ps(_mm512_mul_ps(sums, a), w)
    }
}

/// `sums` (blocks `first..first + 8` of one x row) times the x row's and the
/// weight's block scales, in the definition's order; blocks past the end
/// are multiplied by zero.
#[inline]
#[target_feature(enable = "avx512f,avx512vl")]
unsafe fn apply8(sums: __m256, a_scales: &[f32], w_scales: &[f32], first: usize) -> __m256 {
    let valid = w_scales.len().saturating_sub(first).min(8);
    let mask: __mmask8 = ((1u32 << valid) - 1) as u8;
    let a = _mm256_loadu_ps(a_scales.as_ptr().add(first));
    let w = _mm256_maskz_loadu_ps(mask, w_scales.as_ptr().add(first));
    _mm256_mul_ps(_mm256_mul_ps(sums, a), w)
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

/// Rounded block sums of one FP8 row (`codes`, no NaN) with one x row's
/// values in f64, times 2^1000, times both block scales, into `sums`: eight
/// blocks at a time (leftover blocks one by one). Two or more x rows take
/// the wide tiles, which decode a column once for all of them.
///
/// # Safety
/// The CPU must support AVX-512F and VL; `wide` holds `codes.len()` values,
/// `a_scales` and `w_scales` the blocks, `sums` the blocks rounded up to 16.
#[target_feature(enable = "avx512f,avx512vl")]
pub(super) unsafe fn fp8_block_sums(codes: &[u8], wide: &[f64], a_scales: &[f32], w_scales: &[f32], sums: &mut [f32]) {
    const NB: usize = 8;
    let cols = codes.len();
    let blocks = cols / ACT_BLOCK;
    assert!(wide.len() == cols && sums.len() >= blocks.next_multiple_of(16), "wide row and sums");
    assert!(a_scales.len() >= blocks && w_scales.len() == blocks, "scales");
    let restore = _mm512_set1_pd(RESTORE);
    let whole = blocks / NB * NB;
    for first in (0..whole).step_by(NB) {
        // The weight's rows follow one another: one stream, fetched ahead.
        crate::simd::fetch_ahead(codes.as_ptr().wrapping_add(first * ACT_BLOCK), NB * ACT_BLOCK / 64);
        // Blocks side by side: each block's four FMAs depend on each other,
        // the blocks do not, so the chains hide the FMA latency.
        let mut acc = [_mm512_setzero_pd(); NB];
        for part in 0..4 {
            for (b, acc) in acc.iter_mut().enumerate() {
                let c = (first + b) * ACT_BLOCK + 8 * part;
                *acc = _mm512_fmadd_pd(_mm512_loadu_pd(wide.as_ptr().add(c)), fp8_decode8(codes.as_ptr().add(c)), *acc);
            }
        }
        let exact = _mm512_mul_pd(reduce8(&acc), restore);
        _mm256_storeu_ps(sums.as_mut_ptr().add(first), apply8(_mm512_cvtpd_ps(exact), a_scales, w_scales, first));
    }
    for b in whole..blocks {
        let mut acc = _mm512_setzero_pd();
        for part in 0..4 {
            let c = b * ACT_BLOCK + 8 * part;
            acc = _mm512_fmadd_pd(_mm512_loadu_pd(wide.as_ptr().add(c)), fp8_decode8(codes.as_ptr().add(c)), acc);
        }
        let sum = (_mm512_reduce_add_pd(acc) * RESTORE) as f32;
        sums[b] = sum * a_scales[b] * w_scales[b];
    }
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

/// The lane sums of eight f64 vectors (the first eight of `v`), vector `k` in lane `k`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn reduce8(v: &[__m512d]) -> __m512d {
    assert!(v.len() >= 8);
    // Halves: lanes 0..4 of w[k] are v[2k]'s partial sums, lanes 4..8 v[2k + 1]'s.
    let w: [__m512d; 4] = std::array::from_fn(|k| {
        let (a, b) = (v[2 * k], v[2 * k + 1]);
        _mm512_add_pd(_mm512_shuffle_f64x2::<0x44>(a, b), _mm512_shuffle_f64x2::<0xee>(a, b))
    });
    // Quarters: 128-bit lane q of x[k] holds vector 4k + q's two partial sums.
    let x: [__m512d; 2] = std::array::from_fn(|k| {
        let (a, b) = (w[2 * k], w[2 * k + 1]);
        _mm512_add_pd(_mm512_shuffle_f64x2::<0x88>(a, b), _mm512_shuffle_f64x2::<0xdd>(a, b))
    });
    // Pairs: lane 2q + h holds vector 4h + q.
    let y = _mm512_add_pd(_mm512_unpacklo_pd(x[0], x[1]), _mm512_unpackhi_pd(x[0], x[1]));
    _mm512_permutexvar_pd(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), y)
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
