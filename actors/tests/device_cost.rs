//! The device cost model in simulation: workers and shards advance the
//! virtual clock by the engine's cost model while the tiny model still
//! computes every bit, so time changes with the hardware and outputs do not.

mod common;

use std::time::Duration;

use common::{assert_same, model, prompt, reference, request, requests};
use deepinfer_actors::modelled::cost::DeviceCost;
use deepinfer_actors::{run_simulated, ClusterConfig, DeviceCostModel, RunReport};
use deepinfer_engine::cost::{step_cost, DeviceStep, HardwareKind, ModelKind, SeqWork};
use deepinfer_engine::sampling::SamplingParams;

fn config(cost: Option<HardwareKind>) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(4, 4);
    cfg.devices_per_node = 2;
    cfg.seed = 5;
    cfg.return_logits = true;
    cfg.device_cost = cost.map(|hw| DeviceCostModel::new(hw, ModelKind::V4Flash));
    cfg
}

fn run(cost: Option<HardwareKind>) -> RunReport {
    run_simulated(model(), config(cost), &requests(6, 3)).unwrap()
}

#[test]
fn device_cost_changes_time_not_outputs() {
    let m = model();
    let want = reference(&m, &requests(6, 3));
    let free = run(None);
    let a = run(Some(HardwareKind::H800));
    let b = run(Some(HardwareKind::H800));
    assert_same(&free.outputs, &want, "no device cost");
    assert_same(&a.outputs, &want, "H800");
    assert_same(&b.outputs, &want, "H800 again");
    assert_eq!((a.digest, a.events, a.elapsed, &a.metrics), (b.digest, b.events, b.elapsed, &b.metrics));
    assert_ne!(a.digest, free.digest, "device time shows in the log's times");
    assert_eq!(a.metrics.restarts(), 0);
    assert_eq!((a.metrics.dispatch_resends, a.metrics.step_resends), (0, 0), "no timeout fired");
    assert!(a.elapsed > free.elapsed, "{:?} with device time, {:?} without", a.elapsed, free.elapsed);
}

#[test]
fn virtual_time_follows_the_hardware() {
    let free = run(None);
    let h800 = run(Some(HardwareKind::H800));
    let b200 = run(Some(HardwareKind::B200));
    println!("elapsed: free {:?}, B200 {:?}, H800 {:?}", free.elapsed, b200.elapsed, h800.elapsed);
    assert_eq!(h800.steps, b200.steps, "the same workload");
    assert!(b200.elapsed > free.elapsed);
    assert!(h800.elapsed > b200.elapsed, "H800 {:?} is not slower than B200 {:?}", h800.elapsed, b200.elapsed);
}

/// Times of `worker0 step N attempt 0: 1 sequences, 1 tokens, …` and `worker0 step N done`.
fn decode_steps(log: &[String]) -> Vec<(u64, Duration)> {
    let time = |l: &str| Duration::from_nanos(l.split_whitespace().next().unwrap().parse().unwrap());
    let mut out = Vec::new();
    for (i, l) in log.iter().enumerate() {
        let Some(rest) = l.split("worker0 step ").nth(1) else { continue };
        let Some((step, what)) = rest.split_once(" attempt 0: ") else { continue };
        if !what.starts_with("1 sequences, 1 tokens, 1 waves") {
            continue;
        }
        let done = format!("worker0 step {step} done");
        let end = log[i..].iter().find(|x| x.ends_with(&done)).expect("the step ends");
        out.push((step.parse().unwrap(), time(end) - time(l)));
    }
    out
}

#[test]
fn a_decode_step_lasts_at_least_its_device_cost() {
    let m = model();
    let (len, steps) = (5, 4);
    let reqs = vec![request(prompt(len, 3), steps, SamplingParams::default())];
    let want = reference(&m, &reqs);
    let spec = DeviceCostModel::new(HardwareKind::H800, ModelKind::V4Flash);
    let mut cfg = ClusterConfig::new(1, 1);
    cfg.keep_events = 1 << 16;
    cfg.return_logits = true;
    cfg.device_cost = Some(spec);
    let report = run_simulated(m.clone(), cfg.clone(), &reqs).unwrap();
    assert_same(&report.outputs, &want, "1 device, H800");

    let cost = DeviceCost::new(spec, &cfg.topology(), m.config.num_layers);
    let k = m.config.experts_per_token;
    let layers = m.config.num_layers as u32;
    let decodes = decode_steps(&report.log);
    assert_eq!(decodes.len(), steps - 1, "every token after the first is one decode step");
    for (i, &(step, took)) in decodes.iter().enumerate() {
        let seq = SeqWork { new_tokens: 1, context: len + i };
        let whole = step_cost(
            &HardwareKind::H800.spec(),
            &ModelKind::V4Flash.cost(),
            &DeviceStep {
                sequences: vec![seq],
                expert_tokens: 0,
                experts_hit: 0,
                expert_parallel: 1,
                scale_up_domain: 8,
                offloaded_expert_share: 0.0,
            },
            spec.efficiency,
        );
        let floor = cost.attention_time(&[seq]) + cost.experts_time(k, k) * layers;
        println!("decode step {step}: {took:?}, cost model {:.1} µs, attention + experts {floor:?}", whole.total_us);
        assert!(took.as_nanos() as f64 >= whole.total_us * 1e3 - 1.0, "step {step}: {took:?} < {} µs", whole.total_us);
        assert!(took >= floor, "step {step}: {took:?} < {floor:?}");
    }
}
