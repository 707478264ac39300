//! `deepinfer simulate`: run a scenario on the deterministic cluster
//! simulation — the real router, schedulers, cache managers, workers and
//! shards on one current-thread runtime with a virtual clock, a simulated
//! fabric and modelled full-size devices — and report what it did.

pub mod balance_report;
pub mod cache_report;
pub mod capacity;
pub mod encoder_report;
pub mod handoff_report;
pub mod images;
pub mod plan;
pub mod plots;
pub mod progress;
pub mod report;
mod report_md;
mod series;
pub mod sessions;
pub mod sweep;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use deepinfer_actors::cluster::ctx::Timeouts;
use deepinfer_actors::cluster::disagg::InstanceKind;
use deepinfer_actors::cluster::simulate;
use deepinfer_actors::modelled::balance::BalanceStats;
use deepinfer_actors::modelled::devices::ModelledSpec;
use deepinfer_actors::modelled::drafting::DraftTotals;
use deepinfer_actors::modelled::tiers::{Admission, TierTotals, TIERS};
use deepinfer_actors::sim::fabric::{Link, Partition};
use deepinfer_actors::sim::faults::FaultPlan;
use deepinfer_actors::{Cluster, ClusterConfig, Update};
use deepinfer_engine::cost::Efficiency;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::{FinishReason, Request};
use deepinfer_engine::scheduler::EngineConfig;
use deepinfer_engine::traffic::{parse_mooncake, Arrival, Synthetic, MOONCAKE_BLOCK_TOKENS};

use crate::scenario::{Fault, Scenario, Traffic};
pub use progress::Progress;
use progress::Reporter;
pub use report::Report;

/// How one request went, in simulated microseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub arrival_us: u64,
    pub input_tokens: usize,
    pub output_wanted: usize,
    pub first_token_us: Option<u64>,
    pub last_token_us: u64,
    pub tokens: usize,
    pub cached_tokens: usize,
    pub end: Option<End>,
    /// With cache tiers: prompt tokens each tier served at its first admission, and how long
    /// it waited for lower tiers.
    pub cached_by_tier: Option<[usize; TIERS]>,
    pub tier_load_us: u64,
    /// Its images, their tokens (in `input_tokens`), and how long after its
    /// arrival their rows were at the prefill instance (it reached the router then).
    pub images: u32,
    pub image_tokens: usize,
    pub images_ready_us: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum End {
    Completed,
    Failed(String),
    Refused(String),
}

/// Tokens and requests of one slice of simulated time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Bucket {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub completed: u64,
    pub failed: u64,
    /// Highest KV use of any instance seen in the slice (fraction of its budget).
    pub kv_use_max: f64,
    /// Images arriving in the slice, and the longest wait for a request's
    /// images' rows among its arrivals, µs.
    pub images: u64,
    pub images_ready_max_us: u64,
}

/// Everything a run produced, before it is summarised.
#[derive(Default)]
pub struct RunData {
    pub traces: Vec<Trace>,
    pub buckets: Vec<Bucket>,
    /// `(time s, what)` of every fault.
    pub faults: Vec<(f64, String)>,
    /// Per instance: highest and mean KV use (fraction of its budget).
    pub kv_use: Vec<(f64, f64)>,
    pub kv_budget_gib: Vec<f64>,
    /// Per instance: max/mean expert load per device (step-weighted mean over
    /// the run), the device shares per layer at the end, and the balance over time.
    pub expert_imbalance: Vec<f64>,
    pub expert_shares: Vec<Vec<Vec<f64>>>,
    pub expert_balance: Vec<BalanceStats>,
    pub simulated_s: f64,
    pub steps: u64,
    /// Lines of the run's event log (every message handled, timer fired, fault).
    pub events: u64,
    pub digest: u64,
    pub handovers: u64,
    /// What the prefill → decode handoffs did (reroutes, recomputes, backlog).
    pub handoffs: handoff_report::HandoffReport,
    pub restarts: u64,
    pub rebuilt: u64,
    /// What speculative decoding did, when on.
    pub drafts: Option<DraftTotals>,
    /// What the cache tiers did, when configured.
    pub tiers: Option<TierRun>,
    /// What the image encoders did, when the traffic has images.
    pub encoders: Option<encoder_report::EncoderRun>,
}

