//! What `deepinfer simulate` shows besides its numbers: the time series is
//! smooth when tokens arrive in bursts, `--progress` writes plain lines to
//! a log (one run, a capacity search), and a run without decode says so
//! instead of dividing by decode GPUs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use deepinfer::scenario::Scenario;
use deepinfer::simulate::run;

/// V4-Flash on one colocated 8-H200 node, decode steps simulated 32 at a
/// time (tokens arrive in bursts), a steady load that keeps decoding.
fn steady(sample_s: f64, output: &str) -> String {
    steady_on(sample_s, output, "[[instance]]\nrole = \"both\"\ndevices = 8\n")
}

fn steady_on(sample_s: f64, output: &str, instances: &str) -> String {
    format!(
        r#"
[scenario]
name = "steady"
seed = 3
duration_s = 24
drain_s = 30
warmup_s = 6
hardware = "H200"
model = "V4-Flash"
devices_per_node = 8
sample_s = {sample_s}

{instances}
[engine]
decode_steps_per_event = 32

[traffic]
kind = "poisson"
rate_per_s = 20
input = {{ dist = "uniform", min = 256, max = 1024 }}
output = {output}
"#
    )
}

const DECODING: &str = r#"{ dist = "uniform", min = 150, max = 300 }"#;

fn scenario(text: &str) -> Scenario {
    Scenario::parse("steady.toml", text, Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn bursts_of_tokens_are_spread_over_the_buckets_they_took() {
    // Buckets far shorter than a 32-step decode event: counted where they
    // arrive, the bursts leave empty buckets between full ones. A decode
    // instance of its own, so that prefill steps do not slow decoding (a
    // real dip, which the series should show).
    let disaggregated =
        "[[instance]]\nrole = \"prefill\"\ndevices = 8\n\n[[instance]]\nrole = \"decode\"\ndevices = 8\n";
    let s = scenario(&steady_on(0.05, DECODING, disaggregated));
    let r = run(&s, None, false).unwrap();
    // The measurement window's buckets, as the report takes them.
    let (first, last) = ((s.warmup_s / s.sample_s).ceil() as usize, (s.duration_s / s.sample_s).floor() as usize);
    let window: Vec<f64> = r.series[first..last].iter().map(|p| p.output_tok_s).collect();
    assert!(window.len() > 300, "{} buckets", window.len());
    let zeros = window.iter().filter(|&&x| x == 0.0).count();
    assert_eq!(zeros, 0, "{zeros} empty output buckets of {} while decoding: {window:?}", window.len());
    let mut sorted = window.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let (low, high) = (sorted[0], sorted[sorted.len() - 1]);
    assert!(
        high <= 3.0 * median && low >= median / 3.0,
        "output tok/s from {low} to {high}, median {median}: {window:?}"
    );
    // Spreading moves tokens within the run, it does not make or lose any.
    let total: f64 = r.series.iter().map(|p| p.output_tok_s * s.sample_s).sum();
    assert_eq!(r.requests.completed, r.requests.submitted, "{:?}", r.requests);
    let produced = r.decode_tokens + r.requests.completed;
    assert!((total - produced as f64).abs() < 0.5, "series {total} vs {produced} tokens");
    // The window's throughput is the series' mean over it.
    let mean = window.iter().sum::<f64>() / window.len() as f64;
    assert!((mean - r.output_tok_s).abs() <= 1e-6 * r.output_tok_s, "{mean} vs {}", r.output_tok_s);
}

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("deepinfer-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn simulate(file: &Path, args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_deepinfer")).arg("simulate").arg(file).args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

/// `(simulated s done, total, submitted, running)` of each progress line starting with `label`.
fn progress_lines(stderr: &str, label: &str) -> Vec<(f64, f64, u64, u64)> {
    stderr
        .lines()
        .filter_map(|l| l.strip_prefix(label)?.strip_prefix(": "))
        .map(|l| {
            let words: Vec<&str> = l.split([' ', ',', '/']).filter(|w| !w.is_empty()).collect();
            // "12/54 simulated s, 300 requests submitted, 20 running, 0.4 s of wall time"
            let num = |i: usize| words[i].parse::<f64>().unwrap_or_else(|e| panic!("{l}: word {i}: {e}"));
            assert_eq!(&words[2..4], ["simulated", "s"], "{l}");
            assert_eq!(&words[5..7], ["requests", "submitted"], "{l}");
            assert_eq!(words[8], "running", "{l}");
            assert_eq!(&words[10..], ["s", "of", "wall", "time"], "{l}");
            (num(0), num(1), num(4) as u64, num(7) as u64)
        })
        .collect()
}

#[test]
fn progress_prints_plain_lines_when_stderr_is_a_log() {
    let dir = Dir::new("progress");
    let file = dir.0.join("steady.toml");
    std::fs::write(&file, steady(0.2, DECODING)).unwrap();
    // Captured stderr is not a terminal: no bar, and without --progress no lines.
    let silent = simulate(&file, &[]);
    let stderr = String::from_utf8_lossy(&silent.stderr);
    assert!(progress_lines(&stderr, "progress").is_empty(), "{stderr}");

    // A line at every sample (no wall time between them required), and one at the end.
    let o = simulate(&file, &["--progress", "--progress-every", "0"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines = progress_lines(&stderr, "progress");
    assert!(lines.len() > 100, "{} lines: {stderr}", lines.len());
    for w in lines.windows(2) {
        assert!(w[0].0 <= w[1].0 && w[0].2 <= w[1].2, "going back: {w:?}");
    }
    let (first, last) = (lines[0], lines[lines.len() - 1]);
    assert_eq!((first.0, first.1), (0.0, 54.0), "{stderr}");
    assert!(lines.iter().any(|l| l.3 > 0), "nothing ever running: {stderr}");
    let report = String::from_utf8_lossy(&o.stdout);
    let submitted = report.split("| requests | ").nth(1).and_then(|r| r.split(' ').next()).unwrap();
    assert_eq!(last.2.to_string(), submitted, "the last line counts every request");
    assert_eq!(last.3, 0, "all done at the end: {stderr}");
    // The default spacing (5 s of wall time) prints far fewer.
    let o = simulate(&file, &["--progress"]);
    let few = progress_lines(&String::from_utf8_lossy(&o.stderr), "progress").len();
    assert!((2..lines.len()).contains(&few), "{few} lines at 5 s against {} at 0", lines.len());
}

#[test]
fn a_capacity_search_with_progress_says_how_each_probe_runs_and_ends() {
    let dir = Dir::new("progress-capacity");
    let file = dir.0.join("steady.toml");
    std::fs::write(&file, steady(0.5, DECODING).replace("duration_s = 24", "duration_s = 8")).unwrap();
    let o = simulate(&file, &["--find-capacity", "--capacity-steps", "0", "--progress", "--progress-every", "0"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let probes: Vec<&str> = stderr.lines().filter(|l| l.starts_with("load ") && l.contains("requests/s): ")).collect();
    assert!(probes.len() >= 2, "{stderr}");
    let first = progress_lines(&stderr, "progress, load 1.000×");
    assert!(first.len() > 10, "{stderr}");
    assert!(probes[0].starts_with("load 1.000× ("), "{stderr}");
}

#[test]
fn a_run_without_decode_gives_no_per_decode_gpu_figure() {
    let one = r#"{ dist = "fixed", value = 1 }"#;
    let r = run(&scenario(&steady(0.5, one)), None, false).unwrap();
    assert_eq!(r.decode_tokens, 0);
    assert!(r.output_tok_s > 0.0);
    let md = r.to_markdown();
    let row = md.lines().find(|l| l.starts_with("| output tok/s |")).unwrap();
    assert!(!row.contains("per decode GPU (") && row.contains("no decode step ran"), "{row}");
    let decoding = run(&scenario(&steady(0.5, DECODING)), None, false).unwrap().to_markdown();
    let row = decoding.lines().find(|l| l.starts_with("| output tok/s |")).unwrap();
    assert!(row.contains("per decode GPU (of the 8 that decode)") && row.contains("per decode node (8 GPUs)"), "{row}");
}

/// DeepSeek-V3 on H800 in one colocated instance of `devices`, a few requests.
fn v3(devices: u32) -> Scenario {
    let text = format!(
        r#"
[scenario]
name = "v3-fit"
duration_s = 2
drain_s = 10
hardware = "H800"
model = "DeepSeek-V3"

[[instance]]
role = "both"
devices = {devices}

[traffic]
kind = "poisson"
rate_per_s = 2
input = {{ dist = "fixed", value = 128 }}
output = {{ dist = "fixed", value = 4 }}
"#
    );
    Scenario::parse("v3-fit.toml", &text, Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn weights_that_do_not_fit_are_refused_with_the_reserve_and_what_would_fit() {
    let e = run(&v3(8), None, false).expect_err("V3 does not fit on 8 H800").to_string();
    for needle in ["v3-fit.toml: ", "instance 0 (8 H800 devices)", "10% of the", "reserved for activations"] {
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
    let fits: u32 = e
        .split(" devices per instance:")
        .next()
        .and_then(|x| x.rsplit('(').next())
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("no instance size in: {e}"));
    assert!(fits > 8 && fits.is_multiple_of(8), "{e}");
    let r = run(&v3(fits), None, false).unwrap_or_else(|e| panic!("{fits} devices were said to fit: {e}"));
    assert!(r.requests.completed > 0);
    if fits > 16 {
        assert!(run(&v3(fits - 8), None, false).is_err(), "{} devices fit too", fits - 8);
    }
}
