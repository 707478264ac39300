//! Scheduler time per step at batch 256, without the forward pass: forming
//! the batch, allocating blocks, prefix-cache bookkeeping and recording the
//! sampled tokens (`schedule` + `register_block` + `complete`).
//!
//! Run with `cargo bench -p deepinfer-engine --bench scheduler`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::Preset;
use deepinfer_engine::request::Request;
use deepinfer_engine::scheduler::{EngineConfig, SampledToken, Scheduler};

const BATCH: usize = 256;

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 2 + ((i * 2_654_435_761 + salt * 40_503) >> 9) as u32 % 1000).collect()
}

fn scheduler(mode: PrefixMode) -> Scheduler {
    let config = EngineConfig {
        max_batch_size: BATCH,
        max_batch_tokens: 8192,
        max_waiting: 1 << 16,
        // Accounting only: no memory is behind it.
        kv_budget_bytes: 1 << 40,
        prefix_mode: mode,
        ..EngineConfig::default()
    };
    Scheduler::new(&Preset::SmallV4.config(), config).expect("valid config")
}

/// One step as the engine drives it, with `token` as every sampled token.
fn step(s: &mut Scheduler, token: u32) -> usize {
    let plan = s.schedule();
    for item in &plan.items {
        for &k in &item.snapshots {
            black_box(s.register_block(item.id, k));
        }
    }
    let sampled: Vec<SampledToken> =
        plan.items.iter().filter(|i| i.sample).map(|i| SampledToken { id: i.id, token, ok: true }).collect();
    s.complete(&sampled).len()
}

/// 256 requests past their prompts, decoding.
fn decoding(mode: PrefixMode) -> Scheduler {
    let mut s = scheduler(mode);
    for i in 0..BATCH {
        let mut r = Request::new(prompt(512, i), 3000);
        r.ignore_eos = true;
        s.add(r).expect("accepted");
    }
    for t in 0..40 {
        step(&mut s, 2 + t);
    }
    assert_eq!(s.num_running(), BATCH);
    s
}

fn decode_steps(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_step_batch_256");
    g.measurement_time(Duration::from_secs(5));
    for mode in [PrefixMode::Off, PrefixMode::Exact] {
        g.bench_function(BenchmarkId::new("decode", mode.name()), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    // A fresh set every 2000 steps, well before the sequences end.
                    let n = left.min(2000);
                    let mut s = decoding(mode);
                    let start = Instant::now();
                    for t in 0..n {
                        black_box(step(&mut s, 2 + (t % 900) as u32));
                    }
                    total += start.elapsed();
                    left -= n;
                }
                total
            })
        });
    }
    // Churn: short requests finish every step and new ones are admitted with
    // chunked prefills and prefix hits on a shared 1280-token prefix (longer
    // than small-v4's 1016-token exact replay). Building the new requests is
    // the caller's work and stays outside the timing; `add` is inside.
    g.bench_function(BenchmarkId::new("mixed", "exact"), |b| {
        let shared = prompt(1280, 7);
        let make = |next: &mut usize| {
            (0..8)
                .map(|_| {
                    *next += 1;
                    let mut p = shared.clone();
                    p.extend(prompt(64 + *next % 700, *next));
                    let mut r = Request::new(p, 16 + *next % 48);
                    r.ignore_eos = true;
                    r
                })
                .collect::<Vec<_>>()
        };
        let arrive = |s: &mut Scheduler, mut new: Vec<Request>| {
            while s.num_waiting() < 32 {
                let Some(r) = new.pop() else { break };
                s.add(r).expect("accepted");
            }
            new
        };
        let mut next = 0usize;
        let mut s = scheduler(PrefixMode::Exact);
        for t in 0..200 {
            let new = make(&mut next);
            arrive(&mut s, new);
            step(&mut s, 2 + t);
        }
        let mut t = 0u32;
        b.iter_batched(
            || make(&mut next),
            |new| {
                let unused = arrive(&mut s, new);
                t = t.wrapping_add(1);
                black_box(step(&mut s, 2 + t % 900));
                unused
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, decode_steps);
criterion_main!(benches);
