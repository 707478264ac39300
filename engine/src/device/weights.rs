//! A V4 model's weights in a device's memory, uploaded once from the loaded
//! CPU weights: every matrix in its published layout and format (the
//! kernels decode FP8 and FP4 inside the product), vectors as f32.

use deepinfer_cuda::ops::compressor::DeviceCompressor;
use deepinfer_cuda::ops::linear::DeviceLinear;
use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};

use crate::config::{AttentionKind, ModelConfig, RoutingKind};
use crate::model::weights::{Attention, Block, Compressor, HyperConnection, HyperHead, Mlp, Moe, Weights};

pub(crate) struct DeviceHyper {
    pub mix: DeviceLinear,
    pub base: DeviceBuffer<f32>,
    pub scale: [f32; 3],
}

pub(crate) struct DeviceHead {
    pub mix: DeviceLinear,
    pub base: DeviceBuffer<f32>,
    pub scale: f32,
}

pub(crate) struct DeviceIndexer {
    pub compressor: DeviceCompressorWeights,
    pub wq_b: DeviceLinear,
    pub weights_proj: DeviceLinear,
}

/// A compressor's projections beside its pooling weights.
pub(crate) struct DeviceCompressorWeights {
    pub pooling: DeviceCompressor,
    pub wkv: DeviceLinear,
    pub wgate: DeviceLinear,
}

pub(crate) struct DeviceAttention {
    pub kind: AttentionKind,
    pub wq_a: DeviceLinear,
    pub q_norm: DeviceBuffer<f32>,
    pub wq_b: DeviceLinear,
    pub wkv: DeviceLinear,
    pub kv_norm: DeviceBuffer<f32>,
    pub wo_a: Vec<DeviceLinear>,
    pub wo_b: DeviceLinear,
    pub sink: DeviceBuffer<f32>,
    pub compressor: Option<DeviceCompressorWeights>,
    pub indexer: Option<DeviceIndexer>,
}

pub(crate) struct DeviceMlp {
    pub w1: DeviceLinear,
    pub w2: DeviceLinear,
    pub w3: DeviceLinear,
}

pub(crate) struct DeviceMoe {
    pub routing: RoutingKind,
    pub gate: DeviceLinear,
    pub bias: Option<DeviceBuffer<f32>>,
    pub tid2eid: Option<DeviceBuffer<i32>>,
    pub experts: Vec<DeviceMlp>,
    pub shared: Option<DeviceMlp>,
}

pub(crate) struct DeviceBlock {
    pub attn_norm: DeviceBuffer<f32>,
    pub ffn_norm: DeviceBuffer<f32>,
    pub hc_attn: DeviceHyper,
    pub hc_ffn: DeviceHyper,
    pub attn: DeviceAttention,
    pub moe: DeviceMoe,
}

pub(crate) struct DeviceWeights {
    pub embed: DeviceLinear,
    pub blocks: Vec<DeviceBlock>,
    pub hc_head: DeviceHead,
    pub norm: DeviceBuffer<f32>,
    pub head: DeviceLinear,
}

struct Uploader<'a> {
    gpu: &'a Gpu,
}

impl Uploader<'_> {
    fn linear(&self, w: &deepinfer_kernels::Linear) -> Result<DeviceLinear, DeviceError> {
        DeviceLinear::upload(self.gpu, w)
    }

    fn vector(&self, v: &[f32]) -> Result<DeviceBuffer<f32>, DeviceError> {
        self.gpu.upload(v)
    }

    fn hyper(&self, h: &HyperConnection) -> Result<DeviceHyper, DeviceError> {
        Ok(DeviceHyper { mix: self.linear(&h.mix)?, base: self.vector(&h.base)?, scale: h.scale })
    }

    fn head(&self, h: &HyperHead) -> Result<DeviceHead, DeviceError> {
        Ok(DeviceHead { mix: self.linear(&h.mix)?, base: self.vector(&h.base)?, scale: h.scale })
    }

    fn compressor(&self, c: &Compressor) -> Result<DeviceCompressorWeights, DeviceError> {
        Ok(DeviceCompressorWeights {
            pooling: DeviceCompressor::new(self.gpu, c.ratio, c.dim, c.overlap, &c.ape, &c.norm)?,
            wkv: self.linear(&c.wkv)?,
            wgate: self.linear(&c.wgate)?,
        })
    }

    fn attention(&self, a: &Attention) -> Result<DeviceAttention, DeviceError> {
        let indexer = match &a.indexer {
            Some(ix) => Some(DeviceIndexer {
                compressor: self.compressor(&ix.compressor)?,
                wq_b: self.linear(&ix.wq_b)?,
                weights_proj: self.linear(&ix.weights_proj)?,
            }),
            None => None,
        };
        Ok(DeviceAttention {
            kind: a.kind,
            wq_a: self.linear(&a.wq_a)?,
            q_norm: self.vector(&a.q_norm)?,
            wq_b: self.linear(&a.wq_b)?,
            wkv: self.linear(&a.wkv)?,
            kv_norm: self.vector(&a.kv_norm)?,
            wo_a: a.wo_a.iter().map(|w| self.linear(w)).collect::<Result<_, _>>()?,
            wo_b: self.linear(&a.wo_b)?,
            sink: self.vector(&a.sink)?,
            compressor: a.compressor.as_ref().map(|c| self.compressor(c)).transpose()?,
            indexer,
        })
    }

    fn mlp(&self, m: &Mlp) -> Result<DeviceMlp, DeviceError> {
        Ok(DeviceMlp { w1: self.linear(&m.w1)?, w2: self.linear(&m.w2)?, w3: self.linear(&m.w3)? })
    }

    fn moe(&self, m: &Moe) -> Result<DeviceMoe, DeviceError> {
        let tid2eid = match &m.tid2eid {
            Some(t) => Some(self.gpu.upload(&t.iter().map(|&e| e as i32).collect::<Vec<i32>>())?),
            None => None,
        };
        Ok(DeviceMoe {
            routing: m.routing,
            gate: self.linear(&m.gate)?,
            bias: m.bias.as_deref().map(|b| self.vector(b)).transpose()?,
            tid2eid,
            experts: m.experts.iter().map(|e| self.mlp(e)).collect::<Result<_, _>>()?,
            shared: m.shared.as_ref().map(|s| self.mlp(s)).transpose()?,
        })
    }

    fn block(&self, b: &Block) -> Result<DeviceBlock, DeviceError> {
        Ok(DeviceBlock {
            attn_norm: self.vector(&b.attn_norm)?,
            ffn_norm: self.vector(&b.ffn_norm)?,
            hc_attn: self.hyper(&b.hc_attn)?,
            hc_ffn: self.hyper(&b.hc_ffn)?,
            attn: self.attention(&b.attn)?,
            moe: self.moe(&b.moe)?,
        })
    }
}

impl DeviceWeights {
    /// Every weight of the main model on `gpu`. The routed experts must be
    /// resident in `weights` (a device model runs all of them itself).
    pub(crate) fn upload(gpu: &Gpu, cfg: &ModelConfig, weights: &Weights) -> Result<Self, DeviceError> {
        let up = Uploader { gpu };
        assert_eq!(weights.blocks.len(), cfg.num_layers, "a block per layer");
        Ok(Self {
            embed: up.linear(&weights.embed)?,
            blocks: weights.blocks.iter().map(|b| up.block(b)).collect::<Result<_, _>>()?,
            hc_head: up.head(&weights.hc_head)?,
            norm: up.vector(&weights.norm)?,
            head: up.linear(&weights.head)?,
        })
    }
}
