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
    /// The state where a chunk's draft tokens began (see [`SequenceState::reject_drafts`]).
    pub draft_mark: Option<Box<CompressorMark>>,
}

/// What a compressor held before its chunk's first draft token: enough to
/// take the drafts back without recomputing anything.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressorMark {
    pub entries_len: usize,
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub overlap_kv: Option<Vec<f32>>,
    pub overlap_gate: Option<Vec<f32>>,
}

impl CompressorState {
    /// Remember the state before the first draft token is fed.
    pub(crate) fn mark_drafts(&mut self) {
        self.draft_mark = Some(Box::new(CompressorMark {
            entries_len: self.entries.len(),
            pending_kv: self.pending_kv.clone(),
            pending_gate: self.pending_gate.clone(),
            overlap_kv: self.overlap_kv.clone(),
            overlap_gate: self.overlap_gate.clone(),
        }));
    }

    fn reject_drafts(&mut self) {
        if let Some(m) = self.draft_mark.take() {
            assert!(m.entries_len <= self.entries.len(), "entries only grow during a chunk");
            self.entries.truncate(m.entries_len);
            self.pending_kv = m.pending_kv;
            self.pending_gate = m.pending_gate;
            self.overlap_kv = m.overlap_kv;
            self.overlap_gate = m.overlap_gate;
        }
    }

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
    /// Window rows of positions before the chunk's drafts that the ring
    /// dropped to make room for the drafts, oldest first.
    pub draft_window_dropped: Option<Vec<f32>>,
    /// Draft rows at the end of `window` while a chunk's drafts await verification.
    pub draft_rows: usize,
}

impl LayerState {
    fn new(kind: AttentionKind) -> Self {
        Self {
            window: Vec::new(),
            compressor: kind.compress_ratio().map(|_| CompressorState::default()),
            indexer: matches!(kind, AttentionKind::Csa { .. }).then(CompressorState::default),
            draft_window_dropped: None,
            draft_rows: 0,
        }
    }

    /// Take back the drafts of the last chunk (see [`SequenceState::reject_drafts`]).
    fn reject_drafts(&mut self, head_dim: usize) {
        if let Some(dropped) = self.draft_window_dropped.take() {
            let keep = self.window.len() - self.draft_rows * head_dim;
            let mut window = dropped;
            window.extend_from_slice(&self.window[..keep]);
            self.window = window;
        }
        self.draft_rows = 0;
        for c in self.compressor.iter_mut().chain(self.indexer.iter_mut()) {
            c.reject_drafts();
        }
    }

    fn accept_drafts(&mut self) {
        self.draft_window_dropped = None;
        self.draft_rows = 0;
        for c in self.compressor.iter_mut().chain(self.indexer.iter_mut()) {
            c.draft_mark = None;
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
    /// The state on a device, for a model that runs there (`layers` is then empty).
    pub device: Option<crate::device::DeviceState>,
    /// The position where the last chunk's draft tokens began, until they are
    /// accepted or rejected.
    pub draft_from: Option<usize>,
}

impl SequenceState {
    pub fn new(cfg: &ModelConfig) -> Self {
        Self {
            position: 0,
            layers: cfg.attention.iter().map(|&k| LayerState::new(k)).collect(),
            mtp_position: 0,
            mtp: (0..cfg.num_mtp_layers).map(|_| LayerState::new(AttentionKind::Window)).collect(),
            v41: None,
            device: None,
            draft_from: None,
        }
    }

    /// Whether the last chunk's drafts await [`accept_drafts`](Self::accept_drafts)
    /// or [`reject_drafts`](Self::reject_drafts).
    pub fn has_drafts(&self) -> bool {
        self.draft_from.is_some()
    }

    /// Keep every draft token of the last chunk: the state stays where the chunk ended.
    pub fn accept_drafts(&mut self) {
        assert!(self.draft_from.take().is_some(), "no drafts to accept");
        for layer in &mut self.layers {
            layer.accept_drafts();
        }
        if let Some(v) = &mut self.v41 {
            v.accept_drafts();
        }
    }

    /// Take back every draft token of the last chunk: the state becomes
    /// bit-identical to one that never saw them, positioned where they began.
    /// Nothing is recomputed: the forward pass kept what the drafts overwrote.
    pub fn reject_drafts(&mut self, cfg: &ModelConfig) {
        let from = self.draft_from.take().expect("no drafts to reject");
        assert!(from <= self.position, "drafts begin inside the chunk");
        for layer in &mut self.layers {
            layer.reject_drafts(cfg.head_dim);
        }
        if let Some(v) = &mut self.v41 {
            v.reject_drafts(from);
        }
        self.position = from;
    }

    /// Bytes of KV and compressor state held for this sequence.
    pub fn state_bytes(&self) -> usize {
        self.v41.as_ref().map_or(0, crate::v41::V41State::state_bytes)
            + 4 * self.layers.iter().chain(&self.mtp).map(LayerState::len_f32).sum::<usize>()
    }
}
