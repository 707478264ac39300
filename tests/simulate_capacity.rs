//! `deepinfer simulate --find-capacity`: the search is deterministic, more
//! GPUs never lower the capacity it finds, a load that held is below one
//! that broke, and the command writes its report and plot.

use std::path::Path;
use std::process::Command;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::capacity::{find_capacity, scaled_load, Criteria};
use deepinfer::simulate::{arrivals, run};

/// V4-Flash on H200, `devices` in colocated instances of one 8-GPU node
/// each (more GPUs are more replicas of the same instance), short enough to
/// run a few dozen times.
fn small_text(devices: u32) -> String {
    let instance = "\n[[instance]]\nrole = \"both\"\ndevices = 8\n";
    let instances = instance.repeat((devices / 8).max(1) as usize);
    format!(
        r#"
[scenario]
name = "capacity-{devices}"
seed = 5
duration_s = 20
drain_s = 30
hardware = "H200"
model = "V4-Flash"
devices_per_node = 8

{instances}
[engine]
batch_per_device = 32
batch_tokens_per_device = 4096
decode_steps_per_event = 4

[traffic]
kind = "poisson"
rate_per_s = 40
input = {{ dist = "lognormal", median = 1024, sigma = 0.6, min = 64, max = 8192 }}
output = {{ dist = "lognormal", median = 120, sigma = 0.5, min = 8, max = 600 }}

[slo]
ttft_ms = 1000
tpot_ms = 40
"#
    )
}

fn small(devices: u32) -> Scenario {
    Scenario::parse("capacity.toml", &small_text(devices), Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn a_scaled_load_is_the_same_requests_arriving_faster() {
    let s = small(8);
    let (one, two) = (arrivals(&s).unwrap(), arrivals(&scaled_load(&s, 2.0)).unwrap());
    assert!(two.len() > one.len(), "twice the rate, more requests in the window");
    for (a, b) in one.iter().zip(&two) {
        assert_eq!((a.input_tokens, a.output_tokens), (b.input_tokens, b.output_tokens));
        assert!(b.at_us.abs_diff(a.at_us / 2) <= 1, "{} vs {}", a.at_us, b.at_us);
    }
}

#[test]
fn the_search_is_deterministic_and_more_gpus_never_lower_capacity() {
    let criteria = Criteria::default();
    let steps = 3;
    let eight = find_capacity(&small(8), None, criteria, steps, |_| {}).unwrap();
    let again = find_capacity(&small(8), None, criteria, steps, |_| {}).unwrap();
    assert_eq!(eight.to_json(), again.to_json(), "same scenario and seed, same search");
    let sixteen = find_capacity(&small(16), None, criteria, steps, |_| {}).unwrap();
    println!("{}\n{}", eight.to_markdown(), sixteen.to_markdown());
    let (c8, c16) = (eight.capacity.as_ref().expect("8 GPUs hold some load"), sixteen.capacity.as_ref().unwrap());
    assert!(
        c16.offered_req_s >= c8.offered_req_s,
        "16 GPUs sustain {} req/s < 8 GPUs' {}",
        c16.offered_req_s,
        c8.offered_req_s
    );
    for c in [&eight, &sixteen] {
        assert!(c.limit.is_some(), "{}: the search found a load that broke", c.scenario);
        let held = c.probes.iter().filter(|p| p.sustained).map(|p| p.load_factor).fold(0.0, f64::max);
        let broke = c.probes.iter().filter(|p| !p.sustained).map(|p| p.load_factor).fold(f64::INFINITY, f64::min);
        assert!(held < broke, "{}: a load of {held} held above one of {broke} that broke", c.scenario);
        // The capacity is a real run's figures: running its load again gives them.
        let cap = c.capacity.as_ref().unwrap();
        let r = run(&scaled_load(&small(c.devices), cap.load_factor), None, false).unwrap();
        assert_eq!(r.output_tok_s_per_decode_gpu, cap.output_tok_s_per_decode_gpu);
        assert!(r.slo_attainment >= criteria.slo_attainment_min && r.requests.failed == 0);
    }
}

#[test]
fn the_command_writes_the_capacity_report_and_plot() {
    let dir = std::env::temp_dir().join(format!("deepinfer-capacity-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("small.toml");
    std::fs::write(&file, small_text(8)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["simulate", "--quiet", "--find-capacity", "--capacity-steps", "1", "--out"])
        .arg(dir.join("out"))
        .arg(&file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("# Capacity: "), "{stdout}");
    for f in ["capacity.json", "capacity.md", "capacity.svg"] {
        let text = std::fs::read_to_string(dir.join("out").join(f)).unwrap();
        assert!(text.len() > 200, "{f} is nearly empty");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["simulate", "--quiet", "--find-capacity", "--slo-attainment", "1.5"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("attainment"));
    let _ = std::fs::remove_dir_all(&dir);
}
