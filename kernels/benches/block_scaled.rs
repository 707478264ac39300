//! V4.1's block-scaled product (FP8 activations × FP8 or FP4 weights, 32-wide
//! blocks): every path against the definition's loop, in one run.
//!
//! `cargo bench -p deepinfer-kernels --bench block_scaled [-- fp8|fp4] [--fastest]`
//! (`--fastest`: only the fastest path, for profilers).
//! Prints, per weight and batch, GB/s of weight codes read (batch 1: the
//! decode rate) and GMAC/s.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use deepinfer_kernels::act_quant::{quantized_linear_on, quantized_linear_reference, round_bf16};
use deepinfer_kernels::block_scaled::BlockPath;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::Linear;

/// Deterministic values in [-1, 1) (the tests' SplitMix64), rounded to bf16.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = common::Rng(seed);
    (0..len).map(|_| round_bf16(rng.uniform())).collect()
}

/// Seconds per call: the best of several runs, at least `budget` in all.
fn best_seconds(budget: Duration, mut run: impl FnMut()) -> f64 {
    run();
    let started = Instant::now();
    let mut best = f64::MAX;
    let mut runs = 0;
    while runs < 3 || (started.elapsed() < budget && runs < 200) {
        let t = Instant::now();
        run();
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    best
}

fn main() {
    let only: Option<String> = std::env::args().skip(1).find(|a| a == "fp8" || a == "fp4");
    let fastest_only = std::env::args().any(|a| a == "--fastest");
    let threads = rayon::current_num_threads();
    println!("# block-scaled product, {threads} thread(s), fastest path {:?}\n", BlockPath::detect());
    println!("| weight | rows × cols | n | path | GB/s of codes | GMAC/s | × definition |");
    println!("|---|---|---:|---|---:|---:|---:|");
    let shapes = [(1024usize, 1024usize), (4096, 2048)];
    for (rows, cols) in shapes {
        let w = values(rows * cols, 1);
        let weights: [(&str, Linear); 2] = [
            ("fp8", quantize_fp8_blocks(&w, rows, cols, 32).into_fp8_linear(rows, cols, 32)),
            ("fp4", quantize_fp4_rows(&w, rows, cols, 32).into_fp4_linear(rows, cols, 32)),
        ];
        for (name, lin) in weights.iter().filter(|(name, _)| only.as_deref().is_none_or(|o| o == *name)) {
            let code_bytes = if *name == "fp8" { rows * cols } else { rows * cols / 2 };
            for n in [1usize, 2, 4, 8, 16, 64] {
                let x = values(n * cols, 2);
                let budget = Duration::from_millis(400);
                let reference = if fastest_only {
                    f64::NAN
                } else {
                    best_seconds(budget, || {
                        black_box(quantized_linear_reference(lin, black_box(&x), n));
                    })
                };
                let mut rows_out = Vec::new();
                if !fastest_only {
                    rows_out.push(("definition".to_string(), reference));
                }
                let paths = BlockPath::ALL.into_iter().filter(|p| p.is_available());
                let paths: Vec<BlockPath> = if fastest_only { vec![BlockPath::detect()] } else { paths.collect() };
                for path in paths {
                    let s = best_seconds(budget, || {
                        black_box(quantized_linear_on(path, lin, black_box(&x), n));
                    });
                    rows_out.push((format!("{path:?}"), s));
                }
                for (label, s) in rows_out {
                    let gbs = code_bytes as f64 / s / 1e9;
                    let gmacs = (n * rows * cols) as f64 / s / 1e9;
                    println!(
                        "| {name} | {rows} × {cols} | {n} | {label} | {gbs:.2} | {gmacs:.2} | {:.1} |",
                        reference / s
                    );
                }
            }
        }
    }
}
