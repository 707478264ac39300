//! Image traffic in simulation: drawn deterministically from the seed;
//! encoder instances queue less as they are added; a recurring image hits
//! the encoder cache; without an encoder instance the prefill instances
//! carry the encoding; a model without a vision tower refuses images with
//! the file, line and key; `plan` chooses an encoder count.

use std::path::Path;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::capacity::Criteria;
use deepinfer::simulate::plan::{plan, PlanSpace, Search};
use deepinfer::simulate::{self, cluster_config, Report};
use deepinfer_actors::cluster::topology::Topology;
use deepinfer_actors::modelled::devices::Modelled;
use deepinfer_engine::cost::vision::VisionCost;
use deepinfer_engine::cost::{Efficiency, HardwareKind, ModelKind, SeqWork};

/// V4.1-Flash on one colocated B200 node, most requests with images, `{ENCODERS}` encoder instances.
const BASE: &str = r#"
[scenario]
name = "images-small"
seed = 3
duration_s = 4
drain_s = 10
hardware = "B200"
model = "V4.1-Flash"
devices_per_node = 8

[[instance]]
role = "both"
devices = 8
{ENCODERS}
[engine]
batch_per_device = 32
batch_tokens_per_device = 4096
decode_steps_per_event = 8

[traffic]
kind = "poisson"
rate_per_s = 60
input = { dist = "lognormal", median = 256, sigma = 0.5, min = 16, max = 2048 }
output = { dist = "fixed", value = 16 }

[images]
share = 0.8
per_request = { dist = "uniform", min = 1, max = 3 }
sizes = [{ size = "1920x1080", weight = 2 }, { size = "800x600", weight = 1 }]
repeat_share = {REPEAT}
pool = 8

[slo]
ttft_ms = 2000
tpot_ms = 100
"#;

fn text(encoders: u32, repeat: f64) -> String {
    let e = if encoders == 0 {
        String::new()
    } else {
        format!("\n[[instance]]\nrole = \"encoder\"\ndevices = 1\ncount = {encoders}\ncache_gib = 2\n")
    };
    BASE.replace("{ENCODERS}", &e).replace("{REPEAT}", &repeat.to_string())
}

fn scenario(encoders: u32, repeat: f64) -> Scenario {
    Scenario::parse("images.toml", &text(encoders, repeat), Path::new(".")).unwrap_or_else(|e| panic!("{e}"))
}

