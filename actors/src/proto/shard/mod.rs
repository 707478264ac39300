//! The ExpertShard's protocol machine, sans-IO (its shell is
//! `crate::actor::shard`): the routed experts placed on one device. It
//! answers each dispatch (some experts' gathered rows for one layer) with
//! their outputs, after the device time they take.
//!
//! An expert's weights are its own ([`RoutedExpert`]): read from the
//! checkpoint when the model was loaded without its routed experts (a node
//! process), shared with the model when it holds them all (one process). A
//! new table is prepared ahead (`PrepareExperts`: the shell reads the
//! missing experts off the actor while the current ones serve) and switched
//! to between steps (`LoadExperts`), which frees what the new table leaves out.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::model::{Model, RoutedExpert};

use super::{Crash, Outgoing};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{Addr, Control, DispatchHeader, ExpertResultHeader, Heartbeat, Message, ResultStatus};

/// What the shard asks its shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum ShardEffect {
    /// The device is busy this long (an injected slowdown, or the modelled
    /// time of the rows) before what follows.
    Busy(Duration),
    Send(Outgoing),
    /// Read these experts' weights away from the actor ([`read_experts`]) and
    /// hand them back through [`ShardMachine::on_staged`].
    Read {
        epoch: u64,
        experts: Vec<u32>,
        reply_to: Addr,
    },
}

/// Experts read for a placement epoch ahead of its switch.
pub struct Staged {
    pub epoch: u64,
    pub experts: Vec<Arc<RoutedExpert>>,
    /// Experts that could not be read, with why.
    pub errors: Vec<(u32, String)>,
    pub load_us: u64,
    pub reply_to: Addr,
}

/// Read `experts` from `model` (what the shell runs off the actor).
pub fn read_experts(model: &Model, experts: &[u32]) -> (Vec<Arc<RoutedExpert>>, Vec<(u32, String)>) {
    let mut read = Vec::with_capacity(experts.len());
    let mut errors = Vec::new();
    for &e in experts {
        match model.routed_expert(e) {
            Ok(x) => read.push(Arc::new(x)),
            Err(err) => errors.push((e, err.to_string())),
        }
    }
    (read, errors)
}

/// Experts by id with their weights; `None` on modelled devices, which compute nothing.
type Experts = BTreeMap<u32, Option<Arc<RoutedExpert>>>;

pub struct ShardMachine {
    device: u32,
    addr: Addr,
    epoch: u64,
    held: Experts,
    /// Experts read for a coming epoch, not yet served.
    staged: Option<(u64, Experts)>,
    /// The epoch whose experts the shell is reading now (a resent prepare waits for it).
    reading: Option<u64>,
    effects: Vec<ShardEffect>,
    ctx: Arc<Ctx>,
}

/// Bytes of the experts this shard read (a resident model's shared ones cost nothing here).
fn bytes_read<'a>(experts: impl Iterator<Item = &'a Arc<RoutedExpert>>) -> u64 {
    experts.filter(|x| x.read).map(|x| x.bytes).sum()
}

impl ShardMachine {
    /// Hold exactly `experts` from `epoch` on: staged copies first, then the
    /// ones held, then read now; what is left out is freed.
    /// False when an expert could not be read (it is not held).
    fn load(&mut self, epoch: u64, experts: impl IntoIterator<Item = u32>) -> bool {
        let staged = self.staged.take().filter(|(e, _)| *e == epoch).map(|(_, s)| s).unwrap_or_default();
        let mut next = BTreeMap::new();
        let mut missing = Vec::new();
        for e in experts {
            match staged.get(&e).or_else(|| self.held.get(&e)) {
                Some(x) => {
                    next.insert(e, x.clone());
                }
                None => missing.push(e),
            }
        }
        let (read, errors) = if self.computes() {
            read_experts(&self.ctx.model, &missing)
        } else {
            next.extend(missing.iter().map(|&e| (e, None)));
            (Vec::new(), Vec::new())
        };
        self.record_errors(&errors);
        let metrics = &self.ctx.metrics;
        metrics.expert_bytes_read.fetch_add(bytes_read(read.iter()), Ordering::Relaxed);
        next.extend(read.into_iter().map(|x| (x.id, Some(x))));
        let freed = bytes_read(self.held.iter().filter(|(e, _)| !next.contains_key(e)).filter_map(|(_, x)| x.as_ref()));
        metrics.expert_bytes_freed.fetch_add(freed, Ordering::Relaxed);
        metrics.expert_loads.fetch_add(missing.len() as u64, Ordering::Relaxed);
        self.held = next;
        self.epoch = epoch;
        let bytes: u64 = self.held.values().flatten().map(|x| x.bytes).sum();
        self.ctx.durable.set_experts_held(self.device, self.held.len() as u32, bytes);
        let ids: Vec<u32> = self.held.keys().copied().collect();
        self.ctx.events.record(format_args!("{} holds {ids:?} (epoch {epoch})", self.addr));
        errors.is_empty()
    }

