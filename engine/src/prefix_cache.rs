//! The prefix cache: compressed and indexer blocks addressed by the content
//! of every token before them, shared by reference count, evicted least
//! recently used.
//!
//! A block's key is a hash chain over token blocks: XXH64 (seed 0) of the
//! parent block's key as 8 little-endian bytes followed by the block's token
//! ids as 4 little-endian bytes each; the first block's parent is 0. The hash
//! is fixed, so keys are the same across runs and platforms. A match also
//! compares the stored tokens and parent key, so a hash collision can only
//! cost a miss, never a wrong hit.
//!
//! Only compressed state is cached. The sliding-window KV depends on the
//! tokens just before the boundary through every layer, so a hit rebuilds it
//! by replaying tokens before the boundary (see [`PrefixMode`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::config::ModelConfig;
use crate::kv_pool::BlockId;

/// Whether and how prefix hits are used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixMode {
    /// No caching.
    Off,
    /// Replay the dependency cone, `num_layers × (sliding_window − 1)` tokens:
    /// outputs are bit-identical to a cold run.
    Exact,
    /// Replay only the last window, `sliding_window − 1` tokens: cheaper,
    /// deeper layers' windows are approximate, outputs are close but not identical.
    Bounded,
}

impl PrefixMode {
    pub const ALL: [PrefixMode; 3] = [PrefixMode::Off, PrefixMode::Exact, PrefixMode::Bounded];

    pub fn name(self) -> &'static str {
        match self {
            PrefixMode::Off => "off",
            PrefixMode::Exact => "exact",
            PrefixMode::Bounded => "bounded",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Tokens before a hit's boundary that are recomputed to rebuild the window state.
    pub fn replay_tokens(self, cfg: &ModelConfig) -> usize {
        let window = cfg.sliding_window.saturating_sub(1);
        match self {
            PrefixMode::Off => 0,
            // The blocks restore the window state too: nothing to replay.
            PrefixMode::Exact | PrefixMode::Bounded if cfg.blocks_hold_windows => 0,
            // Every layer has a sliding window: the window state at layer l
            // depends on layer l−1's window one window further back.
            PrefixMode::Exact => cfg.num_layers * window,
            PrefixMode::Bounded => window,
        }
    }
}

const P1: u64 = 0x9e37_79b1_85eb_ca87;
const P2: u64 = 0xc2b2_ae3d_27d4_eb4f;
const P3: u64 = 0x1656_67b1_9e37_79f9;
const P4: u64 = 0x85eb_ca77_c2b2_ae63;
const P5: u64 = 0x27d4_eb2f_1656_67c5;

fn xxh_round(acc: u64, input: u64) -> u64 {
    acc.wrapping_add(input.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

fn xxh_merge(h: u64, v: u64) -> u64 {
    (h ^ xxh_round(0, v)).wrapping_mul(P1).wrapping_add(P4)
}

fn read_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// XXH64 of `data` with seed 0 (the reference algorithm, version 0.8):
/// four independent lanes, so it is several times faster than a byte-serial hash.
pub fn xxh64(data: &[u8]) -> u64 {
    let len = data.len();
    let mut rest = data;
    let mut h = if len >= 32 {
        let mut v = [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)];
        while rest.len() >= 32 {
            for (lane, word) in v.iter_mut().zip(rest.chunks_exact(8)) {
                *lane = xxh_round(*lane, read_u64(word));
            }
            rest = &rest[32..];
        }
        let h = v[0]
            .rotate_left(1)
            .wrapping_add(v[1].rotate_left(7))
            .wrapping_add(v[2].rotate_left(12))
            .wrapping_add(v[3].rotate_left(18));
        v.iter().fold(h, |h, &lane| xxh_merge(h, lane))
    } else {
        P5
    };
    h = h.wrapping_add(len as u64);
    while rest.len() >= 8 {
        h = (h ^ xxh_round(0, read_u64(rest))).rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
        rest = &rest[8..];
    }
    if rest.len() >= 4 {
        let k = u64::from(u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")));
        h = (h ^ k.wrapping_mul(P1)).rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
        rest = &rest[4..];
    }
    for &b in rest {
        h = (h ^ u64::from(b).wrapping_mul(P5)).rotate_left(11).wrapping_mul(P1);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(P2);
    h ^= h >> 29;
    h = h.wrapping_mul(P3);
    h ^ (h >> 32)
}

/// Key of a token block whose predecessor's key is `parent` (0 for the first block).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + 4 * tokens.len());
    bytes.extend_from_slice(&parent.to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh64(&bytes)
}

/// The pool blocks of one cached token block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedBlocks {
    /// Compressed entries; also the key of the block's stored values.
    pub compressed: BlockId,
    /// Indexer keys, for models with CSA layers.
    pub indexer: Option<BlockId>,
}

#[derive(Debug)]
struct Entry {
    parent: u64,
    tokens: Box<[u32]>,
    blocks: CachedBlocks,
    /// Position in the eviction order while no sequence references the block.
    stamp: Option<u64>,
    /// No hit is served at or after this time (its TTL; hits extend it).
    expires_at_ms: u64,
}

/// What became of a block whose last reference went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Released {
    /// Cached, now evictable.
    Kept,
    /// Its TTL had run out: no longer cached; free it.
    Expired(EvictedBlock),
    /// It was never cached: free it.
    NotCached,
}

/// A cached block that left the cache: the caller frees its pool blocks and
/// moves its values to a lower tier, or drops them if it expired.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedBlock {
    pub blocks: CachedBlocks,
    pub key: u64,
    pub parent: u64,
    pub tokens: Box<[u32]>,
    pub expires_at_ms: u64,
    /// Its TTL ran out (rather than room being needed).
    pub expired: bool,
}

/// Hit and miss counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Admissions (first or after preemption) that looked the cache up.
    pub lookups: u64,
    /// Tokens of those sequences.
    pub lookup_tokens: u64,
    /// Tokens whose compressed state came from the cache.
    pub hit_tokens: u64,
    /// Admissions that used a hit.
    pub hits: u64,
    /// Matches no longer than the replay, left unused.
    pub short_matches: u64,
    /// Tokens recomputed to rebuild window state after hits.
    pub replayed_tokens: u64,
    pub inserted_blocks: u64,
    pub evicted_blocks: u64,
    /// Blocks dropped because their TTL ran out.
    pub expired_blocks: u64,
}

