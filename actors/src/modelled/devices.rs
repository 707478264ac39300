//! Modelled devices: how the cluster simulates full-size models on one CPU.
//! Router, schedulers (with the engine's batching policy, KV block pool and
//! prefix cache), cache managers, workers and shards run as always; a
//! worker's step computes no maths: it answers after the time the engine's
//! cost model gives for its sequences and the instance's expert all-to-all,
//! with placeholder tokens. The model it runs is only a shape (experts,
//! vocabulary, context); KV accounting uses the engine's block layout with a
//! budget scaled so that a token costs the modelled model's KV bytes.

use std::sync::{Arc, RwLock};

use deepinfer_engine::config::ModelConfig;
use deepinfer_engine::cost::draft::DraftHead;
use deepinfer_engine::cost::experts::{layer_loads, DeviceShares, Popularity};
use deepinfer_engine::cost::{
    step_cost, DeviceStep, Efficiency, Hardware, HardwareKind, ModelCost, ModelKind, SeqWork, StepCost,
};
use deepinfer_engine::eplb;
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::scheduler::EngineConfig;

use crate::cluster::topology::Topology;
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
    pub seed: u64,
}

/// The figures every modelled worker of a cluster prices its steps with.
#[derive(Debug)]
pub struct Modelled {
    pub spec: ModelledSpec,
    pub hardware: Hardware,
    pub model: ModelCost,
    pub devices_per_node: usize,
    /// Expected share of each expert, `[layer][expert]`.
    pub loads: Vec<Vec<f64>>,
    shares: Vec<RwLock<Arc<DeviceShares>>>,
    /// The draft head priced after each decoding step, when drafting.
    pub draft_head: Option<DraftHead>,
    /// What the schedulers' completed steps drafted, verified and accepted.
    pub drafts: DraftCounters,
    /// Host, disk and shared tiers, when configured.
    pub tiers: Option<ModelledTiers>,
}

