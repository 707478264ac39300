//! Prompt cache tiers: evicted blocks served from host memory, blocks
//! written to block files and read back into a fresh engine (a restart),
//! TTLs from the injected clock, per-request retention, and every hit
//! bit-identical to a cold run.

mod support;

use deepinfer_engine::engine::{Engine, EngineConfig, FetchedBlock, TierConfig};
use deepinfer_engine::kv_tiers::block_file::{decode, encode, fingerprint, FileFault};
use deepinfer_engine::kv_tiers::{PersistRule, Tier};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::{Request, Retention};
use support::*;

const HOUR_MS: u64 = 3600 * 1000;

fn run_one(engine: &mut Engine<&Model>, r: &Request) -> deepinfer_engine::engine::Completion {
    let id = engine.add_request(r.clone()).unwrap();
    let mut done = engine.run_to_completion();
    done.remove(&id).expect("finished")
}

/// A pool that holds one 400-token request and a little more.
fn small_pool(engine_model: &Model) -> EngineConfig {
    let probe = Engine::new(engine_model, config(PrefixMode::Exact)).unwrap();
    let one = probe.scheduler().layout().sequence_bytes(400);
    EngineConfig { kv_budget_bytes: one + one / 4, ..config(PrefixMode::Exact) }
}

#[test]
fn evicted_blocks_come_back_from_host_memory_bit_identical() {
    let model = tiny();
    let mut engine = Engine::new(&model, small_pool(&model)).unwrap();
    engine.configure_tiers(TierConfig { host_bytes: 64 << 20, ..TierConfig::default() });
    let first = request(tokens(380, 1), 4, greedy());
    let cold = run_one(&mut engine, &first);
    // Other prompts push the first one's blocks out of the pool.
    for salt in 2..5 {
        run_one(&mut engine, &request(tokens(380, salt), 4, greedy()));
    }
    assert!(engine.scheduler().prefix_stats().evicted_blocks > 0);
    assert!(!engine.host_tier().is_empty(), "evicted blocks moved to host memory");
    let again = run_one(&mut engine, &first);
    assert_same(&again, &cold, "host hit");
    assert_same(&again, &run_alone(&model, &first), "host hit against no cache");
    assert_eq!(again.finished.cached_tokens, 380 / 64 * 64, "the whole prefix, from whichever tier held each block");
    let by_tier = again.finished.cached_tokens_by_tier;
    assert!(by_tier[Tier::Host.index()] > 0, "served from host: {by_tier:?}");
    assert_eq!(by_tier.iter().sum::<usize>(), again.finished.cached_tokens);
    assert_eq!(engine.tier_counters().promoted_blocks[Tier::Host.index()] as usize * 64, by_tier[1]);
}

#[test]
fn without_a_host_tier_evicted_blocks_are_gone() {
    let model = tiny();
    let mut engine = Engine::new(&model, small_pool(&model)).unwrap();
    let first = request(tokens(380, 1), 4, greedy());
    run_one(&mut engine, &first);
    for salt in 2..5 {
        run_one(&mut engine, &request(tokens(380, salt), 4, greedy()));
    }
    assert_eq!(run_one(&mut engine, &first).finished.cached_tokens, 0);
}

#[test]
fn ttl_expiry_follows_the_injected_clock_and_hits_refresh_it() {
    let model = tiny();
    let mut engine = Engine::new(&model, EngineConfig { cache_ttl_ms: HOUR_MS, ..config(PrefixMode::Exact) }).unwrap();
    engine.configure_tiers(TierConfig { host_bytes: 64 << 20, ..TierConfig::default() });
    let r = request(tokens(300, 3), 3, greedy());
    engine.set_now_ms(1_000);
    run_one(&mut engine, &r);
    // 59 minutes later: a hit, which keeps the blocks another hour.
    engine.set_now_ms(1_000 + HOUR_MS - 60_000);
    assert!(run_one(&mut engine, &r).finished.cached_tokens > 0);
    engine.set_now_ms(1_000 + 2 * HOUR_MS - 120_000);
    assert!(run_one(&mut engine, &r).finished.cached_tokens > 0, "the hit refreshed the TTL");
    // More than an hour after the last use: gone from every tier.
    engine.set_now_ms(1_000 + 3 * HOUR_MS);
    let cold = run_one(&mut engine, &r);
    assert_eq!(cold.finished.cached_tokens, 0);
    assert!(engine.scheduler().prefix_stats().expired_blocks > 0);
    assert_same(&cold, &run_alone(&model, &r), "recomputed after expiry");

    // A request's own retention: five minutes.
    let mut short = request(tokens(300, 4), 3, greedy());
    short.retention = Some(Retention { ttl_ms: 5 * 60_000, persist: false });
    engine.set_now_ms(10 * HOUR_MS);
    run_one(&mut engine, &short);
    engine.set_now_ms(10 * HOUR_MS + 4 * 60_000);
    assert!(run_one(&mut engine, &short).finished.cached_tokens > 0);
    engine.set_now_ms(10 * HOUR_MS + 10 * 60_000);
    assert_eq!(run_one(&mut engine, &short).finished.cached_tokens, 0);
    // Retention out of range is refused with a reason.
    short.retention = Some(Retention { ttl_ms: 0, persist: true });
    assert!(engine.add_request(short).unwrap_err().to_string().contains("retention"));
}

