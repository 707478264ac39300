//! DeepSeek-V4.1 presets: small configs that keep every V4.1 feature (ratio-2
//! and ratio-1 KV groups, reuse layers, an index source without keys, the
//! candidate filter within a few hundred tokens, Engram before a window layer
//! and a compressed one, DSpark), and a seeded random checkpoint in the
//! published naming and formats (FP8 e4m3 with 32 × 32 UE8M0 blocks, FP4
//! experts packed in I8, FP8 Engram rows with per-32 scales).

use bytes::Bytes;
use deepinfer_kernels::quantize::quantize_fp8_rows;
use safetensors::Dtype;
use serde_json::{json, Value};

use crate::checkpoint::Checkpoint;
use crate::model::{LoadError, Model};
use crate::presets::{serialize, Normal, TensorData, Writer};
use crate::v41::config::{EngramConfig, V41Config};
use crate::v41::engram::EngramHash;

/// Shape of a V4.1 preset.
pub struct Shape {
    pub vocab: usize,
    pub dim: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub window: usize,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub candidate_blocks: usize,
    pub candidate_block: usize,
    pub experts: usize,
    pub active: usize,
    pub inter: usize,
    pub engram_heads: usize,
    pub engram_dim: usize,
}

pub const TINY: Shape = Shape {
    vocab: 1024,
    dim: 64,
    heads: 4,
    head_dim: 64,
    rope: 16,
    q_lora: 32,
    o_groups: 2,
    o_lora: 32,
    window: 16,
    index_heads: 2,
    index_dim: 32,
    index_topk: 16,
    candidate_blocks: 4,
    candidate_block: 8,
    experts: 8,
    active: 2,
    inter: 64,
    engram_heads: 2,
    engram_dim: 32,
};

pub const SMALL: Shape = Shape {
    vocab: 1024,
    dim: 1024,
    heads: 16,
    head_dim: 128,
    rope: 64,
    q_lora: 512,
    o_groups: 4,
    o_lora: 256,
    window: 128,
    index_heads: 8,
    index_dim: 64,
    index_topk: 64,
    candidate_blocks: 16,
    candidate_block: 8,
    experts: 32,
    active: 4,
    inter: 256,
    engram_heads: 4,
    engram_dim: 64,
};

/// V4.1-Flash's ratios at half its width (expert width half the hidden size,
/// 128 experts, 6 active): a CPU benchmark model whose experts do not fit a cache.
pub const MEDIUM: Shape = Shape {
    vocab: 1024,
    dim: 2048,
    heads: 32,
    head_dim: 256,
    rope: 64,
    q_lora: 512,
    o_groups: 4,
    o_lora: 512,
    window: 128,
    index_heads: 16,
    index_dim: 128,
    index_topk: 128,
    candidate_blocks: 32,
    candidate_block: 8,
    experts: 128,
    active: 6,
    inter: 1024,
    engram_heads: 4,
    engram_dim: 128,
};

/// The V4.1 config of `shape`.
pub fn config(shape: &Shape, name: &str) -> V41Config {
    V41Config::from_json_str(&config_json(shape).to_string(), name).expect("preset shapes make valid configs")
}

/// A V4.1 model of `cfg` with seeded random weights, built in memory.
pub fn build(cfg: &V41Config, name: &str, seed: u64) -> Result<Model, LoadError> {
    let bytes = Bytes::from(serialize(&random_checkpoint(cfg, seed)));
    let checkpoint = Checkpoint::from_bytes(&format!("builtin:{name}"), bytes)?;
    let weights = crate::v41::weights::Weights::load(&checkpoint, cfg)?;
    let map = token_map(cfg.vocab_size);
    Ok(Model::from_v41(crate::v41::ModelV41::new(cfg.clone(), weights, Some(map))?))
}

/// Compressed id of every token of the built-in vocabulary: ids `2k` and
/// `2k + 1` share id `k` (a stand-in for the tokenizer-derived vocabulary).
pub fn token_map(vocab: usize) -> Vec<u32> {
    (0..vocab as u32).map(|t| t / 2).collect()
}

