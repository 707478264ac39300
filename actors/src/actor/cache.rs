//! CacheManager: one per node, the prefix index of the instances whose
//! scheduler lives there. It maps a block's key (the engine's hash chain
//! over every token up to the block's end) to the block's tokens and the
//! values of its compressed state, so that any worker of the instance can
//! start a sequence from a cached prefix, and answers the router's question
//! "how many leading blocks of this prompt does each instance hold?".
//!
//! Which blocks are cached, and when one is evicted, is the engine
//! scheduler's decision (its `PrefixCache` accounting: references, LRU);
//! this store follows the scheduler's stores and evictions. A lookup compares
//! tokens and parent keys, not only keys, so a collision costs a miss, never
//! a wrong hit. A restarted cache manager starts empty and says so: the
//! schedulers forget their index, and prefix hits become misses.

use std::collections::BTreeMap;
use std::sync::Arc;

use deepinfer_engine::engine::BlockValues;
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::cluster::ctx::Ctx;
use crate::net::transport::pump;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::wire::{Addr, CacheMsg, FetchItem, FetchedItem, Heartbeat, InstanceMatch, Message, StoredBlock};

pub struct CacheManager;

pub struct CacheArgs {
    pub node: u32,
    pub incarnation: u32,
    pub ctx: Arc<Ctx>,
}

pub enum CacheActorMsg {
    Net(Delivery),
}

struct Entry {
    parent: u64,
    tokens: Vec<u32>,
    lens: Vec<u32>,
    values: Vec<f32>,
    stamp: u64,
}

pub struct CacheState {
    node: u32,
    addr: Addr,
    /// (instance, key) → block.
    entries: BTreeMap<(u32, u64), Entry>,
    /// Least recently stored or fetched first, for the capacity bound.
    order: BTreeMap<u64, (u32, u64)>,
    stamp: u64,
    /// f32 values held, and the most allowed (a lost eviction must not grow the store forever).
    held: usize,
    capacity: usize,
    ctx: Arc<Ctx>,
}

/// Values a block's lengths (`BlockValues::to_parts`) account for: per part
/// (present, entries, overlap kv, overlap gate), absent overlaps being `u32::MAX`.
pub(crate) fn parts_len(lens: &[u32]) -> usize {
    let len = |l: u32| if l == u32::MAX { 0 } else { l as usize };
    lens.chunks(4).map(|c| c.iter().skip(1).map(|&l| len(l)).sum::<usize>()).sum()
}

impl CacheState {
    fn touch(&mut self, key: (u32, u64)) {
        if let Some(e) = self.entries.get_mut(&key) {
            self.order.remove(&e.stamp);
            e.stamp = self.stamp;
            self.order.insert(self.stamp, key);
            self.stamp += 1;
        }
    }

    fn remove(&mut self, key: (u32, u64)) {
        if let Some(e) = self.entries.remove(&key) {
            self.order.remove(&e.stamp);
            self.held -= e.values.len();
        }
    }

    fn store(&mut self, instance: u32, blocks: Vec<StoredBlock>, body: &[f32]) {
        let bt = self.ctx.block_tokens;
        let mut parsed = Vec::with_capacity(blocks.len());
        let mut at = 0;
        for b in blocks {
            let n = parts_len(&b.lens);
            let Some(values) = body.get(at..at + n) else { return self.reject("a store's body is too short") };
            if b.tokens.len() != bt {
                return self.reject("a stored block of the wrong size");
            }
            // Modelled devices store blocks without values: only which blocks exist matters.
            let valueless = self.ctx.modelled.is_some() && b.lens.is_empty();
            if let Err(why) = if valueless {
                Ok(())
            } else {
                BlockValues::from_parts(&self.ctx.model, bt, &b.lens, values).map(|_| ())
            } {
                return self.reject(&format!("a stored block does not fit the model: {why}"));
            }
            parsed.push((b, values.to_vec()));
            at += n;
        }
        if at != body.len() {
            return self.reject("a store with trailing values");
        }
        for (b, values) in parsed {
            let key = (instance, b.hash);
            self.remove(key);
            self.held += values.len();
            self.entries.insert(key, Entry { parent: b.parent, tokens: b.tokens, lens: b.lens, values, stamp: 0 });
            self.touch(key);
            bump(&self.ctx.metrics.blocks_stored);
        }
        while self.held > self.capacity {
            let Some((_, key)) = self.order.pop_first() else { break };
            self.remove(key);
        }
    }

    fn reject(&self, why: &str) {
        bump(&self.ctx.metrics.frames_rejected);
        self.ctx.events.record(format_args!("{} rejects: {why}", self.addr));
    }

