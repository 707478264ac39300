//! Modelled prompt-cache tiers below the device pool, for simulation: host
//! memory and a local disk per node, and a shared store (3FS-like) that
//! every node sees. Each tier is the engine's
//! [`TierIndex`](deepinfer_engine::kv_tiers::TierIndex) (bytes, LRU within
//! TTL) over the prefix cache's block keys, holding nothing: only where a
//! block is, and when, matters to the model.
//!
//! - Blocks the device evicts (not expired) move to host memory; blocks host
//!   memory evicts move to the local disk (without a host tier, device
//!   evictions go to the disk directly). A disk eviction drops the block.
//! - Every block a scheduler computes is written through to the shared
//!   store (DeepSeek persists each turn's end; a block is only ever computed
//!   at or before one, so this writes the same blocks, earlier).
//! - Writes queue on their link; a write that would wait more than
//!   [`WRITE_BACKLOG_S`] is dropped and counted.
//! - A waiting request whose prefix continues below the device is held
//!   while the blocks are read at that tier's bandwidth (links queue, so
//!   concurrent loads share it), then the blocks are adopted into the device
//!   pool and the request admitted: the load delays its prefill. A block
//!   read from host memory moves up; disk and shared copies stay.
//!
//! Capacities and bandwidths of host and disk are per node; an instance
//! spanning several nodes has their sum. Time is the simulation clock, so
//! TTLs expire as configured.

use std::sync::Mutex;

use deepinfer_engine::kv_tiers::{Departure, TierIndex, TierStats};

/// Longest a write may queue on its link before it is dropped, seconds.
pub const WRITE_BACKLOG_S: f64 = 2.0;

/// Where a prefix block was served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimTier {
    Device,
    Host,
    Disk,
    Shared,
}

/// Number of tiers, the size of per-tier arrays (by [`SimTier::index`]).
pub const TIERS: usize = 4;

impl SimTier {
    pub const ALL: [SimTier; TIERS] = [SimTier::Device, SimTier::Host, SimTier::Disk, SimTier::Shared];

    pub fn name(self) -> &'static str {
        match self {
            SimTier::Device => "device",
            SimTier::Host => "host",
            SimTier::Disk => "disk",
            SimTier::Shared => "shared",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Sizes and speeds of the tiers (bytes, bytes per second).
#[derive(Clone, Debug, PartialEq)]
pub struct TierSpec {
    /// Positions per prefix block (the engine's block size).
    pub block_tokens: usize,
    /// How long a block stays servable after it was computed or last hit.
    pub ttl_ms: u64,
    /// Host memory for KV blocks per node (0: no host tier), and the host↔device bandwidth per node.
    pub host_bytes: f64,
    pub host_bytes_per_s: f64,
    /// Local disk per node (0: none), its read and write bandwidths.
    pub disk_bytes: f64,
    pub disk_read_bytes_per_s: f64,
    pub disk_write_bytes_per_s: f64,
    /// The shared store (0: none): capacity and aggregate bandwidths of the whole cluster.
    pub shared_bytes: f64,
    pub shared_read_bytes_per_s: f64,
    pub shared_write_bytes_per_s: f64,
}

impl Default for TierSpec {
    fn default() -> Self {
        Self {
            block_tokens: 512,
            ttl_ms: deepinfer_engine::request::DEFAULT_CACHE_TTL_MS,
            host_bytes: 0.0,
            host_bytes_per_s: 50e9,
            disk_bytes: 0.0,
            disk_read_bytes_per_s: 12e9,
            disk_write_bytes_per_s: 6e9,
            shared_bytes: 0.0,
            shared_read_bytes_per_s: 6.6e12,
            shared_write_bytes_per_s: 3e12,
        }
    }
}

/// A link that moves bytes one transfer after another.
#[derive(Clone, Debug, Default)]
struct Link {
    bytes_per_s: f64,
    /// The last queued transfer ends then (µs).
    busy_until_us: u64,
}

impl Link {
    fn new(bytes_per_s: f64) -> Self {
        Self { bytes_per_s: bytes_per_s.max(1.0), busy_until_us: 0 }
    }

    fn duration_us(&self, bytes: f64) -> u64 {
        (bytes / self.bytes_per_s * 1e6).ceil() as u64
    }

    /// Queue `bytes` at `now_us`; when they have arrived.
    fn transfer(&mut self, now_us: u64, bytes: f64) -> u64 {
        let start = self.busy_until_us.max(now_us);
        self.busy_until_us = start + self.duration_us(bytes);
        self.busy_until_us
    }

    /// Queue a write unless the backlog is already past [`WRITE_BACKLOG_S`].
    fn try_write(&mut self, now_us: u64, bytes: f64) -> bool {
        if self.busy_until_us.saturating_sub(now_us) as f64 > WRITE_BACKLOG_S * 1e6 {
            return false;
        }
        self.transfer(now_us, bytes);
        true
    }
}

/// One instance's host memory and local disk.
#[derive(Debug)]
struct Local {
    host: Option<TierIndex<()>>,
    host_link: Link,
    disk: Option<TierIndex<()>>,
    disk_read: Link,
    disk_write: Link,
}

#[derive(Debug)]
struct Shared {
    index: TierIndex<()>,
    read: Link,
    write: Link,
}

/// What the tiers did, for the report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TierTotals {
    /// Blocks brought up into a device pool from each tier, and their bytes.
    pub loaded_blocks: [u64; TIERS],
    pub loaded_bytes: [f64; TIERS],
    /// Blocks written to each tier (demotions, write-through) and writes dropped for a full queue.
    pub written_blocks: [u64; TIERS],
    pub dropped_writes: [u64; TIERS],
    /// Blocks placed in the shared store as written before the run.
    pub preloaded_blocks: u64,
    /// The tier indexes' own counters, summed over instances.
    pub stats: [TierStats; TIERS],
    /// Bytes held at the end, summed over instances.
    pub used_bytes: [f64; TIERS],
}

/// A request's first admission: its prompt and where its hit came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// The cluster's request id.
    pub request: u64,
    pub at_us: u64,
    pub prompt_tokens: usize,
    /// Prompt tokens served by each tier.
    pub by_tier: [usize; TIERS],
    /// How long the reads of its prefix from lower tiers took (queueing on
    /// the links included); it was admitted at the first plan after them.
    pub load_us: u64,
}

