//! Modelled devices: how the cluster simulates full-size models on one CPU.
//! Router, schedulers (with the engine's batching policy, KV block pool and
//! prefix cache), cache managers, workers and shards run as always; a
//! worker's step computes no maths: it answers after the time the engine's
//! cost model gives for its sequences and the instance's expert all-to-all,
//! with placeholder tokens. The model it runs is only a shape (experts,
//! vocabulary, context); KV accounting uses the engine's block layout with a
//! budget scaled so that a token costs the modelled model's KV bytes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deepinfer_engine::config::ModelConfig;
use deepinfer_engine::cost::draft::DraftHead;
use deepinfer_engine::cost::experts::{DeviceShares, ExpertLoads, Popularity};
use deepinfer_engine::cost::{
    step_cost, DeviceStep, Efficiency, Hardware, HardwareKind, ModelCost, ModelKind, Precision, SeqWork, StepCost,
};
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::scheduler::EngineConfig;

use crate::cluster::topology::Topology;
use crate::modelled::balance::{place_shares, BalanceStats, ExpertBalance, LoadCache};
use crate::modelled::deployment::{group_domain, InstanceLimits};
use crate::modelled::drafting::{DraftCounters, Drafting};
use crate::modelled::tiers::{ModelledTiers, TierSpec};

/// Fraction of HBM kept for activations, communication buffers and the allocator.
const HBM_RESERVE: f64 = 0.1;

/// KV bytes one more token costs `model`, past the sliding window.
fn kv_bytes_per_token(model: &ModelCost) -> f64 {
    let (a, b) = (1usize << 15, 1usize << 16);
    (model.kv_bytes_per_sequence(b) - model.kv_bytes_per_sequence(a)) / (b - a) as f64
}

/// What the modelled devices stand for.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelledSpec {
    pub hardware: HardwareKind,
    pub model: ModelKind,
    pub efficiency: Efficiency,
    /// How tokens choose experts (each layer its own seeded order).
    pub popularity: Popularity,
    /// Seconds over which the hot experts change (Zipf popularity; 0: never,
    /// see `ExpertLoads`).
    pub drift_s: f64,
    /// Share of the popularity score that moves (0: none, 1: all).
    pub drift_share: f64,
    /// Seconds between EPLB placements from the previous period's mean loads
    /// (0: placed once from the loads at the start). Only drifting loads are
    /// placed again.
    pub rebalance_s: f64,
    /// Redundant expert slots per instance. With any, experts are placed by
    /// EPLB from the expected loads; without, in contiguous ranges.
    pub redundant_experts: usize,
    /// Per instance, instead of `redundant_experts` (missing entries use it).
    pub redundant_per_instance: Vec<usize>,
    /// Sequences and tokens per device in one step (the instance's limits scale with its size).
    pub batch_per_device: usize,
    pub batch_tokens_per_device: usize,
    /// Most decode steps a scheduler runs as one event when its step is
    /// decode only (1: every step is an event; more: faster simulation,
    /// admissions wait for the event to end and tokens arrive in bursts).
    pub decode_steps_per_event: u32,
    /// Speculative decoding (the instances' `EngineConfig::speculative` must match).
    pub drafting: Option<Drafting>,
    /// KV bytes per device instead of what HBM leaves after the weights (never more).
    pub device_kv_bytes: Option<f64>,
    /// Prompt-cache tiers below the device pool.
    pub tiers: Option<TierSpec>,
    /// Devices in one scale-up domain (NVLink / HCCS); an instance's
    /// all-to-all stays on it inside one.
    pub scale_up_domain: u32,
    /// The formats weights and KV are served in, where not the checkpoint's.
    pub precision: Precision,
    /// Per instance, in order (missing entries: the deployment's settings).
    pub instance_limits: Vec<InstanceLimits>,
    pub seed: u64,
}

