//! The tiers below the pools: host memory, held here, and the disk tier,
//! whose reads and writes the shell does ([`DiskOp`]) and whose reads come
//! back through [`CacheMachine::disk_read`].
//!
//! - A pool's eviction moves its block to host memory (a node-wide
//!   byte-bounded LRU with TTLs); past its bytes the least recently used
//!   block is dropped (a persisted copy stays on disk).
//! - A waiting request's prefix beyond its pool comes up from host memory
//!   at once and from disk when read (`Promote` → `Promoted`); blocks
//!   brought up join the pool store, so the restore that follows finds them.
//! - At persist points (and for a prefix another request hit) each block of
//!   the chain not yet on disk is handed to the writer, once.

use std::sync::Arc;

use deepinfer_engine::engine::{BlockValues, PersistBlock, WantedBlock};

use super::{CacheMachine, Entry};
use crate::limits::{MAX_DISK_KEYS, MAX_PENDING_PROMOTES, MAX_PROMOTE_BYTES};
use crate::sim::events::bump;
use crate::wire::{Addr, CacheMsg, CacheTier, Message, PromoteItem, PromotedBlock, PromotedItem};

/// A block in host memory.
pub(super) struct HostValues {
    lens: Vec<u32>,
    values: Vec<f32>,
    ttl_ms: u64,
    persisted: bool,
}

/// I/O the machine asks of its shell's disk tier.
#[derive(Debug)]
pub enum DiskOp {
    /// Write these blocks' files (each once; a file already there is kept).
    Write(Vec<PersistBlock>),
    /// Read the leading run of `wanted` (a chain) that is on disk and answer
    /// with [`CacheMachine::disk_read`] under `id`, found or not.
    Read { id: u64, wanted: Vec<WantedBlock> },
}

/// A block read from disk, as the shell hands it back.
#[derive(Debug)]
pub struct LoadedBlock {
    pub key: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub lens: Vec<u32>,
    pub values: Vec<f32>,
    /// How long it stays servable from now.
    pub ttl_ms: u64,
}

/// A promotion waiting on disk reads.
pub(super) struct Promoting {
    from: Addr,
    query: u64,
    instance: u32,
    items: Vec<PromotedItem>,
    values: Vec<Vec<f32>>,
    reads_left: usize,
    bytes: usize,
}

impl CacheMachine {
    /// Move a pool block to host memory (or drop it, with no host tier).
    pub(super) fn demote(&mut self, key: (u32, u64)) {
        let Some(e) = self.take_entry(key) else { return };
        if self.host.capacity_bytes() == 0 || e.expires_at_ms <= self.now_ms {
            return;
        }
        let bytes = 4 * (e.values.len() + e.lens.len() + e.tokens.len());
        let value = HostValues { lens: e.lens, values: e.values, ttl_ms: e.ttl_ms, persisted: e.persisted };
        if self.host.insert(self.now_ms, key.1, e.parent, &e.tokens, bytes, e.expires_at_ms, value).is_ok() {
            bump(&self.ctx.metrics.host_blocks_in);
        }
    }

    /// Bring a block from host memory into `instance`'s pool store; whether it was there.
    pub(super) fn lift_from_host(&mut self, instance: u32, key: u64, parent: u64, tokens: &[u32]) -> bool {
        if self.host.peek(self.now_ms, key, parent, tokens).is_none() {
            return false;
        }
        let r = self.host.take(key).expect("peeked");
        let HostValues { lens, values, ttl_ms, persisted } = r.value;
        let expires_at_ms = r.expires_at_ms.max(self.now_ms.saturating_add(ttl_ms));
        let entry =
            Entry { parent, tokens: r.tokens.into_vec(), lens, values, stamp: 0, ttl_ms, expires_at_ms, persisted };
        self.put_entry(instance, key, entry);
        bump(&self.ctx.metrics.host_hit_blocks);
        true
    }

    fn note_on_disk(&mut self, key: u64, parent: u64) {
        self.on_disk.insert(key, parent);
        while self.on_disk.len() > MAX_DISK_KEYS {
            self.on_disk.pop_first();
        }
    }

    /// Blocks of the chain `hashes` (from position 0) for the disk tier, up
    /// to the first this node holds in neither memory tier.
    pub(super) fn persist(&mut self, instance: u32, hashes: &[u64]) {
        if !self.disk {
            return;
        }
        let bt = self.ctx.block_tokens;
        let mut batch = Vec::new();
        let mut parent = 0;
        for &h in hashes {
            // (persisted, tokens, lens, values, TTL) of the block, in its pool store or host memory.
            let found = match self.entries.get(&(instance, h)) {
                Some(e) if e.parent == parent => Some((e.persisted, &e.tokens[..], &e.lens, &e.values, e.ttl_ms)),
                _ => match self.host.get(h) {
                    Some((p, tokens, v)) if p == parent => Some((v.persisted, tokens, &v.lens, &v.values, v.ttl_ms)),
                    _ => None,
                },
            };
            let Some((persisted, tokens, lens, values, ttl_ms)) = found else { break };
            if !persisted {
                // Copied only for a block not yet on disk: a hit's chain is offered again on every hit.
                let Ok(block) = BlockValues::from_parts(&self.ctx.model, bt, lens, values) else { break };
                let tokens = tokens.to_vec();
                batch.push(PersistBlock { key: h, parent, tokens, values: Arc::new(block), ttl_ms });
                if let Some(e) = self.entries.get_mut(&(instance, h)) {
                    e.persisted = true;
                } else if let Some(v) = self.host.value_mut(h) {
                    v.persisted = true;
                }
                self.note_on_disk(h, parent);
            }
            parent = h;
        }
        if !batch.is_empty() {
            self.ctx.metrics.blocks_persisted.fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.disk_ops.push(DiskOp::Write(batch));
        }
    }

