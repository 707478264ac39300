//! The scheduler's side of the cache tiers below the device pool: the
//! injected clock TTLs are measured against, the keys of waiting prompts,
//! adopting blocks fetched from the host or disk tier into the pool, and
//! holding a request while its prefix is on its way.

use super::{Scheduler, Seq};
use crate::kv_pool::{BlockId, BlockKind};
use crate::prefix_cache::{CachedBlocks, EvictedBlock};
use crate::request::RequestId;

/// What [`Scheduler::adopt`] did.
#[derive(Debug, Default)]
pub struct Adoption {
    /// The block now cached in the pool, if there was room.
    pub block: Option<BlockId>,
    /// Cached blocks evicted to make room.
    pub evicted: Vec<EvictedBlock>,
}

impl Scheduler {
    /// Advance the clock TTLs are measured against (it never goes back).
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
    }

    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Keep a waiting request out of admission (`true`) or let it in again.
    pub fn hold(&mut self, id: RequestId, held: bool) {
        if !held {
            self.held.remove(&id);
        } else if self.waiting.contains(&id) {
            self.held.insert(id);
        }
    }

    pub fn is_held(&self, id: RequestId) -> bool {
        self.held.contains(&id)
    }

    /// The first `limit` waiting requests in admission order, held ones included.
    pub fn waiting(&self, limit: usize) -> Vec<RequestId> {
        self.waiting.iter().take(limit).copied().collect()
    }

    /// How long blocks `id` computes or hits stay servable.
    pub fn cache_ttl_ms(&self, id: RequestId) -> u64 {
        self.config.ttl_ms(&self.seq(id).request)
    }

    /// Whether `id` lets its blocks be written to shared storage.
    pub fn cache_persist(&self, id: RequestId) -> bool {
        // A block file's key is checked against its tokens alone, so blocks keyed with an image stay off disk.
        let r = &self.seq(id).request;
        r.retention.is_none_or(|r| r.persist) && r.images.is_empty()
    }

    /// Keys of the full blocks before `id`'s last token (those a hit can
    /// serve), with each block's parent key and tokens.
    pub fn prefix_keys(&mut self, id: RequestId) -> Vec<(u64, u64, Vec<u32>)> {
        let blocks = self.prefix_blocks(id);
        (0..blocks)
            .map(|k| {
                let (key, parent, tokens) = self.prefix_block(id, k);
                (key, parent, tokens.to_vec())
            })
            .collect()
    }

    /// Full blocks before `id`'s last token (those a hit can serve), their keys computed.
    pub fn prefix_blocks(&mut self, id: RequestId) -> usize {
        let bt = self.layout().block_tokens;
        let seq: &mut Seq = self.seqs.get_mut(&id).expect("known request");
        let blocks = (seq.tokens.len() - 1) / bt;
        seq.extend_hashes(blocks, bt);
        blocks
    }

    /// Key, parent key and tokens of block `k < prefix_blocks(id)` of `id`.
    pub fn prefix_block(&self, id: RequestId, k: usize) -> (u64, u64, &[u32]) {
        let bt = self.layout().block_tokens;
        let seq = self.seq(id);
        (seq.hashes[k], if k == 0 { 0 } else { seq.hashes[k - 1] }, &seq.tokens[k * bt..(k + 1) * bt])
    }

    /// Key and parent key of block `k` of `id`, once its hash is known.
    pub fn block_key(&self, id: RequestId, k: usize) -> Option<(u64, u64)> {
        let seq = self.seqs.get(&id)?;
        let key = *seq.hashes.get(k)?;
        Some((key, if k == 0 { 0 } else { seq.hashes[k - 1] }))
    }

    /// The device block caching `key`, live now.
    pub fn cached_block(&self, key: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        self.cache.get(self.now_ms, key, parent, tokens).map(|b| b.compressed)
    }

    /// Key, parent key and tokens of a cached device block.
    pub fn cached_key(&self, block: BlockId) -> Option<(u64, u64, &[u32])> {
        self.cache.key_of(block)
    }

    /// Make a cached block the most recently used (a waiting request will use it).
    pub fn touch_cached(&mut self, block: BlockId) {
        self.cache.touch(block);
    }

    /// The cache's logical eviction time; see [`adopt`](Self::adopt).
    pub fn eviction_clock(&self) -> u64 {
        self.cache.clock()
    }

    /// Cache a block fetched from a lower tier in the pool, unreferenced,
    /// evicting only blocks last used before `spare_since` (so a chain being
    /// brought up never evicts its own head). The caller stores its values
    /// under the returned block and handles the evicted ones.
    pub fn adopt(&mut self, key: u64, parent: u64, tokens: &[u32], expires_at_ms: u64, spare_since: u64) -> Adoption {
        let mut adoption = Adoption::default();
        if let Some(b) = self.cached_block(key, parent, tokens) {
            adoption.block = Some(b);
            return adoption;
        }
        if expires_at_ms <= self.now_ms || self.cache.has_key(key) {
            return adoption;
        }
        let layout = self.layout();
        let with_indexer = layout.bytes(BlockKind::Indexer) > 0;
        let needed =
            layout.bytes(BlockKind::Compressed) + if with_indexer { layout.bytes(BlockKind::Indexer) } else { 0 };
        while self.pool.free_bytes() < needed {
            let Some(e) = self.cache.evict_lru_before(spare_since) else { return adoption };
            self.free_cached(e.blocks);
            adoption.evicted.push(e);
        }
        let compressed = self.pool.alloc(BlockKind::Compressed).expect("room was made");
        let indexer = with_indexer.then(|| self.pool.alloc(BlockKind::Indexer).expect("room was made"));
        let blocks = CachedBlocks { compressed, indexer };
        let inserted = self.cache.insert(key, parent, tokens, blocks, expires_at_ms);
        assert!(inserted, "the key was checked free");
        self.pool.release(compressed);
        if let Some(ix) = indexer {
            self.pool.release(ix);
        }
        let kept = self.cache.unreferenced(compressed, self.now_ms);
        assert_eq!(kept, crate::prefix_cache::Released::Kept, "a live block stays cached");
        adoption.block = Some(compressed);
        adoption
    }
}
