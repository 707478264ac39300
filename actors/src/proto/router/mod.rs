//! The router's protocol machine, sans-IO (its shell is
//! `crate::actor::router`): the entry point. It picks a serving instance for each new
//! request with the engine's prefill balancer
//! ([`deepinfer_engine::balance::choose_prefill`]: the longest cached prefix
//! unless that instance is overloaded, then the least queued prefill work
//! per GPU, then fewer requests, then the lowest index) and keeps the
//! record of every request in flight: its instance and the tokens produced
//! so far. That record is what makes a scheduler restart cost a replay, not a
//! request: when a scheduler announces a new incarnation, every request of
//! its instance is submitted again with the tokens it already produced, and
//! the new scheduler resumes them.
//!
//! Towards schedulers and towards the client the protocol is the same: a
//! `Submit` carries the tokens the sender has, outputs carry their index,
//! and a gap or a silence is repaired by submitting again (see
//! [`crate::wire::Submit`]). Nothing waits forever: a request that makes no
//! progress for `request_attempts` rounds of `request` ends with an error.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::balance::{
    choose_decode, choose_prefill, DecodeCandidate, DecodePolicy, Health, PrefillCandidate, PrefillPolicy, RoundRobin,
};
use deepinfer_engine::prefix_cache::{block_hash, PrefixMode};
use deepinfer_engine::scheduler::Scheduler;

use self::flight_table::FlightTable;
use super::Outgoing;

mod encoders;
mod flight_table;
mod flights;
mod routing;
use crate::cluster::ctx::Ctx;
use crate::cluster::disagg::PrefillRouting;
use crate::modelled::tiers::SimTier;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::wire::{
    Addr, CacheMsg, FinishKind, FinishWire, HandoffMsg, Heartbeat, Message, OutputEnd, OutputItem, Outputs,
    RequestSpec, Role, Submit,
};

/// What the router reacts to.
#[derive(Debug)]
pub enum RouterInput {
    Net(Delivery),
    /// Look for requests and routings past their deadline.
    Tick,
}

struct Flight {
    spec: RequestSpec,
    instance: u32,
    /// Prompt tokens cached on its instance when it was routed.
    cached_tokens: usize,
    /// At a prefill instance: the decode instance it is to move to.
    decode: Option<u32>,
    /// The encoder instance its images go to (the image-encoder balancer's choice).
    encoder: Option<u32>,
    /// The prefill instance it left (late outputs from there are still its own).
    prefilled_on: Option<u32>,
    tokens: Vec<u32>,
    client: Addr,
    /// The client cancelled it: what is sent again is the cancel.
    cancelled: bool,
    attempts: u32,
    deadline: Duration,
}

/// A new request waiting for the cache managers' answers.
struct Routing {
    submit: Submit,
    client: Addr,
    waiting: BTreeSet<u32>,
    /// Leading blocks each instance's pool caches.
    matched: BTreeMap<u32, u32>,
    /// Blocks after those in its node's host memory, then on its disk.
    lower: BTreeMap<u32, (u32, u32)>,
    /// Most leading blocks any node knows are on its disk tier.
    disk_chain: u32,
    deadline: Duration,
}

pub struct RouterMachine {
    addr: Addr,
    /// The node it runs on: its membership view decides which instances are dead.
    node: u32,
    /// Nodes being drained: their instances get no new requests.
    draining: BTreeSet<u32>,
    /// Clients that send keepalives, with when they were last heard: the
    /// requests of one silent for too long are cancelled (it is gone).
    watched: BTreeMap<Addr, Duration>,
    flights: FlightTable,
    /// Which encoder each recent image went to (the encoder balancer's cache affinity).
    affinity: encoders::Affinity,
    routing: BTreeMap<u64, Routing>,
    next_query: u64,
    /// The time of the input being handled.
    now: Duration,
    /// Frames to send, oldest first.
    out: Vec<Outgoing>,
    /// KV sizes, for the decode balancer's view of each instance's use.
    round_robin: RoundRobin,
    ctx: Arc<Ctx>,
}

