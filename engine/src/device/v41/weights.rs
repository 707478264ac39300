//! A V4.1 model's weights in a device's memory, uploaded once from the
//! loaded CPU weights (`v41::weights`): every matrix in its published layout
//! and format (the kernels decode FP8 and FP4 inside the product), vectors
//! as f32. Two weights change form: the mHC mixes become F32 linears (the
//! plain product gives `dot_f64_rows`' bits), and the grouped `wo_a`, which
//! the reference holds in bf16, is uploaded as its bf16 values, one F32
//! linear per group (`attention::output_projection`).

use deepinfer_cuda::ops::linear::DeviceLinear;
use deepinfer_cuda::ops::v41_model::DeviceEngramTable;
use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};
use deepinfer_kernels::act_quant::round_bf16_all;
use deepinfer_kernels::Linear;

use crate::v41::config::V41Config;
use crate::v41::weights::{Attention, Block, Compressor, Engram, Expert, HyperConnection, Indexer, Moe, Weights};

pub(crate) struct DeviceHyper {
    pub mix: DeviceLinear,
    pub base: DeviceBuffer<f32>,
    pub scale: [f32; 3],
}

pub(crate) struct DeviceCompressor {
    pub wkv: DeviceLinear,
    pub wgate: Option<DeviceLinear>,
    pub norm: DeviceBuffer<f32>,
}

pub(crate) struct DeviceIndexer {
    pub wq_b: DeviceLinear,
    pub weights_proj: DeviceLinear,
    pub wk: Option<(DeviceLinear, DeviceBuffer<f32>)>,
}

pub(crate) struct DeviceAttention {
    pub sink: DeviceBuffer<f32>,
    pub wq_a: DeviceLinear,
    pub q_norm: DeviceBuffer<f32>,
    pub wq_b: DeviceLinear,
    pub wkv: DeviceLinear,
    pub kv_norm: DeviceBuffer<f32>,
    /// Per output group: its `[o_lora_rank, group_in]` rows of `wo_a` as bf16 values.
    pub wo_a: Vec<DeviceLinear>,
    pub wo_b: DeviceLinear,
    pub compressor: Option<DeviceCompressor>,
    pub indexer: Option<DeviceIndexer>,
}

pub(crate) struct DeviceExpert {
    pub w1: DeviceLinear,
    pub w2: DeviceLinear,
    pub w3: DeviceLinear,
}

pub(crate) struct DeviceMoe {
    pub gate: DeviceLinear,
    pub bias: DeviceBuffer<f32>,
    pub experts: Vec<DeviceExpert>,
    pub shared: DeviceExpert,
    pub k: usize,
}

pub(crate) struct DeviceEngram {
    pub table: DeviceEngramTable,
    pub wkv: DeviceLinear,
    pub weight: DeviceBuffer<f32>,
}

pub(crate) struct DeviceBlock {
    pub attn_norm: DeviceBuffer<f32>,
    pub ffn_norm: DeviceBuffer<f32>,
    pub hc_attn: DeviceHyper,
    pub hc_ffn: DeviceHyper,
    pub attn: DeviceAttention,
    pub moe: DeviceMoe,
    pub engram: Option<DeviceEngram>,
}

pub(crate) struct DeviceWeightsV41 {
    pub embed: DeviceLinear,
    pub blocks: Vec<DeviceBlock>,
    pub norm: DeviceBuffer<f32>,
    pub head: DeviceLinear,
}

struct Uploader<'a> {
    gpu: &'a Gpu,
    cfg: &'a V41Config,
}

