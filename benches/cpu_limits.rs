//! The CPU engine against this machine's limits, measured in one run:
//! the memory read bandwidth (a streaming kernel), the matmul ceiling per
//! weight format (n = 256), and each preset's prefill and decode speed with
//! the fraction of the bound that applies (active multiply-adds / ceiling for
//! prefill, active weight bytes / bandwidth for decode).
//!
//! `cargo bench --bench cpu_limits [-- MODEL...]`, each MODEL a preset name or
//! a checkpoint directory (`deepinfer model init --preset medium-v4 --out DIR`
//! saves building the large preset in memory); set `RAYON_NUM_THREADS` for the
//! thread count. Models default to tiny-v4, small-v4 and medium-v4.
//!
//! With `CPU_LIMITS_JSON=PATH` the same numbers are also written to PATH as
//! one JSON object (the bounds, then a row per model and phase), for
//! `tools/bench/llamacpp.sh`, which sets it beside llama.cpp's own runs.
//!
//! The FMA rate (16-lane fused multiply-adds on registers, no memory) bounds
//! every matmul, batch-invariant or not: the matmul ceiling's share of it is
//! what the fixed reduction order could at most be costing.

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use deepinfer_engine::model::{Chunk, Footprint, LogitsWanted, Model, SequenceState};
use deepinfer_engine::presets::{build, Preset};
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Isa, Linear, WeightFormat};
use rayon::prelude::*;
use serde_json::{json, Value};

#[path = "cpu_limits/defined.rs"]
mod defined;

