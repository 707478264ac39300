//! Dot products against a quantised weight's rows as bf16 values, decoded
//! inside the product, against the definition (rows dequantised, rounded to
//! bf16, then `dot_f64_rows`), bit for bit: every e4m3 code, scales at the
//! ends of the decoding path's range and outside it, inputs that are tiny,
//! huge, zero or infinite, partial runs of rows and a tail of columns.

mod common;

use bytes::Bytes;
use common::Rng;
use deepinfer_kernels::act_quant::{dot_f64_rows, round_bf16};
use deepinfer_kernels::dequantized_dot::{decodes_codes, dot_f64_dequantized_rows, dot_f64_dequantized_tokens};
use deepinfer_kernels::{Isa, Linear, WeightFormat};

fn no_nan(code: u8) -> u8 {
    if code & 0x7f == 0x7f {
        code - 1
    } else {
        code
    }
}

fn fp8(rng: &mut Rng, rows: usize, cols: usize, block: (usize, usize), scale: impl Fn(&mut Rng) -> f32) -> Linear {
    let data: Vec<u8> = (0..rows * cols).map(|_| no_nan(rng.next_u64() as u8)).collect();
    let scales = (0..rows.div_ceil(block.0) * cols.div_ceil(block.1)).map(|_| scale(rng)).collect();
    Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block.0, block.1) }
}

fn definition(x: &[f32], w: &Linear, first: usize, rows: usize) -> Vec<f64> {
    let mut values = vec![0.0f32; rows * w.cols];
    for (i, row) in values.chunks_exact_mut(w.cols).enumerate() {
        w.dequantize_row(first + i, row);
        row.iter_mut().for_each(|v| *v = round_bf16(*v));
    }
    let mut out = vec![0.0f64; rows];
    dot_f64_rows(x, &values, &mut out);
    out
}

fn assert_same(x: &[f32], w: &Linear, first: usize, rows: usize, what: &str) {
    let want = definition(x, w, first, rows);
    let mut got = vec![f64::NAN; rows];
    dot_f64_dequantized_rows(x, w, first, &mut got);
    for (i, (g, e)) in got.iter().zip(&want).enumerate() {
        let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
        assert!(same, "{what}: row {}: {g:e} vs {e:e}", first + i);
    }
}

fn avx512() -> bool {
    matches!(Isa::detect(), Isa::Avx512)
}

/// Inputs over 2^±40 with zeros and bf16 subnormals.
fn inputs(rng: &mut Rng, cols: usize) -> Vec<f32> {
    (0..cols)
        .map(|c| match c % 13 {
            3 => 0.0,
            7 => 2f32.powi(-130) * (1 + rng.next_u64() % 100) as f32,
            _ => round_bf16(rng.uniform() * 2f32.powi((rng.next_u64() % 81) as i32 - 40)),
        })
        .collect()
}

#[test]
fn decoded_codes_give_the_definitions_bits() {
    let mut rng = Rng(61);
    let power = |rng: &mut Rng| 2f32.powi((rng.next_u64() % 121) as i32 - 100);
    for (rows, cols) in [(1, 8), (4, 16), (7, 37), (33, 64), (70, 2048), (9, 2053)] {
        for block in [(32, 32), (1, 32), (3, 7), (128, 128)] {
            let w = fp8(&mut rng, rows, cols, block, power);
            let x = inputs(&mut rng, cols);
            for (first, count) in [(0, rows), (rows / 3, rows - rows / 3), (rows - 1, 1)] {
                let what = format!("{rows}x{cols} in {block:?} blocks, rows {first}..{}", first + count);
                assert!(decodes_codes(&x, &w, first, count) == avx512(), "{what}: path");
                assert_same(&x, &w, first, count, &what);
            }
        }
    }
}

