//! V4.1's block-scaled product on every path against its definition
//! (`quantized_linear_reference`), bit for bit: FP4 and FP8 weights, every
//! code, block scales that are and are not powers of two, activations that
//! quantise to e4m3 subnormals, shapes with partial digit groups and partial
//! vectors of blocks, batches of 1 to 17 rows (partial tiles of weight rows,
//! columns and x rows on the wide tiles).

mod common;

use bytes::Bytes;
use common::Rng;
use deepinfer_kernels::act_quant::{fp8_quantize_row, quantized_linear_on, quantized_linear_reference};
use deepinfer_kernels::block_scaled::{block_scaled_product, BlockPath};
use deepinfer_kernels::dtype::ue8m0_to_f32;
use deepinfer_kernels::{Linear, WeightFormat};

fn paths() -> Vec<BlockPath> {
    BlockPath::ALL.into_iter().filter(|p| p.is_available()).collect()
}

/// Activations spread over 2^±12 within a row (so a block's small values
/// quantise to e4m3 subnormals), with zeros and bf16 rounding.
fn activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    (0..n * cols)
        .map(|i| {
            let magnitude = 2f32.powi((rng.next_u64() % 25) as i32 - 12);
            let v = if i % 11 == 5 { 0.0 } else { rng.uniform() * magnitude };
            deepinfer_kernels::act_quant::round_bf16(v)
        })
        .collect()
}

/// Scales per block: powers of two as published, or any value (`odd`).
fn scales(rng: &mut Rng, count: usize, odd: bool) -> Vec<f32> {
    (0..count)
        .map(|_| {
            let power = ue8m0_to_f32(120 + (rng.next_u64() % 16) as u8);
            if odd {
                power * (1.0 + rng.uniform().abs())
            } else {
                power
            }
        })
        .collect()
}

fn fp4(rng: &mut Rng, rows: usize, cols: usize, odd: bool) -> Linear {
    let data: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
    let scales = scales(rng, rows * cols / 32, odd);
    Linear { rows, cols, format: WeightFormat::Fp4 { data: Bytes::from(data), scales, block_cols: 32 } }
}

fn fp8(rng: &mut Rng, rows: usize, cols: usize, block_rows: usize, odd: bool) -> Linear {
    // Every code but the two NaNs.
    let data: Vec<u8> = (0..rows * cols).map(|_| rng.next_u64() as u8).map(no_nan).collect();
    let scales = scales(rng, rows.div_ceil(block_rows) * cols / 32, odd);
    Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block_rows, 32) }
}

fn no_nan(code: u8) -> u8 {
    if code & 0x7f == 0x7f {
        code - 1
    } else {
        code
    }
}

fn assert_same(w: &Linear, x: &[f32], n: usize, what: &str) {
    let want = quantized_linear_reference(w, x, n);
    for path in paths() {
        let got = quantized_linear_on(path, w, x, n);
        assert_eq!(got.len(), want.len());
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
            assert!(same, "{what} on {path:?}: output {i} (row {}, column {}): {g:e} vs {e:e}", i / w.rows, i % w.rows);
        }
    }
}

/// (70, 64): more weight rows than one band of the outputs' transposition, and not a whole number of bands.
const SHAPES: [(usize, usize); 10] =
    [(1, 32), (3, 64), (5, 96), (17, 128), (4, 160), (9, 480), (2, 544), (33, 1024), (3, 2080), (70, 64)];

#[test]
fn fp4_weights_give_the_definitions_bits() {
    let mut rng = Rng(41);
    for (rows, cols) in SHAPES {
        for odd in [false, true] {
            let w = fp4(&mut rng, rows, cols, odd);
            for n in [1, 2, 3, 4, 5, 9, 17] {
                let x = activations(&mut rng, n, cols);
                assert_same(&w, &x, n, &format!("fp4 {rows}x{cols}, n {n}, odd scales {odd}"));
            }
        }
    }
}

#[test]
fn fp8_weights_give_the_definitions_bits() {
    let mut rng = Rng(42);
    for (rows, cols) in SHAPES {
        for (block_rows, odd) in [(32, false), (1, true), (3, false)] {
            let w = fp8(&mut rng, rows, cols, block_rows, odd);
            for n in [1, 2, 3, 4, 5, 9, 17] {
                let x = activations(&mut rng, n, cols);
                assert_same(&w, &x, n, &format!("fp8 {rows}x{cols} in {block_rows}-row blocks, n {n}"));
            }
        }
    }
}

