//! Speculative decoding keeps every token: greedy and sampled requests
//! produce exactly what decoding without drafts produces (tokens, logprobs,
//! alternatives, logits), for MTP drafts on DeepSeek-V4 and DSpark drafts on
//! V4.1, every draft count, alone and in batches, with prefix hits,
//! preemption and constrained sampling.

mod support;

use deepinfer_engine::constraint::TokenConstraint;
use deepinfer_engine::engine::{Completion, Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::Request;
use deepinfer_engine::speculative::policy::{DraftPolicy, StepCost};
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig, SpeculativeStats};
use support::*;

/// The built-in trained tiny V4 (tools/train/): its MTP drafts are accepted
/// about half the time, so every path of verification runs.
fn trained() -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-v4-trained");
    Model::load(&dir).expect("the trained checkpoint loads")
}

/// The built-in trained tiny V4.1 with its DSpark layer (tools/train/): its
/// drafts are accepted often, so DSpark's kept and taken-back drafts both run.
fn trained_v41() -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-v41-trained");
    Model::load_with(&dir, deepinfer_engine::model::RoutedExperts::Resident, None)
        .expect("the trained checkpoint loads")
}

fn models() -> Vec<(&'static str, Model, DraftMethod)> {
    vec![
        ("tiny-v4-trained", trained(), DraftMethod::Mtp),
        ("tiny-v4", tiny(), DraftMethod::Mtp),
        ("tiny-v41", build(Preset::TinyV41, 3).expect("tiny-v41 builds"), DraftMethod::Dspark),
        ("tiny-v41-trained", trained_v41(), DraftMethod::Dspark),
    ]
}

fn with_drafts(config: EngineConfig, method: DraftMethod, policy: DraftPolicy) -> EngineConfig {
    EngineConfig { speculative: SpeculativeConfig { method, policy }, ..config }
}

fn requests(n: usize, max_tokens: usize) -> Vec<Request> {
    (0..n)
        .map(|i| {
            let params = if i % 2 == 0 { greedy() } else { seeded(i as u64) };
            let mut r = request(tokens(20 + 13 * (i % 7), 300 + i as u32), max_tokens, params);
            r.ignore_eos = true;
            r
        })
        .collect()
}

fn run(model: &Model, config: EngineConfig, requests: &[Request]) -> (Vec<Completion>, SpeculativeStats) {
    let (out, engine) = run_together(model, config, requests);
    (out, engine.speculative_stats().clone())
}

fn assert_same_outputs(got: &[Completion], want: &[Completion], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.tokens, w.tokens, "{what}: request {i}");
        assert_eq!(g.finished.reason, w.finished.reason, "{what}: request {i}");
        assert_eq!(g.finished.completion_tokens, w.finished.completion_tokens, "{what}: request {i}");
    }
}

#[test]
fn every_draft_count_gives_the_tokens_of_decoding_without_drafts() {
    for (name, model, method) in models() {
        let reqs = requests(4, 24);
        let (plain, _) = run(&model, config(PrefixMode::Off), &reqs);
        for k in 1..=5 {
            for policy in [DraftPolicy::Fixed(k), DraftPolicy::Adaptive { max: k }] {
                let (got, stats) = run(&model, with_drafts(config(PrefixMode::Off), method, policy), &reqs);
                assert_same_outputs(&got, &plain, &format!("{name} {policy:?}"));
                assert!(stats.verified > 0, "{name} {policy:?}: drafts were verified: {stats:?}");
                assert!(stats.accepted <= stats.verified);
                if name.ends_with("-trained") {
                    // Drafts were accepted, some runs of them whole, some cut short.
                    assert!(stats.accepted > 0 && stats.all_accepted > 0, "{name} {policy:?}: {stats:?}");
                    assert!(stats.accepted < stats.verified, "{name} {policy:?}: {stats:?}");
                }
                // Each request computed its tokens alone, too.
                for (r, g) in reqs.iter().zip(&got).take(1) {
                    let (alone, _) =
                        run(&model, with_drafts(config(PrefixMode::Off), method, policy), std::slice::from_ref(r));
                    assert_eq!(alone[0].tokens, g.tokens, "{name} {policy:?}: alone");
                }
            }
        }
    }
}

#[test]
fn a_batch_of_32_with_prefix_hits_equals_each_request_alone_without_drafts() {
    for (name, model, method) in models() {
        // Shared prefixes of two blocks, so later requests hit the cache.
        let shared = tokens(140, 9);
        let reqs: Vec<Request> = requests(32, 20)
            .into_iter()
            .enumerate()
            .map(|(i, mut r)| {
                if i % 3 == 0 {
                    r.prompt = [&shared[..], &r.prompt[..8]].concat();
                }
                r
            })
            .collect();
        let alone: Vec<Completion> = reqs.iter().map(|r| run_alone(&model, r)).collect();
        for k in [1, 3, 5] {
            let cfg = with_drafts(config(PrefixMode::Exact), method, DraftPolicy::Fixed(k));
            let (got, engine) = run_together(&model, cfg, &reqs);
            assert_same_outputs(&got, &alone, &format!("{name} batch 32 k={k}"));
            assert!(engine.scheduler().prefix_stats().hits > 0, "{name}: prefix hits happened");
            assert!(engine.speculative_stats().verified > 0);
        }
    }
}

