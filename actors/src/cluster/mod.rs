// tidy: long file: cluster configuration, the supervision tree, the client and the run modes; each to its own file of cluster/.
//! A cluster of N devices with expert parallelism, serving requests: the
//! supervision tree of every actor, and the client that submits requests to
//! the router and collects their output.
//!
//! ```text
//! ClusterSupervisor
//! └── NodeSupervisor × nodes
//!     ├── CacheManager                       prefix index and block values of the node's instances
//!     ├── Router                             (node 0) picks an instance, records requests in flight
//!     ├── ExpertShard × devices of the node
//!     ├── GpuWorker   × devices of the node
//!     └── Scheduler   × instances homed on the node (the engine's batching policy)
//! ```
//!
//! The client speaks the same protocol to the router as the router to a
//! scheduler (see [`crate::wire::Submit`]): it keeps each request's tokens,
//! submits again after a silence, a gap or a router restart, and ends a
//! request with an error when the cluster gives up or stops answering.

mod client;
pub mod ctx;
pub use ctx::DraftCosts;
pub mod disagg;
pub mod durable;
pub mod placement;
pub mod topology;

pub use client::Cluster;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use deepinfer_engine::constraint::ConstraintSource;
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::model::Model;
use deepinfer_engine::request::{FinishReason, Finished, Request, TokenOutput};
use deepinfer_engine::scheduler::{EngineConfig, Scheduler};
use deepinfer_engine::speculative::SpeculativeConfig;
use ractor::{Actor, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::actor::cache::{CacheArgs, CacheManager};
use crate::actor::encoder::{EncoderArgs, ImageEncoder};
use crate::actor::member::{MemberActor, MemberArgs};
use crate::actor::router::{Router, RouterArgs};
use crate::actor::scheduler::{InstanceScheduler, SchedulerArgs};
use crate::actor::shard::{ExpertShard, ShardArgs};
use crate::actor::supervisor::{
    ChildKind, ChildSpec, Intensity, StartFn, Supervisor, SupervisorArgs, SupervisorEnv, SupervisorMsg,
};
use crate::actor::worker::{GpuWorker, WorkerArgs};
use crate::cluster::ctx::{Ctx, Durable, InstanceGauges, NodeNews, Timeouts, Topology};
use crate::cluster::disagg::{EplbConfig, InstanceKind, PrefillRouting};
use crate::cluster::placement::{Placement, PlacementError};
use crate::modelled::cost::{DeviceCost, DeviceCostModel};
use crate::modelled::devices::{Modelled, ModelledSpec};
use crate::net::transport::{InProcess, Inbox, Transport, DEFAULT_QUEUE};
use crate::proto::cursor::{fit, Fit};
use crate::proto::membership::MembershipConfig;
use crate::sim::clock::{Clock, RealClock, SimClock};
use crate::sim::events::{bump, EventLog, Metrics, MetricsSnapshot};
use crate::sim::fabric::{FabricConfig, NodeOf, SimFabric};
use crate::sim::faults::{FaultPlan, Faults};
use crate::sim::rng::Seed;
use crate::wire::{Addr, FinishKind, Heartbeat, Message, OutputEnd, RequestSpec, Role, Submit};

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub devices: u32,
    /// Expert-parallel degree inside each instance.
    pub expert_parallel: u32,
    pub devices_per_node: u32,
    /// Serving instances the devices are split into, each with its own
    /// scheduler and its own copy of the experts.
    pub instances: u32,
    /// The batching policy of every instance's scheduler.
    pub engine: EngineConfig,
    /// The initial table of each instance (instance-local devices); by default `Placement::expert_parallel`.
    pub placement: Option<Placement>,
    /// Tables to switch to before the given step of every instance (0-based).
    pub placement_changes: Vec<(u64, Placement)>,
    pub node_intensity: Intensity,
    pub cluster_intensity: Intensity,
    /// `None`: `Timeouts::simulated()` on a virtual clock, `Timeouts::real()` on wall time.
    pub timeouts: Option<Timeouts>,
    /// Run membership as an actor per node over the cluster's own transport
    /// (the simulated fabric): a node silent past the failure timeout is
    /// declared down and the survivors serve around it. `None`: membership
    /// is the QUIC transport's (real clusters) or absent (one process).
    pub membership: Option<MembershipConfig>,
    pub seed: u64,
    pub faults: Option<FaultPlan>,
    /// Used by the simulated fabric only.
    pub fabric: FabricConfig,
    /// Return every generated token's logits.
    pub return_logits: bool,
    /// Event-log lines kept for inspection (all are digested).
    pub keep_events: usize,
    /// Simulation only: workers and shards advance the virtual clock by the
    /// engine's device cost model; `None`: computation takes no time.
    pub device_cost: Option<DeviceCostModel>,
    /// Devices of each instance when they differ (empty: `devices / instances` each).
    pub instance_devices: Vec<u32>,
    /// What each instance serves; empty: every instance prefills and decodes.
    pub instance_kinds: Vec<InstanceKind>,
    /// Rebalance each instance's experts from measured loads.
    pub eplb: Option<EplbConfig>,
    pub prefill_routing: PrefillRouting,
    /// Simulation only: full-size modelled devices that compute nothing.
    pub modelled: Option<ModelledSpec>,
    /// Builds the constraints of structured-output requests in the
    /// schedulers; `None`: such requests are refused.
    pub constraints: Option<Constraints>,
    /// Nodes that run a router (the first ones; at least one): the first
    /// not declared dead is active, the others stand by to take over.
    pub routers: u32,
    /// Simulation: the node whose side of the fabric an in-process client
    /// is on (and whose membership it trusts as its own).
    pub client_node: u32,
    /// Where this process's incarnation numbers start. Peers tell a newer
    /// actor from an older one by them, so a restarted node process must
    /// start above anything its previous life gave out (its start time does).
    pub incarnation_base: u64,
    /// The prompt cache's tiers below the device pools, on every node.
    pub cache_tiers: NodeCacheTiers,
    /// What a computing worker's step and its drafting cost, for the
    /// adaptive draft-length policy (`engine.speculative`).
    pub draft_costs: DraftCosts,
    /// Image encoder instances: the node each runs on (empty: images are
    /// encoded on the prefill workers).
    pub encoder_nodes: Vec<u32>,
}

