//! Built-in model presets and a seeded random checkpoint writer, so that a
//! model with every V4 feature exists without downloading anything.
//!
//! The checkpoint uses DeepSeek's published tensor names and formats: FP8 e4m3
//! with UE8M0 128×128 block scales for the dense projections, FP4 e2m1 with one
//! UE8M0 scale per 32 inputs for the routed experts, BF16 for embeddings,
//! compressors and routers, F32 for norms and mHC parameters.

use std::borrow::Cow;

use bytes::Bytes;
use deepinfer_kernels::dtype::f32_to_bf16;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use safetensors::{Dtype, View};
use serde_json::{json, Value};

use crate::checkpoint::Checkpoint;
use crate::config::{AttentionKind, ModelConfig, RoutingKind};
use crate::model::{LoadError, Model};

/// A named built-in configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// Hidden 64, 7 layers (window, window, CSA, HCA, CSA, HCA, CSA) + MTP, 8 routed
    /// experts (2 active) + 1 shared, 3 hash layers, vocabulary 1024.
    TinyV4,
    /// Hidden 1024, 8 layers, 32 routed experts (4 active): a benchmark-sized model.
    SmallV4,
    /// Hidden 2048, 4 layers (window, window, CSA, HCA), 128 routed experts (6 active) of
    /// width 1024 + 1 shared: V4-Flash's ratios at half its width, 1.9 GiB as FP8/FP4,
    /// so decode reads its experts from memory as on a server (a CPU benchmark model).
    MediumV4,
    /// DeepSeek-V4.1, hidden 64, 8 layers (window, a ratio-2 group with a reuse layer and
    /// an index source without keys, a ratio-1 group with the candidate filter) + 1 DSpark
    /// layer, Engram before layers 0 and 2.
    TinyV41,
    /// DeepSeek-V4.1 with the tiny layout at hidden 1024: a benchmark-sized model.
    SmallV41,
    /// `TinyV41` with a 2-block vision tower of width 32 (`presets_v41::vision_config_json`):
    /// a model that takes images.
    TinyV41Vision,
    /// DeepSeek-V4.1 with the tiny layout at hidden 2048, 128 routed experts (6 active)
    /// of width 1024: V4.1-Flash's ratios at half its width, 3.8 GB as FP8/FP4, so
    /// decode reads its experts from memory as on a server (a CPU benchmark model).
    MediumV41,
}

