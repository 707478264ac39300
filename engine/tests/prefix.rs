//! Prefix cache: exact-mode hits are bit-identical to cold runs, bounded-mode
//! hits are close but cheaper, blocks are shared and evicted, short matches
//! are not used.

mod support;

use std::collections::BTreeMap;

use deepinfer_engine::engine::{Collector, Completion, Engine, EngineConfig};
use deepinfer_engine::kv_pool::BlockKind;
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::request::Request;
use support::*;

/// Requests sharing a long prefix, with different tails; the last repeats the first.
fn shared_prefix_requests(prefix_len: usize) -> Vec<Request> {
    let prefix = tokens(prefix_len, 77);
    let mut out: Vec<Request> = (0..4u32)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(5 + 11 * i as usize, 300 + i));
            let mut r = request(prompt, 10, if i % 2 == 0 { greedy() } else { seeded(u64::from(i)) });
            r.ignore_eos = true;
            r
        })
        .collect();
    out.push(out[0].clone());
    out
}

/// Run the first request alone to fill the cache, then the rest together.
fn warm_then_rest<'m>(
    model: &'m Model,
    mode: PrefixMode,
    requests: &[Request],
) -> (Vec<Completion>, Engine<&'m Model>) {
    let mut engine = Engine::new(model, config(mode)).unwrap();
    let first = engine.add_request(requests[0].clone()).unwrap();
    let mut done = engine.run_to_completion();
    let mut out = vec![done.remove(&first).unwrap()];
    let ids: Vec<_> = requests[1..].iter().map(|r| engine.add_request(r.clone()).unwrap()).collect();
    let mut done = engine.run_to_completion();
    out.extend(ids.iter().map(|id| done.remove(id).unwrap()));
    (out, engine)
}

#[test]
fn exact_prefix_hits_are_bit_identical_to_cold_runs() {
    let model = tiny();
    let requests = shared_prefix_requests(300);
    let (warm, engine) = warm_then_rest(&model, PrefixMode::Exact, &requests);
    let stats = engine.scheduler().prefix_stats().clone();
    assert_eq!(stats.lookups, 5);
    assert_eq!(stats.hits, 4, "every request after the first hits");
    // The shared 300 tokens hold four full 64-token blocks; the repeat of the
    // first prompt (305 tokens) hits the same four.
    assert_eq!(stats.hit_tokens, 4 * 256);
    assert_eq!(stats.replayed_tokens, 4 * 7 * 7, "exact replay: layers × (window − 1)");
    for (i, (w, r)) in warm.iter().zip(&requests).enumerate() {
        assert_eq!(w.finished.cached_tokens, if i == 0 { 0 } else { 256 });
        assert_same(w, &run_alone(&model, r), &format!("request {i}"));
    }
}

#[test]
fn bounded_prefix_hits_replay_less_and_stay_close() {
    let model = tiny();
    let requests = shared_prefix_requests(300);
    let (warm, engine) = warm_then_rest(&model, PrefixMode::Bounded, &requests);
    let stats = engine.scheduler().prefix_stats();
    assert_eq!(stats.hits, 4);
    assert_eq!(stats.replayed_tokens, 4 * 7, "bounded replay: window − 1");
    let cold: Vec<_> = requests.iter().map(|r| run_alone(&model, r)).collect();
    assert_same(&warm[0], &cold[0], "the cold first request");
    // Only the window of the deepest layers is approximate: logits move, but not far.
    let diffs: Vec<f32> = warm.iter().zip(&cold).skip(1).map(|(w, c)| max_logit_diff(w, c)).collect();
    assert!(diffs.iter().any(|&d| d > 0.0), "bounded replay is not the exact path");
    assert!(warm.iter().flat_map(|c| &c.tokens).all(|t| t.logits.as_ref().unwrap().iter().all(|v| v.is_finite())));
}

