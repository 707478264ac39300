//! The cache manager driven by scripted frames: stores checked against the
//! model, lookups and fetches that never return a wrong block, evictions,
//! the capacity bound and the restart announcement.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::engine::BlockValues;
use deepinfer_engine::model::{Chunk, LogitsWanted};
use deepinfer_engine::prefix_cache::block_hash;

use super::CacheMachine;
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::proto::test_ctx;
use crate::wire::{self, Addr, CacheMsg, Envelope, FetchItem, Message, StoredBlock};

const SCHEDULER: Addr = Addr::scheduler(0);
const ROUTER: Addr = Addr::router(0);

fn frame(from: Addr, msg: Message, body: &[f32]) -> Delivery {
    Delivery::new(from, wire::encode(&Envelope { from, to: Addr::cache(0), msg }, body).expect("encodes"))
}

/// The first block of `tokens` as the model computes it: key, parent, lengths, values.
fn block(ctx: &Ctx, tokens: &[u32]) -> (StoredBlock, Vec<f32>) {
    let (model, bt) = (&ctx.model, ctx.block_tokens);
    let mut state = model.new_state();
    model.forward(&mut [Chunk::new(&tokens[..bt], &mut state)], LogitsWanted::None, false);
    let (lens, values) = BlockValues::capture(model, &state, 0, bt).to_parts();
    let stored = StoredBlock {
        hash: block_hash(0, &tokens[..bt]),
        parent: 0,
        tokens: tokens[..bt].to_vec(),
        lens,
        ttl_ms: 60_000,
    };
    (stored, values)
}

fn replies(m: &mut CacheMachine) -> Vec<(Addr, Message, Vec<f32>)> {
    m.take_outgoing()
        .into_iter()
        .map(|o| {
            let d = wire::decode(&o.frame).expect("valid frames");
            (o.to, d.envelope.msg, d.body)
        })
        .collect()
}

fn matched(m: &mut CacheMachine, tokens: &[u32], bt: usize) -> u32 {
    let lookup = CacheMsg::Lookup { query: 1, hashes: vec![block_hash(0, &tokens[..bt])], tokens: tokens.to_vec() };
    m.handle(Duration::ZERO, frame(ROUTER, Message::Cache(lookup), &[]));
    match &replies(m)[..] {
        [(to, Message::Cache(CacheMsg::Matched { matches, .. }), _)] if *to == ROUTER => matches[0].blocks,
        other => panic!("one Matched reply: {other:?}"),
    }
}

fn started(ctx: &Arc<Ctx>) -> CacheMachine {
    let mut m = CacheMachine::start(Duration::ZERO, 0, 0, Arc::clone(ctx));
    assert!(replies(&mut m).is_empty(), "a first start announces nothing");
    m
}

#[test]
fn a_stored_block_is_matched_fetched_and_evicted() {
    let ctx = test_ctx(1, 8, 1);
    let bt = ctx.block_tokens;
    let tokens: Vec<u32> = (0..bt as u32).map(|i| 2 + i % 50).collect();
    let (stored, values) = block(&ctx, &tokens);
    let mut m = started(&ctx);
    assert_eq!(matched(&mut m, &tokens, bt), 0);
    let store = CacheMsg::Store { instance: 0, step: 0, blocks: vec![stored.clone()] };
    m.handle(Duration::ZERO, frame(SCHEDULER, Message::Cache(store), &values));
    assert_eq!(matched(&mut m, &tokens, bt), 1);
    let fetch = CacheMsg::Fetch {
        query: 9,
        instance: 0,
        step: 1,
        items: vec![FetchItem { seq: 5, hashes: vec![stored.hash], tokens: tokens.clone() }],
    };
    m.handle(Duration::ZERO, frame(SCHEDULER, Message::Cache(fetch.clone()), &[]));
    match &replies(&mut m)[..] {
        [(to, Message::Cache(CacheMsg::Fetched { query: 9, items }), body)] if *to == SCHEDULER => {
            assert!(items[0].found);
            assert_eq!(items[0].lens, vec![stored.lens.clone()]);
            assert_eq!(body, &values, "the values as stored");
        }
        other => panic!("{other:?}"),
    }
    let evict = CacheMsg::Evict { instance: 0, step: 2, hashes: vec![stored.hash] };
    m.handle(Duration::ZERO, frame(SCHEDULER, Message::Cache(evict), &[]));
    assert_eq!(matched(&mut m, &tokens, bt), 0);
    m.handle(Duration::ZERO, frame(SCHEDULER, Message::Cache(fetch), &[]));
    assert!(
        matches!(&replies(&mut m)[..], [(_, Message::Cache(CacheMsg::Fetched { items, .. }), b)] if !items[0].found && b.is_empty())
    );
    assert_eq!(ctx.metrics.cache_misses.load(Ordering::Relaxed), 1);
}