/// The preset's `config.json`, in the reference's flat `ModelArgs` spelling.
pub fn config_json(s: &Shape) -> Value {
    let layers = 8;
    let mut cfg = json!({
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "vocab_size": s.vocab,
        "dim": s.dim,
        "moe_inter_dim": s.inter,
        "n_layers": layers,
        "n_mtp_layers": 1,
        "n_heads": s.heads,
        "n_routed_experts": s.experts,
        "n_shared_experts": 1,
        "n_activated_experts": s.active,
        "score_func": "sqrtsoftplus",
        "route_scale": 1.5,
        "swiglu_limit": 10.0,
        "q_lora_rank": s.q_lora,
        "head_dim": s.head_dim,
        "rope_head_dim": s.rope,
        "norm_eps": 1e-20,
        "o_groups": s.o_groups,
        "o_lora_rank": s.o_lora,
        "window_size": s.window,
        "compress_ratios": [0, 2, 2, 2, 1, 1, 1, 1, 0],
        "kv_source_layers": [1, 4],
        "index_source_layers": [1, 3, 4, 6],
        "compress_rope_theta": 160000.0,
        "original_seq_len": 256,
        "rope_theta": 10000.0,
        "rope_factor": 4.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "index_n_heads": s.index_heads,
        "index_head_dim": s.index_dim,
        "index_topk": s.index_topk,
        "candidate_source_layer": 4,
        "candidate_topk_blocks": s.candidate_blocks,
        "candidate_block_size": s.candidate_block,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [0, 2],
        "engram_num_embeddings": [0, 0],
        "engram_max_ngram_size": 3,
        "engram_vocab_size": 211,
        "engram_n_heads": s.engram_heads,
        "engram_head_dim": s.engram_dim,
        "engram_pad_id": 2,
        "engram_compressed_vocab_size": s.vocab / 2,
        "dspark_block_size": 3,
        "dspark_noise_token_id": s.vocab - 1,
        "dspark_target_layer_ids": [6, 7],
        "dspark_markov_rank": 32,
        "max_seq_len": 1 << 16,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "dtype": "fp8",
        "expert_dtype": "fp4",
    });
    let rows = engram_rows(&cfg);
    cfg["engram_num_embeddings"] = json!(rows);
    cfg
}

/// An RGB8 test picture, `w × h`, rows top to bottom: the pattern
/// `tools/oracle/make_v41_vision.py` (`synthetic_image`) draws, in integer
/// arithmetic so both sides make the same bytes; `salt` varies it.
pub fn synthetic_image(w: usize, h: usize, salt: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            for c in 0..3 {
                let v = x * (37 + salt) + y * 91 + c * 53 + ((x * y) % 29) * 7 + ((x / 5 + y / 3) % 2) * 100;
                out.push((v % 256) as u8);
            }
        }
    }
    out
}

/// [`config_json`] with a small vision tower: 2 blocks of width 32 (2 heads),
/// the published patch (14) and downsample ratio (3), images scaled up to at
/// least 56 × 56 pixels and at most 64 tokens a span; the image token is the
/// id below the DSpark noise token.
pub fn vision_config_json(s: &Shape) -> Value {
    let mut cfg = config_json(s);
    let keys = json!({
        "vision_n_layers": 2,
        "vision_dim": 32,
        "vision_n_heads": 2,
        "vision_inter_dim": 48,
        "vision_patch_size": 14,
        "vision_rope_theta": 10000.0,
        "vision_downsample_ratio": 3,
        "vision_max_n_token": 64,
        "vision_min_pixels": 56 * 56,
        "vision_max_wh_ratio": null,
        "image_token_id": s.vocab - 2,
    });
    for (k, v) in keys.as_object().expect("an object") {
        cfg[k] = v.clone();
    }
    cfg
}

/// Table rows each Engram layer's disjoint prime buckets need.
fn engram_rows(cfg: &Value) -> Vec<u64> {
    let layers: Vec<usize> = serde_json::from_value(cfg["engram_layer_ids"].clone()).expect("layer ids");
    let e = EngramConfig {
        num_embeddings: vec![u32::MAX as usize; layers.len()],
        layer_ids: layers,
        max_ngram_size: cfg["engram_max_ngram_size"].as_u64().unwrap() as usize,
        vocab_size: cfg["engram_vocab_size"].as_u64().unwrap() as usize,
        n_heads: cfg["engram_n_heads"].as_u64().unwrap() as usize,
        head_dim: cfg["engram_head_dim"].as_u64().unwrap() as usize,
        pad_id: 2,
        compressed_vocab_size: cfg["engram_compressed_vocab_size"].as_u64().unwrap() as usize,
    };
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    let hash = EngramHash::new(&e, token_map(vocab)).expect("preset token map");
    hash.offsets.iter().zip(&hash.primes).map(|(o, p)| o.last().unwrap() + p.last().unwrap()).collect()
}

