//! No single point of failure, in the deterministic simulation, over 20
//! seeds each (every run reproduced to the same event digest):
//! - the node that runs the active router is cut off for good in the middle
//!   of a batch; membership declares it dead, the next router node's router
//!   takes over, the client submits every request there again with the
//!   tokens it has, and every request completes with the fault-free output;
//! - a node cut off for a while comes back: declared dead, then up again,
//!   it rejoins its instance (its experts are put back at the next step)
//!   and no request is lost or changed;
//! - a drained node: no new request goes to its instance while the
//!   requests already there finish; it stops (cut off) and comes back, and
//!   its instance takes requests again;
//! - a front end lost mid-stream: the routers cancel its requests once it
//!   is silent, and another front end serves the same batch;
//! - a node cut off with a minority fences: no table change, no step,
//!   until the partition heals.

mod common;

use std::time::Duration;

use common::{assert_same, model, reference, requests};
use deepinfer_actors::proto::membership::MembershipConfig;
use deepinfer_actors::sim::fabric::Partition;
use deepinfer_actors::sim::faults::{FaultPlan, SlowDevice};
use deepinfer_actors::{run_simulated, simulate, Cluster, ClusterConfig};
use deepinfer_engine::engine::EngineConfig;

const STEPS: usize = 6;

/// Four one-device nodes in two instances (nodes 0–1 and 2–3); routers on
/// nodes 0 and 1; the client on node 3's side of the fabric; node 0 cut
/// off from the rest at `cut`.
fn config(seed: u64, cut: Duration) -> ClusterConfig {
    config_cut(seed, 0, 3, cut, Duration::MAX)
}

/// As [`config`], with node `cut_node` cut off over `from..until` and the client on `client_node`'s side.
fn config_cut(seed: u64, cut_node: u32, client_node: u32, from: Duration, until: Duration) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(4, 2);
    cfg.devices_per_node = 1;
    cfg.instances = 2;
    cfg.seed = seed;
    cfg.return_logits = true;
    cfg.client_node = client_node;
    cfg.keep_events = 200_000;
    cfg.engine = EngineConfig { max_batch_tokens: 32, ..EngineConfig::default() };
    cfg.membership = Some(MembershipConfig::simulated());
    // Slow steps keep requests in flight when node 0 goes.
    let slow = (0..4).map(|device| SlowDevice { device, per_layer: Duration::from_millis(3) }).collect();
    cfg.faults = Some(FaultPlan { slow, ..FaultPlan::default() });
    let rest = (0..4).filter(|&n| n != cut_node).collect();
    cfg.fabric.partitions = vec![Partition { a: vec![cut_node], b: rest, from, until }];
    cfg
}

#[test]
fn losing_the_active_routers_node_loses_no_request_over_20_seeds() {
    let m = model();
    let reqs = requests(6, STEPS);
    let want = reference(&m, &reqs);
    let mut took_over = 0;
    for seed in 0..20u64 {
        let cut = Duration::from_millis(50 + (seed % 5) * 10);
        let report = run_simulated(m.clone(), config(seed, cut), &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}"));
        let log = |needle: &str| report.log.iter().any(|l| l.contains(needle));
        assert!(log("membership: Down { node: 0"), "seed {seed}: node 0 declared down");
        if log("router0 is gone, router1 takes over") {
            took_over += 1;
            assert!(log("client resubmits"), "seed {seed}: the new router heard of every request");
        }
        let again = run_simulated(m.clone(), config(seed, cut), &reqs).unwrap();
        assert_eq!(report.digest, again.digest, "seed {seed}: the same seed, the same run");
    }
    // A batch that finished before the cut needs no new router.
    assert!(took_over >= 15, "router1 took over in only {took_over} of 20 runs");
    eprintln!("router failover: router1 took over in {took_over}/20 runs, 0 requests lost");
}