#[derive(Debug)]
struct Inner {
    local: Vec<Local>,
    shared: Option<Shared>,
    totals: TierTotals,
    admissions: Vec<Admission>,
}

/// The tiers of a modelled cluster: shared by its schedulers (one
/// current-thread runtime, so the order of every call is the simulation's).
#[derive(Debug)]
pub struct ModelledTiers {
    pub spec: TierSpec,
    /// Bytes one prefix block holds in the modelled model.
    pub block_bytes: f64,
    inner: Mutex<Inner>,
}

/// A block a waiting request can load, and from where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    pub key: u64,
    pub parent: u64,
    pub tier: SimTier,
}

fn index(bytes: f64) -> Option<TierIndex<()>> {
    (bytes >= 1.0).then(|| TierIndex::new(bytes.min(usize::MAX as f64 / 2.0) as usize))
}

impl ModelledTiers {
    /// `nodes[i]`: how many nodes instance `i` spans.
    pub fn new(spec: TierSpec, block_bytes: f64, nodes: &[u32]) -> Self {
        let local = nodes
            .iter()
            .map(|&n| {
                let n = n.max(1) as f64;
                Local {
                    host: index(spec.host_bytes * n),
                    host_link: Link::new(spec.host_bytes_per_s * n),
                    disk: index(spec.disk_bytes * n),
                    disk_read: Link::new(spec.disk_read_bytes_per_s * n),
                    disk_write: Link::new(spec.disk_write_bytes_per_s * n),
                }
            })
            .collect();
        let shared = index(spec.shared_bytes).map(|index| Shared {
            index,
            read: Link::new(spec.shared_read_bytes_per_s),
            write: Link::new(spec.shared_write_bytes_per_s),
        });
        let inner = Inner { local, shared, totals: TierTotals::default(), admissions: Vec::new() };
        Self { spec, block_bytes: block_bytes.max(1.0), inner: Mutex::new(inner) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether any tier below the device exists.
    pub fn any(&self) -> bool {
        self.spec.host_bytes >= 1.0 || self.spec.disk_bytes >= 1.0 || self.spec.shared_bytes >= 1.0
    }

    fn bytes(&self) -> usize {
        self.block_bytes as usize
    }

    /// A block left `instance`'s device pool for want of room: down to host
    /// memory, and what that evicts down to the local disk.
    pub fn demote(&self, instance: u32, now_ms: u64, key: u64, parent: u64, expires_at_ms: u64) {
        let bytes = self.bytes();
        let g = &mut *self.lock();
        let Some(l) = g.local.get_mut(instance as usize) else { return };
        let t = &mut g.totals;
        let to_disk = match &mut l.host {
            Some(host) => {
                let Ok(removed) = host.insert(now_ms, key, parent, &[], bytes, expires_at_ms, ()) else { return };
                t.written_blocks[SimTier::Host.index()] += 1;
                removed
                    .into_iter()
                    .filter(|r| r.why == Departure::Evicted)
                    .map(|r| (r.key, r.parent, r.expires_at_ms))
                    .collect()
            }
            None => vec![(key, parent, expires_at_ms)],
        };
        let Some(disk) = &mut l.disk else { return };
        for (key, parent, expires) in to_disk {
            if disk.contains(key) {
                let _ = disk.insert(now_ms, key, parent, &[], bytes, expires, ());
                continue;
            }
            if !l.disk_write.try_write(now_ms * 1000, bytes as f64) {
                t.dropped_writes[SimTier::Disk.index()] += 1;
                continue;
            }
            if disk.insert(now_ms, key, parent, &[], bytes, expires, ()).is_ok() {
                t.written_blocks[SimTier::Disk.index()] += 1;
            }
        }
    }

    /// A block was computed: written through to the shared store.
    pub fn persist(&self, now_ms: u64, key: u64, parent: u64) {
        let bytes = self.bytes();
        let expires = now_ms.saturating_add(self.spec.ttl_ms);
        let g = &mut *self.lock();
        let Some(s) = &mut g.shared else { return };
        if s.index.contains(key) {
            let _ = s.index.insert(now_ms, key, parent, &[], bytes, expires, ());
            return;
        }
        if !s.write.try_write(now_ms * 1000, bytes as f64) {
            g.totals.dropped_writes[SimTier::Shared.index()] += 1;
            return;
        }
        if s.index.insert(now_ms, key, parent, &[], bytes, expires, ()).is_ok() {
            g.totals.written_blocks[SimTier::Shared.index()] += 1;
        }
    }

    /// A block written to the shared store before the simulated time
    /// (traffic already under way when a run starts): no bandwidth, no write counted.
    pub fn preload(&self, now_ms: u64, key: u64, parent: u64) {
        let bytes = self.bytes();
        let expires = now_ms.saturating_add(self.spec.ttl_ms);
        let g = &mut *self.lock();
        if let Some(s) = &mut g.shared {
            if s.index.insert(now_ms, key, parent, &[], bytes, expires, ()).is_ok() {
                g.totals.preloaded_blocks += 1;
            }
        }
    }

    /// The fastest tier below the device holding `(key, parent)` live at `now_ms`.
    pub fn locate(&self, instance: u32, now_ms: u64, key: u64, parent: u64) -> Option<SimTier> {
        let g = self.lock();
        let l = g.local.get(instance as usize)?;
        if l.host.as_ref().is_some_and(|t| t.peek(now_ms, key, parent, &[]).is_some()) {
            return Some(SimTier::Host);
        }
        if l.disk.as_ref().is_some_and(|t| t.peek(now_ms, key, parent, &[]).is_some()) {
            return Some(SimTier::Disk);
        }
        if g.shared.as_ref().is_some_and(|s| s.index.peek(now_ms, key, parent, &[]).is_some()) {
            return Some(SimTier::Shared);
        }
        None
    }

    /// Queue the reads of `counts[tier]` blocks for `instance` at `now_us`;
    /// when the last arrives (µs).
    pub fn read(&self, instance: u32, now_us: u64, counts: [usize; TIERS]) -> u64 {
        let b = self.block_bytes;
        let g = &mut *self.lock();
        let Some(l) = g.local.get_mut(instance as usize) else { return now_us };
        let mut ready = now_us;
        for tier in [SimTier::Host, SimTier::Disk, SimTier::Shared] {
            let n = counts[tier.index()];
            if n == 0 {
                continue;
            }
            let bytes = n as f64 * b;
            let link = match tier {
                SimTier::Host => &mut l.host_link,
                SimTier::Disk => &mut l.disk_read,
                _ => match &mut g.shared {
                    Some(s) => &mut s.read,
                    None => continue,
                },
            };
            ready = ready.max(link.transfer(now_us, bytes));
            g.totals.loaded_bytes[tier.index()] += bytes;
        }
        ready
    }

    /// A block read from `tier` is taken up into the device pool: counted
    /// as a hit there (its TTL refreshed); a host copy leaves host memory.
    /// False if the tier no longer holds it.
    pub fn take_up(&self, instance: u32, now_ms: u64, f: &Found) -> bool {
        let keep = now_ms.saturating_add(self.spec.ttl_ms);
        let g = &mut *self.lock();
        let Some(l) = g.local.get_mut(instance as usize) else { return false };
        let hit = match f.tier {
            SimTier::Host => l.host.as_mut().is_some_and(|t| {
                let hit = t.hit(now_ms, f.key, f.parent, &[], keep).is_some();
                if hit {
                    t.take(f.key);
                }
                hit
            }),
            SimTier::Disk => l.disk.as_mut().is_some_and(|t| t.hit(now_ms, f.key, f.parent, &[], keep).is_some()),
            SimTier::Shared => {
                g.shared.as_mut().is_some_and(|s| s.index.hit(now_ms, f.key, f.parent, &[], keep).is_some())
            }
            SimTier::Device => false,
        };
        if hit {
            g.totals.loaded_blocks[f.tier.index()] += 1;
        }
        hit
    }

    /// Drop what has expired (so the counters see it).
    pub fn expire(&self, instance: u32, now_ms: u64) {
        let g = &mut *self.lock();
        if let Some(l) = g.local.get_mut(instance as usize) {
            for t in [&mut l.host, &mut l.disk].into_iter().flatten() {
                t.expire(now_ms);
            }
        }
        if let Some(s) = &mut g.shared {
            s.index.expire(now_ms);
        }
    }

    pub fn record(&self, a: Admission) {
        self.lock().admissions.push(a);
    }

    /// Every first admission so far, in the order they happened.
    pub fn admissions(&self) -> Vec<Admission> {
        self.lock().admissions.clone()
    }

    pub fn totals(&self) -> TierTotals {
        let g = self.lock();
        let mut t = g.totals.clone();
        let add = |to: &mut TierStats, s: &TierStats| {
            to.hit_blocks += s.hit_blocks;
            to.miss_blocks += s.miss_blocks;
            to.inserted_blocks += s.inserted_blocks;
            to.evicted_blocks += s.evicted_blocks;
            to.expired_blocks += s.expired_blocks;
            to.refused_blocks += s.refused_blocks;
        };
        for l in &g.local {
            for (tier, index) in [(SimTier::Host, &l.host), (SimTier::Disk, &l.disk)] {
                if let Some(x) = index {
                    add(&mut t.stats[tier.index()], &x.stats);
                    t.used_bytes[tier.index()] += x.used_bytes() as f64;
                }
            }
        }
        if let Some(s) = &g.shared {
            add(&mut t.stats[SimTier::Shared.index()], &s.index.stats);
            t.used_bytes[SimTier::Shared.index()] += s.index.used_bytes() as f64;
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> TierSpec {
        TierSpec {
            ttl_ms: 1000,
            host_bytes: 20.0,
            host_bytes_per_s: 10.0,
            disk_bytes: 30.0,
            disk_read_bytes_per_s: 5.0,
            disk_write_bytes_per_s: 1000.0,
            shared_bytes: 0.0,
            ..TierSpec::default()
        }
    }

    #[test]
    fn evictions_cascade_from_host_to_disk_and_reads_queue() {
        let t = ModelledTiers::new(spec(), 10.0, &[1]);
        for k in 1..=3 {
            t.demote(0, 0, k, 0, 1000);
        }
        // Host holds two blocks: the oldest went to disk.
        assert_eq!(t.locate(0, 0, 1, 0), Some(SimTier::Disk));
        assert_eq!(t.locate(0, 0, 3, 0), Some(SimTier::Host));
        assert_eq!(t.locate(0, 1000, 3, 0), None, "expired at its TTL");
        // 10 bytes at 10 B/s: one second; a second read queues behind it.
        assert_eq!(t.read(0, 0, [0, 1, 0, 0]), 1_000_000);
        assert_eq!(t.read(0, 0, [0, 1, 1, 0]), 2_000_000);
        let f = Found { key: 3, parent: 0, tier: SimTier::Host };
        assert!(t.take_up(0, 10, &f));
        assert_eq!(t.locate(0, 10, 3, 0), None, "a host block moves up");
        let d = Found { key: 1, parent: 0, tier: SimTier::Disk };
        assert!(t.take_up(0, 10, &d));
        assert_eq!(t.locate(0, 10, 1, 0), Some(SimTier::Disk), "a disk copy stays");
        assert_eq!(t.totals().loaded_blocks, [0, 1, 1, 0]);
    }

    #[test]
    fn shared_writes_are_dropped_past_the_backlog() {
        let s = TierSpec { shared_bytes: 1e9, shared_write_bytes_per_s: 10.0, ..spec() };
        let t = ModelledTiers::new(s, 10.0, &[1, 1]);
        // Each write takes a second: three fit in the two-second backlog.
        for k in 1..=5 {
            t.persist(0, k, 0);
        }
        let totals = t.totals();
        assert_eq!(totals.written_blocks[SimTier::Shared.index()], 3);
        assert_eq!(totals.dropped_writes[SimTier::Shared.index()], 2);
        assert_eq!(t.locate(1, 0, 2, 0), Some(SimTier::Shared), "every instance sees the store");
    }
}
