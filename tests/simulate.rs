//! `deepinfer simulate`: scenarios run from a seed are reproducible byte for
//! byte, keep their invariants across seeds, survive a fault drill without
//! losing a request, reproduce DeepSeek's published V3/R1 per-node figures,
//! and refuse bad scenario files with the file, line and key.

mod scenario_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::{run, Report};
use scenario_support::assert_refused_with_place;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scenario(name: &str) -> Scenario {
    Scenario::from_file(&repo().join("simulations").join(name)).unwrap()
}

fn simulate_cli(file: &Path, out: &Path, seed: Option<u64>) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deepinfer"));
    cmd.arg("simulate").arg(file).arg("--quiet").arg("--out").arg(out);
    if let Some(seed) = seed {
        cmd.args(["--seed", &seed.to_string()]);
    }
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::read_to_string(out.join("report.json")).unwrap()
}

fn check_invariants(r: &Report, what: &str) {
    let c = &r.requests;
    assert_eq!(c.lost, 0, "{what}: lost requests");
    assert_eq!(c.token_mismatches, 0, "{what}: {:?}", c.first_errors);
    assert_eq!(c.completed + c.failed + c.refused + c.unfinished, c.submitted, "{what}");
    assert!(c.submitted > 0, "{what}: no traffic");
    for (i, x) in r.instances.iter().enumerate() {
        assert!(x.kv_use_max <= 1.0, "{what}: instance {i} KV over its budget ({})", x.kv_use_max);
    }
}

