//! `ModelConfig`: the DeepSeek-V4 hyper-parameters, read from a Hugging Face
//! `config.json`. Both the modern `DeepseekV4Config` keys (`layer_types`,
//! `compress_rates`, `mlp_layer_types`, `rope_parameters`) and the legacy keys
//! that DeepSeek's published checkpoints ship (`compress_ratios`,
//! `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) are understood.

use std::path::Path;

use serde_json::{Map, Value};

/// An error in a config file; the message names the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {source}")]
    Io { file: String, source: std::io::Error },
    #[error("{file}: not valid JSON: {source}")]
    Json { file: String, source: serde_json::Error },
    #[error("{file}: missing key `{key}`")]
    Missing { file: String, key: String },
    #[error("{file}: key `{key}`: {problem}")]
    Invalid { file: String, key: String, problem: String },
}

/// The attention of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Sliding window only.
    Window,
    /// Compressed sparse attention: overlapping compressor of this ratio, lightning-indexer top-k.
    Csa { ratio: usize },
    /// Heavily compressed attention: non-overlapping compressor of this ratio, all visible entries.
    Hca { ratio: usize },
}

impl AttentionKind {
    pub fn compress_ratio(self) -> Option<usize> {
        match self {
            AttentionKind::Window => None,
            AttentionKind::Csa { ratio } | AttentionKind::Hca { ratio } => Some(ratio),
        }
    }
}

/// How a layer's MoE picks experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoutingKind {
    /// Fixed token-id → experts table (`tid2eid`).
    Hash,
    /// Top-k over router scores plus a selection-only bias.
    TopK,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Factor on cos/sin: 1 for the published `rope_scaling` spelling (DeepSeek's
    /// reference applies none); in a nested `rope_parameters` block, what transformers
    /// derives when the key is absent (`0.1·ln(factor) + 1`, or the mscale ratio).
    pub attention_factor: f64,
}

/// Block sizes of the quantised weights, from `quantization_config`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantConfig {
    pub fp8_block: (usize, usize),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    pub attention: Vec<AttentionKind>,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub routing: Vec<RoutingKind>,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub swiglu_limit: f32,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub compress_yarn: Option<YarnConfig>,
    pub max_position_embeddings: usize,
    pub num_mtp_layers: usize,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub quant: QuantConfig,
    /// Prefix-cache blocks carry the window state, so a hit needs no replay (V4.1).
    pub blocks_hold_windows: bool,
}

pub(crate) struct Reader<'a> {
    pub(crate) file: &'a str,
    pub(crate) map: &'a Map<String, Value>,
}

impl<'a> Reader<'a> {
    pub(crate) fn missing(&self, key: &str) -> ConfigError {
        ConfigError::Missing { file: self.file.into(), key: key.into() }
    }
    pub(crate) fn invalid(&self, key: &str, problem: impl Into<String>) -> ConfigError {
        ConfigError::Invalid { file: self.file.into(), key: key.into(), problem: problem.into() }
    }
    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    pub(crate) fn usize(&self, key: &str) -> Result<usize, ConfigError> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }
    pub(crate) fn opt_usize(&self, key: &str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.invalid(key, format!("expected a non-negative integer, found {v}"))),
        }
    }
    pub(crate) fn positive(&self, key: &str) -> Result<usize, ConfigError> {
        let n = self.usize(key)?;
        if n == 0 {
            return Err(self.invalid(key, "must be at least 1"));
        }
        Ok(n)
    }
    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.invalid(key, format!("expected a number, found {v}"))),
        }
    }
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.invalid(key, format!("expected true or false, found {v}"))),
        }
    }
    pub(crate) fn usize_list(&self, key: &str) -> Result<Option<Vec<usize>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| self.invalid(key, format!("expected non-negative integers, found {v}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(self.invalid(key, format!("expected a list of integers, found {v}"))),
        }
    }
    pub(crate) fn str_list(&self, key: &str) -> Result<Option<Vec<&'a str>>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().ok_or_else(|| self.invalid(key, format!("expected strings, found {v}"))))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(self.invalid(key, format!("expected a list of strings, found {v}"))),
        }
    }
    pub(crate) fn token_id(&self, key: &str, default: u32) -> Result<u32, ConfigError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Array(ids)) => ids
                .first()
                .and_then(Value::as_u64)
                .map(|v| v as u32)
                .ok_or_else(|| self.invalid(key, "expected a token id or a non-empty list of ids")),
            Some(v) => {
                v.as_u64().map(|v| v as u32).ok_or_else(|| self.invalid(key, format!("expected a token id, found {v}")))
            }
        }
    }
}

