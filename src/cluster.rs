//! A topology file turned into a running cluster: the actor layout of the
//! nodes, one node's process (`deepinfer node`), the client endpoint that
//! submits work to a running cluster (`generate --topology`), and the
//! membership view (`status`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use deepinfer_actors::cluster::ctx::NodeNews;
use deepinfer_actors::cluster::disagg::{EplbConfig, InstanceKind};
use deepinfer_actors::cluster::placement::Placement;
use deepinfer_actors::cluster::{Constraints, NodeCacheTiers};
use deepinfer_actors::kv_disk::DiskConfig;
use deepinfer_actors::net::quic::{Member, MemberEvent, NodeAddr, QuicConfig, QuicTransport};
use deepinfer_actors::net::tls::{self, CLIENT_NAME};
use deepinfer_actors::sim::clock::{Clock, RealClock};
use deepinfer_actors::sim::events::{EventLog, Metrics};
use deepinfer_actors::sim::faults::Faults;
use deepinfer_actors::wire::Addr;
use deepinfer_actors::{Cluster, ClusterConfig, Env, LocalCluster, NodeRuntime};
use deepinfer_engine::kv_tiers::PersistRule;
use deepinfer_engine::model::Model;
use deepinfer_engine::scheduler::EngineConfig;

use crate::api::constraint::ConstraintFactory;
use crate::config_file::{read_text, value_error, FileError};
use crate::topology::{Backend, InstanceRole, Topology};

/// A topology checked for what this program can launch.
pub struct ClusterPlan {
    pub path: PathBuf,
    pub topology: Topology,
    pub nodes: Vec<NodeAddr>,
    pub devices_per_node: u32,
    pub instances: u32,
    pub expert_parallel: u32,
    pub redundant_experts: usize,
    /// What each serving instance serves (prefill, decode or both).
    pub kinds: Vec<InstanceKind>,
    /// Nodes with serving devices (the first ones); image encoders' nodes follow.
    pub serving_nodes: u32,
    /// The node of each image encoder (`role = "encoder"`, one per node).
    pub encoder_nodes: Vec<u32>,
    pub heartbeat: Duration,
    pub failure_timeout: Duration,
    pub startup_grace: Duration,
}

