//! The cluster serves like the engine: the Scheduler actor runs the engine's
//! own batching policy (stop conditions, chunked prefill, prefix cache), the
//! Router picks instances by cached prefix, and restarts of a scheduler, a
//! cache manager or the router, or lost messages, change no output bit.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{assert_same, model, prompt, reference, request, requests};
use deepinfer_actors::actor::supervisor::Intensity;
use deepinfer_actors::sim::faults::{FaultPlan, KillRule, MessageAction, MessageRule, Target};
use deepinfer_actors::wire::MsgKind;
use deepinfer_actors::{run_in_process, run_simulated, simulate, Cluster, ClusterConfig, GenRequest, Update};
use deepinfer_engine::engine::{Completion, Engine, EngineConfig};
use deepinfer_engine::model::Model;
use deepinfer_engine::request::{FinishReason, Finished, TokenOutput};
use deepinfer_engine::sampling::SamplingParams;

/// 4 devices on 2 nodes; two instances of 2 devices (expert parallel 2), one per node.
fn two_instances(seed: u64) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(4, 2);
    cfg.devices_per_node = 2;
    cfg.instances = 2;
    cfg.seed = seed;
    cfg.keep_events = 1 << 20;
    cfg
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// What a request produced, comparable bit for bit (the prefix-cache share excepted: it depends on timing).
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<u32>,
    top: Vec<Vec<(u32, u32)>>,
    logits: Vec<Vec<u32>>,
    reason: Result<(String, usize), String>,
}

fn outcome(tokens: &[TokenOutput], finished: &Finished) -> Outcome {
    Outcome {
        tokens: tokens.iter().map(|t| t.token).collect(),
        logprobs: tokens.iter().map(|t| t.logprob.to_bits()).collect(),
        top: tokens.iter().map(|t| t.top.iter().map(|&(k, p)| (k, p.to_bits())).collect()).collect(),
        logits: tokens.iter().filter_map(|t| t.logits.as_deref().map(bits)).collect(),
        reason: Ok((format!("{:?}", finished.reason), finished.completion_tokens)),
    }
}

/// Each request through one single-device engine, all queued up front.
fn engine_outcomes(requests: &[GenRequest]) -> Vec<Outcome> {
    engine_outcomes_of(&model(), requests)
}

fn engine_outcomes_of(m: &Model, requests: &[GenRequest]) -> Vec<Outcome> {
    let mut engine = Engine::new(m, EngineConfig::default()).unwrap();
    let ids: Vec<_> = requests.iter().map(|r| engine.add_request(r.clone())).collect();
    let mut done = engine.run_to_completion();
    ids.into_iter()
        .map(|id| match id {
            Ok(id) => {
                let c: Completion = done.remove(&id).unwrap();
                outcome(&c.tokens, &c.finished)
            }
            Err(e) => {
                Outcome { tokens: vec![], logprobs: vec![], top: vec![], logits: vec![], reason: Err(e.to_string()) }
            }
        })
        .collect()
}

/// Each request through the cluster, collected from its updates.
async fn cluster_outcomes(c: &mut Cluster, requests: &[GenRequest]) -> Vec<Outcome> {
    let ids: Vec<u64> = requests.iter().map(|r| c.submit(r.clone())).collect();
    let mut tokens: BTreeMap<u64, Vec<TokenOutput>> = BTreeMap::new();
    let mut ends: BTreeMap<u64, Result<Finished, String>> = BTreeMap::new();
    while let Some(u) = c.next_update().await {
        match u {
            Update::Tokens { id, tokens: t, .. } => tokens.entry(id).or_default().extend(t),
            Update::Finished { id, finished } => {
                ends.insert(id, Ok(finished));
            }
            Update::Refused { id, reason } => {
                ends.insert(id, Err(reason));
            }
        }
    }
    ids.iter()
        .map(|id| {
            let t = tokens.remove(id).unwrap_or_default();
            match ends.remove(id).expect("every request ends") {
                Ok(f) => outcome(&t, &f),
                Err(e) => Outcome { tokens: vec![], logprobs: vec![], top: vec![], logits: vec![], reason: Err(e) },
            }
        })
        .collect()
}