#[test]
fn preempted_requests_with_drafts_keep_their_outputs() {
    for (name, model, method) in models() {
        let reqs = requests(12, 60);
        let alone: Vec<Completion> = reqs.iter().map(|r| run_alone(&model, r)).collect();
        let probe = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
        let budget = 2 * probe.scheduler().layout().sequence_bytes(20 + 13 * 6 + 60);
        let cfg = EngineConfig {
            kv_budget_bytes: budget,
            max_batch_tokens: 96,
            ..with_drafts(config(PrefixMode::Exact), method, DraftPolicy::Adaptive { max: 4 })
        };
        let (got, engine) = run_together(&model, cfg, &reqs);
        assert!(engine.scheduler().stats().preemptions > 0, "{name}: the budget forced preemption");
        assert_same_outputs(&got, &alone, &format!("{name} preemption"));
        assert!(engine.scheduler().pool_stats().used_bytes <= budget);
    }
}

/// Only tokens divisible by 3, done after `limit`; it can be copied, so
/// drafts are masked too.
#[derive(Clone)]
struct EveryThird {
    seen: usize,
    limit: usize,
}

impl TokenConstraint for EveryThird {
    fn allowed(&mut self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            if id % 3 != 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, token: u32) {
        assert_eq!(token % 3, 0, "only allowed tokens are accepted");
        self.seen += 1;
    }
    fn is_done(&self) -> bool {
        self.seen >= self.limit
    }
    fn fork(&self) -> Option<Box<dyn TokenConstraint>> {
        Some(Box::new(self.clone()))
    }
}

#[test]
fn constrained_requests_draft_masked_tokens_and_advance_only_over_accepted_ones() {
    for (name, model, method) in models() {
        let reqs = requests(4, 30);
        let run_constrained = |cfg: EngineConfig| {
            let mut engine = Engine::new(&model, cfg).unwrap();
            let ids: Vec<_> = reqs
                .iter()
                .map(|r| {
                    engine.add_constrained_request(r.clone(), Box::new(EveryThird { seen: 0, limit: 17 })).unwrap()
                })
                .collect();
            let mut done = engine.run_to_completion();
            let out: Vec<Completion> = ids.iter().map(|id| done.remove(id).unwrap()).collect();
            (out, engine.speculative_stats().clone())
        };
        let (plain, _) = run_constrained(config(PrefixMode::Off));
        let (got, stats) = run_constrained(with_drafts(config(PrefixMode::Off), method, DraftPolicy::Fixed(3)));
        assert_same_outputs(&got, &plain, &format!("{name} constrained"));
        for c in &got {
            assert_eq!(c.tokens.len(), 17, "{name}: the constraint ended it");
            assert!(c.token_ids().iter().all(|t| t % 3 == 0));
        }
        assert!(stats.verified > 0);
    }
}

#[test]
fn the_adaptive_policy_drafts_only_when_verification_pays() {
    let model = trained();
    let reqs = requests(2, 16);
    let mut engine =
        Engine::new(&model, with_drafts(config(PrefixMode::Off), DraftMethod::Mtp, DraftPolicy::Adaptive { max: 4 }))
            .unwrap();
    // Every verified token costs as much as a whole step.
    engine.set_step_cost(StepCost::linear(0.001, 1.0));
    for r in &reqs {
        engine.add_request(r.clone()).unwrap();
    }
    engine.run_to_completion();
    // Nothing is verified, and since no draft could pay, none is even proposed.
    let stats = engine.speculative_stats();
    assert!(stats.proposed == 0 && stats.verified == 0, "{stats:?}");
    // With cheap verification the same requests draft and verify.
    let mut engine =
        Engine::new(&model, with_drafts(config(PrefixMode::Off), DraftMethod::Mtp, DraftPolicy::Adaptive { max: 4 }))
            .unwrap();
    engine.set_step_cost(StepCost::linear(1.0, 0.001));
    for r in &reqs {
        engine.add_request(r.clone()).unwrap();
    }
    engine.run_to_completion();
    assert!(engine.speculative_stats().verified > 0, "{:?}", engine.speculative_stats());
}

#[test]
fn drafting_that_costs_more_than_it_yields_is_not_done() {
    let (trained, v41) = (trained(), build(Preset::TinyV41, 3).unwrap());
    for (name, model, method) in [("mtp", &trained, DraftMethod::Mtp), ("dspark", &v41, DraftMethod::Dspark)] {
        let reqs = requests(2, 16);
        let run = |draft_cost: Option<StepCost>| {
            let config = with_drafts(config(PrefixMode::Off), method, DraftPolicy::Adaptive { max: 4 });
            let mut engine = Engine::new(model, config).unwrap();
            // Verification is almost free: only drafting's own cost can stop it.
            engine.set_step_cost(StepCost::linear(1.0, 0.001));
            if let Some(cost) = draft_cost {
                engine.set_draft_cost(cost);
            }
            for r in &reqs {
                engine.add_request(r.clone()).unwrap();
            }
            engine.run_to_completion();
            engine.speculative_stats().clone()
        };
        let free = run(None);
        assert!(free.proposed > 0 && free.verified > 0, "{name}: drafts when drafting is free: {free:?}");
        // Drafting that costs ten steps a request never pays: nothing is drafted.
        let costly = run(Some(StepCost::linear(0.0, 10.0)));
        assert!(costly.proposed == 0 && costly.verified == 0, "{name}: {costly:?}");
    }
}

#[test]
fn a_model_without_the_draft_head_refuses_the_method() {
    let v41 = build(Preset::TinyV41, 3).unwrap();
    let err = Engine::new(&v41, with_drafts(EngineConfig::default(), DraftMethod::Mtp, DraftPolicy::Fixed(2)))
        .err()
        .expect("V4.1 has no MTP block");
    assert!(err.to_string().contains("dspark"), "{err}");
    let v4 = tiny();
    let err = Engine::new(&v4, with_drafts(EngineConfig::default(), DraftMethod::Dspark, DraftPolicy::Fixed(2)))
        .err()
        .expect("V4 has no DSpark layers");
    assert!(err.to_string().contains("V4.1"), "{err}");
}
