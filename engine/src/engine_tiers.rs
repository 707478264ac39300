//! The engine's side of the prompt cache's tiers: evicted device blocks
//! move to host memory; waiting requests' prefixes move up from host (and
//! from disk, through [`Engine::offer_blocks`]) before they are admitted;
//! blocks at persist points are handed out for the disk tier; each hit is
//! counted by the tier it came from.
//!
//! The disk tier itself (files, directories) is I/O and lives with the
//! caller; this side only decides what goes there and takes back what is read.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Deref;
use std::sync::Arc;

use crate::block_values::BlockValues;
use crate::engine::Engine;
use crate::kv_pool::BlockId;
use crate::kv_tiers::{PersistRule, Tier, TierIndex, TierTokens};
use crate::model::Model;
use crate::prefix_cache::EvictedBlock;
use crate::request::{FinishReason, Finished, RequestId};
use crate::scheduler::ScheduledItem;

/// Most blocks waiting to be written to disk; more are dropped and counted.
pub const MAX_PERSIST_QUEUE: usize = 4096;
/// Waiting requests whose prefixes are brought up per step.
const PROMOTE_SCAN: usize = 32;

/// A block held in host memory.
#[derive(Debug)]
pub struct HostBlock {
    values: Arc<BlockValues>,
    /// A copy is on disk.
    persisted: bool,
    /// Where it came from before host memory, for hit accounting.
    origin: Tier,
}

/// A block to write to the disk tier.
#[derive(Clone, Debug)]
pub struct PersistBlock {
    pub key: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub values: Arc<BlockValues>,
    pub ttl_ms: u64,
}

/// A block read from the disk tier for a waiting request.
#[derive(Debug)]
pub struct FetchedBlock {
    pub key: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub values: BlockValues,
    pub expires_at_ms: u64,
}

/// A prefix block of a waiting request that no memory tier holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedBlock {
    pub key: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
}

/// Counters of the tiers as the engine sees them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Prompt tokens served by each tier, by [`Tier::index`].
    pub hit_tokens: [u64; 3],
    /// Blocks brought into the device pool from host memory and from disk.
    pub promoted_blocks: [u64; 3],
    /// Blocks handed out for the disk tier.
    pub persist_blocks: u64,
    /// Blocks not persisted because the queue to disk was full.
    pub persist_dropped: u64,
}

/// Settings of the tiers below the device pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes of block values host memory may hold (0: no host tier).
    pub host_bytes: usize,
    /// A disk tier takes persisted blocks and offers fetched ones.
    pub disk: bool,
    pub persist: PersistRule,
}

/// A running request's cached blocks, in order from position 0, and what
/// persisting them needs once the scheduler has forgotten the request.
#[derive(Debug)]
struct Chain {
    blocks: Vec<BlockId>,
    /// Leading blocks handed out for disk (or found there).
    persisted: usize,
    prompt_blocks: usize,
    ttl_ms: u64,
    persist: bool,
}

/// The engine's tier state.
#[derive(Debug)]
pub(crate) struct Tiers {
    config: TierConfig,
    pub(crate) host: TierIndex<HostBlock>,
    /// Device blocks with a copy on disk.
    persisted: BTreeSet<BlockId>,
    /// Device blocks brought up from a lower tier and not hit yet.
    promoted: BTreeMap<BlockId, Tier>,
    /// Each running request's chain of cached blocks.
    chains: BTreeMap<RequestId, Chain>,
    hit_tiers: BTreeMap<RequestId, TierTokens>,
    /// Waiting requests whose disk blocks were asked for already.
    asked: BTreeSet<RequestId>,
    outbox: Vec<PersistBlock>,
    pub(crate) counters: TierCounters,
}

impl Tiers {
    pub(crate) fn new(config: TierConfig) -> Self {
        Self {
            config,
            host: TierIndex::new(config.host_bytes),
            persisted: BTreeSet::new(),
            promoted: BTreeMap::new(),
            chains: BTreeMap::new(),
            hit_tiers: BTreeMap::new(),
            asked: BTreeSet::new(),
            outbox: Vec::new(),
            counters: TierCounters::default(),
        }
    }
}

impl<M: Deref<Target = Model>> Engine<M> {
    /// Set up the tiers below the device pool.
    pub fn configure_tiers(&mut self, config: TierConfig) {
        self.tiers = Tiers::new(config);
    }

    pub fn tier_config(&self) -> TierConfig {
        self.tiers.config
    }

