//! The CacheManager's protocol machine, sans-IO (its shell is
//! `crate::actor::cache`): one per node, the prefix index of the instances whose
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
use std::time::Duration;

use deepinfer_engine::engine::BlockValues;

use super::Outgoing;
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::wire::{Addr, CacheMsg, FetchItem, FetchedItem, Heartbeat, InstanceMatch, Message, StoredBlock};

struct Entry {
    parent: u64,
    tokens: Vec<u32>,
    lens: Vec<u32>,
    values: Vec<f32>,
    stamp: u64,
}

pub struct CacheMachine {
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
    /// Frames to send, oldest first.
    out: Vec<Outgoing>,
    ctx: Arc<Ctx>,
}

/// Values a block's lengths (`BlockValues::to_parts`) account for: per part
/// (present, entries, overlap kv, overlap gate), absent overlaps being `u32::MAX`.
pub(crate) fn parts_len(lens: &[u32]) -> usize {
    let len = |l: u32| if l == u32::MAX { 0 } else { l as usize };
    lens.chunks(4).map(|c| c.iter().skip(1).map(|&l| len(l)).sum::<usize>()).sum()
}

impl CacheMachine {
    fn touch(&mut self, key: (u32, u64)) {
        if let Some(e) = self.entries.get_mut(&key) {
            // A new entry has no slot yet: its placeholder stamp may be another's.
            if self.order.get(&e.stamp) == Some(&key) {
                self.order.remove(&e.stamp);
            }
            e.stamp = self.stamp;
            self.order.insert(self.stamp, key);
            self.stamp += 1;
        }
    }

    fn remove(&mut self, key: (u32, u64)) {
        if let Some(e) = self.entries.remove(&key) {
            if self.order.get(&e.stamp) == Some(&key) {
                self.order.remove(&e.stamp);
            }
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
        self.send(from, Message::Cache(CacheMsg::Fetched { query, items: out }), &body);
    }
}

impl CacheMachine {
    /// A new (or restarted) cache manager of `node` at `now`. A restarted one
    /// tells the schedulers whose blocks it held to forget them: a hit would
    /// find nothing here.
    pub fn start(now: Duration, node: u32, incarnation: u32, ctx: Arc<Ctx>) -> Self {
        let addr = Addr::cache(node);
        let instances = ctx.topology.instances_on(node);
        let capacity = (ctx.engine.kv_budget_bytes / 4).saturating_mul(instances.len().max(1));
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
        let mut machine = CacheMachine {
            node,
            addr,
            entries: BTreeMap::new(),
            order: BTreeMap::new(),
            stamp: 0,
            held: 0,
            capacity,
            out: Vec::new(),
            ctx,
        };
        if machine.ctx.durable.is_up() {
            let number = machine.ctx.durable.new_incarnation();
            let hello = Heartbeat { incarnation: number, restarted: true, time_ns: now.as_nanos() as u64 };
            for i in instances {
                machine.send(Addr::scheduler(i), Message::Heartbeat(hello.clone()), &[]);
            }
        }
        machine
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    /// The frames the inputs handled so far asked to send.
    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.out)
    }

    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) {
        self.out.extend(super::encode(&self.ctx.events, self.addr, to, msg, body));
    }

    /// React to one frame. The store stays within its capacity after every input.
    pub fn handle(&mut self, d: Delivery) {
        self.dispatch(d);
        assert!(self.held <= self.capacity, "{}: {} values held over {}", self.addr, self.held, self.capacity);
        assert_eq!(self.entries.len(), self.order.len(), "{}: LRU order out of step", self.addr);
    }

    fn dispatch(&mut self, d: Delivery) {
        let Some(m) = self.ctx.open(self.addr, &d) else { return };
        let from = m.envelope.from;
        let topo = &self.ctx.topology;
        let node = self.node;
        let mine = |i: u32| i < topo.instances && topo.home_node(i) == node;
        match m.envelope.msg {
            Message::Cache(CacheMsg::Store { instance, blocks, .. }) if mine(instance) => {
                self.store(instance, blocks, &m.body);
            }
            Message::Cache(CacheMsg::Evict { instance, hashes, .. }) if mine(instance) => {
                for h in hashes {
                    self.remove((instance, h));
                }
            }
            Message::Cache(CacheMsg::Clear { instance }) if mine(instance) => {
                let keys: Vec<(u32, u64)> =
                    self.entries.range((instance, 0)..=(instance, u64::MAX)).map(|(k, _)| *k).collect();
                for k in keys {
                    self.remove(k);
                }
            }
            Message::Cache(CacheMsg::Fetch { query, instance, items, .. }) if mine(instance) => {
                self.fetch(from, query, instance, items);
            }
            Message::Cache(CacheMsg::Lookup { query, hashes, tokens }) => {
                let matches = topo
                    .instances_on(node)
                    .into_iter()
                    .map(|instance| InstanceMatch { instance, blocks: self.matched(instance, &hashes, &tokens) as u32 })
                    .collect();
                let reply = CacheMsg::Matched { query, node, matches };
                self.send(from, Message::Cache(reply), &[]);
            }
            other => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
            }
        }
    }
}

#[cfg(test)]
mod tests;
