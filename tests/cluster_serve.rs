//! The HTTP API on a cluster of real processes: `launch` starts four nodes
//! talking QUIC with mutual TLS and a front end (`serve --topology`); the
//! official `openai` and `anthropic` SDKs get from it exactly the answers
//! one process gives (greedy and seeded sampling, streaming, JSON schema,
//! forced tool calls, logit bias, penalties, min-p), and the SDK scripts
//! that check one process pass against it unchanged.

mod cluster_support;
mod serve_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use cluster_support::{Proc, Site};
use serve_support::{sdks_available, Served};

/// Run an SDK script against `base`, with `reference` as the one-process server when it compares.
fn run_script(script: &str, base: &str, reference: Option<&str>, seeds: u32) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk").join(script);
    let mut command = Command::new("python3");
    command.arg(&path).env("DEEPINFER_BASE_URL", base).env("DEEPINFER_MODEL", "tiny-v4");
    command.env("DEEPINFER_SDK_SEEDS", seeds.to_string());
    if let Some(r) = reference {
        command.env("DEEPINFER_REFERENCE_URL", r);
    }
    let out = command.output().expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    eprint!("{stdout}");
}

/// The front end's URL, from the launcher's listing.
fn api_url(launcher: &Proc) -> String {
    let text = launcher.text();
    let line = text.lines().find(|l| l.trim_start().starts_with("api ")).expect("the launcher lists the front end");
    line.split_whitespace().find(|w| w.starts_with("http://")).expect("an address").to_string()
}

#[test]
fn the_api_on_four_processes_answers_the_sdks_as_one_process_does() {
    if !sdks_available() {
        return;
    }
    let site = Site::new("serve");
    let launcher = Proc::spawn(&["launch", site.t()], true);
    launcher.wait_for("stop with Ctrl-C", Duration::from_secs(120));
    let api = api_url(&launcher);
    let one = Served::start(&[]);
    run_script("same_tokens.py", &api, Some(&one.base), 0);
    run_script("openai_sdk.py", &api, None, 3);
    run_script("anthropic_sdk.py", &api, None, 3);
    run_script("tools_sdk.py", &api, None, 2);
}