/// The cache tiers' side of a run.
#[derive(Clone, Debug, Default)]
pub struct TierRun {
    pub admissions: Vec<Admission>,
    pub totals: TierTotals,
    /// What an unbounded cache without TTLs would serve of the arrivals.
    pub ideal_hit_rate: f64,
    /// Bytes of one prefix block of the modelled model.
    pub block_bytes: f64,
}

/// The requests of a scenario, in arrival order.
pub fn arrivals(s: &Scenario) -> anyhow::Result<Vec<Arrival>> {
    let until_us = (s.duration_s * 1e6) as u64;
    let mut out = match &s.traffic {
        Traffic::Synthetic { pattern, input, output, shared_prefix_tokens, shared_fraction } => Synthetic {
            pattern: *pattern,
            input: *input,
            output: *output,
            shared_prefix_tokens: *shared_prefix_tokens,
            shared_fraction: *shared_fraction,
            duration_s: s.duration_s,
            seed: s.seed,
        }
        .arrivals(),
        Traffic::Mooncake { path, time_scale, repeat } => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("{}: cannot read the trace {}", s.file, path.display()))?;
            let one = parse_mooncake(&text, &path.display().to_string(), *time_scale)?;
            let span = one.last().map_or(0, |a| a.at_us) + 1_000_000;
            let mut all = Vec::with_capacity(one.len() * *repeat as usize);
            for r in 0..*repeat as u64 {
                all.extend(one.iter().map(|a| Arrival { at_us: a.at_us + r * span, ..a.clone() }));
            }
            all
        }
        Traffic::Sessions(x) => sessions::arrivals(x, s.duration_s, s.seed),
    };
    out.retain(|a| a.at_us < until_us);
    Ok(out)
}

/// Whole blocks of each arrival's prompt written to the shared store before
/// the run (resumed sessions), by arrival.
pub fn earlier_blocks(s: &Scenario) -> Vec<usize> {
    match &s.traffic {
        Traffic::Sessions(x) => sessions::generate(x, s.duration_s, s.seed).1,
        _ => Vec::new(),
    }
}

/// Prompt tokens for an arrival: each 512-token block's content is a function
/// of its id, so equal id prefixes are equal token prefixes (prefix-cache hits).
pub fn prompt_of(a: &Arrival, vocab: usize, unique: u64) -> Vec<u32> {
    let span = vocab.saturating_sub(2000).max(1) as u64;
    let token = |block: u64, i: usize| {
        let h = deepinfer_actors::sim::rng::mix64(block.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64);
        (1000 + h % span) as u32
    };
    let mut p = Vec::with_capacity(a.input_tokens);
    let mut j = 0;
    while p.len() < a.input_tokens {
        // Ids past the trace's list are unique to this request.
        let block = a.prefix_blocks.get(j).copied().unwrap_or(u64::MAX - unique * 4096 - j as u64);
        let n = MOONCAKE_BLOCK_TOKENS.min(a.input_tokens - p.len());
        p.extend((0..n).map(|i| token(block, i)));
        j += 1;
    }
    p
}

fn kinds(s: &Scenario) -> Vec<InstanceKind> {
    s.instances.iter().map(|&(r, _)| r).collect()
}

