//! The activation arithmetic DeepSeek-V4.1 bakes into its forward pass: bf16
//! rounding of every stored activation, FP8 e4m3 activations with a
//! power-of-two scale per 32 before every quantised linear, FP4 e2m1
//! quantise-dequantise of cached keys, and the block-scaled GEMM that consumes
//! FP8 activations with FP8 or FP4 weights.
//!
//! Every function is element- or row-wise over fixed groups, so results do not
//! depend on the batch. The GEMM sums each 32-wide K block exactly, scales it
//! by both block scales and accumulates the blocks in f32 in K order, as
//! DeepSeek's kernel does; other products accumulate in f64 and round once.

use crate::block_scaled::{block_scaled_product, BlockPath};
use crate::dtype::{
    bf16_to_f32, f32_to_bf16, f32_to_fp4_e2m1, f32_to_fp8_e4m3, fp8_e4m3_to_f32, FP4_E2M1_VALUES, FP8_E4M3_MAX,
};
use crate::linear::{Isa, Linear, WeightFormat};

/// Activations share one scale per this many consecutive channels.
pub const ACT_BLOCK: usize = 32;

/// `x` rounded to the nearest bf16 (ties to even).
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

/// Round every element to bf16 in place.
pub fn round_bf16_all(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = round_bf16(*v));
}

/// `2^ceil(log2(amax · max_inv))`, computed from the exponent and mantissa bits
/// of the f32 product as DeepSeek's kernel does (no `log2`, so no rounding).
#[inline]
pub fn power_of_two_scale(amax: f32, max_inv: f32) -> f32 {
    let bits = (amax * max_inv).to_bits() as i32;
    let exponent = (bits >> 23) & 0xff;
    let mantissa = bits & ((1 << 23) - 1);
    let log2_ceil = exponent - 127 + i32::from(mantissa != 0);
    f32::from_bits(((log2_ceil + 127) << 23) as u32)
}

/// The FP8 e4m3 value nearest `x` (ties to even), saturated at ±448.
#[inline]
pub fn e4m3_round(x: f32) -> f32 {
    let x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX);
    let magnitude = x.abs();
    let rounded = if magnitude < 2f32.powi(-6) {
        // Subnormals are the multiples of 2^-9. Adding and taking off 2^23
        // rounds a value in [0, 8) to an integer, ties to even, as
        // `round_ties_even` does without its library call.
        const ROUNDER: f32 = 8_388_608.0;
        ((magnitude * 512.0 + ROUNDER) - ROUNDER) / 512.0
    } else {
        // Keep 3 mantissa bits, rounding the 20 dropped bits to nearest even.
        let bits = magnitude.to_bits();
        let lsb = (bits >> 20) & 1;
        f32::from_bits((bits + 0x7_ffff + lsb) & !0xf_ffff)
    };
    rounded.copysign(x)
}

/// FP8 e4m3 codes of one row and its per-32 power-of-two scales.
pub struct Fp8Row {
    pub values: Vec<f32>,
    pub scales: Vec<f32>,
}

/// Quantise one bf16-valued row to FP8 e4m3 with a power-of-two scale per 32
/// channels (amax floored at 1e-4, values saturated at ±448). `values` holds
/// the e4m3 values, not yet multiplied by their scale.
pub fn fp8_quantize_row(x: &[f32]) -> Fp8Row {
    assert!(x.len().is_multiple_of(ACT_BLOCK), "FP8 activation row of {} is not a multiple of 32", x.len());
    let (mut values, mut scales) = (vec![0.0f32; x.len()], vec![0.0f32; x.len() / ACT_BLOCK]);
    #[cfg(target_arch = "x86_64")]
    let done = match Isa::detect() {
        // SAFETY: the detected path guarantees AVX-512F; lengths as allocated above.
        Isa::Avx512 => unsafe { crate::simd::avx512_quantize::fp8_quantize_blocks(x, &mut values, &mut scales) },
        _ => vec![false; scales.len()],
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = vec![false; scales.len()];
    let max_inv = 1.0f32 / FP8_E4M3_MAX;
    for (b, group) in x.chunks_exact(ACT_BLOCK).enumerate().filter(|(b, _)| !done[*b]) {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let s = power_of_two_scale(amax, max_inv);
        let out = &mut values[b * ACT_BLOCK..][..ACT_BLOCK];
        out.iter_mut().zip(group).for_each(|(o, &v)| *o = e4m3_round(v / s));
        scales[b] = s;
    }
    Fp8Row { values, scales }
}

/// FP8 quantise-dequantise in place, back to bf16 values (the window KV cache).
pub fn fp8_round_trip(x: &mut [f32]) {
    for row_start in (0..x.len()).step_by(ACT_BLOCK) {
        let group = &mut x[row_start..row_start + ACT_BLOCK];
        let q = fp8_quantize_row(group);
        for (v, &code) in group.iter_mut().zip(&q.values) {
            *v = round_bf16(code * q.scales[0]);
        }
    }
}

/// The scale kind of an FP4 quantise-dequantise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp4Scale {
    /// Power-of-two (UE8M0) scale per group (the indexer's queries and keys).
    Ue8m0,
    /// An FP8 e4m3 scale of `amax / 6` per group (the compressed KV).
    E4m3,
}

