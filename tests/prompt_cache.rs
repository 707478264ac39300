//! The prompt cache's disk tier through real `deepinfer serve` processes:
//! a restart serves the same prompt from disk with the output of a cold
//! run; damaged files are skipped, counted and recomputed; two servers
//! share one directory; a disk that refuses writes leaves serving intact.

mod serve_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use deepinfer::kv_disk::block_files;
use reqwest::Client;
use serde_json::{json, Value};
use serve_support::Served;

const CHAT: &str = "/v1/chat/completions";
const WRITTEN: &str = "deepinfer_prompt_cache_disk_written_blocks_total";
const INDEXED: &str = "deepinfer_prompt_cache_disk_indexed_at_start_blocks";

/// Wait until every block `s` handed to its disk tier is on disk (written
/// by it, or found there); returns how many it wrote.
async fn settled(s: &Served, client: &Client) -> f64 {
    let start = std::time::Instant::now();
    loop {
        let queued = s.metric(client, "deepinfer_prompt_cache_disk_queued_blocks_total").await;
        let written = s.metric(client, WRITTEN).await;
        let present = s.metric(client, "deepinfer_prompt_cache_disk_present_blocks_total").await;
        if queued > 0.0 && written + present == queued {
            return written;
        }
        assert!(start.elapsed().as_secs() < 30, "{queued} queued, {written} written, {present} present");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

fn cache_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-prompt-cache-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A conversation long enough for several cache blocks.
fn body(topic: &str) -> Value {
    let text: String = (0..120).map(|i| format!("{topic} fact {i} is worth keeping. ")).collect();
    json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 12,
        "temperature": 0,
        "seed": 5,
    })
}

