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
    /// What the last chunk's draft tokens overwrote, until they are accepted or rejected.
    pub draft_mark: Option<Box<V41Mark>>,
}

/// A KV source before a chunk's first draft token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceMark {
    pub entries_len: usize,
    pub keys_len: usize,
    pub pending_kv: Vec<f32>,
    pub pending_score: Vec<f32>,
}

/// What a V4.1 state needs to take a chunk's drafts back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct V41Mark {
    /// Where the drafts began.
    pub position: usize,
    /// Per layer: window rows the drafts pushed out, and the values of the draft rows at the window's end.
    pub windows: Vec<Option<(Vec<f32>, usize)>>,
    pub sources: Vec<Option<SourceMark>>,
    pub engram_history: Vec<u64>,
    pub dspark_windows: Option<Vec<Vec<f32>>>,
}

impl V41State {
    pub fn new(cfg: &V41Config) -> Self {
        Self {
            position: 0,
            windows: vec![Vec::new(); cfg.n_layers],
            sources: (0..cfg.n_layers).map(|l| cfg.layers[l].owns_compressor(l).then(SourceState::default)).collect(),
            engram_history: Vec::new(),
            dspark_windows: vec![Vec::new(); if cfg.dspark.is_some() { cfg.n_mtp_layers } else { 0 }],
            draft_mark: None,
        }
    }

    /// Keep the last chunk's drafts.
    pub fn accept_drafts(&mut self) {
        self.draft_mark = None;
    }

