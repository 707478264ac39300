//! A whole [`SequenceState`] in flat form, to move a prefilled sequence to
//! another instance (prefill/decode disaggregation): lengths (`u32`) and the
//! `f32` values they measure, in a fixed order.
//!
//! ```text
//! lens := position · mtp_position · (layer)* for the main layers then the MTP layers
//! layer := window · compressor part · indexer part
//! part := present (0/1) · entries · pending kv · pending gate · overlap kv · overlap gate (ABSENT = none)
//! ```
//!
//! [`state_from_parts`] accepts exactly the lengths the model would have
//! produced at that position (window, emitted entries, open window, overlap
//! series), so a state read from the network can never trip the forward pass.

use crate::config::{AttentionKind, ModelConfig};
use crate::model::state::{CompressorState, LayerState};
use crate::model::SequenceState;

const ABSENT: u32 = u32::MAX;
const PART: usize = 6;
const PER_LAYER: usize = 1 + 2 * PART;

/// Lengths and values of `state` (a V4.1 state in its own form, see `v41::transfer`).
pub fn state_to_parts(state: &SequenceState) -> (Vec<u32>, Vec<f32>) {
    if let Some(s) = &state.v41 {
        return crate::v41::transfer::to_parts(s);
    }
    let mut lens = vec![state.position as u32, state.mtp_position as u32];
    let mut data = Vec::with_capacity(state.state_bytes() / 4);
    for layer in state.layers.iter().chain(&state.mtp) {
        lens.push(layer.window.len() as u32);
        data.extend_from_slice(&layer.window);
        for part in [&layer.compressor, &layer.indexer] {
            match part {
                None => lens.extend([0, 0, 0, 0, ABSENT, ABSENT]),
                Some(c) => {
                    lens.extend([1, c.entries.len() as u32, c.pending_kv.len() as u32, c.pending_gate.len() as u32]);
                    data.extend_from_slice(&c.entries);
                    data.extend_from_slice(&c.pending_kv);
                    data.extend_from_slice(&c.pending_gate);
                    for o in [&c.overlap_kv, &c.overlap_gate] {
                        lens.push(o.as_ref().map_or(ABSENT, |v| v.len() as u32));
                        data.extend_from_slice(o.as_deref().unwrap_or_default());
                    }
                }
            }
        }
    }
    (lens, data)
}

/// Values `lens` measures, or `None` when the lengths are malformed or overflow.
pub fn parts_values(lens: &[u32]) -> Option<usize> {
    if lens.first() == Some(&crate::v41::transfer::TAG) {
        return crate::v41::transfer::parts_values(lens);
    }
    if lens.len() < 2 || !(lens.len() - 2).is_multiple_of(PER_LAYER) {
        return None;
    }
    lens[2..].iter().enumerate().try_fold(0usize, |sum, (i, &n)| {
        let counted = match i % PER_LAYER {
            0 => true,
            k => {
                let field = (k - 1) % PART;
                // `present` is a flag, not a length.
                field != 0 && n != ABSENT
            }
        };
        if counted {
            sum.checked_add(n as usize)
        } else {
            Some(sum)
        }
    })
}

/// Expected lengths of one compressor (ratio, dim, overlap) at `position`.
fn compressor_lens(ratio: usize, dim: usize, overlap: bool, position: usize) -> [u32; PART] {
    let width = if overlap { 2 * dim } else { dim };
    let pending = (position % ratio * width) as u32;
    let o = if overlap && position >= ratio { (ratio * dim) as u32 } else { ABSENT };
    [1, (position / ratio * dim) as u32, pending, pending, o, o]
}

