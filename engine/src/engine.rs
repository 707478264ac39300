//! The serving core of one instance: a [`Scheduler`] plus the model states it
//! schedules. [`Engine::step`] forms a batch, runs it through the model,
//! samples, and reports what each request produced.
//!
//! How a step runs:
//!
//! 1. The scheduler plans it ([`StepPlan`](crate::scheduler::StepPlan)):
//!    which requests feed which tokens, who was preempted, which cached
//!    blocks were evicted.
//! 2. Preempted requests' states are dropped; (re)admitted requests get a
//!    fresh state, or on a prefix hit one rebuilt from the cached blocks'
//!    compressed entries, positioned at the start of the replay.
//! 3. Each request's tokens are cut into segments at the replay's end and at
//!    the prefix-block boundaries to be cached; the step runs as a few
//!    forward calls ("waves"), wave `w` holding every request's `w`-th
//!    segment, so the compressor state at each such boundary can be copied.
//!    Results do not depend on this cutting: the forward pass is invariant to
//!    chunking and batch composition.
//! 4. Requests that reached the end of their sequence sample their next token
//!    with the counter-based generator keyed by (seed, position).
//! 5. New blocks are offered to the prefix cache, and the scheduler records
//!    the tokens and finishes requests.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;

pub use crate::block_values::{check_restore, restore_state, BlockValues};
use crate::constraint::TokenConstraint;
use crate::engine_tiers::Tiers;
pub use crate::engine_tiers::{FetchedBlock, PersistBlock, TierConfig, TierCounters, WantedBlock};
use crate::images::{check_request, chunk_spans, span_rows};
use crate::kv_pool::BlockId;
use crate::model::{Chunk, LogitsWanted, Model, SequenceState};
use crate::request::{FinishReason, Finished, Request, RequestError, RequestId, RequestUpdate, TokenOutput};
use crate::sampling::{adjust_logits, sample};
pub use crate::scheduler::{EngineConfig, EngineConfigError};
use crate::scheduler::{Registration, SampledToken, ScheduledItem, Scheduler};
use crate::speculative::policy::{choose_lengths, min_survival, StepCost, SURVIVAL_WORTH_DRAFTING_MAX};
use crate::speculative::{draft_next, Chooser, DraftInput, Proposal, SpeculativeStats};

/// A finished request with everything it generated.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub tokens: Vec<TokenOutput>,
    pub finished: Finished,
}

impl Completion {
    pub fn token_ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.token).collect()
    }
}

/// Gathers step updates into completions.
#[derive(Debug, Default)]
pub struct Collector {
    partial: BTreeMap<RequestId, Vec<TokenOutput>>,
}

impl Collector {
    /// Take one step's updates; returns the requests that finished with them.
    pub fn absorb(&mut self, updates: Vec<RequestUpdate>) -> Vec<(RequestId, Completion)> {
        let mut done = Vec::new();
        for u in updates {
            let tokens = self.partial.entry(u.id).or_default();
            tokens.extend(u.tokens);
            if let Some(finished) = u.finished {
                let tokens = self.partial.remove(&u.id).unwrap_or_default();
                done.push((u.id, Completion { tokens, finished }));
            }
        }
        done
    }
}

/// One serving instance: model, scheduler and per-request state.
pub struct Engine<M: Deref<Target = Model> = Arc<Model>> {
    model: M,
    pub(crate) scheduler: Scheduler,
    states: BTreeMap<RequestId, SequenceState>,
    /// Values of cached blocks, by their compressed block.
    pub(crate) stored: BTreeMap<BlockId, Arc<BlockValues>>,
    /// The cache tiers below the device pool.
    pub(crate) tiers: Tiers,
    /// Sampling constraints of the requests that have one.
    constraints: BTreeMap<RequestId, Box<dyn TokenConstraint>>,
    /// Drafts proposed for each decoding request's next step.
    proposals: BTreeMap<RequestId, Proposal>,
    /// What a verification step costs, for the draft-length policy.
    step_cost: StepCost,
    /// What drafting costs by the requests drafted for: one step of an MTP
    /// chain, or DSpark's block (none known: drafting is taken as free).
    draft_cost: Option<StepCost>,
    spec_stats: SpeculativeStats,
    /// Each running request's image span rows, by image, once a step has fed part of the span.
    image_rows: BTreeMap<RequestId, Vec<Option<Arc<[f32]>>>>,
}

