//! The device cost model of the simulator: how long one step of a batch takes
//! on a given accelerator, for a given model, without doing the maths.
//!
//! A step is its kernels, each bound by tensor-core time or HBM time (weights,
//! KV, compressed entries read once per step), plus the expert-parallel
//! dispatch and combine, which two micro-batches partly hide behind the
//! kernels, plus a fixed per-layer overhead. Every figure is per device.

pub mod blackwell;
pub mod calibration;
pub mod draft;
pub mod experts;
pub mod hardware;
pub mod model;
pub mod precision;
pub mod v41;
pub mod vision;

pub use hardware::{Hardware, HardwareKind};
pub use model::{ModelCost, ModelKind};
pub use precision::{KvFormat, Precision, WeightFormat};

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
    /// Devices in one scale-up domain (NVLink / HCCS: 8 in an HGX node, 72
    /// in an NVL72 rack); dispatch beyond it crosses the scale-out network.
    pub scale_up_domain: usize,
    /// Share of the device's routed-expert weights held in host memory
    /// (weight offload): each step streams that share of the experts it
    /// reads over the host link instead of from HBM.
    pub offloaded_expert_share: f64,
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

/// Achieved fractions of the peak figures, per kernel class, and how the
/// expert all-to-all overlaps the kernels. The defaults come from DeepSeek's
/// own published kernel and serving figures on H800 (see `simulations/README.md`,
/// "How a step is priced"); only `overlap` is fitted, on DeepSeek's V3/R1
/// decode operating point.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Efficiency {
    /// Dense FP8 GEMMs (attention projections, shared experts, dense FFNs,
    /// output head): DeepGEMM's normal GEMMs reach about 1,500 of 1,979 TFLOPS.
    pub dense_gemm: f64,
    /// The routed experts' grouped GEMMs: DeepGEMM's grouped contiguous
    /// layout reaches about 1,250 of 1,979 TFLOPS.
    pub expert_gemm: f64,
    /// The attention core of prompt chunks: FlashMLA's prefill, 640 of 989
    /// TFLOPS on H800 (sparse MLA), taken as its decode figure below.
    pub attention: f64,
    /// The attention core of decode steps: FlashMLA's decoding kernel, 660 of
    /// 989 TFLOPS when compute-bound on H800.
    pub attention_decode: f64,
    /// HBM streaming (weights, KV, tables): FlashMLA's 3,000 of 3,350 GB/s
    /// when memory-bound; weight streaming in grouped GEMMs is lower.
    pub memory: f64,
    /// Prefill's all-to-all (DeepEP's normal kernels, one copy per remote node,
    /// NVLink forwarding): 43–58 GB/s of RDMA on 50 GB/s links at EP16–64.
    pub network: f64,
    /// Decode's all-to-all (DeepEP's low-latency kernels, one message per
    /// token and expert): 39–49 GB/s of pair bytes at EP32–256 with 128
    /// tokens per rank, of which the remote share crosses the 50 GB/s link.
    pub network_low_latency: f64,
    /// Share of the SMs the normal kernels take from compute (24 of 132).
    pub comm_sm_share: f64,
    /// Share of the shorter of kernel time and all-to-all time that the two
    /// micro-batches hide behind the longer (0: none, 1: perfect overlap).
    pub overlap: f64,
    /// Kernel launches, norms, synchronisation, per layer.
    pub layer_overhead_us: f64,
}

impl Default for Efficiency {
    fn default() -> Self {
        Self {
            dense_gemm: 0.75,
            expert_gemm: 0.63,
            attention: 0.67,
            attention_decode: 0.67,
            memory: 0.85,
            network: 0.95,
            network_low_latency: 0.78,
            comm_sm_share: 24.0 / 132.0,
            overlap: 0.0,
            layer_overhead_us: 15.0,
        }
    }
}