/// The cluster a scenario describes.
pub fn cluster_config(s: &Scenario, seed: u64) -> ClusterConfig {
    let devices = s.devices();
    let sizes: Vec<u32> = s.instances.iter().map(|&(_, d)| d).collect();
    let mut cfg = ClusterConfig::new(devices, sizes.iter().copied().max().unwrap_or(1));
    cfg.instances = sizes.len() as u32;
    cfg.instance_devices = sizes;
    cfg.instance_kinds = kinds(s);
    cfg.prefill_routing = s.prefill_routing;
    cfg.devices_per_node = s.devices_per_node;
    cfg.seed = seed;
    cfg.engine = EngineConfig {
        prefix_mode: if s.prefix_cache { PrefixMode::Exact } else { PrefixMode::Off },
        block_tokens: Some(s.block_tokens),
        max_waiting: 1 << 20,
        speculative: s.speculative.as_ref().map(|d| d.config).unwrap_or_default(),
        cache_ttl_ms: s.cache.as_ref().map_or(deepinfer_engine::request::DEFAULT_CACHE_TTL_MS, |c| c.tiers.ttl_ms),
        ..EngineConfig::default()
    };
    cfg.modelled = Some(ModelledSpec {
        hardware: s.hardware,
        model: s.model,
        efficiency: Efficiency::for_hardware(s.hardware),
        popularity: s.popularity,
        drift_s: s.expert_drift_s,
        drift_share: s.expert_drift_share,
        rebalance_s: s.rebalance_s,
        redundant_experts: s.redundant_experts,
        redundant_per_instance: (0..s.instances.len())
            .map(|i| s.redundant_per_instance.get(i).copied().flatten().unwrap_or(s.redundant_experts))
            .collect(),
        batch_per_device: s.batch_per_device,
        batch_tokens_per_device: s.batch_tokens_per_device,
        decode_steps_per_event: s.decode_steps_per_event,
        drafting: s.speculative.clone(),
        device_kv_bytes: s.cache.as_ref().and_then(|c| c.device_kv_bytes),
        tiers: s.cache.as_ref().map(|c| c.tiers.clone()),
        scale_up_domain: s.scale_up_domain,
        precision: s.precision,
        instance_limits: s.instance_limits.clone(),
        seed,
    });
    // Modelled steps take up to seconds (long prefills): only a silence much
    // longer than that is a lost message or a dead actor.
    cfg.timeouts = Some(Timeouts {
        dispatch: Duration::from_secs(2),
        dispatch_attempts: 5,
        step: Duration::from_secs(20),
        step_attempts: 12,
        control: Duration::from_secs(1),
        control_attempts: 8,
        request: Duration::from_secs(60),
        request_attempts: 10,
    });
    let nodes: Vec<u32> = (0..s.nodes()).collect();
    let mut plan = FaultPlan::default();
    for f in &s.faults {
        match f {
            Fault::CrashNode { node, at_s, until_s: Some(until) } => cfg.fabric.partitions.push(Partition {
                a: vec![*node],
                b: nodes.iter().copied().filter(|n| n != node).collect(),
                from: Duration::from_secs_f64(*at_s),
                until: Duration::from_secs_f64(*until),
            }),
            Fault::Partition { nodes: cut, at_s, until_s } => cfg.fabric.partitions.push(Partition {
                a: cut.clone(),
                b: nodes.iter().copied().filter(|n| !cut.contains(n)).collect(),
                from: Duration::from_secs_f64(*at_s),
                until: Duration::from_secs_f64(*until_s),
            }),
            Fault::SlowLink { nodes: slow, latency_us, gb_per_s } => {
                let link = Link {
                    latency: Duration::from_secs_f64(latency_us / 1e6),
                    bandwidth: (gb_per_s * 1e9) as u64,
                    jitter: Duration::ZERO,
                };
                for &a in slow {
                    for &b in nodes.iter().filter(|n| !slow.contains(n)) {
                        cfg.fabric.links.insert((a, b), link);
                        cfg.fabric.links.insert((b, a), link);
                    }
                }
            }
            Fault::Straggler { device, slowdown } => plan.stragglers.push((*device, *slowdown)),
            Fault::CrashNode { .. } | Fault::CrashDevice { .. } => {}
        }
    }
    cfg.faults = Some(plan);
    cfg
}

