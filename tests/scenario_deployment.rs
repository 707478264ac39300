//! The deployment keys of a scenario: weight and KV formats, the scale-up
//! domain apart from the node, each instance's batch limits and weight
//! offload — parsed with their defaults, refused with the file, line and key
//! when wrong, and carried into the modelled devices' figures.

use std::path::Path;

use deepinfer::scenario::Scenario;
use deepinfer::simulate::cluster_config;
use deepinfer_actors::cluster::topology::Topology;
use deepinfer_actors::modelled::devices::{Modelled, ModelledError};
use deepinfer_engine::cost::{KvFormat, SeqWork, WeightFormat};

/// A GB200 rack: a 48-GPU decode instance, then a 2-GPU prefill one; `extra`
/// lines go into the tables they name.
fn rack(scenario: &str, decode: &str, prefill: &str, engine: &str, experts: &str) -> String {
    format!(
        r#"[scenario]
name = "rack"
duration_s = 10
hardware = "GB200"
model = "DeepSeek-V3"
devices_per_node = 2
{scenario}

[[instance]]
role = "decode"
devices = 48
{decode}

[[instance]]
role = "prefill"
devices = 2
redundant = 0
{prefill}

[engine]
{engine}

[experts]
redundant = 32
{experts}

[traffic]
kind = "poisson"
rate_per_s = 1
input = {{ dist = "fixed", value = 2000 }}
output = {{ dist = "fixed", value = 16 }}
"#
    )
}

fn parse(text: &str) -> Result<Scenario, String> {
    Scenario::parse("rack.toml", text, Path::new(".")).map_err(|e| e.to_string())
}

fn modelled(s: &Scenario) -> Result<Modelled, ModelledError> {
    let spec = cluster_config(s, s.seed).modelled.expect("a modelled cluster");
    let sizes: Vec<u32> = s.instances.iter().map(|&(_, d)| d).collect();
    Modelled::new(spec, &Topology::with_sizes(s.devices_per_node, &sizes))
}

#[test]
fn the_scale_up_domain_defaults_to_the_hardwares_in_whole_nodes() {
    let s = parse(&rack("", "", "offload_gib = 40", "", "")).unwrap();
    assert_eq!((s.devices_per_node, s.scale_up_domain), (2, 72));
    let b200 = rack("", "", "offload_gib = 40", "", "").replace("GB200", "B200");
    assert_eq!(parse(&b200).unwrap().scale_up_domain, 8);
    let given = parse(&rack("scale_up_domain = 36", "", "offload_gib = 40", "", "")).unwrap();
    assert_eq!(given.scale_up_domain, 36);
    let err = parse(&rack("scale_up_domain = 35", "", "", "", "")).unwrap_err();
    assert!(err.contains("rack.toml:7") && err.contains("scale_up_domain") && err.contains("multiple"), "{err}");
}

#[test]
fn formats_parse_and_a_cache_the_model_has_no_layout_for_is_refused_by_line() {
    let s = parse(&rack(
        "",
        "",
        "offload_gib = 40",
        "kv_dtype = \"fp8\"\nattention_precision = \"bf16\"",
        "precision = \"nvfp4\"",
    ))
    .unwrap();
    assert_eq!(s.precision.kv, Some(KvFormat::Fp8));
    assert_eq!(s.precision.dense, Some(WeightFormat::Bf16));
    assert_eq!(s.precision.experts, Some(WeightFormat::Nvfp4));
    let plain = parse(&rack("", "", "offload_gib = 40", "", "")).unwrap();
    assert_eq!((plain.precision.kv, plain.precision.experts, plain.precision.dense), (None, None, None));

    let err = parse(&rack("", "", "", "kv_dtype = \"fp4\"", "")).unwrap_err();
    assert!(err.contains("kv_dtype") && err.contains("DeepSeek-V3 keeps its KV cache in bf16 or fp8"), "{err}");
    let err = parse(&rack("", "", "", "", "precision = \"int4\"")).unwrap_err();
    assert!(err.contains("experts.precision") && err.contains("unknown `int4`"), "{err}");
    let err = parse(&rack("", "", "offload_gib = -1", "", "")).unwrap_err();
    assert!(err.contains("offload_gib") && err.contains("0 or more"), "{err}");
    let err = parse(&rack("", "batch_per_device = 0", "", "", "")).unwrap_err();
    assert!(err.contains("instance.batch_per_device") && err.contains("1 to 4096"), "{err}");
}