/// EOS on, stop sequences and stop ids taken from a free run, top
/// logprobs, logits, prompts sharing a prefix block, and refused requests.
fn served_requests() -> Vec<GenRequest> {
    let m = model();
    let free = request(prompt(9, 5), 12, SamplingParams::default());
    let seen = engine_outcomes(std::slice::from_ref(&free)).remove(0).tokens;
    let mut out = Vec::new();
    let mut plain = GenRequest::new(prompt(6, 1), 10);
    plain.params.logprobs = 3;
    out.push(plain);
    let mut stop_seq = free.clone();
    stop_seq.ignore_eos = false;
    stop_seq.stop_sequences = vec![seen[4..6].to_vec()];
    out.push(stop_seq);
    let mut stop_id = free.clone();
    stop_id.stop_token_ids = vec![seen[7]];
    stop_id.return_logits = true;
    out.push(stop_id);
    let shared = prompt(70, 33);
    for i in 0..3u32 {
        let params = SamplingParams {
            temperature: 0.9,
            top_p: 0.9,
            top_k: 30,
            seed: 40 + i as u64,
            logprobs: 2,
            ..SamplingParams::default()
        };
        out.push(request([shared.clone(), prompt(2 + 3 * i as usize, 60 + i)].concat(), 6, params));
    }
    out.push(GenRequest::new(vec![3, m.config.vocab_size as u32 + 5], 4));
    out.push(GenRequest::new(prompt(4, 2), 0));
    out
}

#[test]
fn the_cluster_serves_exactly_like_the_engine() {
    let m = model();
    let reqs = served_requests();
    let want = engine_outcomes(&reqs);
    assert!(want.iter().any(|o| matches!(&o.reason, Ok((r, n)) if r == "Stop" && *n < 12)), "a stop fired: {want:?}");
    assert!(want.iter().filter(|o| o.reason.is_err()).count() == 2);
    let mut small = two_instances(3);
    small.engine = EngineConfig { max_batch_tokens: 24, ..EngineConfig::default() };
    for (name, cfg) in [("4 devices, 2 instances", two_instances(1)), ("chunked prefills", small)] {
        let (got, report) = simulate(m.clone(), cfg, async |c: &mut Cluster| cluster_outcomes(c, &reqs).await).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{name}: request {i}");
        }
        assert!(report.metrics.blocks_stored > 0, "{name}: prefix blocks were cached");
    }
    let mut cfg = ClusterConfig::new(8, 8);
    cfg.devices_per_node = 4;
    let (got, _) = simulate(m.clone(), cfg, async |c: &mut Cluster| cluster_outcomes(c, &reqs).await).unwrap();
    assert_eq!(got, want, "8 devices, expert parallel 8");
}

/// DeepSeek-V4.1 in the cluster: prefix blocks (each KV group's entries and
/// keys, and the windows and Engram look-back at the block's end) are cached,
/// fetched and restored with no replay; every output equals the engine's.
#[test]
fn the_cluster_serves_v41_exactly_like_the_engine_with_prefix_hits() {
    let m = common::model_v41();
    let shared = prompt(150, 8);
    let reqs: Vec<GenRequest> = (0..4u32)
        .map(|i| request([shared.clone(), prompt(3 + 5 * i as usize, 70 + i)].concat(), 5, SamplingParams::default()))
        .collect();
    let want = engine_outcomes_of(&m, &reqs);
    let mut cfg = two_instances(2);
    cfg.instances = 1;
    let (got, report) = simulate(m.clone(), cfg, async |c: &mut Cluster| {
        let mut all = cluster_outcomes(c, &reqs[..1]).await;
        all.extend(cluster_outcomes(c, &reqs[1..]).await);
        all
    })
    .unwrap();
    assert_eq!(got, want, "V4.1 through the cluster");
    assert!(report.metrics.blocks_stored > 0, "V4.1 prefix blocks were cached");
    assert!(report.metrics.cache_hits > 0, "a later request hit the cache: {:?}", report.metrics);
}