fn run(s: &Scenario, seed: Option<u64>) -> Report {
    simulate::run(s, seed, false).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn image_traffic_is_deterministic_by_seed() {
    let s = scenario(2, 0.3);
    let a = run(&s, None);
    let b = run(&s, None);
    assert_eq!(a.to_json(), b.to_json());
    let e = a.encoders.as_ref().expect("an encoders section");
    assert!(e.images > 0 && e.image_tokens > 0 && e.total.encoded > 0, "{e:?}");
    assert_eq!(a.requests.lost, 0);
    let c = run(&s, Some(99));
    assert_ne!(a.encoders, c.encoders, "another seed draws other images");
    assert!(a.to_markdown().contains("## Image encoders"));
    assert!(a.series.iter().any(|p| p.images_s > 0.0 && p.images_ready_max_ms > 0.0), "{:?}", a.series);
    assert!(a.to_json().contains("\"images_ready_max_ms\""));
}

#[test]
fn more_encoders_queue_less_under_the_same_load() {
    let one = run(&scenario(1, 0.0), None);
    let three = run(&scenario(3, 0.0), None);
    let (e1, e3) = (one.encoders.unwrap(), three.encoders.unwrap());
    assert_eq!(e1.images, e3.images, "the same traffic");
    assert!(e1.total.utilisation > 2.0 * e3.total.utilisation, "{} vs {}", e1.total.utilisation, e3.total.utilisation);
    assert!(e1.total.queue_wait_ms.p99 > e3.total.queue_wait_ms.p99, "{:?} vs {:?}", e1.total, e3.total);
    assert!(e1.images_ready_ms.p99 > e3.images_ready_ms.p99);
    assert_eq!(e3.instances.len(), 3);
    assert!(e3.instances.iter().all(|i| i.images > 0), "the balancer uses every encoder: {:?}", e3.instances);
}

#[test]
fn recurring_images_hit_the_encoder_cache() {
    let fresh = run(&scenario(2, 0.0), None).encoders.unwrap();
    let recurring = run(&scenario(2, 1.0), None).encoders.unwrap();
    assert_eq!(fresh.total.cache_hits, 0, "unique images never hit");
    // Eight pool images, hundreds of uses: all but the first use of each on each encoder hit.
    assert!(recurring.total.cache_hit_rate > 0.9, "{:?}", recurring.total);
    assert!(recurring.total.encoded <= 16, "{:?}", recurring.total);
    assert!(recurring.total.utilisation < fresh.total.utilisation);
}

#[test]
fn without_an_encoder_instance_the_prefill_instance_carries_the_encoding() {
    let s = Scenario::parse(
        "images.toml",
        &text(0, 0.0).replace(
            r#"sizes = [{ size = "1920x1080", weight = 2 }, { size = "800x600", weight = 1 }]"#,
            r#"sizes = [{ size = "1920x1080" }]"#,
        ),
        Path::new("."),
    )
    .unwrap();
    let r = run(&s, None);
    let e = r.encoders.unwrap();
    assert_eq!(e.mode, "colocated");
    assert!(e.instances.is_empty());
    let v = VisionCost::of(ModelKind::V41Flash).unwrap();
    let plan = v.plan(1920, 1080).unwrap();
    let each_s = v.encode_us(&plan, &HardwareKind::B200.spec(), Efficiency::for_hardware(HardwareKind::B200)) / 1e6;
    assert!((e.colocated_encode_device_s - e.images as f64 * each_s).abs() < 1e-6, "{e:?}");
    assert_eq!(e.images_ready_ms.p99, 0.0, "nothing waits before prefill");
    assert_eq!(e.image_tokens, e.images * plan.tokens() as u64);
}

#[test]
fn colocated_encoding_lengthens_the_next_prefill_step_once_and_no_decode_step() {
    let s = scenario(0, 0.0);
    let spec = cluster_config(&s, s.seed).modelled.expect("a modelled cluster");
    let m = Modelled::new(spec, &Topology::with_sizes(8, &[8])).unwrap();
    let prefill = [SeqWork { new_tokens: 2048, context: 0 }];
    let decode = [SeqWork { new_tokens: 1, context: 2048 }; 16];
    let (p0, d0) = (m.step(0, 8, &prefill, 2048, 0).total_us, m.step(0, 8, &decode, 16, 0).total_us);
    m.add_colocated_encode(0, 3000.0);
    assert_eq!(m.step(0, 8, &decode, 16, 0).total_us, d0, "a decode step leaves it");
    let with = m.step(0, 8, &prefill, 2048, 0).total_us;
    assert!((with - p0 - 3000.0).abs() < 1e-6, "{with} vs {p0}");
    assert_eq!(m.step(0, 8, &prefill, 2048, 0).total_us, p0, "taken once");
}

#[test]
fn a_model_without_a_vision_tower_refuses_images_naming_file_line_and_key() {
    for model in ["V4-Flash", "DeepSeek-V3"] {
        let t = text(0, 0.0).replace("\"V4.1-Flash\"", &format!("\"{model}\""));
        let e = Scenario::parse("text-only.toml", &t, Path::new(".")).unwrap_err().to_string();
        let line = t.lines().position(|l| l.starts_with("per_request")).unwrap() + 1;
        assert!(e.contains(&format!("text-only.toml:{line}")), "{e}");
        assert!(e.contains("per_request") && e.contains("no vision tower"), "{e}");
        let t = text(1, 0.0).replace("\"V4.1-Flash\"", &format!("\"{model}\"")).replace("[images]", "[unused]");
        let t = t.split("[unused]").next().unwrap().to_string() + "[slo]\nttft_ms = 2000\n";
        let e = Scenario::parse("text-only.toml", &t, Path::new(".")).unwrap_err().to_string();
        assert!(e.contains("role") && e.contains("no vision tower"), "{e}");
    }
    let bad = text(1, 0.0).replace("800x600", "800by600");
    let e = Scenario::parse("images.toml", &bad, Path::new(".")).unwrap_err().to_string();
    assert!(e.contains("sizes") && e.contains("800by600"), "{e}");
}

#[test]
fn plan_chooses_an_encoder_count() {
    let s = scenario(1, 0.0);
    let space = PlanSpace {
        gpus: 8,
        prefill_sizes: vec![],
        decode_sizes: vec![],
        colocated_sizes: vec![8],
        redundant: vec![0],
        cache_tiers: vec![],
        kv_dtypes: vec![],
        encoders: vec![0, 1, 2],
    };
    let search = Search { seed: None, criteria: Criteria::default(), steps: 1, threads: 3, progress_every_s: None };
    let p = plan(&s, &space, 2.0, search, |_| {}).unwrap();
    let labels: Vec<&str> = p.candidates.iter().map(|c| c.layout.label.as_str()).collect();
    assert_eq!(p.candidates.len(), 3, "{labels:?}");
    assert!(labels[0].contains("images on prefill") && labels[1].contains("1×E1") && labels[2].contains("2×E1"));
    assert_eq!(p.candidates[2].layout.gpus, 10, "encoder GPUs count");
    let chosen = p.chosen.expect("a layout held a load");
    assert_eq!(p.chosen_encoders, Some(p.candidates[chosen].layout.encoders));
    assert!(p.to_markdown().contains("Chosen: **"), "{}", p.to_markdown());
}
