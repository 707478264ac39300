//! The interleaved FP4 layout: a rearrangement of the published pairs that
//! changes no value and no bit of any product.

mod common;

use bytes::Bytes;
use common::{assert_bits_eq, reference, Rng};
use deepinfer_kernels::fp4_layout::{deinterleave, interleave, interleaved_column, scale_fits_bf16_table};
use deepinfer_kernels::{Fp4Layout, Isa, Linear, WeightFormat};

#[test]
fn each_column_of_a_group_has_exactly_one_nibble() {
    let mut seen = [0u32; 128];
    for word in 0..32 {
        for nibble in 0..4 {
            seen[interleaved_column(word, nibble)] += 1;
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
}

#[test]
fn interleaving_keeps_every_code_in_its_column() {
    let mut rng = Rng(11);
    let pairs: Vec<u8> = (0..3 * 64 * 3).map(|_| rng.next_u64() as u8).collect();
    let interleaved = interleave(&pairs);
    assert_ne!(interleaved, pairs);
    assert_eq!(deinterleave(&interleaved), pairs);
    for c in 0..2 * pairs.len() {
        assert_eq!(Fp4Layout::Interleaved.code(&interleaved, c), Fp4Layout::Pairs.code(&pairs, c), "column {c}");
    }
}

#[test]
fn only_matrices_a_bf16_table_holds_exactly_are_interleaved() {
    let power = |exponent: u32| f32::from_bits(exponent << 23);
    let fits = vec![power(2), power(127), power(252)];
    assert!(Fp4Layout::interleavable(256, 32, &fits));
    assert_eq!(Fp4Layout::preferred(Isa::Avx512, 256, 32, &fits), Fp4Layout::Interleaved);
    for isa in [Isa::Portable, Isa::Avx2] {
        assert_eq!(Fp4Layout::preferred(isa, 256, 32, &fits), Fp4Layout::Pairs, "{isa:?}");
    }
    // 0.5 · 2^-126 would be subnormal, 6 · 2^126 infinite; 1.5 is not a power of two.
    for scale in [power(1), power(253), 1.5, -1.0, 0.0, f32::INFINITY, f32::NAN] {
        assert!(!scale_fits_bf16_table(scale), "{scale:e}");
        assert!(!Fp4Layout::interleavable(256, 32, &[1.0, scale]), "{scale:e}");
    }
    // Columns in whole 128-column groups, scale blocks in whole table lookups.
    assert!(!Fp4Layout::interleavable(192, 32, &fits));
    assert!(!Fp4Layout::interleavable(256, 16, &fits));
}

#[test]
#[should_panic(expected = "cannot be interleaved")]
fn a_scale_the_table_cannot_hold_is_refused() {
    let scales = vec![1.5f32; 8];
    WeightFormat::fp4_in(Fp4Layout::Interleaved, Bytes::from(vec![0u8; 128]), scales, 128, 32);
}

/// Every code, the extreme scales, signed zeros in x and the edge of overflow:
/// the interleaved kernels give the definition's bits on every path and batch.
#[test]
fn extreme_scales_keep_the_definition_on_every_path() {
    let (rows, cols, block) = (24, 512, 32);
    let mut rng = Rng(12);
    let pairs: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
    let scales: Vec<f32> =
        (0..rows * cols / block).map(|b| f32::from_bits([2, 3, 100, 127, 200, 251, 252][b % 7] << 23)).collect();
    let interleaved = Linear {
        rows,
        cols,
        format: WeightFormat::fp4_in(Fp4Layout::Interleaved, Bytes::from(pairs.clone()), scales.clone(), cols, block),
    };
    let in_pairs =
        Linear { rows, cols, format: WeightFormat::fp4_in(Fp4Layout::Pairs, Bytes::from(pairs), scales, cols, block) };
    let mut row = vec![0.0f32; cols];
    let mut pair_row = vec![0.0f32; cols];
    for r in 0..rows {
        interleaved.dequantize_row(r, &mut row);
        in_pairs.dequantize_row(r, &mut pair_row);
        assert_bits_eq(&row, &pair_row, &format!("row {r}"));
    }
    for n in [1, 2, 3, 4, 6, 9] {
        let mut x: Vec<f32> =
            (0..n * cols).map(|_| rng.weight() * 2f32.powi((rng.next_u64() % 40) as i32 - 30)).collect();
        x[0] = -0.0;
        x[1] = 1e-38;
        let want = reference(&in_pairs, &x, n);
        for isa in Isa::ALL.into_iter().filter(|isa| isa.is_available()) {
            let mut out = vec![f32::NAN; n * rows];
            interleaved.forward_with(isa, &x, n, &mut out);
            assert_bits_eq(&out, &want, &format!("{isa:?} n={n}"));
        }
    }
}