/// The figures every modelled worker of a cluster prices its steps with.
#[derive(Debug)]
pub struct Modelled {
    pub spec: ModelledSpec,
    pub hardware: Hardware,
    pub model: ModelCost,
    pub devices_per_node: usize,
    /// Per instance: the devices of its expert-parallel group a dispatch
    /// reaches inside one scale-up domain.
    instance_domain: Vec<usize>,
    /// Share of each expert at the start, `[layer][expert]`.
    pub loads: Vec<Vec<f64>>,
    /// The loads over time, and each instance's placement and what its steps met.
    load_cache: LoadCache,
    balance: Vec<Mutex<ExpertBalance>>,
    /// The draft head priced after each decoding step, when drafting.
    pub draft_head: Option<DraftHead>,
    /// What the schedulers' completed steps drafted, verified and accepted.
    pub drafts: DraftCounters,
    /// Host, disk and shared tiers, when configured.
    pub tiers: Option<ModelledTiers>,
    /// Per instance: image-encoding time (µs per device) waiting to lengthen
    /// its next prefill step, where images are encoded on the prefill
    /// instance itself (no encoder instance; see `encoder.rs`).
    colocated_encode: Vec<Mutex<f64>>,
}

/// Why a modelled cluster cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelledError {
    #[error(
        "instance {instance} ({devices} {hardware} devices): its weights need {need_gib:.1} GiB per device, more \
         than the {usable_gib:.1} GiB left for weights and KV: {reserve_pct:.0}% of the {have_gib:.1} GiB a device \
         has is reserved for activations; {hint}"
    )]
    NoMemory {
        instance: u32,
        devices: u32,
        need_gib: f64,
        have_gib: f64,
        usable_gib: f64,
        reserve_pct: f64,
        hardware: &'static str,
        /// The fewest devices (whole nodes) an instance needs for its weights to fit, if any do.
        fits_devices: Option<u32>,
        /// What would fit, in words.
        hint: String,
    },
    #[error("{why}")]
    Precision { why: String },
    #[error("instance {instance}: offload_gib: {why}")]
    Offload { instance: u32, why: String },
    #[error("instance {instance}: expert placement: {why}")]
    Placement { instance: u32, why: String },
    #[error("speculative method {method} has no draft head on {model}")]
    NoDraftHead { method: String, model: &'static str },
}

impl Modelled {
    pub fn new(spec: ModelledSpec, topology: &Topology) -> Result<Self, ModelledError> {
        let model = spec.model.cost().with_precision(spec.precision).map_err(|why| ModelledError::Precision { why })?;
        let instance_domain =
            (0..topology.instances).map(|i| group_domain(topology.devices_of(i), spec.scale_up_domain)).collect();
        let hardware = spec.hardware.spec();
        let load_cache = LoadCache::new(ExpertLoads::new(
            spec.popularity,
            model.experts,
            model.moe_layers(),
            spec.seed,
            spec.drift_s,
            spec.drift_share,
        ));
        let loads = load_cache.slice(0).to_vec();
        let mut balance = Vec::with_capacity(topology.instances as usize);
        for instance in 0..topology.instances {
            let devices = topology.size_of(instance) as usize;
            let redundant =
                spec.redundant_per_instance.get(instance as usize).copied().unwrap_or(spec.redundant_experts);
            let b = ExpertBalance::new(&load_cache, spec.rebalance_s, redundant, devices, topology.per_node as usize)
                .map_err(|why| ModelledError::Placement { instance, why })?;
            balance.push(Mutex::new(b));
        }
        let draft_head = match &spec.drafting {
            Some(d) if d.max_drafts() > 0 => Some(
                DraftHead::new(&model, d.config.method, d.max_drafts())
                    .ok_or(ModelledError::NoDraftHead { method: d.config.method.to_string(), model: model.name })?,
            ),
            _ => None,
        };
        let tiers = spec.tiers.clone().map(|t| {
            let per_node = topology.per_node.max(1);
            let nodes: Vec<u32> = (0..topology.instances).map(|i| topology.size_of(i).div_ceil(per_node)).collect();
            let block_bytes = kv_bytes_per_token(&model) * t.block_tokens as f64;
            ModelledTiers::new(t, block_bytes, &nodes)
        });
        let m = Self {
            tiers,
            spec,
            hardware,
            model,
            devices_per_node: topology.per_node.max(1) as usize,
            instance_domain,
            loads,
            load_cache,
            balance,
            draft_head,
            drafts: DraftCounters::default(),
            colocated_encode: (0..topology.instances).map(|_| Mutex::new(0.0)).collect(),
        };
        for instance in 0..topology.instances {
            let have = m.hardware.hbm_bytes();
            m.check_offload(instance)?;
            let need = m.hbm_weight_bytes(instance);
            if need > have * (1.0 - HBM_RESERVE) {
                return Err(m.no_memory(instance, topology));
            }
        }
        Ok(m)
    }