impl ClusterPlan {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let (file, text) = read_text(path)?;
        let topology = Topology::parse(&file, &text)?;
        Ok(Self::plan(path, &file, &text, topology)?)
    }

    /// The actor layout: equal nodes, instances over consecutive nodes in
    /// file order with the same size and expert-parallel degree.
    fn plan(path: &Path, file: &str, text: &str, topology: Topology) -> Result<Self, FileError> {
        let err = |span: std::ops::Range<usize>, m: String| value_error(file, text, span, m);
        let first = &topology.nodes[0];
        let per_node = *first.devices.get_ref();
        let encoder_node = |name: &str| {
            topology
                .instances
                .iter()
                .any(|i| i.role == InstanceRole::Encoder && i.nodes.iter().any(|n| n.get_ref() == name))
        };
        for n in topology.nodes.iter().filter(|n| !encoder_node(n.name.get_ref())) {
            if *n.devices.get_ref() != per_node {
                return Err(err(
                    n.devices.span(),
                    format!(
                        "every node needs the same number of devices to launch ({} has {per_node})",
                        first.name.get_ref()
                    ),
                ));
            }
        }
        let mut next_node = 0;
        let mut shape = None;
        let mut serving_nodes = None;
        let mut encoder_nodes = Vec::new();
        for inst in &topology.instances {
            for n in &inst.nodes {
                if topology.nodes.get(next_node).map(|x| x.name.get_ref()) != Some(n.get_ref()) {
                    return Err(err(n.span(), "instances must take the nodes in the order they are declared".into()));
                }
                next_node += 1;
            }
            if inst.role == InstanceRole::Encoder {
                // Encoders' nodes come after every serving node: they hold no serving device.
                serving_nodes.get_or_insert(next_node - inst.nodes.len());
                encoder_nodes.extend((next_node - inst.nodes.len()..next_node).map(|n| n as u32));
                continue;
            }
            if serving_nodes.is_some() {
                return Err(err(inst.name.span(), "serving instances come before the encoder instances".into()));
            }
            let devices = inst.nodes.len() * per_node;
            if let Some(dp) = &inst.attention_dp {
                if *dp.get_ref() != devices {
                    return Err(err(
                        dp.span(),
                        format!("attention runs on every device: attention_dp must be {devices}"),
                    ));
                }
            }
            let ep = inst.expert_parallel.as_ref().map_or(devices, |e| *e.get_ref());
            let this = (devices, ep, inst.redundant_experts);
            match shape {
                None => shape = Some(this),
                Some(s) if s == this => {}
                Some(_) => {
                    return Err(err(
                        inst.name.span(),
                        "every instance needs the same devices, expert_parallel and redundant_experts".into(),
                    ))
                }
            }
        }
        let serving_nodes = serving_nodes.unwrap_or(next_node) as u32;
        if next_node != topology.nodes.len() {
            let n = &topology.nodes[next_node];
            return Err(err(n.name.span(), format!("node `{}` serves no instance", n.name.get_ref())));
        }
        for n in &topology.nodes {
            if !matches!(n.backend, Backend::Cpu | Backend::Cuda) {
                return Err(err(
                    n.name.span(),
                    "only `backend = \"cpu\"` and `backend = \"cuda\"` nodes can be launched".into(),
                ));
            }
        }
        let (_, ep, redundant) = shape.expect("a topology has instances");
        let nodes = topology
            .nodes
            .iter()
            .map(|n| NodeAddr { name: n.name.get_ref().clone(), addr: n.address.get_ref().parse().expect("checked") })
            .collect();
        Ok(Self {
            path: path.to_path_buf(),
            nodes,
            devices_per_node: per_node as u32,
            instances: topology.instances.iter().filter(|i| i.role.kind().is_some()).count() as u32,
            expert_parallel: ep as u32,
            redundant_experts: redundant,
            kinds: topology.instances.iter().filter_map(|i| i.role.kind()).collect(),
            serving_nodes,
            encoder_nodes,
            heartbeat: Duration::from_millis(*topology.cluster.heartbeat_ms.get_ref()),
            failure_timeout: Duration::from_millis(*topology.cluster.failure_timeout_ms.get_ref()),
            startup_grace: Duration::from_millis(*topology.cluster.startup_grace_ms.get_ref()),
            topology,
        })
    }

    pub fn name(&self) -> &str {
        &self.topology.cluster.name
    }

    /// The model to load: a built-in name, or a directory relative to the topology file.
    pub fn model_spec(&self) -> String {
        let model = &self.topology.cluster.model;
        if model.starts_with("builtin:") || Path::new(model).is_absolute() {
            model.clone()
        } else {
            self.path.parent().unwrap_or(Path::new(".")).join(model).display().to_string()
        }
    }

    /// Where the HTTP API listens by default.
    pub fn api_listen(&self) -> SocketAddr {
        self.topology.cluster.api_listen.get_ref().parse().expect("checked when the topology was read")
    }

    /// Serving devices (an encoder's node holds none of them).
    pub fn devices(&self) -> u32 {
        self.devices_per_node * self.serving_nodes
    }

    pub fn node_index(&self, name: &str) -> anyhow::Result<u32> {
        match self.nodes.iter().position(|n| n.name == name) {
            Some(i) => Ok(i as u32),
            None => {
                let known: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
                bail!("{}: no node `{name}` (nodes: {})", self.path.display(), known.join(", "))
            }
        }
    }

    /// `--certs`, else `certs_dir` of the file (relative to it).
    pub fn certs_dir(&self, flag: Option<&Path>) -> anyhow::Result<PathBuf> {
        if let Some(dir) = flag {
            return Ok(dir.to_path_buf());
        }
        match &self.topology.cluster.certs_dir {
            Some(d) => Ok(self.path.parent().unwrap_or(Path::new(".")).join(d)),
            None => bail!(
                "{}: no certificates: set `certs_dir` in [cluster] or pass --certs (create them with \
                 `deepinfer cluster init-certs`)",
                self.path.display()
            ),
        }
    }

    /// Devices, nodes and instances, without the expert table.
    pub fn base_config(&self) -> ClusterConfig {
        let mut cfg = ClusterConfig::new(self.devices(), self.expert_parallel);
        cfg.devices_per_node = self.devices_per_node;
        cfg.instances = self.instances;
        cfg.encoder_nodes = self.encoder_nodes.clone();
        if self.kinds.iter().any(|&k| k != InstanceKind::Both) {
            cfg.instance_kinds = self.kinds.clone();
        }
        cfg.engine = EngineConfig::default();
        // Checked when the file was read. The workers of a multi-process
        // cluster hold no routed experts to time a step with, so the adaptive
        // policy weighs drafts against the default cost shape.
        let speculative = self.topology.cluster.speculative.as_ref().and_then(|s| s.config().ok());
        cfg.engine.speculative = speculative.unwrap_or_default();
        cfg.cache_tiers = self.cache_tiers();
        cfg.eplb = self.topology.cluster.eplb.as_ref().map(|e| EplbConfig {
            every_steps: *e.every_steps.get_ref(),
            decay: *e.decay.get_ref(),
            redundant: e.redundant_experts,
            min_gain: *e.min_gain.get_ref(),
        });
        cfg
    }

    /// Each node's prompt-cache tiers below its pools, from `[cluster.cache]`.
    pub fn cache_tiers(&self) -> NodeCacheTiers {
        let c = self.topology.cluster.cache.clone().unwrap_or_default();
        let base = self.path.parent().unwrap_or(Path::new("."));
        let disk = c.disk_dir.as_ref().map(|d| DiskConfig {
            dir: base.join(d.get_ref()),
            capacity_bytes: c.disk_gib.get_ref().saturating_mul(1 << 30),
            weights_identity: crate::kv_disk::weights_identity(&self.model_spec(), 0),
        });
        NodeCacheTiers {
            host_bytes: usize::try_from(c.host_mib.get_ref().saturating_mul(1 << 20)).unwrap_or(usize::MAX),
            disk,
            disk_shared: c.disk_shared,
            persist: PersistRule { interval_blocks: *c.persist_interval_blocks.get_ref() as usize },
        }
    }

    /// The actors' configuration every process of the cluster shares.
    pub fn cluster_config(&self, model: &Model) -> anyhow::Result<ClusterConfig> {
        let mut cfg = self.base_config();
        if self.redundant_experts > 0 {
            let experts = model.config.n_routed_experts as u32;
            let per_instance = self.devices() / self.instances;
            let mut p = Placement::expert_parallel(experts, per_instance, self.expert_parallel)?;
            // Without load statistics the copies go to the first experts, each on the device after its last copy.
            for r in 0..self.redundant_experts as u32 {
                let e = r % experts;
                let next = (p.replicas(e).last().copied().unwrap_or(0) + 1) % per_instance;
                p = p.with_replica(e, next)?;
            }
            cfg.placement = Some(p);
        }
        Ok(cfg)
    }

    fn quic_config(&self, me: Member, identity: tls::Identity, cfg: &ClusterConfig) -> QuicConfig {
        let mut q = QuicConfig::new(me, self.nodes.clone(), cfg.node_of(), identity);
        q.heartbeat = self.heartbeat;
        q.failure_timeout = self.failure_timeout;
        q.startup_grace = self.startup_grace;
        q
    }

    /// Nodes whose address is on this machine (their IP can be bound here).
    pub fn local_nodes(&self) -> Vec<u32> {
        (0..self.nodes.len() as u32)
            .filter(|&i| {
                let ip = self.nodes[i as usize].addr.ip();
                ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
            })
            .collect()
    }
}

