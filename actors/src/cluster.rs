//! A cluster of N devices with expert parallelism, and a small driver that
//! plays the scheduler's part for a fixed batch of prompts: it assigns each
//! request to a worker (attention data parallelism), runs lock-step steps,
//! re-sends what times out, rebuilds what a restarted worker lost, and ends
//! a request with an error when its step cannot be completed.
//!
//! ```text
//! ClusterSupervisor ── NodeSupervisor × nodes ── ExpertShard × devices of the node
//!                                             └─ GpuWorker  × devices of the node
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deepinfer_engine::model::Model;
use deepinfer_engine::sampling::SamplingParams;
use ractor::{Actor, ActorRef};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::clock::{Clock, RealClock, SimClock};
use crate::ctx::{Ctx, Timeouts};
use crate::events::{bump, EventLog, Metrics, MetricsSnapshot};
use crate::faults::{FaultPlan, Faults};
use crate::placement::{Placement, PlacementError};
use crate::rng::Seed;
use crate::shard::{ExpertShard, ShardArgs};
use crate::sim::{FabricConfig, NodeOf, SimFabric};
use crate::supervisor::{
    ChildKind, ChildSpec, Intensity, StartFn, Supervisor, SupervisorArgs, SupervisorEnv, SupervisorMsg,
};
use crate::transport::{InProcess, Inbox, Transport, DEFAULT_QUEUE};
use crate::wire::{Addr, Control, Message, Role, Sampling, StepItem, StepOutcome, StepRequest, StepResult};
use crate::worker::{GpuWorker, WorkerArgs};

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub devices: u32,
    pub expert_parallel: u32,
    pub devices_per_node: u32,
    /// The initial table; by default `Placement::expert_parallel`.
    pub placement: Option<Placement>,
    /// Tables to switch to before the given step of a `generate` call (0-based).
    pub placement_changes: Vec<(u64, Placement)>,
    pub node_intensity: Intensity,
    pub cluster_intensity: Intensity,
    /// `None`: `Timeouts::simulated()` on a virtual clock, `Timeouts::real()` on wall time.
    pub timeouts: Option<Timeouts>,
    pub seed: u64,
    pub faults: Option<FaultPlan>,
    /// Used by the simulated fabric only.
    pub fabric: FabricConfig,
    /// Return every sampled row's logits.
    pub return_logits: bool,
    /// Event-log lines kept for inspection (all are digested).
    pub keep_events: usize,
}

impl ClusterConfig {
    pub fn new(devices: u32, expert_parallel: u32) -> Self {
        Self {
            devices,
            expert_parallel,
            devices_per_node: 8,
            placement: None,
            placement_changes: Vec::new(),
            node_intensity: Intensity::new(3, Duration::from_secs(5)),
            cluster_intensity: Intensity::new(2, Duration::from_secs(30)),
            timeouts: None,
            seed: 0,
            faults: None,
            fabric: FabricConfig::default(),
            return_logits: false,
            keep_events: 0,
        }
    }

    pub fn nodes(&self) -> u32 {
        self.devices.div_ceil(self.devices_per_node.max(1))
    }

    /// Which node an address lives on (schedulers and routers on node 0).
    pub fn node_of(&self) -> NodeOf {
        let per = self.devices_per_node.max(1);
        Arc::new(move |a: Addr| match a.role {
            Role::Worker | Role::Shard => a.index / per,
            _ => 0,
        })
    }
}

/// A prompt to complete.
#[derive(Clone, Debug, PartialEq)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// One row per generated token when `return_logits`.
    pub logits: Vec<Vec<f32>>,
}

