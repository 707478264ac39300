// tidy: long file: the scenario schema: one type per TOML table, each beside the checks that give its errors a file, line and key.
//! Simulation scenarios (`simulations/*.toml`): the deployment (hardware,
//! model, instances), the engine's limits, expert popularity, traffic
//! (synthetic, multi-turn sessions or a Mooncake trace), faults at given
//! times, SLOs, seed and duration, speculative decoding, the prompt cache's
//! tiers, image traffic and image-encoder instances. Errors name the file,
//! line and key.

mod cache;
mod deployment;
mod images;
mod speculative;

use std::path::{Path, PathBuf};

use deepinfer_actors::cluster::disagg::PrefillRouting;
use deepinfer_actors::modelled::deployment::InstanceLimits;
use deepinfer_actors::modelled::drafting::Drafting;
use deepinfer_actors::modelled::encoder::EncoderSpec;
use deepinfer_engine::cost::experts::Popularity;
use deepinfer_engine::cost::{HardwareKind, ModelKind, Precision};
use deepinfer_engine::traffic::{Lengths, Pattern};
use serde::Deserialize;
use toml::Spanned;

use crate::config_file::{parse_toml, read_text, value_error, FileError};
pub use cache::{CacheConfig, CacheSpec};
pub use images::{ImageSize, ImageTraffic, ImagesSpec, DEFAULT_ENCODER_CACHE_GIB};
pub use speculative::{default_drafting, SpeculativeSpec, DSPARK_ACCEPTANCE, MTP_ACCEPTANCE};

/// Most devices one scenario may simulate.
pub const MAX_DEVICES: u32 = 4096;
/// Longest simulated time, seconds.
pub const MAX_DURATION_S: f64 = 86_400.0;

pub use deepinfer_actors::cluster::disagg::InstanceKind;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Header {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub seed: u64,
    /// Arrivals stop after this many simulated seconds.
    pub duration_s: Spanned<f64>,
    /// After the last arrival, requests still running get this long to finish.
    #[serde(default = "default_drain_s")]
    pub drain_s: Spanned<f64>,
    /// Throughput is measured from this time to `duration_s` (the cluster fills up before).
    #[serde(default)]
    pub warmup_s: Option<Spanned<f64>>,
    /// `H800`, `H100`, `H200`, `B200`, `GB200`, `Ascend950`.
    pub hardware: Spanned<String>,
    /// `DeepSeek-V3` (also R1), `V4-Flash`, `V4.1-Flash`.
    pub model: Spanned<String>,
    #[serde(default = "default_devices_per_node")]
    pub devices_per_node: Spanned<u32>,
    /// Devices in one scale-up domain (NVLink / HCCS), a multiple of
    /// `devices_per_node` (default: the hardware's, e.g. 72 for GB200).
    #[serde(default)]
    pub scale_up_domain: Option<Spanned<u32>>,
    /// Width of the time series' buckets (default: duration / 120).
    #[serde(default)]
    pub sample_s: Option<Spanned<f64>>,
}

fn default_drain_s() -> Spanned<f64> {
    Spanned::new(0..0, 300.0)
}

fn default_devices_per_node() -> Spanned<u32> {
    Spanned::new(0..0, 8)
}

/// What an `[[instance]]` of a scenario is: a serving instance of the
/// cluster, or an image encoder in front of it.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Both,
    Prefill,
    Decode,
    /// Encodes images (V4.1's vision tower) for the prefill instances.
    Encoder,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct InstanceSpec {
    pub role: Spanned<Role>,
    /// Devices of each instance (its expert-parallel degree); a multiple of `devices_per_node`.
    pub devices: Spanned<u32>,
    #[serde(default = "one")]
    pub count: Spanned<u32>,
    /// Redundant expert slots of this instance, instead of `experts.redundant`.
    #[serde(default)]
    pub redundant: Option<usize>,
    /// Sequences and tokens per device in one step, instead of `[engine]`'s.
    #[serde(default)]
    pub batch_per_device: Option<Spanned<usize>>,
    #[serde(default)]
    pub batch_tokens_per_device: Option<Spanned<usize>>,
    /// GiB of each device's routed-expert weights kept in host memory (0: none).
    #[serde(default)]
    pub offload_gib: Option<Spanned<f64>>,
    /// Encoders: GiB of encoded images the instance's cache keeps.
    #[serde(default)]
    pub cache_gib: Option<Spanned<f64>>,
}

