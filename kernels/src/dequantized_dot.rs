//! f64 dot products of an activation row with a quantised weight's rows as
//! bf16 values: [`dot_f64_rows`] over `round_bf16(dequantize_row(r))`, without
//! holding those values.
//!
//! A weight that a reference keeps in bf16 while the checkpoint stores it as
//! FP8 (V4.1's grouped output projection) is read as its FP8 codes, a quarter
//! of the f32 values' bytes. On AVX-512 the codes are decoded inside the dot
//! product; the bits are those of the decoded values because every product
//! and sum is the true one times a fixed power of two (see
//! [`WEIGHT_SCALE_EXP`]).

use crate::act_quant::{dot_f64_rows, round_bf16};
use crate::linear::Linear;
#[cfg(target_arch = "x86_64")]
use crate::linear::{Isa, WeightFormat};

/// Rows decoded together on the path that decodes whole rows.
const DECODED_ROWS: usize = 16;
/// The AVX-512 path reads x times the block scale times 2^`X_SCALE_EXP`
/// (exact, far from overflow for any finite f32 times a scale up to
/// 2^[`SCALE_EXP_MAX`]) ...
#[cfg(target_arch = "x86_64")]
const X_SCALE_EXP: i32 = 500;
/// ... and the weights as value times 2^-`WEIGHT_SCALE_EXP` (the e4m3 code's
/// bits placed under the f64 exponent), so every product and partial sum is
/// the true one times 2^-516: normal, and rounded exactly as the true one.
#[cfg(target_arch = "x86_64")]
const WEIGHT_SCALE_EXP: i32 = 1016;
/// Block scales qualify for the AVX-512 path when they are powers of two in
/// this range: an e4m3 value times such a scale is exact in bf16, so the
/// bf16 rounding of the definition changes nothing.
#[cfg(target_arch = "x86_64")]
const SCALE_EXP_MIN: i32 = -100;
#[cfg(target_arch = "x86_64")]
const SCALE_EXP_MAX: i32 = 20;

/// `out[i]` = [`crate::act_quant::dot_f64`] of `x` with row `first + i` of
/// `w` dequantised to f32 and rounded to bf16, for every `i`.
pub fn dot_f64_dequantized_rows(x: &[f32], w: &Linear, first: usize, out: &mut [f64]) {
    assert_eq!(x.len(), w.cols, "dot_f64_dequantized_rows: {} inputs for {} columns", x.len(), w.cols);
    assert!(first + out.len() <= w.rows, "rows {first}..{} of {}", first + out.len(), w.rows);
    if decodes_codes(x, w, first, out.len()) {
        #[cfg(target_arch = "x86_64")]
        fp8_rows_avx512(x, w, first, out);
        return;
    }
    decoded_rows(x, w, first, out);
}

/// Tokens a batch kernel takes at once: eight accumulators, one weight
/// vector decoded for all of them.
#[cfg(target_arch = "x86_64")]
const TOKENS: usize = 8;
/// Columns of a tile: eight tokens' scaled values (32 KiB) stay in L1 while
/// a run of weight rows passes.
#[cfg(target_arch = "x86_64")]
const TILE_COLS: usize = 512;

/// `out[t * rows + i]` = [`dot_f64_dequantized_rows`] of `xs[t]` with row
/// `first + i`, for every `t`: the same bits. Where the codes are read
/// directly and the CPU has VBMI, a weight vector is decoded once for eight
/// tokens instead of once for each (a prefill's tokens through `wo_a`).
pub fn dot_f64_dequantized_tokens(xs: &[&[f32]], w: &Linear, first: usize, rows: usize, out: &mut [f64]) {
    assert_eq!(out.len(), xs.len() * rows, "dot_f64_dequantized_tokens: outputs");
    // The weight qualifies for every token or for none: only the first
    // token's check reads it; the others need only be finite.
    #[cfg(target_arch = "x86_64")]
    if xs.len() > 1
        && is_x86_feature_detected!("avx512vbmi")
        && decodes_codes(xs[0], w, first, rows)
        && xs[1..].iter().all(|x| x.iter().all(|v| v.is_finite()))
    {
        fp8_tokens_avx512(xs, w, first, rows, out);
        return;
    }
    for (x, out) in xs.iter().zip(out.chunks_mut(rows.max(1))) {
        dot_f64_dequantized_rows(x, w, first, out);
    }
}