    /// Leading blocks of the chain `hashes` over `tokens` that `instance` holds.
    fn matched(&self, instance: u32, hashes: &[u64], tokens: &[u32]) -> usize {
        let bt = self.ctx.block_tokens;
        let mut parent = 0;
        for (k, &h) in hashes.iter().enumerate() {
            let Some(want) = tokens.get(k * bt..(k + 1) * bt) else { return k };
            match self.entries.get(&(instance, h)) {
                Some(e) if e.parent == parent && e.tokens == want => parent = h,
                _ => return k,
            }
        }
        hashes.len()
    }

    fn fetch(&mut self, from: Addr, query: u64, instance: u32, items: Vec<FetchItem>) {
        let mut out = Vec::with_capacity(items.len());
        let mut body = Vec::new();
        for it in items {
            let n = it.hashes.len();
            if n > 0 && self.matched(instance, &it.hashes, &it.tokens) == n {
                let mut lens = Vec::with_capacity(n);
                for &h in &it.hashes {
                    let key = (instance, h);
                    let e = &self.entries[&key];
                    lens.push(e.lens.clone());
                    body.extend_from_slice(&e.values);
                    self.touch(key);
                }
                bump(&self.ctx.metrics.cache_hits);
                out.push(FetchedItem { seq: it.seq, found: true, lens });
            } else {
                bump(&self.ctx.metrics.cache_misses);
                self.ctx.events.record(format_args!("{} misses {n} blocks of sequence {}", self.addr, it.seq));
                out.push(FetchedItem { seq: it.seq, found: false, lens: Vec::new() });
            }
        }
        self.ctx.send(self.addr, from, Message::Cache(CacheMsg::Fetched { query, items: out }), &body);
    }
}

impl Actor for CacheManager {
    type Msg = CacheActorMsg;
    type State = CacheState;
    type Arguments = CacheArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CacheActorMsg>,
        args: CacheArgs,
    ) -> Result<CacheState, ActorProcessingErr> {
        let addr = Addr::cache(args.node);
        let ctx = args.ctx;
        let instances = ctx.topology.instances_on(args.node);
        let capacity = (ctx.engine.kv_budget_bytes / 4).saturating_mul(instances.len().max(1));
        ctx.events.record(format_args!("{addr} up (incarnation {})", args.incarnation));
        pump(ctx.transport.bind(addr), myself, CacheActorMsg::Net);
        // Schedulers whose blocks this store held must forget them: a hit
        // would find nothing here.
        if ctx.is_up() {
            let hello =
                Heartbeat { instance: ctx.new_instance(), restarted: true, time_ns: ctx.clock.now().as_nanos() as u64 };
            for i in instances {
                ctx.send(addr, Addr::scheduler(i), Message::Heartbeat(hello.clone()), &[]);
            }
        }
        Ok(CacheState {
            node: args.node,
            addr,
            entries: BTreeMap::new(),
            order: BTreeMap::new(),
            stamp: 0,
            held: 0,
            capacity,
            ctx,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<CacheActorMsg>,
        msg: CacheActorMsg,
        state: &mut CacheState,
    ) -> Result<(), ActorProcessingErr> {
        let CacheActorMsg::Net(d) = msg;
        let Some(m) = state.ctx.open(state.addr, &d) else { return Ok(()) };
        let from = m.envelope.from;
        let topo = &state.ctx.topology;
        let mine = |i: u32| i < topo.instances && topo.home_node(i) == state.node;
        match m.envelope.msg {
            Message::Cache(CacheMsg::Store { instance, blocks, .. }) if mine(instance) => {
                state.store(instance, blocks, &m.body);
            }
            Message::Cache(CacheMsg::Evict { instance, hashes, .. }) if mine(instance) => {
                for h in hashes {
                    state.remove((instance, h));
                }
            }
            Message::Cache(CacheMsg::Clear { instance }) if mine(instance) => {
                let keys: Vec<(u32, u64)> =
                    state.entries.range((instance, 0)..=(instance, u64::MAX)).map(|(k, _)| *k).collect();
                for k in keys {
                    state.remove(k);
                }
            }
            Message::Cache(CacheMsg::Fetch { query, instance, items, .. }) if mine(instance) => {
                state.fetch(from, query, instance, items);
            }
            Message::Cache(CacheMsg::Lookup { query, hashes, tokens }) => {
                let matches = topo
                    .instances_on(state.node)
                    .into_iter()
                    .map(|instance| InstanceMatch {
                        instance,
                        blocks: state.matched(instance, &hashes, &tokens) as u32,
                    })
                    .collect();
                let reply = CacheMsg::Matched { query, node: state.node, matches };
                state.ctx.send(state.addr, from, Message::Cache(reply), &[]);
            }
            other => {
                bump(&state.ctx.metrics.frames_rejected);
                state.ctx.events.record(format_args!("{} ignores {:?} from {from}", state.addr, other.kind()));
            }
        }
        Ok(())
    }
}
