//! The ceilings of DeepSeek-V4.1's defined arithmetic on this machine.
//!
//! V4.1's linears are defined bit for bit (ARCHITECTURE.md, "DeepSeek-V4.1"):
//! FP8 activations times FP8 or FP4 weights sum each 32-wide K block exactly
//! (in f64 lanes, or in integers for FP4 with VNNI) and chain the scaled
//! blocks in f32; BF16 weights accumulate every output in f64. The f32 matmul
//! ceiling of V4 is therefore not a bound this arithmetic can reach: an f64
//! multiply-add does eight products where an f32 one does sixteen. These rows
//! measure, in the same run, the rate the definition allows (the f64 FMA rate
//! on registers) and the rate each of V4.1's kernels reaches at n = 256, so a
//! V4.1 model's prefill can be read against both.

use std::hint::black_box;
use std::time::{Duration, Instant};

use deepinfer_kernels::act_quant::quantized_linear;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Linear, WeightFormat};

/// V4.1's activation and weight scale blocks along K.
const BLOCK: usize = 32;

/// f64 fused multiply-adds per second on registers alone (12 independent
/// 8-lane accumulators per thread, every thread of the pool), in GFLOP/s.
pub fn fma_f64_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `register_fma_gflops` runs the loop only where AVX-512F is detected.
    return super::register_fma_gflops(8, |iters| unsafe { fma_f64_loop(iters) });
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_f64_loop(iters: u64) -> f64 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_pd(black_box(0.999_999)), _mm512_set1_pd(black_box(1e-7)));
    let mut acc = [_mm512_set1_pd(1.0); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_pd(*v, a, b);
        }
    }
    let mut lanes = [0.0f64; 8];
    _mm512_storeu_pd(lanes.as_mut_ptr(), acc.iter().fold(_mm512_setzero_pd(), |s, v| _mm512_add_pd(s, *v)));
    lanes.iter().sum()
}

/// A `rows × cols` weight in each of V4.1's formats, as its loader holds them
/// (the published layout; scale blocks 32 wide along K).
fn weights(values: &[f32], rows: usize, cols: usize) -> Vec<(&'static str, Linear)> {
    let values = &values[..rows * cols];
    let bf16: Vec<u8> = values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
    vec![
        ("fp8 weights × fp8 activations (exact block sums)", {
            let q = quantize_fp8_blocks(values, rows, cols, BLOCK);
            q.into_fp8_linear(rows, cols, BLOCK)
        }),
        ("fp4 weights × fp8 activations (exact block sums)", {
            let q = quantize_fp4_rows(values, rows, cols, BLOCK);
            q.into_fp4_linear(rows, cols, BLOCK)
        }),
        (
            "bf16 weights (f64 accumulation)",
            Linear { rows, cols, format: WeightFormat::Bf16(bytes::Bytes::from(bf16)) },
        ),
    ]
}

/// Each V4.1 kernel's rate at n = 256, in GFLOP/s, best of a few runs.
pub fn kernel_gflops(values: &[f32]) -> Vec<(&'static str, f64)> {
    const N: usize = 256;
    weights(values, 4096, 4096)
        .into_iter()
        .map(|(name, lin)| {
            let x: Vec<f32> = (0..N * lin.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
            let mut best = Duration::MAX;
            let started = Instant::now();
            let mut runs = 0;
            while runs < 3 || (started.elapsed() < Duration::from_secs(3) && runs < 20) {
                let t = Instant::now();
                black_box(quantized_linear(&lin, &x, N));
                best = best.min(t.elapsed());
                runs += 1;
            }
            (name, 2.0 * (N * lin.rows * lin.cols) as f64 / best.as_secs_f64() / 1e9)
        })
        .collect()
}

/// Each V4.1 kernel's rate for one x row (a decode step at batch 1) on a
/// 256 × 2048 weight that stays in L2, in GB/s of weight bytes as published:
/// what a step could read if memory were free. One call is what the engine
/// makes per linear: the row's FP8 quantisation included.
pub fn one_row_gbs(values: &[f32]) -> Vec<(&'static str, f64)> {
    const CALLS: usize = 200;
    weights(values, 256, 2048)
        .into_iter()
        .map(|(name, lin)| {
            let x: Vec<f32> = (0..lin.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
            let mut best = Duration::MAX;
            let started = Instant::now();
            let mut runs = 0;
            while runs < 3 || (started.elapsed() < Duration::from_secs(1) && runs < 50) {
                let t = Instant::now();
                for _ in 0..CALLS {
                    black_box(quantized_linear(&lin, &x, 1));
                }
                best = best.min(t.elapsed());
                runs += 1;
            }
            (name, (CALLS * published_bytes(&lin)) as f64 / best.as_secs_f64() / 1e9)
        })
        .collect()
}

/// Bytes as published, as the models' footprints count them: the codes (or
/// bf16 values) and one byte per UE8M0 scale.
fn published_bytes(lin: &Linear) -> usize {
    match &lin.format {
        WeightFormat::Fp8 { data, scales, .. } | WeightFormat::Fp4 { data, scales, .. } => data.len() + scales.len(),
        WeightFormat::Bf16(data) => data.len(),
        _ => lin.storage_bytes(),
    }
}