impl<M: Deref<Target = Model>> Engine<M> {
    pub fn new(model: M, config: EngineConfig) -> Result<Self, EngineConfigError> {
        config.speculative.check(&model).map_err(EngineConfigError::Speculative)?;
        let scheduler = Scheduler::new(&model.config, config)?;
        Ok(Self {
            model,
            scheduler,
            states: BTreeMap::new(),
            stored: BTreeMap::new(),
            tiers: Tiers::new(TierConfig::default()),
            constraints: BTreeMap::new(),
            proposals: BTreeMap::new(),
            step_cost: StepCost::linear(1.0, 1.0 / 64.0),
            draft_cost: None,
            spec_stats: SpeculativeStats::default(),
            image_rows: BTreeMap::new(),
        })
    }

    /// The time a step takes by tokens verified, measured on this machine
    /// (the adaptive draft-length policy weighs drafts against it).
    pub fn set_step_cost(&mut self, cost: StepCost) {
        self.step_cost = cost;
    }

    /// The time drafting takes by the requests drafted for (one step of an
    /// MTP chain, or DSpark's block), measured on this machine: with the
    /// adaptive policy a draft is made only while it is expected to pay for
    /// drafting it as well as for verifying it.
    pub fn set_draft_cost(&mut self, cost: StepCost) {
        self.draft_cost = Some(cost);
    }

