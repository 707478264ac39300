//! What every actor of a cluster is handed: the model, the transport, the
//! clock, the log, the counters, the fault plan, the timeouts and what
//! outlives an actor's incarnation (`durable.rs`).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deepinfer_engine::config::ModelConfig;
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::model::Model;
use deepinfer_engine::scheduler::EngineConfig;
use deepinfer_engine::speculative::policy::StepCost;
use ractor::ActorCell;

use crate::cluster::placement::Placement;
pub use crate::cluster::topology::Topology;
use crate::modelled::cost::DeviceCost;
use crate::modelled::devices::Modelled;
use crate::net::transport::{Delivery, Transport};
use crate::sim::clock::Clock;
use crate::sim::events::{bump, EventLog, Metrics};
use crate::sim::faults::Faults;
use crate::wire::{self, Addr, Decoded, Envelope, Message};

/// Membership declared `node` dead (or, `alive`, back after that): as
/// node `seen_from` saw it, or (`None`) as the client itself saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeNews {
    pub node: u32,
    pub alive: bool,
    pub seen_from: Option<u32>,
}

/// How long to wait for an answer, and how often to ask again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// A worker re-sends a layer's unanswered dispatches after this long.
    pub dispatch: Duration,
    /// Dispatch rounds per layer before the worker fails the step.
    pub dispatch_attempts: u32,
    /// The scheduler re-sends an unanswered step request after this long.
    pub step: Duration,
    /// Requests per step (timeouts, rebuilds, failures) before its sequences fail.
    pub step_attempts: u32,
    /// Placement changes: wait for each shard's acknowledgement this long, this often.
    pub control: Duration,
    pub control_attempts: u32,
    /// A client or router asks again about a request that made no progress
    /// (no output, no acknowledgement) for this long…
    pub request: Duration,
    /// …this many times in a row before ending it with an error.
    pub request_attempts: u32,
}

impl Timeouts {
    /// For the virtual clock, where computation takes no time (or, with a
    /// device cost model, milliseconds per step): a timeout only fires when a
    /// message or an actor was really lost.
    pub fn simulated() -> Self {
        Self {
            dispatch: Duration::from_millis(20),
            dispatch_attempts: 8,
            step: Duration::from_millis(400),
            step_attempts: 12,
            control: Duration::from_millis(20),
            control_attempts: 8,
            request: Duration::from_secs(1),
            request_attempts: 8,
        }
    }

    /// For wall time: generous, since a slow machine must not look like a dead actor.
    pub fn real() -> Self {
        Self {
            dispatch: Duration::from_secs(2),
            dispatch_attempts: 5,
            step: Duration::from_secs(30),
            step_attempts: 6,
            control: Duration::from_secs(2),
            control_attempts: 5,
            request: Duration::from_secs(10),
            request_attempts: 6,
        }
    }
}

pub use crate::cluster::durable::{Durable, EncoderGauges, InstanceGauges};

