//! The GPU worker's protocol machine, sans-IO (its shell is
//! `crate::actor::worker`): one per device, an attention data-parallel
//! rank. It owns the states of its sequences, runs attention and the MoE
//! router, ships each token's MoE input to the shards that hold its
//! experts, combines their outputs, and after the last layer samples.
//!
//! A step is driven by messages (nothing waits on its own mailbox): a step
//! request starts a pass and sends layer 0's dispatches; each layer's last
//! expert result combines and starts the next layer; after the last layer
//! the worker samples and answers. Unanswered dispatches are re-sent when
//! the dispatch timer runs out; a late answer to an older pass (or an
//! earlier incarnation) is recognised by its pass id and ignored.
//!
//! A step may take several passes ("waves"), cut exactly where the engine
//! cuts them: at the end of a prefix hit's replay and at every block end
//! whose compressed state the scheduler wants for the prefix cache. A state
//! can start from cached blocks sent with the request instead of position 0.
//! On modelled devices the worker prices the step instead (`modelled.rs`);
//! both check a request by the one rule of `validate.rs`.

mod compute;
mod drafting;
mod images;
mod modelled;
mod validate;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::model::SequenceState;
use deepinfer_engine::speculative::Proposal;

use super::{Crash, Outgoing};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::wire::{Addr, Heartbeat, Message, StepOutcome, StepRequest, StepResult};

/// What the shell feeds the worker.
#[derive(Debug)]
pub enum Input {
    Net(Delivery),
    /// The dispatch timer of (pass, layer, round) ran out.
    Timeout {
        pass: u64,
        layer: u32,
        round: u32,
    },
}

/// What the worker asks its shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum Effect {
    /// The device is busy this long (an injected slowdown, or the modelled
    /// time of attention) before what follows.
    Busy(Duration),
    Send(Outgoing),
    /// Feed back `Input::Timeout` after `after`, replacing the armed timer.
    ArmDispatch {
        pass: u64,
        layer: u32,
        round: u32,
        after: Duration,
    },
    /// The step in flight ended: its dispatch timer goes.
    Disarm,
    /// Send this after `after` (a modelled step's answer, once its device
    /// time has passed), replacing any such answer not sent yet.
    SendLater {
        after: Duration,
        out: Outgoing,
    },
    /// The answer `SendLater` holds is void (its scheduler is gone).
    CancelLater,
    /// Log this line now: after the busy time before it, so that the log's
    /// times are the device's.
    Record(String),
}

pub struct WorkerMachine {
    device: u32,
    addr: Addr,
    /// Global number of this instance's first device (placements are instance-local).
    base: u32,
    scheduler: Addr,
    /// Cluster-unique: pass ids built on it never collide with an earlier incarnation's.
    incarnation: u64,
    passes: u64,
    /// Incarnation number of the scheduler whose sequences the states are.
    owner: u64,
    seqs: BTreeMap<u64, SequenceState>,
    /// Drafts proposed for each sequence's next step (speculative decoding).
    proposals: BTreeMap<u64, Proposal>,
    running: Option<compute::Running>,
    /// The answer to the last completed step, re-sent to a duplicate request.
    last: Option<(u64, u64, Vec<u8>)>,
    /// Modelled devices: each sequence's position.
    positions: BTreeMap<u64, usize>,
    /// Modelled devices: the step whose answer is due, and when.
    modelled_due: Option<(u64, Duration)>,
    /// The time of the input being handled.
    now: Duration,
    effects: Vec<Effect>,
    /// Span rows this worker encoded, by image hash: a span fed over several
    /// chunks (or a repeated image) runs the tower once.
    image_cache: deepinfer_engine::encoder_cache::EncoderCache<Arc<[f32]>>,
    ctx: Arc<Ctx>,
}

