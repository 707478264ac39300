//! The model on an accelerator: a DeepSeek-V4 model whose weights and
//! per-sequence states live in a device's memory (`deepinfer_cuda::Gpu`: an
//! NVIDIA GPU through CUDA, or the emulated device that runs the same
//! kernels on the host). [`Model`](crate::model::Model) carries one as
//! `device`, as it carries a V4.1 model, so the engine, the scheduler, the
//! prefix cache, batch mode and `serve` drive it through the same calls.
//!
//! The forward pass (`forward.rs`) is written once over the device's
//! operations (`deepinfer_cuda::ops`); each operation follows the CPU
//! kernel's definition, so a device step gives the CPU engine's bits.
//! A DeepSeek-V4.1 model runs its own pass (`v41/`), with the same guarantee
//! against the CPU's `crate::v41`.

mod forward;
mod state;
mod v41;
mod weights;

use deepinfer_cuda::{DeviceError, Gpu};
use deepinfer_kernels::ops::Rope;

pub use state::DeviceState;
pub use v41::V41Sequence;

use crate::config::ModelConfig;
use crate::model::state::LayerState;
use crate::model::{Chunk, ChunkOutput, LogitsWanted, Model};
use forward::Span;
use weights::DeviceWeights;

/// Why a model cannot run on a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceModelError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error("{0} does not run on a device yet")]
    Unsupported(&'static str),
}

/// A model's weights on a device, with what its pass needs beside them: a
/// V4 model's, or a V4.1 model's in `v41` (its V4 weights are then empty).
pub struct DeviceModel {
    gpu: Gpu,
    config: ModelConfig,
    weights: DeviceWeights,
    rope_main: Rope,
    rope_compress: Rope,
    v41: Option<Box<v41::DeviceModelV41>>,
}

impl DeviceModel {
    /// Upload `model`'s weights to `gpu`.
    pub fn upload(gpu: &Gpu, model: &Model) -> Result<Self, DeviceModelError> {
        if let Some(m) = &model.v41 {
            if m.weights.blocks.iter().any(|b| b.moe.experts.is_empty()) {
                return Err(DeviceModelError::Unsupported("a model whose routed experts live on expert shards"));
            }
            return Ok(Self {
                gpu: gpu.clone(),
                config: model.config.clone(),
                weights: no_v4_weights(gpu)?,
                rope_main: model.rope_main.clone(),
                rope_compress: model.rope_compress.clone(),
                v41: Some(Box::new(v41::DeviceModelV41::upload(gpu, m)?)),
            });
        }
        if model.weights.blocks.iter().any(|b| b.moe.experts.is_empty()) {
            return Err(DeviceModelError::Unsupported("a model whose routed experts live on expert shards"));
        }
        let weights = DeviceWeights::upload(gpu, &model.config, &model.weights)?;
        Ok(Self {
            gpu: gpu.clone(),
            config: model.config.clone(),
            weights,
            rope_main: model.rope_main.clone(),
            rope_compress: model.rope_compress.clone(),
            v41: None,
        })
    }

    /// Whether this is a DeepSeek-V4.1 model (its states are [`V41Sequence`]s).
    pub fn is_v41(&self) -> bool {
        self.v41.is_some()
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// A fresh sequence's state on the device.
    pub fn new_state(&self) -> Result<DeviceState, DeviceError> {
        if let Some(m) = &self.v41 {
            let seq = m.new_sequence()?;
            return Ok(DeviceState::new(state::DeviceSequence { layers: Vec::new(), v41: Some(Box::new(seq)) }));
        }
        let host: Vec<LayerState> = crate::model::SequenceState::new(&self.config).layers;
        Ok(DeviceState::new(state::DeviceSequence {
            layers: state::upload(&self.gpu, &self.config, &self.weights, &host)?.layers,
            v41: None,
        }))
    }

    /// A device state holding exactly the CPU form `layers`.
    pub fn upload_state(&self, layers: &[LayerState]) -> Result<DeviceState, DeviceError> {
        Ok(DeviceState::new(state::upload(&self.gpu, &self.config, &self.weights, layers)?))
    }

    /// The CPU form of a device state.
    pub fn download_state(&self, state: &DeviceState) -> Result<Vec<LayerState>, DeviceError> {
        state::download(&self.gpu, &self.config, &state.lock())
    }

    /// A V4.1 device state holding exactly `state` (CPU form).
    pub fn upload_state_v41(&self, state: &crate::v41::V41State) -> Result<DeviceState, DeviceError> {
        let m = self.v41.as_ref().expect("a V4.1 device model");
        let seq = m.upload_state(state)?;
        Ok(DeviceState::new(state::DeviceSequence { layers: Vec::new(), v41: Some(Box::new(seq)) }))
    }

    /// The CPU form of a V4.1 device state whose sequence is at `position`.
    pub fn download_state_v41(
        &self,
        state: &DeviceState,
        position: usize,
    ) -> Result<crate::v41::V41State, DeviceError> {
        let m = self.v41.as_ref().expect("a V4.1 device model");
        let seq = state.lock();
        m.download_state(seq.v41.as_deref().expect("a V4.1 device state"), position)
    }

    /// Bytes of device memory a state's values occupy.
    pub fn state_bytes(&self, state: &DeviceState) -> usize {
        match &self.v41 {
            Some(m) => m.state_bytes(state.lock().v41.as_deref().expect("a V4.1 device state")),
            None => state.state_bytes(&self.config),
        }
    }

    /// [`Model::forward`] on the device.
    pub fn forward(
        &self,
        chunks: &mut [Chunk],
        wanted: LogitsWanted,
        keep_streams: bool,
    ) -> Result<Vec<ChunkOutput>, DeviceError> {
        if let Some(m) = &self.v41 {
            return m.forward(chunks, wanted, keep_streams);
        }
        let mut start = 0;
        let mut spans = Vec::with_capacity(chunks.len());
        for c in chunks.iter() {
            assert_eq!(c.drafts, 0, "a device model verifies no drafts (speculative decoding is refused for it)");
            assert!(!c.state.has_drafts(), "no drafts pending");
            spans.push(Span { start, len: c.tokens.len(), position: c.state.position, replay: c.replay });
            start += c.tokens.len();
        }
        let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        let handles: Vec<DeviceState> =
            chunks.iter().map(|c| c.state.device.clone().expect("a device model runs on device states")).collect();
        let mut guards: Vec<_> = handles.iter().map(|h| h.lock()).collect();
        let mut layers: Vec<&mut Vec<state::DeviceLayer>> = guards.iter_mut().map(|g| &mut g.layers).collect();
        let outputs = self.pass(&tokens, &spans, &mut layers, wanted, keep_streams)?;
        drop(layers);
        drop(guards);
        for c in chunks.iter_mut() {
            c.state.position += c.tokens.len();
        }
        Ok(outputs)
    }
}

/// The V4 weights of a V4.1 device model: none (its own are in `v41`).
fn no_v4_weights(gpu: &Gpu) -> Result<DeviceWeights, DeviceError> {
    use deepinfer_cuda::ops::linear::{DeviceLinear, DeviceWeights as Values};
    let empty = || -> Result<DeviceLinear, DeviceError> {
        Ok(DeviceLinear { rows: 0, cols: 0, weights: Values::F32(gpu.zeros(0)?) })
    };
    Ok(DeviceWeights {
        embed: empty()?,
        blocks: Vec::new(),
        hc_head: weights::DeviceHead { mix: empty()?, base: gpu.zeros(0)?, scale: 0.0 },
        norm: gpu.zeros(0)?,
        head: empty()?,
    })
}
