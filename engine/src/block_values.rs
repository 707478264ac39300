//! What a cached prefix block stores and how a hit rebuilds a state from it:
//! per layer the compressed entries (and indexer keys) of the block with the
//! overlap series at its end, or for DeepSeek-V4.1 the block's KV groups and
//! the state at its end; and the flat form a transport carries.

use crate::config::AttentionKind;
use crate::model::state::CompressorState;
use crate::model::{Model, SequenceState};

/// Compressed state of one compressor for one block of positions.
#[derive(Clone, Debug, Default, PartialEq)]
struct CompressorBlock {
    /// The entries emitted inside the block.
    entries: Vec<f32>,
    /// The overlap series at the block's end (CSA).
    overlap_kv: Option<Vec<f32>>,
    overlap_gate: Option<Vec<f32>>,
}

/// Stored values of one cached block, per layer: what a prefix hit restores.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockValues {
    layers: Vec<(Option<CompressorBlock>, Option<CompressorBlock>)>,
    /// A DeepSeek-V4.1 block: its groups' entries and keys, and the state at its end.
    v41: Option<crate::v41::state::BlockSnapshot>,
}

/// A state holding the compressed state of `blocks` (consecutive cached
/// blocks from position 0, as [`BlockValues::capture`] took them),
/// positioned at `position` (the start of the replay).
pub fn restore_state(model: &Model, blocks: &[&BlockValues], position: usize) -> SequenceState {
    let mut state = model.new_state();
    if let Some(m) = &model.v41 {
        let snapshots: Vec<&crate::v41::state::BlockSnapshot> =
            blocks.iter().map(|b| b.v41.as_ref().expect("a V4.1 block")).collect();
        let restored = crate::v41::V41State::restore(&m.config, &snapshots, position);
        match &model.device {
            // A device model's state is rebuilt in the CPU's form, then uploaded.
            Some(d) => {
                state.device = Some(
                    d.upload_state_v41(&restored)
                        .unwrap_or_else(|e| panic!("restoring a cached prefix on {}: {e}", d.gpu().name())),
                );
            }
            None => state.v41 = Some(restored),
        }
        state.position = position;
        return state;
    }
    // A device model's state is rebuilt in the CPU's form, then uploaded.
    let device = state.device.take();
    if device.is_some() {
        state.layers = SequenceState::new(&model.config).layers;
    }
    if let Some(last) = blocks.last() {
        for (l, layer) in state.layers.iter_mut().enumerate() {
            let rebuild = |c: &mut CompressorState, part: fn(&BlockValues, usize) -> Option<&CompressorBlock>| {
                for b in blocks {
                    c.entries.extend_from_slice(&part(b, l).expect("cached block has this layer").entries);
                }
                let tail = part(last, l).expect("cached block has this layer");
                c.overlap_kv = tail.overlap_kv.clone();
                c.overlap_gate = tail.overlap_gate.clone();
            };
            if let Some(c) = &mut layer.compressor {
                rebuild(c, |b, l| b.layers[l].0.as_ref());
            }
            if let Some(c) = &mut layer.indexer {
                rebuild(c, |b, l| b.layers[l].1.as_ref());
            }
        }
    }
    if let (Some(d), Some(_)) = (&model.device, device) {
        let layers = std::mem::take(&mut state.layers);
        state.device = Some(
            d.upload_state(&layers).unwrap_or_else(|e| panic!("restoring a cached prefix on {}: {e}", d.gpu().name())),
        );
    }
    state.position = position;
    state
}

/// Copy the compressed state of block `k` out of a state whose position is its end.
fn snapshot(model: &Model, state: &SequenceState, k: usize, bt: usize) -> BlockValues {
    // A device state's values come back to the host first.
    let state = &*model.host_state(state);
    if let (Some(m), Some(s)) = (&model.v41, &state.v41) {
        return BlockValues { layers: Vec::new(), v41: Some(s.snapshot(&m.config, k, bt)) };
    }
    let cfg = &model.config;
    debug_assert_eq!(state.position, (k + 1) * bt);
    let part = |c: &CompressorState, ratio: usize, dim: usize| {
        let per = bt / ratio * dim;
        debug_assert!(c.pending_kv.is_empty(), "a block ends on a compressor window boundary");
        debug_assert_eq!(c.entries.len(), (k + 1) * per);
        CompressorBlock {
            entries: c.entries[k * per..(k + 1) * per].to_vec(),
            overlap_kv: c.overlap_kv.clone(),
            overlap_gate: c.overlap_gate.clone(),
        }
    };
    let layers = state
        .layers
        .iter()
        .zip(&cfg.attention)
        .map(|(layer, kind)| match kind.compress_ratio() {
            Some(ratio) => (
                layer.compressor.as_ref().map(|c| part(c, ratio, cfg.head_dim)),
                layer.indexer.as_ref().map(|c| part(c, ratio, cfg.index_head_dim)),
            ),
            None => (None, None),
        })
        .collect();
    BlockValues { layers, v41: None }
}