/// What every actor of a cluster is handed: configuration, services
/// (transport, clock, log, counters, faults) and the [`Durable`] state.
pub struct Ctx {
    /// The model that computes (unused by modelled devices).
    pub model: Arc<Model>,
    /// The model the actors serve: `model`'s configuration, or a modelled
    /// full-size model's shape (experts, vocabulary, context).
    pub config: ModelConfig,
    /// Full-size modelled devices: workers price steps instead of computing them.
    pub modelled: Option<Arc<Modelled>>,
    pub transport: Arc<dyn Transport>,
    pub clock: Arc<dyn Clock>,
    pub events: Arc<EventLog>,
    pub metrics: Arc<Metrics>,
    pub faults: Arc<Faults>,
    pub timeouts: Timeouts,
    pub topology: Topology,
    /// Tables to switch to before a given step of every instance.
    pub placement_changes: Vec<(u64, Placement)>,
    /// The batching policy of every instance's scheduler.
    pub engine: EngineConfig,
    /// Positions per prefix-cache block (the engine's layout).
    pub block_tokens: usize,
    /// Return every generated token's logits.
    pub return_logits: bool,
    /// Device time of workers and shards; only on a virtual clock.
    pub device_cost: Option<DeviceCost>,
    /// What each instance serves (prefill/decode disaggregation).
    pub kinds: Vec<crate::cluster::disagg::InstanceKind>,
    pub prefill_routing: crate::cluster::disagg::PrefillRouting,
    /// Expert load balancing at run time; `None`: the table changes only as configured.
    pub eplb: Option<crate::cluster::disagg::EplbConfig>,
    /// Membership as an actor per node (see `ClusterConfig::membership`).
    pub membership: Option<crate::proto::membership::MembershipConfig>,
    /// The root supervisor, for faults that kill a whole subtree or a
    /// service actor from outside (`node1`, `node0/cache0`).
    pub root: OnceLock<ActorCell>,
    /// What outlives an actor's incarnation (placements, step and
    /// incarnation counters, lost devices, gauges).
    pub durable: Durable,
    /// Nodes `0..routers` each run a router; the active one is the first a
    /// node's membership has not declared dead.
    pub routers: u32,
    /// In-process clients hear here which nodes membership declared dead, and where.
    pub node_news: OnceLock<tokio::sync::mpsc::UnboundedSender<NodeNews>>,
    /// Builds structured-output constraints; `None`: such requests are refused.
    pub constraints: Option<Arc<dyn deepinfer_engine::constraint::ConstraintSource>>,
    /// Host memory and disk below the device pools (real devices only; modelled ones use `modelled.tiers`).
    pub cache_tiers: crate::cluster::NodeCacheTiers,
    /// A computing worker's step and drafting costs (adaptive draft lengths).
    pub draft_costs: DraftCosts,
    /// Image encoder instances: the node each runs on (empty: the prefill
    /// workers encode their requests' images).
    pub encoders: Vec<u32>,
}

impl Ctx {
    /// The encoders on `node`.
    pub fn encoders_on(&self, node: u32) -> Vec<u32> {
        (0..self.encoders.len() as u32).filter(|&e| self.encoders[e as usize] == node).collect()
    }
}

/// The time a computing worker's verification step takes by the tokens it
/// verifies, and drafting's time by the requests drafted for, as the
/// adaptive draft-length policy weighs them (`Engine::set_step_cost`,
/// `Engine::set_draft_cost`).
#[derive(Clone, Debug)]
pub struct DraftCosts {
    pub step: StepCost,
    pub draft: Option<StepCost>,
}

impl Default for DraftCosts {
    /// The engine's own default: a step costs one unit plus 1/64 a token; drafting is free.
    fn default() -> Self {
        Self { step: StepCost::linear(1.0, 1.0 / 64.0), draft: None }
    }
}

impl Ctx {
    /// The batching policy of `instance`'s scheduler.
    pub fn engine_for(&self, instance: u32) -> EngineConfig {
        match &self.modelled {
            None => self.engine.clone(),
            Some(m) => {
                let bt = self.block_tokens;
                match KvLayout::new(&self.config, bt, self.engine.window_block_tokens) {
                    Ok(layout) => m.engine_for(&self.engine, &layout, self.topology.size_of(instance), instance),
                    Err(_) => self.engine.clone(),
                }
            }
        }
    }

    /// Encode and send; a failure is logged and treated as a lost message.
    pub fn send(&self, from: Addr, to: Addr, msg: Message, body: &[f32]) -> Option<Vec<u8>> {
        let env = Envelope { from, to, msg };
        match wire::encode(&env, body) {
            Ok(frame) => {
                self.send_frame(from, to, frame.clone());
                Some(frame)
            }
            Err(e) => {
                self.events.record(format_args!("{from} cannot encode for {to}: {e}"));
                None
            }
        }
    }

    pub fn send_frame(&self, from: Addr, to: Addr, frame: Vec<u8>) {
        if let Err(e) = self.transport.send(from, to, frame) {
            self.events.record(format_args!("{from}->{to} not sent: {e}"));
        }
    }