/// Whether [`dot_f64_dequantized_rows`] reads these rows' codes directly
/// (AVX-512, FP8 without NaN codes, every scale a power of two in range, `x`
/// finite) rather than decoding the rows first. Either gives the same bits.
pub fn decodes_codes(x: &[f32], w: &Linear, first: usize, rows: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(Isa::detect(), Isa::Avx512) {
        return fp8_qualifies(x, w, first, rows);
    }
    let _ = (x, w, first, rows);
    false
}

/// The definition: rows decoded to bf16 values, then [`dot_f64_rows`].
fn decoded_rows(x: &[f32], w: &Linear, first: usize, out: &mut [f64]) {
    let cols = w.cols;
    let mut values = vec![0.0f32; DECODED_ROWS * cols];
    for (k, part) in out.chunks_mut(DECODED_ROWS).enumerate() {
        let values = &mut values[..part.len() * cols];
        for (i, row) in values.chunks_exact_mut(cols.max(1)).enumerate() {
            w.dequantize_row(first + k * DECODED_ROWS + i, row);
            row.iter_mut().for_each(|v| *v = round_bf16(*v));
        }
        dot_f64_rows(x, values, part);
    }
}

/// Whether the decoding path gives the definition's bits here: FP8 codes
/// without NaN, every scale the rows use a power of two in range, `x` finite.
#[cfg(target_arch = "x86_64")]
fn fp8_qualifies(x: &[f32], w: &Linear, first: usize, rows: usize) -> bool {
    let WeightFormat::Fp8 { scales, block_rows, block_cols, nan_free, .. } = &w.format else {
        return false;
    };
    if !nan_free || rows == 0 || !x.iter().all(|v| v.is_finite()) {
        return false;
    }
    let per_row = w.cols.div_ceil(*block_cols);
    let blocks = first / block_rows..(first + rows).div_ceil(*block_rows);
    scales[blocks.start * per_row..blocks.end * per_row].iter().all(|&s| scale_qualifies(s))
}

#[cfg(target_arch = "x86_64")]
fn scale_qualifies(s: f32) -> bool {
    let bits = s.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127;
    bits >> 31 == 0 && bits & 0x7f_ffff == 0 && (SCALE_EXP_MIN..=SCALE_EXP_MAX).contains(&exp)
}

#[cfg(target_arch = "x86_64")]
fn fp8_rows_avx512(x: &[f32], w: &Linear, first: usize, out: &mut [f64]) {
    let WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } = &w.format else {
        unreachable!("checked by fp8_qualifies");
    };
    let (cols, block_rows, block_cols) = (w.cols, *block_rows, *block_cols);
    let per_row = cols.div_ceil(block_cols);
    let whole = cols / 8 * 8;
    let mut scaled_x = vec![0.0f64; whole];
    let vbmi = is_x86_feature_detected!("avx512vbmi");
    let mut r = first;
    while r < first + out.len() {
        // A run of rows sharing one row of block scales: x scaled once for them.
        let block = r / block_rows;
        let end = ((block + 1) * block_rows).min(first + out.len());
        let scale_row = &scales[block * per_row..][..per_row];
        scale_columns(x, 0..whole, scale_row, block_cols, &mut scaled_x);
        let mut finish = |row: usize, lanes: &[f64; 8]| {
            let tail = tail_values(&data[row * cols..][..cols], whole, scale_row, block_cols);
            out[row - first] = crate::act_quant::combine_lanes(lanes, &x[whole..], &tail[..cols - whole]);
        };
        let mut row = r;
        while row < end {
            // SAFETY: `detect` found AVX-512F, and VBMI where it is used; the
            // codes hold the rows asked for, `scaled_x` the whole vectors of columns.
            let rows = if end - row >= 4 { 4 } else { 1 };
            let codes = &data[row * cols..(row + rows) * cols];
            let mut lanes = [[0.0; 8]; 4];
            unsafe {
                match (rows, vbmi) {
                    (4, true) => lanes = avx512::scaled_lanes_vbmi::<4>(&scaled_x, codes, cols),
                    (4, false) => lanes = avx512::scaled_lanes::<4>(&scaled_x, codes, cols),
                    (_, true) => [lanes[0]] = avx512::scaled_lanes_vbmi::<1>(&scaled_x, codes, cols),
                    (_, false) => [lanes[0]] = avx512::scaled_lanes::<1>(&scaled_x, codes, cols),
                }
            }
            lanes[..rows].iter().enumerate().for_each(|(k, lanes)| finish(row + k, lanes));
            row += rows;
        }
        r = end;
    }
}