    pub fn speculative_stats(&self) -> &SpeculativeStats {
        &self.spec_stats
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Queue a request; refused requests never affect the others.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, RequestError> {
        check_request(&self.model, &request)?;
        self.scheduler.add(request)
    }

    /// Queue a request whose every sampled token must pass `constraint`.
    pub fn add_constrained_request(
        &mut self,
        request: Request,
        constraint: Box<dyn TokenConstraint>,
    ) -> Result<RequestId, RequestError> {
        check_request(&self.model, &request)?;
        let id = self.scheduler.add(request)?;
        self.constraints.insert(id, constraint);
        Ok(id)
    }

    /// Cancel a request and free everything it holds.
    pub fn cancel(&mut self, id: RequestId) -> Result<Finished, RequestError> {
        let finished = self.scheduler.cancel(id)?;
        self.forget(id);
        Ok(finished)
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Run steps until every queued request has finished.
    pub fn run_to_completion(&mut self) -> BTreeMap<RequestId, Completion> {
        let mut collector = Collector::default();
        let mut done = BTreeMap::new();
        while self.has_work() {
            let updates = self.step();
            done.extend(collector.absorb(updates));
        }
        done
    }

    /// Run one step. Returns, by request id, the tokens generated and the
    /// requests that finished.
    pub fn step(&mut self) -> Vec<RequestUpdate> {
        self.promote_waiting();
        let mut plan = self.scheduler.schedule();
        self.on_evicted(std::mem::take(&mut plan.evicted));
        for &id in &plan.preempted {
            self.states.remove(&id);
            self.proposals.remove(&id);
            self.on_preempted(id);
        }
        let mut updates: BTreeMap<RequestId, RequestUpdate> = BTreeMap::new();
        for (id, finished) in plan.failed {
            self.forget(id);
            updates.insert(id, RequestUpdate { id, tokens: Vec::new(), finished: Some(finished) });
        }
        let items = plan.items;
        items.iter().for_each(|it| self.on_admitted(it));
        let mut drafts = self.drafts_to_verify(&items);
        for (i, it) in items.iter().enumerate() {
            // Drafts never ride on a chunk with image positions.
            if self.load_image_rows(it) {
                drafts[i].clear();
            }
        }
        let dim = self.model.v41.as_ref().map_or(0, |m| m.config.dim);
        let mut states: Vec<SequenceState> = items
            .iter()
            .map(|it| match &it.start {
                Some(hit) => self.restore(hit, it.from),
                None => self.states.remove(&it.id).expect("a running request has a state"),
            })
            .collect();

        let bt = self.scheduler.layout().block_tokens;
        let segments: Vec<Vec<(usize, usize, bool)>> = items.iter().map(|it| segments(it, bt)).collect();
        let waves = segments.iter().map(Vec::len).max().unwrap_or(0);
        // Drafting reads the hidden rows of every request that samples.
        let keep_hidden = self.scheduler.config().speculative.max_drafts() > 0 && items.iter().any(|it| it.sample);
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; items.len()];
        let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); items.len()];
        let mut snapshots = Vec::new();
        let vocab = self.model.config.vocab_size;
        for w in 0..waves {
            let last_here = |i: usize| items[i].sample && segments[i].len() == w + 1;
            let tail = (0..items.len()).filter(|&i| last_here(i)).map(|i| drafts[i].len() + 1).max();
            let mut members = Vec::new();
            let mut fed: Vec<Vec<u32>> = Vec::new();
            for (i, it) in items.iter().enumerate() {
                if let Some(&(a, b, _)) = segments[i].get(w) {
                    let mut tokens = self.scheduler.tokens(it.id)[a..b].to_vec();
                    if b == it.to {
                        tokens.extend_from_slice(&drafts[i]);
                    }
                    fed.push(tokens);
                    members.push(i);
                }
            }
            // `fed` holds the members' tokens in item order, as below.
            let mut feeds = fed.iter();
            let mut chunks: Vec<Chunk> = Vec::with_capacity(members.len());
            for (i, state) in states.iter_mut().enumerate() {
                let Some(&(_, b, replay)) = segments[i].get(w) else { continue };
                let n = if b == items[i].to { drafts[i].len() } else { 0 };
                let tokens = feeds.next().expect("one feed per member");
                chunks.push(Chunk { tokens, state, replay, drafts: n });
            }
            let wanted = match tail {
                None => LogitsWanted::None,
                Some(1) => LogitsWanted::Last,
                Some(n) => LogitsWanted::Tail(n),
            };
            let spans: Vec<_> = members
                .iter()
                .map(|&i| {
                    let (a, b, _) = segments[i][w];
                    let id = items[i].id;
                    self.image_rows
                        .get(&id)
                        .map_or_else(Vec::new, |rows| chunk_spans(&self.scheduler.request(id).images, rows, a..b, dim))
                })
                .collect();
            let outputs = self.model.forward_spans(&mut chunks, &spans, wanted, keep_hidden);
            drop(spans);
            drop(chunks);
            for (i, out) in members.into_iter().zip(outputs) {
                let (_, end, _) = segments[i][w];
                let it = &items[i];
                if keep_hidden && it.sample {
                    hidden[i].extend_from_slice(&out.streams);
                }
                if it.sample && end == it.to {
                    let keep = (drafts[i].len() + 1) * vocab;
                    rows[i] = Some(out.logits[out.logits.len() - keep..].to_vec());
                }
                if end.is_multiple_of(bt) && end > 0 && it.snapshots.contains(&(end / bt - 1)) {
                    assert!(end < it.to || drafts[i].is_empty(), "no drafts follow a block end");
                    snapshots.push((
                        it.id,
                        end / bt - 1,
                        BlockValues::capture(&self.model, &states[i], end / bt - 1, bt),
                    ));
                }
            }
        }
        for (it, state) in items.iter().zip(states) {
            self.states.insert(it.id, state);
        }
        for (id, k, values) in snapshots {
            match self.scheduler.register_block(id, k) {
                Registration::New(b) => {
                    self.stored.insert(b, Arc::new(values));
                    self.on_registered(id, k, b);
                }
                Registration::Shared(b) => self.on_registered(id, k, b),
                Registration::Skipped => {}
            }
        }

