//! The prompt cache's disk tier: one file per block under a directory that
//! may be a local disk or a mount several nodes share (3FS, NFS, Lustre).
//!
//! - Layout: `DIR/<model fingerprint>/<first key byte>/<key>.kvb`, so models
//!   and configurations never mix and no directory grows past 1/256 of the tier.
//! - Writes go to a temporary name and are renamed into place: a reader sees
//!   a whole file or none, and two processes writing the same block both
//!   leave a whole, identical file.
//! - The index is rebuilt from the headers at start; a file whose header is
//!   foreign, truncated or corrupt is skipped, counted and removed, and so is
//!   one that fails its checksum when read; none is ever served.
//! - A file's TTL is in its header and its last use is its modification
//!   time: a hit refreshes it with one metadata write.
//! - Any I/O error (a full disk, a read-only mount) is counted and warned
//!   about, and the block stays in memory: the disk tier degrades, requests
//!   never fail because of it.
//!
//! [`DiskTier`] does blocking I/O; [`worker`] runs it on its own thread.

pub mod worker;

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use deepinfer_engine::engine::{FetchedBlock, PersistBlock, WantedBlock};
use deepinfer_engine::kv_tiers::block_file::{self, FileFault, HEADER_BYTES};
use deepinfer_engine::kv_tiers::{Departure, Removed, TierIndex};
use deepinfer_engine::model::Model;

/// Counters of the disk tier, shared with `/metrics`.
#[derive(Debug, Default)]
pub struct DiskStats {
    pub blocks: AtomicU64,
    pub bytes: AtomicU64,
    pub capacity_bytes: AtomicU64,
    /// Blocks found at start.
    pub indexed_at_start: AtomicU64,
    pub hit_blocks: AtomicU64,
    pub miss_blocks: AtomicU64,
    pub written_blocks: AtomicU64,
    /// Blocks another process (or this one) had written already.
    pub already_present: AtomicU64,
    pub write_errors: AtomicU64,
    /// Blocks not written because the writer's queue was full.
    pub dropped_writes: AtomicU64,
    pub read_errors: AtomicU64,
    pub evicted_blocks: AtomicU64,
    pub expired_blocks: AtomicU64,
    pub corrupt_files: AtomicU64,
    pub truncated_files: AtomicU64,
    pub foreign_files: AtomicU64,
    /// Bytes read back into memory, and the time it took (ns), for bandwidth.
    pub read_bytes: AtomicU64,
    pub read_ns: AtomicU64,
}

impl DiskStats {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// Where the disk tier lives and what it may hold.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Bytes of block files this process keeps (least recently used removed past it).
    pub capacity_bytes: u64,
    /// What identifies the weights (a preset and seed, a checkpoint's files).
    pub weights_identity: String,
}

/// Milliseconds since the Unix epoch of a file time.
fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The disk tier of one process.
pub struct DiskTier {
    root: PathBuf,
    fingerprint: u64,
    block_tokens: usize,
    model: Arc<Model>,
    /// Files by block key; tokens are checked when a file is read.
    index: TierIndex<()>,
    stats: Arc<DiskStats>,
    temp_counter: u64,
    warned_at_ms: Option<u64>,
}

/// Threads reading shard directories when the index is rebuilt.
const SCAN_THREADS: usize = 16;

/// One file met by the index rebuild.
enum ScanResult {
    Found { used_ms: u64, key: u64, path: PathBuf, parent: u64, ttl_ms: u64, len: u64 },
    Bad(PathBuf, FileFault),
}

/// Least time between two warnings about failing disk I/O.
const WARNING_INTERVAL_MS: u64 = 60_000;

