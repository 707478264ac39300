//! Kills, restarts and drains of real `deepinfer node` processes under
//! streaming load through an API front end. Four nodes serve one instance
//! with its experts on all four (the layout whose tables every step
//! crosses). First the sequence that once wedged such a cluster for good
//! (after a table change, node0 killed and started again, then node3
//! drained and started again: every request failed with "shard 1 does not
//! hold expert 7" until node0 was restarted by hand), then 20 kills or
//! drains of random nodes drawn
//! from a seed, some started again at once (faster than the failure
//! timeout), some after a pause.
//!
//! Every streamed request either completes (`[DONE]` after a finish
//! reason) or fails the way a client can retry: HTTP 503 with
//! `Retry-After`, or a stream that ends with an error event and no finish
//! marker before it. After the last restart the cluster serves again within
//! a few failure timeouts, and every request sent after that completes.

mod cluster_support;
mod serve_support;

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cluster_support::{run_plain, spawn_node, start_nodes, Proc, Site, FAILURE_TIMEOUT_MS};
use deepinfer::api::generate::mix;
use futures_util::StreamExt;
use serve_support::Served;

/// Concurrent streaming clients.
const CLIENTS: usize = 6;
/// Random faults after the wedge sequence.
const FAULTS: usize = 20;

/// How one request ended.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    Completed,
    /// 503 with `Retry-After`, or an error event ending the stream: the client may retry.
    Retryable(String),
    /// Anything else: a defect.
    Wrong(String),
}

struct Ended {
    started: Instant,
    ended: Instant,
    outcome: Outcome,
}

fn request(i: u64) -> serde_json::Value {
    serde_json::json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": format!("Chaos request {i}")}],
        "max_tokens": 16,
        "ignore_eos": true,
        "seed": i,
        "stream": true,
        "thinking": {"type": "disabled"},
    })
}

/// Send one streamed chat request and classify how it ended.
async fn one(client: &reqwest::Client, url: &str, i: u64) -> Outcome {
    let sent = client.post(url).json(&request(i)).send().await;
    let r = match sent {
        Ok(r) => r,
        Err(e) => return Outcome::Wrong(format!("no answer from the front end: {e}")),
    };
    let status = r.status().as_u16();
    if status == 503 || status == 429 {
        return match r.headers().get("retry-after") {
            Some(_) => Outcome::Retryable(format!("HTTP {status}")),
            None => Outcome::Wrong(format!("HTTP {status} without Retry-After")),
        };
    }
    if status != 200 {
        return Outcome::Wrong(format!("HTTP {status}: {}", r.text().await.unwrap_or_default()));
    }
    let mut body = r.bytes_stream();
    let mut text = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(90), async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(bytes) => text.extend_from_slice(&bytes),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    })
    .await;
    let text = String::from_utf8_lossy(&text).to_string();
    match read {
        Err(_) => return Outcome::Wrong(format!("stream still open after 90 s: {text}")),
        Ok(Err(e)) => return Outcome::Wrong(format!("stream broken: {e}: {text}")),
        Ok(Ok(())) => {}
    }
    let finished = text.contains("\"finish_reason\":\"length\"") || text.contains("\"finish_reason\":\"stop\"");
    let errored = text.lines().any(|l| l.starts_with("data: {\"error\""));
    match (finished, errored, text.contains("data: [DONE]")) {
        (true, false, true) => Outcome::Completed,
        // A table the cluster could repair is never a reason to fail.
        (false, true, false) if text.contains("does not hold expert") || text.contains("not acknowledged") => {
            Outcome::Wrong(format!("failed on a stale table: {text}"))
        }
        (false, true, false) => Outcome::Retryable("stream ended with an error event".into()),
        (true, true, _) => Outcome::Wrong(format!("a finish marker and an error: {text}")),
        _ => Outcome::Wrong(format!("neither completed nor failed: {text}")),
    }
}

