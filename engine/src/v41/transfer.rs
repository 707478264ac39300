//! A whole [`V41State`] in flat form, to move a prefilled DeepSeek-V4.1
//! sequence to another instance:
//!
//! ```text
//! lens := TAG · position · window × layers · (entries · keys · pending kv · pending score) × KV sources
//!         · Engram look-back · DSpark window × draft layers
//! ```
//!
//! The Engram look-back (compressed token ids, below 2^24) travels as f32.
//! [`from_parts`] accepts exactly the lengths the model would have produced at
//! that position, so a state read from the network can never trip the forward pass.

use super::config::V41Config;
use super::engram::{entry_as_f32, entry_from_f32, DEAD};
use super::state::V41State;

/// First length of a V4.1 state (a V4 state starts with its position, never this).
pub const TAG: u32 = u32::MAX - 41;

/// Largest compressed token id that travels exactly as f32.
const ID_MAX: u64 = 1 << 24;

pub fn to_parts(state: &V41State) -> (Vec<u32>, Vec<f32>) {
    let mut lens = vec![TAG, state.position as u32];
    let mut data = Vec::with_capacity(state.state_bytes() / 4);
    for w in &state.windows {
        lens.push(w.len() as u32);
        data.extend_from_slice(w);
    }
    for s in state.sources.iter().flatten() {
        for part in [&s.entries, &s.keys, &s.pending_kv, &s.pending_score] {
            lens.push(part.len() as u32);
            data.extend_from_slice(part);
        }
    }
    assert!(state.engram_history.iter().all(|&id| id < ID_MAX || id == DEAD), "Engram ids travel as f32");
    lens.push(state.engram_history.len() as u32);
    data.extend(state.engram_history.iter().map(|&id| entry_as_f32(id)));
    for w in &state.dspark_windows {
        lens.push(w.len() as u32);
        data.extend_from_slice(w);
    }
    (lens, data)
}

/// Values `lens` measures (every field after the tag and the position is a length).
pub fn parts_values(lens: &[u32]) -> Option<usize> {
    if lens.len() < 2 || lens[0] != TAG {
        return None;
    }
    lens[2..].iter().try_fold(0usize, |sum, &n| sum.checked_add(n as usize))
}

/// The lengths a state of `cfg` has at `position` (DSpark windows aside: they
/// hold what was observed, at most a window).
fn expected(cfg: &V41Config, position: usize) -> Vec<u32> {
    let (hd, ihd) = (cfg.head_dim, cfg.index_head_dim);
    let mut lens = vec![TAG, position as u32];
    lens.extend((0..cfg.n_layers).map(|_| (position.min(cfg.window_size) * hd) as u32));
    for l in cfg.kv_source_layers() {
        let ratio = cfg.layers[l].ratio;
        let pending = if ratio > 1 { (position % ratio * hd) as u32 } else { 0 };
        lens.extend([(position / ratio * hd) as u32, (position / ratio * ihd) as u32, pending, pending]);
    }
    lens.push(cfg.engram.as_ref().map_or(0, |e| position.min(e.max_ngram_size)) as u32);
    lens
}

/// The inverse of [`to_parts`], checked against the model.
pub fn from_parts(cfg: &V41Config, lens: &[u32], data: &[f32], max_position: usize) -> Result<V41State, String> {
    let position = match lens {
        [TAG, p, ..] => *p as usize,
        _ => return Err("not a V4.1 state".to_string()),
    };
    if position == 0 || position > max_position {
        return Err(format!("position {position} outside 1..={max_position}"));
    }
    let want = expected(cfg, position);
    let drafts = if cfg.dspark.is_some() { cfg.n_mtp_layers } else { 0 };
    if lens.len() != want.len() + drafts || lens[..want.len()] != want[..] {
        return Err(format!("lengths do not fit the model at position {position}"));
    }
    if lens[want.len()..]
        .iter()
        .any(|&n| n as usize > cfg.window_size * cfg.head_dim || !(n as usize).is_multiple_of(cfg.head_dim))
    {
        return Err("a DSpark window longer than the window".to_string());
    }
    if parts_values(lens) != Some(data.len()) {
        return Err(format!("{} values do not match the lengths", data.len()));
    }
    let mut at = 0;
    let mut fields = lens[2..].iter();
    let mut take = || {
        let n = *fields.next().expect("lengths checked") as usize;
        let v = data[at..at + n].to_vec();
        at += n;
        v
    };
    let mut state = V41State::new(cfg);
    state.position = position;
    for w in state.windows.iter_mut() {
        *w = take();
    }
    for s in state.sources.iter_mut().flatten() {
        s.entries = take();
        s.keys = take();
        s.pending_kv = take();
        s.pending_score = take();
    }
    let history = take();
    state.engram_history = history
        .iter()
        .map(|&v| entry_from_f32(v, ID_MAX as f32).ok_or_else(|| format!("Engram look-back holds {v}, not a token id")))
        .collect::<Result<_, _>>()?;
    for w in state.dspark_windows.iter_mut() {
        *w = take();
    }
    Ok(state)
}
