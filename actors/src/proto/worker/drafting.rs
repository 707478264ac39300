//! Speculative decoding on a computing worker: the drafts a sequence's
//! previous step proposed ride after its real tokens, the target's rows
//! verify them exactly as `Engine::verify` does (each position's own choice
//! is the output; a draft is accepted while it equals it), the state keeps
//! or takes back the drafts, and the model's draft head proposes the next
//! ones from the hidden rows the step computed.
//!
//! The worker sees the scheduler's allowance per item (what its plan
//! reserved in the token budget and the KV pool), not the request's stop
//! conditions: tokens past a finish are dropped by the scheduler, whose
//! plan never lets a draft pass `max_tokens` or the context, nor (with the
//! prefix cache on) follow or reach a block end. A constrained item never
//! drafts here (only its first row's mask travels), so its tokens are
//! always the constraint's; nor does a state the worker does not hold
//! already (`validate::may_draft`).

use deepinfer_engine::sampling::{adjust_logits_from_history, sample};
use deepinfer_engine::speculative::policy::{choose_lengths, min_survival, SURVIVAL_WORTH_DRAFTING_MAX};
use deepinfer_engine::speculative::{count_output_token, draft_next, Chooser, DraftInput};

use super::compute::ItemRun;
use super::WorkerMachine;
use crate::sim::events::add;
use crate::wire::{SeqOutput, TopLogprob};

impl WorkerMachine {
    /// Most drafts an item may verify here (0: this worker does not draft):
    /// the configured most, within the model's window as the engine's
    /// scheduler allows.
    pub(super) fn drafts_max(&self) -> usize {
        if self.ctx.modelled.is_some() {
            return 0;
        }
        let window = self.ctx.model.config.sliding_window.saturating_sub(2);
        self.ctx.engine.speculative.max_drafts().min(window)
    }

    /// Append to each item the drafts it verifies this step: its proposal
    /// for the position after its tokens, as many as the policy picks within
    /// the scheduler's allowance. Every item's older proposal goes.
    pub(super) fn attach_drafts(&mut self, items: &mut [ItemRun], allowances: &[usize]) {
        assert_eq!(items.len(), allowances.len(), "one allowance per item");
        let mut proposals = Vec::with_capacity(items.len());
        for (it, &allowance) in items.iter().zip(allowances) {
            let proposal = self.proposals.remove(&it.seq);
            let usable = it.sample && it.allowed.is_empty() && allowance > 0;
            proposals.push(proposal.filter(|p| usable && p.at == it.to()));
        }
        if self.drafts_max() == 0 {
            return;
        }
        let acceptance: Vec<Vec<f64>> =
            proposals.iter().map(|p| p.as_ref().map_or_else(Vec::new, |p| p.acceptance.clone())).collect();
        let limits: Vec<usize> =
            proposals.iter().zip(allowances).map(|(p, &a)| if p.is_some() { a } else { 0 }).collect();
        let policy = self.ctx.engine.speculative.policy;
        let lengths = choose_lengths(policy, &acceptance, &limits, &self.ctx.draft_costs.step);
        for ((it, proposal), n) in items.iter_mut().zip(proposals).zip(lengths) {
            let Some(p) = proposal.filter(|_| n > 0) else { continue };
            it.tokens.extend_from_slice(&p.tokens[..n]);
            it.drafts = n;
        }
    }