impl Preset {
    pub const ALL: [Preset; 7] = [
        Preset::TinyV4,
        Preset::SmallV4,
        Preset::MediumV4,
        Preset::TinyV41,
        Preset::SmallV41,
        Preset::MediumV41,
        Preset::TinyV41Vision,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::TinyV4 => "tiny-v4",
            Preset::SmallV4 => "small-v4",
            Preset::MediumV4 => "medium-v4",
            Preset::TinyV41 => "tiny-v41",
            Preset::SmallV41 => "small-v41",
            Preset::MediumV41 => "medium-v41",
            Preset::TinyV41Vision => "tiny-v41-vision",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub fn is_v41(self) -> bool {
        matches!(self, Preset::TinyV41 | Preset::SmallV41 | Preset::MediumV41 | Preset::TinyV41Vision)
    }

    /// The preset's `config.json` (modern `DeepseekV4Config` keys; for V4.1 the reference's).
    pub fn config_json(self) -> Value {
        match self {
            Preset::TinyV41 => return crate::presets_v41::config_json(&crate::presets_v41::TINY),
            Preset::SmallV41 => return crate::presets_v41::config_json(&crate::presets_v41::SMALL),
            Preset::MediumV41 => return crate::presets_v41::config_json(&crate::presets_v41::MEDIUM),
            Preset::TinyV41Vision => return crate::presets_v41::vision_config_json(&crate::presets_v41::TINY),
            _ => {}
        }
        let (vocab, hidden, layers, heads, head_dim, rope, q_lora, groups, o_lora, window) = match self {
            Preset::TinyV4 => (1024, 64, 7, 4, 64, 16, 32, 2, 32, 8),
            Preset::MediumV4 => (1024, 2048, 4, 32, 256, 64, 512, 4, 512, 128),
            _ => (1024, 1024, 8, 16, 128, 64, 512, 4, 256, 128),
        };
        let (index_heads, index_dim, topk, experts, active, inter, hash, hca) = match self {
            Preset::TinyV4 => (2, 32, 2, 8, 2, 32, 3, 16),
            Preset::MediumV4 => (16, 128, 128, 128, 6, 1024, 1, 128),
            _ => (8, 64, 64, 32, 4, 256, 2, 128),
        };
        // The benchmark model drafts nothing: an MTP block would add 128 more experts.
        let mtp_layers = if self == Preset::MediumV4 { 0 } else { 1 };
        let layer_types: Vec<&str> = (0..layers)
            .map(|i| match i {
                0 | 1 => "sliding_attention",
                i if i % 2 == 0 => "compressed_sparse_attention",
                _ => "heavily_compressed_attention",
            })
            .collect();
        let mlp_types: Vec<&str> = (0..layers).map(|i| if i < hash { "hash_moe" } else { "moe" }).collect();
        // DeepSeek's published spelling of the same layout, one ratio per layer and
        // then per MTP layer (window only), so converters of the published format
        // (llama.cpp's among them) read these checkpoints unchanged.
        let compress_ratios: Vec<usize> = layer_types
            .iter()
            .map(|t| match *t {
                "compressed_sparse_attention" => 4,
                "heavily_compressed_attention" => hca,
                _ => 0,
            })
            .chain(std::iter::repeat_n(0, mtp_layers))
            .collect();
        json!({
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "qk_rope_head_dim": rope,
            "q_lora_rank": q_lora,
            "o_groups": groups,
            "o_lora_rank": o_lora,
            "moe_intermediate_size": inter,
            "n_routed_experts": experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": active,
            "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": true,
            "routed_scaling_factor": 1.5,
            "swiglu_limit": 10.0,
            "sliding_window": window,
            "index_n_heads": index_heads,
            "index_head_dim": index_dim,
            "index_topk": topk,
            "layer_types": layer_types,
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca},
            "mlp_layer_types": mlp_types,
            "compress_ratios": compress_ratios,
            "num_hash_layers": hash,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32.0, "beta_slow": 1.0},
            "max_position_embeddings": 4096,
            "num_nextn_predict_layers": mtp_layers,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                    "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        })
    }

    pub fn config(self) -> ModelConfig {
        if self.is_v41() {
            return self.v41_config().scheduling_view();
        }
        ModelConfig::from_json_str(&self.config_json().to_string(), self.name()).expect("preset config is valid")
    }

    pub fn v41_config(self) -> crate::v41::V41Config {
        crate::v41::V41Config::from_json_str(&self.config_json().to_string(), self.name())
            .expect("preset config is valid")
    }
}

/// One tensor ready to be serialised.
pub struct TensorData {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for &TensorData {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Serialise tensors as one safetensors file.
pub fn serialize(tensors: &[TensorData]) -> Vec<u8> {
    safetensors::serialize(tensors.iter().map(|t| (t.name.as_str(), t)), None).expect("tensor sizes match shapes")
}

/// SplitMix64 normals: a small seeded stream, stable across platforms.
pub(crate) struct Normal {
    pub(crate) state: u64,
}

impl Normal {
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn sample(&mut self, std: f32) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * std
    }
    pub(crate) fn vec(&mut self, len: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..len).map(|_| mean + self.sample(std)).collect()
    }
}

pub(crate) struct Writer {
    pub(crate) rng: Normal,
    pub(crate) tensors: Vec<TensorData>,
}

impl Writer {
    pub(crate) fn f32(&mut self, name: &str, shape: &[usize], mean: f32, std: f32) {
        let v = self.rng.vec(shape.iter().product(), mean, std);
        self.tensors.push(TensorData {
            name: name.into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        });
    }
    pub(crate) fn bf16(&mut self, name: &str, rows: usize, cols: usize, std: f32) {
        let v = self.rng.vec(rows * cols, 0.0, std);
        self.tensors.push(TensorData {
            name: format!("{name}.weight"),
            dtype: Dtype::BF16,
            shape: vec![rows, cols],
            data: v.iter().flat_map(|x| f32_to_bf16(*x).to_le_bytes()).collect(),
        });
    }
    pub(crate) fn fp8(&mut self, name: &str, rows: usize, cols: usize, block: usize) {
        let v = self.rng.vec(rows * cols, 0.0, 1.0 / (cols as f32).sqrt());
        let q = quantize_fp8_blocks(&v, rows, cols, block);
        self.tensors.push(TensorData {
            name: format!("{name}.weight"),
            dtype: Dtype::F8_E4M3,
            shape: vec![rows, cols],
            data: q.codes,
        });
        self.tensors.push(TensorData {
            name: format!("{name}.scale"),
            dtype: Dtype::F8_E8M0,
            shape: vec![q.scale_shape.0, q.scale_shape.1],
            data: q.scales,
        });
    }
    pub(crate) fn fp4(&mut self, name: &str, rows: usize, cols: usize) {
        let v = self.rng.vec(rows * cols, 0.0, 1.0 / (cols as f32).sqrt());
        let q = quantize_fp4_rows(&v, rows, cols, 32);
        self.tensors.push(TensorData {
            name: format!("{name}.weight"),
            dtype: Dtype::I8,
            shape: vec![rows, cols / 2],
            data: q.codes,
        });
        self.tensors.push(TensorData {
            name: format!("{name}.scale"),
            dtype: Dtype::F8_E8M0,
            shape: vec![q.scale_shape.0, q.scale_shape.1],
            data: q.scales,
        });
    }
    pub(crate) fn norm(&mut self, name: &str, len: usize) {
        self.f32(name, &[len], 1.0, 0.1);
    }
    fn hyper(&mut self, prefix: &str, cfg: &ModelConfig) {
        let hc = cfg.hc_mult;
        let outputs = (2 + hc) * hc;
        self.f32(&format!("{prefix}_fn"), &[outputs, hc * cfg.hidden_size], 0.0, 0.05);
        self.f32(&format!("{prefix}_base"), &[outputs], 0.0, 0.5);
        self.f32(&format!("{prefix}_scale"), &[3], 1.0, 0.1);
    }
    fn compressor(&mut self, prefix: &str, cfg: &ModelConfig, ratio: usize, dim: usize, overlap: bool) {
        let width = if overlap { 2 * dim } else { dim };
        let d = cfg.hidden_size;
        self.bf16(&format!("{prefix}.wkv"), width, d, 1.0 / (d as f32).sqrt());
        self.bf16(&format!("{prefix}.wgate"), width, d, 1.0 / (d as f32).sqrt());
        self.f32(&format!("{prefix}.ape"), &[ratio, width], 0.0, 0.5);
        self.norm(&format!("{prefix}.norm.weight"), dim);
    }
    fn mlp(&mut self, prefix: &str, cfg: &ModelConfig, inter: usize, fp4: bool) {
        let d = cfg.hidden_size;
        let block = cfg.quant.fp8_block.0;
        for (name, rows, cols) in [("w1", inter, d), ("w2", d, inter), ("w3", inter, d)] {
            if fp4 {
                self.fp4(&format!("{prefix}.{name}"), rows, cols);
            } else {
                self.fp8(&format!("{prefix}.{name}"), rows, cols, block);
            }
        }
    }
    fn block(&mut self, p: &str, cfg: &ModelConfig, kind: AttentionKind, routing: RoutingKind) {
        let d = cfg.hidden_size;
        let b = cfg.quant.fp8_block.0;
        let qdim = cfg.num_heads * cfg.head_dim;
        self.norm(&format!("{p}.attn_norm.weight"), d);
        self.norm(&format!("{p}.ffn_norm.weight"), d);
        self.hyper(&format!("{p}.hc_attn"), cfg);
        self.hyper(&format!("{p}.hc_ffn"), cfg);
        let a = format!("{p}.attn");
        self.fp8(&format!("{a}.wq_a"), cfg.q_lora_rank, d, b);
        self.norm(&format!("{a}.q_norm.weight"), cfg.q_lora_rank);
        self.fp8(&format!("{a}.wq_b"), qdim, cfg.q_lora_rank, b);
        self.fp8(&format!("{a}.wkv"), cfg.head_dim, d, b);
        self.norm(&format!("{a}.kv_norm.weight"), cfg.head_dim);
        self.fp8(&format!("{a}.wo_a"), cfg.o_groups * cfg.o_lora_rank, qdim / cfg.o_groups, b);
        self.fp8(&format!("{a}.wo_b"), d, cfg.o_groups * cfg.o_lora_rank, b);
        self.f32(&format!("{a}.attn_sink"), &[cfg.num_heads], 0.0, 1.0);
        match kind {
            AttentionKind::Window => {}
            AttentionKind::Hca { ratio } => {
                self.compressor(&format!("{a}.compressor"), cfg, ratio, cfg.head_dim, false)
            }
            AttentionKind::Csa { ratio } => {
                self.compressor(&format!("{a}.compressor"), cfg, ratio, cfg.head_dim, true);
                self.compressor(&format!("{a}.indexer.compressor"), cfg, ratio, cfg.index_head_dim, true);
                self.fp8(&format!("{a}.indexer.wq_b"), cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, b);
                self.bf16(&format!("{a}.indexer.weights_proj"), cfg.index_n_heads, d, 1.0 / (d as f32).sqrt());
            }
        }
        let f = format!("{p}.ffn");
        let e = cfg.n_routed_experts;
        self.bf16(&format!("{f}.gate"), e, d, 1.0 / (d as f32).sqrt());
        match routing {
            RoutingKind::TopK => self.f32(&format!("{f}.gate.bias"), &[e], 0.0, 0.1),
            RoutingKind::Hash => {
                let k = cfg.experts_per_token;
                let mut ids = Vec::with_capacity(cfg.vocab_size * k);
                for _ in 0..cfg.vocab_size {
                    // k distinct experts per token: a seeded partial shuffle.
                    let mut pool: Vec<i32> = (0..e as i32).collect();
                    for slot in 0..k {
                        let pick = slot + (self.rng.next_u64() % (e - slot) as u64) as usize;
                        pool.swap(slot, pick);
                        ids.push(pool[slot]);
                    }
                }
                self.tensors.push(TensorData {
                    name: format!("{f}.gate.tid2eid"),
                    dtype: Dtype::I32,
                    shape: vec![cfg.vocab_size, k],
                    data: ids.iter().flat_map(|x| x.to_le_bytes()).collect(),
                });
            }
        }
        for i in 0..e {
            self.mlp(&format!("{f}.experts.{i}"), cfg, cfg.moe_intermediate_size, true);
        }
        self.mlp(&format!("{f}.shared_experts"), cfg, cfg.moe_intermediate_size * cfg.n_shared_experts, false);
    }
}

/// Random weights for `cfg` in the published naming and formats, from `seed`.
pub fn random_checkpoint(cfg: &ModelConfig, seed: u64) -> Vec<TensorData> {
    let mut w = Writer { rng: Normal { state: seed ^ 0x5eed_d1ce_0fd3_3b00 }, tensors: Vec::new() };
    let d = cfg.hidden_size;
    w.bf16("embed", cfg.vocab_size, d, 1.0);
    for i in 0..cfg.num_layers {
        w.block(&format!("layers.{i}"), cfg, cfg.attention[i], cfg.routing[i]);
    }
    let hc = cfg.hc_mult;
    for prefix in std::iter::once(String::new()).chain((0..cfg.num_mtp_layers).map(|i| format!("mtp.{i}."))) {
        w.f32(&format!("{prefix}hc_head_fn"), &[hc, hc * d], 0.0, 0.05);
        w.f32(&format!("{prefix}hc_head_base"), &[hc], 0.0, 0.5);
        w.f32(&format!("{prefix}hc_head_scale"), &[1], 1.0, 0.1);
    }
    w.norm("norm.weight", d);
    w.bf16("head", cfg.vocab_size, d, 2.0 / (d as f32).sqrt());
    for i in 0..cfg.num_mtp_layers {
        let p = format!("mtp.{i}");
        w.norm(&format!("{p}.enorm.weight"), d);
        w.norm(&format!("{p}.hnorm.weight"), d);
        w.fp8(&format!("{p}.e_proj"), d, d, cfg.quant.fp8_block.0);
        w.fp8(&format!("{p}.h_proj"), d, d, cfg.quant.fp8_block.0);
        w.norm(&format!("{p}.norm.weight"), d);
        w.block(&p, cfg, AttentionKind::Window, RoutingKind::TopK);
    }
    w.tensors
}

/// Build a preset model in memory, without touching the file system.
pub fn build(preset: Preset, seed: u64) -> Result<Model, LoadError> {
    if preset.is_v41() {
        return crate::presets_v41::build(&preset.v41_config(), preset.name(), seed);
    }
    let cfg = preset.config();
    let bytes = Bytes::from(serialize(&random_checkpoint(&cfg, seed)));
    let checkpoint = Checkpoint::from_bytes(&format!("builtin:{}", preset.name()), bytes)?;
    let weights = crate::model::weights::Weights::load(&checkpoint, &cfg)?;
    Ok(Model::new(cfg, weights))
}

#[cfg(test)]
mod tests {
    use super::Preset;
    use crate::config::ModelConfig;

