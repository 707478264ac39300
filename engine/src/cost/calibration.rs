//! Published operating points the cost model is set against: DeepSeek's own
//! figures (its kernels' benchmarks and its V3/R1 serving statistics), from
//! which the efficiencies come, and other teams' published deployments, kept
//! as checks the model was not tuned on.

use super::{low_latency_all_to_all_s, step_cost, DeviceStep, Efficiency, HardwareKind, ModelCost, ModelKind, SeqWork};

/// Whether a point set the model's constants or only checks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Calibration,
    Check,
}

/// One published figure and what the cost model gives for the same work.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    pub role: Role,
    pub source: &'static str,
    pub what: String,
    pub unit: &'static str,
    pub published: f64,
    pub modelled: f64,
}

impl Point {
    /// Modelled relative to published: +0.10 is 10% above.
    pub fn error(&self) -> f64 {
        self.modelled / self.published - 1.0
    }
}

/// DeepSeek's V3/R1 decode statistics (Inference System Overview, Feb 2025):
/// 14.8k output tokens/s per H800 node at 20–22 tokens/s per user, which is
/// about 88 sequences per GPU (14,800 / 8 / 21). The context is not
/// published; 4,500 tokens (inputs averaging about 4k plus half an answer)
/// is assumed.
const DEEPSEEK_DECODE_SEQS: usize = 88;
const DEEPSEEK_DECODE_CONTEXT: usize = 4_500;

/// DeepEP's low-latency kernels on H800 (its README): 128 tokens per rank,
/// 7,168 hidden, top-8, FP8 dispatch, BF16 combine; dispatch + combine µs.
const DEEPEP_LOW_LATENCY_US: [(usize, f64); 5] =
    [(16, 118.0 + 195.0), (32, 155.0 + 273.0), (64, 173.0 + 314.0), (128, 192.0 + 369.0), (256, 194.0 + 360.0)];

/// SGLang's DeepSeek-V3 deployment on H100 (LMSYS blog, May 2025): prefill
/// on 4 nodes (EP32), input tokens/s per node by prompt length, and decode
/// on 9 nodes (EP72) with 2,000-token inputs and 256 sequences per GPU.
const SGLANG_PREFILL_PER_NODE: [(usize, f64); 3] = [(1024, 57_674.0), (2048, 54_543.0), (4096, 50_302.0)];
const SGLANG_DECODE_PER_NODE: f64 = 22_282.0;

/// DeepSeek's V4.1-Flash production figures: 14,000 output tokens/s per
/// decode GPU at 230 tokens/s per user, about 61 sequences per GPU. The
/// hardware and the context are not published: B200 in EP64 and 32K tokens
/// (mostly cached agentic prompts) are taken, without drafts.
const V41_DECODE_SEQS: usize = 61;
const V41_DECODE_CONTEXT: usize = 32_768;

/// Prefill tokens per GPU in one step (DeepSeek's profile: 16K).
const PREFILL_TOKENS_PER_GPU: usize = 16_384;

/// One GPU's decode step of `model` on EP`ep` (8 GPUs a node): `batch` sequences of `context`.
fn decode_step(model: &ModelCost, ep: usize, redundant: usize, batch: usize, context: usize) -> DeviceStep {
    DeviceStep {
        sequences: vec![SeqWork { new_tokens: 1, context }; batch],
        expert_tokens: batch * model.experts_per_token,
        experts_hit: (model.experts + redundant).div_ceil(ep),
        expert_parallel: ep,
        devices_per_node: 8,
    }
}

/// One GPU's prefill step on EP`ep` (8 GPUs a node, 32 redundant expert
/// slots): as many prompts of `length` as fill `PREFILL_TOKENS_PER_GPU`.
pub fn prefill_step(model: &ModelCost, ep: usize, length: usize) -> DeviceStep {
    let seqs = (PREFILL_TOKENS_PER_GPU / length.max(1)).max(1);
    DeviceStep {
        sequences: vec![SeqWork { new_tokens: length, context: 0 }; seqs],
        expert_tokens: seqs * length * model.experts_per_token,
        experts_hit: (model.experts + 32).div_ceil(ep),
        expert_parallel: ep,
        devices_per_node: 8,
    }
}

/// Input tokens/s per 8-GPU node for prompts of `length` on EP`ep`.
pub fn prefill_per_node(hw: HardwareKind, ep: usize, length: usize, eff: Efficiency) -> f64 {
    let v3 = ModelKind::DeepSeekV3.cost();
    let step = prefill_step(&v3, ep, length);
    let tokens: usize = step.sequences.iter().map(|s| s.new_tokens).sum();
    8.0 * tokens as f64 * 1e6 / step_cost(&hw.spec(), &v3, &step, eff).total_us
}

/// Every published point with the model's figure under `eff`.
pub fn points(eff: Efficiency) -> Vec<Point> {
    let v3 = ModelKind::DeepSeekV3.cost();
    let h800 = HardwareKind::H800.spec();
    let mut out = Vec::new();
    let step = decode_step(&v3, 144, 32, DEEPSEEK_DECODE_SEQS, DEEPSEEK_DECODE_CONTEXT);
    out.push(Point {
        role: Role::Calibration,
        source: "DeepSeek V3/R1 inference overview",
        what: format!(
            "decode EP144 H800, {DEEPSEEK_DECODE_SEQS} seqs/GPU × {DEEPSEEK_DECODE_CONTEXT} ctx: tokens/s per user"
        ),
        unit: "tok/s",
        published: 21.0,
        modelled: 1e6 / step_cost(&h800, &v3, &step, eff).total_us,
    });
    for (ep, us) in DEEPEP_LOW_LATENCY_US {
        let one_layer = low_latency_all_to_all_s(&h800, &v3, 128, ep, 8, eff) / v3.moe_layers() as f64;
        out.push(Point {
            role: Role::Calibration,
            source: "DeepEP low-latency kernels",
            what: format!("EP{ep} H800, 128 tokens: dispatch + combine"),
            unit: "µs",
            published: us,
            modelled: one_layer * 1e6,
        });
    }
    for (length, per_node) in SGLANG_PREFILL_PER_NODE {
        out.push(Point {
            role: Role::Check,
            source: "SGLang, 96 H100",
            what: format!("prefill EP32 H100, {length}-token prompts: input tokens/s per node"),
            unit: "tok/s",
            published: per_node,
            modelled: prefill_per_node(HardwareKind::H100, 32, length, eff),
        });
    }
    let step = decode_step(&v3, 72, 0, 256, 2000);
    let cost = step_cost(&HardwareKind::H100.spec(), &v3, &step, eff);
    out.push(Point {
        role: Role::Check,
        source: "SGLang, 96 H100",
        what: "decode EP72 H100, 256 seqs/GPU × 2000 ctx: output tokens/s per node".to_string(),
        unit: "tok/s",
        published: SGLANG_DECODE_PER_NODE,
        modelled: 8.0 * 256.0 * 1e6 / cost.total_us,
    });
    let v41 = ModelKind::V41Flash.cost();
    let step = decode_step(&v41, 64, 64, V41_DECODE_SEQS, V41_DECODE_CONTEXT);
    let cost = step_cost(&HardwareKind::B200.spec(), &v41, &step, eff);
    out.push(Point {
        role: Role::Check,
        source: "DeepSeek V4.1-Flash production",
        what: format!(
            "decode EP64 B200 (assumed), {V41_DECODE_SEQS} seqs/GPU × {V41_DECODE_CONTEXT} ctx, no drafts: tokens/s per user"
        ),
        unit: "tok/s",
        published: 230.0,
        modelled: 1e6 / cost.total_us,
    });
    out
}
