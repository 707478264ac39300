//! The model on the emulated device (the CUDA kernels compiled for this CPU,
//! run by the same executor as on a GPU) against the CPU engine: the same
//! greedy tokens over 64 steps and the same logits bit for bit, for each
//! built-in model that runs on a device (V4 and V4.1), alone and in a batch. On a GPU,
//! `DEEPINFER_TEST_DEVICE=cuda` runs this file there (`tools/gpu/check.sh`).

use std::collections::BTreeMap;

use deepinfer::generation::load_model;
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::Request;

/// Greedy steps per prompt.
const STEPS: usize = 64;

/// Three prompts of 10 to 300 tokens inside `vocab`, from a fixed stream.
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    [10usize, 97, 300]
        .iter()
        .map(|&len| {
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % (vocab as u64 - 3)) as u32 + 3
                })
                .collect()
        })
        .collect()
}

/// Every request's tokens and logits rows, run together in one engine.
fn run(model: &Model, prompts: &[Vec<u32>], config: EngineConfig) -> Vec<(Vec<u32>, Vec<Vec<u32>>)> {
    let mut engine = Engine::new(model, config).expect("engine");
    let mut ids = Vec::new();
    for p in prompts {
        let mut r = Request::new(p.clone(), STEPS);
        r.ignore_eos = true;
        r.return_logits = true;
        ids.push(engine.add_request(r).expect("request"));
    }
    let done: BTreeMap<_, _> = engine.run_to_completion();
    ids.iter()
        .map(|id| {
            let c = &done[id];
            let logits = c
                .tokens
                .iter()
                .map(|t| t.logits.as_ref().expect("logits").iter().map(|v| v.to_bits()).collect())
                .collect();
            (c.token_ids(), logits)
        })
        .collect()
}

fn check_model(spec: &str) {
    check_model_on(spec, &deepinfer_cuda::test_gpu());
}

fn check_model_on(spec: &str, gpu: &deepinfer_cuda::Gpu) {
    let cpu = load_model(spec, 0, None).unwrap().model;
    let device = load_model(spec, 0, None).unwrap().model.on_device(gpu).expect("the model goes on the device");
    let prompts = prompts(cpu.config.vocab_size);
    let config = EngineConfig::default();
    let want = run(&cpu, &prompts, config.clone());
    // Each prompt alone on the device, then all three in one batch.
    for (i, p) in prompts.iter().enumerate() {
        let got = run(&device, std::slice::from_ref(p), config.clone());
        assert_eq!(got[0].0, want[i].0, "{spec}: prompt {i} ({} tokens): greedy tokens", p.len());
        for (step, (g, w)) in got[0].1.iter().zip(&want[i].1).enumerate() {
            assert!(g == w, "{spec}: prompt {i}: logits of step {step} differ from the CPU engine's");
        }
        assert_eq!(got[0].0.len(), STEPS);
    }
    let batched = run(&device, &prompts, config);
    for (i, (got, w)) in batched.iter().zip(&want).enumerate() {
        assert_eq!(got.0, w.0, "{spec}: prompt {i} in a batch of 3: greedy tokens");
        assert!(got.1 == w.1, "{spec}: prompt {i} in a batch of 3: logits differ from alone");
    }
}

#[test]
fn tiny_v4_on_the_device_gives_the_cpu_engines_tokens_and_logits() {
    check_model("builtin:tiny-v4");
}

#[test]
fn trained_tiny_v4_on_the_device_gives_the_cpu_engines_tokens_and_logits() {
    check_model("builtin:tiny-v4-trained");
}

#[test]
fn tiny_v41_on_the_device_gives_the_cpu_engines_tokens_and_logits() {
    check_model("builtin:tiny-v41");
}

#[test]
fn trained_tiny_v41_on_the_device_gives_the_cpu_engines_tokens_and_logits() {
    check_model("builtin:tiny-v41-trained");
}

/// The emulated device with each block's threads in the opposite order: a
/// kernel that reads another thread's write without a barrier (hidden when
/// the fibers run in thread order) changes the bits here.
#[test]
fn with_threads_reversed_the_device_still_gives_the_cpu_engines_tokens() {
    let gpu = deepinfer_cuda::Gpu::emulated_reversed();
    check_model_on("builtin:tiny-v4", &gpu);
    check_model_on("builtin:tiny-v41", &gpu);
}

/// A prefix-cache hit on the device: the second request restores the first
/// one's cached blocks into a device state (through their CPU form) and
/// replays the window; its tokens and logits are the CPU engine's, which
/// takes the same hit.
fn check_prefix_hit(spec: &str) {
    let cpu = load_model(spec, 0, None).unwrap().model;
    let device =
        load_model(spec, 0, None).unwrap().model.on_device(&deepinfer_cuda::test_gpu()).expect("on the device");
    let first = prompts(cpu.config.vocab_size).pop().expect("a 300-token prompt");
    let mut second = first[..260].to_vec();
    second.extend_from_slice(&first[5..45]);
    let run_both = |model: &Model| {
        let mut engine = Engine::new(model, EngineConfig::default()).expect("engine");
        let mut out = Vec::new();
        for p in [&first, &second] {
            let mut r = Request::new(p.clone(), 16);
            r.ignore_eos = true;
            r.return_logits = true;
            let id = engine.add_request(r).expect("request");
            let done = engine.run_to_completion();
            let c = &done[&id];
            let logits: Vec<Vec<u32>> =
                c.tokens.iter().map(|t| t.logits.as_ref().unwrap().iter().map(|v| v.to_bits()).collect()).collect();
            out.push((c.token_ids(), logits));
        }
        (out, engine.scheduler().prefix_stats().hit_tokens)
    };
    let (want, cpu_hits) = run_both(&cpu);
    let (got, device_hits) = run_both(&device);
    assert!(cpu_hits > 0, "{spec}: the second prompt hits the first one's blocks");
    assert_eq!(device_hits, cpu_hits, "{spec}: the same hit on the device");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "{spec}: request {i}: tokens");
        assert!(g.1 == w.1, "{spec}: request {i}: logits differ from the CPU engine's");
    }
}

#[test]
fn a_prefix_hit_on_the_device_gives_the_cpu_engines_tokens_v4() {
    check_prefix_hit("builtin:tiny-v4");
}

#[test]
fn a_prefix_hit_on_the_device_gives_the_cpu_engines_tokens_v41() {
    check_prefix_hit("builtin:tiny-v41");
}
