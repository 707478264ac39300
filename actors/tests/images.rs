//! Images through the cluster: a request's images travel client → router →
//! scheduler → the prefill worker, which feeds the spans as embedding
//! overrides (bias_vl routing, Engram gaps), across chunked prefill too; the
//! greedy tokens are the single-process engine's; the cluster's prefix-cache
//! keys carry the image, so two images never share cached KV and the same
//! image hits; requests whose images disagree with their prompt are refused.

use deepinfer_engine::presets_v41::synthetic_image;
use std::collections::BTreeMap;
use std::time::Duration;

use deepinfer_actors::proto::membership::MembershipConfig;
use deepinfer_actors::sim::fabric::Partition;
use deepinfer_actors::sim::faults::{FaultPlan, KillRule, Target};
use deepinfer_actors::{simulate, Cluster, ClusterConfig, GenRequest, Update};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::images::{ImageContent, PromptBuilder, RequestImage};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::{Finished, Request};
use deepinfer_engine::sampling::SamplingParams;

fn text(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 5 + (i * 131 + salt * 17) % 400).collect()
}

fn model() -> Model {
    build(Preset::TinyV41Vision, 3).expect("tiny-v41-vision builds")
}

/// Text, an image, text, a second image, text: `salt` changes the first image only.
fn two_images(model: &Model, salt: usize) -> (Vec<u32>, Vec<RequestImage>) {
    let cfg = model.image_model().unwrap().config.vision.clone().unwrap();
    let mut b = PromptBuilder::new(&cfg);
    b.text(&text(10, 1)).image(&synthetic_image(200, 120, salt), 200, 120).unwrap();
    b.text(&text(7, 2)).image(&synthetic_image(90, 160, 3), 90, 160).unwrap().text(&text(12, 3));
    b.finish()
}

fn greedy(prompt: &[u32], images: &[RequestImage], max_tokens: usize) -> GenRequest {
    let mut r = Request::with_images(prompt.to_vec(), images.to_vec(), max_tokens);
    r.params = SamplingParams::default();
    r.ignore_eos = true;
    r
}

fn engine_config() -> EngineConfig {
    EngineConfig { block_tokens: Some(8), prefix_mode: PrefixMode::Exact, ..EngineConfig::default() }
}

/// Each request alone through one engine, in order (the cache warm from the ones before).
fn engine_runs(model: &Model, requests: &[GenRequest]) -> Vec<(Vec<u32>, usize)> {
    let mut engine = Engine::new(model, engine_config()).unwrap();
    requests
        .iter()
        .map(|r| {
            let id = engine.add_request(r.clone()).unwrap();
            let c = engine.run_to_completion().remove(&id).unwrap();
            (c.token_ids(), c.finished.cached_tokens)
        })
        .collect()
}

/// Each request through the cluster, one after another: tokens and the end.
async fn cluster_runs(c: &mut Cluster, requests: &[GenRequest]) -> Vec<Result<(Vec<u32>, Finished), String>> {
    let mut out = Vec::new();
    for r in requests {
        let id = c.submit(r.clone());
        let mut tokens = Vec::new();
        let mut ends: BTreeMap<u64, Result<Finished, String>> = BTreeMap::new();
        while !ends.contains_key(&id) {
            match c.next_update().await.expect("the cluster runs") {
                Update::Tokens { id: i, tokens: t, .. } if i == id => tokens.extend(t.iter().map(|t| t.token)),
                Update::Finished { id, finished } => drop(ends.insert(id, Ok(finished))),
                Update::Refused { id, reason } => drop(ends.insert(id, Err(reason))),
                _ => {}
            }
        }
        out.push(ends.remove(&id).unwrap().map(|f| (tokens, f)));
    }
    out
}

fn cluster(instances: u32, engine: EngineConfig) -> ClusterConfig {
    let mut cfg = ClusterConfig::new(2 * instances, 2);
    cfg.devices_per_node = 2;
    cfg.instances = instances;
    cfg.engine = engine;
    cfg.seed = 5;
    cfg.keep_events = 1 << 20;
    cfg
}

#[test]
fn two_images_through_the_cluster_give_the_engines_tokens_and_cache_by_image() {
    let m = model();
    let (prompt, x) = two_images(&m, 0);
    let (prompt_y, y) = two_images(&m, 9);
    assert_eq!(prompt, prompt_y, "the same token ids, another first image");
    assert_ne!(x[0].hash, y[0].hash);
    let reqs = [greedy(&prompt, &x, 6), greedy(&prompt, &y, 6), greedy(&prompt, &x, 6)];
    let want = engine_runs(&m, &reqs);
    assert_ne!(want[0].0, want[1].0, "the image matters");
    let span = x[0].span();
    assert_eq!(want[1].1, span.start / 8 * 8, "another image hits only the text before it");
    assert_eq!(want[2].1, (prompt.len() - 1) / 8 * 8, "the same image hits through its span");
    let chunked = EngineConfig { max_batch_tokens: 7, ..engine_config() };
    for (name, cfg) in [("one instance", cluster(1, engine_config())), ("chunks of 7", cluster(1, chunked))] {
        let (got, report) =
            simulate(std::sync::Arc::new(model()), cfg, async |c: &mut Cluster| cluster_runs(c, &reqs).await).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let (tokens, finished) = g.as_ref().unwrap_or_else(|e| panic!("{name}: request {i} refused: {e}"));
            assert_eq!(tokens, &w.0, "{name}: tokens of request {i}");
            assert_eq!(finished.cached_tokens, w.1, "{name}: cached tokens of request {i}");
        }
        assert!(report.metrics.cache_hits > 0, "{name}: the same image hit the cluster's cache");
    }
}

