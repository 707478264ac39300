//! The event log and counters of a run. In simulation the log's digest is the
//! fingerprint of a run: same seed, same digest, byte for byte.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::sim::clock::Clock;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

struct Inner {
    digest: u64,
    count: u64,
    kept: Vec<String>,
}

/// Folds formatted text into an FNV-1a digest, optionally keeping it.
struct Digesting {
    digest: u64,
    line: Option<String>,
}

impl std::fmt::Write for Digesting {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        for b in s.bytes() {
            self.digest = (self.digest ^ b as u64).wrapping_mul(FNV_PRIME);
        }
        if let Some(line) = &mut self.line {
            line.push_str(s);
        }
        Ok(())
    }
}

/// Ordered record of what happened, folded into a 64-bit FNV-1a digest.
/// Lines carry the clock's time, so with a virtual clock they are reproducible.
pub struct EventLog {
    clock: Arc<dyn Clock>,
    keep: usize,
    /// Also write every line to standard error (a real node's `DEEPINFER_EVENTS=1`).
    echo: bool,
    inner: Mutex<Inner>,
}

impl EventLog {
    /// `keep`: how many lines to retain for inspection (all are digested).
    pub fn new(clock: Arc<dyn Clock>, keep: usize) -> Self {
        Self { clock, keep, echo: false, inner: Mutex::new(Inner { digest: FNV_OFFSET, count: 0, kept: Vec::new() }) }
    }

    /// The same log, also writing each line to standard error as it is recorded.
    pub fn echoing(mut self, echo: bool) -> Self {
        self.echo = echo;
        self
    }

    pub fn record(&self, what: std::fmt::Arguments<'_>) {
        let t = self.clock.now();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let keep = inner.kept.len() < self.keep;
        // The line is hashed as it is formatted; it is only kept as text when asked.
        let mut w = Digesting { digest: inner.digest, line: (keep || self.echo).then(String::new) };
        let _ = writeln!(w, "{:>12} {}", t.as_nanos(), what);
        inner.digest = w.digest;
        inner.count += 1;
        if let Some(mut line) = w.line {
            line.pop();
            if self.echo {
                eprintln!("event {line}");
            }
            if keep {
                inner.kept.push(line);
            }
        }
    }

    pub fn digest(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).digest
    }

    pub fn len(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn lines(&self) -> Vec<String> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).kept.clone()
    }

    pub fn now(&self) -> Duration {
        self.clock.now()
    }
}

/// Counters shared by every actor of a cluster (they survive restarts).
#[derive(Default)]
pub struct Metrics {
    pub frames_sent: AtomicU64,
    pub frames_delivered: AtomicU64,
    pub frames_dropped: AtomicU64,
    pub frames_duplicated: AtomicU64,
    pub frames_rejected: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub worker_restarts: AtomicU64,
    pub shard_restarts: AtomicU64,
    pub member_restarts: AtomicU64,
    pub supervisor_restarts: AtomicU64,
    pub escalations: AtomicU64,
    pub kills_injected: AtomicU64,
    pub dispatch_resends: AtomicU64,
    pub step_resends: AtomicU64,
    pub sequences_rebuilt: AtomicU64,
    pub expert_loads: AtomicU64,
    /// Expert weight bytes shards read from the checkpoint, and freed.
    pub expert_bytes_read: AtomicU64,
    pub expert_bytes_freed: AtomicU64,
    /// Placement switches whose new experts were loaded ahead, while the old table served.
    pub placements_prepared: AtomicU64,
    pub passes: AtomicU64,
    /// Expert dispatches a shard computed and answered.
    pub dispatches_answered: AtomicU64,
    pub layers: AtomicU64,
    pub scheduler_restarts: AtomicU64,
    pub cache_restarts: AtomicU64,
    pub router_restarts: AtomicU64,
    /// Image encoders restarted by their supervisor.
    pub encoder_restarts: AtomicU64,
    /// Images a scheduler asked an encoder instance to encode (each try).
    pub images_sent_to_encoders: AtomicU64,
    /// Encodes tried again after an encoder was lost, refused or silent.
    pub encode_retries: AtomicU64,
    /// Images encoded on the prefill workers instead of an encoder instance.
    pub images_colocated: AtomicU64,
    /// Images an encoder instance answered from its cache.
    pub encoder_cache_hits: AtomicU64,
    pub submits_resent: AtomicU64,
    pub requests_resumed: AtomicU64,
    /// Requests moved from a prefill instance to a decode instance.
    pub handovers: AtomicU64,
    pub requests_restarted: AtomicU64,
    /// Handoffs a prefill instance gave up on and placed on a decode
    /// instance to be recomputed there, by why: no state (none exported, or
    /// too large for a frame), its handoff table full, not adopted after
    /// every transfer attempt.
    pub reroutes_no_state: AtomicU64,
    pub reroutes_backlog: AtomicU64,
    pub reroutes_unadopted: AtomicU64,
    /// State transfers sent again after their acknowledgement deadline.
    pub transfers_resent: AtomicU64,
    /// Handed-off requests a decode instance recomputed because their state did not check out.
    pub handoff_recomputes: AtomicU64,
    /// Most handoffs one prefill scheduler had waiting at once (sent or queued for its link).
    pub handoffs_pending_peak: AtomicU64,
    /// Time from a prefill's finish to its adoption by the decode instance.
    pub handoff_wait: Histogram,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub lookups: AtomicU64,
    /// Prompt-cache blocks moved to a node's host memory by a pool's eviction.
    pub host_blocks_in: AtomicU64,
    /// Blocks brought back up for a waiting request, from host memory and from disk.
    pub host_hit_blocks: AtomicU64,
    pub disk_hit_blocks: AtomicU64,
    /// Blocks handed to a disk tier's writer.
    pub blocks_persisted: AtomicU64,
    /// Computing workers' speculative decoding: drafts proposed, verified
    /// (sent through the target with a step) and accepted; verifications are
    /// the sampling items that verified at least one draft.
    pub drafts_proposed: AtomicU64,
    pub drafts_verified: AtomicU64,
    pub drafts_accepted: AtomicU64,
    pub verifications: AtomicU64,
    /// Verifications whose every draft was accepted.
    pub verifications_all_accepted: AtomicU64,
}