    /// Why `instance`'s weights do not fit, and the smallest instance whose would.
    fn no_memory(&self, instance: u32, topology: &Topology) -> ModelledError {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let have = self.hardware.hbm_bytes();
        let usable = have * (1.0 - HBM_RESERVE);
        let devices = topology.size_of(instance);
        let per_node = topology.per_node.max(1);
        let redundant =
            self.spec.redundant_per_instance.get(instance as usize).copied().unwrap_or(self.spec.redundant_experts);
        // Routed-expert slots spread over more devices: each holds fewer of them.
        let slots = self.model.experts + redundant;
        let fits = |d: u32| self.model.device_weight_bytes(slots.div_ceil(d as usize)) <= usable;
        let most = (slots as u32).div_ceil(per_node) * per_node;
        let fits_devices = (1..=most / per_node).map(|n| n * per_node).find(|&d| d > devices && fits(d));
        // Or fewer of them in HBM: the least `offload_gib` that fits, if the host holds it.
        let hbm_need = self.hbm_weight_bytes(instance);
        let offload = self.limits(instance).offload_bytes + (hbm_need - usable).max(0.0);
        let offload_hint = if offload <= self.expert_bytes(instance) && offload <= self.hardware.host_bytes() {
            format!(
                "; or offload_gib = {:.0} on this instance keeps that much of its experts in host memory",
                gib(offload).ceil()
            )
        } else {
            String::new()
        };
        let hint = match fits_devices {
            Some(d) => format!(
                "more devices per instance would hold them ({d} devices per instance: each then holds {} routed \
                 expert slots, not {}){offload_hint}",
                slots.div_ceil(d as usize),
                slots.div_ceil(devices as usize)
            ),
            None => {
                format!(
                    "no instance size would: with one routed expert per device the dense weights and embeddings alone \
                 need {:.1} GiB",
                    gib(self.model.device_weight_bytes(1))
                ) + &offload_hint
            }
        };
        ModelledError::NoMemory {
            instance,
            devices,
            need_gib: gib(hbm_need),
            have_gib: gib(have),
            usable_gib: gib(usable),
            reserve_pct: HBM_RESERVE * 100.0,
            hardware: self.hardware.name,
            fits_devices,
            hint,
        }
    }

    /// Contiguous experts, or DeepSeek's EPLB with `redundant` extra slots.
    pub fn place(
        loads: &[Vec<f64>],
        redundant: usize,
        devices: usize,
        per_node: usize,
    ) -> Result<DeviceShares, String> {
        place_shares(loads, redundant, devices, per_node)
    }

    fn balance(&self, instance: u32) -> std::sync::MutexGuard<'_, ExpertBalance> {
        let cell = &self.balance[(instance as usize).min(self.balance.len() - 1)];
        cell.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The current device shares of `instance`.
    pub fn shares(&self, instance: u32) -> Arc<DeviceShares> {
        self.balance(instance).shares()
    }

    /// Switch `instance` to new shares (a rebalanced placement), between
    /// steps; drifting loads replace them at their next sample.
    pub fn set_shares(&self, instance: u32, shares: DeviceShares) {
        if let Some(cell) = self.balance.get(instance as usize) {
            cell.lock().unwrap_or_else(|e| e.into_inner()).set_shares(shares);
        }
    }

    /// Bring `instance`'s placement and shares to `now` (a rebalance is due
    /// every `rebalance_s`, the loads move every sample of the drift) and
    /// count `steps` priced there. A worker calls it before pricing a step.
    pub fn advance(&self, instance: u32, now: Duration, steps: u64) {
        self.balance(instance).advance(&self.load_cache, now.as_secs_f64(), steps);
    }

    /// What `instance`'s steps met: imbalance over time and rebalances.
    pub fn balance_stats(&self, instance: u32) -> BalanceStats {
        self.balance(instance).stats.clone()
    }

    /// Weights one device of `instance` holds.
    pub fn weight_bytes(&self, instance: u32) -> f64 {
        self.model.device_weight_bytes(self.shares(instance).slots_per_device)
    }