/// The prompt cache below each instance's device pool, per node: host
/// memory takes the blocks a pool evicts, a disk tier takes blocks at the
/// persist points and keeps them across restarts.
#[derive(Clone, Debug, Default)]
pub struct NodeCacheTiers {
    /// Bytes of block values each node keeps in host memory (0: evicted blocks are dropped).
    pub host_bytes: usize,
    /// The disk tier; `None`: none.
    pub disk: Option<crate::kv_disk::DiskConfig>,
    /// `disk.dir` is one mount every node reads and writes (3FS, NFS,
    /// Lustre): a block any node wrote serves every instance. Otherwise each
    /// node keeps its own directory under it (`node<i>`).
    pub disk_shared: bool,
    pub persist: deepinfer_engine::kv_tiers::PersistRule,
}

impl NodeCacheTiers {
    /// Whether blocks can be found below the device pools at all.
    pub fn any(&self) -> bool {
        self.host_bytes > 0 || self.disk.is_some()
    }

    /// Node `node`'s disk tier.
    pub fn disk_of(&self, node: u32) -> Option<crate::kv_disk::DiskConfig> {
        let mut d = self.disk.clone()?;
        if !self.disk_shared {
            d.dir = d.dir.join(format!("node{node}"));
        }
        Some(d)
    }
}

/// The schedulers' [`ConstraintSource`], shared by every instance.
#[derive(Clone)]
pub struct Constraints(pub Arc<dyn ConstraintSource>);

impl std::fmt::Debug for Constraints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraints")
    }
}

impl ClusterConfig {
    pub fn new(devices: u32, expert_parallel: u32) -> Self {
        Self {
            devices,
            expert_parallel,
            devices_per_node: 8,
            instances: 1,
            engine: EngineConfig::default(),
            placement: None,
            placement_changes: Vec::new(),
            node_intensity: Intensity::new(3, Duration::from_secs(5)),
            cluster_intensity: Intensity::new(2, Duration::from_secs(30)),
            timeouts: None,
            membership: None,
            seed: 0,
            faults: None,
            fabric: FabricConfig::default(),
            return_logits: false,
            keep_events: 0,
            device_cost: None,
            instance_devices: Vec::new(),
            instance_kinds: Vec::new(),
            eplb: None,
            prefill_routing: PrefillRouting::CacheAffinity,
            modelled: None,
            constraints: None,
            routers: 2,
            client_node: 0,
            incarnation_base: 0,
            cache_tiers: NodeCacheTiers::default(),
            draft_costs: DraftCosts::default(),
            encoder_nodes: Vec::new(),
        }
    }

