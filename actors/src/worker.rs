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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use deepinfer_engine::model::{Chunk, ExpertOutputs, LogitsWanted, Pass, SequenceState};
use deepinfer_engine::sampling::{sample, SamplingParams};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::ctx::{pump, Ctx};
use crate::events::bump;
use crate::faults::Target;
use crate::placement::{row_key, Placement};
use crate::transport::Delivery;
use crate::wire::{
    Addr, DispatchHeader, ExpertResultHeader, ExpertRows, Heartbeat, Message, ResultStatus, SeqOutput, StepOutcome,
    StepRequest, StepResult,
};

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

/// A forward pass in flight.
struct Running {
    step: u64,
    attempt: u32,
    reply_to: Addr,
    pass_id: u64,
    placement: Placement,
    seqs: Vec<u64>,
    tokens: Vec<Vec<u32>>,
    states: Vec<SequenceState>,
    params: Vec<SamplingParams>,
    row_keys: Vec<u64>,
    return_logits: bool,
    pass: Pass,
    layer: u32,
    round: u32,
    outputs: Option<ExpertOutputs>,
    pending: BTreeMap<u32, Part>,
    timer: Option<JoinHandle<()>>,
}

pub struct WorkerState {
    device: u32,
    addr: Addr,
    /// Cluster-unique: pass ids built on it never collide with an earlier incarnation's.
    instance: u64,
    passes: u64,
    seqs: BTreeMap<u64, SequenceState>,
    running: Option<Running>,
    /// The answer to the last completed step, re-sent to a duplicate request.
    last: Option<(u64, Vec<u8>)>,
    ctx: Arc<Ctx>,
}

fn params(s: &crate::wire::Sampling) -> SamplingParams {
    SamplingParams { temperature: s.temperature, top_p: s.top_p, top_k: s.top_k as usize, seed: s.seed, logprobs: 0 }
}

impl WorkerState {
    fn reply(&self, to: Addr, step: u64, attempt: u32, outcome: StepOutcome, body: &[f32]) -> Option<Vec<u8>> {
        let r = StepResult { step, attempt, device: self.device, outcome };
        self.ctx.send(self.addr, to, Message::StepResult(r), body)
    }

    /// Abandon the pass in flight; its states are half advanced, so they go.
    fn abort(&mut self, why: &str) {
        if let Some(run) = self.running.take() {
            if let Some(t) = run.timer {
                t.abort();
            }
            self.ctx.events.record(format_args!("{} aborts step {}: {why}", self.addr, run.step));
            self.reply(run.reply_to, run.step, run.attempt, StepOutcome::Failed(why.to_string()), &[]);
        }
    }

