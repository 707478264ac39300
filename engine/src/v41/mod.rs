//! DeepSeek-V4.1-Flash: config, weights, per-sequence state and the forward
//! pass, with the reference's baked-in arithmetic (bf16 activations, FP8
//! activations before quantised linears, FP8 window KV, FP4 compressed KV and
//! index keys).

pub mod attention;
pub mod config;
pub mod dspark;
pub mod engram;
pub mod ffn;
mod footprint;
pub mod forward;
pub mod numpy_rng;
pub mod ops;
pub mod state;
pub mod transfer;
pub mod vision;
pub mod weights;

use std::path::Path;

pub use config::V41Config;
pub use dspark::Drafts;
use engram::EngramHash;
pub use forward::{ChunkInput, ChunkResult, EmbeddedSpan, Rows};
use ops::RopeTable;
pub use state::V41State;
use weights::Weights;

use crate::checkpoint::Checkpoint;
use crate::model::LoadError;

/// File beside `config.json` mapping every token id to its Engram compressed id.
pub const ENGRAM_TOKEN_MAP: &str = "engram_token_map.json";

pub struct ModelV41 {
    pub config: V41Config,
    pub weights: Weights,
    pub engram_hash: Option<EngramHash>,
    rope_main: RopeTable,
    rope_compress: RopeTable,
}

impl ModelV41 {
    /// Load a directory; an Engram model reads its compressed vocabulary from
    /// `engram_token_map.json` (see [`ModelV41::load_with_token_map`] to give it).
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        Self::load_with_token_map(dir, None)
    }

    /// Load a directory with the Engram compressed id of every token id (derived
    /// from the tokenizer by the caller), else from `engram_token_map.json`.
    pub fn load_with_token_map(dir: &Path, token_map: Option<Vec<u32>>) -> Result<Self, LoadError> {
        Self::load_routed(dir, token_map, crate::model::RoutedExperts::Resident)
    }

    /// [`ModelV41::load_with_token_map`] with the main layers' routed experts where `routed` says.
    pub fn load_routed(
        dir: &Path,
        token_map: Option<Vec<u32>>,
        routed: crate::model::RoutedExperts,
    ) -> Result<Self, LoadError> {
        let config = V41Config::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        let weights = Weights::load_with(&checkpoint, &config, routed)?;
        let token_map = match (&config.engram, token_map) {
            (Some(_), Some(map)) => Some(map),
            (Some(_), None) => Some(read_token_map(&dir.join(ENGRAM_TOKEN_MAP))?),
            (None, _) => None,
        };
        Self::new(config, weights, token_map)
    }

    /// Whether `dir` holds a V4.1 model with Engram layers but no token map file.
    pub fn needs_token_map(dir: &Path) -> bool {
        let Ok(cfg) = V41Config::from_file(&dir.join("config.json")) else { return false };
        cfg.engram.is_some() && !dir.join(ENGRAM_TOKEN_MAP).is_file()
    }

    pub fn new(config: V41Config, weights: Weights, token_map: Option<Vec<u32>>) -> Result<Self, LoadError> {
        let engram_hash = match (&config.engram, token_map) {
            (Some(e), Some(map)) => Some(EngramHash::new(e, map).map_err(|problem| {
                crate::checkpoint::CheckpointError::File { file: ENGRAM_TOKEN_MAP.into(), problem }
            })?),
            (Some(_), None) => {
                return Err(crate::checkpoint::CheckpointError::File {
                    file: ENGRAM_TOKEN_MAP.into(),
                    problem: "the config has Engram layers but no token map was given".into(),
                }
                .into())
            }
            (None, _) => None,
        };
        let c = &config;
        let rope_main = RopeTable::new(c.rope_head_dim, c.rope_theta, 0, c.rope_factor, c.beta_fast, c.beta_slow);
        let rope_compress = RopeTable::new(
            c.rope_head_dim,
            c.compress_rope_theta,
            c.original_seq_len,
            c.rope_factor,
            c.beta_fast,
            c.beta_slow,
        );
        Ok(Self { config, weights, engram_hash, rope_main, rope_compress })
    }

    pub fn new_state(&self) -> V41State {
        V41State::new(&self.config)
    }
}

/// `{"token_map": [...], "compressed_vocab_size": N}`.
fn read_token_map(path: &Path) -> Result<Vec<u32>, crate::checkpoint::CheckpointError> {
    let text = std::fs::read_to_string(path).map_err(|e| crate::checkpoint::CheckpointError::File {
        file: path.display().to_string(),
        problem: format!(
            "cannot read ({e}); an Engram model needs its tokenizer's compressed vocabulary: \
             {ENGRAM_TOKEN_MAP} beside config.json, or a tokenizer.json to derive it from"
        ),
    })?;
    parse_token_map(&text, &path.display().to_string())
}

/// The compressed id of every token id, from the text of an `engram_token_map.json`
/// (`file` names it in errors).
pub fn parse_token_map(text: &str, file: &str) -> Result<Vec<u32>, crate::checkpoint::CheckpointError> {
    let err = |problem: String| crate::checkpoint::CheckpointError::File { file: file.to_string(), problem };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
    let list = value
        .get("token_map")
        .and_then(|v| v.as_array())
        .ok_or_else(|| err("missing key `token_map` (a list of compressed ids, one per token id)".into()))?;
    list.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .filter(|&x| x <= u32::MAX as u64)
                .map(|x| x as u32)
                .ok_or_else(|| err(format!("key `token_map[{i}]`: expected a compressed id, found {v}")))
        })
        .collect()
}
