//! The scheduler's side of the modelled cache tiers ([`crate::modelled::tiers`]):
//! the engine policy's clock follows the simulation's; evicted device blocks
//! go down; computed blocks are written through to the shared store; a
//! waiting request whose prefix continues in a lower tier is held while the
//! blocks are read, then they are adopted into the device pool (and the
//! node's CacheManager, valueless) and it is let in; each first admission
//! is recorded with the tokens each tier served.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use deepinfer_engine::kv_pool::BlockId;
use deepinfer_engine::prefix_cache::EvictedBlock;
use deepinfer_engine::request::RequestId;
use deepinfer_engine::scheduler::ScheduledItem;

use super::{Effect, SchedulerMachine};
use crate::cluster::disagg::InstanceKind;
use crate::modelled::tiers::{Admission, Found, ModelledTiers, SimTier, TIERS};
use crate::wire::{CacheMsg, Message, StoredBlock};

use crate::limits::LOOKUP_SCAN;

/// A held request's prefix on its way up.
struct Load {
    ready_us: u64,
    held_since_us: u64,
}

/// Per scheduler incarnation.
#[derive(Default)]
pub(super) struct TierGlue {
    /// Device blocks brought up from a lower tier and not hit yet.
    promoted: BTreeMap<BlockId, SimTier>,
    loading: BTreeMap<RequestId, Load>,
    /// How long each request's lower-tier reads took (queueing on the
    /// links included), until its first admission.
    waited: BTreeMap<RequestId, u64>,
    /// Requests whose first admission was recorded (or that came prefilled).
    counted: BTreeSet<RequestId>,
    /// Waiting requests looked up at least once.
    checked: BTreeSet<RequestId>,
    /// Wake-ups already armed (µs).
    armed: BTreeSet<u64>,
}

impl SchedulerMachine {
    fn tiers(&self) -> Option<Arc<crate::modelled::devices::Modelled>> {
        self.ctx.modelled.clone().filter(|m| m.tiers.is_some())
    }

    fn now_us(&self) -> u64 {
        self.now().as_micros() as u64
    }

    /// Before a plan: the policy's clock; finished loads adopted and their
    /// requests let in; new waiting requests looked up below the device.
    pub(super) fn tiers_before_plan(&mut self, step: u64) {
        let now_us = self.now_us();
        self.policy.set_now_ms(now_us / 1000);
        let Some(m) = self.tiers() else { return };
        let tiers = m.tiers.as_ref().expect("checked");
        if !tiers.any() {
            return;
        }
        tiers.expire(self.instance, now_us / 1000);
        let ready: Vec<RequestId> =
            self.tier_glue.loading.iter().filter(|(_, l)| l.ready_us <= now_us).map(|(id, _)| *id).collect();
        for rid in ready {
            let load = self.tier_glue.loading.remove(&rid).expect("listed");
            *self.tier_glue.waited.entry(rid).or_default() += load.ready_us.saturating_sub(load.held_since_us);
            if self.by_rid.contains_key(&rid) {
                self.adopt_prefix(tiers, rid, step);
                self.policy.hold(rid, false);
            }
        }
        if self.ctx.kind(self.instance) != InstanceKind::Decode {
            self.look_up_waiting(tiers, now_us);
        }
        self.arm_tier_wakeups(now_us);
    }

    /// Start reading the lower-tier prefix of waiting requests (again, if
    /// what the device held of it has gone down since).
    fn look_up_waiting(&mut self, tiers: &ModelledTiers, now_us: u64) {
        for (i, rid) in self.policy.waiting(usize::MAX).into_iter().enumerate() {
            let again = i < LOOKUP_SCAN;
            if self.tier_glue.loading.contains_key(&rid)
                || !self.by_rid.contains_key(&rid)
                || !(self.tier_glue.checked.insert(rid) || again)
            {
                continue;
            }
            self.look_up(tiers, rid, now_us);
        }
    }

    /// A request arrived: its prefix is read from lower tiers while it
    /// waits in the queue, not after the next plan.
    pub(super) fn tiers_arrived(&mut self, rid: RequestId) {
        let Some(m) = self.tiers() else { return };
        let tiers = m.tiers.as_ref().expect("checked");
        if !tiers.any() || self.ctx.kind(self.instance) == InstanceKind::Decode {
            return;
        }
        let now_us = self.now_us();
        self.policy.set_now_ms(now_us / 1000);
        self.tier_glue.checked.insert(rid);
        self.look_up(tiers, rid, now_us);
        self.arm_tier_wakeups(now_us);
    }

    /// Hold `rid` while the blocks of its prefix past the device's are read.
    fn look_up(&mut self, tiers: &ModelledTiers, rid: RequestId, now_us: u64) {
        let now_ms = now_us / 1000;
        let mut counts = [0usize; TIERS];
        for (key, parent, tokens) in self.policy.prefix_keys(rid) {
            if self.policy.cached_block(key, parent, &tokens).is_some() {
                continue;
            }
            match tiers.locate(self.instance, now_ms, key, parent) {
                Some(t) => counts[t.index()] += 1,
                None => break,
            }
        }
        if counts.iter().sum::<usize>() == 0 {
            return;
        }
        let ready_us = tiers.read(self.instance, now_us, counts);
        self.policy.hold(rid, true);
        self.tier_glue.loading.insert(rid, Load { ready_us, held_since_us: now_us });
    }

