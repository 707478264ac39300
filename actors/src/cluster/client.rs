//! The client of a cluster: submits requests to a router, relays their
//! outputs in order as [`Update`]s, resubmits what made no progress, follows
//! membership to a live router, and (as a client of other processes) tells
//! its router it is alive.

use super::*;

#[path = "client_outputs.rs"]
mod outputs;

/// How a router's answer begins when it ends a new request for want of an
/// instance (`RouterMachine::decide`), and how this client says the same.
const NO_INSTANCE_UP: &str = "no serving instance is up";

struct Outstanding {
    spec: RequestSpec,
    tokens: Vec<u32>,
    cancelled: bool,
    attempts: u32,
    deadline: Duration,
}

/// The client of a running cluster.
pub struct Cluster {
    ctx: Arc<Ctx>,
    addr: Addr,
    inbox: Inbox,
    /// The supervision tree, when this process runs it.
    root: Option<(ActorRef<SupervisorMsg>, JoinHandle<()>)>,
    down_rx: mpsc::UnboundedReceiver<String>,
    /// Nodes membership declared dead, as they are heard of.
    nodes_rx: mpsc::UnboundedReceiver<NodeNews>,
    /// Per node: who declared it dead (`None`: this client's own membership).
    declared: BTreeMap<u32, BTreeSet<Option<u32>>>,
    /// An in-process client's node, whose membership it trusts as its own.
    attached: Option<u32>,
    /// Nodes this client holds dead: its own membership said so, or most of the other nodes did.
    down_nodes: BTreeSet<u32>,
    /// The node whose router this client submits to.
    router: u32,
    /// `down` says every router node is dead: a router node's return ends it.
    routers_lost: bool,
    /// A client of other processes tells its router it is alive this often
    /// (so that the requests of one that vanished are cancelled), next at `next_keepalive`.
    keepalive: Option<Duration>,
    next_keepalive: Duration,
    down: Option<String>,
    /// Why no instance can take a new request as this client sees the
    /// nodes: every instance of a needed role has its scheduler's node dead.
    unservable: Option<String>,
    /// The router in use ended a new request because no instance was up for
    /// it (draining instances, which only routers know of, included); held
    /// until something says otherwise: tokens, a node back, another router.
    router_unserved: Option<String>,
    next_id: u64,
    outstanding: BTreeMap<u64, Outstanding>,
    /// Every outstanding request's deadline, earliest first.
    deadlines: BTreeSet<(Duration, u64)>,
    ready: VecDeque<Update>,
    /// The last status report of each node asked (`ask_status`).
    statuses: BTreeMap<u32, crate::wire::NodeStatus>,
}

impl Cluster {
    /// Check the configuration and start the supervision tree and every actor.
    pub async fn start(model: Arc<Model>, cfg: ClusterConfig, env: Env) -> Result<Self, ClusterError> {
        let ctx = build_ctx(model, &cfg, env)?;
        let topo = ctx.topology.clone();
        let addr = Addr::client(0);
        let inbox = ctx.transport.bind(addr);
        let (tx, down_rx) = mpsc::unbounded_channel();
        let (news, nodes_rx) = mpsc::unbounded_channel::<NodeNews>();
        let _ = ctx.node_news.set(news);
        let (root, root_done) = start_tree(&ctx, &cfg, 0..topo.nodes(), tx).await?;
        ctx.events.record(format_args!(
            "cluster up: {} devices, {} instances, expert parallel {}, {} nodes, {} transport",
            cfg.devices,
            topo.instances,
            cfg.expert_parallel,
            topo.nodes(),
            ctx.transport.name()
        ));
        let mut client = Self::client(ctx, addr, inbox, Some((root, root_done)), (down_rx, nodes_rx), 0);
        client.attached = Some(cfg.client_node);
        Ok(client)
    }