fn env(transport: Arc<QuicTransport>, clock: Arc<dyn Clock>) -> Env {
    let metrics = Arc::new(Metrics::default());
    // `DEEPINFER_EVENTS=1`: every actor event on standard error (what a simulation's log holds).
    let echo = std::env::var_os("DEEPINFER_EVENTS").is_some_and(|v| v != "0");
    let events = Arc::new(EventLog::new(Arc::clone(&clock), 0).echoing(echo));
    let faults = Arc::new(Faults::inert(Arc::clone(&metrics)));
    Env { transport, clock, events, metrics, faults }
}

pub(crate) fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 8);
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_all().build()?)
}

pub(crate) fn start_transport(
    plan: &ClusterPlan,
    me: Member,
    identity: tls::Identity,
    cfg: &ClusterConfig,
) -> anyhow::Result<(Arc<QuicTransport>, Arc<dyn Clock>)> {
    let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
    let events = Arc::new(EventLog::new(Arc::clone(&clock), 0));
    let t = QuicTransport::start(plan.quic_config(me, identity, cfg), Arc::clone(&clock), events, Arc::default())?;
    Ok((t, clock))
}

/// A client endpoint of the running cluster of `path`: what `generate`
/// drives instead of an in-process cluster.
pub fn connect(path: &Path, certs: Option<&Path>, model: Model) -> anyhow::Result<LocalCluster> {
    let plan = ClusterPlan::load(path)?;
    let (rt, cluster) = connect_client(&plan, certs, Arc::new(model))?;
    Ok(LocalCluster::from_runtime(rt, cluster))
}

