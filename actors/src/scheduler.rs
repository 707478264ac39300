//! Scheduler: one per serving instance. The batching policy is the engine's
//! own sans-IO [`deepinfer_engine::scheduler::Scheduler`] — admission,
//! chunked prefill under the token budget, KV blocks and preemption, stop
//! conditions, prefix-cache accounting — driven by messages instead of a
//! loop around `Engine::step`:
//!
//! 1. `schedule()` gives the step's plan; each request runs on one GpuWorker
//!    of the instance (attention data parallelism: the least loaded when it
//!    is added, fixed thereafter), so the plan becomes one `StepRequest` per
//!    worker with requests in it.
//! 2. Items that start from a prefix hit need the cached blocks' values: they
//!    are fetched from the node's CacheManager first (a miss recomputes the
//!    whole prefix: `rebuild`).
//! 3. Results are gathered; computed blocks are offered to the engine's
//!    prefix cache (`register_block`) and the new ones stored in the
//!    CacheManager; sampled tokens go to `complete`, and every new token and
//!    finish goes to the router in one `Outputs` message.
//!
//! Recovery: a step request that is not answered is re-sent; a worker that
//! lost a sequence's state gets it again with its whole history (`rebuild`);
//! after `step_attempts` the affected requests end with an error. A
//! restarted scheduler starts empty and announces itself; the router submits
//! its requests again with the tokens they had produced, which are
//! recomputed (bit-identical) and generation resumes.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::engine::step_segments;
use deepinfer_engine::eplb::ExpertLoadTracker;
use deepinfer_engine::kv_pool::BlockId;
use deepinfer_engine::prefix_cache::block_hash;
use deepinfer_engine::request::{FinishReason, Finished, Request, RequestId};
use deepinfer_engine::sampling::SamplingParams;
use deepinfer_engine::scheduler::{Registration, SampledToken, Scheduler as Policy, StepPlan};
use deepinfer_engine::transfer::parts_values;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::task::JoinHandle;

use crate::cache::parts_len;
use crate::ctx::{pump, Ctx};
use crate::disagg::{eplb_table, InstanceKind, MAX_PENDING_TRANSFERS, TRANSFER_ATTEMPTS};
use crate::events::bump;
use crate::faults::Target;
use crate::router::end_item;
use crate::transport::Delivery;
use crate::wire::{
    Addr, BlockSnapshot, CacheMsg, Control, ExpertLoad, FetchItem, FetchedItem, FinishKind, FinishWire, HandoffMsg,
    Heartbeat, Message, OutputEnd, OutputItem, Outputs, PlacementWire, RequestSpec, Role, Sampling, SeqOutput,
    StateExport, StepItem, StepOutcome, StepRequest, StepResult, StoredBlock, Submit, Verification,
};

#[path = "scheduler_drafts.rs"]
mod drafts;
use drafts::{Outs, Shape};
#[path = "scheduler_tiers.rs"]
mod tiers_glue;
use tiers_glue::TierGlue;

pub struct Scheduler;

pub struct SchedulerArgs {
    pub instance: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum SchedulerMsg {
    Net(Delivery),
    /// Start the next step if there is work and none is running.
    Tick,
    /// The timer armed with this serial number fired.
    Timeout(u64),
    /// Attempt `attempt` of request `id`'s state transfer was not adopted in time.
    TransferTimeout {
        id: u64,
        attempt: u32,
    },
}

/// A request this incarnation serves.
struct Live {
    rid: RequestId,
    worker: u32,
    spec: RequestSpec,
    /// Key chain over the request's full blocks, extended as needed.
    hashes: Vec<u64>,
    /// Its worker state was computed from position 0 without a restore (a
    /// rebuild), so its compressors hold everything: a prefix hit's
    /// remaining replay must be computed normally instead.
    plain: bool,
    /// Hand it to this decode instance once it has sampled (prefill/decode disaggregation).
    decode: Option<u32>,
    /// Its state as a prefill instance computed it (lengths, values), until admitted.
    import: Option<(Vec<u32>, Vec<f32>)>,
}

/// A prefilled request waiting for its decode instance to adopt it.
struct Handoff {
    spec: RequestSpec,
    generated: Vec<u32>,
    lens: Vec<u32>,
    values: Vec<f32>,
    target: u32,
    attempt: u32,
    timer: Option<JoinHandle<()>>,
}

/// One item of the plan as it is sent.
struct Item {
    id: u64,
    rid: RequestId,
    worker: u32,
    from: usize,
    to: usize,
    replay_until: usize,
    sample: bool,
    /// The sampled row's logits are asked for.
    logits: bool,
    sampling: Sampling,
    /// Keys of the prefix-hit blocks the state starts from.
    restore: Vec<u64>,
    values: Option<(Vec<Vec<u32>>, Vec<f32>)>,
    snapshots: Vec<usize>,
    rebuild: bool,
    /// Start from this imported state (admitted at `from` > 0 without cached blocks).
    import: Option<(Vec<u32>, Vec<f32>)>,
    /// Return the state after the step: it moves to a decode instance.
    export: bool,
    /// Most drafts it may verify (speculative decoding).
    drafts: usize,
}

struct Pending {
    attempt: u32,
    deadline: Duration,
    release: Vec<u64>,
}

/// A sampled token and, when asked for, its logits row.
type SampledRow = (SeqOutput, Option<Vec<f32>>);

struct Answer {
    outputs: Vec<SeqOutput>,
    snapshots: Vec<BlockSnapshot>,
    loads: Vec<ExpertLoad>,
    exports: Vec<StateExport>,
    verifications: Vec<Verification>,
    body: Vec<f32>,
}

/// A block computed this step, with the wave that computed it.
struct Snap {
    wave: usize,
    item: usize,
    block: usize,
    lens: Vec<u32>,
    values: Vec<f32>,
}

struct StepRun {
    step: u64,
    items: Vec<Item>,
    /// Indices of each worker's items.
    by_worker: BTreeMap<u32, Vec<usize>>,
    placement: PlacementWire,
    /// Tokens of the whole step.
    batch_tokens: u64,
    /// Decode steps the workers run as one (modelled devices).
    repeat: u32,
    pending: BTreeMap<u32, Pending>,
    answers: BTreeMap<u32, Answer>,
    /// Results received (the scheduler's fault-injection points).
    received: u32,
    /// Requests that ended while the step was formed.
    ended: Vec<OutputItem>,
}

enum Phase {
    Idle,
    /// Waiting for the instance's shards to acknowledge placement `epoch`, then run `step`.
    Loading {
        epoch: u64,
        waiting: BTreeSet<u32>,
        round: u32,
        deadline: Duration,
        step: Option<u64>,
    },
    Fetching {
        run: StepRun,
        query: u64,
        deadline: Duration,
    },
    Running(StepRun),
}

pub struct SchedulerState {
    instance: u32,
    addr: Addr,
    /// Cluster-unique number of this incarnation; workers drop the states of older ones.
    number: u64,
    me: ActorRef<SchedulerMsg>,
    policy: Policy,
    live: BTreeMap<u64, Live>,
    by_rid: BTreeMap<RequestId, u64>,
    /// Requests and their prompt tokens per worker.
    load: BTreeMap<u32, (usize, usize)>,
    /// Sequences whose worker state can go, sent with the worker's next step.
    release: BTreeMap<u32, Vec<u64>>,
    /// Key of every block the engine's prefix cache holds.
    cached: BTreeMap<BlockId, u64>,
    /// Values of the blocks stored at the end of the last step: the next
    /// step's hits on them need no fetch (which could overtake the store).
    recent: BTreeMap<u64, (Vec<u32>, Vec<f32>)>,
    phase: Phase,
    serial: u64,
    timer: Option<JoinHandle<()>>,
    queries: u64,
    router: Addr,
    cache: Addr,
    /// Measured expert loads (EPLB at run time).
    eplb: Option<ExpertLoadTracker>,
    /// Prefilled requests on their way to a decode instance.
    handoffs: BTreeMap<u64, Handoff>,
    /// Modelled cache tiers below the device pool.
    tier_glue: TierGlue,
    ctx: Arc<Ctx>,
}

fn finish_wire(f: &Finished) -> FinishWire {
    let reason = match &f.reason {
        FinishReason::Stop => FinishKind::Stop,
        FinishReason::Length => FinishKind::Length,
        FinishReason::Cancelled => FinishKind::Cancelled,
        FinishReason::Error(e) => FinishKind::Error(e.clone()),
    };
    FinishWire {
        reason,
        prompt_tokens: f.prompt_tokens as u32,
        completion_tokens: f.completion_tokens as u32,
        cached_tokens: f.cached_tokens as u32,
        preemptions: f.preemptions,
    }
}

/// The engine request a spec describes.
pub(crate) fn request_of(spec: &RequestSpec) -> Request {
    let s = &spec.sampling;
    let params = SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        seed: s.seed,
        logprobs: s.logprobs as usize,
        // The wire carries no logit processing: `Cluster::submit` refuses it.
        ..SamplingParams::default()
    };
    let mut r = Request::new(spec.prompt.clone(), spec.max_tokens as usize).with_params(params);
    r.stop_token_ids = spec.stop_token_ids.clone();
    r.stop_sequences = spec.stop_sequences.clone();
    r.ignore_eos = spec.ignore_eos;
    r.return_logits = spec.logits;
    r
}

