// tidy: long file: the router actor, still logic and shell in one; its protocol machine moves to actors/src/proto.
//! Router: the entry point. It picks a serving instance for each new
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
    choose_decode, choose_prefill, prefill_cost, DecodeCandidate, DecodePolicy, Health, PrefillCandidate,
    PrefillPolicy, RoundRobin,
};
use deepinfer_engine::kv_pool::KvLayout;
use deepinfer_engine::prefix_cache::{block_hash, PrefixMode};
use deepinfer_engine::scheduler::Scheduler as Policy;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cluster::ctx::Ctx;
use crate::cluster::disagg::PrefillRouting;
use crate::modelled::tiers::SimTier;
use crate::net::transport::pump;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::wire::{
    Addr, CacheMsg, FinishKind, FinishWire, HandoffMsg, Heartbeat, Message, OutputEnd, OutputItem, Outputs,
    RequestSpec, Role, Submit,
};

pub struct Router;

pub struct RouterArgs {
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum RouterMsg {
    Net(Delivery),
    Tick,
}

struct Flight {
    spec: RequestSpec,
    instance: u32,
    /// Prompt tokens cached on its instance when it was routed.
    cached_tokens: usize,
    /// At a prefill instance: the decode instance it is to move to.
    decode: Option<u32>,
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
    matched: BTreeMap<u32, u32>,
    deadline: Duration,
}

pub struct RouterState {
    addr: Addr,
    flights: BTreeMap<u64, Flight>,
    routing: BTreeMap<u64, Routing>,
    next_query: u64,
    ticker: Option<JoinHandle<()>>,
    /// KV sizes, for the decode balancer's view of each instance's use.
    layout: Option<KvLayout>,
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
        preemptions: 0,
    };
    OutputItem { id, from: from as u32, tokens: Vec::new(), logits: false, end: Some(OutputEnd::Finished(finished)) }
}

impl RouterState {
    fn now(&self) -> Duration {
        self.ctx.clock.now()
    }

    fn to_client(&self, client: Addr, items: Vec<OutputItem>, body: &[f32]) {
        if !items.is_empty() {
            self.ctx.send(self.addr, client, Message::Outputs(Outputs { items }), body);
        }
    }

    fn forward(&self, f: &Flight) {
        let msg = if f.cancelled {
            Message::Cancel { id: f.spec.id }
        } else {
            Message::Submit(Submit { spec: f.spec.clone(), generated: f.tokens.clone(), decode: f.decode })
        };
        self.ctx.send(self.addr, Addr::scheduler(f.instance), msg, &[]);
    }

    fn on_submit(&mut self, client: Addr, submit: Submit) {
        let id = submit.spec.id;
        self.ctx.send(self.addr, client, Message::Ack { ids: vec![id] }, &[]);
        let deadline = self.now() + self.ctx.timeouts.request;
        if let Some(f) = self.flights.get_mut(&id) {
            // The client's tokens are authoritative: fewer means an output was lost on the way to it.
            if !f.cancelled {
                f.tokens = submit.generated;
            }
            f.client = client;
            f.deadline = deadline;
            let f = &self.flights[&id];
            self.forward(f);
            return;
        }
        if self.routing.values().any(|r| r.submit.spec.id == id) {
            return;
        }
        let topo = &self.ctx.topology;
        let chain = prompt_chain(&submit.spec.prompt, self.ctx.block_tokens);
        let query = self.next_query;
        self.next_query += 1;
        let mut routing = Routing {
            submit,
            client,
            waiting: BTreeSet::new(),
            matched: BTreeMap::new(),
            deadline: self.now() + self.ctx.timeouts.control,
        };
        if topo.instances > 1 && self.ctx.engine.prefix_mode != PrefixMode::Off && !chain.is_empty() {
            let tokens = routing.submit.spec.prompt[..chain.len() * self.ctx.block_tokens].to_vec();
            for node in (0..topo.nodes()).filter(|&n| !topo.instances_on(n).is_empty()) {
                let ask = CacheMsg::Lookup { query, hashes: chain.clone(), tokens: tokens.clone() };
                self.ctx.send(self.addr, Addr::cache(node), Message::Cache(ask), &[]);
                routing.waiting.insert(node);
            }
            bump(&self.ctx.metrics.lookups);
        }
        self.routing.insert(query, routing);
        if self.routing[&query].waiting.is_empty() {
            self.decide(query);
        }
    }

