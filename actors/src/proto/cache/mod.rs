//! The CacheManager's protocol machine, sans-IO (its shell is
//! `crate::actor::cache`): one per node, the prompt cache of the instances
//! whose scheduler lives there, in three tiers.
//!
//! - **Pool blocks**: the values of the blocks each instance's device pool
//!   caches (the engine scheduler's `PrefixCache` decides which, and when
//!   one is evicted; this store follows its stores and evictions), so that
//!   any worker of the instance can start a sequence from a cached prefix.
//! - **Host memory** (`lower.rs`): a byte-bounded LRU with TTLs, node-wide,
//!   that takes what a pool evicts and gives it back to a waiting request.
//! - **Disk**: block files written at the persist points and read back for
//!   a waiting request; the I/O is the shell's, asked for as [`DiskOp`]s.
//!
//! It answers the router's question "how many leading blocks of this prompt
//! does each instance hold, and in which tier?". A lookup compares tokens
//! and parent keys, not only keys, so a collision costs a miss, never a
//! wrong hit. A restarted cache manager starts with empty memory tiers (the
//! disk tier is indexed again) and says so: the schedulers forget their
//! index, and pool hits become misses.

mod lower;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::engine::BlockValues;
use deepinfer_engine::kv_tiers::TierIndex;

pub use self::lower::{DiskOp, LoadedBlock};
use self::lower::{HostValues, Promoting};
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
    /// How long it stays servable after a use, and until when (ms of the machine's clock).
    ttl_ms: u64,
    expires_at_ms: u64,
    /// A copy is on the disk tier (or was handed to its writer).
    persisted: bool,
}