impl DiskTier {
    /// Open (creating it if needed) the tier for `model` and rebuild its
    /// index from the files there. A directory that cannot be created or
    /// read gives an empty tier whose writes fail and are counted.
    pub fn open(
        model: Arc<Model>,
        block_tokens: usize,
        config: &DiskConfig,
        stats: Arc<DiskStats>,
        now_ms: u64,
    ) -> Self {
        let fingerprint = block_file::fingerprint(&model, &config.weights_identity, block_tokens);
        let root = config.dir.join(format!("{fingerprint:016x}"));
        stats.capacity_bytes.store(config.capacity_bytes, Ordering::Relaxed);
        let mut tier = Self {
            root,
            fingerprint,
            block_tokens,
            model,
            index: TierIndex::new(usize::try_from(config.capacity_bytes).unwrap_or(usize::MAX)),
            stats,
            temp_counter: 0,
            warned_at_ms: None,
        };
        if let Err(e) = fs::create_dir_all(tier.root.join("tmp")) {
            tier.warn(now_ms, &format!("cannot create {}: {e}", tier.root.display()));
        }
        tier.scan(now_ms);
        tier
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Key and parent key of every block file indexed.
    pub fn keys(&self) -> Vec<(u64, u64)> {
        self.index.keys().collect()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn path(&self, key: u64) -> PathBuf {
        self.root.join(format!("{:02x}", key >> 56)).join(format!("{key:016x}.kvb"))
    }

    fn warn(&mut self, now_ms: u64, what: &str) {
        if self.warned_at_ms.is_none_or(|t| now_ms >= t + WARNING_INTERVAL_MS) {
            self.warned_at_ms = Some(now_ms);
            eprintln!("deepinfer: warning: prompt cache disk tier: {what}; blocks stay in memory only");
        }
    }

    fn count_fault(&self, fault: &FileFault) {
        let counter = match fault {
            FileFault::Truncated { .. } => &self.stats.truncated_files,
            FileFault::Corrupt(_) => &self.stats.corrupt_files,
            FileFault::Foreign(_) => &self.stats.foreign_files,
        };
        DiskStats::add(counter, 1);
    }

    /// Rebuild the index from the files' headers, oldest use first so the
    /// least recently used order survives a restart. Shard directories are
    /// read by several threads at once: a cold scan waits on the disk, not the CPU.
    fn scan(&mut self, now_ms: u64) {
        let Ok(shards) = fs::read_dir(&self.root) else { return };
        let mut shard_dirs: Vec<PathBuf> = shards
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n != "tmp"))
            .collect();
        shard_dirs.sort();
        let threads = SCAN_THREADS.min(shard_dirs.len()).max(1);
        let this = &*self;
        let mut results: Vec<ScanResult> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let mine: Vec<&PathBuf> = shard_dirs.iter().skip(t).step_by(threads).collect();
                    scope.spawn(move || mine.into_iter().flat_map(|d| this.scan_shard(d)).collect::<Vec<_>>())
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().expect("a scan thread")).collect()
        });
        results.sort_by_key(|r| match r {
            ScanResult::Found { used_ms, key, .. } => (0, *used_ms, *key),
            ScanResult::Bad(..) => (1, 0, 0),
        });
        for r in results {
            match r {
                ScanResult::Bad(path, fault) => {
                    self.count_fault(&fault);
                    let _ = fs::remove_file(&path);
                }
                ScanResult::Found { used_ms, key, path, parent, ttl_ms, len } => {
                    let expires = used_ms.saturating_add(ttl_ms);
                    if expires <= now_ms {
                        DiskStats::add(&self.stats.expired_blocks, 1);
                        let _ = fs::remove_file(&path);
                        continue;
                    }
                    let removed = self.index.insert(now_ms, key, parent, &[], len as usize, expires, ());
                    self.remove_files(removed.unwrap_or_default());
                }
            }
        }
        DiskStats::add(&self.stats.indexed_at_start, self.index.len() as u64);
        self.publish();
    }

    /// The block files of one shard directory, read but not yet indexed.
    fn scan_shard(&self, shard: &Path) -> Vec<ScanResult> {
        let Ok(files) = fs::read_dir(shard) else { return Vec::new() };
        let mut out = Vec::new();
        for entry in files.filter_map(Result::ok) {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "kvb") {
                continue;
            }
            match self.read_header_of(&path) {
                Err(None) => {} // unreadable now: left alone
                Err(Some(fault)) => out.push(ScanResult::Bad(path, fault)),
                Ok((header, len, used_ms)) => {
                    let named = path.file_stem().and_then(|s| u64::from_str_radix(&s.to_string_lossy(), 16).ok());
                    if named != Some(header.key) {
                        out.push(ScanResult::Bad(path, FileFault::Corrupt("named after another key".into())));
                        continue;
                    }
                    let (key, parent, ttl_ms) = (header.key, header.parent, header.ttl_ms);
                    out.push(ScanResult::Found { used_ms, key, path, parent, ttl_ms, len });
                }
            }
        }
        out
    }

    /// Header, length and last use of a block file; `Err(None)` if it cannot be read at all.
    fn read_header_of(&self, path: &Path) -> Result<(block_file::Header, u64, u64), Option<FileFault>> {
        let mut f = fs::File::open(path).map_err(|_| None)?;
        let meta = f.metadata().map_err(|_| None)?;
        let mut head = [0u8; HEADER_BYTES];
        let n = read_up_to(&mut f, &mut head).map_err(|_| None)?;
        let header = block_file::read_header(&head[..n], self.fingerprint, self.block_tokens).map_err(Some)?;
        if meta.len() != header.file_bytes() {
            return Err(Some(FileFault::Truncated { have: meta.len(), need: header.file_bytes() }));
        }
        Ok((header, meta.len(), meta.modified().map(unix_ms).unwrap_or(0)))
    }

    fn remove_files(&mut self, removed: Vec<Removed<()>>) {
        for r in removed {
            let counter = match r.why {
                Departure::Evicted => &self.stats.evicted_blocks,
                Departure::Expired => &self.stats.expired_blocks,
                Departure::Taken => &self.stats.read_errors,
            };
            DiskStats::add(counter, 1);
            let _ = fs::remove_file(self.path(r.key));
        }
        self.publish();
    }

    /// Forget a block and remove its file (damaged or expired).
    fn drop_file(&mut self, key: u64, path: &Path) {
        self.index.take(key);
        let _ = fs::remove_file(path);
        self.publish();
    }

    fn publish(&self) {
        self.stats.blocks.store(self.index.len() as u64, Ordering::Relaxed);
        self.stats.bytes.store(self.index.used_bytes() as u64, Ordering::Relaxed);
    }

    /// Write a block's file unless it is there already (from this process or another).
    pub fn write(&mut self, block: &PersistBlock, now_ms: u64) {
        let path = self.path(block.key);
        if self.index.contains(block.key) || path.exists() {
            DiskStats::add(&self.stats.already_present, 1);
            if !self.index.contains(block.key) {
                if let Ok((header, len, used_ms)) = self.read_header_of(&path) {
                    let expires = used_ms.max(now_ms).saturating_add(header.ttl_ms);
                    let removed = self.index.insert(now_ms, block.key, block.parent, &[], len as usize, expires, ());
                    self.remove_files(removed.unwrap_or_default());
                }
            }
            return;
        }
        let bytes = block_file::encode(
            self.fingerprint,
            self.block_tokens,
            block.key,
            block.parent,
            &block.tokens,
            &block.values,
            block.ttl_ms,
            now_ms,
        );
        self.temp_counter += 1;
        let temp =
            self.root.join("tmp").join(format!("{:016x}.{}.{}.tmp", block.key, std::process::id(), self.temp_counter));
        let written = (|| -> std::io::Result<()> {
            fs::create_dir_all(path.parent().expect("a shard directory"))?;
            let mut f = fs::File::create(&temp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            fs::rename(&temp, &path)
        })();
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            DiskStats::add(&self.stats.write_errors, 1);
            self.warn(now_ms, &format!("cannot write {}: {e}", path.display()));
            return;
        }
        DiskStats::add(&self.stats.written_blocks, 1);
        let expires = now_ms.saturating_add(block.ttl_ms);
        match self.index.insert(now_ms, block.key, block.parent, &[], bytes.len(), expires, ()) {
            Ok(removed) => self.remove_files(removed),
            Err(()) => {
                let _ = fs::remove_file(&path);
            }
        }
    }

    /// Read the leading run of `wanted` (a chain from some block on) that is
    /// on disk, stopping at the first block missing, expired or damaged.
    pub fn fetch(&mut self, wanted: &[WantedBlock], now_ms: u64) -> Vec<FetchedBlock> {
        let mut out = Vec::new();
        for w in wanted {
            match self.read_block(w, now_ms) {
                Some(b) => out.push(b),
                None => {
                    DiskStats::add(&self.stats.miss_blocks, 1);
                    break;
                }
            }
        }
        DiskStats::add(&self.stats.hit_blocks, out.len() as u64);
        out
    }

    fn read_block(&mut self, w: &WantedBlock, now_ms: u64) -> Option<FetchedBlock> {
        let path = self.path(w.key);
        if !self.index.contains(w.key) && !path.exists() {
            return None;
        }
        let started = std::time::Instant::now();
        let bytes = match fs::File::open(&path).and_then(|f| {
            // Never more than a block file may hold, whatever is at that path.
            let len = f.metadata()?.len().min(block_file::MAX_FILE_BYTES + 1);
            let mut buf = Vec::with_capacity(len as usize);
            f.take(block_file::MAX_FILE_BYTES + 1).read_to_end(&mut buf)?;
            Ok(buf)
        }) {
            Ok(bytes) => bytes,
            Err(_) => {
                // Removed by another process, or unreadable: a miss.
                self.index.take(w.key);
                self.publish();
                return None;
            }
        };
        let block = match block_file::decode(&self.model, &bytes, self.fingerprint, self.block_tokens) {
            Ok(b) if b.header.key == w.key && b.header.parent == w.parent && b.tokens == w.tokens => b,
            Ok(_) => return None,
            Err(fault) => {
                self.count_fault(&fault);
                self.drop_file(w.key, &path);
                return None;
            }
        };
        DiskStats::add(&self.stats.read_bytes, bytes.len() as u64);
        DiskStats::add(&self.stats.read_ns, started.elapsed().as_nanos() as u64);
        let used_ms = fs::metadata(&path).and_then(|m| m.modified()).map(unix_ms).unwrap_or(0);
        if used_ms.saturating_add(block.header.ttl_ms) <= now_ms {
            DiskStats::add(&self.stats.expired_blocks, 1);
            self.drop_file(w.key, &path);
            return None;
        }
        // A hit: its TTL starts again now, here and for every process sharing the file.
        let expires_at_ms = now_ms.saturating_add(block.header.ttl_ms);
        let _ = fs::File::options()
            .write(true)
            .open(&path)
            .and_then(|f| f.set_modified(UNIX_EPOCH + Duration::from_millis(now_ms)));
        if self.index.hit(now_ms, w.key, w.parent, &[], expires_at_ms).is_none() {
            let removed = self.index.insert(now_ms, w.key, w.parent, &[], bytes.len(), expires_at_ms, ());
            self.remove_files(removed.unwrap_or_default());
        }
        Some(FetchedBlock { key: w.key, parent: w.parent, tokens: block.tokens, values: block.values, expires_at_ms })
    }
}

