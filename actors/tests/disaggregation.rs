//! Prefill/decode disaggregation and run-time EPLB change where work runs,
//! never the bits: a request prefilled on one instance and decoded on
//! another from the transferred state equals the single-device reference;
//! lost transfers and a decode node that dies during a transfer cost a retry
//! or a recompute, never a request; a cluster that rebalances its experts
//! from measured loads gives the same tokens and logits as one that does not.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{assert_same, model, model_v41, prompt, reference, request, requests};
use deepinfer_actors::cluster::disagg::{EplbConfig, InstanceKind};
use deepinfer_actors::sim::fabric::Partition;
use deepinfer_actors::sim::faults::{FaultPlan, KillRule, MessageAction, MessageRule, Target};
use deepinfer_actors::sim::rng::Seed;
use deepinfer_actors::wire::MsgKind;
use deepinfer_actors::{run_in_process, run_simulated, simulate, Cluster, ClusterConfig, GenRequest, Update};
use deepinfer_engine::request::FinishReason;
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
    let sampled =
        SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, seed: 5, logprobs: 2, ..SamplingParams::default() };
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
    assert!(sim.log.iter().any(|l| l.contains("scheduler0 transfers request")));
    // The decode instance's worker never prefilled: one token per sequence in every step.
    let decode_steps: Vec<&String> =
        sim.log.iter().filter(|l| l.contains("worker1 step") && l.contains("tokens")).collect();
    assert!(!decode_steps.is_empty());
    for l in decode_steps {
        let n: Vec<&str> = l.split(": ").nth(1).unwrap().split(' ').collect();
        assert_eq!(n[0], n[2], "{l}");
    }
    // Same seed, same run.
    assert_eq!(run_simulated(m.clone(), split(1), &reqs).unwrap().digest, sim.digest);

    let sim = run_simulated(m.clone(), split(2), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "2 + 2 (EP 2) disaggregated, simulated");
    let real = run_in_process(m.clone(), split(1), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "1 + 1 disaggregated, in-process");
}

/// DeepSeek-V4.1: the moved state is each KV group's entries and index keys,
/// every layer's window, the open ratio-2 groups and the Engram look-back.
#[test]
fn v41_prefill_on_one_instance_decode_on_another_matches_one_device() {
    let m = model_v41();
    let reqs = workload();
    let want = reference(&m, &reqs);
    let sim = run_simulated(m.clone(), split(1), &reqs).unwrap();
    assert_same(&sim.outputs, &want, "V4.1, 1 + 1 disaggregated, simulated");
    assert_eq!(count(&sim.log, "adopts request"), reqs.len(), "adoptions");
    assert_eq!(count(&sim.log, "recomputes request"), 0);
    let real = run_in_process(m.clone(), split(2), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "V4.1, 2 + 2 (EP 2) disaggregated, in-process");
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
    cfg.eplb = Some(EplbConfig { every_steps: 2, decay: 0.5, redundant: 4, min_gain: 0.0 });
    let on = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&on.outputs, &want, "EPLB on");
    let changes = count(&on.log, "eplb: new expert table");
    assert!(changes > 0, "the measured loads changed the table");
    // Every shard loaded each new table before a step ran under it.
    assert_eq!(count(&on.log, "(epoch 1)"), 4);
    let real = run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "EPLB on, in-process");
}

#[test]
fn a_request_cancelled_during_its_handoff_ends_and_the_others_do_not_change() {
    let m = model();
    let reqs = requests(3, 12);
    let want = reference(&m, &reqs);
    let (got, report) = simulate(m.clone(), split(1), async |c: &mut Cluster| {
        let ids: Vec<u64> = reqs.iter().map(|r| c.submit(r.clone())).collect();
        let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut ends = BTreeMap::new();
        while let Some(u) = c.next_update().await {
            match u {
                Update::Tokens { id, tokens: t, .. } => {
                    let seen = tokens.entry(id).or_default();
                    seen.extend(t.iter().map(|t| t.token));
                    // The first token comes from the prefill instance, as the state leaves it.
                    if id == ids[1] && !ends.contains_key(&id) {
                        c.cancel(id);
                        ends.insert(id, None);
                    }
                }
                Update::Finished { id, finished } => {
                    ends.insert(id, Some(finished.reason));
                }
                Update::Refused { .. } => unreachable!(),
            }
        }
        (ids, tokens, ends)
    })
    .unwrap();
    let (ids, tokens, ends) = got;
    assert_eq!(ends[&ids[1]], Some(FinishReason::Cancelled));
    let cancelled = &tokens[&ids[1]];
    assert!(!cancelled.is_empty() && cancelled.len() < 12 && cancelled[..] == want[1].tokens[..cancelled.len()]);
    for i in [0, 2] {
        assert_eq!(tokens[&ids[i]], want[i].tokens);
        assert_eq!(ends[&ids[i]], Some(FinishReason::Length));
    }
    assert!(count(&report.log, "adopts request") >= 2);
}

#[test]
fn a_random_kill_in_each_of_24_seeds_never_changes_a_disaggregated_output() {
    let m = model();
    let reqs = workload();
    let want = reference(&m, &reqs);
    let layers = m.config.num_layers as u32;
    let mut kills = 0;
    for seed in 0..24u64 {
        let mut cfg = split(2);
        cfg.seed = seed;
        cfg.keep_events = 0;
        let plan = FaultPlan::random_kill(Seed(seed), 4, 2, 2, 6, layers);
        cfg.faults = Some(plan.clone());
        let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}, plan {plan:?}"));
        assert_eq!(report.metrics.escalations, 0, "seed {seed}");
        kills += report.metrics.kills_injected;
    }
    assert!(kills >= 18, "most planned kills reach their actor: {kills} of 24");
}
