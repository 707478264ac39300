//! The number formats a deployment stores and computes in: routed experts,
//! the other weights (attention projections, shared experts, dense layers,
//! head), and the KV cache. Each format has a storage size (bits per value,
//! its block scales included) and a tensor-core rate on a given accelerator.

use super::Hardware;

/// How weights are stored, and what the GEMMs that read them run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum WeightFormat {
    Bf16,
    /// E4M3 with a scale per 128×128 block (DeepSeek's checkpoints).
    Fp8,
    /// E2M1 with a UE8M0 scale per 32 (OCP MX), multiplied with FP8
    /// activations as DeepSeek-V4 runs its experts: the FP8 tensor-core rate.
    Mxfp4,
    /// E2M1 with an E4M3 scale per 16 and one per tensor (NVIDIA), with the
    /// activations quantised to NVFP4 too: the FP4 tensor-core rate where
    /// the part has one, FP8's where it does not.
    Nvfp4,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 4] = [Self::Bf16, Self::Fp8, Self::Mxfp4, Self::Nvfp4];

    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
            Self::Mxfp4 => "mxfp4",
            Self::Nvfp4 => "nvfp4",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name().eq_ignore_ascii_case(name))
    }

    /// Stored bits per weight, scales included (FP8's one f32 per 16,384
    /// weights is left out: 0.002 bits).
    pub fn bits(self) -> f64 {
        match self {
            Self::Bf16 => 16.0,
            Self::Fp8 => 8.0,
            Self::Mxfp4 => 4.0 + 8.0 / 32.0,
            Self::Nvfp4 => 4.0 + 8.0 / 16.0,
        }
    }

    /// Peak tensor-core FLOP/s of a GEMM reading weights in this format.
    pub fn flops(self, hw: &Hardware) -> f64 {
        match self {
            Self::Bf16 => hw.bf16_flops(),
            Self::Fp8 | Self::Mxfp4 => hw.fp8_flops(),
            Self::Nvfp4 => hw.fp4_tflops.map_or(hw.fp8_flops(), |t| t * 1e12),
        }
    }
}

/// How the KV cache is stored, and what the attention core runs at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum KvFormat {
    /// BF16 values; the attention core in BF16.
    Bf16,
    /// FP8 E4M3 values with a scale per 128; the attention core on FP8
    /// tensor cores (FlashMLA's and TensorRT-LLM's FP8 MLA kernels).
    Fp8,
    /// V4.1's own layout: FP8 window rows, FP4 compressed entries and
    /// indexer keys (`cost::v41`); the core computes in BF16.
    V41Mixed,
}

impl KvFormat {
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
            Self::V41Mixed => "fp4",
        }
    }

    /// Bytes per cached element (V4.1's layout carries its own sizes).
    pub fn element_bytes(self) -> f64 {
        match self {
            Self::Bf16 => 2.0,
            Self::Fp8 => 1.0 + 4.0 / 128.0,
            Self::V41Mixed => 1.0,
        }
    }

    /// Peak FLOP/s of the attention core reading this cache.
    pub fn flops(self, hw: &Hardware) -> f64 {
        match self {
            Self::Fp8 => hw.fp8_flops(),
            Self::Bf16 | Self::V41Mixed => hw.bf16_flops(),
        }
    }
}

/// A deployment's formats; [`super::ModelCost::with_precision`] applies it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Precision {
    /// Routed experts (`None`: the checkpoint's).
    pub experts: Option<WeightFormat>,
    /// Every other weight (`None`: the checkpoint's).
    pub dense: Option<WeightFormat>,
    /// The KV cache (`None`: the model's own).
    pub kv: Option<KvFormat>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::HardwareKind;

    #[test]
    fn four_bit_formats_carry_their_scales_and_their_rates() {
        assert_eq!(WeightFormat::Mxfp4.bits(), 4.25);
        assert_eq!(WeightFormat::Nvfp4.bits(), 4.5);
        let (h100, b200) = (HardwareKind::H100.spec(), HardwareKind::B200.spec());
        // W4A8 runs at FP8's rate everywhere; W4A4 at FP4's where there is one.
        assert_eq!(WeightFormat::Mxfp4.flops(&b200), b200.fp8_flops());
        assert_eq!(WeightFormat::Nvfp4.flops(&b200), 2.0 * b200.fp8_flops());
        assert_eq!(WeightFormat::Nvfp4.flops(&h100), h100.fp8_flops());
        for f in WeightFormat::ALL {
            assert_eq!(WeightFormat::from_name(f.name()), Some(f));
        }
    }
}