pub struct CacheMachine {
    node: u32,
    addr: Addr,
    /// (instance, key) → a block its pool caches.
    entries: BTreeMap<(u32, u64), Entry>,
    /// Least recently stored or fetched first, for the capacity bound.
    order: BTreeMap<u64, (u32, u64)>,
    stamp: u64,
    /// f32 values held, and the most allowed (a lost eviction must not grow the store forever).
    held: usize,
    capacity: usize,
    /// Host memory below the pools, by key (any instance of the node).
    host: TierIndex<HostValues>,
    /// A disk tier is configured.
    disk: bool,
    /// Key → parent of blocks known to be on the disk tier (written here or found at start).
    on_disk: BTreeMap<u64, u64>,
    /// Promotions waiting on disk reads, by the first read's id.
    promoting: BTreeMap<u64, Promoting>,
    /// Disk read id → the promotion and item it is for.
    reads: BTreeMap<u64, (u64, usize)>,
    next_read: u64,
    now_ms: u64,
    /// Frames to send, oldest first.
    out: Vec<Outgoing>,
    disk_ops: Vec<DiskOp>,
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
        let keep_until = self.now_ms;
        if let Some(e) = self.entries.get_mut(&key) {
            // A new entry has no slot yet: its placeholder stamp may be another's.
            if self.order.get(&e.stamp) == Some(&key) {
                self.order.remove(&e.stamp);
            }
            e.stamp = self.stamp;
            e.expires_at_ms = e.expires_at_ms.max(keep_until.saturating_add(e.ttl_ms));
            self.order.insert(self.stamp, key);
            self.stamp += 1;
        }
    }

    /// Take a pool block out of the store (it goes to host memory, or is dropped).
    fn take_entry(&mut self, key: (u32, u64)) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        if self.order.get(&e.stamp) == Some(&key) {
            self.order.remove(&e.stamp);
        }
        self.held -= e.values.len();
        Some(e)
    }

    /// Put a block in `instance`'s pool store as the most recently used,
    /// moving the least recently used ones down past the capacity.
    fn put_entry(&mut self, instance: u32, key: u64, entry: Entry) {
        self.take_entry((instance, key));
        // Memory tiers are exclusive: the block is in a pool now.
        self.host.take(key);
        self.held += entry.values.len();
        self.entries.insert((instance, key), entry);
        self.touch((instance, key));
        while self.held > self.capacity {
            let Some((_, victim)) = self.order.pop_first() else { break };
            self.demote(victim);
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
            let persisted = self.on_disk.get(&b.hash) == Some(&b.parent);
            let entry = Entry {
                parent: b.parent,
                tokens: b.tokens,
                lens: b.lens,
                values,
                stamp: 0,
                ttl_ms: b.ttl_ms,
                expires_at_ms: self.now_ms.saturating_add(b.ttl_ms),
                persisted,
            };
            self.put_entry(instance, b.hash, entry);
            bump(&self.ctx.metrics.blocks_stored);
        }
    }

    fn reject(&self, why: &str) {
        bump(&self.ctx.metrics.frames_rejected);
        self.ctx.events.record(format_args!("{} rejects: {why}", self.addr));
    }

    /// Whether `instance`'s pool store holds `key` with these tokens after `parent`.
    fn in_pool(&self, instance: u32, key: u64, parent: u64, tokens: &[u32]) -> bool {
        self.entries.get(&(instance, key)).is_some_and(|e| e.parent == parent && e.tokens == tokens)
    }

    /// Leading blocks of the chain `hashes` over `tokens` that `instance`'s pool holds.
    fn matched(&self, instance: u32, hashes: &[u64], tokens: &[u32]) -> usize {
        let bt = self.ctx.block_tokens;
        let mut parent = 0;
        for (k, &h) in hashes.iter().enumerate() {
            let Some(want) = tokens.get(k * bt..(k + 1) * bt) else { return k };
            if !self.in_pool(instance, h, parent, want) {
                return k;
            }
            parent = h;
        }
        hashes.len()
    }

    /// A restore's blocks: from the pool store, or from host memory when the
    /// store moved one down (it goes back up).
    fn fetch(&mut self, from: Addr, query: u64, instance: u32, items: Vec<FetchItem>) {
        let bt = self.ctx.block_tokens;
        let mut out = Vec::with_capacity(items.len());
        let mut body = Vec::new();
        for it in items {
            let n = it.hashes.len();
            let mut parent = 0;
            let mut lens = Vec::with_capacity(n);
            let mut values = Vec::new();
            let usable = n > 0 && it.tokens.len() >= n * bt;
            for (k, &h) in it.hashes.iter().enumerate().take_while(|_| usable) {
                let want = &it.tokens[k * bt..(k + 1) * bt];
                if !(self.in_pool(instance, h, parent, want) || self.lift_from_host(instance, h, parent, want)) {
                    break;
                }
                // Copied now: bringing a later block up may move this one down again.
                let Some(e) = self.entries.get(&(instance, h)) else { break };
                lens.push(e.lens.clone());
                values.extend_from_slice(&e.values);
                self.touch((instance, h));
                parent = h;
            }
            if usable && lens.len() == n {
                body.extend_from_slice(&values);
                bump(&self.ctx.metrics.cache_hits);
                // A prefix another request hit is worth keeping on disk.
                self.persist(instance, &it.hashes);
                out.push(FetchedItem { seq: it.seq, found: true, lens });
            } else {
                bump(&self.ctx.metrics.cache_misses);
                self.ctx.events.record(format_args!("{} misses {n} blocks of sequence {}", self.addr, it.seq));
                out.push(FetchedItem { seq: it.seq, found: false, lens: Vec::new() });
            }
        }
        self.send(from, Message::Cache(CacheMsg::Fetched { query, items: out }), &body);
    }

    /// The router's question for one prompt: per instance of the node, its
    /// pool's leading blocks, then those in host memory, then on disk; and
    /// the prompt's leading blocks known to be on disk.
    fn lookup(&self, hashes: &[u64], tokens: &[u32]) -> (Vec<InstanceMatch>, u32) {
        let bt = self.ctx.block_tokens;
        let usable = hashes.len().min(tokens.len() / bt);
        let matches = self
            .ctx
            .topology
            .instances_on(self.node)
            .into_iter()
            .map(|instance| {
                let blocks = self.matched(instance, &hashes[..usable], tokens);
                let (mut host_blocks, mut disk_blocks) = (0, 0);
                let mut parent = if blocks == 0 { 0 } else { hashes[blocks - 1] };
                for (k, &h) in hashes.iter().enumerate().take(usable).skip(blocks) {
                    let want = &tokens[k * bt..(k + 1) * bt];
                    if disk_blocks == 0 && self.host.peek(self.now_ms, h, parent, want).is_some() {
                        host_blocks += 1;
                    } else if self.on_disk.get(&h) == Some(&parent) {
                        disk_blocks += 1;
                    } else {
                        break;
                    }
                    parent = h;
                }
                InstanceMatch { instance, blocks: blocks as u32, host_blocks, disk_blocks }
            })
            .collect();
        let mut parent = 0;
        let disk_chain = hashes[..usable]
            .iter()
            .take_while(|&&h| {
                let on = self.on_disk.get(&h) == Some(&parent);
                parent = h;
                on
            })
            .count();
        (matches, disk_chain as u32)
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
        // Modelled devices have their own modelled tiers.
        let tiers = if ctx.modelled.is_some() { Default::default() } else { ctx.cache_tiers.clone() };
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
        let mut machine = CacheMachine {
            node,
            addr,
            entries: BTreeMap::new(),
            order: BTreeMap::new(),
            stamp: 0,
            held: 0,
            capacity,
            host: TierIndex::new(tiers.host_bytes),
            disk: tiers.disk.is_some(),
            on_disk: BTreeMap::new(),
            promoting: BTreeMap::new(),
            reads: BTreeMap::new(),
            next_read: 0,
            now_ms: now.as_millis() as u64,
            out: Vec::new(),
            disk_ops: Vec::new(),
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

    /// Whether the machine asks for disk I/O at all.
    pub fn has_disk(&self) -> bool {
        self.disk
    }

    /// The frames the inputs handled so far asked to send.
    pub fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.out)
    }

    /// The disk reads and writes the inputs handled so far asked for.
    pub fn take_disk_ops(&mut self) -> Vec<DiskOp> {
        std::mem::take(&mut self.disk_ops)
    }

    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) {
        self.out.extend(super::encode(&self.ctx.events, self.addr, to, msg, body));
    }

    /// React to one frame at `now`. The store stays within its capacity after every input.
    pub fn handle(&mut self, now: Duration, d: Delivery) {
        self.advance(now);
        self.dispatch(d);
        self.check();
    }

    fn advance(&mut self, now: Duration) {
        let now_ms = now.as_millis() as u64;
        assert!(now_ms >= self.now_ms, "{}: time went backwards", self.addr);
        self.now_ms = now_ms;
        self.host.expire(now_ms);
    }

    fn check(&self) {
        assert!(self.held <= self.capacity, "{}: {} values held over {}", self.addr, self.held, self.capacity);
        assert_eq!(self.entries.len(), self.order.len(), "{}: LRU order out of step", self.addr);
        assert!(self.host.used_bytes() <= self.host.capacity_bytes(), "{}: host tier over its bytes", self.addr);
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
                    self.demote((instance, h));
                }
            }
            Message::Cache(CacheMsg::Clear { instance }) if mine(instance) => {
                let keys: Vec<(u32, u64)> =
                    self.entries.range((instance, 0)..=(instance, u64::MAX)).map(|(k, _)| *k).collect();
                for k in keys {
                    self.demote(k);
                }
            }
            Message::Cache(CacheMsg::Fetch { query, instance, items, .. }) if mine(instance) => {
                self.fetch(from, query, instance, items);
            }
            Message::Cache(CacheMsg::Persist { instance, hashes }) if mine(instance) => {
                self.persist(instance, &hashes);
            }
            Message::Cache(CacheMsg::Promote { query, instance, items }) if mine(instance) => {
                self.promote(from, query, instance, items);
            }
            Message::Cache(CacheMsg::Lookup { query, hashes, tokens }) => {
                let (matches, disk_chain) = self.lookup(&hashes, &tokens);
                let reply = CacheMsg::Matched { query, node, matches, disk_chain };
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
