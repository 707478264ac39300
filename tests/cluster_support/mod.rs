//! Real cluster processes for the tests: a child process killed when its
//! guard drops, whose output lines are kept with the time they arrived; a
//! directory with a four-node topology on free ports and its certificates.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_deepinfer");
pub const FAILURE_TIMEOUT_MS: u64 = 1000;

/// A child process that is killed (if still running) when dropped; its
/// stderr lines are collected with the time they arrived.
pub struct Proc {
    pub child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Proc {
    pub fn spawn(args: &[&str], stdout: bool) -> Self {
        let mut child = Command::new(BIN)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(if stdout { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::piped())
            .spawn()
            .expect("binary starts");
        let lines = Arc::new(Mutex::new(Vec::new()));
        for stream in [
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        {
            let lines = Arc::clone(&lines);
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push((Instant::now(), line));
                }
            });
        }
        Self { child, lines }
    }

    pub fn text(&self) -> String {
        self.lines.lock().unwrap().iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }

    /// Wait until a line contains `needle`; panics with everything seen after `limit`.
    pub fn wait_for(&self, needle: &str, limit: Duration) -> Instant {
        self.wait_for_since(needle, None, limit)
    }

    /// Wait for a line containing `needle` that arrived after `since`.
    pub fn wait_for_since(&self, needle: &str, since: Option<Instant>, limit: Duration) -> Instant {
        let end = Instant::now() + limit;
        loop {
            let lines = self.lines.lock().unwrap();
            let found = lines.iter().find(|(t, l)| since.is_none_or(|s| *t > s) && l.contains(needle));
            if let Some((t, _)) = found {
                return *t;
            }
            drop(lines);
            assert!(Instant::now() < end, "no `{needle}` within {limit:?}:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let end = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < end, "still running after {limit:?}:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn run(args: &[&str]) -> Output {
    let mut child = Proc::spawn(args, true);
    let status = child.wait_exit(Duration::from_secs(120));
    std::thread::sleep(Duration::from_millis(50)); // let the reader threads drain
    let text = child.text();
    Output { status, stdout: text.into_bytes(), stderr: Vec::new() }
}

pub fn run_plain(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("binary runs")
}

/// A directory with a four-node topology on free ports and its certificates.
pub struct Site {
    pub dir: PathBuf,
    pub topology: PathBuf,
}

/// One instance over all four nodes, experts spread over all four.
pub const ONE_INSTANCE: &str = "\n[[instance]]\nname = \"main\"\nrole = \"both\"\n\
                            nodes = [\"node0\", \"node1\", \"node2\", \"node3\"]\nattention_dp = 4\nexpert_parallel = 4\n";
/// Two instances of two nodes; the second's scheduler lives on node2.
pub const TWO_INSTANCES: &str = "\n[[instance]]\nname = \"a\"\nrole = \"both\"\nnodes = [\"node0\", \"node1\"]\n\
                             \n[[instance]]\nname = \"b\"\nrole = \"both\"\nnodes = [\"node2\", \"node3\"]\n";

impl Site {
    pub fn new(name: &str) -> Self {
        Self::with_instances(name, ONE_INSTANCE)
    }

    pub fn with_instances(name: &str, instances: &str) -> Self {
        Self::build(name, instances, false)
    }

    /// Nodes that load the model from a checkpoint directory (the built-in
    /// tiny-v4 written by `model init`, so one process's reference is the
    /// same): each shard reads only the experts placed on it.
    pub fn with_checkpoint(name: &str, instances: &str) -> Self {
        Self::build(name, instances, true)
    }

    fn build(name: &str, instances: &str, checkpoint: bool) -> Self {
        Self::build_with(name, instances, checkpoint, "")
    }

    /// Four nodes with `cluster_keys` added to `[cluster]`.
    pub fn build_with(name: &str, instances: &str, checkpoint: bool, cluster_keys: &str) -> Self {
        let model = if checkpoint { None } else { Some("builtin:tiny-v4") };
        Self::build_model(name, instances, model, cluster_keys)
    }

    /// Four nodes serving `model` (`None`: a checkpoint directory of the
    /// built-in tiny-v4), with `cluster_keys` added after `[cluster]`.
    pub fn build_model(name: &str, instances: &str, model: Option<&str>, cluster_keys: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("deepinfer-quic-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let model = model.unwrap_or_else(|| {
            let o = run_plain(&["model", "init", "--preset", "tiny-v4", "--seed", "0", "--out", s(&dir.join("model"))]);
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            "model"
        });
        // Ports that were free a moment ago (held together so they differ).
        let sockets: Vec<UdpSocket> = (0..4).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
        let ports: Vec<u16> = sockets.iter().map(|s| s.local_addr().unwrap().port()).collect();
        drop(sockets);
        let mut text = format!(
            "[cluster]\nname = \"{name}\"\nmodel = \"{model}\"\napi_listen = \"127.0.0.1:0\"\n\
             heartbeat_ms = 100\nfailure_timeout_ms = {FAILURE_TIMEOUT_MS}\ncerts_dir = \"certs\"\n{cluster_keys}"
        );
        for (i, port) in ports.iter().enumerate() {
            text += &format!(
                "\n[[node]]\nname = \"node{i}\"\naddress = \"127.0.0.1:{port}\"\ndevices = 1\nbackend = \"cpu\"\n"
            );
        }
        text += instances;
        let topology = dir.join("cluster.toml");
        std::fs::write(&topology, text).unwrap();
        let o = run_plain(&["cluster", "init-certs", "--topology", s(&topology), "--out", s(&dir.join("certs"))]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Self { dir, topology }
    }

    pub fn t(&self) -> &str {
        s(&self.topology)
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Start `deepinfer node` for node `i` of `site`'s topology; it stops when its stdin closes.
pub fn spawn_node(site: &Site, i: usize) -> Proc {
    Proc::spawn(&["node", "--topology", site.t(), "--node", &format!("node{i}"), "--exit-with-stdin"], false)
}

/// Start the four nodes of `site` and wait until each sees the whole cluster.
pub fn start_nodes(site: &Site) -> Vec<Proc> {
    let nodes: Vec<Proc> = (0..4).map(|i| spawn_node(site, i)).collect();
    for n in &nodes {
        n.wait_for("cluster ready", Duration::from_secs(60));
    }
    nodes
}

/// A batch input of `n` requests of `max_tokens` (prompts start with
/// `label`) in `site`'s directory, and what one process outputs for it.
pub fn batch_with_reference(site: &Site, label: &str, n: usize, max_tokens: usize) -> (PathBuf, String) {
    let lines: Vec<String> = (0..n)
        .map(|i| serde_json::json!({"id": i, "prompt": format!("{label} {i}"), "max_tokens": max_tokens}).to_string())
        .collect();
    let input = site.dir.join("in.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let one_out = site.dir.join("one.jsonl");
    let one = run_plain(&["generate", "--input", s(&input), "--output", s(&one_out)]);
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    (input, std::fs::read_to_string(&one_out).unwrap())
}

/// Close every node's stdin (each stops its actors in order) and check that each exits with success.
pub fn stop_nodes(nodes: &mut [Proc]) {
    for n in nodes.iter_mut() {
        drop(n.child.stdin.take());
    }
    for (i, n) in nodes.iter_mut().enumerate() {
        let code = n.wait_exit(Duration::from_secs(30));
        assert!(code.success(), "node{i}: {code}\n{}", n.text());
    }
}

/// Run the batch `input` on `site`'s cluster as a client (output `<name>.jsonl`) and check it is `want`.
pub fn batch_on_cluster(site: &Site, input: &Path, want: &str, name: &str) {
    let out = site.dir.join(format!("{name}.jsonl"));
    let o = run_plain(&["generate", "--topology", site.t(), "--input", s(input), "--output", s(&out)]);
    assert!(o.status.success(), "{name}: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), want, "{name}: the tokens of one process");
}

/// `deepinfer status` of `site`: whether every node answered, and what it printed.
pub fn cluster_status(site: &Site) -> (bool, String) {
    let o = run_plain(&["status", "--topology", site.t(), "--wait-ms", "3000"]);
    (o.status.success(), String::from_utf8_lossy(&o.stdout).to_string())
}