/// The expected lengths of a state of `cfg` at these positions.
fn expected_lens(cfg: &ModelConfig, position: usize, mtp_position: usize) -> Vec<u32> {
    let hd = cfg.head_dim;
    let keep = cfg.sliding_window.saturating_sub(1);
    let mut lens = vec![position as u32, mtp_position as u32];
    let none = [0, 0, 0, 0, ABSENT, ABSENT];
    let kinds = cfg.attention.iter().map(|&k| (k, position));
    let mtp = (0..cfg.num_mtp_layers).map(|_| (AttentionKind::Window, mtp_position));
    for (kind, pos) in kinds.chain(mtp) {
        lens.push((pos.min(keep) * hd) as u32);
        match kind {
            AttentionKind::Window => {
                lens.extend(none);
                lens.extend(none);
            }
            AttentionKind::Hca { ratio } => {
                lens.extend(compressor_lens(ratio, hd, false, pos));
                lens.extend(none);
            }
            AttentionKind::Csa { ratio } => {
                lens.extend(compressor_lens(ratio, hd, true, pos));
                lens.extend(compressor_lens(ratio, cfg.index_head_dim, true, pos));
            }
        }
    }
    lens
}

impl crate::model::Model {
    /// [`state_from_parts`] for this model, V4 or V4.1.
    pub fn state_from_parts(&self, lens: &[u32], data: &[f32], max_position: usize) -> Result<SequenceState, String> {
        match &self.v41 {
            Some(m) => {
                let inner = crate::v41::transfer::from_parts(&m.config, lens, data, max_position)?;
                let mut state = self.new_state();
                state.position = inner.position;
                state.v41 = Some(inner);
                Ok(state)
            }
            None => state_from_parts(&self.config, lens, data, max_position),
        }
    }
}

