//! Planning a deployment: for one scenario's model, hardware, traffic and
//! SLOs, every layout of a given number of GPUs within a search space
//! (prefill:decode split and instance sizes, that is expert-parallel
//! degrees, for disaggregated serving; instance sizes for colocated
//! serving; redundant experts; the prompt-cache tiers kept) has its capacity searched
//! ([`find_capacity`](super::capacity::find_capacity)); each gets its cost per million tokens at a GPU-hour
//! price, and the layouts no other beats on both throughput per GPU and
//! tokens/s per user form the frontier.

use serde::Serialize;

use super::capacity::{find_capacity_with, Criteria, Probe};
use super::plots::scatter_chart;
use super::Progress;
use crate::scenario::{Scenario, DEFAULT_ENCODER_CACHE_GIB};
use deepinfer_actors::cluster::disagg::InstanceKind;
use deepinfer_actors::modelled::encoder::EncoderSpec;
use deepinfer_engine::cost::{KvFormat, Precision};

/// Most layouts one plan simulates (each is a capacity search of several runs).
pub const MAX_LAYOUTS: usize = 48;
/// Devices of an encoder instance `--encoders` adds when the file has none to copy.
pub const ENCODER_DEVICES_DEFAULT: u32 = 1;

/// What a plan searches over.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlanSpace {
    /// GPUs every layout uses, all of them.
    pub gpus: u32,
    /// Devices of one prefill, decode or colocated instance (its expert-parallel degree).
    pub prefill_sizes: Vec<u32>,
    pub decode_sizes: Vec<u32>,
    pub colocated_sizes: Vec<u32>,
    /// Redundant expert slots per instance.
    pub redundant: Vec<usize>,
    /// Prompt-cache tiers to try, of those the file configures (empty: the file's as they are).
    pub cache_tiers: Vec<CacheTiers>,
    /// KV cache formats to try (empty: the file's).
    pub kv_dtypes: Vec<KvDtype>,
    /// Image-encoder instances to try, each like the file's first (0:
    /// images encoded on the prefill instances; empty: the file's count).
    pub encoders: Vec<u32>,
}

/// A KV cache format `plan` tries, as `[engine] kv_dtype` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    Bf16,
    Fp8,
    /// V4.1's own layout (FP8 window, FP4 compressed entries).
    Fp4,
}

impl KvDtype {
    pub fn format(self) -> KvFormat {
        match self {
            KvDtype::Bf16 => KvFormat::Bf16,
            KvDtype::Fp8 => KvFormat::Fp8,
            KvDtype::Fp4 => KvFormat::V41Mixed,
        }
    }
}

/// Which of the file's prompt-cache tiers a layout keeps below the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CacheTiers {
    /// The device's prefix cache only.
    Device,
    /// The device and host memory.
    Host,
    /// Every tier the file configures (host, local disk, shared store).
    All,
}

impl CacheTiers {
    pub fn name(self) -> &'static str {
        match self {
            CacheTiers::Device => "device",
            CacheTiers::Host => "device+host",
            CacheTiers::All => "all tiers",
        }
    }
}

/// One deployment of the plan's GPUs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Layout {
    /// E.g. `2×P32 + 1×D64, 32 redundant`.
    pub label: String,
    pub instances: Vec<(String, u32, u32)>,
    pub redundant: usize,
    /// The cache tiers it keeps (`None`: the file's).
    pub cache_tiers: Option<CacheTiers>,
    /// The KV cache format it keeps (`None`: the file's).
    pub kv_dtype: Option<KvDtype>,
    /// Image-encoder instances (0: images encoded on the prefill instances)
    /// and their GPUs, which `gpus` includes.
    pub encoders: u32,
    pub encoder_gpus: u32,
    /// Whether the traffic has images (then `encoders` is the layout's choice).
    pub images: bool,
    /// GPUs of the layout, and those that prefill and decode (all of them when colocated).
    pub gpus: u32,
    pub prefill_gpus: u32,
    pub decode_gpus: u32,
    pub colocated: bool,
}

