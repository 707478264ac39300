//! `deepinfer plan`: every layout of the GPUs is searched, deterministically;
//! costs follow from the capacities by the stated formula; the frontier is
//! the set no other layout dominates; the command writes its files and
//! names what it refuses.

use std::path::Path;
use std::process::Command;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::capacity::Criteria;
use deepinfer::simulate::plan::{deployed, layouts, plan, CacheTiers, KvDtype, Plan, PlanSpace, Search};
use deepinfer_engine::cost::KvFormat;

/// V4-Flash on H200, one prefill and one decode node, short runs near its capacity.
const SMALL: &str = r#"
[scenario]
name = "plan-small"
seed = 5
duration_s = 6
drain_s = 10
hardware = "H200"
model = "V4-Flash"
devices_per_node = 8

[[instance]]
role = "prefill"
devices = 8

[[instance]]
role = "decode"
devices = 8

[engine]
batch_per_device = 32
batch_tokens_per_device = 4096
decode_steps_per_event = 4

[traffic]
kind = "poisson"
rate_per_s = 150
input = { dist = "lognormal", median = 1024, sigma = 0.6, min = 64, max = 8192 }
output = { dist = "lognormal", median = 120, sigma = 0.5, min = 8, max = 600 }

[slo]
ttft_ms = 1000
tpot_ms = 40
"#;