    /// Decode a received frame; a bad one is counted, logged and dropped.
    pub fn open(&self, at: Addr, d: &Delivery) -> Option<Decoded> {
        match wire::decode(&d.frame) {
            Ok(m) if m.envelope.to == at => Some(m),
            Ok(m) => {
                bump(&self.metrics.frames_rejected);
                self.events.record(format_args!("{at} got a frame for {}", m.envelope.to));
                None
            }
            Err(e) => {
                bump(&self.metrics.frames_rejected);
                self.events.record(format_args!("{at} rejects a frame from {}: {e}", d.from));
                None
            }
        }
    }

    /// What `instance` serves.
    pub fn kind(&self, instance: u32) -> crate::cluster::disagg::InstanceKind {
        self.kinds.get(instance as usize).copied().unwrap_or_default()
    }

    /// The router that actors of node `seen_from` talk to.
    pub fn active_router(&self, seen_from: u32) -> Addr {
        Addr::router(self.durable.first_live_node(seen_from, self.routers).unwrap_or(0))
    }

    /// Membership declared `dead` down; act on it from node `here`: its
    /// devices get no more work; each scheduler of `here` whose instance has
    /// devices there re-places their experts and restarts its requests on
    /// the survivors, unless `here` is now in a minority (then it fences); the router of `here` (if it runs one) stops routing to
    /// instances whose scheduler lived there and, if it is the active one,
    /// moves their requests to the others; a dead active router's place goes
    /// to the next node's.
    pub fn node_down(&self, here: u32, dead: u32) {
        let topo = &self.topology;
        let devices: Vec<u32> = (0..topo.devices).filter(|&d| topo.node_of_device(d) == dead).collect();
        self.durable.mark_lost(here, &devices);
        self.durable.mark_node_down(here, dead);
        if let Some(news) = self.node_news.get() {
            let _ = news.send(NodeNews { node: dead, alive: false, seen_from: Some(here) });
        }
        let msg = || Message::Control(wire::Control::NodeDown { node: dead });
        if here < self.routers {
            self.send(Addr::node(here), Addr::router(here), msg(), &[]);
        }
        // Every scheduler here: one whose instance has no device there may still find itself in a minority.
        for i in topo.instances_on(here) {
            self.send(Addr::node(here), Addr::scheduler(i), msg(), &[]);
        }
    }

    /// Node `here`'s membership is about to declare `suspects` dead; when that
    /// takes `here` out of a minority, its schedulers hear it (as `NodeUp` of
    /// `here`) and unfence: a peer that was only suspected never comes back Up.
    pub fn set_suspects(&self, here: u32, suspects: std::collections::BTreeSet<u32>) {
        let was = self.durable.in_minority(here);
        self.durable.set_suspects(here, suspects);
        if was && !self.durable.in_minority(here) {
            for i in self.topology.instances_on(here) {
                let msg = Message::Control(wire::Control::NodeUp { node: here });
                self.send(Addr::node(here), Addr::scheduler(i), msg, &[]);
            }
        }
    }

    /// Membership hears `node` again after declaring it dead; act on it from
    /// node `here`: its devices take work again, and each scheduler of
    /// `here` whose instance has devices there puts their experts back.
    pub fn node_up(&self, here: u32, node: u32) {
        let topo = &self.topology;
        let devices: Vec<u32> = (0..topo.devices).filter(|&d| topo.node_of_device(d) == node).collect();
        if !self.durable.mark_node_up(here, node, &devices) {
            return;
        }
        if let Some(news) = self.node_news.get() {
            let _ = news.send(NodeNews { node, alive: true, seen_from: Some(here) });
        }
        let msg = || Message::Control(wire::Control::NodeUp { node });
        if here < self.routers {
            self.send(Addr::node(here), Addr::router(here), msg(), &[]);
        }
        // Every scheduler here: a fenced one may be back in the majority.
        for i in topo.instances_on(here) {
            self.send(Addr::node(here), Addr::scheduler(i), msg(), &[]);
        }
    }

    /// Crash the actor at `path` below the root (`node0`, `node0/cache0`), as a fault would.
    pub fn kill(&self, path: &str) {
        if let Some(root) = self.root.get() {
            let _ = root.send_message(crate::actor::supervisor::SupervisorMsg::KillChild(path.to_string()));
        }
    }
}
