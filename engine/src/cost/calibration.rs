//! Published operating points the cost model is set against: DeepSeek's own
//! figures (its kernels' benchmarks and its V3/R1 serving statistics), from
//! which the efficiencies come, and other teams' published deployments, kept
//! as checks the model was not tuned on.

use super::precision::{KvFormat, Precision, WeightFormat};
use super::{
    blackwell, low_latency_all_to_all_s, step_cost, DeviceStep, Efficiency, HardwareKind, ModelCost, ModelKind, SeqWork,
};

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
    /// Largest relative error the point allows (`engine/src/cost/tests.rs` holds it).
    pub bound: f64,
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
/// hardware and the context are not published. With "about 400 Gbit/s
/// interconnect per 8 GPUs" of scale-out, decode experts spread over 64–128
/// GPUs must share one scale-up domain: GB200 NVL72 in EP64 is taken, with
/// 32K tokens of context (mostly cached agentic prompts) and no drafts.
/// Prefill: 1.5M input tokens/s per prefill GPU with 96% served by the
/// prompt cache; taken as turns of 1,365 new tokens after 31,403 cached
/// (4% of 32K), on the same hardware.
const V41_PREFILL_PER_GPU: f64 = 1.5e6;
const V41_PREFILL_NEW: usize = 1_365;
const V41_PREFILL_CACHED: usize = 31_403;
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
        scale_up_domain: 8,
        offloaded_expert_share: 0.0,
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
        scale_up_domain: 8,
        offloaded_expert_share: 0.0,
    }
}

/// Input tokens/s per 8-GPU node for prompts of `length` on EP`ep`.
pub fn prefill_per_node(hw: HardwareKind, ep: usize, length: usize, eff: Efficiency) -> f64 {
    let v3 = ModelKind::DeepSeekV3.cost();
    let step = prefill_step(&v3, ep, length);
    let tokens: usize = step.sequences.iter().map(|s| s.new_tokens).sum();
    8.0 * tokens as f64 * 1e6 / step_cost(&hw.spec(), &v3, &step, eff).total_us
}

/// Every published point, each priced with its generation's achieved
/// fractions: Hopper's ([`Efficiency::default`]) and Blackwell's.
pub fn points() -> Vec<Point> {
    let mut out = hopper_points(Efficiency::default());
    out.extend(blackwell_points(blackwell::efficiency()));
    out
}

/// Hopper's points with the model's figure under `eff`.
pub fn hopper_points(eff: Efficiency) -> Vec<Point> {
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
        // DeepSeek's context is assumed.
        bound: 0.2,
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
            bound: 0.12,
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
            // Not fitted on.
            bound: 0.1,
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
        bound: 0.1,
    });
    out
}

/// SGLang's DeepSeek-V3 on GB200 NVL72 (LMSYS, Sept 2025, part II): 2,000-token
/// prompts; decode on 48 GPUs (EP48, one NVLink domain), prefill instances of
/// 4 GPUs (BF16 attention, FP8 experts) or 2 with weights offloaded to the
/// Grace (FP8 attention and KV, NVFP4 experts). Per GPU: input tokens/s of
/// prefill, output tokens/s of decode.
const SGLANG_GB200: [(&str, f64, f64); 2] =
    [("FP8 attention and KV, NVFP4 experts", 26_156.0, 13_386.0), ("BF16 attention, FP8 experts", 18_471.0, 9_087.0)];
/// Decode sequences per GPU with FP8 KV ("1408 for 2k ISL", chosen to fill the KV cache).
const SGLANG_GB200_FP8_BATCH: usize = 1408;
const SGLANG_PROMPT: usize = 2000;

fn precision(fp8_kv_and_fp4: bool) -> Precision {
    if fp8_kv_and_fp4 {
        Precision { experts: Some(WeightFormat::Nvfp4), dense: None, kv: Some(KvFormat::Fp8) }
    } else {
        Precision { experts: Some(WeightFormat::Fp8), dense: None, kv: Some(KvFormat::Bf16) }
    }
}