/// The inverse of [`state_to_parts`], checked against the model: the lengths
/// must be exactly those of a state at the positions they name (at most
/// `max_position`), and the values must add up.
pub fn state_from_parts(
    cfg: &ModelConfig,
    lens: &[u32],
    data: &[f32],
    max_position: usize,
) -> Result<SequenceState, String> {
    let [position, mtp_position, ..] = lens[..] else { return Err("no positions".to_string()) };
    let (position, mtp_position) = (position as usize, mtp_position as usize);
    if position == 0 || position > max_position || mtp_position > position {
        return Err(format!("positions {position}/{mtp_position} outside 1..={max_position}"));
    }
    if cfg.attention.iter().any(|k| k.compress_ratio() == Some(0)) {
        return Err("a compress ratio of 0".to_string());
    }
    if lens != expected_lens(cfg, position, mtp_position) {
        return Err(format!("lengths do not fit the model at position {position}"));
    }
    if parts_values(lens) != Some(data.len()) {
        return Err(format!("{} values do not match the lengths", data.len()));
    }
    let mut at = 0;
    let mut take = |n: u32| {
        let v = data[at..at + n as usize].to_vec();
        at += n as usize;
        v
    };
    let mut state = SequenceState::new(cfg);
    state.position = position;
    state.mtp_position = mtp_position;
    let mut l = lens[2..].chunks_exact(PER_LAYER);
    for layer in state.layers.iter_mut().chain(state.mtp.iter_mut()) {
        let fields = l.next().expect("lengths checked");
        *layer = LayerState { window: take(fields[0]), ..LayerState::default() };
        for (p, slot) in [&mut layer.compressor, &mut layer.indexer].into_iter().enumerate() {
            let f = &fields[1 + p * PART..1 + (p + 1) * PART];
            if f[0] == 1 {
                let entries = take(f[1]);
                let pending_kv = take(f[2]);
                let pending_gate = take(f[3]);
                let overlap_kv = (f[4] != ABSENT).then(|| take(f[4]));
                let overlap_gate = (f[5] != ABSENT).then(|| take(f[5]));
                *slot = Some(CompressorState {
                    entries,
                    pending_kv,
                    pending_gate,
                    overlap_kv,
                    overlap_gate,
                    draft_mark: None,
                });
            }
        }
    }
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Chunk, LogitsWanted, Model};
    use crate::presets::{build, Preset};

    fn model() -> Model {
        build(Preset::TinyV4, 7).expect("tiny-v4 builds")
    }

    #[test]
    fn a_moved_state_decodes_bit_identically() {
        let m = model();
        let prompt: Vec<u32> = (0..150).map(|i| (i * 37 % 200) as u32 + 3).collect();
        let mut state = m.new_state();
        let mut chunks = [Chunk { tokens: &prompt, state: &mut state, replay: false, drafts: 0 }];
        m.forward(&mut chunks, LogitsWanted::Last, false);
        let (lens, data) = state_to_parts(&state);
        assert_eq!(parts_values(&lens), Some(data.len()));
        let mut moved = state_from_parts(&m.config, &lens, &data, 4096).unwrap();
        assert_eq!(moved, state);
        // Decoding continues identically from either copy.
        let next = [42u32, 7, 99];
        let mut a = [Chunk { tokens: &next, state: &mut state, replay: false, drafts: 0 }];
        let la = m.forward(&mut a, LogitsWanted::Last, false);
        let mut b = [Chunk { tokens: &next, state: &mut moved, replay: false, drafts: 0 }];
        let lb = m.forward(&mut b, LogitsWanted::Last, false);
        assert_eq!(la[0].logits, lb[0].logits);
    }

    /// A V4.1 state (both KV groups, Engram, DSpark) moves and decodes on identically;
    /// every changed length is refused.
    #[test]
    fn a_moved_v41_state_decodes_bit_identically() {
        let m = build(Preset::TinyV41, 7).expect("tiny-v41 builds");
        let prompt: Vec<u32> = (0..131).map(|i| (i * 37 % 200) as u32 + 3).collect();
        let mut state = m.new_state();
        m.forward(&mut [Chunk::new(&prompt, &mut state)], LogitsWanted::Last, false);
        let (lens, data) = state_to_parts(&state);
        assert_eq!(parts_values(&lens), Some(data.len()));
        let mut moved = m.state_from_parts(&lens, &data, 4096).unwrap();
        assert_eq!(moved, state);
        let next = [42u32, 7, 99];
        let la = m.forward(&mut [Chunk::new(&next, &mut state)], LogitsWanted::Last, false);
        let lb = m.forward(&mut [Chunk::new(&next, &mut moved)], LogitsWanted::Last, false);
        assert_eq!(la[0].logits, lb[0].logits);
        assert!(m.state_from_parts(&lens, &data[1..], 4096).is_err());
        assert!(m.state_from_parts(&lens, &data, 130).is_err());
        for i in 1..lens.len() {
            let mut bad = lens.clone();
            bad[i] = bad[i].wrapping_add(1);
            assert!(m.state_from_parts(&bad, &data, 4096).is_err(), "length {i} changed");
        }
    }

    #[test]
    fn malformed_parts_are_refused() {
        let m = model();
        let prompt: Vec<u32> = (0..70).map(|i| i as u32 + 3).collect();
        let mut state = m.new_state();
        m.forward(
            &mut [Chunk { tokens: &prompt, state: &mut state, replay: false, drafts: 0 }],
            LogitsWanted::Last,
            false,
        );
        let (lens, data) = state_to_parts(&state);
        let cfg = &m.config;
        assert!(state_from_parts(cfg, &lens, &data[1..], 4096).is_err());
        assert!(state_from_parts(cfg, &lens, &data, 69).is_err());
        assert!(state_from_parts(cfg, &lens[..5], &data, 4096).is_err());
        assert!(state_from_parts(cfg, &[], &[], 4096).is_err());
        for i in 0..lens.len() {
            let mut bad = lens.clone();
            bad[i] = bad[i].wrapping_add(1);
            assert!(state_from_parts(cfg, &bad, &data, 4096).is_err(), "length {i} changed");
            bad[i] = u32::MAX;
            assert!(bad[i] == lens[i] || state_from_parts(cfg, &bad, &data, 4096).is_err(), "length {i} absent");
        }
        assert_eq!(parts_values(&[1, 2, 3]), None);
    }
}
