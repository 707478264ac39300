//! The one rule a step request must follow, for computing and modelled
//! workers alike: checked whole before anything is computed, so a bad
//! request is refused with a reason and never half runs.

use std::collections::BTreeSet;

use deepinfer_engine::config::ModelConfig;

use crate::proto::sampling_params;
use crate::wire::{StepItem, StepRequest};

/// What kind of device answers the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Device {
    /// Runs the model: one step per request, verifying at most this many
    /// drafts per item (0: it does not draft).
    Computing { drafts_max: usize },
    /// Prices the step: may run several decode steps as one and verify
    /// drafts, but computes no logits.
    Modelled,
}

impl Device {
    /// Most drafts an item may verify; `None`: as many as the plan reserved.
    fn drafts_max(self) -> Option<usize> {
        match self {
            Device::Computing { drafts_max } => Some(drafts_max),
            Device::Modelled => None,
        }
    }
}

/// Check `req` for a worker whose held states are at `held(seq)`; returns
/// the sequences it lacks the history of (answered with `NeedsHistory`), or
/// why the request is refused.
pub(super) fn check_request(
    req: &StepRequest,
    config: &ModelConfig,
    block_tokens: usize,
    device: Device,
    held: impl Fn(u64) -> Option<usize>,
) -> Result<Vec<u64>, String> {
    assert!(block_tokens > 0, "blocks hold at least one position");
    let repeat = req.repeat.max(1);
    match device {
        Device::Computing { .. } if repeat > 1 => {
            return Err(format!("{repeat} steps in one: a computing device runs one"))
        }
        Device::Modelled if repeat > 1 && req.items.iter().any(|it| !it.sample) => {
            return Err(format!("{repeat} repeated steps need every item to sample"));
        }
        _ => {}
    }
    let mut seen = BTreeSet::new();
    let mut missing = Vec::new();
    for it in &req.items {
        let fresh = seen.insert(it.seq);
        if let Some(why) = item_error(it, fresh, repeat as usize, config, block_tokens, device) {
            return Err(format!("sequence {}: {why}", it.seq));
        }
        // Position 0, a restore or an import is a new state; later positions need the state they continue.
        let position = it.position as usize;
        let new = !it.restore.is_empty() || !it.import.is_empty();
        if position > 0 && !new && held(it.seq) != Some(position) {
            missing.push(it.seq);
        }
    }
    Ok(missing)
}

/// Whether a computing device may append `it.drafts` drafts to `it`: after
/// the real tokens of a sampled, unconstrained sequence whose held state it
/// continues without a replay (a new, rebuilt, restored or imported state
/// has no proposal of this worker's), within the context, and not after a
/// block end whose state is snapshotted (the drafts would be in it).
fn may_draft(it: &StepItem, bt: usize, config: &ModelConfig) -> bool {
    let (position, drafts) = (it.position as usize, it.drafts as usize);
    let end = position.saturating_add(it.tokens.len());
    let continued = position > 0 && !it.rebuild && it.restore.is_empty() && it.import.is_empty();
    it.sample
        && it.allowed.is_empty()
        && continued
        && it.replay_until as usize <= position
        && end.saturating_add(drafts) <= config.max_position_embeddings
        && !it.snapshots.iter().any(|&k| (k as usize + 1).saturating_mul(bt) == end)
}

/// Why `it` cannot run (`repeat` steps in one), or `None`.
fn item_error(
    it: &StepItem,
    fresh: bool,
    repeat: usize,
    config: &ModelConfig,
    bt: usize,
    device: Device,
) -> Option<String> {
    let (position, len) = (it.position as usize, it.tokens.len());
    let end = position.saturating_add(len);
    let replay = it.replay_until as usize;
    let restored = it.restore.len();
    let snapshots_inside = it.snapshots.windows(2).all(|w| w[0] < w[1])
        && it.snapshots.iter().all(|&k| {
            let block_end = (k as usize).saturating_add(1).saturating_mul(bt);
            block_end > position.max(replay) && block_end <= end
        });
    let why = if it.tokens.is_empty() {
        "no tokens".to_string()
    } else if !fresh {
        "listed twice".to_string()
    } else if it.rebuild && (position != 0 || restored != 0 || replay != 0) {
        "a rebuild starts at position 0 from nothing".to_string()
    } else if end.saturating_add(repeat - 1) > config.max_position_embeddings {
        "exceeds the context".to_string()
    } else if restored > 0 && (replay != restored.saturating_mul(bt) || position > replay) {
        format!("restores {restored} blocks but replays to {replay} from {position}")
    } else if restored == 0 && position == 0 && replay != 0 {
        "replay without a restored state".to_string()
    } else if !it.import.is_empty() && (it.rebuild || restored != 0 || replay != 0 || position == 0) {
        "an imported state starts past 0, alone".to_string()
    } else if !snapshots_inside {
        format!("snapshots {:?} outside ({position}, {end}]", it.snapshots)
    } else if device == Device::Modelled && it.logits {
        "a modelled device computes no logits".to_string()
    } else if let Some(drafts_max) = device.drafts_max().filter(|&most| it.drafts as usize > most) {
        format!("{} drafts: this device verifies at most {drafts_max}", it.drafts)
    } else if it.drafts > 0 && device != Device::Modelled && !may_draft(it, bt, config) {
        "drafts only follow the sampled end of a held, unconstrained sequence, inside the context \
         and short of a snapshotted block end"
            .to_string()
    } else if !it.allowed.is_empty() && (!it.sample || it.allowed.len() != config.vocab_size.div_ceil(32)) {
        format!(
            "an allowed-token mask of {} words, for {} tokens and sample {}",
            it.allowed.len(),
            config.vocab_size,
            it.sample
        )
    } else if !it.allowed.is_empty() && !it.allowed.iter().any(|&w| w != 0) {
        "an allowed-token mask that allows nothing".to_string()
    } else if !it.history.is_empty()
        && (!it.sample
            || !it.history.windows(2).all(|w| w[0].token < w[1].token)
            || it.history.last().is_some_and(|h| h.token as usize >= config.vocab_size))
    {
        "a token history that is not ascending inside the vocabulary, or not sampled".to_string()
    } else {
        return sampling_params(&it.sampling).validate(config.vocab_size).err().map(|e| e.to_string());
    };
    Some(why)
}
