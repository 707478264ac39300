//! Prometheus series of the prompt cache's tiers, labelled `tier` =
//! `device`, `host` or `disk`: hits, blocks and bytes held, evictions,
//! expiries, disk writes and faults, and the time prefixes take to load.

use deepinfer_engine::engine::Engine;
use deepinfer_engine::kv_pool::BlockKind;
use deepinfer_engine::kv_tiers::Tier;
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};

use crate::kv_disk::worker::DiskWorker;
use crate::kv_disk::DiskStats;

pub const HIT_TOKENS: &str = "deepinfer_prompt_cache_hit_tokens_total";
pub const MISS_TOKENS: &str = "deepinfer_prompt_cache_miss_tokens_total";
pub const BLOCKS: &str = "deepinfer_prompt_cache_blocks";
pub const BYTES: &str = "deepinfer_prompt_cache_bytes";
pub const CAPACITY_BYTES: &str = "deepinfer_prompt_cache_capacity_bytes";
pub const EVICTIONS: &str = "deepinfer_prompt_cache_evictions_total";
pub const EXPIRIES: &str = "deepinfer_prompt_cache_expiries_total";
pub const PROMOTED: &str = "deepinfer_prompt_cache_promoted_blocks_total";
pub const DISK_QUEUED: &str = "deepinfer_prompt_cache_disk_queued_blocks_total";
pub const DISK_WRITTEN: &str = "deepinfer_prompt_cache_disk_written_blocks_total";
pub const DISK_PRESENT: &str = "deepinfer_prompt_cache_disk_present_blocks_total";
pub const DISK_WRITE_ERRORS: &str = "deepinfer_prompt_cache_disk_write_errors_total";
pub const DISK_WRITES_DROPPED: &str = "deepinfer_prompt_cache_disk_writes_dropped_total";
pub const DISK_BAD_FILES: &str = "deepinfer_prompt_cache_disk_bad_files_total";
pub const DISK_INDEXED_AT_START: &str = "deepinfer_prompt_cache_disk_indexed_at_start_blocks";
pub const LOAD: &str = "deepinfer_prompt_cache_load_seconds";
/// Device memory this process's buffers hold (weights and sequence states), on a device model.
pub const DEVICE_MEMORY: &str = "deepinfer_device_memory_bytes";
/// The device's total memory (a GPU's; none for the emulated device).
pub const DEVICE_MEMORY_TOTAL: &str = "deepinfer_device_memory_total_bytes";

pub fn describe() {
    describe_counter!(HIT_TOKENS, "Prompt tokens served by the prompt cache, by the tier they were found in");
    describe_counter!(MISS_TOKENS, "Prompt tokens looked up and not served by any tier");
    describe_gauge!(BLOCKS, "Blocks held by each tier");
    describe_gauge!(DEVICE_MEMORY, Unit::Bytes, "Device memory held by this process (weights and sequence states)");
    describe_gauge!(DEVICE_MEMORY_TOTAL, Unit::Bytes, "The device's total memory");
    describe_gauge!(BYTES, Unit::Bytes, "Bytes held by each tier");
    describe_gauge!(CAPACITY_BYTES, Unit::Bytes, "Byte budget of each tier");
    describe_counter!(EVICTIONS, "Blocks evicted from each tier for room");
    describe_counter!(EXPIRIES, "Blocks dropped from each tier when their TTL ran out");
    describe_counter!(PROMOTED, "Blocks brought into the device pool, by the tier they came from");
    describe_counter!(DISK_QUEUED, "Blocks handed to the disk tier for writing (persist points)");
    describe_counter!(DISK_WRITTEN, "Block files written");
    describe_counter!(
        DISK_PRESENT,
        "Blocks not written because their file was there already (this process or another)"
    );
    describe_counter!(DISK_WRITE_ERRORS, "Block files that could not be written (full disk, read-only mount)");
    describe_counter!(DISK_WRITES_DROPPED, "Blocks not written because the queue to disk was full");
    describe_counter!(DISK_BAD_FILES, "Block files skipped and removed, by reason (corrupt, truncated, foreign)");
    describe_gauge!(DISK_INDEXED_AT_START, "Block files found when the disk tier's index was rebuilt");
    describe_histogram!(
        LOAD,
        Unit::Seconds,
        "From a waiting request's disk fetch being queued to its blocks being read"
    );
}

/// A disk fetch completed.
pub fn disk_load(latency: std::time::Duration, _blocks: usize) {
    histogram!(LOAD, "tier" => Tier::Disk.name()).record(latency.as_secs_f64());
}

