//! Fault injection: named points in the actors and the fabric that consult a
//! [`FaultPlan`]. Without a plan every point is a no-op. Kills fire wherever a
//! plan is installed; message faults exist only in the simulated fabric.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sim::events::{bump, EventLog, Metrics};
use crate::sim::rng::{Rng, Seed};
use crate::wire::MsgKind;

/// An actor a fault can hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    Worker(u32),
    Shard(u32),
    /// A node supervisor, with every actor of the node.
    Node(u32),
    /// The scheduler of a serving instance.
    Scheduler(u32),
    /// The cache manager of a node.
    CacheManager(u32),
    Router,
    /// An image encoder instance.
    Encoder(u32),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Worker(d) => write!(f, "worker{d}"),
            Target::Shard(d) => write!(f, "shard{d}"),
            Target::Node(n) => write!(f, "node{n}"),
            Target::Scheduler(i) => write!(f, "scheduler{i}"),
            Target::CacheManager(n) => write!(f, "cache{n}"),
            Target::Router => write!(f, "router0"),
            Target::Encoder(e) => write!(f, "encoder{e}"),
        }
    }
}

/// Crash `target` at the first injection point it reaches at or after
/// (`step`, `layer`). Workers reach a point before each layer of a pass,
/// shards on each dispatch, a scheduler at the start of each of its steps
/// (layer 0) and on each step result it receives (layer 1, 2, …); nodes,
/// cache managers and the router are killed from outside (through their
/// supervisor) when a scheduler starts step `step`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KillRule {
    pub target: Target,
    pub step: u64,
    pub layer: u32,
    /// Fire at every later point too (every incarnation dies): drives a
    /// supervisor past its restart intensity.
    pub repeat: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MessageAction {
    Drop,
    Duplicate,
    Delay(Duration),
}

/// Apply `action` to frames of `kind` with `probability`, at most `max_hits` times.
#[derive(Clone, Debug, PartialEq)]
pub struct MessageRule {
    pub kind: MsgKind,
    pub action: MessageAction,
    pub probability: f64,
    pub max_hits: u32,
}

/// Every compute step of `device` (a worker's layer, a shard's dispatch) takes `per_layer` longer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlowDevice {
    pub device: u32,
    pub per_layer: Duration,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultPlan {
    pub kills: Vec<KillRule>,
    pub messages: Vec<MessageRule>,
    pub slow: Vec<SlowDevice>,
    /// Modelled devices that take this many times longer per step (stragglers).
    pub stragglers: Vec<(u32, f64)>,
}

impl FaultPlan {
    /// One kill of a random worker, shard, scheduler, cache manager, router
    /// or (with several nodes) node at a random step below `steps` and layer
    /// below `layers`, drawn from `seed`.
    pub fn random_kill(seed: Seed, devices: u32, nodes: u32, instances: u32, steps: u64, layers: u32) -> Self {
        let mut rng = seed.stream("fault-plan");
        let kinds = if nodes > 1 { 6 } else { 5 };
        let target = match rng.below(kinds) {
            0 => Target::Worker(rng.below(devices as u64) as u32),
            1 => Target::Shard(rng.below(devices as u64) as u32),
            2 => Target::Scheduler(rng.below(instances as u64) as u32),
            3 => Target::CacheManager(rng.below(nodes as u64) as u32),
            4 => Target::Router,
            _ => Target::Node(rng.below(nodes as u64) as u32),
        };
        let step = rng.below(steps);
        let layer = rng.below(layers as u64) as u32;
        Self { kills: vec![KillRule { target, step, layer, repeat: false }], ..Self::default() }
    }
}

struct State {
    fired: Vec<bool>,
    hits: Vec<u32>,
    rng: Rng,
}

/// A plan being applied: remembers which one-shot kills fired (across restarts).
pub struct Faults {
    plan: Option<FaultPlan>,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
    events: Option<Arc<EventLog>>,
}

impl Faults {
    /// No faults: every injection point is inert.
    pub fn inert(metrics: Arc<Metrics>) -> Self {
        Self {
            plan: None,
            state: Mutex::new(State { fired: Vec::new(), hits: Vec::new(), rng: Rng::new(0) }),
            metrics,
            events: None,
        }
    }

    pub fn new(plan: FaultPlan, seed: Seed, metrics: Arc<Metrics>, events: Arc<EventLog>) -> Self {
        let state = State {
            fired: vec![false; plan.kills.len()],
            hits: vec![0; plan.messages.len()],
            rng: seed.stream("faults"),
        };
        Self { plan: Some(plan), state: Mutex::new(state), metrics, events: Some(events) }
    }

    pub fn is_active(&self) -> bool {
        self.plan.is_some()
    }

    /// Injection point: should `target` crash here?
    pub fn kill_point(&self, target: Target, step: u64, layer: u32) -> bool {
        let Some(plan) = &self.plan else { return false };
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (i, k) in plan.kills.iter().enumerate() {
            if k.target == target && (step, layer) >= (k.step, k.layer) && (k.repeat || !st.fired[i]) {
                st.fired[i] = true;
                drop(st);
                bump(&self.metrics.kills_injected);
                if let Some(ev) = &self.events {
                    ev.record(format_args!("fault kill {target} at step {step} layer {layer}"));
                }
                return true;
            }
        }
        false
    }

    /// Nodes, cache managers and the router to crash at the start of `step`, in order.
    pub fn external_kills(&self, step: u64) -> Vec<Target> {
        let Some(plan) = &self.plan else { return Vec::new() };
        let targets: std::collections::BTreeSet<Target> = plan
            .kills
            .iter()
            .map(|k| k.target)
            .filter(|t| matches!(t, Target::Node(_) | Target::CacheManager(_) | Target::Router))
            .collect();
        targets.into_iter().filter(|&t| self.kill_point(t, step, u32::MAX)).collect()
    }

    /// What the fabric should do with a frame of `kind` (first matching rule that triggers).
    pub fn message_action(&self, kind: MsgKind) -> Option<MessageAction> {
        let plan = self.plan.as_ref()?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for (i, r) in plan.messages.iter().enumerate() {
            if r.kind == kind && st.hits[i] < r.max_hits && st.rng.chance(r.probability) {
                st.hits[i] += 1;
                return Some(r.action);
            }
        }
        None
    }

    /// How many times longer a modelled step of `device` takes (1.0: no straggler).
    pub fn slow_factor(&self, device: u32) -> f64 {
        let Some(plan) = &self.plan else { return 1.0 };
        plan.stragglers.iter().filter(|(d, _)| *d == device).map(|(_, f)| f.max(1.0)).product()
    }

    /// Extra time each compute step of `device` takes.
    pub fn slowdown(&self, device: u32) -> Duration {
        let Some(plan) = &self.plan else { return Duration::ZERO };
        plan.slow.iter().filter(|s| s.device == device).map(|s| s.per_layer).sum()
    }
}