/// SGLang's 2-GPU prefill instance of V3 with NVFP4 experts does not hold
/// its weights in HBM; with part of its experts in the Grace's memory it
/// does, and every step streams that part over the host link.
#[test]
fn offloaded_experts_fit_a_small_instance_and_cost_host_link_time() {
    let fp4 = |prefill: &str| rack("", "", prefill, "kv_dtype = \"fp8\"", "precision = \"nvfp4\"");
    let err = modelled(&parse(&fp4("")).unwrap()).unwrap_err();
    assert!(matches!(err, ModelledError::NoMemory { instance: 1, .. }), "{err}");
    let too_much = modelled(&parse(&fp4("offload_gib = 500")).unwrap()).unwrap_err();
    assert!(too_much.to_string().contains("routed experts"), "{too_much}");
    // FP8 experts: 318 GiB of them per device, more than a Grace keeps for one GPU.
    let fp8 = rack("", "", "offload_gib = 300", "", "");
    let no_host = modelled(&parse(&fp8).unwrap()).unwrap_err();
    assert!(no_host.to_string().contains("of host memory"), "{no_host}");

    let prefill_step = |offload: &str| {
        let m = modelled(&parse(&fp4(offload)).unwrap()).unwrap_or_else(|e| panic!("{e}"));
        let work = vec![SeqWork { new_tokens: 2000, context: 0 }; 8];
        (m.offloaded_share(1), m.kv_bytes_per_device(1), m.step(1, 2, &work, 32_000, 0).total_us)
    };
    let (share_a, kv_a, us_a) = prefill_step("offload_gib = 30");
    let (share_b, kv_b, us_b) = prefill_step("offload_gib = 60");
    assert!(share_a > 0.1 && share_b > share_a, "{share_a} {share_b}");
    // More in host memory: more HBM for KV, a slower step.
    assert!(kv_b > kv_a && us_b > us_a, "{kv_a} {kv_b} {us_a} {us_b}");
}

/// The 48-GPU decode group sits inside the rack's NVLink domain: its
/// all-to-all never crosses the scale-out network. Split over two domains of
/// 24 it does, and its decode step is slower.
#[test]
fn a_group_inside_one_domain_dispatches_over_nvlink_only() {
    let decode_us = |scenario: &str| {
        let s = parse(&rack(scenario, "", "offload_gib = 40", "", "precision = \"nvfp4\"")).unwrap();
        let m = modelled(&s).unwrap_or_else(|e| panic!("{e}"));
        let work = vec![SeqWork { new_tokens: 1, context: 2000 }; 256];
        (m.scale_up_domain(0), m.step(0, 48, &work, 256, 0).network_us)
    };
    let (rack_domain, rack_us) = decode_us("");
    let (split_domain, split_us) = decode_us("scale_up_domain = 24");
    assert_eq!((rack_domain, split_domain), (48, 24));
    assert!(split_us > 2.0 * rack_us, "{rack_us} {split_us}");
}

#[test]
fn an_instance_batch_limit_overrides_the_engines() {
    let prefill = "offload_gib = 40\nbatch_tokens_per_device = 16384";
    let s = parse(&rack("", "batch_per_device = 1408", prefill, "", "precision = \"nvfp4\"")).unwrap();
    assert_eq!(s.instance_limits[0].batch_per_device, Some(1408));
    assert_eq!(s.instance_limits[1].batch_tokens_per_device, Some(16384));
    assert_eq!(s.instance_limits[1].batch_per_device, None);
    let cfg = cluster_config(&s, 0);
    let m = modelled(&s).unwrap();
    let shape = deepinfer_engine::presets::Preset::TinyV4.config();
    let layout = deepinfer_engine::kv_pool::KvLayout::new(&shape, 512, cfg.engine.window_block_tokens).unwrap();
    let decode = m.engine_for(&cfg.engine, &layout, 48, 0);
    let prefill = m.engine_for(&cfg.engine, &layout, 2, 1);
    assert_eq!(decode.max_batch_size, (1408 * 48).min(deepinfer_engine::scheduler::MAX_BATCH_SIZE));
    assert_eq!(prefill.max_batch_size, 128 * 2);
    assert_eq!(prefill.max_batch_tokens, 16384 * 2);
    assert_eq!(decode.max_batch_tokens, 8192 * 48);
}
