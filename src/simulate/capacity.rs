//! Capacity search: the highest offered load a deployment sustains within
//! its SLOs. The scenario's traffic is scaled (rates multiplied, a trace's
//! time compressed) with the same seed, so every probe sees the same
//! requests arriving faster or slower; a probe doubles the load until it
//! breaks, halves it until it holds, then bisects (geometrically) between
//! the highest load that held and the lowest that broke.

use serde::Serialize;

use super::plots::line_chart;
use super::{run, Progress, Report};
use crate::scenario::{Scenario, Traffic};
use deepinfer_engine::traffic::Pattern;

/// Loads are searched within this factor of the file's, either way.
pub const LOAD_FACTOR_MAX: f64 = 64.0;
/// Bisection steps after the load is bracketed: the bracket ends 2^(1/2^steps)
/// wide in ratio (6 steps: about 1%).
pub const STEPS_DEFAULT: u32 = 6;
pub const STEPS_MAX: u32 = 12;
/// A probe with KV use this close to the budget names KV as the limit.
const KV_FULL: f64 = 0.95;

/// When a load counts as sustained.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Criteria {
    /// Least share of requests within both SLOs (TTFT and TPOT), over
    /// those whose outcome is known (`Report::slo_attainment_judged`).
    pub slo_attainment_min: f64,
}

impl Default for Criteria {
    fn default() -> Self {
        Self { slo_attainment_min: 0.9 }
    }
}

/// One simulated load.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Probe {
    /// Multiple of the scenario's own arrival rate.
    pub load_factor: f64,
    pub offered_req_s: f64,
    pub input_tok_s_per_prefill_gpu: f64,
    pub output_tok_s_per_decode_gpu: f64,
    pub input_tok_s_per_prefill_node: f64,
    pub output_tok_s_per_decode_node: f64,
    /// The whole deployment's input and output tokens/s.
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub ttft_p90_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p90_ms: f64,
    pub slo_attainment: f64,
    pub kv_use_max: f64,
    pub sustained: bool,
    /// What broke, when it did not hold.
    pub broke: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Capacity {
    pub scenario: String,
    pub seed: u64,
    pub devices: u32,
    pub prefill_devices: u32,
    pub decode_devices: u32,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    pub criteria: Criteria,
    /// In the order they ran.
    pub probes: Vec<Probe>,
    /// The highest load that held; `None` if none did down to 1/64 of the file's.
    pub capacity: Option<Probe>,
    /// What broke first above it (`None` if nothing broke up to 64× the file's load).
    pub limit: Option<String>,
}

/// `s` with its arrivals `factor` times as frequent (same seed, same requests).
pub fn scaled_load(s: &Scenario, factor: f64) -> Scenario {
    assert!(factor.is_finite() && factor > 0.0, "a load factor is positive");
    let traffic = match &s.traffic {
        Traffic::Synthetic { pattern, input, output, shared_prefix_tokens, shared_fraction } => {
            let pattern = match *pattern {
                Pattern::Poisson { rate_per_s } => Pattern::Poisson { rate_per_s: rate_per_s * factor },
                Pattern::Bursty { rate_per_s, burst_factor, on_s, off_s } => {
                    Pattern::Bursty { rate_per_s: rate_per_s * factor, burst_factor, on_s, off_s }
                }
            };
            Traffic::Synthetic {
                pattern,
                input: *input,
                output: *output,
                shared_prefix_tokens: *shared_prefix_tokens,
                shared_fraction: *shared_fraction,
            }
        }
        // A compressed trace is repeated more often, so that it still covers the window.
        Traffic::Mooncake { path, time_scale, repeat } => Traffic::Mooncake {
            path: path.clone(),
            time_scale: time_scale / factor,
            repeat: (*repeat as f64 * factor.max(1.0)).ceil().min(u32::MAX as f64) as u32,
        },
        Traffic::Sessions(x) => {
            Traffic::Sessions(crate::scenario::Sessions { rate_per_s: x.rate_per_s * factor, ..x.clone() })
        }
    };
    Scenario { traffic, ..s.clone() }
}

impl Probe {
    /// `load 2.000× (41.20 requests/s): held`, or what broke.
    pub fn summary(&self) -> String {
        let held = if self.sustained { "held".to_string() } else { format!("broke: {}", self.broke.join("; ")) };
        format!("load {:.3}× ({:.2} requests/s): {held}", self.load_factor, self.offered_req_s)
    }
}