/// Kills to perform at their time: `(µs, path, label)`, in time order.
fn timed_kills(s: &Scenario) -> Vec<(u64, Vec<String>, String)> {
    let per_node = s.devices_per_node;
    let mut kills: Vec<(u64, Vec<String>, String)> = s
        .faults
        .iter()
        .filter_map(|f| match *f {
            Fault::CrashNode { node, at_s, until_s } => {
                let label = match until_s {
                    Some(u) => format!("node{node} crashes (down until {u} s)"),
                    None => format!("node{node} crashes"),
                };
                Some(((at_s * 1e6) as u64, vec![format!("node{node}")], label))
            }
            Fault::CrashDevice { device, at_s } => {
                let node = device / per_node;
                let paths = vec![format!("node{node}/worker{device}"), format!("node{node}/shard{device}")];
                Some(((at_s * 1e6) as u64, paths, format!("device {device} crashes")))
            }
            _ => None,
        })
        .collect();
    kills.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.2.cmp(&b.2)));
    kills
}

/// Faults with a time, for the report's timeline.
fn fault_marks(s: &Scenario) -> Vec<(f64, String)> {
    let mut marks: Vec<(f64, String)> = Vec::new();
    for f in &s.faults {
        match f {
            Fault::CrashNode { node, at_s, until_s } => {
                marks.push((*at_s, format!("node{node} down")));
                if let Some(u) = until_s {
                    marks.push((*u, format!("node{node} back")));
                }
            }
            Fault::CrashDevice { device, at_s } => marks.push((*at_s, format!("device {device} crash"))),
            Fault::Partition { nodes, at_s, until_s } => {
                marks.push((*at_s, format!("partition {nodes:?}")));
                marks.push((*until_s, "partition healed".to_string()));
            }
            _ => {}
        }
    }
    marks.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));
    marks
}

/// Run `s` (with `seed` instead of its own, if given), showing `progress`
/// (`true`: a bar; see [`Progress`]).
pub fn run(s: &Scenario, seed: Option<u64>, progress: impl Into<Progress>) -> anyhow::Result<Report> {
    let seed = seed.unwrap_or(s.seed);
    let s = &Scenario { seed, ..s.clone() };
    let mut arrivals = arrivals(s)?;
    let image_jobs = images::images_of(s, &mut arrivals);
    let earlier = earlier_blocks(s);
    // The shape the actors see; modelled devices never run it.
    let model = Arc::new(build(Preset::TinyV4, 0)?);
    let cfg = cluster_config(s, seed);
    let bar = Reporter::new(&progress.into(), s.duration_s + s.drain_s);
    let kills = timed_kills(s);
    let (data, sim) = simulate(model, cfg, async |c: &mut Cluster| {
        let stage = images::ImageStage::new(s, image_jobs);
        drive(c, s, &arrivals, &earlier, &kills, &bar, stage).await
    })
    .map_err(|e| anyhow::anyhow!("{}: {e}", s.file))?;
    let mut data = data;
    data.steps = sim.steps;
    data.digest = sim.digest;
    data.events = sim.events;
    data.handovers = sim.metrics.handovers;
    data.handoffs = handoff_report::HandoffReport::new(&sim.metrics);
    data.rebuilt = sim.metrics.sequences_rebuilt;
    let m = &sim.metrics;
    data.restarts = m.restarts();
    Ok(Report::new(s, &data))
}

/// Hand arrival `index` to the cluster at `now` (its arrival, or when its
/// images' rows reached the prefill instance); its trace is `traces[index]`.
#[allow(clippy::too_many_arguments)]
fn submit(
    c: &mut Cluster,
    s: &Scenario,
    arrivals: &[Arrival],
    earlier: &[usize],
    tiers: Option<&deepinfer_actors::modelled::tiers::ModelledTiers>,
    index: usize,
    now: u64,
    ids: &mut BTreeMap<u64, usize>,
) {
    let a = &arrivals[index];
    let prompt = prompt_of(a, 129_280, index as u64);
    if let (Some(t), Some(&blocks)) = (tiers, earlier.get(index)) {
        // History computed before the run: in the shared store, block by engine block.
        let bt = s.block_tokens;
        let mut parent = 0;
        for chunk in prompt[..blocks * MOONCAKE_BLOCK_TOKENS].chunks_exact(bt) {
            let key = deepinfer_engine::prefix_cache::block_hash(parent, chunk);
            t.preload(now / 1000, key, parent);
            parent = key;
        }
    }
    let mut r = Request::new(prompt, a.output_tokens.max(1));
    r.ignore_eos = true;
    let id = c.submit(r);
    ids.insert(id, index);
}

