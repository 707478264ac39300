//! The device cost model of the simulator: how long one step of a batch takes
//! on a given accelerator, for a given model, without doing the maths.
//!
//! A step is a roofline over three resources that DeepSeek's serving overlaps
//! (two micro-batches hide communication behind compute): tensor-core time,
//! HBM time (weights, KV, compressed entries read once per step) and network
//! time (expert-parallel dispatch and combine), plus a fixed per-layer
//! overhead. Every figure is per device.

pub mod draft;
pub mod experts;
pub mod hardware;
pub mod model;
pub mod v41;

pub use hardware::{Hardware, HardwareKind};
pub use model::{ModelCost, ModelKind};

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeqWork {
    /// Tokens computed this step (1 for decode, a chunk for prefill).
    pub new_tokens: usize,
    /// Tokens already in the context before this step.
    pub context: usize,
}

/// What one device does in one step.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceStep {
    /// Sequences whose attention runs on this device (its data-parallel rank).
    pub sequences: Vec<SeqWork>,
    /// Token-expert pairs the device's expert shard computes, per MoE layer on average.
    pub expert_tokens: usize,
    /// Distinct routed experts hit on the device (their weights are read).
    pub experts_hit: usize,
    /// Expert-parallel degree (devices sharing the routed experts).
    pub expert_parallel: usize,
    /// Devices per node (the scale-up domain); dispatch beyond it crosses the scale-out network.
    pub devices_per_node: usize,
}

/// The time of one step and where it went, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepCost {
    pub compute_us: f64,
    pub memory_us: f64,
    pub network_us: f64,
    pub overhead_us: f64,
    pub total_us: f64,
}

/// Achievable fractions of the peak figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Efficiency {
    pub compute: f64,
    pub memory: f64,
    pub network: f64,
    /// Kernel launches, synchronisation, per layer.
    pub layer_overhead_us: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Self { compute: 0.55, memory: 0.8, network: 0.7, layer_overhead_us: 15.0 }
    }
}

/// Cost of one step of `step` on `hw` for `model`.
pub fn step_cost(hw: &Hardware, model: &ModelCost, step: &DeviceStep, eff: Efficiency) -> StepCost {
    let tokens: usize = step.sequences.iter().map(|s| s.new_tokens).sum();
    if tokens == 0 && step.expert_tokens == 0 {
        return StepCost { compute_us: 0.0, memory_us: 0.0, network_us: 0.0, overhead_us: 0.0, total_us: 0.0 };
    }
    // Tensor-core work: dense projections and attention in BF16/FP8, experts at their storage precision.
    let attention_flops: f64 = step.sequences.iter().map(|s| model.attention_flops(s.new_tokens, s.context)).sum();
    let dense_flops = tokens as f64 * model.dense_flops_per_token();
    let expert_flops = step.expert_tokens as f64 * model.expert_flops_per_token() * model.moe_layers() as f64;
    let compute_s = (attention_flops / hw.bf16_flops()
        + dense_flops / hw.fp8_flops()
        + expert_flops / hw.flops_for_bits(model.expert_bits))
        / eff.compute;

    // HBM: dense weights once per step, the hit experts' weights, the KV state each sequence reads.
    let kv_bytes: f64 = step.sequences.iter().map(|s| model.kv_read_bytes(s.new_tokens, s.context)).sum();
    let weight_bytes = model.dense_weight_bytes() + step.experts_hit as f64 * model.expert_weight_bytes_all_layers();
    let table_bytes = tokens as f64 * model.table_read_bytes_per_token();
    let memory_s = (weight_bytes + kv_bytes + table_bytes) / hw.hbm_bytes_per_s() / eff.memory;

    // Network: each token goes to `k` experts and comes back, per MoE layer. As
    // DeepEP does, a token crosses to each remote node once and fans out to that
    // node's experts over the scale-up links.
    let ep = step.expert_parallel.max(1) as f64;
    let per_node = step.devices_per_node.clamp(1, step.expert_parallel.max(1)) as f64;
    let nodes = (ep / per_node).ceil();
    let k = model.experts_per_token as f64;
    let pair_bytes = model.dispatch_bytes_per_token() + model.combine_bytes_per_token();
    let per_token_layers = tokens as f64 * pair_bytes * model.moe_layers() as f64;
    let nodes_reached = nodes * (1.0 - (1.0 - 1.0 / nodes).powf(k));
    let off_node = nodes_reached * (nodes - 1.0) / nodes;
    let on_node = if ep > 1.0 { k * (1.0 - 1.0 / per_node) } else { 0.0 };
    let network_s = (per_token_layers * on_node / hw.scale_up_bytes_per_s()
        + per_token_layers * off_node / hw.scale_out_bytes_per_s())
        / eff.network;

    let overhead_us = model.layers as f64 * eff.layer_overhead_us;
    let (compute_us, memory_us, network_us) = (compute_s * 1e6, memory_s * 1e6, network_s * 1e6);
    StepCost {
        compute_us,
        memory_us,
        network_us,
        overhead_us,
        total_us: compute_us.max(memory_us).max(network_us) + overhead_us,
    }
}

#[cfg(test)]
mod tests;