impl Writer {
    fn engram_table(&mut self, name: &str, rows: usize, cols: usize) {
        let v = self.rng.vec(rows * cols, 0.0, 1.0);
        let q = quantize_fp8_rows(&v, rows, cols, 32);
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

    fn v41_expert(&mut self, prefix: &str, c: &V41Config, fp4: bool) {
        let (d, inter) = (c.dim, c.moe_inter_dim);
        for (name, rows, cols) in [("w1", inter, d), ("w2", d, inter), ("w3", inter, d)] {
            if fp4 {
                self.fp4(&format!("{prefix}.{name}"), rows, cols);
            } else {
                self.fp8(&format!("{prefix}.{name}"), rows, cols, 32);
            }
        }
    }

    fn v41_block(&mut self, p: &str, c: &V41Config, layer: usize) {
        let d = c.dim;
        let std = 1.0 / (d as f32).sqrt();
        let hc = c.hc_mult;
        let mix = (2 + hc) * hc;
        self.f32(&format!("{p}.attn_norm.weight"), &[d], 1.0, 0.1);
        self.f32(&format!("{p}.ffn_norm.weight"), &[d], 1.0, 0.1);
        for h in ["hc_attn", "hc_ffn"] {
            self.f32(&format!("{p}.{h}_fn"), &[mix, hc * d], 0.0, 0.05);
            self.f32(&format!("{p}.{h}_base"), &[mix], 0.0, 0.5);
            self.f32(&format!("{p}.{h}_scale"), &[3], 1.0, 0.1);
        }
        let a = format!("{p}.attn");
        let qdim = c.n_heads * c.head_dim;
        self.fp8(&format!("{a}.wq_a"), c.q_lora_rank, d, 32);
        self.f32(&format!("{a}.q_norm.weight"), &[c.q_lora_rank], 1.0, 0.1);
        self.fp8(&format!("{a}.wq_b"), qdim, c.q_lora_rank, 32);
        self.fp8(&format!("{a}.wkv"), c.head_dim, d, 32);
        self.f32(&format!("{a}.kv_norm.weight"), &[c.head_dim], 1.0, 0.1);
        self.fp8(&format!("{a}.wo_a"), c.o_groups * c.o_lora_rank, qdim / c.o_groups, 32);
        self.fp8(&format!("{a}.wo_b"), d, c.o_groups * c.o_lora_rank, 32);
        self.f32(&format!("{a}.attn_sink"), &[c.n_heads], 0.0, 1.0);
        if let Some(plan) = c.layers.get(layer).copied() {
            if plan.owns_compressor(layer) {
                self.bf16(&format!("{a}.compressor.wkv"), c.head_dim, d, std);
                if plan.ratio > 1 {
                    self.bf16(&format!("{a}.compressor.wgate"), c.head_dim, d, std);
                }
                self.f32(&format!("{a}.compressor.norm.weight"), &[c.head_dim], 1.0, 0.1);
                self.bf16(&format!("{a}.indexer.wk"), c.index_head_dim, c.head_dim, 1.0 / (c.head_dim as f32).sqrt());
                self.f32(&format!("{a}.indexer.k_norm.weight"), &[c.index_head_dim], 1.0, 0.1);
            }
            if plan.runs_indexer(layer) {
                self.fp8(&format!("{a}.indexer.wq_b"), c.index_n_heads * c.index_head_dim, c.q_lora_rank, 32);
                self.bf16(&format!("{a}.indexer.weights_proj"), c.index_n_heads, d, std);
            }
            if let (Some(slot), Some(e)) = (plan.engram, &c.engram) {
                let g = format!("{p}.engram");
                self.engram_table(&format!("{g}.embed"), e.num_embeddings[slot], e.head_dim);
                self.fp8(&format!("{g}.wkv"), d * (hc + 1), e.hash_cols() * e.head_dim, 32);
                self.f32(&format!("{g}.q_weight"), &[hc, d], 1.0, 0.1);
                self.f32(&format!("{g}.k_weight"), &[hc, d], 1.0, 0.1);
            }
        }
        let f = format!("{p}.ffn");
        let (e, _) = c.moe_config(layer);
        self.bf16(&format!("{f}.gate"), e, d, std);
        self.f32(&format!("{f}.gate.bias"), &[e], 0.0, 0.1);
        if c.vision.is_some() {
            self.f32(&format!("{f}.gate.bias_vl"), &[e], 0.0, 0.1);
        }
        for i in 0..e {
            self.v41_expert(&format!("{f}.experts.{i}"), c, true);
        }
        self.v41_expert(&format!("{f}.shared_experts"), c, false);
    }
}

impl Writer {
    /// A bf16 vector under `name` exactly.
    fn bf16_vector(&mut self, name: &str, len: usize, std: f32) {
        let v = self.rng.vec(len, 0.0, std);
        self.tensors.push(TensorData {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: vec![len],
            data: v.iter().flat_map(|x| deepinfer_kernels::dtype::f32_to_bf16(*x).to_le_bytes()).collect(),
        });
    }

