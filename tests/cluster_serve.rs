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

use cluster_support::{spawn_node, start_nodes, Proc, Site};
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

/// A front end of `site`'s running cluster on a free port.
fn front_end(site: &Site) -> Served {
    let mut cmd = Command::new(cluster_support::BIN);
    cmd.args(["serve", "--topology", site.t(), "--listen", "127.0.0.1:0"]);
    Served::start_command(cmd)
}

/// Request `i` (not streamed) answered by `front` as by one process.
async fn assert_same_answer(client: &reqwest::Client, front: &Served, one: &Served, i: u64) {
    let ask = |base: &Served| client.post(base.url("/v1/chat/completions")).json(&long_request(i, false)).send();
    let (got, want) = (ask(front).await.unwrap(), ask(one).await.unwrap());
    assert_eq!(got.status(), 200);
    let content = |v: serde_json::Value| v["choices"][0]["message"]["content"].clone();
    assert_eq!(content(got.json().await.unwrap()), content(want.json().await.unwrap()), "request {i}");
}

/// A request of the front-end test: long, seeded, streamed or not.
fn long_request(i: u64, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": format!("Front end request {i}")}],
        "max_tokens": 160,
        "ignore_eos": true,
        "temperature": 0.8,
        "seed": i,
        "stream": stream,
        "thinking": {"type": "disabled"},
    })
}

/// Two front ends on one cluster; one is killed outright while it streams
/// four answers. Each of its streams ends at once with an error (none
/// hangs), and the same requests sent to the other front end complete with
/// one process's answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_end_killed_mid_stream_ends_its_streams_and_another_serves_them() {
    use futures_util::StreamExt;
    let site = Site::new("front-ends");
    let nodes = start_nodes(&site);
    let (doomed, other, one) = (front_end(&site), front_end(&site), Served::start(&[]));
    let client = reqwest::Client::new();
    let chat = "/v1/chat/completions";
    let mut streams = Vec::new();
    for i in 0..4 {
        let r = client.post(doomed.url(chat)).json(&long_request(i, true)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let mut body = r.bytes_stream();
        body.next().await.expect("a first chunk").unwrap();
        streams.push(body);
    }
    drop(doomed); // SIGKILL mid-stream
    for (i, mut body) in streams.into_iter().enumerate() {
        let ended = tokio::time::timeout(Duration::from_secs(10), async {
            let mut text = Vec::new();
            loop {
                match body.next().await {
                    Some(Ok(bytes)) => text.extend_from_slice(&bytes),
                    Some(Err(_)) | None => return String::from_utf8_lossy(&text).to_string(),
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("stream {i} hangs after its front end died"));
        assert!(!ended.contains("[DONE]"), "stream {i} cannot have completed: {ended}");
    }
    // The client retries on the other front end: one process's answers.
    for i in 0..4 {
        assert_same_answer(&client, &other, &one, i).await;
    }
    drop(nodes);
}

/// With every router node gone a front end says so: `/health` answers 503
/// with the reason and a request ends at once with an error; when the
/// router nodes are started again it is healthy and serves one process's
/// answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_end_says_when_no_router_is_left_and_serves_again_when_they_return() {
    let site = Site::with_instances("routers-gone", cluster_support::TWO_INSTANCES);
    let mut nodes = start_nodes(&site);
    let (front, one) = (front_end(&site), Served::start(&[]));
    let client = reqwest::Client::new();
    let chat = "/v1/chat/completions";
    let health = || async { client.get(front.url("/health")).send().await.unwrap() };
    assert_eq!(health().await.status(), 200);
    for i in [0, 1] {
        nodes[i].child.kill().unwrap();
    }
    let gone = std::time::Instant::now();
    let why = loop {
        let h = health().await;
        if h.status() == 503 {
            break h.text().await.unwrap();
        }
        assert!(gone.elapsed() < Duration::from_secs(20), "/health never said the routers are gone");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(why.contains("every router node is unreachable"), "{why}");
    let refused = client.post(front.url(chat)).json(&long_request(1, false)).send().await.unwrap();
    assert!(refused.status().is_server_error(), "{}", refused.status());
    for i in [0, 1] {
        nodes[i] = spawn_node(&site, i);
    }
    let back = std::time::Instant::now();
    while health().await.status() != 200 {
        assert!(back.elapsed() < Duration::from_secs(30), "/health never recovered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 0..2 {
        assert_same_answer(&client, &front, &one, i).await;
    }
    drop(nodes);
}
