//! What outlives an actor's incarnation: the one mutable state the actors
//! of a cluster share, each part with the reason it cannot be a message.
//! Everything else an actor knows came to it in a frame.
//!
//! - Each instance's placement table, as each node's process holds it: the
//!   scheduler writes its home node's copy; a shard that restarts loads the
//!   experts its own node's copy gives it before any dispatch arrives (the
//!   scheduler that wrote the table may itself be restarting). On any other
//!   node that copy is the configured table, which is why a started shard
//!   asks its scheduler for the current one; a simulation keeps the copies
//!   apart so that it fails where a cluster of processes would.
//! - Step and incarnation counters: a restarted scheduler or worker must
//!   never reuse a step or pass id of its earlier incarnation, whose frames
//!   may still be in flight.
//! - Whether the tree has started: any later start is a restart.
//! - The devices each node's membership declared dead, kept per observing
//!   node (in a simulation every node shares this value, and a partitioned
//!   node's view must not leak into the others').
//! - Occupancy gauges, written by schedulers, read only by observers.
//!
//! In a multi-process cluster each process holds its own; what one node
//! writes, no other reads.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;

use crate::cluster::placement::Placement;

/// An instance's occupancy after its last planned step.
#[derive(Debug, Default)]
pub struct InstanceGauges {
    /// Bytes of the engine's KV block pool in use (cached blocks included), and its budget.
    pub kv_used_bytes: AtomicU64,
    pub kv_budget_bytes: AtomicU64,
    pub running: AtomicU64,
    pub waiting: AtomicU64,
}

/// An image encoder's counters since its node started. Shared state rather
/// than messages because a node's status agent reads them at any time, as
/// it reads the instance gauges; only the encoder's shell writes them.
#[derive(Debug, Default)]
pub struct EncoderGauges {
    pub images_encoded: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Images waiting for the tower now.
    pub queue_images: AtomicU64,
    /// Time the tower ran (wall time on a real clock; 0 on a virtual one).
    pub encode_us: AtomicU64,
}

pub struct Durable {
    /// Per node, per instance: the table that node's process holds.
    placements: Vec<Vec<RwLock<Placement>>>,
    /// Each instance's table as configured, over all its devices.
    initial: Vec<Placement>,
    steps: Vec<AtomicU64>,
    gauges: Vec<InstanceGauges>,
    encoder_gauges: Vec<EncoderGauges>,
    incarnations: AtomicU64,
    up: AtomicBool,
    lost_devices: Vec<RwLock<BTreeSet<u32>>>,
    /// Per node: the nodes its membership declared dead.
    down_nodes: Vec<RwLock<BTreeSet<u32>>>,
    /// Per node: the nodes its membership is about to declare dead.
    suspects: Vec<RwLock<BTreeSet<u32>>>,
    /// Per node: the id of its process, which membership heartbeats carry
    /// (a simulated process restart draws a new one).
    processes: Vec<AtomicU64>,
    /// Per device: the routed experts its shard holds and their weight bytes (written by the shard).
    experts_held: Vec<(AtomicU64, AtomicU64)>,
}

impl Durable {
    /// One placement table per instance, for a cluster of `nodes` nodes.
    pub fn new(placements: Vec<Placement>, nodes: u32, devices: u32, incarnation_base: u64) -> Self {
        assert!(!placements.is_empty() && nodes > 0, "a cluster has an instance and a node");
        let instances = placements.len();
        Self {
            placements: (0..nodes).map(|_| placements.iter().cloned().map(RwLock::new).collect()).collect(),
            initial: placements,
            steps: (0..instances).map(|_| AtomicU64::new(0)).collect(),
            gauges: (0..instances).map(|_| InstanceGauges::default()).collect(),
            encoder_gauges: Vec::new(),
            incarnations: AtomicU64::new(incarnation_base),
            up: AtomicBool::new(false),
            lost_devices: (0..nodes).map(|_| RwLock::new(BTreeSet::new())).collect(),
            down_nodes: (0..nodes).map(|_| RwLock::new(BTreeSet::new())).collect(),
            suspects: (0..nodes).map(|_| RwLock::new(BTreeSet::new())).collect(),
            processes: (0..nodes).map(|n| AtomicU64::new(incarnation_base + 1 + u64::from(n))).collect(),
            experts_held: (0..devices).map(|_| (AtomicU64::new(0), AtomicU64::new(0))).collect(),
        }
    }

