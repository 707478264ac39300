//! A step on a device that computes: the request's states are restored,
//! imported or continued, then each wave runs layer by layer with the
//! experts' rows dispatched to the shards; after the last wave the worker
//! samples, captures the blocks the scheduler asked for and answers.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::cost::SeqWork;
use deepinfer_engine::engine::{check_restore, restore_state, step_segments, BlockValues};
use deepinfer_engine::images::RequestImage;
use deepinfer_engine::model::{Chunk, ExpertOutputs, LogitsWanted, Pass, SequenceState};
use deepinfer_engine::sampling::SamplingParams;
use deepinfer_engine::transfer::{parts_values, state_to_parts};

use super::images::{embedded, wave_span_parts};
use super::validate::{check_request, Device};
use super::{Effect, WorkerMachine};
use crate::cluster::placement::{row_key, Placement};
use crate::limits::MAX_EXPORT_BYTES;
use crate::proto::cache::parts_len;
use crate::proto::images::{dim as image_dim, step_image_values, step_request_images};
use crate::proto::{sampling_params, Crash, Outgoing};
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{
    Addr, BlockSnapshot, DispatchHeader, ExpertLoad, ExpertResultHeader, ExpertRows, Message, ResultStatus,
    StateExport, StepItem, StepOutcome, StepRequest, Verification,
};

/// Rows of one dispatch part: experts (ascending) and their `(row, slot)` pairs.
struct Part {
    device: u32,
    experts: Vec<(u32, Vec<(usize, usize)>)>,
    frame: Vec<u8>,
}

/// One sequence's share of a step.
pub(super) struct ItemRun {
    pub(super) seq: u64,
    /// Position of the first of `tokens`.
    pub(super) from: usize,
    /// The step's tokens, then the drafts it verifies.
    pub(super) tokens: Vec<u32>,
    /// How many of `tokens` are drafts (after the last real one).
    pub(super) drafts: usize,
    pub(super) state: SequenceState,
    pub(super) params: SamplingParams,
    pub(super) sample: bool,
    /// The structured-output mask of the sampled token (empty: any).
    pub(super) allowed: Vec<u32>,
    /// The token history its penalties look at (empty without penalties).
    pub(super) history: Vec<(u32, u32)>,
    pub(super) logits: bool,
    /// `(start, end, replay)` per wave, absolute positions.
    pub(super) segments: Vec<(usize, usize, bool)>,
    snapshots: Vec<usize>,
    /// The logits rows to sample from: the last real token's, then one per draft.
    pub(super) row: Option<Vec<f32>>,
    /// Hidden rows of every position the step fed (drafting reads them).
    pub(super) hidden: Vec<f32>,
    pub(super) export: bool,
    /// The images its positions reach, and each one's span rows once computed.
    pub(super) images: Vec<RequestImage>,
    pub(super) image_rows: Vec<Option<Arc<[f32]>>>,
}

impl ItemRun {
    /// The position after the step's real tokens.
    pub(super) fn to(&self) -> usize {
        self.from + self.tokens.len() - self.drafts
    }

    /// Drafts fed with segment `(a, b)`: the item's drafts after its last real token.
    fn drafts_after(&self, b: usize) -> usize {
        if b == self.to() {
            self.drafts
        } else {
            0
        }
    }
}

/// The chunks of wave `wave`: every item that has a segment there.
fn wave_chunks(items: &mut [ItemRun], wave: usize) -> Vec<Chunk<'_>> {
    items
        .iter_mut()
        .filter_map(|it| {
            let &(a, b, replay) = it.segments.get(wave)?;
            let drafts = it.drafts_after(b);
            let tokens = &it.tokens[a - it.from..b + drafts - it.from];
            Some(Chunk { tokens, state: &mut it.state, replay, drafts })
        })
        .collect()
}

/// A step in flight.
pub(super) struct Running {
    pub(super) step: u64,
    attempt: u32,
    reply_to: Addr,
    placement: Placement,
    items: Vec<ItemRun>,
    wave: usize,
    waves: usize,
    /// Captured blocks: (item, block, values), in capture order.
    snaps: Vec<(usize, usize, BlockValues)>,
    pass_id: u64,
    row_keys: Vec<u64>,
    pass: Pass,
    layer: u32,
    round: u32,
    outputs: Option<ExpertOutputs>,
    pending: BTreeMap<u32, Part>,
    /// Rows routed per (layer, expert) this step, for EPLB.
    loads: BTreeMap<(u32, u32), u32>,
}

