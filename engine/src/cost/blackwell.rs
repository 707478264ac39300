//! Blackwell (SM100: B200, GB200, GB300) in the cost model: the achieved
//! fractions of peak that DeepSeek's own kernels publish on SM100, and the
//! operating points that set and check them. The Hopper fractions
//! ([`Efficiency::default`]) came from the same libraries on H800; on
//! Blackwell every library reaches a smaller share of a much larger peak.

use super::{Efficiency, HardwareKind};

/// DeepGEMM's Mega MoE (FP8 activations × FP4 weights, dispatch, both
/// GEMMs, SwiGLU and combine fused) on SM100, DeepSeek-V4-Pro's shapes
/// (hidden 7168, 384 experts of 3072, top-6) on EP8 (DeepGEMM PR #316):
/// 2,438 TFLOPS at 32,768 tokens per rank; 369.6 µs at 512 tokens per rank.
const MEGA_MOE_TFLOPS: f64 = 2438.0;
pub(crate) const MEGA_MOE_SMALL_US: f64 = 369.6;
/// FlashMLA's sparse MLA prefill on B200 (README): up to 1,450 TFLOPS of BF16.
const FLASHMLA_PREFILL_TFLOPS: f64 = 1450.0;
/// FlashMLA's sparse decoding on B200 (README: FP8 cache, BF16 matmuls):
/// up to 350 TFLOPS, "not really optimized yet" (410 on H800).
const FLASHMLA_DECODE_TFLOPS: f64 = 350.0;
/// DeepEP V2 on SM100, EP8 over NVLink with 24 SMs (README): dispatch
/// 643 GB/s, combine 675 GB/s (8K tokens, hidden 7168, top-8, FP8 dispatch).
const DEEPEP_NVLINK_GB_S: [f64; 2] = [643.0, 675.0];
/// SMs DeepEP V2 takes for that bandwidth, of B200's 148.
const DEEPEP_SMS: f64 = 24.0;
const SM100_SMS: f64 = 148.0;

/// DeepGEMM's normal GEMMs reach 1.2× its grouped ones on H800 (1,500 and
/// 1,250 TFLOPS); DeepGEMM publishes no dense SM100 figure, so the dense
/// fraction keeps that ratio to the grouped one measured on SM100.
const DENSE_OVER_GROUPED: f64 = 1500.0 / 1250.0;

/// The achieved fractions on SM100.
pub fn efficiency() -> Efficiency {
    let b200 = HardwareKind::B200.spec();
    let expert_gemm = MEGA_MOE_TFLOPS / b200.fp8_tflops;
    let network = (DEEPEP_NVLINK_GB_S[0] + DEEPEP_NVLINK_GB_S[1]) / 2.0 / b200.scale_up_gb_s;
    Efficiency {
        dense_gemm: expert_gemm * DENSE_OVER_GROUPED,
        expert_gemm,
        attention: FLASHMLA_PREFILL_TFLOPS / b200.bf16_tflops,
        attention_decode: FLASHMLA_DECODE_TFLOPS / b200.bf16_tflops,
        memory: MEMORY,
        network,
        // No low-latency figure is published for SM100: the normal kernels' share of the link.
        network_low_latency: network,
        comm_sm_share: DEEPEP_SMS / SM100_SMS,
        ..Efficiency::default()
    }
}

/// HBM streaming on SM100, from the Mega MoE at 512 tokens per rank
/// (V4-Pro's experts on EP8): the fraction that gives its 369.6 µs with
/// the grouped-GEMM rate above (`calibration::blackwell_points` holds it to that).
const MEMORY: f64 = 0.60;