/// FP4 e2m1 quantise-dequantise in place, in groups of `block`, back to bf16 values.
pub fn fp4_round_trip(x: &mut [f32], block: usize, scale: Fp4Scale) {
    assert!(block > 0 && x.len().is_multiple_of(block), "FP4 row of {} in groups of {block}", x.len());
    for group in x.chunks_exact_mut(block) {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let s = match scale {
            Fp4Scale::E4m3 => fp8_e4m3_to_f32(f32_to_fp8_e4m3(amax.max(6.0 * 2f32.powi(-9)) / 6.0)),
            Fp4Scale::Ue8m0 => power_of_two_scale(amax.max(6.0 * 2f32.powi(-126)), 1.0f32 / 6.0),
        };
        for v in group.iter_mut() {
            let q = (*v / s).clamp(-6.0, 6.0);
            *v = round_bf16(FP4_E2M1_VALUES[f32_to_fp4_e2m1(q) as usize] * s);
        }
    }
}

/// Σ a·b accumulated in f64. Products of f32 values are exact in f64, so the
/// result is the exact sum rounded a few times in f64; where the exact sum
/// fits 53 bits (the FP8 × FP8 and FP8 × FP4 blocks of 32) it is exact and no
/// order of addition can change it. Eight lanes in a fixed order, so every
/// instruction set gives the same bits (an FMA rounds an exact product once,
/// as a multiply then an add does).
#[inline]
pub fn dot_f64(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "dot lengths");
    match Isa::detect() {
        // SAFETY: `detect` returns only instruction sets this CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { dot_f64_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { dot_f64_avx2(a, b) },
        // SAFETY: as above (NEON).
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { dot_f64_rows_neon(a, [b])[0] },
        _ => dot_f64_lanes(a, b),
    }
}

#[inline(always)]
fn dot_f64_lanes(a: &[f32], b: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_tail, b_tail) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for j in 0..8 {
            acc[j] += x[j] as f64 * y[j] as f64;
        }
    }
    combine_lanes(&acc, a_tail, b_tail)
}

/// [`dot_f64_lanes`] with its eight lanes in one register: the same sums in
/// the same order (an FMA of an exact product is the multiply and the add).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_f64_avx512(a: &[f32], b: &[f32]) -> f64 {
    use std::arch::x86_64::*;
    let whole = a.len() / 8 * 8;
    let mut acc = _mm512_setzero_pd();
    for c in (0..whole).step_by(8) {
        let x = _mm512_cvtps_pd(_mm256_loadu_ps(a.as_ptr().add(c)));
        let y = _mm512_cvtps_pd(_mm256_loadu_ps(b.as_ptr().add(c)));
        acc = _mm512_fmadd_pd(x, y, acc);
    }
    let mut lanes = [0.0f64; 8];
    _mm512_storeu_pd(lanes.as_mut_ptr(), acc);
    combine_lanes(&lanes, &a[whole..], &b[whole..])
}

/// `out[i] = dot_f64(a, rows[i * a.len()..][..a.len()])` for every row: the
/// same bits, four rows at a time on AVX-512 (four independent chains share
/// each load of `a`, where one chain alone waits on its FMA's latency).
pub fn dot_f64_rows(a: &[f32], rows: &[f32], out: &mut [f64]) {
    let cols = a.len();
    assert_eq!(rows.len(), out.len() * cols, "dot_f64_rows: {} values for {} rows of {cols}", rows.len(), out.len());
    dot_f64_with_row(a, |i| &rows[i * cols..][..cols], out);
}