/// [`dot_f64_dequantized_tokens`] on AVX-512 with VBMI: for each run of rows
/// sharing a row of block scales and each group of [`TOKENS`] tokens, the
/// tokens' scaled values tile by tile, every row's lanes carried from one
/// tile to the next (so each lane still sums its columns in order).
#[cfg(target_arch = "x86_64")]
fn fp8_tokens_avx512(xs: &[&[f32]], w: &Linear, first: usize, rows: usize, out: &mut [f64]) {
    let WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } = &w.format else {
        unreachable!("checked by fp8_qualifies");
    };
    let (cols, block_rows, block_cols) = (w.cols, *block_rows, *block_cols);
    let per_row = cols.div_ceil(block_cols);
    let whole = cols / 8 * 8;
    let restore = 2f64.powi(WEIGHT_SCALE_EXP - X_SCALE_EXP);
    for t0 in (0..xs.len()).step_by(TOKENS) {
        let group = &xs[t0..(t0 + TOKENS).min(xs.len())];
        let m = group.len();
        let mut r = first;
        while r < first + rows {
            let block = r / block_rows;
            let end = ((block + 1) * block_rows).min(first + rows);
            let scale_row = &scales[block * per_row..][..per_row];
            // Tile by tile, token by token: tile `k0` holds `m` runs of its columns.
            let mut scaled = vec![0.0f64; m * whole];
            for k0 in (0..whole).step_by(TILE_COLS) {
                let kc = TILE_COLS.min(whole - k0);
                for (t, x) in group.iter().enumerate() {
                    let at = &mut scaled[m * k0 + t * kc..][..kc];
                    scale_columns(x, k0..k0 + kc, scale_row, block_cols, at);
                }
            }
            let mut lanes = vec![[0.0f64; 8]; (end - r) * m];
            for k0 in (0..whole).step_by(TILE_COLS) {
                let kc = TILE_COLS.min(whole - k0);
                let tile = &scaled[m * k0..][..m * kc];
                for (i, lanes) in lanes.chunks_exact_mut(m).enumerate() {
                    let codes = &data[(r + i) * cols + k0..][..kc];
                    // SAFETY: the caller checked AVX-512F and VBMI; `tile`
                    // holds `m` runs of `kc` values, `codes` `kc` codes.
                    unsafe { avx512::token_lanes(tile, codes, lanes) };
                }
            }
            for (i, lanes) in lanes.chunks_exact(m).enumerate() {
                let row = r + i;
                let tail = tail_values(&data[row * cols..][..cols], whole, scale_row, block_cols);
                for (t, lanes) in lanes.iter().enumerate() {
                    let restored = lanes.map(|v| v * restore);
                    let x_tail = &group[t][whole..];
                    out[(t0 + t) * rows + row - first] =
                        crate::act_quant::combine_lanes(&restored, x_tail, &tail[..cols - whole]);
                }
            }
            r = end;
        }
    }
}