/// A request that shares a cached prefix goes to the instance holding it,
/// even when another instance is less loaded; once that instance's cache
/// manager restarts (empty), the same request misses, and its output does not change.
#[test]
fn routing_follows_the_cached_prefix_and_a_restarted_cache_turns_hits_into_misses() {
    let m = model();
    let shared = prompt(70, 8);
    let warm = request([shared.clone(), prompt(3, 1)].concat(), 4, SamplingParams::default());
    let hit = request([shared.clone(), prompt(5, 2)].concat(), 4, SamplingParams::default());
    let long = request(prompt(5, 3), 30, SamplingParams::default());
    let want = reference(&m, std::slice::from_ref(&hit)).remove(0);

    // Submit, then wait until it has a token (its first step ran) or ended.
    async fn first_token(c: &mut Cluster, r: &GenRequest) -> u64 {
        let id = c.submit(r.clone());
        while let Some(u) = c.next_update().await {
            if matches!(u, Update::Tokens { id: i, .. } | Update::Finished { id: i, .. } if i == id) {
                break;
            }
        }
        id
    }
    async fn finish(c: &mut Cluster, id: u64) -> (Vec<u32>, Finished) {
        let mut tokens = Vec::new();
        while let Some(u) = c.next_update().await {
            match u {
                Update::Tokens { id: i, tokens: t, .. } if i == id => tokens.extend(t.iter().map(|t| t.token)),
                Update::Finished { id: i, finished } if i == id => return (tokens, finished),
                _ => {}
            }
        }
        panic!("request {id} never finished")
    }
    let scenario = async |c: &mut Cluster| {
        let w = c.submit(warm.clone());
        finish(c, w).await;
        // Keep instance 0 busy: by load alone the next request would go to instance 1.
        first_token(c, &long).await;
        let id = c.submit(hit.clone());
        (id, finish(c, id).await)
    };

    let ((id, (tokens, finished)), report) = simulate(m.clone(), two_instances(4), scenario).unwrap();
    assert_eq!(tokens, want.tokens);
    assert_eq!(finished.cached_tokens, 64, "one prefix block came from the cache");
    let line = format!("router sends request {id} to scheduler0 (1 cached blocks)");
    assert!(report.log.iter().any(|l| l.contains(&line)), "routed by prefix, not by load");
    assert!(report.metrics.cache_hits >= 1);

    // The same, with instance 0's cache manager killed when the busy request starts.
    let mut cfg = two_instances(4);
    let steps = report.steps;
    let warm_steps = 5; // one prefill, then a step per token after the first
    assert!(steps > warm_steps);
    cfg.faults = Some(FaultPlan {
        kills: vec![KillRule { target: Target::CacheManager(0), step: warm_steps, layer: 0, repeat: false }],
        ..FaultPlan::default()
    });
    let ((id, (tokens, finished)), report) = simulate(m.clone(), cfg, scenario).unwrap();
    assert_eq!(tokens, want.tokens, "a miss recomputes the same bits");
    assert_eq!(finished.cached_tokens, 0, "nothing cached survived the restart");
    assert_eq!((report.metrics.cache_restarts, report.metrics.kills_injected), (1, 1));
    let line = format!("router sends request {id} to scheduler1 (0 cached blocks)");
    assert!(report.log.iter().any(|l| l.contains(&line)), "no prefix anywhere: routed by load");
}

#[test]
fn a_restarted_scheduler_resumes_every_request_from_the_routers_record() {
    let m = model();
    let reqs = requests(6, 6);
    let want = reference(&m, &reqs);
    for (step, layer) in [(0, 0), (2, 1), (3, 2), (4, 0)] {
        let mut cfg = ClusterConfig::new(4, 2);
        cfg.return_logits = true;
        cfg.keep_events = 1 << 20;
        cfg.faults = Some(FaultPlan {
            kills: vec![KillRule { target: Target::Scheduler(0), step, layer, repeat: false }],
            ..FaultPlan::default()
        });
        let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("scheduler killed at step {step}, point {layer}"));
        let mx = &report.metrics;
        assert_eq!((mx.kills_injected, mx.scheduler_restarts, mx.escalations), (1, 1, 0), "{mx:?}");
        assert!(report.log.iter().any(|l| l.contains("router resubmits 6 requests to scheduler0")));
        if step > 0 {
            assert!(mx.requests_resumed > 0, "requests resumed with their tokens: {mx:?}");
        }
    }
}