/// `out[i] = dot_f64(a, rows[i])` for rows anywhere in memory (keys of a
/// cache): the same bits, four rows at a time on AVX-512.
pub fn dot_f64_each(a: &[f32], rows: &[&[f32]], out: &mut [f64]) {
    assert_eq!(rows.len(), out.len(), "dot_f64_each: {} rows for {} outputs", rows.len(), out.len());
    assert!(rows.iter().all(|r| r.len() == a.len()), "dot_f64_each: row lengths");
    dot_f64_with_row(a, |i| rows[i], out);
}

/// A kernel of [`dot_f64`] with four rows at once.
type FourRowDots = fn(&[f32], [&[f32]; 4]) -> [f64; 4];

/// `out[i] = dot_f64(a, row(i))`; every row holds `a.len()` values.
#[inline]
fn dot_f64_with_row<'r>(a: &[f32], row: impl Fn(usize) -> &'r [f32], out: &mut [f64]) {
    let four_rows: Option<FourRowDots> = match Isa::detect() {
        // SAFETY: `detect` found AVX-512F; the kernel asserts the row lengths.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => Some(|a, rows| unsafe { dot_f64_4rows_avx512(a, rows) }),
        // SAFETY: `detect` found NEON; the kernel asserts the row lengths.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => Some(|a, rows| unsafe { dot_f64_rows_neon(a, rows) }),
        _ => None,
    };
    let mut done = 0;
    if let Some(four_rows) = four_rows.filter(|_| !a.is_empty()) {
        done = out.len() / 4 * 4;
        for (i, quad) in out[..done].chunks_exact_mut(4).enumerate() {
            quad.copy_from_slice(&four_rows(a, std::array::from_fn(|k| row(4 * i + k))));
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(done) {
        *o = dot_f64(a, row(i));
    }
}

/// Four rows of [`dot_f64_avx512`] against one `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_f64_4rows_avx512(a: &[f32], rows: [&[f32]; 4]) -> [f64; 4] {
    use std::arch::x86_64::*;
    let cols = a.len();
    assert!(rows.iter().all(|r| r.len() == cols), "four rows of {cols}");
    let whole = cols / 8 * 8;
    let mut acc = [_mm512_setzero_pd(); 4];
    for c in (0..whole).step_by(8) {
        let x = _mm512_cvtps_pd(_mm256_loadu_ps(a.as_ptr().add(c)));
        for (k, acc) in acc.iter_mut().enumerate() {
            let y = _mm512_cvtps_pd(_mm256_loadu_ps(rows[k].as_ptr().add(c)));
            *acc = _mm512_fmadd_pd(x, y, *acc);
        }
    }
    std::array::from_fn(|k| {
        let mut lanes = [0.0f64; 8];
        _mm512_storeu_pd(lanes.as_mut_ptr(), acc[k]);
        combine_lanes(&lanes, &a[whole..], &rows[k][whole..])
    })
}

/// [`dot_f64_lanes`] of `a` with each of `R` rows on NEON: lane `j` of the
/// eight in register `j / 2`, the same sums in the same order.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
unsafe fn dot_f64_rows_neon<const R: usize>(a: &[f32], rows: [&[f32]; R]) -> [f64; R] {
    use std::arch::aarch64::*;
    let cols = a.len();
    assert!(rows.iter().all(|r| r.len() == cols), "{R} rows of {cols}");
    let whole = cols / 8 * 8;
    // Eight f32 at `p` as four pairs of f64.
    let wide = |p: *const f32| {
        let (low, high) = (vld1q_f32(p), vld1q_f32(p.add(4)));
        [
            vcvt_f64_f32(vget_low_f32(low)),
            vcvt_high_f64_f32(low),
            vcvt_f64_f32(vget_low_f32(high)),
            vcvt_high_f64_f32(high),
        ]
    };
    let mut acc = [[vdupq_n_f64(0.0); 4]; R];
    for c in (0..whole).step_by(8) {
        let x = wide(a.as_ptr().add(c));
        for (acc, row) in acc.iter_mut().zip(&rows) {
            let y = wide(row.as_ptr().add(c));
            for p in 0..4 {
                acc[p] = vfmaq_f64(acc[p], x[p], y[p]);
            }
        }
    }
    std::array::from_fn(|k| {
        let mut lanes = [0.0f64; 8];
        for (p, v) in acc[k].iter().enumerate() {
            vst1q_f64(lanes.as_mut_ptr().add(2 * p), *v);
        }
        combine_lanes(&lanes, &a[whole..], &rows[k][whole..])
    })
}

/// The fixed tree over the eight lanes, plus the tail's products in order.
#[inline(always)]
pub(crate) fn combine_lanes(acc: &[f64; 8], a_tail: &[f32], b_tail: &[f32]) -> f64 {
    let tail: f64 = a_tail.iter().zip(b_tail).map(|(&x, &y)| x as f64 * y as f64).sum();
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f64_avx2(a: &[f32], b: &[f32]) -> f64 {
    dot_f64_lanes(a, b)
}

/// Σ over 32-wide blocks, in K order, of (exact block sum of a·w) · a_scale ·
/// w_scale, in f32: one output of the quantised product, as defined.
#[inline]
fn scaled_blocks(q: &Fp8Row, row: &[f32], w_scales: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for ((a, w), (&a_scale, &w_scale)) in
        q.values.chunks_exact(ACT_BLOCK).zip(row.chunks_exact(ACT_BLOCK)).zip(q.scales.iter().zip(w_scales))
    {
        // The block sum is exact (see dot_f64), whatever the order of addition.
        acc += dot_f64_lanes(a, w) as f32 * a_scale * w_scale;
    }
    acc
}

/// Multiply-adds above which a linear is spread over threads (each output is
/// computed alone, so the bits do not depend on the split).
const PARALLEL_MIN_WORK: usize = 1 << 16;

/// `out[t · rows + r] = f(weight row r decoded, r, t)` for every output, in
/// parallel over rows for large layers.
fn by_row(
    w: &Linear,
    n: usize,
    decode: impl Fn(usize, &mut [f32]) + Sync,
    f: impl Fn(&[f32], usize, usize) -> f32 + Sync,
) -> Vec<f32> {
    use rayon::prelude::*;
    let column = |r: usize| {
        let mut row = vec![0.0f32; w.cols];
        decode(r, &mut row);
        (0..n).map(|t| f(&row, r, t)).collect::<Vec<f32>>()
    };
    let columns: Vec<Vec<f32>> = if rayon::current_num_threads() > 1 && w.rows * w.cols * n >= PARALLEL_MIN_WORK {
        (0..w.rows).into_par_iter().map(column).collect()
    } else {
        (0..w.rows).map(column).collect()
    };
    let mut out = vec![0.0f32; n * w.rows];
    for (r, col) in columns.iter().enumerate() {
        for (t, &v) in col.iter().enumerate() {
            out[t * w.rows + r] = v;
        }
    }
    out
}

/// `out[n × rows]` (bf16 values) of a quantised linear over bf16-valued input
/// rows `x[n × cols]`: each row is quantised to FP8 per 32, then multiplied
/// with the FP8 (32 × 32 blocks) or FP4 (per-32 row scales) weight block by
/// block. BF16 and F32 weights take the plain product, rounded to bf16.
///
/// Computed by [`block_scaled_product`] on the fastest [`BlockPath`]; the
/// bits are those of [`quantized_linear_reference`].
pub fn quantized_linear(w: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    quantized_linear_on(BlockPath::detect(), w, x, n)
}

/// [`quantized_linear`] on a chosen path (for tests and benchmarks). Panics
/// if this CPU lacks `path`.
pub fn quantized_linear_on(path: BlockPath, w: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * w.cols, "quantised linear input");
    if let WeightFormat::Panels(_) = &w.format {
        // These kernels read the published layout.
        return quantized_linear_on(path, &w.clone().into_published(), x, n);
    }
    if !w.format.is_quantized() {
        return quantized_linear_reference(w, x, n);
    }
    assert_eq!(scale_block_cols(w), ACT_BLOCK, "weight scale blocks must be 32 wide along K");
    let quantized: Vec<Fp8Row> = x.chunks_exact(w.cols).map(fp8_quantize_row).collect();
    match block_scaled_product(path, w, &quantized) {
        Some(mut out) => {
            round_bf16_all(&mut out);
            out
        }
        None => reference_product(w, &quantized),
    }
}

/// The definition of [`quantized_linear`]: one weight row at a time, each
/// block's exact sum in f64 lanes, then the scaled blocks in K order.
pub fn quantized_linear_reference(w: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * w.cols, "quantised linear input");
    if let WeightFormat::Panels(_) = &w.format {
        return quantized_linear_reference(&w.clone().into_published(), x, n);
    }
    if !w.format.is_quantized() {
        let mut out = vec![0.0f32; n * w.rows];
        plain_linear(w, x, n, &mut out);
        round_bf16_all(&mut out);
        return out;
    }
    assert_eq!(scale_block_cols(w), ACT_BLOCK, "weight scale blocks must be 32 wide along K");
    let quantized: Vec<Fp8Row> = x.chunks_exact(w.cols).map(fp8_quantize_row).collect();
    reference_product(w, &quantized)
}