/// Read until `buf` is full or the file ends; the bytes read.
fn read_up_to(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Every block file under `dir` (any fingerprint), sorted: what a tier there holds.
pub fn block_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "kvb") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The tiers below the device pool as a process sets them up.
#[derive(Clone)]
pub struct CacheSetup {
    pub tiers: deepinfer_engine::engine::TierConfig,
    pub disk: Option<DiskConfig>,
    pub clock: worker::Clock,
}

impl std::fmt::Debug for CacheSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheSetup").field("tiers", &self.tiers).field("disk", &self.disk).finish_non_exhaustive()
    }
}

impl CacheSetup {
    /// No host or disk tier; TTLs measured on the system clock.
    pub fn memory_only() -> Self {
        Self { tiers: Default::default(), disk: None, clock: system_clock() }
    }
}

/// Milliseconds since the Unix epoch, from the system clock.
pub fn system_clock() -> worker::Clock {
    Arc::new(|| unix_ms(SystemTime::now()))
}

/// What identifies a model's weights for the disk tier: a built-in preset
/// and its seed, or a checkpoint directory's path and its files' sizes and
/// modification times (rewriting a checkpoint invalidates its blocks).
pub fn weights_identity(spec: &str, seed: u64) -> String {
    if spec.starts_with("builtin:") {
        return format!("{spec} seed {seed}");
    }
    let dir = fs::canonicalize(spec).unwrap_or_else(|_| PathBuf::from(spec));
    let mut files: Vec<String> = fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors" || x == "json"))
                .filter_map(|e| {
                    let m = e.metadata().ok()?;
                    Some(format!(
                        "{}:{}:{}",
                        e.file_name().to_string_lossy(),
                        m.len(),
                        m.modified().map(unix_ms).unwrap_or(0)
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    format!("{}|{}", dir.display(), files.join(","))
}

#[cfg(test)]
mod tests;