    /// A client of a cluster whose actors run elsewhere (other processes,
    /// reached through `env.transport`), with address `Addr::client(index)`;
    /// request ids start at `index << 32` so clients do not collide.
    /// `dead_nodes` says which nodes membership declared dead: a dead
    /// router's place goes to the next router node's, and every request is
    /// submitted there again; with none left every request ends with an error.
    pub fn connect(
        model: Arc<Model>,
        cfg: ClusterConfig,
        env: Env,
        index: u32,
        dead_nodes: mpsc::UnboundedReceiver<NodeNews>,
    ) -> Result<Self, ClusterError> {
        let ctx = build_ctx(model, &cfg, env)?;
        let addr = Addr::client(index);
        let inbox = ctx.transport.bind(addr);
        // Nothing else can take the cluster down under a client of other processes.
        let (_, never) = mpsc::unbounded_channel();
        let keepalive = ctx.timeouts.request / 4;
        let mut client = Self::client(ctx, addr, inbox, None, (never, dead_nodes), (index as u64) << 32);
        client.keepalive = Some(keepalive);
        Ok(client)
    }

    /// Another client at `Addr::client(index)` that sends keepalives as a front end of another
    /// process does (routers cancel its requests once it is silent); it hears no membership news.
    pub fn front_end(&self, index: u32) -> Self {
        assert!(index > 0, "client 0 is the cluster's own");
        let (addr, quiet) = (Addr::client(index), (mpsc::unbounded_channel().1, mpsc::unbounded_channel().1));
        let inbox = self.ctx.transport.bind(addr);
        let mut client = Self::client(Arc::clone(&self.ctx), addr, inbox, None, quiet, (index as u64) << 32);
        client.keepalive = Some(self.ctx.timeouts.request / 4);
        client.attached = self.attached;
        client
    }

    fn client(
        ctx: Arc<Ctx>,
        addr: Addr,
        inbox: Inbox,
        root: Option<(ActorRef<SupervisorMsg>, JoinHandle<()>)>,
        (down_rx, nodes_rx): (mpsc::UnboundedReceiver<String>, mpsc::UnboundedReceiver<NodeNews>),
        first_id: u64,
    ) -> Self {
        Self {
            ctx,
            addr,
            inbox,
            root,
            down_rx,
            nodes_rx,
            declared: BTreeMap::new(),
            attached: None,
            down_nodes: BTreeSet::new(),
            router: 0,
            routers_lost: false,
            keepalive: None,
            next_keepalive: Duration::ZERO,
            down: None,
            unservable: None,
            router_unserved: None,
            next_id: first_id,
            outstanding: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            ready: VecDeque::new(),
            statuses: BTreeMap::new(),
        }
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        self.ctx.metrics.snapshot()
    }

    /// The cluster's clock (virtual in simulation).
    pub fn clock(&self) -> Arc<dyn Clock> {
        Arc::clone(&self.ctx.clock)
    }

    pub fn topology(&self) -> &Topology {
        &self.ctx.topology
    }

    /// The modelled devices' figures, in a modelled simulation.
    pub fn modelled(&self) -> Option<Arc<Modelled>> {
        self.ctx.modelled.clone()
    }

    /// Each instance's KV use, running and waiting requests after its last step.
    pub fn gauges(&self) -> &[InstanceGauges] {
        self.ctx.durable.gauges()
    }

    /// Simulation only: `node`'s process dies and starts again at once, as
    /// `kill -9` and a new `deepinfer node` do. Its actors start afresh
    /// from what a new process holds ([`crate::cluster::durable::Durable::restart_process`]).
    pub fn restart_process(&self, node: u32) {
        self.ctx.events.record(format_args!("fault: node{node}'s process restarts"));
        self.ctx.durable.restart_process(node);
        bump(&self.ctx.metrics.kills_injected);
        self.ctx.kill(&format!("node{node}"));
    }

