//! The scheduler's side of speculative decoding: a worker reports, per
//! sampling item and decode step, how many drafts it verified and how many
//! the target accepted; the scheduler completes the accepted tokens one by
//! one and keeps the drafts of a fully accepted run, as `Engine::verify`
//! does, within the allowance its own plan reserved. Computing workers draft
//! with the model's own head (`proto/worker/drafting.rs`); modelled ones as
//! their acceptance model says.

use std::collections::BTreeMap;

use deepinfer_engine::request::{FinishReason, Finished, RequestId};
use deepinfer_engine::scheduler::SampledToken;
use deepinfer_engine::speculative::policy::MAX_DRAFT_TOKENS;

use super::by_seq::{BySeq, SeqSlots};
use super::{finish_wire, Item, SampledRow, SchedulerMachine};
use crate::modelled::devices::Modelled;
use crate::wire::{BlockSnapshot, OutputEnd, OutputItem, SeqOutput, StateExport, TokenOut, Verification};

/// The parts of a worker's answer that are checked against the step.
pub(super) struct Shape<'a> {
    pub outputs: &'a [SeqOutput],
    pub snapshots: &'a [BlockSnapshot],
    pub exports: &'a [StateExport],
    pub verifications: &'a [Verification],
}

/// A step's outputs per request, in the order they first produced one,
/// with their logits rows when the request returns them.
#[derive(Default)]
pub(super) struct Outs {
    pub items: Vec<(OutputItem, Option<Vec<f32>>)>,
    slot: SeqSlots,
}

impl Outs {
    /// Request `id`'s next token; `from`: its tokens before this one.
    pub fn push(&mut self, id: u64, from: usize, cached: usize, o: SeqOutput, row: Option<Vec<f32>>) {
        let token = TokenOut { token: o.token, logprob: o.logprob, top: o.top };
        let (k, new) = self.slot.get_or_insert(id, self.items.len());
        if new {
            let (tokens, logits, cached) = (vec![token], row.is_some(), cached as u32);
            let item = OutputItem { id, from: from as u32, tokens, logits, end: None, cached };
            self.items.push((item, row));
        } else {
            let (item, rows) = &mut self.items[k];
            item.tokens.push(token);
            // One logits row per token, in order.
            if let (Some(rows), Some(row)) = (rows.as_mut(), row) {
                rows.extend_from_slice(&row);
            }
        }
    }

    pub fn finish(&mut self, id: u64, f: &Finished) {
        if let Some(k) = self.slot.get(id) {
            self.items[k].0.end = Some(OutputEnd::Finished(finish_wire(f)));
        }
    }
}

impl SchedulerMachine {
    /// Outputs each sampling item of `mine` owes: `Some(None)` without
    /// drafting (then no verification may come), else `1 + accepted` summed
    /// over its `repeat` verifications; `None`: the answer is malformed.
    pub(super) fn verified_tokens(
        &self,
        mine: &BTreeMap<u64, &Item>,
        repeat: u64,
        verifications: &[Verification],
    ) -> Option<Option<BTreeMap<u64, u64>>> {
        if !self.drafting() {
            return verifications.is_empty().then_some(None);
        }
        let mut steps: BTreeMap<u64, u64> = BTreeMap::new();
        let mut tokens: BTreeMap<u64, u64> = BTreeMap::new();
        for v in verifications {
            let it = mine.get(&v.seq).filter(|it| it.sample)?;
            let n = steps.entry(v.seq).or_default();
            let first = *n == 0;
            if v.accepted > v.drafts || v.drafts as usize > MAX_DRAFT_TOKENS || *n >= repeat {
                return None;
            }
            // The first step's drafts are the plan's; later ones the scheduler clamps.
            if first && v.drafts as usize > it.drafts {
                return None;
            }
            *n += 1;
            *tokens.entry(v.seq).or_default() += 1 + u64::from(v.accepted);
        }
        if steps.values().any(|&n| n != repeat) {
            return None;
        }
        Some(Some(tokens))
    }

    /// Whether this instance's workers verify drafts.
    pub(super) fn drafting(&self) -> bool {
        match &self.ctx.modelled {
            Some(m) => m.drafting().is_some(),
            None => self.ctx.engine.speculative.max_drafts() > 0,
        }
    }

    /// The drafts an item may verify: what the plan reserved, except that on
    /// computing devices a constrained item (only its first row's mask
    /// travels) and one whose state moves on (a prefill instance's last step)
    /// draft nothing.
    pub(super) fn draft_allowance(&self, reserved: usize, constrained: bool, export: bool) -> usize {
        if self.ctx.modelled.is_none() && (constrained || export) {
            0
        } else {
            reserved
        }
    }

    /// The drafts item `it` may verify as sent from `position`: on computing
    /// devices none where the worker starts the state (rebuilt, restored,
    /// imported or replayed), which holds no proposal of that worker's.
    pub(super) fn drafts_to_send(&self, it: &Item, position: usize, replay_until: usize) -> u32 {
        let held = position > 0 && !it.rebuild && it.values.is_none() && it.import.is_none();
        if self.ctx.modelled.is_some() || (held && replay_until <= position) {
            it.drafts as u32
        } else {
            0
        }
    }

