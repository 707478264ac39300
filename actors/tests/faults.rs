//! A failed actor costs a replayed step, never a request: with a random
//! worker, shard, scheduler, cache manager, router or node killed at a
//! random step, every request completes with exactly the fault-free output.
//! Past the restart intensity, the affected requests end with an error and
//! the run still finishes.

mod common;

use std::time::Duration;

use common::{assert_same, model, prompt, reference, request, requests};
use deepinfer_actors::actor::supervisor::Intensity;
use deepinfer_actors::cluster::ctx::Timeouts;
use deepinfer_actors::proto::membership::MembershipConfig;
use deepinfer_actors::sim::fabric::Partition;
use deepinfer_actors::sim::faults::{FaultPlan, KillRule, MessageAction, MessageRule, SlowDevice, Target};
use deepinfer_actors::sim::rng::Seed;
use deepinfer_actors::wire::MsgKind;
use deepinfer_actors::{run_simulated, ClusterConfig, GenRequest};
use deepinfer_engine::engine::EngineConfig;
use deepinfer_engine::sampling::SamplingParams;

const STEPS: usize = 4;

/// 4 devices on 2 nodes, expert parallel 2 (each expert on two devices).
fn config(seed: u64) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(4, 2);
    cfg.devices_per_node = 2;
    cfg.seed = seed;
    cfg.return_logits = true;
    cfg
}

/// Short requests, and three that share a 70-token prefix (one full prefix
/// block) so that later ones start from the cached block.
fn mixed_requests() -> Vec<GenRequest> {
    let mut reqs = requests(5, STEPS);
    let shared = prompt(70, 91);
    for (i, tail) in [3usize, 7, 5].into_iter().enumerate() {
        let params = if i == 1 {
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                top_k: 40,
                seed: 77,
                logprobs: 0,
                ..SamplingParams::default()
            }
        } else {
            SamplingParams::default()
        };
        reqs.push(request([shared.clone(), prompt(tail, 200 + i as u32)].concat(), STEPS, params));
    }
    reqs
}

/// Two instances of 2 devices (one per node), small steps: prefills are
/// chunked and requests are admitted over several steps.
fn two_instances(seed: u64) -> ClusterConfig {
    let mut cfg = config(seed);
    cfg.instances = 2;
    cfg.engine = EngineConfig { max_batch_tokens: 32, ..EngineConfig::default() };
    cfg
}

#[test]
fn a_random_kill_in_each_of_60_seeds_never_changes_the_output() {
    let m = model();
    let reqs = mixed_requests();
    let want = reference(&m, &reqs);
    let layers = m.config.num_layers as u32;
    let (mut kills, mut restarts, mut hits, mut resumed) = (0, 0, 0, 0);
    let mut by_target = [0u32; 6];
    for seed in 0..60u64 {
        let mut cfg = two_instances(seed);
        let plan = FaultPlan::random_kill(Seed(seed), 4, 2, 2, 8, layers);
        by_target[match plan.kills[0].target {
            Target::Worker(_) => 0,
            Target::Shard(_) => 1,
            Target::Scheduler(_) => 2,
            Target::CacheManager(_) => 3,
            Target::Router => 4,
            Target::Node(_) => 5,
            Target::Encoder(_) => unreachable!("a cluster without encoders draws none"),
        }] += 1;
        cfg.faults = Some(plan.clone());
        let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}, plan {plan:?}"));
        let mx = &report.metrics;
        assert_eq!(mx.restarts(), mx.kills_injected, "seed {seed}: one restart per kill ({mx:?})");
        assert_eq!(mx.escalations, 0, "seed {seed}");
        kills += mx.kills_injected;
        restarts += mx.restarts();
        hits += mx.cache_hits;
        resumed += mx.requests_resumed;
    }
    println!(
        "60 seeds: {kills} kills, {restarts} restarts, {hits} prefix hits, {resumed} requests resumed; \
         targets worker/shard/scheduler/cache/router/node = {by_target:?}"
    );
    assert!(by_target.iter().all(|&n| n > 0), "every kind of target drawn: {by_target:?}");
    assert!(kills >= 55, "most planned kills reach their actor: {kills} of 60");
    assert!(hits > 0 && resumed > 0, "prefix hits and resumed requests happened");
}

