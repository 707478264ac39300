//! The cache tiers in a report: hit rate per tier (overall and over time),
//! what was loaded, written, dropped, evicted and expired per tier, and the
//! TTFT of requests by where their prefix came from.

use deepinfer_actors::modelled::tiers::{SimTier, TIERS};
use serde::Serialize;

use super::plots::Line;
use super::report::Percentiles;
use super::{End, RunData};
use crate::scenario::Scenario;

const GIB: f64 = (1u64 << 30) as f64;

/// One value per tier.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PerTier<T> {
    pub device: T,
    pub host: T,
    pub disk: T,
    pub shared: T,
}

impl<T: Clone> PerTier<T> {
    fn from_fn(f: impl Fn(SimTier) -> T) -> Self {
        Self { device: f(SimTier::Device), host: f(SimTier::Host), disk: f(SimTier::Disk), shared: f(SimTier::Shared) }
    }

    pub fn get(&self, t: SimTier) -> &T {
        match t {
            SimTier::Device => &self.device,
            SimTier::Host => &self.host,
            SimTier::Disk => &self.disk,
            SimTier::Shared => &self.shared,
        }
    }
}

/// Hit rates of one slice of time (prompt tokens admitted in it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TierPoint {
    pub t_s: f64,
    pub prompt_tokens: u64,
    pub hit_rate: PerTier<f64>,
}

/// Requests grouped by the tier that served most of their hit (`miss`: none).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SourceLatency {
    pub source: String,
    pub requests: u64,
    /// Mean share of their prompt served from cache.
    pub hit_share: f64,
    pub ttft_ms: Percentiles,
    /// Mean time their lower-tier reads took (they are admitted at the first plan after).
    pub load_ms_mean: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CacheReport {
    pub ttl_s: f64,
    /// KV per device when the scenario caps it.
    pub device_kv_gib: Option<f64>,
    pub host_gib_per_node: f64,
    pub disk_gib_per_node: f64,
    pub shared_gib: f64,
    pub block_mib: f64,
    /// Share of first-admission prompt tokens served from cache, all tiers.
    pub hit_rate: f64,
    pub hit_rate_by_tier: PerTier<f64>,
    /// What an unbounded cache without TTLs would serve of the same arrivals.
    pub ideal_hit_rate: f64,
    pub loaded_blocks: PerTier<u64>,
    pub loaded_gib: PerTier<f64>,
    pub written_blocks: PerTier<u64>,
    pub dropped_writes: PerTier<u64>,
    pub evicted_blocks: PerTier<u64>,
    pub expired_blocks: PerTier<u64>,
    pub used_gib_at_end: PerTier<f64>,
    /// Blocks of conversations under way before the run, placed in the shared store.
    pub preloaded_blocks: u64,
    pub ttft_by_source: Vec<SourceLatency>,
    pub series: Vec<TierPoint>,
}

fn source(by_tier: &[usize; TIERS]) -> Option<SimTier> {
    let most = *by_tier.iter().max()?;
    (most > 0).then(|| SimTier::ALL.into_iter().find(|t| by_tier[t.index()] == most).expect("a maximum"))
}