impl SchedulerState {
    fn now(&self) -> Duration {
        self.ctx.clock.now()
    }

    fn generated(&self, rid: RequestId) -> usize {
        self.policy.tokens(rid).len() - self.policy.request(rid).prompt.len()
    }

    fn wants_logits(&self, spec: &RequestSpec) -> bool {
        spec.logits || self.ctx.return_logits
    }

    fn arm(&mut self, deadline: Duration) {
        if let Some(t) = self.timer.take() {
            t.abort();
        }
        self.serial += 1;
        let (clock, me, serial) = (Arc::clone(&self.ctx.clock), self.me.clone(), self.serial);
        let wait = deadline.saturating_sub(clock.now());
        self.timer = Some(tokio::spawn(async move {
            clock.sleep(wait).await;
            let _ = me.send_message(SchedulerMsg::Timeout(serial));
        }));
    }

    fn tick(&self) {
        let _ = self.me.send_message(SchedulerMsg::Tick);
    }

    fn send_outputs(&self, items: Vec<OutputItem>, body: &[f32]) {
        if !items.is_empty() {
            self.ctx.send(self.addr, self.router, Message::Outputs(Outputs { items }), body);
        }
    }

    /// The worker (attention data-parallel rank) for a new request: a prefill
    /// instance evens out prompt tokens per worker, others requests per worker.
    fn pick_worker(&self) -> u32 {
        let by_tokens = self.ctx.kind(self.instance) == InstanceKind::Prefill;
        let devices = self.ctx.topology.devices_of(self.instance);
        let first = devices.start;
        devices
            .filter(|d| !self.ctx.is_lost(*d))
            .min_by_key(|d| {
                let (n, tokens) = self.load.get(d).copied().unwrap_or((0, 0));
                if by_tokens {
                    (tokens, n, *d)
                } else {
                    (n, tokens, *d)
                }
            })
            .unwrap_or(first)
    }

    fn assign(&mut self, rid: RequestId, worker: u32, prompt: usize) {
        let load = self.load.entry(worker).or_default();
        load.0 += 1;
        load.1 += prompt;
        self.policy.set_rank(rid, worker);
    }

    /// Forget a request this incarnation served; its worker state can go.
    fn forget(&mut self, id: u64) -> Option<Live> {
        let l = self.live.remove(&id)?;
        self.by_rid.remove(&l.rid);
        if let Some((n, tokens)) = self.load.get_mut(&l.worker) {
            *n = n.saturating_sub(1);
            *tokens = tokens.saturating_sub(l.spec.prompt.len());
        }
        self.release.entry(l.worker).or_default().push(id);
        Some(l)
    }

    /// End a live request with an error.
    fn fail(&mut self, id: u64, why: &str) -> Option<OutputItem> {
        let l = self.forget(id)?;
        let from = self.generated(l.rid);
        let mut f = self.policy.cancel(l.rid).ok()?;
        f.reason = FinishReason::Error(why.to_string());
        Some(OutputItem {
            id,
            from: from as u32,
            tokens: Vec::new(),
            logits: false,
            end: Some(OutputEnd::Finished(finish_wire(&f))),
        })
    }

    fn chain(&mut self, id: u64, blocks: usize) -> Vec<u64> {
        let bt = self.ctx.block_tokens;
        let l = self.live.get_mut(&id).expect("live request");
        let tokens = self.policy.tokens(l.rid);
        while l.hashes.len() < blocks {
            let k = l.hashes.len();
            let parent = l.hashes.last().copied().unwrap_or(0);
            l.hashes.push(block_hash(parent, &tokens[k * bt..(k + 1) * bt]));
        }
        l.hashes[..blocks].to_vec()
    }

