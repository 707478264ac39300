//! FP4 weights regrouped for the AVX-512 decode kernel: the same values, the
//! same bits out of every forward pass on every path, and the published
//! layout back.

mod common;

use bytes::Bytes;
use common::Rng;
use deepinfer_kernels::fp4_groups::Fp4Groups;
use deepinfer_kernels::{Isa, Linear, WeightFormat};

fn available() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// Random codes (every code appears) and power-of-two scales whose exponents
/// reach both ends of the range the groups keep.
fn published(rows: usize, cols: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let data: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next_u64() as u8).collect();
    let scales = (0..rows * cols / 32)
        .map(|b| match b % 7 {
            0 => 2f32.powi(-125),
            1 => 2f32.powi(125),
            _ => 2f32.powi((rng.next_u64() % 21) as i32 - 10),
        })
        .collect();
    (data, scales)
}

fn both(rows: usize, cols: usize, rng: &mut Rng) -> (Linear, Linear) {
    let (data, scales) = published(rows, cols, rng);
    let groups = Fp4Groups::pack(rows, cols, &data, &scales, 32).expect("qualifies");
    let pairs = Linear { rows, cols, format: WeightFormat::Fp4 { data: Bytes::from(data), scales, block_cols: 32 } };
    (pairs, Linear { rows, cols, format: WeightFormat::Fp4Grouped(groups) })
}

/// Inputs small enough that no product overflows at the largest scale.
fn inputs(len: usize, rng: &mut Rng) -> Vec<f32> {
    (0..len).map(|_| rng.weight() * 1e-3).collect()
}

#[test]
fn grouped_weights_hold_the_published_values() {
    let mut rng = Rng(11);
    for (rows, cols) in [(1, 128), (8, 256), (13, 384), (37, 128)] {
        let (data, scales) = published(rows, cols, &mut rng);
        let groups = Fp4Groups::pack(rows, cols, &data, &scales, 32).expect("qualifies");
        assert_eq!(groups.to_published(), (data.clone(), scales.clone()), "{rows} × {cols}");
        let pairs =
            Linear { rows, cols, format: WeightFormat::Fp4 { data: Bytes::from(data), scales, block_cols: 32 } };
        let grouped = Linear { rows, cols, format: WeightFormat::Fp4Grouped(groups) };
        let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
        for r in 0..rows {
            pairs.dequantize_row(r, &mut want);
            grouped.dequantize_row(r, &mut got);
            let (want, got): (Vec<u32>, Vec<u32>) =
                (want.iter().map(|v| v.to_bits()).collect(), got.iter().map(|v| v.to_bits()).collect());
            assert_eq!(got, want, "row {r} of {rows} × {cols}");
        }
    }
}

#[test]
fn grouped_forward_has_the_bits_of_the_published_layout_on_every_path() {
    let mut rng = Rng(12);
    // Row counts on both sides of the grouped kernel's crossover at every width.
    for (rows, cols) in [(1, 128), (9, 256), (21, 384), (17, 512), (24, 1024), (40, 2048)] {
        let (pairs, grouped) = both(rows, cols, &mut rng);
        for n in 1..=14 {
            let x = inputs(n * cols, &mut rng);
            let mut want = vec![0.0f32; n * rows];
            pairs.forward_with(Isa::Portable, &x, n, &mut want);
            for isa in available() {
                let mut got = vec![f32::NAN; n * rows];
                grouped.forward_with(isa, &x, n, &mut got);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} {rows} × {cols}, n = {n}, output {k}");
                }
            }
        }
    }
}

#[test]
fn grouped_forward_is_the_same_on_any_number_of_threads() {
    let mut rng = Rng(13);
    // Large enough to be split over threads (2^21 multiply-adds and more).
    let (rows, cols) = (1032, 2048);
    let (_, grouped) = both(rows, cols, &mut rng);
    for n in [1, 2, 3] {
        let x = inputs(n * cols, &mut rng);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let mut out = vec![0.0f32; n * rows];
            pool.install(|| grouped.forward(&x, n, &mut out));
            out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let one = run(1);
        assert_eq!(run(3), one, "n = {n}");
    }
}

#[test]
fn weights_the_groups_cannot_hold_exactly_are_refused() {
    let mut rng = Rng(14);
    let (rows, cols) = (4, 256);
    let (data, scales) = published(rows, cols, &mut rng);
    assert!(Fp4Groups::pack(rows, cols, &data, &scales, 32).is_some());
    assert!(Fp4Groups::pack(rows, cols, &data, &scales, 16).is_none(), "16-column scales");
    assert!(Fp4Groups::pack(rows, 96, &data, &scales, 32).is_none(), "columns off the 128-column chunks");
    for bad in [1.5, 2f32.powi(126), 2f32.powi(-126), -1.0, 0.0, f32::INFINITY, f32::NAN] {
        let mut scales = scales.clone();
        scales[5] = bad;
        assert!(Fp4Groups::pack(rows, cols, &data, &scales, 32).is_none(), "scale {bad}");
    }
}

#[test]
fn the_decode_layout_keeps_every_value() {
    let mut rng = Rng(15);
    let (pairs, _) = both(24, 512, &mut rng);
    let regrouped = pairs.clone().into_decode_layout();
    let on_avx512 = matches!(Isa::detect(), Isa::Avx512 | Isa::Avx512Vbmi);
    assert_eq!(matches!(regrouped.format, WeightFormat::Fp4Grouped(_)), on_avx512);
    let (mut want, mut got) = (vec![0.0f32; 512], vec![0.0f32; 512]);
    for r in 0..24 {
        pairs.dequantize_row(r, &mut want);
        regrouped.dequantize_row(r, &mut got);
        assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "row {r}");
    }
}