/// A layout with its capacity and what it costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    pub layout: Layout,
    /// The highest load that held (see [`find_capacity`](super::capacity::find_capacity)); `None` if none did.
    pub capacity: Option<Probe>,
    /// What broke first above it, or why the layout could not run.
    pub limit: Option<String>,
    /// Input plus output tokens per second per GPU at the capacity.
    pub tok_s_per_gpu: f64,
    /// Output tokens per second one user sees at the capacity (1000 / TPOT p50).
    pub tok_s_per_user: f64,
    /// Dollars per million tokens at the capacity: input on the prefill
    /// GPUs' hours, output on the decode GPUs' (disaggregated layouts only),
    /// and both over all GPU hours.
    pub usd_per_million_input: Option<f64>,
    pub usd_per_million_output: Option<f64>,
    pub usd_per_million_tokens: Option<f64>,
    /// No other layout has both more throughput per GPU and more tokens/s per user.
    pub on_frontier: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub scenario: String,
    pub hardware: String,
    pub model: String,
    pub space: PlanSpace,
    pub gpu_hour_usd: f64,
    pub criteria: Criteria,
    /// In the order of `layouts`.
    pub candidates: Vec<Candidate>,
    /// The layout with the most tokens/s per GPU at its capacity (fewer GPUs,
    /// then fewer encoders, on ties) and its encoder count, when any held a load.
    pub chosen: Option<usize>,
    pub chosen_encoders: Option<u32>,
}

fn kind_name(kind: InstanceKind) -> &'static str {
    match kind {
        InstanceKind::Prefill => "P",
        InstanceKind::Decode => "D",
        InstanceKind::Both => "C",
    }
}

fn layout(
    groups: &[(InstanceKind, u32, u32)],
    redundant: usize,
    cache_tiers: Option<CacheTiers>,
    kv_dtype: Option<KvDtype>,
    encoders: Option<(u32, u32)>,
) -> Layout {
    let label = groups.iter().map(|&(k, n, d)| format!("{n}×{}{d}", kind_name(k))).collect::<Vec<_>>().join(" + ");
    let gpus = |want: fn(InstanceKind) -> bool| groups.iter().filter(|g| want(g.0)).map(|g| g.1 * g.2).sum();
    let mut cache = cache_tiers.map_or(String::new(), |t| format!(", cache: {}", t.name()));
    if let Some(kv) = kv_dtype {
        cache += &format!(", KV {}", kv.format().name());
    }
    let images = encoders.is_some();
    let (encoders, encoder_devices) = encoders.unwrap_or((0, 0));
    if images {
        cache += &match encoders {
            0 => ", images on prefill".to_string(),
            n => format!(", {n}×E{encoder_devices}"),
        };
    }
    Layout {
        label: format!("{label}, {redundant} redundant{cache}"),
        instances: groups.iter().map(|&(k, n, d)| (kind_name(k).to_string(), n, d)).collect(),
        redundant,
        cache_tiers,
        kv_dtype,
        encoders,
        encoder_gpus: encoders * encoder_devices,
        images,
        gpus: groups.iter().map(|g| g.1 * g.2).sum::<u32>() + encoders * encoder_devices,
        prefill_gpus: gpus(InstanceKind::prefills),
        decode_gpus: gpus(InstanceKind::decodes),
        colocated: groups.iter().all(|g| g.0 == InstanceKind::Both),
    }
}

/// Every layout of `space` for `s`: disaggregated if the file's instances
/// are, colocated otherwise. Sizes must be multiples of the node.
/// A layout's instances as a scenario lists them: role and devices of each.
pub type Instances = Vec<(InstanceKind, u32)>;

/// How each layout's capacity is searched.
#[derive(Clone, Copy, Debug)]
pub struct Search {
    pub seed: Option<u64>,
    pub criteria: Criteria,
    /// Bisection steps once the load is bracketed.
    pub steps: u32,
    /// Layouts searched at once.
    pub threads: usize,
    /// With a value: every probe prints a line on stderr when it ends, and
    /// its run one at most this often (seconds of wall time) while it runs.
    pub progress_every_s: Option<f64>,
}

