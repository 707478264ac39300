//! End-to-end serving measurements, printed as Markdown tables:
//!
//! - `throughput`: generated tokens per second at batch 1, 8, 32, 128.
//! - `ttft`: time to first token for a request whose long prefix is cached,
//!   cold and with exact and bounded replay.
//! - `replay`: how far bounded-replay outputs are from cold ones (tiny-v4).
//!
//! These workloads take seconds to minutes each, so they are timed directly
//! rather than sampled by criterion. Run all with
//! `cargo bench -p deepinfer-engine --bench serving`, or one part with
//! `… -- throughput`; `DEEPINFER_BENCH_PRESETS=tiny-v4` limits the models.

use std::time::Instant;

use deepinfer_engine::engine::{Completion, Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::Request;

fn tokens(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 2 + ((i * 2_654_435_761 + salt * 40_503) >> 9) as u32 % 1000).collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    let mut r = Request::new(prompt, max_tokens);
    r.ignore_eos = true;
    r
}

fn config(mode: PrefixMode, batch: usize) -> EngineConfig {
    EngineConfig { prefix_mode: mode, max_batch_size: batch, max_batch_tokens: 2048, ..EngineConfig::default() }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `batch` requests of `prompt` tokens each generating `new` tokens, all at once.
fn throughput(model: &Model, name: &str, prompt: usize, new: usize) {
    println!("\n### Throughput, {name} (prompt {prompt} tokens, {new} new tokens per request, greedy)\n");
    println!("| batch | wall s | steps | generated tokens/s | all tokens/s | decode tokens/s |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for batch in [1, 8, 32, 128] {
        let mut engine = Engine::new(model, config(PrefixMode::Off, batch)).unwrap();
        for i in 0..batch {
            engine.add_request(request(tokens(prompt, i), new)).unwrap();
        }
        let start = Instant::now();
        let (mut decode_secs, mut decode_tokens) = (0.0, 0usize);
        while engine.has_work() {
            let computed = engine.scheduler().stats().computed_tokens;
            let t = Instant::now();
            let updates = engine.step();
            let fed = engine.scheduler().stats().computed_tokens - computed;
            // A pure decode step feeds exactly one token per sequence and samples each.
            if fed as usize == updates.len() && updates.len() == batch {
                decode_secs += t.elapsed().as_secs_f64();
                decode_tokens += updates.len();
            }
        }
        let wall = start.elapsed().as_secs_f64();
        let generated = batch * new;
        println!(
            "| {batch} | {wall:.2} | {} | {:.1} | {:.1} | {:.1} |",
            engine.scheduler().stats().steps,
            generated as f64 / wall,
            (batch * (prompt + new)) as f64 / wall,
            decode_tokens as f64 / decode_secs.max(1e-9),
        );
    }
}

/// Time to first token of `prefix + suffix` with the prefix cached (or not).
fn ttft(model: &Model, name: &str, prefix: usize, suffix: usize, repeats: usize) {
    println!("\n### Time to first token, {name} (shared prefix {prefix} tokens + {suffix} new, median of {repeats})\n");
    println!("| mode | prefix hit tokens | replayed tokens | tokens computed | TTFT ms |");
    println!("|---|---:|---:|---:|---:|");
    let shared = tokens(prefix, 1);
    let with_suffix = |salt| {
        let mut p = shared.clone();
        p.extend(tokens(suffix, salt));
        request(p, 1)
    };
    for (label, mode) in
        [("cold (no hit)", PrefixMode::Off), ("exact hit", PrefixMode::Exact), ("bounded hit", PrefixMode::Bounded)]
    {
        let mut times = Vec::new();
        let mut row = (0, 0, 0);
        for r in 0..repeats {
            let mut engine = Engine::new(model, config(mode, 8)).unwrap();
            if mode != PrefixMode::Off {
                engine.add_request(with_suffix(1000 + r)).unwrap();
                engine.run_to_completion();
            }
            let before = engine.scheduler().stats().computed_tokens;
            let hits = engine.scheduler().prefix_stats().hit_tokens;
            let start = Instant::now();
            engine.add_request(with_suffix(r)).unwrap();
            let done = engine.run_to_completion();
            times.push(start.elapsed().as_secs_f64() * 1e3);
            assert_eq!(done.values().next().unwrap().tokens.len(), 1);
            row = (
                engine.scheduler().prefix_stats().hit_tokens - hits,
                if mode == PrefixMode::Off { 0 } else { engine.scheduler().replay_tokens() },
                engine.scheduler().stats().computed_tokens - before,
            );
        }
        println!("| {label} | {} | {} | {} | {:.1} |", row.0, row.1, row.2, median(times));
    }
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = l.iter().map(|&v| (v as f64 - max).exp()).sum();
    l.iter().map(|&v| v as f64 - max - sum.ln()).collect()
}

fn argmax(l: &[f32]) -> usize {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b })
}