impl Running {
    /// Parts are pending only while a layer's outputs are being gathered,
    /// and the wave is one the step has.
    pub(super) fn is_consistent(&self) -> bool {
        (self.pending.is_empty() || self.outputs.is_some()) && self.wave < self.waves.max(1)
    }
}

/// What a request's body holds for one item: its restored blocks and its imported state.
struct Inbound {
    blocks: Vec<BlockValues>,
    import: Option<SequenceState>,
    images: Vec<RequestImage>,
}

impl WorkerMachine {
    pub(super) fn compute_step(&mut self, from: Addr, mut req: StepRequest, body: Vec<f32>) {
        let cfg = &self.ctx.config;
        let placement = match Placement::from_wire(&req.placement, cfg.n_routed_experts) {
            Ok(p) if p.devices() == self.instance_devices() => p,
            Ok(p) => {
                let why =
                    format!("placement of {} devices for an instance of {}", p.devices(), self.instance_devices());
                return self.refuse(from, &req, why);
            }
            Err(e) => return self.refuse(from, &req, format!("bad placement: {e}")),
        };
        let seqs = &self.seqs;
        let held = |seq| seqs.get(&seq).map(|s: &SequenceState| s.position);
        let device = Device::Computing { drafts_max: self.drafts_max() };
        let missing = match check_request(&req, cfg, self.ctx.block_tokens, device, held) {
            Ok(missing) => missing,
            Err(why) => return self.refuse(from, &req, why),
        };
        let inbound = match self.parse_body(&req.items, &body) {
            Ok(inbound) => inbound,
            Err(why) => return self.refuse(from, &req, why),
        };
        if !missing.is_empty() {
            return self.needs_history(from, &req, missing);
        }
        let mut items = Vec::with_capacity(req.items.len());
        let allowances: Vec<usize> = req.items.iter().map(|it| it.drafts as usize).collect();
        for (it, mut inbound) in std::mem::take(&mut req.items).into_iter().zip(inbound) {
            let images = std::mem::take(&mut inbound.images);
            let image_rows = match self.image_rows(&images) {
                Ok(rows) => rows,
                Err(why) => return self.refuse(from, &req, format!("sequence {}: {why}", it.seq)),
            };
            let state = match self.starting_state(&it, inbound) {
                Ok(state) => state,
                Err(why) => {
                    let outcome = StepOutcome::Failed(format!("sequence {}: {why}", it.seq));
                    self.reply(from, req.step, req.attempt, outcome, &[]);
                    return;
                }
            };
            let from = it.position as usize;
            let snapshots: Vec<usize> = it.snapshots.iter().map(|&k| k as usize).collect();
            let to = from + it.tokens.len();
            let segments = step_segments(from, to, it.replay_until as usize, &snapshots, self.ctx.block_tokens);
            items.push(ItemRun {
                seq: it.seq,
                from,
                tokens: it.tokens,
                state,
                params: sampling_params(&it.sampling),
                sample: it.sample,
                allowed: it.allowed,
                history: it.history.iter().map(|h| (h.token, h.count)).collect(),
                logits: it.logits,
                segments,
                snapshots,
                row: None,
                hidden: Vec::new(),
                export: it.export,
                drafts: 0,
                images,
                image_rows,
            });
        }
        self.attach_drafts(&mut items, &allowances);
        let waves = items.iter().map(|it| it.segments.len()).max().unwrap_or(0);
        self.ctx.events.record(format_args!(
            "{} step {} attempt {}: {} sequences, {} tokens, {waves} waves",
            self.addr,
            req.step,
            req.attempt,
            items.len(),
            items.iter().map(|it| it.tokens.len()).sum::<usize>()
        ));
        let empty = items.is_empty();
        self.running = Some(Running {
            step: req.step,
            attempt: req.attempt,
            reply_to: from,
            placement,
            items,
            wave: 0,
            waves,
            snaps: Vec::new(),
            pass_id: 0,
            row_keys: Vec::new(),
            pass: self.ctx.model.begin_pass(&[]),
            layer: 0,
            round: 0,
            outputs: None,
            pending: BTreeMap::new(),
            loads: BTreeMap::new(),
        });
        if empty {
            self.finish();
        } else {
            self.begin_wave();
        }
    }