    fn on_submit(&mut self, submit: Submit) {
        let Submit { spec, generated, decode } = submit;
        let id = spec.id;
        let mut worker = None;
        if self.handoffs.contains_key(&id) {
            // Prefilled and on its way to a decode instance: that is progress.
            self.ctx.send(self.addr, self.router, Message::Ack { ids: vec![id] }, &[]);
            return;
        }
        if let Some(l) = self.live.get_mut(&id) {
            l.decode = decode;
            let l = &self.live[&id];
            if self.generated(l.rid) == generated.len() {
                self.ctx.send(self.addr, self.router, Message::Ack { ids: vec![id] }, &[]);
                self.tick();
                return;
            }
            // The router has a different count: recompute from what it has.
            let l = self.forget(id).expect("live");
            let _ = self.policy.cancel(l.rid);
            bump(&self.ctx.metrics.requests_restarted);
            self.ctx.events.record(format_args!("{} restarts request {id} at {} tokens", self.addr, generated.len()));
            worker = Some(l.worker);
        }
        let context = self.ctx.config.max_position_embeddings;
        if !generated.is_empty()
            && (generated.len() >= spec.max_tokens as usize || spec.prompt.len() + generated.len() >= context)
        {
            let item = end_item(id, generated.len(), spec.prompt.len(), FinishKind::Length);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let request = request_of(&spec);
        let added = if generated.is_empty() {
            self.policy.add(request)
        } else {
            bump(&self.ctx.metrics.requests_resumed);
            self.policy.add_resumed(request, &generated)
        };
        match added {
            Err(e) => {
                let item = OutputItem {
                    id,
                    from: generated.len() as u32,
                    tokens: Vec::new(),
                    logits: false,
                    end: Some(OutputEnd::Refused(e.to_string())),
                };
                self.send_outputs(vec![item], &[]);
            }
            Ok(rid) => {
                let worker = worker.unwrap_or_else(|| self.pick_worker());
                self.assign(rid, worker, spec.prompt.len());
                self.by_rid.insert(rid, id);
                self.live
                    .insert(id, Live { rid, worker, spec, hashes: Vec::new(), plain: false, decode, import: None });
                self.tiers_arrived(rid);
                self.ctx.send(self.addr, self.router, Message::Ack { ids: vec![id] }, &[]);
                self.tick();
            }
        }
    }

    fn on_cancel(&mut self, id: u64) {
        if let Some(h) = self.handoffs.remove(&id) {
            if let Some(t) = h.timer {
                t.abort();
            }
            let item = end_item(id, h.generated.len(), h.spec.prompt.len(), FinishKind::Cancelled);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let item = match self.forget(id) {
            Some(l) => {
                let from = self.generated(l.rid);
                match self.policy.cancel(l.rid) {
                    Ok(f) => OutputItem {
                        id,
                        from: from as u32,
                        tokens: Vec::new(),
                        logits: false,
                        end: Some(OutputEnd::Finished(finish_wire(&f))),
                    },
                    Err(_) => end_item(id, from, l.spec.prompt.len(), FinishKind::Cancelled),
                }
            }
            None => end_item(id, 0, 0, FinishKind::Cancelled),
        };
        self.send_outputs(vec![item], &[]);
    }

    /// Start a step: faults, a placement change, then the plan.
    fn begin_step(&mut self) -> Result<(), ActorProcessingErr> {
        if !matches!(self.phase, Phase::Idle) || !self.policy.has_work() {
            return Ok(());
        }
        let step = self.ctx.next_step(self.instance);
        for t in self.ctx.faults.external_kills(step) {
            let path = match t {
                Target::Node(n) => format!("node{n}"),
                Target::CacheManager(n) => format!("node{n}/cache{n}"),
                Target::Router => "node0/router0".to_string(),
                _ => continue,
            };
            self.ctx.kill(&path);
        }
        let mut change = self.ctx.placement_changes.iter().find(|(s, _)| *s == step).map(|(_, p)| p.clone());
        if change.is_none() {
            change = self.eplb_change();
        }
        if let Some(p) = change {
            let epoch = self.ctx.placement(self.instance).epoch() + 1;
            self.ctx.set_placement(self.instance, p.with_epoch(epoch));
            self.ctx.events.record(format_args!("{} placement epoch {epoch}", self.addr));
            self.load_placement(Some(step));
        }
        if self.ctx.faults.kill_point(Target::Scheduler(self.instance), step, 0) {
            return Err(format!("{}: injected crash at step {step}", self.addr).into());
        }
        if matches!(self.phase, Phase::Idle) {
            self.plan(step);
        }
        Ok(())
    }

    /// A new table from the measured loads when one is due and differs from the current one.
    fn eplb_change(&mut self) -> Option<crate::placement::Placement> {
        let cfg = self.ctx.eplb?;
        let tracker = self.eplb.as_mut().filter(|t| t.should_rebalance())?;
        let current = self.ctx.placement(self.instance);
        match eplb_table(tracker, current.devices(), cfg.redundant) {
            Ok(p) if p.clone().with_epoch(current.epoch()) != current => {
                self.ctx.events.record(format_args!("{} eplb: new expert table", self.addr));
                Some(p)
            }
            Ok(_) => None,
            Err(e) => {
                self.ctx.events.record(format_args!("{} eplb: {e}", self.addr));
                None
            }
        }
    }

    /// Send the instance's current table to its shards and wait for every acknowledgement.
    fn load_placement(&mut self, step: Option<u64>) {
        let p = self.ctx.placement(self.instance);
        let waiting: BTreeSet<u32> =
            self.ctx.topology.devices_of(self.instance).filter(|d| !self.ctx.is_lost(*d)).collect();
        self.send_tables(&waiting);
        let deadline = self.now() + self.ctx.timeouts.control;
        self.phase = Phase::Loading { epoch: p.epoch(), waiting, round: 0, deadline, step };
        self.arm(deadline);
    }

    fn send_tables(&self, to: &BTreeSet<u32>) {
        let p = self.ctx.placement(self.instance);
        let base = self.ctx.topology.devices_of(self.instance).start;
        for &d in to {
            let msg = Control::LoadExperts { epoch: p.epoch(), experts: p.experts_on(d - base) };
            self.ctx.send(self.addr, Addr::shard(d), Message::Control(msg), &[]);
        }
    }

    fn plan(&mut self, step: u64) {
        self.tiers_before_plan(step);
        let mut plan = self.policy.schedule();
        let pool = self.policy.pool_stats();
        let g = &self.ctx.gauges[self.instance as usize];
        g.kv_used_bytes.store(pool.used_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        g.kv_budget_bytes.store(pool.budget_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        g.running.store(self.policy.num_running() as u64, std::sync::atomic::Ordering::Relaxed);
        g.waiting.store(self.policy.num_waiting() as u64, std::sync::atomic::Ordering::Relaxed);
        let mut ended = Vec::new();
        self.settle(step, &mut plan, &mut ended);
        let mut items = Vec::with_capacity(plan.items.len());
        for it in plan.items {
            let Some(&id) = self.by_rid.get(&it.id) else { continue };
            self.tiers_admitted(id, &it);
            if it.start.is_some() {
                // (Re)admitted: a fresh or restored state.
                self.live.get_mut(&id).expect("live").plain = false;
            }
            // Admitted past 0 without cached blocks: from a state another instance computed.
            let imported = it.from > 0 && it.start.as_ref().is_some_and(Vec::is_empty);
            let import = if imported { self.live.get_mut(&id).and_then(|l| l.import.take()) } else { None };
            let l = &self.live[&id];
            let hit = it.start.as_deref().unwrap_or_default();
            let mut restore: Option<Vec<u64>> = hit.iter().map(|b| self.cached.get(b).copied()).collect();
            if imported && import.is_none() {
                restore = None;
            }
            let s = &l.spec.sampling;
            let export = it.sample && l.decode.is_some();
            items.push(Item {
                import,
                export,
                logits: it.sample && self.wants_logits(&l.spec),
                sampling: Sampling {
                    temperature: s.temperature,
                    top_p: s.top_p,
                    top_k: s.top_k,
                    seed: s.seed,
                    logprobs: s.logprobs,
                },
                id,
                rid: it.id,
                worker: l.worker,
                from: it.from,
                to: it.to,
                replay_until: it.replay_until,
                sample: it.sample,
                rebuild: restore.is_none(),
                restore: restore.unwrap_or_default(),
                values: None,
                snapshots: it.snapshots,
                drafts: it.drafts,
            });
        }
        let mut run = StepRun {
            step,
            items,
            by_worker: BTreeMap::new(),
            placement: PlacementWire { epoch: 0, devices: 0, replicas: Vec::new() },
            batch_tokens: 0,
            repeat: 1,
            pending: BTreeMap::new(),
            answers: BTreeMap::new(),
            received: 0,
            ended,
        };
        if run.items.is_empty() {
            // Nothing can run now: wait for new input rather than spin.
            self.send_outputs(run.ended, &[]);
            self.phase = Phase::Idle;
            return;
        }
        for it in run.items.iter_mut().filter(|it| !it.restore.is_empty()) {
            if it.restore.iter().all(|h| self.recent.contains_key(h)) {
                let mut lens = Vec::with_capacity(it.restore.len());
                let mut data = Vec::new();
                for h in &it.restore {
                    let (l, v) = &self.recent[h];
                    lens.push(l.clone());
                    data.extend_from_slice(v);
                }
                it.values = Some((lens, data));
            }
        }
        let fetch: Vec<usize> = run
            .items
            .iter()
            .enumerate()
            .filter(|(_, it)| !it.restore.is_empty() && it.values.is_none())
            .map(|(i, _)| i)
            .collect();
        if fetch.is_empty() {
            self.send_all(run);
            return;
        }
        let bt = self.ctx.block_tokens;
        let fetch_items = fetch
            .iter()
            .map(|&i| {
                let it = &run.items[i];
                let tokens = self.policy.tokens(it.rid)[..it.restore.len() * bt].to_vec();
                FetchItem { seq: it.id, hashes: it.restore.clone(), tokens }
            })
            .collect();
        let query = self.queries;
        self.queries += 1;
        let msg = CacheMsg::Fetch { query, instance: self.instance, step, items: fetch_items };
        self.ctx.send(self.addr, self.cache, Message::Cache(msg), &[]);
        let deadline = self.now() + self.ctx.timeouts.control;
        self.phase = Phase::Fetching { run, query, deadline };
        self.arm(deadline);
    }

    /// The cache answered (or did not): items without their blocks' values recompute from position 0.
    fn fetched(&mut self, mut run: StepRun, found: Vec<FetchedItem>, body: Vec<f32>) {
        let mut values: BTreeMap<u64, (Vec<Vec<u32>>, Vec<f32>)> = BTreeMap::new();
        let mut at = 0;
        for f in found.into_iter().filter(|f| f.found) {
            let n: usize = f.lens.iter().map(|l| parts_len(l)).sum();
            let Some(v) = body.get(at..at + n) else { break };
            at += n;
            values.insert(f.seq, (f.lens, v.to_vec()));
        }
        let mut missed = false;
        for it in run.items.iter_mut().filter(|it| !it.restore.is_empty() && it.values.is_none()) {
            match values.remove(&it.id) {
                Some(v) if v.0.len() == it.restore.len() => it.values = Some(v),
                _ => {
                    it.rebuild = true;
                    missed = true;
                }
            }
        }
        if missed {
            // The store lost blocks the engine counts on: forget them all, so
            // they are computed and stored again instead of missing again.
            self.policy.clear_prefix_cache();
            self.cached.clear();
            self.recent.clear();
            self.tiers_cleared();
            self.ctx.events.record(format_args!("{} prefix blocks missing: cache index cleared", self.addr));
        }
        self.send_all(run);
    }

    fn send_all(&mut self, mut run: StepRun) {
        for it in run.items.iter().filter(|it| it.rebuild) {
            if let Some(l) = self.live.get_mut(&it.id) {
                l.plain = true;
            }
        }
        run.by_worker.clear();
        for (i, it) in run.items.iter().enumerate() {
            run.by_worker.entry(it.worker).or_default().push(i);
        }
        run.placement = self.placement_wire();
        run.batch_tokens = run.items.iter().map(|it| (it.to - it.from) as u64).sum();
        run.repeat = self.decode_repeat(&run.items);
        let workers: Vec<u32> = run.by_worker.keys().copied().collect();
        let deadline = self.now() + self.ctx.timeouts.step;
        for w in workers {
            let release = self.release.remove(&w).unwrap_or_default();
            run.pending.insert(w, Pending { attempt: 0, deadline, release });
            if !self.send_step(&run, w) {
                run.pending.remove(&w);
            }
        }
        if run.pending.is_empty() {
            self.complete(run);
            return;
        }
        self.phase = Phase::Running(run);
        self.arm(deadline);
    }

    /// The item's request is still the one it was planned for (not ended, cancelled or restarted since).
    fn alive(&self, it: &Item) -> bool {
        self.by_rid.get(&it.rid) == Some(&it.id)
    }

    /// Send (again) `worker`'s part of the step; false if none of it is still wanted.
    /// The table sent with step requests. Modelled devices price the
    /// all-to-all from the expected expert loads and need no table.
    fn placement_wire(&self) -> PlacementWire {
        let p = self.ctx.placement(self.instance);
        if self.ctx.modelled.is_some() {
            PlacementWire { epoch: p.epoch(), devices: p.devices(), replicas: Vec::new() }
        } else {
            p.to_wire()
        }
    }

    fn send_step(&self, run: &StepRun, worker: u32) -> bool {
        let p = &run.pending[&worker];
        let mut body = Vec::new();
        let items: Vec<StepItem> = run
            .by_worker
            .get(&worker)
            .into_iter()
            .flatten()
            .map(|&i| &run.items[i])
            .filter(|it| self.alive(it))
            .map(|it| {
                let tokens = self.policy.tokens(it.rid);
                let plain = self.live.get(&it.id).is_some_and(|l| l.plain);
                let (position, restore, replay_until) = match (&it.values, it.rebuild) {
                    (_, true) => (0, Vec::new(), 0),
                    (Some((lens, data)), false) => {
                        body.extend_from_slice(data);
                        (it.from, lens.clone(), it.replay_until)
                    }
                    (None, false) => (it.from, Vec::new(), if plain { 0 } else { it.replay_until }),
                };
                let import = match (&it.import, it.rebuild) {
                    (Some((lens, data)), false) => {
                        body.extend_from_slice(data);
                        lens.clone()
                    }
                    _ => Vec::new(),
                };
                StepItem {
                    seq: it.id,
                    position: position as u64,
                    tokens: tokens[position..it.to].to_vec(),
                    rebuild: it.rebuild,
                    sampling: it.sampling.clone(),
                    sample: it.sample,
                    logits: it.logits,
                    replay_until: replay_until as u64,
                    restore,
                    snapshots: it.snapshots.iter().map(|&k| k as u32).collect(),
                    export: it.export,
                    import,
                    drafts: it.drafts as u32,
                }
            })
            .collect();
        if items.is_empty() {
            return false;
        }
        let req = StepRequest {
            step: run.step,
            attempt: p.attempt,
            scheduler: self.number,
            placement: run.placement.clone(),
            items,
            release: p.release.clone(),
            batch_tokens: run.batch_tokens,
            repeat: run.repeat,
        };
        self.ctx.send(self.addr, Addr::worker(worker), Message::StepRequest(req), &body);
        true
    }

    fn rearm_running(&mut self) {
        if let Phase::Running(run) = &self.phase {
            if let Some(d) = run.pending.values().map(|p| p.deadline).min() {
                self.arm(d);
            }
        }
    }

    /// Ask `worker` again (rebuilding what it lost), or give up on its requests.
    fn retry(&mut self, run: &mut StepRun, worker: u32, why: &str) {
        let Some(p) = run.pending.get_mut(&worker) else { return };
        p.attempt += 1;
        if p.attempt >= self.ctx.timeouts.step_attempts {
            let reason = format!("step {} on worker{worker} failed after {} attempts: {why}", run.step, p.attempt);
            self.ctx.events.record(format_args!("{reason}"));
            run.pending.remove(&worker);
            let ids: Vec<u64> = run.items.iter().filter(|it| it.worker == worker).map(|it| it.id).collect();
            for id in ids {
                if let Some(item) = self.fail(id, &reason) {
                    run.ended.push(item);
                }
            }
            return;
        }
        bump(&self.ctx.metrics.step_resends);
        self.ctx.events.record(format_args!("resend step {} to worker{worker}: {why}", run.step));
        for it in run.items.iter().filter(|it| it.worker == worker && it.rebuild) {
            if let Some(l) = self.live.get_mut(&it.id) {
                l.plain = true;
            }
        }
        p.deadline = self.now() + self.ctx.timeouts.step;
        if !self.send_step(run, worker) {
            run.pending.remove(&worker);
        }
    }

    fn on_result(&mut self, from: Addr, r: StepResult, body: Vec<f32>) -> Result<(), ActorProcessingErr> {
        let Phase::Running(mut run) = std::mem::replace(&mut self.phase, Phase::Idle) else { return Ok(()) };
        let worker = from.index;
        if r.step != run.step || r.device != worker || !run.pending.contains_key(&worker) {
            self.phase = Phase::Running(run);
            return Ok(());
        }
        run.received += 1;
        if self.ctx.faults.kill_point(Target::Scheduler(self.instance), run.step, run.received) {
            return Err(format!("{}: injected crash at step {} result {}", self.addr, run.step, run.received).into());
        }
        match r.outcome {
            StepOutcome::Done { outputs, snapshots, loads, exports, verifications } => {
                let shape = Shape {
                    outputs: &outputs,
                    snapshots: &snapshots,
                    exports: &exports,
                    verifications: &verifications,
                };
                if self.check_answer(&run, worker, shape, body.len()) {
                    run.pending.remove(&worker);
                    run.answers.insert(worker, Answer { outputs, snapshots, loads, exports, verifications, body });
                } else {
                    self.ctx
                        .events
                        .record(format_args!("ignoring a malformed result of step {} from worker{worker}", run.step));
                }
            }
            StepOutcome::NeedsHistory(ids) => {
                for it in run.items.iter_mut().filter(|it| it.worker == worker && ids.contains(&it.id)) {
                    it.rebuild = true;
                }
                self.retry(&mut run, worker, "worker lost sequence state");
            }
            StepOutcome::Failed(why) => {
                for it in run.items.iter_mut().filter(|it| it.worker == worker) {
                    it.rebuild = true;
                }
                self.retry(&mut run, worker, &why);
            }
        }
        if run.pending.is_empty() {
            self.complete(run);
        } else {
            self.phase = Phase::Running(run);
            self.rearm_running();
        }
        Ok(())
    }

    /// One output per sampling item and the snapshots asked for, with a body
    /// that adds up. Items whose request ended since the step was sent may be
    /// answered or not.
    fn check_answer(&self, run: &StepRun, worker: u32, answer: Shape<'_>, body: usize) -> bool {
        let Shape { outputs, snapshots, exports, verifications } = answer;
        let vocab = self.ctx.config.vocab_size;
        let mine: BTreeMap<u64, &Item> =
            run.by_worker.get(&worker).into_iter().flatten().map(|&i| (run.items[i].id, &run.items[i])).collect();
        let mut want_body = 0;
        // Each sampling item answers `repeat` tokens (with drafts, `1 +
        // accepted` per step), at consecutive positions in order.
        let repeat = run.repeat.max(1) as u64;
        let Some(tokens) = self.verified_tokens(&mine, repeat, verifications) else { return false };
        let want = |seq: u64| tokens.as_ref().map_or(repeat, |t| t.get(&seq).copied().unwrap_or(0));
        let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
        for o in outputs {
            let Some(it) = mine.get(&o.seq).filter(|it| it.sample) else { return false };
            let n = seen.entry(o.seq).or_default();
            let ok = o.position == it.to as u64 + *n
                && *n < want(o.seq)
                && (o.token as usize) < vocab
                && o.top.iter().all(|t| (t.token as usize) < vocab);
            *n += 1;
            if !ok {
                return false;
            }
            want_body += if it.logits { vocab } else { 0 };
        }
        let mut got = BTreeSet::new();
        for s in snapshots {
            let asked = mine.get(&s.seq).is_some_and(|it| it.snapshots.contains(&(s.block as usize)));
            if !asked || !got.insert((s.seq, s.block as usize)) {
                return false;
            }
            want_body += parts_len(&s.lens);
        }
        // Exports may be left out (too large): the request is then recomputed where it goes.
        let mut exported = BTreeSet::new();
        for x in exports {
            let asked = mine.get(&x.seq).is_some_and(|it| it.export);
            let Some(n) = parts_values(&x.lens).filter(|_| asked && exported.insert(x.seq)) else { return false };
            want_body += n;
        }
        let complete = mine.values().filter(|it| self.alive(it)).all(|it| {
            let answered = seen.get(&it.id).copied().unwrap_or(0) == want(it.id);
            let verified = tokens.is_none() || tokens.as_ref().is_some_and(|t| t.contains_key(&it.id));
            (!it.sample || (answered && verified)) && it.snapshots.iter().all(|&k| got.contains(&(it.id, k)))
        });
        complete && body == want_body
    }

    fn complete(&mut self, run: StepRun) {
        let vocab = self.ctx.config.vocab_size;
        let bt = self.ctx.block_tokens;
        let StepRun { step, items, answers, mut ended, repeat, .. } = run;
        self.record_loads(&answers);
        // A sequence appears once per step.
        let index: BTreeMap<u64, usize> = items.iter().enumerate().map(|(i, it)| (it.id, i)).collect();
        let of = |seq: u64, worker: u32| index.get(&seq).copied().filter(|&i| items[i].worker == worker);
        let mut exported: BTreeMap<u64, (Vec<u32>, Vec<f32>)> = BTreeMap::new();
        // Per worker: outputs by sequence, with their logits rows; snapshots with their values.
        let mut sampled_rows: BTreeMap<u64, VecDeque<SampledRow>> = BTreeMap::new();
        let mut verified: BTreeMap<u64, VecDeque<Verification>> = BTreeMap::new();
        let mut snaps: Vec<Snap> = Vec::new();
        for (worker, a) in answers {
            for v in a.verifications {
                verified.entry(v.seq).or_default().push_back(v);
            }
            let mut at = 0;
            for o in a.outputs {
                let wants = of(o.seq, worker).is_some_and(|i| items[i].logits);
                let row = wants.then(|| {
                    at += vocab;
                    a.body[at - vocab..at].to_vec()
                });
                sampled_rows.entry(o.seq).or_default().push_back((o, row));
            }
            for s in a.snapshots {
                let n = parts_len(&s.lens);
                let values = a.body[at..at + n].to_vec();
                at += n;
                let Some(i) = of(s.seq, worker) else { continue };
                let it = &items[i];
                let k = s.block as usize;
                let wave = step_segments(it.from, it.to, it.replay_until, &it.snapshots, bt)
                    .iter()
                    .position(|&(_, end, _)| end == (k + 1) * bt)
                    .unwrap_or(usize::MAX);
                snaps.push(Snap { wave, item: i, block: k, lens: s.lens, values });
            }
            for x in a.exports {
                let n = parts_values(&x.lens).unwrap_or(0);
                let values = a.body[at..at + n].to_vec();
                at += n;
                exported.insert(x.seq, (x.lens, values));
            }
        }
        // The order the engine registers blocks in: wave by wave, items in plan order.
        snaps.sort_by_key(|s| (s.wave, s.item, s.block));
        let mut stores = Vec::new();
        let mut store_body = Vec::new();
        self.recent.clear();
        for Snap { item: i, block: k, lens, values, .. } in snaps {
            let it = &items[i];
            if !self.alive(it) {
                continue;
            }
            if let Registration::New(b) = self.policy.register_block(it.rid, k) {
                let chain = self.chain(it.id, k + 1);
                let parent = if k == 0 { 0 } else { chain[k - 1] };
                self.cached.insert(b, chain[k]);
                self.tiers_computed(chain[k], parent);
                stores.push(StoredBlock {
                    hash: chain[k],
                    parent,
                    tokens: self.policy.tokens(it.rid)[k * bt..(k + 1) * bt].to_vec(),
                    lens: lens.clone(),
                });
                store_body.extend_from_slice(&values);
                self.recent.insert(chain[k], (lens, values));
            }
        }
        if !stores.is_empty() {
            let msg = CacheMsg::Store { instance: self.instance, step, blocks: stores };
            self.ctx.send(self.addr, self.cache, Message::Cache(msg), &store_body);
        }
        // Sampling items, then (modelled decode events) the further decode
        // steps the workers ran as one: each is planned and completed here as
        // the engine would have, step by step.
        let mut current: Vec<(u64, RequestId, usize)> =
            items.iter().filter(|it| it.sample && self.alive(it)).map(|it| (it.id, it.rid, it.drafts)).collect();
        let mut outs = Outs::default();
        let drafting = self.ctx.modelled.clone().filter(|m| m.drafting().is_some());
        for sub in 0..repeat.max(1) {
            if sub > 0 {
                current = self.plan_decode_substep(step, &mut ended);
            }
            if let Some(m) = &drafting {
                self.complete_verified(m, &current, &mut sampled_rows, &mut verified, &mut outs);
                continue;
            }
            let mut sampled = Vec::with_capacity(current.len());
            for &(id, rid, _) in &current {
                let Some((o, row)) = sampled_rows.get_mut(&id).and_then(VecDeque::pop_front) else { continue };
                sampled.push(SampledToken { id: rid, token: o.token, ok: o.logprob.is_finite() });
                outs.push(id, self.generated(rid), o, row);
            }
            for (rid, f) in self.policy.complete(&sampled) {
                let Some(&id) = self.by_rid.get(&rid) else { continue };
                self.forget(id);
                outs.finish(id, &f);
            }
        }
        let mut body = Vec::new();
        for (item, row) in outs.items {
            if let Some(row) = row {
                body.extend_from_slice(&row);
            }
            ended.push(item);
        }
        self.send_outputs(ended, &body);
        // After the outputs: the router has the first token before the decode instance speaks.
        let leaving: Vec<u64> = items.iter().filter(|it| it.export && self.alive(it)).map(|it| it.id).collect();
        for id in leaving {
            let state = exported.remove(&id);
            self.hand_off(id, state);
        }
        self.phase = Phase::Idle;
        self.tick();
    }

    /// Fold the step's routed rows into the load tracker (malformed entries are ignored).
    fn record_loads(&mut self, answers: &BTreeMap<u32, Answer>) {
        let Some(tracker) = self.eplb.as_mut() else { return };
        let (layers, experts) = (self.ctx.model.config.num_layers, self.ctx.model.config.n_routed_experts);
        let mut rows = vec![0u32; layers * experts];
        for x in answers.values().flat_map(|a| &a.loads) {
            if (x.layer as usize) < layers && (x.expert as usize) < experts {
                let r = &mut rows[x.layer as usize * experts + x.expert as usize];
                *r = r.saturating_add(x.rows);
            }
        }
        if rows.iter().any(|&r| r > 0) {
            let _ = tracker.record_step(&rows);
        }
    }

    /// A request prefilled here leaves for its decode instance with its state;
    /// without one (too large to export) the router places it for recompute.
    fn hand_off(&mut self, id: u64, state: Option<(Vec<u32>, Vec<f32>)>) {
        let Some(target) = self.live.get(&id).and_then(|l| l.decode) else { return };
        let Some(l) = self.forget(id) else { return };
        let generated = self.policy.tokens(l.rid)[l.spec.prompt.len()..].to_vec();
        let _ = self.policy.cancel(l.rid);
        match state {
            Some((lens, values)) if self.handoffs.len() < MAX_PENDING_TRANSFERS => {
                let h = Handoff { spec: l.spec, generated, lens, values, target, attempt: 0, timer: None };
                bump(&self.ctx.metrics.handovers);
                self.handoffs.insert(id, h);
                self.send_transfer(id);
            }
            _ => self.reroute(id, target, "no state to transfer"),
        }
    }

    fn send_transfer(&mut self, id: u64) {
        let Some(h) = self.handoffs.get_mut(&id) else { return };
        let msg = HandoffMsg::Transfer {
            spec: h.spec.clone(),
            generated: h.generated.clone(),
            lens: h.lens.clone(),
            attempt: h.attempt,
        };
        let to = Addr::scheduler(h.target);
        self.ctx.events.record(format_args!("{} transfers request {id} to {to} (attempt {})", self.addr, h.attempt));
        let sent = self.ctx.send(self.addr, to, Message::Handoff(msg), &h.values).is_some();
        if !sent {
            let target = h.target;
            self.handoffs.remove(&id);
            self.reroute(id, target, "the state does not fit a frame");
            return;
        }
        let (clock, me, wait, attempt) =
            (Arc::clone(&self.ctx.clock), self.me.clone(), self.ctx.timeouts.control, h.attempt);
        if let Some(t) = h.timer.replace(tokio::spawn(async move {
            clock.sleep(wait).await;
            let _ = me.send_message(SchedulerMsg::TransferTimeout { id, attempt });
        })) {
            t.abort();
        }
    }

    fn reroute(&mut self, id: u64, target: u32, why: &str) {
        bump(&self.ctx.metrics.requests_restarted);
        self.ctx.events.record(format_args!("{} reroutes request {id} away from scheduler{target}: {why}", self.addr));
        let msg = HandoffMsg::Reroute { id, instance: target };
        self.ctx.send(self.addr, self.router, Message::Handoff(msg), &[]);
    }

    fn on_transfer_timeout(&mut self, id: u64, attempt: u32) {
        let Some(h) = self.handoffs.get_mut(&id).filter(|h| h.attempt == attempt) else { return };
        h.attempt += 1;
        if h.attempt < TRANSFER_ATTEMPTS {
            self.send_transfer(id);
            return;
        }
        let h = self.handoffs.remove(&id).expect("present");
        self.reroute(id, h.target, &format!("not adopted after {TRANSFER_ATTEMPTS} transfers"));
    }

    fn on_adopted(&mut self, id: u64, instance: u32) {
        if self.handoffs.get(&id).is_some_and(|h| h.target == instance) {
            if let Some(t) = self.handoffs.remove(&id).and_then(|h| h.timer) {
                t.abort();
            }
            self.ctx.events.record(format_args!("{} request {id} adopted by scheduler{instance}", self.addr));
        }
    }

    /// A prefilled request arrives: it continues here from its state. A state
    /// that does not check out is recomputed instead; either way it is adopted.
    fn on_transfer(&mut self, from: Addr, spec: RequestSpec, generated: Vec<u32>, lens: Vec<u32>, values: Vec<f32>) {
        let id = spec.id;
        let adopted = Message::Handoff(HandoffMsg::Adopted { id, instance: self.instance });
        if self.live.contains_key(&id) {
            // A repeated (or late) transfer of a request already running here:
            // it may have moved on since; only the answer was lost.
            self.ctx.send(self.addr, from, adopted.clone(), &[]);
            self.ctx.send(self.addr, self.router, adopted, &[]);
            return;
        }
        let cfg = &self.ctx.model.config;
        let position = spec.prompt.len() + generated.len();
        if generated.len() >= spec.max_tokens as usize || position >= self.ctx.config.max_position_embeddings {
            // Nothing is left to generate (a peer that should have finished it).
            self.ctx.send(self.addr, from, adopted.clone(), &[]);
            self.ctx.send(self.addr, self.router, adopted, &[]);
            let item = end_item(id, generated.len(), spec.prompt.len(), FinishKind::Length);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let checked = if generated.is_empty() || parts_values(&lens) != Some(values.len()) {
            Err("lengths do not match the body".to_string())
        } else if self.ctx.modelled.is_some() {
            // Modelled devices move positions, not values.
            Ok(())
        } else {
            self.ctx.model.state_from_parts(&lens, &values, cfg.max_position_embeddings).and_then(|s| {
                if s.position + 1 == position {
                    Ok(())
                } else {
                    Err(format!("state at {} for {position} tokens", s.position))
                }
            })
        };
        let request = request_of(&spec);
        let added = match &checked {
            Ok(()) => self.policy.add_prefilled(request, &generated),
            Err(why) => {
                self.ctx.events.record(format_args!("{} recomputes request {id}: {why}", self.addr));
                if generated.is_empty() {
                    self.policy.add(request)
                } else {
                    self.policy.add_resumed(request, &generated)
                }
            }
        };
        self.ctx.send(self.addr, from, adopted.clone(), &[]);
        self.ctx.send(self.addr, self.router, adopted, &[]);
        match added {
            Err(e) => {
                let end = Some(OutputEnd::Refused(e.to_string()));
                let item = OutputItem { id, from: generated.len() as u32, tokens: Vec::new(), logits: false, end };
                self.send_outputs(vec![item], &[]);
            }
            Ok(rid) => {
                self.tiers_imported(rid);
                let worker = self.pick_worker();
                self.assign(rid, worker, spec.prompt.len());
                self.by_rid.insert(rid, id);
                let import = checked.is_ok().then_some((lens, values));
                self.ctx.events.record(format_args!("{} adopts request {id} at {position} tokens", self.addr));
                let live = Live { rid, worker, spec, hashes: Vec::new(), plain: false, decode: None, import };
                self.live.insert(id, live);
                self.tick();
            }
        }
    }

    /// What a plan ends besides its items: failed requests (their final
    /// outputs join `ended`), preempted states to release, evicted cached blocks.
    fn settle(&mut self, step: u64, plan: &mut StepPlan, ended: &mut Vec<OutputItem>) {
        for (rid, f) in std::mem::take(&mut plan.failed) {
            let Some(&id) = self.by_rid.get(&rid) else { continue };
            self.forget(id);
            ended.push(OutputItem {
                id,
                from: f.completion_tokens as u32,
                tokens: Vec::new(),
                logits: false,
                end: Some(OutputEnd::Finished(finish_wire(&f))),
            });
        }
        for rid in &plan.preempted {
            if let Some(l) = self.by_rid.get(rid).and_then(|id| self.live.get(id)) {
                self.release.entry(l.worker).or_default().push(l.spec.id);
            }
        }
        self.tiers_evicted(&plan.evicted);
        let evicted: Vec<u64> = plan.evicted.iter().filter_map(|e| self.cached.remove(&e.blocks.compressed)).collect();
        if !evicted.is_empty() {
            let msg = CacheMsg::Evict { instance: self.instance, step, hashes: evicted };
            self.ctx.send(self.addr, self.cache, Message::Cache(msg), &[]);
        }
    }

    /// The next decode step of a multi-step event: plan it (running
    /// requests only), register the blocks it completes (valueless, as
    /// modelled devices store them) and return its sampling items.
    fn plan_decode_substep(&mut self, step: u64, ended: &mut Vec<OutputItem>) -> Vec<(u64, RequestId, usize)> {
        let bt = self.ctx.block_tokens;
        let mut plan = self.policy.schedule_running();
        self.settle(step, &mut plan, ended);
        let mut stores = Vec::new();
        let mut current = Vec::with_capacity(plan.items.len());
        for it in &plan.items {
            let Some(&id) = self.by_rid.get(&it.id) else { continue };
            for &k in &it.snapshots {
                if let Registration::New(b) = self.policy.register_block(it.id, k) {
                    let chain = self.chain(id, k + 1);
                    self.cached.insert(b, chain[k]);
                    self.tiers_computed(chain[k], if k == 0 { 0 } else { chain[k - 1] });
                    stores.push(StoredBlock {
                        hash: chain[k],
                        parent: if k == 0 { 0 } else { chain[k - 1] },
                        tokens: self.policy.tokens(it.id)[k * bt..(k + 1) * bt].to_vec(),
                        lens: Vec::new(),
                    });
                }
            }
            if it.sample {
                current.push((id, it.id, it.drafts));
            }
        }
        if !stores.is_empty() {
            let msg = CacheMsg::Store { instance: self.instance, step, blocks: stores };
            self.ctx.send(self.addr, self.cache, Message::Cache(msg), &[]);
        }
        current
    }

    /// Decode steps to run as one event: more than one only for modelled
    /// devices, a plan where every item decodes one token (transferred
    /// requests included), and room in the KV budget.
    fn decode_repeat(&self, items: &[Item]) -> u32 {
        let Some(m) = &self.ctx.modelled else { return 1 };
        let most = m.spec.decode_steps_per_event.max(1) as usize;
        if most == 1 || items.is_empty() {
            return 1;
        }
        let context = self.ctx.config.max_position_embeddings;
        let drafts = m.drafting().map_or(0, |d| d.max_drafts());
        if drafts > 0 && !self.room_for_drafts(items, drafts) {
            return 1;
        }
        let mut repeat = most;
        for it in items {
            // With drafts, a decode step also feeds again the drafts a rejection took back.
            let decodes =
                it.to == it.from + 1 || (drafts > 0 && it.to - it.from <= drafts && self.generated(it.rid) > 0);
            let plain = it.sample && decodes && it.restore.is_empty() && !it.rebuild && !it.export;
            // A request that finishes within the event drops out of the later
            // steps (its extra tokens are discarded), so length is no limit.
            let Some(l) = self.live.get(&it.id).filter(|_| plain) else { return 1 };
            if !l.spec.ignore_eos || !l.spec.stop_token_ids.is_empty() || !l.spec.stop_sequences.is_empty() {
                return 1;
            }
            repeat = repeat.min(context.saturating_sub(it.to + 1));
        }
        let pool = self.policy.pool_stats();
        let layout = self.policy.layout();
        let growth = repeat * (1 + drafts);
        let needed = items.len().saturating_mul(layout.sequence_bytes(growth + layout.block_tokens));
        if needed > pool.budget_bytes.saturating_sub(pool.used_bytes) {
            return 1;
        }
        repeat.max(1) as u32
    }

    fn on_timeout(&mut self, serial: u64) {
        if serial != self.serial {
            return;
        }
        let now = self.now();
        match std::mem::replace(&mut self.phase, Phase::Idle) {
            Phase::Idle => {}
            Phase::Loading { epoch, waiting, round, deadline, step } => {
                if deadline > now {
                    self.phase = Phase::Loading { epoch, waiting, round, deadline, step };
                    self.arm(deadline);
                } else if round + 1 >= self.ctx.timeouts.control_attempts {
                    let why = format!("placement epoch {epoch} not acknowledged by shards {waiting:?}");
                    self.ctx.events.record(format_args!("{}: {why}", self.addr));
                    let ids: Vec<u64> = self.live.keys().copied().collect();
                    let items = ids.into_iter().filter_map(|id| self.fail(id, &why)).collect();
                    self.send_outputs(items, &[]);
                } else {
                    self.send_tables(&waiting);
                    let deadline = now + self.ctx.timeouts.control;
                    self.phase = Phase::Loading { epoch, waiting, round: round + 1, deadline, step };
                    self.arm(deadline);
                }
            }
            Phase::Fetching { run, query, deadline } => {
                if deadline > now {
                    self.phase = Phase::Fetching { run, query, deadline };
                    self.arm(deadline);
                } else {
                    self.ctx.events.record(format_args!("{} fetch {query} unanswered", self.addr));
                    self.fetched(run, Vec::new(), Vec::new());
                }
            }
            Phase::Running(mut run) => {
                let late: Vec<u32> = run.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(w, _)| *w).collect();
                for w in late {
                    self.retry(&mut run, w, "no answer");
                }
                if run.pending.is_empty() {
                    self.complete(run);
                } else {
                    self.phase = Phase::Running(run);
                    self.rearm_running();
                }
            }
        }
    }

    fn on_loaded(&mut self, epoch: u64, device: u32) -> Result<(), ActorProcessingErr> {
        let Phase::Loading { epoch: want, waiting, .. } = &mut self.phase else { return Ok(()) };
        if epoch != *want {
            return Ok(());
        }
        waiting.remove(&device);
        if !waiting.is_empty() {
            return Ok(());
        }
        let Phase::Loading { step, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else { unreachable!() };
        match step {
            Some(step) => self.plan(step),
            None => self.tick(),
        }
        Ok(())
    }

    fn on_worker_restarted(&mut self, worker: u32, instance: u64) {
        let Phase::Running(mut run) = std::mem::replace(&mut self.phase, Phase::Idle) else {
            return;
        };
        if run.pending.contains_key(&worker) {
            self.retry(&mut run, worker, &format!("worker restarted (instance {instance})"));
        }
        if run.pending.is_empty() {
            self.complete(run);
        } else {
            self.phase = Phase::Running(run);
            self.rearm_running();
        }
    }

    /// Membership declared `node` dead. If it held devices of this instance,
    /// their copies of the experts move to survivors (a new placement epoch)
    /// and this scheduler fails on purpose: its supervisor restarts it, the
    /// router submits every request again, and they are recomputed on the
    /// surviving workers, as after any scheduler crash.
    fn on_node_down(&mut self, node: u32) -> Result<(), ActorProcessingErr> {
        let topo = &self.ctx.topology;
        let lost: Vec<u32> = topo.devices_of(self.instance).filter(|&d| topo.node_of_device(d) == node).collect();
        self.ctx.mark_lost(&lost);
        let base = topo.devices_of(self.instance).start;
        let gone = topo.devices_of(self.instance).filter(|&d| self.ctx.is_lost(d)).map(|d| d - base).collect();
        let current = self.ctx.placement(self.instance);
        match current.without_devices(&gone) {
            // Already running without them (a repeated report, or a restart after the change).
            Ok(p) if p == current => return Ok(()),
            Ok(p) => self.ctx.set_placement(self.instance, p.with_epoch(current.epoch() + 1)),
            Err(e) => {
                let why = format!("node{node} is down and no device of instance {} is left: {e}", self.instance);
                let ids: Vec<u64> = self.live.keys().copied().collect();
                let items = ids.into_iter().filter_map(|id| self.fail(id, &why)).collect();
                self.send_outputs(items, &[]);
                return Ok(());
            }
        }
        Err(format!("{}: node{node} is down (devices {lost:?}); restarting on the survivors", self.addr).into())
    }

    fn on_cache_restarted(&mut self) {
        self.policy.clear_prefix_cache();
        self.cached.clear();
        self.recent.clear();
        self.tiers_cleared();
        self.ctx.events.record(format_args!("{} cache restarted: prefix index cleared", self.addr));
        if let Phase::Fetching { .. } = self.phase {
            let Phase::Fetching { run, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else { unreachable!() };
            self.fetched(run, Vec::new(), Vec::new());
        }
    }
}

impl Actor for Scheduler {
    type Msg = SchedulerMsg;
    type State = SchedulerState;
    type Arguments = SchedulerArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SchedulerMsg>,
        args: SchedulerArgs,
    ) -> Result<SchedulerState, ActorProcessingErr> {
        let ctx = args.ctx;
        let addr = Addr::scheduler(args.instance);
        let policy = Policy::new(&ctx.config, ctx.engine_for(args.instance)).map_err(|e| format!("{addr}: {e}"))?;
        let number = ctx.new_instance();
        ctx.events.record(format_args!("{addr} up (incarnation {}, instance {number})", args.incarnation));
        pump(ctx.transport.bind(addr), myself.clone(), SchedulerMsg::Net);
        let cache = Addr::cache(ctx.topology.home_node(args.instance));
        let router = Addr::router(0);
        let restarted = ctx.is_up();
        let eplb = ctx.eplb.map(|c| {
            ExpertLoadTracker::new(
                ctx.model.config.num_layers,
                ctx.model.config.n_routed_experts,
                c.decay,
                c.every_steps,
            )
        });
        ctx.send(addr, cache, Message::Cache(CacheMsg::Clear { instance: args.instance }), &[]);
        let hello = Heartbeat { instance: number, restarted, time_ns: ctx.clock.now().as_nanos() as u64 };
        ctx.send(addr, router, Message::Heartbeat(hello), &[]);
        let mut state = SchedulerState {
            instance: args.instance,
            addr,
            number,
            me: myself,
            policy,
            live: BTreeMap::new(),
            by_rid: BTreeMap::new(),
            load: BTreeMap::new(),
            release: BTreeMap::new(),
            cached: BTreeMap::new(),
            recent: BTreeMap::new(),
            phase: Phase::Idle,
            serial: 0,
            timer: None,
            queries: 0,
            router,
            cache,
            eplb,
            handoffs: BTreeMap::new(),
            tier_glue: TierGlue::default(),
            ctx,
        };
        // A predecessor may have died between changing the table and hearing every shard load it.
        if restarted {
            state.load_placement(None);
        }
        Ok(state)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<SchedulerMsg>,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = state.timer.take() {
            t.abort();
        }
        for h in state.handoffs.values_mut() {
            if let Some(t) = h.timer.take() {
                t.abort();
            }
        }
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<SchedulerMsg>,
        msg: SchedulerMsg,
        state: &mut SchedulerState,
    ) -> Result<(), ActorProcessingErr> {
        let d = match msg {
            SchedulerMsg::Tick => return state.begin_step(),
            SchedulerMsg::Timeout(serial) => {
                state.on_timeout(serial);
                return Ok(());
            }
            SchedulerMsg::TransferTimeout { id, attempt } => {
                state.on_transfer_timeout(id, attempt);
                return Ok(());
            }
            SchedulerMsg::Net(d) => d,
        };
        let Some(m) = state.ctx.open(state.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        let topo = &state.ctx.topology;
        let mine = |a: Addr| topo.devices_of(state.instance).contains(&a.index);
        match (from.role, m.envelope.msg) {
            (Role::Router, Message::Submit(s)) => state.on_submit(s),
            (Role::Router, Message::Cancel { id }) => state.on_cancel(id),
            (Role::Scheduler, Message::Handoff(HandoffMsg::Transfer { spec, generated, lens, .. })) => {
                state.on_transfer(from, spec, generated, lens, m.body)
            }
            (Role::Scheduler, Message::Handoff(HandoffMsg::Adopted { id, instance })) if instance == from.index => {
                state.on_adopted(id, instance)
            }
            (Role::Worker, Message::StepResult(r)) if mine(from) => return state.on_result(from, r, m.body),
            (Role::Worker, Message::Heartbeat(h)) if mine(from) && h.restarted => {
                state.on_worker_restarted(from.index, h.instance)
            }
            (Role::Shard, Message::Control(Control::Loaded { epoch, device })) if mine(from) => {
                return state.on_loaded(epoch, device)
            }
            (Role::CacheManager, Message::Heartbeat(h)) if from == state.cache && h.restarted => {
                state.on_cache_restarted()
            }
            (Role::CacheManager, Message::Cache(CacheMsg::Fetched { query, items })) if from == state.cache => {
                if matches!(&state.phase, Phase::Fetching { query: q, .. } if *q == query) {
                    let Phase::Fetching { run, .. } = std::mem::replace(&mut state.phase, Phase::Idle) else {
                        unreachable!()
                    };
                    state.fetched(run, items, m.body);
                }
            }
            (Role::Node, Message::Control(Control::NodeDown { node }))
                if from == Addr::node(topo.home_node(state.instance)) =>
            {
                return state.on_node_down(node)
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
