//! Hit rate against cache capacity: a scenario's `[cache]` tiers added one
//! at a time (device only, + host, + local disk, + shared store), each at
//! several multiples of the file's capacities (the device KV cap included),
//! with the TTFT each buys. Runs are independent simulations of the same
//! arrivals and seed, several at once.

use serde::Serialize;

use super::cache_report::PerTier;
use super::plots::line_chart;
use super::report::Percentiles;
use super::{run, Report};
use crate::scenario::{CacheConfig, Scenario};

const GIB: f64 = (1u64 << 30) as f64;

/// The tiers of each configuration, in order.
pub const CONFIGS: [(&str, [bool; 3]); 4] = [
    ("device only", [false, false, false]),
    ("+ host", [true, false, false]),
    ("+ disk", [true, true, false]),
    ("+ shared disk", [true, true, true]),
];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepRow {
    pub config: String,
    pub scale: f64,
    /// Device KV of every instance plus host and disk of every node plus the shared store.
    pub capacity_gib: f64,
    pub hit_rate: f64,
    pub hit_rate_by_tier: PerTier<f64>,
    pub ttft_ms: Percentiles,
    pub completed: u64,
    pub submitted: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sweep {
    pub scenario: String,
    pub seed: u64,
    pub ideal_hit_rate: f64,
    pub rows: Vec<SweepRow>,
}

/// `s` with configuration `tiers` (host, disk, shared on or off) at `scale`.
pub fn variant(s: &Scenario, c: &CacheConfig, tiers: [bool; 3], scale: f64) -> Scenario {
    let mut c = c.scaled(scale);
    let [host, disk, shared] = tiers;
    if !host {
        c.tiers.host_bytes = 0.0;
    }
    if !disk {
        c.tiers.disk_bytes = 0.0;
    }
    if !shared {
        c.tiers.shared_bytes = 0.0;
    }
    Scenario { cache: Some(c), ..s.clone() }
}

fn row(config: &str, scale: f64, s: &Scenario, r: &Report) -> SweepRow {
    let c = s.cache.as_ref().expect("a variant has a cache");
    let device: f64 = r.instances.iter().map(|i| i.kv_budget_gib).sum();
    let nodes = s.nodes() as f64;
    let capacity_gib = device + (c.tiers.host_bytes + c.tiers.disk_bytes) * nodes / GIB + c.tiers.shared_bytes / GIB;
    let cache = r.cache.as_ref();
    SweepRow {
        config: config.to_string(),
        scale,
        capacity_gib,
        hit_rate: cache.map_or(0.0, |x| x.hit_rate),
        hit_rate_by_tier: cache.map(|x| x.hit_rate_by_tier.clone()).unwrap_or_default(),
        ttft_ms: r.ttft_ms.clone(),
        completed: r.requests.completed,
        submitted: r.requests.submitted,
    }
}

/// Run every configuration at every scale (`threads` at a time).
pub fn cache_sweep(s: &Scenario, scales: &[f64], seed: Option<u64>, threads: usize) -> anyhow::Result<Sweep> {
    let Some(c) = &s.cache else {
        anyhow::bail!("{}: a cache sweep needs a [cache] table", s.file);
    };
    // A configuration that adds a tier the file does not size would repeat the one before.
    let sized = [c.tiers.host_bytes, c.tiers.disk_bytes, c.tiers.shared_bytes].map(|b| b >= 1.0);
    let configs: Vec<(&str, [bool; 3])> = CONFIGS
        .iter()
        .enumerate()
        .filter(|(i, _)| *i == 0 || sized[i - 1])
        .map(|(_, &(name, tiers))| (name, tiers))
        .collect();
    let jobs: Vec<(&str, [bool; 3], f64)> =
        configs.iter().flat_map(|&(name, tiers)| scales.iter().map(move |&x| (name, tiers, x))).collect();
    let mut results: Vec<Option<anyhow::Result<SweepRow>>> = (0..jobs.len()).map(|_| None).collect();
    for chunk in (0..jobs.len()).collect::<Vec<_>>().chunks(threads.max(1)) {
        let done: Vec<(usize, anyhow::Result<SweepRow>)> = std::thread::scope(|scope| {
            let handles: Vec<_> = chunk
                .iter()
                .map(|&i| {
                    let (name, tiers, scale) = jobs[i];
                    let v = variant(s, c, tiers, scale);
                    scope.spawn(move || (i, run(&v, seed, false).map(|r| row(name, scale, &v, &r))))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a sweep run panicked")).collect()
        });
        for (i, r) in done {
            results[i] = Some(r);
        }
    }
    let rows = results.into_iter().map(|r| r.expect("every job ran")).collect::<anyhow::Result<Vec<_>>>()?;
    let arrivals = super::arrivals(s)?;
    Ok(Sweep {
        scenario: s.name.clone(),
        seed: seed.unwrap_or(s.seed),
        ideal_hit_rate: super::sessions::ideal_hit_rate(&arrivals, &super::earlier_blocks(s)),
        rows,
    })
}

impl Sweep {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a sweep serialises") + "\n"
    }

    pub fn to_markdown(&self) -> String {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let mut md = format!(
            "# Cache capacity sweep: {}\n\nSeed {}; an unbounded cache without TTLs would serve {} of prompt tokens.\n\n\
             | tiers | scale | capacity GiB | hit rate | device / host / disk / shared | TTFT ms p50 / p99 | completed |\n\
             |---|---|---|---|---|---|---|\n",
            self.scenario,
            self.seed,
            pct(self.ideal_hit_rate)
        );
        for r in &self.rows {
            let h = &r.hit_rate_by_tier;
            md += &format!(
                "| {} | {} | {:.0} | {} | {} / {} / {} / {} | {:.0} / {:.0} | {} of {} |\n",
                r.config,
                r.scale,
                r.capacity_gib,
                pct(r.hit_rate),
                pct(h.device),
                pct(h.host),
                pct(h.disk),
                pct(h.shared),
                r.ttft_ms.p50,
                r.ttft_ms.p99,
                r.completed,
                r.submitted
            );
        }
        md += "\nPlots: `cache_sweep.svg` (hit rate), `cache_sweep_ttft.svg` (TTFT p50 and p99).\n";
        md
    }

    fn lines(&self, y: impl Fn(&SweepRow) -> f64) -> Vec<(String, Vec<(f64, f64)>)> {
        CONFIGS
            .iter()
            .map(|(name, _)| {
                let pts = self.rows.iter().filter(|r| r.config == *name).map(|r| (r.capacity_gib, y(r)));
                (name.to_string(), pts.collect())
            })
            .collect()
    }

    /// `cache_sweep.svg` and `cache_sweep_ttft.svg`.
    pub fn plots(&self) -> (String, String) {
        let colours = ["#7f7f7f", "#ff7f0e", "#2ca02c", "#9467bd"];
        let hit = self.lines(|r| r.hit_rate * 100.0);
        let hit: Vec<_> = hit.iter().zip(colours).map(|((n, p), c)| (n.as_str(), c, p.clone())).collect();
        let hit_svg = line_chart(
            &format!("{}: prompt-cache hit rate vs capacity", self.scenario),
            "cache capacity, all tiers (GiB)",
            "hit rate (% of prompt tokens)",
            &hit,
            &[],
        );
        let (p50, p99) = (self.lines(|r| r.ttft_ms.p50), self.lines(|r| r.ttft_ms.p99));
        let names: Vec<(String, String)> =
            CONFIGS.iter().map(|(n, _)| (format!("{n} p50"), format!("{n} p99"))).collect();
        let mut ttft = Vec::new();
        for (i, c) in colours.iter().enumerate() {
            ttft.push((names[i].0.as_str(), *c, p50[i].1.clone()));
            ttft.push((names[i].1.as_str(), *c, p99[i].1.clone()));
        }
        let ttft_svg = line_chart(
            &format!("{}: TTFT vs cache capacity", self.scenario),
            "cache capacity, all tiers (GiB)",
            "TTFT (ms)",
            &ttft,
            &[],
        );
        (hit_svg, ttft_svg)
    }
}