    pub fn topology(&self) -> Topology {
        let t = if self.instance_devices.is_empty() {
            Topology::uniform(self.devices, self.devices_per_node, self.instances)
        } else {
            Topology::with_sizes(self.devices_per_node, &self.instance_devices)
        };
        // An encoder may run on a node of its own, after the serving ones.
        let last = self.encoder_nodes.iter().map(|&n| n.saturating_add(1)).max().unwrap_or(0);
        let extra = last.saturating_sub(t.serving_nodes());
        t.with_extra_nodes(extra)
    }

    pub fn nodes(&self) -> u32 {
        self.topology().nodes()
    }

    /// The nodes that run a router: `routers`, at least one and at most
    /// every serving node (an encoder's own node runs none).
    pub fn router_nodes(&self) -> u32 {
        self.routers.clamp(1, self.topology().serving_nodes())
    }

    /// Which node an address lives on.
    pub fn node_of(&self) -> NodeOf {
        let topo = self.topology();
        let client_node = self.client_node;
        let encoders = self.encoder_nodes.clone();
        Arc::new(move |a: Addr| match a.role {
            Role::Worker | Role::Shard => topo.node_of_device(a.index),
            Role::Scheduler => topo.home_node(a.index),
            Role::CacheManager | Role::Node | Role::Router | Role::Agent => a.index,
            Role::Client => client_node,
            // An encoder that does not exist lives nowhere a frame can reach.
            Role::Encoder => encoders.get(a.index as usize).copied().unwrap_or(u32::MAX),
        })
    }
}

/// A request to complete: the engine's own request type.
pub type GenRequest = Request;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// One row per generated token when logits were asked for.
    pub logits: Vec<Vec<f32>>,
    /// The most likely alternatives of each token (`params.logprobs` of them).
    pub top: Vec<Vec<(u32, f32)>>,
    pub finished: Option<Finished>,
}

/// Why a request ended without completing, and what it had produced.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{reason}")]
pub struct RequestFailed {
    pub reason: String,
    pub tokens: Vec<u32>,
}

/// What the cluster reports about a request, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// New tokens, in order, none repeated, and how many prompt tokens the
    /// prefix cache served.
    Tokens { id: u64, tokens: Vec<TokenOutput>, cached_tokens: usize },
    /// The request ended (an error names why); nothing follows.
    Finished { id: u64, finished: Finished },
    /// The request can never run (the engine's validation): why.
    Refused { id: u64, reason: String },
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("placement has {got} devices, an instance {want}")]
    PlacementDevices { got: u32, want: u32 },
    #[error("{0}")]
    Disaggregation(String),
    #[error("{devices} devices cannot be split into {instances} instances")]
    Instances { devices: u32, instances: u32 },
    #[error("engine configuration: {0}")]
    Engine(String),
    #[error("cannot start the cluster: {0}")]
    Start(String),
    #[error("runtime: {0}")]
    Runtime(String),
}

/// What a cluster runs on.
#[derive(Clone)]
pub struct Env {
    pub transport: Arc<dyn Transport>,
    pub clock: Arc<dyn Clock>,
    pub events: Arc<EventLog>,
    pub metrics: Arc<Metrics>,
    pub faults: Arc<Faults>,
}

pub struct RunReport {
    pub outputs: Vec<Result<Generated, RequestFailed>>,
    pub metrics: MetricsSnapshot,
    pub digest: u64,
    pub events: u64,
    pub log: Vec<String>,
    /// Steps started by all schedulers.
    pub steps: u64,
    /// Clock time of the run: virtual in simulation.
    pub elapsed: Duration,
}

type Spawn<A> = fn(u32, u32, Arc<Ctx>) -> <A as Actor>::Arguments;

/// A child that (re)starts actor `A` with `args(index, incarnation, ctx)`.
fn spec<A>(name: String, kind: ChildKind, index: u32, ctx: &Arc<Ctx>, actor: fn() -> A, args: Spawn<A>) -> ChildSpec
where
    A: Actor,
{
    let ctx = Arc::clone(ctx);
    let start: StartFn = Arc::new(move |parent, incarnation| {
        let a = args(index, incarnation, Arc::clone(&ctx));
        Box::pin(async move { A::spawn_linked(None, actor(), a, parent).await.map(|(r, _)| r.get_cell()) })
    });
    ChildSpec { name, kind, start }
}

