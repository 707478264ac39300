//! The scheduler's protocol machine: one per serving instance, sans-IO.
//! [`SchedulerMachine::handle`] takes the time and one input (a frame, a
//! tick, a timer) and leaves [`Effect`]s (frames to send, timers to arm,
//! actors to kill) for its shell, `crate::actor::scheduler`, to carry out;
//! nothing here touches a clock, a socket or an actor. The batching policy is the engine's
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

use deepinfer_engine::constraint::{allowed_tokens, TokenConstraint};
use deepinfer_engine::engine::step_segments;
use deepinfer_engine::eplb::ExpertLoadTracker;
use deepinfer_engine::images::block_key;
use deepinfer_engine::kv_pool::BlockId;
use deepinfer_engine::request::{FinishReason, Finished, Request, RequestId, Retention};
use deepinfer_engine::sampling::token_history;
use deepinfer_engine::scheduler::{Registration, SampledToken, Scheduler, StepPlan};
use deepinfer_engine::transfer::parts_values;

use crate::cluster::ctx::Ctx;
use crate::cluster::disagg::{
    eplb_table, InstanceKind, MAX_HANDOFF_BACKLOG, MAX_PENDING_TRANSFERS, TRANSFER_ATTEMPTS,
    TRANSFER_RATE_FLOOR_BYTES_PER_S, TRANSFER_WINDOW,
};
use crate::net::transport::Delivery;
use crate::proto::cache::parts_len;
use crate::proto::router::end_item;
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{
    Addr, BlockSnapshot, CacheMsg, Control, ExpertLoad, FetchItem, FetchedItem, FinishKind, FinishWire, HandoffMsg,
    Heartbeat, Message, OutputEnd, OutputItem, Outputs, PlacementWire, RequestSpec, Role, Sampling, SeqOutput,
    StateExport, StepItem, StepOutcome, StepRequest, StepResult, StoredBlock, Submit, TokenCount, Verification,
};

mod by_seq;
use by_seq::{BySeq, SeqSlots};
mod drafts;
use drafts::{Outs, Shape};
mod encoding;
mod handoffs;
mod invariants;
mod promotion;
mod recovery;
mod requests;
mod results;
mod steps;
mod tiers;
use tiers::TierGlue;
#[cfg(test)]
mod tests;

/// What the machine reacts to.
#[derive(Debug)]
pub enum Input {
    /// A frame from the network, not yet decoded.
    Net(Delivery),
    /// Start the next step if there is work and none is running.
    Tick,
    /// The step timer armed with this serial number fired.
    Timeout(u64),
    /// Attempt `attempt` of request `id`'s state transfer was not adopted in time.
    TransferTimeout { id: u64, attempt: u32 },
}

/// What the machine asks its shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum Effect {
    /// Send an encoded frame from this scheduler.
    Send {
        to: Addr,
        frame: Vec<u8>,
    },
    /// Feed `Input::Tick` back as soon as possible.
    Tick,
    /// Feed `Input::Tick` back at this time (not cancelled).
    TickAt(Duration),
    /// (Re)arm the one step timer: feed `Input::Timeout(serial)` at `at`,
    /// dropping any timer armed before.
    ArmStep {
        at: Duration,
        serial: u64,
    },
    /// (Re)arm request `id`'s transfer timer.
    ArmTransfer {
        id: u64,
        attempt: u32,
        at: Duration,
    },
    DisarmTransfer(u64),
    /// Crash the actor at this path below the root (an injected fault).
    Kill(String),
}

pub use super::Crash;

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
    /// Its structured-output constraint, advanced over every token it generated.
    constraint: Option<Box<dyn TokenConstraint>>,
    /// Its blocks may be written to the disk tier.
    persist: bool,
}

impl Live {
    /// A request starting on `worker` from nothing computed.
    fn new(
        rid: RequestId,
        worker: u32,
        spec: RequestSpec,
        constraint: Option<Box<dyn TokenConstraint>>,
        persist: bool,
    ) -> Self {
        Self { rid, worker, spec, hashes: Vec::new(), plain: false, decode: None, import: None, constraint, persist }
    }
}

