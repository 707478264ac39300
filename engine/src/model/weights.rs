//! The weights of a DeepSeek-V4 model, loaded under the tensor names of
//! DeepSeek's published checkpoints.

use std::sync::Arc;

use deepinfer_kernels::{Linear, WeightFormat};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{AttentionKind, ModelConfig, RoutingKind};

/// mHC mixing weights for one sublayer: `fn` maps the normalised, flattened
/// streams to the pre, post and comb logits.
pub struct HyperConnection {
    pub mix: Linear,
    pub base: Vec<f32>,
    pub scale: [f32; 3],
}

/// The final (or MTP) collapse of the hc streams into one hidden state.
pub struct HyperHead {
    pub mix: Linear,
    pub base: Vec<f32>,
    pub scale: f32,
}

/// A learned softmax-gated pooling of `ratio` tokens into one entry of `dim`
/// channels. With `overlap` (CSA) each token projects to two series and an entry
/// pools the previous window's first series with this window's second.
pub struct Compressor {
    pub wkv: Linear,
    pub wgate: Linear,
    /// Per-slot gate bias, `[ratio, width]`.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub ratio: usize,
    pub dim: usize,
    pub overlap: bool,
}

impl Compressor {
    /// Channels each token projects to.
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

/// The lightning indexer of a CSA layer.
pub struct Indexer {
    pub compressor: Compressor,
    pub wq_b: Linear,
    pub weights_proj: Linear,
}

pub struct Attention {
    pub kind: AttentionKind,
    pub wq_a: Linear,
    pub q_norm: Vec<f32>,
    pub wq_b: Linear,
    pub wkv: Linear,
    pub kv_norm: Vec<f32>,
    /// `wo_a` split into its `o_groups` block-diagonal parts.
    pub wo_a: Vec<Linear>,
    pub wo_b: Linear,
    pub sink: Vec<f32>,
    pub compressor: Option<Compressor>,
    pub indexer: Option<Indexer>,
}

/// A SwiGLU MLP: `w2(silu(w1 x) * w3 x)` with V4's clamps.
pub struct Mlp {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

pub struct Moe {
    pub routing: RoutingKind,
    pub gate: Linear,
    /// Selection-only bias (top-k layers).
    pub bias: Option<Vec<f32>>,
    /// `[vocab, experts_per_token]` expert ids (hash layers).
    pub tid2eid: Option<Vec<u32>>,
    /// The routed experts; empty when they live elsewhere ([`RoutedExperts::Elsewhere`]).
    pub experts: Vec<Arc<Mlp>>,
    pub shared: Option<Mlp>,
}

pub struct Block {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub hc_attn: HyperConnection,
    pub hc_ffn: HyperConnection,
    pub attn: Attention,
    pub moe: Moe,
}

/// The multi-token-prediction block: fuses the next token's embedding with the
/// main model's last hidden streams, runs one block, and predicts one token further.
pub struct Mtp {
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub e_proj: Linear,
    pub h_proj: Linear,
    pub block: Block,
    pub hc_head: HyperHead,
    pub norm: Vec<f32>,
}

pub struct Weights {
    pub embed: Linear,
    pub blocks: Vec<Block>,
    pub hc_head: HyperHead,
    pub norm: Vec<f32>,
    pub head: Linear,
    pub mtp: Vec<Mtp>,
    /// What the load left out and why, for the user to see once.
    pub notices: Vec<String>,
}

/// Where a load puts the routed experts of the main layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RoutedExperts {
    /// In the model, with everything else.
    #[default]
    Resident,
    /// Left in the checkpoint: expert shards load the ones placed on them
    /// (`Model::routed_expert`). MTP blocks keep theirs.
    Elsewhere,
}

/// Whether `name` is a routed expert's tensor of a main layer (`layers.N.ffn.experts.*`).
pub fn is_main_routed_expert(name: &str) -> bool {
    name.strip_prefix("layers.")
        .and_then(|rest| rest.split_once('.'))
        .is_some_and(|(layer, rest)| layer.parse::<usize>().is_ok() && rest.starts_with("ffn.experts."))
}

pub(crate) struct Loader<'a> {
    pub(crate) ck: &'a Checkpoint,
    pub(crate) cfg: &'a ModelConfig,
}