async fn drive(
    c: &mut Cluster,
    s: &Scenario,
    arrivals: &[Arrival],
    earlier: &[usize],
    kills: &[(u64, Vec<String>, String)],
    bar: &Reporter,
    mut stage: images::ImageStage,
) -> RunData {
    let modelled = c.modelled();
    let tiers = modelled.as_ref().and_then(|m| m.tiers.as_ref());
    let clock = c.clock();
    let us = |d: Duration| d.as_micros() as u64;
    let sample_us = ((s.sample_s * 1e6) as u64).max(1000);
    let end_us = ((s.duration_s + s.drain_s) * 1e6) as u64;
    let instances = c.topology().instances as usize;
    let mut traces: Vec<Trace> = Vec::with_capacity(arrivals.len());
    let mut ids: BTreeMap<u64, usize> = BTreeMap::new();
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut kv_max = vec![0.0f64; instances];
    let mut kv_sum = vec![0.0f64; instances];
    let mut kv_samples = 0u64;
    let (mut next, mut next_kill, mut next_sample) = (0usize, 0usize, 0u64);
    loop {
        let now = us(clock.now());
        while next_kill < kills.len() && kills[next_kill].0 <= now {
            let (_, paths, label) = &kills[next_kill];
            c.record(format_args!("scenario fault at {now} us: {label}"));
            for p in paths {
                c.kill(p);
            }
            next_kill += 1;
        }
        while next < arrivals.len() && arrivals[next].at_us <= now {
            let a = &arrivals[next];
            let jobs = &stage.jobs[next];
            traces.push(Trace {
                arrival_us: a.at_us,
                input_tokens: a.input_tokens,
                output_wanted: a.output_tokens.max(1),
                images: jobs.len() as u32,
                image_tokens: jobs.iter().map(|j| j.tokens).sum(),
                ..Trace::default()
            });
            let ready = stage.arrive(next, now, modelled.as_deref());
            images::record(&mut buckets, (now / sample_us) as usize, stage.jobs[next].len(), stage.waited_us[next]);
            next += 1;
            if ready {
                submit(c, s, arrivals, earlier, tiers, next - 1, now, &mut ids);
            }
        }
        while let Some(i) = stage.ready(now) {
            submit(c, s, arrivals, earlier, tiers, i, now, &mut ids);
        }
        while next_sample <= now {
            let slot = (next_sample / sample_us) as usize;
            if buckets.len() <= slot {
                buckets.resize(slot + 1, Bucket::default());
            }
            for (i, g) in c.gauges().iter().enumerate() {
                let used = g.kv_used_bytes.load(std::sync::atomic::Ordering::Relaxed) as f64;
                let budget = g.kv_budget_bytes.load(std::sync::atomic::Ordering::Relaxed).max(1) as f64;
                let f = used / budget;
                kv_max[i] = kv_max[i].max(f);
                kv_sum[i] += f;
                buckets[slot].kv_use_max = buckets[slot].kv_use_max.max(f);
            }
            kv_samples += 1;
            next_sample += sample_us;
            bar.show(now as f64 / 1e6, traces.len(), c.outstanding());
        }
        if (next == arrivals.len() && stage.waiting.is_empty() && !c.has_updates()) || now >= end_us {
            break;
        }
        let mut wake = end_us.min(next_sample);
        if let Some(a) = arrivals.get(next) {
            wake = wake.min(a.at_us);
        }
        if let Some(k) = kills.get(next_kill) {
            wake = wake.min(k.0);
        }
        if let Some(at) = stage.next_ready_us() {
            wake = wake.min(at);
        }
        let sleep = clock.sleep(Duration::from_micros(wake.saturating_sub(now)));
        let update = if c.has_updates() {
            tokio::select! {
                u = c.next_update() => u,
                _ = sleep => None,
            }
        } else {
            sleep.await;
            None
        };
        let Some(u) = update else { continue };
        let now = us(clock.now());
        let slot = (now / sample_us) as usize;
        if buckets.len() <= slot {
            buckets.resize(slot + 1, Bucket::default());
        }
        match u {
            Update::Tokens { id, tokens, .. } => {
                let Some(&i) = ids.get(&id) else { continue };
                let t = &mut traces[i];
                // A burst counts evenly over the time since the request's
                // previous tokens (its arrival, for the first): see `series`.
                let since = if t.first_token_us.is_none() { t.arrival_us } else { t.last_token_us };
                if t.first_token_us.is_none() {
                    t.first_token_us = Some(now);
                    // When its prefill started is not seen here: its prompt
                    // counts over the wait for its first token.
                    series::spread(&mut buckets, t.input_tokens as u64, (since, now), sample_us, |b| {
                        &mut b.input_tokens
                    });
                }
                t.tokens += tokens.len();
                t.last_token_us = now;
                series::spread(&mut buckets, tokens.len() as u64, (since, now), sample_us, |b| &mut b.output_tokens);
            }
            Update::Finished { id, finished } => {
                let Some(&i) = ids.get(&id) else { continue };
                let t = &mut traces[i];
                t.cached_tokens = finished.cached_tokens;
                t.end = Some(match finished.reason {
                    FinishReason::Error(e) => {
                        buckets[slot].failed += 1;
                        End::Failed(e)
                    }
                    _ => {
                        buckets[slot].completed += 1;
                        End::Completed
                    }
                });
            }
            Update::Refused { id, reason } => {
                let Some(&i) = ids.get(&id) else { continue };
                buckets[slot].failed += 1;
                traces[i].end = Some(End::Refused(reason));
            }
        }
    }
    let simulated_s = clock.now().as_secs_f64();
    bar.finish(simulated_s, traces.len(), c.outstanding());
    let (mut imbalance, mut shares, mut budgets, mut balance) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    if let Some(m) = c.modelled() {
        for i in 0..instances as u32 {
            let sh = m.shares(i);
            let stats = m.balance_stats(i);
            imbalance.push(balance_report::mean_imbalance(&stats, sh.imbalance()));
            balance.push(stats);
            shares.push(sh.shares.clone());
            budgets.push(m.kv_bytes_per_device(i) * c.topology().size_of(i) as f64 / (1u64 << 30) as f64);
        }
    }
    for (t, &waited) in traces.iter_mut().zip(&stage.waited_us) {
        t.images_ready_us = waited;
    }
    let samples = kv_samples.max(1) as f64;
    let drafts = c.modelled().filter(|m| m.drafting().is_some()).map(|m| m.drafts.totals());
    let tiers = c.modelled().and_then(|m| {
        let t = m.tiers.as_ref()?;
        let admissions = t.admissions();
        for a in &admissions {
            if let Some(&i) = ids.get(&a.request) {
                traces[i].cached_by_tier = Some(a.by_tier);
                traces[i].tier_load_us = a.load_us;
            }
        }
        Some(TierRun {
            admissions,
            totals: t.totals(),
            ideal_hit_rate: sessions::ideal_hit_rate(arrivals, earlier),
            block_bytes: t.block_bytes,
        })
    });
    RunData {
        traces,
        buckets,
        faults: fault_marks(s),
        kv_use: kv_max.iter().zip(&kv_sum).map(|(&m, &sum)| (m, sum / samples)).collect(),
        kv_budget_gib: budgets,
        expert_imbalance: imbalance,
        expert_shares: shares,
        expert_balance: balance,
        simulated_s,
        drafts,
        tiers,
        encoders: s.images.as_ref().map(|_| encoder_report::EncoderRun {
            instances: stage.stage.stats(),
            colocated_images: stage.stage.colocated_images,
            colocated_encode_us: stage.stage.colocated_encode_us,
        }),
        // The run's totals are filled in from the cluster's report.
        ..RunData::default()
    }
}