impl Efficiency {
    /// The achieved fractions on `kind`: Blackwell's from DeepSeek's
    /// kernels measured on SM100 ([`blackwell`]), every other part Hopper's
    /// (the defaults; Ascend has no published kernel figures yet).
    pub fn for_hardware(kind: HardwareKind) -> Self {
        match kind {
            HardwareKind::B200 | HardwareKind::Gb200 | HardwareKind::Gb300 => blackwell::efficiency(),
            _ => Self::default(),
        }
    }

    /// Step time from its kernel time, all-to-all time and fixed overhead.
    pub fn total_us(&self, kernels_us: f64, network_us: f64, overhead_us: f64) -> f64 {
        let hidden = kernels_us.min(network_us) * self.overlap.clamp(0.0, 1.0);
        kernels_us + network_us - hidden + overhead_us
    }
}

/// Most tokens a sequence computes in a step that DeepEP's low-latency
/// kernels carry (one plus the most drafts a request verifies); longer
/// chunks are prefill, carried by the normal kernels.
pub const DECODE_TOKENS_MAX: usize = 1 + crate::speculative::policy::MAX_DRAFT_TOKENS;

/// Whether a step with these sequences is a decode step (low-latency all-to-all).
pub fn is_decode(sequences: &[SeqWork]) -> bool {
    sequences.iter().all(|s| s.new_tokens <= DECODE_TOKENS_MAX)
}

/// One kernel class's roofline: its FLOPs at its achieved rate against its
/// bytes at the achieved HBM bandwidth; the slower bound counts, in seconds,
/// as (compute-bound, memory-bound).
fn roofline(flops: f64, flops_per_s: f64, bytes: f64, bytes_per_s: f64) -> (f64, f64) {
    let (compute, memory) = (flops / flops_per_s, bytes / bytes_per_s);
    if compute >= memory {
        (compute, 0.0)
    } else {
        (0.0, memory)
    }
}

/// Cost of one step of `step` on `hw` for `model`.
///
/// The kernels of a step run one after another: dense GEMMs, the routed
/// experts' grouped GEMMs and the attention core, each bound by its FLOPs or
/// its HBM bytes (its own roofline), then tables read by row. The expert
/// all-to-all runs beside them, and two micro-batches hide `eff.overlap` of
/// the shorter of the two behind the longer.
pub fn step_cost(hw: &Hardware, model: &ModelCost, step: &DeviceStep, eff: Efficiency) -> StepCost {
    let tokens: usize = step.sequences.iter().map(|s| s.new_tokens).sum();
    if tokens == 0 && step.expert_tokens == 0 {
        return StepCost { compute_us: 0.0, memory_us: 0.0, network_us: 0.0, overhead_us: 0.0, total_us: 0.0 };
    }
    let hbm = hw.hbm_bytes_per_s() * eff.memory;
    // Dense projections, shared experts and the head: weights read once per step.
    let dense = roofline(
        tokens as f64 * model.dense_flops_per_token(),
        model.dense_format.flops(hw) * eff.dense_gemm,
        if tokens > 0 { model.dense_weight_bytes() } else { 0.0 },
        hbm,
    );
    // Routed experts at their storage precision: the hit experts' weights,
    // the offloaded share of them streamed from host memory beside the HBM
    // reads (the slower of the two streams counts).
    let expert_bytes = step.experts_hit as f64 * model.expert_weight_bytes_all_layers();
    let offloaded = step.offloaded_expert_share.clamp(0.0, 1.0);
    let host_s = expert_bytes * offloaded / (hw.host_link_bytes_per_s() * eff.memory);
    let mut experts = roofline(
        step.expert_tokens as f64 * model.expert_flops_per_token() * model.moe_layers() as f64,
        model.expert_format.flops(hw) * eff.expert_gemm,
        expert_bytes * (1.0 - offloaded),
        hbm,
    );
    if host_s > experts.0.max(experts.1) {
        experts = (0.0, host_s);
    }
    // The attention core: scores and values against the KV each sequence reads.
    // Decode and prompt chunks run different kernels, each at its own
    // achieved rate: the core's time is theirs summed, at one nominal rate.
    let core_flops = model.kv_format.flops(hw);
    let attention_s: f64 = step
        .sequences
        .iter()
        .map(|s| {
            let rate = if s.new_tokens <= DECODE_TOKENS_MAX { eff.attention_decode } else { eff.attention };
            model.attention_flops(s.new_tokens, s.context) / (core_flops * rate)
        })
        .sum();
    let attention = roofline(
        attention_s,
        1.0,
        step.sequences.iter().map(|s| model.kv_read_bytes(s.new_tokens, s.context)).sum(),
        hbm,
    );
    let tables_s = tokens as f64 * model.table_read_bytes_per_token() / hbm;
    let mut compute_s = dense.0 + experts.0 + attention.0;
    let mut memory_s = dense.1 + experts.1 + attention.1 + tables_s;

    let ep = step.expert_parallel.max(1);
    let decode = is_decode(&step.sequences);
    let network_s = if ep == 1 {
        0.0
    } else if decode {
        low_latency_all_to_all_s(hw, model, tokens, ep, step.scale_up_domain, eff)
    } else {
        // The normal kernels run on SMs taken from compute.
        let slowdown = 1.0 / (1.0 - eff.comm_sm_share.clamp(0.0, 0.9));
        compute_s *= slowdown;
        memory_s *= slowdown;
        normal_all_to_all_s(hw, model, tokens, ep, step.scale_up_domain, eff)
    };

    let overhead_us = model.layers as f64 * eff.layer_overhead_us;
    let (compute_us, memory_us, network_us) = (compute_s * 1e6, memory_s * 1e6, network_s * 1e6);
    StepCost {
        compute_us,
        memory_us,
        network_us,
        overhead_us,
        total_us: eff.total_us(compute_us + memory_us, network_us, overhead_us),
    }
}