/// `x[c] · s · 2^X_SCALE_EXP` into `out` for the columns `columns`, `s`
/// each column's block scale in `scale_row`: what the codes meet.
#[cfg(target_arch = "x86_64")]
fn scale_columns(x: &[f32], columns: std::ops::Range<usize>, scale_row: &[f32], block_cols: usize, out: &mut [f64]) {
    assert_eq!(out.len(), columns.len(), "scaled columns");
    let x_scale = 2f64.powi(X_SCALE_EXP);
    let mut c = columns.start;
    while c < columns.end {
        // One scale block's columns at a time.
        let end = ((c / block_cols + 1) * block_cols).min(columns.end);
        let s = scale_row[c / block_cols] as f64;
        let at = &mut out[c - columns.start..end - columns.start];
        for (v, &x) in at.iter_mut().zip(&x[c..end]) {
            *v = x as f64 * s * x_scale;
        }
        c = end;
    }
}

/// A row's codes past its whole vectors of eight (`codes[whole..]`) as the
/// bf16 values they stand for, padded with zeros.
#[cfg(target_arch = "x86_64")]
fn tail_values(codes: &[u8], whole: usize, scale_row: &[f32], block_cols: usize) -> [f32; 8] {
    let mut values = [0.0f32; 8];
    for (c, v) in (whole..codes.len()).zip(values.iter_mut()) {
        *v = round_bf16(crate::dtype::fp8_e4m3_to_f32(codes[c]) * scale_row[c / block_cols]);
    }
    values
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{WEIGHT_SCALE_EXP, X_SCALE_EXP};
    use crate::block_scaled::{fp8_decode8, lane_byte_vbmi, multishift_controls};

    /// The eight f64 lanes of each of `ROWS` code rows against `scaled_x`,
    /// restored to the true sums' scale: lane `j` sums columns `j, j + 8, …`
    /// below `scaled_x.len()` in order, as `dot_f64` does.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scaled_lanes<const ROWS: usize>(
        scaled_x: &[f64],
        codes: &[u8],
        cols: usize,
    ) -> [[f64; 8]; ROWS] {
        lanes::<ROWS, false>(scaled_x, codes, cols)
    }

    /// [`scaled_lanes`] decoding 64 columns at a time: `vpermb` gathers
    /// columns `j, j + 8, …` into quadword `j` and `vpmultishiftqb` takes
    /// each byte in turn, two operations for eight weights where one load,
    /// a sign extension and two more took three.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and VBMI.
    #[target_feature(enable = "avx512f,avx512vbmi")]
    pub(super) unsafe fn scaled_lanes_vbmi<const ROWS: usize>(
        scaled_x: &[f64],
        codes: &[u8],
        cols: usize,
    ) -> [[f64; 8]; ROWS] {
        lanes::<ROWS, true>(scaled_x, codes, cols)
    }

    /// Continues each token's eight lanes (`lanes[t]`, unrestored) over one
    /// tile: `tile` holds each token's scaled values for the tile's columns
    /// in turn, `codes` one weight row's codes for them. Lane `j` adds
    /// columns `j, j + 8, …` in order, as [`scaled_lanes`] does.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and VBMI.
    #[target_feature(enable = "avx512f,avx512vbmi")]
    pub(super) unsafe fn token_lanes(tile: &[f64], codes: &[u8], lanes: &mut [[f64; 8]]) {
        macro_rules! tokens {
            ($m:literal) => {
                token_lanes_m::<$m>(tile, codes, lanes.try_into().expect("a group of tokens"))
            };
        }
        match lanes.len() {
            1 => tokens!(1),
            2 => tokens!(2),
            3 => tokens!(3),
            4 => tokens!(4),
            5 => tokens!(5),
            6 => tokens!(6),
            7 => tokens!(7),
            8 => tokens!(8),
            m => unreachable!("{m} tokens at once"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vbmi")]
    unsafe fn token_lanes_m<const M: usize>(tile: &[f64], codes: &[u8], lanes: &mut [[f64; 8]; M]) {
        let kc = codes.len();
        assert!(kc.is_multiple_of(8) && tile.len() == M * kc, "a tile of {M} tokens");
        let mut acc: [__m512d; M] = std::array::from_fn(|t| _mm512_loadu_pd(lanes[t].as_ptr()));
        let x = |t: usize, c: usize| _mm512_loadu_pd(tile.as_ptr().add(t * kc + c));
        let control = multishift_controls();
        let transpose = eight_by_eight();
        let mut c = 0;
        while c + 64 <= kc {
            let packed = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(codes.as_ptr().add(c).cast()));
            for (b, control) in control.iter().enumerate() {
                let weights = lane_byte_vbmi(packed, *control);
                for (t, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_pd(x(t, c + 8 * b), weights, *acc);
                }
            }
            c += 64;
        }
        while c < kc {
            let weights = fp8_decode8(codes.as_ptr().add(c));
            for (t, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_pd(x(t, c), weights, *acc);
            }
            c += 8;
        }
        for (lanes, acc) in lanes.iter_mut().zip(&acc) {
            _mm512_storeu_pd(lanes.as_mut_ptr(), *acc);
        }
    }

    /// The `vpermb` indices that put byte `8k + j` of 64 at byte `k` of
    /// quadword `j`: columns `j, j + 8, …` of 64 codes into quadword `j`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn eight_by_eight() -> __m512i {
        _mm512_set_epi8(
            63, 55, 47, 39, 31, 23, 15, 7, 62, 54, 46, 38, 30, 22, 14, 6, 61, 53, 45, 37, 29, 21, 13, 5, 60, 52, 44,
            36, 28, 20, 12, 4, 59, 51, 43, 35, 27, 19, 11, 3, 58, 50, 42, 34, 26, 18, 10, 2, 57, 49, 41, 33, 25, 17, 9,
            1, 56, 48, 40, 32, 24, 16, 8, 0,
        )
    }

    #[inline(always)]
    unsafe fn lanes<const ROWS: usize, const VBMI: bool>(
        scaled_x: &[f64],
        codes: &[u8],
        cols: usize,
    ) -> [[f64; 8]; ROWS] {
        assert!(codes.len() == ROWS * cols && scaled_x.len() == cols / 8 * 8, "codes and scaled x");
        // A const row count keeps the accumulators in registers.
        let mut acc = [_mm512_setzero_pd(); ROWS];
        let mut start = 0;
        if VBMI {
            let control = multishift_controls();
            let transpose = eight_by_eight();
            while start + 64 <= scaled_x.len() {
                let packed: [__m512i; ROWS] = std::array::from_fn(|k| {
                    let bytes = _mm512_loadu_si512(codes.as_ptr().add(k * cols + start).cast());
                    _mm512_permutexvar_epi8(transpose, bytes)
                });
                for (b, control) in control.iter().enumerate() {
                    let x = _mm512_loadu_pd(scaled_x.as_ptr().add(start + 8 * b));
                    for (acc, packed) in acc.iter_mut().zip(&packed) {
                        *acc = _mm512_fmadd_pd(x, lane_byte_vbmi(*packed, *control), *acc);
                    }
                }
                start += 64;
            }
        }
        for c in (start..scaled_x.len()).step_by(8) {
            let x = _mm512_loadu_pd(scaled_x.as_ptr().add(c));
            for (k, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_fmadd_pd(x, fp8_decode8(codes.as_ptr().add(k * cols + c)), *acc);
            }
        }
        let restore = _mm512_set1_pd(2f64.powi(WEIGHT_SCALE_EXP - X_SCALE_EXP));
        std::array::from_fn(|k| {
            let mut lanes = [0.0f64; 8];
            _mm512_storeu_pd(lanes.as_mut_ptr(), _mm512_mul_pd(acc[k], restore));
            lanes
        })
    }
}
