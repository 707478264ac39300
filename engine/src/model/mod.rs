//! The DeepSeek-V4 model: weights, per-sequence state and the forward pass.

mod attention;
mod forward;
mod hyper;
pub mod moe;
pub mod state;
pub mod weights;

use std::path::Path;

use deepinfer_kernels::ops::{Rope, Yarn};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{AttentionKind, ConfigError, ModelConfig};
pub use forward::{Chunk, ChunkOutput, LogitsWanted, MtpChunk, Pass};
pub use moe::{Dispatch, ExpertOutputs, Route};
pub use state::SequenceState;
use weights::Weights;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// A loaded model: configuration, weights and the rotary tables.
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    rope_main: Rope,
    rope_compress: Rope,
}

impl Model {
    /// Load `config.json` and the `*.safetensors` weights from a Hugging Face directory.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let checkpoint = Checkpoint::open(dir)?;
        let weights = Weights::load(&checkpoint, &config)?;
        Ok(Self::new(config, weights))
    }

    pub fn new(config: ModelConfig, weights: Weights) -> Self {
        let rope_main = Rope::new(config.rope_dim, config.rope_theta, None);
        let yarn = config.compress_yarn.map(|y| Yarn {
            factor: y.factor,
            original_max_position_embeddings: y.original_max_position_embeddings,
            beta_fast: y.beta_fast,
            beta_slow: y.beta_slow,
            attention_factor: y.attention_factor,
        });
        let rope_compress = Rope::new(config.rope_dim, config.compress_rope_theta, yarn);
        Self { config, weights, rope_main, rope_compress }
    }

    /// A fresh state for a new sequence.
    pub fn new_state(&self) -> SequenceState {
        SequenceState::new(&self.config)
    }

    /// Whether the checkpoint carried an MTP block.
    pub fn has_mtp(&self) -> bool {
        !self.weights.mtp.is_empty()
    }

    fn rope_for(&self, kind: AttentionKind) -> &Rope {
        match kind {
            AttentionKind::Window => &self.rope_main,
            _ => &self.rope_compress,
        }
    }
}
