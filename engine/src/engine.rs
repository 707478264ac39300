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

use crate::config::AttentionKind;
use crate::constraint::TokenConstraint;
use crate::kv_pool::BlockId;
use crate::model::state::CompressorState;
use crate::model::{Chunk, LogitsWanted, Model, SequenceState};
use crate::request::{FinishReason, Finished, Request, RequestError, RequestId, RequestUpdate, TokenOutput};
use crate::sampling::{adjust_logits, sample};
pub use crate::scheduler::{EngineConfig, EngineConfigError};
use crate::scheduler::{Registration, SampledToken, ScheduledItem, Scheduler};

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
    scheduler: Scheduler,
    states: BTreeMap<RequestId, SequenceState>,
    /// Values of cached blocks, by their compressed block.
    stored: BTreeMap<BlockId, BlockValues>,
    /// Sampling constraints of the requests that have one.
    constraints: BTreeMap<RequestId, Box<dyn TokenConstraint>>,
}

impl<M: Deref<Target = Model>> Engine<M> {
    pub fn new(model: M, config: EngineConfig) -> Result<Self, EngineConfigError> {
        let scheduler = Scheduler::new(&model.config, config)?;
        Ok(Self { model, scheduler, states: BTreeMap::new(), stored: BTreeMap::new(), constraints: BTreeMap::new() })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Queue a request; refused requests never affect the others.
    pub fn add_request(&mut self, request: Request) -> Result<RequestId, RequestError> {
        self.scheduler.add(request)
    }

    /// Queue a request whose every sampled token must pass `constraint`.
    pub fn add_constrained_request(
        &mut self,
        request: Request,
        constraint: Box<dyn TokenConstraint>,
    ) -> Result<RequestId, RequestError> {
        let id = self.scheduler.add(request)?;
        self.constraints.insert(id, constraint);
        Ok(id)
    }

    /// Cancel a request and free everything it holds.
    pub fn cancel(&mut self, id: RequestId) -> Result<Finished, RequestError> {
        let finished = self.scheduler.cancel(id)?;
        self.states.remove(&id);
        self.constraints.remove(&id);
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
        let plan = self.scheduler.schedule();
        for b in &plan.evicted {
            self.stored.remove(b);
        }
        for id in &plan.preempted {
            self.states.remove(id);
        }
        let mut updates: BTreeMap<RequestId, RequestUpdate> = BTreeMap::new();
        for (id, finished) in plan.failed {
            self.states.remove(&id);
            self.constraints.remove(&id);
            updates.insert(id, RequestUpdate { id, tokens: Vec::new(), finished: Some(finished) });
        }
        let items = plan.items;
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
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; items.len()];
        let mut snapshots = Vec::new();
        for w in 0..waves {
            let wants_logits = items.iter().zip(&segments).any(|(it, s)| it.sample && s.len() == w + 1);
            let mut members = Vec::new();
            let mut chunks = Vec::new();
            for (i, state) in states.iter_mut().enumerate() {
                if let Some(&(a, b, replay)) = segments[i].get(w) {
                    let tokens = &self.scheduler.tokens(items[i].id)[a..b];
                    chunks.push(Chunk { tokens, state, replay, drafts: 0 });
                    members.push(i);
                }
            }
            let wanted = if wants_logits { LogitsWanted::Last } else { LogitsWanted::None };
            let outputs = self.model.forward(&mut chunks, wanted, false);
            drop(chunks);
            for (i, out) in members.into_iter().zip(outputs) {
                let (_, end, _) = segments[i][w];
                let it = &items[i];
                if it.sample && end == it.to {
                    rows[i] = Some(out.logits);
                }
                if end.is_multiple_of(bt) && end > 0 && it.snapshots.contains(&(end / bt - 1)) {
                    snapshots.push((it.id, end / bt - 1, snapshot(&self.model, &states[i], end / bt - 1, bt)));
                }
            }
        }

        let mut sampled = Vec::new();
        for (i, it) in items.iter().enumerate() {
            let Some(mut row) = rows[i].take() else { continue };
            let constraint = self.constraints.get_mut(&it.id);
            let request = self.scheduler.request(it.id);
            if request.params.adjusts_logits() {
                let (prompt, output) = self.scheduler.tokens(it.id).split_at(request.prompt.len());
                adjust_logits(&mut row, &request.params, prompt, output);
            }
            let s = match constraint {
                Some(c) => {
                    c.allowed(&mut row);
                    let s = sample(&row, &request.params, it.to as u64);
                    c.accept(s.token);
                    s
                }
                None => sample(&row, &request.params, it.to as u64),
            };
            sampled.push(SampledToken { id: it.id, token: s.token, ok: s.logprob.is_finite() });
            let token = TokenOutput {
                token: s.token,
                logprob: s.logprob,
                top: s.top,
                logits: request.return_logits.then_some(row),
            };
            updates.insert(it.id, RequestUpdate { id: it.id, tokens: vec![token], finished: None });
        }
        for (it, state) in items.iter().zip(states) {
            self.states.insert(it.id, state);
        }
        for (id, k, values) in snapshots {
            if let Registration::New(b) = self.scheduler.register_block(id, k) {
                self.stored.insert(b, values);
            }
        }
        let mut finished = self.scheduler.complete(&sampled);
        // A constraint that admits nothing more ends its request as a stop.
        for s in &sampled {
            let done = self.constraints.get(&s.id).is_some_and(|c| c.is_done());
            if done && !finished.iter().any(|(id, _)| *id == s.id) {
                if let Ok(mut f) = self.scheduler.cancel(s.id) {
                    f.reason = FinishReason::Stop;
                    finished.push((s.id, f));
                }
            }
        }
        for (id, finished) in finished {
            self.states.remove(&id);
            self.constraints.remove(&id);
            updates.entry(id).or_insert_with(|| RequestUpdate { id, tokens: Vec::new(), finished: None }).finished =
                Some(finished);
        }
        updates.into_values().collect()
    }

    /// A state holding the compressed state of the cached blocks `hit`,
    /// positioned at `position` (the start of the replay).
    fn restore(&self, hit: &[BlockId], position: usize) -> SequenceState {
        let blocks: Vec<&BlockValues> = hit.iter().map(|b| &self.stored[b]).collect();
        restore_state(&self.model, &blocks, position)
    }
}

/// A state holding the compressed state of `blocks` (consecutive cached
/// blocks from position 0, as [`BlockValues::capture`] took them),
/// positioned at `position` (the start of the replay).
pub fn restore_state(model: &Model, blocks: &[&BlockValues], position: usize) -> SequenceState {
    let mut state = model.new_state();
    if let (Some(m), Some(v)) = (&model.v41, state.v41.as_mut()) {
        let snapshots: Vec<&crate::v41::state::BlockSnapshot> =
            blocks.iter().map(|b| b.v41.as_ref().expect("a V4.1 block")).collect();
        *v = crate::v41::V41State::restore(&m.config, &snapshots, position);
        state.position = position;
        return state;
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
    state.position = position;
    state
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

/// Copy the compressed state of block `k` out of a state whose position is its end.
fn snapshot(model: &Model, state: &SequenceState, k: usize, bt: usize) -> BlockValues {
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
