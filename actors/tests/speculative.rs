//! Speculative decoding on computing workers: the drafts a worker's model
//! proposes ride with the next step and the target verifies them, so a
//! cluster that drafts gives, token for token and logit for logit, what
//! decoding without drafts gives — with expert parallelism, two instances,
//! prefill/decode disaggregation (the decode instance drafts), a worker
//! killed mid-run, penalties and sampled requests — while most drafts of a
//! trained model are accepted.

mod common;

use std::path::Path;
use std::sync::{Arc, OnceLock};

use common::{assert_same, model_v41, prompt, reference, request, requests};
use deepinfer_actors::cluster::disagg::InstanceKind;
use deepinfer_actors::sim::faults::{FaultPlan, KillRule, Target};
use deepinfer_actors::{run_in_process, run_simulated, ClusterConfig, GenRequest, RunReport};
use deepinfer_engine::engine::Engine;
use deepinfer_engine::model::{Model, RoutedExperts};
use deepinfer_engine::sampling::SamplingParams;
use deepinfer_engine::scheduler::EngineConfig;
use deepinfer_engine::speculative::policy::DraftPolicy;
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};

/// `tiny-v4` trained on Rust sources with its MTP block: its drafts are mostly accepted.
fn trained() -> Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-v4-trained");
    Arc::clone(MODEL.get_or_init(|| Arc::new(Model::load(&dir).expect("the trained checkpoint loads"))))
}

fn drafting(method: DraftMethod, policy: DraftPolicy) -> SpeculativeConfig {
    SpeculativeConfig { method, policy }
}

/// EP over `devices` devices in one instance, drafting as `spec` says.
fn config(devices: u32, spec: SpeculativeConfig) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(devices, devices);
    cfg.devices_per_node = devices;
    cfg.engine.speculative = spec;
    cfg.return_logits = true;
    cfg
}

/// Greedy and sampled requests that decode long enough to draft many times.
fn workload() -> Vec<GenRequest> {
    let mut reqs = requests(4, 24);
    let sampled = SamplingParams { temperature: 0.7, top_p: 0.9, seed: 11, logprobs: 2, ..SamplingParams::default() };
    reqs.push(request(prompt(70, 3), 20, sampled));
    reqs
}

fn drafted(report: &RunReport) -> (u64, u64) {
    (report.metrics.drafts_verified, report.metrics.drafts_accepted)
}

/// Drafts verified and accepted by the single-device engine on the same requests.
fn engine_drafted(m: &Model, spec: SpeculativeConfig, reqs: &[GenRequest]) -> (u64, u64) {
    let mut engine = Engine::new(m, EngineConfig { speculative: spec, ..EngineConfig::default() }).unwrap();
    for r in reqs {
        engine.add_request(r.clone()).unwrap();
    }
    engine.run_to_completion();
    let stats = engine.speculative_stats();
    (stats.verified, stats.accepted)
}

#[test]
fn mtp_drafting_workers_give_the_tokens_of_decoding_without_drafts() {
    let m = trained();
    let reqs = workload();
    let want = reference(&m, &reqs);
    for (name, policy) in [("fixed 3", DraftPolicy::Fixed(3)), ("adaptive 4", DraftPolicy::Adaptive { max: 4 })] {
        let spec = drafting(DraftMethod::Mtp, policy);
        let sim = run_simulated(m.clone(), config(2, spec), &reqs).unwrap();
        assert_same(&sim.outputs, &want, &format!("EP2 simulated, {name}"));
        let (verified, accepted) = drafted(&sim);
        assert!(verified > 40 && accepted > verified / 4, "{name}: {accepted} of {verified} drafts accepted");
        if let DraftPolicy::Fixed(_) = policy {
            // Each worker drafts what the engine would: the same proposals, verified alike.
            // (Adaptive lengths depend on the batch, which differs between the two.)
            assert_eq!((verified, accepted), engine_drafted(&m, spec, &reqs), "{name}: the engine's drafts");
        }
        // Fewer steps than tokens: the accepted drafts came for free.
        let tokens: usize = reqs.iter().map(|r| r.max_tokens).sum();
        assert!(sim.steps < tokens as u64, "{name}: {} steps for {tokens} tokens", sim.steps);
        assert_eq!(run_simulated(m.clone(), config(2, spec), &reqs).unwrap().digest, sim.digest, "{name}: same run");
    }
    let spec = drafting(DraftMethod::Mtp, DraftPolicy::Fixed(2));
    let real = run_in_process(m.clone(), config(2, spec), &reqs, 2).unwrap();
    assert_same(&real.outputs, &want, "EP2 in-process, fixed 2");
    assert!(drafted(&real).1 > 0);
}