const CONTEXT_TOKENS: usize = 128;
/// Buffer of the bandwidth test: far larger than any last-level cache.
const STREAM_BYTES: usize = 1 << 30;

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let mut wanted: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    if wanted.is_empty() {
        wanted = ["tiny-v4", "small-v4", "medium-v4"].map(String::from).to_vec();
    }
    let threads = rayon::current_num_threads();
    println!("# CPU limits: {threads} thread(s), kernels on {:?}", Isa::detect());

    let bandwidth = read_bandwidth_gbs();
    println!("\nmemory read bandwidth: {bandwidth:.1} GB/s (best of 5 passes over 1 GiB)");
    let fma_peak = fma_peak_gflops();
    match fma_peak {
        Some(peak) => println!("FMA rate on registers: {peak:.1} GFLOP/s"),
        None => println!("FMA rate on registers: not measured (no AVX-512 here)"),
    }
    println!("\n| weights | n | GFLOP/s (4096 × 4096) | of the FMA rate |\n|---|---:|---:|---:|");
    let mut ceiling = 0.0f64;
    let mut ceilings = Vec::new();
    for (name, lin) in ceiling_weights() {
        let gflops = matmul_gflops(&lin, 256);
        ceiling = ceiling.max(gflops);
        ceilings.push(json!({"weights": name, "gflops": gflops}));
        let share = fma_peak.map_or(String::new(), |peak| format!("{:.0}%", 100.0 * gflops / peak));
        println!("| {name} | 256 | {gflops:.1} | {share} |");
    }

    println!("\n| weights (256 × 2048, in L2) | n | GB/s of codes decoded |\n|---|---:|---:|");
    // Each format's one-row rate in bytes as published, which prices a
    // decode step's weights by what the kernels can decode, memory aside.
    let mut v4_rates = OneRowRates { fp4_gbs: f64::NAN, other_gbs: f64::NAN };
    for (name, lin) in decode_weights() {
        let (codes_gbs, published_gbs) = decode_gbs(&lin);
        println!("| {name} | 1 | {codes_gbs:.1} |");
        match lin.clone().into_published().format {
            WeightFormat::Fp4 { .. } => v4_rates.fp4_gbs = published_gbs,
            _ => v4_rates.other_gbs = published_gbs,
        }
    }

    let v41 = defined_arithmetic(fma_peak, ceiling);
    let v41_rates = OneRowRates { fp4_gbs: v41.one_row.fp4, other_gbs: v41.one_row.fp8 };

    println!(
        "\n| model | phase | tokens/s | GFLOP/s | GB/s of weights | bound | fraction of bound |\n|---|---|---:|---:|---:|---|---:|"
    );
    let mut rows: Vec<Value> = Vec::new();
    for name in &wanted {
        let started = Instant::now();
        let (name, model) = match Preset::from_name(name) {
            Some(preset) => (preset.name().to_string(), build(preset, 1).expect("preset builds")),
            None => {
                let dir = std::path::Path::new(name);
                let label = dir.file_name().map_or(name.clone(), |f| f.to_string_lossy().into_owned());
                (label, Model::load(dir).unwrap_or_else(|e| panic!("{name}: {e}")))
            }
        };
        let built_s = started.elapsed().as_secs_f64();
        let f = model.footprint().expect("a V4 model with its experts");
        eprintln!(
            "{name}: ready in {built_s:.1} s; per token {:.1} MB of {:.1} MB weights, {:.1} M multiply-adds",
            f.active_bytes as f64 / 1e6,
            f.total_bytes as f64 / 1e6,
            f.active_macs as f64 / 1e6
        );
        for len in [128usize, 512] {
            let secs = time_prefill(&model, len);
            let tps = len as f64 / secs;
            let gflops = 2.0 * f.active_macs as f64 * tps / 1e9;
            println!(
                "| {name} | prefill {len} | {tps:.1} | {gflops:.1} | | matmul {ceiling:.0} GFLOP/s | {:.0}% |",
                100.0 * gflops / ceiling
            );
            // V4.1's arithmetic is defined (exact block sums, f64 sums): its
            // own kernels' rates at n = 256 bound it, each format for its share.
            let defined_tps = model.is_v41().then(|| v41.prefill_tokens_per_s(&f));
            if let Some(bound_tps) = defined_tps {
                println!(
                    "| {name} | prefill {len} | | | | V4.1 kernels at n = 256: {bound_tps:.1} tokens/s | {:.0}% |",
                    100.0 * tps / bound_tps
                );
            }
            rows.push(json!({
                "model": name, "phase": "prefill", "tokens": len, "tokens_per_s": tps, "gflops": gflops,
                "bound": "matmul", "fraction_of_bound": gflops / ceiling,
                "defined_kernels_tokens_per_s": defined_tps,
                "fraction_of_defined_kernels": defined_tps.map(|b| tps / b),
            }));
        }
        for batch in [1usize, 8, 32] {
            let secs = time_decode(&model, batch);
            let tps = batch as f64 / secs;
            let gflops = 2.0 * f.active_macs as f64 * tps / 1e9;
            // At batch 1 a step reads exactly one token's active weights.
            let weight_gbs = (batch == 1).then(|| f.active_bytes as f64 / secs / 1e9);
            let (gbs, fraction) = match weight_gbs {
                Some(gbs) => (format!("{gbs:.1}"), format!("{:.0}%", 100.0 * gbs / bandwidth)),
                None => (String::new(), String::new()),
            };
            let bound = if batch == 1 { format!("memory {bandwidth:.0} GB/s") } else { String::new() };
            println!("| {name} | decode, batch {batch} | {tps:.1} | {gflops:.1} | {gbs} | {bound} | {fraction} |");
            // What the one-row kernels could decode per second with memory
            // free: the bound that binds where it is below the memory's.
            let rates = if model.is_v41() { &v41_rates } else { &v4_rates };
            // The rates are one thread's (the weight is below the split
            // size); a step's large linears split over every thread.
            let kernel_tps = (batch == 1).then(|| threads as f64 * rates.tokens_per_s(&f));
            if let Some(bound_tps) = kernel_tps {
                println!(
                    "| {name} | decode, batch 1 | | | | one-row kernels in L2 × {threads} thread(s): {bound_tps:.1} tokens/s | {:.0}% |",
                    100.0 * tps / bound_tps
                );
            }
            rows.push(json!({
                "model": name, "phase": "decode", "batch": batch, "context_tokens": CONTEXT_TOKENS,
                "tokens_per_s": tps, "gflops": gflops, "weight_gbs": weight_gbs,
                "bound": weight_gbs.map(|_| "memory"), "fraction_of_bound": weight_gbs.map(|gbs| gbs / bandwidth),
                "kernels_tokens_per_s": kernel_tps, "fraction_of_kernels": kernel_tps.map(|b| tps / b),
            }));
        }
    }
    if let Some(path) = std::env::var_os("CPU_LIMITS_JSON") {
        let report = json!({
            "threads": threads,
            "isa": format!("{:?}", Isa::detect()),
            "bandwidth_gbs": bandwidth,
            "fma_gflops": fma_peak,
            "matmul_ceiling_gflops": ceiling,
            "matmul_ceilings": ceilings,
            "one_row_gbs": {"v4": v4_rates.to_json(), "v41": v41_rates.to_json()},
            "v41_defined": v41.to_json(),
            "rows": rows,
        });
        let text = serde_json::to_string_pretty(&report).expect("serializing a JSON value cannot fail");
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.to_string_lossy()));
    }
}