    /// Take the last chunk's drafts back: the state before them, bit for bit.
    pub fn reject_drafts(&mut self, from: usize) {
        let Some(mark) = self.draft_mark.take() else { return };
        assert_eq!(mark.position, from, "the drafts began where the sequence state says");
        for (window, m) in self.windows.iter_mut().zip(&mark.windows) {
            if let Some((dropped, draft_values)) = m {
                let mut w = dropped.clone();
                w.extend_from_slice(&window[..window.len() - draft_values]);
                *window = w;
            }
        }
        for (src, m) in self.sources.iter_mut().zip(&mark.sources) {
            if let (Some(s), Some(m)) = (src.as_mut(), m) {
                s.entries.truncate(m.entries_len);
                s.keys.truncate(m.keys_len);
                s.pending_kv = m.pending_kv.clone();
                s.pending_score = m.pending_score.clone();
            }
        }
        self.engram_history = mark.engram_history;
        if let Some(d) = mark.dspark_windows {
            self.dspark_windows = d;
        }
        self.position = from;
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

/// First field of a V4.1 block's lengths. The lengths come in fours (a field
/// kind, then up to three lengths), the layout V4 blocks use too, so a
/// transport sizes either without knowing which it carries.
pub const BLOCK_TAG: u32 = u32::MAX - 42;
const GROUP: u32 = 1;
const WINDOW: u32 = 2;
const HISTORY: u32 = 3;
const DRAFT: u32 = 4;

impl BlockSnapshot {
    /// Values [`to_parts`](Self::to_parts) would write, without writing them.
    pub fn value_count(&self) -> usize {
        let windows = |w: &[Vec<f32>]| w.iter().map(Vec::len).sum::<usize>();
        self.groups.iter().map(|(e, k)| e.len() + k.len()).sum::<usize>()
            + windows(&self.windows)
            + self.engram_history.len()
            + windows(&self.dspark_windows)
    }

    /// Lengths (fours: kind, lengths) and the values they measure.
    pub fn to_parts(&self) -> (Vec<u32>, Vec<f32>) {
        let mut lens = vec![BLOCK_TAG, 0, 0, 0];
        let mut data = Vec::new();
        for (e, k) in &self.groups {
            lens.extend([GROUP, e.len() as u32, k.len() as u32, 0]);
            data.extend_from_slice(e);
            data.extend_from_slice(k);
        }
        for w in &self.windows {
            lens.extend([WINDOW, w.len() as u32, 0, 0]);
            data.extend_from_slice(w);
        }
        lens.extend([HISTORY, self.engram_history.len() as u32, 0, 0]);
        data.extend(self.engram_history.iter().map(|&id| super::engram::entry_as_f32(id)));
        for w in &self.dspark_windows {
            lens.extend([DRAFT, w.len() as u32, 0, 0]);
            data.extend_from_slice(w);
        }
        (lens, data)
    }

    /// The inverse of [`to_parts`](Self::to_parts), checked against the model and the block size.
    pub fn from_parts(cfg: &V41Config, block_tokens: usize, lens: &[u32], data: &[f32]) -> Result<Self, String> {
        let sources = cfg.kv_source_layers();
        let drafts = if cfg.dspark.is_some() { cfg.n_mtp_layers } else { 0 };
        let fields = 1 + sources.len() + cfg.n_layers + 1 + drafts;
        if lens.len() != 4 * fields || lens[..4] != [BLOCK_TAG, 0, 0, 0] {
            return Err(format!("{} lengths, not a V4.1 block of this model", lens.len()));
        }
        let (hd, ihd, win) = (cfg.head_dim, cfg.index_head_dim, cfg.window_size);
        let mut at = 0usize;
        let mut take = |n: u32| -> Result<Vec<f32>, String> {
            let v = data.get(at..at + n as usize).ok_or_else(|| format!("{} values, more needed", data.len()))?;
            at += n as usize;
            Ok(v.to_vec())
        };
        let mut chunks = lens[4..].chunks_exact(4);
        let mut next = |kind: u32| -> Result<[u32; 3], String> {
            match chunks.next() {
                Some(&[k, a, b, c]) if k == kind => Ok([a, b, c]),
                _ => Err(format!("a field of kind {kind} expected")),
            }
        };
        let mut groups = Vec::with_capacity(sources.len());
        for &l in &sources {
            let ratio = cfg.layers[l].ratio;
            let [e, k, zero] = next(GROUP)?;
            let entries = block_tokens / ratio;
            if !block_tokens.is_multiple_of(ratio)
                || e as usize != entries * hd
                || k as usize != entries * ihd
                || zero != 0
            {
                return Err(format!("layer {l}: {e}/{k} values do not fit a block of {block_tokens}"));
            }
            groups.push((take(e)?, take(k)?));
        }
        let mut windows = Vec::with_capacity(cfg.n_layers);
        for l in 0..cfg.n_layers {
            let [w, z1, z2] = next(WINDOW)?;
            if w as usize > win * hd || !(w as usize).is_multiple_of(hd) || z1 != 0 || z2 != 0 {
                return Err(format!("layer {l}: a window of {w} values"));
            }
            windows.push(take(w)?);
        }
        let [h, z1, z2] = next(HISTORY)?;
        let keep = cfg.engram.as_ref().map_or(0, |e| e.max_ngram_size);
        if h as usize > keep || z1 != 0 || z2 != 0 {
            return Err(format!("an Engram look-back of {h}"));
        }
        let vocab = cfg.engram.as_ref().map_or(0, |e| e.compressed_vocab_size) as f32;
        let history = take(h)?
            .into_iter()
            .map(|v| super::engram::entry_from_f32(v, vocab).ok_or_else(|| format!("Engram look-back holds {v}")))
            .collect::<Result<Vec<u64>, _>>()?;
        let mut dspark_windows = Vec::with_capacity(drafts);
        for _ in 0..drafts {
            let [w, z1, z2] = next(DRAFT)?;
            if w as usize > win * hd || !(w as usize).is_multiple_of(hd) || z1 != 0 || z2 != 0 {
                return Err(format!("a DSpark window of {w} values"));
            }
            dspark_windows.push(take(w)?);
        }
        if at != data.len() {
            return Err(format!("{} values, {at} expected", data.len()));
        }
        Ok(Self { groups, windows, engram_history: history, dspark_windows })
    }

    /// Whether this block, the last of a hit ending at `position`, holds the windows a state there has.
    pub fn fits(&self, cfg: &V41Config, position: usize) -> Result<(), String> {
        let want = position.min(cfg.window_size) * cfg.head_dim;
        let history = cfg.engram.as_ref().map_or(0, |e| position.min(e.max_ngram_size));
        if self.windows.iter().any(|w| w.len() != want) || self.engram_history.len() != history {
            return Err(format!("the block's windows do not fit position {position}"));
        }
        Ok(())
    }
}