impl Uploader<'_> {
    fn linear(&self, w: &Linear) -> Result<DeviceLinear, DeviceError> {
        DeviceLinear::upload(self.gpu, w)
    }

    fn vector(&self, v: &[f32]) -> Result<DeviceBuffer<f32>, DeviceError> {
        self.gpu.upload(v)
    }

    fn hyper(&self, h: &HyperConnection) -> Result<DeviceHyper, DeviceError> {
        let cols = self.cfg.hc_mult * self.cfg.dim;
        let mix = Linear::from_f32(h.mix.len() / cols, cols, h.mix.clone());
        Ok(DeviceHyper { mix: self.linear(&mix)?, base: self.vector(&h.base)?, scale: h.scale })
    }

    fn compressor(&self, c: &Compressor) -> Result<DeviceCompressor, DeviceError> {
        Ok(DeviceCompressor {
            wkv: self.linear(&c.wkv)?,
            wgate: c.wgate.as_ref().map(|w| self.linear(w)).transpose()?,
            norm: self.vector(&c.norm)?,
        })
    }

    fn indexer(&self, ix: &Indexer) -> Result<DeviceIndexer, DeviceError> {
        Ok(DeviceIndexer {
            wq_b: self.linear(&ix.wq_b)?,
            weights_proj: self.linear(&ix.weights_proj)?,
            wk: match &ix.wk {
                Some((w, norm)) => Some((self.linear(w)?, self.vector(norm)?)),
                None => None,
            },
        })
    }

    /// `wo_a`'s rows of each group dequantised and rounded to bf16.
    fn grouped_wo_a(&self, w: &Linear) -> Result<Vec<DeviceLinear>, DeviceError> {
        let (groups, rank) = (self.cfg.o_groups, self.cfg.o_lora_rank);
        assert_eq!(w.rows, groups * rank, "wo_a rows");
        (0..groups)
            .map(|g| {
                let mut values = vec![0.0f32; rank * w.cols];
                for (r, row) in values.chunks_exact_mut(w.cols.max(1)).enumerate() {
                    w.dequantize_row(g * rank + r, row);
                }
                round_bf16_all(&mut values);
                self.linear(&Linear::from_f32(rank, w.cols, values))
            })
            .collect()
    }

    fn attention(&self, a: &Attention) -> Result<DeviceAttention, DeviceError> {
        Ok(DeviceAttention {
            sink: self.vector(&a.sink)?,
            wq_a: self.linear(&a.wq_a)?,
            q_norm: self.vector(&a.q_norm)?,
            wq_b: self.linear(&a.wq_b)?,
            wkv: self.linear(&a.wkv)?,
            kv_norm: self.vector(&a.kv_norm)?,
            wo_a: self.grouped_wo_a(&a.wo_a)?,
            wo_b: self.linear(&a.wo_b)?,
            compressor: a.compressor.as_ref().map(|c| self.compressor(c)).transpose()?,
            indexer: a.indexer.as_ref().map(|ix| self.indexer(ix)).transpose()?,
        })
    }

    fn expert(&self, e: &Expert) -> Result<DeviceExpert, DeviceError> {
        Ok(DeviceExpert { w1: self.linear(&e.w1)?, w2: self.linear(&e.w2)?, w3: self.linear(&e.w3)? })
    }

    fn moe(&self, m: &Moe) -> Result<DeviceMoe, DeviceError> {
        Ok(DeviceMoe {
            gate: self.linear(&m.gate)?,
            bias: self.vector(&m.bias)?,
            experts: m.experts.iter().map(|e| self.expert(e)).collect::<Result<_, _>>()?,
            shared: self.expert(&m.shared)?,
            k: m.n_activated,
        })
    }

    fn engram(&self, e: &Engram) -> Result<DeviceEngram, DeviceError> {
        let t = &e.table;
        Ok(DeviceEngram {
            table: DeviceEngramTable::upload(self.gpu, t.rows, t.dim, &t.values, &t.scales)?,
            wkv: self.linear(&e.wkv)?,
            weight: self.vector(&e.weight)?,
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
            engram: b.engram.as_ref().map(|e| self.engram(e)).transpose()?,
        })
    }
}

impl DeviceWeightsV41 {
    /// The backbone's weights on `gpu` (the DSpark layers stay on the host:
    /// a device model drafts nothing). The routed experts must be resident.
    pub(crate) fn upload(gpu: &Gpu, cfg: &V41Config, weights: &Weights) -> Result<Self, DeviceError> {
        let up = Uploader { gpu, cfg };
        assert_eq!(weights.blocks.len(), cfg.n_layers, "a block per layer");
        Ok(Self {
            embed: up.linear(&weights.embed)?,
            blocks: weights.blocks.iter().map(|b| up.block(b)).collect::<Result<_, _>>()?,
            norm: up.vector(&weights.norm)?,
            head: up.linear(&weights.head)?,
        })
    }
}
