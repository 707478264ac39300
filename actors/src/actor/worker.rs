// tidy: long file: the GPU worker actor, still logic and shell in one; its protocol machine moves to actors/src/proto.
//! GpuWorker: one per device. It is an attention data-parallel rank: it owns
//! the states of its sequences, runs attention and the MoE router, ships each
//! token's MoE input to the shards that hold its experts, combines their
//! outputs, and after the last layer samples.
//!
//! A step is a state machine driven by messages (the actor never blocks on
//! its own mailbox): a step request starts a pass and sends layer 0's
//! dispatches; each layer's last expert result combines and starts the next
//! layer; after the last layer the worker samples and answers. Unanswered
//! dispatches are re-sent on a timer; a late answer to an older pass (or an
//! earlier incarnation) is recognised by its pass id and ignored.
//!
//! A step may take several passes ("waves"), cut exactly where the engine
//! cuts them: at the end of a prefix hit's replay and at every block end
//! whose compressed state the scheduler wants for the prefix cache. A state
//! can start from cached blocks sent with the request instead of position 0.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use deepinfer_engine::cost::SeqWork;
use deepinfer_engine::engine::{check_restore, restore_state, step_segments, BlockValues};
use deepinfer_engine::model::{Chunk, ExpertOutputs, LogitsWanted, Pass, SequenceState};
use deepinfer_engine::sampling::{sample, SamplingParams};
use deepinfer_engine::transfer::{parts_values, state_to_parts};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cluster::ctx::Ctx;
use crate::cluster::placement::{row_key, Placement};
use crate::net::transport::pump;
use crate::net::transport::Delivery;
use crate::proto::cache::parts_len;
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{
    Addr, BlockSnapshot, DispatchHeader, ExpertLoad, ExpertResultHeader, ExpertRows, Heartbeat, Message, ResultStatus,
    SeqOutput, StateExport, StepOutcome, StepRequest, StepResult, TopLogprob,
};

#[path = "worker_modelled.rs"]
mod modelled;

pub use crate::limits::MAX_EXPORT_BYTES;

pub struct GpuWorker;

pub struct WorkerArgs {
    pub device: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum WorkerMsg {
    Net(Delivery),
    /// Dispatch timer of (pass, layer, round).
    Timeout {
        pass: u64,
        layer: u32,
        round: u32,
    },
}

/// Rows of one dispatch part: experts (ascending) and their `(row, slot)` pairs.
struct Part {
    device: u32,
    experts: Vec<(u32, Vec<(usize, usize)>)>,
    frame: Vec<u8>,
}

/// One sequence's share of a step.
struct ItemRun {
    seq: u64,
    /// Position of the first of `tokens`.
    from: usize,
    tokens: Vec<u32>,
    state: SequenceState,
    params: SamplingParams,
    sample: bool,
    logits: bool,
    /// `(start, end, replay)` per wave, absolute positions.
    segments: Vec<(usize, usize, bool)>,
    snapshots: Vec<usize>,
    row: Option<Vec<f32>>,
    export: bool,
}

/// The chunks of wave `wave`: every item that has a segment there.
fn wave_chunks(items: &mut [ItemRun], wave: usize) -> Vec<Chunk<'_>> {
    items
        .iter_mut()
        .filter_map(|it| {
            let &(a, b, replay) = it.segments.get(wave)?;
            Some(Chunk { tokens: &it.tokens[a - it.from..b - it.from], state: &mut it.state, replay, drafts: 0 })
        })
        .collect()
}

/// A step in flight.
struct Running {
    step: u64,
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
    timer: Option<JoinHandle<()>>,
    /// Rows routed per (layer, expert) this step, for EPLB.
    loads: BTreeMap<(u32, u32), u32>,
}

pub struct WorkerState {
    device: u32,
    addr: Addr,
    /// Global number of this instance's first device (placements are instance-local).
    base: u32,
    scheduler: Addr,
    /// Cluster-unique: pass ids built on it never collide with an earlier incarnation's.
    instance: u64,
    passes: u64,
    /// Instance number of the scheduler whose sequences the states are.
    owner: u64,
    seqs: BTreeMap<u64, SequenceState>,
    running: Option<Running>,
    /// The answer to the last completed step, re-sent to a duplicate request.
    last: Option<(u64, u64, Vec<u8>)>,
    /// Modelled devices: each sequence's position, and the step being "computed".
    positions: BTreeMap<u64, usize>,
    modelled_run: Option<modelled::ModelledRun>,
    ctx: Arc<Ctx>,
}