/// DeepEP's normal kernels (prefill): a token crosses to each remote node
/// that holds one of its `k` experts once and fans out there over the
/// scale-up links, which run beside the slower scale-out transfer.
fn normal_all_to_all_s(
    hw: &Hardware,
    model: &ModelCost,
    tokens: usize,
    ep: usize,
    per_node: usize,
    eff: Efficiency,
) -> f64 {
    let ep = ep as f64;
    let per_node = per_node.clamp(1, ep as usize) as f64;
    let nodes = (ep / per_node).ceil();
    let k = model.experts_per_token as f64;
    let bytes = tokens as f64 * model.pair_bytes() * model.moe_layers() as f64;
    let nodes_reached = nodes * (1.0 - (1.0 - 1.0 / nodes).powf(k));
    let off_node = nodes_reached * (nodes - 1.0) / nodes;
    let on_node = k * (1.0 - 1.0 / per_node);
    let scale_out = bytes * off_node / hw.scale_out_bytes_per_s();
    let scale_up = bytes * on_node / hw.scale_up_bytes_per_s();
    scale_out.max(scale_up) / eff.network
}

/// DeepEP's low-latency kernels (decode): one message per token and expert,
/// remote experts over the scale-out links, the node's own over scale-up.
pub(crate) fn low_latency_all_to_all_s(
    hw: &Hardware,
    model: &ModelCost,
    tokens: usize,
    ep: usize,
    per_node: usize,
    eff: Efficiency,
) -> f64 {
    let per_node = per_node.clamp(1, ep);
    let pairs = tokens as f64 * model.experts_per_token as f64 * model.moe_layers() as f64;
    let bytes = pairs * model.pair_bytes();
    let off_node = (ep - per_node) as f64 / ep as f64;
    let on_node = (per_node - 1) as f64 / ep as f64;
    (bytes * off_node / hw.scale_out_bytes_per_s() + bytes * on_node / hw.scale_up_bytes_per_s())
        / eff.network_low_latency
}

#[cfg(test)]
mod tests;