fn one() -> Spanned<u32> {
    Spanned::new(0..0, 1)
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    /// Sequences per device in one step.
    #[serde(default = "default_batch")]
    pub batch_per_device: Spanned<usize>,
    /// Tokens (prompt chunks and decodes) per device in one step.
    #[serde(default = "default_batch_tokens")]
    pub batch_tokens_per_device: Spanned<usize>,
    /// `exact` or `off`.
    #[serde(default = "default_prefix")]
    pub prefix_cache: Spanned<String>,
    /// Positions per KV block and prefix-cache block (Mooncake's hash blocks are 512).
    #[serde(default = "default_block")]
    pub block_tokens: Spanned<usize>,
    /// Decode-only steps simulated as one event (1: exact; more: faster, with
    /// admissions waiting for the event and tokens arriving in bursts).
    #[serde(default = "default_steps_per_event")]
    pub decode_steps_per_event: Spanned<u32>,
    /// KV cache format: `bf16`, `fp8`, or `fp4` (V4.1's own layout); default the model's.
    #[serde(default)]
    pub kv_dtype: Option<Spanned<String>>,
    /// Format of every weight but the routed experts: `bf16`, `fp8`, `mxfp4`, `nvfp4`; default the checkpoint's.
    #[serde(default)]
    pub attention_precision: Option<Spanned<String>>,
}

impl Default for EngineSpec {
    fn default() -> Self {
        Self {
            batch_per_device: default_batch(),
            batch_tokens_per_device: default_batch_tokens(),
            prefix_cache: default_prefix(),
            block_tokens: default_block(),
            decode_steps_per_event: default_steps_per_event(),
            kv_dtype: None,
            attention_precision: None,
        }
    }
}

fn default_batch() -> Spanned<usize> {
    Spanned::new(0..0, 128)
}
fn default_batch_tokens() -> Spanned<usize> {
    Spanned::new(0..0, 8192)
}
fn default_prefix() -> Spanned<String> {
    Spanned::new(0..0, "exact".into())
}
fn default_block() -> Spanned<usize> {
    Spanned::new(0..0, 512)
}
fn default_steps_per_event() -> Spanned<u32> {
    Spanned::new(0..0, 1)
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ExpertsSpec {
    /// `uniform` or `zipf`.
    #[serde(default = "default_popularity")]
    pub popularity: Spanned<String>,
    #[serde(default = "default_zipf")]
    pub zipf_s: Spanned<f64>,
    /// Redundant expert slots per instance, placed by EPLB (0: contiguous experts, no EPLB).
    #[serde(default)]
    pub redundant: usize,
    /// Format of the routed experts: `bf16`, `fp8`, `mxfp4`, `nvfp4`; default the checkpoint's.
    #[serde(default)]
    pub precision: Option<Spanned<String>>,
    /// Seconds over which the hot experts change (Zipf only; 0: never).
    #[serde(default = "default_drift")]
    pub drift_s: Spanned<f64>,
    /// Share of the popularity score that moves with the traffic (0 to 1);
    /// the rest is a lasting property of each expert.
    #[serde(default = "default_drift_share")]
    pub drift_share: Spanned<f64>,
    /// Seconds between EPLB placements from the previous period's mean loads
    /// (0: placed once, from the loads at the start).
    #[serde(default = "default_rebalance")]
    pub rebalance_s: Spanned<f64>,
}

impl Default for ExpertsSpec {
    fn default() -> Self {
        Self {
            popularity: default_popularity(),
            zipf_s: default_zipf(),
            redundant: 0,
            precision: None,
            drift_s: default_drift(),
            drift_share: default_drift_share(),
            rebalance_s: default_rebalance(),
        }
    }
}

/// Shortest drift and rebalancing period besides 0 (the loads are sampled
/// 64 times per drift), and the longest.
const MIN_DRIFT_S: f64 = 10.0;
const MIN_REBALANCE_S: f64 = 1.0;
const MAX_EXPERT_PERIOD_S: f64 = 86_400.0;

fn default_drift() -> Spanned<f64> {
    Spanned::new(0..0, 0.0)
}
/// An assumption (simulations/README.md, "Expert balance over time").
fn default_drift_share() -> Spanned<f64> {
    Spanned::new(0..0, 0.1)
}
/// DeepSeek-V3's report: the redundant experts are "adjusted periodically (e.g., every 10 minutes)".
fn default_rebalance() -> Spanned<f64> {
    Spanned::new(0..0, 600.0)
}

fn default_popularity() -> Spanned<String> {
    Spanned::new(0..0, "uniform".into())
}
fn default_zipf() -> Spanned<f64> {
    Spanned::new(0..0, 1.2)
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, tag = "dist", rename_all = "lowercase")]
pub enum LengthSpec {
    Fixed { value: usize },
    Uniform { min: usize, max: usize },
    LogNormal { median: f64, sigma: f64, min: usize, max: usize },
}

