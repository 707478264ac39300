//! Constrained sampling: the hook masks each sampled row, sees each token,
//! and ends its request when it admits nothing more; other requests in the
//! same batch are untouched.

mod support;

use deepinfer_engine::constraint::TokenConstraint;
use deepinfer_engine::engine::Engine;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::request::{FinishReason, Request};
use support::*;

/// Allows only even token ids, and is done after `limit` tokens.
struct EvenTokens {
    seen: Vec<u32>,
    limit: usize,
}

impl TokenConstraint for EvenTokens {
    fn allowed(&mut self, logits: &mut [f32]) {
        for (id, l) in logits.iter_mut().enumerate() {
            if id % 2 == 1 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, token: u32) {
        self.seen.push(token);
    }
    fn is_done(&self) -> bool {
        self.seen.len() >= self.limit
    }
}

/// Allows nothing.
struct Nothing;

impl TokenConstraint for Nothing {
    fn allowed(&mut self, logits: &mut [f32]) {
        logits.fill(f32::NEG_INFINITY);
    }
    fn accept(&mut self, _token: u32) {}
    fn is_done(&self) -> bool {
        false
    }
}

#[test]
fn a_constraint_masks_sampling_and_ends_its_request() {
    let model = tiny();
    let mut engine = Engine::new(&model, config(PrefixMode::Off)).unwrap();
    let mut free = request(tokens(30, 3), 12, seeded(5));
    free.ignore_eos = true;
    let plain = engine.add_request(free.clone()).unwrap();
    let even =
        engine.add_constrained_request(free.clone(), Box::new(EvenTokens { seen: Vec::new(), limit: 5 })).unwrap();
    let broken = engine.add_constrained_request(free.clone(), Box::new(Nothing)).unwrap();
    let mut done = engine.run_to_completion();

    let alone = run_alone(&model, &free);
    let plain = done.remove(&plain).unwrap();
    assert_eq!(plain.token_ids(), alone.token_ids(), "an unconstrained neighbour is unaffected");

    let even = done.remove(&even).unwrap();
    assert_eq!(even.finished.reason, FinishReason::Stop);
    assert_eq!(even.tokens.len(), 5, "done after the fifth token");
    assert!(even.token_ids().iter().all(|t| t % 2 == 0), "{:?}", even.token_ids());
    assert!(even.tokens.iter().all(|t| t.logprob.is_finite()));

    let broken = done.remove(&broken).unwrap();
    assert!(matches!(broken.finished.reason, FinishReason::Error(_)), "{:?}", broken.finished);
    assert_eq!(engine.scheduler().pool_stats().blocks, [0, 0, 0, 0], "everything freed");
}

#[test]
fn cancelling_a_constrained_request_frees_it() {
    let model = tiny();
    let mut engine = Engine::new(&model, config(PrefixMode::Off)).unwrap();
    let id = engine
        .add_constrained_request(Request::new(tokens(20, 1), 50), Box::new(EvenTokens { seen: Vec::new(), limit: 40 }))
        .unwrap();
    engine.step();
    engine.step();
    assert_eq!(engine.cancel(id).unwrap().reason, FinishReason::Cancelled);
    assert!(!engine.has_work());
    assert_eq!(engine.scheduler().pool_stats().blocks, [0, 0, 0, 0]);
}
