//! Linear layers (`y = x · Wᵀ`) over the weight formats of DeepSeek checkpoints.
//!
//! Quantised weights are dequantised inside the kernel, a tile at a time; no
//! full f32 copy of a quantised matrix is ever made. Each output element is one
//! dot product whose reduction order depends only on `cols`, so results are
//! batch-invariant.

use bytes::Bytes;

use crate::dtype::{bf16_to_f32, fp8_e4m3_to_f32, FP4_E2M1_VALUES};

/// How a weight matrix of `rows × cols` (out × in, row-major) is stored.
#[derive(Clone, Debug)]
pub enum WeightFormat {
    F32(Vec<f32>),
    /// Little-endian bf16, `rows * cols * 2` bytes.
    Bf16(Bytes),
    /// FP8 e4m3fn, one byte per weight, with one scale per
    /// `block_rows × block_cols` block: `scales[(r / block_rows) * ceil(cols / block_cols) + c / block_cols]`.
    Fp8 {
        data: Bytes,
        scales: Vec<f32>,
        block_rows: usize,
        block_cols: usize,
    },
    /// FP4 e2m1, two weights per byte (even column in the low nibble), one scale per
    /// `block_cols` consecutive columns of a row: `scales[r * (cols / block_cols) + c / block_cols]`.
    Fp4 {
        data: Bytes,
        scales: Vec<f32>,
        block_cols: usize,
    },
}

/// A weight matrix of `rows` outputs by `cols` inputs.
#[derive(Clone, Debug)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
}

impl Linear {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "f32 weight of {rows}x{cols}");
        Self { rows, cols, format: WeightFormat::F32(data) }
    }

    /// Bytes this weight occupies in memory.
    pub fn storage_bytes(&self) -> usize {
        match &self.format {
            WeightFormat::F32(d) => d.len() * 4,
            WeightFormat::Bf16(d) => d.len(),
            WeightFormat::Fp8 { data, scales, .. } | WeightFormat::Fp4 { data, scales, .. } => {
                data.len() + scales.len() * 4
            }
        }
    }

    /// Dequantise row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let cols = self.cols;
        match &self.format {
            WeightFormat::F32(d) => out.copy_from_slice(&d[r * cols..(r + 1) * cols]),
            WeightFormat::Bf16(d) => {
                let bytes = &d[r * cols * 2..(r + 1) * cols * 2];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            WeightFormat::Fp8 { data, scales, block_rows, block_cols } => {
                let blocks_per_row = cols.div_ceil(*block_cols);
                let scale_row = &scales[(r / block_rows) * blocks_per_row..][..blocks_per_row];
                for (c, (o, &b)) in out.iter_mut().zip(&data[r * cols..(r + 1) * cols]).enumerate() {
                    *o = fp8_e4m3_to_f32(b) * scale_row[c / block_cols];
                }
            }
            WeightFormat::Fp4 { data, scales, block_cols } => {
                let blocks_per_row = cols / block_cols;
                let scale_row = &scales[r * blocks_per_row..][..blocks_per_row];
                let packed = &data[r * cols / 2..(r + 1) * cols / 2];
                for (i, &b) in packed.iter().enumerate() {
                    let c = 2 * i;
                    let s = scale_row[c / block_cols];
                    out[c] = FP4_E2M1_VALUES[(b & 0xf) as usize] * s;
                    out[c + 1] = FP4_E2M1_VALUES[(b >> 4) as usize] * s;
                }
            }
        }
    }

    /// `out[n × rows] = x[n × cols] · Wᵀ`.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "linear input");
        assert_eq!(out.len(), n * self.rows, "linear output");
        let mut row = vec![0.0f32; self.cols];
        for r in 0..self.rows {
            self.dequantize_row(r, &mut row);
            for i in 0..n {
                out[i * self.rows + r] = dot(&x[i * self.cols..(i + 1) * self.cols], &row);
            }
        }
    }
}

/// Dot product with a fixed reduction order: 16 lane accumulators over the
/// length, then a fixed pairwise tree. Every path (SIMD or not) must keep this order.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 16];
    let chunks = a.len() / 16;
    for k in 0..chunks {
        for l in 0..16 {
            acc[l] = a[k * 16 + l].mul_add(b[k * 16 + l], acc[l]);
        }
    }
    for j in chunks * 16..a.len() {
        let l = j - chunks * 16;
        acc[l] = a[j].mul_add(b[j], acc[l]);
    }
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}