impl LengthSpec {
    fn lengths(&self) -> Lengths {
        match *self {
            LengthSpec::Fixed { value } => Lengths::Fixed(value),
            LengthSpec::Uniform { min, max } => Lengths::Uniform { min, max },
            LengthSpec::LogNormal { median, sigma, min, max } => Lengths::LogNormal { median, sigma, min, max },
        }
    }

    fn check(&self) -> Result<(), String> {
        let ok = match *self {
            LengthSpec::Fixed { value } => value >= 1,
            LengthSpec::Uniform { min, max } => min >= 1 && min <= max,
            LengthSpec::LogNormal { median, sigma, min, max } => {
                median.is_finite() && median >= 1.0 && sigma.is_finite() && sigma >= 0.0 && min >= 1 && min <= max
            }
        };
        if ok {
            Ok(())
        } else {
            Err("lengths must be at least 1 with min ≤ max (and a finite median and sigma)".into())
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum TrafficKind {
    Poisson,
    Bursty,
    Mooncake,
    /// Multi-turn conversations: `rate_per_s` new sessions per second.
    Sessions,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrafficSpec {
    pub kind: TrafficKind,
    #[serde(default)]
    pub rate_per_s: Option<Spanned<f64>>,
    #[serde(default = "default_burst")]
    pub burst_factor: f64,
    #[serde(default = "default_on_off")]
    pub on_s: f64,
    #[serde(default = "default_on_off")]
    pub off_s: f64,
    #[serde(default)]
    pub input: Option<Spanned<LengthSpec>>,
    #[serde(default)]
    pub output: Option<Spanned<LengthSpec>>,
    #[serde(default)]
    pub shared_prefix_tokens: usize,
    #[serde(default)]
    pub shared_fraction: f64,
    /// Mooncake trace (JSON Lines), relative to the scenario file.
    #[serde(default)]
    pub trace: Option<Spanned<String>>,
    /// Stretch the trace's time (2.0 = half the rate).
    #[serde(default = "default_scale")]
    pub time_scale: Spanned<f64>,
    /// Replay the trace this many times back to back (its ids stay shared: later rounds hit the cache).
    #[serde(default = "one")]
    pub repeat: Spanned<u32>,
    /// Sessions: turns per conversation.
    #[serde(default)]
    pub turns: Option<Spanned<LengthSpec>>,
    /// Sessions: seconds between a turn's arrival and the next one's.
    #[serde(default)]
    pub think_s: Option<Spanned<LengthSpec>>,
    /// Sessions: how many different system prompts the shared ones are.
    #[serde(default = "one")]
    pub system_prompts: Spanned<u32>,
    /// Sessions: the share of conversations already under way when the run
    /// starts (their earlier turns are in the shared store, not in HBM)…
    #[serde(default)]
    pub resumed_fraction: Option<Spanned<f64>>,
    /// …and the tokens of their history.
    #[serde(default)]
    pub history: Option<Spanned<LengthSpec>>,
}

fn default_burst() -> f64 {
    4.0
}
fn default_on_off() -> f64 {
    10.0
}
fn default_scale() -> Spanned<f64> {
    Spanned::new(0..0, 1.0)
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// Crash a node (`node`) or one device (`device`) at `at_s`; a node stays unreachable until `until_s`.
    Crash,
    /// Nodes `nodes` cannot reach the others during `[at_s, until_s)`.
    Partition,
    /// Links between nodes `nodes` and the others get `latency_us` and `gb_per_s` (for the whole run).
    SlowLink,
    /// Device `device` is `slowdown` times slower (for the whole run).
    Straggler,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    #[serde(default)]
    pub at_s: Option<Spanned<f64>>,
    #[serde(default)]
    pub until_s: Option<Spanned<f64>>,
    #[serde(default)]
    pub node: Option<Spanned<u32>>,
    #[serde(default)]
    pub device: Option<Spanned<u32>>,
    #[serde(default)]
    pub nodes: Vec<u32>,
    #[serde(default)]
    pub latency_us: Option<f64>,
    #[serde(default)]
    pub gb_per_s: Option<f64>,
    #[serde(default)]
    pub slowdown: Option<Spanned<f64>>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SloSpec {
    #[serde(default = "default_ttft")]
    pub ttft_ms: f64,
    #[serde(default = "default_tpot")]
    pub tpot_ms: f64,
}

impl Default for SloSpec {
    fn default() -> Self {
        Self { ttft_ms: default_ttft(), tpot_ms: default_tpot() }
    }
}

fn default_ttft() -> f64 {
    2000.0
}
fn default_tpot() -> f64 {
    100.0
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RoutingSpec {
    /// How new requests pick their (prefill) instance: `cache_affinity` or `round_robin`.
    #[serde(default)]
    pub prefill: Option<Spanned<String>>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    scenario: Header,
    #[serde(rename = "instance")]
    instances: Vec<InstanceSpec>,
    #[serde(default)]
    engine: EngineSpec,
    #[serde(default)]
    experts: ExpertsSpec,
    traffic: TrafficSpec,
    #[serde(default, rename = "fault")]
    faults: Vec<FaultSpec>,
    #[serde(default)]
    slo: SloSpec,
    #[serde(default)]
    routing: RoutingSpec,
    #[serde(default)]
    speculative: Option<SpeculativeSpec>,
    #[serde(default)]
    cache: Option<CacheSpec>,
    #[serde(default)]
    images: Option<ImagesSpec>,
}

/// Where requests come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Traffic {
    Synthetic { pattern: Pattern, input: Lengths, output: Lengths, shared_prefix_tokens: usize, shared_fraction: f64 },
    Mooncake { path: PathBuf, time_scale: f64, repeat: u32 },
    Sessions(Sessions),
}

/// Multi-turn conversations (see [`crate::simulate::sessions`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Sessions {
    pub rate_per_s: f64,
    /// Each turn's new user message.
    pub input: Lengths,
    pub output: Lengths,
    pub turns: Lengths,
    pub think_s: Lengths,
    /// A system prompt of this many tokens (whole blocks) opens `shared_fraction` of the sessions…
    pub system_prompt_tokens: usize,
    pub shared_fraction: f64,
    /// …one of this many.
    pub system_prompts: u32,
    /// Conversations under way before the run: this share of sessions
    /// brings a history of `history` tokens, written to the shared store
    /// earlier (see [`crate::simulate::sessions`]).
    pub resumed_fraction: f64,
    pub history: Lengths,
}

/// A fault at a simulated time.
#[derive(Clone, Debug, PartialEq)]
pub enum Fault {
    CrashNode { node: u32, at_s: f64, until_s: Option<f64> },
    CrashDevice { device: u32, at_s: f64 },
    Partition { nodes: Vec<u32>, at_s: f64, until_s: f64 },
    SlowLink { nodes: Vec<u32>, latency_us: f64, gb_per_s: f64 },
    Straggler { device: u32, slowdown: f64 },
}

/// A checked scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct Scenario {
    pub file: String,
    pub name: String,
    pub description: String,
    pub seed: u64,
    pub duration_s: f64,
    pub drain_s: f64,
    pub warmup_s: f64,
    pub sample_s: f64,
    pub hardware: HardwareKind,
    pub model: ModelKind,
    pub devices_per_node: u32,
    /// Devices in one scale-up domain (a multiple of `devices_per_node`).
    pub scale_up_domain: u32,
    /// The formats weights and KV are served in, where not the checkpoint's.
    pub precision: Precision,
    /// One entry per instance, in order.
    pub instances: Vec<(InstanceKind, u32)>,
    /// Redundant expert slots per instance where it differs from `redundant_experts`.
    pub redundant_per_instance: Vec<Option<usize>>,
    /// Per instance: its own batch limits and weight offload.
    pub instance_limits: Vec<InstanceLimits>,
    pub batch_per_device: usize,
    pub batch_tokens_per_device: usize,
    pub prefix_cache: bool,
    pub block_tokens: usize,
    pub decode_steps_per_event: u32,
    pub popularity: Popularity,
    pub redundant_experts: usize,
    /// Seconds over which the hot experts change (0: static loads), and the share of popularity that moves.
    pub expert_drift_s: f64,
    pub expert_drift_share: f64,
    /// Seconds between EPLB placements (0: placed once).
    pub rebalance_s: f64,
    pub traffic: Traffic,
    pub faults: Vec<Fault>,
    pub ttft_slo_ms: f64,
    pub tpot_slo_ms: f64,
    pub prefill_routing: PrefillRouting,
    /// Speculative decoding and its acceptance model; `None`: off.
    pub speculative: Option<Drafting>,
    /// Cache tiers below the device and the blocks' TTL; `None`: the device's prefix cache only.
    pub cache: Option<CacheConfig>,
    /// Requests' images; `None`: text only.
    pub images: Option<ImageTraffic>,
    /// Image-encoder instances, in order (none: images are encoded on the prefill instances).
    pub encoders: Vec<EncoderSpec>,
}

impl Scenario {
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        let (file, text) = read_text(path)?;
        Self::parse(&file, &text, path.parent().unwrap_or(Path::new(".")))
    }

    /// Parse and check a scenario; `file` names it in errors, `dir` resolves its trace path.
    pub fn parse(file: &str, text: &str, dir: &Path) -> Result<Self, FileError> {
        let f: ScenarioFile = parse_toml(file, text)?;
        let err = |span: std::ops::Range<usize>, message: String| value_error(file, text, span, message);
        let h = &f.scenario;
        let duration_s = *h.duration_s.get_ref();
        if duration_s.is_nan() || duration_s <= 0.0 || duration_s > MAX_DURATION_S {
            return Err(err(h.duration_s.span(), format!("must be in (0, {MAX_DURATION_S}] seconds")));
        }
        let drain_s = *h.drain_s.get_ref();
        if !(0.0..=MAX_DURATION_S).contains(&drain_s) {
            return Err(err(h.drain_s.span(), format!("must be in [0, {MAX_DURATION_S}] seconds")));
        }
        let warmup_s = match &h.warmup_s {
            None => 0.0,
            Some(w) if (0.0..duration_s).contains(w.get_ref()) => *w.get_ref(),
            Some(w) => return Err(err(w.span(), format!("must be in [0, duration_s = {duration_s})"))),
        };
        let hardware = HardwareKind::from_name(h.hardware.get_ref()).ok_or_else(|| {
            err(
                h.hardware.span(),
                format!("unknown hardware `{}` (H800, H100, H200, B200, GB200, Ascend950)", h.hardware.get_ref()),
            )
        })?;
        let model = ModelKind::from_name(h.model.get_ref()).ok_or_else(|| {
            err(
                h.model.span(),
                format!("unknown model `{}` (DeepSeek-V3, DeepSeek-R1, V4-Flash, V4.1-Flash)", h.model.get_ref()),
            )
        })?;
        let per_node = *h.devices_per_node.get_ref();
        if !(1..=72).contains(&per_node) {
            return Err(err(h.devices_per_node.span(), "must be 1 to 72".into()));
        }
        let sample_s = match &h.sample_s {
            Some(s) if s.get_ref().is_nan() || *s.get_ref() <= 0.0 => {
                return Err(err(s.span(), "must be positive".into()))
            }
            Some(s) => *s.get_ref(),
            None => duration_s / 120.0,
        };
        if f.instances.iter().all(|i| *i.role.get_ref() == Role::Encoder) {
            return Err(err(0..0, "a scenario needs at least one [[instance]] table that serves text".into()));
        }
        let mut instances = Vec::new();
        let mut redundant_per_instance = Vec::new();
        let mut instance_limits = Vec::new();
        let mut encoders = Vec::new();
        for inst in &f.instances {
            let kind = match *inst.role.get_ref() {
                Role::Both => InstanceKind::Both,
                Role::Prefill => InstanceKind::Prefill,
                Role::Decode => InstanceKind::Decode,
                Role::Encoder => {
                    let misplaced = [
                        ("redundant", inst.redundant.is_some()),
                        ("batch_per_device", inst.batch_per_device.is_some()),
                        ("batch_tokens_per_device", inst.batch_tokens_per_device.is_some()),
                        ("offload_gib", inst.offload_gib.is_some()),
                    ];
                    if let Some((key, _)) = misplaced.iter().find(|(_, set)| *set) {
                        return Err(err(inst.role.span(), format!("an encoder instance takes no `{key}`")));
                    }
                    let spec = images::encoder_spec(
                        model,
                        hardware,
                        &inst.devices,
                        inst.cache_gib.as_ref(),
                        inst.role.span(),
                        &err,
                    )?;
                    let count = *inst.count.get_ref();
                    if count == 0 {
                        return Err(err(inst.count.span(), "must be at least 1".into()));
                    }
                    encoders.extend(std::iter::repeat_n(spec, count as usize));
                    continue;
                }
            };
            if let Some(c) = &inst.cache_gib {
                return Err(err(c.span(), "only an encoder instance has an image cache".into()));
            }
            let devices = *inst.devices.get_ref();
            if devices == 0 || !devices.is_multiple_of(per_node) {
                return Err(err(
                    inst.devices.span(),
                    format!("must be a positive multiple of devices_per_node ({per_node})"),
                ));
            }
            let count = *inst.count.get_ref();
            if count == 0 {
                return Err(err(inst.count.span(), "must be at least 1".into()));
            }
            instances.extend(std::iter::repeat_n((kind, devices), count as usize));
            redundant_per_instance.extend(std::iter::repeat_n(inst.redundant, count as usize));
            let limits = deployment::instance_limits(
                inst.batch_per_device.as_ref(),
                inst.batch_tokens_per_device.as_ref(),
                inst.offload_gib.as_ref(),
                &err,
            )?;
            instance_limits.extend(std::iter::repeat_n(limits, count as usize));
        }
        let total: u64 = instances.iter().map(|&(_, d)| d as u64).sum();
        if total > MAX_DEVICES as u64 {
            return Err(err(0..0, format!("{total} devices; a scenario simulates at most {MAX_DEVICES}")));
        }
        if instances.iter().all(|&(r, _)| r == InstanceKind::Prefill)
            || instances.iter().all(|&(r, _)| r == InstanceKind::Decode)
        {
            let first = f.instances.iter().find(|i| *i.role.get_ref() != Role::Encoder).expect("checked above");
            return Err(err(first.devices.span(), "instances must be able to prefill and to decode".into()));
        }
        let e = &f.engine;
        let batch = *e.batch_per_device.get_ref();
        if !(1..=4096).contains(&batch) {
            return Err(err(e.batch_per_device.span(), "must be 1 to 4096".into()));
        }
        let batch_tokens = *e.batch_tokens_per_device.get_ref();
        if !(1..=65536).contains(&batch_tokens) {
            return Err(err(e.batch_tokens_per_device.span(), "must be 1 to 65536".into()));
        }
        let prefix_cache = match e.prefix_cache.get_ref().as_str() {
            "exact" => true,
            "off" => false,
            other => return Err(err(e.prefix_cache.span(), format!("unknown `{other}` (exact, off)"))),
        };
        let block_tokens = *e.block_tokens.get_ref();
        if !(64..=4096).contains(&block_tokens) || !block_tokens.is_multiple_of(64) {
            return Err(err(e.block_tokens.span(), "must be a multiple of 64 from 64 to 4096".into()));
        }
        let steps_per_event = *e.decode_steps_per_event.get_ref();
        if !(1..=256).contains(&steps_per_event) {
            return Err(err(e.decode_steps_per_event.span(), "must be 1 to 256".into()));
        }
        let x = &f.experts;
        let precision = deployment::precision(
            model,
            x.precision.as_ref(),
            e.attention_precision.as_ref(),
            e.kv_dtype.as_ref(),
            &err,
        )?;
        let scale_up_domain = deployment::scale_up_domain(h.scale_up_domain.as_ref(), hardware, per_node, &err)?;
        let popularity = match x.popularity.get_ref().as_str() {
            "uniform" => Popularity::Uniform,
            "zipf" => {
                let s = *x.zipf_s.get_ref();
                if !(s.is_finite() && (0.0..=4.0).contains(&s)) {
                    return Err(err(x.zipf_s.span(), "must be in [0, 4]".into()));
                }
                Popularity::Zipf { s }
            }
            other => return Err(err(x.popularity.span(), format!("unknown `{other}` (uniform, zipf)"))),
        };
        let period = |v: &Spanned<f64>, least: f64| {
            let p = *v.get_ref();
            if p == 0.0 || (least..=MAX_EXPERT_PERIOD_S).contains(&p) {
                Ok(p)
            } else {
                Err(err(v.span(), format!("must be 0 or {least} to {MAX_EXPERT_PERIOD_S} seconds")))
            }
        };
        let expert_drift_s = period(&x.drift_s, MIN_DRIFT_S)?;
        let expert_drift_share = *x.drift_share.get_ref();
        if !(0.0..=1.0).contains(&expert_drift_share) {
            return Err(err(x.drift_share.span(), "must be in [0, 1]".into()));
        }
        let rebalance_s = period(&x.rebalance_s, MIN_REBALANCE_S)?;
        let prefill_routing = match &f.routing.prefill {
            None => PrefillRouting::CacheAffinity,
            Some(p) => match p.get_ref().as_str() {
                "cache_affinity" => PrefillRouting::CacheAffinity,
                "round_robin" => PrefillRouting::RoundRobin,
                other => {
                    return Err(err(p.span(), format!("unknown `{other}` (cache_affinity, round_robin)")));
                }
            },
        };
        let traffic = Self::traffic(&f.traffic, dir, &err)?;
        let speculative = match &f.speculative {
            Some(spec) => spec.drafting(model, &err)?,
            None => None,
        };
        let cache = match &f.cache {
            Some(c) => Some(c.config(block_tokens, &err)?),
            None => None,
        };
        let images = match &f.images {
            Some(i) => Some(i.traffic(model, &err)?),
            None => None,
        };
        let devices_total = total as u32;
        let nodes_total = devices_total.div_ceil(per_node);
        let mut faults = Vec::new();
        for fs in &f.faults {
            faults.push(Self::fault(fs, devices_total, nodes_total, duration_s + drain_s, &err)?);
        }
        Ok(Self {
            file: file.to_string(),
            name: h.name.clone(),
            description: h.description.clone(),
            seed: h.seed,
            duration_s,
            drain_s,
            warmup_s,
            sample_s,
            hardware,
            model,
            devices_per_node: per_node,
            scale_up_domain,
            precision,
            instances,
            redundant_per_instance,
            instance_limits,
            batch_per_device: batch,
            batch_tokens_per_device: batch_tokens,
            prefix_cache,
            block_tokens,
            decode_steps_per_event: steps_per_event,
            popularity,
            redundant_experts: x.redundant,
            expert_drift_s,
            expert_drift_share,
            rebalance_s,
            traffic,
            faults,
            ttft_slo_ms: f.slo.ttft_ms,
            tpot_slo_ms: f.slo.tpot_ms,
            prefill_routing,
            speculative,
            cache,
            images,
            encoders,
        })
    }

    fn traffic(
        t: &TrafficSpec,
        dir: &Path,
        err: &dyn Fn(std::ops::Range<usize>, String) -> FileError,
    ) -> Result<Traffic, FileError> {
        if t.kind == TrafficKind::Mooncake {
            let Some(trace) = &t.trace else {
                return Err(err(0..0, "key `traffic.trace`: a mooncake replay needs a trace file".into()));
            };
            let scale = *t.time_scale.get_ref();
            if !(scale.is_finite() && scale > 0.0) {
                return Err(err(t.time_scale.span(), "must be positive".into()));
            }
            let repeat = *t.repeat.get_ref();
            if !(1..=1000).contains(&repeat) {
                return Err(err(t.repeat.span(), "must be 1 to 1000".into()));
            }
            return Ok(Traffic::Mooncake { path: dir.join(trace.get_ref()), time_scale: scale, repeat });
        }
        let Some(rate) = &t.rate_per_s else {
            return Err(err(0..0, "key `traffic.rate_per_s`: synthetic traffic needs a rate".into()));
        };
        if !(rate.get_ref().is_finite() && *rate.get_ref() > 0.0) {
            return Err(err(rate.span(), "must be positive".into()));
        }
        let lengths = |l: &Option<Spanned<LengthSpec>>, what: &str| -> Result<Lengths, FileError> {
            let Some(l) = l else {
                return Err(err(0..0, format!("key `traffic.{what}`: synthetic traffic needs {what} lengths")));
            };
            l.get_ref().check().map_err(|m| err(l.span(), m))?;
            Ok(l.get_ref().lengths())
        };
        if !(0.0..=1.0).contains(&t.shared_fraction) {
            return Err(err(0..0, "key `traffic.shared_fraction`: must be in [0, 1]".into()));
        }
        if t.kind == TrafficKind::Sessions {
            let resumed_fraction = match &t.resumed_fraction {
                None => 0.0,
                Some(f) if (0.0..=1.0).contains(f.get_ref()) => *f.get_ref(),
                Some(f) => return Err(err(f.span(), "must be in [0, 1]".into())),
            };
            if resumed_fraction > 0.0 && t.history.is_none() {
                return Err(err(0..0, "key `traffic.history`: resumed sessions need history lengths".into()));
            }
            let system_prompts = *t.system_prompts.get_ref();
            if !(1..=1_000_000).contains(&system_prompts) {
                return Err(err(t.system_prompts.span(), "must be 1 to 1000000".into()));
            }
            return Ok(Traffic::Sessions(Sessions {
                rate_per_s: *rate.get_ref(),
                input: lengths(&t.input, "input")?,
                output: lengths(&t.output, "output")?,
                turns: lengths(&t.turns, "turns")?,
                think_s: lengths(&t.think_s, "think_s")?,
                system_prompt_tokens: t.shared_prefix_tokens,
                shared_fraction: t.shared_fraction,
                system_prompts,
                resumed_fraction,
                history: match &t.history {
                    Some(_) => lengths(&t.history, "history")?,
                    None => Lengths::Fixed(1),
                },
            }));
        }
        let pattern = match t.kind {
            TrafficKind::Poisson => Pattern::Poisson { rate_per_s: *rate.get_ref() },
            _ => Pattern::Bursty {
                rate_per_s: *rate.get_ref(),
                burst_factor: t.burst_factor.max(1.0),
                on_s: t.on_s.max(0.001),
                off_s: t.off_s.max(0.0),
            },
        };
        Ok(Traffic::Synthetic {
            pattern,
            input: lengths(&t.input, "input")?,
            output: lengths(&t.output, "output")?,
            shared_prefix_tokens: t.shared_prefix_tokens,
            shared_fraction: t.shared_fraction,
        })
    }

    fn fault(
        f: &FaultSpec,
        devices: u32,
        nodes: u32,
        end_s: f64,
        err: &dyn Fn(std::ops::Range<usize>, String) -> FileError,
    ) -> Result<Fault, FileError> {
        let time = |v: &Option<Spanned<f64>>, what: &str| -> Result<Option<f64>, FileError> {
            match v {
                None => Ok(None),
                Some(t) if t.get_ref().is_finite() && (0.0..=end_s).contains(t.get_ref()) => Ok(Some(*t.get_ref())),
                Some(t) => Err(err(t.span(), format!("{what} must be within the run (0 to {end_s} s)"))),
            }
        };
        let at = time(&f.at_s, "at_s")?;
        let until = time(&f.until_s, "until_s")?;
        let need_at = || at.ok_or_else(|| err(0..0, format!("key `fault.at_s`: a {:?} fault needs a time", f.kind)));
        if let (Some(a), Some(u), Some(s)) = (at, until, &f.until_s) {
            if u <= a {
                return Err(err(s.span(), "must be after at_s".into()));
            }
        }
        let check_nodes = |list: &[u32]| -> Result<Vec<u32>, FileError> {
            if list.is_empty() || list.iter().any(|&n| n >= nodes) {
                return Err(err(0..0, format!("key `fault.nodes`: name 1 or more of the {nodes} nodes (0-based)")));
            }
            Ok(list.to_vec())
        };
        Ok(match f.kind {
            FaultKind::Crash => match (&f.node, &f.device) {
                (Some(n), None) if *n.get_ref() < nodes => {
                    Fault::CrashNode { node: *n.get_ref(), at_s: need_at()?, until_s: until }
                }
                (Some(n), None) => return Err(err(n.span(), format!("the scenario has {nodes} nodes (0-based)"))),
                (None, Some(d)) if *d.get_ref() < devices => {
                    Fault::CrashDevice { device: *d.get_ref(), at_s: need_at()? }
                }
                (None, Some(d)) => return Err(err(d.span(), format!("the scenario has {devices} devices (0-based)"))),
                _ => return Err(err(0..0, "key `fault`: a crash names either `node` or `device`".into())),
            },
            FaultKind::Partition => {
                let (Some(a), Some(u)) = (at, until) else {
                    return Err(err(0..0, "key `fault`: a partition needs at_s and until_s".into()));
                };
                Fault::Partition { nodes: check_nodes(&f.nodes)?, at_s: a, until_s: u }
            }
            FaultKind::SlowLink => Fault::SlowLink {
                nodes: check_nodes(&f.nodes)?,
                latency_us: f.latency_us.unwrap_or(10.0).max(0.0),
                gb_per_s: f.gb_per_s.unwrap_or(25.0).max(0.001),
            },
            FaultKind::Straggler => {
                let Some(d) = &f.device else {
                    return Err(err(0..0, "key `fault.device`: a straggler names its device".into()));
                };
                if *d.get_ref() >= devices {
                    return Err(err(d.span(), format!("the scenario has {devices} devices (0-based)")));
                }
                let slowdown = f.slowdown.as_ref().map_or(2.0, |s| *s.get_ref());
                if !(slowdown.is_finite() && slowdown >= 1.0) {
                    let span = f.slowdown.as_ref().map_or(0..0, |s| s.span());
                    return Err(err(span, "must be at least 1".into()));
                }
                Fault::Straggler { device: *d.get_ref(), slowdown }
            }
        })
    }

    pub fn devices(&self) -> u32 {
        self.instances.iter().map(|&(_, d)| d).sum()
    }

    pub fn nodes(&self) -> u32 {
        self.devices().div_ceil(self.devices_per_node)
    }
}
