//! Real clusters on 127.0.0.1: separate `deepinfer` processes talking QUIC
//! with mutual TLS. Four processes generate the bytes one process does; the
//! launcher stops cleanly on SIGTERM; a node killed with SIGKILL in the
//! middle of a batch is detected by the survivors, and every request either
//! completes exactly as in one process or ends with an error that says why.
//! Every wait has a timeout and every child is killed when its guard drops.

use std::io::{BufRead, BufReader, Write};
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_deepinfer");
const FAILURE_TIMEOUT_MS: u64 = 1000;

/// A child process that is killed (if still running) when dropped; its
/// stderr lines are collected with the time they arrived.
struct Proc {
    child: Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Proc {
    fn spawn(args: &[&str], stdout: bool) -> Self {
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

    fn text(&self) -> String {
        self.lines.lock().unwrap().iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>().join("\n")
    }

    /// Wait until a line contains `needle`; panics with everything seen after `limit`.
    fn wait_for(&self, needle: &str, limit: Duration) -> Instant {
        let end = Instant::now() + limit;
        loop {
            if let Some((t, _)) = self.lines.lock().unwrap().iter().find(|(_, l)| l.contains(needle)) {
                return *t;
            }
            assert!(Instant::now() < end, "no `{needle}` within {limit:?}:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
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

fn run(args: &[&str]) -> Output {
    let mut child = Proc::spawn(args, true);
    let status = child.wait_exit(Duration::from_secs(120));
    std::thread::sleep(Duration::from_millis(50)); // let the reader threads drain
    let text = child.text();
    Output { status, stdout: text.into_bytes(), stderr: Vec::new() }
}

fn run_plain(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("binary runs")
}

/// A directory with a four-node topology on free ports and its certificates.
struct Site {
    dir: PathBuf,
    topology: PathBuf,
}

/// One instance over all four nodes, experts spread over all four.
const ONE_INSTANCE: &str = "\n[[instance]]\nname = \"main\"\nrole = \"both\"\n\
                            nodes = [\"node0\", \"node1\", \"node2\", \"node3\"]\nattention_dp = 4\nexpert_parallel = 4\n";
/// Two instances of two nodes; the second's scheduler lives on node2.
const TWO_INSTANCES: &str = "\n[[instance]]\nname = \"a\"\nrole = \"both\"\nnodes = [\"node0\", \"node1\"]\n\
                             \n[[instance]]\nname = \"b\"\nrole = \"both\"\nnodes = [\"node2\", \"node3\"]\n";

impl Site {
    fn new(name: &str) -> Self {
        Self::with_instances(name, ONE_INSTANCE)
    }

    fn with_instances(name: &str, instances: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("deepinfer-quic-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Ports that were free a moment ago (held together so they differ).
        let sockets: Vec<UdpSocket> = (0..4).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
        let ports: Vec<u16> = sockets.iter().map(|s| s.local_addr().unwrap().port()).collect();
        drop(sockets);
        let mut text = format!(
            "[cluster]\nname = \"{name}\"\nmodel = \"builtin:tiny-v4\"\napi_listen = \"127.0.0.1:0\"\n\
             heartbeat_ms = 100\nfailure_timeout_ms = {FAILURE_TIMEOUT_MS}\ncerts_dir = \"certs\"\n"
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

    fn t(&self) -> &str {
        s(&self.topology)
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn four_processes_generate_what_one_process_does_and_the_launcher_stops_them() {
    let site = Site::new("four");
    let mut launcher = Proc::spawn(&["launch", site.t()], true);
    launcher.wait_for("stop with Ctrl-C", Duration::from_secs(60));

    for prompt in ["The quick brown fox", "Hello cluster"] {
        let base = ["generate", "--prompt", prompt, "--max-tokens", "24", "--show-tokens"];
        let one = run_plain(&[&base[..], &["--model", "builtin:tiny-v4"]].concat());
        let four = run_plain(&[&base[..], &["--topology", site.t()]].concat());
        assert!(one.status.success() && four.status.success(), "{}", String::from_utf8_lossy(&four.stderr));
        assert!(String::from_utf8_lossy(&one.stdout).contains("tokens: ["));
        assert_eq!(four.stdout, one.stdout, "{prompt}");
        assert!(String::from_utf8_lossy(&four.stderr).contains("on the cluster of"));
    }
    let status = run(&["status", "--topology", site.t()]);
    let text = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.status.success() && text.contains("4/4 nodes up"), "{text}");

    // SIGTERM: every node stops in order and the launcher exits 0.
    let kill = Command::new("kill").args(["-TERM", &launcher.child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let code = launcher.wait_exit(Duration::from_secs(30));
    assert!(code.success(), "{code}\n{}", launcher.text());
    let log = launcher.text();
    for i in 0..4 {
        assert!(log.contains(&format!("node node{i} stopped (exit status: 0)")), "{log}");
    }
    let after = run_plain(&["status", "--topology", site.t(), "--wait-ms", "300"]);
    assert!(!after.status.success());
}

#[test]
fn a_node_killed_mid_batch_is_detected_and_every_request_completes_or_fails_clearly() {
    kill_mid_batch(&Site::new("kill"), 2);
}

/// node0 holds the router: requests cannot complete, and must say so
/// instead of hanging; so must a client that connects afterwards.
#[test]
fn killing_the_router_node_ends_requests_with_a_clear_error() {
    kill_mid_batch(&Site::new("kill-router"), 0);
}

/// node2 is the home of the second instance: its requests move to the first.
#[test]
fn requests_of_an_instance_whose_scheduler_node_dies_move_to_another_instance() {
    kill_mid_batch(&Site::with_instances("kill-home", TWO_INSTANCES), 2);
}

/// Prefill on node0, decode on three instances of their own (nodes 1–3):
/// every request's state crosses processes over QUIC. node2, a decode
/// instance, dies while requests are handed over and decoded there; they move
/// to the other decode instances and complete exactly as in one process.
const DISAGGREGATED: &str = "\n[[instance]]\nname = \"p\"\nrole = \"prefill\"\nnodes = [\"node0\"]\n\
                             \n[[instance]]\nname = \"d1\"\nrole = \"decode\"\nnodes = [\"node1\"]\n\
                             \n[[instance]]\nname = \"d2\"\nrole = \"decode\"\nnodes = [\"node2\"]\n\
                             \n[[instance]]\nname = \"d3\"\nrole = \"decode\"\nnodes = [\"node3\"]\n";

#[test]
fn prefill_and_decode_in_separate_processes_survive_a_decode_node_dying() {
    let completed = kill_mid_batch(&Site::with_instances("disagg", DISAGGREGATED), 2);
    assert_eq!(completed, 8, "a request handed to the dead decode instance was lost or failed");
}

/// Kill node `victim` in the middle of an 8-request batch; check detection,
/// the outcome of every request and that nothing hangs.
fn kill_mid_batch(site: &Site, victim: usize) -> usize {
    let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    let down = format!("node node{victim} down");
    let mut nodes: Vec<Proc> = (0..4)
        .map(|i| {
            Proc::spawn(&["node", "--topology", site.t(), "--node", &format!("node{i}"), "--exit-with-stdin"], false)
        })
        .collect();
    for n in &nodes {
        n.wait_for("cluster ready", Duration::from_secs(60));
    }
    let lines: Vec<String> = (0..8)
        .map(|i| {
            serde_json::json!({"id": i, "prompt": format!("Request number {i} says"), "max_tokens": 400, "ignore_eos": true})
                .to_string()
        })
        .collect();
    let input = site.dir.join("in.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let (one_out, four_out) = (site.dir.join("one.jsonl"), site.dir.join("four.jsonl"));
    let one = run_plain(&["generate", "--input", s(&input), "--output", s(&one_out)]);
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));

    let mut client =
        Proc::spawn(&["generate", "--topology", site.t(), "--input", s(&input), "--output", s(&four_out)], true);
    // Let the batch get going, then kill the node outright.
    std::thread::sleep(Duration::from_millis(300));
    assert!(client.child.try_wait().unwrap().is_none(), "the batch ended before the kill:\n{}", client.text());
    nodes[victim].child.kill().unwrap();
    let status = client.wait_exit(Duration::from_secs(120));
    let client_done = Instant::now();

    // Every survivor saw the node go, within the failure timeout plus a few heartbeats.
    for &i in &survivors {
        let at = nodes[i].wait_for(&down, Duration::from_secs(10));
        let log = nodes[i].text();
        let line = log.lines().find(|l| l.contains(&down)).unwrap();
        let silent: u64 = line.split("silent for ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
        // Printed in whole milliseconds: more than the timeout reads as at least it.
        assert!((FAILURE_TIMEOUT_MS..FAILURE_TIMEOUT_MS + 2000).contains(&silent), "{line}");
        if victim != 0 {
            // (Without the router the client stops at the same detection.)
            assert!(at < client_done, "detected while the batch ran");
        }
    }
    assert!(status.success(), "{}", client.text());
    let read = |p: &Path| -> Vec<Value> {
        std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let (one, four) = (read(&one_out), read(&four_out));
    assert_eq!(one.len(), 8);
    assert_eq!(four.len(), 8);
    let mut completed = 0;
    for (a, b) in one.iter().zip(&four) {
        if b.get("error").is_some() {
            let e = b["error"].as_str().unwrap();
            assert!(e.contains("node") || e.contains("worker") || e.contains("attempts"), "unclear error: {e}");
            continue;
        }
        completed += 1;
        for key in ["id", "finish_reason", "text", "token_ids"] {
            assert_eq!(a[key], b[key], "{key} of {a}");
        }
    }
    let again = run_plain(&["generate", "--topology", site.t(), "--input", s(&input), "--output", s(&four_out)]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    if victim == 0 {
        // Without the router nothing completes, and a new client says why at once.
        assert_eq!(completed, 0);
        for b in read(&four_out) {
            let e = b["error"].as_str().unwrap_or_default();
            assert!(e.contains("node0 (the router) is unreachable"), "{b}");
        }
    } else {
        // Survivors serve: the same batch again completes in full, identically.
        for (a, b) in one.iter().zip(&read(&four_out)) {
            assert_eq!(a["token_ids"], b["token_ids"]);
        }
    }
    let summary = client.text().lines().find(|l| l.contains("requests (")).unwrap_or_default().to_string();
    eprintln!("node{victim} killed: {completed}/8 requests completed across the kill; {summary}");
    for n in &mut nodes {
        drop(n.child.stdin.take());
    }
    for &i in &survivors {
        let code = nodes[i].wait_exit(Duration::from_secs(30));
        assert!(code.success(), "node{i}: {code}\n{}", nodes[i].text());
    }
    let _ = std::io::stderr().flush();
    completed
}

#[test]
fn a_launcher_killed_outright_takes_its_nodes_with_it() {
    let site = Site::new("orphans");
    let mut launcher = Proc::spawn(&["launch", site.t()], true);
    launcher.wait_for("stop with Ctrl-C", Duration::from_secs(60));
    let pids: Vec<String> =
        launcher.text().lines().filter_map(|l| l.split(" pid ").nth(1).map(|p| p.trim().to_string())).collect();
    assert_eq!(pids.len(), 4, "{}", launcher.text());
    launcher.child.kill().unwrap(); // SIGKILL: no chance to stop anything
    launcher.wait_exit(Duration::from_secs(10));
    let alive = |pid: &str| Command::new("kill").args(["-0", pid]).stderr(Stdio::null()).status().unwrap().success();
    let end = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|p| alive(p)) {
        assert!(Instant::now() < end, "nodes outlived their launcher: {pids:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
