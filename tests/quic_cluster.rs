//! Real clusters on 127.0.0.1: separate `deepinfer` processes talking QUIC
//! with mutual TLS. Four processes generate the bytes one process does; the
//! launcher stops cleanly on SIGTERM; a node killed with SIGKILL in the
//! middle of a batch is detected by the survivors, and every request either
//! completes exactly as in one process or ends with an error that says why.
//! Every wait has a timeout and every child is killed when its guard drops.

mod cluster_support;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cluster_support::{cluster_status, run, run_plain, s, start_nodes, Proc, Site, FAILURE_TIMEOUT_MS, TWO_INSTANCES};
use serde_json::Value;

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

/// node0 holds the active router and the home of the first instance: the
/// client turns to node1's router, which moves the first instance's
/// requests to the second; nothing is lost and every token is one
/// process's. A client that connects afterwards is served too.
#[test]
fn killing_the_active_routers_node_loses_no_request() {
    let completed = kill_mid_batch(&Site::with_instances("kill-router", TWO_INSTANCES), 0);
    assert_eq!(completed, 8, "every request completes across the router's loss");
}

/// node0 holds the active router and the only instance's scheduler: the
/// requests cannot complete, and say so instead of hanging; so does a
/// client that connects afterwards.
#[test]
fn killing_the_only_instances_home_ends_requests_with_a_clear_error() {
    let completed = kill_mid_batch(&Site::new("kill-home-one"), 0);
    assert_eq!(completed, 0);
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

/// The decode processes of a disaggregated cluster draft with the trained
/// model's MTP block and verify the drafts: the tokens are those of one
/// process decoding without drafts, and `status` shows drafts accepted.
#[test]
fn decode_processes_draft_and_verify_with_the_tokens_of_one_process() {
    let keys = "\n[cluster.speculative]\nmethod = \"mtp\"\nnum_draft_tokens = 2\ndraft_length = \"fixed\"\n";
    let site = Site::build_model("drafting", DISAGGREGATED, Some("builtin:tiny-v4-trained"), keys);
    let mut nodes = start_nodes(&site);
    for prompt in ["impl<T> Iterator for", "/// Returns the number of"] {
        let base = ["generate", "--prompt", prompt, "--max-tokens", "40", "--show-tokens"];
        let one = run_plain(&[&base[..], &["--model", "builtin:tiny-v4-trained"]].concat());
        let four = run_plain(&[&base[..], &["--topology", site.t()]].concat());
        assert!(one.status.success() && four.status.success(), "{}", String::from_utf8_lossy(&four.stderr));
        assert_eq!(four.stdout, one.stdout, "{prompt}");
    }
    let (ok, text) = cluster_status(&site);
    assert!(ok, "{text}");
    let accepted: u64 = text
        .lines()
        .filter_map(|l| l.split("drafts accepted ").nth(1))
        .filter_map(|rest| rest.split(' ').next()?.parse::<u64>().ok())
        .sum();
    assert!(accepted > 10, "drafts accepted on the decode nodes: {text}");
    // `--speculative` on a client of a running cluster would be ignored: it is refused.
    let refused = run_plain(&["generate", "--topology", site.t(), "--prompt", "x", "--speculative", "mtp"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("[cluster.speculative]"));
    cluster_support::stop_nodes(&mut nodes);
}

/// Kill node `victim` in the middle of an 8-request batch; check detection,
/// the outcome of every request and that nothing hangs.
/// Whether requests can outlive `victim`: with the only instance's home gone
/// the client may finish on its own detection, before every survivor's.
fn completed_possible(site: &Site, victim: usize) -> bool {
    victim != 0 || std::fs::read_to_string(&site.topology).unwrap().matches("[[instance]]").count() > 1
}

fn kill_mid_batch(site: &Site, victim: usize) -> usize {
    let survivors: Vec<usize> = (0..4).filter(|&i| i != victim).collect();
    let down = format!("node node{victim} down");
    let mut nodes = start_nodes(site);
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
        if completed_possible(site, victim) {
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
    if completed == 0 {
        // Nowhere to run: a new client hears why as soon as it knows node0 is gone.
        for b in read(&four_out) {
            let e = b["error"].as_str().unwrap_or_default();
            assert!(e.contains("no serving instance is up"), "{b}");
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
    assert_eq!(pids.len(), 5, "four nodes and the API front end: {}", launcher.text());
    launcher.child.kill().unwrap(); // SIGKILL: no chance to stop anything
    launcher.wait_exit(Duration::from_secs(10));
    let alive = |pid: &str| Command::new("kill").args(["-0", pid]).stderr(Stdio::null()).status().unwrap().success();
    let end = Instant::now() + Duration::from_secs(30);
    while pids.iter().any(|p| alive(p)) {
        assert!(Instant::now() < end, "nodes outlived their launcher: {pids:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