impl Loader<'_> {
    /// A linear of the f32 forward pass, in the layout this CPU's kernels read fastest.
    fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<Linear, CheckpointError> {
        Ok(self.ck.linear(prefix, rows, cols, self.cfg.quant.fp8_block)?.into_decode_layout())
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        self.ck.f32_tensor(name, &[len])
    }

    fn hyper(&self, prefix: &str) -> Result<HyperConnection, CheckpointError> {
        let hc = self.cfg.hc_mult;
        let outputs = (2 + hc) * hc;
        let flat = hc * self.cfg.hidden_size;
        let mix = Linear::from_f32(outputs, flat, self.ck.f32_tensor(&format!("{prefix}_fn"), &[outputs, flat])?)
            .into_decode_layout();
        let scale = self.vector(&format!("{prefix}_scale"), 3)?;
        Ok(HyperConnection {
            mix,
            base: self.vector(&format!("{prefix}_base"), outputs)?,
            scale: [scale[0], scale[1], scale[2]],
        })
    }

    fn hyper_head(&self, prefix: &str) -> Result<HyperHead, CheckpointError> {
        let hc = self.cfg.hc_mult;
        let flat = hc * self.cfg.hidden_size;
        let mix = Linear::from_f32(hc, flat, self.ck.f32_tensor(&format!("{prefix}hc_head_fn"), &[hc, flat])?)
            .into_decode_layout();
        Ok(HyperHead {
            mix,
            base: self.vector(&format!("{prefix}hc_head_base"), hc)?,
            scale: self.vector(&format!("{prefix}hc_head_scale"), 1)?[0],
        })
    }

    fn compressor(&self, prefix: &str, ratio: usize, dim: usize, overlap: bool) -> Result<Compressor, CheckpointError> {
        let width = if overlap { 2 * dim } else { dim };
        let d = self.cfg.hidden_size;
        Ok(Compressor {
            wkv: self.linear(&format!("{prefix}.wkv"), width, d)?,
            wgate: self.linear(&format!("{prefix}.wgate"), width, d)?,
            ape: self.ck.f32_tensor(&format!("{prefix}.ape"), &[ratio, width])?,
            norm: self.vector(&format!("{prefix}.norm.weight"), dim)?,
            ratio,
            dim,
            overlap,
        })
    }

    fn attention(&self, p: &str, kind: AttentionKind) -> Result<Attention, CheckpointError> {
        let c = self.cfg;
        let d = c.hidden_size;
        let qdim = c.num_heads * c.head_dim;
        let group_in = qdim / c.o_groups;
        let wo_a = self.linear(&format!("{p}.wo_a"), c.o_groups * c.o_lora_rank, group_in)?;
        let (compressor, indexer) = match kind {
            AttentionKind::Window => (None, None),
            AttentionKind::Hca { ratio } => {
                (Some(self.compressor(&format!("{p}.compressor"), ratio, c.head_dim, false)?), None)
            }
            AttentionKind::Csa { ratio } => {
                let indexer = Indexer {
                    compressor: self.compressor(&format!("{p}.indexer.compressor"), ratio, c.index_head_dim, true)?,
                    wq_b: self.linear(
                        &format!("{p}.indexer.wq_b"),
                        c.index_n_heads * c.index_head_dim,
                        c.q_lora_rank,
                    )?,
                    weights_proj: self.linear(&format!("{p}.indexer.weights_proj"), c.index_n_heads, d)?,
                };
                (Some(self.compressor(&format!("{p}.compressor"), ratio, c.head_dim, true)?), Some(indexer))
            }
        };
        Ok(Attention {
            kind,
            wq_a: self.linear(&format!("{p}.wq_a"), c.q_lora_rank, d)?,
            q_norm: self.vector(&format!("{p}.q_norm.weight"), c.q_lora_rank)?,
            wq_b: self.linear(&format!("{p}.wq_b"), qdim, c.q_lora_rank)?,
            wkv: self.linear(&format!("{p}.wkv"), c.head_dim, d)?,
            kv_norm: self.vector(&format!("{p}.kv_norm.weight"), c.head_dim)?,
            wo_a: split_rows(&wo_a, c.o_groups),
            wo_b: self.linear(&format!("{p}.wo_b"), d, c.o_groups * c.o_lora_rank)?,
            sink: self.vector(&format!("{p}.attn_sink"), c.num_heads)?,
            compressor,
            indexer,
        })
    }

    fn mlp(&self, p: &str, inter: usize) -> Result<Mlp, CheckpointError> {
        let d = self.cfg.hidden_size;
        Ok(Mlp {
            w1: self.linear(&format!("{p}.w1"), inter, d)?,
            w2: self.linear(&format!("{p}.w2"), d, inter)?,
            w3: self.linear(&format!("{p}.w3"), inter, d)?,
        })
    }

    /// Routed experts stored as transformers holds them: `gate_up_proj` `[E, 2I, D]`
    /// (w1 rows, then w3 rows) and `down_proj` `[E, D, I]`, unquantised.
    /// `only`: that expert alone, copied out of the tensors (which are then dropped).
    fn fused_experts(&self, p: &str, only: Option<usize>) -> Result<Vec<Mlp>, CheckpointError> {
        let c = self.cfg;
        let (e, inter, d) = (c.n_routed_experts, c.moe_intermediate_size, c.hidden_size);
        // One expert alone: only its slab of each fused tensor is read.
        let (gate_up_name, down_name) = (format!("{p}.gate_up_proj"), format!("{p}.down_proj"));
        let (gate_up, down) = match only {
            Some(i) => (self.ck.get_slab(&gate_up_name, i)?, self.ck.get_slab(&down_name, i)?),
            None => (self.ck.get(&gate_up_name)?, self.ck.get(&down_name)?),
        };
        gate_up.expect_shape(&[e, 2 * inter, d])?;
        down.expect_shape(&[e, d, inter])?;
        let first = only.unwrap_or(0);
        let matrix = |t: &crate::checkpoint::RawTensor, first_row: usize, rows: usize, cols: usize| {
            let size = match t.dtype {
                safetensors::Dtype::F32 => 4,
                safetensors::Dtype::BF16 => 2,
                other => return Err(t.error(format!("fused experts must be F32 or BF16, found {other:?}"))),
            };
            let bytes = t.bytes.slice(first_row * cols * size..(first_row + rows) * cols * size);
            let format = if size == 4 {
                WeightFormat::F32(bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())
            } else {
                WeightFormat::Bf16(bytes)
            };
            Ok(Linear { rows, cols, format }.into_decode_layout())
        };
        let range = match only {
            Some(i) => i..i + 1,
            None => 0..e,
        };
        range
            .map(|i| {
                let j = i - first;
                Ok(Mlp {
                    w1: matrix(&gate_up, j * 2 * inter, inter, d)?,
                    w3: matrix(&gate_up, j * 2 * inter + inter, inter, d)?,
                    w2: matrix(&down, j * d, d, inter)?,
                })
            })
            .collect()
    }

    /// Routed expert `expert` of the MoE at `p` (`layers.N.ffn`).
    pub(crate) fn routed_expert(&self, p: &str, expert: usize) -> Result<Mlp, CheckpointError> {
        if self.ck.contains(&format!("{p}.experts.gate_up_proj")) {
            let mut one = self.fused_experts(&format!("{p}.experts"), Some(expert))?;
            return Ok(one.pop().expect("one expert"));
        }
        self.mlp(&format!("{p}.experts.{expert}"), self.cfg.moe_intermediate_size)
    }

    fn moe(&self, p: &str, routing: RoutingKind, routed: RoutedExperts) -> Result<Moe, CheckpointError> {
        let c = self.cfg;
        let e = c.n_routed_experts;
        let (bias, tid2eid) = match routing {
            RoutingKind::TopK => (Some(self.vector(&format!("{p}.gate.bias"), e)?), None),
            RoutingKind::Hash => {
                let name = format!("{p}.gate.tid2eid");
                let ids = self.ck.int_tensor(&name, &[c.vocab_size, c.experts_per_token])?;
                let mut table = Vec::with_capacity(ids.len());
                for id in ids {
                    if id < 0 || id as usize >= e {
                        return Err(CheckpointError::Tensor {
                            file: "checkpoint".into(),
                            tensor: name,
                            problem: format!("expert id {id} outside 0..{e}"),
                        });
                    }
                    table.push(id as u32);
                }
                (None, Some(table))
            }
        };
        let experts: Vec<Mlp> = if routed == RoutedExperts::Elsewhere {
            Vec::new()
        } else if self.ck.contains(&format!("{p}.experts.gate_up_proj")) {
            self.fused_experts(&format!("{p}.experts"), None)?
        } else {
            (0..e).map(|i| self.mlp(&format!("{p}.experts.{i}"), c.moe_intermediate_size)).collect::<Result<_, _>>()?
        };
        let experts = experts.into_iter().map(Arc::new).collect();
        let shared = if c.n_shared_experts > 0 {
            Some(self.mlp(&format!("{p}.shared_experts"), c.moe_intermediate_size * c.n_shared_experts)?)
        } else {
            None
        };
        Ok(Moe { routing, gate: self.linear(&format!("{p}.gate"), e, c.hidden_size)?, bias, tid2eid, experts, shared })
    }

    fn block(
        &self,
        p: &str,
        kind: AttentionKind,
        routing: RoutingKind,
        routed: RoutedExperts,
    ) -> Result<Block, CheckpointError> {
        let d = self.cfg.hidden_size;
        Ok(Block {
            attn_norm: self.vector(&format!("{p}.attn_norm.weight"), d)?,
            ffn_norm: self.vector(&format!("{p}.ffn_norm.weight"), d)?,
            hc_attn: self.hyper(&format!("{p}.hc_attn"))?,
            hc_ffn: self.hyper(&format!("{p}.hc_ffn"))?,
            attn: self.attention(&format!("{p}.attn"), kind)?,
            moe: self.moe(&format!("{p}.ffn"), routing, routed)?,
        })
    }
}