    /// Crash the actor at `path` (`node3`, `node0/worker2`), as a fault would: its supervisor restarts it.
    pub fn kill(&self, path: &str) {
        self.ctx.events.record(format_args!("fault: kill {path}"));
        bump(&self.ctx.metrics.kills_injected);
        self.ctx.kill(path);
    }

    /// Record a line in the event log (and its digest).
    pub fn record(&self, line: std::fmt::Arguments<'_>) {
        self.ctx.events.record(line);
    }

    /// The current expert placement of `instance`.
    pub fn placement(&self, instance: u32) -> Placement {
        self.ctx.durable.placement(self.ctx.topology.home_node(instance), instance)
    }

    /// Steps started by all schedulers.
    pub fn steps(&self) -> u64 {
        self.ctx.durable.total_steps()
    }

    /// Requests submitted and not yet reported finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// Requests still running, or updates not yet taken by [`Self::next_update`].
    pub fn has_updates(&self) -> bool {
        !self.outstanding.is_empty() || !self.ready.is_empty()
    }

    /// Why the cluster cannot serve a new request, if it cannot: it went
    /// down, every instance's scheduler node is dead, or the router said
    /// no instance is up (every one down or draining, as it sees them).
    pub fn down_reason(&self) -> Option<&str> {
        self.down.as_deref().or(self.unservable.as_deref()).or(self.router_unserved.as_deref())
    }

    /// Follow what an update says about the router's view of the instances.
    fn note_serving(&mut self, u: &Update) {
        match u {
            Update::Tokens { tokens, .. } if !tokens.is_empty() => self.router_unserved = None,
            Update::Finished { finished, .. } => match &finished.reason {
                FinishReason::Error(e) if e.starts_with(NO_INSTANCE_UP) => self.router_unserved = Some(e.clone()),
                FinishReason::Error(_) => {}
                _ => self.router_unserved = None,
            },
            _ => {}
        }
    }

    /// Whether an instance of each role a request needs (one that prefills,
    /// one that decodes) has its scheduler on a node this client holds
    /// alive: routers hold an instance down with its scheduler's node.
    fn check_instances(&mut self) {
        let topo = &self.ctx.topology;
        let live = |i: &u32| !self.down_nodes.contains(&topo.home_node(*i));
        let has = |f: fn(InstanceKind) -> bool| (0..topo.instances).filter(live).any(|i| f(self.ctx.kind(i)));
        self.unservable = if has(InstanceKind::prefills) && has(InstanceKind::decodes) {
            None
        } else {
            let homes: BTreeSet<u32> = (0..topo.instances).map(|i| topo.home_node(i)).collect();
            let dead: Vec<u32> = homes.into_iter().filter(|n| self.down_nodes.contains(n)).collect();
            Some(format!("{NO_INSTANCE_UP}: the schedulers' nodes {dead:?} are declared dead by membership"))
        };
    }

    fn send_submit(&self, o: &Outstanding) {
        let msg = if o.cancelled {
            Message::Cancel { id: o.spec.id }
        } else {
            Message::Submit(Submit { spec: o.spec.clone(), generated: o.tokens.clone(), decode: None, encoder: None })
        };
        self.ctx.send(self.addr, Addr::router(self.router), msg, &[]);
    }

    /// Submit a request; its id names it in every [`Update`].
    pub fn submit(&mut self, request: Request) -> u64 {
        self.submit_constrained(request, None)
    }

