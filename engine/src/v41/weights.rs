//! DeepSeek-V4.1's weights under the published tensor names (the reference's
//! module names: `layers.N.attn.*`, `layers.N.ffn.*`, `layers.N.engram.*`,
//! `mtp.K.*`). Quantised tensors stay as stored; the Engram tables are read in
//! place from the memory-mapped shards.

use std::sync::Arc;

use deepinfer_kernels::act_quant::round_bf16_all;
use deepinfer_kernels::Linear;

use super::config::{LayerPlan, V41Config};
use super::engram::EngramTable;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::model::weights::{is_main_routed_expert, RoutedExperts};

/// FP8 weights share one UE8M0 scale per 32 × 32 block.
pub const FP8_BLOCK: (usize, usize) = (32, 32);

pub struct Compressor {
    pub wkv: Linear,
    /// Softmax-gate logits of the pooled tokens (ratio > 1 only).
    pub wgate: Option<Linear>,
    pub norm: Vec<f32>,
}

pub struct Indexer {
    pub wq_b: Linear,
    pub weights_proj: Linear,
    /// Index-key projection of the compressed latent (KV-source layers only).
    pub wk: Option<(Linear, Vec<f32>)>,
}

pub struct Attention {
    pub sink: Vec<f32>,
    pub wq_a: Linear,
    pub q_norm: Vec<f32>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: Vec<f32>,
    /// Block-diagonal output projection `[groups · o_lora, heads · head_dim / groups]`,
    /// as stored; used as bf16 values (see `attention::output_projection`).
    pub wo_a: Linear,
    pub wo_b: Linear,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
}

pub struct Expert {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

pub struct Moe {
    /// Router weight `[experts, dim]`, bf16 values.
    pub gate: Linear,
    pub bias: Vec<f32>,
    /// The bias image-span rows pick their experts with (models with a vision tower).
    pub bias_vl: Option<Vec<f32>>,
    /// The routed experts; empty when they live elsewhere ([`RoutedExperts::Elsewhere`]).
    pub experts: Vec<Arc<Expert>>,
    pub shared: Expert,
    pub n_activated: usize,
}

/// mHC weights of one sublayer.
pub struct HyperConnection {
    /// `[(2 + hc) · hc, hc · dim]`.
    pub mix: Vec<f32>,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

pub struct Engram {
    pub table: EngramTable,
    pub wkv: Linear,
    /// `q_weight · k_weight`, `[hc, dim]` (only ever used as their product).
    pub weight: Vec<f32>,
}

pub struct Block {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HyperConnection,
    pub hc_ffn: HyperConnection,
    pub attn: Attention,
    pub moe: Moe,
    pub engram: Option<Engram>,
}

/// The heads of the last DSpark layer.
pub struct DsparkHeads {
    pub norm: Vec<f32>,
    /// Markov head: embedding `[vocab, rank]` and output `[vocab, rank]`, bf16 values.
    pub markov_embed: Vec<f32>,
    pub markov_head: Linear,
    /// Confidence projection `[1, dim + rank]`.
    pub confidence: Linear,
}

pub struct DsparkLayer {
    pub block: Block,
    /// Projection and norm of the target's concatenated hidden states (first layer only).
    pub main: Option<(Linear, Vec<f32>)>,
    pub heads: Option<DsparkHeads>,
}

pub struct Weights {
    /// `[vocab, dim]` bf16 values.
    pub embed: Linear,
    pub blocks: Vec<Block>,
    pub norm: Vec<f32>,
    /// `[vocab, dim]`, used in f32.
    pub head: Linear,
    pub dspark: Vec<DsparkLayer>,
    /// The vision tower, the aligner and the image span's vectors (`vision_n_layers > 0`).
    pub vision: Option<super::vision::VisionWeights>,
}

pub(crate) struct Loader<'a> {
    pub(crate) ck: &'a Checkpoint,
    pub(crate) cfg: &'a V41Config,
}

impl Loader<'_> {
    fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<Linear, CheckpointError> {
        self.ck.linear(prefix, rows, cols, FP8_BLOCK)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        self.ck.f32_tensor(name, &[len])
    }

    /// A weight the reference holds in bf16 whatever the file stores (an FP8
    /// file is dequantised and rounded, as DeepSeek's converter does).
    fn bf16_values(&self, prefix: &str, rows: usize, cols: usize) -> Result<Vec<f32>, CheckpointError> {
        let w = self.linear(prefix, rows, cols)?;
        let mut out = vec![0.0f32; rows * cols];
        for r in 0..rows {
            w.dequantize_row(r, &mut out[r * cols..(r + 1) * cols]);
        }
        round_bf16_all(&mut out);
        Ok(out)
    }

