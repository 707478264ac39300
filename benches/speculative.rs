//! Speculative decoding on CPU, side by side with decoding without drafts in
//! the same run: acceptance length, the share of verified drafts the target
//! rejected, and decode tokens/s per request and in total, at batch 1, 8 and
//! 64. `cargo bench --bench speculative [-- MODEL...]` (default: the trained
//! built-ins and tiny-v41); each line is one engine run of the whole batch.

use std::time::Instant;

use deepinfer::generation::{load_model, new_engine};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::request::Request;
use deepinfer_engine::sampling::SamplingParams;
use deepinfer_engine::speculative::policy::DraftPolicy;
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};

const PROMPTS: [&str; 8] = [
    "fn main() {\n    let mut",
    "impl<T: Clone> Iterator for",
    "/// Returns the number of",
    "use std::collections::",
    "pub struct Config {\n    pub",
    "#[derive(Debug, Clone",
    "match self {\n        Self::",
    "let result = match value {",
];
const MAX_TOKENS: usize = 96;
const BATCHES: [usize; 3] = [1, 8, 64];

fn modes(v41: bool) -> Vec<(String, SpeculativeConfig)> {
    let method = if v41 { DraftMethod::Dspark } else { DraftMethod::Mtp };
    let mut out = vec![("off".to_string(), SpeculativeConfig::default())];
    for k in [1, 3, 5] {
        out.push((format!("{method} fixed {k}"), SpeculativeConfig { method, policy: DraftPolicy::Fixed(k) }));
    }
    out.push((format!("{method} adaptive ≤5"), SpeculativeConfig { method, policy: DraftPolicy::Adaptive { max: 5 } }));
    out
}

fn run(model: &Model, tokenizer: &tokenizers::Tokenizer, batch: usize, spec: SpeculativeConfig) -> String {
    let config = EngineConfig {
        max_batch_size: batch,
        prefix_mode: PrefixMode::Off,
        speculative: spec,
        ..EngineConfig::default()
    };
    let mut engine: Engine<&Model> = new_engine(model, config).expect("engine");
    for i in 0..batch {
        let text = PROMPTS[i % PROMPTS.len()];
        let mut prompt = vec![model.config.bos_token_id];
        prompt.extend(tokenizer.encode(text, false).expect("encodes").get_ids());
        let params = SamplingParams { seed: i as u64, ..SamplingParams::default() };
        let mut r = Request::new(prompt, MAX_TOKENS).with_params(params);
        r.ignore_eos = true;
        engine.add_request(r).expect("accepted");
    }
    // Prefill first, so that the clock measures decoding.
    let mut generated = 0;
    while engine.scheduler().stats().generated_tokens < batch as u64 {
        generated += engine.step().iter().map(|u| u.tokens.len()).sum::<usize>();
    }
    let started = Instant::now();
    let mut steps = 0;
    while engine.has_work() {
        generated += engine.step().iter().map(|u| u.tokens.len()).sum::<usize>();
        steps += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    let decoded = generated - batch;
    let s = engine.speculative_stats();
    format!(
        "| {batch} | {:.2} | {:.0}% | {:.2} | {:.1} | {:.0} | {steps} |",
        if s.verifications > 0 { s.acceptance_length() } else { 1.0 },
        100.0 * s.rejected_share(),
        s.verified as f64 / steps.max(1) as f64 / batch as f64,
        decoded as f64 / batch as f64 / secs,
        decoded as f64 / secs,
    )
}

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let models = if args.is_empty() {
        vec!["builtin:tiny-v4-trained".to_string(), "builtin:tiny-v41-trained".to_string()]
    } else {
        args
    };
    for spec in models {
        let loaded = load_model(&spec, 1, None).expect("model loads");
        println!("\n### {spec}\n");
        println!("| mode | batch | acceptance length | rejected | drafts/request/step | tok/s per request | tok/s total | steps |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for (name, mode) in modes(loaded.model.is_v41()) {
            for batch in BATCHES {
                println!("| {name} {}", run(&loaded.model, &loaded.tokenizer, batch, mode));
            }
        }
    }
}