/// The fastest of a few timed runs of `f` (after one warm-up), in seconds,
/// running at least `budget` in all.
fn best_of(budget: Duration, mut setup_and_run: impl FnMut() -> Duration) -> f64 {
    setup_and_run();
    let started = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || (started.elapsed() < budget && runs < 50) {
        best = best.min(setup_and_run());
        runs += 1;
    }
    best.as_secs_f64()
}

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 2 + ((i * 7919 + salt * 104729) % 1000) as u32).collect()
}

fn time_prefill(model: &Model, len: usize) -> f64 {
    let tokens = prompt(len, 0);
    best_of(Duration::from_secs(3), || {
        let mut state = model.new_state();
        let started = Instant::now();
        black_box(model.forward(&mut [Chunk::new(&tokens, &mut state)], LogitsWanted::Last, false));
        started.elapsed()
    })
}

fn time_decode(model: &Model, batch: usize) -> f64 {
    let states: Vec<SequenceState> = (0..batch)
        .map(|b| {
            let mut state = model.new_state();
            model.forward(&mut [Chunk::new(&prompt(CONTEXT_TOKENS, b), &mut state)], LogitsWanted::None, false);
            state
        })
        .collect();
    let next: Vec<[u32; 1]> = (0..batch).map(|b| [2 + b as u32]).collect();
    best_of(Duration::from_secs(3), || {
        let mut states = states.clone();
        let mut chunks: Vec<Chunk> = states.iter_mut().zip(&next).map(|(s, t)| Chunk::new(&t[..], s)).collect();
        let started = Instant::now();
        black_box(model.forward(&mut chunks, LogitsWanted::Last, false));
        started.elapsed()
    })
}

/// Deterministic weights in [-0.5, 0.5) without structure the kernels could exploit.
fn weight_values(len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i * 2_654_435_761) % 1000) as f32 / 1000.0 - 0.5).collect()
}

/// One 4096 × 4096 weight per stored format, laid out for the kernels as a
/// loaded model's are.
fn ceiling_weights() -> Vec<(&'static str, Linear)> {
    let (rows, cols) = (4096, 4096);
    let values = weight_values(rows * cols);
    let bf16: Vec<u8> = values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
    vec![
        ("f32", Linear::from_f32(rows, cols, values.clone()).into_decode_layout()),
        ("bf16", Linear { rows, cols, format: WeightFormat::Bf16(Bytes::from(bf16)) }.into_decode_layout()),
        (
            "fp8 e4m3, 128 × 128 blocks",
            quantize_fp8_blocks(&values, rows, cols, 128).into_fp8_linear(rows, cols, 128).into_decode_layout(),
        ),
        (
            "fp4 e2m1, 32-column scales",
            quantize_fp4_rows(&values, rows, cols, 32).into_fp4_linear(rows, cols, 32).into_decode_layout(),
        ),
    ]
}

/// Small FP8 and FP4 weights that stay in L2: what the fused decode kernels
/// can read per second when memory is not the limit.
fn decode_weights() -> Vec<(&'static str, Linear)> {
    let (rows, cols) = (256, 2048);
    let values = weight_values(rows * cols);
    vec![
        (
            "fp8 e4m3, 128 × 128 blocks",
            quantize_fp8_blocks(&values, rows, cols, 128).into_fp8_linear(rows, cols, 128).into_decode_layout(),
        ),
        (
            "fp4 e2m1, 32-column scales",
            quantize_fp4_rows(&values, rows, cols, 32).into_fp4_linear(rows, cols, 32).into_decode_layout(),
        ),
    ]
}

