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

/// What a prefix-cache block of a V4.1 sequence stores: each KV group's
/// entries and index keys of the block, and everything else the state holds at
/// the block's end (every layer's window, the Engram look-back, the DSpark
/// windows). A hit restores the state at the hit's end exactly, with no replay.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockSnapshot {
    /// Per KV source, in layer order: (entries, keys) of this block.
    pub groups: Vec<(Vec<f32>, Vec<f32>)>,
    pub windows: Vec<Vec<f32>>,
    pub engram_history: Vec<u64>,
    pub dspark_windows: Vec<Vec<f32>>,
}

impl V41State {
    /// Block `k` of `block_tokens` positions, from a state positioned at its end.
    pub fn snapshot(&self, cfg: &V41Config, k: usize, block_tokens: usize) -> BlockSnapshot {
        assert_eq!(self.position, (k + 1) * block_tokens, "a snapshot is taken at its block's end");
        let groups = cfg
            .kv_source_layers()
            .into_iter()
            .map(|l| {
                let s = self.sources[l].as_ref().expect("KV source state");
                let ratio = cfg.layers[l].ratio;
                assert!(
                    block_tokens.is_multiple_of(ratio) && s.pending_kv.is_empty(),
                    "a block ends on a group boundary"
                );
                let (e, i) = (block_tokens / ratio * cfg.head_dim, block_tokens / ratio * cfg.index_head_dim);
                (s.entries[k * e..(k + 1) * e].to_vec(), s.keys[k * i..(k + 1) * i].to_vec())
            })
            .collect();
        BlockSnapshot {
            groups,
            windows: self.windows.clone(),
            engram_history: self.engram_history.clone(),
            dspark_windows: self.dspark_windows.clone(),
        }
    }

    /// The state at the end of `blocks` (consecutive from position 0), which is `position`.
    pub fn restore(cfg: &V41Config, blocks: &[&BlockSnapshot], position: usize) -> Self {
        let mut state = Self::new(cfg);
        let Some(last) = blocks.last() else {
            assert_eq!(position, 0, "a state without blocks starts at position 0");
            return state;
        };
        for (g, l) in cfg.kv_source_layers().into_iter().enumerate() {
            let s = state.sources[l].as_mut().expect("KV source state");
            for b in blocks {
                s.entries.extend_from_slice(&b.groups[g].0);
                s.keys.extend_from_slice(&b.groups[g].1);
            }
        }
        state.windows = last.windows.clone();
        state.engram_history = last.engram_history.clone();
        state.dspark_windows = last.dspark_windows.clone();
        state.position = position;
        state
    }
}