#[test]
fn a_node_that_comes_back_rejoins_its_instance_and_loses_no_request_over_20_seeds() {
    let m = model();
    let reqs = requests(8, STEPS);
    let want = reference(&m, &reqs);
    let mut rejoined = 0;
    for seed in 0..20u64 {
        let from = Duration::from_millis(50 + (seed % 4) * 10);
        let cfg = || config_cut(seed, 3, 1, from, from + Duration::from_millis(400));
        let report = run_simulated(m.clone(), cfg(), &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}"));
        let at = |needle: &str| report.log.iter().position(|l| l.contains(needle));
        assert!(at("membership: Down { node: 3").is_some(), "seed {seed}: node 3 declared down");
        if let Some(back) = at("scheduler1: node3 is back") {
            rejoined += 1;
            // The table switches at the first step after every shard read
            // its experts: a batch that ended before then needs no switch.
            let after = &report.log[back..];
            let prepared = after.iter().position(|l| l.contains("scheduler1 rejoin: epoch") && l.contains("prepared"));
            let stepped = |from: usize| after[from..].iter().any(|l| l.contains("send scheduler1->worker"));
            let replaced = after.iter().any(|l| l.contains("scheduler1 placement epoch"));
            assert!(
                replaced || prepared.is_none_or(|p| !stepped(p)),
                "seed {seed}: node 3's experts are put back:\n{:#?}",
                report.log.iter().filter(|l| l.contains("epoch") || l.contains("node3 is")).collect::<Vec<_>>()
            );
        }
        let again = run_simulated(m.clone(), cfg(), &reqs).unwrap();
        assert_eq!(report.digest, again.digest, "seed {seed}: the same seed, the same run");
    }
    assert!(rejoined >= 15, "node 3 rejoined in only {rejoined} of 20 runs");
    eprintln!("rejoin: node 3 came back in {rejoined}/20 runs, 0 requests lost");
}

#[test]
fn a_drained_node_gets_no_new_request_stops_and_serves_again_after_it_returns_over_20_seeds() {
    let m = model();
    let reqs = requests(12, STEPS);
    let want = reference(&m, &reqs);
    for seed in 0..20u64 {
        // Node 3 (second device of instance 1) stops at 400 ms, back at 800 ms.
        let mut cfg = config_cut(seed, 3, 1, Duration::from_millis(400), Duration::from_millis(800));
        cfg.faults = None;
        let waves = reqs.chunks(4).map(<[_]>::to_vec).collect::<Vec<_>>();
        let (outputs, report) = simulate(m.clone(), cfg, async |c: &mut Cluster| {
            let mut out = c.generate(&waves[0]).await;
            c.drain(3);
            c.clock().sleep(Duration::from_millis(20)).await;
            out.extend(c.generate(&waves[1]).await);
            let now = c.clock().now();
            c.clock().sleep(Duration::from_millis(1200).saturating_sub(now)).await;
            out.extend(c.generate(&waves[2]).await);
            out
        })
        .unwrap();
        assert_same(&outputs, &want, &format!("seed {seed}"));
        let routed_to = |id: u64| -> Vec<String> {
            let needle = format!("router sends request {id} to ");
            report.log.iter().filter_map(|l| l.split(&needle).nth(1)).map(|r| r[..10].to_string()).collect()
        };
        for id in 4..8 {
            assert_eq!(routed_to(id), vec!["scheduler0"], "seed {seed}: request {id} avoids the drained instance");
        }
        let log = |needle: &str| report.log.iter().any(|l| l.contains(needle));
        assert!(
            log("membership: Down { node: 3") && log("routes to node3 again"),
            "seed {seed}: it left and came back"
        );
        let back = (8..12).filter(|&id| routed_to(id).contains(&"scheduler1".to_string())).count();
        assert!(back > 0, "seed {seed}: after it returned, instance 1 serves again");
    }
}