pub fn layouts(s: &Scenario, space: &PlanSpace) -> anyhow::Result<Vec<(Layout, Instances)>> {
    let per_node = s.devices_per_node;
    anyhow::ensure!(
        space.gpus > 0 && space.gpus.is_multiple_of(per_node),
        "--gpus must be a positive multiple of {per_node} (a node)"
    );
    let sizes = |v: &[u32], what: &str| -> anyhow::Result<Vec<u32>> {
        for &d in v {
            anyhow::ensure!(
                d > 0 && d.is_multiple_of(per_node),
                "{what} instance size {d}: a positive multiple of {per_node}"
            );
        }
        Ok(v.to_vec())
    };
    let disaggregated = s.instances.iter().any(|(k, _)| *k != InstanceKind::Both);
    let mut groups: Vec<Vec<(InstanceKind, u32, u32)>> = Vec::new();
    if disaggregated {
        for p in sizes(&space.prefill_sizes, "prefill")? {
            for d in sizes(&space.decode_sizes, "decode")? {
                let mut np = 1;
                while np * p < space.gpus {
                    let rest = space.gpus - np * p;
                    if rest.is_multiple_of(d) {
                        groups.push(vec![(InstanceKind::Prefill, np, p), (InstanceKind::Decode, rest / d, d)]);
                    }
                    np += 1;
                }
            }
        }
    } else {
        for c in sizes(&space.colocated_sizes, "colocated")? {
            if space.gpus.is_multiple_of(c) {
                groups.push(vec![(InstanceKind::Both, space.gpus / c, c)]);
            }
        }
    }
    let tiers: Vec<Option<CacheTiers>> = if space.cache_tiers.is_empty() {
        vec![None]
    } else {
        anyhow::ensure!(s.cache.is_some(), "--cache-tiers: the file configures no [cache] tiers to choose from");
        space.cache_tiers.iter().copied().map(Some).collect()
    };
    let kv_dtypes: Vec<Option<KvDtype>> = if space.kv_dtypes.is_empty() {
        vec![None]
    } else {
        for &kv in &space.kv_dtypes {
            let kv_only = Precision { kv: Some(kv.format()), ..s.precision };
            if let Err(why) = s.model.cost().with_precision(kv_only) {
                anyhow::bail!("--kv-dtypes {}: {why}", kv.format().name());
            }
        }
        space.kv_dtypes.iter().copied().map(Some).collect()
    };
    // Encoder counts, with the devices of one encoder instance (`None`: text only).
    let encoder_devices = s.encoders.first().map_or(ENCODER_DEVICES_DEFAULT, |e| e.devices);
    let encoders: Vec<Option<(u32, u32)>> = match (&s.images, space.encoders.is_empty()) {
        (None, true) => vec![None],
        (None, false) => anyhow::bail!("--encoders: the file's traffic has no [images]"),
        (Some(_), true) => vec![Some((s.encoders.len() as u32, encoder_devices))],
        (Some(_), false) => space.encoders.iter().map(|&n| Some((n, encoder_devices))).collect(),
    };
    let mut out = Vec::new();
    for g in &groups {
        for &r in &space.redundant {
            for &t in &tiers {
                for &kv in &kv_dtypes {
                    for &e in &encoders {
                        let instances =
                            g.iter().flat_map(|&(k, n, d)| std::iter::repeat_n((k, d), n as usize)).collect();
                        out.push((layout(g, r, t, kv, e), instances));
                    }
                }
            }
        }
    }
    anyhow::ensure!(!out.is_empty(), "no layout of {} GPUs fits the instance sizes asked for", space.gpus);
    anyhow::ensure!(
        out.len() <= MAX_LAYOUTS,
        "{} layouts: at most {MAX_LAYOUTS} (give fewer sizes, redundant counts or cache tiers)",
        out.len()
    );
    Ok(out)
}

/// `s` deployed as `layout` says: its `instances`, redundant expert slots
/// and the cache tiers it keeps.
pub fn deployed(s: &Scenario, instances: &[(InstanceKind, u32)], layout: &Layout) -> Scenario {
    let mut cache = s.cache.clone();
    if let (Some(c), Some(keep)) = (cache.as_mut(), layout.cache_tiers) {
        if keep < CacheTiers::All {
            c.tiers.disk_bytes = 0.0;
            c.tiers.shared_bytes = 0.0;
        }
        if keep < CacheTiers::Host {
            c.tiers.host_bytes = 0.0;
        }
    }
    // Each new instance keeps the limits and offload the file gives its role's first instance.
    let limits_of = |kind: InstanceKind| {
        s.instances
            .iter()
            .position(|(k, _)| *k == kind)
            .and_then(|i| s.instance_limits.get(i).cloned())
            .unwrap_or_default()
    };
    let precision = Precision { kv: layout.kv_dtype.map(KvDtype::format).or(s.precision.kv), ..s.precision };
    let encoder = s.encoders.first().copied().unwrap_or(EncoderSpec {
        devices: ENCODER_DEVICES_DEFAULT,
        cache_bytes: (DEFAULT_ENCODER_CACHE_GIB * (1u64 << 30) as f64) as u64,
    });
    let encoders = if s.images.is_some() { vec![encoder; layout.encoders as usize] } else { s.encoders.clone() };
    Scenario {
        encoders,
        instances: instances.to_vec(),
        redundant_per_instance: vec![None; instances.len()],
        instance_limits: instances.iter().map(|&(k, _)| limits_of(k)).collect(),
        precision,
        redundant_experts: layout.redundant,
        cache,
        ..s.clone()
    }
}