    /// Split the body into each item's restored blocks and imported state, checking every length.
    fn parse_body(&self, items: &[StepItem], body: &[f32]) -> Result<Vec<Inbound>, String> {
        let (model, bt, context) = (&self.ctx.model, self.ctx.block_tokens, self.ctx.config.max_position_embeddings);
        let mut at = 0usize;
        let mut take = |size: usize| {
            let data = body.get(at..at.saturating_add(size)).ok_or_else(|| "the body is too short".to_string());
            at = at.saturating_add(size);
            data
        };
        let mut inbound = Vec::with_capacity(items.len());
        for it in items {
            let mut blocks = Vec::with_capacity(it.restore.len());
            for lens in &it.restore {
                let block = take(parts_len(lens)).and_then(|data| BlockValues::from_parts(model, bt, lens, data));
                blocks.push(block.map_err(|why| format!("sequence {}: restored block: {why}", it.seq))?);
            }
            let import = if it.import.is_empty() {
                None
            } else {
                let state = parts_values(&it.import)
                    .ok_or_else(|| "malformed lengths".to_string())
                    .and_then(&mut take)
                    .and_then(|data| model.state_from_parts(&it.import, data, context))
                    .and_then(|state| match state.position == it.position as usize {
                        true => Ok(state),
                        false => Err(format!("state at {} for position {}", state.position, it.position)),
                    });
                Some(state.map_err(|why| format!("sequence {}: imported state: {why}", it.seq))?)
            };
            let to = (it.position as usize).saturating_add(it.tokens.len());
            let images = step_image_values(model, &it.images)
                .and_then(&mut take)
                .and_then(|values| step_request_images(&it.images, values, it.position as usize..to, context))
                .map_err(|why| format!("sequence {}: images: {why}", it.seq))?;
            inbound.push(Inbound { blocks, import, images });
        }
        if at != body.len() {
            return Err(format!("{} body values, {at} expected", body.len()));
        }
        Ok(inbound)
    }

    /// The state an item's step starts from: imported, restored from
    /// blocks, new at position 0, or the one this worker holds.
    fn starting_state(&mut self, it: &StepItem, inbound: Inbound) -> Result<SequenceState, String> {
        let from = it.position as usize;
        let held = self.seqs.remove(&it.seq);
        if let Some(state) = inbound.import {
            return Ok(state);
        }
        let model = &self.ctx.model;
        if !inbound.blocks.is_empty() {
            let refs: Vec<&BlockValues> = inbound.blocks.iter().collect();
            check_restore(model, &refs, from).map_err(|why| format!("restored blocks: {why}"))?;
            return Ok(restore_state(model, &refs, from));
        }
        if from == 0 {
            if it.rebuild {
                bump(&self.ctx.metrics.sequences_rebuilt);
            }
            return Ok(model.new_state());
        }
        Ok(held.expect("a continued state was checked to be held"))
    }

    /// Start the pass of the current wave.
    fn begin_wave(&mut self) {
        let Some(run) = self.running.as_mut() else { return };
        let wave = run.wave;
        let mut row_keys = Vec::new();
        for it in &run.items {
            if let Some(&(a, b, _)) = it.segments.get(wave) {
                row_keys.extend((a..b + it.drafts_after(b)).map(|p| row_key(it.seq, p as u64)));
            }
        }
        // Each chunk's image span rows, held apart from the items, whose states the chunks borrow.
        let parts = wave_span_parts(&run.items, wave, image_dim(&self.ctx.model));
        let spans = embedded(&parts);
        let chunks = wave_chunks(&mut run.items, wave);
        run.pass = self.ctx.model.begin_pass_spans(&chunks, &spans);
        drop(chunks);
        run.row_keys = row_keys;
        run.outputs = None;
        run.pending.clear();
        self.passes += 1;
        bump(&self.ctx.metrics.passes);
        // The incarnation's bits spread over the high half (it may use all 64 bits).
        let high = self.incarnation.wrapping_mul(0x9e37_79b9_7f4a_7c15) & !0xffff_ffff;
        run.pass_id = high | (self.passes & 0xffff_ffff);
    }