/// Write what `engine` hands out for disk into block files (in memory).
fn persist(engine: &mut Engine<&Model>, fp: u64) -> Vec<(u64, Vec<u8>)> {
    let bt = engine.scheduler().layout().block_tokens;
    engine
        .take_persist()
        .into_iter()
        .map(|b| {
            assert_eq!(b.values.value_bytes(), 4 * b.values.to_parts().1.len(), "the host tier's byte count");
            (b.key, encode(fp, bt, b.key, b.parent, &b.tokens, &b.values, b.ttl_ms, 0))
        })
        .collect()
}

#[test]
fn persisted_blocks_restore_a_fresh_engine_bit_identically() {
    let models = [("tiny-v4", tiny()), ("tiny-v41", build(Preset::TinyV41, 2).expect("tiny-v41 builds"))];
    for (name, model) in &models {
        let fp = fingerprint(model, name, 64);
        let disk = TierConfig { disk: true, persist: PersistRule { interval_blocks: 2 }, ..TierConfig::default() };
        let r = request(tokens(400, 5), 6, greedy());
        let mut first = Engine::new(model, config(PrefixMode::Exact)).unwrap();
        first.configure_tiers(disk);
        let bt = first.scheduler().layout().block_tokens;
        let cold = run_one(&mut first, &r);
        let files = persist(&mut first, fp);
        // Every full block of the prompt, persisted at the intervals and the
        // prompt's end; the output's blocks (none full here) at the finish.
        assert_eq!(files.len(), 400 / bt, "{name}");
        assert!(persist(&mut first, fp).is_empty(), "{name}: each block is handed out once");

        // A new engine, as after a restart: nothing in memory.
        let mut second = Engine::new(model, config(PrefixMode::Exact)).unwrap();
        second.configure_tiers(disk);
        let id = second.add_request(r.clone()).unwrap();
        let wanted = second.wanted_blocks(8);
        assert_eq!(wanted.len(), 1);
        assert_eq!(wanted[0].0, id);
        assert_eq!(wanted[0].1.len(), 400 / bt);
        assert!(second.wanted_blocks(8).is_empty(), "asked once");
        second.hold(id, true);
        let fetched: Vec<FetchedBlock> = wanted[0]
            .1
            .iter()
            .map(|w| {
                let bytes = &files.iter().find(|(k, _)| *k == w.key).expect("persisted").1;
                let block = decode(model, bytes, fp, bt).expect("a good file");
                assert_eq!(block.tokens, w.tokens);
                FetchedBlock {
                    key: w.key,
                    parent: block.header.parent,
                    tokens: block.tokens,
                    values: block.values,
                    expires_at_ms: u64::MAX,
                }
            })
            .collect();
        second.offer_blocks(id, fetched);
        second.hold(id, false);
        let mut done = second.run_to_completion();
        let warm = done.remove(&id).unwrap();
        assert_same(&warm, &cold, &format!("{name}: disk hit after a restart"));
        assert_eq!(warm.finished.cached_tokens_by_tier, [0, 0, 400 / bt * bt], "{name}");
    }
}

#[test]
fn a_held_request_waits_for_its_prefix() {
    let model = tiny();
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    engine.configure_tiers(TierConfig { disk: true, ..TierConfig::default() });
    let id = engine.add_request(request(tokens(200, 6), 2, greedy())).unwrap();
    engine.hold(id, true);
    assert!(engine.step().is_empty(), "held: not admitted");
    engine.hold(id, false);
    let mut done = engine.run_to_completion();
    assert_eq!(done.remove(&id).unwrap().token_ids().len(), 2);
}

#[test]
fn in_memory_retention_is_never_persisted() {
    let model = tiny();
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    engine.configure_tiers(TierConfig { disk: true, ..TierConfig::default() });
    let mut r = request(tokens(300, 8), 3, greedy());
    r.retention = Some(Retention { ttl_ms: HOUR_MS, persist: false });
    run_one(&mut engine, &r);
    assert!(engine.take_persist().is_empty());
}

#[test]
fn damaged_or_foreign_block_files_are_recognised() {
    let model = tiny();
    let fp = fingerprint(&model, "builtin:tiny-v4 seed 7", 64);
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    engine.configure_tiers(TierConfig { disk: true, ..TierConfig::default() });
    run_one(&mut engine, &request(tokens(200, 9), 2, greedy()));
    let (_, good) = persist(&mut engine, fp).remove(0);
    assert!(decode(&model, &good, fp, 64).is_ok());
    let truncated = &good[..good.len() - 100];
    assert!(matches!(decode(&model, truncated, fp, 64), Err(FileFault::Truncated { .. })));
    let mut flipped = good.clone();
    flipped[200] ^= 0x10;
    assert!(matches!(decode(&model, &flipped, fp, 64), Err(FileFault::Corrupt(_))));
    assert!(matches!(decode(&model, &good, fp ^ 1, 64), Err(FileFault::Foreign(_))));
    let other = fingerprint(&model, "builtin:tiny-v4 seed 8", 64);
    assert_ne!(other, fp, "other weights, other fingerprint");
    assert!(matches!(decode(&model, &[b'x'; 200], fp, 64), Err(FileFault::Foreign(_))), "not a block file");
}