fn small() -> Scenario {
    Scenario::parse("plan.toml", SMALL, Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

fn space() -> PlanSpace {
    PlanSpace {
        gpus: 24,
        prefill_sizes: vec![8],
        decode_sizes: vec![8, 16],
        colocated_sizes: vec![],
        redundant: vec![0],
        cache_tiers: vec![],
        kv_dtypes: vec![],
        encoders: vec![],
    }
}

fn planned() -> Plan {
    let search = Search { seed: None, criteria: Criteria::default(), steps: 1, threads: 2, progress_every_s: None };
    plan(&small(), &space(), 2.0, search, |_| ()).expect("plans")
}

#[test]
fn every_split_of_the_gpus_is_a_layout() {
    let labels: Vec<String> = layouts(&small(), &space()).unwrap().into_iter().map(|(l, _)| l.label).collect();
    assert_eq!(labels, ["1×P8 + 2×D8, 0 redundant", "2×P8 + 1×D8, 0 redundant", "1×P8 + 1×D16, 0 redundant"]);
    let odd = PlanSpace { gpus: 20, ..space() };
    assert!(layouts(&small(), &odd).unwrap_err().to_string().contains("multiple of 8"));
    let many = PlanSpace { gpus: 1024, decode_sizes: vec![8, 16, 32], redundant: vec![0, 8, 16], ..space() };
    assert!(layouts(&small(), &many).unwrap_err().to_string().contains("at most"));
}

#[test]
fn a_plan_is_deterministic_priced_by_its_capacities_and_its_frontier_is_undominated() {
    let p = planned();
    assert_eq!(p.to_json(), planned().to_json(), "same seed, same plan");
    assert_eq!(p.candidates.len(), 3);
    for c in &p.candidates {
        let cap = c.capacity.as_ref().unwrap_or_else(|| panic!("{} held some load: {:?}", c.layout.label, c.limit));
        assert_eq!(c.layout.gpus, 24);
        // Each figure from the capacity run: throughput over all GPUs, cost as GPU-hours over tokens made.
        let total = cap.input_tok_s + cap.output_tok_s;
        assert!((c.tok_s_per_gpu - total / 24.0).abs() < 1e-6);
        assert!((c.tok_s_per_user - 1000.0 / cap.tpot_p50_ms).abs() < 1e-6);
        let usd = |gpus: u32, tok_s: f64| f64::from(gpus) * 2.0 / (tok_s * 3600.0 / 1e6);
        assert!((c.usd_per_million_tokens.unwrap() - usd(24, total)).abs() < 1e-9);
        assert!((c.usd_per_million_input.unwrap() - usd(c.layout.prefill_gpus, cap.input_tok_s)).abs() < 1e-9);
        assert!((c.usd_per_million_output.unwrap() - usd(c.layout.decode_gpus, cap.output_tok_s)).abs() < 1e-9);
    }
    let dominated = |a: &deepinfer::simulate::plan::Candidate| {
        p.candidates.iter().any(|b| {
            b.tok_s_per_user >= a.tok_s_per_user
                && b.tok_s_per_gpu >= a.tok_s_per_gpu
                && (b.tok_s_per_user > a.tok_s_per_user || b.tok_s_per_gpu > a.tok_s_per_gpu)
        })
    };
    assert!(p.candidates.iter().any(|c| c.on_frontier));
    for c in &p.candidates {
        assert_eq!(c.on_frontier, !dominated(c), "{}", c.layout.label);
    }
    // The layouts differ: the split matters to capacity.
    let best = p.candidates.iter().map(|c| c.tok_s_per_gpu).fold(0.0, f64::max);
    let worst = p.candidates.iter().map(|c| c.tok_s_per_gpu).fold(f64::MAX, f64::min);
    assert!(best > 1.1 * worst, "{best} vs {worst}");
}

#[test]
fn the_command_writes_its_files_and_refuses_what_cannot_be_laid_out() {
    let dir = std::env::temp_dir().join(format!("deepinfer-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plan.toml");
    std::fs::write(&file, SMALL).unwrap();
    let bin = env!("CARGO_BIN_EXE_deepinfer");
    let args = ["plan", file.to_str().unwrap(), "--gpus", "16", "--capacity-steps", "0", "--out"];
    let o = Command::new(bin).args(args).arg(dir.join("out")).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = String::from_utf8_lossy(&o.stdout);
    assert!(md.contains("1×P8 + 1×D8, 0 redundant") && md.contains("$/M output"), "{md}");
    for f in ["plan.json", "plan.md", "plan.svg"] {
        assert!(dir.join("out").join(f).exists(), "{f}");
    }
    assert!(std::fs::read_to_string(dir.join("out/plan.svg")).unwrap().contains("<circle"));
    let o = Command::new(bin).args(["plan", file.to_str().unwrap(), "--gpus", "12"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--gpus must be a positive multiple of 8"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Cache tiers are a dimension of the search: each layout once per choice,
/// each deployed with the tiers it keeps of those the file configures.
#[test]
fn cache_tiers_are_searched_as_layouts_keep_them() {
    let with_cache = format!("{SMALL}\n[cache]\nhost_gib = 64\ndisk_gib = 500\nshared_gib = 1000\n");
    let s = Scenario::parse("plan.toml", &with_cache, Path::new(".")).unwrap_or_else(|e| panic!("{e}"));
    let choices = vec![CacheTiers::Device, CacheTiers::Host, CacheTiers::All];
    let space = PlanSpace { gpus: 16, decode_sizes: vec![8], cache_tiers: choices, ..space() };
    let found = layouts(&s, &space).unwrap();
    let labels: Vec<&str> = found.iter().map(|(l, _)| l.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "1×P8 + 1×D8, 0 redundant, cache: device",
            "1×P8 + 1×D8, 0 redundant, cache: device+host",
            "1×P8 + 1×D8, 0 redundant, cache: all tiers"
        ]
    );
    let tiers = |i: usize| {
        let (layout, instances) = &found[i];
        let c = deployed(&s, instances, layout).cache.expect("the file's cache stays");
        (c.tiers.host_bytes > 0.0, c.tiers.disk_bytes > 0.0, c.tiers.shared_bytes > 0.0)
    };
    assert_eq!(tiers(0), (false, false, false));
    assert_eq!(tiers(1), (true, false, false));
    assert_eq!(tiers(2), (true, true, true));
    // Without a [cache] table there is nothing to choose from.
    let err = layouts(&small(), &space).unwrap_err().to_string();
    assert!(err.contains("no [cache]"), "{err}");
}

/// The KV cache format is a dimension of the search like the cache tiers:
/// each layout once per format, deployed with it; a format the model has
/// no layout for is refused by name.
#[test]
fn kv_dtypes_are_searched_as_layouts_keep_them() {
    let s = small();
    let space = PlanSpace { gpus: 16, decode_sizes: vec![8], kv_dtypes: vec![KvDtype::Bf16, KvDtype::Fp8], ..space() };
    let found = layouts(&s, &space).unwrap();
    let labels: Vec<&str> = found.iter().map(|(l, _)| l.label.as_str()).collect();
    assert_eq!(labels, ["1×P8 + 1×D8, 0 redundant, KV bf16", "1×P8 + 1×D8, 0 redundant, KV fp8"]);
    let kv = |i: usize| deployed(&s, &found[i].1, &found[i].0).precision.kv;
    assert_eq!(kv(0), Some(KvFormat::Bf16));
    assert_eq!(kv(1), Some(KvFormat::Fp8));
    let fp4 = PlanSpace { kv_dtypes: vec![KvDtype::Fp4], ..space };
    let err = layouts(&s, &fp4).unwrap_err().to_string();
    assert!(err.contains("--kv-dtypes fp4") && err.contains("bf16 or fp8"), "{err}");
}
