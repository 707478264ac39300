//! `deepinfer simulate` with speculative decoding: a run with drafts is
//! reproducible, loses nothing and conserves tokens, its acceptance length is
//! what the acceptance model implies, cheap drafts shorten the time per
//! output token, and bad `[speculative]` tables name the file, line and key.

mod scenario_support;

use std::path::Path;
use std::process::Command;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::{run, Report};
use deepinfer_engine::speculative::policy::expected_tokens;
use scenario_support::assert_refused_with_place;

/// V4.1-Flash on 16 B200: an 8-device prefill instance hands requests to an
/// 8-device decode instance that runs 8 decode steps per event.
const DISAGGREGATED: &str = r#"
[scenario]
name = "spec-small"
seed = 11
duration_s = 12
drain_s = 60
hardware = "B200"
model = "V4.1-Flash"

[[instance]]
role = "prefill"
devices = 8

[[instance]]
role = "decode"
devices = 8

[engine]
batch_per_device = 64
batch_tokens_per_device = 8192
decode_steps_per_event = 8

[experts]
popularity = "zipf"
zipf_s = 0.6
redundant = 8

[traffic]
kind = "poisson"
rate_per_s = 6
input = { dist = "lognormal", median = 1500, sigma = 0.8, min = 32, max = 16384 }
output = { dist = "lognormal", median = 200, sigma = 0.8, min = 1, max = 1500 }
shared_prefix_tokens = 1024
shared_fraction = 0.5
"#;