/// A plain copy of [`Metrics`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    pub frames_sent: u64,
    pub frames_delivered: u64,
    pub frames_dropped: u64,
    pub frames_duplicated: u64,
    pub frames_rejected: u64,
    pub bytes_sent: u64,
    pub worker_restarts: u64,
    pub shard_restarts: u64,
    pub member_restarts: u64,
    pub supervisor_restarts: u64,
    pub escalations: u64,
    pub kills_injected: u64,
    pub dispatch_resends: u64,
    pub step_resends: u64,
    pub sequences_rebuilt: u64,
    pub expert_loads: u64,
    pub expert_bytes_read: u64,
    pub expert_bytes_freed: u64,
    pub placements_prepared: u64,
    pub passes: u64,
    pub dispatches_answered: u64,
    pub layers: u64,
    pub scheduler_restarts: u64,
    pub cache_restarts: u64,
    pub router_restarts: u64,
    pub encoder_restarts: u64,
    pub images_sent_to_encoders: u64,
    pub encode_retries: u64,
    pub images_colocated: u64,
    pub encoder_cache_hits: u64,
    pub submits_resent: u64,
    pub requests_resumed: u64,
    pub handovers: u64,
    pub requests_restarted: u64,
    pub reroutes_no_state: u64,
    pub reroutes_backlog: u64,
    pub reroutes_unadopted: u64,
    pub transfers_resent: u64,
    pub handoff_recomputes: u64,
    pub handoffs_pending_peak: u64,
    /// Handoff wait from prefill finish to adoption, µs: (p50, p99, count).
    pub handoff_wait_us: (u64, u64, u64),
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub blocks_stored: u64,
    pub lookups: u64,
    pub host_blocks_in: u64,
    pub host_hit_blocks: u64,
    pub disk_hit_blocks: u64,
    pub blocks_persisted: u64,
    pub drafts_proposed: u64,
    pub drafts_verified: u64,
    pub drafts_accepted: u64,
    pub verifications: u64,
    pub verifications_all_accepted: u64,
}

impl MetricsSnapshot {
    /// Handoffs placed elsewhere for recompute, whatever the reason.
    pub fn reroutes(&self) -> u64 {
        self.reroutes_no_state + self.reroutes_backlog + self.reroutes_unadopted
    }