    /// Modelled tiers below the device: a prefix continuing in an instance's
    /// host memory, its node's disk or the shared store is read while the
    /// request waits, not recomputed, so it counts as cached, a little less
    /// than on the device (the fastest tier wins a tie, and the shared store,
    /// which every instance sees, favours none).
    fn count_lower_tiers(&self, prompt: &[u32], matched: &BTreeMap<u32, u32>, candidates: &mut [PrefillCandidate]) {
        let Some(tiers) = self.ctx.modelled.as_ref().and_then(|m| m.tiers.as_ref()) else { return };
        let chain = prompt_chain(prompt, self.ctx.block_tokens);
        let now_ms = self.now().as_millis() as u64;
        for (i, c) in candidates.iter_mut().enumerate() {
            let start = matched.get(&(i as u32)).copied().unwrap_or(0) as usize;
            let mut worth = 0.0;
            for k in start..chain.len() {
                let parent = if k == 0 { 0 } else { chain[k - 1] };
                let Some(tier) = tiers.locate(i as u32, now_ms, chain[k], parent) else { break };
                worth += match tier {
                    SimTier::Device | SimTier::Host => 0.98,
                    SimTier::Disk => 0.95,
                    SimTier::Shared => 0.9,
                };
            }
            c.cached_tokens += (worth * self.ctx.block_tokens as f64) as usize;
        }
    }

    /// The engine's prefill balancer over what the router knows: prompts
    /// that have produced no token yet are the queued prefill work.
    fn decide(&mut self, query: u64) {
        let Some(r) = self.routing.remove(&query) else { return };
        let topo = &self.ctx.topology;
        let policy = PrefillPolicy::default();
        let mut candidates: Vec<PrefillCandidate> = (0..topo.instances)
            .map(|i| PrefillCandidate {
                health: if self.ctx.is_lost(0, topo.devices_of(i).start) {
                    Health::Down
                } else if self.ctx.kind(i).prefills() {
                    Health::Up
                } else {
                    Health::Draining
                },
                gpus: topo.devices_of(i).len() as u32,
                queued_cost: 0.0,
                requests: 0,
                cached_tokens: r.matched.get(&i).copied().unwrap_or(0) as usize * self.ctx.block_tokens,
            })
            .collect();
        self.count_lower_tiers(&r.submit.spec.prompt, &r.matched, &mut candidates);
        for f in self.flights.values() {
            let Some(c) = candidates.get_mut(f.instance as usize) else { continue };
            c.requests += 1;
            if f.tokens.is_empty() {
                let prompt = f.spec.prompt.len();
                let cached = f.cached_tokens.min(prompt.saturating_sub(1));
                c.queued_cost += prefill_cost(prompt - cached, cached, policy.attention_tokens);
            }
        }
        let instance = match self.ctx.prefill_routing {
            PrefillRouting::CacheAffinity => choose_prefill(&policy, &candidates, r.submit.spec.prompt.len()),
            PrefillRouting::RoundRobin => {
                self.round_robin.choose(&candidates.iter().map(|c| c.health).collect::<Vec<_>>())
            }
        }
        .unwrap_or(0) as u32;
        let cached_tokens = candidates.get(instance as usize).map_or(0, |c| c.cached_tokens);
        let decode = (!self.ctx.kind(instance).decodes()).then(|| self.choose_decode(None)).flatten();
        let id = r.submit.spec.id;
        self.ctx.events.record(format_args!(
            "router sends request {id} to scheduler{instance} ({} cached blocks)",
            r.matched.get(&instance).copied().unwrap_or(0)
        ));
        let f = Flight {
            spec: r.submit.spec,
            instance,
            cached_tokens,
            decode,
            prefilled_on: None,
            tokens: r.submit.generated,
            client: r.client,
            cancelled: false,
            attempts: 0,
            deadline: self.now() + self.ctx.timeouts.request,
        };
        self.forward(&f);
        self.flights.insert(id, f);
    }