    /// Run attention and routing of the current layer and send its dispatches.
    fn start_layer(&mut self) -> Result<(), Crash> {
        let ctx = std::sync::Arc::clone(&self.ctx);
        let (addr, device, base) = (self.addr, self.device, self.base);
        let Some(run) = self.running.as_mut() else { return Ok(()) };
        let layer = run.pass.layer() as u32;
        if ctx.faults.kill_point(Target::Worker(device), run.step, layer) {
            return Err(Crash(format!("{addr}: injected crash at step {} layer {layer}", run.step)));
        }
        let slow = ctx.faults.slowdown(device);
        if !slow.is_zero() {
            self.effects.push(Effect::Busy(slow));
        }
        let dispatch = {
            let mut chunks = wave_chunks(&mut run.items, run.wave);
            ctx.model.attend(&mut run.pass, &mut chunks).clone()
        };
        let mut by_device: BTreeMap<u32, BTreeMap<u32, Vec<(usize, usize)>>> = BTreeMap::new();
        for (e, pairs) in dispatch.rows_by_expert() {
            *run.loads.entry((layer, e as u32)).or_default() += pairs.len() as u32;
            for pair in pairs {
                let dev = base + run.placement.choose(e as u32, run.row_keys[pair.0]);
                by_device.entry(dev).or_default().entry(e as u32).or_default().push(pair);
            }
        }
        run.layer = layer;
        run.round = 0;
        run.outputs = Some(ExpertOutputs::new(&dispatch, ctx.model.config.experts_per_token));
        run.pending.clear();
        for (part, (dev, experts)) in by_device.into_iter().enumerate() {
            let experts: Vec<(u32, Vec<(usize, usize)>)> = experts.into_iter().collect();
            let mut body = Vec::new();
            let mut rows = Vec::with_capacity(experts.len());
            for (e, pairs) in &experts {
                body.extend(dispatch.gather(pairs));
                // Experts that weigh their rows before the down projection get the weights after the rows.
                if ctx.model.experts_take_weights() {
                    body.extend(dispatch.weights_of(pairs));
                }
                rows.push(ExpertRows { expert: *e, rows: pairs.len() as u32 });
            }
            let h = DispatchHeader {
                pass: run.pass_id,
                step: run.step,
                layer,
                part: part as u32,
                worker: device,
                epoch: run.placement.epoch(),
                experts: rows,
            };
            let out = crate::proto::encode(&ctx.events, addr, Addr::shard(dev), Message::Dispatch(h), &body);
            let frame = out.as_ref().map(|o| o.frame.clone()).unwrap_or_default();
            self.effects.extend(out.map(Effect::Send));
            run.pending.insert(part as u32, Part { device: dev, experts, frame });
        }
        let after = ctx.timeouts.dispatch;
        self.effects.push(Effect::ArmDispatch { pass: run.pass_id, layer, round: 0, after });
        Ok(())
    }

    /// Drive the step as far as it goes without waiting: next layer, next wave, or the end.
    pub(super) fn advance(&mut self) -> Result<(), Crash> {
        loop {
            let Some(run) = self.running.as_mut() else { return Ok(()) };
            if !run.pending.is_empty() {
                return Ok(());
            }
            if let Some(outputs) = run.outputs.take() {
                self.ctx.model.combine(&mut run.pass, &outputs);
                bump(&self.ctx.metrics.layers);
            }
            if !run.pass.is_done() {
                self.start_layer()?;
                continue;
            }
            self.finish_wave();
            let busy = self.attention_time();
            if !busy.is_zero() {
                self.effects.push(Effect::Busy(busy));
            }
            let run = self.running.as_mut().expect("a finished wave's step is still running");
            run.wave += 1;
            if run.wave == run.waves {
                self.finish();
                return Ok(());
            }
            self.begin_wave();
        }
    }

