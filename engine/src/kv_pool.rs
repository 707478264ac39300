//! The KV block pool: a memory budget split into fixed-size blocks of four
//! kinds, and the block tables that say which blocks a sequence holds.
//!
//! DeepSeek-V4 keeps four kinds of per-sequence state, with different growth:
//!
//! - **Window**: the last `sliding_window − 1` KV vectors of every layer. Its
//!   size is bounded, so a sequence needs at most a fixed number of blocks.
//! - **Compressed**: the CSA/HCA entries, one per `ratio` tokens per
//!   compressed layer, growing with the sequence. One block covers
//!   `block_tokens` positions of every compressed layer, plus the CSA
//!   compressor's overlap series at the block's end (what a prefix hit ending
//!   there needs to continue compressing).
//! - **Indexer**: the lightning indexer's keys of CSA layers, laid out like
//!   `Compressed`.
//! - **Partial**: the compressors' open windows and live overlap series: one
//!   fixed-size block per sequence.
//!
//! The pool is the authority on allocation: a sequence runs a step only when
//! the blocks for the positions it will hold afterwards are allocated. The
//! values themselves still live in each sequence's contiguous
//! [`SequenceState`](crate::model::SequenceState); blocks account for them.

use crate::config::{AttentionKind, ModelConfig};

/// Kinds of KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BlockKind {
    Window,
    Compressed,
    Indexer,
    Partial,
}

impl BlockKind {
    pub const ALL: [BlockKind; 4] = [BlockKind::Window, BlockKind::Compressed, BlockKind::Indexer, BlockKind::Partial];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Window => "window",
            BlockKind::Compressed => "compressed",
            BlockKind::Indexer => "indexer",
            BlockKind::Partial => "partial",
        }
    }
}

/// Sizes of the blocks of one model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Positions covered by one compressed or indexer block; a multiple of
    /// every compress ratio, so no compressor window straddles two blocks.
    pub block_tokens: usize,
    /// Positions of window KV per window block.
    pub window_block_tokens: usize,
    /// Window KV vectors a sequence keeps between steps (`sliding_window − 1`).
    pub window_tokens: usize,
    /// Bytes of one block of each kind, indexed by [`BlockKind::index`]; 0 when the model has none.
    pub block_bytes: [usize; 4],
}

/// Why a layout cannot be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("block_tokens {block_tokens} must be a positive multiple of every compress ratio ({ratios:?})")]
    BlockTokens { block_tokens: usize, ratios: Vec<usize> },
    #[error("window_block_tokens must be at least 1")]
    WindowBlockTokens,
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Bytes per f32 value.
const F32: usize = 4;

impl KvLayout {
    /// The distinct compress ratios of the model's layers, ascending.
    pub fn compress_ratios(cfg: &ModelConfig) -> Vec<usize> {
        let mut ratios: Vec<usize> = cfg.attention.iter().filter_map(|k| k.compress_ratio()).collect();
        ratios.sort_unstable();
        ratios.dedup();
        ratios
    }

    /// The default block size: the least common multiple of the compress
    /// ratios, repeated up to at least 64 positions.
    pub fn default_block_tokens(cfg: &ModelConfig) -> usize {
        let lcm = Self::compress_ratios(cfg).into_iter().fold(1, |a, r| a / gcd(a, r) * r);
        lcm * 64usize.div_ceil(lcm)
    }