#[test]
fn lost_submits_outputs_acks_and_cache_messages_are_repaired() {
    let m = model();
    let mut reqs = requests(5, 5);
    let shared = prompt(70, 12);
    reqs.extend(
        (0..3).map(|i| request([shared.clone(), prompt(3 + i, 90 + i as u32)].concat(), 5, Default::default())),
    );
    let want = reference(&m, &reqs);
    let mut repaired = 0;
    for seed in 0..6u64 {
        let mut cfg = two_instances(seed);
        cfg.return_logits = true;
        cfg.engine = EngineConfig { max_batch_tokens: 40, ..EngineConfig::default() };
        let rule = |kind, action, probability, max_hits| MessageRule { kind, action, probability, max_hits };
        cfg.faults = Some(FaultPlan {
            messages: vec![
                rule(MsgKind::Outputs, MessageAction::Drop, 0.25, 4),
                rule(MsgKind::Outputs, MessageAction::Duplicate, 0.2, 4),
                rule(MsgKind::Submit, MessageAction::Drop, 0.2, 3),
                rule(MsgKind::Ack, MessageAction::Drop, 0.3, 5),
                rule(MsgKind::Cache, MessageAction::Drop, 0.3, 3),
                rule(MsgKind::Outputs, MessageAction::Delay(Duration::from_millis(2)), 0.2, 5),
            ],
            ..FaultPlan::default()
        });
        let report = run_simulated(m.clone(), cfg, &reqs).unwrap();
        assert_same(&report.outputs, &want, &format!("seed {seed}"));
        let mx = &report.metrics;
        assert!(mx.frames_dropped > 0, "seed {seed}: {mx:?}");
        repaired += mx.submits_resent + mx.requests_restarted;
    }
    assert!(repaired > 0, "lost outputs were asked for again");
}