/// A prefilled request waiting for its decode instance to adopt it.
struct Handoff {
    spec: RequestSpec,
    generated: Vec<u32>,
    lens: Vec<u32>,
    values: Vec<f32>,
    target: u32,
    attempt: u32,
    /// When the prefill finished.
    since: Duration,
    /// Sent (holding a slot of its target's window) rather than queued.
    sent: bool,
    /// Bytes of its state.
    bytes: u64,
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
    /// The tokens it may sample (its constraint's mask); empty: any.
    allowed: Vec<u32>,
    /// The token history its penalties look at; empty without penalties.
    history: Vec<TokenCount>,
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

/// A table being prepared: sent to the shards as `PrepareExperts`, installed
/// at the first step after every shard answered `Prepared`.
pub(super) struct Preparing {
    pub(super) placement: crate::cluster::placement::Placement,
    /// The epoch it replaces; another change installed meanwhile makes it stale.
    pub(super) base_epoch: u64,
    pub(super) waiting: BTreeSet<u32>,
    pub(super) deadline: Duration,
    pub(super) round: u32,
    pub(super) bytes_read: u64,
    pub(super) load_us_max: u64,
    pub(super) why: &'static str,
}

pub struct SchedulerMachine {
    instance: u32,
    /// The node it lives on (whose view of lost devices it shares).
    home: u32,
    addr: Addr,
    /// Cluster-unique number of this incarnation; workers drop the states of older ones.
    number: u64,
    /// The time of the input being handled.
    now: Duration,
    /// What the input being handled asks the shell to do.
    effects: Vec<Effect>,
    /// The engine's scheduler: admission, batch plans, KV budget, prefix index.
    policy: Scheduler,
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
    /// Serial of the step timer last armed: an older one that fires is stale.
    serial: u64,
    queries: u64,
    /// The router node that owns each request it answers for (the one that
    /// last submitted it), until its final output is sent.
    owners: BTreeMap<u64, u32>,
    /// The router that spoke last: the owner of what has none recorded.
    last_router: u32,
    /// A node of this instance came back: its experts return at the next step.
    rejoined: bool,
    cache: Addr,
    /// Measured expert loads (EPLB at run time).
    eplb: Option<ExpertLoadTracker>,
    /// A new table whose experts the shards are reading while the current one serves.
    preparing: Option<Preparing>,
    /// Its node is in a minority partition: it runs no step and changes no table.
    fenced: bool,
    /// Prefilled requests on their way to a decode instance.
    handoffs: BTreeMap<u64, Handoff>,
    /// Per decode instance: handoffs waiting for a transfer slot, in finish order.
    queued: BTreeMap<u32, VecDeque<u64>>,
    /// Per decode instance: transfers sent and not yet adopted, and their bytes.
    in_flight: BTreeMap<u32, (usize, u64)>,
    /// Modelled cache tiers below the device pool.
    tier_glue: TierGlue,
    promotions: promotion::Promotions,
    /// Requests waiting for an encoder instance's rows of their images.
    encodes: encoding::Encodes,
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
        cached_host_tokens: 0,
        cached_disk_tokens: 0,
        preemptions: f.preemptions,
    }
}

/// The engine request a spec describes.
pub(crate) fn request_of(spec: &RequestSpec) -> Request {
    let params = super::sampling_params(&spec.sampling);
    let mut r = Request::new(spec.prompt.clone(), spec.max_tokens as usize).with_params(params);
    r.stop_token_ids = spec.stop_token_ids.clone();
    r.stop_sequences = spec.stop_sequences.clone();
    r.ignore_eos = spec.ignore_eos;
    r.return_logits = spec.logits;
    r.retention = spec.retention.map(|w| Retention { ttl_ms: w.ttl_ms, persist: w.persist });
    r.priority = spec.priority;
    r.images = crate::proto::images::request_images(&spec.images);
    r
}

impl SchedulerMachine {
    /// Router `from` submitted or cancelled request `id`: it owns it now.
    fn owned_by(&mut self, from: Addr, id: u64) {
        if from.index < self.ctx.routers {
            self.last_router = from.index;
            self.owners.insert(id, from.index);
        }
    }

    fn now(&self) -> Duration {
        self.now
    }