#[test]
fn images_that_disagree_with_the_prompt_are_refused_by_the_cluster() {
    let m = model();
    let (prompt, x) = two_images(&m, 0);
    let mut moved = x.clone();
    moved[1].start += 1;
    let mut other_hash = x.clone();
    other_hash[0].hash ^= 1;
    let mut short_rows = x.clone();
    short_rows[0].content = ImageContent::Rows(vec![0.0; 5].into());
    let text_only = build(Preset::TinyV41, 3).unwrap();
    // Past what one frame carries: refused by the client, not lost on the way.
    let mut huge = x.clone();
    huge[0].content = ImageContent::Rows(vec![0.0; 15 << 20].into());
    // A plan no image has (its sizes would overflow whoever believed them).
    let mut bogus = x.clone();
    bogus[0].plan.n_llm_h = u32::MAX as usize;
    bogus[0].plan.n_vit_h = u32::MAX as usize;
    let reqs = [
        greedy(&prompt, &moved, 2),
        greedy(&prompt, &other_hash, 2),
        greedy(&prompt, &short_rows, 2),
        greedy(&prompt, &huge, 2),
        greedy(&prompt, &bogus, 2),
    ];
    let m = std::sync::Arc::new(m);
    for cfg in [cluster(1, engine_config()), with_encoders(1)] {
        let (got, _) = simulate(m.clone(), cfg, async |c: &mut Cluster| cluster_runs(c, &reqs).await).unwrap();
        let wants = ["outside every image span", "hash", "row values", "a request may carry", "not the model's plan"];
        for (g, want) in got.iter().zip(wants) {
            let why = g.as_ref().err().unwrap_or_else(|| panic!("refused for {want}"));
            assert!(why.contains(want), "{why:?} names {want}");
        }
    }
    let (got, _) = simulate(std::sync::Arc::new(text_only), cluster(1, engine_config()), async |c: &mut Cluster| {
        cluster_runs(c, &reqs[..1]).await
    })
    .unwrap();
    assert!(got[0].as_ref().is_err_and(|e| e.contains("takes no images")), "{got:?}");
}

/// One instance on node 0 and `encoders` encoder instances on nodes of their own.
fn with_encoders(encoders: u32) -> ClusterConfig {
    let mut cfg = cluster(1, engine_config());
    cfg.encoder_nodes = (1..=encoders).collect();
    cfg
}

#[test]
fn an_encoder_instance_encodes_the_images_and_its_cache_serves_a_repeat() {
    let m = model();
    let (prompt, x) = two_images(&m, 0);
    let (_, y) = two_images(&m, 9);
    let reqs = [greedy(&prompt, &x, 6), greedy(&prompt, &y, 6), greedy(&prompt, &x, 6)];
    let want = engine_runs(&m, &reqs);
    let (got, report) =
        simulate(std::sync::Arc::new(model()), with_encoders(2), async |c: &mut Cluster| cluster_runs(c, &reqs).await)
            .unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (tokens, finished) = g.as_ref().unwrap_or_else(|e| panic!("request {i} refused: {e}"));
        assert_eq!(tokens, &w.0, "tokens of request {i}");
        assert_eq!(finished.cached_tokens, w.1, "cached tokens of request {i}");
    }
    let m = &report.metrics;
    assert_eq!(m.images_sent_to_encoders, 6, "two images a request: {m:?}");
    assert_eq!(m.images_colocated, 0);
    // The second shares x's second image, the third repeats both: the
    // balancer sends them to the encoder that has them, whose cache answers.
    assert_eq!(m.encoder_cache_hits, 3, "x's two images and y's second: {m:?}");
    // One after another, the idle encoder that holds the images wins each time.
    assert!(!report.log.iter().any(|l| l.contains("images to encoder1")), "affinity kept them on encoder0");
}