use crate::proto::sampling_params as params;

impl WorkerState {
    /// Devices of this worker's instance.
    fn instance_devices(&self) -> u32 {
        let topo = &self.ctx.topology;
        topo.size_of(topo.instance_of(self.device))
    }

    fn reply(&self, to: Addr, step: u64, attempt: u32, outcome: StepOutcome, body: &[f32]) -> Option<Vec<u8>> {
        let r = StepResult { step, attempt, device: self.device, outcome };
        self.ctx.send(self.addr, to, Message::StepResult(r), body)
    }

    /// Abandon the step in flight; its states are half advanced, so they go.
    fn abort(&mut self, why: &str) {
        if let Some(run) = self.running.take() {
            if let Some(t) = run.timer {
                t.abort();
            }
            self.ctx.events.record(format_args!("{} aborts step {}: {why}", self.addr, run.step));
            self.reply(run.reply_to, run.step, run.attempt, StepOutcome::Failed(why.to_string()), &[]);
        }
    }

    fn on_step_request(&mut self, from: Addr, req: StepRequest, body: Vec<f32>) {
        if req.scheduler < self.owner {
            return;
        }
        if req.scheduler > self.owner {
            // A new scheduler incarnation starts every sequence over.
            if self.owner != 0 {
                self.ctx.events.record(format_args!("{} drops the states of an earlier scheduler", self.addr));
            }
            self.abort("the scheduler restarted");
            self.seqs.clear();
            self.positions.clear();
            self.modelled_run = None;
            self.last = None;
            self.owner = req.scheduler;
        }
        if let Some(run) = &self.running {
            if run.step >= req.step {
                return;
            }
            self.abort("superseded by a newer step");
        }
        if let Some(run) = &self.modelled_run {
            if run.step >= req.step && run.pending() {
                return;
            }
        }
        if let Some((owner, step, frame)) = &self.last {
            if *owner == req.scheduler && *step == req.step {
                self.ctx.send_frame(self.addr, from, frame.clone());
                return;
            }
            if *owner == req.scheduler && *step > req.step {
                return;
            }
        }
        for seq in &req.release {
            self.seqs.remove(seq);
            self.positions.remove(seq);
        }
        if let Some(m) = self.ctx.modelled.clone() {
            return self.modelled_step(from, req, &m);
        }
        let fail = |me: &Self, why: String| {
            me.reply(from, req.step, req.attempt, StepOutcome::Failed(why), &[]);
        };
        let cfg = &self.ctx.config;
        let bt = self.ctx.block_tokens;
        let placement = match Placement::from_wire(&req.placement, cfg.n_routed_experts) {
            Ok(p) if p.devices() == self.instance_devices() => p,
            Ok(p) => {
                return fail(
                    self,
                    format!("placement of {} devices for an instance of {}", p.devices(), self.instance_devices()),
                )
            }
            Err(e) => return fail(self, format!("bad placement: {e}")),
        };
        let mut seen = BTreeSet::new();
        let mut missing = Vec::new();
        let mut restored: Vec<Vec<BlockValues>> = Vec::with_capacity(req.items.len());
        let mut imported: Vec<Option<SequenceState>> = Vec::with_capacity(req.items.len());
        let mut at = 0usize;
        for it in &req.items {
            let (position, len) = (it.position as usize, it.tokens.len());
            let end = position.saturating_add(len);
            let replay = it.replay_until as usize;
            let n = it.restore.len();
            let snaps_ok = it.snapshots.windows(2).all(|w| w[0] < w[1])
                && it.snapshots.iter().all(|&k| {
                    let b = (k as usize + 1) * bt;
                    b > position.max(replay) && b <= end
                });
            let bad = if it.tokens.is_empty() {
                Some("no tokens".to_string())
            } else if !seen.insert(it.seq) {
                Some("listed twice".to_string())
            } else if it.rebuild && (position != 0 || n != 0 || replay != 0) {
                Some("a rebuild starts at position 0 from nothing".to_string())
            } else if end > cfg.max_position_embeddings {
                Some("exceeds the context".to_string())
            } else if n > 0 && (replay != n * bt || position > replay) {
                Some(format!("restores {n} blocks but replays to {replay} from {position}"))
            } else if n == 0 && position == 0 && replay != 0 {
                Some("replay without a restored state".to_string())
            } else if !it.import.is_empty() && (it.rebuild || n != 0 || replay != 0 || position == 0) {
                Some("an imported state starts past 0, alone".to_string())
            } else if !snaps_ok {
                Some(format!("snapshots {:?} outside ({position}, {end}]", it.snapshots))
            } else {
                params(&it.sampling).validate(cfg.vocab_size).err().map(|e| e.to_string())
            };
            if let Some(why) = bad {
                return fail(self, format!("sequence {}: {why}", it.seq));
            }
            let mut blocks = Vec::with_capacity(n);
            for lens in &it.restore {
                let size = parts_len(lens);
                let parsed = body
                    .get(at..at.saturating_add(size))
                    .ok_or_else(|| "the body is too short".to_string())
                    .and_then(|data| BlockValues::from_parts(&self.ctx.model, bt, lens, data));
                match parsed {
                    Ok(b) => blocks.push(b),
                    Err(why) => return fail(self, format!("sequence {}: restored block: {why}", it.seq)),
                }
                at += size;
            }
            restored.push(blocks);
            if it.import.is_empty() {
                imported.push(None);
            } else {
                let size = parts_values(&it.import).ok_or_else(|| "malformed lengths".to_string());
                let parsed = size.and_then(|size| {
                    let data =
                        body.get(at..at.saturating_add(size)).ok_or_else(|| "the body is too short".to_string())?;
                    at += size;
                    let state = self.ctx.model.state_from_parts(&it.import, data, cfg.max_position_embeddings)?;
                    if state.position != position {
                        return Err(format!("state at {} for position {position}", state.position));
                    }
                    Ok(state)
                });
                match parsed {
                    Ok(state) => imported.push(Some(state)),
                    Err(why) => return fail(self, format!("sequence {}: imported state: {why}", it.seq)),
                }
            }
            // Position 0, a restore or an import is a new state; later positions need the state they continue.
            let new = n > 0 || !it.import.is_empty();
            if position > 0 && !new && self.seqs.get(&it.seq).is_none_or(|s| s.position != position) {
                missing.push(it.seq);
            }
        }
        if at != body.len() {
            return fail(self, format!("{} body values, {at} expected", body.len()));
        }
        if !missing.is_empty() {
            self.ctx.events.record(format_args!("{} needs history of {missing:?} for step {}", self.addr, req.step));
            self.reply(from, req.step, req.attempt, StepOutcome::NeedsHistory(missing), &[]);
            return;
        }

        let mut items = Vec::with_capacity(req.items.len());
        for ((it, blocks), import) in req.items.into_iter().zip(restored).zip(imported) {
            let from = it.position as usize;
            let state = if let Some(state) = import {
                self.seqs.remove(&it.seq);
                state
            } else if !blocks.is_empty() {
                self.seqs.remove(&it.seq);
                let refs: Vec<&BlockValues> = blocks.iter().collect();
                if let Err(why) = check_restore(&self.ctx.model, &refs, from) {
                    return fail(self, format!("sequence {}: restored blocks: {why}", it.seq));
                }
                restore_state(&self.ctx.model, &refs, from)
            } else if from == 0 {
                if it.rebuild {
                    bump(&self.ctx.metrics.sequences_rebuilt);
                }
                self.seqs.remove(&it.seq);
                self.ctx.model.new_state()
            } else {
                self.seqs.remove(&it.seq).expect("checked above")
            };
            let snapshots: Vec<usize> = it.snapshots.iter().map(|&k| k as usize).collect();
            let to = from + it.tokens.len();
            let segments = step_segments(from, to, it.replay_until as usize, &snapshots, bt);
            items.push(ItemRun {
                seq: it.seq,
                from,
                tokens: it.tokens,
                state,
                params: params(&it.sampling),
                sample: it.sample,
                logits: it.logits,
                segments,
                snapshots,
                row: None,
                export: it.export,
            });
        }
        let waves = items.iter().map(|it| it.segments.len()).max().unwrap_or(0);
        self.ctx.events.record(format_args!(
            "{} step {} attempt {}: {} sequences, {} tokens, {waves} waves",
            self.addr,
            req.step,
            req.attempt,
            items.len(),
            items.iter().map(|it| it.tokens.len()).sum::<usize>()
        ));
        let pass = self.ctx.model.begin_pass(&[]);
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
            pass,
            layer: 0,
            round: 0,
            outputs: None,
            pending: BTreeMap::new(),
            timer: None,
            loads: BTreeMap::new(),
        });
        if empty {
            self.finish();
        } else {
            self.begin_wave();
        }
    }

    /// Start the pass of the current wave.
    fn begin_wave(&mut self) {
        let Some(run) = self.running.as_mut() else { return };
        let wave = run.wave;
        let mut row_keys = Vec::new();
        for it in &run.items {
            if let Some(&(a, b, _)) = it.segments.get(wave) {
                row_keys.extend((a..b).map(|p| row_key(it.seq, p as u64)));
            }
        }
        let chunks = wave_chunks(&mut run.items, wave);
        run.pass = self.ctx.model.begin_pass(&chunks);
        drop(chunks);
        run.row_keys = row_keys;
        run.outputs = None;
        run.pending.clear();
        self.passes += 1;
        bump(&self.ctx.metrics.passes);
        run.pass_id = (self.instance << 32) | self.passes;
    }

    /// Run attention and routing of the current layer and send its dispatches.
    async fn start_layer(&mut self, me: &ActorRef<WorkerMsg>) -> Result<(), ActorProcessingErr> {
        let ctx = Arc::clone(&self.ctx);
        let (addr, device, base) = (self.addr, self.device, self.base);
        let Some(run) = self.running.as_mut() else { return Ok(()) };
        let layer = run.pass.layer() as u32;
        if ctx.faults.kill_point(Target::Worker(device), run.step, layer) {
            return Err(format!("{addr}: injected crash at step {} layer {layer}", run.step).into());
        }
        let slow = ctx.faults.slowdown(device);
        if !slow.is_zero() {
            ctx.clock.sleep(slow).await;
        }
        let dispatch = {
            let mut chunks = wave_chunks(&mut run.items, run.wave);
            ctx.model.attend(&mut run.pass, &mut chunks).clone()
        };
        let mut by_device: BTreeMap<u32, BTreeMap<u32, Vec<(usize, usize)>>> = BTreeMap::new();
        for e in dispatch.experts_hit() {
            *run.loads.entry((layer, e as u32)).or_default() += dispatch.rows_for(e).len() as u32;
            for pair in dispatch.rows_for(e) {
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
            let frame = ctx.send(addr, Addr::shard(dev), Message::Dispatch(h), &body).unwrap_or_default();
            run.pending.insert(part as u32, Part { device: dev, experts, frame });
        }
        Self::arm(&ctx, run, me);
        Ok(())
    }

    fn arm(ctx: &Arc<Ctx>, run: &mut Running, me: &ActorRef<WorkerMsg>) {
        if let Some(t) = run.timer.take() {
            t.abort();
        }
        let (clock, me, wait) = (Arc::clone(&ctx.clock), me.clone(), ctx.timeouts.dispatch);
        let (pass, layer, round) = (run.pass_id, run.layer, run.round);
        run.timer = Some(tokio::spawn(async move {
            clock.sleep(wait).await;
            let _ = me.send_message(WorkerMsg::Timeout { pass, layer, round });
        }));
    }

    /// Drive the step as far as it goes without waiting: next layer, next wave, or the end.
    async fn advance(&mut self, me: &ActorRef<WorkerMsg>) -> Result<(), ActorProcessingErr> {
        loop {
            let Some(run) = self.running.as_mut() else { return Ok(()) };
            if !run.pending.is_empty() {
                return Ok(());
            }
            if let Some(outputs) = run.outputs.take() {
                self.ctx.model.combine(&mut run.pass, &outputs);
                bump(&self.ctx.metrics.layers);
            }
            if run.pass.is_done() {
                self.finish_wave();
                let Some(run) = self.running.as_mut() else { return Ok(()) };
                // Simulated device time of the wave's attention and dense layers.
                if let Some(cost) = &self.ctx.device_cost {
                    let wave: Vec<SeqWork> = run
                        .items
                        .iter()
                        .filter_map(|it| it.segments.get(run.wave))
                        .map(|&(a, b, _)| SeqWork { new_tokens: b - a, context: a })
                        .collect();
                    let busy = cost.attention_time(&wave);
                    if !busy.is_zero() {
                        self.ctx.clock.sleep(busy).await;
                    }
                }
                run.wave += 1;
                if run.wave == run.waves {
                    self.finish();
                    return Ok(());
                }
                self.begin_wave();
                continue;
            }
            self.start_layer(me).await?;
        }
    }

    /// After the last layer of a wave: keep the logits rows to sample from and
    /// copy the blocks that end here.
    fn finish_wave(&mut self) {
        let Some(run) = self.running.as_mut() else { return };
        let (wave, bt) = (run.wave, self.ctx.block_tokens);
        let wants = run.items.iter().any(|it| it.sample && it.segments.len() == wave + 1);
        let wanted = if wants { LogitsWanted::Last } else { LogitsWanted::None };
        let pass = std::mem::replace(&mut run.pass, self.ctx.model.begin_pass(&[]));
        let outs = {
            let mut chunks = wave_chunks(&mut run.items, wave);
            self.ctx.model.finish_pass(pass, &mut chunks, wanted, false)
        };
        let members = run.items.iter().enumerate().filter(|(_, it)| it.segments.len() > wave).map(|(i, _)| i);
        for (i, out) in members.collect::<Vec<_>>().into_iter().zip(outs) {
            let it = &mut run.items[i];
            let (_, end, _) = it.segments[wave];
            if it.sample && wave + 1 == it.segments.len() {
                it.row = Some(out.logits);
            }
            if end % bt == 0 && it.snapshots.contains(&(end / bt - 1)) {
                let k = end / bt - 1;
                run.snaps.push((i, k, BlockValues::capture(&self.ctx.model, &it.state, k, bt)));
            }
        }
    }

    fn finish(&mut self) {
        let Some(mut run) = self.running.take() else { return };
        if let Some(t) = run.timer.take() {
            t.abort();
        }
        let mut outputs = Vec::new();
        let mut body = Vec::new();
        for it in &mut run.items {
            let Some(row) = it.row.take() else { continue };
            let position = it.state.position as u64;
            let s = sample(&row, &it.params, position);
            let top = s.top.iter().map(|&(token, logprob)| TopLogprob { token, logprob }).collect();
            outputs.push(SeqOutput { seq: it.seq, token: s.token, logprob: s.logprob, position, top });
            if it.logits {
                body.extend_from_slice(&row);
            }
        }
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
        self.ctx.events.record(format_args!("{} step {} done", self.addr, run.step));
        let frame = self.reply(
            run.reply_to,
            run.step,
            run.attempt,
            StepOutcome::Done { outputs, snapshots, loads, exports, verifications: Vec::new() },
            &body,
        );
        self.last = frame.map(|f| (self.owner, run.step, f));
    }

    async fn on_expert_result(
        &mut self,
        from: Addr,
        h: ExpertResultHeader,
        body: Vec<f32>,
        me: &ActorRef<WorkerMsg>,
    ) -> Result<(), ActorProcessingErr> {
        let d = self.ctx.model.config.hidden_size;
        let Some(run) = self.running.as_mut() else { return Ok(()) };
        if h.pass != run.pass_id || h.step != run.step || h.layer != run.layer {
            return Ok(());
        }
        let Some(part) = run.pending.get(&h.part) else { return Ok(()) };
        if part.device != h.shard {
            return Ok(());
        }
        match &h.status {
            ResultStatus::Ok => {}
            ResultStatus::NotHeld(e) => {
                let why =
                    format!("shard {} does not hold expert {e} (placement epoch {})", h.shard, run.placement.epoch());
                self.abort(&why);
                return Ok(());
            }
            ResultStatus::Invalid(why) => {
                let why = format!("shard {} refused layer {}: {why}", h.shard, h.layer);
                self.abort(&why);
                return Ok(());
            }
        }
        let want: Vec<ExpertRows> =
            part.experts.iter().map(|(e, p)| ExpertRows { expert: *e, rows: p.len() as u32 }).collect();
        let rows: usize = part.experts.iter().map(|(_, p)| p.len()).sum();
        if h.experts != want || body.len() != rows * d {
            bump(&self.ctx.metrics.frames_rejected);
            self.ctx.events.record(format_args!("{} ignores a malformed result from {from}", self.addr));
            return Ok(());
        }
        let part = run.pending.remove(&h.part).expect("looked up above");
        let outputs = run.outputs.as_mut().expect("outputs exist while parts are pending");
        let mut at = 0;
        for (_, pairs) in &part.experts {
            let n = pairs.len() * d;
            outputs.store(pairs, &body[at..at + n]);
            at += n;
        }
        self.advance(me).await
    }

    fn on_timeout(&mut self, pass: u64, layer: u32, round: u32, me: &ActorRef<WorkerMsg>) {
        let ctx = Arc::clone(&self.ctx);
        let Some(run) = self.running.as_mut() else { return };
        if run.pass_id != pass || run.layer != layer || run.round != round || run.pending.is_empty() {
            return;
        }
        let silent: BTreeSet<u32> = run.pending.values().map(|p| p.device).collect();
        if round + 1 >= ctx.timeouts.dispatch_attempts {
            let why = format!("shards {silent:?} did not answer layer {layer} after {} rounds", round + 1);
            self.abort(&why);
            return;
        }
        run.round += 1;
        ctx.events.record(format_args!("{} resends layer {layer} to {silent:?} (round {})", self.addr, run.round));
        for p in run.pending.values() {
            bump(&ctx.metrics.dispatch_resends);
            ctx.send_frame(self.addr, Addr::shard(p.device), p.frame.clone());
        }
        Self::arm(&ctx, run, me);
    }
}