    pub fn new(cfg: &ModelConfig, block_tokens: usize, window_block_tokens: usize) -> Result<Self, LayoutError> {
        let ratios = Self::compress_ratios(cfg);
        if block_tokens == 0 || ratios.iter().any(|&r| !block_tokens.is_multiple_of(r)) {
            return Err(LayoutError::BlockTokens { block_tokens, ratios });
        }
        if window_block_tokens == 0 {
            return Err(LayoutError::WindowBlockTokens);
        }
        let (mut compressed, mut indexer, mut partial) = (0, 0, 0);
        // One compressor of `dim`: entries of a block, the overlap series kept at
        // its end, and the open window (kv and gate, `width` wide each) of a sequence.
        let mut add = |ratio: usize, dim: usize, overlap: bool, entries: &mut usize| {
            let width = if overlap { 2 * dim } else { dim };
            let overlap_len = if overlap { 2 * ratio * dim } else { 0 };
            *entries += block_tokens / ratio * dim + overlap_len;
            partial += 2 * (ratio - 1) * width + overlap_len;
        };
        for kind in &cfg.attention {
            match *kind {
                AttentionKind::Window => {}
                AttentionKind::Hca { ratio } => add(ratio, cfg.head_dim, false, &mut compressed),
                AttentionKind::Csa { ratio } => {
                    add(ratio, cfg.head_dim, true, &mut compressed);
                    add(ratio, cfg.index_head_dim, true, &mut indexer);
                }
            }
        }
        // Blocks that hold the window state at their end (V4.1's prefix blocks)
        // are charged every layer's window too, whether cached or running.
        if cfg.blocks_hold_windows {
            compressed += cfg.num_layers * cfg.sliding_window * cfg.head_dim;
        }
        let window = window_block_tokens * cfg.num_layers * cfg.head_dim;
        Ok(Self {
            block_tokens,
            window_block_tokens,
            window_tokens: cfg.sliding_window.saturating_sub(1),
            block_bytes: [window * F32, compressed * F32, indexer * F32, partial * F32],
        })
    }

    pub fn bytes(&self, kind: BlockKind) -> usize {
        self.block_bytes[kind.index()]
    }

    /// Blocks of `kind` a sequence holding `positions` tokens needs.
    pub fn blocks_needed(&self, kind: BlockKind, positions: usize) -> usize {
        if self.bytes(kind) == 0 || positions == 0 {
            return 0;
        }
        match kind {
            BlockKind::Window => positions.min(self.window_tokens).div_ceil(self.window_block_tokens),
            BlockKind::Compressed | BlockKind::Indexer => positions.div_ceil(self.block_tokens),
            BlockKind::Partial => 1,
        }
    }

    /// Bytes a sequence holding `positions` tokens needs, all kinds together.
    pub fn sequence_bytes(&self, positions: usize) -> usize {
        BlockKind::ALL.iter().map(|&k| self.blocks_needed(k, positions) * self.bytes(k)).sum()
    }
}

/// Index of a block in the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

#[derive(Clone, Copy, Debug)]
struct Meta {
    kind: BlockKind,
    refs: u32,
    live: bool,
}

/// Blocks held by one sequence, per kind, in position order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub tables: [Vec<BlockId>; 4],
}

impl BlockTable {
    pub fn get(&self, kind: BlockKind) -> &[BlockId] {
        &self.tables[kind.index()]
    }

    pub fn is_empty(&self) -> bool {
        self.tables.iter().all(Vec::is_empty)
    }
}

/// Occupancy of the pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub budget_bytes: usize,
    pub used_bytes: usize,
    /// Live blocks per kind, indexed by [`BlockKind::index`].
    pub blocks: [usize; 4],
}

/// Fixed-size blocks under a byte budget, with reference counts.
///
/// Allocation is deterministic: freed slots are reused last-in first-out.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    budget: usize,
    used: usize,
    blocks: [usize; 4],
    meta: Vec<Meta>,
    free_slots: Vec<u32>,
}