    /// Submit a request whose output must match `constraint` (a description
    /// the cluster's [`Constraints`] build from). A request the cluster
    /// cannot run gets an [`Update::Refused`] naming why.
    pub fn submit_constrained(&mut self, request: Request, constraint: Option<String>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let spec = RequestSpec {
            id,
            prompt: request.prompt,
            max_tokens: request.max_tokens.min(u32::MAX as usize) as u32,
            sampling: crate::proto::sampling_wire(&request.params),
            stop_token_ids: request.stop_token_ids,
            stop_sequences: request.stop_sequences,
            ignore_eos: request.ignore_eos,
            logits: request.return_logits || self.ctx.return_logits,
            constraint,
            retention: request.retention.map(|r| crate::wire::RetentionWire { ttl_ms: r.ttl_ms, persist: r.persist }),
            priority: request.priority,
            images: crate::proto::images::images_wire(&request.images),
        };
        if let Some(reason) = outputs::oversized(&spec) {
            self.ready.push_back(Update::Refused { id, reason });
            return id;
        }
        let deadline = self.ctx.clock.now() + self.ctx.timeouts.request;
        let o = Outstanding { spec, tokens: Vec::new(), cancelled: false, attempts: 0, deadline };
        self.send_submit(&o);
        self.deadlines.insert((o.deadline, id));
        self.outstanding.insert(id, o);
        id
    }

    /// Stop generating for `id`; its `Finished` update still comes (tokens after this call are not reported).
    pub fn cancel(&mut self, id: u64) {
        if let Some(o) = self.outstanding.get_mut(&id) {
            o.cancelled = true;
            let o = &self.outstanding[&id];
            self.send_submit(o);
        }
    }

    /// Ask every router to route nothing new to the instances with devices
    /// on `node` until it restarts (the first step of a drain; their
    /// acknowledgements are for `deepinfer drain`, which waits for them).
    pub fn drain(&mut self, node: u32) {
        self.ctx.events.record(format_args!("client drains node{node}"));
        for r in 0..self.ctx.routers {
            let msg = Message::Control(crate::wire::Control::Drain { node, nonce: u64::from(self.addr.index) });
            self.ctx.send(self.addr, Addr::router(r), msg, &[]);
        }
    }

    /// Move request `id`'s deadline to `at`.
    fn set_deadline(&mut self, id: u64, at: Duration) {
        if let Some(o) = self.outstanding.get_mut(&id) {
            self.deadlines.remove(&(o.deadline, id));
            o.deadline = at;
            self.deadlines.insert((at, id));
        }
    }

    fn forget(&mut self, id: u64) -> Option<Outstanding> {
        let o = self.outstanding.remove(&id)?;
        self.deadlines.remove(&(o.deadline, id));
        Some(o)
    }

    fn end(&mut self, id: u64, reason: FinishReason) {
        if let Some(o) = self.forget(id) {
            let finished = Finished {
                reason,
                prompt_tokens: o.spec.prompt.len(),
                completion_tokens: o.tokens.len(),
                cached_tokens: 0,
                cached_tokens_by_tier: [0; 3],
                preemptions: 0,
            };
            self.ready.push_back(Update::Finished { id, finished });
        }
    }

    /// The next update of any outstanding request; `None` when none is left.
    /// Never waits forever: silence past the request timeouts, or a cluster
    /// whose supervisors gave up, ends requests with an error.
    pub async fn next_update(&mut self) -> Option<Update> {
        loop {
            if let Some(u) = self.ready.pop_front() {
                self.note_serving(&u);
                return Some(u);
            }
            if self.outstanding.is_empty() {
                return None;
            }
            // Here too: a caller may drop this future before its timer fires.
            self.keep_alive();
            if let Some(why) = self.down.clone() {
                let ids: Vec<u64> = self.outstanding.keys().copied().collect();
                for id in ids {
                    self.end(id, FinishReason::Error(format!("cluster down: {why}")));
                }
                continue;
            }
            let mut deadline = self.deadlines.first().expect("one per outstanding request").0;
            if self.keepalive.is_some() {
                deadline = deadline.min(self.next_keepalive);
            }
            let wait = deadline.saturating_sub(self.ctx.clock.now());
            tokio::select! {
                biased;
                Some(why) = self.down_rx.recv() => {
                    self.ctx.events.record(format_args!("client: cluster down: {why}"));
                    self.down = Some(why);
                    continue;
                }
                Some(news) = self.nodes_rx.recv() => {
                    self.on_node_news(news);
                    continue;
                }
                d = self.inbox.recv() => {
                    let Some(d) = d else {
                        self.down = Some("transport closed".into());
                        continue;
                    };
                    if let Some(m) = self.ctx.open(self.addr, &d) {
                        self.on_message(m.envelope.from, m.envelope.msg, m.body);
                    }
                }
                _ = self.ctx.clock.sleep(wait) => {}
            }
            self.check_deadlines();
            self.keep_alive();
        }
    }

