//! What a simulation reports: throughput per GPU and per node, latency
//! percentiles, goodput under the SLOs, prefix hit rate, expert balance, KV
//! use, and the requests that completed, failed or were lost — as JSON, as a
//! Markdown table and (see [`super::plots`]) as plots.

use deepinfer_actors::modelled::drafting::DraftTotals;
use deepinfer_engine::speculative::policy::{expected_tokens, DraftPolicy};
use serde::Serialize;

use super::balance_report::BalanceReport;
use super::cache_report::CacheReport;
use super::encoder_report::EncoderReport;
use super::handoff_report::HandoffReport;
use super::{End, RunData};
use crate::scenario::{InstanceKind, Scenario};

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles of sorted values.
    pub(crate) fn of(sorted: &[f64]) -> Self {
        if sorted.is_empty() {
            return Self::default();
        }
        let at = |p: f64| sorted[((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        Self { p50: at(0.5), p90: at(0.9), p99: at(0.99), mean: sorted.iter().sum::<f64>() / sorted.len() as f64 }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InstanceReport {
    pub role: String,
    pub devices: u32,
    pub kv_budget_gib: f64,
    pub kv_use_max: f64,
    pub kv_use_mean: f64,
    /// Max over mean expert load per device (1.0 is perfect balance).
    pub expert_imbalance: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SeriesPoint {
    pub t_s: f64,
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub completed: u64,
    pub failed: u64,
    pub kv_use_max: f64,
    /// With image traffic: images arriving per second, and the longest any
    /// request arriving in the slice waited for its images' rows, ms.
    #[serde(skip_serializing_if = "is_zero")]
    pub images_s: f64,
    #[serde(skip_serializing_if = "is_zero")]
    pub images_ready_max_ms: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Report {
    pub scenario: String,
    pub seed: u64,
    pub hardware: String,
    pub model: String,
    pub devices: u32,
    pub nodes: u32,
    /// GPUs of one node: every `*_per_*_node` figure is the per-GPU one times this.
    pub devices_per_node: u32,
    /// GPUs of the instances that prefill (prefill and colocated ones): the
    /// `*_per_prefill_*` figures divide by them…
    pub prefill_devices: u32,
    /// …and of those that decode (decode and colocated ones), which the
    /// `*_per_decode_*` figures divide by.
    pub decode_devices: u32,
    pub duration_s: f64,
    /// Throughput is measured over `[warmup_s, duration_s)`.
    pub warmup_s: f64,
    pub simulated_s: f64,
    pub requests: Counts,
    /// Over the measured window: prompt tokens whose first token came out (cache hits included), per second.
    pub input_tok_s: f64,
    pub output_tok_s: f64,
    pub input_tok_s_per_prefill_gpu: f64,
    pub input_tok_s_per_prefill_node: f64,
    pub output_tok_s_per_decode_gpu: f64,
    pub output_tok_s_per_decode_node: f64,
    /// Output tokens decode steps produced over the whole run (all but each
    /// request's first). 0 when no decode step ran (every request asked for
    /// one token): the per-decode figures then count first tokens only, and
    /// report.md leaves them out.
    pub decode_tokens: u64,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    /// Completed requests within both SLOs, per second of the arrival window.
    pub goodput_req_s: f64,
    pub slo_attainment: f64,
    /// Share within both SLOs of every request whose outcome is known: a
    /// request still running when the run ends counts once it must break
    /// one (no first token yet past the TTFT SLO, or its last token, still to
    /// come, already too late for the TPOT SLO); failed and refused ones
    /// count as broken; 1 when no outcome is known.
    pub slo_attainment_judged: f64,
    /// Requests still running at the end that had broken no SLO yet.
    pub slo_undetermined: u64,
    /// Completed or running requests that broke the TTFT SLO, and the TPOT
    /// SLO (one may break both).
    pub slo_broken_ttft: u64,
    pub slo_broken_tpot: u64,
    pub prefix_hit_rate: f64,
    pub instances: Vec<InstanceReport>,
    pub faults: Vec<(f64, String)>,
    pub series: Vec<SeriesPoint>,
    pub steps: u64,
    /// Lines of the event log: what the simulation processed.
    pub events: u64,
    pub actor_restarts: u64,
    /// Sequences a worker computed again from position 0 (it had lost their
    /// state, or held it at another position): 0 without faults.
    pub sequences_rebuilt: u64,
    pub handovers: u64,
    /// Reroutes, recomputes and the backlog of the prefill → decode handoffs.
    pub handoffs: HandoffReport,
    /// Speculative decoding, when on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeReport>,
    /// The cache tiers below the device, when configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheReport>,
    /// Expert balance as the steps met it (modelled devices).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expert_balance: Option<BalanceReport>,
    /// The image encoders, when the traffic has images.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub encoders: Option<EncoderReport>,
    /// Digest of the run's event log: equal for equal runs.
    pub event_digest: String,
    /// Sorted latencies, for the CDF plots.
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
    #[serde(skip)]
    pub tpot_sorted_ms: Vec<f64>,
    /// `[layer][device]` expert load shares of the first decoding instance, for the heatmap.
    #[serde(skip)]
    pub expert_heatmap: Vec<Vec<f64>>,
}

/// What speculative decoding did, over the whole run (decoding request-steps
/// of every instance).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SpeculativeReport {
    pub method: String,
    /// `fixed` or `adaptive`.
    pub draft_length: String,
    pub num_draft_tokens: usize,
    /// The acceptance model: mean probability that draft i is accepted given
    /// draft i − 1 was; its spread and the draft head's estimation noise.
    pub acceptance: Vec<f64>,
    pub acceptance_spread: f64,
    pub confidence_noise: f64,
    /// Tokens per verification: accepted drafts plus the target's own.
    pub acceptance_length: f64,
    /// What the model's means imply for the lengths verified; the adaptive
    /// policy beats it by skipping drafts the head doubts.
    pub acceptance_length_model: f64,
    /// Share of verified drafts the target rejected.
    pub wasted_verification: f64,
    /// Drafts verified per decoding request-step (steps without drafts included).
    pub drafts_per_step: f64,
    pub drafts_per_verification: f64,
    /// Tokens each decoding request-step produced.
    pub tokens_per_step: f64,
    pub decode_steps: u64,
    pub verifications: u64,
    pub proposed_drafts: u64,
    pub verified_drafts: u64,
    pub accepted_drafts: u64,
}

impl SpeculativeReport {
    fn new(s: &Scenario, t: &DraftTotals) -> Option<Self> {
        let d = s.speculative.as_ref()?;
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let most = d.config.max_drafts();
        let means: Vec<f64> = (0..most).map(|j| d.acceptance.mean(j)).collect();
        let implied: f64 =
            t.by_length.iter().enumerate().skip(1).map(|(k, &n)| n as f64 * expected_tokens(&means, k.min(most))).sum();
        let plain_steps = t.decode_steps - t.verifications;
        Some(Self {
            method: d.config.method.to_string(),
            draft_length: match d.config.policy {
                DraftPolicy::Adaptive { .. } => "adaptive".into(),
                _ => "fixed".into(),
            },
            num_draft_tokens: most,
            acceptance: d.acceptance.acceptance.clone(),
            acceptance_spread: d.acceptance.spread,
            confidence_noise: d.acceptance.confidence_noise,
            acceptance_length: ratio(t.verification_tokens, t.verifications),
            acceptance_length_model: if t.verifications == 0 { 0.0 } else { implied / t.verifications as f64 },
            wasted_verification: ratio(t.verified - t.accepted, t.verified),
            drafts_per_step: ratio(t.verified, t.decode_steps),
            drafts_per_verification: ratio(t.verified, t.verifications),
            tokens_per_step: ratio(t.verification_tokens + plain_steps, t.decode_steps),
            decode_steps: t.decode_steps,
            verifications: t.verifications,
            proposed_drafts: t.proposed,
            verified_drafts: t.verified,
            accepted_drafts: t.accepted,
        })
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub submitted: u64,
    pub completed: u64,
    /// Ended with an error by the cluster (it says why).
    pub failed: u64,
    pub refused: u64,
    /// Still running when the drain time ran out.
    pub unfinished: u64,
    /// Neither completed, failed, refused nor running: must be 0.
    pub lost: u64,
    /// Completed with a different number of tokens than asked for: must be 0.
    pub token_mismatches: u64,
    pub first_errors: Vec<String>,
}

/// What the SLOs say of every request, running ones included.
#[derive(Default)]
struct Judged {
    good: u64,
    bad: u64,
    /// Still running at the end without having broken an SLO.
    open: u64,
    broke_ttft: u64,
    broke_tpot: u64,
}

fn judge_slos(s: &Scenario, d: &RunData) -> Judged {
    let end_us = (d.simulated_s * 1e6) as u64;
    let (ttft_us, tpot_us) = (s.ttft_slo_ms * 1e3, s.tpot_slo_ms * 1e3);
    let mut j = Judged::default();
    for t in &d.traces {
        // For a request still running, the end of the run bounds what is
        // still to come: its first token (if none yet) and its last token
        // come no earlier, so these are lower bounds on its final TTFT and TPOT.
        let waited_us = t.first_token_us.unwrap_or(end_us).saturating_sub(t.arrival_us);
        let ttft_ok = waited_us as f64 <= ttft_us;
        let tpot_ok = match (t.first_token_us, &t.end) {
            (Some(f), Some(End::Completed)) if t.tokens > 1 => {
                t.last_token_us.saturating_sub(f) as f64 / (t.tokens - 1) as f64 <= tpot_us
            }
            (Some(f), None) if t.output_wanted > 1 => {
                end_us.saturating_sub(f) as f64 / (t.output_wanted - 1) as f64 <= tpot_us
            }
            _ => true,
        };
        // A failed or refused request is broken whatever its timing said so far.
        let timed = matches!(t.end, None | Some(End::Completed));
        j.broke_ttft += u64::from(timed && !ttft_ok);
        j.broke_tpot += u64::from(timed && !tpot_ok);
        match (&t.end, ttft_ok && tpot_ok) {
            (Some(End::Completed), true) => j.good += 1,
            (None, true) => j.open += 1,
            _ => j.bad += 1,
        }
    }
    j
}

impl Report {
    pub fn new(s: &Scenario, d: &RunData) -> Self {
        let window_s = s.duration_s;
        let sample_s = s.sample_s;
        // Throughput over whole buckets inside [warmup, duration).
        let first = (s.warmup_s / sample_s).ceil() as usize;
        let last = ((s.duration_s / sample_s).floor() as usize).max(first + 1);
        let measured_s = (last - first) as f64 * sample_s;
        let in_window = |i: usize| (first..last).contains(&i);
        let input: u64 = d.buckets.iter().enumerate().filter(|(i, _)| in_window(*i)).map(|(_, b)| b.input_tokens).sum();
        let output: u64 =
            d.buckets.iter().enumerate().filter(|(i, _)| in_window(*i)).map(|(_, b)| b.output_tokens).sum();
        let devices_of = |want: fn(InstanceKind) -> bool| -> u32 {
            s.instances.iter().filter(|(r, _)| want(*r)).map(|&(_, n)| n).sum()
        };
        let prefill = devices_of(|r| r != InstanceKind::Decode);
        let decode = devices_of(|r| r != InstanceKind::Prefill);
        let per_node = s.devices_per_node as f64;
        let (input_tok_s, output_tok_s) = (input as f64 / measured_s, output as f64 / measured_s);

        let mut counts = Counts { submitted: d.traces.len() as u64, ..Counts::default() };
        let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
        let (mut good, mut prompt_tokens, mut cached_tokens) = (0u64, 0u64, 0u64);
        for t in &d.traces {
            let ttft_ms = t.first_token_us.map(|f| (f.saturating_sub(t.arrival_us)) as f64 / 1e3);
            let tpot_ms = match t.first_token_us {
                Some(f) if t.tokens > 1 => {
                    Some((t.last_token_us.saturating_sub(f)) as f64 / 1e3 / (t.tokens - 1) as f64)
                }
                _ => None,
            };
            match &t.end {
                Some(End::Completed) => {
                    counts.completed += 1;
                    if t.tokens != t.output_wanted {
                        counts.token_mismatches += 1;
                        if counts.first_errors.len() < 5 {
                            counts.first_errors.push(format!(
                                "a request arriving at {} us completed with {} of {} tokens",
                                t.arrival_us, t.tokens, t.output_wanted
                            ));
                        }
                    }
                    prompt_tokens += t.input_tokens as u64;
                    cached_tokens += t.cached_tokens as u64;
                    ttft.extend(ttft_ms);
                    tpot.extend(tpot_ms);
                    let ok = ttft_ms.is_some_and(|x| x <= s.ttft_slo_ms) && tpot_ms.is_none_or(|x| x <= s.tpot_slo_ms);
                    if ok && t.arrival_us < (window_s * 1e6) as u64 {
                        good += 1;
                    }
                }
                Some(End::Failed(why)) => {
                    counts.failed += 1;
                    if counts.first_errors.len() < 5 {
                        counts.first_errors.push(why.clone());
                    }
                }
                Some(End::Refused(why)) => {
                    counts.refused += 1;
                    if counts.first_errors.len() < 5 {
                        counts.first_errors.push(why.clone());
                    }
                }
                None => counts.unfinished += 1,
            }
        }
        let judged = judge_slos(s, d);
        counts.lost = counts.submitted - counts.completed - counts.failed - counts.refused - counts.unfinished;
        ttft.sort_by(f64::total_cmp);
        tpot.sort_by(f64::total_cmp);
        let instances = s
            .instances
            .iter()
            .enumerate()
            .map(|(i, &(role, devices))| InstanceReport {
                role: format!("{role:?}").to_lowercase(),
                devices,
                kv_budget_gib: d.kv_budget_gib.get(i).copied().unwrap_or(0.0),
                kv_use_max: d.kv_use.get(i).map_or(0.0, |k| k.0),
                kv_use_mean: d.kv_use.get(i).map_or(0.0, |k| k.1),
                expert_imbalance: d.expert_imbalance.get(i).copied().unwrap_or(1.0),
            })
            .collect();
        let heat = s.instances.iter().position(|(r, _)| *r != InstanceKind::Prefill).unwrap_or(0);
        let series = d
            .buckets
            .iter()
            .enumerate()
            .map(|(i, b)| SeriesPoint {
                t_s: i as f64 * sample_s,
                input_tok_s: b.input_tokens as f64 / sample_s,
                output_tok_s: b.output_tokens as f64 / sample_s,
                completed: b.completed,
                failed: b.failed,
                kv_use_max: b.kv_use_max,
                images_s: b.images as f64 / sample_s,
                images_ready_max_ms: b.images_ready_max_us as f64 / 1e3,
            })
            .collect();
        Self {
            scenario: s.name.clone(),
            seed: s.seed,
            hardware: s.hardware.name().to_string(),
            model: s.model.cost().name.to_string(),
            devices: s.devices(),
            nodes: s.nodes(),
            devices_per_node: s.devices_per_node,
            prefill_devices: prefill,
            decode_devices: decode,
            duration_s: s.duration_s,
            warmup_s: s.warmup_s,
            simulated_s: d.simulated_s,
            requests: counts,
            input_tok_s,
            output_tok_s,
            input_tok_s_per_prefill_gpu: input_tok_s / prefill.max(1) as f64,
            input_tok_s_per_prefill_node: input_tok_s / prefill.max(1) as f64 * per_node,
            output_tok_s_per_decode_gpu: output_tok_s / decode.max(1) as f64,
            output_tok_s_per_decode_node: output_tok_s / decode.max(1) as f64 * per_node,
            decode_tokens: d.traces.iter().map(|t| t.tokens.saturating_sub(1) as u64).sum(),
            ttft_ms: Percentiles::of(&ttft),
            tpot_ms: Percentiles::of(&tpot),
            slo_ttft_ms: s.ttft_slo_ms,
            slo_tpot_ms: s.tpot_slo_ms,
            goodput_req_s: good as f64 / window_s,
            slo_attainment: if ttft.is_empty() { 0.0 } else { good as f64 / ttft.len() as f64 },
            // Nothing known to have broken an SLO is within them.
            slo_attainment_judged: if judged.good + judged.bad == 0 {
                1.0
            } else {
                judged.good as f64 / (judged.good + judged.bad) as f64
            },
            slo_undetermined: judged.open,
            slo_broken_ttft: judged.broke_ttft,
            slo_broken_tpot: judged.broke_tpot,
            prefix_hit_rate: if prompt_tokens == 0 { 0.0 } else { cached_tokens as f64 / prompt_tokens as f64 },
            instances,
            faults: d.faults.clone(),
            series,
            steps: d.steps,
            events: d.events,
            actor_restarts: d.restarts,
            sequences_rebuilt: d.rebuilt,
            handovers: d.handovers,
            handoffs: d.handoffs.clone(),
            speculative: d.drafts.as_ref().and_then(|t| SpeculativeReport::new(s, t)),
            cache: CacheReport::new(s, d),
            expert_balance: BalanceReport::new(s, d),
            encoders: EncoderReport::new(d),
            event_digest: format!("{:016x}", d.digest),
            ttft_sorted_ms: ttft,
            tpot_sorted_ms: tpot,
            expert_heatmap: d.expert_shares.get(heat).cloned().unwrap_or_default(),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a report serialises") + "\n"
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::simulate::Trace;

    fn scenario() -> Scenario {
        let text = r#"
[scenario]
name = "judge"
duration_s = 10
hardware = "H200"
model = "V4-Flash"
devices_per_node = 8

[[instance]]
role = "both"
devices = 8

[traffic]
kind = "poisson"
rate_per_s = 1
input = { dist = "uniform", min = 64, max = 64 }
output = { dist = "uniform", min = 8, max = 8 }

[slo]
ttft_ms = 1000
tpot_ms = 50
"#;
        Scenario::parse("judge.toml", text, Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn trace(arrival_ms: u64, first_ms: Option<u64>, last_ms: u64, tokens: usize, end: Option<End>) -> Trace {
        Trace {
            arrival_us: arrival_ms * 1000,
            input_tokens: 64,
            output_wanted: 8,
            first_token_us: first_ms.map(|f| f * 1000),
            last_token_us: last_ms * 1000,
            tokens: if end == Some(End::Completed) { 8 } else { tokens },
            end,
            ..Trace::default()
        }
    }

    #[test]
    fn requests_still_running_count_once_they_broke_an_slo() {
        let s = scenario();
        let traces = vec![
            trace(0, Some(200), 550, 8, Some(End::Completed)),   // within both
            trace(0, Some(1500), 1850, 8, Some(End::Completed)), // TTFT broken
            trace(9_000, None, 0, 0, None),                      // waiting 3 s at the end: TTFT broken
            trace(11_500, None, 0, 0, None),                     // waiting 0.5 s: not known yet
            trace(5_000, Some(5_100), 5_700, 4, None),           // 8 tokens cannot end by 12 s at 50 ms each
            trace(2_000, Some(2_100), 2_100, 1, None),           // stalled after its first token: TPOT broken
            trace(11_800, Some(11_900), 11_950, 2, None),        // on pace so far: not known yet
            trace(1_000, None, 0, 0, Some(End::Failed("lost its worker".into()))),
        ];
        let d = RunData { traces, simulated_s: 12.0, ..RunData::default() };
        let r = Report::new(&s, &d);
        assert_eq!((r.slo_broken_ttft, r.slo_broken_tpot, r.slo_undetermined), (2, 2, 2));
        assert_eq!(r.slo_attainment_judged, 1.0 / 6.0, "one good of six known");
        assert_eq!(r.slo_attainment, 0.5, "completed ones only: one of two");
    }

    #[test]
    fn the_output_row_says_what_it_divides_by_and_drops_per_decode_figures_without_decode() {
        let s = scenario();
        let decoding =
            RunData { traces: vec![trace(0, Some(200), 550, 8, Some(End::Completed))], ..RunData::default() };
        let md = Report::new(&s, &decoding).to_markdown();
        assert!(md.contains("per decode GPU (of the 8 that decode)"), "{md}");
        assert!(md.contains("per decode node (8 GPUs)") && md.contains("per prefill node (8 GPUs)"), "{md}");
        let first_only = Trace { output_wanted: 1, ..trace(0, Some(200), 200, 1, Some(End::Completed)) };
        let first_only = Trace { tokens: 1, ..first_only };
        let r = Report::new(&s, &RunData { traces: vec![first_only], ..RunData::default() });
        assert_eq!(r.decode_tokens, 0);
        let md = r.to_markdown();
        assert!(!md.contains("per decode GPU ("), "{md}");
        assert!(md.contains("no decode step ran"), "{md}");
    }
}