    /// Move the clock TTLs are measured against; expired blocks leave every tier.
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.scheduler.set_now_ms(now_ms);
        self.tiers.host.expire(self.scheduler.now_ms());
    }

    /// Keep a waiting request out of admission while its prefix is fetched (`true`), or let it in.
    pub fn hold(&mut self, id: RequestId, held: bool) {
        self.scheduler.hold(id, held);
    }

    pub fn tier_counters(&self) -> &TierCounters {
        &self.tiers.counters
    }

    /// The host tier's index (bytes, blocks, its own counters).
    pub fn host_tier(&self) -> &TierIndex<HostBlock> {
        &self.tiers.host
    }

    /// Blocks to write to the disk tier since the last call.
    pub fn take_persist(&mut self) -> Vec<PersistBlock> {
        std::mem::take(&mut self.tiers.outbox)
    }

    /// Prefix blocks of waiting requests, not asked for before, that neither
    /// the device nor host memory holds: the disk tier may. The caller holds
    /// each listed request ([`Scheduler::hold`](crate::scheduler::Scheduler::hold))
    /// until it has offered what it found.
    pub fn wanted_blocks(&mut self, requests_max: usize) -> Vec<(RequestId, Vec<WantedBlock>)> {
        if !self.tiers.config.disk {
            return Vec::new();
        }
        let now = self.scheduler.now_ms();
        let mut out = Vec::new();
        for id in self.scheduler.waiting(requests_max) {
            if !self.tiers.asked.insert(id) {
                continue;
            }
            let wanted: Vec<WantedBlock> = self
                .scheduler
                .prefix_keys(id)
                .into_iter()
                .skip_while(|(key, parent, tokens)| {
                    self.scheduler.cached_block(*key, *parent, tokens).is_some()
                        || self.tiers.host.peek(now, *key, *parent, tokens).is_some()
                })
                .map(|(key, parent, tokens)| WantedBlock { key, parent, tokens })
                .collect();
            if !wanted.is_empty() {
                out.push((id, wanted));
            }
        }
        out
    }

    /// Blocks read from disk for waiting request `id`: into the device pool
    /// if there is room (never evicting the blocks of its prefix already
    /// there), else host memory.
    pub fn offer_blocks(&mut self, id: RequestId, blocks: Vec<FetchedBlock>) {
        if self.scheduler.status(id).is_some() {
            self.touch_device_prefix(id);
        }
        let spare_since = self.scheduler.eviction_clock();
        for b in blocks {
            let values = Arc::new(b.values);
            let adoption = self.scheduler.adopt(b.key, b.parent, &b.tokens, b.expires_at_ms, spare_since);
            self.on_evicted(adoption.evicted);
            match adoption.block {
                Some(id) => {
                    self.stored.entry(id).or_insert(values);
                    self.tiers.persisted.insert(id);
                    self.tiers.promoted.entry(id).or_insert(Tier::Disk);
                    self.tiers.counters.promoted_blocks[Tier::Disk.index()] += 1;
                }
                None => {
                    let bytes = values.value_bytes();
                    let host = HostBlock { values, persisted: true, origin: Tier::Disk };
                    let now = self.scheduler.now_ms();
                    // Removed host blocks are dropped: disk or nothing holds them.
                    let _ = self.tiers.host.insert(now, b.key, b.parent, &b.tokens, bytes, b.expires_at_ms, host);
                }
            }
        }
    }

    /// Make the leading device-cached blocks of `id`'s prefix the most
    /// recently used, so bringing up the rest does not evict them.
    /// Returns how many leading blocks the device holds.
    fn touch_device_prefix(&mut self, id: RequestId) -> usize {
        let blocks = self.scheduler.prefix_blocks(id);
        for k in 0..blocks {
            let (key, parent, tokens) = self.scheduler.prefix_block(id, k);
            match self.scheduler.cached_block(key, parent, tokens) {
                Some(b) => self.scheduler.touch_cached(b),
                None => return k,
            }
        }
        blocks
    }

    /// Blocks that left the device pool: expired ones are dropped, evicted
    /// ones move to host memory.
    pub(crate) fn on_evicted(&mut self, evicted: Vec<EvictedBlock>) {
        let now = self.scheduler.now_ms();
        for e in evicted {
            let id = e.blocks.compressed;
            let values = self.stored.remove(&id);
            let persisted = self.tiers.persisted.remove(&id);
            let origin = self.tiers.promoted.remove(&id).unwrap_or(Tier::Device);
            let (Some(values), false) = (values, e.expired) else { continue };
            if self.tiers.host.capacity_bytes() == 0 {
                continue;
            }
            let bytes = values.value_bytes();
            let host =
                HostBlock { values, persisted, origin: if origin == Tier::Device { Tier::Host } else { origin } };
            let _ = self.tiers.host.insert(now, e.key, e.parent, &e.tokens, bytes, e.expires_at_ms, host);
        }
    }

    /// Before admission: bring the host-held prefix blocks of waiting
    /// requests into the device pool, after the blocks they already have there.
    pub(crate) fn promote_waiting(&mut self) {
        if self.tiers.host.is_empty() {
            return;
        }
        let now = self.scheduler.now_ms();
        let waiting: Vec<RequestId> =
            self.scheduler.waiting(PROMOTE_SCAN).into_iter().filter(|&id| !self.scheduler.is_held(id)).collect();
        // Every scanned request's device-held head is spared, not only the first's.
        let heads: Vec<usize> = waiting.iter().map(|&id| self.touch_device_prefix(id)).collect();
        let spare_since = self.scheduler.eviction_clock();
        for (id, head) in waiting.into_iter().zip(heads) {
            let keep_until = now.saturating_add(self.scheduler.cache_ttl_ms(id));
            for k in head..self.scheduler.prefix_blocks(id) {
                let (key, parent, tokens) = self.scheduler.prefix_block(id, k);
                if self.scheduler.cached_block(key, parent, tokens).is_some() {
                    continue;
                }
                if self.tiers.host.hit(now, key, parent, tokens, keep_until).is_none() {
                    break;
                }
                let tokens = tokens.to_vec();
                let taken = self.tiers.host.take(key).expect("just hit");
                let adoption = self.scheduler.adopt(key, parent, &tokens, taken.expires_at_ms, spare_since);
                self.on_evicted(adoption.evicted);
                let Some(b) = adoption.block else {
                    // No room on the device: it stays in host memory.
                    let _ = self.tiers.host.insert(
                        now,
                        key,
                        parent,
                        &tokens,
                        taken.bytes,
                        taken.expires_at_ms,
                        taken.value,
                    );
                    break;
                };
                let HostBlock { values, persisted, origin } = taken.value;
                self.stored.insert(b, values);
                if persisted {
                    self.tiers.persisted.insert(b);
                }
                self.tiers.promoted.insert(b, origin);
                self.tiers.counters.promoted_blocks[origin.index()] += 1;
            }
        }
    }

    /// A request was (re)admitted with these cached blocks: count its hit by
    /// tier on its first admission; a shared prefix is a persist point.
    pub(crate) fn on_admitted(&mut self, item: &ScheduledItem) {
        let Some(hit) = &item.start else { return };
        let bt = self.scheduler.layout().block_tokens;
        let mut by_tier = [0usize; 3];
        for b in hit {
            let tier = self.tiers.promoted.remove(b).unwrap_or(Tier::Device);
            by_tier[tier.index()] += bt;
        }
        if !self.tiers.hit_tiers.contains_key(&item.id) {
            for (t, n) in by_tier.iter().enumerate() {
                self.tiers.counters.hit_tokens[t] += *n as u64;
            }
            self.tiers.hit_tiers.insert(item.id, by_tier);
        }
        let chain = Chain {
            blocks: hit.clone(),
            persisted: 0,
            prompt_blocks: self.scheduler.request(item.id).prompt.len() / bt,
            ttl_ms: self.scheduler.cache_ttl_ms(item.id),
            persist: self.scheduler.cache_persist(item.id),
        };
        self.tiers.chains.insert(item.id, chain);
        if !hit.is_empty() {
            self.persist(item.id, hit.len());
        }
    }

    /// Block `k` of `id` is cached as `block`.
    pub(crate) fn on_registered(&mut self, id: RequestId, k: usize, block: BlockId) {
        let Some(chain) = self.tiers.chains.get_mut(&id) else { return };
        if chain.blocks.len() != k {
            return;
        }
        chain.blocks.push(block);
        if let Some(upto) = self.tiers.config.persist.point(k, chain.prompt_blocks) {
            self.persist(id, upto);
        }
    }

    /// `id` ended: a finished output is a persist point; its hit split by
    /// tier goes into `finished`.
    pub(crate) fn on_finished(&mut self, id: RequestId, finished: &mut Finished) {
        if matches!(finished.reason, FinishReason::Stop | FinishReason::Length) {
            let blocks = self.tiers.chains.get(&id).map_or(0, |c| c.blocks.len());
            self.persist(id, blocks);
        }
        self.forget_tiers(id);
        if let Some(split) = self.tiers.hit_tiers.remove(&id) {
            finished.cached_tokens_by_tier = split;
        }
    }

    pub(crate) fn forget_tiers(&mut self, id: RequestId) {
        self.tiers.chains.remove(&id);
        self.tiers.asked.remove(&id);
    }

    /// A request was preempted: its chain is rebuilt on readmission.
    pub(crate) fn on_preempted(&mut self, id: RequestId) {
        self.tiers.chains.remove(&id);
    }

    /// Hand out the first `upto` blocks of `id`'s chain for disk, those not there yet.
    fn persist(&mut self, id: RequestId, upto: usize) {
        let Some(chain) = self.tiers.chains.get_mut(&id) else { return };
        if !self.tiers.config.disk || !chain.persist {
            return;
        }
        let upto = upto.min(chain.blocks.len());
        let ttl_ms = chain.ttl_ms;
        for &b in &chain.blocks[chain.persisted.min(upto)..upto] {
            if self.tiers.persisted.contains(&b) {
                continue;
            }
            let (Some(values), Some((key, parent, tokens))) = (self.stored.get(&b), self.scheduler.cached_key(b))
            else {
                continue;
            };
            if self.tiers.outbox.len() >= MAX_PERSIST_QUEUE {
                self.tiers.counters.persist_dropped += 1;
                continue;
            }
            self.tiers.persisted.insert(b);
            self.tiers.counters.persist_blocks += 1;
            self.tiers.outbox.push(PersistBlock {
                key,
                parent,
                tokens: tokens.to_vec(),
                values: values.clone(),
                ttl_ms,
            });
        }
        chain.persisted = chain.persisted.max(upto);
    }
}