fn node_spec(node: u32, ctx: &Arc<Ctx>, intensity: Intensity, env: SupervisorEnv) -> ChildSpec {
    let ctx = Arc::clone(ctx);
    let start: StartFn = Arc::new(move |parent, _| {
        let topo = &ctx.topology;
        let devices = node * topo.per_node..((node + 1) * topo.per_node).min(topo.devices);
        let mut children = vec![spec(
            format!("cache{node}"),
            ChildKind::CacheManager,
            node,
            &ctx,
            || CacheManager,
            |node, incarnation, ctx| CacheArgs { node, incarnation, ctx },
        )];
        if node < ctx.routers {
            children.push(spec(
                format!("router{node}"),
                ChildKind::Router,
                node,
                &ctx,
                || Router,
                |node, incarnation, ctx| RouterArgs { node, incarnation, ctx },
            ));
        }
        if ctx.membership.is_some() {
            children.push(spec(
                format!("member{node}"),
                ChildKind::Member,
                node,
                &ctx,
                || MemberActor,
                |node, incarnation, ctx| MemberArgs { node, incarnation, ctx },
            ));
        }
        children.extend(devices.clone().map(|d| {
            spec(
                format!("shard{d}"),
                ChildKind::Shard,
                d,
                &ctx,
                || ExpertShard,
                |device, incarnation, ctx| ShardArgs { device, incarnation, ctx },
            )
        }));
        children.extend(devices.clone().map(|d| {
            spec(
                format!("worker{d}"),
                ChildKind::Worker,
                d,
                &ctx,
                || GpuWorker,
                |device, incarnation, ctx| WorkerArgs { device, incarnation, ctx },
            )
        }));
        children.extend(ctx.encoders_on(node).into_iter().map(|e| {
            spec(
                format!("encoder{e}"),
                ChildKind::Encoder,
                e,
                &ctx,
                || ImageEncoder,
                |index, incarnation, ctx| EncoderArgs { index, incarnation, ctx },
            )
        }));
        children.extend(topo.instances_on(node).into_iter().map(|i| {
            spec(
                format!("scheduler{i}"),
                ChildKind::Scheduler,
                i,
                &ctx,
                || InstanceScheduler,
                |instance, incarnation, ctx| SchedulerArgs { instance, incarnation, ctx },
            )
        }));
        let args =
            SupervisorArgs { name: format!("node{node}"), children, intensity, env: env.clone(), on_give_up: None };
        Box::pin(
            async move { Supervisor::spawn_linked(None, Supervisor, args, parent).await.map(|(a, _)| a.get_cell()) },
        )
    });
    ChildSpec { name: format!("node{node}"), kind: ChildKind::Supervisor, start }
}

