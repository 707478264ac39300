//! Shared fixtures: the tiny model, a batch of requests and the single-device reference.

#![allow(dead_code)]

use std::sync::{Arc, OnceLock};

use deepinfer_actors::{GenRequest, Generated};
use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::sampling::{sample, SamplingParams};

pub fn model() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| Arc::new(build(Preset::TinyV4, 7).expect("tiny-v4 builds"))))
}

/// The DeepSeek-V4.1 preset (Engram, CSA2 groups, the candidate filter).
pub fn model_v41() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    Arc::clone(MODEL.get_or_init(|| Arc::new(build(Preset::TinyV41, 7).expect("tiny-v41 builds"))))
}

pub fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 2 + (i.wrapping_mul(2654435761).wrapping_add(salt * 97) >> 7) % 1000).collect()
}

/// Greedy and seeded requests of different lengths.
pub fn requests(n: usize, max_tokens: usize) -> Vec<GenRequest> {
    (0..n)
        .map(|i| {
            let params = if i % 2 == 0 {
                SamplingParams::default()
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    top_k: 50,
                    seed: 1000 + i as u64,
                    logprobs: 0,
                    ..SamplingParams::default()
                }
            };
            request(prompt(3 + (i * 5) % 11, i as u32), max_tokens, params)
        })
        .collect()
}

/// A request that runs exactly `max_tokens` steps (EOS does not stop it), as the reference does.
pub fn request(prompt: Vec<u32>, max_tokens: usize, params: SamplingParams) -> GenRequest {
    let mut r = GenRequest::new(prompt, max_tokens).with_params(params);
    r.ignore_eos = true;
    r
}

/// Each request alone through `Model::forward` on one device.
pub fn reference(model: &Model, requests: &[GenRequest]) -> Vec<Generated> {
    requests
        .iter()
        .map(|r| {
            let mut state = model.new_state();
            let mut out = Generated::default();
            let mut feed = r.prompt.clone();
            for _ in 0..r.max_tokens {
                let logits =
                    model.forward(&mut [Chunk::new(&feed, &mut state)], LogitsWanted::Last, false).remove(0).logits;
                let s = sample(&logits, &r.params, state.position as u64);
                out.tokens.push(s.token);
                out.logprobs.push(s.logprob);
                out.logits.push(logits);
                feed = vec![s.token];
            }
            out
        })
        .collect()
}

/// Outputs equal bit for bit (logits compared as bits, NaN-safe).
pub fn assert_same(got: &[Result<Generated, deepinfer_actors::RequestFailed>], want: &[Generated], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: request count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.as_ref().unwrap_or_else(|e| panic!("{what}: request {i} failed: {e}"));
        assert_eq!(g.tokens, w.tokens, "{what}: tokens of request {i}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            g.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            bits(&w.logprobs),
            "{what}: logprobs {i}"
        );
        if !g.logits.is_empty() {
            assert_eq!(g.logits.len(), w.logits.len(), "{what}: logits rows of request {i}");
            for (a, b) in g.logits.iter().zip(&w.logits) {
                assert!(bits(a) == bits(b), "{what}: logits of request {i} differ");
            }
        }
    }
}
