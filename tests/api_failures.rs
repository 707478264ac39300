//! Failures look like failures on every API, streamed or not: no finish
//! marker (`finish_reason`, `message_stop`, `response.completed`, `[DONE]`)
//! before the protocol's own error, an HTTP error status where nothing was
//! streamed (503 with `Retry-After` when a retry may succeed, 500 for a
//! fault of the model), and a `/health` that says not ready while nothing
//! can be served. Two real failures: a checkpoint whose logits are not
//! finite (one process), and a cluster front end whose only node is killed
//! mid-stream. The `openai` and `anthropic` SDKs raise on both
//! (tests/sdk/failures_sdk.py).

mod cluster_support;
mod serve_support;

use std::net::UdpSocket;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use cluster_support::{run_plain, s, Proc, BIN};
use futures_util::StreamExt;
use serde_json::{json, Value};
use serve_support::{sdks_available, Served};

const FAILURE_TIMEOUT_MS: u64 = 1000;

#[derive(Clone, Copy, Debug)]
enum Api {
    Chat,
    Responses,
    Messages,
    Completions,
}

const APIS: [Api; 4] = [Api::Chat, Api::Responses, Api::Messages, Api::Completions];

/// `api`'s path and a request of `max_tokens` that never stops early.
fn request(api: Api, stream: bool, max_tokens: u32) -> (&'static str, Value) {
    let messages = json!([{"role": "user", "content": "Tell me everything"}]);
    let (path, mut body) = match api {
        Api::Chat => ("/v1/chat/completions", json!({"messages": messages, "max_tokens": max_tokens})),
        Api::Responses => ("/v1/responses", json!({"input": "Tell me everything", "max_output_tokens": max_tokens})),
        Api::Messages => ("/v1/messages", json!({"messages": messages, "max_tokens": max_tokens})),
        Api::Completions => ("/v1/completions", json!({"prompt": "Tell me everything", "max_tokens": max_tokens})),
    };
    body["model"] = json!("tiny-v4");
    body["stream"] = json!(stream);
    body["ignore_eos"] = json!(true);
    (path, body)
}