    /// Encode `msg` for `to` and queue it; false (logged) if it cannot be encoded.
    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) -> bool {
        let Some(o) = super::encode(&self.ctx.events, self.addr, to, msg, body) else { return false };
        self.effects.push(Effect::Send { to: o.to, frame: o.frame });
        true
    }

    /// The router that owns request `id`.
    fn router_of(&self, id: u64) -> Addr {
        Addr::router(self.owners.get(&id).copied().unwrap_or(self.last_router))
    }

    fn arm(&mut self, deadline: Duration) {
        self.serial += 1;
        self.effects.push(Effect::ArmStep { at: deadline, serial: self.serial });
    }

    fn tick(&mut self) {
        self.effects.push(Effect::Tick);
    }

    /// Send outputs to the routers that own them (one message each, with
    /// their logits rows); a request's last output ends its ownership.
    fn send_outputs(&mut self, items: Vec<OutputItem>, body: &[f32]) {
        let vocab = self.ctx.config.vocab_size;
        let mut by_router: BTreeMap<Addr, (Vec<OutputItem>, Vec<f32>)> = BTreeMap::new();
        let mut at = 0;
        for mut item in items {
            let rows = if item.logits { item.tokens.len() * vocab } else { 0 };
            let router = self.router_of(item.id);
            if item.end.is_some() {
                self.owners.remove(&item.id);
                self.tier_hits_into(&mut item);
            }
            let (mine, values) = by_router.entry(router).or_default();
            values.extend_from_slice(&body[at..at + rows]);
            at += rows;
            mine.push(item);
        }
        for (router, (items, values)) in by_router {
            self.send(router, Message::Outputs(Outputs { items }), &values);
        }
    }
}