/// Whether `blocks` (consecutive from position 0) can restore a state at `position`.
pub fn check_restore(model: &Model, blocks: &[&BlockValues], position: usize) -> Result<(), String> {
    match (&model.v41, blocks.last().and_then(|b| b.v41.as_ref())) {
        (Some(m), Some(last)) => last.fits(&m.config, position),
        _ => Ok(()),
    }
}

/// Absent overlap series in [`BlockValues::to_parts`] lengths.
const ABSENT: u32 = u32::MAX;
/// Lengths per layer in [`BlockValues::to_parts`]: for the compressor then
/// the indexer, present (0/1), entries, overlap kv, overlap gate.
const LENS_PER_LAYER: usize = 8;

impl BlockValues {
    /// The compressed state of block `k` of a state positioned at the block's end.
    pub fn capture(model: &Model, state: &SequenceState, k: usize, block_tokens: usize) -> Self {
        snapshot(model, state, k, block_tokens)
    }

    /// Bytes the block's values occupy in memory (what a host tier budgets).
    pub fn value_bytes(&self) -> usize {
        if let Some(v) = &self.v41 {
            return 4 * v.value_count();
        }
        let part = |b: &Option<CompressorBlock>| {
            b.as_ref().map_or(0, |b| {
                b.entries.len()
                    + b.overlap_kv.as_ref().map_or(0, Vec::len)
                    + b.overlap_gate.as_ref().map_or(0, Vec::len)
            })
        };
        4 * self.layers.iter().map(|(c, ix)| part(c) + part(ix)).sum::<usize>()
    }

    /// Flat form for a transport: lengths (8 per layer) and the values they measure.
    pub fn to_parts(&self) -> (Vec<u32>, Vec<f32>) {
        if let Some(v) = &self.v41 {
            return v.to_parts();
        }
        let mut lens = Vec::with_capacity(self.layers.len() * LENS_PER_LAYER);
        let mut data = Vec::new();
        for (c, ix) in &self.layers {
            for part in [c, ix] {
                match part {
                    None => lens.extend([0, 0, ABSENT, ABSENT]),
                    Some(b) => {
                        lens.extend([1, b.entries.len() as u32]);
                        data.extend_from_slice(&b.entries);
                        for o in [&b.overlap_kv, &b.overlap_gate] {
                            lens.push(o.as_ref().map_or(ABSENT, |v| v.len() as u32));
                            data.extend_from_slice(o.as_deref().unwrap_or_default());
                        }
                    }
                }
            }
        }
        (lens, data)
    }

    /// The inverse of [`to_parts`](Self::to_parts), checked against the
    /// model's layers and the block size: a malformed block is an error,
    /// never a state that would trip the forward pass.
    pub fn from_parts(model: &Model, block_tokens: usize, lens: &[u32], data: &[f32]) -> Result<Self, String> {
        if let Some(m) = &model.v41 {
            let v = crate::v41::state::BlockSnapshot::from_parts(&m.config, block_tokens, lens, data)?;
            return Ok(Self { layers: Vec::new(), v41: Some(v) });
        }
        let cfg = &model.config;
        if lens.len() != cfg.num_layers * LENS_PER_LAYER {
            return Err(format!("{} lengths for {} layers", lens.len(), cfg.num_layers));
        }
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<Vec<f32>, String> {
            let v = data.get(at..at + n).ok_or_else(|| format!("{} values, more needed", data.len()))?;
            at += n;
            Ok(v.to_vec())
        };
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, kind) in cfg.attention.iter().enumerate() {
            let want = [
                kind.compress_ratio().map(|r| (r, cfg.head_dim)),
                matches!(kind, AttentionKind::Csa { .. })
                    .then(|| (kind.compress_ratio().unwrap_or(1), cfg.index_head_dim)),
            ];
            let mut parts = [None, None];
            for (p, want) in want.into_iter().enumerate() {
                let [present, entries, okv, ogate] = lens[l * LENS_PER_LAYER + 4 * p..][..4] else { unreachable!() };
                match (want, present) {
                    (None, 0) if entries == 0 && okv == ABSENT && ogate == ABSENT => {}
                    (Some((ratio, dim)), 1) if block_tokens.is_multiple_of(ratio) => {
                        let per = block_tokens / ratio * dim;
                        let overlap_ok = okv == ogate && (okv == ABSENT || okv as usize == ratio * dim);
                        if entries as usize != per || !overlap_ok {
                            return Err(format!("layer {l}: lengths {entries}/{okv}/{ogate} do not fit the model"));
                        }
                        let entries = take(per)?;
                        let overlap = |n: u32, take: &mut dyn FnMut(usize) -> Result<Vec<f32>, String>| {
                            if n == ABSENT {
                                Ok(None)
                            } else {
                                take(n as usize).map(Some)
                            }
                        };
                        let overlap_kv = overlap(okv, &mut take)?;
                        let overlap_gate = overlap(ogate, &mut take)?;
                        parts[p] = Some(CompressorBlock { entries, overlap_kv, overlap_gate });
                    }
                    _ => return Err(format!("layer {l}: part {p} does not fit the model")),
                }
            }
            let [c, ix] = parts;
            layers.push((c, ix));
        }
        if at != data.len() {
            return Err(format!("{} values, {at} expected", data.len()));
        }
        Ok(Self { layers, v41: None })
    }
}