fn reference_product(w: &Linear, quantized: &[Fp8Row]) -> Vec<f32> {
    let scales = block_scales(w);
    let blocks = w.cols / ACT_BLOCK;
    by_row(
        w,
        quantized.len(),
        |r, row| unscaled_row(w, r, row),
        |row, r, t| round_bf16(scaled_blocks(&quantized[t], row, &scales[r * blocks..(r + 1) * blocks])),
    )
}

/// The product `x · Wᵀ`, each output accumulated in f64 and rounded once to
/// f32 (the bits of [`dot_f64`] per output), weight rows decoded 16 at a time.
pub fn plain_linear(w: &Linear, x: &[f32], n: usize, out: &mut [f32]) {
    use rayon::prelude::*;
    assert_eq!(x.len(), n * w.cols, "linear input");
    assert_eq!(out.len(), n * w.rows, "linear output");
    const ROWS: usize = 16;
    let cols = w.cols;
    let strip = |(j, by_row): (usize, &mut [f32])| {
        let count = by_row.len() / n.max(1);
        let mut decoded = vec![0.0f32; count * cols];
        for (i, row) in decoded.chunks_exact_mut(cols.max(1)).enumerate().take(count) {
            w.dequantize_row(j * ROWS + i, row);
        }
        let mut sums = vec![0.0f64; count];
        for t in 0..n {
            dot_f64_rows(&x[t * cols..(t + 1) * cols], &decoded, &mut sums);
            for (i, &v) in sums.iter().enumerate() {
                by_row[i * n + t] = v as f32;
            }
        }
    };
    let mut by_row = vec![0.0f32; w.rows * n];
    if n > 0 && cols > 0 {
        if rayon::current_num_threads() > 1 && w.rows * cols * n >= PARALLEL_MIN_WORK {
            by_row.par_chunks_mut(ROWS * n).enumerate().for_each(strip);
        } else {
            by_row.chunks_mut(ROWS * n).enumerate().for_each(strip);
        }
    }
    crate::block_scaled::rows_to_tokens(&by_row, w.rows, n, out);
}