impl KvPool {
    pub fn new(layout: KvLayout, budget_bytes: usize) -> Self {
        Self { layout, budget: budget_bytes, used: 0, blocks: [0; 4], meta: Vec::new(), free_slots: Vec::new() }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn free_bytes(&self) -> usize {
        self.budget - self.used
    }

    /// A new block with one reference, if the budget allows.
    pub fn alloc(&mut self, kind: BlockKind) -> Option<BlockId> {
        let bytes = self.layout.bytes(kind);
        if bytes > self.free_bytes() {
            return None;
        }
        self.used += bytes;
        self.blocks[kind.index()] += 1;
        let meta = Meta { kind, refs: 1, live: true };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.meta[slot as usize] = meta;
                slot
            }
            None => {
                self.meta.push(meta);
                (self.meta.len() - 1) as u32
            }
        };
        Some(BlockId(slot))
    }

    fn meta(&mut self, id: BlockId) -> &mut Meta {
        let m = &mut self.meta[id.0 as usize];
        assert!(m.live, "block {id:?} is not allocated");
        m
    }

    pub fn kind(&self, id: BlockId) -> BlockKind {
        self.meta[id.0 as usize].kind
    }

    pub fn refs(&self, id: BlockId) -> u32 {
        self.meta[id.0 as usize].refs
    }

    /// Add a reference.
    pub fn retain(&mut self, id: BlockId) {
        self.meta(id).refs += 1;
    }

    /// Drop a reference; returns how many are left. The block stays
    /// allocated until [`KvPool::free`] (an unreferenced block may be cached).
    pub fn release(&mut self, id: BlockId) -> u32 {
        let m = self.meta(id);
        assert!(m.refs > 0, "block {id:?} released more often than retained");
        m.refs -= 1;
        m.refs
    }

    /// Return an unreferenced block to the budget.
    pub fn free(&mut self, id: BlockId) {
        let m = self.meta(id);
        assert_eq!(m.refs, 0, "block {id:?} freed while referenced");
        m.live = false;
        let kind = m.kind;
        self.used -= self.layout.bytes(kind);
        self.blocks[kind.index()] -= 1;
        self.free_slots.push(id.0);
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats { budget_bytes: self.budget, used_bytes: self.used, blocks: self.blocks }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::Preset;

    #[test]
    fn tiny_layout_sizes() {
        let cfg = Preset::TinyV4.config();
        assert_eq!(KvLayout::default_block_tokens(&cfg), 64);
        let l = KvLayout::new(&cfg, 64, 16).unwrap();
        // 3 CSA layers (ratio 4, overlap) and 2 HCA layers (ratio 16), head_dim 64, index_head_dim 32.
        let compressed = 3 * (16 * 64 + 2 * 4 * 64) + 2 * (4 * 64);
        assert_eq!(l.bytes(BlockKind::Compressed), 4 * compressed);
        assert_eq!(l.bytes(BlockKind::Indexer), 4 * 3 * (16 * 32 + 2 * 4 * 32));
        assert_eq!(l.bytes(BlockKind::Window), 4 * 16 * 7 * 64);
        assert_eq!(l.blocks_needed(BlockKind::Window, 1000), 1);
        assert_eq!(l.blocks_needed(BlockKind::Compressed, 65), 2);
        assert_eq!(l.blocks_needed(BlockKind::Partial, 1), 1);
        assert_eq!(l.sequence_bytes(0), 0);
        assert!(KvLayout::new(&cfg, 24, 16).is_err(), "24 is not a multiple of 16");
    }

    #[test]
    fn pool_respects_its_budget_and_reuses_slots() {
        let cfg = Preset::TinyV4.config();
        let l = KvLayout::new(&cfg, 64, 16).unwrap();
        let b = l.bytes(BlockKind::Compressed);
        let mut pool = KvPool::new(l, 2 * b + 1);
        let x = pool.alloc(BlockKind::Compressed).unwrap();
        let y = pool.alloc(BlockKind::Compressed).unwrap();
        assert!(pool.alloc(BlockKind::Compressed).is_none());
        pool.retain(x);
        assert_eq!(pool.release(x), 1);
        assert_eq!(pool.release(x), 0);
        pool.free(x);
        assert_eq!(pool.alloc(BlockKind::Compressed), Some(x));
        assert_eq!(pool.stats().blocks[BlockKind::Compressed.index()], 2);
        assert_eq!(pool.release(y), 0);
        pool.free(y);
        assert_eq!(pool.stats().used_bytes, b);
    }
}