#[test]
fn bad_stores_are_refused_whole_and_a_colliding_key_is_no_hit() {
    let ctx = test_ctx(1, 8, 1);
    let bt = ctx.block_tokens;
    let tokens: Vec<u32> = (0..bt as u32).map(|i| 3 + i % 40).collect();
    let (stored, values) = block(&ctx, &tokens);
    let mut m = started(&ctx);
    let store = |blocks: Vec<StoredBlock>| Message::Cache(CacheMsg::Store { instance: 0, step: 0, blocks });
    let rejected = || ctx.metrics.frames_rejected.load(Ordering::Relaxed);
    // Too short, too long, values that do not fit the model, wrong block size.
    let before = rejected();
    m.handle(Duration::ZERO, frame(SCHEDULER, store(vec![stored.clone()]), &values[1..]));
    m.handle(Duration::ZERO, frame(SCHEDULER, store(vec![stored.clone()]), &[values.clone(), vec![0.0]].concat()));
    let mut wrong_lens = stored.clone();
    wrong_lens.lens[1] += 1;
    m.handle(Duration::ZERO, frame(SCHEDULER, store(vec![wrong_lens]), &[values.clone(), vec![0.0]].concat()));
    let mut short = stored.clone();
    short.tokens.pop();
    m.handle(Duration::ZERO, frame(SCHEDULER, store(vec![short]), &values));
    assert_eq!(rejected(), before + 4);
    assert_eq!(matched(&mut m, &tokens, bt), 0, "nothing of a refused store is kept");
    // The same key over other tokens (a collision) is a miss, never a wrong hit.
    m.handle(Duration::ZERO, frame(SCHEDULER, store(vec![stored.clone()]), &values));
    let mut other = tokens.clone();
    other[0] += 1;
    let lookup = CacheMsg::Lookup { query: 2, hashes: vec![stored.hash], tokens: other };
    m.handle(Duration::ZERO, frame(ROUTER, Message::Cache(lookup), &[]));
    assert!(
        matches!(&replies(&mut m)[..], [(_, Message::Cache(CacheMsg::Matched { matches, .. }), _)] if matches[0].blocks == 0)
    );
    // An instance this node does not home is not served.
    let foreign = Message::Cache(CacheMsg::Clear { instance: 7 });
    m.handle(Duration::ZERO, frame(SCHEDULER, foreign, &[]));
    assert_eq!(matched(&mut m, &tokens, bt), 1);
}

#[test]
fn the_store_keeps_within_its_capacity_dropping_the_least_recent() {
    let ctx = test_ctx(1, 8, 1);
    let bt = ctx.block_tokens;
    let mut m = started(&ctx);
    let blocks: Vec<(Vec<u32>, StoredBlock, Vec<f32>)> = (0..3u32)
        .map(|k| {
            let tokens: Vec<u32> = (0..bt as u32).map(|i| 2 + (i * (k + 3)) % 97).collect();
            let (s, v) = block(&ctx, &tokens);
            (tokens, s, v)
        })
        .collect();
    // Room for two blocks' values.
    m.capacity = blocks[0].2.len() * 2;
    for (_, s, v) in &blocks {
        let store = CacheMsg::Store { instance: 0, step: 0, blocks: vec![s.clone()] };
        m.handle(Duration::ZERO, frame(SCHEDULER, Message::Cache(store), v));
    }
    let held: Vec<u32> = blocks.iter().map(|(t, _, _)| matched(&mut m, t, bt)).collect();
    assert_eq!(held, vec![0, 1, 1], "the oldest went");
}

#[test]
fn a_restarted_cache_manager_tells_its_schedulers_to_forget() {
    let ctx = test_ctx(4, 2, 2);
    ctx.durable.mark_up();
    let mut m = CacheMachine::start(Duration::from_millis(5), 0, 1, Arc::clone(&ctx));
    let out = replies(&mut m);
    assert_eq!(out.len(), 1, "node 0 homes instance 0 only: {out:?}");
    assert!(matches!(&out[0], (to, Message::Heartbeat(h), _) if *to == SCHEDULER && h.restarted));
}

#[path = "tier_tests.rs"]
mod tier_tests;
