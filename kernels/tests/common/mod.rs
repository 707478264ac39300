//! Shared helpers: a deterministic generator and weights in every format.
#![allow(dead_code)]

use bytes::Bytes;
use deepinfer_kernels::dtype::{f32_to_bf16, FP4_E2M1_VALUES};
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Linear, WeightFormat};

/// SplitMix64: reproducible test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Roughly normal, with occasional outliers so blocks get different scales.
    pub fn weight(&mut self) -> f32 {
        let v = (0..4).map(|_| self.uniform()).sum::<f32>();
        if self.next_u64().is_multiple_of(61) {
            v * 40.0
        } else {
            v
        }
    }

    pub fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.weight()).collect()
    }
}

pub fn bf16_linear(rows: usize, cols: usize, w: &[f32]) -> Linear {
    let bytes: Vec<u8> = w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
    Linear { rows, cols, format: WeightFormat::Bf16(Bytes::from(bytes)) }
}

pub fn fp8_linear(rows: usize, cols: usize, w: &[f32], block: usize) -> Linear {
    quantize_fp8_blocks(w, rows, cols, block).into_fp8_linear(rows, cols, block)
}

pub fn fp4_linear(rows: usize, cols: usize, w: &[f32], block: usize) -> Linear {
    quantize_fp4_rows(w, rows, cols, block).into_fp4_linear(rows, cols, block)
}

/// `len` random FP8 e4m3 codes, none of them NaN (0x7f, 0xff).
pub fn fp8_codes_without_nan(len: usize, rng: &mut Rng) -> Vec<u8> {
    (0..len)
        .map(|_| loop {
            let b = rng.next_u64() as u8;
            if b & 0x7f != 0x7f {
                break b;
            }
        })
        .collect()
}

/// Raw FP8 codes (no NaN) with rectangular `block_rows × block_cols` scale blocks.
pub fn fp8_raw_linear(rows: usize, cols: usize, block_rows: usize, block_cols: usize, rng: &mut Rng) -> Linear {
    let data = fp8_codes_without_nan(rows * cols, rng);
    let blocks = rows.div_ceil(block_rows) * cols.div_ceil(block_cols);
    let scales = (0..blocks).map(|_| 2f32.powi((rng.next_u64() % 12) as i32 - 8)).collect();
    Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block_rows, block_cols) }
}

/// Every format (and a few block layouts) of a `rows × cols` matrix. FP4 needs an
/// even `cols`; it is skipped otherwise, and only block sizes dividing `cols` are used.
pub fn all_formats(rows: usize, cols: usize, rng: &mut Rng) -> Vec<(String, Linear)> {
    let w = rng.vec(rows * cols);
    let mut out = vec![
        ("f32".to_string(), Linear::from_f32(rows, cols, w.clone())),
        ("bf16".to_string(), bf16_linear(rows, cols, &w)),
        ("fp8/128".to_string(), fp8_linear(rows, cols, &w, 128)),
        ("fp8/7".to_string(), fp8_linear(rows, cols, &w, 7)),
        ("fp8-raw/5x24".to_string(), fp8_raw_linear(rows, cols, 5, 24, rng)),
    ];
    if cols.is_multiple_of(2) {
        for block in [32, 16, 6, 3, 2] {
            if cols.is_multiple_of(block) {
                out.push((format!("fp4/{block}"), fp4_linear(rows, cols, &w, block)));
            }
        }
    }
    out
}

/// Output by definition, written out longhand: FP4 rows sum each scale block
/// as a chain of x times the e2m1 values from +0.0 and add the block sums
/// times their scales in order; every other format is one chain of x times
/// the dequantised weights from +0.0, column by column. Checks the library's
/// own `forward_reference` against it on the way.
pub fn reference(lin: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    let published = lin.clone().into_published();
    let (rows, cols) = (lin.rows, lin.cols);
    let mut out = vec![0.0f32; n * rows];
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        published.dequantize_row(r, &mut row);
        for i in 0..n {
            let xi = &x[i * cols..][..cols];
            out[i * rows + r] = match &published.format {
                WeightFormat::Fp4 { data, scales, block_cols } => {
                    let value = |c: usize| {
                        let byte = data[(r * cols + c) / 2];
                        FP4_E2M1_VALUES[if c.is_multiple_of(2) { byte & 15 } else { byte >> 4 } as usize]
                    };
                    let mut total = 0.0f32;
                    for b in 0..cols / block_cols {
                        let mut sum = 0.0f32;
                        for (c, &xc) in xi.iter().enumerate().skip(b * block_cols).take(*block_cols) {
                            sum = xc.mul_add(value(c), sum);
                        }
                        total = sum.mul_add(scales[r * (cols / block_cols) + b], total);
                    }
                    total
                }
                _ => {
                    let mut acc = 0.0f32;
                    for (&xc, &wc) in xi.iter().zip(&row) {
                        acc = xc.mul_add(wc, acc);
                    }
                    acc
                }
            };
        }
    }
    let library = lin.forward_reference(x, n);
    let same = |a: &f32, b: &f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    assert!(out.iter().zip(&library).all(|(a, b)| same(a, b)), "forward_reference leaves the definition");
    out
}

pub fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {k}: {g:e} vs {w:e}");
    }
}