    fn on_step_request(&mut self, from: Addr, req: StepRequest) {
        if let Some(run) = &self.running {
            if run.step == req.step {
                return;
            }
            if run.step > req.step {
                return;
            }
            self.abort("superseded by a newer step");
        }
        if let Some((step, frame)) = &self.last {
            if *step == req.step {
                self.ctx.send_frame(self.addr, from, frame.clone());
                return;
            }
            if *step > req.step {
                return;
            }
        }
        for seq in &req.release {
            self.seqs.remove(seq);
        }
        let cfg = &self.ctx.model.config;
        let placement = match Placement::from_wire(&req.placement, cfg.n_routed_experts) {
            Ok(p) => p,
            Err(e) => {
                self.reply(from, req.step, req.attempt, StepOutcome::Failed(format!("bad placement: {e}")), &[]);
                return;
            }
        };
        let mut seen = BTreeSet::new();
        let mut missing = Vec::new();
        for it in &req.items {
            let bad = if it.tokens.is_empty() {
                Some("no tokens".to_string())
            } else if !seen.insert(it.seq) {
                Some("listed twice".to_string())
            } else if it.rebuild && it.position != 0 {
                Some("rebuild must start at position 0".to_string())
            } else if it.position as usize + it.tokens.len() > cfg.max_position_embeddings {
                Some("exceeds the context".to_string())
            } else {
                params(&it.sampling).validate(cfg.vocab_size).err().map(|e| e.to_string())
            };
            if let Some(why) = bad {
                let why = format!("sequence {}: {why}", it.seq);
                self.reply(from, req.step, req.attempt, StepOutcome::Failed(why), &[]);
                return;
            }
            // Position 0 is a new sequence; later positions need the state they continue.
            if it.position > 0 && self.seqs.get(&it.seq).is_none_or(|s| s.position as u64 != it.position) {
                missing.push(it.seq);
            }
        }
        if !missing.is_empty() {
            self.ctx.events.record(format_args!("{} needs history of {missing:?} for step {}", self.addr, req.step));
            self.reply(from, req.step, req.attempt, StepOutcome::NeedsHistory(missing), &[]);
            return;
        }

        let n = req.items.len();
        let (mut seqs, mut tokens, mut states, mut ps, mut row_keys) =
            (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n), Vec::new());
        for it in req.items {
            let state = if it.position == 0 {
                self.seqs.remove(&it.seq);
                if it.rebuild {
                    bump(&self.ctx.metrics.sequences_rebuilt);
                }
                self.ctx.model.new_state()
            } else {
                self.seqs.remove(&it.seq).expect("checked above")
            };
            row_keys.extend((0..it.tokens.len() as u64).map(|j| row_key(it.seq, state.position as u64 + j)));
            seqs.push(it.seq);
            tokens.push(it.tokens);
            states.push(state);
            ps.push(params(&it.sampling));
        }
        let pass = {
            let chunks: Vec<Chunk> = states.iter_mut().zip(&tokens).map(|(s, t)| Chunk::new(t, s)).collect();
            self.ctx.model.begin_pass(&chunks)
        };
        self.passes += 1;
        bump(&self.ctx.metrics.passes);
        let pass_id = (self.instance << 32) | self.passes;
        self.ctx.events.record(format_args!(
            "{} step {} attempt {} pass {pass_id:#x}: {n} sequences, {} rows",
            self.addr,
            req.step,
            req.attempt,
            row_keys.len()
        ));
        self.running = Some(Running {
            step: req.step,
            attempt: req.attempt,
            reply_to: from,
            pass_id,
            placement,
            seqs,
            tokens,
            states,
            params: ps,
            row_keys,
            return_logits: req.return_logits,
            pass,
            layer: 0,
            round: 0,
            outputs: None,
            pending: BTreeMap::new(),
            timer: None,
        });
    }

    /// Run attention and routing of the current layer and send its dispatches.
    async fn start_layer(&mut self, me: &ActorRef<WorkerMsg>) -> Result<(), ActorProcessingErr> {
        let ctx = Arc::clone(&self.ctx);
        let addr = self.addr;
        let device = self.device;
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
            let mut chunks: Vec<Chunk> =
                run.states.iter_mut().zip(&run.tokens).map(|(s, t)| Chunk::new(t, s)).collect();
            ctx.model.attend(&mut run.pass, &mut chunks).clone()
        };
        let mut by_device: BTreeMap<u32, BTreeMap<u32, Vec<(usize, usize)>>> = BTreeMap::new();
        for e in dispatch.experts_hit() {
            for pair in dispatch.rows_for(e) {
                let dev = run.placement.choose(e as u32, run.row_keys[pair.0]);
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

    /// Drive the pass as far as it goes without waiting: next layer, or the end.
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
                self.finish();
                return Ok(());
            }
            self.start_layer(me).await?;
        }
    }

    fn finish(&mut self) {
        let Some(mut run) = self.running.take() else { return };
        if let Some(t) = run.timer.take() {
            t.abort();
        }
        let vocab = self.ctx.model.config.vocab_size;
        let outs = {
            let mut chunks: Vec<Chunk> =
                run.states.iter_mut().zip(&run.tokens).map(|(s, t)| Chunk::new(t, s)).collect();
            self.ctx.model.finish_pass(run.pass, &mut chunks, LogitsWanted::Last, false)
        };
        let mut sampled = Vec::with_capacity(outs.len());
        let mut body = Vec::new();
        for (i, out) in outs.iter().enumerate() {
            let position = run.states[i].position as u64;
            let s = sample(&out.logits, &run.params[i], position);
            sampled.push(SeqOutput { seq: run.seqs[i], token: s.token, logprob: s.logprob, position });
            if run.return_logits {
                debug_assert_eq!(out.logits.len(), vocab);
                body.extend_from_slice(&out.logits);
            }
        }
        for (seq, state) in run.seqs.iter().zip(run.states) {
            self.seqs.insert(*seq, state);
        }
        self.ctx.events.record(format_args!("{} step {} done", self.addr, run.step));
        let frame = self.reply(run.reply_to, run.step, run.attempt, StepOutcome::Done(sampled), &body);
        self.last = frame.map(|f| (run.step, f));
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
        let instance = args.ctx.new_instance();
        args.ctx.events.record(format_args!("{addr} up (incarnation {}, instance {instance})", args.incarnation));
        pump(args.ctx.transport.bind(addr), myself, WorkerMsg::Net);
        // Tell the scheduler a (new) incarnation is up, so a step this worker
        // lost is re-sent now rather than at its timeout.
        let hello =
            Heartbeat { instance, restarted: args.ctx.is_up(), time_ns: args.ctx.clock.now().as_nanos() as u64 };
        args.ctx.send(addr, Addr::scheduler(0), Message::Heartbeat(hello), &[]);
        Ok(WorkerState {
            device: args.device,
            addr,
            instance,
            passes: 0,
            seqs: BTreeMap::new(),
            running: None,
            last: None,
            ctx: args.ctx,
        })
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
                    Message::StepRequest(req) => {
                        state.on_step_request(from, req);
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
