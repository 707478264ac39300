//! Round-trip error of the checkpoint quantisers.

mod common;

use common::Rng;
use deepinfer_kernels::dtype::FP4_E2M1_VALUES;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};

/// Weights with a spread of magnitudes: some blocks tiny, some with outliers.
fn weights(rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let band = [1e-3, 1.0, 300.0, 1e4][(i / 37) % 4];
            rng.weight() * band
        })
        .collect()
}

#[test]
fn fp8_round_trip_error_is_within_a_sixteenth_of_the_block_max() {
    let mut rng = Rng(10);
    for (rows, cols, block) in [(130, 300, 128), (37, 50, 16), (5, 9, 4)] {
        let w = weights(rows, cols, &mut rng);
        let lin = quantize_fp8_blocks(&w, rows, cols, block).into_fp8_linear(rows, cols, block);
        let mut deq = vec![0.0f32; rows * cols];
        for (r, row) in deq.chunks_exact_mut(cols).enumerate() {
            lin.dequantize_row(r, row);
        }
        for br in 0..rows.div_ceil(block) {
            for bc in 0..cols.div_ceil(block) {
                let cells: Vec<usize> = (br * block..((br + 1) * block).min(rows))
                    .flat_map(|r| (bc * block..((bc + 1) * block).min(cols)).map(move |c| r * cols + c))
                    .collect();
                let max = cells.iter().fold(0.0f32, |m, &k| m.max(w[k].abs()));
                for &k in &cells {
                    let err = (w[k] - deq[k]).abs();
                    // e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of the
                    // value, and the block's scale keeps every value in range.
                    assert!(err <= max / 16.0, "block ({br},{bc}) elem {k}: {} -> {}", w[k], deq[k]);
                    assert!(err <= w[k].abs() / 16.0 + max / 16.0 / 1024.0, "relative error at {k}");
                }
            }
        }
    }
}

#[test]
fn fp4_round_trip_error_is_within_half_a_grid_step() {
    let grid = &FP4_E2M1_VALUES[..8]; // 0, 0.5, 1, 1.5, 2, 3, 4, 6
    let mut rng = Rng(11);
    for (rows, cols, block) in [(33, 96, 32), (4, 64, 16), (3, 12, 6)] {
        let w = weights(rows, cols, &mut rng);
        let q = quantize_fp4_rows(&w, rows, cols, block);
        let scales: Vec<f32> = q.scales.iter().map(|&s| deepinfer_kernels::dtype::ue8m0_to_f32(s)).collect();
        let lin = q.into_fp4_linear(rows, cols, block);
        let mut row = vec![0.0f32; cols];
        for r in 0..rows {
            lin.dequantize_row(r, &mut row);
            for c in 0..cols {
                let s = scales[r * (cols / block) + c / block];
                let v = (w[r * cols + c] / s).abs();
                assert!(v <= 6.0, "scale too small at ({r},{c})");
                // The grid interval holding |w / s|, and half its width in weight units.
                let upper = grid.iter().position(|&g| g >= v).unwrap();
                let half_step = if upper == 0 { 0.0 } else { (grid[upper] - grid[upper - 1]) / 2.0 };
                let err = (w[r * cols + c] - row[c]).abs();
                assert!(err <= half_step * s, "({r},{c}): {} -> {} (scale {s})", w[r * cols + c], row[c]);
            }
        }
    }
}