    /// DeepSeek's published keys (`compress_ratios`, `num_hash_layers`) and the
    /// `transformers` ones (`layer_types`, `mlp_layer_types`) describe the same
    /// model: each spelling alone parses to the preset's configuration.
    #[test]
    fn published_and_transformers_spellings_agree() {
        for preset in Preset::ALL.into_iter().filter(|p| !p.is_v41()) {
            let full = preset.config_json();
            let mut published = full.clone();
            let map = published.as_object_mut().unwrap();
            map.remove("layer_types");
            map.remove("mlp_layer_types");
            map.remove("compress_rates");
            let mut transformers = full.clone();
            let map = transformers.as_object_mut().unwrap();
            map.remove("compress_ratios");
            map.remove("num_hash_layers");
            let expected = preset.config();
            for (label, json) in [("published", published), ("transformers", transformers)] {
                let parsed = ModelConfig::from_json_str(&json.to_string(), preset.name()).unwrap();
                assert_eq!(parsed, expected, "{} in the {label} spelling", preset.name());
            }
            let ratios = full["compress_ratios"].as_array().unwrap().len();
            let layers =
                full["num_hidden_layers"].as_u64().unwrap() + full["num_nextn_predict_layers"].as_u64().unwrap();
            assert_eq!(ratios as u64, layers, "{}: one ratio per layer and per MTP layer", preset.name());
        }
    }
}
