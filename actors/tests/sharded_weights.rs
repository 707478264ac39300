//! Experts sharded for real: with a model loaded without its routed experts,
//! each shard reads from the checkpoint only the experts placed on it, a
//! rebalanced table is read ahead while the old one serves and frees what
//! it leaves out, and no token or logit changes.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{assert_same, model, reference, requests};
use deepinfer_actors::cluster::disagg::EplbConfig;
use deepinfer_actors::{run_simulated, ClusterConfig};
use deepinfer_engine::model::{Model, RoutedExperts};
use deepinfer_engine::presets::{random_checkpoint, serialize, Preset};

/// The tiny-v4 preset of [`common::model`] written as a checkpoint directory.
fn checkpoint_dir(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-sharded-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let preset = Preset::TinyV4;
    std::fs::write(dir.join("config.json"), preset.config_json().to_string()).unwrap();
    std::fs::write(dir.join("model.safetensors"), serialize(&random_checkpoint(&preset.config(), 7))).unwrap();
    dir
}

fn all_expert_bytes(m: &Model) -> u64 {
    (0..m.config.n_routed_experts as u32).map(|e| m.routed_expert(e).unwrap().bytes).sum()
}

#[test]
fn each_shard_reads_only_its_experts_and_the_tokens_are_the_whole_models() {
    let dir = checkpoint_dir("ep4");
    let sharded = Arc::new(Model::load_with(&dir, RoutedExperts::Elsewhere, None).unwrap());
    let whole = model();
    let reqs = requests(4, 6);
    let want = reference(&whole, &reqs);
    let mut cfg = ClusterConfig::new(4, 4);
    cfg.return_logits = true;
    let run = run_simulated(Arc::clone(&sharded), cfg, &reqs).unwrap();
    assert_same(&run.outputs, &want, "EP4 over experts read by their shards");
    // Four shards of two experts each: every expert read once, none twice.
    assert_eq!(run.metrics.expert_bytes_read, all_expert_bytes(&whole));
    assert_eq!(run.metrics.expert_bytes_freed, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rebalanced_table_is_read_ahead_moves_weights_and_keeps_the_bits() {
    let dir = checkpoint_dir("eplb");
    let sharded = Arc::new(Model::load_with(&dir, RoutedExperts::Elsewhere, None).unwrap());
    let whole = model();
    let reqs = requests(6, 8);
    let want = reference(&whole, &reqs);
    let mut cfg = ClusterConfig::new(4, 4);
    cfg.return_logits = true;
    cfg.keep_events = 1 << 20;
    cfg.eplb = Some(EplbConfig { every_steps: 2, decay: 0.5, redundant: 4, min_gain: 0.0 });
    let run = run_simulated(Arc::clone(&sharded), cfg.clone(), &reqs).unwrap();
    assert_same(&run.outputs, &want, "EPLB over sharded weights");
    assert!(run.metrics.placements_prepared > 0, "a table was prepared ahead and switched to");
    let initial = all_expert_bytes(&whole);
    assert!(run.metrics.expert_bytes_read > initial, "the new tables' experts were read");
    assert!(run.metrics.expert_bytes_freed > 0, "what a new table left out was freed");
    assert!(run.log.iter().any(|l| l.contains("eplb: epoch") && l.contains("prepared")));
    // Same seed, same run.
    let again = run_simulated(sharded, cfg, &reqs).unwrap();
    assert_eq!(again.digest, run.digest);
    let _ = std::fs::remove_dir_all(&dir);
}