fn probe(s: &Scenario, factor: f64, r: &Report, criteria: Criteria) -> Probe {
    let c = &r.requests;
    let mut broke = Vec::new();
    if c.failed + c.refused + c.lost > 0 {
        let first = c.first_errors.first().map_or(String::new(), |e| format!(": {e}"));
        broke.push(format!("{} requests failed or refused{first}", c.failed + c.refused + c.lost));
    }
    if r.slo_attainment_judged < criteria.slo_attainment_min {
        let pct = r.slo_attainment_judged * 100.0;
        if r.slo_broken_ttft > 0 {
            let (n, p90, slo) = (r.slo_broken_ttft, r.ttft_ms.p90, r.slo_ttft_ms);
            broke.push(format!(
                "prefill: {n} requests over the TTFT SLO (p90 {p90:.0} ms vs {slo:.0} ms; {pct:.0}% within SLOs)"
            ));
        }
        if r.slo_broken_tpot > 0 {
            let (n, p90, slo) = (r.slo_broken_tpot, r.tpot_ms.p90, r.slo_tpot_ms);
            broke.push(format!(
                "decode: {n} requests over the TPOT SLO (p90 {p90:.1} ms vs {slo:.1} ms; {pct:.0}% within SLOs)"
            ));
        }
        if broke.is_empty() {
            broke.push(format!("{pct:.0}% of requests within SLOs"));
        }
    }
    let kv_use_max = r.instances.iter().map(|i| i.kv_use_max).fold(0.0, f64::max);
    if !broke.is_empty() && kv_use_max >= KV_FULL {
        let full: Vec<&str> = r.instances.iter().filter(|i| i.kv_use_max >= KV_FULL).map(|i| i.role.as_str()).collect();
        broke.insert(0, format!("KV capacity ({} instance at {:.0}%)", full.join(", "), kv_use_max * 100.0));
    }
    Probe {
        load_factor: factor,
        offered_req_s: c.submitted as f64 / s.duration_s,
        input_tok_s_per_prefill_gpu: r.input_tok_s_per_prefill_gpu,
        output_tok_s_per_decode_gpu: r.output_tok_s_per_decode_gpu,
        input_tok_s_per_prefill_node: r.input_tok_s_per_prefill_node,
        output_tok_s_per_decode_node: r.output_tok_s_per_decode_node,
        input_tok_s: r.input_tok_s,
        output_tok_s: r.output_tok_s,
        ttft_p90_ms: r.ttft_ms.p90,
        tpot_p50_ms: r.tpot_ms.p50,
        tpot_p90_ms: r.tpot_ms.p90,
        slo_attainment: r.slo_attainment_judged,
        kv_use_max,
        sustained: broke.is_empty(),
        broke,
    }
}

/// Search the highest sustained load of `s`; `on_probe` sees each probe as it ends.
pub fn find_capacity(
    s: &Scenario,
    seed: Option<u64>,
    criteria: Criteria,
    steps: u32,
    on_probe: impl FnMut(&Probe),
) -> anyhow::Result<Capacity> {
    find_capacity_with(s, seed, criteria, steps, &Progress::Off, on_probe)
}