/// Search every layout of `space` (`threads` at a time), price it and mark the frontier.
pub fn plan(
    s: &Scenario,
    space: &PlanSpace,
    gpu_hour_usd: f64,
    search: Search,
    on_done: impl Fn(&Candidate) + Sync,
) -> anyhow::Result<Plan> {
    let Search { seed, criteria, steps, threads, progress_every_s } = search;
    anyhow::ensure!(gpu_hour_usd.is_finite() && gpu_hour_usd > 0.0, "the GPU-hour price must be positive");
    let jobs = layouts(s, space)?;
    let mut candidates: Vec<Option<Candidate>> = vec![None; jobs.len()];
    let on_done = &on_done;
    for chunk in (0..jobs.len()).collect::<Vec<_>>().chunks(threads.max(1)) {
        let done: Vec<(usize, Candidate)> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&i| {
                    let (layout, instances) = &jobs[i];
                    let v = deployed(s, instances, layout);
                    scope.spawn(move || {
                        let label = &layout.label;
                        let progress = progress_every_s.map_or(Progress::Off, |e| Progress::lines(e, label));
                        let on_probe = |p: &Probe| {
                            if progress_every_s.is_some() {
                                eprintln!("{label}: {}", p.summary());
                            }
                        };
                        let c = match find_capacity_with(&v, seed, criteria, steps, &progress, on_probe) {
                            Ok(c) => priced(layout.clone(), c.capacity, c.limit, gpu_hour_usd),
                            Err(e) => priced(layout.clone(), None, Some(format!("cannot run: {e}")), gpu_hour_usd),
                        };
                        on_done(&c);
                        (i, c)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a capacity search does not panic")).collect()
        });
        for (i, c) in done {
            candidates[i] = Some(c);
        }
    }
    let mut candidates: Vec<Candidate> = candidates.into_iter().map(|c| c.expect("every layout ran")).collect();
    mark_frontier(&mut candidates);
    let chosen = choose(&candidates);
    Ok(Plan {
        chosen,
        chosen_encoders: chosen.map(|i| candidates[i].layout.encoders),
        scenario: s.name.clone(),
        hardware: s.hardware.name().to_string(),
        model: s.model.cost().name.to_string(),
        space: space.clone(),
        gpu_hour_usd,
        criteria,
        candidates,
    })
}

fn priced(layout: Layout, capacity: Option<Probe>, limit: Option<String>, gpu_hour_usd: f64) -> Candidate {
    let all_gpus = f64::from(layout.gpus.max(1));
    let (mut tok_s_per_gpu, mut tok_s_per_user) = (0.0, 0.0);
    let (mut input, mut output, mut blended) = (None, None, None);
    if let Some(p) = &capacity {
        tok_s_per_gpu = (p.input_tok_s + p.output_tok_s) / all_gpus;
        tok_s_per_user = if p.tpot_p50_ms > 0.0 { 1000.0 / p.tpot_p50_ms } else { 0.0 };
        // Dollars an hour of `gpus` GPUs, per million tokens made in that hour.
        let per_million = |gpus: f64, tok_s: f64| (tok_s > 0.0).then(|| gpus * gpu_hour_usd / (tok_s * 3600.0 / 1e6));
        blended = per_million(all_gpus, p.input_tok_s + p.output_tok_s);
        if !layout.colocated {
            // Images are part of the input: encoder GPUs are charged with the prefill ones.
            input = per_million(f64::from(layout.prefill_gpus + layout.encoder_gpus), p.input_tok_s);
            output = per_million(f64::from(layout.decode_gpus), p.output_tok_s);
        }
    }
    Candidate {
        layout,
        capacity,
        limit,
        tok_s_per_gpu,
        tok_s_per_user,
        usd_per_million_input: input,
        usd_per_million_output: output,
        usd_per_million_tokens: blended,
        on_frontier: false,
    }
}

/// The index of the candidate with the most tokens/s per GPU; ties go to
/// fewer GPUs, then fewer encoders, then the first.
fn choose(candidates: &[Candidate]) -> Option<usize> {
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.capacity.is_some())
        .min_by(|(i, a), (j, b)| {
            b.tok_s_per_gpu
                .total_cmp(&a.tok_s_per_gpu)
                .then(a.layout.gpus.cmp(&b.layout.gpus))
                .then(a.layout.encoders.cmp(&b.layout.encoders))
                .then(i.cmp(j))
        })
        .map(|(i, _)| i)
}

