//! Per-sequence state carried between forward steps: the sliding-window KV,
//! the compressed entries and the compressors' partial windows.

use crate::config::{AttentionKind, ModelConfig};

/// The running state of one compressor (main or indexer) of one layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressorState {
    /// Emitted entries, `[count, dim]`, normalised and rotated.
    pub entries: Vec<f32>,
    /// Projected (kv, gate) of the tokens of the window still open, `[pending, width]` each.
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    /// First series of the last closed window (kv, gate with its slot bias), for overlap.
    pub overlap_kv: Option<Vec<f32>>,
    pub overlap_gate: Option<Vec<f32>>,
}

impl CompressorState {
    pub fn count(&self, dim: usize) -> usize {
        self.entries.len() / dim
    }
}

/// State of one attention layer for one sequence.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerState {
    /// The last `sliding_window − 1` (or fewer) KV vectors, oldest first, `[n, head_dim]`.
    pub window: Vec<f32>,
    pub compressor: Option<CompressorState>,
    pub indexer: Option<CompressorState>,
}

impl LayerState {
    fn new(kind: AttentionKind) -> Self {
        Self {
            window: Vec::new(),
            compressor: kind.compress_ratio().map(|_| CompressorState::default()),
            indexer: matches!(kind, AttentionKind::Csa { .. }).then(CompressorState::default),
        }
    }

    /// f32 values held.
    pub fn len_f32(&self) -> usize {
        let c = |s: &Option<CompressorState>| {
            s.as_ref().map_or(0, |s| {
                s.entries.len()
                    + s.pending_kv.len()
                    + s.pending_gate.len()
                    + s.overlap_kv.as_ref().map_or(0, Vec::len)
                    + s.overlap_gate.as_ref().map_or(0, Vec::len)
            })
        };
        self.window.len() + c(&self.compressor) + c(&self.indexer)
    }
}

/// Everything the model remembers about one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceState {
    /// Tokens processed so far (the next token's position).
    pub position: usize,
    pub layers: Vec<LayerState>,
    /// Tokens the MTP block has processed, and its layer state.
    pub mtp_position: usize,
    pub mtp: Vec<LayerState>,
    /// The whole state of a DeepSeek-V4.1 sequence (its layers share compressed KV).
    pub v41: Option<crate::v41::V41State>,
}

impl SequenceState {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self {
            position: 0,
            layers: cfg.attention.iter().map(|&k| LayerState::new(k)).collect(),
            mtp_position: 0,
            mtp: (0..cfg.num_mtp_layers).map(|_| LayerState::new(AttentionKind::Window)).collect(),
            v41: None,
        }
    }

    /// Bytes of KV and compressor state held for this sequence.
    pub fn state_bytes(&self) -> usize {
        self.v41.as_ref().map_or(0, crate::v41::V41State::state_bytes)
            + 4 * self.layers.iter().chain(&self.mtp).map(LayerState::len_f32).sum::<usize>()
    }
}