/// A client of the running cluster of `plan`, connected on the runtime
/// returned with it (which must drive it): `generate` and the API front end.
pub fn connect_client(
    plan: &ClusterPlan,
    certs: Option<&Path>,
    model: Arc<Model>,
) -> anyhow::Result<(tokio::runtime::Runtime, Cluster)> {
    let identity = tls::load_identity(&plan.certs_dir(certs)?, CLIENT_NAME)?;
    let cfg = plan.cluster_config(&model)?;
    let rt = runtime()?;
    // Unique enough among the clients of one cluster; request ids start at index << 32.
    let index = std::process::id();
    let names: Vec<String> = plan.nodes.iter().map(|n| n.name.clone()).collect();
    let cluster = rt.block_on(async {
        let (transport, clock) = start_transport(plan, Member::Client(index), identity, &cfg)?;
        let mut members = transport.subscribe();
        let (dead_tx, dead_rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(e) = members.recv().await {
                let news = match e {
                    MemberEvent::Down { node, silent } => {
                        let name = names.get(node as usize).map_or("?", String::as_str);
                        eprintln!("client: node {name} is unreachable: silent for {} ms", silent.as_millis());
                        NodeNews { node, alive: false, seen_from: None }
                    }
                    MemberEvent::Up { node } => NodeNews { node, alive: true, seen_from: None },
                };
                let _ = dead_tx.send(news);
            }
        });
        anyhow::Ok(Cluster::connect(model, cfg, env(transport, clock), index, dead_rx)?)
    })?;
    Ok((rt, cluster))
}

/// What `deepinfer node` was asked for.
pub struct NodeOptions {
    pub topology: PathBuf,
    pub node: String,
    pub certs: Option<PathBuf>,
    /// End when standard input closes (the launcher's children).
    pub exit_with_stdin: bool,
}

