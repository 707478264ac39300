//! The image encoder in the cost model: DeepSeek-V4.1's vision tower (ViT)
//! and 3×3 aligner, priced per image on an accelerator from the tower's
//! shapes (`v41::vision`, DESIGN.md "Images").
//!
//! One image of `n` patches and `m` aligner rows costs
//! - the patch embedding, `2·n·(3·p²)·d`;
//! - per block, the projections `2·n·(4·d²)` (Q, K, V, O) and the SwiGLU
//!   `2·n·(3·d·f)`, and the bidirectional attention core `4·n²·d` (QKᵀ and
//!   PV over the whole image: the quadratic term, which dominates past a few
//!   thousand patches);
//! - the aligner, `2·m·(r²·d·h) + 2·m·h²` (unfold → `h`, then `h → h`).
//!
//! The ViT runs in bf16: the projections at the dense-GEMM fraction of the
//! bf16 peak (`Efficiency::dense_gemm`: DeepGEMM's normal GEMMs, the closest
//! published figure for large dense GEMMs, measured in FP8 and applied here
//! to bf16's peak), the attention core at the prefill attention fraction
//! (`Efficiency::attention`: FlashMLA's prefill, the closest kernel to a
//! FlashAttention-style dense core). Weights are read once per image (one
//! image per device at a time) against the memory fraction; the time is the
//! roofline of the two plus the per-layer overhead. Images are encoded one
//! per device: the tower (about 1 GB in bf16) fits every device, so an
//! encoder instance is data-parallel over its devices.

use super::{Efficiency, Hardware, ModelKind};
use crate::v41::vision::{plan_image, ImageError, ImagePlan, VisionConfig};

/// Bytes per value of the tower's weights and of the aligner rows sent on (bf16).
const BF16_BYTES: f64 = 2.0;

/// A model's image encoder, for pricing.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionCost {
    pub config: VisionConfig,
    /// The text model's hidden size: the aligner's output width.
    pub llm_dim: usize,
}

/// The published DeepSeek-V4.1 vision keys (`ModelArgs`' defaults, which
/// `VisionConfig::read` also takes): 32 blocks of width 1024, 16 heads,
/// SwiGLU 2816, 14-pixel patches, a 3×3 aligner, at least 544² pixels, at
/// most 1,024 tokens an image.
pub fn published_vision() -> VisionConfig {
    VisionConfig {
        n_layers: 32,
        dim: 1024,
        n_heads: 16,
        inter_dim: 2816,
        patch_size: 14,
        rope_theta: 10000.0,
        downsample_ratio: 3,
        max_n_token: 1024,
        min_pixels: 544 * 544,
        max_wh_ratio: None,
        image_token_id: 129264,
    }
}

impl VisionCost {
    /// The image encoder of `model`, or `None` when it takes no images
    /// (DeepSeek-V3 / R1 and V4-Flash have no vision tower).
    pub fn of(model: ModelKind) -> Option<Self> {
        match model {
            ModelKind::V41Flash => Some(Self { config: published_vision(), llm_dim: model.cost().hidden }),
            ModelKind::DeepSeekV3 | ModelKind::V4Flash => None,
        }
    }

    /// The resize plan of a `width × height` image (its patches and tokens).
    pub fn plan(&self, width: usize, height: usize) -> Result<ImagePlan, ImageError> {
        plan_image(width, height, &self.config)
    }

    /// Parameters of the tower and the aligner.
    pub fn params(&self) -> f64 {
        let c = &self.config;
        let (d, f) = (c.dim as f64, c.inter_dim as f64);
        let patch_in = (3 * c.patch_size * c.patch_size) as f64;
        let r2 = (c.downsample_ratio * c.downsample_ratio) as f64;
        let h = self.llm_dim as f64;
        let per_block = 4.0 * d * d + 3.0 * d * f;
        patch_in * d + c.n_layers as f64 * per_block + r2 * d * h + h * h
    }

    pub fn weight_bytes(&self) -> f64 {
        self.params() * BF16_BYTES
    }