/// Check the configuration and make what every actor shares.
pub(crate) fn build_ctx(model: Arc<Model>, cfg: &ClusterConfig, env: Env) -> Result<Arc<Ctx>, ClusterError> {
    let topo = cfg.topology();
    let sized = !cfg.instance_devices.is_empty() && cfg.instance_devices.len() as u32 == cfg.instances;
    if cfg.devices == 0
        || cfg.instances == 0
        || topo.devices != cfg.devices
        || (!sized && !cfg.devices.is_multiple_of(cfg.instances))
        || (0..topo.instances).any(|i| topo.size_of(i) == 0)
    {
        return Err(ClusterError::Instances { devices: cfg.devices, instances: cfg.instances });
    }
    // Each encoder on a serving node or on one of its own right after them.
    let most = topo.serving_nodes().saturating_add(cfg.encoder_nodes.len() as u32);
    if cfg.encoder_nodes.len() > 64 || cfg.encoder_nodes.iter().any(|&n| n >= most) {
        return Err(ClusterError::Start(format!(
            "encoders on nodes {:?}: each runs on one of the {} serving nodes or a node of its own after them",
            cfg.encoder_nodes,
            topo.serving_nodes()
        )));
    }
    let modelled = match &cfg.modelled {
        Some(spec) if env.clock.is_virtual() => {
            Some(Arc::new(Modelled::new(spec.clone(), &topo).map_err(|e| ClusterError::Engine(e.to_string()))?))
        }
        Some(_) => return Err(ClusterError::Engine("modelled devices need a virtual clock".into())),
        None => None,
    };
    // Computing workers draft with the model's own head; modelled ones as their acceptance model says.
    let drafting = |c: &SpeculativeConfig| (c.max_drafts() > 0).then_some(*c);
    match &cfg.modelled {
        None => cfg.engine.speculative.check(&model).map_err(ClusterError::Engine)?,
        Some(m) => {
            if drafting(&cfg.engine.speculative) != m.drafting.as_ref().and_then(|d| drafting(&d.config)) {
                return Err(ClusterError::Engine(
                    "engine.speculative and the modelled devices' drafting must be the same".into(),
                ));
            }
        }
    }
    let config = match &modelled {
        Some(m) => m.shape_config(&model.config),
        None => model.config.clone(),
    };
    Scheduler::new(&config, cfg.engine.clone()).map_err(|e| ClusterError::Engine(e.to_string()))?;
    let experts = config.n_routed_experts;
    let mut placements = Vec::with_capacity(topo.instances as usize);
    for instance in 0..topo.instances {
        let size = topo.size_of(instance);
        let placement = match &cfg.placement {
            Some(p) => p.clone(),
            None => Placement::expert_parallel(experts as u32, size, cfg.expert_parallel.min(size))?,
        };
        for p in std::iter::once(&placement).chain(cfg.placement_changes.iter().map(|(_, p)| p)) {
            p.check_experts(experts)?;
            if p.devices() != size {
                return Err(ClusterError::PlacementDevices { got: p.devices(), want: size });
            }
        }
        placements.push(placement);
    }
    let kinds = &cfg.instance_kinds;
    if !kinds.is_empty()
        && (kinds.len() != topo.instances as usize
            || !kinds.iter().any(|k| k.prefills())
            || !kinds.iter().any(|k| k.decodes()))
    {
        let why = format!(
            "{} instance kinds for {} instances, some prefilling and some decoding",
            kinds.len(),
            topo.instances
        );
        return Err(ClusterError::Disaggregation(why));
    }
    let timeouts =
        cfg.timeouts.unwrap_or(if env.clock.is_virtual() { Timeouts::simulated() } else { Timeouts::real() });
    let device_cost = match cfg.device_cost {
        Some(spec) if env.clock.is_virtual() => Some(DeviceCost::new(spec, &topo, model.config.num_layers)),
        _ => None,
    };
    let block_tokens = cfg.engine.block_tokens.unwrap_or_else(|| KvLayout::default_block_tokens(&config));
    let ctx = Arc::new(Ctx {
        model,
        config,
        modelled,
        transport: env.transport,
        clock: env.clock,
        events: env.events,
        metrics: env.metrics,
        faults: env.faults,
        timeouts,
        topology: topo.clone(),
        placement_changes: cfg.placement_changes.clone(),
        engine: cfg.engine.clone(),
        block_tokens,
        return_logits: cfg.return_logits,
        device_cost,
        kinds: cfg.instance_kinds.clone(),
        eplb: cfg.eplb,
        membership: cfg.membership,
        prefill_routing: cfg.prefill_routing,
        root: OnceLock::new(),
        durable: Durable::new(placements, topo.nodes(), topo.devices, cfg.incarnation_base)
            .with_encoders(cfg.encoder_nodes.len()),
        constraints: cfg.constraints.as_ref().map(|c| Arc::clone(&c.0)),
        routers: cfg.router_nodes(),
        node_news: OnceLock::new(),
        cache_tiers: cfg.cache_tiers.clone(),
        draft_costs: cfg.draft_costs.clone(),
        encoders: cfg.encoder_nodes.clone(),
    });
    for instance in 0..topo.instances {
        Scheduler::new(&ctx.config, ctx.engine_for(instance)).map_err(|e| ClusterError::Engine(e.to_string()))?;
    }
    Ok(ctx)
}

/// Start the root supervisor with the subtrees of `nodes`; `on_give_up` hears why it gave up.
async fn start_tree(
    ctx: &Arc<Ctx>,
    cfg: &ClusterConfig,
    nodes: std::ops::Range<u32>,
    on_give_up: mpsc::UnboundedSender<String>,
) -> Result<(ActorRef<SupervisorMsg>, JoinHandle<()>), ClusterError> {
    let senv = SupervisorEnv {
        clock: Arc::clone(&ctx.clock),
        events: Arc::clone(&ctx.events),
        metrics: Arc::clone(&ctx.metrics),
    };
    let children = nodes.map(|n| node_spec(n, ctx, cfg.node_intensity, senv.clone())).collect();
    let args = SupervisorArgs {
        name: "cluster".into(),
        children,
        intensity: cfg.cluster_intensity,
        env: senv,
        on_give_up: Some(on_give_up),
    };
    let (root, root_done) =
        Supervisor::spawn(None, Supervisor, args).await.map_err(|e| ClusterError::Start(e.to_string()))?;
    let _ = ctx.root.set(root.get_cell());
    ctx.durable.mark_up();
    Ok((root, root_done))
}