    fn hyper(&self, prefix: &str) -> Result<HyperConnection, CheckpointError> {
        let hc = self.cfg.hc_mult;
        let outputs = (2 + hc) * hc;
        let scale = self.vector(&format!("{prefix}_scale"), 3)?;
        Ok(HyperConnection {
            mix: self.ck.f32_tensor(&format!("{prefix}_fn"), &[outputs, hc * self.cfg.dim])?,
            base: self.vector(&format!("{prefix}_base"), outputs)?,
            scale: [scale[0], scale[1], scale[2]],
        })
    }

    pub(crate) fn expert(&self, prefix: &str) -> Result<Expert, CheckpointError> {
        let (d, inter) = (self.cfg.dim, self.cfg.moe_inter_dim);
        Ok(Expert {
            w1: self.linear(&format!("{prefix}.w1"), inter, d)?,
            w2: self.linear(&format!("{prefix}.w2"), d, inter)?,
            w3: self.linear(&format!("{prefix}.w3"), inter, d)?,
        })
    }

    fn moe(&self, prefix: &str, layer: usize, routed: RoutedExperts) -> Result<Moe, CheckpointError> {
        let (e, k) = self.cfg.moe_config(layer);
        let gate = self.linear(&format!("{prefix}.gate"), e, self.cfg.dim)?;
        if gate.format.is_quantized() {
            return Err(self.ck.get(&format!("{prefix}.gate.weight"))?.error("the router must be BF16 or F32".into()));
        }
        Ok(Moe {
            gate,
            bias: self.vector(&format!("{prefix}.gate.bias"), e)?,
            bias_vl: match self.cfg.vision {
                Some(_) => Some(self.vector(&format!("{prefix}.gate.bias_vl"), e)?),
                None => None,
            },
            experts: match routed {
                RoutedExperts::Resident => (0..e)
                    .map(|i| self.expert(&format!("{prefix}.experts.{i}")).map(Arc::new))
                    .collect::<Result<_, _>>()?,
                RoutedExperts::Elsewhere => Vec::new(),
            },
            shared: self.expert(&format!("{prefix}.shared_experts"))?,
            n_activated: k,
        })
    }

    fn attention(&self, prefix: &str, layer: usize, plan: Option<&LayerPlan>) -> Result<Attention, CheckpointError> {
        let c = self.cfg;
        let d = c.dim;
        let qdim = c.n_heads * c.head_dim;
        let group_in = qdim / c.o_groups;
        let compressor = match plan {
            Some(p) if p.owns_compressor(layer) => Some(Compressor {
                wkv: self.linear(&format!("{prefix}.compressor.wkv"), c.head_dim, d)?,
                wgate: if p.ratio > 1 {
                    Some(self.linear(&format!("{prefix}.compressor.wgate"), c.head_dim, d)?)
                } else {
                    None
                },
                norm: self.vector(&format!("{prefix}.compressor.norm.weight"), c.head_dim)?,
            }),
            _ => None,
        };
        let indexer = match plan {
            Some(p) if p.runs_indexer(layer) => Some(Indexer {
                wq_b: self.linear(
                    &format!("{prefix}.indexer.wq_b"),
                    c.index_n_heads * c.index_head_dim,
                    c.q_lora_rank,
                )?,
                weights_proj: self.linear(&format!("{prefix}.indexer.weights_proj"), c.index_n_heads, d)?,
                wk: if p.owns_compressor(layer) {
                    Some((
                        self.linear(&format!("{prefix}.indexer.wk"), c.index_head_dim, c.head_dim)?,
                        self.vector(&format!("{prefix}.indexer.k_norm.weight"), c.index_head_dim)?,
                    ))
                } else {
                    None
                },
            }),
            _ => None,
        };
        Ok(Attention {
            sink: self.vector(&format!("{prefix}.attn_sink"), c.n_heads)?,
            wq_a: self.linear(&format!("{prefix}.wq_a"), c.q_lora_rank, d)?,
            q_norm: self.vector(&format!("{prefix}.q_norm.weight"), c.q_lora_rank)?,
            wq_b: self.linear(&format!("{prefix}.wq_b"), qdim, c.q_lora_rank)?,
            wkv: self.linear(&format!("{prefix}.wkv"), c.head_dim, d)?,
            kv_norm: self.vector(&format!("{prefix}.kv_norm.weight"), c.head_dim)?,
            wo_a: self.linear(&format!("{prefix}.wo_a"), c.o_groups * c.o_lora_rank, group_in)?,
            wo_b: self.linear(&format!("{prefix}.wo_b"), d, c.o_groups * c.o_lora_rank)?,
            compressor,
            indexer,
        })
    }