    /// FLOPs of one image: `(projections and aligner, attention core)`.
    pub fn flops(&self, plan: &ImagePlan) -> (f64, f64) {
        let c = &self.config;
        let n = (plan.n_vit_h * plan.n_vit_w) as f64;
        let m = (plan.n_llm_h * plan.n_llm_w) as f64;
        let (d, f) = (c.dim as f64, c.inter_dim as f64);
        let patch_in = (3 * c.patch_size * c.patch_size) as f64;
        let r2 = (c.downsample_ratio * c.downsample_ratio) as f64;
        let h = self.llm_dim as f64;
        let layers = c.n_layers as f64;
        let dense = 2.0 * n * patch_in * d
            + layers * 2.0 * n * (4.0 * d * d + 3.0 * d * f)
            + 2.0 * m * r2 * d * h
            + 2.0 * m * h * h;
        let attention = layers * 4.0 * n * n * d;
        (dense, attention)
    }

    /// Device time of encoding one image on `hw`, µs.
    pub fn encode_us(&self, plan: &ImagePlan, hw: &Hardware, eff: Efficiency) -> f64 {
        let (dense, attention) = self.flops(plan);
        let compute_s = dense / (hw.bf16_flops() * eff.dense_gemm) + attention / (hw.bf16_flops() * eff.attention);
        // Weights once, activations (patches × width, bf16) in and out of each block.
        let n = (plan.n_vit_h * plan.n_vit_w) as f64;
        let activations = self.config.n_layers as f64 * 2.0 * n * self.config.dim as f64 * BF16_BYTES;
        let memory_s = (self.weight_bytes() + activations) / (hw.hbm_bytes_per_s() * eff.memory);
        compute_s.max(memory_s) * 1e6 + (self.config.n_layers + 1) as f64 * eff.layer_overhead_us
    }

    /// Bytes of an image's encoded rows (the whole span, bf16, at the text
    /// model's width): what an encoder caches and sends to the prefill instance.
    pub fn rows_bytes(&self, plan: &ImagePlan) -> u64 {
        (plan.tokens() as f64 * self.llm_dim as f64 * BF16_BYTES) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::HardwareKind;

    #[test]
    fn only_v41_has_a_tower_and_its_size_is_the_published_one() {
        assert!(VisionCost::of(ModelKind::DeepSeekV3).is_none());
        assert!(VisionCost::of(ModelKind::V4Flash).is_none());
        let v = VisionCost::of(ModelKind::V41Flash).unwrap();
        // 32 × (4·1024² + 3·1024·2816) + 588·1024 + 9216·5120 + 5120² ≈ 485 M.
        let p = v.params();
        assert!((480e6..490e6).contains(&p), "{p}");
    }

    #[test]
    fn the_largest_image_is_attention_bound_and_tens_of_ms_on_h100() {
        let v = VisionCost::of(ModelKind::V41Flash).unwrap();
        let big = v.plan(1920, 1080).unwrap();
        assert!(big.tokens() <= 1024);
        let (dense, attention) = v.flops(&big);
        assert!(attention > dense, "{attention} vs {dense}");
        let h100 = HardwareKind::H100.spec();
        let us = v.encode_us(&big, &h100, Efficiency::default());
        assert!((10_000.0..60_000.0).contains(&us), "{us} µs");
        // A small image is scaled up to 544²: far cheaper, but not free.
        let small = v.plan(320, 240).unwrap();
        let small_us = v.encode_us(&small, &h100, Efficiency::default());
        assert!(small_us < us / 2.0 && small_us > 1000.0, "{small_us}");
        // Faster on B200 than on H100.
        let b200 = HardwareKind::B200.spec();
        assert!(v.encode_us(&big, &b200, Efficiency::for_hardware(HardwareKind::B200)) < us);
    }

    #[test]
    fn rows_are_the_span_at_the_text_width_in_bf16() {
        let v = VisionCost::of(ModelKind::V41Flash).unwrap();
        let plan = v.plan(1024, 1024).unwrap();
        assert_eq!(v.rows_bytes(&plan), plan.tokens() as u64 * 5120 * 2);
    }
}
