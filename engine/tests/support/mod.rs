//! Helpers shared by the serving tests.

#![allow(dead_code)]

use std::collections::BTreeMap;

use deepinfer_engine::engine::{Completion, Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::{Request, RequestId};
use deepinfer_engine::sampling::SamplingParams;

pub fn tiny() -> Model {
    build(Preset::TinyV4, 7).expect("tiny-v4 builds")
}

/// Deterministic token ids in 2..1002 (no BOS/EOS).
pub fn tokens(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 2 + (i.wrapping_mul(2654435761).wrapping_add(salt.wrapping_mul(40503)) >> 9) % 1000)
        .collect()
}

pub fn seeded(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 50, seed, logprobs: 3, ..SamplingParams::default() }
}

pub fn greedy() -> SamplingParams {
    SamplingParams { logprobs: 2, ..SamplingParams::default() }
}

pub fn request(prompt: Vec<u32>, max_tokens: usize, params: SamplingParams) -> Request {
    let mut r = Request::new(prompt, max_tokens).with_params(params);
    r.return_logits = true;
    r
}

pub fn config(mode: PrefixMode) -> EngineConfig {
    EngineConfig { prefix_mode: mode, ..EngineConfig::default() }
}

/// Run requests through one engine, all queued up front; completions in submission order.
pub fn run_together<'m>(
    model: &'m Model,
    config: EngineConfig,
    requests: &[Request],
) -> (Vec<Completion>, Engine<&'m Model>) {
    let mut engine = Engine::new(model, config).expect("valid config");
    let ids: Vec<RequestId> = requests.iter().map(|r| engine.add_request(r.clone()).expect("accepted")).collect();
    let mut done = engine.run_to_completion();
    let out = ids.iter().map(|id| done.remove(id).expect("every request finishes")).collect();
    (out, engine)
}

/// Run one request on a fresh engine with the prefix cache off.
pub fn run_alone(model: &Model, request: &Request) -> Completion {
    let (mut out, _) = run_together(model, config(PrefixMode::Off), std::slice::from_ref(request));
    out.remove(0)
}

/// Bits of one token's report: id, logprob, top alternatives, logits.
type TokenBits = (u32, u32, Vec<(u32, u32)>, Vec<u32>);

/// The bits of everything a completion reports per token.
pub fn fingerprint(c: &Completion) -> Vec<TokenBits> {
    c.tokens
        .iter()
        .map(|t| {
            (
                t.token,
                t.logprob.to_bits(),
                t.top.iter().map(|&(id, lp)| (id, lp.to_bits())).collect(),
                t.logits.as_ref().expect("logits requested").iter().map(|v| v.to_bits()).collect(),
            )
        })
        .collect()
}

/// Assert two completions are bit-identical, token by token.
pub fn assert_same(a: &Completion, b: &Completion, what: &str) {
    assert_eq!(a.token_ids(), b.token_ids(), "{what}: tokens");
    assert!(fingerprint(a) == fingerprint(b), "{what}: logprobs or logits differ");
    assert_eq!(a.finished.reason, b.finished.reason, "{what}: finish reason");
}

/// Largest |Δ| between the logits of two completions over their common tokens.
pub fn max_logit_diff(a: &Completion, b: &Completion) -> f32 {
    a.tokens
        .iter()
        .zip(&b.tokens)
        .flat_map(|(x, y)| {
            x.logits.as_ref().unwrap().iter().zip(y.logits.as_ref().unwrap()).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

pub fn by_id(done: BTreeMap<RequestId, Completion>) -> Vec<Completion> {
    done.into_values().collect()
}