impl Actor for GpuWorker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<WorkerMsg>,
        args: WorkerArgs,
    ) -> Result<WorkerState, ActorProcessingErr> {
        let addr = Addr::worker(args.device);
        let topo = &args.ctx.topology;
        let serving = topo.instance_of(args.device);
        let scheduler = Addr::scheduler(serving);
        let instance = args.ctx.new_incarnation();
        args.ctx.events.record(format_args!("{addr} up (incarnation {}, instance {instance})", args.incarnation));
        pump(args.ctx.transport.bind(addr), myself, WorkerMsg::Net);
        // Tell the scheduler a (new) incarnation is up, so a step this worker
        // lost is re-sent now rather than at its timeout.
        let hello = Heartbeat {
            incarnation: instance,
            restarted: args.ctx.is_up(),
            time_ns: args.ctx.clock.now().as_nanos() as u64,
        };
        args.ctx.send(addr, scheduler, Message::Heartbeat(hello), &[]);
        Ok(WorkerState {
            device: args.device,
            addr,
            base: topo.devices_of(serving).start,
            scheduler,
            instance,
            passes: 0,
            owner: 0,
            seqs: BTreeMap::new(),
            running: None,
            last: None,
            positions: BTreeMap::new(),
            modelled_run: None,
            ctx: args.ctx,
        })
    }

    async fn post_stop(&self, _me: ActorRef<WorkerMsg>, state: &mut WorkerState) -> Result<(), ActorProcessingErr> {
        // A crashed device answers nothing: its pending modelled reply dies with it.
        state.modelled_run = None;
        if let Some(run) = state.running.take() {
            if let Some(t) = run.timer {
                t.abort();
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<WorkerMsg>,
        msg: WorkerMsg,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WorkerMsg::Net(d) => {
                let Some(m) = state.ctx.open(state.addr, &d) else { return Ok(()) };
                let from = m.envelope.from;
                match m.envelope.msg {
                    Message::StepRequest(req) if from == state.scheduler => {
                        state.on_step_request(from, req, m.body);
                        state.advance(&me).await
                    }
                    Message::ExpertResult(h) => state.on_expert_result(from, h, m.body, &me).await,
                    other => {
                        bump(&state.ctx.metrics.frames_rejected);
                        state.ctx.events.record(format_args!("{} ignores {:?} from {from}", state.addr, other.kind()));
                        Ok(())
                    }
                }
            }
            WorkerMsg::Timeout { pass, layer, round } => {
                state.on_timeout(pass, layer, round, &me);
                Ok(())
            }
        }
    }
}
