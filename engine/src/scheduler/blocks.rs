//! KV blocks of running requests: reserving a step's blocks (evicting
//! cached blocks, then preempting the newest requests), admission with a
//! prefix match, and releasing a request's blocks back to the pool or the
//! prefix cache.

use super::{Scheduler, StepPlan};
use crate::kv_pool::BlockKind;
use crate::prefix_cache::{CachedBlocks, PrefixMode, Released};
use crate::request::{FinishReason, RequestId, RequestStatus};

impl Scheduler {
    /// Allocate `id`'s blocks for `to` positions, evicting cached blocks and
    /// then preempting the newest running requests as needed. False if `id`
    /// itself was preempted or failed.
    pub(super) fn reserve(&mut self, id: RequestId, to: usize, plan: &mut StepPlan) -> bool {
        loop {
            if self.try_grow(id, to) {
                return true;
            }
            if self.evict_one(plan) {
                continue;
            }
            let victim = *self.running.last().expect("the request itself is running");
            if victim == id && self.running.len() == 1 {
                // Alone with an empty cache and still short: admission checks
                // make this unreachable, but never loop on it.
                let finished = self
                    .finish(id, FinishReason::Error(format!("the KV budget cannot hold this request at {to} tokens")));
                plan.failed.push((id, finished));
                return false;
            }
            self.preempt(victim, plan);
            if victim == id {
                return false;
            }
        }
    }

    pub(super) fn evict_one(&mut self, plan: &mut StepPlan) -> bool {
        let Some(e) = self.cache.evict_lru() else { return false };
        self.free_cached(e.blocks);
        plan.evicted.push(e);
        true
    }

    pub(super) fn free_cached(&mut self, b: CachedBlocks) {
        self.pool.free(b.compressed);
        if let Some(ix) = b.indexer {
            self.pool.free(ix);
        }
    }

    /// Allocate what `id` lacks for `to` positions, all or nothing.
    pub(super) fn try_grow(&mut self, id: RequestId, to: usize) -> bool {
        let seq = self.seqs.get_mut(&id).expect("known request");
        let layout = self.pool.layout();
        let mut missing = [0usize; 4];
        let mut bytes = 0;
        for kind in BlockKind::ALL {
            let want = layout.blocks_needed(kind, to);
            let have = seq.blocks.tables[kind.index()].len();
            missing[kind.index()] = want.saturating_sub(have);
            bytes += missing[kind.index()] * layout.bytes(kind);
        }
        if bytes > self.pool.free_bytes() {
            return false;
        }
        for kind in BlockKind::ALL {
            for _ in 0..missing[kind.index()] {
                let b = self.pool.alloc(kind).expect("checked against free bytes");
                seq.blocks.tables[kind.index()].push(b);
            }
        }
        true
    }

    /// Try to admit the head of the queue with at most `budget` tokens this
    /// step; returns the tokens scheduled.
    pub(super) fn admit(&mut self, id: RequestId, budget: usize, plan: &mut StepPlan) -> Option<usize> {
        let bt = self.layout().block_tokens;
        let replay = self.limits.replay;
        let seq = self.seqs.get_mut(&id).expect("queued request is known");
        let len = seq.tokens.len();
        let mut hit = Vec::new();
        let mut short_match = false;
        let imported = seq.imported;
        if self.mode != PrefixMode::Off && imported == 0 {
            // At least the last token is computed, for its logits.
            let blocks = (len - 1) / bt;
            seq.extend_hashes(blocks, bt);
            hit = self.cache.longest_match(self.now_ms, &seq.hashes[..blocks], &seq.tokens, bt);
            if !hit.is_empty() && hit.len() * bt <= replay {
                short_match = true;
                hit.clear();
            }
        }
        let boundary = hit.len() * bt;
        let keep_until = self.now_ms.saturating_add(self.config.ttl_ms(&seq.request));
        for b in &hit {
            self.pool.retain(b.compressed);
            self.cache.referenced(b.compressed);
            self.cache.extend(b.compressed, keep_until);
            seq.blocks.tables[BlockKind::Compressed.index()].push(b.compressed);
            if let Some(ix) = b.indexer {
                self.pool.retain(ix);
                seq.blocks.tables[BlockKind::Indexer.index()].push(ix);
            }
        }
        seq.registered = hit.len();
        seq.computed = if imported > 0 {
            imported
        } else if hit.is_empty() {
            0
        } else {
            boundary - replay
        };
        seq.replay_until = if hit.is_empty() { 0 } else { boundary };
        let from = seq.computed;
        let to = from + (len - from).min(budget).min(self.config.max_chunk_tokens.unwrap_or(usize::MAX).max(1));
        while !self.try_grow(id, to) {
            if !self.evict_one(plan) {
                self.release_blocks(id);
                return None;
            }
        }
        self.remove_waiting(id);
        self.running.push(id);
        let stats = &mut self.cache.stats;
        let seq = self.seqs.get_mut(&id).expect("known request");
        if self.mode != PrefixMode::Off && imported == 0 {
            stats.lookups += 1;
            stats.lookup_tokens += len as u64;
            stats.short_matches += u64::from(short_match);
            if !hit.is_empty() {
                stats.hits += 1;
                stats.hit_tokens += boundary as u64;
                stats.replayed_tokens += replay as u64;
            }
        }
        if seq.preemptions == 0 {
            seq.cached_tokens = boundary;
        }
        seq.status = RequestStatus::Prefilling;
        self.stats.admissions += 1;
        plan.items.push(self.item(id, from, to, Some(hit.iter().map(|b| b.compressed).collect())));
        Some(to - from)
    }

    /// Drop all of `id`'s block references, tail first, so the tail of a
    /// cached chain is evicted before its head.
    pub(super) fn release_blocks(&mut self, id: RequestId) {
        let seq = self.seqs.get_mut(&id).expect("known request");
        let tables = std::mem::take(&mut seq.blocks.tables);
        seq.registered = 0;
        seq.computed = 0;
        seq.replay_until = 0;
        let [window, compressed, indexer, partial] = tables;
        for b in window.into_iter().chain(partial) {
            self.pool.release(b);
            self.pool.free(b);
        }
        for (k, &c) in compressed.iter().enumerate().rev() {
            let ix = indexer.get(k).copied();
            let left = self.pool.release(c);
            if let Some(ix) = ix {
                self.pool.release(ix);
            }
            if left == 0 {
                match self.cache.unreferenced(c, self.now_ms) {
                    Released::Kept => {}
                    Released::Expired(expired) => {
                        self.free_cached(expired.blocks);
                        self.dropped.push(expired);
                    }
                    Released::NotCached => self.free_cached(CachedBlocks { compressed: c, indexer: ix }),
                }
            }
        }
    }

    pub(super) fn preempt(&mut self, id: RequestId, plan: &mut StepPlan) {
        self.release_blocks(id);
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        let seq = self.seqs.get_mut(&id).expect("known request");
        seq.status = RequestStatus::Preempted;
        seq.imported = 0;
        seq.preemptions += 1;
        self.stats.preemptions += 1;
        plan.preempted.push(id);
    }
}