#[test]
fn dropped_delayed_duplicated_messages_slow_devices_and_partitions_do_not_change_the_output() {
    let m = model();
    let reqs = requests(6, STEPS);
    let want = reference(&m, &reqs);
    for seed in 0..8u64 {
        let mut cfg = config(seed);
        let rule = |kind, action, probability, max_hits| MessageRule { kind, action, probability, max_hits };
        cfg.faults = Some(FaultPlan {
            kills: Vec::new(),
            messages: vec![
                rule(MsgKind::Dispatch, MessageAction::Drop, 0.05, 10),
                rule(MsgKind::ExpertResult, MessageAction::Duplicate, 0.1, 20),
                rule(MsgKind::ExpertResult, MessageAction::Drop, 0.03, 5),
                rule(MsgKind::StepResult, MessageAction::Drop, 0.2, 3),
                rule(MsgKind::StepRequest, MessageAction::Delay(Duration::from_millis(3)), 0.3, 10),
                rule(MsgKind::StepRequest, MessageAction::Duplicate, 0.2, 10),
            ],
            slow: vec![SlowDevice { device: (seed % 4) as u32, per_layer: Duration::from_micros(300) }],
            stragglers: Vec::new(),
        });
        cfg.fabric.drop = 0.002;
        cfg.fabric.duplicate = 0.01;
        cfg.fabric.partitions = vec![Partition {
            a: vec![0],
            b: vec![1],
            from: Duration::from_micros(50),
            until: Duration::from_millis(30),
        }];
        let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}"));
        let mx = &report.metrics;
        assert!(mx.frames_dropped > 0 && mx.frames_duplicated > 0, "seed {seed}: faults happened: {mx:?}");
        assert!(mx.dispatch_resends + mx.step_resends > 0, "seed {seed}: lost work was re-sent: {mx:?}");
    }
}

