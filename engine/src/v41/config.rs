//! `V41Config`: DeepSeek-V4.1's hyper-parameters, read from the reference's
//! flat `inference/config.json` (its `ModelArgs` field names), and the role of
//! every layer derived from them once (`LayerPlan`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{ConfigError, Reader};

/// How the routed experts' weights turn into scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreFunc {
    Softmax,
    Sigmoid,
    SqrtSoftplus,
}

/// Engram n-gram memory.
#[derive(Clone, Debug, PartialEq)]
pub struct EngramConfig {
    pub layer_ids: Vec<usize>,
    /// Table rows per Engram layer.
    pub num_embeddings: Vec<usize>,
    pub max_ngram_size: usize,
    /// Where each (n-gram size, head) starts searching for its prime bucket count.
    pub vocab_size: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// Token that fills n-gram slots before the sequence start.
    pub pad_id: u32,
    /// Size of the tokenizer-derived compressed vocabulary; every hash multiplier derives from it.
    pub compressed_vocab_size: usize,
}

impl EngramConfig {
    /// Table indices each position looks up per layer: (n-gram sizes 2..=max) × heads.
    pub fn hash_cols(&self) -> usize {
        (self.max_ngram_size - 1) * self.n_heads
    }
}

/// DSpark draft layers (stored as `mtp.K.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct DsparkConfig {
    pub block_size: usize,
    pub noise_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub markov_rank: usize,
    pub n_routed_experts: usize,
    pub n_activated_experts: usize,
}

/// The candidate (first-level) filter role of an index-source layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CandidateRole {
    None,
    /// Publishes the top candidate blocks for the index sources after it.
    Source,
    /// Scores only inside the source's candidate blocks.
    Consumer,
}

/// What one backbone layer's attention does, derived once from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    /// 0: sliding window only; 1: uncompressed shared KV; r > 1: r-to-1 gated pooling.
    pub ratio: usize,
    /// The layer whose compressor (and index keys) this layer reads; itself when it owns one.
    pub kv_source: Option<usize>,
    /// The layer whose selection this layer reuses; itself when it runs an indexer.
    pub index_source: Option<usize>,
    pub candidate: CandidateRole,
    /// Position of this layer in `engram.layer_ids`.
    pub engram: Option<usize>,
}

impl LayerPlan {
    pub fn owns_compressor(&self, layer: usize) -> bool {
        self.kv_source == Some(layer)
    }
    pub fn runs_indexer(&self, layer: usize) -> bool {
        self.index_source == Some(layer)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct V41Config {
    pub vocab_size: usize,
    pub dim: usize,
    pub moe_inter_dim: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_routed_experts: usize,
    pub n_activated_experts: usize,
    pub score_func: ScoreFunc,
    pub gate_temp: f32,
    pub norm_topk_prob: bool,
    pub route_scale: f32,
    pub swiglu_limit: f32,
    pub q_lora_rank: usize,
    pub head_dim: usize,
    pub rope_head_dim: usize,
    pub norm_eps: f32,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub window_size: usize,
    pub compress_ratios: Vec<usize>,
    pub compress_rope_theta: f64,
    pub original_seq_len: usize,
    pub rope_theta: f64,
    pub rope_factor: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub candidate_topk_blocks: usize,
    pub candidate_block_size: usize,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub engram: Option<EngramConfig>,
    pub dspark: Option<DsparkConfig>,
    pub vision: Option<super::vision::VisionConfig>,
    pub n_mtp_layers: usize,
    pub max_seq_len: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub layers: Vec<LayerPlan>,
}

impl V41Config {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { file: file.clone(), source })?;
        Self::from_json_str(&text, &file)
    }

    /// Whether a parsed `config.json` describes DeepSeek-V4.1.
    pub fn is_v41(value: &Value) -> bool {
        let model_type = value.get("model_type").and_then(Value::as_str);
        matches!(model_type, Some("deepseek_v41") | Some("deepseek_v41_text"))
            || (model_type.is_none() && value.get("kv_source_layers").is_some())
    }