    fn record_errors(&self, errors: &[(u32, String)]) {
        for (e, why) in errors {
            self.ctx.events.record(format_args!("{} cannot read expert {e}: {why}", self.addr));
            eprintln!("{}: cannot read expert {e}: {why}", self.addr);
        }
    }

    /// The shell read what a `Read` effect asked for.
    pub fn on_staged(&mut self, s: Staged) {
        if self.reading == Some(s.epoch) {
            self.reading = None;
        }
        self.record_errors(&s.errors);
        let bytes = bytes_read(s.experts.iter());
        self.ctx.metrics.expert_bytes_read.fetch_add(bytes, Ordering::Relaxed);
        if s.epoch <= self.epoch {
            return;
        }
        let entry = match &mut self.staged {
            Some((epoch, map)) if *epoch == s.epoch => map,
            _ => &mut self.staged.insert((s.epoch, BTreeMap::new())).1,
        };
        entry.extend(s.experts.into_iter().map(|x| (x.id, Some(x))));
        if s.errors.is_empty() {
            let ack = Control::Prepared { epoch: s.epoch, device: self.device, bytes_read: bytes, load_us: s.load_us };
            self.send(s.reply_to, Message::Control(ack), &[]);
        }
    }

    /// Stage what `experts` of `epoch` needs beyond what is held.
    fn prepare(&mut self, from: Addr, epoch: u64, experts: Vec<u32>) {
        if epoch <= self.epoch {
            self.behind(from, epoch);
            return;
        }
        let staged = self.staged.as_ref().filter(|(e, _)| *e == epoch).map(|(_, s)| s);
        let missing: Vec<u32> = experts
            .into_iter()
            .filter(|e| !self.held.contains_key(e) && !staged.is_some_and(|s| s.contains_key(e)))
            .collect();
        if self.staged.as_ref().is_some_and(|(e, _)| *e != epoch) {
            self.staged = None;
        }
        if !self.computes() {
            // Modelled weights: nothing to read.
            let ack = Control::Prepared { epoch, device: self.device, bytes_read: 0, load_us: 0 };
            self.send(from, Message::Control(ack), &[]);
            return;
        }
        if self.reading == Some(epoch) {
            return;
        }
        self.reading = Some(epoch);
        self.effects.push(ShardEffect::Read { epoch, experts: missing, reply_to: from });
    }

    /// Tell `to` that its table of `epoch` is not newer than the one held.
    fn behind(&mut self, to: Addr, epoch: u64) {
        self.ctx.events.record(format_args!(
            "{} holds epoch {}: table of epoch {epoch} from {to} not taken",
            self.addr, self.epoch
        ));
        let msg = Control::Behind { epoch, held: self.epoch, device: self.device };
        self.send(to, Message::Control(msg), &[]);
    }

    /// Whether this shard computes (and so holds weights); modelled devices only price.
    fn computes(&self) -> bool {
        self.ctx.modelled.is_none()
    }

    /// Sizes and indices of a dispatch, checked before any engine call (which would assert).
    fn check(&self, h: &DispatchHeader, body: &[f32]) -> Result<(), ResultStatus> {
        let cfg = &self.ctx.model.config;
        if h.layer as usize >= cfg.num_layers {
            return Err(ResultStatus::Invalid(format!("layer {} of {}", h.layer, cfg.num_layers)));
        }
        let mut rows = 0u64;
        for x in &h.experts {
            if x.expert as usize >= cfg.n_routed_experts {
                return Err(ResultStatus::Invalid(format!("expert {} of {}", x.expert, cfg.n_routed_experts)));
            }
            if !self.held.contains_key(&x.expert) {
                return Err(ResultStatus::NotHeld(x.expert));
            }
            rows += x.rows as u64;
        }
        if rows * self.row_width() as u64 != body.len() as u64 {
            return Err(ResultStatus::Invalid(format!("{rows} rows but a body of {} values", body.len())));
        }
        Ok(())
    }

    /// Values per dispatched row: its hidden state, and its routing weight for
    /// models whose experts apply it.
    fn row_width(&self) -> usize {
        self.ctx.model.config.hidden_size + usize::from(self.ctx.model.experts_take_weights())
    }

    fn compute(&self, h: &DispatchHeader, body: &[f32]) -> Vec<f32> {
        let model = &self.ctx.model;
        let d = model.config.hidden_size;
        let mut out = Vec::with_capacity(body.len());
        let mut at = 0;
        for x in &h.experts {
            let rows = x.rows as usize;
            let (layer, expert) = (h.layer as usize, x.expert);
            if rows > 0 {
                let input = &body[at..at + rows * d];
                let weights =
                    if model.experts_take_weights() { &body[at + rows * d..at + rows * (d + 1)] } else { &[] };
                let weights_of = self.held[&expert].as_ref().expect("a computing shard holds its experts' weights");
                out.extend(model.routed_forward(weights_of, layer, input, weights));
            }
            at += rows * self.row_width();
        }
        out
    }

