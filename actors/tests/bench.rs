//! Throughput of the actor runtime against the engine alone: run with
//! `cargo test -p deepinfer-actors --test bench -- --ignored --nocapture`.
//! Prints a Markdown table; nothing here asserts on time.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::{model, prompt};
use deepinfer_actors::{run_in_process, run_simulated, ClusterConfig, GenRequest};
use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::sampling::{sample, SamplingParams};

const REQUESTS: usize = 8;
const PROMPT: usize = 16;
const TOKENS: usize = 32;

fn reqs() -> Vec<GenRequest> {
    (0..REQUESTS).map(|i| common::request(prompt(PROMPT, i as u32), TOKENS, SamplingParams::default())).collect()
}

/// The same work on one device, all sequences in one batch per step.
fn engine_alone(m: &Model, reqs: &[GenRequest]) -> f64 {
    let t = Instant::now();
    let mut states: Vec<_> = reqs.iter().map(|_| m.new_state()).collect();
    let mut feeds: Vec<Vec<u32>> = reqs.iter().map(|r| r.prompt.clone()).collect();
    for _ in 0..TOKENS {
        let mut chunks: Vec<Chunk> = states.iter_mut().zip(&feeds).map(|(s, f)| Chunk::new(f, s)).collect();
        let outs = m.forward(&mut chunks, LogitsWanted::Last, false);
        for (i, o) in outs.iter().enumerate() {
            feeds[i] = vec![sample(&o.logits, &reqs[i].params, states[i].position as u64).token];
        }
    }
    t.elapsed().as_secs_f64()
}

#[test]
#[ignore = "benchmark"]
fn bench() {
    let m: Arc<Model> = model();
    let reqs = reqs();
    engine_alone(&m, &reqs);
    let base = (0..3).map(|_| engine_alone(&m, &reqs)).fold(f64::MAX, f64::min);
    let steps = TOKENS as f64;
    println!("tiny-v4, {REQUESTS} requests × ({PROMPT} prompt + {TOKENS} generated), best of 3\n");
    println!("| runtime | devices × EP | steps | wall ms/token | overhead ms/token | frames | frames/s |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    println!("| engine alone (one batch) | 1 | {TOKENS} | {:.3} | — | — | — |", base * 1e3 / steps);
    for (devices, ep) in [(1, 1), (2, 2), (4, 2), (8, 8)] {
        for sim in [false, true] {
            let mut best = f64::MAX;
            let (mut frames, mut ran) = (0, 0);
            for _ in 0..3 {
                let cfg = ClusterConfig::new(devices, ep);
                let t = Instant::now();
                let r = if sim {
                    run_simulated(m.clone(), cfg, &reqs).unwrap()
                } else {
                    run_in_process(m.clone(), cfg, &reqs, 2).unwrap()
                };
                best = best.min(t.elapsed().as_secs_f64());
                frames = r.metrics.frames_sent;
                ran = r.steps;
                assert!(r.outputs.iter().all(|o| o.is_ok()));
            }
            let name = if sim { "simulated (1 thread, virtual clock)" } else { "in-process (2 threads)" };
            println!(
                "| {name} | {devices} × {ep} | {ran} | {:.3} | {:.3} | {frames} | {:.0} |",
                best * 1e3 / steps,
                (best - base) * 1e3 / steps,
                frames as f64 / best
            );
        }
    }
}