impl PrefixStats {
    /// Looked-up tokens not served from the cache.
    pub fn miss_tokens(&self) -> u64 {
        self.lookup_tokens - self.hit_tokens
    }

    /// Share of looked-up tokens served from the cache.
    pub fn hit_rate(&self) -> f64 {
        if self.lookup_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.lookup_tokens as f64
        }
    }
}

/// Index of cached blocks. Reference counts live in the
/// [`KvPool`](crate::kv_pool::KvPool); this tracks which blocks are cached
/// and the order in which unreferenced ones are evicted.
#[derive(Debug, Default)]
pub struct PrefixCache {
    // Looked up by key only, never iterated.
    entries: HashMap<u64, Entry>,
    by_block: HashMap<BlockId, u64>,
    /// Unreferenced cached blocks by stamp: the first is evicted first.
    lru: BTreeMap<u64, u64>,
    /// (expiry, key) of every entry: the first expires first.
    expiry: BTreeSet<(u64, u64)>,
    /// Logical time of the eviction order.
    clock: u64,
    pub stats: PrefixStats,
}

impl PrefixCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Unreferenced cached blocks (evictable).
    pub fn evictable(&self) -> usize {
        self.lru.len()
    }

    /// The cached block with key `hash`, if its content is `tokens` after
    /// `parent` and it has not expired at `now_ms`.
    pub fn get(&self, now_ms: u64, hash: u64, parent: u64, tokens: &[u32]) -> Option<CachedBlocks> {
        self.entries
            .get(&hash)
            .filter(|e| e.parent == parent && *e.tokens == *tokens && e.expires_at_ms > now_ms)
            .map(|e| e.blocks)
    }

    /// The leading run of `hashes` (a chain over `tokens` in blocks of
    /// `block_tokens`) that is cached and live at `now_ms`.
    pub fn longest_match(&self, now_ms: u64, hashes: &[u64], tokens: &[u32], block_tokens: usize) -> Vec<CachedBlocks> {
        let mut parent = 0;
        let mut found = Vec::new();
        for (k, &h) in hashes.iter().enumerate() {
            match self.get(now_ms, h, parent, &tokens[k * block_tokens..(k + 1) * block_tokens]) {
                Some(b) => found.push(b),
                None => break,
            }
            parent = h;
        }
        found
    }

    /// Cache `blocks` under `hash`; false if the key is taken. The caller
    /// keeps its reference; the block joins the eviction order when the last
    /// reference goes.
    pub fn insert(&mut self, hash: u64, parent: u64, tokens: &[u32], blocks: CachedBlocks, expires_at_ms: u64) -> bool {
        if self.entries.contains_key(&hash) {
            return false;
        }
        self.entries.insert(hash, Entry { parent, tokens: tokens.into(), blocks, stamp: None, expires_at_ms });
        self.expiry.insert((expires_at_ms, hash));
        self.by_block.insert(blocks.compressed, hash);
        self.stats.inserted_blocks += 1;
        true
    }

    /// Whether any entry, live or not, has this key.
    pub fn has_key(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    pub fn is_cached(&self, compressed: BlockId) -> bool {
        self.by_block.contains_key(&compressed)
    }

    /// Key, parent key and tokens of a cached block.
    pub fn key_of(&self, compressed: BlockId) -> Option<(u64, u64, &[u32])> {
        let hash = *self.by_block.get(&compressed)?;
        let e = &self.entries[&hash];
        Some((hash, e.parent, &e.tokens))
    }

    /// Keep the block live until at least `keep_until_ms` (a hit refreshes its TTL).
    pub fn extend(&mut self, compressed: BlockId, keep_until_ms: u64) {
        let Some(&hash) = self.by_block.get(&compressed) else { return };
        let e = self.entries.get_mut(&hash).expect("index and entries agree");
        if keep_until_ms > e.expires_at_ms {
            self.expiry.remove(&(e.expires_at_ms, hash));
            e.expires_at_ms = keep_until_ms;
            self.expiry.insert((keep_until_ms, hash));
        }
    }

    /// Make an unreferenced block the most recently used.
    pub fn touch(&mut self, compressed: BlockId) {
        let Some(&hash) = self.by_block.get(&compressed) else { return };
        let e = self.entries.get_mut(&hash).expect("index and entries agree");
        if let Some(stamp) = e.stamp {
            self.lru.remove(&stamp);
            e.stamp = Some(self.clock);
            self.lru.insert(self.clock, hash);
            self.clock += 1;
        }
    }

    /// The logical time of the eviction order: blocks released or touched
    /// from now on have stamps at or above it.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// A sequence took a reference to this cached block: it may not be evicted.
    pub fn referenced(&mut self, compressed: BlockId) {
        if let Some(e) = self.by_block.get(&compressed).and_then(|h| self.entries.get_mut(h)) {
            if let Some(stamp) = e.stamp.take() {
                self.lru.remove(&stamp);
            }
        }
    }

    /// The last reference to this block went. The cache keeps it (it becomes
    /// the most recently used evictable block) unless it has expired at
    /// `now_ms`; otherwise the caller frees it.
    pub fn unreferenced(&mut self, compressed: BlockId, now_ms: u64) -> Released {
        let Some(hash) = self.by_block.get(&compressed).copied() else {
            return Released::NotCached;
        };
        let e = self.entries.get_mut(&hash).expect("index and entries agree");
        debug_assert!(e.stamp.is_none());
        if e.expires_at_ms <= now_ms {
            return Released::Expired(self.remove(hash, true));
        }
        let stamp = self.clock;
        self.clock += 1;
        e.stamp = Some(stamp);
        self.lru.insert(stamp, hash);
        Released::Kept
    }

    /// Forget the least recently used unreferenced block; the caller frees its pool blocks.
    pub fn evict_lru(&mut self) -> Option<EvictedBlock> {
        self.evict_lru_before(u64::MAX)
    }

    /// Forget the least recently used unreferenced block released or touched
    /// before logical time `stamp` (see [`clock`](Self::clock)).
    pub fn evict_lru_before(&mut self, stamp: u64) -> Option<EvictedBlock> {
        let (&first, &hash) = self.lru.first_key_value()?;
        if first >= stamp {
            return None;
        }
        Some(self.remove(hash, false))
    }

    /// Forget every unreferenced block that has expired at `now_ms`;
    /// referenced ones stay with their sequences and go when released.
    pub fn expire(&mut self, now_ms: u64) -> Vec<EvictedBlock> {
        let due: Vec<u64> = self
            .expiry
            .range(..(now_ms.saturating_add(1), 0))
            .map(|&(_, h)| h)
            .filter(|h| self.entries[h].stamp.is_some())
            .collect();
        due.into_iter().map(|h| self.remove(h, true)).collect()
    }

    fn remove(&mut self, hash: u64, expired: bool) -> EvictedBlock {
        let e = self.entries.remove(&hash).expect("a cached key");
        if let Some(stamp) = e.stamp {
            self.lru.remove(&stamp);
        }
        self.expiry.remove(&(e.expires_at_ms, hash));
        self.by_block.remove(&e.blocks.compressed);
        if expired {
            self.stats.expired_blocks += 1;
        } else {
            self.stats.evicted_blocks += 1;
        }
        EvictedBlock {
            blocks: e.blocks,
            key: hash,
            parent: e.parent,
            tokens: e.tokens,
            expires_at_ms: e.expires_at_ms,
            expired,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xxh64_matches_the_reference() {
        // Reference values from libxxhash 0.8.
        assert_eq!(xxh64(b""), 0xef46_db37_51d8_e999);
        assert_eq!(xxh64(b"a"), 0xd24e_c4f1_a98c_6e5b);
        assert_eq!(xxh64(b"abc"), 0x44bc_2cf5_ad77_0999);
        assert_eq!(xxh64(&(0..40).collect::<Vec<u8>>()), 0xf5da_40f1_b117_41e9);
        assert_eq!(xxh64(&(0..100).collect::<Vec<u8>>()), 0x6ac1_e580_3216_6597);
    }

    #[test]
    fn block_hash_is_a_fixed_chain() {
        // Fixed forever: keys must not change across runs, versions or platforms.
        assert_eq!(block_hash(0, &[]), 0x34c9_6acd_cadb_1bbb);
        assert_eq!(block_hash(0, &[1, 2, 3]), 0x0e66_d8fb_4eaf_8fcc);
        let a = block_hash(0, &[1, 2, 3]);
        assert_ne!(a, block_hash(0, &[1, 2, 4]));
        assert_ne!(block_hash(a, &[5]), block_hash(0, &[5]), "the parent is part of the key");
    }

    fn blocks(i: u32) -> CachedBlocks {
        CachedBlocks { compressed: BlockId(i), indexer: None }
    }

    #[test]
    fn lookup_verifies_content_and_evicts_oldest_first() {
        let mut c = PrefixCache::new();
        let toks = [7u32, 8, 9, 10];
        let h0 = block_hash(0, &toks[..2]);
        let h1 = block_hash(h0, &toks[2..]);
        assert!(c.insert(h0, 0, &toks[..2], blocks(0), NEVER));
        assert!(c.insert(h1, h0, &toks[2..], blocks(1), NEVER));
        assert!(!c.insert(h1, h0, &toks[2..], blocks(2), NEVER), "key taken");
        assert_eq!(c.longest_match(0, &[h0, h1], &toks, 2), vec![blocks(0), blocks(1)]);
        // Same key, other content: a miss, not a wrong hit.
        assert_eq!(c.get(0, h1, h0, &[10, 10]), None);
        // Released tail first, so the tail is evicted first.
        assert_eq!(c.unreferenced(BlockId(1), 0), Released::Kept);
        assert_eq!(c.unreferenced(BlockId(0), 0), Released::Kept);
        assert_eq!(c.unreferenced(BlockId(5), 0), Released::NotCached, "not cached");
        c.referenced(BlockId(1));
        assert_eq!(c.evict_lru().map(|e| (e.blocks, e.key, e.expired)), Some((blocks(0), h0, false)));
        assert_eq!(c.evict_lru(), None, "block 1 is referenced again");
        assert_eq!(c.longest_match(0, &[h0, h1], &toks, 2), vec![]);
    }

    const NEVER: u64 = u64::MAX;

    #[test]
    fn expired_blocks_are_misses_and_leave_when_unreferenced() {
        let mut c = PrefixCache::new();
        let h0 = block_hash(0, &[1, 2]);
        let h1 = block_hash(h0, &[3, 4]);
        c.insert(h0, 0, &[1, 2], blocks(0), 100);
        c.insert(h1, h0, &[3, 4], blocks(1), 50);
        assert_eq!(c.longest_match(49, &[h0, h1], &[1, 2, 3, 4], 2).len(), 2);
        assert_eq!(c.longest_match(50, &[h0, h1], &[1, 2, 3, 4], 2).len(), 1, "the tail expired");
        // A hit extends the head's TTL; the referenced tail stays until released.
        c.extend(BlockId(0), 500);
        assert!(c.expire(60).is_empty(), "both are referenced");
        let Released::Expired(gone) = c.unreferenced(BlockId(1), 60) else { panic!("expired on release") };
        assert_eq!((gone.key, gone.expired), (h1, true));
        assert_eq!(c.unreferenced(BlockId(0), 60), Released::Kept);
        assert!(c.expire(499).is_empty());
        assert_eq!(c.expire(500).iter().map(|e| e.key).collect::<Vec<_>>(), vec![h0]);
        assert_eq!((c.len(), c.stats.expired_blocks), (0, 2));
    }

    #[test]
    fn eviction_can_spare_blocks_used_since_a_stamp() {
        let mut c = PrefixCache::new();
        for i in 0..3u32 {
            c.insert(u64::from(i) + 1, 0, &[i], blocks(i), NEVER);
            assert_eq!(c.unreferenced(BlockId(i), 0), Released::Kept);
        }
        let since = c.clock();
        c.touch(BlockId(0));
        assert_eq!(c.evict_lru_before(since).map(|e| e.blocks), Some(blocks(1)));
        assert_eq!(c.evict_lru_before(since).map(|e| e.blocks), Some(blocks(2)));
        assert_eq!(c.evict_lru_before(since), None, "block 0 was touched since");
        assert_eq!(c.key_of(BlockId(0)), Some((1, 0, &[0u32][..])));
    }
}
