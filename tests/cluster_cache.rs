//! The cluster's prompt cache below the KV pools, with real node processes
//! over QUIC: a disk tier that outlives every process, and one shared by
//! every node.

mod cluster_support;
mod serve_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cluster_support::*;
use deepinfer::kv_disk::block_files;
use serde_json::Value;
use serve_support::Served;

/// The block files under `dir` once at least `at_least` exist, or after a
/// minute: a node's disk writer stores blocks after the request has been
/// answered, and a loaded machine can hold it back.
fn block_files_after_writes(dir: &Path, at_least: usize) -> Vec<PathBuf> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let files = block_files(dir);
        if files.len() >= at_least || std::time::Instant::now() >= deadline {
            return files;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A prompt long enough for several cache blocks.
fn long_prompt(topic: &str) -> String {
    (0..60).map(|i| format!("{topic} fact {i} is worth keeping. ")).collect()
}

/// One request per prompt in `site`'s directory, and what one process outputs for it.
fn input_and_reference(site: &Site, prompts: &[String]) -> (PathBuf, Vec<Value>) {
    let lines: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| serde_json::json!({"id": i, "prompt": p, "max_tokens": 8}).to_string())
        .collect();
    let input = site.dir.join("in.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = site.dir.join("one.jsonl");
    let o = run_plain(&["generate", "--input", s(&input), "--output", s(&out)]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (input, rows(&out))
}

fn rows(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// Run `input` on the cluster as a client: each row, and its cached prompt tokens.
fn on_cluster(site: &Site, input: &Path, name: &str) -> Vec<(Value, u64)> {
    let out = site.dir.join(format!("{name}.jsonl"));
    let o = run_plain(&["generate", "--topology", site.t(), "--input", s(input), "--output", s(&out)]);
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    rows(&out)
        .into_iter()
        .map(|mut r| {
            let cached = r["usage"]["cached_tokens"].as_u64().expect("usage.cached_tokens");
            r["usage"]["cached_tokens"] = Value::from(0);
            (r, cached)
        })
        .collect()
}

#[test]
fn a_restarted_cluster_serves_a_prompt_from_its_disk_tier_as_one_process_would() {
    let site = Site::build_with("kv-restart", ONE_INSTANCE, false, "\n[cluster.cache]\ndisk_dir = \"kv\"\n");
    let (input, one) = input_and_reference(&site, &[long_prompt("alpha")]);
    let mut nodes = start_nodes(&site);
    let first = on_cluster(&site, &input, "first");
    assert_eq!(first[0], (one[0].clone(), 0), "a cold run: one process's tokens, nothing cached");
    stop_nodes(&mut nodes);
    // The instance's scheduler lives on node0: its node's own directory holds the blocks.
    let written = block_files(&site.dir.join("kv").join("node0"));
    assert!(written.len() >= 4, "the prompt's blocks were written: {written:?}");
    assert!(block_files(&site.dir.join("kv").join("node1")).is_empty());

    let mut nodes = start_nodes(&site);
    let second = on_cluster(&site, &input, "second");
    assert_eq!(second[0].0, one[0], "a disk hit gives one process's tokens");
    assert!(second[0].1 >= 4 * 64, "served from disk after the restart: {} cached tokens", second[0].1);
    stop_nodes(&mut nodes);
}

#[test]
fn a_shared_disk_serves_an_instance_whose_node_never_computed_the_prompt() {
    let keys = "\n[cluster.cache]\ndisk_dir = \"kv\"\ndisk_shared = true\nhost_mib = 0\n";
    let site = Site::build_with("kv-shared", TWO_INSTANCES, false, keys);
    let (input, one) = input_and_reference(&site, &[long_prompt("beta")]);
    let mut nodes = start_nodes(&site);
    let first = on_cluster(&site, &input, "first");
    assert_eq!(first[0], (one[0].clone(), 0));
    // The disk tier writes behind the answer, on its own thread.
    let written = block_files_after_writes(&site.dir.join("kv"), 4);
    assert!(written.len() >= 4, "written to the shared directory: {written:?}");
    // Instance `a`'s home node is drained away: `b`, homed on node2, serves.
    let o = run_plain(&["drain", "node0", "--topology", site.t(), "--timeout-s", "60"]);
    assert!(o.status.success(), "drain node0: {}", String::from_utf8_lossy(&o.stderr));
    nodes[0].wait_exit(Duration::from_secs(30));
    let second = on_cluster(&site, &input, "second");
    assert_eq!(second[0].0, one[0], "the shared blocks give one process's tokens");
    assert!(second[0].1 >= 4 * 64, "node2 read what node0 wrote: {} cached tokens", second[0].1);
    stop_nodes(&mut nodes[1..]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_that_asks_for_memory_only_retention_leaves_nothing_on_disk() {
    let site = Site::build_with("kv-in-memory", ONE_INSTANCE, false, "\n[cluster.cache]\ndisk_dir = \"kv\"\n");
    let mut nodes = start_nodes(&site);
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--topology", site.t(), "--listen", "127.0.0.1:0"]);
    let front = Served::start_command(cmd);
    let body = serde_json::json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": long_prompt("gamma")}],
        "max_tokens": 6,
        "temperature": 0,
        "prompt_cache_retention": "in_memory",
    });
    let r = reqwest::Client::new().post(front.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    drop(front);
    stop_nodes(&mut nodes);
    assert!(block_files(&site.dir.join("kv")).is_empty(), "`in_memory` blocks are never written");
}

/// Ask `front` one chat request about `topic`: the answer's content and usage.
async fn chat(front: &Served, topic: &str) -> (Value, Value) {
    let body = serde_json::json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": long_prompt(topic)}],
        "max_tokens": 6,
        "temperature": 0,
        "seed": 5,
    });
    let r = reqwest::Client::new().post(front.url("/v1/chat/completions")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    (v["choices"].clone(), v["usage"].clone())
}

fn front_end(site: &Site) -> Served {
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--topology", site.t(), "--listen", "127.0.0.1:0"]);
    Served::start_command(cmd)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_disk_hit_on_a_restarted_cluster_is_reported_by_tier() {
    let site = Site::build_with("kv-tiers", ONE_INSTANCE, false, "\n[cluster.cache]\ndisk_dir = \"kv\"\n");
    let mut nodes = start_nodes(&site);
    let front = front_end(&site);
    let (cold, usage) = chat(&front, "delta").await;
    assert_eq!(usage["prompt_cache_tokens_by_tier"], serde_json::json!({"device": 0, "host": 0, "disk": 0}));
    // Asked again: a hit in the instance's pool.
    let (again, usage) = chat(&front, "delta").await;
    assert_eq!(again, cold);
    let cached = usage["prompt_tokens_details"]["cached_tokens"].clone();
    assert_eq!(usage["prompt_cache_tokens_by_tier"], serde_json::json!({"device": cached, "host": 0, "disk": 0}));
    drop(front);
    stop_nodes(&mut nodes);

    let mut nodes = start_nodes(&site);
    let front = front_end(&site);
    let (warm, usage) = chat(&front, "delta").await;
    assert_eq!(warm, cold, "a disk hit gives the cold run's answer");
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let tiers = &usage["prompt_cache_tokens_by_tier"];
    assert!(tiers["disk"].as_u64().unwrap() >= 4 * 64, "{usage}");
    assert_eq!(
        tiers["device"].as_u64().unwrap() + tiers["host"].as_u64().unwrap() + tiers["disk"].as_u64().unwrap(),
        cached
    );
    drop(front);
    stop_nodes(&mut nodes);
}