    /// Sample item `it`'s rows (its last real token's, then one per draft)
    /// into `outputs` (and `body` for returned logits): one token per row
    /// while the drafts are accepted. The state keeps all drafts or takes
    /// them all back; `it.tokens` becomes the sequence from `it.from` up to
    /// the newest token, not yet fed. Returns how many drafts were accepted.
    pub(super) fn verify(
        &self,
        it: &mut ItemRun,
        rows: &[f32],
        outputs: &mut Vec<SeqOutput>,
        body: &mut Vec<f32>,
    ) -> usize {
        let vocab = self.ctx.config.vocab_size;
        assert_eq!(rows.len(), (it.drafts + 1) * vocab, "a row per draft and one more");
        let to = it.to();
        let mut accepted = 0;
        let mut newest = 0;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let mut row = row.to_vec();
            // The engine's order: bias and penalties, then the structured-output mask, then sampling.
            adjust_logits_from_history(&mut row, &it.params, &it.history);
            if j == 0 {
                mask_row(&mut row, &it.allowed);
            }
            let position = (to + j) as u64;
            let s = sample(&row, &it.params, position);
            let top = s.top.iter().map(|&(token, logprob)| TopLogprob { token, logprob }).collect();
            outputs.push(SeqOutput { seq: it.seq, token: s.token, logprob: s.logprob, position, top });
            if it.logits {
                body.extend_from_slice(&row);
            }
            if it.params.adjusts_logits() {
                count_output_token(&mut it.history, s.token);
            }
            newest = s.token;
            if j >= it.drafts || it.tokens[to - it.from + j] != s.token {
                break;
            }
            accepted += 1;
        }
        if it.drafts > 0 {
            add(&self.ctx.metrics.drafts_verified, it.drafts as u64);
            add(&self.ctx.metrics.verifications, 1);
            if accepted == it.drafts {
                it.state.accept_drafts();
                add(&self.ctx.metrics.verifications_all_accepted, 1);
            } else {
                it.state.reject_drafts(&self.ctx.model.config);
            }
            add(&self.ctx.metrics.drafts_accepted, accepted as u64);
        }
        it.tokens.truncate(to - it.from + accepted);
        it.tokens.push(newest);
        it.drafts = 0;
        accepted
    }

    /// Draft the next tokens of the items that sampled (and stay here:
    /// exported ones move to another instance) from their hidden rows.
    pub(super) fn propose(&mut self, items: &mut [ItemRun]) {
        let spec = self.ctx.engine.speculative;
        let max = self.drafts_max();
        if max == 0 {
            return;
        }
        let wanted = |it: &ItemRun| it.sample && !it.export && it.allowed.is_empty() && !it.hidden.is_empty();
        let running = items.iter().filter(|it| it.sample).count();
        let costs = &self.ctx.draft_costs;
        let min_survival = min_survival(spec.policy, running, &costs.step, costs.draft.as_ref());
        if min_survival >= SURVIVAL_WORTH_DRAFTING_MAX {
            // No draft can pay for its verification at this batch.
            return;
        }
        let mut seqs = Vec::new();
        let mut inputs = Vec::new();
        for it in items.iter_mut().filter(|it| wanted(it)) {
            let ItemRun { seq, from, tokens, state, params, history, hidden, .. } = it;
            seqs.push(*seq);
            inputs.push(DraftInput {
                state,
                rows: hidden,
                rows_from: *from,
                tokens,
                tokens_from: *from,
                count: max,
                min_survival,
                chooser: Chooser { params, history: history.clone(), constraint: None },
            });
        }
        if inputs.is_empty() {
            return;
        }
        let proposals = draft_next(&self.ctx.model, &mut inputs);
        drop(inputs);
        for (seq, p) in seqs.into_iter().zip(proposals) {
            add(&self.ctx.metrics.drafts_proposed, p.tokens.len() as u64);
            if !p.tokens.is_empty() {
                self.proposals.insert(seq, p);
            }
        }
    }
}

/// Set the logits of tokens outside `allowed` (one bit per token; empty
/// allows all) to -inf, as the engine's constraint does.
fn mask_row(row: &mut [f32], allowed: &[u32]) {
    if allowed.is_empty() {
        return;
    }
    for (token, logit) in row.iter_mut().enumerate() {
        if allowed.get(token / 32).is_none_or(|w| w >> (token % 32) & 1 == 0) {
            *logit = f32::NEG_INFINITY;
        }
    }
}
