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

use crate::dtype::{
    bf16_to_f32, f32_to_bf16, f32_to_fp4_e2m1, f32_to_fp8_e4m3, fp8_e4m3_to_f32, FP4_E2M1_VALUES, FP8_E4M3_MAX,
};
use crate::linear::{Linear, WeightFormat};

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
    let max_inv = 1.0f32 / FP8_E4M3_MAX;
    let mut values = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / ACT_BLOCK);
    for group in x.chunks_exact(ACT_BLOCK) {
        let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let s = power_of_two_scale(amax, max_inv);
        values.extend(group.iter().map(|&v| fp8_e4m3_to_f32(f32_to_fp8_e4m3(v / s))));
        scales.push(s);
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

/// `out[n × rows]` (bf16 values) of a quantised linear over bf16-valued input
/// rows `x[n × cols]`: each row is quantised to FP8 per 32, then multiplied
/// with the FP8 (32 × 32 blocks) or FP4 (per-32 row scales) weight block by
/// block. BF16 and F32 weights take the plain product, rounded to bf16.
pub fn quantized_linear(w: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * w.cols, "quantised linear input");
    let mut out = vec![0.0f32; n * w.rows];
    match &w.format {
        WeightFormat::Fp8 { block_cols, .. } | WeightFormat::Fp4 { block_cols, .. } => {
            assert_eq!(*block_cols, ACT_BLOCK, "weight scale blocks must be 32 wide along K");
            let table = WeightTable::new(w);
            for t in 0..n {
                let q = fp8_quantize_row(&x[t * w.cols..(t + 1) * w.cols]);
                for r in 0..w.rows {
                    out[t * w.rows + r] = round_bf16(table.scaled_dot(r, &q));
                }
            }
        }
        WeightFormat::Bf16(_) | WeightFormat::F32(_) => {
            plain_linear(w, x, n, &mut out);
            round_bf16_all(&mut out);
        }
    }
    out
}

/// The product `x · Wᵀ`, each output accumulated in f64 (exact products) and
/// rounded once to f32: a result that no summation order can change.
pub fn plain_linear(w: &Linear, x: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "linear input");
    assert_eq!(out.len(), n * w.rows, "linear output");
    let mut row = vec![0.0f32; w.cols];
    for r in 0..w.rows {
        w.dequantize_row(r, &mut row);
        for t in 0..n {
            let input = &x[t * w.cols..(t + 1) * w.cols];
            out[t * w.rows + r] = input.iter().zip(&row).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32;
        }
    }
}

/// A quantised weight decoded to its unscaled element values, with the scale of
/// every (row, K block).
struct WeightTable<'a> {
    weight: &'a Linear,
    blocks: usize,
    scales: Vec<f32>,
}

impl<'a> WeightTable<'a> {
    fn new(weight: &'a Linear) -> Self {
        let blocks = weight.cols / ACT_BLOCK;
        let scales = match &weight.format {
            WeightFormat::Fp8 { scales, block_rows, block_cols, .. } => {
                let per_row = weight.cols.div_ceil(*block_cols);
                (0..weight.rows)
                    .flat_map(|r| (0..blocks).map(move |b| scales[(r / block_rows) * per_row + b]))
                    .collect()
            }
            WeightFormat::Fp4 { scales, .. } => scales.clone(),
            _ => unreachable!("only quantised weights have a table"),
        };
        Self { weight, blocks, scales }
    }

    fn element(&self, r: usize, c: usize) -> f32 {
        match &self.weight.format {
            WeightFormat::Fp8 { data, .. } => fp8_e4m3_to_f32(data[r * self.weight.cols + c]),
            WeightFormat::Fp4 { data, .. } => {
                let byte = data[(r * self.weight.cols + c) / 2];
                FP4_E2M1_VALUES[if c % 2 == 0 { byte & 0xf } else { byte >> 4 } as usize]
            }
            _ => unreachable!("only quantised weights have a table"),
        }
    }

    /// Σ over K blocks of (Σ a·w in the block) · a_scale · w_scale, blocks in order.
    fn scaled_dot(&self, r: usize, q: &Fp8Row) -> f32 {
        let mut acc = 0.0f32;
        for b in 0..self.blocks {
            // FP8 × FP8 (or FP4) products are exact and their block sum is exact in f64.
            let mut partial = 0.0f64;
            for c in b * ACT_BLOCK..(b + 1) * ACT_BLOCK {
                partial += q.values[c] as f64 * self.element(r, c) as f64;
            }
            acc += partial as f32 * q.scales[b] * self.scales[r * self.blocks + b];
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