    pub fn from_json_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|source| ConfigError::Json { file: file.into(), source })?;
        let map = value.as_object().ok_or_else(|| ConfigError::Invalid {
            file: file.into(),
            key: "<root>".into(),
            problem: "expected a JSON object".into(),
        })?;
        let flat = flat_keys(map, file)?;
        let r = Reader { file, map: &flat };
        Self::read(&r)
    }

    fn read(r: &Reader) -> Result<Self, ConfigError> {
        let n_layers = r.positive("n_layers")?;
        let n_mtp_layers = r.opt_usize("n_mtp_layers")?.unwrap_or(0);
        let dim = r.positive("dim")?;
        let n_heads = r.positive("n_heads")?;
        let head_dim = r.positive("head_dim")?;
        let rope_head_dim = r.positive("rope_head_dim")?;
        let multiple_of = |key: &str, value: usize, unit: usize| {
            if !value.is_multiple_of(unit) {
                Err(r.invalid(key, format!("{value} must be a multiple of {unit} (activation quantisation groups)")))
            } else {
                Ok(())
            }
        };
        multiple_of("dim", dim, 32)?;
        multiple_of("head_dim", head_dim, 32)?;
        if rope_head_dim % 2 != 0 || rope_head_dim > head_dim {
            return Err(r.invalid("rope_head_dim", format!("{rope_head_dim} must be even and at most head_dim")));
        }
        let o_groups = r.positive("o_groups")?;
        if n_heads % o_groups != 0 {
            return Err(r.invalid("o_groups", format!("{o_groups} does not divide n_heads {n_heads}")));
        }
        let n_routed_experts = r.positive("n_routed_experts")?;
        let n_activated_experts = r.positive("n_activated_experts")?;
        if n_activated_experts > n_routed_experts {
            return Err(r.invalid("n_activated_experts", "exceeds n_routed_experts"));
        }
        if r.opt_usize("n_shared_experts")?.unwrap_or(1) != 1 {
            return Err(r.invalid("n_shared_experts", "DeepSeek-V4.1 has exactly one shared expert"));
        }
        let score_func = match r.get("score_func").and_then(Value::as_str).unwrap_or("sqrtsoftplus") {
            "softmax" => ScoreFunc::Softmax,
            "sigmoid" => ScoreFunc::Sigmoid,
            "sqrtsoftplus" => ScoreFunc::SqrtSoftplus,
            other => return Err(r.invalid("score_func", format!("unknown score function {other:?}"))),
        };
        let compress_ratios = r.usize_list("compress_ratios")?.ok_or_else(|| r.missing("compress_ratios"))?;
        if compress_ratios.len() != n_layers + n_mtp_layers {
            return Err(r.invalid(
                "compress_ratios",
                format!(
                    "has {} entries; expected one per layer, draft layers included ({n_layers} + {n_mtp_layers})",
                    compress_ratios.len()
                ),
            ));
        }
        if let Some(bad) = compress_ratios[n_layers.min(compress_ratios.len())..].iter().position(|&x| x != 0) {
            return Err(r.invalid(
                "compress_ratios",
                format!(
                    "entry {} belongs to a DSpark layer, which attends over its window only: expected 0",
                    n_layers + bad
                ),
            ));
        }
        let index_head_dim = r.positive("index_head_dim")?;
        multiple_of("index_head_dim", index_head_dim, 32)?;
        if index_head_dim < rope_head_dim {
            return Err(r.invalid("index_head_dim", "must be at least rope_head_dim"));
        }
        let kv_sources = r.usize_list("kv_source_layers")?.unwrap_or_default();
        let index_sources = r.usize_list("index_source_layers")?.unwrap_or_default();
        let candidate_source = match r.get("candidate_source_layer") {
            None => None,
            Some(v) => match v.as_i64() {
                Some(x) if x < 0 => None,
                Some(x) => Some(x as usize),
                None => return Err(r.invalid("candidate_source_layer", format!("expected a layer id, found {v}"))),
            },
        };
        let candidate_topk_blocks = r.opt_usize("candidate_topk_blocks")?.unwrap_or(0);
        let candidate_block_size = r.opt_usize("candidate_block_size")?.unwrap_or(0);
        let index_topk = r.positive("index_topk")?;
        let engram = Self::read_engram(r)?;
        let layers = Self::plan_layers(
            r,
            &compress_ratios[..n_layers],
            &kv_sources,
            &index_sources,
            candidate_source,
            engram.as_ref(),
        )?;
        if candidate_source.is_some() {
            if candidate_topk_blocks == 0 || candidate_block_size == 0 {
                return Err(r.invalid("candidate_topk_blocks", "a candidate source needs blocks and a block size"));
            }
            // The newest block may hold a single entry: the others must still cover the top-k.
            if candidate_topk_blocks * candidate_block_size - (candidate_block_size - 1) < index_topk {
                return Err(r.invalid(
                    "candidate_topk_blocks",
                    format!(
                        "{candidate_topk_blocks} blocks of {candidate_block_size} can hold fewer than index_topk \
                         ({index_topk}) entries"
                    ),
                ));
            }
        }
        let dspark = Self::read_dspark(r, n_layers, n_mtp_layers)?;
        let expert_dtype = r.get("expert_dtype").and_then(Value::as_str);
        if let Some(t) = expert_dtype.filter(|t| *t != "fp4") {
            return Err(r.invalid("expert_dtype", format!("only \"fp4\" or null, found {t:?}")));
        }
        Ok(Self {
            vocab_size: r.positive("vocab_size")?,
            dim,
            moe_inter_dim: r.positive("moe_inter_dim")?,
            n_layers,
            n_heads,
            n_routed_experts,
            n_activated_experts,
            score_func,
            gate_temp: r.f64_or("gate_temp", 1.0)? as f32,
            norm_topk_prob: r.bool_or("norm_topk_prob", true)?,
            route_scale: r.f64_or("route_scale", 1.0)? as f32,
            swiglu_limit: r.f64_or("swiglu_limit", 0.0)? as f32,
            q_lora_rank: r.positive("q_lora_rank")?,
            head_dim,
            rope_head_dim,
            norm_eps: r.f64_or("norm_eps", 1e-20)? as f32,
            o_groups,
            o_lora_rank: r.positive("o_lora_rank")?,
            window_size: r.positive("window_size")?,
            compress_ratios,
            compress_rope_theta: r.f64_or("compress_rope_theta", 40000.0)?,
            original_seq_len: r.opt_usize("original_seq_len")?.unwrap_or(0),
            rope_theta: r.f64_or("rope_theta", 10000.0)?,
            rope_factor: r.f64_or("rope_factor", 40.0)?,
            beta_fast: r.f64_or("beta_fast", 32.0)?,
            beta_slow: r.f64_or("beta_slow", 1.0)?,
            index_n_heads: r.positive("index_n_heads")?,
            index_head_dim,
            index_topk,
            candidate_topk_blocks,
            candidate_block_size,
            hc_mult: r.positive("hc_mult")?,
            hc_sinkhorn_iters: r.positive("hc_sinkhorn_iters")?,
            hc_eps: r.f64_or("hc_eps", 1e-6)? as f32,
            engram,
            dspark,
            vision: super::vision::VisionConfig::read(r)?,
            n_mtp_layers,
            max_seq_len: r.opt_usize("max_seq_len")?.unwrap_or(1 << 20),
            bos_token_id: r.token_id("bos_token_id", 0)?,
            eos_token_id: r.token_id("eos_token_id", 1)?,
            layers,
        })
    }

    fn read_engram(r: &Reader) -> Result<Option<EngramConfig>, ConfigError> {
        let layer_ids = r.usize_list("engram_layer_ids")?.unwrap_or_default();
        if layer_ids.is_empty() {
            return Ok(None);
        }
        let num_embeddings =
            r.usize_list("engram_num_embeddings")?.ok_or_else(|| r.missing("engram_num_embeddings"))?;
        if num_embeddings.len() != layer_ids.len() {
            return Err(r.invalid("engram_num_embeddings", "needs one entry per engram_layer_ids entry"));
        }
        let max_ngram_size = r.positive("engram_max_ngram_size")?;
        if max_ngram_size < 2 {
            return Err(r.invalid("engram_max_ngram_size", "must be at least 2 (bigrams)"));
        }
        let head_dim = r.positive("engram_head_dim")?;
        if head_dim % 32 != 0 {
            return Err(r.invalid("engram_head_dim", "must be a multiple of 32 (one scale per 32)"));
        }
        Ok(Some(EngramConfig {
            layer_ids,
            num_embeddings,
            max_ngram_size,
            vocab_size: r.positive("engram_vocab_size")?,
            n_heads: r.positive("engram_n_heads")?,
            head_dim,
            pad_id: r.opt_usize("engram_pad_id")?.unwrap_or(2) as u32,
            compressed_vocab_size: r.positive("engram_compressed_vocab_size")?,
        }))
    }

    fn read_dspark(r: &Reader, n_layers: usize, n_mtp_layers: usize) -> Result<Option<DsparkConfig>, ConfigError> {
        let block_size = r.opt_usize("dspark_block_size")?.unwrap_or(0);
        if block_size == 0 {
            return Ok(None);
        }
        if n_mtp_layers == 0 {
            return Err(r.invalid("n_mtp_layers", "DSpark (dspark_block_size > 0) needs at least one draft layer"));
        }
        let target_layer_ids = r.usize_list("dspark_target_layer_ids")?.unwrap_or_default();
        if target_layer_ids.is_empty() || target_layer_ids.iter().any(|&l| l >= n_layers) {
            return Err(r.invalid("dspark_target_layer_ids", format!("needs backbone layer ids below {n_layers}")));
        }
        Ok(Some(DsparkConfig {
            block_size,
            noise_token_id: r.opt_usize("dspark_noise_token_id")?.unwrap_or(0) as u32,
            target_layer_ids,
            markov_rank: r.opt_usize("dspark_markov_rank")?.unwrap_or(256),
            n_routed_experts: r.opt_usize("dspark_n_routed_experts")?.unwrap_or(0),
            n_activated_experts: r.opt_usize("dspark_n_activated_experts")?.unwrap_or(0),
        }))
    }

    /// Each layer's sources: the latest KV source and index source at or before it.
    fn plan_layers(
        r: &Reader,
        ratios: &[usize],
        kv_sources: &[usize],
        index_sources: &[usize],
        candidate_source: Option<usize>,
        engram: Option<&EngramConfig>,
    ) -> Result<Vec<LayerPlan>, ConfigError> {
        let n = ratios.len();
        for (key, list) in [("kv_source_layers", kv_sources), ("index_source_layers", index_sources)] {
            if let Some(&bad) = list.iter().find(|&&l| l >= n || ratios[l] == 0) {
                return Err(r.invalid(key, format!("layer {bad} is not a backbone layer with compress_ratio > 0")));
            }
        }
        if let Some(c) = candidate_source {
            if !index_sources.contains(&c) {
                return Err(r.invalid("candidate_source_layer", format!("layer {c} is not an index source")));
            }
        }
        if let Some(e) = engram {
            if let Some(&bad) = e.layer_ids.iter().find(|&&l| l >= n) {
                return Err(r.invalid("engram_layer_ids", format!("layer {bad} is not a backbone layer")));
            }
        }
        let mut plans = Vec::with_capacity(n);
        let (mut kv, mut index) = (None, None);
        for (layer, &ratio) in ratios.iter().enumerate() {
            if kv_sources.contains(&layer) {
                kv = Some(layer);
            }
            if index_sources.contains(&layer) {
                index = Some(layer);
            }
            let engram_slot = engram.and_then(|e| e.layer_ids.iter().position(|&l| l == layer));
            if ratio == 0 {
                plans.push(LayerPlan {
                    ratio,
                    kv_source: None,
                    index_source: None,
                    candidate: CandidateRole::None,
                    engram: engram_slot,
                });
                continue;
            }
            let problem = |what: &str| {
                r.invalid("compress_ratios", format!("layer {layer} has ratio {ratio} but no {what} at or before it"))
            };
            let (kv_source, index_source) =
                (kv.ok_or_else(|| problem("KV source"))?, index.ok_or_else(|| problem("index source"))?);
            for source in [kv_source, index_source] {
                if ratios[source] != ratio {
                    return Err(r.invalid(
                        "compress_ratios",
                        format!(
                            "layer {layer} (ratio {ratio}) would share layer {source}'s ratio-{} KV",
                            ratios[source]
                        ),
                    ));
                }
            }
            let candidate = match candidate_source {
                Some(c) if c == layer => CandidateRole::Source,
                Some(c) if c < layer && index_source == layer => CandidateRole::Consumer,
                _ => CandidateRole::None,
            };
            if candidate == CandidateRole::Consumer && ratios[candidate_source.unwrap()] != ratio {
                return Err(r.invalid("candidate_source_layer", "candidate consumers must share the source's ratio"));
            }
            plans.push(LayerPlan {
                ratio,
                kv_source: Some(kv_source),
                index_source: Some(index_source),
                candidate,
                engram: engram_slot,
            });
        }
        Ok(plans)
    }

    /// Routed and activated experts of a layer (DSpark layers may have their own).
    pub fn moe_config(&self, layer: usize) -> (usize, usize) {
        match (&self.dspark, layer >= self.n_layers) {
            (Some(d), true) => (
                if d.n_routed_experts > 0 { d.n_routed_experts } else { self.n_routed_experts },
                if d.n_activated_experts > 0 { d.n_activated_experts } else { self.n_activated_experts },
            ),
            _ => (self.n_routed_experts, self.n_activated_experts),
        }
    }

    pub fn mix_shape(&self) -> super::ops::MixShape {
        super::ops::MixShape {
            hc: self.hc_mult,
            iters: self.hc_sinkhorn_iters,
            norm_eps: self.norm_eps,
            hc_eps: self.hc_eps,
        }
    }

    /// Layers whose index keys a sequence keeps (the KV sources).
    pub fn kv_source_layers(&self) -> Vec<usize> {
        (0..self.n_layers).filter(|&l| self.layers[l].owns_compressor(l)).collect()
    }
}

