//! Quantisation of f32 matrices into DeepSeek's checkpoint formats: used to
//! write checkpoints and to test the matmuls that consume them.

use bytes::Bytes;

use crate::dtype::{f32_to_fp4_e2m1, f32_to_fp8_e4m3, ue8m0_scale_for, ue8m0_to_f32, FP4_E2M1_MAX, FP8_E4M3_MAX};
use crate::linear::{Linear, WeightFormat};

/// A quantised matrix as a checkpoint stores it: raw codes and UE8M0 scale bytes.
#[derive(Clone, Debug)]
pub struct Quantized {
    pub codes: Vec<u8>,
    /// UE8M0 exponents, row-major over the scale grid.
    pub scales: Vec<u8>,
    /// Shape of the scale grid (rows, cols).
    pub scale_shape: (usize, usize),
}

/// FP8 e4m3 with one UE8M0 scale per `block × block` tile (partial tiles at the edges).
pub fn quantize_fp8_blocks(w: &[f32], rows: usize, cols: usize, block: usize) -> Quantized {
    assert_eq!(w.len(), rows * cols);
    let (grid_r, grid_c) = (rows.div_ceil(block), cols.div_ceil(block));
    let mut scales = vec![0u8; grid_r * grid_c];
    for br in 0..grid_r {
        for bc in 0..grid_c {
            let mut max_abs = 0.0f32;
            for r in br * block..((br + 1) * block).min(rows) {
                for c in bc * block..((bc + 1) * block).min(cols) {
                    max_abs = max_abs.max(w[r * cols + c].abs());
                }
            }
            scales[br * grid_c + bc] = ue8m0_scale_for(max_abs, FP8_E4M3_MAX);
        }
    }
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let s = ue8m0_to_f32(scales[(r / block) * grid_c + c / block]);
            codes[r * cols + c] = f32_to_fp8_e4m3(w[r * cols + c] / s);
        }
    }
    Quantized { codes, scales, scale_shape: (grid_r, grid_c) }
}

/// FP8 e4m3 with one UE8M0 scale per `block` columns of each row (the Engram tables).
pub fn quantize_fp8_rows(w: &[f32], rows: usize, cols: usize, block: usize) -> Quantized {
    assert_eq!(w.len(), rows * cols);
    assert!(cols.is_multiple_of(block), "fp8 rows need cols divisible by {block}");
    let blocks = cols / block;
    let mut scales = vec![0u8; rows * blocks];
    let mut codes = vec![0u8; rows * cols];
    for r in 0..rows {
        for b in 0..blocks {
            let seg = &w[r * cols + b * block..r * cols + (b + 1) * block];
            let max_abs = seg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let code = ue8m0_scale_for(max_abs, FP8_E4M3_MAX);
            scales[r * blocks + b] = code;
            let s = ue8m0_to_f32(code);
            for (c, &v) in seg.iter().enumerate() {
                codes[r * cols + b * block + c] = f32_to_fp8_e4m3(v / s);
            }
        }
    }
    Quantized { codes, scales, scale_shape: (rows, blocks) }
}

/// FP4 e2m1 packed two per byte (even column low nibble), one UE8M0 scale per
/// `block` columns of each row. `cols` must be a multiple of `block` and of 2.
pub fn quantize_fp4_rows(w: &[f32], rows: usize, cols: usize, block: usize) -> Quantized {
    assert_eq!(w.len(), rows * cols);
    assert!(cols.is_multiple_of(block) && cols.is_multiple_of(2), "fp4 needs cols divisible by {block}");
    let blocks = cols / block;
    let mut scales = vec![0u8; rows * blocks];
    let mut codes = vec![0u8; rows * cols / 2];
    for r in 0..rows {
        for b in 0..blocks {
            let seg = &w[r * cols + b * block..r * cols + (b + 1) * block];
            let max_abs = seg.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            scales[r * blocks + b] = ue8m0_scale_for(max_abs, FP4_E2M1_MAX);
        }
        for c in (0..cols).step_by(2) {
            let s = ue8m0_to_f32(scales[r * blocks + c / block]);
            let lo = f32_to_fp4_e2m1(w[r * cols + c] / s);
            let hi = f32_to_fp4_e2m1(w[r * cols + c + 1] / s);
            codes[(r * cols + c) / 2] = lo | (hi << 4);
        }
    }
    Quantized { codes, scales, scale_shape: (rows, blocks) }
}

impl Quantized {
    fn scales_f32(&self) -> Vec<f32> {
        self.scales.iter().map(|&s| ue8m0_to_f32(s)).collect()
    }

    /// A linear layer that reads these FP8 codes directly.
    pub fn into_fp8_linear(self, rows: usize, cols: usize, block: usize) -> Linear {
        let scales = self.scales_f32();
        Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(self.codes), scales, block, block) }
    }

    /// A linear layer that reads these FP4 codes directly.
    pub fn into_fp4_linear(self, rows: usize, cols: usize, block: usize) -> Linear {
        let scales = self.scales_f32();
        Linear { rows, cols, format: WeightFormat::Fp4 { data: Bytes::from(self.codes), scales, block_cols: block } }
    }
}