/// The tiers' totals, read after each step.
pub fn update(engine: &Engine, disk: Option<&DiskWorker>) {
    update_engine(engine);
    if let Some(d) = disk {
        update_disk(&d.stats);
    }
}

/// What the engine knows: the device and host tiers, hits by tier, blocks queued for disk.
fn update_engine(engine: &Engine) {
    let s = engine.scheduler();
    let tc = engine.tier_counters();
    for t in Tier::ALL {
        counter!(HIT_TOKENS, "tier" => t.name()).absolute(tc.hit_tokens[t.index()]);
    }
    counter!(PROMOTED, "tier" => Tier::Host.name()).absolute(tc.promoted_blocks[Tier::Host.index()]);
    counter!(PROMOTED, "tier" => Tier::Disk.name()).absolute(tc.promoted_blocks[Tier::Disk.index()]);
    let prefix = s.prefix_stats();
    counter!(MISS_TOKENS).absolute(prefix.lookup_tokens - prefix.hit_tokens);
    let layout = s.layout();
    let block_bytes = layout.bytes(BlockKind::Compressed) + layout.bytes(BlockKind::Indexer);
    gauge!(BLOCKS, "tier" => Tier::Device.name()).set(s.cached_blocks() as f64);
    gauge!(BYTES, "tier" => Tier::Device.name()).set((s.cached_blocks() * block_bytes) as f64);
    gauge!(CAPACITY_BYTES, "tier" => Tier::Device.name()).set(s.config().kv_budget_bytes as f64);
    counter!(EVICTIONS, "tier" => Tier::Device.name()).absolute(prefix.evicted_blocks);
    counter!(EXPIRIES, "tier" => Tier::Device.name()).absolute(prefix.expired_blocks);
    let host = engine.host_tier();
    gauge!(BLOCKS, "tier" => Tier::Host.name()).set(host.len() as f64);
    gauge!(BYTES, "tier" => Tier::Host.name()).set(host.used_bytes() as f64);
    gauge!(CAPACITY_BYTES, "tier" => Tier::Host.name()).set(host.capacity_bytes() as f64);
    counter!(EVICTIONS, "tier" => Tier::Host.name()).absolute(host.stats.evicted_blocks);
    counter!(EXPIRIES, "tier" => Tier::Host.name()).absolute(host.stats.expired_blocks);
    counter!(DISK_QUEUED).absolute(tc.persist_blocks);
    counter!(DISK_WRITES_DROPPED, "queue" => "engine").absolute(tc.persist_dropped);
    if let Some(device) = &engine.model().device {
        let gpu = device.gpu();
        gauge!(DEVICE_MEMORY, "device" => gpu.name()).set(gpu.memory_in_use() as f64);
        if let Some(total) = gpu.total_memory() {
            gauge!(DEVICE_MEMORY_TOTAL, "device" => gpu.name()).set(total as f64);
        }
    }
}

/// The disk tier's own counters; also read when `/metrics` is scraped, as
/// the disk thread goes on writing after the engine falls idle.
pub fn update_disk(st: &DiskStats) {
    gauge!(BLOCKS, "tier" => Tier::Disk.name()).set(DiskStats::get(&st.blocks) as f64);
    gauge!(BYTES, "tier" => Tier::Disk.name()).set(DiskStats::get(&st.bytes) as f64);
    gauge!(CAPACITY_BYTES, "tier" => Tier::Disk.name()).set(DiskStats::get(&st.capacity_bytes) as f64);
    counter!(EVICTIONS, "tier" => Tier::Disk.name()).absolute(DiskStats::get(&st.evicted_blocks));
    counter!(EXPIRIES, "tier" => Tier::Disk.name()).absolute(DiskStats::get(&st.expired_blocks));
    counter!(DISK_WRITTEN).absolute(DiskStats::get(&st.written_blocks));
    counter!(DISK_PRESENT).absolute(DiskStats::get(&st.already_present));
    counter!(DISK_WRITE_ERRORS).absolute(DiskStats::get(&st.write_errors));
    counter!(DISK_WRITES_DROPPED, "queue" => "writer").absolute(DiskStats::get(&st.dropped_writes));
    for (reason, c) in
        [("corrupt", &st.corrupt_files), ("truncated", &st.truncated_files), ("foreign", &st.foreign_files)]
    {
        counter!(DISK_BAD_FILES, "reason" => reason).absolute(DiskStats::get(c));
    }
    gauge!(DISK_INDEXED_AT_START).set(DiskStats::get(&st.indexed_at_start) as f64);
}