/// `CLIENTS` clients sending one request after another until `stop`.
fn load(url: String, stop: Arc<AtomicBool>, log: Arc<Mutex<Vec<Ended>>>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let client = reqwest::Client::new();
            let tasks: Vec<_> = (0..CLIENTS as u64)
                .map(|c| {
                    let (client, url, stop, log) = (client.clone(), url.clone(), stop.clone(), log.clone());
                    tokio::spawn(async move {
                        let mut i = c * 1_000_000;
                        while !stop.load(Ordering::Relaxed) {
                            let started = Instant::now();
                            let outcome = one(&client, &url, i).await;
                            let retry = !matches!(outcome, Outcome::Completed);
                            log.lock().unwrap().push(Ended { started, ended: Instant::now(), outcome });
                            if retry {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            i += 1;
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
    })
}

/// A fault on one node.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL, then a new process after `pause`.
    Kill { node: usize, pause: Duration },
    /// `deepinfer drain --force`, then a new process.
    Drain { node: usize },
}

/// The wedge sequence, then `FAULTS` drawn from `seed`.
fn faults(seed: u64) -> Vec<Fault> {
    // SplitMix64: `mix` adds the stream's step to what it is given.
    let mut state = seed;
    let mut next = move || {
        let out = mix(state);
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        out
    };
    // node3 leaves and returns while node0's scheduler lives (its table
    // goes to epoch 2 on every shard), then the wedge: node0's new process
    // numbers from epoch 0, and draining node3 moves its experts.
    let mut out = vec![
        Fault::Kill { node: 3, pause: Duration::from_millis(2 * FAILURE_TIMEOUT_MS) },
        Fault::Kill { node: 0, pause: Duration::from_millis(1500) },
        Fault::Drain { node: 3 },
    ];
    for _ in 0..FAULTS {
        let node = (next() % 4) as usize;
        out.push(match next() % 3 {
            0 => Fault::Drain { node },
            // Started again at once (nobody saw it go) or after being declared down.
            1 => Fault::Kill { node, pause: Duration::ZERO },
            _ => Fault::Kill { node, pause: Duration::from_millis(2 * FAILURE_TIMEOUT_MS) },
        });
    }
    out
}

fn apply(site: &Site, nodes: &mut [Proc], fault: Fault) {
    let node = match fault {
        Fault::Kill { node, pause } => {
            nodes[node].child.kill().unwrap();
            let _ = nodes[node].child.wait();
            std::thread::sleep(pause);
            node
        }
        Fault::Drain { node } => {
            let name = format!("node{node}");
            let o = run_plain(&["drain", &name, "--topology", site.t(), "--force", "--timeout-s", "60"]);
            assert!(o.status.success(), "drain {name}: {}", String::from_utf8_lossy(&o.stderr));
            let code = nodes[node].wait_exit(Duration::from_secs(30));
            assert!(code.success(), "{name} stops cleanly: {code}");
            node
        }
    };
    nodes[node] = spawn_node(site, node);
    nodes[node].wait_for("cluster ready", Duration::from_secs(60));
}

#[test]
fn kills_restarts_and_drains_of_processes_under_streaming_load_fail_nothing_for_good() {
    let site = Site::new("chaos");
    let mut nodes = start_nodes(&site);
    let mut cmd = Command::new(cluster_support::BIN);
    cmd.args(["serve", "--topology", site.t(), "--listen", "127.0.0.1:0"]);
    let front = Served::start_command(cmd);
    let (stop, log) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
    let clients = load(front.url("/v1/chat/completions"), stop.clone(), log.clone());

    let faults = faults(0x00c0_ffee);
    for (k, &fault) in faults.iter().enumerate() {
        let t = Instant::now();
        apply(&site, &mut nodes, fault);
        eprintln!("fault {k}: {fault:?} over in {:.1} s", t.elapsed().as_secs_f64());
    }
    let ready = Instant::now();
    // Long enough for every client to send several requests after recovery.
    std::thread::sleep(Duration::from_millis(6 * FAILURE_TIMEOUT_MS));
    stop.store(true, Ordering::Relaxed);
    clients.join().expect("the clients ran");

    let log = log.lock().unwrap();
    let wrong: Vec<String> = log
        .iter()
        .filter_map(|e| match &e.outcome {
            Outcome::Wrong(why) => Some(why.clone()),
            _ => None,
        })
        .collect();
    assert!(wrong.is_empty(), "{} requests ended neither completed nor retryable: {wrong:#?}", wrong.len());
    let completed = log.iter().filter(|e| e.outcome == Outcome::Completed).count();
    let retryable = log.len() - completed;
    // Served again: a request completes within 3 failure timeouts of the last restart, and every request sent after that completes.
    let settle = ready + Duration::from_millis(3 * FAILURE_TIMEOUT_MS);
    let first = log.iter().filter(|e| e.outcome == Outcome::Completed && e.ended > ready).map(|e| e.ended).min();
    assert!(first.is_some_and(|t| t <= settle), "nothing completed within 3 failure timeouts of the last restart");
    let late: Vec<&Outcome> = log.iter().filter(|e| e.started > settle).map(|e| &e.outcome).collect();
    assert!(late.len() >= CLIENTS, "only {} requests were sent after the cluster was back", late.len());
    let failed_late: Vec<&&Outcome> = late.iter().filter(|o| ***o != Outcome::Completed).collect();
    assert!(failed_late.is_empty(), "requests failed after the cluster was back: {failed_late:?}");
    eprintln!(
        "{} faults under {CLIENTS} streaming clients: {} requests, {completed} completed, {retryable} failed retryably, \
         first completion {:.2} s after the last restart",
        faults.len(),
        log.len(),
        first.map_or(f64::NAN, |t| (t - ready).as_secs_f64())
    );
    drop(front);
    cluster_support::stop_nodes(&mut nodes);
}