    /// Complete a computing step's sampling items with drafts: each takes its
    /// verification and its `1 + accepted` tokens, one by one, until one ends
    /// it (a stop, a length, or a constraint that admits nothing more).
    pub(super) fn complete_drafted(
        &mut self,
        current: &[(u64, RequestId, usize)],
        rows: &mut BySeq<SampledRow>,
        verified: &mut BySeq<Verification>,
        outs: &mut Outs,
    ) {
        for &(id, rid, allowance) in current {
            let Some(v) = verified.pop(id) else { continue };
            let Some(queue) = rows.queue(id) else { continue };
            let drafts = (v.drafts as usize).min(allowance);
            let accepted = (v.accepted as usize).min(drafts);
            let mut answered: Vec<SampledRow> = queue.drain(..(1 + accepted).min(queue.len())).collect();
            let (mut produced, mut finished, mut satisfied) = (0usize, None, false);
            for (o, row) in answered.drain(..) {
                let sampled = SampledToken { id: rid, token: o.token, ok: o.logprob.is_finite() };
                if let Some(c) = self.live.get_mut(&id).and_then(|l| l.constraint.as_deref_mut()) {
                    c.accept(o.token);
                    satisfied = c.is_done();
                }
                outs.push(id, self.generated(rid), self.policy.cached_tokens(rid).unwrap_or(0), o, row);
                produced += 1;
                finished = self.policy.complete(&[sampled]).pop().map(|(_, f)| f);
                if finished.is_some() || satisfied {
                    break;
                }
            }
            if let Some(f) = finished {
                // The end of a model turn: its whole computed chain goes to disk.
                if let Some(l) = self.forget(id).filter(|l| l.persist) {
                    self.persist_chain(l.hashes);
                }
                outs.finish(id, &f);
            } else if satisfied {
                // A constraint that admits nothing more ends its request as a stop, as in the engine.
                if let Some(l) = self.forget(id) {
                    if let Ok(mut f) = self.policy.cancel(l.rid) {
                        f.reason = FinishReason::Stop;
                        outs.finish(id, &f);
                    }
                }
            } else if drafts > 0 && accepted == drafts && produced == 1 + accepted {
                self.policy.accept_drafts(rid, drafts);
            }
        }
    }

    /// Complete one decode step of an event with drafts: each request in
    /// `current` (id, request, allowance) takes its next verification and
    /// the tokens it produced, counted within the allowance, and completes
    /// them one by one until one ends it.
    pub(super) fn complete_verified(
        &mut self,
        m: &Modelled,
        current: &[(u64, RequestId, usize)],
        rows: &mut BySeq<SampledRow>,
        verified: &mut BySeq<Verification>,
        outs: &mut Outs,
    ) {
        let most = m.drafting().map_or(0, |d| d.max_drafts());
        for &(id, rid, allowance) in current {
            let Some(v) = verified.pop(id) else { continue };
            let Some(queue) = rows.queue(id) else { continue };
            let n = (1 + v.accepted as usize).min(queue.len());
            // The worker cannot see `max_tokens`: where the plan allowed fewer
            // drafts, the ones past the allowance were never verified.
            let drafts = (v.drafts as usize).min(allowance);
            let accepted = (v.accepted as usize).min(drafts);
            let decoding = self.generated(rid) > 0;
            let (mut produced, mut finished) = (0usize, None);
            // The step's tokens leave the queue; those past a finish are dropped.
            for (o, row) in queue.drain(..n).take(1 + accepted) {
                let sampled = SampledToken { id: rid, token: o.token, ok: o.logprob.is_finite() };
                outs.push(id, self.generated(rid), self.policy.cached_tokens(rid).unwrap_or(0), o, row);
                produced += 1;
                finished = self.policy.complete(&[sampled]).pop().map(|(_, f)| f);
                if finished.is_some() {
                    break;
                }
            }
            if decoding {
                m.drafts.record(drafts, accepted.min(produced.saturating_sub(1)), produced);
            }
            match finished {
                Some(f) => {
                    self.forget(id);
                    outs.finish(id, &f);
                }
                None => {
                    if drafts > 0 && accepted == drafts && produced == 1 + accepted {
                        self.policy.accept_drafts(rid, drafts);
                    }
                    // What the engine's draft head proposes for the next step.
                    let left = self.policy.request(rid).max_tokens.saturating_sub(self.generated(rid) + 1);
                    m.drafts.propose(most.min(left));
                }
            }
        }
    }

    /// Whether every later step of an event has token budget for each item's
    /// drafts and the drafts a rejection feeds again (else the plan would cut
    /// what the worker ran).
    pub(super) fn room_for_drafts(&self, items: &[Item], drafts: usize) -> bool {
        let per_item = 2 * drafts + 1;
        let cfg = self.policy.config();
        if items.len().saturating_mul(per_item) > cfg.max_batch_tokens {
            return false;
        }
        let Some(cap) = cfg.max_rank_tokens else { return true };
        let mut per_worker: BTreeMap<u32, usize> = BTreeMap::new();
        for it in items {
            *per_worker.entry(it.worker).or_default() += per_item;
        }
        per_worker.values().all(|&n| n <= cap)
    }
}