/// A streamed answer that failed: the protocol's error ends it, and no
/// finish marker comes before.
fn assert_failed_stream(api: Api, text: &str, status: u16) {
    let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    let last = *data.last().unwrap_or_else(|| panic!("{api:?}: an empty stream"));
    let last: Value = serde_json::from_str(last).unwrap_or_else(|e| panic!("{api:?}: {e}: {last}"));
    match api {
        Api::Chat | Api::Completions => {
            assert!(!text.contains("[DONE]"), "{api:?}: [DONE] after a failure: {text}");
            assert!(!text.contains("\"finish_reason\":\""), "{api:?}: a finish reason before the error: {text}");
            let code = if status == 503 { json!("service_unavailable") } else { Value::Null };
            assert_eq!(last["error"]["code"], code, "{api:?}: {last}");
            assert!(last["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{last}");
        }
        Api::Messages => {
            for marker in ["message_delta", "message_stop", "end_turn"] {
                assert!(!text.contains(marker), "{api:?}: {marker} before the error: {text}");
            }
            assert!(text.contains("event: error"), "{api:?}: {text}");
            let kind = if status == 503 { "overloaded_error" } else { "api_error" };
            assert_eq!(last["type"], "error", "{last}");
            assert_eq!(last["error"]["type"], kind, "{last}");
        }
        Api::Responses => {
            for marker in ["response.completed", "response.incomplete"] {
                assert!(!text.contains(marker), "{api:?}: {marker} before the error: {text}");
            }
            assert_eq!(last["type"], "response.failed", "{last}");
            assert_eq!(last["response"]["status"], "failed", "{last}");
            assert_eq!(last["response"]["error"]["code"], "server_error", "{last}");
            let created = data.iter().filter_map(|d| serde_json::from_str::<Value>(d).ok()).next().unwrap();
            assert_eq!(created["type"], "response.created");
            assert_eq!(last["response"]["id"], created["response"]["id"], "the failed response is the one created");
            let sequence = data.len() as u64 - 1;
            assert_eq!(last["sequence_number"], sequence, "sequence numbers continue");
        }
    }
}

/// A plain answer that failed: `status`, `Retry-After` on a 503, the protocol's error body.
async fn assert_failed_plain(api: Api, response: reqwest::Response, status: u16) {
    assert_eq!(response.status(), status, "{api:?}");
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    assert_eq!(retry_after.is_some(), status == 503, "{api:?}: Retry-After {retry_after:?}");
    let body: Value = response.json().await.unwrap();
    match api {
        Api::Messages => {
            let kind = if status == 503 { "overloaded_error" } else { "api_error" };
            assert_eq!(body["error"]["type"], kind, "{body}");
        }
        _ => assert_eq!(body["error"]["type"], "server_error", "{body}"),
    }
}

async fn health(client: &reqwest::Client, served: &Served, path: &str) -> (u16, Value) {
    let r = client.get(served.url(path)).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// tests/sdk/failures_sdk.py against `served`, whose failures are `status`.
fn run_sdk_script(served: &Served, status: u16) {
    if !sdks_available() {
        return;
    }
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/failures_sdk.py");
    let out = Command::new("python3")
        .arg(&path)
        .env("DEEPINFER_BASE_URL", &served.base)
        .env("DEEPINFER_MODEL", "tiny-v4")
        .env("DEEPINFER_EXPECT_STATUS", status.to_string())
        .output()
        .expect("python3 runs");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "failures_sdk.py failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    eprint!("{stdout}");
}

/// tiny-v4 written to `dir` with its final norm's weights NaN: every step's
/// logits are NaN and the engine ends each request with an error.
fn nan_checkpoint(dir: &Path) {
    let o = run_plain(&["model", "init", "--preset", "tiny-v4", "--seed", "0", "--out", s(dir)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let file = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let norm = &header["norm.weight"];
    assert_eq!(norm["dtype"], "F32");
    let (start, end) = (norm["data_offsets"][0].as_u64().unwrap(), norm["data_offsets"][1].as_u64().unwrap());
    for at in (8 + n + start as usize..8 + n + end as usize).step_by(4) {
        bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    }
    std::fs::write(&file, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_fault_is_a_500_or_an_error_event_on_every_api_and_leaves_the_server_ready() {
    let dir = std::env::temp_dir().join(format!("deepinfer-nan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    nan_checkpoint(&dir);
    let served = Served::start(&["--model", s(&dir), "--served-model-name", "tiny-v4"]);
    let client = reqwest::Client::new();
    for api in APIS {
        let (path, body) = request(api, false, 8);
        assert_failed_plain(api, client.post(served.url(path)).json(&body).send().await.unwrap(), 500).await;
        let (path, body) = request(api, true, 8);
        let r = client.post(served.url(path)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{api:?}: the stream had begun");
        assert_failed_stream(api, &r.text().await.unwrap(), 500);
    }
    // A fault of the model is no reason to take the server out of rotation.
    assert_eq!(health(&client, &served, "/health").await.0, 200);
    assert_eq!(health(&client, &served, "/health/live").await.0, 200);
    run_sdk_script(&served, 500);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A cluster of one instance over `nodes` nodes of `devices` devices each
/// (two devices in all at least, so `serve --topology` is its front end);
/// the instance's scheduler and the first router live on node0.
fn one_instance_site(dir: &Path, nodes: usize, devices: usize) -> std::path::PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let mut text = format!(
        "[cluster]\nname = \"failures\"\nmodel = \"builtin:tiny-v4\"\napi_listen = \"127.0.0.1:0\"\n\
         heartbeat_ms = 100\nfailure_timeout_ms = {FAILURE_TIMEOUT_MS}\ncerts_dir = \"certs\"\n"
    );
    // Ports that were free a moment ago (held together so they differ).
    let sockets: Vec<UdpSocket> = (0..nodes).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    for (i, socket) in sockets.iter().enumerate() {
        let port = socket.local_addr().unwrap().port();
        text += &format!(
            "\n[[node]]\nname = \"node{i}\"\naddress = \"127.0.0.1:{port}\"\ndevices = {devices}\nbackend = \"cpu\"\n"
        );
    }
    drop(sockets);
    let names: Vec<String> = (0..nodes).map(|i| format!("\"node{i}\"")).collect();
    text += &format!("\n[[instance]]\nname = \"main\"\nrole = \"both\"\nnodes = [{}]\n", names.join(", "));
    let topology = dir.join("cluster.toml");
    std::fs::write(&topology, text).unwrap();
    let o = run_plain(&["cluster", "init-certs", "--topology", s(&topology), "--out", s(&dir.join("certs"))]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    topology
}

/// The case: the only serving node is killed while every API
/// streams and waits. Each stream ends with its protocol's error and no
/// finish marker, each plain request gets 503 with `Retry-After`, `/health`
/// turns 503 with the reason within the failure timeout (liveness stays
/// 200), and the SDKs raise on every API afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_only_serving_node_fails_every_api_with_503_and_health_says_so() {
    kill_node0_while_every_api_runs("one-node", 1, 2).await;
}

/// The same where a router survives: node1's router is reachable, but the
/// only instance's scheduler died with node0, so nothing can serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_only_instances_home_with_a_router_left_fails_every_api_and_health_says_so() {
    kill_node0_while_every_api_runs("router-left", 2, 1).await;
}

async fn kill_node0_while_every_api_runs(name: &str, nodes: usize, devices: usize) {
    let dir = std::env::temp_dir().join(format!("deepinfer-failures-{}-{name}", std::process::id()));
    let topology = one_instance_site(&dir, nodes, devices);
    let spawn = |i: usize| {
        let node = format!("node{i}");
        Proc::spawn(&["node", "--topology", s(&topology), "--node", &node, "--exit-with-stdin"], false)
    };
    let mut procs: Vec<Proc> = (0..nodes).map(spawn).collect();
    for p in &procs {
        p.wait_for("cluster ready", Duration::from_secs(60));
    }
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--topology", s(&topology), "--listen", "127.0.0.1:0"]);
    let front = Served::start_command(cmd);
    let client = reqwest::Client::new();
    assert_eq!(health(&client, &front, "/health").await, (200, json!({"status": "ok"})));

    // Long enough to run for seconds: each is mid-answer when the node dies.
    let mut streams = Vec::new();
    for api in APIS {
        let (path, body) = request(api, true, 3500);
        let r = client.post(front.url(path)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{api:?}");
        let mut body = r.bytes_stream();
        let first = body.next().await.expect("a first chunk").unwrap();
        streams.push((api, first.to_vec(), body));
    }
    let mut plain = Vec::new();
    for api in APIS {
        let (path, body) = request(api, false, 3500);
        plain.push((api, tokio::spawn(client.post(front.url(path)).json(&body).send())));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    procs[0].child.kill().unwrap();
    let killed = Instant::now();

    for (api, mut text, mut body) in streams {
        let ended = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(Ok(bytes)) = body.next().await {
                text.extend_from_slice(&bytes);
            }
        })
        .await;
        assert!(ended.is_ok(), "{api:?}: the stream hangs after its node died");
        assert_failed_stream(api, &String::from_utf8_lossy(&text), 503);
    }
    for (api, response) in plain {
        assert_failed_plain(api, response.await.unwrap().unwrap(), 503).await;
    }
    let not_ready = loop {
        let (status, body) = health(&client, &front, "/health").await;
        if status == 503 {
            break (killed.elapsed(), body);
        }
        assert!(killed.elapsed() < Duration::from_secs(30), "/health still says {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("{name}: /health not ready {:?} after the kill: {}", not_ready.0, not_ready.1);
    // The node is declared down after the failure timeout; the rest is slack for a busy machine.
    let limit = Duration::from_millis(FAILURE_TIMEOUT_MS) + Duration::from_secs(5);
    assert!(not_ready.0 < limit, "/health said ok for {:?} after the only instance died", not_ready.0);
    assert_eq!(not_ready.1["status"], "unavailable");
    assert!(not_ready.1["reason"].as_str().is_some_and(|r| !r.is_empty()), "{}", not_ready.1);
    assert_eq!(health(&client, &front, "/health/ready").await.0, 503);
    assert_eq!(health(&client, &front, "/health/live").await.0, 200, "a front end restart mends nothing");
    run_sdk_script(&front, 503);
    drop(front);
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
}
