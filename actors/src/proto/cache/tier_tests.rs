//! The tiers below the pools, driven by scripted frames on an injected
//! clock: evictions to host memory and back up, TTLs, the host bytes
//! bound, persist points handed to the disk writer once, disk reads.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::engine::BlockValues;
use deepinfer_engine::kv_tiers::PersistRule;
use deepinfer_engine::model::{Chunk, LogitsWanted};
use deepinfer_engine::prefix_cache::block_hash;

use super::{frame, replies, ROUTER, SCHEDULER};
use crate::cluster::ctx::Ctx;
use crate::cluster::NodeCacheTiers;
use crate::kv_disk::DiskConfig;
use crate::proto::cache::{CacheMachine, DiskOp, LoadedBlock};
use crate::proto::test_ctx_with;
use crate::wire::{CacheMsg, CacheTier, InstanceMatch, Message, PromoteItem, PromotedItem, StoredBlock};

const TTL_MS: u64 = 10_000;

/// Blocks of a chain with their values.
type Blocks = Vec<(StoredBlock, Vec<f32>)>;

fn ms(t: u64) -> Duration {
    Duration::from_millis(t)
}

fn tiers(host_bytes: usize, disk: bool) -> NodeCacheTiers {
    NodeCacheTiers {
        host_bytes,
        disk: disk.then(|| DiskConfig {
            dir: std::env::temp_dir().join("never-opened-by-the-machine"),
            capacity_bytes: 1 << 30,
            weights_identity: "test".into(),
        }),
        disk_shared: false,
        persist: PersistRule::default(),
    }
}

/// The first `n` blocks of `tokens` as the model computes them, chained.
fn chain(ctx: &Ctx, tokens: &[u32], n: usize) -> Blocks {
    let (model, bt) = (&ctx.model, ctx.block_tokens);
    let mut state = model.new_state();
    let mut out = Vec::new();
    let mut parent = 0;
    for k in 0..n {
        model.forward(&mut [Chunk::new(&tokens[k * bt..(k + 1) * bt], &mut state)], LogitsWanted::None, false);
        let (lens, values) = BlockValues::capture(model, &state, k, bt).to_parts();
        let hash = block_hash(parent, &tokens[k * bt..(k + 1) * bt]);
        let block = StoredBlock { hash, parent, tokens: tokens[k * bt..(k + 1) * bt].to_vec(), lens, ttl_ms: TTL_MS };
        out.push((block, values));
        parent = hash;
    }
    out
}

fn setup(host_bytes: usize, disk: bool) -> (Arc<Ctx>, CacheMachine, Vec<u32>, Blocks) {
    let ctx = test_ctx_with(1, 8, 1, tiers(host_bytes, disk));
    let bt = ctx.block_tokens;
    let tokens: Vec<u32> = (0..3 * bt as u32).map(|i| 2 + (i * 7) % 91).collect();
    let blocks = chain(&ctx, &tokens, 2);
    let m = CacheMachine::start(Duration::ZERO, 0, 0, Arc::clone(&ctx));
    (ctx, m, tokens, blocks)
}

fn store_all(m: &mut CacheMachine, now: Duration, blocks: &[(StoredBlock, Vec<f32>)]) {
    let stored = blocks.iter().map(|(b, _)| b.clone()).collect();
    let body: Vec<f32> = blocks.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    m.handle(now, frame(SCHEDULER, Message::Cache(CacheMsg::Store { instance: 0, step: 0, blocks: stored }), &body));
}

fn evict_all(m: &mut CacheMachine, now: Duration, blocks: &[(StoredBlock, Vec<f32>)]) {
    let hashes = blocks.iter().map(|(b, _)| b.hash).collect();
    m.handle(now, frame(SCHEDULER, Message::Cache(CacheMsg::Evict { instance: 0, step: 1, hashes }), &[]));
}

fn lookup(
    m: &mut CacheMachine,
    now: Duration,
    tokens: &[u32],
    blocks: &[(StoredBlock, Vec<f32>)],
) -> (InstanceMatch, u32) {
    let hashes = blocks.iter().map(|(b, _)| b.hash).collect();
    m.handle(now, frame(ROUTER, Message::Cache(CacheMsg::Lookup { query: 1, hashes, tokens: tokens.to_vec() }), &[]));
    match &replies(m)[..] {
        [(_, Message::Cache(CacheMsg::Matched { matches, disk_chain, .. }), _)] => (matches[0], *disk_chain),
        other => panic!("one Matched reply: {other:?}"),
    }
}