#[test]
fn past_the_restart_intensity_requests_end_with_an_error() {
    let m = model();
    // Request 0 (worker 0) finishes in one step; the others need five.
    let mut reqs = requests(4, 5);
    reqs[0].max_tokens = 1;
    let mut cfg = config(3);
    cfg.node_intensity = Intensity::new(2, Duration::from_secs(10));
    cfg.cluster_intensity = Intensity::new(1, Duration::from_secs(60));
    cfg.timeouts = Some(Timeouts { step_attempts: 100, ..Timeouts::simulated() });
    // Every incarnation of worker 1 crashes from step 1 on.
    cfg.faults = Some(FaultPlan {
        kills: vec![KillRule { target: Target::Worker(1), step: 1, layer: 0, repeat: true }],
        ..FaultPlan::default()
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let (mm, rr) = (m.clone(), reqs.clone());
    std::thread::spawn(move || tx.send(run_simulated(mm, cfg, &rr).unwrap()).unwrap());
    let report = rx.recv_timeout(Duration::from_secs(120)).expect("the run ends (nothing hangs)");
    // What ran only on worker 0 may finish before the faults (request 0, if
    // it arrived in time); everything else ends with why, none hangs.
    let mut failed = None;
    for (i, (out, r)) in report.outputs.iter().zip(&reqs).enumerate() {
        match out {
            Ok(g) => assert_eq!(g.tokens.len(), r.max_tokens, "request {i} is complete"),
            Err(err) => {
                assert!(
                    err.reason.contains("cluster down") && err.reason.contains("exceed"),
                    "request {i}: {}",
                    err.reason
                );
                assert!(err.tokens.len() < r.max_tokens, "request {i} is incomplete");
                failed = Some(err.reason.clone());
            }
        }
    }
    let why = failed.expect("the requests on worker 1 fail");
    assert!(report.outputs.iter().skip(1).all(Result::is_err), "only request 0 can finish in one step");
    let mx = &report.metrics;
    println!("intensity: {mx:?}\n{why}");
    // node0 restarts worker1 twice, gives up; the cluster restarts node0 once; node0 gives up again; the cluster gives up.
    assert_eq!(mx.worker_restarts, 4, "{mx:?}");
    assert_eq!(mx.supervisor_restarts, 1, "{mx:?}");
    assert_eq!(mx.escalations, 3, "{mx:?}");
}

#[test]
fn requests_whose_steps_cannot_be_delivered_end_with_an_error() {
    let m = model();
    let reqs = requests(4, 3);
    let want = reference(&m, &reqs);
    let mut cfg = config(5);
    cfg.timeouts = Some(Timeouts { step_attempts: 3, ..Timeouts::simulated() });
    // Every step request to a worker is dropped for the whole run: no
    // actor dies, so no supervisor acts; the scheduler gives up per request.
    cfg.faults = Some(FaultPlan {
        messages: vec![MessageRule {
            kind: MsgKind::StepRequest,
            action: MessageAction::Drop,
            probability: 1.0,
            max_hits: u32::MAX,
        }],
        ..FaultPlan::default()
    });
    let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
    for out in &report.outputs {
        let err = out.as_ref().expect_err("unreachable");
        assert!(err.reason.contains("failed after 3 attempts: no answer"), "{}", err.reason);
    }
    // And the same cluster with one lost step request recovers.
    let mut cfg = config(5);
    cfg.faults = Some(FaultPlan {
        messages: vec![MessageRule {
            kind: MsgKind::StepRequest,
            action: MessageAction::Drop,
            probability: 1.0,
            max_hits: 1,
        }],
        ..FaultPlan::default()
    });
    let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
    assert_same(&report.outputs, &want, "one lost step request");
    assert_eq!(report.metrics.step_resends, 1);
}

/// Supervision is the same on real threads and wall time.
#[test]
fn the_in_process_cluster_recovers_from_killed_workers_and_shards() {
    let m = model();
    let reqs = requests(6, STEPS);
    let want = reference(&m, &reqs);
    let mut cfg = config(0);
    cfg.timeouts = Some(Timeouts { dispatch: Duration::from_millis(200), ..Timeouts::real() });
    cfg.faults = Some(FaultPlan {
        kills: vec![
            KillRule { target: Target::Worker(2), step: 1, layer: 3, repeat: false },
            KillRule { target: Target::Shard(1), step: 2, layer: 5, repeat: false },
        ],
        ..FaultPlan::default()
    });
    let report = deepinfer_actors::run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&report.outputs, &want, "in-process with kills");
    let mx = &report.metrics;
    assert_eq!((mx.kills_injected, mx.worker_restarts, mx.shard_restarts), (2, 1, 1), "{mx:?}");
}

/// Node 1 is cut off for good: membership, running as an actor per node
/// over the simulated fabric, declares it down, and every request
/// completes on node 0 with the fault-free output — requests of the
/// instance that lived on node 1 moved by the router, and an instance that
/// spanned both nodes re-placed on its surviving devices.
#[test]
fn a_node_lost_for_good_is_declared_down_and_its_requests_complete_elsewhere() {
    let m = model();
    let reqs = requests(6, STEPS);
    let want = reference(&m, &reqs);
    for (name, two) in [("an instance per node", true), ("one instance on both nodes", false)] {
        let run = |seed: u64| {
            let mut cfg = if two { two_instances(seed) } else { config(seed) };
            cfg.membership = Some(MembershipConfig::simulated());
            cfg.keep_events = 100_000;
            // Slow steps keep requests in flight past the first heartbeats,
            // when node 1 goes.
            let slow = (0..4).map(|device| SlowDevice { device, per_layer: Duration::from_millis(3) }).collect();
            cfg.faults = Some(FaultPlan { slow, ..FaultPlan::default() });
            cfg.fabric.partitions =
                vec![Partition { a: vec![0], b: vec![1], from: Duration::from_millis(30), until: Duration::MAX }];
            run_simulated(m.clone(), cfg, &reqs).unwrap()
        };
        for seed in 0..3u64 {
            let report = run(seed);
            assert_same(&report.outputs, &want, &format!("{name}, seed {seed}"));
            let declared = report.log.iter().any(|l| l.contains("node0 membership: Down { node: 1"));
            assert!(declared, "{name}, seed {seed}: node 0 declared node 1 down after {:?}", report.elapsed);
            let moved = report.log.iter().any(|l| l.contains("router moves request") || l.contains("is down (devices"));
            assert!(moved, "{name}, seed {seed}: work left node 1");
            assert_eq!(report.digest, run(seed).digest, "{name}, seed {seed}: the same seed, the same run");
        }
    }
}
