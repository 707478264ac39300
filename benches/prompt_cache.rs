//! The prompt cache's tiers on CPU: time to first token of a request whose
//! 4,032-token prefix is cold, on the device (the KV pool), in host memory,
//! or on disk after a restart with the page cache dropped; the disk tier's
//! restore bandwidth next to the disk's raw read bandwidth measured by `dd`
//! in the same run; and the time to rebuild the disk index of 10⁵ blocks.
//!
//! `cargo bench --bench prompt_cache [-- MODEL [DIR]]` (default
//! `builtin:small-v4`, a directory under the system's temporary one). The
//! page cache is dropped through `/proc/sys/vm/drop_caches` when the process
//! may write it (root); otherwise the table says the disk reads were warm.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use deepinfer::generation::load_model;
use deepinfer::kv_disk::{DiskConfig, DiskStats, DiskTier};
use deepinfer_engine::engine::{Engine, EngineConfig, TierConfig};
use deepinfer_engine::kv_tiers::block_file;
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::{block_hash, PrefixMode};
use deepinfer_engine::request::Request;

/// small-v4's context is 4,096 tokens: the largest whole-block prefix that
/// leaves room for a private tail and one generated token.
const PREFIX_TOKENS: usize = 4096 - 64;
const TAIL_TOKENS: usize = 32;
const INDEX_BLOCKS: usize = 100_000;

fn prompt(model: &Model, salt: u32, len: usize) -> Vec<u32> {
    let vocab = model.config.vocab_size as u32 - 2;
    (0..len as u32)
        .map(|i| 2 + (i.wrapping_mul(2_654_435_761).wrapping_add(salt.wrapping_mul(40_503)) >> 7) % vocab)
        .collect()
}

fn with_tail(prefix: &[u32], model: &Model, tail: u32) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend(prompt(model, 1000 + tail, TAIL_TOKENS));
    p
}

/// Time from submitting a one-token request to its token.
fn ttft(engine: &mut Engine, tokens: Vec<u32>) -> (Duration, [usize; 3]) {
    let id = engine.add_request(Request::new(tokens, 1)).expect("accepted");
    let start = Instant::now();
    let mut done = engine.run_to_completion();
    (start.elapsed(), done.remove(&id).expect("finished").finished.cached_tokens_by_tier)
}

fn engine(model: &Arc<Model>, kv_bytes: usize, tiers: TierConfig) -> Engine {
    let config = EngineConfig { prefix_mode: PrefixMode::Exact, kv_budget_bytes: kv_bytes, ..EngineConfig::default() };
    let mut e = Engine::new(model.clone(), config).expect("engine");
    e.configure_tiers(tiers);
    e
}

fn drop_page_cache() -> bool {
    let _ = Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok()
}