#[test]
fn a_cancelled_request_ends_and_the_others_do_not_change() {
    let m = model();
    let reqs = requests(3, 12);
    let want = reference(&m, &reqs);
    let (got, _) = simulate(m.clone(), two_instances(2), async |c: &mut Cluster| {
        let ids: Vec<u64> = reqs.iter().map(|r| c.submit(r.clone())).collect();
        let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
        let mut ends = BTreeMap::new();
        while let Some(u) = c.next_update().await {
            match u {
                Update::Tokens { id, tokens: t, .. } => {
                    let seen = tokens.entry(id).or_default();
                    seen.extend(t.iter().map(|t| t.token));
                    if id == ids[1] && seen.len() >= 3 && !ends.contains_key(&id) {
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
    assert!(cancelled.len() >= 3 && cancelled.len() < 12 && cancelled[..] == want[1].tokens[..cancelled.len()]);
    for i in [0, 2] {
        assert_eq!(tokens[&ids[i]], want[i].tokens);
        assert_eq!(ends[&ids[i]], Some(FinishReason::Length));
    }
}

/// A scheduler, cache manager or router that dies at every step exhausts its
/// node's restart intensity, then the cluster's: every unfinished request
/// ends with an error saying so, and the run ends.
#[test]
fn a_service_actor_that_keeps_crashing_ends_requests_with_an_error() {
    let m = model();
    for target in [Target::Scheduler(0), Target::CacheManager(0), Target::Router] {
        let reqs = requests(4, 6);
        let mut cfg = ClusterConfig::new(4, 2);
        cfg.node_intensity = Intensity::new(2, Duration::from_secs(10));
        cfg.cluster_intensity = Intensity::new(1, Duration::from_secs(60));
        cfg.faults = Some(FaultPlan {
            kills: vec![KillRule { target, step: 1, layer: 0, repeat: true }],
            ..FaultPlan::default()
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let mm = m.clone();
        std::thread::spawn(move || tx.send(run_simulated(mm, cfg, &reqs).unwrap()).unwrap());
        let report = rx.recv_timeout(Duration::from_secs(120)).expect("the run ends (nothing hangs)");
        for (i, out) in report.outputs.iter().enumerate() {
            let err = out.as_ref().expect_err("a request past the intensity limit fails");
            assert!(
                err.reason.contains("cluster down") && err.reason.contains("exceed"),
                "{target}: {i}: {}",
                err.reason
            );
        }
        let mx = &report.metrics;
        println!("{target}: {mx:?}");
        assert_eq!((mx.supervisor_restarts, mx.escalations), (1, 3), "{target}: {mx:?}");
    }
}

/// Real threads and wall time: a killed scheduler and cache manager, shared prefixes.
#[test]
fn the_in_process_cluster_survives_a_scheduler_and_a_cache_manager_restart() {
    let m = model();
    let mut reqs = requests(4, 5);
    let shared = prompt(70, 4);
    reqs.extend((0..2).map(|i| request([shared.clone(), prompt(2 + i, 7 + i as u32)].concat(), 5, Default::default())));
    let want = reference(&m, &reqs);
    let mut cfg = two_instances(0);
    cfg.return_logits = true;
    cfg.faults = Some(FaultPlan {
        kills: vec![
            KillRule { target: Target::Scheduler(1), step: 2, layer: 1, repeat: false },
            KillRule { target: Target::CacheManager(0), step: 1, layer: 0, repeat: false },
        ],
        ..FaultPlan::default()
    });
    let report = run_in_process(m.clone(), cfg, &reqs, 2).unwrap();
    assert_same(&report.outputs, &want, "in-process with a scheduler and a cache manager killed");
    let mx = &report.metrics;
    assert_eq!((mx.kills_injected, mx.scheduler_restarts, mx.cache_restarts), (2, 1, 1), "{mx:?}");
}

/// Block values cross the wire as lengths and floats: they round-trip, and
/// anything that does not fit the model is refused before it reaches a state.
#[test]
fn block_values_round_trip_and_malformed_ones_are_refused() {
    use deepinfer_engine::engine::{restore_state, BlockValues};
    use deepinfer_engine::model::{Chunk, LogitsWanted};
    let m = model();
    let bt = 64;
    let mut state = m.new_state();
    let tokens = prompt(bt, 3);
    m.forward(&mut [Chunk::new(&tokens, &mut state)], LogitsWanted::None, false);
    let block = BlockValues::capture(&m, &state, 0, bt);
    let (lens, data) = block.to_parts();
    assert_eq!(BlockValues::from_parts(&m, bt, &lens, &data).unwrap(), block);
    let restored = restore_state(&m, &[&block], bt);
    for (a, b) in restored.layers.iter().zip(&state.layers) {
        let entries = |l: &deepinfer_engine::model::state::LayerState| l.compressor.as_ref().map(|c| bits(&c.entries));
        assert_eq!(entries(a), entries(b));
    }
    let mut short = data.clone();
    short.pop();
    assert!(BlockValues::from_parts(&m, bt, &lens, &short).is_err());
    let mut long = data.clone();
    long.push(0.0);
    assert!(BlockValues::from_parts(&m, bt, &lens, &long).is_err());
    assert!(BlockValues::from_parts(&m, bt, &lens[..lens.len() - 8], &data).is_err());
    assert!(BlockValues::from_parts(&m, 32, &lens, &data).is_err(), "another block size");
    for i in 0..lens.len() {
        for v in [0, 1, 7, u32::MAX, lens[i].wrapping_add(4)] {
            let mut bad = lens.clone();
            bad[i] = v;
            if bad != lens {
                let _ = BlockValues::from_parts(&m, bt, &bad, &data);
            }
        }
    }
}