/// Why a request ended without completing, and what it had produced.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{reason}")]
pub struct RequestFailed {
    pub reason: String,
    pub tokens: Vec<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("placement has {got} devices, the cluster {want}")]
    PlacementDevices { got: u32, want: u32 },
    #[error("cannot start the cluster: {0}")]
    Start(String),
    #[error("placement epoch {epoch} not acknowledged by shards {devices:?}")]
    PlacementNotAcknowledged { epoch: u64, devices: Vec<u32> },
    #[error("cluster down: {0}")]
    Down(String),
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
    pub steps: u64,
    /// Clock time of the run: virtual in simulation.
    pub elapsed: Duration,
}

struct Seq {
    index: usize,
    device: u32,
    history: Vec<u32>,
    fed: usize,
    max_tokens: usize,
    sampling: Sampling,
    out: Generated,
    rebuild: bool,
}

struct Pending {
    seqs: Vec<u64>,
    attempt: u32,
    deadline: Duration,
}

pub struct Cluster {
    ctx: Arc<Ctx>,
    cfg: ClusterConfig,
    addr: Addr,
    inbox: Inbox,
    root: ActorRef<SupervisorMsg>,
    root_done: JoinHandle<()>,
    down_rx: mpsc::UnboundedReceiver<String>,
    down: Option<String>,
    placement: Placement,
    step: u64,
    next_seq: u64,
}

fn worker_spec(device: u32, ctx: &Arc<Ctx>) -> ChildSpec {
    let ctx = Arc::clone(ctx);
    let start: StartFn = Arc::new(move |parent, incarnation| {
        let args = WorkerArgs { device, incarnation, ctx: Arc::clone(&ctx) };
        Box::pin(async move { GpuWorker::spawn_linked(None, GpuWorker, args, parent).await.map(|(a, _)| a.get_cell()) })
    });
    ChildSpec { name: format!("worker{device}"), kind: ChildKind::Worker, start }
}

fn shard_spec(device: u32, ctx: &Arc<Ctx>) -> ChildSpec {
    let ctx = Arc::clone(ctx);
    let start: StartFn = Arc::new(move |parent, incarnation| {
        let args = ShardArgs { device, incarnation, ctx: Arc::clone(&ctx) };
        Box::pin(
            async move { ExpertShard::spawn_linked(None, ExpertShard, args, parent).await.map(|(a, _)| a.get_cell()) },
        )
    });
    ChildSpec { name: format!("shard{device}"), kind: ChildKind::Shard, start }
}

fn node_spec(
    node: u32,
    devices: std::ops::Range<u32>,
    ctx: &Arc<Ctx>,
    intensity: Intensity,
    env: SupervisorEnv,
) -> ChildSpec {
    let ctx = Arc::clone(ctx);
    let start: StartFn = Arc::new(move |parent, _| {
        let mut children: Vec<ChildSpec> = devices.clone().map(|d| shard_spec(d, &ctx)).collect();
        children.extend(devices.clone().map(|d| worker_spec(d, &ctx)));
        let args =
            SupervisorArgs { name: format!("node{node}"), children, intensity, env: env.clone(), on_give_up: None };
        Box::pin(
            async move { Supervisor::spawn_linked(None, Supervisor, args, parent).await.map(|(a, _)| a.get_cell()) },
        )
    });
    ChildSpec { name: format!("node{node}"), kind: ChildKind::Supervisor, start }
}

