//! A burst of finished prefills larger than the link to the decode instance
//! drains within one control timeout: every state reaches the decode
//! instance at the link's rate, none is sent again, rerouted or recomputed.

mod common;

use std::time::Duration;

use common::{model, requests};
use deepinfer_actors::cluster::ctx::Timeouts;
use deepinfer_actors::cluster::disagg::{InstanceKind, TRANSFER_WINDOW};
use deepinfer_actors::sim::fabric::Link;
use deepinfer_actors::{run_simulated, ClusterConfig};

/// Instance 0 prefills on node 0, instance 1 decodes on node 1.
fn split() -> ClusterConfig {
    let mut cfg = ClusterConfig::new(2, 1);
    cfg.instances = 2;
    cfg.devices_per_node = 1;
    cfg.instance_kinds = vec![InstanceKind::Prefill, InstanceKind::Decode];
    cfg.keep_events = 1 << 20;
    cfg
}

/// Bytes of the largest state transfer in a run's log.
fn largest_transfer(log: &[String]) -> u64 {
    log.iter()
        .filter(|l| l.contains("send scheduler0->scheduler1 handoff"))
        .filter_map(|l| l.split_whitespace().find_map(|w| w.strip_suffix('B').and_then(|n| n.parse().ok())))
        .max()
        .expect("states were transferred")
}

fn count(log: &[String], needle: &str) -> usize {
    log.iter().filter(|l| l.contains(needle)).count()
}

#[test]
fn a_burst_of_finished_prefills_drains_to_decode_without_reroutes() {
    let m = model();
    let reqs = requests(256, 2);
    let control = Timeouts::simulated().control;
    // The size of one state on the wire, on the default fabric.
    let probe = run_simulated(m.clone(), split(), &reqs).unwrap();
    let state = largest_transfer(&probe.log);
    // A link from prefill to decode that moves a window of states in half a
    // control timeout, so the whole burst takes several timeouts.
    let bandwidth = 2 * TRANSFER_WINDOW as u64 * state * 1_000_000_000 / control.as_nanos() as u64;
    let burst_s = reqs.len() as f64 * state as f64 / bandwidth as f64;
    assert!(burst_s > 3.0 * control.as_secs_f64(), "the burst takes {burst_s} s on the link");
    let mut cfg = split();
    let slow = Link { latency: Duration::from_micros(10), bandwidth, jitter: Duration::ZERO };
    cfg.fabric.links.insert((0, 1), slow);
    let sim = run_simulated(m.clone(), cfg, &reqs).unwrap();
    for (i, out) in sim.outputs.iter().enumerate() {
        let g = out.as_ref().unwrap_or_else(|e| panic!("request {i} failed: {e:?}"));
        assert_eq!(g.tokens.len(), 2, "request {i}");
    }
    let metrics = &sim.metrics;
    assert_eq!(metrics.handovers, reqs.len() as u64, "every request left with its state");
    assert_eq!(count(&sim.log, "adopts request"), reqs.len(), "every state was adopted");
    assert_eq!(metrics.reroutes(), 0, "rerouted: {metrics:?}");
    assert_eq!(metrics.handoff_recomputes, 0);
    assert_eq!(count(&sim.log, "recomputes request"), 0);
    assert_eq!(metrics.transfers_resent, 0, "a transfer waited past its deadline");
    assert_eq!(metrics.requests_restarted, 0);
    // The states queued at the prefill instance and waited their turn on the link.
    assert!(metrics.handoffs_pending_peak > TRANSFER_WINDOW as u64, "peak {}", metrics.handoffs_pending_peak);
    let (_, p99_us, adopted) = metrics.handoff_wait_us;
    assert_eq!(adopted, reqs.len() as u64);
    assert!(p99_us as f64 > 2.0 * control.as_micros() as f64, "the last states waited {p99_us} µs");
}
