//! DeepSeek-V4.1 on a device: the weights (`weights.rs`), one sequence's
//! state (`state.rs`) and the forward pass (`forward.rs`), written once over
//! the device's operations (`deepinfer_cuda::ops::v41` for the defined
//! arithmetic, `v41_model` for the model's steps), so that a step gives the
//! CPU engine's (`crate::v41`) logits bit for bit, whatever the batch.
//!
//! What a device V4.1 model refuses: DSpark drafts and speculative decoding
//! (refused for every device model in `speculative`), passes driven layer by
//! layer (`Model::begin_pass` asserts: the actors' expert parallelism), and
//! routed experts that live on expert shards. Its states carry no DSpark
//! window updates (they feed only drafts) and a forward pass returns no
//! DSpark hidden rows (`ChunkOutput::streams` stays empty).

mod forward;
mod state;
mod weights;

use std::sync::{Arc, Mutex};

use deepinfer_cuda::ops::v41::DeviceRope;
use deepinfer_cuda::{DeviceError, Gpu};

pub use state::V41Sequence;

use crate::v41::engram::EngramHash;
use crate::v41::ops::RopeTable;
use crate::v41::{ModelV41, V41Config, V41State};
use weights::DeviceWeightsV41;

/// A rotary table's cos/sin on the device for positions `0..`, grown (to the
/// next power of two) when a pass reaches past it.
struct RopeCache {
    freqs: Vec<f32>,
    table: Mutex<Option<Arc<DeviceRope>>>,
}

impl RopeCache {
    fn new(rope: &RopeTable) -> Self {
        Self { freqs: rope.freqs.clone(), table: Mutex::new(None) }
    }

    /// A table holding positions `0..positions` at least.
    fn table(&self, gpu: &Gpu, positions: usize) -> Result<Arc<DeviceRope>, DeviceError> {
        let mut slot = self.table.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = slot.as_ref().filter(|t| t.positions >= positions) {
            return Ok(Arc::clone(t));
        }
        let t = Arc::new(DeviceRope::new(gpu, &self.freqs, positions.next_power_of_two().max(1024))?);
        *slot = Some(Arc::clone(&t));
        Ok(t)
    }
}

/// A V4.1 model's backbone on a device.
pub(crate) struct DeviceModelV41 {
    gpu: Gpu,
    cfg: V41Config,
    weights: DeviceWeightsV41,
    engram_hash: Option<EngramHash>,
    rope_main: RopeCache,
    rope_compress: RopeCache,
}

impl DeviceModelV41 {
    /// Upload `model`'s backbone to `gpu`. The routed experts must be resident.
    pub(crate) fn upload(gpu: &Gpu, model: &ModelV41) -> Result<Self, DeviceError> {
        let c = &model.config;
        let rope_main = RopeTable::new(c.rope_head_dim, c.rope_theta, 0, c.rope_factor, c.beta_fast, c.beta_slow);
        let rope_compress = RopeTable::new(
            c.rope_head_dim,
            c.compress_rope_theta,
            c.original_seq_len,
            c.rope_factor,
            c.beta_fast,
            c.beta_slow,
        );
        Ok(Self {
            gpu: gpu.clone(),
            cfg: c.clone(),
            weights: DeviceWeightsV41::upload(gpu, c, &model.weights)?,
            engram_hash: model.engram_hash.clone(),
            rope_main: RopeCache::new(&rope_main),
            rope_compress: RopeCache::new(&rope_compress),
        })
    }

    /// A fresh sequence on the device.
    pub(crate) fn new_sequence(&self) -> Result<V41Sequence, DeviceError> {
        V41Sequence::upload(&self.gpu, &self.cfg, &V41State::new(&self.cfg))
    }

    /// A device sequence holding exactly `state` (CPU form).
    pub(crate) fn upload_state(&self, state: &V41State) -> Result<V41Sequence, DeviceError> {
        V41Sequence::upload(&self.gpu, &self.cfg, state)
    }

    /// The CPU form of a device sequence at `position`.
    pub(crate) fn download_state(&self, seq: &V41Sequence, position: usize) -> Result<V41State, DeviceError> {
        seq.download(&self.gpu, &self.cfg, position)
    }

    pub(crate) fn state_bytes(&self, seq: &V41Sequence) -> usize {
        seq.state_bytes(&self.cfg)
    }
}