fn promote_msg(blocks: &[(StoredBlock, Vec<f32>)]) -> Message {
    let item = PromoteItem {
        seq: 4,
        parent: 0,
        hashes: blocks.iter().map(|(b, _)| b.hash).collect(),
        tokens: blocks.iter().flat_map(|(b, _)| b.tokens.iter().copied()).collect(),
    };
    Message::Cache(CacheMsg::Promote { query: 3, instance: 0, items: vec![item] })
}

fn promoted(m: &mut CacheMachine) -> (PromotedItem, Vec<f32>) {
    match replies(m).pop() {
        Some((to, Message::Cache(CacheMsg::Promoted { query: 3, mut items }), body)) if to == SCHEDULER => {
            (items.remove(0), body)
        }
        other => panic!("a Promoted answer: {other:?}"),
    }
}

#[test]
fn evicted_blocks_wait_in_host_memory_and_come_back_up_whole() {
    let (ctx, mut m, tokens, blocks) = setup(1 << 20, false);
    store_all(&mut m, ms(0), &blocks);
    evict_all(&mut m, ms(10), &blocks);
    let (found, _) = lookup(&mut m, ms(20), &tokens, &blocks);
    assert_eq!((found.blocks, found.host_blocks, found.disk_blocks), (0, 2, 0), "both in host memory");
    m.handle(ms(30), frame(SCHEDULER, promote_msg(&blocks), &[]));
    let (item, body) = promoted(&mut m);
    assert_eq!(item.blocks.len(), 2);
    assert!(item.blocks.iter().all(|b| b.tier == CacheTier::Host && b.ttl_ms == TTL_MS));
    let want: Vec<f32> = blocks.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    assert_eq!(body, want, "the values as computed, bit for bit");
    assert_eq!(item.blocks[1].lens, blocks[1].0.lens);
    // Up again: in the pool store (a restore finds them), out of host memory.
    let (found, _) = lookup(&mut m, ms(40), &tokens, &blocks);
    assert_eq!((found.blocks, found.host_blocks), (2, 0));
    assert_eq!(ctx.metrics.host_hit_blocks.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(m.take_disk_ops().is_empty(), "no disk tier, no disk I/O");
}

#[test]
fn host_blocks_expire_on_the_injected_clock_and_are_never_served_after() {
    let (_, mut m, tokens, blocks) = setup(1 << 20, false);
    store_all(&mut m, ms(0), &blocks);
    evict_all(&mut m, ms(500), &blocks);
    assert_eq!(lookup(&mut m, ms(TTL_MS - 1), &tokens, &blocks).0.host_blocks, 2, "live until its TTL");
    assert_eq!(lookup(&mut m, ms(TTL_MS), &tokens, &blocks).0.host_blocks, 0, "gone at it");
    m.handle(ms(TTL_MS + 1), frame(SCHEDULER, promote_msg(&blocks), &[]));
    let (item, body) = promoted(&mut m);
    assert!(item.blocks.is_empty() && body.is_empty());
}

#[test]
fn host_memory_keeps_within_its_bytes_dropping_the_least_recent() {
    let ctx = test_ctx_with(1, 8, 1, tiers(0, false));
    let bt = ctx.block_tokens;
    let singles: Vec<(Vec<u32>, Blocks)> = (0..3u32)
        .map(|k| {
            let tokens: Vec<u32> = (0..bt as u32).map(|i| 2 + (i * (k + 5)) % 89).collect();
            let c = chain(&ctx, &tokens, 1);
            (tokens, c)
        })
        .collect();
    let one = &singles[0].1[0];
    let block_bytes = 4 * (one.1.len() + one.0.lens.len() + bt);
    let ctx = test_ctx_with(1, 8, 1, tiers(2 * block_bytes, false));
    let mut m = CacheMachine::start(Duration::ZERO, 0, 0, Arc::clone(&ctx));
    for (t, (_, c)) in singles.iter().enumerate() {
        store_all(&mut m, ms(t as u64), c);
        evict_all(&mut m, ms(t as u64), c);
    }
    let held: Vec<u32> = singles.iter().map(|(tokens, c)| lookup(&mut m, ms(5), tokens, c).0.host_blocks).collect();
    assert_eq!(held, vec![0, 1, 1], "the oldest went");
}

#[test]
fn a_persist_point_hands_each_block_to_the_writer_once() {
    let (ctx, mut m, tokens, blocks) = setup(1 << 20, true);
    store_all(&mut m, ms(0), &blocks);
    let hashes: Vec<u64> = blocks.iter().map(|(b, _)| b.hash).collect();
    let persist = |hashes: Vec<u64>| Message::Cache(CacheMsg::Persist { instance: 0, hashes });
    m.handle(ms(1), frame(SCHEDULER, persist(hashes[..1].to_vec()), &[]));
    m.handle(ms(2), frame(SCHEDULER, persist(hashes.clone()), &[]));
    let written: Vec<Vec<u64>> = m
        .take_disk_ops()
        .into_iter()
        .map(|op| match op {
            DiskOp::Write(b) => b.iter().map(|b| b.key).collect(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(written, vec![vec![hashes[0]], vec![hashes[1]]], "the chain, each block once");
    // Evicted to host memory, persisted blocks are not written again; the router hears of the disk chain.
    evict_all(&mut m, ms(3), &blocks);
    m.handle(ms(4), frame(SCHEDULER, persist(hashes.clone()), &[]));
    assert!(m.take_disk_ops().is_empty());
    assert_eq!(lookup(&mut m, ms(5), &tokens, &blocks).1, 2);
    let block = BlockValues::from_parts(&ctx.model, ctx.block_tokens, &blocks[0].0.lens, &blocks[0].1).unwrap();
    assert_eq!(block.to_parts().1, blocks[0].1);
}

#[test]
fn a_prefix_on_disk_is_read_and_answered_after_what_memory_held() {
    let (ctx, mut m, tokens, blocks) = setup(1 << 20, true);
    // Block 0 in host memory; block 1 only on disk (found at start).
    store_all(&mut m, ms(0), &blocks[..1]);
    evict_all(&mut m, ms(0), &blocks[..1]);
    m.disk_indexed(vec![(blocks[1].0.hash, blocks[1].0.parent)]);
    let (found, disk_chain) = lookup(&mut m, ms(1), &tokens, &blocks);
    assert_eq!((found.host_blocks, found.disk_blocks, disk_chain), (1, 1, 0), "block 0 is not on disk");
    m.handle(ms(2), frame(SCHEDULER, promote_msg(&blocks), &[]));
    assert!(replies(&mut m).is_empty(), "the answer waits for the disk");
    let (id, wanted) = match &m.take_disk_ops()[..] {
        [DiskOp::Read { id, wanted }] => (*id, wanted.clone()),
        other => panic!("one read: {other:?}"),
    };
    assert_eq!(
        wanted.iter().map(|w| (w.key, w.parent)).collect::<Vec<_>>(),
        vec![(blocks[1].0.hash, blocks[0].0.hash)]
    );
    let (b, v) = &blocks[1];
    let loaded = LoadedBlock {
        key: b.hash,
        parent: b.parent,
        tokens: b.tokens.clone(),
        lens: b.lens.clone(),
        values: v.clone(),
        ttl_ms: 7,
    };
    m.disk_read(ms(3), id, vec![loaded], None);
    let (item, body) = promoted(&mut m);
    assert_eq!(item.blocks.iter().map(|b| b.tier).collect::<Vec<_>>(), vec![CacheTier::Host, CacheTier::Disk]);
    assert_eq!(item.blocks[1].ttl_ms, 7);
    let want: Vec<f32> = blocks.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    assert_eq!(body, want);
    assert_eq!(ctx.metrics.disk_hit_blocks.load(std::sync::atomic::Ordering::Relaxed), 1);
    // A read that finds nothing answers with what memory had, and forgets the block it missed.
    evict_all(&mut m, ms(4), &blocks);
    m.handle(ms(5), frame(SCHEDULER, Message::Cache(CacheMsg::Clear { instance: 0 }), &[]));
    let host_only = lookup(&mut m, ms(5), &tokens, &blocks).0;
    assert_eq!(host_only.host_blocks, 2);
}