    /// Tell the router in use that this client is alive, when it is time.
    fn keep_alive(&mut self) {
        let (Some(every), now) = (self.keepalive, self.ctx.clock.now()) else { return };
        if now >= self.next_keepalive {
            self.next_keepalive = now + every;
            let hb = Heartbeat { incarnation: 0, restarted: false, time_ns: now.as_nanos() as u64 };
            self.ctx.send(self.addr, Addr::router(self.router), Message::Heartbeat(hb), &[]);
        }
    }

    /// Submit every outstanding request again, with the tokens it has, to
    /// the router in use (which may know nothing of them).
    fn resubmit_all(&mut self) {
        // Another router, or a new one: what the last one said of the instances is stale.
        self.router_unserved = None;
        let deadline = self.ctx.clock.now() + self.ctx.timeouts.request;
        self.ctx.events.record(format_args!(
            "client resubmits {} requests to router{}",
            self.outstanding.len(),
            self.router
        ));
        for o in self.outstanding.values_mut() {
            o.deadline = deadline;
        }
        self.deadlines = self.outstanding.keys().map(|&id| (deadline, id)).collect();
        for o in self.outstanding.values() {
            bump(&self.ctx.metrics.submits_resent);
            self.send_submit(o);
        }
    }

    /// Whether what was declared of `node` makes it dead to this client: its
    /// own membership (or an in-process client's node) says so, or most nodes do.
    fn holds_dead(&self, node: u32) -> bool {
        let Some(witnesses) = self.declared.get(&node) else { return false };
        let own = witnesses.contains(&None) || self.attached.is_some_and(|n| witnesses.contains(&Some(n)));
        own || witnesses.len() * 2 > self.ctx.topology.nodes() as usize
    }

    /// A membership declared a node dead. The client holds it dead when its
    /// own membership says so, or most of the nodes do (a node cut off alone
    /// declares every other one dead). If it ran the router in
    /// use, the next router node's takes over (with every request submitted
    /// again); with none left, the cluster is down for this client.
    fn on_node_news(&mut self, news: NodeNews) {
        if news.alive {
            // A node back may end a drain or bring a scheduler back: ask the routers again.
            self.router_unserved = None;
        }
        self.follow_routers(news);
        self.check_instances();
    }

    fn follow_routers(&mut self, news: NodeNews) {
        assert!(news.node < self.ctx.topology.nodes(), "membership names a node of the cluster");
        let node = news.node;
        if news.alive {
            // Back: usable again if its router is needed (the one in use stays).
            if let Some(w) = self.declared.get_mut(&node) {
                w.remove(&news.seen_from);
            }
            if !self.holds_dead(node) {
                self.down_nodes.remove(&node);
                if self.routers_lost && node < self.ctx.routers {
                    // Every router was gone; this one is back: serve again through it.
                    self.ctx.events.record(format_args!("client: router{node} is back"));
                    self.routers_lost = false;
                    self.down = None;
                    self.router = node;
                    self.resubmit_all();
                }
            }
            return;
        }
        self.declared.entry(node).or_default().insert(news.seen_from);
        if !self.holds_dead(node) || !self.down_nodes.insert(node) || node != self.router {
            return;
        }
        match (0..self.ctx.routers).find(|n| !self.down_nodes.contains(n)) {
            Some(next) => {
                self.ctx.events.record(format_args!("client: router{node} is gone, router{next} takes over"));
                self.router = next;
                self.resubmit_all();
            }
            None => {
                let why = format!(
                    "every router node is unreachable (nodes 0..{} declared dead by membership)",
                    self.ctx.routers
                );
                self.ctx.events.record(format_args!("client: cluster down: {why}"));
                self.down = Some(why);
                self.routers_lost = true;
            }
        }
    }