    /// The engine's decode balancer over the router's view: requests and
    /// their KV per instance; `exclude` (a failed transfer's target) only if
    /// another instance decodes.
    fn choose_decode(&self, exclude: Option<u32>) -> Option<u32> {
        let topo = &self.ctx.topology;
        let first = self.ctx.engine_for(0);
        let policy =
            DecodePolicy { max_requests_per_gpu: (first.max_batch_size as u32).div_ceil(topo.size_of(0).max(1)) };
        let mut candidates: Vec<DecodeCandidate> = (0..topo.instances)
            .map(|i| DecodeCandidate {
                health: if self.ctx.is_lost(0, topo.devices_of(i).start) {
                    Health::Down
                } else if self.ctx.kind(i).decodes() {
                    Health::Up
                } else {
                    Health::Draining
                },
                gpus: topo.size_of(i).max(1),
                kv_used: 0,
                kv_capacity: self.ctx.engine_for(i).kv_budget_bytes as u64,
                requests: 0,
            })
            .collect();
        for f in self.flights.values() {
            let Some(c) = candidates.get_mut(f.decode.unwrap_or(f.instance) as usize) else { continue };
            c.requests += 1;
            let tokens = f.spec.prompt.len() + f.tokens.len();
            c.kv_used += self.layout.as_ref().map_or(0, |l| l.sequence_bytes(tokens)) as u64;
        }
        let pick = |c: &[DecodeCandidate]| choose_decode(&policy, c, 0).map(|i| i as u32);
        let fallback = pick(&candidates);
        if let Some(c) = exclude.and_then(|x| candidates.get_mut(x as usize)) {
            c.health = Health::Down;
        }
        pick(&candidates).or(fallback)
    }

    /// The decode instance took the request over from its prefill instance.
    fn on_adopted(&mut self, id: u64, instance: u32) {
        let now = self.now();
        let Some(f) = self.flights.get_mut(&id) else {
            // Cancelled (or ended) while its state was on the way: stop it there.
            self.ctx.send(self.addr, Addr::scheduler(instance), Message::Cancel { id }, &[]);
            return;
        };
        if f.decode != Some(instance) && f.instance != instance {
            return;
        }
        if f.instance != instance {
            f.prefilled_on = Some(f.instance);
            f.instance = instance;
        }
        f.decode = None;
        f.attempts = 0;
        f.deadline = now + self.ctx.timeouts.request;
        self.ctx.events.record(format_args!("router: request {id} decodes on scheduler{instance}"));
        if f.cancelled {
            let f = &self.flights[&id];
            self.forward(f);
        }
    }

    /// The prefill instance could not move the request: another decode instance recomputes it.
    fn on_reroute(&mut self, from: u32, id: u64, failed: u32) {
        let now = self.now();
        if self.flights.get(&id).is_none_or(|f| f.instance != from) {
            return;
        }
        let target = self.choose_decode(Some(failed)).unwrap_or(failed);
        let f = self.flights.get_mut(&id).expect("checked");
        f.prefilled_on = Some(from);
        f.instance = target;
        f.decode = None;
        f.attempts = 0;
        f.deadline = now + self.ctx.timeouts.request;
        self.ctx.events.record(format_args!("router: request {id} rerouted to scheduler{target}"));
        bump(&self.ctx.metrics.submits_resent);
        let f = &self.flights[&id];
        self.forward(f);
    }

    fn on_outputs(&mut self, from: Addr, out: Outputs, body: Vec<f32>) {
        let vocab = self.ctx.config.vocab_size;
        let rows: usize = out.items.iter().filter(|i| i.logits).map(|i| i.tokens.len()).sum();
        if rows * vocab != body.len() {
            bump(&self.ctx.metrics.frames_rejected);
            self.ctx.events.record(format_args!("router rejects outputs of {from}: body does not match"));
            return;
        }
        let now = self.now();
        let mut by_client: BTreeMap<Addr, (Vec<OutputItem>, Vec<f32>)> = BTreeMap::new();
        let mut at = 0;
        for item in out.items {
            let n = if item.logits { item.tokens.len() * vocab } else { 0 };
            let logits = &body[at..at + n];
            at += n;
            let id = item.id;
            // Not ours (any more): output of an earlier router's request, or
            // of a request routed again. It is not cancelled: the request may
            // be running there again by now; it ends by itself.
            let mine = |f: &&mut Flight| {
                f.instance == from.index || f.decode == Some(from.index) || f.prefilled_on == Some(from.index)
            };
            let Some(f) = self.flights.get_mut(&id).filter(mine) else { continue };
            let cancelled = matches!(&item.end, Some(OutputEnd::Finished(w)) if w.reason == FinishKind::Cancelled);
            if cancelled && !f.cancelled {
                // A scheduler's answer to a cancel meant for an earlier life of the request.
                continue;
            }
            let (have, start) = (f.tokens.len(), item.from as usize);
            if start > have {
                // A gap: something was lost on the way; ask for it again.
                self.ctx.events.record(format_args!("router missed output {have}..{start} of request {id}"));
                bump(&self.ctx.metrics.submits_resent);
                f.deadline = now + self.ctx.timeouts.request;
                let f = &self.flights[&id];
                self.forward(f);
                continue;
            }
            let skip = have - start;
            if skip > item.tokens.len() {
                continue;
            }
            f.tokens.extend(item.tokens[skip..].iter().map(|t| t.token));
            f.attempts = 0;
            f.deadline = now + self.ctx.timeouts.request;
            let client = f.client;
            let mut new = OutputItem {
                id,
                from: have as u32,
                tokens: item.tokens[skip..].to_vec(),
                logits: item.logits,
                end: item.end.clone(),
            };
            // A request decoded elsewhere than it was prefilled reports the
            // prefill's cache hits (the lookup at routing time).
            if let (Some(OutputEnd::Finished(w)), Some(_)) = (&mut new.end, f.prefilled_on) {
                w.cached_tokens = w.cached_tokens.max(f.cached_tokens as u32);
            }
            if item.end.is_some() {
                self.flights.remove(&id);
            }
            if new.tokens.is_empty() && new.end.is_none() {
                continue;
            }
            let (items, b) = by_client.entry(client).or_default();
            if item.logits {
                b.extend_from_slice(&logits[skip * vocab..]);
            }
            items.push(new);
        }
        for (client, (items, b)) in by_client {
            self.to_client(client, items, &b);
        }
    }

