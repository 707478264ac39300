//! `deepinfer drain` refuses a drain that would leave no instance to take
//! new requests (every instance of a needed role has a device on the node,
//! or on a node that is down), before it sends anything, unless `--force`;
//! and a front end's `/health` says when no instance can take a request
//! (every scheduler's node dead, or the router finding every instance down
//! or draining) and says ok again when one can. Real `deepinfer node`
//! processes over QUIC, two instances of two nodes each.

mod cluster_support;
mod serve_support;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cluster_support::{run_plain, spawn_node, start_nodes, Proc, Site, BIN, TWO_INSTANCES};
use serve_support::Served;

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

fn drain(site: &Site, node: &str, force: bool) -> Output {
    let mut args = vec!["drain", node, "--topology", site.t(), "--timeout-s", "60"];
    if force {
        args.push("--force");
    }
    run_plain(&args)
}

/// The topology alone shows the outage: refused at once, no node needed.
#[test]
fn a_drain_of_the_only_instance_of_a_role_is_refused_from_the_topology() {
    let site = Site::new("drain-one");
    let started = Instant::now();
    let o = drain(&site, "node1", false);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("refusing to drain node1: every instance has a device on node1 (main)"), "{err}");
    assert!(err.contains("add an instance") && err.contains("--force"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    assert!(started.elapsed() < Duration::from_secs(10), "refused before reaching the cluster");

    // With prefill/decode instances, what is missing is the role.
    let roles = "\n[[instance]]\nname = \"p\"\nrole = \"prefill\"\nnodes = [\"node0\", \"node1\"]\n\
                 \n[[instance]]\nname = \"d\"\nrole = \"decode\"\nnodes = [\"node2\", \"node3\"]\n";
    let site = Site::with_instances("drain-roles", roles);
    let err = stderr(&drain(&site, "node3", false));
    assert!(err.contains("every decode instance has a device on node3 (d)"), "{err}");
}

fn front_end(site: &Site) -> Served {
    let mut cmd = Command::new(BIN);
    cmd.args(["serve", "--topology", site.t(), "--listen", "127.0.0.1:0"]);
    Served::start_command(cmd)
}

fn request(i: u64) -> serde_json::Value {
    serde_json::json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": format!("Drain request {i}")}],
        "max_tokens": 8,
        "temperature": 0,
    })
}

/// `/health` of `front`: the status and the reason, if any.
async fn health(client: &reqwest::Client, front: &Served) -> (u16, String) {
    let r = client.get(front.url("/health")).send().await.unwrap();
    let status = r.status().as_u16();
    let body: serde_json::Value = r.json().await.unwrap();
    (status, body["reason"].as_str().unwrap_or_default().to_string())
}

/// Wait until `/health` answers `want`; the reason it gave.
async fn health_becomes(client: &reqwest::Client, front: &Served, want: u16, what: &str) -> String {
    let start = Instant::now();
    loop {
        let (status, reason) = health(client, front).await;
        if status == want {
            return reason;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "{what}: /health still {status} {reason}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn chat(client: &reqwest::Client, front: &Served, i: u64) -> u16 {
    let r = client.post(front.url("/v1/chat/completions")).json(&request(i)).send().await.unwrap();
    r.status().as_u16()
}

/// Start the nodes `which` again and wait until they and the running nodes
/// hear each other (and the restarted ones have declared the stopped ones down).
fn restart(nodes: &mut [Proc], site: &Site, which: &[usize]) {
    let at = Instant::now();
    let running: Vec<usize> =
        (0..4).filter(|j| !which.contains(j) && nodes[*j].child.try_wait().unwrap().is_none()).collect();
    for &i in which {
        nodes[i] = spawn_node(site, i);
    }
    for &i in which {
        for j in (0..4).filter(|&j| j != i) {
            let up = which.contains(&j) || running.contains(&j);
            let news = format!("node node{j} {}", if up { "up" } else { "down" });
            nodes[i].wait_for(&news, Duration::from_secs(60));
        }
        for &j in &running {
            nodes[j].wait_for_since(&format!("node node{i} up"), Some(at), Duration::from_secs(30));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drains_that_would_stop_serving_are_refused_and_health_says_when_nothing_serves() {
    // A node started while another is down waits this long for it, not a minute.
    let site = Site::build_with("drain-health", TWO_INSTANCES, false, "startup_grace_ms = 2000\n");
    let mut nodes = start_nodes(&site);
    let front = front_end(&site);
    let client = reqwest::Client::new();
    assert_eq!(health(&client, &front).await.0, 200);

    // Both schedulers' nodes die: nothing can serve, and `/health` says so
    // without a request having failed.
    for i in [0, 2] {
        nodes[i].child.kill().unwrap();
    }
    let why = health_becomes(&client, &front, 503, "schedulers' nodes dead").await;
    assert!(why.starts_with("no serving instance is up") && why.contains("[0, 2]"), "{why}");

    // Draining node1 would leave nothing: `a` is on it, `b` on a dead node.
    let o = drain(&site, "node1", false);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("(a) or on a node that is down (b on node2)") && err.contains("--force"), "{err}");
    assert!(nodes[1].child.try_wait().unwrap().is_none(), "a refused drain leaves the node running");

    restart(&mut nodes, &site, &[0, 2]);
    health_becomes(&client, &front, 200, "schedulers back").await;
    assert_eq!(chat(&client, &front, 0).await, 200);

    // Instance `b` serves while node1 drains: allowed, and said.
    let o = drain(&site, "node1", false);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("instances a stop taking new requests") && err.contains("b serve on"), "{err}");
    nodes[1].wait_exit(Duration::from_secs(30));

    // node1 is away, so `a` takes nothing: draining node3 (of `b`) is refused...
    let err = stderr(&drain(&site, "node3", false));
    assert!(err.contains("every instance has a device on node3 (b) or on a node that is down (a on node1)"), "{err}");
    // ...unless forced; then nothing serves, and `/health` says why for as
    // long as nothing is heard to change it (not only while the failed
    // request's own evidence lasts).
    let o = drain(&site, "node3", true);
    assert!(o.status.success() && stderr(&o).contains("(--force)"), "{}", stderr(&o));
    nodes[3].wait_exit(Duration::from_secs(30));
    assert!(chat(&client, &front, 1).await >= 500, "no instance takes a request");
    // (The failed request's evidence comes first; the driver's next poll brings the reason.)
    let start = Instant::now();
    loop {
        let why = health(&client, &front).await.1;
        if why.starts_with("no serving instance is up") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{why}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // node1 back: `a` serves again, and `/health` says ok.
    restart(&mut nodes, &site, &[1]);
    let start = Instant::now();
    while chat(&client, &front, 2).await != 200 {
        assert!(start.elapsed() < Duration::from_secs(30), "instance a never served again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    health_becomes(&client, &front, 200, "node1 back").await;
    drop(front);
    drop(nodes);
}