/// A front end (a client of another process: it sends keepalives) dies in
/// the middle of streaming a batch; a user reconnects through another front
/// end and sends the batch again. Over 20 seeds: every request on the second
/// front end completes with the fault-free output, the routers cancel the
/// dead front end's requests once it has been silent for the request
/// timeouts (nothing keeps running for nobody), and the run reproduces.
#[test]
fn a_front_end_lost_mid_stream_leaves_nothing_running_and_another_serves_the_batch_over_20_seeds() {
    use deepinfer_actors::cluster::ctx::Timeouts;
    use deepinfer_actors::Update;

    let m = model();
    let reqs = requests(6, 40);
    let want = reference(&m, &reqs);
    for seed in 0..20u64 {
        let run = |seed: u64| {
            let mut cfg = config_cut(seed, 0, 3, Duration::MAX, Duration::MAX);
            cfg.fabric.partitions.clear();
            // A silent front end is given up after 2 × 300 ms.
            cfg.timeouts =
                Some(Timeouts { request: Duration::from_millis(300), request_attempts: 2, ..Timeouts::simulated() });
            simulate(m.clone(), cfg, async |c: &mut Cluster| {
                let mut lost = c.front_end(1);
                for r in &reqs {
                    lost.submit(r.clone());
                }
                // Stream until a few tokens of the batch arrived (a seed-dependent number).
                let mut tokens = 0;
                while tokens < 8 + seed as usize {
                    match lost.next_update().await {
                        Some(Update::Tokens { tokens: t, .. }) => tokens += t.len(),
                        Some(_) => {}
                        None => break,
                    }
                }
                let unfinished = lost.outstanding();
                drop(lost);
                let mut other = c.front_end(2);
                let outputs = other.generate(&reqs).await;
                // Long enough for the routers to give the silent front end up.
                c.clock().sleep(Duration::from_secs(2)).await;
                let running: u64 =
                    c.gauges().iter().map(|g| g.running.load(std::sync::atomic::Ordering::Relaxed)).sum();
                (outputs, unfinished, running)
            })
            .unwrap()
        };
        let ((outputs, unfinished, running), report) = run(seed);
        assert_same(&outputs, &want, &format!("seed {seed}: the batch on the second front end"));
        assert!(unfinished > 0, "seed {seed}: the front end died with requests in flight");
        let cancelled = report.log.iter().find(|l| l.contains("router: client1 is gone; cancelling"));
        let line = cancelled.unwrap_or_else(|| panic!("seed {seed}: the dead front end's requests were not cancelled"));
        assert!(line.contains(&format!("its {unfinished} requests")), "seed {seed}: {line}");
        assert_eq!(running, 0, "seed {seed}: nothing runs for the dead front end");
        let (_, again) = run(seed);
        assert_eq!(report.digest, again.digest, "seed {seed}: the same seed, the same run");
    }
}

/// A node cut off with a minority of the cluster (node 0 alone against
/// nodes 1–3) fences: its scheduler changes no table and runs no step, so
/// no request is served from placements only the minority believes in;
/// when the partition heals it unfences and serves again. Over 20 seeds,
/// every request completes with the fault-free output.
#[test]
fn a_minority_partition_fences_itself_and_changes_no_table_over_20_seeds() {
    let m = model();
    let reqs = requests(6, STEPS);
    let want = reference(&m, &reqs);
    for seed in 0..20u64 {
        let cut = Duration::from_millis(50 + (seed % 5) * 10);
        for heal in [None, Some(Duration::from_millis(400))] {
            let until = heal.map_or(Duration::MAX, |h| cut + h);
            let report = run_simulated(m.clone(), config_cut(seed, 0, 3, cut, until), &reqs).unwrap();
            let what = format!("seed {seed}, healed after {heal:?}");
            assert_same(&report.outputs, &want, &what);
            let lines = |needle: &str| report.log.iter().filter(|l| l.contains(needle)).count();
            assert!(lines("scheduler0 fenced: node0 is in a minority partition") > 0, "{what}: node 0 fenced");
            let fenced_at = report.log.iter().position(|l| l.contains("scheduler0 fenced")).unwrap();
            let unfenced_at = report.log.iter().position(|l| l.contains("scheduler0 unfenced"));
            // The minority never re-placed the experts of the devices it could not see.
            let while_fenced = &report.log[fenced_at..unfenced_at.unwrap_or(report.log.len())];
            let changes = while_fenced
                .iter()
                .filter(|l| l.contains("scheduler0 placement epoch") || l.contains("scheduler0: devices"))
                .count();
            assert_eq!(changes, 0, "{what}: a table changed while fenced");
            let before = report.log[..fenced_at].iter().filter(|l| l.contains("scheduler0: devices")).count();
            assert_eq!(before, 0, "{what}: scheduler0 re-placed experts before it fenced");
            assert_eq!(unfenced_at.is_some(), heal.is_some(), "{what}: unfenced exactly when the partition healed");
        }
    }
}