#[test]
fn an_encoder_lost_mid_batch_costs_a_retry_never_the_request() {
    let m = model();
    let (prompt, x) = two_images(&m, 0);
    let (_, y) = two_images(&m, 9);
    let reqs = [greedy(&prompt, &x, 5), greedy(&prompt, &y, 5)];
    let want = engine_runs(&m, &reqs);
    for (encoders, kill_at) in [(2, 1), (1, 1), (2, 2)] {
        let mut cfg = with_encoders(encoders);
        let kill = KillRule { target: Target::Encoder(0), step: kill_at, layer: 0, repeat: false };
        cfg.faults = Some(FaultPlan { kills: vec![kill], ..FaultPlan::default() });
        let (got, report) = simulate(std::sync::Arc::new(model()), cfg, async |c: &mut Cluster| {
            // Both at once: the encoder dies with images of both in its queue.
            let ids: Vec<u64> = reqs.iter().map(|r| c.submit(r.clone())).collect();
            let mut tokens: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
            let mut ends = BTreeMap::new();
            while ends.len() < ids.len() {
                match c.next_update().await.expect("the cluster runs") {
                    Update::Tokens { id, tokens: t, .. } => {
                        tokens.entry(id).or_default().extend(t.iter().map(|t| t.token))
                    }
                    Update::Finished { id, finished } => drop(ends.insert(id, Ok(finished))),
                    Update::Refused { id, reason } => drop(ends.insert(id, Err(reason))),
                }
            }
            ids.iter().map(|id| (tokens.remove(id).unwrap_or_default(), ends.remove(id).unwrap())).collect::<Vec<_>>()
        })
        .unwrap();
        let what = format!("{encoders} encoders, killed at image {kill_at}");
        for (i, ((tokens, end), w)) in got.iter().zip(&want).enumerate() {
            assert!(end.is_ok(), "{what}: request {i} ended {end:?}");
            assert_eq!(tokens, &w.0, "{what}: tokens of request {i}");
        }
        let m = &report.metrics;
        assert_eq!((m.kills_injected, m.encoder_restarts), (1, 1), "{what}: {m:?}");
        assert!(m.encode_retries >= 1, "{what}: the lost images were asked for again: {m:?}");
        if encoders == 1 {
            assert!(m.images_colocated >= 1, "{what}: with no other encoder, the workers encode: {m:?}");
        }
    }
}

/// The encoder's node cut off from the cluster (simulated membership): the
/// images sent to it before membership declares it down are encoded on the
/// prefill workers once it does; every request gets the engine's tokens.
#[test]
fn an_encoder_node_cut_off_mid_run_costs_a_retry_never_the_request() {
    let m = model();
    let reqs: Vec<GenRequest> = (0..4)
        .map(|k| {
            let (prompt, images) = two_images(&m, 7 * k);
            greedy(&prompt, &images, 4)
        })
        .collect();
    let want = engine_runs(&m, &reqs);
    let mut cfg = with_encoders(1);
    cfg.membership = Some(MembershipConfig::simulated());
    let cut = Duration::from_millis(300);
    cfg.fabric.partitions = vec![Partition { a: vec![1], b: vec![0], from: cut, until: Duration::MAX }];
    let (got, report) = simulate(std::sync::Arc::new(model()), cfg, async |c: &mut Cluster| {
        let mut all = cluster_runs(c, &reqs[..2]).await;
        // Past the cut, before membership's failure timeout: the router still names the encoder.
        let clock = c.clock();
        clock.sleep(cut.saturating_sub(clock.now()) + Duration::from_millis(20)).await;
        all.extend(cluster_runs(c, &reqs[2..]).await);
        all
    })
    .unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let (tokens, _) = g.as_ref().unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(tokens, &w.0, "tokens of request {i}");
    }
    let mx = &report.metrics;
    assert!(report.log.iter().any(|l| l.contains("encoder0 lost request")), "the cut lost images in flight");
    assert!(mx.encode_retries >= 1 && mx.images_colocated >= 2, "{mx:?}");
}

/// With modelled device time, the encoder instance is busy for the cost
/// model's price of V4.1-Flash's tower per image (H800 here): the run takes
/// that much longer, and the tokens do not change.
#[test]
fn an_encoder_on_a_modelled_device_takes_the_towers_time() {
    use deepinfer_actors::DeviceCostModel;
    use deepinfer_engine::cost::vision::VisionCost;
    use deepinfer_engine::cost::{Efficiency, HardwareKind, ModelKind};

    let m = model();
    let (prompt, x) = two_images(&m, 0);
    let reqs = [greedy(&prompt, &x, 3)];
    let want = engine_runs(&m, &reqs);
    let run = |cost: Option<HardwareKind>| {
        let mut cfg = with_encoders(1);
        cfg.device_cost = cost.map(|hw| DeviceCostModel::new(hw, ModelKind::V41Flash));
        let (got, report) =
            simulate(std::sync::Arc::new(model()), cfg, async |c: &mut Cluster| cluster_runs(c, &reqs).await).unwrap();
        assert_eq!(got[0].as_ref().unwrap().0, want[0].0, "the engine's tokens");
        report
    };
    let timed = run(Some(HardwareKind::H800));
    let cost = VisionCost::of(ModelKind::V41Flash).unwrap();
    let hw = HardwareKind::H800.spec();
    let tower_us: f64 = x
        .iter()
        .map(|i| cost.encode_us(&cost.plan(i.plan.width, i.plan.height).unwrap(), &hw, Efficiency::default()))
        .sum();
    assert!(tower_us > 1000.0, "a published tower takes milliseconds: {tower_us} µs");
    assert!(timed.elapsed.as_secs_f64() * 1e6 > tower_us, "{:?} covers the tower's {tower_us} µs", timed.elapsed);
    let busy = timed.log.iter().filter(|l| l.contains("encoder0->scheduler0")).count();
    assert!(busy >= 2, "the rows came back");
}