    fn on_tick(&mut self) {
        let now = self.now();
        let late: Vec<u64> = self.routing.iter().filter(|(_, r)| r.deadline <= now).map(|(q, _)| *q).collect();
        for q in late {
            self.decide(q);
        }
        let late: Vec<u64> = self.flights.iter().filter(|(_, f)| f.deadline <= now).map(|(id, _)| *id).collect();
        for id in late {
            let f = self.flights.get_mut(&id).expect("listed");
            f.attempts += 1;
            f.deadline = now + self.ctx.timeouts.request;
            if f.attempts > self.ctx.timeouts.request_attempts || (f.cancelled && f.attempts > 1) {
                let f = self.flights.remove(&id).expect("listed");
                if f.cancelled {
                    let item = end_item(id, f.tokens.len(), f.spec.prompt.len(), FinishKind::Cancelled);
                    self.to_client(f.client, vec![item], &[]);
                    continue;
                }
                let why = format!(
                    "scheduler{} made no progress on request {id} after {} attempts",
                    f.instance, self.ctx.timeouts.request_attempts
                );
                self.ctx.events.record(format_args!("router: {why}"));
                self.ctx.send(self.addr, Addr::scheduler(f.instance), Message::Cancel { id }, &[]);
                let item = end_item(id, f.tokens.len(), f.spec.prompt.len(), FinishKind::Error(why));
                self.to_client(f.client, vec![item], &[]);
                continue;
            }
            bump(&self.ctx.metrics.submits_resent);
            let f = &self.flights[&id];
            self.forward(f);
        }
    }

    /// Membership declared `node` dead (node0's transport says so):
    /// requests on an instance whose scheduler lived there, or bound to
    /// decode on one, are routed again as if just submitted with the tokens
    /// they have (recomputed on the new instance, bit for bit); the dead
    /// instances are `Down` to both balancers. With no instance left they
    /// end with an error.
    fn on_node_down(&mut self, node: u32) {
        let topo = &self.ctx.topology;
        let dead: Vec<bool> = (0..topo.instances).map(|i| self.ctx.is_lost(0, topo.devices_of(i).start)).collect();
        let is_dead = |i: u32| dead.get(i as usize).copied().unwrap_or(false);
        let moved: Vec<u64> = self
            .flights
            .iter()
            .filter(|(_, f)| is_dead(f.instance) || f.decode.is_some_and(is_dead))
            .map(|(id, _)| *id)
            .collect();
        let none_left = dead.iter().all(|&d| d);
        for id in moved {
            let f = self.flights.remove(&id).expect("listed");
            let (from, prompt) = (f.tokens.len(), f.spec.prompt.len());
            if f.cancelled || none_left {
                let why = format!("node{node} is down and no serving instance is left");
                let reason = if f.cancelled { FinishKind::Cancelled } else { FinishKind::Error(why) };
                self.to_client(f.client, vec![end_item(id, from, prompt, reason)], &[]);
                continue;
            }
            self.ctx
                .events
                .record(format_args!("router moves request {id} off scheduler{} (node{node} down)", f.instance));
            self.on_submit(f.client, Submit { spec: f.spec, generated: f.tokens, decode: None });
        }
    }

    fn on_cancel(&mut self, client: Addr, id: u64) {
        if let Some(f) = self.flights.get_mut(&id) {
            f.cancelled = true;
            let f = &self.flights[&id];
            self.forward(f);
            return;
        }
        let routed =
            self.routing.iter().find(|(_, r)| r.submit.spec.id == id).map(|(q, r)| (*q, r.submit.spec.prompt.len()));
        let prompt = routed.map_or(0, |(_, p)| p);
        if let Some((q, _)) = routed {
            self.routing.remove(&q);
        }
        self.to_client(client, vec![end_item(id, 0, prompt, FinishKind::Cancelled)], &[]);
    }
}

