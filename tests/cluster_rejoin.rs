//! A node that comes back: four `deepinfer node` processes over QUIC; node2
//! is killed outright, the survivors declare it dead and serve without it
//! (`deepinfer status` shows it unreachable and seen down); a new node2
//! process starts, the survivors hear it again, it rejoins its instance
//! (its experts are put back, it computes again) and every batch, before,
//! during and after, gives the tokens of one process. The nodes load the
//! model from a checkpoint directory, so each shard reads only its experts:
//! the survivors read node2's while it is away, the new node2 reads its own.
//! Nodes started while one is dead give up waiting for it after the startup
//! grace, serve without it, and take it in when it starts.

mod cluster_support;

use std::time::{Duration, Instant};

use cluster_support::{
    batch_on_cluster, batch_with_reference, cluster_status, run_plain, s, spawn_node, start_nodes, stop_nodes, Site,
};

#[test]
fn a_killed_node_started_again_rejoins_and_the_tokens_never_change() {
    let site = Site::with_checkpoint("rejoin", cluster_support::ONE_INSTANCE);
    let mut nodes = start_nodes(&site);
    let (input, want) = batch_with_reference(&site, "Batch request", 6, 24);
    let batch = |name: &str| batch_on_cluster(&site, &input, &want, name);
    batch("before");

    nodes[2].child.kill().unwrap();
    let killed = Instant::now();
    for i in [0, 1, 3] {
        nodes[i].wait_for_since("node node2 down", Some(killed), Duration::from_secs(15));
    }
    batch("without node2");
    let status = |what: &str| {
        let (all_up, text) = cluster_status(&site);
        eprintln!("status {what}:\n{text}");
        (all_up, text)
    };
    let (all_up, text) = status("without node2");
    assert!(!all_up && text.contains("3/4 nodes up"), "{text}");
    let line = |text: &str, node: &str| text.lines().find(|l| l.trim_start().starts_with(node)).unwrap().to_string();
    assert!(line(&text, "node2").contains("unreachable"), "{text}");
    assert!(line(&text, "node0").contains("sees down: [2]"), "{text}");
    // Every routed expert of tiny-v4 (8) is held by a live node, before and after.
    let experts = |text: &str| -> u32 {
        text.lines().filter_map(|l| l.split("experts").nth(1)?.split_whitespace().next()?.parse::<u32>().ok()).sum()
    };
    assert_eq!(experts(&text), 8, "{text}");
    let incarnation = |l: &str| l.split("(incarnation ").nth(1).and_then(|r| r.split(')').next()).map(str::to_string);

    let restarted = Instant::now();
    nodes[2] = spawn_node(&site, 2);
    for i in [0, 1, 3] {
        nodes[i].wait_for_since("node node2 up", Some(restarted), Duration::from_secs(30));
    }
    nodes[2].wait_for("cluster ready", Duration::from_secs(30));
    batch("after node2 rejoined");
    let (all_up, after) = status("after node2 rejoined");
    assert!(all_up && after.contains("4/4 nodes up"), "{after}");
    assert!(!line(&after, "node0").contains("sees down"), "{after}");
    assert!(incarnation(&line(&after, "node2")).is_some(), "{after}");
    assert_eq!(experts(&after), 8, "{after}");
    assert!(!line(&after, "node2").contains("experts    0"), "node2 holds experts again: {after}");
    assert_eq!(incarnation(&line(&after, "node0")), incarnation(&line(&text, "node0")), "node0 never restarted");

    stop_nodes(&mut nodes);
    // The new node2 did work after it rejoined: its experts were put back.
    let text = nodes[2].text();
    let line = text.lines().find(|l| l.contains("stopped; its workers")).expect("node2's summary");
    let answered: u64 = line.split("answered ").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert!(answered > 0, "node2 computed no expert after rejoining: {line}");
    eprintln!("rejoined {line}");
}