impl WorkerMachine {
    /// A (re)started worker of `device`. It greets its scheduler at once, so
    /// that a step an earlier incarnation lost is re-sent now rather than at
    /// its timeout.
    pub fn start(now: Duration, device: u32, incarnation: u32, ctx: Arc<Ctx>) -> Self {
        let addr = Addr::worker(device);
        let serving = ctx.topology.instance_of(device);
        let number = ctx.durable.new_incarnation();
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation}, instance {number})"));
        let mut machine = WorkerMachine {
            device,
            addr,
            base: ctx.topology.devices_of(serving).start,
            scheduler: Addr::scheduler(serving),
            incarnation: number,
            passes: 0,
            owner: 0,
            seqs: BTreeMap::new(),
            proposals: BTreeMap::new(),
            running: None,
            last: None,
            positions: BTreeMap::new(),
            modelled_due: None,
            now,
            effects: Vec::new(),
            image_cache: deepinfer_engine::encoder_cache::EncoderCache::new(crate::limits::WORKER_IMAGE_CACHE_BYTES),
            ctx,
        };
        let hello =
            Heartbeat { incarnation: number, restarted: machine.ctx.durable.is_up(), time_ns: now.as_nanos() as u64 };
        machine.send(machine.scheduler, Message::Heartbeat(hello), &[]);
        machine
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// React to one input at `now`.
    pub fn handle(&mut self, now: Duration, input: Input) -> Result<(), Crash> {
        assert!(now >= self.now, "time runs forward");
        self.now = now;
        let result = match input {
            Input::Net(d) => self.on_frame(d),
            Input::Timeout { pass, layer, round } => {
                self.on_timeout(pass, layer, round);
                Ok(())
            }
        };
        assert!(self.running.as_ref().is_none_or(|run| run.is_consistent()), "{}: step in flight", self.addr);
        result
    }

    fn on_frame(&mut self, d: Delivery) -> Result<(), Crash> {
        let Some(m) = self.ctx.open(self.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        match m.envelope.msg {
            Message::StepRequest(req) if from == self.scheduler => {
                self.on_step_request(from, req, m.body);
                self.advance()
            }
            Message::ExpertResult(h) => {
                if self.on_expert_result(from, h, m.body) {
                    self.advance()?;
                }
                Ok(())
            }
            other => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
                Ok(())
            }
        }
    }

    /// Encode and send; the frame is returned for resending.
    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) -> Option<Vec<u8>> {
        let out = super::encode(&self.ctx.events, self.addr, to, msg, body)?;
        let frame = out.frame.clone();
        self.effects.push(Effect::Send(out));
        Some(frame)
    }

    fn reply(&mut self, to: Addr, step: u64, attempt: u32, outcome: StepOutcome, body: &[f32]) -> Option<Vec<u8>> {
        let r = StepResult { step, attempt, device: self.device, outcome };
        self.send(to, Message::StepResult(r), body)
    }

    fn refuse(&mut self, to: Addr, req: &StepRequest, why: String) {
        self.reply(to, req.step, req.attempt, StepOutcome::Failed(why), &[]);
    }

    /// Devices of this worker's instance.
    fn instance_devices(&self) -> u32 {
        let topo = &self.ctx.topology;
        topo.size_of(topo.instance_of(self.device))
    }

    /// Whose request it is and whether it is new; then the step itself.
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
            self.proposals.clear();
            self.positions.clear();
            if self.modelled_due.take().is_some() {
                self.effects.push(Effect::CancelLater);
            }
            self.last = None;
            self.owner = req.scheduler;
        }
        if let Some(run) = &self.running {
            if run.step >= req.step {
                return;
            }
            self.abort("superseded by a newer step");
        }
        if self.modelled_due.is_some_and(|(step, due)| step >= req.step && self.now < due) {
            return;
        }
        if let Some((owner, step, frame)) = &self.last {
            if *owner == req.scheduler && *step == req.step {
                let out = Outgoing { to: from, frame: frame.clone() };
                self.effects.push(Effect::Send(out));
                return;
            }
            if *owner == req.scheduler && *step > req.step {
                return;
            }
        }
        for seq in &req.release {
            self.seqs.remove(seq);
            self.proposals.remove(seq);
            self.positions.remove(seq);
        }
        match self.ctx.modelled.clone() {
            Some(m) => self.modelled_step(from, req, &m),
            None => self.compute_step(from, req, body),
        }
    }

    /// Ask for the history of `missing` instead of running the step.
    fn needs_history(&mut self, from: Addr, req: &StepRequest, missing: Vec<u64>) {
        self.ctx.events.record(format_args!("{} needs history of {missing:?} for step {}", self.addr, req.step));
        self.reply(from, req.step, req.attempt, StepOutcome::NeedsHistory(missing), &[]);
    }
}

#[cfg(test)]
mod tests;
