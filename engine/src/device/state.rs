//! One sequence's state in a device's memory: per layer the sliding window's
//! last `window − 1` keys and the compressors' slots (entries, the open
//! window, the overlap series). It converts to and from the CPU's
//! [`LayerState`]s exactly, which is how a prefix-cache block is captured or
//! restored and how a state moves between devices.

use std::sync::{Arc, Mutex, MutexGuard};

use deepinfer_cuda::ops::compressor::{CompressorSlots, DeviceCompressor};
use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};

use super::weights::DeviceWeights;
use crate::config::ModelConfig;
use crate::model::state::{CompressorState, LayerState};

/// Compressed entries a fresh compressor has room for; the slots double when full.
const INITIAL_ENTRIES: usize = 64;

pub(crate) struct DeviceLayer {
    /// `[window − 1, head_dim]`: the last keys, oldest first, `window_rows` of them.
    pub window: DeviceBuffer<f32>,
    pub window_rows: usize,
    pub compressor: Option<CompressorSlots>,
    pub indexer: Option<CompressorSlots>,
}

pub(crate) struct DeviceSequence {
    pub layers: Vec<DeviceLayer>,
    /// A DeepSeek-V4.1 sequence (`layers` is then empty).
    pub v41: Option<Box<super::v41::V41Sequence>>,
}

/// A sequence's state on a device, shared by clones of its
/// [`SequenceState`](crate::model::SequenceState) (a clone does not copy
/// device memory); freed when the last holder drops it.
#[derive(Clone)]
pub struct DeviceState(Arc<Mutex<DeviceSequence>>);

impl std::fmt::Debug for DeviceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceState({} layers)", self.lock().layers.len())
    }
}

impl PartialEq for DeviceState {
    /// The same device state (not equal contents).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl DeviceState {
    pub(crate) fn new(sequence: DeviceSequence) -> Self {
        Self(Arc::new(Mutex::new(sequence)))
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, DeviceSequence> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Bytes of device memory this state's values occupy (what is held, not reserved).
    pub fn state_bytes(&self, cfg: &ModelConfig) -> usize {
        let seq = self.lock();
        seq.layers
            .iter()
            .map(|l| {
                let c = |s: &Option<CompressorSlots>, dim: usize| s.as_ref().map_or(0, |s| s.count() * dim);
                l.window_rows * cfg.head_dim + c(&l.compressor, cfg.head_dim) + c(&l.indexer, cfg.index_head_dim)
            })
            .sum::<usize>()
            * 4
    }
}

fn slots_from(
    gpu: &Gpu,
    pooling: &DeviceCompressor,
    host: &CompressorState,
    dim: usize,
) -> Result<CompressorSlots, DeviceError> {
    let count = host.entries.len() / dim;
    let capacity = INITIAL_ENTRIES.max(count.next_power_of_two());
    let overlap = host.overlap_kv.as_deref().zip(host.overlap_gate.as_deref());
    CompressorSlots::upload_from(gpu, pooling, &host.entries, &host.pending_kv, &host.pending_gate, overlap, capacity)
}

fn slots_to_host(gpu: &Gpu, slots: &CompressorSlots) -> Result<CompressorState, DeviceError> {
    let h = slots.download(gpu)?;
    Ok(CompressorState {
        entries: h.entries,
        pending_kv: h.pending_kv,
        pending_gate: h.pending_gate,
        overlap_kv: h.overlap_kv,
        overlap_gate: h.overlap_gate,
        draft_mark: None,
    })
}

/// A device sequence holding exactly `layers` (CPU form).
pub(crate) fn upload(
    gpu: &Gpu,
    cfg: &ModelConfig,
    weights: &DeviceWeights,
    layers: &[LayerState],
) -> Result<DeviceSequence, DeviceError> {
    assert_eq!(layers.len(), weights.blocks.len(), "a layer state per layer");
    let hd = cfg.head_dim;
    let keep = cfg.sliding_window - 1;
    let mut out = Vec::with_capacity(layers.len());
    for (layer, block) in layers.iter().zip(&weights.blocks) {
        assert!(layer.draft_window_dropped.is_none(), "no drafts pending on a state moved to a device");
        let rows = layer.window.len() / hd;
        assert!(rows <= keep, "a window of {rows} keys for a window of {}", cfg.sliding_window);
        let window = gpu.zeros::<f32>(keep.max(1) * hd)?;
        gpu.write(&window, 0, &layer.window)?;
        let compressor = match (&block.attn.compressor, &layer.compressor) {
            (Some(c), Some(h)) => Some(slots_from(gpu, &c.pooling, h, c.pooling.dim)?),
            (Some(c), None) => Some(slots_from(gpu, &c.pooling, &CompressorState::default(), c.pooling.dim)?),
            _ => None,
        };
        let indexer = match (&block.attn.indexer, &layer.indexer) {
            (Some(ix), Some(h)) => Some(slots_from(gpu, &ix.compressor.pooling, h, ix.compressor.pooling.dim)?),
            (Some(ix), None) => {
                Some(slots_from(gpu, &ix.compressor.pooling, &CompressorState::default(), ix.compressor.pooling.dim)?)
            }
            _ => None,
        };
        out.push(DeviceLayer { window, window_rows: rows, compressor, indexer });
    }
    Ok(DeviceSequence { layers: out, v41: None })
}

/// The CPU form of a device sequence, value for value.
pub(crate) fn download(gpu: &Gpu, cfg: &ModelConfig, seq: &DeviceSequence) -> Result<Vec<LayerState>, DeviceError> {
    seq.layers
        .iter()
        .map(|l| {
            Ok(LayerState {
                window: gpu.download_range(&l.window, 0, l.window_rows * cfg.head_dim)?,
                compressor: l.compressor.as_ref().map(|s| slots_to_host(gpu, s)).transpose()?,
                indexer: l.indexer.as_ref().map(|s| slots_to_host(gpu, s)).transpose()?,
                draft_window_dropped: None,
                draft_rows: 0,
            })
        })
        .collect()
}

/// Make room in `slots` for `more` entries (doubling), keeping every value
/// (copied on the device).
pub(crate) fn reserve(gpu: &Gpu, slots: &mut CompressorSlots, more: usize) -> Result<(), DeviceError> {
    let needed = slots.count() + more;
    if needed <= slots.capacity() {
        return Ok(());
    }
    slots.grow(gpu, needed.next_power_of_two().max(2 * slots.capacity()))
}