    /// The table of `instance` as `node`'s process holds it (its scheduler's
    /// home node holds the current one).
    pub fn placement(&self, node: u32, instance: u32) -> Placement {
        self.placements[node as usize][instance as usize].read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_placement(&self, node: u32, instance: u32, p: Placement) {
        *self.placements[node as usize][instance as usize].write().unwrap_or_else(|e| e.into_inner()) = p;
    }

    /// What `node`'s process holds when it starts again (a simulated process
    /// restart): the configured tables and no view of dead nodes. Counters
    /// stay: ids must never repeat, and a real process takes its
    /// incarnations from the clock for the same reason.
    pub fn restart_process(&self, node: u32) {
        let Some(tables) = self.placements.get(node as usize) else { return };
        let nodes = self.processes.len() as u64;
        self.processes[node as usize].fetch_add(nodes, Ordering::Relaxed);
        for (t, initial) in tables.iter().zip(&self.initial) {
            *t.write().unwrap_or_else(|e| e.into_inner()) = initial.clone();
        }
        for views in [&self.lost_devices, &self.down_nodes, &self.suspects] {
            if let Some(v) = views.get(node as usize) {
                v.write().unwrap_or_else(|e| e.into_inner()).clear();
            }
        }
    }

    /// The id of `node`'s process (never 0).
    pub fn process(&self, node: u32) -> u64 {
        self.processes.get(node as usize).map_or(1, |p| p.load(Ordering::Relaxed))
    }

    /// A new step id of `instance`'s scheduler.
    pub fn next_step(&self, instance: u32) -> u64 {
        self.steps[instance as usize].fetch_add(1, Ordering::Relaxed)
    }

    /// Steps started by every instance.
    pub fn total_steps(&self) -> u64 {
        self.steps.iter().map(|s| s.load(Ordering::Relaxed)).sum()
    }

    /// A cluster-unique number for an actor's (re)start.
    pub fn new_incarnation(&self) -> u64 {
        self.incarnations.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    /// The whole tree has started.
    pub fn mark_up(&self) {
        self.up.store(true, Ordering::Relaxed);
    }

    /// Node `seen_from` heard that the device's node was declared dead.
    pub fn is_lost(&self, seen_from: u32, device: u32) -> bool {
        self.lost_devices
            .get(seen_from as usize)
            .is_some_and(|l| l.read().unwrap_or_else(|e| e.into_inner()).contains(&device))
    }

    pub fn mark_lost(&self, seen_from: u32, devices: &[u32]) {
        if let Some(l) = self.lost_devices.get(seen_from as usize) {
            l.write().unwrap_or_else(|e| e.into_inner()).extend(devices.iter().copied());
        }
    }

    /// `instance`'s table as configured, over all its devices.
    pub fn initial_placement(&self, instance: u32) -> Placement {
        self.initial[instance as usize].clone()
    }

    /// Node `seen_from` hears `node` again: it and its devices are back.
    /// False if it had not been declared dead there.
    pub fn mark_node_up(&self, seen_from: u32, node: u32, devices: &[u32]) -> bool {
        let Some(down) = self.down_nodes.get(seen_from as usize) else { return false };
        if !down.write().unwrap_or_else(|e| e.into_inner()).remove(&node) {
            return false;
        }
        if let Some(l) = self.lost_devices.get(seen_from as usize) {
            let mut lost = l.write().unwrap_or_else(|e| e.into_inner());
            devices.iter().for_each(|d| {
                lost.remove(d);
            });
        }
        true
    }

    pub fn set_experts_held(&self, device: u32, experts: u32, bytes: u64) {
        if let Some((count, held_bytes)) = self.experts_held.get(device as usize) {
            count.store(u64::from(experts), Ordering::Relaxed);
            held_bytes.store(bytes, Ordering::Relaxed);
        }
    }

    /// The routed experts `device`'s shard holds.
    pub fn experts_held(&self, device: u32) -> u32 {
        self.experts_held.get(device as usize).map_or(0, |(h, _)| h.load(Ordering::Relaxed) as u32)
    }

    /// Bytes of the weights of the routed experts `device`'s shard holds.
    pub fn expert_bytes_held(&self, device: u32) -> u64 {
        self.experts_held.get(device as usize).map_or(0, |(_, b)| b.load(Ordering::Relaxed))
    }

    /// Whether node `seen_from` holds `node` dead.
    pub fn is_node_down(&self, seen_from: u32, node: u32) -> bool {
        self.down_nodes
            .get(seen_from as usize)
            .is_some_and(|d| d.read().unwrap_or_else(|e| e.into_inner()).contains(&node))
    }

    /// Node `seen_from` heard that `node` was declared dead.
    pub fn mark_node_down(&self, seen_from: u32, node: u32) {
        if let Some(d) = self.down_nodes.get(seen_from as usize) {
            d.write().unwrap_or_else(|e| e.into_inner()).insert(node);
        }
    }

    /// The nodes `seen_from`'s membership is about to declare dead.
    pub fn set_suspects(&self, seen_from: u32, suspects: BTreeSet<u32>) {
        if let Some(s) = self.suspects.get(seen_from as usize) {
            *s.write().unwrap_or_else(|e| e.into_inner()) = suspects;
        }
    }

    /// Whether node `seen_from` is cut off with a minority of the cluster: it
    /// holds fewer than half of the nodes alive (itself included), or exactly
    /// half without node 0 (the tie goes to node 0's side); nodes about to be
    /// declared dead count as dead. A minority serves
    /// nothing: its view of who holds which expert cannot be trusted.
    pub fn in_minority(&self, seen_from: u32) -> bool {
        let Some(down) = self.down_nodes.get(seen_from as usize) else { return false };
        let mut down = down.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(s) = self.suspects.get(seen_from as usize) {
            down.extend(s.read().unwrap_or_else(|e| e.into_inner()).iter().copied());
        }
        let nodes = self.down_nodes.len();
        let alive = nodes - down.iter().filter(|&&n| n != seen_from && (n as usize) < nodes).count();
        2 * alive < nodes || (2 * alive == nodes && down.contains(&0))
    }

    /// The first of nodes `0..routers` that `seen_from` has not heard is dead
    /// (its router is the active one there); `None` if every one is.
    pub fn first_live_node(&self, seen_from: u32, routers: u32) -> Option<u32> {
        let down = self.down_nodes.get(seen_from as usize)?.read().unwrap_or_else(|e| e.into_inner());
        (0..routers).find(|n| !down.contains(n))
    }

    pub fn gauges(&self) -> &[InstanceGauges] {
        &self.gauges
    }

    /// With counters for `encoders` image encoders.
    pub fn with_encoders(mut self, encoders: usize) -> Self {
        self.encoder_gauges = (0..encoders).map(|_| EncoderGauges::default()).collect();
        self
    }

    pub fn encoder_gauges(&self) -> &[EncoderGauges] {
        &self.encoder_gauges
    }
}
