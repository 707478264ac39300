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
    let x_scale = 2f64.powi(X_SCALE_EXP);
    let mut scaled_x = vec![0.0f64; whole];
    let vbmi = is_x86_feature_detected!("avx512vbmi");
    let mut r = first;
    while r < first + out.len() {
        // A run of rows sharing one row of block scales: x scaled once for them.
        let block = r / block_rows;
        let end = ((block + 1) * block_rows).min(first + out.len());
        let scale_row = &scales[block * per_row..][..per_row];
        for ((xs, scaled), &s) in x.chunks(block_cols).zip(scaled_x.chunks_mut(block_cols)).zip(scale_row) {
            for (v, &x) in scaled.iter_mut().zip(xs) {
                *v = x as f64 * s as f64 * x_scale;
            }
        }
        let tail_values = |row: usize| -> [f32; 8] {
            let mut values = [0.0f32; 8];
            for (c, v) in (whole..cols).zip(values.iter_mut()) {
                *v = round_bf16(crate::dtype::fp8_e4m3_to_f32(data[row * cols + c]) * scale_row[c / block_cols]);
            }
            values
        };
        let mut finish = |row: usize, lanes: &[f64; 8]| {
            let tail = tail_values(row);
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
            // Byte `k` of quadword `j` from byte `8k + j`: a transpose of eight by eight.
            let transpose = _mm512_set_epi8(
                63, 55, 47, 39, 31, 23, 15, 7, 62, 54, 46, 38, 30, 22, 14, 6, 61, 53, 45, 37, 29, 21, 13, 5, 60, 52,
                44, 36, 28, 20, 12, 4, 59, 51, 43, 35, 27, 19, 11, 3, 58, 50, 42, 34, 26, 18, 10, 2, 57, 49, 41, 33,
                25, 17, 9, 1, 56, 48, 40, 32, 24, 16, 8, 0,
            );
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
