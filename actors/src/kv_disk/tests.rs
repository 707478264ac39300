//! The disk tier on a real file system, with the clock injected.

use std::sync::Arc;

use deepinfer_engine::engine::{Engine, EngineConfig, PersistBlock, TierConfig, WantedBlock};
use deepinfer_engine::model::Model;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::Request;

use super::*;

const HOUR_MS: u64 = 3_600_000;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-kv-disk-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    dir
}

/// A model and the blocks it hands out for a 300-token prompt.
fn blocks() -> (Arc<Model>, Vec<PersistBlock>) {
    let model = Arc::new(build(Preset::TinyV4, 7).unwrap());
    let mut engine =
        Engine::new(model.clone(), EngineConfig { cache_ttl_ms: HOUR_MS, ..EngineConfig::default() }).unwrap();
    engine.configure_tiers(TierConfig { disk: true, ..TierConfig::default() });
    let prompt: Vec<u32> = (0..300).map(|i| 2 + (i * 37) % 900).collect();
    engine.add_request(Request::new(prompt, 2)).unwrap();
    engine.run_to_completion();
    (model, engine.take_persist())
}

fn wanted(blocks: &[PersistBlock]) -> Vec<WantedBlock> {
    blocks.iter().map(|b| WantedBlock { key: b.key, parent: b.parent, tokens: b.tokens.clone() }).collect()
}

fn open(model: &Arc<Model>, dir: &Path, capacity_bytes: u64, now_ms: u64) -> (DiskTier, Arc<DiskStats>) {
    let config = DiskConfig { dir: dir.to_path_buf(), capacity_bytes, weights_identity: "tiny seed 7".into() };
    let stats = Arc::new(DiskStats::default());
    (DiskTier::open(model.clone(), 64, &config, stats.clone(), now_ms), stats)
}

#[test]
fn blocks_survive_a_reopen_and_expire_by_their_ttl() {
    let (model, blocks) = blocks();
    assert_eq!(blocks.len(), 4);
    let dir = temp("reopen");
    let t0 = 1_700_000_000_000;
    let (mut tier, stats) = open(&model, &dir, 1 << 30, t0);
    blocks.iter().for_each(|b| tier.write(b, t0));
    blocks.iter().for_each(|b| tier.write(b, t0));
    assert_eq!((DiskStats::get(&stats.written_blocks), DiskStats::get(&stats.already_present)), (4, 4));
    drop(tier);

    let (mut tier, stats) = open(&model, &dir, 1 << 30, t0 + 1000);
    assert_eq!(DiskStats::get(&stats.indexed_at_start), 4);
    let got = tier.fetch(&wanted(&blocks), t0 + 1000);
    assert_eq!(got.len(), 4);
    for (g, b) in got.iter().zip(&blocks) {
        assert_eq!(g.values, *b.values, "values come back bit for bit");
        assert_eq!(g.expires_at_ms, t0 + 1000 + HOUR_MS);
    }
    // The hit refreshed every file's TTL: 59 minutes later a new process still finds them.
    drop(tier);
    let later = t0 + 1000 + HOUR_MS - 60_000;
    let (mut tier, stats) = open(&model, &dir, 1 << 30, later);
    assert_eq!(DiskStats::get(&stats.indexed_at_start), 4);
    assert_eq!(tier.fetch(&wanted(&blocks)[..1], later).len(), 1);
    drop(tier);
    // Past the TTL of the untouched ones: removed at the index rebuild.
    let (tier, stats) = open(&model, &dir, 1 << 30, later + HOUR_MS - 1000);
    assert_eq!((tier.len(), DiskStats::get(&stats.expired_blocks)), (1, 3));
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn the_byte_budget_removes_the_least_recently_used_files() {
    let (model, blocks) = blocks();
    let dir = temp("budget");
    let size = fs::metadata({
        let (mut tier, _) = open(&model, &dir, 1 << 30, 0);
        tier.write(&blocks[0], 0);
        tier.path(blocks[0].key)
    })
    .unwrap()
    .len();
    let _ = fs::remove_dir_all(&dir);
    let (mut tier, stats) = open(&model, &dir, 2 * size + size / 2, 0);
    blocks.iter().for_each(|b| tier.write(b, 0));
    assert_eq!((tier.len(), DiskStats::get(&stats.evicted_blocks)), (2, 2));
    assert!(!tier.path(blocks[0].key).exists() && tier.path(blocks[3].key).exists());
    // A chain whose head is gone is a miss from the start.
    assert!(tier.fetch(&wanted(&blocks), 0).is_empty());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn foreign_and_misnamed_files_are_skipped_and_removed() {
    let (model, blocks) = blocks();
    let dir = temp("foreign");
    let (mut tier, _) = open(&model, &dir, 1 << 30, 0);
    blocks.iter().for_each(|b| tier.write(b, 0));
    let root = tier.root().to_path_buf();
    drop(tier);
    // Another model's block copied into this model's directory.
    let other = DiskConfig { dir: temp("other"), capacity_bytes: 1 << 30, weights_identity: "tiny seed 8".into() };
    let mut foreign = DiskTier::open(model.clone(), 64, &other, Arc::default(), 0);
    foreign.write(&blocks[0], 0);
    let foreign_path = foreign.path(blocks[0].key);
    // A shard no block of ours lives in.
    let shard = root.join(format!("{:02x}", ((blocks[0].key >> 56) + 1) & 0xff));
    fs::create_dir_all(&shard).unwrap();
    fs::copy(&foreign_path, shard.join(format!("{:016x}.kvb", blocks[0].key))).unwrap();
    // A good file under another block's name.
    let mine = root.join(format!("{:02x}", blocks[1].key >> 56)).join(format!("{:016x}.kvb", blocks[1].key));
    fs::copy(&mine, shard.join("0000000000000001.kvb")).unwrap();
    let (tier, stats) = open(&model, &dir, 1 << 30, 0);
    assert_eq!(tier.len(), 4);
    assert_eq!((DiskStats::get(&stats.foreign_files), DiskStats::get(&stats.corrupt_files)), (1, 1));
    assert!(!shard.join("0000000000000001.kvb").exists());
    let _ = fs::remove_dir_all(&dir);
    let _ = fs::remove_dir_all(&other.dir);
}