    pub fn restarts(&self) -> u64 {
        self.worker_restarts
            + self.shard_restarts
            + self.member_restarts
            + self.supervisor_restarts
            + self.scheduler_restarts
            + self.cache_restarts
            + self.router_restarts
            + self.encoder_restarts
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Buckets per doubling of a [`Histogram`]: a quantile is within about 9%.
const HISTOGRAM_PER_OCTAVE: usize = 8;
/// Buckets of a [`Histogram`]: values from 1 to 2^40 (µs: 12 days); larger ones count in the last.
const HISTOGRAM_BUCKETS: usize = 40 * HISTOGRAM_PER_OCTAVE;

/// A fixed-size log-scale histogram of durations in µs, shared by every
/// actor without a lock: its memory does not grow with the samples.
pub struct Histogram([AtomicU64; HISTOGRAM_BUCKETS]);

impl Default for Histogram {
    fn default() -> Self {
        Self(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

impl Histogram {
    fn bucket(us: u64) -> usize {
        let x = (us.max(1) as f64).log2() * HISTOGRAM_PER_OCTAVE as f64;
        (x as usize).min(HISTOGRAM_BUCKETS - 1)
    }

    pub fn record(&self, d: Duration) {
        bump(&self.0[Self::bucket(d.as_micros() as u64)]);
    }

    pub fn count(&self) -> u64 {
        self.0.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The value below which a share `q` of the samples lie (a bucket's
    /// geometric middle); 0 without samples.
    pub fn quantile(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self.0.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, n) in counts.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return 2f64.powf((i as f64 + 0.5) / HISTOGRAM_PER_OCTAVE as f64).round() as u64;
            }
        }
        unreachable!("rank within the total")
    }
}

impl Metrics {
    pub fn snapshot(&self) -> MetricsSnapshot {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        MetricsSnapshot {
            frames_sent: g(&self.frames_sent),
            frames_delivered: g(&self.frames_delivered),
            frames_dropped: g(&self.frames_dropped),
            frames_duplicated: g(&self.frames_duplicated),
            frames_rejected: g(&self.frames_rejected),
            bytes_sent: g(&self.bytes_sent),
            worker_restarts: g(&self.worker_restarts),
            shard_restarts: g(&self.shard_restarts),
            member_restarts: g(&self.member_restarts),
            supervisor_restarts: g(&self.supervisor_restarts),
            escalations: g(&self.escalations),
            kills_injected: g(&self.kills_injected),
            dispatch_resends: g(&self.dispatch_resends),
            step_resends: g(&self.step_resends),
            sequences_rebuilt: g(&self.sequences_rebuilt),
            expert_loads: g(&self.expert_loads),
            expert_bytes_read: g(&self.expert_bytes_read),
            expert_bytes_freed: g(&self.expert_bytes_freed),
            placements_prepared: g(&self.placements_prepared),
            passes: g(&self.passes),
            dispatches_answered: g(&self.dispatches_answered),
            layers: g(&self.layers),
            scheduler_restarts: g(&self.scheduler_restarts),
            cache_restarts: g(&self.cache_restarts),
            router_restarts: g(&self.router_restarts),
            encoder_restarts: g(&self.encoder_restarts),
            images_sent_to_encoders: g(&self.images_sent_to_encoders),
            encode_retries: g(&self.encode_retries),
            images_colocated: g(&self.images_colocated),
            encoder_cache_hits: g(&self.encoder_cache_hits),
            submits_resent: g(&self.submits_resent),
            requests_resumed: g(&self.requests_resumed),
            handovers: g(&self.handovers),
            requests_restarted: g(&self.requests_restarted),
            reroutes_no_state: g(&self.reroutes_no_state),
            reroutes_backlog: g(&self.reroutes_backlog),
            reroutes_unadopted: g(&self.reroutes_unadopted),
            transfers_resent: g(&self.transfers_resent),
            handoff_recomputes: g(&self.handoff_recomputes),
            handoffs_pending_peak: g(&self.handoffs_pending_peak),
            handoff_wait_us: (
                self.handoff_wait.quantile(0.5),
                self.handoff_wait.quantile(0.99),
                self.handoff_wait.count(),
            ),
            cache_hits: g(&self.cache_hits),
            cache_misses: g(&self.cache_misses),
            blocks_stored: g(&self.blocks_stored),
            lookups: g(&self.lookups),
            host_blocks_in: g(&self.host_blocks_in),
            host_hit_blocks: g(&self.host_hit_blocks),
            disk_hit_blocks: g(&self.disk_hit_blocks),
            blocks_persisted: g(&self.blocks_persisted),
            drafts_proposed: g(&self.drafts_proposed),
            drafts_verified: g(&self.drafts_verified),
            drafts_accepted: g(&self.drafts_accepted),
            verifications: g(&self.verifications),
            verifications_all_accepted: g(&self.verifications_all_accepted),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_are_within_a_bucket() {
        let h = Histogram::default();
        assert_eq!((h.quantile(0.5), h.count()), (0, 0));
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us * 1000));
        }
        assert_eq!(h.count(), 1000);
        let (p50, p99) = (h.quantile(0.5) as f64, h.quantile(0.99) as f64);
        assert!((p50 / 500_000.0 - 1.0).abs() < 0.1, "p50 {p50}");
        assert!((p99 / 990_000.0 - 1.0).abs() < 0.1, "p99 {p99}");
    }
}