/// Run one node until SIGINT/SIGTERM (or stdin closing), then stop its actors in order.
pub fn run_node(opts: &NodeOptions) -> anyhow::Result<()> {
    let plan = ClusterPlan::load(&opts.topology)?;
    let me = plan.node_index(&opts.node)?;
    let name = opts.node.clone();
    if plan.topology.nodes[me as usize].backend == Backend::Cuda {
        // The node's own machine answers whether it has a GPU, before anything loads.
        let gpu =
            deepinfer_cuda::Gpu::cuda(0).map_err(|e| anyhow::anyhow!("node `{name}`: backend = \"cuda\": {e}"))?;
        anyhow::bail!(
            "node `{name}`: backend = \"cuda\" found {}, but cluster workers run layer by layer beside expert \
             shards, which the device model does not do yet; one GPU serves with `deepinfer serve --device cuda`",
            gpu.name()
        );
    }
    let identity = tls::load_identity(&plan.certs_dir(opts.certs.as_deref())?, &name)
        .with_context(|| format!("certificates of node `{name}`"))?;
    // Workers need the dense weights; each shard reads the routed experts placed on it.
    let routed = deepinfer_engine::model::RoutedExperts::Elsewhere;
    let loaded = crate::generation::load_model_with(&plan.model_spec(), 0, None, routed)?;
    let mut cfg = plan.cluster_config(&loaded.model)?;
    // A node process started again must outrank its previous life's actors.
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    cfg.incarnation_base = (since_epoch.as_millis() as u64) << 20;
    // The schedulers build structured-output constraints over the model's tokenizer.
    let (vocab, eos) = (loaded.model.config.vocab_size, loaded.model.config.eos_token_id);
    match ConstraintFactory::new(&loaded.tokenizer, vocab, eos) {
        Ok(f) => cfg.constraints = Some(Constraints(Arc::new(f))),
        Err(e) => eprintln!("node {}: structured output disabled: {e:#}", opts.node),
    }
    let rt = runtime()?;
    let stdin_closed = opts.exit_with_stdin.then(|| {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
            let _ = tx.send(());
        });
        rx
    });
    rt.block_on(async move {
        let (transport, clock) = start_transport(&plan, Member::Node(me), identity, &cfg)?;
        let mut members = transport.subscribe();
        let mut actors =
            NodeRuntime::start(Arc::new(loaded.model), cfg.clone(), env(Arc::clone(&transport), clock), me)
                .await
                .with_context(|| format!("starting node `{name}`"))?;
        let drained = Arc::new(tokio::sync::Notify::new());
        crate::node_agent::spawn(Arc::clone(&actors.ctx), me, std::time::SystemTime::now(), Arc::clone(&drained));
        let devices = me * plan.devices_per_node..(me + 1) * plan.devices_per_node;
        if plan.encoder_nodes.contains(&me) {
            eprintln!("node {name}: listening on {} (QUIC), an image encoder", transport.local_addr());
        } else {
            eprintln!(
                "node {name}: listening on {} (QUIC), devices {}..{} of {}",
                transport.local_addr(),
                devices.start,
                devices.end,
                plan.devices()
            );
        }
        let total = plan.nodes.len();
        let mut ready = total == 1;
        if ready {
            eprintln!("node {name}: cluster ready (1/1 nodes up)");
        }
        let stdin_closed = async move {
            match stdin_closed {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::pin!(stdin_closed);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        // Suspects change between membership events too (a peer that was only late speaks again).
        let mut quorum = tokio::time::interval(plan.heartbeat);
        let why = loop {
            tokio::select! {
                _ = quorum.tick() => actors.set_suspects(transport.suspects()),
                e = members.recv() => match e {
                    Some(MemberEvent::Up { node }) => {
                        eprintln!("node {name}: node {} up", plan.nodes[node as usize].name);
                        // Back after being declared dead: its devices take work again.
                        actors.set_suspects(transport.suspects());
                        actors.node_up(node);
                        let up = transport.nodes_up().len();
                        if !ready && up == total {
                            ready = true;
                            eprintln!("node {name}: cluster ready ({up}/{total} nodes up)");
                        }
                    }
                    Some(MemberEvent::Down { node, silent }) => {
                        eprintln!(
                            "node {name}: node {} down: silent for {} ms (failure timeout {} ms)",
                            plan.nodes[node as usize].name,
                            silent.as_millis(),
                            plan.failure_timeout.as_millis()
                        );
                        actors.set_suspects(transport.suspects());
                        actors.node_down(node);
                    }
                    None => break "membership stopped".to_string(),
                },
                why = actors.gave_up() => {
                    eprintln!("node {name}: supervisors gave up: {why}");
                    actors.shutdown().await;
                    bail!("node {name}: {why}");
                }
                _ = tokio::signal::ctrl_c() => break "interrupted".to_string(),
                _ = term.recv() => break "terminated".to_string(),
                _ = &mut stdin_closed => break "launcher closed standard input".to_string(),
                _ = drained.notified() => break "drained".to_string(),
            }
        };
        eprintln!("node {name}: stopping ({why})");
        let m = actors.ctx.metrics.snapshot();
        actors.shutdown().await;
        eprintln!(
            "node {name}: stopped; its workers ran {} passes, its shards answered {} expert dispatches",
            m.passes, m.dispatches_answered
        );
        Ok(())
    })
}

/// Wait up to `wait` until the nodes `transport` sees up satisfy `done`;
/// the nodes up then, whether it did or not.
pub(crate) async fn wait_for_members(
    transport: &QuicTransport,
    wait: Duration,
    done: impl Fn(&[u32]) -> bool,
) -> Vec<u32> {
    let _ = tokio::time::timeout(wait, async {
        while !done(&transport.nodes_up()) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    transport.nodes_up()
}

/// Connect as a client, wait up to `wait` for every node to answer, ask
/// each for its status and print one line per node; true when all are up.
pub fn status(path: &Path, certs: Option<&Path>, wait: Duration) -> anyhow::Result<bool> {
    let plan = ClusterPlan::load(path)?;
    let identity = tls::load_identity(&plan.certs_dir(certs)?, CLIENT_NAME)?;
    let cfg = plan.base_config();
    let rt = runtime()?;
    let index = std::process::id();
    let (up, reports, heard) = rt.block_on(async {
        let (transport, _) = start_transport(&plan, Member::Client(index), identity, &cfg)?;
        let total = plan.nodes.len();
        let up = wait_for_members(&transport, wait, |up| up.len() == total).await;
        let reports = crate::node_agent::query(&*transport, Addr::client(index), &up, wait).await;
        let heard: Vec<Option<Duration>> = (0..total as u32).map(|n| transport.heard_ago(n)).collect();
        deepinfer_actors::net::transport::Transport::close(&*transport);
        anyhow::Ok((up, reports, heard))
    })?;
    println!(
        "cluster {}: {}/{} nodes up, {} devices, {} instance(s), expert parallel {}",
        plan.name(),
        up.len(),
        plan.nodes.len(),
        plan.devices(),
        plan.instances,
        plan.expert_parallel
    );
    for (i, n) in plan.nodes.iter().enumerate() {
        let node = i as u32;
        match reports.get(&node) {
            Some(s) => println!("  {}", crate::node_agent::status_line(&n.name, s, heard[i])),
            None => {
                let state = if up.contains(&node) { "up (no report)" } else { "unreachable" };
                let first = node * plan.devices_per_node;
                println!("  {:<10} {state}  {}  devices {}..{}", n.name, n.addr, first, first + plan.devices_per_node);
            }
        }
    }
    Ok(up.len() == plan.nodes.len())
}
