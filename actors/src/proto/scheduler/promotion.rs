//! The scheduler's side of its node's cache tiers below the pool, for real
//! devices (modelled ones use `tiers.rs`): a new request whose prefix goes
//! on past the pool is held (no batch slot, no KV) while the cache manager
//! brings those blocks up from host memory or disk (`Promote` →
//! `Promoted`); they are adopted into the pool and the request is let in
//! with a hit. Blocks computed at the persist points, and the chain of each
//! finished request, are offered to the disk tier (`Persist`).

use std::collections::BTreeMap;

use deepinfer_engine::request::RequestId;

use super::SchedulerMachine;
use crate::cluster::disagg::InstanceKind;
use crate::proto::cache::parts_len;
use crate::wire::{CacheMsg, CacheTier, Message, OutputEnd, OutputItem, PromoteItem, PromotedItem};

/// A request held while its prefix comes up: the keys asked for, from `first`.
struct Held {
    rid: RequestId,
    first: usize,
    keys: Vec<(u64, u64, Vec<u32>)>,
}

/// Promotions in flight, by query; the pool blocks they brought up, until
/// a request hits them; what each request's hits came from.
#[derive(Default)]
pub(super) struct Promotions {
    held: BTreeMap<u64, Held>,
    /// Pool blocks (by key) brought up and not hit yet, with the tier they came from.
    promoted: BTreeMap<u64, CacheTier>,
    /// Per request: tokens its hits took from host memory and from disk.
    hits: BTreeMap<u64, [u32; 2]>,
}

impl SchedulerMachine {
    /// Whether this instance looks below its pool at all.
    fn promotes(&self) -> bool {
        self.ctx.modelled.is_none()
            && self.ctx.cache_tiers.any()
            && self.ctx.engine.prefix_mode != deepinfer_engine::prefix_cache::PrefixMode::Off
            && self.ctx.kind(self.instance) != InstanceKind::Decode
    }

    /// A request arrived: ask for the blocks of its prefix that the pool lacks.
    pub(super) fn promote_arrived(&mut self, rid: RequestId) {
        let Some(&id) = self.by_rid.get(&rid) else { return };
        if !self.promotes() {
            return;
        }
        self.policy.set_now_ms(self.now().as_millis() as u64);
        let keys = self.policy.prefix_keys(rid);
        let first = keys.iter().take_while(|(k, p, t)| self.policy.cached_block(*k, *p, t).is_some()).count();
        if first == keys.len() {
            return;
        }
        let parent = if first == 0 { 0 } else { keys[first - 1].0 };
        let item = PromoteItem {
            seq: id,
            parent,
            hashes: keys[first..].iter().map(|k| k.0).collect(),
            tokens: keys[first..].iter().flat_map(|k| k.2.iter().copied()).collect(),
        };
        let query = self.queries;
        self.queries += 1;
        let msg = CacheMsg::Promote { query, instance: self.instance, items: vec![item] };
        self.send(self.cache, Message::Cache(msg), &[]);
        self.policy.hold(rid, true);
        self.promotions.held.insert(query, Held { rid, first, keys });
    }

    /// The cache manager's answer: adopt what came up into the pool, in
    /// chain order while there is room (what is not adopted goes back
    /// down), and let the request in.
    pub(super) fn on_promoted(&mut self, query: u64, items: Vec<PromotedItem>, body: Vec<f32>) {
        let Some(held) = self.promotions.held.remove(&query) else { return };
        let now_ms = self.now().as_millis() as u64;
        self.policy.set_now_ms(now_ms);
        let spare_since = self.policy.eviction_clock();
        let alive = self.by_rid.contains_key(&held.rid);
        let mut down = Vec::new();
        let mut adopted = 0;
        let mut at = 0;
        for it in items.iter().take(1) {
            for (j, b) in it.blocks.iter().enumerate() {
                let n = parts_len(&b.lens);
                if body.len() < at + n {
                    break;
                }
                at += n;
                let Some((key, parent, tokens)) = held.keys.get(held.first + j) else { break };
                if !alive || adopted < j {
                    down.push(*key);
                    continue;
                }
                let adoption = self.policy.adopt(*key, *parent, tokens, now_ms.saturating_add(b.ttl_ms), spare_since);
                self.tiers_evicted(&adoption.evicted);
                down.extend(adoption.evicted.iter().filter_map(|e| self.cached.remove(&e.blocks.compressed)));
                match adoption.block {
                    Some(block) => {
                        self.cached.insert(block, *key);
                        self.promotions.promoted.insert(*key, b.tier);
                        adopted += 1;
                    }
                    None => down.push(*key),
                }
            }
        }
        if adopted > 0 {
            self.ctx.events.record(format_args!("{} brought up {adopted} prefix blocks (query {query})", self.addr));
        }
        if !down.is_empty() {
            let msg = CacheMsg::Evict { instance: self.instance, step: 0, hashes: down };
            self.send(self.cache, Message::Cache(msg), &[]);
        }
        self.policy.hold(held.rid, false);
        self.tick();
    }

    /// Request `id` starts from the pool blocks `keys`: those brought up
    /// from a lower tier count there (once: the block is a pool hit after).
    pub(super) fn count_tier_hits(&mut self, id: u64, keys: &[u64]) {
        let bt = self.ctx.block_tokens as u32;
        for key in keys {
            if let Some(tier) = self.promotions.promoted.remove(key) {
                let hits = self.promotions.hits.entry(id).or_default();
                hits[if tier == CacheTier::Host { 0 } else { 1 }] += bt;
            }
        }
    }

    /// A request's last output: the share of its cached tokens that came from below the pool.
    pub(super) fn tier_hits_into(&mut self, item: &mut OutputItem) {
        let Some([host, disk]) = self.promotions.hits.remove(&item.id) else { return };
        if let Some(OutputEnd::Finished(w)) = &mut item.end {
            w.cached_host_tokens = host.min(w.cached_tokens);
            w.cached_disk_tokens = disk.min(w.cached_tokens - w.cached_host_tokens);
        }
    }

    pub(super) fn forget_tier_hits(&mut self, id: u64) {
        self.promotions.hits.remove(&id);
    }

    /// Pool blocks that left the pool are no longer anyone's lower-tier hit.
    pub(super) fn promoted_evicted(&mut self, keys: &[u64]) {
        for key in keys {
            self.promotions.promoted.remove(key);
        }
    }

    /// The cache manager restarted: nothing it was asked will come; let the held requests in.
    pub(super) fn promotions_lost(&mut self) {
        self.promotions.promoted.clear();
        for held in std::mem::take(&mut self.promotions.held).into_values() {
            self.policy.hold(held.rid, false);
        }
    }

    /// Offer the chain `hashes` (from position 0) to the disk tier.
    pub(super) fn persist_chain(&mut self, hashes: Vec<u64>) {
        if hashes.is_empty() || self.ctx.cache_tiers.disk.is_none() || self.ctx.modelled.is_some() {
            return;
        }
        self.send(self.cache, Message::Cache(CacheMsg::Persist { instance: self.instance, hashes }), &[]);
    }
}
