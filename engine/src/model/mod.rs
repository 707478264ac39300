//! The DeepSeek-V4 model: weights, per-sequence state and the forward pass.

mod attention;
pub(crate) mod footprint;
mod forward;
mod hyper;
pub mod moe;
mod routed;
mod rows;
pub mod state;
pub mod weights;

use std::path::Path;

use deepinfer_kernels::ops::{Rope, Yarn};

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::config::{AttentionKind, ConfigError, ModelConfig};
use crate::v41::{ModelV41, V41Config};
pub(crate) use attention::draft_window_mark;
pub use footprint::Footprint;
pub use forward::{Chunk, ChunkOutput, LogitsWanted, MtpChunk, Pass};
pub use moe::{Dispatch, ExpertOutputs, Route};
pub use routed::RoutedExpert;
pub use state::SequenceState;
pub use weights::RoutedExperts;
use weights::Weights;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
}

/// A loaded model: configuration, weights and the rotary tables.
///
/// A DeepSeek-V4.1 model runs its own forward pass (`v41`); `config` is then
/// its scheduling view and `weights` holds no V4 layers.
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub(crate) rope_main: Rope,
    pub(crate) rope_compress: Rope,
    pub v41: Option<Box<ModelV41>>,
    /// The model on an accelerator: its forward pass runs there, on the
    /// device states `new_state` makes (see [`crate::device`]).
    pub device: Option<Box<crate::device::DeviceModel>>,
    /// Where the main layers' routed experts are read from when they are not
    /// in `weights` ([`RoutedExperts::Elsewhere`]).
    expert_source: Option<std::sync::Arc<Checkpoint>>,
}

impl Model {
    /// The V4.1 model whose vision tower serves a request's images, or why this
    /// model takes none (DeepSeek-V4; a V4.1 config without `vision_n_layers`; a
    /// model on a device, whose pass takes no image spans yet): a request error.
    pub fn image_model(&self) -> Result<&ModelV41, crate::v41::vision::ImageError> {
        use crate::v41::vision::ImageError;
        let Some(m) = &self.v41 else {
            return Err(ImageError::NoVisionTower("DeepSeek-V4 has no vision tower".into()));
        };
        m.vision()?;
        if self.device.is_some() {
            return Err(ImageError::Unsupported("images on a device model (its pass takes no image spans yet)".into()));
        }
        Ok(m)
    }

    /// Load `config.json` and the `*.safetensors` weights from a Hugging Face directory.
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        if is_v41_dir(dir)? {
            return Ok(Self::from_v41(ModelV41::load(dir)?));
        }
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
        Self { config, weights, rope_main, rope_compress, v41: None, device: None, expert_source: None }
    }

    /// Wrap a DeepSeek-V4.1 model.
    pub fn from_v41(model: ModelV41) -> Self {
        let config = model.config.scheduling_view();
        let rope = Rope::new(config.rope_dim, config.rope_theta, None);
        Self {
            config,
            weights: Weights::empty(),
            rope_main: rope.clone(),
            rope_compress: rope,
            v41: Some(Box::new(model)),
            device: None,
            expert_source: None,
        }
    }

    pub fn is_v41(&self) -> bool {
        self.v41.is_some()
    }

    /// A fresh state for a new sequence.
    pub fn new_state(&self) -> SequenceState {
        let mut state = SequenceState::new(&self.config);
        if let Some(m) = &self.v41 {
            state.layers.clear();
            state.v41 = Some(m.new_state());
        }
        if let Some(d) = &self.device {
            state.layers.clear();
            // A V4.1 sequence on a device lives there whole.
            state.v41 = None;
            state.device =
                Some(d.new_state().unwrap_or_else(|e| panic!("a sequence's state on {}: {e}", d.gpu().name())));
        }
        state
    }

    /// This model with its forward pass on `gpu` (weights uploaded once).
    /// A V4 model's CPU weights are dropped once uploaded: the host does not
    /// keep a second copy of the model for the life of the process.
    pub fn on_device(mut self, gpu: &deepinfer_cuda::Gpu) -> Result<Self, crate::device::DeviceModelError> {
        self.device = Some(Box::new(crate::device::DeviceModel::upload(gpu, &self)?));
        if self.v41.is_none() {
            let notices = std::mem::take(&mut self.weights.notices);
            self.weights = Weights { notices, ..Weights::empty() };
        }
        Ok(self)
    }

    pub fn is_on_device(&self) -> bool {
        self.device.is_some()
    }

    /// `state` in the CPU's form: a device state's values brought back
    /// (for capturing a prefix-cache block or moving the state; a V4.1
    /// state's as `v41`), any other state as it is.
    pub fn host_state<'s>(&self, state: &'s SequenceState) -> std::borrow::Cow<'s, SequenceState> {
        match (&self.device, &state.device) {
            (Some(d), Some(dev)) => {
                let mut host = state.clone();
                host.device = None;
                let read = |e: deepinfer_cuda::DeviceError| -> ! {
                    panic!("reading a sequence's state from {}: {e}", d.gpu().name())
                };
                if d.is_v41() {
                    host.v41 = Some(d.download_state_v41(dev, state.position).unwrap_or_else(|e| read(e)));
                } else {
                    host.layers = d.download_state(dev).unwrap_or_else(|e| read(e));
                }
                std::borrow::Cow::Owned(host)
            }
            _ => std::borrow::Cow::Borrowed(state),
        }
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

/// Whether `dir/config.json` describes DeepSeek-V4.1.
fn is_v41_dir(dir: &Path) -> Result<bool, ConfigError> {
    let path = dir.join("config.json");
    let file = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Io { file: file.clone(), source })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json { file, source })?;
    Ok(V41Config::is_v41(&value))
}