/// Why a modelled cluster cannot be set up.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelledError {
    #[error("instance {instance}: weights need {need_gib:.1} GiB of the {have_gib:.1} GiB a {hardware} device has")]
    NoMemory { instance: u32, need_gib: f64, have_gib: f64, hardware: &'static str },
    #[error("instance {instance}: expert placement: {why}")]
    Placement { instance: u32, why: String },
    #[error("speculative method {method} has no draft head on {model}")]
    NoDraftHead { method: String, model: &'static str },
}

impl Modelled {
    pub fn new(spec: ModelledSpec, topology: &Topology) -> Result<Self, ModelledError> {
        let model = spec.model.cost();
        let hardware = spec.hardware.spec();
        let loads = layer_loads(spec.popularity, model.experts, model.moe_layers(), spec.seed);
        let mut shares = Vec::with_capacity(topology.instances as usize);
        for instance in 0..topology.instances {
            let devices = topology.size_of(instance) as usize;
            let redundant =
                spec.redundant_per_instance.get(instance as usize).copied().unwrap_or(spec.redundant_experts);
            let s = Self::place(&loads, redundant, devices, topology.per_node as usize)
                .map_err(|why| ModelledError::Placement { instance, why })?;
            shares.push(RwLock::new(Arc::new(s)));
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
            loads,
            shares,
            draft_head,
            drafts: DraftCounters::default(),
        };
        for instance in 0..topology.instances {
            let have = m.hardware.hbm_bytes();
            let need = m.weight_bytes(instance);
            if need > have * (1.0 - HBM_RESERVE) {
                return Err(ModelledError::NoMemory {
                    instance,
                    need_gib: need / (1u64 << 30) as f64,
                    have_gib: have / (1u64 << 30) as f64,
                    hardware: m.hardware.name,
                });
            }
        }
        Ok(m)
    }

    /// Contiguous experts, or DeepSeek's EPLB with `redundant` extra slots.
    pub fn place(
        loads: &[Vec<f64>],
        redundant: usize,
        devices: usize,
        per_node: usize,
    ) -> Result<DeviceShares, String> {
        if redundant == 0 {
            return Ok(DeviceShares::contiguous(loads, devices));
        }
        let experts = loads.first().map_or(0, Vec::len);
        // Round the slots up to a multiple of the devices, as a real deployment would.
        let physical = (experts + redundant).div_ceil(devices) * devices;
        // The global policy: the hierarchical one keeps dispatch inside nodes
        // (node-limited routing), which the step cost does not credit, so it
        // would only show its worse balance.
        let nodes = devices.div_ceil(per_node.max(1));
        let p = eplb::rebalance(loads, physical, 1, nodes, devices).map_err(|e| e.to_string())?;
        Ok(DeviceShares::from_placement(loads, &p))
    }

    /// The current device shares of `instance`.
    pub fn shares(&self, instance: u32) -> Arc<DeviceShares> {
        let cell = &self.shares[(instance as usize).min(self.shares.len() - 1)];
        Arc::clone(&cell.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Switch `instance` to new shares (a rebalanced placement), between steps.
    pub fn set_shares(&self, instance: u32, shares: DeviceShares) {
        if let Some(cell) = self.shares.get(instance as usize) {
            *cell.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(shares);
        }
    }

    /// Weights one device of `instance` holds.
    pub fn weight_bytes(&self, instance: u32) -> f64 {
        self.model.device_weight_bytes(self.shares(instance).slots_per_device)
    }

    /// HBM left for KV on each device of `instance`.
    pub fn kv_bytes_per_device(&self, instance: u32) -> f64 {
        let hbm = (self.hardware.hbm_bytes() * (1.0 - HBM_RESERVE) - self.weight_bytes(instance)).max(0.0);
        self.spec.device_kv_bytes.map_or(hbm, |cap| hbm.min(cap.max(0.0)))
    }

    /// KV bytes one more token costs, past the sliding window.
    pub fn kv_bytes_per_token(&self) -> f64 {
        kv_bytes_per_token(&self.model)
    }

    /// The batching policy of `instance`: limits scaled by its devices and a
    /// block budget that holds as many tokens as its HBM holds of the modelled KV.
    pub fn engine_for(&self, base: &EngineConfig, layout: &KvLayout, devices: u32, instance: u32) -> EngineConfig {
        let (a, b) = (1usize << 15, 1usize << 16);
        let layout_per_token = (layout.sequence_bytes(b) - layout.sequence_bytes(a)) as f64 / (b - a) as f64;
        let tokens = self.kv_bytes_per_device(instance) * devices as f64 / self.kv_bytes_per_token();
        let budget = (tokens * layout_per_token).min(usize::MAX as f64 / 2.0) as usize;
        EngineConfig {
            max_batch_size: (self.spec.batch_per_device * devices as usize)
                .clamp(1, deepinfer_engine::scheduler::MAX_BATCH_SIZE),
            max_batch_tokens: (self.spec.batch_tokens_per_device * devices as usize)
                .clamp(1, deepinfer_engine::scheduler::MAX_BATCH_TOKENS),
            max_chunk_tokens: Some(self.spec.batch_tokens_per_device.max(1)),
            max_rank_tokens: Some(self.spec.batch_tokens_per_device.max(1)),
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
    pub fn draft_cost(&self, expert_parallel: usize, contexts: &[usize], drafts: usize) -> f64 {
        match &self.draft_head {
            Some(h) if !contexts.is_empty() && drafts > 0 => {
                let eff = self.spec.efficiency;
                h.cost(&self.hardware, contexts, drafts, expert_parallel, self.devices_per_node, eff).total_us
            }
            _ => 0.0,
        }
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
            devices_per_node: self.devices_per_node,
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
        cost.total_us = eff.total_us(cost.compute_us + cost.memory_us, cost.network_us, cost.overhead_us);
        cost
    }
}