/// The largest products and sums the formats allow: every activation ±448
/// after quantisation, every weight ±6 (FP4) or ±448 (FP8), all of one sign
/// and alternating.
#[test]
fn extreme_blocks_stay_exact() {
    for sign_flip in [false, true] {
        let cols = 256;
        let x: Vec<f32> = (0..cols).map(|c| if sign_flip && c % 2 == 1 { -448.0 } else { 448.0 }).collect();
        let fp4 = Linear {
            rows: 2,
            cols,
            format: WeightFormat::Fp4 {
                data: Bytes::from(vec![0x77u8; cols]),
                scales: vec![1.0; 2 * cols / 32],
                block_cols: 32,
            },
        };
        assert_batches(&fp4, &x, "fp4 at full scale");
        let fp8 = Linear {
            rows: 2,
            cols,
            format: WeightFormat::fp8(Bytes::from(vec![0x7eu8; 2 * cols]), vec![1.0; 8], 32, 32),
        };
        assert_batches(&fp8, &x, "fp8 at full scale");
        // A single huge product beside the smallest ones: the sum needs every bit.
        let mut tiny: Vec<f32> = vec![2f32.powi(-9) * 448.0 / 256.0; cols];
        tiny[0] = 448.0;
        assert_batches(&fp8, &tiny, "fp8 with subnormal activations");
        assert_batches(&fp4, &tiny, "fp4 with subnormal activations");
    }
}

/// `row` repeated as batches of 1, 2 and 17 rows: every kernel shape.
fn assert_batches(w: &Linear, row: &[f32], what: &str) {
    for n in [1, 2, 17] {
        let x: Vec<f32> = row.iter().copied().cycle().take(n * row.len()).collect();
        assert_same(w, &x, n, &format!("{what}, n {n}"));
    }
}

/// Inputs the fast paths hand back to the definition: a NaN weight code, a
/// non-finite activation.
#[test]
fn nan_codes_and_infinite_inputs_take_the_definition() {
    let mut rng = Rng(43);
    let cols = 128;
    let mut data: Vec<u8> = (0..4 * cols).map(|_| no_nan(rng.next_u64() as u8)).collect();
    data[70] = 0x7f;
    let with_nan = Linear { rows: 4, cols, format: WeightFormat::fp8(Bytes::from(data), vec![1.0; 4], 32, 32) };
    let x = activations(&mut rng, 2, cols);
    let acts: Vec<_> = x.chunks_exact(cols).map(fp8_quantize_row).collect();
    assert!(block_scaled_product(BlockPath::Portable, &with_nan, &acts).is_none());
    assert_same(&with_nan, &x, 2, "fp8 with a NaN code");
    let w = fp4(&mut rng, 4, cols, false);
    let mut x = activations(&mut rng, 2, cols);
    x[cols + 3] = f32::INFINITY;
    let acts: Vec<_> = x.chunks_exact(cols).map(fp8_quantize_row).collect();
    assert!(block_scaled_product(BlockPath::Portable, &w, &acts).is_none());
    assert_same(&w, &x, 2, "fp4 with an infinite activation");
}

/// The fast path is taken for ordinary inputs (so the tests above compare
/// it, not the definition with itself).
#[test]
fn ordinary_inputs_take_the_fast_path() {
    let mut rng = Rng(44);
    let w = fp4(&mut rng, 3, 64, false);
    let x = activations(&mut rng, 1, 64);
    let acts: Vec<_> = x.chunks_exact(64).map(fp8_quantize_row).collect();
    for path in paths() {
        assert!(block_scaled_product(path, &w, &acts).is_some(), "{path:?}");
    }
    let w = fp8(&mut rng, 3, 64, 32, false);
    for path in paths() {
        assert!(block_scaled_product(path, &w, &acts).is_some(), "{path:?}");
    }
}

/// No activation rows: an empty product on every path, not a panic.
#[test]
fn no_rows_give_an_empty_product() {
    let mut rng = Rng(45);
    for w in [fp4(&mut rng, 3, 64, false), fp8(&mut rng, 3, 64, 32, false)] {
        for path in paths() {
            assert_eq!(block_scaled_product(path, &w, &[]), Some(Vec::new()), "{path:?}");
        }
    }
}