#[test]
fn running_requests_share_cached_blocks_and_the_cache_evicts_lru() {
    let model = tiny();
    let prefix = tokens(200, 5);
    let with_tail = |salt| {
        let mut p = prefix.clone();
        p.extend(tokens(20, salt));
        request(p, 30, greedy())
    };
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    let mut collector = Collector::default();
    let a = engine.add_request(with_tail(1)).unwrap();
    collector.absorb(engine.step());
    let b = engine.add_request(with_tail(2)).unwrap();
    collector.absorb(engine.step());
    let table = |id| engine.scheduler().block_table(id).unwrap().get(BlockKind::Compressed).to_vec();
    let (ta, tb) = (table(a), table(b));
    assert_eq!(ta[..3], tb[..3], "the three full prefix blocks are shared");
    assert_ne!(ta[3], tb[3], "the tails are private");
    let mut done = BTreeMap::new();
    while engine.has_work() {
        done.extend(collector.absorb(engine.step()));
    }
    assert_same(&done[&a], &run_alone(&model, &with_tail(1)), "first request");
    assert_same(&done[&b], &run_alone(&model, &with_tail(2)), "sharing request");

    // A budget that holds one request plus a few cached blocks: older chains are evicted.
    let one = engine.scheduler().layout().sequence_bytes(400);
    let config = EngineConfig { kv_budget_bytes: one + one / 2, ..config(PrefixMode::Exact) };
    let requests: Vec<Request> = (0..6u32).map(|i| request(tokens(380, 40 + i), 4, greedy())).collect();
    let mut engine = Engine::new(&model, config).unwrap();
    for r in &requests {
        let id = engine.add_request(r.clone()).unwrap();
        let done = engine.run_to_completion();
        assert_same(&done[&id], &run_alone(&model, r), "evicting run");
    }
    let stats = engine.scheduler().prefix_stats();
    assert!(stats.evicted_blocks > 0);
    assert!(engine.scheduler().pool_stats().used_bytes <= one + one / 2);
    // The latest prompt's blocks survived; the first one's were evicted first.
    let again: Vec<_> =
        [&requests[5], &requests[0]].iter().map(|r| engine.add_request((*r).clone()).unwrap()).collect();
    let done = engine.run_to_completion();
    assert!(done[&again[0]].finished.cached_tokens > 0);
    assert_eq!(done[&again[1]].finished.cached_tokens, 0);
}

#[test]
fn a_match_no_longer_than_the_replay_is_not_used() {
    let model = tiny();
    // 16-token blocks: a 40-token shared prefix matches 32 tokens, less than the 49-token cone.
    let prefix = tokens(40, 8);
    let reqs: Vec<Request> = (0..2)
        .map(|i| {
            let mut p = prefix.clone();
            p.extend(tokens(10, 90 + i));
            request(p, 3, greedy())
        })
        .collect();
    let mut engine = Engine::new(&model, config_with_blocks(16)).unwrap();
    for r in &reqs {
        engine.add_request(r.clone()).unwrap();
        engine.run_to_completion();
    }
    let stats = engine.scheduler().prefix_stats();
    assert_eq!((stats.hits, stats.short_matches, stats.hit_tokens), (0, 1, 0));

    // Long enough (64 ≥ 49 + 1): used.
    let prefix = tokens(70, 8);
    let mut engine = Engine::new(&model, config_with_blocks(16)).unwrap();
    for i in 0..2 {
        let mut p = prefix.clone();
        p.extend(tokens(10, 90 + i));
        let r = request(p, 3, greedy());
        let id = engine.add_request(r.clone()).unwrap();
        let done = engine.run_to_completion();
        assert_same(&done[&id], &run_alone(&model, &r), "16-token blocks");
    }
    assert_eq!(engine.scheduler().prefix_stats().hit_tokens, 64);
}

fn config_with_blocks(block_tokens: usize) -> EngineConfig {
    EngineConfig { block_tokens: Some(block_tokens), ..config(PrefixMode::Exact) }
}

/// DeepSeek-V4.1: a block stores its KV groups' entries and index keys and the
/// state at its end (windows, Engram look-back), so a hit replays nothing and
/// is bit-identical to a cold run (the preset's window and chosen entries fit
/// one softmax block, so the key order cannot change a rounding).
#[test]
fn v41_exact_prefix_hits_restore_without_replay_and_are_bit_identical() {
    let model = deepinfer_engine::presets::build(deepinfer_engine::presets::Preset::TinyV41, 2).unwrap();
    let requests = shared_prefix_requests(300);
    let (warm, engine) = warm_then_rest(&model, PrefixMode::Exact, &requests);
    let stats = engine.scheduler().prefix_stats().clone();
    assert_eq!(stats.hits, 4, "every request after the first hits");
    assert_eq!(stats.hit_tokens, 4 * 256);
    assert_eq!(stats.replayed_tokens, 0, "the blocks hold the window state");
    for (i, (w, r)) in warm.iter().zip(&requests).enumerate() {
        assert_eq!(w.finished.cached_tokens, if i == 0 { 0 } else { 256 });
        assert_same(w, &run_alone(&model, r), &format!("V4.1 request {i}"));
    }
}