/// The actors of one node of a multi-process cluster (its `NodeSupervisor`
/// subtree under a local root); the other nodes are reached through the transport.
pub struct NodeRuntime {
    pub ctx: Arc<Ctx>,
    pub node: u32,
    root: ActorRef<SupervisorMsg>,
    root_done: JoinHandle<()>,
    down_rx: mpsc::UnboundedReceiver<String>,
}

impl NodeRuntime {
    pub async fn start(model: Arc<Model>, cfg: ClusterConfig, env: Env, node: u32) -> Result<Self, ClusterError> {
        let ctx = build_ctx(model, &cfg, env)?;
        if node >= ctx.topology.nodes() {
            return Err(ClusterError::Start(format!("node {node} is not one of {} nodes", ctx.topology.nodes())));
        }
        let (tx, down_rx) = mpsc::unbounded_channel();
        let (root, root_done) = start_tree(&ctx, &cfg, node..node + 1, tx).await?;
        ctx.events.record(format_args!("node{node} up: {} transport", ctx.transport.name()));
        Ok(Self { ctx, node, root, root_done, down_rx })
    }

    /// Tell local actors that membership declared `node` dead: its devices
    /// get no more work; each scheduler of this node whose instance has
    /// devices there re-places their experts and restarts its requests on
    /// the survivors; the router moves the requests of instances whose
    /// scheduler lived there to the others.
    pub fn node_down(&self, node: u32) {
        self.ctx.node_down(self.node, node);
    }

    /// The nodes this node's membership is about to declare dead (counted as
    /// dead when deciding whether this node is in a minority).
    pub fn set_suspects(&self, suspects: std::collections::BTreeSet<u32>) {
        self.ctx.set_suspects(self.node, suspects);
    }

    /// Tell local actors that `node`, declared dead before, answers again.
    pub fn node_up(&self, node: u32) {
        self.ctx.node_up(self.node, node);
    }

    /// Resolves when the node's supervisors gave up, with why.
    pub async fn gave_up(&mut self) -> String {
        self.down_rx.recv().await.unwrap_or_else(|| "supervision tree stopped".into())
    }

    /// Stop the subtree in order and close the transport.
    pub async fn shutdown(self) {
        let _ = self.root.send_message(SupervisorMsg::Shutdown);
        let _ = self.root_done.await;
        self.ctx.transport.close();
    }
}

/// Start, run `f` against the cluster, shut down, report (`outputs` empty).
pub async fn run_with<T>(
    model: Arc<Model>,
    cfg: ClusterConfig,
    env: Env,
    f: impl AsyncFnOnce(&mut Cluster) -> T,
) -> Result<(T, RunReport), ClusterError> {
    let (clock, events, metrics) = (Arc::clone(&env.clock), Arc::clone(&env.events), Arc::clone(&env.metrics));
    let t0 = clock.now();
    let mut cluster = Cluster::start(model, cfg, env).await?;
    let out = f(&mut cluster).await;
    let steps = cluster.steps();
    cluster.shutdown().await;
    let report = RunReport {
        outputs: Vec::new(),
        metrics: metrics.snapshot(),
        digest: events.digest(),
        events: events.len(),
        log: events.lines(),
        steps,
        elapsed: clock.now() - t0,
    };
    Ok((out, report))
}

/// Start, generate, shut down, report.
pub async fn run(
    model: Arc<Model>,
    cfg: ClusterConfig,
    env: Env,
    requests: &[Request],
) -> Result<RunReport, ClusterError> {
    let (outputs, report) = run_with(model, cfg, env, async |c: &mut Cluster| c.generate(requests).await).await?;
    Ok(RunReport { outputs, ..report })
}

fn faults_for(cfg: &ClusterConfig, metrics: &Arc<Metrics>, events: &Arc<EventLog>) -> Arc<Faults> {
    Arc::new(match &cfg.faults {
        Some(plan) => {
            Faults::new(plan.clone(), Seed(cfg.seed).child("faults"), Arc::clone(metrics), Arc::clone(events))
        }
        None => Faults::inert(Arc::clone(metrics)),
    })
}

