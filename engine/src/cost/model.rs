//! Model figures for the cost model: parameter counts, FLOPs per token, KV bytes
//! per token, dispatch bytes, from each model's published configuration.

use super::precision::{KvFormat, Precision, WeightFormat};

/// A model the simulator knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ModelKind {
    /// DeepSeek-V3 / R1: MLA attention, 61 layers (3 dense), 256 experts (8 active).
    DeepSeekV3,
    /// DeepSeek-V4-Flash: window + CSA/HCA attention, 43 layers, 256 experts (6 active), FP4 experts.
    V4Flash,
    /// DeepSeek-V4.1-Flash: hidden 5120, 40 layers (CSA2: 2 window, 18 ratio-2, 20 ratio-1; KV
    /// held by 4 source layers), 384 experts (6 active), Engram on 2 layers.
    V41Flash,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Attention {
    /// Multi-head latent attention (absorbed for decode).
    Mla { heads: usize, q_lora: usize, kv_lora: usize, qk_nope: usize, qk_rope: usize, v_head: usize },
    /// V4: one shared KV head, sliding window, compressed entries, grouped output projection.
    V4 {
        heads: usize,
        head_dim: usize,
        q_lora: usize,
        o_groups: usize,
        o_lora: usize,
        window: usize,
        csa_layers: usize,
        hca_layers: usize,
        csa_ratio: usize,
        hca_ratio: usize,
        index_heads: usize,
        index_dim: usize,
        index_topk: usize,
    },
    /// V4.1: CSA2 shared compressed KV, the two-level indexer, Engram.
    V41(super::v41::V41Attention),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelCost {
    pub kind: ModelKind,
    pub name: &'static str,
    pub layers: usize,
    /// Layers with a dense feed-forward instead of MoE.
    pub dense_layers: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub attention: Attention,
    pub experts: usize,
    pub experts_per_token: usize,
    pub shared_experts: usize,
    pub expert_inter: usize,
    pub dense_inter: usize,
    /// Storage format of the routed experts and of every other weight.
    pub expert_format: WeightFormat,
    pub dense_format: WeightFormat,
    /// Storage format of the KV cache.
    pub kv_format: KvFormat,
    /// Longest context (`max_position_embeddings`).
    pub context: usize,
}

/// The V4 models' context (1M tokens); V3's is set where it is built.
const CONTEXT: usize = 1 << 20;

impl ModelKind {
    pub const ALL: [ModelKind; 3] = [Self::DeepSeekV3, Self::V4Flash, Self::V41Flash];

    /// The model a scenario names; `DeepSeek-R1` is DeepSeek-V3's architecture
    /// and weights shape, so it is costed as V3.
    pub fn from_name(name: &str) -> Option<Self> {
        if name.eq_ignore_ascii_case("DeepSeek-R1") {
            return Some(ModelKind::DeepSeekV3);
        }
        Self::ALL.into_iter().find(|k| k.cost().name.eq_ignore_ascii_case(name))
    }

    pub fn cost(self) -> ModelCost {
        let v4 = |q_lora| Attention::V4 {
            heads: 64,
            head_dim: 512,
            q_lora,
            o_groups: 8,
            o_lora: 1024,
            window: 128,
            csa_layers: 0,
            hca_layers: 0,
            csa_ratio: 4,
            hca_ratio: 128,
            index_heads: 64,
            index_dim: 128,
            index_topk: 512,
        };
        let with_layers = |a: Attention, csa, hca| match a {
            Attention::V4 {
                heads,
                head_dim,
                q_lora,
                o_groups,
                o_lora,
                window,
                csa_ratio,
                hca_ratio,
                index_heads,
                index_dim,
                index_topk,
                ..
            } => Attention::V4 {
                heads,
                head_dim,
                q_lora,
                o_groups,
                o_lora,
                window,
                csa_layers: csa,
                hca_layers: hca,
                csa_ratio,
                hca_ratio,
                index_heads,
                index_dim,
                index_topk,
            },
            other => other,
        };
        match self {
            ModelKind::DeepSeekV3 => ModelCost {
                kind: self,
                name: "DeepSeek-V3",
                layers: 61,
                dense_layers: 3,
                hidden: 7168,
                vocab: 129280,
                attention: Attention::Mla {
                    heads: 128,
                    q_lora: 1536,
                    kv_lora: 512,
                    qk_nope: 128,
                    qk_rope: 64,
                    v_head: 128,
                },
                experts: 256,
                experts_per_token: 8,
                shared_experts: 1,
                expert_inter: 2048,
                dense_inter: 18432,
                expert_format: WeightFormat::Fp8,
                dense_format: WeightFormat::Fp8,
                kv_format: KvFormat::Bf16,
                context: 163_840,
            },
            // 43 layers: 2 window-only, then CSA and HCA alternating (21 + 20).
            ModelKind::V4Flash => ModelCost {
                kind: self,
                name: "V4-Flash",
                layers: 43,
                dense_layers: 0,
                hidden: 4096,
                vocab: 129280,
                attention: with_layers(v4(1024), 21, 20),
                experts: 256,
                experts_per_token: 6,
                shared_experts: 1,
                expert_inter: 2048,
                dense_inter: 0,
                expert_format: WeightFormat::Mxfp4,
                dense_format: WeightFormat::Fp8,
                kv_format: KvFormat::Bf16,
                context: CONTEXT,
            },
            ModelKind::V41Flash => ModelCost {
                kind: self,
                name: "V4.1-Flash",
                layers: 40,
                dense_layers: 0,
                hidden: 5120,
                vocab: 129280,
                attention: Attention::V41(super::v41::V41Attention::released()),
                experts: 384,
                experts_per_token: 6,
                shared_experts: 1,
                expert_inter: 2304,
                dense_inter: 0,
                expert_format: WeightFormat::Mxfp4,
                dense_format: WeightFormat::Fp8,
                kv_format: KvFormat::V41Mixed,
                context: CONTEXT,
            },
        }
    }
}

impl ModelCost {
    /// The model served in `precision`'s formats; a cache format the model's
    /// attention does not have is refused.
    pub fn with_precision(mut self, precision: Precision) -> Result<Self, String> {
        self.expert_format = precision.experts.unwrap_or(self.expert_format);
        self.dense_format = precision.dense.unwrap_or(self.dense_format);
        if let Some(kv) = precision.kv {
            let fits = match self.attention {
                Attention::V41(_) => kv == KvFormat::V41Mixed,
                _ => kv != KvFormat::V41Mixed,
            };
            if !fits {
                let have = match self.attention {
                    Attention::V41(_) => "fp4 (its own layout: FP8 window rows, FP4 compressed entries)",
                    _ => "bf16 or fp8",
                };
                return Err(format!("{} keeps its KV cache in {have}, not {}", self.name, kv.name()));
            }
            self.kv_format = kv;
        }
        Ok(self)
    }

    pub fn moe_layers(&self) -> usize {
        self.layers - self.dense_layers
    }

    /// Parameters of one layer's attention (projections, compressors, indexer).
    pub fn attention_params_per_layer(&self) -> f64 {
        let h = self.hidden as f64;
        match self.attention {
            Attention::Mla { heads, q_lora, kv_lora, qk_nope, qk_rope, v_head } => {
                let (heads, q_lora, kv_lora) = (heads as f64, q_lora as f64, kv_lora as f64);
                q_lora * h
                    + heads * (qk_nope + qk_rope) as f64 * q_lora
                    + (kv_lora + qk_rope as f64) * h
                    + heads * (qk_nope + v_head) as f64 * kv_lora
                    + h * heads * v_head as f64
            }
            Attention::V4 {
                heads,
                head_dim,
                q_lora,
                o_groups,
                o_lora,
                csa_layers,
                hca_layers,
                index_heads,
                index_dim,
                ..
            } => {
                let (qd, q_lora, hd) = ((heads * head_dim) as f64, q_lora as f64, head_dim as f64);
                let base = q_lora * h
                    + qd * q_lora
                    + hd * h
                    + (o_groups * o_lora) as f64 * (qd / o_groups as f64)
                    + h * (o_groups * o_lora) as f64;
                // Compressors (kv + gate) and the indexer, averaged over layers.
                let csa = 2.0 * 2.0 * hd * h
                    + (index_heads * index_dim) as f64 * q_lora
                    + index_heads as f64 * h
                    + 2.0 * 2.0 * index_dim as f64 * h;
                let hca = 2.0 * hd * h;
                base + (csa * csa_layers as f64 + hca * hca_layers as f64) / self.layers as f64
            }
            Attention::V41(ref a) => a.params(self.hidden) / self.layers as f64,
        }
    }

    /// Bytes of memory tables read by row (V4.1's Engram), outside the compute parameters.
    pub fn table_bytes(&self) -> f64 {
        match self.attention {
            Attention::V41(ref a) => a.engram_table_bytes(),
            _ => 0.0,
        }
    }

    /// Bytes of table rows each new token reads (V4.1's Engram lookups).
    pub fn table_read_bytes_per_token(&self) -> f64 {
        match self.attention {
            Attention::V41(ref a) => a.engram_read_bytes_per_token(),
            _ => 0.0,
        }
    }

    fn expert_params(&self) -> f64 {
        3.0 * (self.hidden * self.expert_inter) as f64
    }

    fn dense_params(&self) -> f64 {
        self.attention_params_per_layer() * self.layers as f64
            + self.shared_experts as f64 * self.expert_params() * self.moe_layers() as f64
            + 3.0 * (self.hidden * self.dense_inter) as f64 * self.dense_layers as f64
            + (self.vocab * self.hidden) as f64
    }

    /// All parameters (embedding included).
    pub fn total_params(&self) -> f64 {
        self.dense_params()
            + (self.vocab * self.hidden) as f64
            + self.experts as f64 * self.expert_params() * self.moe_layers() as f64
    }

    /// Parameters one token uses (embedding excluded, head included).
    pub fn active_params(&self) -> f64 {
        self.dense_params() + self.experts_per_token as f64 * self.expert_params() * self.moe_layers() as f64
    }

    /// FLOPs per token in dense matmuls (attention projections, shared and dense FFNs, head).
    pub fn dense_flops_per_token(&self) -> f64 {
        2.0 * self.dense_params()
    }

    /// FLOPs of one routed expert for one token.
    pub fn expert_flops_per_token(&self) -> f64 {
        2.0 * self.expert_params()
    }

    /// Bytes of dense weights a device reads each step (replicated on every attention rank).
    pub fn dense_weight_bytes(&self) -> f64 {
        self.dense_params() * self.dense_format.bits() / 8.0
    }

    /// Bytes of one routed expert across all MoE layers.
    pub fn expert_weight_bytes_all_layers(&self) -> f64 {
        self.expert_params() * self.moe_layers() as f64 * self.expert_format.bits() / 8.0
    }

    /// Bytes of all weights held by a device with `experts_per_device` routed experts.
    pub fn device_weight_bytes(&self, experts_per_device: usize) -> f64 {
        self.dense_weight_bytes()
            + (self.vocab * self.hidden) as f64 * 2.0
            + experts_per_device as f64 * self.expert_weight_bytes_all_layers()
    }

    /// Attention FLOPs (scores and values) of `new` tokens after `context` tokens.
    pub fn attention_flops(&self, new: usize, context: usize) -> f64 {
        if new == 0 {
            return 0.0;
        }
        // Average visible length over the new tokens.
        let visible = context as f64 + (new as f64 + 1.0) / 2.0;
        let per_token = match self.attention {
            // Decode attends in the absorbed (latent) form; prefill expands keys
            // and values per head, which is cheaper per key (as DeepSeek serves it).
            Attention::Mla { heads, kv_lora, qk_nope, qk_rope, v_head, .. } => {
                let per_key =
                    if new > 1 { heads * (qk_nope + qk_rope + v_head) } else { heads * (2 * kv_lora + qk_rope) };
                visible * per_key as f64 * 2.0 * self.layers as f64
            }
            Attention::V4 {
                heads,
                head_dim,
                window,
                csa_layers,
                hca_layers,
                csa_ratio,
                hca_ratio,
                index_heads,
                index_dim,
                index_topk,
                ..
            } => {
                let per_key = (heads * head_dim) as f64 * 2.0 * 2.0;
                let win = visible.min(window as f64);
                let csa_entries = visible / csa_ratio as f64;
                let csa = (win + csa_entries.min(index_topk as f64)) * per_key
                    + csa_entries * (index_heads * index_dim) as f64 * 2.0;
                let hca = (win + visible / hca_ratio as f64) * per_key;
                let window_only = self.layers - csa_layers - hca_layers;
                window_only as f64 * win * per_key + csa_layers as f64 * csa + hca_layers as f64 * hca
            }
            Attention::V41(ref a) => a.flops_per_token(visible),
        };
        per_token * new as f64
    }

    /// KV bytes a sequence reads in one step (once per step, whatever `new` is):
    /// its window, the CSA entries the indexer picks plus every indexer key, the HCA entries.
    pub fn kv_read_bytes(&self, new: usize, context: usize) -> f64 {
        self.kv_bytes(context + new, true)
    }

    /// KV bytes held for a sequence of `context` tokens (all layers).
    pub fn kv_bytes_per_sequence(&self, context: usize) -> f64 {
        self.kv_bytes(context, false)
    }

    fn kv_bytes(&self, tokens: usize, only_selected: bool) -> f64 {
        let visible = tokens as f64;
        let b = self.kv_format.element_bytes();
        match self.attention {
            Attention::Mla { kv_lora, qk_rope, .. } => visible * (kv_lora + qk_rope) as f64 * b * self.layers as f64,
            Attention::V4 {
                head_dim,
                window,
                csa_layers,
                hca_layers,
                csa_ratio,
                hca_ratio,
                index_dim,
                index_topk,
                ..
            } => {
                let hd = head_dim as f64;
                let win = visible.min(window as f64) * hd * b;
                let csa_entries = visible / csa_ratio as f64;
                let csa_values = if only_selected { csa_entries.min(index_topk as f64) } else { csa_entries };
                let csa = win + csa_values * hd * b + csa_entries * index_dim as f64;
                let hca = win + visible / hca_ratio as f64 * hd * b;
                let window_only = self.layers - csa_layers - hca_layers;
                window_only as f64 * win + csa_layers as f64 * csa + hca_layers as f64 * hca
            }
            Attention::V41(ref a) => a.kv_bytes(visible, only_selected),
        }
    }

    /// Bytes one token sends to one expert (FP8 activations with an f32
    /// scale per 128) and receives back (BF16), per MoE layer.
    pub fn pair_bytes(&self) -> f64 {
        let hidden = self.hidden as f64;
        hidden + hidden / 32.0 + 2.0 * hidden
    }
}