/// Hugging Face `config.json` spellings (under `text_config`) → the reference's `ModelArgs` keys.
const HF_KEYS: &[(&str, &str)] = &[
    ("hidden_size", "dim"),
    ("moe_intermediate_size", "moe_inter_dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("qk_rope_head_dim", "rope_head_dim"),
    ("rms_norm_eps", "norm_eps"),
    ("num_experts_per_tok", "n_activated_experts"),
    ("scoring_func", "score_func"),
    ("routed_scaling_factor", "route_scale"),
    ("sliding_window", "window_size"),
    ("kv_source_layer_ids", "kv_source_layers"),
    ("index_source_layer_ids", "index_source_layers"),
    ("candidate_source_layer_id", "candidate_source_layer"),
    ("engram_pad_token_id", "engram_pad_id"),
    ("num_nextn_predict_layers", "n_mtp_layers"),
    ("dspark_num_experts_per_tok", "dspark_n_activated_experts"),
    ("max_position_embeddings", "max_seq_len"),
];

/// The config as one flat map of `ModelArgs` keys, whichever spelling the file uses.
fn flat_keys(root: &Map<String, Value>, file: &str) -> Result<Map<String, Value>, ConfigError> {
    let invalid = |key: &str, problem: String| ConfigError::Invalid { file: file.into(), key: key.into(), problem };
    let Some(text) = root.get("text_config") else { return Ok(root.clone()) };
    let text = text.as_object().ok_or_else(|| invalid("text_config", "expected an object".into()))?;
    let mut flat = text.clone();
    for key in ["bos_token_id", "eos_token_id"] {
        if let (Some(v), false) = (root.get(key), flat.contains_key(key)) {
            flat.insert(key.to_string(), v.clone());
        }
    }
    for (hf, ours) in HF_KEYS {
        if let (Some(v), false) = (text.get(*hf), text.contains_key(*ours)) {
            flat.insert(ours.to_string(), v.clone());
        }
    }
    if let Some(kv_heads) = text.get("num_key_value_heads") {
        if kv_heads.as_u64() != Some(1) {
            return Err(invalid(
                "text_config.num_key_value_heads",
                format!("DeepSeek-V4.1 shares one KV head, found {kv_heads}"),
            ));
        }
    }
    if let Some(rope) = text.get("rope_scaling").and_then(Value::as_object) {
        for (hf, ours) in [
            ("factor", "rope_factor"),
            ("beta_fast", "beta_fast"),
            ("beta_slow", "beta_slow"),
            ("original_max_position_embeddings", "original_seq_len"),
        ] {
            if let Some(v) = rope.get(hf) {
                flat.entry(ours.to_string()).or_insert_with(|| v.clone());
            }
        }
    }
    if let Some(q) = root.get("quantization_config").and_then(Value::as_object) {
        if let Some(block) = q.get("weight_block_size") {
            if block != &serde_json::json!([32, 32]) {
                return Err(invalid(
                    "quantization_config.weight_block_size",
                    format!("DeepSeek-V4.1 stores 32×32 FP8 blocks, found {block}"),
                ));
            }
        }
        if let Some(fmt) = q.get("scale_fmt").filter(|f| f.as_str() != Some("ue8m0")) {
            return Err(invalid("quantization_config.scale_fmt", format!("only \"ue8m0\" is supported, found {fmt}")));
        }
        if let Some(e) = q.get("expert_dtype") {
            flat.entry("expert_dtype".to_string()).or_insert_with(|| e.clone());
        }
    }
    Ok(flat)
}

impl V41Config {
    /// The V4 `ModelConfig` the scheduler, KV accounting and cost model read:
    /// shapes, and per layer `Csa` (entries + index keys) for the KV sources
    /// that hold compressed state and `Window` for the rest.
    pub fn scheduling_view(&self) -> crate::config::ModelConfig {
        use crate::config::{AttentionKind, ModelConfig, QuantConfig, RoutingKind};
        let attention = (0..self.n_layers)
            .map(|l| {
                let p = self.layers[l];
                if p.owns_compressor(l) {
                    AttentionKind::Csa { ratio: p.ratio }
                } else {
                    AttentionKind::Window
                }
            })
            .collect();
        ModelConfig {
            vocab_size: self.vocab_size,
            hidden_size: self.dim,
            num_layers: self.n_layers,
            num_heads: self.n_heads,
            head_dim: self.head_dim,
            rope_dim: self.rope_head_dim,
            q_lora_rank: self.q_lora_rank,
            o_groups: self.o_groups,
            o_lora_rank: self.o_lora_rank,
            sliding_window: self.window_size,
            attention,
            index_n_heads: self.index_n_heads,
            index_head_dim: self.index_head_dim,
            index_topk: self.index_topk,
            n_routed_experts: self.n_routed_experts,
            n_shared_experts: 1,
            experts_per_token: self.n_activated_experts,
            moe_intermediate_size: self.moe_inter_dim,
            routing: vec![RoutingKind::TopK; self.n_layers],
            routed_scaling_factor: self.route_scale,
            norm_topk_prob: self.norm_topk_prob,
            swiglu_limit: self.swiglu_limit,
            hc_mult: self.hc_mult,
            hc_sinkhorn_iters: self.hc_sinkhorn_iters,
            hc_eps: self.hc_eps,
            rms_norm_eps: self.norm_eps,
            rope_theta: self.rope_theta,
            compress_rope_theta: self.compress_rope_theta,
            compress_yarn: None,
            max_position_embeddings: self.max_seq_len,
            num_mtp_layers: 0,
            bos_token_id: self.bos_token_id,
            eos_token_id: self.eos_token_id,
            quant: QuantConfig { fp8_block: (32, 32) },
            blocks_hold_windows: true,
        }
    }
}