#[test]
fn drafting_composes_with_instances_disaggregation_and_a_killed_worker() {
    let m = trained();
    let reqs = workload();
    let want = reference(&m, &reqs);
    let spec = drafting(DraftMethod::Mtp, DraftPolicy::Fixed(3));

    let mut two = config(4, spec);
    two.instances = 2;
    two.expert_parallel = 2;
    let sim = run_simulated(m.clone(), two, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "two instances of EP2");
    assert!(drafted(&sim).1 > 0);

    // Instance 0 prefills, instance 1 decodes and drafts.
    let mut split = config(2, spec);
    split.instances = 2;
    split.expert_parallel = 1;
    split.devices_per_node = 1;
    split.instance_kinds = vec![InstanceKind::Prefill, InstanceKind::Decode];
    let sim = run_simulated(m.clone(), split, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "prefill on one instance, decode with drafts on another");
    assert!(drafted(&sim).1 > 0);
    assert_eq!(sim.metrics.handovers, reqs.len() as u64);

    // A worker dies in the middle of a step that verifies drafts: the step is replayed.
    let mut killed = config(2, spec);
    killed.faults = Some(FaultPlan {
        kills: vec![KillRule { target: Target::Worker(1), step: 6, layer: 2, repeat: false }],
        ..FaultPlan::default()
    });
    let sim = run_simulated(m.clone(), killed, &reqs).unwrap();
    assert_same(&sim.outputs, &want, "a worker killed mid-run");
    assert_eq!((sim.metrics.kills_injected, sim.metrics.worker_restarts), (1, 1));
    assert!(drafted(&sim).1 > 0);
}

/// Penalties change each row by the tokens before it, drafts included; the
/// comparison is with the same cluster decoding without drafts (whose
/// penalties match the engine's, see `serving.rs`).
#[test]
fn drafting_with_penalties_and_logit_bias_gives_the_tokens_without_drafts() {
    let m = trained();
    let penalised = SamplingParams {
        repetition_penalty: 1.3,
        frequency_penalty: 0.4,
        presence_penalty: 0.2,
        logit_bias: vec![(7, 2.0), (30, -1.5)],
        ..SamplingParams::default()
    };
    let sampled = SamplingParams { temperature: 0.9, seed: 3, frequency_penalty: 0.5, ..SamplingParams::default() };
    let reqs = vec![request(prompt(20, 1), 24, penalised), request(prompt(9, 2), 24, sampled)];
    let plain = run_simulated(m.clone(), config(2, SpeculativeConfig::default()), &reqs).unwrap();
    let spec = drafting(DraftMethod::Mtp, DraftPolicy::Fixed(3));
    let sim = run_simulated(m.clone(), config(2, spec), &reqs).unwrap();
    let want: Vec<_> = plain.outputs.into_iter().map(|r| r.expect("completes")).collect();
    assert_same(&sim.outputs, &want, "penalties with drafts");
    let (verified, accepted) = drafted(&sim);
    assert!(accepted > 0 && accepted < verified, "{accepted} of {verified} drafts accepted");
}

/// DeepSeek-V4.1's DSpark block drafts on the workers too: the trained tiny
/// V4.1's drafts are often accepted, the random preset's almost never; both
/// give the tokens without drafts and exactly the engine's drafts.
#[test]
fn dspark_drafting_workers_give_the_tokens_of_decoding_without_drafts() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets/tiny-v41-trained");
    let trained =
        Arc::new(Model::load_with(&dir, RoutedExperts::Resident, None).expect("the trained checkpoint loads"));
    for (name, m) in [("trained", trained), ("random", model_v41())] {
        let reqs = requests(3, 16);
        let want = reference(&m, &reqs);
        let spec = drafting(DraftMethod::Dspark, DraftPolicy::Fixed(2));
        let sim = run_simulated(m.clone(), config(2, spec), &reqs).unwrap();
        assert_same(&sim.outputs, &want, &format!("V4.1 DSpark, EP2, {name}"));
        let (verified, accepted) = drafted(&sim);
        assert!(verified > 0, "{name}");
        if name == "trained" {
            assert!(accepted > 0, "{name}: {accepted} of {verified}");
        }
        assert_eq!(drafted(&sim), engine_drafted(&m, spec, &reqs), "{name}: the engine's drafts");
    }
}
