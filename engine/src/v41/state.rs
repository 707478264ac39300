//! What a DeepSeek-V4.1 sequence carries between steps. CSA2 shares one
//! compressed KV (and one set of index keys) per group of layers, so the
//! compressed state lives with the group's KV-source layer only.

use super::config::V41Config;

/// The compressed KV of one KV-source layer.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceState {
    /// Emitted entries `[count, head_dim]`: rotated at their group's first position, FP4 round-tripped.
    pub entries: Vec<f32>,
    /// Index keys `[count, index_head_dim]`, rotated and FP4 round-tripped.
    pub keys: Vec<f32>,
    /// f32 projections (kv, gate logits) of the tokens of the group still open (ratio > 1).
    pub pending_kv: Vec<f32>,
    pub pending_score: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct V41State {
    /// Tokens processed (the next token's position).
    pub position: usize,
    /// Per backbone layer: window KV of the last `window_size` positions, oldest first.
    pub windows: Vec<Vec<f32>>,
    /// Per backbone layer: `Some` for KV sources.
    pub sources: Vec<Option<SourceState>>,
    /// Compressed token ids of the last `max_ngram_size − 1` tokens (Engram look-back).
    pub engram_history: Vec<u64>,
    /// Per DSpark layer: window KV of the target's hidden states.
    pub dspark_windows: Vec<Vec<f32>>,
}

impl V41State {
    pub fn new(cfg: &V41Config) -> Self {
        Self {
            position: 0,
            windows: vec![Vec::new(); cfg.n_layers],
            sources: (0..cfg.n_layers).map(|l| cfg.layers[l].owns_compressor(l).then(SourceState::default)).collect(),
            engram_history: Vec::new(),
            dspark_windows: vec![Vec::new(); if cfg.dspark.is_some() { cfg.n_mtp_layers } else { 0 }],
        }
    }

    /// Bytes of KV and compressor state held.
    pub fn state_bytes(&self) -> usize {
        let source = |s: &SourceState| s.entries.len() + s.keys.len() + s.pending_kv.len() + s.pending_score.len();
        4 * (self.windows.iter().chain(&self.dspark_windows).map(Vec::len).sum::<usize>()
            + self.sources.iter().flatten().map(source).sum::<usize>())
            + 8 * self.engram_history.len()
    }
}
