//! Expert parallelism changes where experts run, never the bits: tokens and
//! logits of an N-device cluster equal the single-device `Model::forward`.

mod common;

use common::{assert_same, model, model_v41, prompt, reference, request, requests};
use deepinfer_actors::cluster::placement::Placement;
use deepinfer_actors::{run_in_process, run_simulated, ClusterConfig};
use deepinfer_engine::sampling::SamplingParams;

fn config(devices: u32, ep: u32) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(devices, ep);
    cfg.return_logits = true;
    cfg
}

#[test]
fn one_device_matches_the_engine() {
    let m = model();
    let reqs = requests(3, 4);
    let want = reference(&m, &reqs);
    let report = run_simulated(m.clone(), config(1, 1), &reqs).unwrap();
    assert_same(&report.outputs, &want, "1 device, simulated");
}

#[test]
fn eight_devices_expert_parallel_eight_match_one_device() {
    let m = model();
    let reqs = requests(10, 5);
    let want = reference(&m, &reqs);
    let mut cfg = config(8, 8);
    cfg.keep_events = 1 << 20;
    let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "8 × EP 8, simulated");
    assert_eq!(sim.metrics.restarts(), 0);
    assert_eq!(sim.metrics.frames_rejected, 0);
    // All-to-all: every worker dispatched to every shard.
    for w in 0..8 {
        for s in 0..8 {
            let hop = format!("deliver worker{w}->shard{s} ");
            assert!(sim.log.iter().any(|l| l.contains(&hop)), "no dispatch from worker{w} to shard{s}");
        }
    }
    let real = run_in_process(m.clone(), config(8, 8), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "8 × EP 8, in-process");
}

/// DeepSeek-V4.1 ships each row's routing weight with it (its experts apply it
/// before the down projection); prompts long enough for both KV groups to
/// compress and the candidate filter to choose.
#[test]
fn v41_eight_devices_expert_parallel_eight_match_one_device() {
    let m = model_v41();
    let mut reqs = requests(4, 4);
    reqs.push(request(prompt(90, 5), 6, SamplingParams::default()));
    let want = reference(&m, &reqs);
    let sim = run_simulated(m.clone(), config(8, 8), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "V4.1, 8 × EP 8, simulated");
    assert_eq!(sim.metrics.frames_rejected, 0);
    let real = run_in_process(m.clone(), config(8, 8), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "V4.1, 8 × EP 8, in-process");
}

#[test]
fn four_devices_expert_parallel_two_match_one_device() {
    let m = model();
    let reqs = requests(7, 5);
    let want = reference(&m, &reqs);
    let mut cfg = config(4, 2);
    cfg.devices_per_node = 2;
    let sim = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "4 × EP 2 on 2 nodes, simulated");
    let real = run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "4 × EP 2, in-process");
}

#[test]
fn redundant_experts_and_placement_changes_keep_the_bits() {
    let m = model();
    let reqs = requests(6, 6);
    let want = reference(&m, &reqs);
    let experts = m.config.n_routed_experts as u32;
    // Hot experts 0 and 5 copied onto every device; then a rebalanced table
    // with different copies; then plain expert parallelism again.
    let mut hot = Placement::expert_parallel(experts, 4, 4).unwrap();
    for d in 0..4 {
        hot = hot.with_replica(0, d).unwrap().with_replica(5, d).unwrap();
    }
    let mut shifted = Placement::new(4, (0..experts).map(|e| vec![(e + 1) % 4, (e + 2) % 4]).collect()).unwrap();
    shifted = shifted.with_replica(3, 0).unwrap();
    let mut cfg = config(4, 4);
    cfg.placement = Some(hot);
    cfg.placement_changes = vec![(2, shifted), (4, Placement::expert_parallel(experts, 4, 4).unwrap())];
    cfg.keep_events = 1 << 20;
    let sim = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "redundant experts, simulated");
    // Both changes were loaded by every shard before the step that used them.
    for epoch in [1, 2] {
        let loaded = sim.log.iter().filter(|l| l.contains(&format!("(epoch {epoch})"))).count();
        assert_eq!(loaded, 4, "shards holding epoch {epoch}");
    }
    // Every device served rows.
    for d in 0..4 {
        assert!(sim.log.iter().any(|l| l.contains(&format!("->shard{d} dispatch"))), "shard{d} idle");
    }
    let real = run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "redundant experts, in-process");
}