    /// Bring waiting requests' prefixes up: from the pool store or host
    /// memory now, the rest from disk once read.
    pub(super) fn promote(&mut self, from: Addr, query: u64, instance: u32, items: Vec<PromoteItem>) {
        let bt = self.ctx.block_tokens;
        let token = self.next_read;
        let mut p = Promoting { from, query, instance, items: Vec::new(), values: Vec::new(), reads_left: 0, bytes: 0 };
        for it in items {
            let mut blocks = Vec::new();
            let mut values = Vec::new();
            let n = if it.tokens.len() == it.hashes.len() * bt { it.hashes.len() } else { 0 };
            let mut parent = it.parent;
            let mut k = 0;
            while k < n && p.bytes < MAX_PROMOTE_BYTES {
                let (h, want) = (it.hashes[k], &it.tokens[k * bt..(k + 1) * bt]);
                if !(self.in_pool(instance, h, parent, want) || self.lift_from_host(instance, h, parent, want)) {
                    break;
                }
                let Some(e) = self.entries.get(&(instance, h)) else { break };
                blocks.push(PromotedBlock { lens: e.lens.clone(), ttl_ms: e.ttl_ms, tier: CacheTier::Host });
                values.extend_from_slice(&e.values);
                p.bytes += 4 * e.values.len();
                self.touch((instance, h));
                parent = h;
                k += 1;
            }
            if k < n && self.disk && p.bytes < MAX_PROMOTE_BYTES && self.promoting.len() < MAX_PENDING_PROMOTES {
                let id = self.next_read;
                self.next_read += 1;
                let wanted = (k..n)
                    .map(|j| WantedBlock {
                        key: it.hashes[j],
                        parent: if j == k { parent } else { it.hashes[j - 1] },
                        tokens: it.tokens[j * bt..(j + 1) * bt].to_vec(),
                    })
                    .collect();
                self.disk_ops.push(DiskOp::Read { id, wanted });
                self.reads.insert(id, (token, p.items.len()));
                p.reads_left += 1;
            }
            p.items.push(PromotedItem { seq: it.seq, blocks });
            p.values.push(values);
        }
        if p.reads_left == 0 {
            self.answer(p);
        } else {
            self.promoting.insert(token, p);
        }
    }

    fn answer(&mut self, p: Promoting) {
        let body: Vec<f32> = p.values.concat();
        self.send(p.from, Message::Cache(CacheMsg::Promoted { query: p.query, items: p.items }), &body);
    }

    /// What the disk read `id` found (a leading run of what it asked for;
    /// empty when nothing, or when the read could not be queued).
    pub fn disk_read(&mut self, now: std::time::Duration, id: u64, blocks: Vec<LoadedBlock>, missing: Option<u64>) {
        self.advance(now);
        if let Some(key) = missing {
            self.on_disk.remove(&key);
        }
        let Some((token, item)) = self.reads.remove(&id) else { return };
        let Some(mut p) = self.promoting.remove(&token) else { return };
        for b in blocks {
            if p.bytes >= MAX_PROMOTE_BYTES {
                break;
            }
            self.note_on_disk(b.key, b.parent);
            let entry = Entry {
                parent: b.parent,
                tokens: b.tokens,
                lens: b.lens.clone(),
                values: b.values.clone(),
                stamp: 0,
                ttl_ms: b.ttl_ms,
                expires_at_ms: self.now_ms.saturating_add(b.ttl_ms),
                persisted: true,
            };
            self.put_entry(p.instance, b.key, entry);
            p.bytes += 4 * b.values.len();
            p.items[item].blocks.push(PromotedBlock { lens: b.lens, ttl_ms: b.ttl_ms, tier: CacheTier::Disk });
            p.values[item].extend_from_slice(&b.values);
            bump(&self.ctx.metrics.disk_hit_blocks);
        }
        p.reads_left -= 1;
        if p.reads_left == 0 {
            self.answer(p);
        } else {
            self.promoting.insert(token, p);
        }
        self.check();
    }

    /// The blocks the disk tier found when its index was rebuilt.
    pub fn disk_indexed(&mut self, keys: Vec<(u64, u64)>) {
        for (key, parent) in keys {
            self.note_on_disk(key, parent);
        }
    }
}