/// A candidate with a capacity is on the frontier when no other is at least
/// as good on both axes and better on one.
fn mark_frontier(candidates: &mut [Candidate]) {
    let points: Vec<Option<(f64, f64)>> =
        candidates.iter().map(|c| c.capacity.as_ref().map(|_| (c.tok_s_per_user, c.tok_s_per_gpu))).collect();
    for (i, c) in candidates.iter_mut().enumerate() {
        let Some((u, g)) = points[i] else { continue };
        c.on_frontier = !points
            .iter()
            .enumerate()
            .any(|(j, q)| q.is_some_and(|(u2, g2)| j != i && u2 >= u && g2 >= g && (u2 > u || g2 > g)));
    }
}

impl Plan {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan serialises") + "\n"
    }

    pub fn to_markdown(&self) -> String {
        let money = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.3}"));
        let mut md = format!(
            "# Plan: {} on {} {} GPUs\n\n{} layouts, each searched for the highest load that holds with at least \
             {:.0}% of requests within the scenario's TTFT and TPOT SLOs. Costs at ${:.2} per GPU-hour; input is \
             charged to the prefill (and image-encoder) GPUs, output to the decode GPUs. ★: on the frontier (no layout has both more \
             tokens/s per GPU and more tokens/s per user).\n\n\
             | layout | tok/s per GPU | tok/s per user | $/M input | $/M output | $/M tokens | limit above capacity |\n\
             |---|---|---|---|---|---|---|\n",
            self.model,
            self.space.gpus,
            self.hardware,
            self.candidates.len(),
            self.criteria.slo_attainment_min * 100.0,
            self.gpu_hour_usd
        );
        if let Some(i) = self.chosen {
            let c = &self.candidates[i];
            md = md.replacen(
                "| layout |",
                &format!(
                    "Chosen: **{}** ({:.0} tok/s per GPU{}).\n\n| layout |",
                    c.layout.label,
                    c.tok_s_per_gpu,
                    match (c.layout.images, c.layout.encoders) {
                        (false, _) => String::new(),
                        (true, 0) => ", images encoded on the prefill instances".to_string(),
                        (true, n) => format!(", {n} encoder instances on {} GPUs", c.layout.encoder_gpus),
                    }
                ),
                1,
            );
        }
        let mut order: Vec<&Candidate> = self.candidates.iter().collect();
        order.sort_by(|a, b| b.tok_s_per_gpu.total_cmp(&a.tok_s_per_gpu));
        for c in order {
            md += &format!(
                "| {}{} | {:.0} | {:.1} | {} | {} | {} | {} |\n",
                if c.on_frontier { "★ " } else { "" },
                c.layout.label,
                c.tok_s_per_gpu,
                c.tok_s_per_user,
                money(c.usd_per_million_input),
                money(c.usd_per_million_output),
                money(c.usd_per_million_tokens),
                c.limit.as_deref().unwrap_or("nothing broke up to 64×")
            );
        }
        md
    }

    /// Throughput per GPU against tokens/s per user, every layout a point, the frontier a line.
    pub fn plot(&self) -> String {
        let points: Vec<(f64, f64, String)> = self
            .candidates
            .iter()
            .filter(|c| c.capacity.is_some())
            .map(|c| (c.tok_s_per_user, c.tok_s_per_gpu, c.layout.label.clone()))
            .collect();
        let mut frontier: Vec<(f64, f64)> =
            self.candidates.iter().filter(|c| c.on_frontier).map(|c| (c.tok_s_per_user, c.tok_s_per_gpu)).collect();
        frontier.sort_by(|a, b| a.0.total_cmp(&b.0));
        let title = format!("Plan: {} on {} {}", self.model, self.space.gpus, self.hardware);
        scatter_chart(&title, "output tok/s per user", "tok/s per GPU", &points, &frontier)
    }
}