    /// Simulated device time of the current wave's attention and dense layers.
    fn attention_time(&self) -> Duration {
        let (Some(cost), Some(run)) = (&self.ctx.device_cost, &self.running) else { return Duration::ZERO };
        let wave: Vec<SeqWork> = run
            .items
            .iter()
            .filter_map(|it| Some((it, it.segments.get(run.wave)?)))
            .map(|(it, &(a, b, _))| SeqWork { new_tokens: b + it.drafts_after(b) - a, context: a })
            .collect();
        cost.attention_time(&wave)
    }

    /// After the last layer of a wave: keep the logits rows to sample from and
    /// copy the blocks that end here.
    fn finish_wave(&mut self) {
        let drafts_max = self.drafts_max();
        let Some(run) = self.running.as_mut() else { return };
        let (wave, bt) = (run.wave, self.ctx.block_tokens);
        let vocab = self.ctx.config.vocab_size;
        let ends_here = |it: &ItemRun| it.sample && it.segments.len() == wave + 1;
        let tail = run.items.iter().filter(|it| ends_here(it)).map(|it| it.drafts + 1).max();
        let wanted = match tail {
            None => LogitsWanted::None,
            Some(1) => LogitsWanted::Last,
            Some(n) => LogitsWanted::Tail(n),
        };
        // Drafting reads the hidden rows of every item that samples.
        let keep_hidden = drafts_max > 0 && run.items.iter().any(|it| it.sample);
        let pass = std::mem::replace(&mut run.pass, self.ctx.model.begin_pass(&[]));
        let outs = {
            let mut chunks = wave_chunks(&mut run.items, wave);
            self.ctx.model.finish_pass(pass, &mut chunks, wanted, keep_hidden)
        };
        let members = run.items.iter().enumerate().filter(|(_, it)| it.segments.len() > wave).map(|(i, _)| i);
        for (i, out) in members.collect::<Vec<_>>().into_iter().zip(outs) {
            let it = &mut run.items[i];
            let (_, end, _) = it.segments[wave];
            if keep_hidden && it.sample {
                it.hidden.extend_from_slice(&out.streams);
            }
            if it.sample && wave + 1 == it.segments.len() {
                let keep = (it.drafts + 1) * vocab;
                it.row = Some(out.logits[out.logits.len() - keep..].to_vec());
            }
            if end % bt == 0 && it.snapshots.contains(&(end / bt - 1)) {
                assert!(end < it.to() || it.drafts == 0, "no drafts follow a block end");
                let k = end / bt - 1;
                run.snaps.push((i, k, BlockValues::capture(&self.ctx.model, &it.state, k, bt)));
            }
        }
    }

    /// Sample, gather the snapshots and exports, keep the states, answer.
    fn finish(&mut self) {
        let Some(mut run) = self.running.take() else { return };
        self.effects.push(Effect::Disarm);
        let mut outputs = Vec::new();
        let mut body = Vec::new();
        let mut verifications = Vec::new();
        for it in &mut run.items {
            let Some(rows) = it.row.take() else { continue };
            let drafts = it.drafts as u32;
            let accepted = self.verify(it, &rows, &mut outputs, &mut body) as u32;
            if self.drafts_max() > 0 {
                verifications.push(Verification { seq: it.seq, drafts, accepted });
            }
        }
        self.propose(&mut run.items);
        let mut snapshots = Vec::with_capacity(run.snaps.len());
        for (i, k, values) in &run.snaps {
            let (lens, data) = values.to_parts();
            body.extend_from_slice(&data);
            snapshots.push(BlockSnapshot { seq: run.items[*i].seq, block: *k as u32, lens });
        }
        let mut exports = Vec::new();
        let mut export_body = Vec::new();
        for it in run.items.iter().filter(|it| it.export) {
            let (lens, data) = state_to_parts(&it.state);
            export_body.extend_from_slice(&data);
            exports.push(StateExport { seq: it.seq, lens });
        }
        if (body.len() + export_body.len()) * 4 <= MAX_EXPORT_BYTES {
            body.extend_from_slice(&export_body);
        } else {
            self.ctx.events.record(format_args!("{} leaves out {} state exports: too large", self.addr, exports.len()));
            exports.clear();
        }
        let loads = run.loads.iter().map(|(&(layer, expert), &rows)| ExpertLoad { layer, expert, rows }).collect();
        for it in run.items {
            self.seqs.insert(it.seq, it.state);
        }
        self.effects.push(Effect::Record(format!("{} step {} done", self.addr, run.step)));
        let outcome = StepOutcome::Done { outputs, snapshots, loads, exports, verifications };
        let frame = self.reply(run.reply_to, run.step, run.attempt, outcome, &body);
        self.last = frame.map(|f| (self.owner, run.step, f));
    }