impl Actor for Router {
    type Msg = RouterMsg;
    type State = RouterState;
    type Arguments = RouterArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<RouterMsg>,
        args: RouterArgs,
    ) -> Result<RouterState, ActorProcessingErr> {
        let addr = Addr::router(0);
        let ctx = args.ctx;
        ctx.events.record(format_args!("{addr} up (incarnation {})", args.incarnation));
        pump(ctx.transport.bind(addr), myself.clone(), RouterMsg::Net);
        // A new incarnation knows nothing: the client submits everything again.
        let hello = Heartbeat {
            instance: ctx.new_instance(),
            restarted: ctx.is_up(),
            time_ns: ctx.clock.now().as_nanos() as u64,
        };
        ctx.send(addr, Addr::client(0), Message::Heartbeat(hello), &[]);
        let (clock, every) = (Arc::clone(&ctx.clock), ctx.timeouts.control.min(ctx.timeouts.request / 4));
        let ticker = tokio::spawn(async move {
            loop {
                clock.sleep(every).await;
                if myself.send_message(RouterMsg::Tick).is_err() {
                    break;
                }
            }
        });
        Ok(RouterState {
            addr,
            flights: BTreeMap::new(),
            routing: BTreeMap::new(),
            next_query: 0,
            ticker: Some(ticker),
            layout: Policy::new(&ctx.config, ctx.engine_for(0)).ok().map(|p| p.layout().clone()),
            round_robin: RoundRobin::default(),
            ctx,
        })
    }

    async fn post_stop(&self, _me: ActorRef<RouterMsg>, state: &mut RouterState) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<RouterMsg>,
        msg: RouterMsg,
        state: &mut RouterState,
    ) -> Result<(), ActorProcessingErr> {
        let d = match msg {
            RouterMsg::Tick => {
                state.on_tick();
                return Ok(());
            }
            RouterMsg::Net(d) => d,
        };
        let Some(m) = state.ctx.open(state.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        let now = state.now();
        match (from.role, m.envelope.msg) {
            (Role::Client, Message::Submit(s)) => state.on_submit(from, s),
            (Role::Client, Message::Cancel { id }) => state.on_cancel(from, id),
            (Role::Scheduler, Message::Ack { ids }) => {
                for id in ids {
                    if let Some(f) = state.flights.get_mut(&id).filter(|f| f.instance == from.index) {
                        f.attempts = 0;
                        f.deadline = now + state.ctx.timeouts.request;
                    }
                }
            }
            (Role::Scheduler, Message::Outputs(out)) => state.on_outputs(from, out, m.body),
            (Role::Scheduler, Message::Handoff(HandoffMsg::Adopted { id, instance })) if instance == from.index => {
                state.on_adopted(id, instance)
            }
            (Role::Scheduler, Message::Handoff(HandoffMsg::Reroute { id, instance })) => {
                state.on_reroute(from.index, id, instance)
            }
            (Role::Scheduler, Message::Heartbeat(h)) if h.restarted => {
                let ids: Vec<u64> =
                    state.flights.iter().filter(|(_, f)| f.instance == from.index).map(|(id, _)| *id).collect();
                state.ctx.events.record(format_args!("router resubmits {} requests to {from}", ids.len()));
                for id in ids {
                    bump(&state.ctx.metrics.submits_resent);
                    let f = state.flights.get_mut(&id).expect("listed");
                    f.deadline = now + state.ctx.timeouts.request;
                    let f = &state.flights[&id];
                    state.forward(f);
                }
            }
            (Role::CacheManager, Message::Cache(CacheMsg::Matched { query, node, matches })) => {
                if let Some(r) = state.routing.get_mut(&query) {
                    r.waiting.remove(&node);
                    for m in matches {
                        r.matched.insert(m.instance, m.blocks);
                    }
                    if r.waiting.is_empty() {
                        state.decide(query);
                    }
                }
            }
            (Role::Node, Message::Control(crate::wire::Control::NodeDown { node })) if from == Addr::node(0) => {
                state.on_node_down(node)
            }
            (_, Message::Heartbeat(_)) => {}
            (_, other) => {
                bump(&state.ctx.metrics.frames_rejected);
                state.ctx.events.record(format_args!("{} ignores {:?} from {from}", state.addr, other.kind()));
            }
        }
        Ok(())
    }
}