    /// A bf16 linear `[out, inp]` and, with `bias`, its bf16 bias.
    fn biased(&mut self, name: &str, out: usize, inp: usize, bias: bool) {
        self.bf16(name, out, inp, 1.0 / (inp as f32).sqrt());
        if bias {
            self.bf16_vector(&format!("{name}.bias"), out, 0.1);
        }
    }

    /// The vision tower, the aligner and the span vectors, named and typed as published.
    fn vision(&mut self, v: &crate::v41::vision::VisionConfig, d: usize) {
        let vd = v.dim;
        self.biased("vision.patch_embed.proj", vd, 3 * v.patch_size * v.patch_size, true);
        for i in 0..v.n_layers {
            let p = format!("vision.blocks.{i}");
            self.f32(&format!("{p}.norm1.weight"), &[vd], 1.0, 0.1);
            self.biased(&format!("{p}.attn.wqkv"), 3 * vd, vd, true);
            self.biased(&format!("{p}.attn.wo"), vd, vd, true);
            self.f32(&format!("{p}.norm2.weight"), &[vd], 1.0, 0.1);
            self.biased(&format!("{p}.mlp.w1"), 2 * v.inter_dim, vd, false);
            self.biased(&format!("{p}.mlp.w2"), vd, v.inter_dim, false);
        }
        self.f32("vision.norm.weight", &[vd], 1.0, 0.1);
        let r2 = v.downsample_ratio * v.downsample_ratio;
        self.biased("aligner.w1", d, vd * r2, true);
        self.biased("aligner.w2", d, d, true);
        for name in ["image_start", "image_end", "image_newline"] {
            self.bf16_vector(name, d, 1.0);
        }
    }
}

/// Random V4.1 weights for `cfg` in the published naming and formats, from `seed`.
pub fn random_checkpoint(c: &V41Config, seed: u64) -> Vec<TensorData> {
    let mut w = Writer { rng: Normal { state: seed ^ 0x5eed_0041_0fd3_3b00 }, tensors: Vec::new() };
    let d = c.dim;
    w.bf16("embed", c.vocab_size, d, 1.0);
    for i in 0..c.n_layers {
        w.v41_block(&format!("layers.{i}"), c, i);
    }
    w.f32("norm.weight", &[d], 1.0, 0.1);
    w.bf16("head", c.vocab_size, d, 2.0 / (d as f32).sqrt());
    if let Some(v) = &c.vision {
        w.vision(v, d);
    }
    if let Some(ds) = &c.dspark {
        for k in 0..c.n_mtp_layers {
            let p = format!("mtp.{k}");
            w.v41_block(&p, c, c.n_layers + k);
            if k == 0 {
                w.fp8(&format!("{p}.main_proj"), d, d * ds.target_layer_ids.len(), 32);
                w.f32(&format!("{p}.main_norm.weight"), &[d], 1.0, 0.1);
            }
            if k + 1 == c.n_mtp_layers {
                w.f32(&format!("{p}.norm.weight"), &[d], 1.0, 0.1);
                w.bf16(&format!("{p}.markov_head.embed"), c.vocab_size, ds.markov_rank, 1.0);
                w.bf16(
                    &format!("{p}.markov_head.head"),
                    c.vocab_size,
                    ds.markov_rank,
                    1.0 / (ds.markov_rank as f32).sqrt(),
                );
                w.bf16(&format!("{p}.confidence_head.proj"), 1, d + ds.markov_rank, 1.0 / (d as f32).sqrt());
            }
        }
    }
    w.tensors
}

/// The token map file written beside a V4.1 preset's config.
pub fn token_map_json(vocab: usize) -> Value {
    let map = token_map(vocab);
    json!({"token_map": map, "compressed_vocab_size": vocab / 2})
}