/// GB/s of codes, and of codes and one byte per scale (as published).
fn decode_gbs(lin: &Linear) -> (f64, f64) {
    const CALLS: usize = 200;
    let x: Vec<f32> = (0..lin.cols).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; lin.rows];
    let secs = best_of(Duration::from_secs(1), || {
        let started = Instant::now();
        for _ in 0..CALLS {
            lin.forward(&x, 1, &mut out);
        }
        black_box(&out);
        started.elapsed()
    });
    let published = lin.clone().into_published();
    let codes = match &published.format {
        WeightFormat::Fp8 { data, .. } | WeightFormat::Fp4 { data, .. } => data.len(),
        _ => unreachable!("quantised weights"),
    };
    let per_second = CALLS as f64 / secs / 1e9;
    (codes as f64 * per_second, published_bytes(&published) as f64 * per_second)
}

/// Bytes of a weight in the published layout, as the models' footprints
/// count them: the codes (or plain values) and one byte per UE8M0 scale.
fn published_bytes(lin: &Linear) -> usize {
    match &lin.format {
        WeightFormat::Fp8 { data, scales, .. } | WeightFormat::Fp4 { data, scales, .. } => data.len() + scales.len(),
        WeightFormat::Bf16(data) => data.len(),
        WeightFormat::F32(values) => values.len() * 4,
        WeightFormat::Panels(panels) => panels.published_bytes(),
    }
}

/// One-row kernel rates by format, in GB/s of weights as published (codes
/// and one byte per scale), as the models' footprints count them.
struct OneRowRates {
    fp4_gbs: f64,
    /// FP8, and what else a step reads (bf16, f32: a small share), at FP8's rate.
    other_gbs: f64,
}

impl OneRowRates {
    /// Decode tokens/s at batch 1 if every active weight were decoded at its
    /// format's one-row rate from L2.
    fn tokens_per_s(&self, f: &Footprint) -> f64 {
        let fp4 = f.active_fp4_bytes as f64 / (self.fp4_gbs * 1e9);
        let other = (f.active_bytes - f.active_fp4_bytes) as f64 / (self.other_gbs * 1e9);
        1.0 / (fp4 + other)
    }

    fn to_json(&self) -> Value {
        json!({"fp4": self.fp4_gbs, "fp8_and_other": self.other_gbs})
    }
}

/// DeepSeek-V4.1's defined arithmetic measured: the f64 FMA rate, each
/// kernel at n = 256 and for one row.
struct DefinedArithmetic {
    fma_f64: Option<f64>,
    /// GFLOP/s at n = 256.
    kernels: defined::ByFormat,
    /// GB/s of weights for one x row, from L2.
    one_row: defined::ByFormat,
}

impl DefinedArithmetic {
    /// Prefill tokens/s if every multiply-add ran at its format's n = 256 rate
    /// (FP4 weights at FP4's, the rest at FP8's).
    fn prefill_tokens_per_s(&self, f: &Footprint) -> f64 {
        let fp4 = 2.0 * f.active_fp4_macs as f64 / (self.kernels.fp4 * 1e9);
        let other = 2.0 * (f.active_macs - f.active_fp4_macs) as f64 / (self.kernels.fp8 * 1e9);
        1.0 / (fp4 + other)
    }

    fn to_json(&self) -> Value {
        let named = |by: &defined::ByFormat| {
            by.named().iter().map(|(n, v)| json!({"weights": n, "value": v})).collect::<Vec<_>>()
        };
        json!({"fma_f64_gflops": self.fma_f64, "n256_gflops": named(&self.kernels), "one_row_gbs": named(&self.one_row)})
    }
}