impl Cluster {
    /// Start the supervision tree and every worker and shard.
    pub async fn start(model: Arc<Model>, cfg: ClusterConfig, env: Env) -> Result<Self, ClusterError> {
        let experts = model.config.n_routed_experts;
        let placement = match &cfg.placement {
            Some(p) => p.clone(),
            None => Placement::expert_parallel(experts as u32, cfg.devices, cfg.expert_parallel)?,
        };
        placement.check_experts(experts)?;
        if placement.devices() != cfg.devices {
            return Err(ClusterError::PlacementDevices { got: placement.devices(), want: cfg.devices });
        }
        for (_, p) in &cfg.placement_changes {
            p.check_experts(experts)?;
        }
        let timeouts =
            cfg.timeouts.unwrap_or(if env.clock.is_virtual() { Timeouts::simulated() } else { Timeouts::real() });
        let ctx = Arc::new(Ctx {
            model,
            transport: env.transport,
            clock: env.clock,
            events: env.events,
            metrics: env.metrics,
            faults: env.faults,
            timeouts,
            placement: Arc::new(RwLock::new(placement.clone())),
            instances: AtomicU64::new(0),
            up: AtomicBool::new(false),
        });
        let addr = Addr::scheduler(0);
        let inbox = ctx.transport.bind(addr);
        let senv = SupervisorEnv {
            clock: Arc::clone(&ctx.clock),
            events: Arc::clone(&ctx.events),
            metrics: Arc::clone(&ctx.metrics),
        };
        let per = cfg.devices_per_node.max(1);
        let nodes = (0..cfg.nodes())
            .map(|n| node_spec(n, n * per..((n + 1) * per).min(cfg.devices), &ctx, cfg.node_intensity, senv.clone()))
            .collect();
        let (tx, down_rx) = mpsc::unbounded_channel();
        let args = SupervisorArgs {
            name: "cluster".into(),
            children: nodes,
            intensity: cfg.cluster_intensity,
            env: senv,
            on_give_up: Some(tx),
        };
        let (root, root_done) =
            Supervisor::spawn(None, Supervisor, args).await.map_err(|e| ClusterError::Start(e.to_string()))?;
        ctx.up.store(true, Ordering::Relaxed);
        ctx.events.record(format_args!(
            "cluster up: {} devices, expert parallel {}, {} nodes, {} transport",
            cfg.devices,
            cfg.expert_parallel,
            cfg.nodes(),
            ctx.transport.name()
        ));
        Ok(Self { ctx, cfg, addr, inbox, root, root_done, down_rx, down: None, placement, step: 0, next_seq: 0 })
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.ctx.metrics.snapshot()
    }

    /// Switch to `p` (its epoch is set here): every shard loads its experts and
    /// acknowledges before the next step runs.
    pub async fn set_placement(&mut self, p: Placement) -> Result<(), ClusterError> {
        p.check_experts(self.ctx.model.config.n_routed_experts)?;
        if p.devices() != self.cfg.devices {
            return Err(ClusterError::PlacementDevices { got: p.devices(), want: self.cfg.devices });
        }
        let epoch = self.placement.epoch() + 1;
        let p = p.with_epoch(epoch);
        *self.ctx.placement.write().unwrap_or_else(|e| e.into_inner()) = p.clone();
        self.ctx.events.record(format_args!("placement epoch {epoch}"));
        let mut waiting: BTreeSet<u32> = (0..self.cfg.devices).collect();
        for _ in 0..self.ctx.timeouts.control_attempts {
            for &d in &waiting {
                let msg = Message::Control(Control::LoadExperts { epoch, experts: p.experts_on(d) });
                self.ctx.send(self.addr, Addr::shard(d), msg, &[]);
            }
            let deadline = self.ctx.clock.now() + self.ctx.timeouts.control;
            while !waiting.is_empty() {
                let wait = deadline.saturating_sub(self.ctx.clock.now());
                if wait.is_zero() {
                    break;
                }
                tokio::select! {
                    biased;
                    Some(why) = self.down_rx.recv() => {
                        self.down = Some(why.clone());
                        return Err(ClusterError::Down(why));
                    }
                    d = self.inbox.recv() => {
                        let Some(d) = d else { return Err(ClusterError::Down("transport closed".into())) };
                        if let Some(m) = self.ctx.open(self.addr, &d) {
                            if let Message::Control(Control::Loaded { epoch: e, device }) = m.envelope.msg {
                                if e == epoch {
                                    waiting.remove(&device);
                                }
                            }
                        }
                    }
                    _ = self.ctx.clock.sleep(wait) => {}
                }
            }
            if waiting.is_empty() {
                self.placement = p;
                return Ok(());
            }
        }
        Err(ClusterError::PlacementNotAcknowledged { epoch, devices: waiting.into_iter().collect() })
    }