/// Run on one current-thread runtime with tokio's paused clock and the
/// simulated fabric: reproducible from `cfg.seed`.
pub fn run_simulated(model: Arc<Model>, cfg: ClusterConfig, requests: &[Request]) -> Result<RunReport, ClusterError> {
    let (outputs, report) = simulate(model, cfg, async |c: &mut Cluster| c.generate(requests).await)?;
    Ok(RunReport { outputs, ..report })
}

/// [`run_with`] in simulation: one current-thread runtime, tokio's paused
/// clock, the simulated fabric; reproducible from `cfg.seed`.
pub fn simulate<T>(
    model: Arc<Model>,
    cfg: ClusterConfig,
    f: impl AsyncFnOnce(&mut Cluster) -> T,
) -> Result<(T, RunReport), ClusterError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| ClusterError::Runtime(e.to_string()))?;
    rt.block_on(async move {
        let clock: Arc<dyn Clock> = SimClock::start();
        let metrics = Arc::new(Metrics::default());
        let events = Arc::new(EventLog::new(Arc::clone(&clock), cfg.keep_events));
        let faults = faults_for(&cfg, &metrics, &events);
        let fabric = SimFabric::start(
            cfg.fabric.clone(),
            Seed(cfg.seed).child("fabric"),
            cfg.node_of(),
            Arc::clone(&clock),
            Arc::clone(&events),
            Arc::clone(&metrics),
            Arc::clone(&faults),
        );
        let env = Env { transport: fabric, clock, events, metrics, faults };
        run_with(model, cfg, env, f).await
    })
}

/// Wall time and in-process channels (call inside the runtime that will run the cluster).
pub(crate) fn in_process_env(cfg: &ClusterConfig) -> Env {
    let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
    let metrics = Arc::new(Metrics::default());
    let events = Arc::new(EventLog::new(Arc::clone(&clock), cfg.keep_events));
    let faults = faults_for(cfg, &metrics, &events);
    let transport = Arc::new(InProcess::new(DEFAULT_QUEUE, Arc::clone(&metrics)));
    Env { transport, clock, events, metrics, faults }
}

fn multi_thread(threads: usize) -> Result<tokio::runtime::Runtime, ClusterError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_time()
        .build()
        .map_err(|e| ClusterError::Runtime(e.to_string()))
}

/// Run on a multi-threaded runtime with wall time and in-process channels.
pub fn run_in_process(
    model: Arc<Model>,
    cfg: ClusterConfig,
    requests: &[Request],
    threads: usize,
) -> Result<RunReport, ClusterError> {
    multi_thread(threads)?.block_on(async move {
        let env = in_process_env(&cfg);
        run(model, cfg, env, requests).await
    })
}

/// An in-process cluster driven from synchronous code (the CLI): it owns
/// its runtime; every call blocks until it has an answer.
pub struct LocalCluster {
    rt: tokio::runtime::Runtime,
    cluster: Cluster,
}

impl LocalCluster {
    pub fn start(model: Arc<Model>, cfg: ClusterConfig, threads: usize) -> Result<Self, ClusterError> {
        let rt = multi_thread(threads)?;
        let cluster = rt.block_on(async move {
            let env = in_process_env(&cfg);
            Cluster::start(model, cfg, env).await
        })?;
        Ok(Self { rt, cluster })
    }

    /// Drive `cluster` (started or connected on `rt`) from synchronous code.
    pub fn from_runtime(rt: tokio::runtime::Runtime, cluster: Cluster) -> Self {
        Self { rt, cluster }
    }

    pub fn submit(&mut self, request: Request) -> u64 {
        let _guard = self.rt.enter();
        self.cluster.submit(request)
    }

    pub fn cancel(&mut self, id: u64) {
        let _guard = self.rt.enter();
        self.cluster.cancel(id);
    }

    /// The next update; `None` when nothing is outstanding.
    pub fn next_update(&mut self) -> Option<Update> {
        self.rt.block_on(self.cluster.next_update())
    }

    pub fn outstanding(&self) -> usize {
        self.cluster.outstanding()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.cluster.metrics()
    }

    pub fn shutdown(self) {
        let LocalCluster { rt, cluster } = self;
        rt.block_on(cluster.shutdown());
    }
}