impl Weights {
    /// No layers: the V4 part of a model that runs another architecture.
    pub fn empty() -> Self {
        let none = || Linear::from_f32(0, 0, Vec::new());
        Self {
            embed: none(),
            blocks: Vec::new(),
            hc_head: HyperHead { mix: none(), base: Vec::new(), scale: 1.0 },
            norm: Vec::new(),
            head: none(),
            mtp: Vec::new(),
            notices: Vec::new(),
        }
    }

    /// Load every tensor the forward pass needs; MTP blocks only if present.
    pub fn load(ck: &Checkpoint, cfg: &ModelConfig) -> Result<Self, CheckpointError> {
        Self::load_with(ck, cfg, RoutedExperts::Resident)
    }

    /// [`Weights::load`], with the main layers' routed experts where `routed` says.
    pub fn load_with(ck: &Checkpoint, cfg: &ModelConfig, routed: RoutedExperts) -> Result<Self, CheckpointError> {
        let l = Loader { ck, cfg };
        let d = cfg.hidden_size;
        let blocks = (0..cfg.num_layers)
            .map(|i| l.block(&format!("layers.{i}"), cfg.attention[i], cfg.routing[i], routed))
            .collect::<Result<Vec<_>, _>>()?;
        let mut mtp = Vec::new();
        let mut notices = Vec::new();
        for i in 0..cfg.num_mtp_layers {
            let p = format!("mtp.{i}");
            if !ck.names().any(|n| n.starts_with(&format!("{p}."))) {
                notices.push(format!(
                    "config.json announces {} MTP layer(s) (num_nextn_predict_layers) but the checkpoint has \
                     no {p}.* tensors (as after transformers' save_pretrained): loading without MTP",
                    cfg.num_mtp_layers
                ));
                break;
            }
            mtp.push(Mtp {
                enorm: l.vector(&format!("{p}.enorm.weight"), d)?,
                hnorm: l.vector(&format!("{p}.hnorm.weight"), d)?,
                e_proj: l.linear(&format!("{p}.e_proj"), d, d)?,
                h_proj: l.linear(&format!("{p}.h_proj"), d, d)?,
                block: l.block(&p, AttentionKind::Window, RoutingKind::TopK, RoutedExperts::Resident)?,
                hc_head: l.hyper_head(&format!("{p}."))?,
                norm: l.vector(&format!("{p}.norm.weight"), d)?,
            });
        }
        let weights = Weights {
            embed: l.linear("embed", cfg.vocab_size, d)?,
            blocks,
            hc_head: l.hyper_head("")?,
            norm: l.vector("norm.weight", d)?,
            head: l.linear("head", cfg.vocab_size, d)?,
            mtp,
            notices,
        };
        // MTP blocks past what the config announces are left out on purpose.
        let beyond_config = |name: &str| {
            name.strip_prefix("mtp.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|k| k.parse::<usize>().ok())
                .is_some_and(|k| k >= cfg.num_mtp_layers)
        };
        let left_in_checkpoint = |name: &str| routed == RoutedExperts::Elsewhere && is_main_routed_expert(name);
        ck.check_all_used(|name| beyond_config(name) || left_in_checkpoint(name))?;
        Ok(weights)
    }

    /// Bytes of all weights as stored.
    pub fn storage_bytes(&self) -> usize {
        let mlp = |m: &Mlp| m.w1.storage_bytes() + m.w2.storage_bytes() + m.w3.storage_bytes();
        let block = |b: &Block| {
            let a = &b.attn;
            let mut n =
                a.wq_a.storage_bytes() + a.wq_b.storage_bytes() + a.wkv.storage_bytes() + a.wo_b.storage_bytes();
            n += a.wo_a.iter().map(Linear::storage_bytes).sum::<usize>();
            n += b.moe.gate.storage_bytes() + b.moe.experts.iter().map(|m| mlp(m)).sum::<usize>();
            n + b.moe.shared.as_ref().map_or(0, mlp)
        };
        self.embed.storage_bytes()
            + self.head.storage_bytes()
            + self.blocks.iter().map(block).sum::<usize>()
            + self.mtp.iter().map(|m| block(&m.block)).sum::<usize>()
    }
}

/// Split a matrix into `groups` consecutive row ranges of equal size, keeping its
/// storage format. FP8 scale rows are repeated per row when a group boundary falls
/// inside a scale block.
pub fn split_rows(w: &Linear, groups: usize) -> Vec<Linear> {
    assert!(w.rows.is_multiple_of(groups), "{} rows into {groups} groups", w.rows);
    if let WeightFormat::Panels(_) = &w.format {
        let published = w.clone().into_published();
        return split_rows(&published, groups).into_iter().map(Linear::into_decode_layout).collect();
    }
    let rows = w.rows / groups;
    let cols = w.cols;
    (0..groups)
        .map(|g| {
            let r0 = g * rows;
            let format = match &w.format {
                WeightFormat::F32(d) => WeightFormat::F32(d[r0 * cols..(r0 + rows) * cols].to_vec()),
                WeightFormat::Bf16(d) => WeightFormat::Bf16(d.slice(r0 * cols * 2..(r0 + rows) * cols * 2)),
                WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free } => {
                    let per_row = cols.div_ceil(*block_cols);
                    let row_scales = (r0..r0 + rows)
                        .flat_map(|r| scales[(r / block_rows) * per_row..][..per_row].iter().copied())
                        .collect();
                    WeightFormat::Fp8 {
                        data: data.slice(r0 * cols..(r0 + rows) * cols),
                        scales: row_scales,
                        block_rows: 1,
                        block_cols: *block_cols,
                        nan_free: *nan_free,
                    }
                }
                WeightFormat::Panels(_) => unreachable!("laid-out weights are split as published"),
                WeightFormat::Fp4 { data, scales, block_cols } => {
                    let per_row = cols / block_cols;
                    WeightFormat::Fp4 {
                        data: data.slice(r0 * cols / 2..(r0 + rows) * cols / 2),
                        scales: scales[r0 * per_row..(r0 + rows) * per_row].to_vec(),
                        block_cols: *block_cols,
                    }
                }
            };
            Linear { rows, cols, format }
        })
        .collect()
}