/// `dd`'s own figure for reading `file`, in MB/s (10⁶ bytes).
fn dd_read_mb_s(file: &Path, direct: bool) -> Option<f64> {
    let mut cmd = Command::new("dd");
    cmd.arg(format!("if={}", file.display())).args(["of=/dev/null", "bs=4M"]);
    if direct {
        cmd.arg("iflag=direct");
    }
    let out = cmd.output().ok()?;
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    let line = text.lines().find(|l| l.contains("copied"))?;
    // "1073741824 bytes (1.1 GB, 1.0 GiB) copied, 0.9 s, 1.2 GB/s"
    let bytes: f64 = line.split_whitespace().next()?.parse().ok()?;
    let secs: f64 = line.split("copied, ").nth(1)?.split(' ').next()?.replace(',', ".").parse().ok()?;
    Some(bytes / secs / 1e6)
}

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let spec = args.first().cloned().unwrap_or_else(|| "builtin:small-v4".into());
    let dir =
        args.get(1).map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("deepinfer-bench-prompt-cache"));
    let _ = std::fs::remove_dir_all(&dir);
    let model = Arc::new(load_model(&spec, 0, None).expect("model").model);
    let probe = engine(&model, 1 << 30, TierConfig::default());
    let layout = probe.scheduler().layout().clone();
    let bt = layout.block_tokens;
    let one_request = layout.sequence_bytes(PREFIX_TOKENS + TAIL_TOKENS + 1);
    let prefix = prompt(&model, 1, PREFIX_TOKENS);
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    println!(
        "model {spec}, {threads} threads, blocks of {bt} tokens, prefix {PREFIX_TOKENS} + tail {TAIL_TOKENS} tokens"
    );

    // Cold, then a device hit on the same engine; its blocks go to disk.
    let config = DiskConfig { dir: dir.clone(), capacity_bytes: 64 << 30, weights_identity: format!("{spec} seed 0") };
    let disk_tiers = TierConfig { disk: true, ..TierConfig::default() };
    let mut first = engine(&model, 2 * one_request, disk_tiers);
    let (cold, _) = ttft(&mut first, with_tail(&prefix, &model, 1));
    let (device, device_split) = ttft(&mut first, with_tail(&prefix, &model, 2));
    let stats = Arc::new(DiskStats::default());
    let mut tier = DiskTier::open(model.clone(), bt, &config, stats.clone(), 0);
    let persisted = first.take_persist();
    let block_bytes: usize = persisted.iter().map(|b| b.values.value_bytes()).sum::<usize>() / persisted.len().max(1);
    for b in &persisted {
        tier.write(b, 1);
    }
    drop(first);

    // Host: a pool that holds one request; a second prompt pushes the first to host memory.
    let host_tiers = TierConfig { host_bytes: 4 << 30, ..TierConfig::default() };
    let mut second = engine(&model, one_request + one_request / 4, host_tiers);
    ttft(&mut second, with_tail(&prefix, &model, 3));
    ttft(&mut second, prompt(&model, 2, PREFIX_TOKENS + TAIL_TOKENS));
    let (host, host_split) = ttft(&mut second, with_tail(&prefix, &model, 4));
    drop(second);

    // Disk: a new engine and a reopened tier, as after a restart.
    drop(tier);
    let dropped = drop_page_cache();
    let started = Instant::now();
    let mut tier = DiskTier::open(model.clone(), bt, &config, stats.clone(), 2);
    let index_rebuild = started.elapsed();
    let mut third = engine(&model, 2 * one_request, disk_tiers);
    let id = third.add_request(Request::new(with_tail(&prefix, &model, 5), 1)).expect("accepted");
    let start = Instant::now();
    let wanted = third.wanted_blocks(1).pop().expect("blocks wanted").1;
    let read_before = (DiskStats::get(&stats.read_bytes), DiskStats::get(&stats.read_ns));
    let fetched = tier.fetch(&wanted, 3);
    let fetch_time = start.elapsed();
    third.offer_blocks(id, fetched);
    let mut done = third.run_to_completion();
    let disk = start.elapsed();
    let disk_split = done.remove(&id).expect("finished").finished.cached_tokens_by_tier;
    let read_bytes = DiskStats::get(&stats.read_bytes) - read_before.0;
    let read_s = (DiskStats::get(&stats.read_ns) - read_before.1) as f64 * 1e-9;

    // The disk's raw read bandwidth, by dd, on a file of the same directory.
    let raw = dir.join("raw-read.bin");
    let mib = 1024;
    let status = Command::new("dd")
        .arg("if=/dev/urandom")
        .arg(format!("of={}", raw.display()))
        .args(["bs=1M", &format!("count={mib}"), "conv=fsync"])
        .output();
    let dropped_raw = drop_page_cache();
    let dd = status.ok().and_then(|_| dd_read_mb_s(&raw, !dropped_raw));
    let _ = std::fs::remove_file(&raw);

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let restore_mb_s = read_bytes as f64 / read_s / 1e6;
    println!();
    println!("| prefix served from | TTFT ms | × cold | cached tokens (device/host/disk) |");
    println!("|---|---:|---:|---|");
    println!("| nothing (cold prefill) | {:.0} | 1.00 | 0/0/0 |", ms(cold));
    for (name, t, s) in
        [("device (KV pool)", device, device_split), ("host memory", host, host_split), ("disk", disk, disk_split)]
    {
        println!("| {name} | {:.0} | {:.2} | {}/{}/{} |", ms(t), ms(t) / ms(cold), s[0], s[1], s[2]);
    }
    println!();
    println!(
        "disk: {} blocks of {:.0} KiB values ({:.1} MiB read, {} page cache) in {:.1} ms of {:.1} ms fetch: restore {:.0} MB/s; dd raw read {} MB/s ({})",
        wanted.len(),
        block_bytes as f64 / 1024.0,
        read_bytes as f64 / (1 << 20) as f64,
        if dropped { "dropped" } else { "warm" },
        read_s * 1e3,
        ms(fetch_time),
        restore_mb_s,
        dd.map_or("n/a".into(), |v| format!("{v:.0}")),
        if dropped_raw { "page cache dropped" } else { "O_DIRECT" },
    );
    println!("index of {} files rebuilt in {:.1} ms", tier.len(), ms(index_rebuild));
    drop(tier);

    index_rebuild_at_scale(&model, &dir, bt);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Write 10⁵ block files (one block's values under distinct keys) and time
/// the index rebuild a restart does.
fn index_rebuild_at_scale(model: &Arc<Model>, dir: &Path, bt: usize) {
    let scale_dir = dir.join("index-scale");
    let config = DiskConfig { dir: scale_dir.clone(), capacity_bytes: u64::MAX, weights_identity: "index".into() };
    let fp = block_file::fingerprint(model, &config.weights_identity, bt);
    let root = scale_dir.join(format!("{fp:016x}"));
    let started = Instant::now();
    let mut total = 0usize;
    // Files without values keep the disk use down; the scan reads each
    // header and file size either way, never the values.
    let values = deepinfer_engine::block_values::BlockValues::default();
    for i in 0..INDEX_BLOCKS {
        let tokens: Vec<u32> = (0..bt as u32).map(|t| t + i as u32).collect();
        let key = block_hash(0, &tokens);
        let bytes = block_file::encode(fp, bt, key, 0, &tokens, &values, 3_600_000, 0);
        let shard = root.join(format!("{:02x}", key >> 56));
        std::fs::create_dir_all(&shard).expect("shard directory");
        std::fs::write(shard.join(format!("{key:016x}.kvb")), &bytes).expect("block file");
        total += bytes.len();
    }
    let written = started.elapsed();
    let dropped = drop_page_cache();
    let started = Instant::now();
    let tier = DiskTier::open(model.clone(), bt, &config, Arc::new(DiskStats::default()), 1);
    let rebuilt = started.elapsed();
    println!(
        "index of {} block files ({:.0} MiB) rebuilt in {:.2} s ({} page cache; written in {:.1} s)",
        tier.len(),
        total as f64 / (1 << 20) as f64,
        rebuilt.as_secs_f64(),
        if dropped { "dropped" } else { "warm" },
        written.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&scale_dir);
}
