//! Experiments on the cluster simulator, printed as Markdown tables:
//! expert rebalancing under skewed routing, prefix-affinity routing against
//! round robin on a Mooncake trace, and a prefill:decode ratio sweep.
//!
//! ```sh
//! cargo run --release --example sim_experiments            # all three
//! cargo run --release --example sim_experiments -- eplb    # one of eplb, routing, ratio
//! ```

use std::path::Path;

use deepinfer::scenario::{InstanceKind, Scenario};
use deepinfer::simulate::{run, Report};
use deepinfer_actors::cluster::disagg::PrefillRouting;

fn parse(text: &str) -> Scenario {
    Scenario::parse("experiment.toml", text, Path::new(env!("CARGO_MANIFEST_DIR")).join("simulations").as_path())
        .expect("a valid scenario")
}

fn simulate(s: &Scenario) -> Report {
    let r = run(s, None, false).expect("the run completes");
    assert_eq!(r.requests.lost, 0, "{}: requests lost", s.name);
    r
}

/// Zipf-skewed routing (s = 1.2 per layer) on a saturated decode instance:
/// contiguous experts against DeepSeek's EPLB with redundant slots. The
/// prefill instance is large and balanced in every run, so only decode differs.
fn eplb() {
    let base = parse(
        r#"
[scenario]
name = "eplb-skew"
seed = 11
duration_s = 60
warmup_s = 30
drain_s = 0
hardware = "H200"
model = "V4-Flash"

[[instance]]
role = "prefill"
devices = 32
redundant = 32

[[instance]]
role = "decode"
devices = 16

[engine]
batch_per_device = 128
batch_tokens_per_device = 8192
decode_steps_per_event = 32

[experts]
popularity = "zipf"
zipf_s = 1.2

[traffic]
kind = "poisson"
rate_per_s = 600
input = { dist = "lognormal", median = 1500, sigma = 0.6, min = 64, max = 16384 }
output = { dist = "lognormal", median = 800, sigma = 0.5, min = 64, max = 4096 }
"#,
    );
    println!("### Expert rebalancing on skewed routing (V4-Flash, 32 prefill + 16 decode H200, Zipf s=1.2 per layer, decode saturated)\n");
    println!(
        "| decode placement | decode expert load max/mean | output tok/s per decode GPU | TPOT p50 ms | TPOT p90 ms |"
    );
    println!("|---|---|---|---|---|");
    for (label, redundant) in [("contiguous, no redundancy", 0), ("EPLB, 16 redundant", 16), ("EPLB, 32 redundant", 32)]
    {
        let mut s = base.clone();
        s.redundant_per_instance = vec![Some(32), Some(redundant)];
        let r = simulate(&s);
        println!(
            "| {label} | {:.2} | {:.0} | {:.1} | {:.1} |",
            r.instances[1].expert_imbalance, r.output_tok_s_per_decode_gpu, r.tpot_ms.p50, r.tpot_ms.p90
        );
    }
    println!();
}

/// The Mooncake trace on four colocated instances, each with its own prefix cache.
fn routing() {
    let base = parse(
        r#"
[scenario]
name = "mooncake-routing"
seed = 1
duration_s = 600
drain_s = 120
hardware = "H200"
model = "V4-Flash"

[[instance]]
role = "both"
devices = 8
count = 4

[engine]
batch_per_device = 128
batch_tokens_per_device = 8192
decode_steps_per_event = 8

[traffic]
kind = "mooncake"
trace = "../../shared/traces/mooncake-synthetic.jsonl"
time_scale = 0.5
"#,
    );
    let deepinfer::scenario::Traffic::Mooncake { path, .. } = &base.traffic else { unreachable!() };
    if !path.exists() {
        println!("(routing: {} is not here)\n", path.display());
        return;
    }
    println!("### Prefix-affinity routing against round robin (Mooncake synthetic trace at 2× speed, V4-Flash on 4 × 8 H200)\n");
    println!("| prefill routing | prefix hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | input tok/s per GPU |");
    println!("|---|---|---|---|---|---|");
    for (label, routing) in
        [("round robin", PrefillRouting::RoundRobin), ("cache affinity", PrefillRouting::CacheAffinity)]
    {
        let r = simulate(&Scenario { prefill_routing: routing, ..base.clone() });
        println!(
            "| {label} | {:.1}% | {:.0} | {:.0} | {:.0} | {:.0} |",
            r.prefix_hit_rate * 100.0,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.input_tok_s_per_prefill_gpu
        );
    }
    println!();
}

/// V4.1-Flash on 128 B200 under one offered load, the devices split between
/// a prefill and a decode instance in different ratios.
fn ratio() {
    let base = parse(
        r#"
[scenario]
name = "pd-ratio"
seed = 2
duration_s = 120
warmup_s = 40
drain_s = 0
hardware = "B200"
model = "V4.1-Flash"

[[instance]]
role = "prefill"
devices = 64

[[instance]]
role = "decode"
devices = 64

[engine]
batch_per_device = 256
batch_tokens_per_device = 8192
decode_steps_per_event = 32

[experts]
popularity = "zipf"
zipf_s = 0.6
redundant = 32

[traffic]
kind = "poisson"
rate_per_s = 400
input = { dist = "lognormal", median = 3000, sigma = 0.9, min = 64, max = 65536 }
output = { dist = "lognormal", median = 400, sigma = 0.8, min = 16, max = 8192 }
shared_prefix_tokens = 4096
shared_fraction = 0.5

[slo]
ttft_ms = 3000
tpot_ms = 50
"#,
    );
    println!("### Prefill:decode ratio sweep (V4.1-Flash, 128 B200, 400 requests/s offered)\n");
    println!("| prefill:decode devices | goodput req/s | input tok/s | output tok/s | TTFT p90 ms | TPOT p90 ms | unfinished |");
    println!("|---|---|---|---|---|---|---|");
    let mut best = (0.0, 0);
    for prefill in [32u32, 48, 64, 80, 96] {
        let s = Scenario {
            instances: vec![(InstanceKind::Prefill, prefill), (InstanceKind::Decode, 128 - prefill)],
            ..base.clone()
        };
        let r = simulate(&s);
        println!(
            "| {prefill}:{} | {:.1} | {:.0} | {:.0} | {:.0} | {:.1} | {} |",
            128 - prefill,
            r.goodput_req_s,
            r.input_tok_s,
            r.output_tok_s,
            r.ttft_ms.p90,
            r.tpot_ms.p90,
            r.requests.unfinished
        );
        if r.goodput_req_s > best.0 {
            best = (r.goodput_req_s, prefill);
        }
    }
    println!("\nBest ratio by goodput: {}:{} ({:.1} req/s within the SLOs).\n", best.1, 128 - best.1, best.0);
}

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let only = std::env::args().nth(1);
    let want = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if want("eplb") {
        eplb();
    }
    if want("routing") {
        routing();
    }
    if want("ratio") {
        ratio();
    }
}