    fn engram(&self, prefix: &str, slot: usize) -> Result<Engram, CheckpointError> {
        let c = self.cfg;
        let e = c.engram.as_ref().expect("engram layer without config");
        let rows = e.num_embeddings[slot];
        let table = self.ck.get(&format!("{prefix}.embed.weight"))?;
        table.expect_shape(&[rows, e.head_dim])?;
        if table.dtype != safetensors::Dtype::F8_E4M3 {
            return Err(table.error(format!("Engram table must be F8_E4M3, found {:?}", table.dtype)));
        }
        let scale = self.ck.get(&format!("{prefix}.embed.scale"))?;
        scale.expect_shape(&[rows, e.head_dim / 32])?;
        if !matches!(scale.dtype, safetensors::Dtype::F8_E8M0 | safetensors::Dtype::U8) {
            return Err(scale.error(format!("Engram scales must be F8_E8M0, found {:?}", scale.dtype)));
        }
        let q = self.ck.f32_tensor(&format!("{prefix}.q_weight"), &[c.hc_mult, c.dim])?;
        let k = self.ck.f32_tensor(&format!("{prefix}.k_weight"), &[c.hc_mult, c.dim])?;
        Ok(Engram {
            table: EngramTable { rows, dim: e.head_dim, values: table.bytes.clone(), scales: scale.bytes.clone() },
            wkv: self.linear(&format!("{prefix}.wkv"), c.dim * (c.hc_mult + 1), e.hash_cols() * e.head_dim)?,
            weight: q.iter().zip(&k).map(|(a, b)| a * b).collect(),
        })
    }

    fn block(
        &self,
        prefix: &str,
        layer: usize,
        plan: Option<&LayerPlan>,
        routed: RoutedExperts,
    ) -> Result<Block, CheckpointError> {
        let d = self.cfg.dim;
        let engram = match plan.and_then(|p| p.engram) {
            Some(slot) => Some(self.engram(&format!("{prefix}.engram"), slot)?),
            None => None,
        };
        Ok(Block {
            attn_norm: self.vector(&format!("{prefix}.attn_norm.weight"), d)?,
            ffn_norm: self.vector(&format!("{prefix}.ffn_norm.weight"), d)?,
            hc_attn: self.hyper(&format!("{prefix}.hc_attn"))?,
            hc_ffn: self.hyper(&format!("{prefix}.hc_ffn"))?,
            attn: self.attention(&format!("{prefix}.attn"), layer, plan)?,
            moe: self.moe(&format!("{prefix}.ffn"), layer, routed)?,
            engram,
        })
    }
}

impl Weights {
    pub fn load(ck: &Checkpoint, cfg: &V41Config) -> Result<Self, CheckpointError> {
        Self::load_with(ck, cfg, RoutedExperts::Resident)
    }

    /// [`Weights::load`], with the main layers' routed experts where `routed` says
    /// (the DSpark layers keep theirs).
    pub fn load_with(ck: &Checkpoint, cfg: &V41Config, routed: RoutedExperts) -> Result<Self, CheckpointError> {
        let l = Loader { ck, cfg };
        let (v, d) = (cfg.vocab_size, cfg.dim);
        let blocks = (0..cfg.n_layers)
            .map(|i| l.block(&format!("layers.{i}"), i, Some(&cfg.layers[i]), routed))
            .collect::<Result<Vec<_>, _>>()?;
        let mut dspark = Vec::new();
        if let Some(ds) = &cfg.dspark {
            for k in 0..cfg.n_mtp_layers {
                let p = format!("mtp.{k}");
                let block = l.block(&p, cfg.n_layers + k, None, RoutedExperts::Resident)?;
                let main = if k == 0 {
                    Some((
                        l.linear(&format!("{p}.main_proj"), d, d * ds.target_layer_ids.len())?,
                        l.vector(&format!("{p}.main_norm.weight"), d)?,
                    ))
                } else {
                    None
                };
                let heads = if k + 1 == cfg.n_mtp_layers {
                    Some(DsparkHeads {
                        norm: l.vector(&format!("{p}.norm.weight"), d)?,
                        markov_embed: l.bf16_values(&format!("{p}.markov_head.embed"), v, ds.markov_rank)?,
                        markov_head: l.linear(&format!("{p}.markov_head.head"), v, ds.markov_rank)?,
                        confidence: l.linear(&format!("{p}.confidence_head.proj"), 1, d + ds.markov_rank)?,
                    })
                } else {
                    None
                };
                dspark.push(DsparkLayer { block, main, heads });
            }
        }
        let weights = Self {
            embed: l.linear("embed", v, d)?,
            blocks,
            norm: l.vector("norm.weight", d)?,
            head: l.linear("head", v, d)?,
            dspark,
            vision: match &cfg.vision {
                Some(v) => Some(super::vision::VisionWeights::load(ck, v, d)?),
                None => None,
            },
        };
        // A text-only config (no `vision_n_layers`) leaves a checkpoint's vision tower unread: it refuses images.
        ck.check_all_used(|name| {
            name.starts_with("vision.")
                || name.starts_with("aligner.")
                || name.starts_with("image_")
                || name.ends_with(".gate.bias_vl")
                || (routed == RoutedExperts::Elsewhere && is_main_routed_expert(name))
        })?;
        Ok(weights)
    }
}