/// Measures and prints [`DefinedArithmetic`] against the f32 FMA rate and
/// the f32 matmul ceiling of the same run.
fn defined_arithmetic(fma_f32: Option<f64>, ceiling: f64) -> DefinedArithmetic {
    let values = weight_values(4096 * 4096);
    let fma_f64 = defined::fma_f64_gflops();
    match (fma_f64, fma_f32) {
        (Some(f64_rate), Some(f32_rate)) => println!(
            "\nDeepSeek-V4.1 (defined arithmetic): f64 FMA rate on registers {f64_rate:.1} GFLOP/s ({:.0}% of the f32 rate)",
            100.0 * f64_rate / f32_rate
        ),
        _ => println!("\nDeepSeek-V4.1 (defined arithmetic): f64 FMA rate not measured (no AVX-512 here)"),
    }
    let kernels = defined::kernel_gflops(&values);
    println!("\n| V4.1 weights (4096 × 4096) | n | GFLOP/s | of the f64 FMA rate | of the f32 matmul ceiling |\n|---|---:|---:|---:|---:|");
    for (name, gflops) in kernels.named() {
        let share = fma_f64.map_or(String::new(), |peak| format!("{:.0}%", 100.0 * gflops / peak));
        println!("| {name} | 256 | {gflops:.1} | {share} | {:.0}% |", 100.0 * gflops / ceiling);
    }
    let one_row = defined::one_row_gbs(&values);
    println!("\n| V4.1 weights (256 × 2048, in L2) | n | GB/s of weights |\n|---|---:|---:|");
    for (name, gbs) in one_row.named() {
        println!("| {name} | 1 | {gbs:.1} |");
    }
    DefinedArithmetic { fma_f64, kernels, one_row }
}

fn matmul_gflops(lin: &Linear, n: usize) -> f64 {
    let x: Vec<f32> = (0..n * lin.cols).map(|i| (i % 17) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; n * lin.rows];
    let secs = best_of(Duration::from_secs(2), || {
        let started = Instant::now();
        lin.forward(&x, n, &mut out);
        black_box(&out);
        started.elapsed()
    });
    2.0 * (n * lin.rows * lin.cols) as f64 / secs / 1e9
}

/// Fused multiply-adds per second on registers alone (12 independent 16-lane
/// accumulators per thread, every thread of the pool), in GFLOP/s.
fn fma_peak_gflops() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `register_fma_gflops` runs the loop only where AVX-512F is detected.
    return register_fma_gflops(16, |iters| unsafe { fma_loop(iters) as f64 });
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// GFLOP/s of `fma_loop` (12 independent accumulators of `lanes` lanes,
/// `fma_loop(iters)` rounds of them) on every thread of the pool, best of 5;
/// `None` without AVX-512F, which the loops need.
#[cfg(target_arch = "x86_64")]
fn register_fma_gflops(lanes: u64, fma_loop: impl Fn(u64) -> f64 + Sync) -> Option<f64> {
    if !is_x86_feature_detected!("avx512f") {
        return None;
    }
    const ITERS: u64 = 20_000_000;
    let threads = rayon::current_num_threads() as u64;
    let secs = (0..5)
        .map(|_| {
            let started = Instant::now();
            let sum: f64 = (0..threads).into_par_iter().map(|_| fma_loop(ITERS)).sum();
            black_box(sum);
            started.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min);
    Some((threads * ITERS * 12 * lanes * 2) as f64 / secs / 1e9)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop(iters: u64) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(black_box(0.999_999)), _mm512_set1_ps(black_box(1e-7)));
    let mut acc = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    let mut lanes = [0.0f32; 16];
    _mm512_storeu_ps(lanes.as_mut_ptr(), acc.iter().fold(_mm512_setzero_ps(), |s, v| _mm512_add_ps(s, *v)));
    lanes.iter().sum()
}

/// Bytes read per second by a sum over a buffer far larger than the caches,
/// split over every thread of the pool.
fn read_bandwidth_gbs() -> f64 {
    let words = vec![1u64; STREAM_BYTES / 8];
    let threads = rayon::current_num_threads();
    let chunk = words.len().div_ceil(threads);
    let secs = (0..5)
        .map(|_| {
            let started = Instant::now();
            let sum: u64 = words.par_chunks(chunk).map(sum_words).sum();
            assert_eq!(black_box(sum), words.len() as u64);
            started.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min);
    STREAM_BYTES as f64 / secs / 1e9
}

fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU just above.
        return unsafe { sum_words_avx2(words) };
    }
    sum_words_portable(words)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u64]) -> u64 {
    sum_words_portable(words)
}

/// Eight independent lanes, so the compiler keeps several loads in flight.
#[inline(always)]
fn sum_words_portable(words: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    let mut blocks = words.chunks_exact(8);
    for block in &mut blocks {
        for (lane, w) in lanes.iter_mut().zip(block) {
            *lane = lane.wrapping_add(*w);
        }
    }
    lanes.iter().chain(blocks.remainder()).fold(0u64, |a, &b| a.wrapping_add(b))
}