/// Requests sharing a cached prefix: outputs with exact and bounded replay against cold runs.
fn replay_quality(model: &Model, name: &str, prefix: usize, requests: usize, new: usize) {
    println!("\n### Bounded vs exact replay, {name} ({requests} requests sharing a {prefix}-token prefix, {new} greedy tokens each)\n");
    let shared = tokens(prefix, 2);
    let reqs: Vec<Request> = (0..requests)
        .map(|i| {
            let mut p = shared.clone();
            p.extend(tokens(8 + i % 24, 500 + i));
            let mut r = request(p, new);
            r.return_logits = true;
            r
        })
        .collect();
    let run = |mode: PrefixMode| -> Vec<Completion> {
        let mut engine = Engine::new(model, config(mode, 64)).unwrap();
        // The first request fills the cache; the rest hit it.
        let mut out = Vec::new();
        for chunk in [&reqs[..1], &reqs[1..]] {
            let ids: Vec<_> = chunk.iter().map(|r| engine.add_request(r.clone()).unwrap()).collect();
            let mut done = engine.run_to_completion();
            out.extend(ids.iter().map(|id| done.remove(id).unwrap()));
        }
        out
    };
    let cold = run(PrefixMode::Off);
    println!("| mode | replayed tokens | first token: max abs Δlogit | mean abs Δlogit | mean KL(cold‖hit) nats | same argmax | identical {new}-token outputs | mean first divergence |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for mode in [PrefixMode::Exact, PrefixMode::Bounded] {
        let hit = run(mode);
        let (mut max_d, mut sum_d, mut n_d, mut kl, mut same_argmax, mut identical, mut diverge) =
            (0f32, 0f64, 0usize, 0f64, 0usize, 0usize, 0usize);
        for (c, h) in cold.iter().zip(&hit).skip(1) {
            let (lc, lh) = (c.tokens[0].logits.as_ref().unwrap(), h.tokens[0].logits.as_ref().unwrap());
            for (a, b) in lc.iter().zip(lh) {
                max_d = max_d.max((a - b).abs());
                sum_d += f64::from((a - b).abs());
                n_d += 1;
            }
            let (pc, ph) = (log_softmax(lc), log_softmax(lh));
            kl += pc.iter().zip(&ph).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
            same_argmax += usize::from(argmax(lc) == argmax(lh));
            let (tc, th) = (c.token_ids(), h.token_ids());
            identical += usize::from(tc == th);
            diverge += tc.iter().zip(&th).position(|(a, b)| a != b).unwrap_or(new);
        }
        let n = requests - 1;
        println!(
            "| {} | {} | {max_d:.3e} | {:.3e} | {:.3e} | {same_argmax}/{n} | {identical}/{n} | {:.1} |",
            mode.name(),
            Engine::new(model, config(mode, 1)).unwrap().scheduler().replay_tokens(),
            sum_d / n_d as f64,
            kl / n as f64,
            diverge as f64 / n as f64,
        );
    }
    let spread = {
        let l = cold[1].tokens[0].logits.as_ref().unwrap();
        let mean = l.iter().map(|&v| f64::from(v)).sum::<f64>() / l.len() as f64;
        (l.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / l.len() as f64).sqrt()
    };
    println!("\n(standard deviation of a cold first-token logits row: {spread:.3})");
}

fn main() {
    let part = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let wanted = |p: &str| part.as_deref().is_none_or(|w| w == p);
    let presets = std::env::var("DEEPINFER_BENCH_PRESETS").unwrap_or_else(|_| "tiny-v4,small-v4".into());
    for name in presets.split(',') {
        let preset = Preset::from_name(name).unwrap_or_else(|| panic!("unknown preset {name}"));
        let model = build(preset, 1).expect("preset builds");
        let tiny = preset == Preset::TinyV4;
        if wanted("throughput") {
            if tiny {
                throughput(&model, name, 256, 64);
            } else {
                throughput(&model, name, 64, 16);
            }
        }
        if wanted("ttft") {
            ttft(&model, name, 2048, 32, if tiny { 5 } else { 1 });
        }
        if wanted("replay") && tiny {
            replay_quality(&model, name, 1024, 33, 16);
        }
    }
}
