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
use deepinfer_engine::model::{Chunk, LogitsWanted, Model, SequenceState};
use deepinfer_engine::presets::{build, Preset};
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Isa, Linear, WeightFormat};
use rayon::prelude::*;
use serde_json::{json, Value};

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
    for (name, lin) in decode_weights() {
        println!("| {name} | 1 | {:.1} |", decode_gbs(&lin));
    }

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
            rows.push(json!({
                "model": name, "phase": "prefill", "tokens": len, "tokens_per_s": tps, "gflops": gflops,
                "bound": "matmul", "fraction_of_bound": gflops / ceiling,
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
            rows.push(json!({
                "model": name, "phase": "decode", "batch": batch, "context_tokens": CONTEXT_TOKENS,
                "tokens_per_s": tps, "gflops": gflops, "weight_gbs": weight_gbs,
                "bound": weight_gbs.map(|_| "memory"), "fraction_of_bound": weight_gbs.map(|gbs| gbs / bandwidth),
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

fn decode_gbs(lin: &Linear) -> f64 {
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
    let codes = match &lin.clone().into_published().format {
        WeightFormat::Fp8 { data, .. } | WeightFormat::Fp4 { data, .. } => data.len(),
        _ => unreachable!("quantised weights"),
    };
    (CALLS * codes) as f64 / secs / 1e9
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
    if is_x86_feature_detected!("avx512f") {
        const ITERS: u64 = 20_000_000;
        let threads = rayon::current_num_threads() as u64;
        let secs = (0..5)
            .map(|_| {
                let started = Instant::now();
                // SAFETY: AVX-512F was detected just above.
                let sum: f32 = (0..threads).into_par_iter().map(|_| unsafe { fma_loop(ITERS) }).sum();
                black_box(sum);
                started.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min);
        return Some((threads * ITERS * 12 * 16 * 2) as f64 / secs / 1e9);
    }
    None
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