/// Key chain of the full blocks of `prompt` that a prefix hit could use (the
/// last token is always computed, as in the engine's admission).
pub(crate) fn prompt_chain(prompt: &[u32], bt: usize) -> Vec<u64> {
    let blocks = prompt.len().saturating_sub(1) / bt;
    let mut parent = 0;
    (0..blocks)
        .map(|k| {
            parent = block_hash(parent, &prompt[k * bt..(k + 1) * bt]);
            parent
        })
        .collect()
}

/// An output item that ends request `id` with `reason`.
pub(crate) fn end_item(id: u64, from: usize, prompt: usize, reason: FinishKind) -> OutputItem {
    let finished = FinishWire {
        reason,
        prompt_tokens: prompt as u32,
        completion_tokens: from as u32,
        cached_tokens: 0,
        cached_host_tokens: 0,
        cached_disk_tokens: 0,
        preemptions: 0,
    };
    OutputItem {
        id,
        from: from as u32,
        tokens: Vec::new(),
        logits: false,
        end: Some(OutputEnd::Finished(finished)),
        cached: 0,
    }
}

impl RouterMachine {
    fn now(&self) -> Duration {
        self.now
    }

    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) {
        self.out.extend(super::encode(&self.ctx.events, self.addr, to, msg, body));
    }

    /// A watched client spoke: it is alive.
    fn heard_client(&mut self, client: Addr) {
        let now = self.now;
        if let Some(heard) = self.watched.get_mut(&client) {
            *heard = now;
        }
    }

    fn send_to_client(&mut self, client: Addr, items: Vec<OutputItem>, body: &[f32]) {
        if !items.is_empty() {
            self.send(client, Message::Outputs(Outputs { items }), body);
        }
    }

    /// Send request `id` (again) to its instance: its submit with the
    /// tokens it has, or its cancel.
    fn forward(&mut self, id: u64) {
        let Some(f) = self.flights.get(&id) else { return };
        let msg = if f.cancelled {
            Message::Cancel { id: f.spec.id }
        } else {
            Message::Submit(Submit {
                spec: f.spec.clone(),
                generated: f.tokens.clone(),
                decode: f.decode,
                encoder: f.encoder,
            })
        };
        self.send(Addr::scheduler(f.instance), msg, &[]);
    }
}