impl CacheReport {
    pub fn new(s: &Scenario, d: &RunData) -> Option<Self> {
        let c = s.cache.as_ref()?;
        let run = d.tiers.as_ref()?;
        let (mut prompt, mut by) = (0u64, [0u64; TIERS]);
        let slot_s = s.sample_s;
        let mut series: Vec<(u64, [u64; TIERS])> = Vec::new();
        for a in &run.admissions {
            prompt += a.prompt_tokens as u64;
            let slot = (a.at_us as f64 / 1e6 / slot_s) as usize;
            if series.len() <= slot {
                series.resize(slot + 1, (0, [0; TIERS]));
            }
            series[slot].0 += a.prompt_tokens as u64;
            for (t, &n) in a.by_tier.iter().enumerate() {
                by[t] += n as u64;
                series[slot].1[t] += n as u64;
            }
        }
        let rate = |n: u64, of: u64| if of == 0 { 0.0 } else { n as f64 / of as f64 };
        let mut groups: Vec<(String, Vec<f64>, f64, f64)> = ["device", "host", "disk", "shared", "miss"]
            .iter()
            .map(|n| (n.to_string(), Vec::new(), 0.0, 0.0))
            .collect();
        for t in &d.traces {
            let (Some(split), Some(End::Completed), Some(first)) = (&t.cached_by_tier, &t.end, t.first_token_us) else {
                continue;
            };
            let g = &mut groups[source(split).map_or(4, SimTier::index)];
            g.1.push(first.saturating_sub(t.arrival_us) as f64 / 1e3);
            g.2 += split.iter().sum::<usize>() as f64 / t.input_tokens.max(1) as f64;
            g.3 += t.tier_load_us as f64 / 1e3;
        }
        let ttft_by_source = groups
            .into_iter()
            .filter(|g| !g.1.is_empty())
            .map(|(name, mut ttft, share, load)| {
                ttft.sort_by(f64::total_cmp);
                let n = ttft.len() as f64;
                SourceLatency {
                    source: name,
                    requests: ttft.len() as u64,
                    hit_share: share / n,
                    ttft_ms: Percentiles::of(&ttft),
                    load_ms_mean: load / n,
                }
            })
            .collect();
        let tt = &run.totals;
        Some(Self {
            ttl_s: c.tiers.ttl_ms as f64 / 1e3,
            device_kv_gib: c.device_kv_bytes.map(|b| b / GIB),
            host_gib_per_node: c.tiers.host_bytes / GIB,
            disk_gib_per_node: c.tiers.disk_bytes / GIB,
            shared_gib: c.tiers.shared_bytes / GIB,
            block_mib: run.block_bytes / (1u64 << 20) as f64,
            hit_rate: rate(by.iter().sum(), prompt),
            hit_rate_by_tier: PerTier::from_fn(|t| rate(by[t.index()], prompt)),
            ideal_hit_rate: run.ideal_hit_rate,
            loaded_blocks: PerTier::from_fn(|t| tt.loaded_blocks[t.index()]),
            loaded_gib: PerTier::from_fn(|t| tt.loaded_bytes[t.index()] / GIB),
            written_blocks: PerTier::from_fn(|t| tt.written_blocks[t.index()]),
            dropped_writes: PerTier::from_fn(|t| tt.dropped_writes[t.index()]),
            evicted_blocks: PerTier::from_fn(|t| tt.stats[t.index()].evicted_blocks),
            expired_blocks: PerTier::from_fn(|t| tt.stats[t.index()].expired_blocks),
            used_gib_at_end: PerTier::from_fn(|t| tt.used_bytes[t.index()] / GIB),
            preloaded_blocks: tt.preloaded_blocks,
            ttft_by_source,
            series: series
                .into_iter()
                .enumerate()
                .map(|(i, (p, by))| TierPoint {
                    t_s: i as f64 * slot_s,
                    prompt_tokens: p,
                    hit_rate: PerTier::from_fn(|t| rate(by[t.index()], p)),
                })
                .collect(),
        })
    }

    pub fn to_markdown(&self) -> String {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let mut md = format!(
            "\n## Prompt cache tiers\n\nTTL {:.0} s, blocks of {:.1} MiB{}; hit rate **{}** of prompt tokens (an unbounded cache without TTLs: {}).\n\n",
            self.ttl_s,
            self.block_mib,
            self.device_kv_gib.map_or(String::new(), |g| format!(", device KV capped at {g:.1} GiB per device")),
            pct(self.hit_rate),
            pct(self.ideal_hit_rate)
        );
        if self.preloaded_blocks > 0 {
            md += &format!(
                "Histories of conversations under way before the run: {} blocks in the shared store.\n\n",
                self.preloaded_blocks
            );
        }
        md += "| tier | capacity | hit rate | loaded blocks (GiB) | written | writes dropped | evicted | expired |\n|---|---|---|---|---|---|---|---|\n";
        let gib = |x: f64| if x < 10.0 { format!("{x:.1} GiB") } else { format!("{x:.0} GiB") };
        for t in SimTier::ALL {
            let cap = match t {
                SimTier::Device => "KV pool".to_string(),
                SimTier::Host => format!("{}/node", gib(self.host_gib_per_node)),
                SimTier::Disk => format!("{}/node", gib(self.disk_gib_per_node)),
                SimTier::Shared => gib(self.shared_gib),
            };
            md += &format!(
                "| {} | {cap} | {} | {} ({:.1}) | {} | {} | {} | {} |\n",
                t.name(),
                pct(*self.hit_rate_by_tier.get(t)),
                self.loaded_blocks.get(t),
                self.loaded_gib.get(t),
                self.written_blocks.get(t),
                self.dropped_writes.get(t),
                self.evicted_blocks.get(t),
                self.expired_blocks.get(t)
            );
        }
        md += "\n| prefix mostly from | requests | cached share | TTFT ms p50 / p99 | lower-tier reads, ms (mean) |\n|---|---|---|---|---|\n";
        for g in &self.ttft_by_source {
            md += &format!(
                "| {} | {} | {} | {:.0} / {:.0} | {:.1} |\n",
                g.source,
                g.requests,
                pct(g.hit_share),
                g.ttft_ms.p50,
                g.ttft_ms.p99,
                g.load_ms_mean
            );
        }
        md
    }

    /// Hit rate per tier over time, as lines for [`super::plots::line_chart`].
    pub fn lines(&self) -> Vec<Line<'static>> {
        let colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"];
        let mut lines: Vec<Line<'static>> = SimTier::ALL
            .iter()
            .zip(colours)
            .map(|(&t, c)| (t.name(), c, self.series.iter().map(|p| (p.t_s, p.hit_rate.get(t) * 100.0)).collect()))
            .collect();
        let total = self
            .series
            .iter()
            .map(|p| (p.t_s, SimTier::ALL.iter().map(|&t| p.hit_rate.get(t)).sum::<f64>() * 100.0))
            .collect();
        lines.push(("all tiers", "#222222", total));
        lines
    }
}