    /// Bring `rid`'s prefix up: device blocks kept warm, the rest adopted
    /// from the fastest tier holding each, until one is missing or the pool
    /// is full. Its whole prefix goes into `recent` (modelled blocks hold no
    /// values), so its restore needs no fetch that could overtake the store
    /// of the adopted blocks.
    fn adopt_prefix(&mut self, tiers: &ModelledTiers, rid: RequestId, step: u64) {
        let now_ms = self.now_us() / 1000;
        let ttl = self.policy.cache_ttl_ms(rid);
        let spare_since = self.policy.eviction_clock();
        let (mut stores, mut gone) = (Vec::new(), Vec::new());
        for (key, parent, tokens) in self.policy.prefix_keys(rid) {
            if let Some(b) = self.policy.cached_block(key, parent, &tokens) {
                self.policy.touch_cached(b);
                self.recent.insert(key, (Vec::new(), Vec::new()));
                continue;
            }
            let Some(tier) = tiers.locate(self.instance, now_ms, key, parent) else { break };
            let found = Found { key, parent, tier };
            let adoption = self.policy.adopt(key, parent, &tokens, now_ms.saturating_add(ttl), spare_since);
            self.tiers_evicted(&adoption.evicted);
            gone.extend(adoption.evicted.iter().filter_map(|e| self.cached.remove(&e.blocks.compressed)));
            let Some(b) = adoption.block else { break };
            // Counted and moved up (what the evictions just made room for may have pushed it out
            // of its tier already: it is on the device now either way).
            tiers.take_up(self.instance, now_ms, &found);
            self.tier_glue.promoted.insert(b, tier);
            self.cached.insert(b, key);
            self.recent.insert(key, (Vec::new(), Vec::new()));
            stores.push(StoredBlock { hash: key, parent, tokens, lens: Vec::new(), ttl_ms: ttl });
        }
        if !gone.is_empty() {
            let msg = CacheMsg::Evict { instance: self.instance, step, hashes: gone };
            self.send(self.cache, Message::Cache(msg), &[]);
        }
        if !stores.is_empty() {
            let msg = CacheMsg::Store { instance: self.instance, step, blocks: stores };
            self.send(self.cache, Message::Cache(msg), &[]);
        }
    }

    /// Wake the scheduler when a load completes, in case nothing else does.
    fn arm_tier_wakeups(&mut self, now_us: u64) {
        let due: BTreeSet<u64> = self.tier_glue.loading.values().map(|l| l.ready_us).collect();
        self.tier_glue.armed.retain(|&t| t > now_us);
        for at in due {
            if !self.tier_glue.armed.insert(at) {
                continue;
            }
            self.effects.push(Effect::TickAt(std::time::Duration::from_micros(at)));
        }
    }

    /// Device blocks that left the pool (before their keys are forgotten):
    /// those evicted for room go down a tier.
    pub(super) fn tiers_evicted(&mut self, evicted: &[EvictedBlock]) {
        for e in evicted {
            self.tier_glue.promoted.remove(&e.blocks.compressed);
        }
        let Some(m) = self.tiers() else { return };
        let tiers = m.tiers.as_ref().expect("checked");
        let now_ms = self.now_us() / 1000;
        for e in evicted.iter().filter(|e| !e.expired) {
            tiers.demote(self.instance, now_ms, e.key, e.parent, e.expires_at_ms);
        }
    }

    /// A block this instance computed: written through to the shared store.
    pub(super) fn tiers_computed(&self, key: u64, parent: u64) {
        if let Some(m) = self.tiers() {
            m.tiers.as_ref().expect("checked").persist(self.now_us() / 1000, key, parent);
        }
    }

    /// A request came prefilled from another instance: its prompt was counted there.
    pub(super) fn tiers_imported(&mut self, rid: RequestId) {
        self.tier_glue.counted.insert(rid);
    }

    /// An item of a plan was (re)admitted with these cached blocks: on its
    /// first admission, record where its hit came from.
    pub(super) fn tiers_admitted(&mut self, id: u64, it: &ScheduledItem) {
        let Some(hit) = &it.start else { return };
        let Some(m) = self.tiers() else { return };
        if !self.tier_glue.counted.insert(it.id) {
            return;
        }
        let bt = self.ctx.block_tokens;
        let mut by_tier = [0usize; TIERS];
        for b in hit {
            let tier = self.tier_glue.promoted.remove(b).unwrap_or(SimTier::Device);
            by_tier[tier.index()] += bt;
        }
        self.tier_glue.checked.remove(&it.id);
        let load_us = self.tier_glue.waited.remove(&it.id).unwrap_or(0);
        m.tiers.as_ref().expect("checked").record(Admission {
            request: id,
            at_us: self.now_us(),
            prompt_tokens: self.policy.request(it.id).prompt.len(),
            by_tier,
            load_us,
        });
    }

    /// The device cache was cleared: nothing in it came from a lower tier any more.
    pub(super) fn tiers_cleared(&mut self) {
        self.tier_glue.promoted.clear();
    }
}
