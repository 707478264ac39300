//! Prefill/decode disaggregation and run-time EPLB change where work runs,
//! never the bits: a request prefilled on one instance and decoded on
//! another from the transferred state equals the single-device reference;
//! lost transfers and a decode node that dies during a transfer cost a retry
//! or a recompute, never a request; a cluster that rebalances its experts
//! from measured loads gives the same tokens and logits as one that does not.

mod common;

use std::time::Duration;

use common::{assert_same, model, prompt, reference, request, requests};
use deepinfer_actors::disagg::{EplbConfig, InstanceKind};
use deepinfer_actors::faults::{FaultPlan, KillRule, MessageAction, MessageRule, Target};
use deepinfer_actors::sim::Partition;
use deepinfer_actors::wire::MsgKind;
use deepinfer_actors::{run_in_process, run_simulated, ClusterConfig, GenRequest};
use deepinfer_engine::sampling::SamplingParams;

/// Instance 0 prefills, instance 1 decodes; one device each, one node each.
fn split(devices_per_instance: u32) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(2 * devices_per_instance, devices_per_instance);
    cfg.instances = 2;
    cfg.devices_per_node = devices_per_instance;
    cfg.instance_kinds = vec![InstanceKind::Prefill, InstanceKind::Decode];
    cfg.return_logits = true;
    cfg.keep_events = 1 << 20;
    cfg
}

/// Short prompts and two that cross compressor windows and a prefix block.
fn workload() -> Vec<GenRequest> {
    let mut reqs = requests(4, 5);
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, seed: 5, logprobs: 2 };
    reqs.push(request(prompt(75, 3), 6, sampled));
    reqs.push(request(prompt(130, 4), 4, SamplingParams::default()));
    reqs
}

fn count(log: &[String], needle: &str) -> usize {
    log.iter().filter(|l| l.contains(needle)).count()
}

#[test]
fn prefill_on_one_instance_decode_on_another_matches_one_device() {
    let m = model();
    let reqs = workload();
    let want = reference(&m, &reqs);
    let sim = run_simulated(m.clone(), split(1), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "1 + 1 disaggregated, simulated");
    // Every request moved with its state and none was recomputed.
    assert_eq!(count(&sim.log, "adopts request"), reqs.len(), "adoptions");
    assert_eq!(count(&sim.log, "recomputes request"), 0);
    assert_eq!(count(&sim.log, "reroutes request"), 0);
    // The decode instance never prefilled: its steps feed one token per sequence.
    assert!(sim.log.iter().any(|l| l.contains("scheduler0 transfers request")));

    let sim = run_simulated(m.clone(), split(2), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "2 + 2 (EP 2) disaggregated, simulated");
    let real = run_in_process(m.clone(), split(1), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "1 + 1 disaggregated, in-process");
}

#[test]
fn lost_transfers_are_retried_and_a_decode_node_killed_mid_transfer_costs_no_request() {
    let m = model();
    let reqs = workload();
    let want = reference(&m, &reqs);
    // The first two transfers are lost: sent again.
    let mut cfg = split(1);
    cfg.faults = Some(FaultPlan {
        messages: vec![MessageRule {
            kind: MsgKind::Handoff,
            action: MessageAction::Drop,
            probability: 1.0,
            max_hits: 2,
        }],
        ..FaultPlan::default()
    });
    let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "lost transfers");
    assert!(count(&sim.log, "(attempt 1)") > 0, "a transfer was sent again");

    // The decode node is cut off for a while: every transfer is lost; after
    // its attempts the router places the request on the decode instance
    // again once it is reachable, and it is recomputed there.
    let mut cfg = split(1);
    cfg.fabric.partitions =
        vec![Partition { a: vec![0], b: vec![1], from: Duration::ZERO, until: Duration::from_millis(200) }];
    let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "every transfer lost");
    assert_eq!(count(&sim.log, "reroutes request"), reqs.len());
    assert_eq!(count(&sim.log, "adopts request"), 0);

    // Everything of the handoff protocol is lost, the reroutes too: the
    // router's silence timer submits again; each time the prefill instance
    // recomputes, makes a token and tries again. Slow, but nothing is lost.
    let mut cfg = split(1);
    cfg.faults = Some(FaultPlan {
        messages: vec![MessageRule {
            kind: MsgKind::Handoff,
            action: MessageAction::Drop,
            probability: 1.0,
            max_hits: u32::MAX,
        }],
        ..FaultPlan::default()
    });
    let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "every handoff message lost");

    // The decode node (its scheduler, worker, shard and cache) dies when an
    // instance starts step 1 (a transfer is on its way: the new incarnation
    // adopts it) or step 2 (one request was adopted: the router submits it
    // again and the new incarnation recomputes it).
    for step in 1..3 {
        let mut cfg = split(1);
        cfg.faults = Some(FaultPlan {
            kills: vec![KillRule { target: Target::Node(1), step, layer: 0, repeat: false }],
            ..FaultPlan::default()
        });
        let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&sim.outputs, &want, &format!("decode node killed at step {step}"));
        assert_eq!(sim.metrics.kills_injected, 1, "step {step}: the kill happened");
    }
}

#[test]
fn run_time_eplb_moves_experts_and_keeps_the_bits() {
    let m = model();
    let reqs = requests(6, 8);
    let mut cfg = ClusterConfig::new(4, 4);
    cfg.return_logits = true;
    cfg.keep_events = 1 << 20;
    let want = reference(&m, &reqs);
    let off = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&off.outputs, &want, "EPLB off");
    cfg.eplb = Some(EplbConfig { every_steps: 2, decay: 0.5, redundant: 4 });
    let on = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&on.outputs, &want, "EPLB on");
    let changes = count(&on.log, "eplb: new expert table");
    assert!(changes > 0, "the measured loads changed the table");
    // Every shard loaded each new table before a step ran under it.
    assert_eq!(count(&on.log, "(epoch 1)"), 4);
    let real = run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "EPLB on, in-process");
}