    /// Take the membership news that arrived, without waiting: a client
    /// with nothing outstanding still follows the routers (and can say
    /// whether the cluster is reachable, [`Self::down_reason`]).
    pub fn poll_news(&mut self) {
        while let Ok(news) = self.nodes_rx.try_recv() {
            self.on_node_news(news);
        }
        // Frames that came while nothing waited for them (status reports, late outputs).
        while let Some(d) = self.inbox.try_recv() {
            if let Some(m) = self.ctx.open(self.addr, &d) {
                self.on_message(m.envelope.from, m.envelope.msg, m.body);
            }
        }
        if let Ok(why) = self.down_rx.try_recv() {
            self.ctx.events.record(format_args!("client: cluster down: {why}"));
            self.down = Some(why);
        }
    }

    fn check_deadlines(&mut self) {
        let now = self.ctx.clock.now();
        // In id order, as before the deadlines were indexed.
        let mut late: Vec<u64> = self.deadlines.range(..=(now, u64::MAX)).map(|&(_, id)| id).collect();
        late.sort_unstable();
        for id in late {
            self.set_deadline(id, now + self.ctx.timeouts.request);
            let o = self.outstanding.get_mut(&id).expect("listed");
            o.attempts += 1;
            if o.attempts > self.ctx.timeouts.request_attempts {
                let why = format!(
                    "router{} made no progress on request {id} after {} attempts",
                    self.router, self.ctx.timeouts.request_attempts
                );
                self.ctx.events.record(format_args!("client: {why}"));
                self.end(id, FinishReason::Error(why));
                continue;
            }
            bump(&self.ctx.metrics.submits_resent);
            let o = &self.outstanding[&id];
            self.send_submit(o);
        }
    }

    /// Generate for every request; each ends with its tokens or with why it could not.
    pub async fn generate(&mut self, requests: &[Request]) -> Vec<Result<Generated, RequestFailed>> {
        let mut slots: BTreeMap<u64, usize> = BTreeMap::new();
        for (i, r) in requests.iter().enumerate() {
            slots.insert(self.submit(r.clone()), i);
        }
        let mut out: Vec<Generated> = vec![Generated::default(); requests.len()];
        let mut results: Vec<Option<Result<Generated, RequestFailed>>> = vec![None; requests.len()];
        while let Some(u) = self.next_update().await {
            match u {
                Update::Tokens { id, tokens, .. } => {
                    let Some(&i) = slots.get(&id) else { continue };
                    let g = &mut out[i];
                    for t in tokens {
                        g.tokens.push(t.token);
                        g.logprobs.push(t.logprob);
                        g.top.push(t.top);
                        if let Some(l) = t.logits {
                            g.logits.push(l);
                        }
                    }
                }
                Update::Finished { id, finished } => {
                    let Some(&i) = slots.get(&id) else { continue };
                    let g = std::mem::take(&mut out[i]);
                    results[i] = Some(match &finished.reason {
                        FinishReason::Error(e) => Err(RequestFailed { reason: e.clone(), tokens: g.tokens }),
                        _ => Ok(Generated { finished: Some(finished), ..g }),
                    });
                }
                Update::Refused { id, reason } => {
                    let Some(&i) = slots.get(&id) else { continue };
                    results[i] = Some(Err(RequestFailed { reason, tokens: Vec::new() }));
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(RequestFailed { reason: "not run".into(), tokens: Vec::new() })))
            .collect()
    }

    /// Stop the tree in order and close the transport.
    pub async fn shutdown(self) {
        if let Some((root, done)) = self.root {
            let _ = root.send_message(SupervisorMsg::Shutdown);
            let _ = done.await;
        }
        self.ctx.transport.close();
    }
}
