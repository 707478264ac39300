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

/// One figure for each of V4.1's weight formats.
#[derive(Clone, Copy, Default)]
pub struct ByFormat {
    pub fp8: f64,
    pub fp4: f64,
    pub bf16: f64,
}

impl ByFormat {
    /// The figures with the names the tables print.
    pub fn named(&self) -> [(&'static str, f64); 3] {
        [
            ("fp8 weights × fp8 activations (exact block sums)", self.fp8),
            ("fp4 weights × fp8 activations (exact block sums)", self.fp4),
            ("bf16 weights (f64 accumulation)", self.bf16),
        ]
    }
}

/// A `rows × cols` weight in each of V4.1's formats, as its loader holds them
/// (the published layout; scale blocks 32 wide along K): FP8, FP4, BF16.
fn weights(values: &[f32], rows: usize, cols: usize) -> [Linear; 3] {
    let values = &values[..rows * cols];
    let bf16: Vec<u8> = values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
    [
        quantize_fp8_blocks(values, rows, cols, BLOCK).into_fp8_linear(rows, cols, BLOCK),
        quantize_fp4_rows(values, rows, cols, BLOCK).into_fp4_linear(rows, cols, BLOCK),
        Linear { rows, cols, format: WeightFormat::Bf16(bytes::Bytes::from(bf16)) },
    ]
}

/// `measure` of each format's weight, as a [`ByFormat`].
fn by_format(weights: [Linear; 3], measure: impl Fn(&Linear) -> f64) -> ByFormat {
    let [fp8, fp4, bf16] = weights.map(|lin| measure(&lin));
    ByFormat { fp8, fp4, bf16 }
}

/// Each V4.1 kernel's rate at n = 256, in GFLOP/s, best of a few runs.
pub fn kernel_gflops(values: &[f32]) -> ByFormat {
    const N: usize = 256;
    by_format(weights(values, 4096, 4096), |lin| {
        let x: Vec<f32> = (0..N * lin.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
        let secs = super::best_of(Duration::from_secs(3), || {
            let started = Instant::now();
            black_box(quantized_linear(lin, &x, N));
            started.elapsed()
        });
        2.0 * (N * lin.rows * lin.cols) as f64 / secs / 1e9
    })
}

/// Each V4.1 kernel's rate for one x row (a decode step at batch 1) on a
/// 256 × 2048 weight that stays in L2, in GB/s of weight bytes as published:
/// what a step could read if memory were free. One call is what the engine
/// makes per linear: the row's FP8 quantisation included.
pub fn one_row_gbs(values: &[f32]) -> ByFormat {
    const CALLS: usize = 200;
    by_format(weights(values, 256, 2048), |lin| {
        let x: Vec<f32> = (0..lin.cols).map(|i| ((i % 17) as f32 - 8.0) * 0.05).collect();
        let secs = super::best_of(Duration::from_secs(1), || {
            let started = Instant::now();
            for _ in 0..CALLS {
                black_box(quantized_linear(lin, &x, 1));
            }
            started.elapsed()
        });
        (CALLS * super::published_bytes(lin)) as f64 / secs / 1e9
    })
}