async fn ask(s: &Served, body: &Value) -> Value {
    let r = Client::new().post(s.url(CHAT)).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// What must not change between a cold run and a cache hit.
fn essentials(v: &Value) -> Value {
    json!({"choices": v["choices"], "completion_tokens": v["usage"]["completion_tokens"],
           "prompt_tokens": v["usage"]["prompt_tokens"]})
}

fn by_tier(v: &Value, tier: &str) -> u64 {
    v["usage"]["prompt_cache_tokens_by_tier"][tier].as_u64().expect("a per-tier count")
}

fn with_dir(dir: &Path) -> Vec<String> {
    vec!["--kv-cache-dir".into(), dir.display().to_string()]
}

fn start(flags: &[String]) -> Served {
    Served::start(&flags.iter().map(String::as_str).collect::<Vec<_>>())
}

#[tokio::test]
async fn a_restarted_server_serves_the_prompt_from_disk_as_a_cold_run_would() {
    let client = Client::new();
    let cold = essentials(&ask(&Served::start(&["--prefix-cache", "off"]), &body("alpha")).await);
    let dir = cache_dir("restart");
    let first = start(&with_dir(&dir));
    let v = ask(&first, &body("alpha")).await;
    assert_eq!(essentials(&v), cold);
    assert_eq!(by_tier(&v, "disk"), 0);
    let written = settled(&first, &client).await;
    assert!(written >= 4.0, "{written}");
    // Killed, not stopped: what was written must already be whole on disk.
    drop(first);
    assert_eq!(block_files(&dir).len() as f64, written);

    let second = start(&with_dir(&dir));
    assert_eq!(second.metric(&client, INDEXED).await, written, "the index is rebuilt from the files");
    let v = ask(&second, &body("alpha")).await;
    assert_eq!(essentials(&v), cold, "a disk hit gives the cold run's output");
    assert!(by_tier(&v, "disk") >= 4 * 64, "{}", v["usage"]);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(), Some(by_tier(&v, "disk")));
    let hits = second.metric(&client, "deepinfer_prompt_cache_hit_tokens_total{tier=\"disk\"}").await;
    assert_eq!(hits, by_tier(&v, "disk") as f64);
    drop(second);

    // Damage two files: one cut short, one with a flipped bit.
    let files = block_files(&dir);
    let cut = &files[0];
    let bytes = std::fs::read(cut).unwrap();
    std::fs::write(cut, &bytes[..bytes.len() / 2]).unwrap();
    let flipped = &files[files.len() - 1];
    let mut bytes = std::fs::read(flipped).unwrap();
    let at = bytes.len() - 20;
    bytes[at] ^= 0x40;
    std::fs::write(flipped, bytes).unwrap();
    let third = start(&with_dir(&dir));
    let truncated = "deepinfer_prompt_cache_disk_bad_files_total{reason=\"truncated\"}";
    let corrupt = "deepinfer_prompt_cache_disk_bad_files_total{reason=\"corrupt\"}";
    assert_eq!(third.metric(&client, truncated).await, 1.0, "found when the index was rebuilt");
    let v = ask(&third, &body("alpha")).await;
    assert_eq!(essentials(&v), cold, "damaged blocks are recomputed, never served");
    assert!(third.metric(&client, truncated).await + third.metric(&client, corrupt).await >= 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn two_servers_share_one_directory() {
    let client = Client::new();
    let dir = cache_dir("shared");
    let (a, b) = (start(&with_dir(&dir)), start(&with_dir(&dir)));
    let topics = ["red", "green", "blue"];
    // Both servers get every prompt at once: each block is written by both.
    let mut wants = Vec::new();
    for t in topics {
        let request = body(t);
        let (x, y) = tokio::join!(ask(&a, &request), ask(&b, &request));
        assert_eq!(essentials(&x), essentials(&y));
        wants.push(essentials(&x));
    }
    // Each block was written by one of them (or both at once); the other found the file.
    let written = settled(&a, &client).await + settled(&b, &client).await;
    drop((a, b));
    let files = block_files(&dir);
    let mut names: Vec<_> = files.iter().map(|f| f.file_name().unwrap().to_owned()).collect();
    names.dedup();
    assert_eq!(names.len(), files.len(), "one file per block");
    // Both may write one block at once: still one whole file.
    assert!(files.len() as f64 <= written, "{} files, {written} written", files.len());
    // A third server reads every block either one wrote.
    let c = start(&with_dir(&dir));
    assert_eq!(c.metric(&client, INDEXED).await, files.len() as f64);
    for (t, want) in topics.iter().zip(&wants) {
        let v = ask(&c, &body(t)).await;
        assert_eq!(&essentials(&v), want);
        assert!(by_tier(&v, "disk") > 0, "{t}: {}", v["usage"]);
    }
    for reason in ["corrupt", "truncated", "foreign"] {
        let name = format!("deepinfer_prompt_cache_disk_bad_files_total{{reason=\"{reason}\"}}");
        assert_eq!(c.metric(&client, &name).await, 0.0, "{reason}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_disk_that_refuses_writes_degrades_to_memory_with_a_warning() {
    let client = Client::new();
    let dir = cache_dir("full");
    // Files may not grow past 1 KiB in this process (a full disk, as the
    // writer sees it); SIGXFSZ is ignored so the write fails instead.
    let args = Served::serve_args(&with_dir(&dir).iter().map(String::as_str).collect::<Vec<_>>());
    let mut cmd = Command::new("sh");
    cmd.arg("-c").arg("trap '' XFSZ; ulimit -f 2; exec \"$0\" \"$@\"").arg(env!("CARGO_BIN_EXE_deepinfer")).args(args);
    let s = Served::start_command(cmd);
    let first = ask(&s, &body("full")).await;
    s.wait_metric(&client, "deepinfer_prompt_cache_disk_write_errors_total", |n| n >= 1.0).await;
    assert_eq!(s.metric(&client, WRITTEN).await, 0.0);
    // Still served, from memory.
    let again = ask(&s, &body("full")).await;
    assert_eq!(essentials(&again), essentials(&first));
    assert!(by_tier(&again, "device") > 0);
    let log = s.log.lock().unwrap().join("\n");
    assert!(log.contains("warning: prompt cache disk tier"), "{log}");
    assert!(block_files(&dir).is_empty(), "no partial file is left");
    let _ = std::fs::remove_dir_all(&dir);
}
