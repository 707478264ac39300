//! A simulated run is a function of its seed: the same seed gives the same
//! event log (digest) twice; another seed changes the interleaving (the
//! digest) but not a single output bit.

mod common;

use std::time::Duration;

use common::{assert_same, model, reference, requests};
use deepinfer_actors::sim::faults::{FaultPlan, MessageAction, MessageRule};
use deepinfer_actors::sim::rng::Seed;
use deepinfer_actors::wire::MsgKind;
use deepinfer_actors::{run_simulated, ClusterConfig, RunReport};

fn run(seed: u64) -> RunReport {
    let m = model();
    let mut cfg = ClusterConfig::new(8, 4);
    cfg.devices_per_node = 4;
    cfg.seed = seed;
    cfg.return_logits = true;
    cfg.keep_events = 200_000;
    cfg.fabric.duplicate = 0.01;
    let mut plan = FaultPlan::random_kill(Seed(seed), 8, 2, 1, 4, m.config.num_layers as u32);
    plan.messages.push(MessageRule {
        kind: MsgKind::ExpertResult,
        action: MessageAction::Delay(Duration::from_micros(40)),
        probability: 0.1,
        max_hits: 50,
    });
    cfg.faults = Some(plan);
    run_simulated(m, cfg, &requests(9, 4)).unwrap()
}

#[test]
fn same_seed_same_digest_other_seeds_same_outputs() {
    let m = model();
    let want = reference(&m, &requests(9, 4));
    let a = run(11);
    let b = run(11);
    assert_same(&a.outputs, &want, "seed 11");
    assert_same(&b.outputs, &want, "seed 11 again");
    if a.digest != b.digest {
        let first = a.log.iter().zip(&b.log).position(|(x, y)| x != y);
        panic!("seed 11 diverged at line {first:?}: {:?} vs {:?}", first.map(|i| &a.log[i]), first.map(|i| &b.log[i]));
    }
    assert_eq!((a.events, a.elapsed, &a.metrics), (b.events, b.elapsed, &b.metrics));
    assert!(a.events > 1000, "a real run: {} events", a.events);

    let mut digests = vec![a.digest];
    for seed in [12, 13, 14] {
        let r = run(seed);
        assert_same(&r.outputs, &want, &format!("seed {seed}"));
        digests.push(r.digest);
    }
    println!("digests: {}", digests.iter().map(|d| format!("{d:016x}")).collect::<Vec<_>>().join(" "));
    let mut unique = digests.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), digests.len(), "different seeds interleave differently");
}

/// The digest does not depend on the process (addresses, hash seeds, actor ids).
#[test]
fn same_seed_same_digest_in_another_process() {
    const CHILD: &str = "DEEPINFER_ACTORS_DIGEST_CHILD";
    let digest = run(11).digest;
    if std::env::var_os(CHILD).is_some() {
        println!("\nDIGEST={digest:016x}");
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "same_seed_same_digest_in_another_process", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let child = stdout.lines().find_map(|l| l.split("DIGEST=").nth(1)).expect("child printed its digest");
    assert_eq!(child, format!("{digest:016x}"));
}