    /// Abandon the step in flight; its states are half advanced, so they go.
    pub(super) fn abort(&mut self, why: &str) {
        self.abort_as(why, None);
    }

    /// [`Self::abort`], saying which shard's table is not the step's, if that is why.
    fn abort_as(&mut self, why: &str, mismatched_shard: Option<u32>) {
        if let Some(run) = self.running.take() {
            self.effects.push(Effect::Disarm);
            self.ctx.events.record(format_args!("{} aborts step {}: {why}", self.addr, run.step));
            let why = why.to_string();
            let outcome = match mismatched_shard {
                Some(shard) => StepOutcome::TableMismatch { shard, why },
                None => StepOutcome::Failed(why),
            };
            self.reply(run.reply_to, run.step, run.attempt, outcome, &[]);
        }
    }

    /// Store one part's expert outputs; true when the step may go on.
    pub(super) fn on_expert_result(&mut self, from: Addr, h: ExpertResultHeader, body: Vec<f32>) -> bool {
        let d = self.ctx.model.config.hidden_size;
        let Some(run) = self.running.as_mut() else { return false };
        if h.pass != run.pass_id || h.step != run.step || h.layer != run.layer {
            return false;
        }
        let Some(part) = run.pending.get(&h.part) else { return false };
        if part.device != h.shard {
            return false;
        }
        match &h.status {
            ResultStatus::Ok => {}
            ResultStatus::NotHeld(e) => {
                let why =
                    format!("shard {} does not hold expert {e} (placement epoch {})", h.shard, run.placement.epoch());
                self.abort_as(&why, Some(h.shard));
                return false;
            }
            ResultStatus::Invalid(why) => {
                let why = format!("shard {} refused layer {}: {why}", h.shard, h.layer);
                self.abort(&why);
                return false;
            }
        }
        let want: Vec<ExpertRows> =
            part.experts.iter().map(|(e, p)| ExpertRows { expert: *e, rows: p.len() as u32 }).collect();
        let rows: usize = part.experts.iter().map(|(_, p)| p.len()).sum();
        if h.experts != want || body.len() != rows * d {
            bump(&self.ctx.metrics.frames_rejected);
            self.ctx.events.record(format_args!("{} ignores a malformed result from {from}", self.addr));
            return false;
        }
        let part = run.pending.remove(&h.part).expect("looked up above");
        let outputs = run.outputs.as_mut().expect("outputs exist while parts are pending");
        let mut at = 0;
        for (_, pairs) in &part.experts {
            let n = pairs.len() * d;
            outputs.store(pairs, &body[at..at + n]);
            at += n;
        }
        true
    }

    /// Re-send the dispatches still unanswered, or give the step up after the last round.
    pub(super) fn on_timeout(&mut self, pass: u64, layer: u32, round: u32) {
        let Some(run) = self.running.as_mut() else { return };
        if run.pass_id != pass || run.layer != layer || run.round != round || run.pending.is_empty() {
            return;
        }
        let silent: BTreeSet<u32> = run.pending.values().map(|p| p.device).collect();
        if round + 1 >= self.ctx.timeouts.dispatch_attempts {
            let why = format!("shards {silent:?} did not answer layer {layer} after {} rounds", round + 1);
            self.abort(&why);
            return;
        }
        run.round += 1;
        self.ctx.events.record(format_args!("{} resends layer {layer} to {silent:?} (round {})", self.addr, run.round));
        for p in run.pending.values() {
            bump(&self.ctx.metrics.dispatch_resends);
            self.effects.push(Effect::Send(Outgoing { to: Addr::shard(p.device), frame: p.frame.clone() }));
        }
        let after = self.ctx.timeouts.dispatch;
        self.effects.push(Effect::ArmDispatch { pass, layer, round: run.round, after });
    }
}