        let mut to_draft = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let Some(logits) = rows[i].take() else { continue };
            let (tokens, finished) = self.verify(it, &drafts[i], &logits);
            let update =
                updates.entry(it.id).or_insert_with(|| RequestUpdate { id: it.id, tokens: Vec::new(), finished: None });
            update.tokens = tokens;
            match finished {
                Some(mut f) => {
                    self.on_finished(it.id, &mut f);
                    self.forget(it.id);
                    update.finished = Some(f);
                }
                None => to_draft.push(i),
            }
        }
        if keep_hidden {
            self.propose(&items, &to_draft, &hidden);
        }
        updates.into_values().collect()
    }

    /// Compute the rows of `it`'s image spans that its positions reach and that
    /// are not kept yet (the tower runs once per image and request). True when
    /// `it` feeds part of a span.
    fn load_image_rows(&mut self, it: &ScheduledItem) -> bool {
        let images = &self.scheduler.request(it.id).images;
        let reached = |s: &std::ops::Range<usize>| s.start < it.to && it.from < s.end;
        if !images.iter().any(|image| reached(&image.span())) {
            return false;
        }
        let rows = self.image_rows.entry(it.id).or_insert_with(|| vec![None; images.len()]);
        for (image, slot) in images.iter().zip(rows.iter_mut()) {
            if slot.is_none() && reached(&image.span()) {
                *slot = Some(span_rows(&self.model, image).expect("a request's images are checked on arrival"));
            }
        }
        true
    }

    /// Forget everything kept for a request that ended.
    fn forget(&mut self, id: RequestId) {
        self.image_rows.remove(&id);
        self.forget_tiers(id);
        self.states.remove(&id);
        self.constraints.remove(&id);
        self.proposals.remove(&id);
    }

    /// The drafts each item verifies this step: the request's proposal for
    /// the position after the item, as many as the policy chooses within the
    /// scheduler's allowance.
    fn drafts_to_verify(&mut self, items: &[ScheduledItem]) -> Vec<Vec<u32>> {
        let policy = self.scheduler.config().speculative.policy;
        let mut acceptance = Vec::with_capacity(items.len());
        let mut limits = Vec::with_capacity(items.len());
        for it in items {
            match self.proposals.get(&it.id) {
                Some(p) if it.drafts > 0 && p.at == it.to => {
                    acceptance.push(p.acceptance.clone());
                    limits.push(it.drafts);
                }
                _ => {
                    acceptance.push(Vec::new());
                    limits.push(0);
                }
            }
        }
        let lengths = choose_lengths(policy, &acceptance, &limits, &self.step_cost);
        items
            .iter()
            .zip(lengths)
            .map(|(it, n)| match self.proposals.remove(&it.id) {
                Some(p) if n > 0 => p.tokens[..n].to_vec(),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Sample the item's token and verify its drafts: the target's choice at
    /// each position is the output; a draft is accepted while it equals it.
    /// Rejected drafts are taken back from the state; all accepted, the state
    /// keeps them. Returns the tokens produced and the finish, if any.
    fn verify(&mut self, it: &ScheduledItem, drafts: &[u32], logits: &[f32]) -> (Vec<TokenOutput>, Option<Finished>) {
        let vocab = self.model.config.vocab_size;
        assert_eq!(logits.len(), (drafts.len() + 1) * vocab, "a row per draft and one more");
        let mut out = Vec::with_capacity(drafts.len() + 1);
        let mut accepted = 0;
        let mut finished = None;
        for (j, row) in logits.chunks_exact(vocab).enumerate() {
            let mut row = row.to_vec();
            let request = self.scheduler.request(it.id);
            if request.params.adjusts_logits() {
                let (prompt, output) = self.scheduler.tokens(it.id).split_at(request.prompt.len());
                adjust_logits(&mut row, &request.params, prompt, output);
            }
            let mut constraint = self.constraints.get_mut(&it.id);
            if let Some(c) = constraint.as_deref_mut() {
                c.allowed(&mut row);
            }
            let s = sample(&row, &request.params, (it.to + j) as u64);
            let done = constraint.is_some_and(|c| {
                c.accept(s.token);
                c.is_done()
            });
            let sampled = SampledToken { id: it.id, token: s.token, ok: s.logprob.is_finite() };
            out.push(TokenOutput {
                token: s.token,
                logprob: s.logprob,
                top: s.top,
                logits: request.return_logits.then_some(row),
            });
            if let Some((_, f)) = self.scheduler.complete(&[sampled]).pop() {
                finished = Some(f);
            } else if done {
                // A constraint that admits nothing more ends its request as a stop.
                let mut f = self.scheduler.cancel(it.id).expect("a running request");
                f.reason = FinishReason::Stop;
                finished = Some(f);
            }
            if finished.is_some() || drafts.get(j) != Some(&s.token) {
                break;
            }
            accepted += 1;
        }
        if !drafts.is_empty() {
            let stats = &mut self.spec_stats;
            stats.verifications += 1;
            stats.verified += drafts.len() as u64;
            stats.accepted += accepted as u64;
            stats.all_accepted += u64::from(accepted == drafts.len());
            stats.verification_tokens += out.len() as u64;
            if finished.is_none() {
                let state = self.states.get_mut(&it.id).expect("a running request has a state");
                if accepted == drafts.len() {
                    state.accept_drafts();
                    self.scheduler.accept_drafts(it.id, accepted);
                } else {
                    state.reject_drafts(&self.model.config);
                }
            }
        }
        (out, finished)
    }

    /// Draft the next tokens of the items `which` (still running after
    /// sampling), from the hidden rows their step computed.
    fn propose(&mut self, items: &[ScheduledItem], which: &[usize], hidden: &[Vec<f32>]) {
        let spec = self.scheduler.config().speculative;
        let max = spec.max_drafts();
        let running = self.scheduler.num_running();
        let min_survival = min_survival(spec.policy, running, &self.step_cost, self.draft_cost.as_ref());
        if min_survival >= SURVIVAL_WORTH_DRAFTING_MAX {
            // At this batch no draft can pay for its verification: drafting
            // would only cost (the MTP window catches up when it resumes).
            return;
        }
        let ids: Vec<RequestId> = which.iter().map(|&i| items[i].id).collect();
        let mut states: Vec<&mut SequenceState> =
            self.states.iter_mut().filter(|(id, _)| ids.contains(id)).map(|(_, s)| s).collect();
        // `states` follows id order; pair each with its item.
        let mut order: Vec<usize> = which.to_vec();
        order.sort_by_key(|&i| items[i].id);
        let mut inputs = Vec::with_capacity(order.len());
        for (state, &i) in states.iter_mut().zip(&order) {
            let it = &items[i];
            let request = self.scheduler.request(it.id);
            let tokens = self.scheduler.tokens(it.id);
            let generated = tokens.len() - request.prompt.len();
            let (prompt, output) = tokens.split_at(request.prompt.len());
            let mut chooser = Chooser::new(&request.params, prompt, output);
            chooser.constraint = self.constraints.get(&it.id).and_then(|c| c.fork());
            inputs.push(DraftInput {
                state,
                rows: &hidden[i],
                rows_from: it.from,
                tokens,
                tokens_from: 0,
                count: max.min(request.max_tokens.saturating_sub(generated + 1)),
                min_survival,
                chooser,
            });
        }
        let proposals = draft_next(&self.model, &mut inputs);
        drop(inputs);
        for (&i, p) in order.iter().zip(proposals) {
            self.spec_stats.proposed += p.tokens.len() as u64;
            if !p.tokens.is_empty() {
                self.proposals.insert(items[i].id, p);
            }
        }
    }

    /// A state holding the compressed state of the cached blocks `hit`,
    /// positioned at `position` (the start of the replay).
    fn restore(&self, hit: &[BlockId], position: usize) -> SequenceState {
        let blocks: Vec<&BlockValues> = hit.iter().map(|b| &*self.stored[b]).collect();
        restore_state(&self.model, &blocks, position)
    }
}

/// Cut an item's tokens at the replay's end and at the boundaries to snapshot.
fn segments(it: &ScheduledItem, bt: usize) -> Vec<(usize, usize, bool)> {
    step_segments(it.from, it.to, it.replay_until, &it.snapshots, bt)
}

/// The forward calls ("waves") one item of a step is cut into: `[from, to)`
/// cut at `replay_until` and at the end of each block in `snapshots`; each
/// piece is `(start, end, replay)`. A distributed worker runs the same cuts.
pub fn step_segments(
    from: usize,
    to: usize,
    replay_until: usize,
    snapshots: &[usize],
    bt: usize,
) -> Vec<(usize, usize, bool)> {
    let mut cuts: Vec<usize> = snapshots.iter().map(|k| (k + 1) * bt).collect();
    cuts.push(replay_until);
    cuts.retain(|&c| c > from && c < to);
    cuts.sort_unstable();
    cuts.dedup();
    cuts.push(to);
    let mut start = from;
    cuts.into_iter()
        .map(|end| {
            let seg = (start, end, end <= replay_until);
            start = end;
            seg
        })
        .collect()
}