/// Columns per scale along K of a quantised weight.
fn scale_block_cols(w: &Linear) -> usize {
    match &w.format {
        WeightFormat::Fp8 { block_cols, .. } | WeightFormat::Fp4 { block_cols, .. } => *block_cols,
        _ => unreachable!("only quantised weights have scale blocks"),
    }
}

/// The scale of every (row, 32-wide K block) of a quantised weight.
fn block_scales(w: &Linear) -> Vec<f32> {
    let blocks = w.cols / ACT_BLOCK;
    match &w.format {
        WeightFormat::Fp8 { scales, block_rows, block_cols, .. } => {
            let per_row = w.cols.div_ceil(*block_cols);
            (0..w.rows).flat_map(|r| (0..blocks).map(move |b| scales[(r / block_rows) * per_row + b])).collect()
        }
        WeightFormat::Fp4 { scales, .. } => scales.clone(),
        _ => unreachable!("only quantised weights have block scales"),
    }
}

/// Row `r` of a quantised weight as its element values, scales not applied.
fn unscaled_row(w: &Linear, r: usize, out: &mut [f32]) {
    match &w.format {
        WeightFormat::Fp8 { data, .. } => {
            for (o, &b) in out.iter_mut().zip(&data[r * w.cols..(r + 1) * w.cols]) {
                *o = fp8_e4m3_to_f32(b);
            }
        }
        WeightFormat::Fp4 { data, .. } => {
            for (pair, &b) in out.chunks_exact_mut(2).zip(&data[r * w.cols / 2..(r + 1) * w.cols / 2]) {
                pair[0] = FP4_E2M1_VALUES[(b & 0xf) as usize];
                pair[1] = FP4_E2M1_VALUES[(b >> 4) as usize];
            }
        }
        _ => unreachable!("only quantised weights have unscaled rows"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-level rounding gives the value of the code the table search picks.
    #[test]
    fn e4m3_round_matches_the_encoder() {
        let mut probes: Vec<f32> = (0u8..=0x7e)
            .flat_map(|c| {
                let v = fp8_e4m3_to_f32(c);
                let next = fp8_e4m3_to_f32((c + 1).min(0x7e));
                [v, (v + next) / 2.0, f32::from_bits(v.to_bits() + 1), f32::from_bits(v.to_bits().max(1) - 1), -v]
            })
            .collect();
        probes.extend([0.0, -0.0, 1e-9, 447.9, 500.0, -1e6, 2f32.powi(-6) * 0.99]);
        let mut x = 0x9e37_79b9u32;
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            probes.push(f32::from_bits(x & 0x43ff_ffff) * if x & 2 == 0 { 1.0 } else { -1.0 });
        }
        for v in probes {
            let want = fp8_e4m3_to_f32(f32_to_fp8_e4m3(v));
            assert_eq!(e4m3_round(v).to_bits(), want.to_bits(), "{v:e}");
        }
    }

    /// Values spread over 2^±60 (xorshift from `seed`): summed in another
    /// order, they give other bits.
    fn spread_values(seed: u32) -> impl FnMut() -> f32 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let mantissa = (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
            mantissa * 2f32.powi((x % 121) as i32 - 60)
        }
    }

    /// Four rows at a time keep each row's bits.
    #[test]
    fn dot_f64_rows_has_each_rows_bits() {
        let mut next = spread_values(0x9abc_def0);
        for (rows, cols) in [(1, 5), (4, 8), (7, 19), (9, 512), (13, 1027)] {
            let a: Vec<f32> = (0..cols).map(|_| next()).collect();
            let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
            let mut got = vec![0.0f64; rows];
            dot_f64_rows(&a, &w, &mut got);
            for (r, g) in got.iter().enumerate() {
                let want = dot_f64_lanes(&a, &w[r * cols..(r + 1) * cols]);
                assert_eq!(g.to_bits(), want.to_bits(), "{rows} x {cols}, row {r}");
            }
        }
    }

    #[test]
    fn dot_f64_each_has_each_rows_bits() {
        let mut next = spread_values(0x1357_9bdf);
        for (rows, cols) in [(0, 8), (1, 5), (4, 8), (7, 19), (9, 256), (13, 1027)] {
            let a: Vec<f32> = (0..cols).map(|_| next()).collect();
            // Rows scattered through one buffer, in reverse order.
            let w: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
            let scattered: Vec<&[f32]> = w.chunks_exact(cols).rev().collect();
            let mut got = vec![0.0f64; rows];
            dot_f64_each(&a, &scattered, &mut got);
            for (r, g) in got.iter().enumerate() {
                let want = dot_f64_lanes(&a, scattered[r]);
                assert_eq!(g.to_bits(), want.to_bits(), "{rows} x {cols}, row {r}");
            }
        }
    }

    /// The SIMD dot product keeps the lanes' order.
    #[test]
    fn dot_f64_has_the_lanes_bits_on_this_cpu() {
        let mut next = spread_values(0x1234_5678);
        for len in (0..40).chain([511, 512, 1027]) {
            let a: Vec<f32> = (0..len).map(|_| next()).collect();
            let b: Vec<f32> = (0..len).map(|_| next()).collect();
            assert_eq!(dot_f64(&a, &b).to_bits(), dot_f64_lanes(&a, &b).to_bits(), "length {len}");
        }
    }

    #[test]
    fn power_of_two_scale_rounds_up() {
        assert_eq!(power_of_two_scale(448.0, 1.0 / 448.0), 1.0);
        assert_eq!(power_of_two_scale(449.0, 1.0 / 448.0), 2.0);
        assert_eq!(power_of_two_scale(6.0, 1.0 / 6.0), 1.0);
        assert_eq!(power_of_two_scale(1.0, 1.0 / 6.0), 0.25);
    }

    #[test]
    fn fp8_round_trip_keeps_codes() {
        let mut x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
        let before = x.clone();
        fp8_round_trip(&mut x);
        // amax 8 → scale 2^ceil(log2(8/448)) = 2^-5; every multiple of 0.5 is exact.
        assert_eq!(x, before);
    }

    #[test]
    fn fp4_round_trip_uses_the_grid() {
        let mut x = vec![0.3f32, 0.75, 1.1, 6.0, -2.6, 0.0, 5.0, -0.25];
        fp4_round_trip(&mut x, 8, Fp4Scale::Ue8m0);
        // amax 6 → scale 1; values land on the e2m1 grid with ties to the even code.
        assert_eq!(x, vec![0.5, 1.0, 1.0, 6.0, -3.0, 0.0, 4.0, -0.0]);
    }
}
