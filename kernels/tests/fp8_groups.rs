//! FP8 weights regrouped for the AVX-512 decode kernel: the same values, the
//! same bits out of every forward pass on every path (block scales on x and
//! on the weights alike), and the published layout back.

mod common;

use bytes::Bytes;
use common::Rng;
use deepinfer_kernels::fp8_groups::Fp8Groups;
use deepinfer_kernels::{Isa, Linear, WeightFormat};

fn available() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// Every code but the two NaNs.
fn codes(len: usize, rng: &mut Rng) -> Vec<u8> {
    (0..len).map(|_| rng.next_u64() as u8).map(|b| if b & 0x7f == 0x7f { b ^ 1 } else { b }).collect()
}

/// Scales of a `block_rows × block_cols` grid: powers of two (the published
/// UE8M0), ones too small to move onto x, and ones that are not powers of
/// two. Blocks shorter than a group repeat their group's scale, as a matrix
/// split from 128-row blocks does.
fn scale_grid(rows: usize, cols: usize, (block_rows, block_cols): (usize, usize), rng: &mut Rng) -> Vec<f32> {
    let col_blocks = cols.div_ceil(block_cols);
    let shared_rows = block_rows.max(8);
    let per_group: Vec<f32> = (0..rows.div_ceil(shared_rows) * col_blocks)
        .map(|b| match b % 9 {
            0 => 2f32.powi(-125),
            1 => 2f32.powi(5),
            2 => 0.3,
            3 => -0.25,
            4 => 0.0,
            5 => 1e-40,
            _ => 2f32.powi((rng.next_u64() % 20) as i32 - 14),
        })
        .collect();
    (0..rows.div_ceil(block_rows) * col_blocks)
        .map(|b| per_group[(b / col_blocks * block_rows / shared_rows) * col_blocks + b % col_blocks])
        .collect()
}

fn published(rows: usize, cols: usize, block: (usize, usize), rng: &mut Rng) -> Linear {
    let (data, scales) = (codes(rows * cols, rng), scale_grid(rows, cols, block, rng));
    Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block.0, block.1) }
}

fn grouped(lin: &Linear) -> Linear {
    let WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free } = &lin.format else {
        panic!("published fp8")
    };
    let groups = Fp8Groups::pack(lin.rows, lin.cols, data, scales, (*block_rows, *block_cols), *nan_free)
        .unwrap_or_else(|| panic!("{} × {} {block_rows}×{block_cols} qualifies", lin.rows, lin.cols));
    Linear { rows: lin.rows, cols: lin.cols, format: WeightFormat::Fp8Grouped(groups) }
}

/// x rows of ordinary size, with every third batch holding one row so large
/// that no block scale may move onto it.
fn inputs(n: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.weight() * 1e-2).collect();
    if n.is_multiple_of(3) {
        x[cols..2 * cols].iter_mut().for_each(|v| *v *= 1e36);
    }
    x
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

const SHAPES: [(usize, usize, (usize, usize)); 6] = [
    (1, 64, (128, 128)),
    (8, 128, (128, 128)),
    (13, 192, (1, 64)),
    (37, 256, (8, 128)),
    (40, 2048, (128, 128)),
    (24, 320, (16, 192)),
];

#[test]
fn grouped_weights_hold_the_published_values() {
    let mut rng = Rng(21);
    for (rows, cols, block) in SHAPES {
        let lin = published(rows, cols, block, &mut rng);
        let groups = grouped(&lin);
        let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
        for r in 0..rows {
            lin.dequantize_row(r, &mut want);
            groups.dequantize_row(r, &mut got);
            assert_eq!(bits(&got), bits(&want), "row {r} of {rows} × {cols}");
        }
        let WeightFormat::Fp8Grouped(groups) = &groups.format else { unreachable!() };
        let WeightFormat::Fp8 { data, scales, .. } = &lin.format else { unreachable!() };
        let (codes_back, scales_back) = groups.to_published();
        assert_eq!(&codes_back[..], &data[..], "codes of {rows} × {cols}");
        assert_eq!(bits(&scales_back), bits(scales), "scales of {rows} × {cols}");
    }
}

#[test]
fn grouped_forward_has_the_bits_of_the_published_layout_on_every_path() {
    let mut rng = Rng(22);
    for (rows, cols, block) in SHAPES {
        let lin = published(rows, cols, block, &mut rng);
        let groups = grouped(&lin);
        for n in (1..=9).chain([32]) {
            let x = inputs(n, cols, &mut rng);
            let mut want = vec![0.0f32; n * rows];
            lin.forward_with(Isa::Portable, &x, n, &mut want);
            for isa in available() {
                let mut got = vec![f32::NAN; n * rows];
                groups.forward_with(isa, &x, n, &mut got);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "{isa:?} {rows} × {cols} {block:?}, n = {n}, output {k}");
                }
            }
        }
    }
}

#[test]
fn grouped_forward_is_the_same_on_any_number_of_threads() {
    let mut rng = Rng(23);
    // Large enough to be split over threads (2^21 multiply-adds and more).
    let (rows, cols) = (1032, 2048);
    let groups = grouped(&published(rows, cols, (128, 128), &mut rng));
    for n in [1, 2, 3, 5] {
        let x = inputs(n, cols, &mut rng);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let mut out = vec![0.0f32; n * rows];
            pool.install(|| groups.forward(&x, n, &mut out));
            bits(&out)
        };
        let one = run(1);
        assert_eq!(run(3), one, "n = {n}");
    }
}

#[test]
fn weights_the_groups_cannot_hold_exactly_are_refused() {
    let mut rng = Rng(24);
    let (rows, cols) = (16, 256);
    let data = codes(rows * cols, &mut rng);
    let scales = vec![0.5f32; 4];
    let pack =
        |data: &[u8], scales: &[f32], block, nan_free| Fp8Groups::pack(rows, cols, data, scales, block, nan_free);
    assert!(pack(&data, &scales, (8, 128), true).is_some());
    assert!(pack(&data, &scales, (8, 128), false).is_none(), "codes that may hold a NaN");
    assert!(pack(&data, &[0.5; 32], (4, 32), true).is_none(), "32-column blocks");
    assert!(Fp8Groups::pack(rows, 96, &data, &scales, (8, 32), true).is_none(), "columns off the 64-column chunks");
    let mut split = vec![0.5f32; 8];
    split[2] = 0.25;
    assert!(pack(&data, &split, (4, 128), true).is_none(), "a group whose rows differ in scale");
    for bad in [64.0, -100.0, f32::INFINITY, f32::NAN] {
        let mut scales = scales.clone();
        scales[3] = bad;
        assert!(pack(&data, &scales, (8, 128), true).is_none(), "scale {bad}");
    }
}

#[test]
fn the_decode_layout_keeps_every_value() {
    let mut rng = Rng(25);
    let lin = published(24, 512, (128, 128), &mut rng);
    let regrouped = lin.clone().into_decode_layout();
    let on_avx512 = matches!(Isa::detect(), Isa::Avx512 | Isa::Avx512Vbmi);
    assert_eq!(matches!(regrouped.format, WeightFormat::Fp8Grouped(_)), on_avx512);
    let (mut want, mut got) = (vec![0.0f32; 512], vec![0.0f32; 512]);
    for r in 0..24 {
        lin.dequantize_row(r, &mut want);
        regrouped.dequantize_row(r, &mut got);
        assert_eq!(bits(&got), bits(&want), "row {r}");
    }
}