    fn send_step(
        &self,
        device: u32,
        step: u64,
        attempt: u32,
        p: &Pending,
        active: &BTreeMap<u64, Seq>,
        release: &[u64],
    ) {
        let items = p
            .seqs
            .iter()
            .map(|id| {
                let s = &active[id];
                let (position, tokens) =
                    if s.rebuild { (0, s.history.clone()) } else { (s.fed, s.history[s.fed..].to_vec()) };
                StepItem {
                    seq: *id,
                    position: position as u64,
                    tokens,
                    rebuild: s.rebuild,
                    sampling: s.sampling.clone(),
                }
            })
            .collect();
        let req = StepRequest {
            step,
            attempt,
            placement: self.placement.to_wire(),
            items,
            release: release.to_vec(),
            return_logits: self.cfg.return_logits,
        };
        self.ctx.send(self.addr, Addr::worker(device), Message::StepRequest(req), &[]);
    }

    /// Generate for every request; each ends with its tokens or with why it could not.
    pub async fn generate(&mut self, requests: &[GenRequest]) -> Vec<Result<Generated, RequestFailed>> {
        let cfg = &self.ctx.model.config;
        let (vocab, context) = (cfg.vocab_size, cfg.max_position_embeddings);
        let mut results: Vec<Option<Result<Generated, RequestFailed>>> = vec![None; requests.len()];
        let mut active: BTreeMap<u64, Seq> = BTreeMap::new();
        let mut assigned = 0u32;
        for (index, r) in requests.iter().enumerate() {
            let bad = if r.prompt.is_empty() {
                Some("empty prompt".to_string())
            } else if r.max_tokens == 0 {
                Some("max_tokens must be at least 1".to_string())
            } else if r.prompt.len() + r.max_tokens > context {
                Some(format!("prompt + max_tokens exceed the context of {context}"))
            } else {
                r.params.validate(vocab).err().map(|e| e.to_string())
            };
            if let Some(reason) = bad {
                results[index] = Some(Err(RequestFailed { reason, tokens: Vec::new() }));
                continue;
            }
            let p = &r.params;
            let seq = Seq {
                index,
                device: assigned % self.cfg.devices,
                history: r.prompt.clone(),
                fed: 0,
                max_tokens: r.max_tokens,
                sampling: Sampling { temperature: p.temperature, top_p: p.top_p, top_k: p.top_k as u32, seed: p.seed },
                out: Generated::default(),
                rebuild: false,
            };
            assigned += 1;
            active.insert(self.next_seq, seq);
            self.next_seq += 1;
        }

        let mut release: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        let mut local_step = 0u64;
        while !active.is_empty() {
            if let Some(why) = self.down.clone() {
                fail_all(&mut active, &mut results, &format!("cluster down: {why}"));
                break;
            }
            let change = self.cfg.placement_changes.iter().find(|(s, _)| *s == local_step).map(|(_, p)| p.clone());
            if let Some(p) = change {
                if let Err(e) = self.set_placement(p).await {
                    fail_all(&mut active, &mut results, &e.to_string());
                    break;
                }
            }
            let step = self.step;
            self.step += 1;
            for n in self.ctx.faults.node_kills(step) {
                let _ = self.root.send_message(SupervisorMsg::KillChild(format!("node{n}")));
            }
            let mut pending: BTreeMap<u32, Pending> = BTreeMap::new();
            for (id, s) in &active {
                pending
                    .entry(s.device)
                    .or_insert_with(|| Pending { seqs: Vec::new(), attempt: 0, deadline: Duration::ZERO })
                    .seqs
                    .push(*id);
            }
            let now = self.ctx.clock.now();
            for (&device, p) in pending.iter_mut() {
                p.deadline = now + self.ctx.timeouts.step;
                let rel = release.remove(&device).unwrap_or_default();
                self.send_step(device, step, 0, p, &active, &rel);
            }
            while !pending.is_empty() {
                let deadline = pending.values().map(|p| p.deadline).min().expect("non-empty");
                let wait = deadline.saturating_sub(self.ctx.clock.now());
                let mut retry: Vec<(u32, String)> = Vec::new();
                tokio::select! {
                    biased;
                    Some(why) = self.down_rx.recv() => {
                        self.down = Some(why);
                        break;
                    }
                    d = self.inbox.recv() => {
                        let Some(d) = d else {
                            self.down = Some("transport closed".into());
                            break;
                        };
                        if let Some(m) = self.ctx.open(self.addr, &d) {
                            match m.envelope.msg {
                                Message::StepResult(r) => {
                                    if let Some(why) =
                                        self.on_result(step, r, m.body, &mut pending, &mut active, &mut results, &mut release)
                                    {
                                        retry.push(why);
                                    }
                                }
                                Message::Heartbeat(h) if h.restarted && m.envelope.from.role == Role::Worker => {
                                    let device = m.envelope.from.index;
                                    if pending.contains_key(&device) {
                                        retry.push((device, format!("worker restarted (instance {})", h.instance)));
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    _ = self.ctx.clock.sleep(wait) => {}
                }
                let now = self.ctx.clock.now();
                for (&device, p) in &pending {
                    if p.deadline <= now && !retry.iter().any(|(d, _)| *d == device) {
                        retry.push((device, "no answer".into()));
                    }
                }
                for (device, why) in retry {
                    let Some(p) = pending.get_mut(&device) else { continue };
                    p.attempt += 1;
                    if p.attempt >= self.ctx.timeouts.step_attempts {
                        let reason =
                            format!("step {step} on worker{device} failed after {} attempts: {why}", p.attempt);
                        self.ctx.events.record(format_args!("{reason}"));
                        let p = pending.remove(&device).expect("present");
                        for id in p.seqs {
                            if let Some(s) = active.remove(&id) {
                                release.entry(device).or_default().push(id);
                                results[s.index] =
                                    Some(Err(RequestFailed { reason: reason.clone(), tokens: s.out.tokens }));
                            }
                        }
                        continue;
                    }
                    bump(&self.ctx.metrics.step_resends);
                    self.ctx.events.record(format_args!("resend step {step} to worker{device}: {why}"));
                    p.deadline = now + self.ctx.timeouts.step;
                    let rel = release.get(&device).cloned().unwrap_or_default();
                    self.send_step(device, step, p.attempt, p, &active, &rel);
                }
            }
            local_step += 1;
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(RequestFailed { reason: "not run".into(), tokens: Vec::new() })))
            .collect()
    }

    /// Apply one step result; returns `(device, why)` when that device's step must be re-sent.
    #[allow(clippy::too_many_arguments)]
    fn on_result(
        &self,
        step: u64,
        r: StepResult,
        body: Vec<f32>,
        pending: &mut BTreeMap<u32, Pending>,
        active: &mut BTreeMap<u64, Seq>,
        results: &mut [Option<Result<Generated, RequestFailed>>],
        release: &mut BTreeMap<u32, Vec<u64>>,
    ) -> Option<(u32, String)> {
        if r.step != step {
            return None;
        }
        let device = r.device;
        let p = pending.get(&device)?;
        match r.outcome {
            StepOutcome::Done(outs) => {
                let vocab = self.ctx.model.config.vocab_size;
                let ok = outs.len() == p.seqs.len()
                    && outs
                        .iter()
                        .zip(&p.seqs)
                        .all(|(o, id)| o.seq == *id && o.position == active[id].history.len() as u64)
                    && body.len() == if self.cfg.return_logits { outs.len() * vocab } else { 0 };
                if !ok {
                    self.ctx
                        .events
                        .record(format_args!("ignoring a malformed result of step {step} from worker{device}"));
                    return None;
                }
                let p = pending.remove(&device).expect("present");
                for (i, (o, id)) in outs.iter().zip(&p.seqs).enumerate() {
                    let s = active.get_mut(id).expect("pending sequences are active");
                    s.fed = s.history.len();
                    s.rebuild = false;
                    s.history.push(o.token);
                    s.out.tokens.push(o.token);
                    s.out.logprobs.push(o.logprob);
                    if self.cfg.return_logits {
                        s.out.logits.push(body[i * vocab..(i + 1) * vocab].to_vec());
                    }
                    if s.out.tokens.len() >= s.max_tokens {
                        let s = active.remove(id).expect("present");
                        release.entry(device).or_default().push(*id);
                        results[s.index] = Some(Ok(s.out));
                    }
                }
                None
            }
            StepOutcome::NeedsHistory(ids) => {
                for id in ids {
                    if p.seqs.contains(&id) {
                        if let Some(s) = active.get_mut(&id) {
                            s.rebuild = true;
                        }
                    }
                }
                Some((device, "worker lost sequence state".into()))
            }
            StepOutcome::Failed(why) => {
                for id in &p.seqs {
                    if let Some(s) = active.get_mut(id) {
                        s.rebuild = true;
                    }
                }
                Some((device, why))
            }
        }
    }

    /// Stop the tree in order and close the transport.
    pub async fn shutdown(self) {
        let _ = self.root.send_message(SupervisorMsg::Shutdown);
        let _ = self.root_done.await;
        self.ctx.transport.close();
    }

    /// Why the cluster went down, if it did.
    pub fn down_reason(&self) -> Option<&str> {
        self.down.as_deref()
    }
}

fn fail_all(active: &mut BTreeMap<u64, Seq>, results: &mut [Option<Result<Generated, RequestFailed>>], reason: &str) {
    for (_, s) in std::mem::take(active) {
        results[s.index] = Some(Err(RequestFailed { reason: reason.to_string(), tokens: s.out.tokens }));
    }
}

/// Start, generate, shut down, report.
pub async fn run(
    model: Arc<Model>,
    cfg: ClusterConfig,
    env: Env,
    requests: &[GenRequest],
) -> Result<RunReport, ClusterError> {
    let (clock, events, metrics) = (Arc::clone(&env.clock), Arc::clone(&env.events), Arc::clone(&env.metrics));
    let t0 = clock.now();
    let mut cluster = Cluster::start(model, cfg, env).await?;
    let outputs = cluster.generate(requests).await;
    let steps = cluster.step;
    cluster.shutdown().await;
    Ok(RunReport {
        outputs,
        metrics: metrics.snapshot(),
        digest: events.digest(),
        events: events.len(),
        log: events.lines(),
        steps,
        elapsed: clock.now() - t0,
    })
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
pub fn run_simulated(
    model: Arc<Model>,
    cfg: ClusterConfig,
    requests: &[GenRequest],
) -> Result<RunReport, ClusterError> {
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
        run(model, cfg, env, requests).await
    })
}

/// Run on a multi-threaded runtime with wall time and in-process channels.
pub fn run_in_process(
    model: Arc<Model>,
    cfg: ClusterConfig,
    requests: &[GenRequest],
    threads: usize,
) -> Result<RunReport, ClusterError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .enable_time()
        .build()
        .map_err(|e| ClusterError::Runtime(e.to_string()))?;
    rt.block_on(async move {
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        let metrics = Arc::new(Metrics::default());
        let events = Arc::new(EventLog::new(Arc::clone(&clock), cfg.keep_events));
        let faults = faults_for(&cfg, &metrics, &events);
        let transport = Arc::new(InProcess::new(DEFAULT_QUEUE, Arc::clone(&metrics)));
        let env = Env { transport, clock, events, metrics, faults };
        run(model, cfg, env, requests).await
    })
}
