//! Throughput of `Linear::forward` on a 4096 × 4096 weight in every format
//! (FP8 and FP4 both as published and regrouped for this CPU).
//!
//! Criterion's element rate is set to 2·n·rows·cols per call, so "elem/s" reads
//! as FLOP/s. Run with `cargo bench -p deepinfer-kernels --bench matmul`.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use deepinfer_kernels::dtype::f32_to_bf16;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Linear, WeightFormat};

const ROWS: usize = 4096;
const COLS: usize = 4096;

/// Deterministic values in roughly [-1, 1) (SplitMix64).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn weights() -> Vec<(&'static str, Linear)> {
    let w = values(ROWS * COLS, 1);
    let bf16: Vec<u8> = w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
    vec![
        ("f32", Linear::from_f32(ROWS, COLS, w.clone())),
        ("bf16", Linear { rows: ROWS, cols: COLS, format: WeightFormat::Bf16(Bytes::from(bf16)) }),
        ("fp8", quantize_fp8_blocks(&w, ROWS, COLS, 128).into_fp8_linear(ROWS, COLS, 128)),
        // The layouts the engine loads FP8 and FP4 in where AVX-512BW decodes them.
        (
            "fp8 regrouped",
            quantize_fp8_blocks(&w, ROWS, COLS, 128).into_fp8_linear(ROWS, COLS, 128).into_decode_layout(),
        ),
        ("fp4", quantize_fp4_rows(&w, ROWS, COLS, 32).into_fp4_linear(ROWS, COLS, 32)),
        ("fp4 regrouped", quantize_fp4_rows(&w, ROWS, COLS, 32).into_fp4_linear(ROWS, COLS, 32).into_decode_layout()),
    ]
}

fn linear_forward(c: &mut Criterion) {
    let mut group = c.benchmark_group("linear_forward_4096x4096");
    group.sample_size(10).warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(2));
    for (name, lin) in weights() {
        // FP8 and FP4 also at the small batches where their decode kernels change.
        let batches: &[usize] = if name.starts_with("fp") { &[1, 2, 3, 4, 6, 8, 32, 256] } else { &[1, 32, 256] };
        for &n in batches {
            let x = values(n * COLS, 2);
            let mut out = vec![0.0f32; n * ROWS];
            group.throughput(Throughput::Elements((2 * n * ROWS * COLS) as u64));
            group.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter(|| lin.forward(black_box(&x), n, black_box(&mut out)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, linear_forward);
criterion_main!(benches);