/// A batch of tokens gives each token's own bits: groups of eight and their
/// remainders, columns in several tiles with a tail past the whole vectors,
/// runs of rows cut by the scale blocks, and one token whose input the codes
/// cannot take (so the batch takes the per-token path).
#[test]
fn batches_of_tokens_give_each_tokens_bits() {
    let mut rng = Rng(62);
    let power = |rng: &mut Rng| 2f32.powi((rng.next_u64() % 121) as i32 - 100);
    for (rows, cols, block) in [(5, 8, (32, 32)), (33, 1100, (3, 7)), (20, 2053, (128, 128)), (16, 64, (1, 32))] {
        let w = fp8(&mut rng, rows, cols, block, power);
        for tokens in [1, 2, 3, 8, 9, 17] {
            let xs: Vec<Vec<f32>> = (0..tokens).map(|_| inputs(&mut rng, cols)).collect();
            let mut with_nan = xs.clone();
            with_nan[tokens / 2][cols / 2] = f32::NAN;
            for (xs, what) in [(&xs, "finite"), (&with_nan, "one NaN")] {
                let refs: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
                for (first, count) in [(0, rows), (rows / 3, rows - rows / 3)] {
                    let what = format!("{rows}x{cols} in {block:?} blocks, {tokens} tokens ({what}), rows {first}..");
                    let mut got = vec![f64::NAN; tokens * count];
                    dot_f64_dequantized_tokens(&refs, &w, first, count, &mut got);
                    for (t, x) in xs.iter().enumerate() {
                        let mut want = vec![f64::NAN; count];
                        dot_f64_dequantized_rows(x, &w, first, &mut want);
                        let got = &got[t * count..][..count];
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(g, e)| g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()));
                        assert!(same, "{what}: token {t}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_code_at_the_ends_of_the_scale_range() {
    let cols = 256;
    let data: Vec<u8> = (0..=255u8).map(no_nan).collect();
    for exp in [-100, 20] {
        let w = Linear {
            rows: 1,
            cols,
            format: WeightFormat::fp8(Bytes::from(data.clone()), vec![2f32.powi(exp); 8], 1, 32),
        };
        for x in [vec![1.0f32; cols], vec![f32::MAX; cols], vec![f32::MIN_POSITIVE / 8.0; cols]] {
            assert!(decodes_codes(&x, &w, 0, 1) == avx512(), "scale 2^{exp}: path");
            assert_same(&x, &w, 0, 1, &format!("every code, scale 2^{exp}, x {:e}", x[0]));
        }
    }
}

/// A block scale drawn from the generator.
type ScaleOf = fn(&mut Rng) -> f32;

#[test]
fn what_the_codes_cannot_give_takes_the_decoded_rows() {
    let mut rng = Rng(62);
    let (rows, cols) = (12, 96);
    let cases: [(&str, ScaleOf); 3] = [
        ("scales not powers of two", |rng| 1.0 + rng.uniform().abs()),
        ("scales below the range", |_| 2f32.powi(-101)),
        ("scales above the range", |_| 2f32.powi(21)),
    ];
    for (what, scale) in cases {
        let w = fp8(&mut rng, rows, cols, (4, 32), scale);
        let x = inputs(&mut rng, cols);
        assert!(!decodes_codes(&x, &w, 0, rows), "{what}: path");
        assert_same(&x, &w, 0, rows, what);
    }
    let w = fp8(&mut rng, rows, cols, (4, 32), |_| 1.0);
    let mut x = inputs(&mut rng, cols);
    x[17] = f32::INFINITY;
    assert!(!decodes_codes(&x, &w, 0, rows), "an infinite input: path");
    assert_same(&x, &w, 0, rows, "an infinite input");
    let mut data = vec![0x38u8; rows * cols];
    data[5] = 0x7f;
    let nan = Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), vec![1.0; 3 * 3], 4, 32) };
    let x = inputs(&mut rng, cols);
    assert!(!decodes_codes(&x, &nan, 0, rows), "a NaN code: path");
    assert_same(&x, &nan, 0, rows, "a NaN code");
    let bf16 = common::bf16_linear(rows, cols, &rng.vec(rows * cols));
    assert!(!decodes_codes(&x, &bf16, 0, rows), "bf16 weights: path");
    assert_same(&x, &bf16, 0, rows, "bf16 weights");
}