impl ModelConfig {
    /// Read `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { file: file.clone(), source })?;
        Self::from_json_str(&text, &file)
    }

    /// Parse the text of a `config.json`; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|source| ConfigError::Json { file: file.into(), source })?;
        let map = value.as_object().ok_or_else(|| ConfigError::Invalid {
            file: file.into(),
            key: "<root>".into(),
            problem: "expected a JSON object".into(),
        })?;
        let r = Reader { file, map };
        if let Some(model_type) = r.get("model_type") {
            if model_type.as_str() != Some("deepseek_v4") {
                return Err(r.invalid("model_type", format!("expected \"deepseek_v4\", found {model_type}")));
            }
        }

        let num_layers = r.positive("num_hidden_layers")?;
        let hidden_size = r.positive("hidden_size")?;
        let num_heads = r.positive("num_attention_heads")?;
        let head_dim = r.positive("head_dim")?;
        if let Some(kv_heads) = r.opt_usize("num_key_value_heads")? {
            if kv_heads != 1 {
                return Err(r.invalid("num_key_value_heads", "DeepSeek-V4 shares one KV head; expected 1"));
            }
        }
        let rope_dim = Self::read_rope_dim(&r, head_dim)?;
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(r.invalid("qk_rope_head_dim", format!("{rope_dim} must be even and at most head_dim")));
        }

        let attention = Self::read_attention(&r, num_layers)?;
        let routing = Self::read_routing(&r, num_layers)?;

        let o_groups = r.positive("o_groups")?;
        if num_heads % o_groups != 0 {
            return Err(r.invalid("o_groups", format!("{o_groups} does not divide num_attention_heads {num_heads}")));
        }
        let n_routed_experts = r.positive("n_routed_experts")?;
        let experts_per_token = r.positive("num_experts_per_tok")?;
        if experts_per_token > n_routed_experts {
            return Err(r.invalid("num_experts_per_tok", "exceeds n_routed_experts"));
        }
        if let Some(func) = r.get("scoring_func") {
            if func.as_str() != Some("sqrtsoftplus") {
                return Err(r.invalid("scoring_func", format!("only \"sqrtsoftplus\" is supported, found {func}")));
            }
        }
        // Both references renormalise the selected sqrt-softplus scores unconditionally.
        if !r.bool_or("norm_topk_prob", true)? {
            return Err(r.invalid(
                "norm_topk_prob",
                "DeepSeek-V4 always renormalises the top-k weights; false is not this architecture",
            ));
        }
        // A compressor pools `ratio` slots (twice that with overlap) per entry.
        let ratio_max = deepinfer_kernels::pooling::POOL_ROWS_MAX / 2;
        if let Some(ratio) =
            attention.iter().filter_map(|a| a.compress_ratio()).find(|&n| !(1..=ratio_max).contains(&n))
        {
            // The key the ratios came from: a per-layer list, else the rates.
            let key = ["compress_ratios", "compress_rates", "compress_rate_csa", "compress_rate_hca"]
                .into_iter()
                .find(|k| r.get(k).is_some())
                .unwrap_or("compress_ratios");
            return Err(r.invalid(key, format!("a compress ratio of {ratio}: must be 1 to {ratio_max}")));
        }
        let index_head_dim = r.positive("index_head_dim")?;
        if attention.iter().any(|a| matches!(a, AttentionKind::Csa { .. })) && index_head_dim < rope_dim {
            return Err(r.invalid("index_head_dim", "must be at least qk_rope_head_dim"));
        }

        let (rope_theta, compress_rope_theta, compress_yarn) = Self::read_rope(&r)?;
        let quant = Self::read_quant(&r)?;

        Ok(ModelConfig {
            vocab_size: r.positive("vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            head_dim,
            rope_dim,
            q_lora_rank: r.positive("q_lora_rank")?,
            o_groups,
            o_lora_rank: r.positive("o_lora_rank")?,
            sliding_window: r.positive("sliding_window")?,
            attention,
            index_n_heads: r.positive("index_n_heads")?,
            index_head_dim,
            index_topk: r.positive("index_topk")?,
            n_routed_experts,
            n_shared_experts: r.opt_usize("n_shared_experts")?.unwrap_or(1),
            experts_per_token,
            moe_intermediate_size: r.positive("moe_intermediate_size")?,
            routing,
            routed_scaling_factor: r.f64_or("routed_scaling_factor", 1.5)? as f32,
            norm_topk_prob: true,
            swiglu_limit: r.f64_or("swiglu_limit", 10.0)? as f32,
            hc_mult: r.opt_usize("hc_mult")?.unwrap_or(4),
            hc_sinkhorn_iters: r.opt_usize("hc_sinkhorn_iters")?.unwrap_or(20),
            hc_eps: r.f64_or("hc_eps", 1e-6)? as f32,
            rms_norm_eps: r.f64_or("rms_norm_eps", 1e-6)? as f32,
            rope_theta,
            compress_rope_theta,
            compress_yarn,
            max_position_embeddings: r.positive("max_position_embeddings")?,
            num_mtp_layers: r.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
            bos_token_id: r.token_id("bos_token_id", 0)?,
            eos_token_id: r.token_id("eos_token_id", 1)?,
            quant,
            blocks_hold_windows: false,
        })
    }

    /// Rotary channels per head: `qk_rope_head_dim`, else `head_dim × partial_rotary_factor`
    /// truncated as transformers does (top-level, or per rope type in `rope_parameters`,
    /// where both types must agree: one set of channels is rotated in every layer).
    fn read_rope_dim(r: &Reader, head_dim: usize) -> Result<usize, ConfigError> {
        let from_factor = |key: &str, factor: f64| -> Result<usize, ConfigError> {
            if !(factor > 0.0 && factor <= 1.0) {
                return Err(r.invalid(key, format!("{factor} is not in (0, 1]")));
            }
            Ok((head_dim as f64 * factor) as usize)
        };
        let mut dims = Vec::new();
        if let Some(Value::Object(params)) = r.get("rope_parameters") {
            for kind in ["main", "compress"] {
                if let Some(f) = params.get(kind).and_then(|p| p.get("partial_rotary_factor")) {
                    let key = format!("rope_parameters.{kind}.partial_rotary_factor");
                    let f = f.as_f64().ok_or_else(|| r.invalid(&key, "expected a number"))?;
                    dims.push((key.clone(), from_factor(&key, f)?));
                }
            }
        }
        if let Some(d) = r.opt_usize("qk_rope_head_dim")? {
            dims.push(("qk_rope_head_dim".into(), d));
        } else if r.get("partial_rotary_factor").is_some() {
            let f = r.f64_or("partial_rotary_factor", 0.0)?;
            dims.push(("partial_rotary_factor".into(), from_factor("partial_rotary_factor", f)?));
        }
        let rope_dim = match dims.first() {
            Some(&(_, d)) => d,
            None => head_dim * 64 / 512,
        };
        if let Some((key, d)) = dims.iter().find(|(_, d)| *d != rope_dim) {
            return Err(r.invalid(key, format!("gives {d} rotary channels where {} gives {rope_dim}", dims[0].0)));
        }
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            return Err(r.invalid(
                &dims.first().map_or("qk_rope_head_dim".into(), |d| d.0.clone()),
                format!("{rope_dim} rotary channels: must be even, at least 2 and at most head_dim"),
            ));
        }
        Ok(rope_dim)
    }

    fn read_attention(r: &Reader, num_layers: usize) -> Result<Vec<AttentionKind>, ConfigError> {
        let mut csa_rate = 4usize;
        let mut hca_rate = 128usize;
        if let Some(rates) = r.get("compress_rates") {
            let rates = rates.as_object().ok_or_else(|| r.invalid("compress_rates", "expected an object"))?;
            for (name, slot) in
                [("compressed_sparse_attention", &mut csa_rate), ("heavily_compressed_attention", &mut hca_rate)]
            {
                if let Some(v) = rates.get(name) {
                    *slot =
                        v.as_u64().filter(|&n| n > 0).ok_or_else(|| {
                            r.invalid(&format!("compress_rates.{name}"), "expected a positive integer")
                        })? as usize;
                }
            }
        }
        if let Some(n) = r.opt_usize("compress_rate_csa")? {
            csa_rate = n;
        }
        if let Some(n) = r.opt_usize("compress_rate_hca")? {
            hca_rate = n;
        }
        if let Some(types) = r.str_list("layer_types")? {
            if types.len() < num_layers {
                return Err(r.invalid("layer_types", format!("has {} entries for {num_layers} layers", types.len())));
            }
            return types[..num_layers]
                .iter()
                .map(|t| match *t {
                    "sliding_attention" => Ok(AttentionKind::Window),
                    "compressed_sparse_attention" => Ok(AttentionKind::Csa { ratio: csa_rate }),
                    "heavily_compressed_attention" => Ok(AttentionKind::Hca { ratio: hca_rate }),
                    other => Err(r.invalid("layer_types", format!("unknown layer type \"{other}\""))),
                })
                .collect();
        }
        if let Some(v) = r.get("compress_ratios") {
            let ratios = v.as_array().ok_or_else(|| r.invalid("compress_ratios", "expected a list of integers"))?;
            if ratios.len() < num_layers {
                return Err(
                    r.invalid("compress_ratios", format!("has {} entries for {num_layers} layers", ratios.len()))
                );
            }
            return ratios[..num_layers]
                .iter()
                .map(|v| match v.as_u64() {
                    Some(0) => Ok(AttentionKind::Window),
                    Some(n) if n as usize == csa_rate => Ok(AttentionKind::Csa { ratio: n as usize }),
                    Some(n) => Ok(AttentionKind::Hca { ratio: n as usize }),
                    None => Err(r.invalid("compress_ratios", format!("expected integers, found {v}"))),
                })
                .collect();
        }
        Err(r.missing("layer_types"))
    }

    fn read_routing(r: &Reader, num_layers: usize) -> Result<Vec<RoutingKind>, ConfigError> {
        if let Some(types) = r.str_list("mlp_layer_types")? {
            if types.len() < num_layers {
                return Err(
                    r.invalid("mlp_layer_types", format!("has {} entries for {num_layers} layers", types.len()))
                );
            }
            return types[..num_layers]
                .iter()
                .map(|t| match *t {
                    "hash_moe" => Ok(RoutingKind::Hash),
                    "moe" => Ok(RoutingKind::TopK),
                    other => Err(r.invalid("mlp_layer_types", format!("unknown MLP layer type \"{other}\""))),
                })
                .collect();
        }
        let hash_layers = r.opt_usize("num_hash_layers")?.unwrap_or(3);
        Ok((0..num_layers).map(|i| if i < hash_layers { RoutingKind::Hash } else { RoutingKind::TopK }).collect())
    }

    fn read_rope(r: &Reader) -> Result<(f64, f64, Option<YarnConfig>), ConfigError> {
        let mut main_theta = r.f64_or("rope_theta", 10000.0)?;
        let mut compress_theta = r.f64_or("compress_rope_theta", 160000.0)?;
        // The scaling block: `rope_scaling` (published checkpoints), or the
        // `compress` entry of a nested `rope_parameters`, or a flat `rope_parameters`.
        let mut scaling_key = "rope_scaling";
        let mut scaling = r.get("rope_scaling").cloned();
        if let Some(params) = r.get("rope_parameters") {
            let params = params.as_object().ok_or_else(|| r.invalid("rope_parameters", "expected an object"))?;
            match (params.get("main"), params.get("compress")) {
                (Some(main), Some(compress)) => {
                    if let Some(t) = main.get("rope_theta").and_then(Value::as_f64) {
                        main_theta = t;
                    }
                    if let Some(t) = compress.get("rope_theta").and_then(Value::as_f64) {
                        compress_theta = t;
                    }
                    scaling_key = "rope_parameters.compress";
                    scaling = Some(compress.clone());
                }
                _ => {
                    if scaling.is_none() {
                        scaling_key = "rope_parameters";
                        scaling = Some(Value::Object(params.clone()));
                    }
                }
            }
        }
        let Some(Value::Object(s)) = scaling else {
            return Ok((main_theta, compress_theta, None));
        };
        // Only an already nested block keeps its own default; transformers sets 1 when it nests.
        let nested = scaling_key == "rope_parameters.compress";
        let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
        let yarn = match kind {
            "default" => None,
            "yarn" => {
                let num = |k: &str, d: Option<f64>| -> Result<f64, ConfigError> {
                    match s.get(k).filter(|v| !v.is_null()) {
                        Some(v) => {
                            v.as_f64().ok_or_else(|| r.invalid(&format!("{scaling_key}.{k}"), "expected a number"))
                        }
                        None => d.ok_or_else(|| r.missing(&format!("{scaling_key}.{k}"))),
                    }
                };
                let original = num("original_max_position_embeddings", None)?;
                let max_positions = r.f64_or("max_position_embeddings", original)?;
                let factor = num("factor", Some(max_positions / original))?;
                // transformers' YaRN default: `0.1·ln(scale)·mscale + 1` (1 at scale ≤ 1).
                let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let derived =
                    match (s.get("mscale").and_then(Value::as_f64), s.get("mscale_all_dim").and_then(Value::as_f64)) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(factor, m) / mscale(factor, all),
                        _ => mscale(factor, 1.0),
                    };
                // The published spelling is read as DeepSeek means it: no cos/sin factor.
                let attention_factor = num("attention_factor", Some(if nested { derived } else { 1.0 }))?;
                Some(YarnConfig {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: num("beta_fast", Some(32.0))?,
                    beta_slow: num("beta_slow", Some(1.0))?,
                    attention_factor,
                })
            }
            other => return Err(r.invalid(&format!("{scaling_key}.rope_type"), format!("unsupported \"{other}\""))),
        };
        Ok((main_theta, compress_theta, yarn))
    }

    fn read_quant(r: &Reader) -> Result<QuantConfig, ConfigError> {
        let mut fp8_block = (128, 128);
        if let Some(q) = r.get("quantization_config") {
            if let Some(b) = q.get("weight_block_size").filter(|v| !v.is_null()) {
                let dims: Option<Vec<usize>> =
                    b.as_array().map(|a| a.iter().filter_map(|v| v.as_u64().map(|n| n as usize)).collect());
                match dims.as_deref() {
                    Some([rows, cols]) if *rows > 0 && *cols > 0 => fp8_block = (*rows, *cols),
                    _ => return Err(r.invalid("quantization_config.weight_block_size", "expected [rows, cols]")),
                }
            }
        }
        Ok(QuantConfig { fp8_block })
    }

    /// Attention head dimensions without rotary embedding.
    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.rope_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLASH_LIKE: &str = r#"{
        "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 1,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
        "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0, 4, 128, 0],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
    }"#;

    #[test]
    fn reads_published_legacy_keys() {
        let c = ModelConfig::from_json_str(FLASH_LIKE, "config.json").unwrap();
        assert_eq!(
            c.attention,
            vec![
                AttentionKind::Window,
                AttentionKind::Window,
                AttentionKind::Csa { ratio: 4 },
                AttentionKind::Hca { ratio: 128 }
            ]
        );
        assert_eq!(c.routing, vec![RoutingKind::Hash, RoutingKind::Hash, RoutingKind::Hash, RoutingKind::TopK]);
        assert_eq!(c.rope_dim, 64);
        assert_eq!(c.compress_yarn.unwrap().factor, 16.0);
        assert_eq!(c.num_mtp_layers, 1);
    }

    #[test]
    fn missing_key_is_named() {
        let text = FLASH_LIKE.replace("\"hidden_size\": 4096,", "");
        let err = ModelConfig::from_json_str(&text, "/m/config.json").unwrap_err().to_string();
        assert_eq!(err, "/m/config.json: missing key `hidden_size`");
    }

    #[test]
    fn malformed_key_is_named() {
        let text = FLASH_LIKE.replace("\"o_groups\": 8", "\"o_groups\": \"eight\"");
        let err = ModelConfig::from_json_str(&text, "config.json").unwrap_err().to_string();
        assert!(err.contains("key `o_groups`") && err.contains("integer"), "{err}");
        let text = FLASH_LIKE.replace("\"o_groups\": 8", "\"o_groups\": 7");
        let err = ModelConfig::from_json_str(&text, "config.json").unwrap_err().to_string();
        assert!(err.contains("key `o_groups`") && err.contains("does not divide"), "{err}");
    }

    #[test]
    fn a_compress_ratio_past_the_pooling_limit_is_refused() {
        let text = FLASH_LIKE.replace("[0, 0, 4, 128, 0]", "[0, 0, 4, 4096, 0]");
        let err = ModelConfig::from_json_str(&text, "config.json").unwrap_err().to_string();
        assert!(err.contains("key `compress_ratios`") && err.contains("4096"), "{err}");
        let text = FLASH_LIKE.replace("[0, 0, 4, 128, 0]", "[0, 0, 4, 2048, 0]");
        assert!(ModelConfig::from_json_str(&text, "config.json").is_ok(), "2048 is within the limit");
    }

    #[test]
    fn bad_json_names_the_file() {
        let err = ModelConfig::from_json_str("{", "x/config.json").unwrap_err().to_string();
        assert!(err.starts_with("x/config.json: not valid JSON"), "{err}");
    }
}