/// [`find_capacity`], each probe's run showing `progress` (lines labelled with its load).
pub fn find_capacity_with(
    s: &Scenario,
    seed: Option<u64>,
    criteria: Criteria,
    steps: u32,
    progress: &Progress,
    mut on_probe: impl FnMut(&Probe),
) -> anyhow::Result<Capacity> {
    anyhow::ensure!(
        criteria.slo_attainment_min > 0.0 && criteria.slo_attainment_min <= 1.0,
        "the SLO attainment to sustain is a share in (0, 1]"
    );
    anyhow::ensure!(steps <= STEPS_MAX, "at most {STEPS_MAX} bisection steps");
    let mut probes: Vec<Probe> = Vec::new();
    let mut first: Option<Report> = None;
    let mut at = |factor: f64, probes: &mut Vec<Probe>| -> anyhow::Result<bool> {
        let v = scaled_load(s, factor);
        let r = run(&v, seed, progress.relabelled(|l| format!("{l}, load {factor:.3}×")))?;
        let p = probe(&v, factor, &r, criteria);
        on_probe(&p);
        let held = p.sustained;
        probes.push(p);
        first.get_or_insert(r);
        Ok(held)
    };
    // Bracket: `low` held (or 0), `high` broke (or nothing did).
    let (mut low, mut high): (Option<f64>, Option<f64>) = (None, None);
    if at(1.0, &mut probes)? {
        low = Some(1.0);
        let mut f = 2.0;
        while f <= LOAD_FACTOR_MAX {
            if !at(f, &mut probes)? {
                high = Some(f);
                break;
            }
            low = Some(f);
            f *= 2.0;
        }
    } else {
        high = Some(1.0);
        let mut f = 0.5;
        while f >= 1.0 / LOAD_FACTOR_MAX {
            if at(f, &mut probes)? {
                low = Some(f);
                break;
            }
            high = Some(f);
            f /= 2.0;
        }
    }
    if let (Some(mut lo), Some(mut hi)) = (low, high) {
        for _ in 0..steps {
            let mid = (lo * hi).sqrt();
            if at(mid, &mut probes)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
    }
    let best = |want: bool| probes.iter().filter(move |p| p.sustained == want);
    let capacity = best(true).max_by(|a, b| a.load_factor.total_cmp(&b.load_factor)).cloned();
    let above = capacity.as_ref().map_or(0.0, |c| c.load_factor);
    let limit = best(false)
        .filter(|p| p.load_factor > above)
        .min_by(|a, b| a.load_factor.total_cmp(&b.load_factor))
        .map(|p| p.broke.join("; "));
    let r = first.expect("at least one probe ran");
    Ok(Capacity {
        scenario: s.name.clone(),
        seed: r.seed,
        devices: r.devices,
        prefill_devices: r.prefill_devices,
        decode_devices: r.decode_devices,
        slo_ttft_ms: r.slo_ttft_ms,
        slo_tpot_ms: r.slo_tpot_ms,
        criteria,
        probes,
        capacity,
        limit,
    })
}

impl Capacity {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a capacity search serialises") + "\n"
    }

    pub fn to_markdown(&self) -> String {
        let mut md = format!(
            "# Capacity: {}\n\nSeed {}; {} devices ({} prefilling, {} decoding). Sustained: no request failed or \
             refused, and at least {:.0}% of requests within TTFT ≤ {:.0} ms and TPOT ≤ {:.1} ms (a request still \
             running at the end counts once it has broken one).\n\n",
            self.scenario,
            self.seed,
            self.devices,
            self.prefill_devices,
            self.decode_devices,
            self.criteria.slo_attainment_min * 100.0,
            self.slo_ttft_ms,
            self.slo_tpot_ms
        );
        match &self.capacity {
            Some(c) => {
                md += &format!(
                    "**Capacity: {:.3}× the file's load, {:.2} requests/s.** Input {:.0} tok/s per prefill GPU \
                     ({:.0} per node), output {:.0} tok/s per decode GPU ({:.0} per node).\n\n",
                    c.load_factor,
                    c.offered_req_s,
                    c.input_tok_s_per_prefill_gpu,
                    c.input_tok_s_per_prefill_node,
                    c.output_tok_s_per_decode_gpu,
                    c.output_tok_s_per_decode_node
                );
            }
            None => md += "**No load held**, down to 1/64 of the file's.\n\n",
        }
        match &self.limit {
            Some(l) => md += &format!("Limit above it: {l}.\n\n"),
            None => md += "Nothing broke up to 64× the file's load.\n\n",
        }
        md += "| load × | requests/s | input tok/s per prefill GPU | output tok/s per decode GPU | TTFT p90 ms | \
               TPOT p90 ms | within SLOs | KV use max | held |\n|---|---|---|---|---|---|---|---|---|\n";
        let mut sorted = self.probes.clone();
        sorted.sort_by(|a, b| a.load_factor.total_cmp(&b.load_factor));
        for p in &sorted {
            md += &format!(
                "| {:.3} | {:.2} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1}% | {:.0}% | {} |\n",
                p.load_factor,
                p.offered_req_s,
                p.input_tok_s_per_prefill_gpu,
                p.output_tok_s_per_decode_gpu,
                p.ttft_p90_ms,
                p.tpot_p90_ms,
                p.slo_attainment * 100.0,
                p.kv_use_max * 100.0,
                if p.sustained { "yes".to_string() } else { format!("no: {}", p.broke.join("; ")) }
            );
        }
        md
    }

    /// Output tokens/s per decode GPU against offered requests/s, probes
    /// that held and those that broke as two lines, the capacity marked.
    pub fn plot(&self) -> String {
        let mut sorted = self.probes.clone();
        sorted.sort_by(|a, b| a.offered_req_s.total_cmp(&b.offered_req_s));
        let points = |held: bool| -> Vec<(f64, f64)> {
            sorted
                .iter()
                .filter(|p| p.sustained == held)
                .map(|p| (p.offered_req_s, p.output_tok_s_per_decode_gpu))
                .collect()
        };
        let lines = [("held", "#2b7bba", points(true)), ("broke", "#d7301f", points(false))];
        let marks: Vec<(f64, String)> =
            self.capacity.iter().map(|c| (c.offered_req_s, format!("capacity {:.2} req/s", c.offered_req_s))).collect();
        let title = format!("Capacity search: {}", self.scenario);
        line_chart(&title, "offered requests/s", "output tok/s per decode GPU", &lines, &marks)
    }
}