#[test]
fn the_same_scenario_and_seed_give_a_byte_identical_report() {
    let dir = std::env::temp_dir().join(format!("deepinfer-sim-{}", std::process::id()));
    let file = repo().join("simulations/fault-drill.toml");
    let a = simulate_cli(&file, &dir.join("a"), None);
    let b = simulate_cli(&file, &dir.join("b"), None);
    assert_eq!(a, b, "two runs of one seed differ");
    let c = simulate_cli(&file, &dir.join("c"), Some(99));
    assert_ne!(a, c, "another seed gives the same run");
    for f in ["report.md", "throughput.svg", "latency_cdf.svg", "tpot_cdf.svg", "expert_load.svg"] {
        let text = std::fs::read_to_string(dir.join("a").join(f)).unwrap();
        assert!(text.len() > 200, "{f} is nearly empty");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A small disaggregated deployment with skewed experts, shared prefixes and
/// a device crash, over many seeds: nothing lost, tokens conserved, memory
/// within capacity.
#[test]
fn a_seed_sweep_keeps_the_invariants() {
    let text = r#"
[scenario]
name = "sweep"
duration_s = 20
drain_s = 60
hardware = "H200"
model = "V4-Flash"

[[instance]]
role = "prefill"
devices = 8

[[instance]]
role = "decode"
devices = 8

[[instance]]
role = "both"
devices = 8

[engine]
batch_per_device = 32
batch_tokens_per_device = 4096
decode_steps_per_event = 4

[experts]
popularity = "zipf"
zipf_s = 1.0
redundant = 8

[traffic]
kind = "bursty"
rate_per_s = 8
burst_factor = 3
on_s = 4
off_s = 4
input = { dist = "lognormal", median = 1500, sigma = 1.0, min = 16, max = 16384 }
output = { dist = "uniform", min = 1, max = 300 }
shared_prefix_tokens = 1024
shared_fraction = 0.5

[[fault]]
kind = "crash"
device = 9
at_s = 7
"#;
    let s = Scenario::parse("sweep.toml", text, Path::new(".")).unwrap();
    for seed in 0..8 {
        let r = run(&s, Some(seed), false).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        check_invariants(&r, &format!("seed {seed}"));
        assert_eq!(r.requests.failed, 0, "seed {seed}: {:?}", r.requests.first_errors);
        assert!(r.handovers > 0, "seed {seed}: nothing went through the prefill instance");
        assert!(r.actor_restarts >= 2, "seed {seed}: the crash restarted nothing");
    }
}

#[test]
fn the_fault_drill_shows_the_crash_and_the_recovery_and_loses_nothing() {
    let s = scenario("fault-drill.toml");
    let r = run(&s, None, false).unwrap();
    check_invariants(&r, "drill");
    assert_eq!(r.requests.failed, 0, "{:?}", r.requests.first_errors);
    assert_eq!(r.requests.unfinished, 0);
    assert!(r.actor_restarts >= 3, "{} restarts", r.actor_restarts);
    assert!(r.faults.iter().any(|(t, what)| *t == 60.0 && what.contains("node3 down")), "{:?}", r.faults);
    // Output per second: before the crash, while node 3 is away, after it is back.
    let mean = |from: f64, to: f64| {
        let pts: Vec<f64> = r.series.iter().filter(|p| p.t_s >= from && p.t_s < to).map(|p| p.output_tok_s).collect();
        pts.iter().sum::<f64>() / pts.len().max(1) as f64
    };
    let (before, during, after) = (mean(40.0, 60.0), mean(64.0, 88.0), mean(110.0, 150.0));
    // Node 3 holds half of instance 1, which stalls; instance 0 takes the new requests.
    assert!(during < 0.9 * before, "no dip while node 3 is down: {before:.0} → {during:.0}");
    assert!(after > 0.8 * before, "no recovery: {before:.0} → {after:.0}");
}

/// DeepSeek's V3/R1 inference system overview: about 73.7k input tokens/s
/// per prefill node (cache hits included) and 14.8k output tokens/s per
/// decode node. The scenario offers the published daily traffic mix per node;
/// the deployment must carry it within 15%.
#[test]
fn the_v3_h800_reproduction_lands_near_the_published_per_node_figures() {
    let mut s = scenario("v3-h800-deepseek.toml");
    // A shorter window than the shipped file keeps the test quick. Decode
    // runs near its capacity at this load (as DeepSeek's 20–22 tokens/s per
    // user say theirs does), so it fills slowly: a minute of warm-up.
    s.duration_s = 120.0;
    s.warmup_s = 60.0;
    s.drain_s = 0.0;
    s.sample_s = 1.0;
    let r = run(&s, None, false).unwrap();
    assert_eq!(r.requests.lost, 0);
    let within = |got: f64, want: f64| (got / want - 1.0).abs() <= 0.15;
    assert!(
        within(r.input_tok_s_per_prefill_node, 73_700.0),
        "input per prefill node {:.0}",
        r.input_tok_s_per_prefill_node
    );
    assert!(
        within(r.output_tok_s_per_decode_node, 14_800.0),
        "output per decode node {:.0}",
        r.output_tok_s_per_decode_node
    );
    assert!((0.45..0.65).contains(&r.prefix_hit_rate), "hit rate {:.3}", r.prefix_hit_rate);
}

#[test]
fn a_mooncake_trace_replays_with_prefix_hits() {
    let s = scenario("mooncake-replay.toml");
    let deepinfer::scenario::Traffic::Mooncake { path, .. } = &s.traffic else { panic!("not a trace replay") };
    if !path.exists() {
        eprintln!("skipped: {} is not here", path.display());
        return;
    }
    let s = Scenario { duration_s: 240.0, warmup_s: 0.0, drain_s: 120.0, ..s };
    let r = run(&s, None, false).unwrap();
    check_invariants(&r, "mooncake");
    assert_eq!(r.requests.completed, r.requests.submitted);
    // What an unbounded prefix cache would hit, from the trace's hash ids alone.
    let (mut seen, mut hit, mut total) = (std::collections::BTreeSet::new(), 0usize, 0usize);
    for a in deepinfer::simulate::arrivals(&s).unwrap() {
        let shared = a.prefix_blocks.iter().take_while(|b| seen.contains(*b)).count();
        hit += (shared * 512).min(a.input_tokens);
        total += a.input_tokens;
        seen.extend(a.prefix_blocks.iter().copied());
    }
    let ideal = hit as f64 / total as f64;
    assert!(ideal > 0.05, "the trace shares prefixes ({ideal:.3})");
    assert!((r.prefix_hit_rate - ideal).abs() < 0.03, "hit rate {:.3}, trace allows {ideal:.3}", r.prefix_hit_rate);
}

#[test]
fn every_shipped_scenario_parses() {
    for entry in std::fs::read_dir(repo().join("simulations")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            Scenario::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

#[test]
fn bad_scenarios_name_the_file_line_and_key() {
    let good = std::fs::read_to_string(repo().join("simulations/fault-drill.toml")).unwrap();
    let cases = [
        ("rate_per_s = 30", "rate_per_s = 30\nrate = 4", "traffic.rate", "unknown field"),
        ("devices = 16", "devices = \"sixteen\"", "instance.devices", "invalid type"),
        ("hardware = \"H200\"", "hardware = \"H900\"", "scenario.hardware", "unknown hardware"),
        ("node = 3", "node = 30", "fault.node", "nodes"),
        ("devices = 16", "devices = 12", "instance.devices", "multiple of devices_per_node"),
    ];
    assert_refused_with_place("drill.toml", &good, &cases);
}

#[test]
fn expert_drift_and_rebalancing_have_defaults_and_errors_that_name_the_key() {
    let good = std::fs::read_to_string(repo().join("simulations/fault-drill.toml")).unwrap();
    // Without the keys: static loads, DeepSeek's 10-minute period.
    let s = Scenario::parse("drill.toml", &good, Path::new(".")).unwrap();
    assert_eq!((s.expert_drift_s, s.expert_drift_share, s.rebalance_s), (0.0, 0.1, 600.0));
    let with = good.replacen("[traffic]", "[experts]\ndrift_s = 900\nrebalance_s = 0\n\n[traffic]", 1);
    let s = Scenario::parse("drill.toml", &with, Path::new(".")).unwrap();
    assert_eq!((s.expert_drift_s, s.expert_drift_share, s.rebalance_s), (900.0, 0.1, 0.0));
    let experts = "[experts]\ndrift_s = 900\ndrift_share = 0.3\nrebalance_s = 60\n\n[traffic]";
    let good = good.replacen("[traffic]", experts, 1);
    let cases = [
        ("drift_s = 900", "drift_s = 5", "experts.drift_s", "must be 0 or 10 to 86400 seconds"),
        ("drift_s = 900", "drift_s = -1", "experts.drift_s", "must be 0 or 10"),
        ("drift_share = 0.3", "drift_share = 1.5", "experts.drift_share", "must be in [0, 1]"),
        ("rebalance_s = 60", "rebalance_s = 0.5", "experts.rebalance_s", "must be 0 or 1 to 86400 seconds"),
        ("rebalance_s = 60", "rebalance_s = 1e9", "experts.rebalance_s", "must be 0 or 1"),
        ("rebalance_s = 60", "rebalance_s = \"often\"", "experts.rebalance_s", "invalid type"),
    ];
    assert_refused_with_place("drill.toml", &good, &cases);
}