    /// Bytes of routed-expert weights one device of `instance` holds.
    fn expert_bytes(&self, instance: u32) -> f64 {
        self.shares(instance).slots_per_device as f64 * self.model.expert_weight_bytes_all_layers()
    }

    fn limits(&self, instance: u32) -> InstanceLimits {
        self.spec.instance_limits.get(instance as usize).cloned().unwrap_or_default()
    }

    /// An offload larger than the device's experts or than its host memory is refused.
    fn check_offload(&self, instance: u32) -> Result<(), ModelledError> {
        let gib = |b: f64| b / (1u64 << 30) as f64;
        let (offload, experts) = (self.limits(instance).offload_bytes, self.expert_bytes(instance));
        let why = if offload > experts {
            format!("{:.1} GiB, but a device holds {:.1} GiB of routed experts", gib(offload), gib(experts))
        } else if offload > self.hardware.host_bytes() {
            format!(
                "{:.1} GiB, but a {} device has {:.0} GiB of host memory",
                gib(offload),
                self.hardware.name,
                self.hardware.host_gib
            )
        } else {
            return Ok(());
        };
        Err(ModelledError::Offload { instance, why })
    }

    /// Share of a device's routed-expert weights `instance` keeps in host memory.
    pub fn offloaded_share(&self, instance: u32) -> f64 {
        let experts = self.expert_bytes(instance);
        if experts > 0.0 {
            (self.limits(instance).offload_bytes / experts).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Weights one device of `instance` keeps in HBM (all but the offloaded ones).
    pub fn hbm_weight_bytes(&self, instance: u32) -> f64 {
        self.weight_bytes(instance) - self.offloaded_share(instance) * self.expert_bytes(instance)
    }

    /// The devices of `instance`'s group a dispatch reaches inside one scale-up domain.
    pub fn scale_up_domain(&self, instance: u32) -> usize {
        self.instance_domain.get(instance as usize).copied().unwrap_or(self.devices_per_node)
    }

    /// HBM left for KV on each device of `instance`.
    pub fn kv_bytes_per_device(&self, instance: u32) -> f64 {
        let hbm = (self.hardware.hbm_bytes() * (1.0 - HBM_RESERVE) - self.hbm_weight_bytes(instance)).max(0.0);
        self.spec.device_kv_bytes.map_or(hbm, |cap| hbm.min(cap.max(0.0)))
    }

    /// KV bytes one more token costs, past the sliding window.
    pub fn kv_bytes_per_token(&self) -> f64 {
        kv_bytes_per_token(&self.model)
    }

    /// The batching policy of `instance`: limits scaled by its devices and a
    /// block budget that holds as many tokens as its HBM holds of the modelled KV.
    pub fn engine_for(&self, base: &EngineConfig, layout: &KvLayout, devices: u32, instance: u32) -> EngineConfig {
        let limits = self.limits(instance);
        let batch = limits.batch_per_device.unwrap_or(self.spec.batch_per_device);
        let batch_tokens = limits.batch_tokens_per_device.unwrap_or(self.spec.batch_tokens_per_device);
        let (a, b) = (1usize << 15, 1usize << 16);
        let layout_per_token = (layout.sequence_bytes(b) - layout.sequence_bytes(a)) as f64 / (b - a) as f64;
        let tokens = self.kv_bytes_per_device(instance) * devices as f64 / self.kv_bytes_per_token();
        let budget = (tokens * layout_per_token).min(usize::MAX as f64 / 2.0) as usize;
        EngineConfig {
            max_batch_size: (batch * devices as usize).clamp(1, deepinfer_engine::scheduler::MAX_BATCH_SIZE),
            max_batch_tokens: (batch_tokens * devices as usize).clamp(1, deepinfer_engine::scheduler::MAX_BATCH_TOKENS),
            max_chunk_tokens: Some(batch_tokens.max(1)),
            max_rank_tokens: Some(batch_tokens.max(1)),
            kv_budget_bytes: budget.max(layout.sequence_bytes(1)),
            ..base.clone()
        }
    }

    /// The model the actors see: the computing model's structure with the
    /// modelled model's experts, vocabulary and context.
    pub fn shape_config(&self, base: &ModelConfig) -> ModelConfig {
        let mut cfg = base.clone();
        cfg.n_routed_experts = self.model.experts;
        cfg.experts_per_token = self.model.experts_per_token;
        cfg.vocab_size = self.model.vocab;
        cfg.max_position_embeddings = self.model.context;
        // The scheduler caps drafts at the window ring (less two); the shape's
        // window is small, the modelled models' is 128.
        let most = self.drafting().map_or(0, Drafting::max_drafts);
        cfg.sliding_window = cfg.sliding_window.max(most + 2);
        cfg
    }

    /// Speculative decoding, when on.
    pub fn drafting(&self) -> Option<&Drafting> {
        self.spec.drafting.as_ref().filter(|d| d.max_drafts() > 0)
    }

    /// Device time (µs) of the draft head proposing `drafts` for requests of
    /// `contexts` on one device of an expert-parallel group whose every rank
    /// drafts alike.
    pub fn draft_cost(&self, instance: u32, expert_parallel: usize, contexts: &[usize], drafts: usize) -> f64 {
        match &self.draft_head {
            Some(h) if !contexts.is_empty() && drafts > 0 => {
                let eff = self.spec.efficiency;
                let domain = self.scale_up_domain(instance);
                h.cost(&self.hardware, contexts, drafts, expert_parallel, domain, eff).total_us
            }
            _ => 0.0,
        }
    }

    /// Adds `per_device_us` of image encoding to `instance`'s next prefill step.
    pub fn add_colocated_encode(&self, instance: u32, per_device_us: f64) {
        if let Some(backlog) = self.colocated_encode.get(instance as usize) {
            *backlog.lock().expect("encode backlog") += per_device_us.max(0.0);
        }
    }

    /// The image encoding waiting for `instance`'s next prefill step, taken:
    /// the first worker of the step to price it carries it, and the step
    /// waits for its slowest worker, so the whole step is that much longer.
    fn take_colocated_encode(&self, instance: u32) -> f64 {
        self.colocated_encode
            .get(instance as usize)
            .map_or(0.0, |b| std::mem::take(&mut *b.lock().expect("encode backlog")))
    }

    /// One worker's step: its sequences' attention and dense layers, and the
    /// instance's expert all-to-all, paced by the most loaded device. State
    /// imported from a prefill instance crosses the scale-out network.
    pub fn step(
        &self,
        instance: u32,
        expert_parallel: usize,
        sequences: &[SeqWork],
        batch_tokens: usize,
        imported_tokens: usize,
    ) -> StepCost {
        let shares = self.shares(instance);
        let pairs = batch_tokens as f64 * self.model.experts_per_token as f64 * shares.max_share;
        let step = DeviceStep {
            sequences: sequences.to_vec(),
            expert_tokens: pairs.ceil() as usize,
            experts_hit: shares.slots_per_device,
            expert_parallel,
            scale_up_domain: self.scale_up_domain(instance),
            offloaded_expert_share: self.offloaded_share(instance),
        };
        let eff = self.spec.efficiency;
        let mut cost = step_cost(&self.hardware, &self.model, &step, eff);
        // The all-to-all waits for its busiest receiver: skewed experts
        // concentrate the dispatched rows on the devices holding hot ones.
        cost.network_us *= shares.imbalance().max(1.0);
        if imported_tokens > 0 {
            // Imported KV streams over the scale-out links while the kernels
            // run (what the all-to-all leaves idle): only what does not fit beside the kernels lengthens the step.
            let bytes = self.model.kv_bytes_per_sequence(imported_tokens);
            let import_us = bytes / self.hardware.scale_out_bytes_per_s() / eff.network * 1e6;
            let idle_us = (cost.compute_us + cost.memory_us) * (1.0 - eff.overlap.clamp(0.0, 1.0));
            cost.network_us += (import_us - idle_us).max(0.0);
        }
        if !deepinfer_engine::cost::is_decode(sequences) {
            // Colocated image encoding runs on the same devices before the prompt's chunk.
            cost.compute_us += self.take_colocated_encode(instance);
        }
        cost.total_us = eff.total_us(cost.compute_us + cost.memory_us, cost.network_us, cost.overhead_us);
        cost
    }
}