impl RouterMachine {
    /// A new incarnation of node `node`'s router at `now`: it knows nothing,
    /// so it says so to the client, which submits everything again if this
    /// is the router it uses.
    pub fn start(now: Duration, node: u32, incarnation: u32, ctx: Arc<Ctx>) -> Self {
        let addr = Addr::router(node);
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
        let hello = Heartbeat {
            incarnation: ctx.durable.new_incarnation(),
            restarted: ctx.durable.is_up(),
            time_ns: now.as_nanos() as u64,
        };
        let layout = Scheduler::new(&ctx.config, ctx.engine_for(0)).ok().map(|p| p.layout().clone());
        let mut machine = RouterMachine {
            addr,
            node,
            draining: BTreeSet::new(),
            watched: BTreeMap::new(),
            flights: FlightTable::new(layout, PrefillPolicy::default().attention_tokens),
            affinity: Default::default(),
            routing: BTreeMap::new(),
            next_query: 0,
            now,
            out: Vec::new(),
            round_robin: RoundRobin::default(),
            ctx,
        };
        // A standby router has nothing to announce until clients turn to it.
        if machine.ctx.active_router(node) == addr {
            machine.send(Addr::client(0), Message::Heartbeat(hello), &[]);
        }
        machine
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// How often the shell should feed `RouterInput::Tick`.
    pub fn tick_every(&self) -> Duration {
        self.ctx.timeouts.control.min(self.ctx.timeouts.request / 4)
    }

    /// The frames the inputs handled so far asked to send.
    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.out)
    }

    /// Requests in flight (routed to an instance and not ended).
    pub fn in_flight(&self) -> usize {
        self.flights.len()
    }

    /// React to one input at `now`.
    pub fn handle(&mut self, now: Duration, input: RouterInput) {
        assert!(now >= self.now, "time went backwards: {now:?} after {:?}", self.now);
        self.now = now;
        let tick = matches!(input, RouterInput::Tick);
        match input {
            RouterInput::Tick => self.on_tick(),
            RouterInput::Net(d) => self.on_frame(d),
        }
        // A request is either being routed or in flight, never both.
        debug_assert!(self.routing.values().all(|r| !self.flights.contains_key(&r.submit.spec.id)));
        // The balancers' sums against a recount, once a tick (a walk over every flight).
        if cfg!(debug_assertions) && tick {
            self.flights.check();
        }
    }

    fn on_frame(&mut self, d: Delivery) {
        let Some(m) = self.ctx.open(self.addr, &d) else { return };
        let from = m.envelope.from;
        let now = self.now;
        match (from.role, m.envelope.msg) {
            (Role::Client, Message::Submit(s)) => {
                self.heard_client(from);
                self.on_submit(from, s)
            }
            (Role::Client, Message::Cancel { id }) => {
                self.heard_client(from);
                self.on_cancel(from, id)
            }
            (Role::Scheduler, Message::Ack { ids }) => {
                for id in ids {
                    if let Some(mut f) = self.flights.get_mut(&id) {
                        if f.instance == from.index {
                            f.attempts = 0;
                            f.deadline = now + self.ctx.timeouts.request;
                        }
                    }
                }
            }
            (Role::Scheduler, Message::Outputs(out)) => self.on_outputs(from, out, m.body),
            (Role::Scheduler, Message::Handoff(HandoffMsg::Adopted { id, instance })) if instance == from.index => {
                self.on_adopted(id, instance)
            }
            (Role::Scheduler, Message::Handoff(HandoffMsg::Reroute { id, instance })) => {
                self.on_reroute(from.index, id, instance)
            }
            // Any hello (schedulers send one as they start): one whose process
            // restarted says `restarted: false`, and holds none of its flights.
            (Role::Scheduler, Message::Heartbeat(_)) => {
                let ids: Vec<u64> =
                    self.flights.iter().filter(|(_, f)| f.instance == from.index).map(|(id, _)| *id).collect();
                self.ctx.events.record(format_args!("router resubmits {} requests to {from}", ids.len()));
                for id in ids {
                    bump(&self.ctx.metrics.submits_resent);
                    self.flights.get_mut(&id).expect("listed").deadline = now + self.ctx.timeouts.request;
                    self.forward(id);
                }
            }
            (Role::CacheManager, Message::Cache(CacheMsg::Matched { query, node, matches, disk_chain })) => {
                if let Some(r) = self.routing.get_mut(&query) {
                    r.waiting.remove(&node);
                    for m in matches {
                        r.matched.insert(m.instance, m.blocks);
                        r.lower.insert(m.instance, (m.host_blocks, m.disk_blocks));
                    }
                    r.disk_chain = r.disk_chain.max(disk_chain);
                    if r.waiting.is_empty() {
                        self.decide(query);
                    }
                }
            }
            (Role::Node, Message::Control(crate::wire::Control::NodeDown { node }))
                if from == Addr::node(self.node) =>
            {
                self.on_node_down(node)
            }
            // Its instances count as up again through the shared view of lost
            // devices; a drained node that restarted is not draining any more.
            (Role::Node, Message::Control(crate::wire::Control::NodeUp { node })) if from == Addr::node(self.node) => {
                self.draining.remove(&node);
                self.ctx.events.record(format_args!("{} routes to node{node} again", self.addr));
            }
            (Role::Client, Message::Control(crate::wire::Control::Drain { node, nonce })) => {
                if node < self.ctx.topology.nodes() && self.draining.insert(node) {
                    self.ctx.events.record(format_args!("{} drains node{node}: no new requests there", self.addr));
                }
                self.send(from, Message::Control(crate::wire::Control::DrainAck { node, nonce }), &[]);
            }
            // A client of another process says it is alive: its requests are watched.
            (Role::Client, Message::Heartbeat(_)) => {
                self.watched.insert(from, now);
            }
            (_, Message::Heartbeat(_)) => {}
            (_, other) => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