fn parse(text: &str) -> Scenario {
    Scenario::parse("spec.toml", text, Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

fn with_speculative(base: &str, table: &str) -> Scenario {
    parse(&format!("{base}\n[speculative]\n{table}\n"))
}

fn check_invariants(r: &Report, what: &str) {
    let c = &r.requests;
    assert!(c.submitted > 20, "{what}: {} requests", c.submitted);
    assert_eq!(c.lost, 0, "{what}: lost requests");
    assert_eq!(c.token_mismatches, 0, "{what}: {:?}", c.first_errors);
    assert_eq!((c.failed, c.refused, c.unfinished), (0, 0, 0), "{what}: {:?}", c.first_errors);
    assert_eq!(c.completed, c.submitted, "{what}");
    // The workers' states stayed where the schedulers counted them.
    assert_eq!(r.sequences_rebuilt, 0, "{what}: sequences computed again");
}

#[test]
fn a_run_with_drafts_is_reproducible_and_conserves_every_token() {
    let s = with_speculative(DISAGGREGATED, "method = \"dspark\"\nnum_draft_tokens = 5\ndraft_length = \"adaptive\"");
    let a = run(&s, None, false).unwrap();
    let b = run(&s, None, false).unwrap();
    assert_eq!(a.to_json(), b.to_json(), "two runs of one seed differ");
    check_invariants(&a, "dspark");
    let x = a.speculative.as_ref().expect("the report shows speculative decoding");
    assert!(x.verifications > 1000, "{x:?}");
    assert!(x.accepted_drafts <= x.verified_drafts && x.verified_drafts <= 5 * x.verifications, "{x:?}");
    assert!((1.0..=6.0).contains(&x.acceptance_length), "{x:?}");
    // Every decoding step produced 1 + accepted tokens: their sum is the output less the first tokens.
    let output: u64 = a.series.iter().map(|p| (p.output_tok_s * s.sample_s).round() as u64).sum();
    let from_steps = x.decode_steps + x.accepted_drafts;
    assert_eq!(output, from_steps + a.requests.completed, "tokens from the steps and from the client");
    assert!(a.to_json().contains("\"wasted_verification\""));
    let md = a.to_markdown();
    assert!(md.contains("| acceptance length |"));
    // The goodput row names both shares, and the plots line every plot written.
    assert!(md.contains("% of completed, ") && md.contains("% of all judged"), "{md}");
    assert!(md.contains("`tpot_cdf.svg`"), "{md}");
    let c = run(&s, Some(12), false).unwrap();
    assert_ne!(a.event_digest, c.event_digest, "another seed gives the same run");
    check_invariants(&c, "dspark, seed 12");
}

#[test]
fn mtp_drafts_work_one_step_per_event_on_a_colocated_instance() {
    let base = DISAGGREGATED
        .replace("model = \"V4.1-Flash\"", "model = \"V4-Flash\"")
        .replace("role = \"prefill\"", "role = \"both\"")
        .replace("role = \"decode\"", "role = \"both\"")
        .replace("decode_steps_per_event = 8", "decode_steps_per_event = 1")
        .replace("duration_s = 12", "duration_s = 6");
    let s = with_speculative(&base, "method = \"mtp\"\nnum_draft_tokens = 3\ndraft_length = \"fixed\"");
    let r = run(&s, None, false).unwrap();
    check_invariants(&r, "mtp");
    let x = r.speculative.as_ref().unwrap();
    assert_eq!((x.method.as_str(), x.draft_length.as_str()), ("mtp", "fixed"));
    assert!(x.verifications > 300 && x.drafts_per_verification <= 3.0, "{x:?}");
    assert_eq!(run(&s, None, false).unwrap().to_json(), r.to_json());
}

/// With fixed lengths the head's estimates play no part, so the tokens per
/// verification must be what the acceptance model's means give, whatever
/// the spread of each draft's own probability.
#[test]
fn the_acceptance_length_is_what_the_acceptance_model_implies() {
    let acceptance = [0.9, 0.7, 0.5];
    let s = with_speculative(
        DISAGGREGATED,
        "method = \"dspark\"\nnum_draft_tokens = 3\ndraft_length = \"fixed\"\nacceptance = [0.9, 0.7, 0.5]",
    );
    let r = run(&s, None, false).unwrap();
    check_invariants(&r, "fixed");
    let x = r.speculative.as_ref().unwrap();
    assert!(x.verifications > 3000, "{x:?}");
    // Nearly every verification has all three drafts (block ends and the last tokens cut a few).
    assert!(x.drafts_per_verification > 2.9, "{x:?}");
    let model = expected_tokens(&acceptance, 3);
    assert!((x.acceptance_length_model - model).abs() < 0.03, "{x:?} vs {model}");
    let tolerance = 0.04 * x.acceptance_length_model;
    assert!(
        (x.acceptance_length - x.acceptance_length_model).abs() < tolerance,
        "measured {:.3}, model {:.3}",
        x.acceptance_length,
        x.acceptance_length_model
    );
    let accepted_share = 1.0 - x.wasted_verification;
    let want = (model - 1.0) / 3.0;
    assert!((accepted_share - want).abs() < 0.03, "accepted share {accepted_share:.3}, model {want:.3}");
}

/// At light load a decode step is bound by reading weights and KV, so
/// verifying a few more tokens per request costs little and every step
/// yields more than one token: the time per output token falls.
#[test]
fn cheap_drafts_shorten_the_time_per_output_token() {
    let off = parse(DISAGGREGATED);
    let on = with_speculative(DISAGGREGATED, "method = \"dspark\"");
    let (a, b) = (run(&off, None, false).unwrap(), run(&on, None, false).unwrap());
    check_invariants(&a, "off");
    check_invariants(&b, "dspark");
    assert!(a.speculative.is_none() && !a.to_json().contains("acceptance_length"));
    assert!(
        b.tpot_ms.p50 < 0.7 * a.tpot_ms.p50,
        "TPOT p50: off {:.2} ms, dspark {:.2} ms",
        a.tpot_ms.p50,
        b.tpot_ms.p50
    );
    assert!(b.tpot_ms.mean < a.tpot_ms.mean);
    // The same requests, so the same tokens in all.
    let total = |r: &Report| r.series.iter().map(|p| p.output_tok_s).sum::<f64>();
    assert!((total(&a) - total(&b)).abs() < 1e-6 * total(&a));
}

#[test]
fn bad_speculative_tables_name_the_file_line_and_key() {
    let good = format!("{DISAGGREGATED}\n[speculative]\nmethod = \"dspark\"\nnum_draft_tokens = 5\n");
    assert!(parse(&good).speculative.is_some());
    let cases = [
        ("method = \"dspark\"", "method = \"mtp\"", "speculative.method", "no mtp draft head"),
        ("method = \"dspark\"", "method = \"eagle\"", "speculative.method", "unknown speculative method"),
        ("num_draft_tokens = 5", "num_draft_tokens = 17", "speculative.num_draft_tokens", "1 to 16"),
        ("num_draft_tokens = 5", "draft_length = \"greedy\"", "speculative.draft_length", "fixed, adaptive"),
        ("num_draft_tokens = 5", "acceptance = [0.9, 1.5]", "speculative.acceptance", "in [0, 1]"),
        ("num_draft_tokens = 5", "acceptance_spread = 1.0", "speculative.acceptance_spread", "[0, 1)"),
        ("num_draft_tokens = 5", "drafts = 4", "speculative.drafts", "unknown field"),
    ];
    assert_refused_with_place("spec.toml", &good, &cases);
    // DSpark needs V4.1's draft layers.
    let text = good.replace("model = \"V4.1-Flash\"", "model = \"V4-Flash\"");
    let e = Scenario::parse("spec.toml", &text, Path::new(".")).unwrap_err();
    assert!(e.to_string().contains("V4-Flash has no dspark draft head"), "{e}");
}

#[test]
fn the_command_line_turns_drafting_on_and_off() {
    let dir = std::env::temp_dir().join(format!("deepinfer-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("small.toml");
    std::fs::write(&file, DISAGGREGATED.replace("duration_s = 12", "duration_s = 4")).unwrap();
    let simulate = |method: &str| {
        let out = dir.join(method);
        let o = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
            .arg("simulate")
            .arg(&file)
            .args(["--speculative", method, "--quiet", "--out"])
            .arg(&out)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).to_string(),
            std::fs::read_to_string(out.join("report.json")),
        )
    };
    let (ok, stderr, json) = simulate("dspark");
    assert!(ok, "{stderr}");
    let json = json.unwrap();
    assert!(json.contains("\"method\": \"dspark\"") && json.contains("\"draft_length\": \"adaptive\""), "{json}");
    let (ok, stderr, json) = simulate("off");
    assert!(ok, "{stderr}");
    assert!(!json.unwrap().contains("acceptance_length"));
    let (ok, stderr, _) = simulate("mtp");
    assert!(!ok && stderr.contains("V4.1-Flash has no mtp draft head"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