/// A rolling restart under continuous load: two instances of two nodes
/// each; every node in turn is drained (no new requests, the running ones
/// finish, it stops), started again and rejoins, while a client keeps
/// sending batches. Not one request fails, and every batch has the tokens
/// of one process.
#[test]
fn a_rolling_restart_of_every_node_under_load_fails_no_request() {
    let site = Site::with_instances("rolling", cluster_support::TWO_INSTANCES);
    let mut nodes = start_nodes(&site);
    let (input, want) = batch_with_reference(&site, "Rolling request", 12, 16);

    // The load: batch after batch until the restarts are done.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (done, topology, input, dir, want) =
            (done.clone(), site.t().to_string(), input.clone(), site.dir.clone(), want.clone());
        std::thread::spawn(move || {
            let mut batches = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) || batches == 0 {
                let out = dir.join(format!("load{batches}.jsonl"));
                let o = run_plain(&["generate", "--topology", &topology, "--input", s(&input), "--output", s(&out)]);
                let got = std::fs::read_to_string(&out).unwrap_or_default();
                assert!(o.status.success(), "batch {batches}: {}", String::from_utf8_lossy(&o.stderr));
                assert_eq!(got, want, "batch {batches}: a failed or changed request");
                batches += 1;
            }
            batches
        })
    };
    for i in 0..4 {
        let name = format!("node{i}");
        let o = run_plain(&["drain", &name, "--topology", site.t(), "--timeout-s", "60"]);
        assert!(o.status.success(), "drain {name}: {}", String::from_utf8_lossy(&o.stderr));
        let code = nodes[i].wait_exit(Duration::from_secs(30));
        assert!(code.success(), "{name} stops cleanly: {code}\n{}", nodes[i].text());
        assert!(nodes[i].text().contains("stopping (drained)"), "{}", nodes[i].text());
        let restarted = Instant::now();
        nodes[i] = spawn_node(&site, i);
        nodes[i].wait_for("cluster ready", Duration::from_secs(30));
        for j in (0..4).filter(|&j| j != i) {
            nodes[j].wait_for_since(&format!("node {name} up"), Some(restarted), Duration::from_secs(30));
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let batches = load.join().expect("every batch under load completed with one process's tokens");
    eprintln!("rolling restart of 4 nodes: {batches} batches of 12 requests under load, 0 failed");
    stop_nodes(&mut nodes);
}

/// Three nodes started while the fourth is dead: past the startup grace
/// they declare it down and serve without it (the tokens of one process);
/// started late, it is heard, rejoins and serves.
#[test]
fn nodes_started_while_one_is_dead_serve_without_it_and_take_it_in_when_it_starts() {
    let site = Site::build_with("late", cluster_support::ONE_INSTANCE, true, "startup_grace_ms = 2000\n");
    let started = Instant::now();
    let mut nodes: Vec<_> = (0..3).map(|i| spawn_node(&site, i)).collect();
    for n in &nodes {
        n.wait_for_since("node node3 down", Some(started), Duration::from_secs(60));
    }
    let (input, want) = batch_with_reference(&site, "Late request", 4, 16);
    let batch = |name: &str| batch_on_cluster(&site, &input, &want, name);
    batch("without node3");
    let (_, text) = cluster_status(&site);
    assert!(text.contains("3/4 nodes up") && text.contains("sees down: [3]"), "{text}");

    let late = Instant::now();
    nodes.push(spawn_node(&site, 3));
    for n in &nodes[..3] {
        n.wait_for_since("node node3 up", Some(late), Duration::from_secs(30));
    }
    nodes[3].wait_for("cluster ready", Duration::from_secs(30));
    batch("with node3");
    let (all_up, text) = cluster_status(&site);
    assert!(all_up && text.contains("4/4 nodes up") && !text.contains("sees down"), "{text}");
    stop_nodes(&mut nodes);
}

/// Expert load balancing while serving, over processes that read their own
/// experts: tables change under a batch (the new copies are read while the
/// old ones serve, the old ones freed), and the tokens are one process's.
#[test]
fn rebalancing_experts_between_processes_moves_weights_and_keeps_the_tokens() {
    let keys = "[cluster.eplb]\nevery_steps = 2\nredundant_experts = 4\nmin_gain = 0.0\n";
    let site = Site::build_with("eplb", cluster_support::ONE_INSTANCE, true, keys);
    let mut nodes = cluster_support::start_nodes(&site);
    let (input, want) = batch_with_reference(&site, "Rebalanced request", 8, 24);
    batch_on_cluster(&site, &input, &want, "eplb");
    let (_, text) = cluster_status(&site);
    eprintln!("{text}");
    let node0 = text.lines().find(|l| l.trim_start().starts_with("node0")).unwrap();
    let epoch: u64 = node0.split("table epoch ").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    assert!(epoch > 0, "the table changed under the batch: {node0}");
    // "read 12.0 KiB, freed 9.0 KiB" on each line: nonzero somewhere.
    let amount = |after: &str| -> f64 {
        text.lines().filter_map(|l| l.split(after).nth(1)?.split_whitespace().next()?.parse::<f64>().ok()).sum()
    };
    let (read, freed) = (amount("weights read "), amount("freed "));
    assert!(read > 0.0 && freed > 0.0, "weights moved (read {read}, freed {freed}): {text}");
    stop_nodes(&mut nodes);
}