impl SchedulerMachine {
    /// A new incarnation of `instance`'s scheduler, starting at `now`: it
    /// clears the instance's entries in the node's cache and announces
    /// itself to the router (restarted, when the cluster was up before).
    pub fn start(now: Duration, instance: u32, incarnation: u32, ctx: Arc<Ctx>) -> Result<Self, Crash> {
        let addr = Addr::scheduler(instance);
        let policy =
            Scheduler::new(&ctx.config, ctx.engine_for(instance)).map_err(|e| Crash(format!("{addr}: {e}")))?;
        let number = ctx.durable.new_incarnation();
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation}, instance {number})"));
        let cache = Addr::cache(ctx.topology.home_node(instance));
        let restarted = ctx.durable.is_up();
        let eplb = ctx.eplb.map(|c| {
            ExpertLoadTracker::new(
                ctx.model.config.num_layers,
                ctx.model.config.n_routed_experts,
                c.decay,
                c.every_steps,
            )
        });
        let mut machine = SchedulerMachine {
            instance,
            home: ctx.topology.home_node(instance),
            addr,
            number,
            now,
            effects: Vec::new(),
            policy,
            live: BTreeMap::new(),
            by_rid: BTreeMap::new(),
            load: BTreeMap::new(),
            release: BTreeMap::new(),
            cached: BTreeMap::new(),
            recent: BTreeMap::new(),
            phase: Phase::Idle,
            serial: 0,
            queries: 0,
            owners: BTreeMap::new(),
            last_router: ctx.active_router(ctx.topology.home_node(instance)).index,
            rejoined: false,
            preparing: None,
            // A scheduler (re)started in a minority partition waits for the majority.
            fenced: ctx.durable.in_minority(ctx.topology.home_node(instance)),
            cache,
            eplb,
            handoffs: BTreeMap::new(),
            queued: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            tier_glue: TierGlue::default(),
            promotions: Default::default(),
            encodes: Default::default(),
            ctx,
        };
        machine.send(cache, Message::Cache(CacheMsg::Clear { instance }), &[]);
        let hello = Heartbeat { incarnation: number, restarted, time_ns: now.as_nanos() as u64 };
        // Every router may own requests of this instance.
        for node in 0..machine.ctx.routers {
            machine.send(Addr::router(node), Message::Heartbeat(hello.clone()), &[]);
        }
        // A predecessor may have died between changing the table and hearing
        // every shard load it; and a scheduler whose process restarted holds
        // the configured table while the shards may hold a later one. Either
        // way the shards hear this scheduler's table before its first step.
        machine.load_placement(None);
        Ok(machine)
    }

    /// This scheduler's address.
    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// What the inputs handled so far asked for, oldest first.
    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// React to one input at `now`. The effects it left are to be carried
    /// out even when it crashes (they happened before the crash).
    pub fn handle(&mut self, now: Duration, input: Input) -> Result<(), Crash> {
        assert!(now >= self.now, "time went backwards: {now:?} after {:?}", self.now);
        self.now = now;
        let result = self.dispatch(input);
        self.check_tables();
        result
    }

    fn dispatch(&mut self, input: Input) -> Result<(), Crash> {
        let d = match input {
            Input::Tick => {
                self.check_encodes(None);
                return self.begin_step();
            }
            Input::Timeout(serial) => {
                self.on_timeout(serial);
                return Ok(());
            }
            Input::TransferTimeout { id, attempt } => {
                self.on_transfer_timeout(id, attempt);
                return Ok(());
            }
            Input::Net(d) => d,
        };
        let Some(m) = self.ctx.open(self.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        let devices = self.ctx.topology.devices_of(self.instance);
        let mine = |a: Addr| devices.contains(&a.index);
        match (from.role, m.envelope.msg) {
            (Role::Router, Message::Submit(s)) => {
                self.owned_by(from, s.spec.id);
                self.on_submit(s)
            }
            (Role::Router, Message::Cancel { id }) => {
                self.owned_by(from, id);
                if !self.cancel_encoding(id) {
                    self.on_cancel(id)
                }
            }
            (Role::Encoder, Message::Encoder(msg)) => self.on_encoder(from, msg, m.body),
            (Role::Scheduler, Message::Handoff(HandoffMsg::Transfer { spec, generated, lens, router, .. })) => {
                self.owners.insert(spec.id, router);
                self.on_transfer(from, *spec, generated, lens, m.body)
            }
            (Role::Scheduler, Message::Handoff(HandoffMsg::Adopted { id, instance })) if instance == from.index => {
                self.on_adopted(id, instance)
            }
            (Role::Worker, Message::StepResult(r)) if mine(from) => return self.on_result(from, r, m.body),
            // Any hello: a worker whose process restarted says `restarted: false`.
            (Role::Worker, Message::Heartbeat(h)) if mine(from) => self.on_worker_restarted(from.index, h.incarnation),
            (Role::Shard, Message::Control(Control::Prepared { epoch, device, bytes_read, load_us })) if mine(from) => {
                self.on_prepared(epoch, device, bytes_read, load_us)
            }
            (Role::Shard, Message::Control(Control::Loaded { epoch, device })) if mine(from) => {
                return self.on_loaded(epoch, device)
            }
            (Role::Shard, Message::Control(Control::Behind { epoch, held, device })) if mine(from) => {
                self.on_behind(epoch, held, device)
            }
            // A shard (re)started: its table is its process's copy, maybe not the current one.
            (Role::Shard, Message::Heartbeat(_)) if mine(from) => self.on_shard_started(from.index),
            (Role::CacheManager, Message::Heartbeat(h)) if from == self.cache && h.restarted => {
                self.on_cache_restarted()
            }
            (Role::CacheManager, Message::Cache(CacheMsg::Promoted { query, items })) if from == self.cache => {
                self.on_promoted(query, items, m.body)
            }
            (Role::CacheManager, Message::Cache(CacheMsg::Fetched { query, items })) if from == self.cache => {
                if matches!(&self.phase, Phase::Fetching { query: q, .. } if *q == query) {
                    let Phase::Fetching { run, .. } = std::mem::replace(&mut self.phase, Phase::Idle) else {
                        unreachable!()
                    };
                    self.fetched(run, items, m.body);
                }
            }
            (Role::Node, Message::Control(Control::NodeDown { node }))
                if from == Addr::node(self.ctx.topology.home_node(self.instance)) =>
            {
                self.check_encodes(Some(node));
                return self.on_node_down(node);
            }
            (Role::Node, Message::Control(Control::NodeUp { node }))
                if from == Addr::node(self.ctx.topology.home_node(self.instance)) =>
            {
                return self.on_node_up(node)
            }
            (_, Message::Heartbeat(_)) => {}
            (_, other) => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
            }
        }
        Ok(())
    }
}