    /// A (re)started shard of `device`: it holds the experts its instance's
    /// current table places on it.
    pub fn start(device: u32, incarnation: u32, ctx: Arc<Ctx>) -> Self {
        let addr = Addr::shard(device);
        let topo = &ctx.topology;
        let serving = topo.instance_of(device);
        let placement = ctx.durable.placement(topo.node_of_device(device), serving);
        let local = device - topo.devices_of(serving).start;
        let mut machine = ShardMachine {
            device,
            addr,
            epoch: 0,
            held: BTreeMap::new(),
            staged: None,
            reading: None,
            effects: Vec::new(),
            ctx,
        };
        machine.load(placement.epoch(), placement.experts_on(local));
        machine.ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
        // The table read above is this process's copy: in a cluster of
        // processes a restarted node's copy is the configured one, not the
        // one its instance's scheduler last sent. The hello asks for that.
        let hello = Heartbeat { incarnation: u64::from(incarnation), restarted: true, time_ns: 0 };
        machine.send(Addr::scheduler(serving), Message::Heartbeat(hello), &[]);
        machine
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    pub fn take_effects(&mut self) -> Vec<ShardEffect> {
        std::mem::take(&mut self.effects)
    }

    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) {
        self.effects.extend(super::encode(&self.ctx.events, self.addr, to, msg, body).map(ShardEffect::Send));
    }

    /// React to one frame.
    pub fn handle(&mut self, d: Delivery) -> Result<(), Crash> {
        let Some(m) = self.ctx.open(self.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        match m.envelope.msg {
            Message::Dispatch(h) => return self.on_dispatch(from, h, m.body),
            Message::Control(Control::LoadExperts { epoch, experts } | Control::PrepareExperts { epoch, experts })
                if experts.iter().any(|&e| e as usize >= self.ctx.config.n_routed_experts) =>
            {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!(
                    "{} refuses a table of epoch {epoch} from {from}: expert ids past {}",
                    self.addr, self.ctx.config.n_routed_experts
                ));
            }
            Message::Control(Control::LoadExperts { epoch, experts }) => {
                // An older table never replaces a newer one, and is not
                // acknowledged as if it had: the sender hears which epoch
                // is held. One whose experts could not all be read is not
                // acknowledged either.
                if epoch < self.epoch {
                    self.behind(from, epoch);
                } else if self.load(epoch, experts) {
                    let ack = Control::Loaded { epoch, device: self.device };
                    self.send(from, Message::Control(ack), &[]);
                }
            }
            Message::Control(Control::PrepareExperts { epoch, experts }) => self.prepare(from, epoch, experts),
            Message::Control(Control::Ping { nonce }) => {
                self.send(from, Message::Control(Control::Pong { nonce }), &[]);
            }
            other => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
            }
        }
        Ok(())
    }

    fn on_dispatch(&mut self, from: Addr, h: DispatchHeader, body: Vec<f32>) -> Result<(), Crash> {
        if self.ctx.faults.kill_point(Target::Shard(self.device), h.step, h.layer) {
            return Err(Crash(format!("{}: injected crash at step {} layer {}", self.addr, h.step, h.layer)));
        }
        let slow = self.ctx.faults.slowdown(self.device);
        if !slow.is_zero() {
            self.effects.push(ShardEffect::Busy(slow));
        }
        let (status, out) = match self.check(&h, &body) {
            Ok(()) => {
                bump(&self.ctx.metrics.dispatches_answered);
                (ResultStatus::Ok, self.compute(&h, &body))
            }
            Err(status) => {
                self.ctx.events.record(format_args!("{} refuses dispatch from {from}: {status:?}", self.addr));
                (status, Vec::new())
            }
        };
        // Simulated device time of these expert rows.
        if let (ResultStatus::Ok, Some(cost)) = (&status, &self.ctx.device_cost) {
            let rows: usize = h.experts.iter().map(|x| x.rows as usize).sum();
            let experts = h.experts.iter().filter(|x| x.rows > 0).count();
            let busy = cost.experts_time(rows, experts);
            if !busy.is_zero() {
                self.effects.push(ShardEffect::Busy(busy));
            }
        }
        let reply = ExpertResultHeader {
            pass: h.pass,
            step: h.step,
            layer: h.layer,
            part: h.part,
            shard: self.device,
            status,
            experts: h.experts,
        };
        self.send(from, Message::ExpertResult(reply), &out);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