/// Decode sequences of `context` that fill what a device's HBM leaves after
/// its weights and the 10% reserve.
pub fn sequences_that_fill(model: &ModelCost, hbm_bytes: f64, experts_per_device: usize, context: usize) -> usize {
    let free = hbm_bytes * 0.9 - model.device_weight_bytes(experts_per_device);
    (free / model.kv_bytes_per_sequence(context)).max(1.0) as usize
}

/// Share of a device's routed-expert weights that must live in host memory
/// for its weights to fit what HBM leaves after the 10% reserve.
pub fn offload_needed(model: &ModelCost, hbm_bytes: f64, experts_per_device: usize) -> f64 {
    let experts = experts_per_device as f64 * model.expert_weight_bytes_all_layers();
    let over = model.device_weight_bytes(experts_per_device) - hbm_bytes * 0.9;
    (over / experts).clamp(0.0, 1.0)
}

/// One GB200 step of V3 in SGLang's setting: output tokens/s per GPU of
/// decode on EP48, input tokens/s per GPU of prefill on EP`ep`.
fn sglang_gb200(fp8_kv_and_fp4: bool, eff: Efficiency) -> (f64, f64) {
    let hw = HardwareKind::Gb200.spec();
    let v3 = ModelKind::DeepSeekV3.cost().with_precision(precision(fp8_kv_and_fp4)).expect("V3 has these formats");
    let ep = 48;
    let experts = (v3.experts + 32).div_ceil(ep);
    let context = SGLANG_PROMPT + 50;
    let batch = if fp8_kv_and_fp4 {
        SGLANG_GB200_FP8_BATCH
    } else {
        sequences_that_fill(&v3, hw.hbm_bytes(), experts, context)
    };
    let decode = DeviceStep {
        sequences: vec![SeqWork { new_tokens: 1, context }; batch],
        expert_tokens: batch * v3.experts_per_token,
        experts_hit: experts,
        expert_parallel: ep,
        scale_up_domain: hw.scale_up_domain,
        offloaded_expert_share: 0.0,
    };
    let output = batch as f64 * 1e6 / step_cost(&hw, &v3, &decode, eff).total_us;
    // Prefill: 4 GPUs hold every expert in HBM; 2 keep in the Grace's
    // memory what of their experts does not fit (the least offload).
    let ep = if fp8_kv_and_fp4 { 2 } else { 4 };
    let offloaded = offload_needed(&v3, hw.hbm_bytes(), v3.experts.div_ceil(ep));
    let seqs = PREFILL_TOKENS_PER_GPU / SGLANG_PROMPT;
    let prefill = DeviceStep {
        sequences: vec![SeqWork { new_tokens: SGLANG_PROMPT, context: 0 }; seqs],
        expert_tokens: seqs * SGLANG_PROMPT * v3.experts_per_token,
        experts_hit: v3.experts.div_ceil(ep),
        expert_parallel: ep,
        scale_up_domain: hw.scale_up_domain,
        offloaded_expert_share: offloaded,
    };
    let input = (seqs * SGLANG_PROMPT) as f64 * 1e6 / step_cost(&hw, &v3, &prefill, eff).total_us;
    (input, output)
}

/// The V4-Pro Mega MoE layer at 512 tokens per rank on EP8 (B200), in µs:
/// its experts' weights and FLOPs, and the dispatch and combine over NVLink.
fn mega_moe_small_us(eff: Efficiency) -> f64 {
    let hw = HardwareKind::B200.spec();
    let v4_pro = ModelCost {
        hidden: 7168,
        experts: 384,
        experts_per_token: 6,
        expert_inter: 3072,
        layers: 1,
        dense_layers: 0,
        ..ModelKind::V4Flash.cost()
    };
    let tokens = 512;
    let step = DeviceStep {
        sequences: Vec::new(),
        expert_tokens: tokens * v4_pro.experts_per_token,
        experts_hit: v4_pro.experts / 8,
        expert_parallel: 8,
        scale_up_domain: 8,
        offloaded_expert_share: 0.0,
    };
    let kernels = step_cost(&hw, &v4_pro, &step, eff);
    kernels.compute_us + kernels.memory_us
}

