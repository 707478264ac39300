//! The ExpertShard's protocol machine, sans-IO (its shell is
//! `crate::actor::shard`): the routed experts placed on one device. It
//! answers each dispatch (some experts' gathered rows for one layer) with
//! their outputs, after the device time they take.
//!
//! Gap: every device shares the whole model through `Arc<Model>`; "loading"
//! an expert records that the shard holds it and is checked on every
//! dispatch, where a deployment would read only those experts' weights.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use super::{Crash, Outgoing};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{Addr, Control, DispatchHeader, ExpertResultHeader, Message, ResultStatus};

/// What the shard asks its shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum ShardEffect {
    /// The device is busy this long (an injected slowdown, or the modelled
    /// time of the rows) before what follows.
    Busy(Duration),
    Send(Outgoing),
}

pub struct ShardMachine {
    device: u32,
    addr: Addr,
    epoch: u64,
    held: BTreeSet<u32>,
    effects: Vec<ShardEffect>,
    ctx: Arc<Ctx>,
}

impl ShardMachine {
    fn load(&mut self, epoch: u64, experts: impl IntoIterator<Item = u32>) {
        self.held = experts.into_iter().collect();
        self.epoch = epoch;
        self.ctx.metrics.expert_loads.fetch_add(self.held.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.ctx.durable.set_experts_held(self.device, self.held.len() as u32);
        self.ctx.events.record(format_args!("{} holds {:?} (epoch {epoch})", self.addr, self.held));
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
            if !self.held.contains(&x.expert) {
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
            let (layer, expert) = (h.layer as usize, x.expert as usize);
            if rows > 0 {
                let input = &body[at..at + rows * d];
                if model.experts_take_weights() {
                    let weights = &body[at + rows * d..at + rows * (d + 1)];
                    out.extend(model.expert_forward_weighted(layer, expert, input, weights));
                } else {
                    out.extend(model.expert_forward(layer, expert, input));
                }
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
        let placement = ctx.durable.placement(serving);
        let local = device - topo.devices_of(serving).start;
        let mut machine = ShardMachine { device, addr, epoch: 0, held: BTreeSet::new(), effects: Vec::new(), ctx };
        machine.load(placement.epoch(), placement.experts_on(local));
        machine.ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
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
            Message::Control(Control::LoadExperts { epoch, experts }) => {
                // An older table arriving late never replaces a newer one.
                if epoch >= self.epoch {
                    self.load(epoch, experts);
                }
                let ack = Control::Loaded { epoch, device: self.device };
                self.send(from, Message::Control(ack), &[]);
            }
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