/// Blackwell's points: the SM100 kernel figures that set [`blackwell::efficiency`],
/// and deployments that only check it.
pub fn blackwell_points(eff: Efficiency) -> Vec<Point> {
    let mut out = vec![Point {
        role: Role::Calibration,
        source: "DeepGEMM Mega MoE, SM100",
        what: "V4-Pro experts, EP8, 512 tokens per rank: one MoE layer".to_string(),
        unit: "µs",
        published: blackwell::MEGA_MOE_SMALL_US,
        modelled: mega_moe_small_us(eff),
        bound: 0.1,
    }];
    let v41 = ModelKind::V41Flash.cost();
    let gb200 = HardwareKind::Gb200.spec();
    let step = DeviceStep {
        scale_up_domain: gb200.scale_up_domain,
        ..decode_step(&v41, 64, 64, V41_DECODE_SEQS, V41_DECODE_CONTEXT)
    };
    let cost = step_cost(&gb200, &v41, &step, eff);
    out.push(Point {
        role: Role::Check,
        source: "DeepSeek V4.1-Flash production",
        what: format!(
            "decode EP64 GB200 NVL72 (assumed), {V41_DECODE_SEQS} seqs/GPU × {V41_DECODE_CONTEXT} ctx, no drafts: tokens/s per user"
        ),
        unit: "tok/s",
        published: 230.0,
        modelled: 1e6 / cost.total_us,
        // Hardware, context and drafting are assumed.
        bound: 0.2,
    });
    let seqs = PREFILL_TOKENS_PER_GPU / V41_PREFILL_NEW;
    let step = DeviceStep {
        sequences: vec![SeqWork { new_tokens: V41_PREFILL_NEW, context: V41_PREFILL_CACHED }; seqs],
        expert_tokens: seqs * V41_PREFILL_NEW * v41.experts_per_token,
        experts_hit: (v41.experts + 64).div_ceil(64),
        expert_parallel: 64,
        scale_up_domain: gb200.scale_up_domain,
        offloaded_expert_share: 0.0,
    };
    let input = (seqs * (V41_PREFILL_NEW + V41_PREFILL_CACHED)) as f64;
    out.push(Point {
        role: Role::Check,
        source: "DeepSeek V4.1-Flash production",
        what: format!(
            "prefill EP64 GB200 NVL72 (assumed), {V41_PREFILL_NEW} new after {V41_PREFILL_CACHED} cached: input tokens/s per GPU"
        ),
        unit: "tok/s",
        published: V41_PREFILL_PER_GPU,
        modelled: input * 1e6 / step_cost(&gb200, &v41, &step, eff).total_us,
        // The hardware and the split of new and cached tokens per turn are
        // assumed; the modelled figure is 27% low.
        bound: 0.3,
    });
    for (fp8_kv_and_fp4, (what, input, output)) in [true, false].into_iter().zip(SGLANG_GB200) {
        let (modelled_input, modelled_output) = sglang_gb200(fp8_kv_and_fp4, eff);
        out.push(Point {
            role: Role::Check,
            source: "SGLang, GB200 NVL72",
            what: format!("prefill, {what}, 2000-token prompts: input tokens/s per GPU"),
            unit: "tok/s",
            published: input,
            modelled: modelled_input,
            // Not fitted on; SGLang's prefill step size is not published.
            bound: 0.25,
        });
        out.push(Point {
            role: Role::Check,
            source: "SGLang, GB200 NVL72",
            what: format!("decode EP48, {what}, 2000 ctx: output tokens/s per GPU"),
            unit: "tok/s",
            published: output,
            modelled: modelled_output,
            // Not fitted on; the BF16 run's batch is not published.
            bound: 0.25,
        });
    }
    out
}
