use super::*;

#[test]
fn deepseek_r1_is_costed_as_v3() {
    for name in ["DeepSeek-R1", "deepseek-r1"] {
        assert_eq!(ModelKind::from_name(name), Some(ModelKind::DeepSeekV3), "{name}");
    }
    assert_eq!(ModelKind::from_name("DeepSeek-R2"), None);
}

#[test]
fn parameter_counts_match_the_published_sizes() {
    let v3 = ModelKind::DeepSeekV3.cost();
    // 671B total, 37B active (DeepSeek-V3 report).
    assert!((v3.total_params() / 1e9 - 671.0).abs() < 10.0, "{}", v3.total_params() / 1e9);
    assert!((v3.active_params() / 1e9 - 37.5).abs() < 2.0, "{}", v3.active_params() / 1e9);
    let flash = ModelKind::V4Flash.cost();
    // V4-Flash: 284B total, 13B active.
    assert!((flash.total_params() / 1e9 - 284.0).abs() < 10.0, "{}", flash.total_params() / 1e9);
    assert!((flash.active_params() / 1e9 - 13.0).abs() < 1.5, "{}", flash.active_params() / 1e9);
    // V4.1-Flash: about 552B parameters; its checkpoint holds 510 GB, of which the
    // FP4 experts and the two FP8 Engram tables (memory read by row, not parameters
    // that compute) are most.
    let next = ModelKind::V41Flash.cost();
    assert!((540.0..565.0).contains(&(next.total_params() / 1e9)), "{}", next.total_params() / 1e9);
    let bytes =
        next.expert_weight_bytes_all_layers() * next.experts as f64 + next.dense_weight_bytes() + next.table_bytes();
    assert!((480.0..540.0).contains(&(bytes / 1e9)), "{} GB", bytes / 1e9);
}

#[test]
fn compressed_attention_keeps_a_fraction_of_mla_kv() {
    let v3 = ModelKind::DeepSeekV3.cost();
    let flash = ModelKind::V4Flash.cost();
    let ctx = 1 << 20;
    let ratio = flash.kv_bytes_per_sequence(ctx) / v3.kv_bytes_per_sequence(ctx);
    assert!(ratio < 0.15, "V4-Flash holds {ratio:.3} of V3's KV at 1M tokens");
    // Attention work per decode token grows with the context for MLA, barely for V4.
    let growth = |m: &ModelCost| m.attention_flops(1, 131_072) / m.attention_flops(1, 4096);
    assert!(growth(&v3) > 25.0 && growth(&flash) < 8.0, "{} {}", growth(&v3), growth(&flash));
}

fn decode_step(batch: usize, context: usize, ep: usize) -> DeviceStep {
    let v3 = ModelKind::DeepSeekV3.cost();
    // Token-expert pairs spread evenly over the EP group's devices.
    let pairs = batch * v3.experts_per_token;
    DeviceStep {
        sequences: vec![SeqWork { new_tokens: 1, context }; batch],
        expert_tokens: pairs,
        experts_hit: (v3.experts + 32).div_ceil(ep),
        expert_parallel: ep,
        scale_up_domain: 8,
        offloaded_expert_share: 0.0,
    }
}

#[test]
fn cost_grows_with_work_and_faster_hardware_is_faster() {
    let v4 = ModelKind::V4Flash.cost();
    let e = Efficiency::default();
    let small = decode_step(16, 4096, 64);
    let large = decode_step(128, 4096, 64);
    for kind in HardwareKind::ALL {
        let hw = kind.spec();
        assert!(step_cost(&hw, &v4, &large, e).total_us > step_cost(&hw, &v4, &small, e).total_us, "{kind:?}");
    }
    let h800 = step_cost(&HardwareKind::H800.spec(), &v4, &large, e).total_us;
    let b200 = step_cost(&HardwareKind::B200.spec(), &v4, &large, e).total_us;
    assert!(b200 < h800);
    let idle = DeviceStep {
        sequences: vec![],
        expert_tokens: 0,
        experts_hit: 0,
        expert_parallel: 8,
        scale_up_domain: 8,
        offloaded_expert_share: 0.0,
    };
    assert_eq!(step_cost(&HardwareKind::H200.spec(), &v4, &idle, e).total_us, 0.0);
}

#[test]
fn names_round_trip() {
    for k in HardwareKind::ALL {
        assert_eq!(HardwareKind::from_name(k.name()), Some(k));
    }
    for m in ModelKind::ALL {
        assert_eq!(ModelKind::from_name(m.cost().name), Some(m));
    }
}

#[test]
fn published_operating_points_are_within_their_bounds() {
    use calibration::points;
    for p in points() {
        let bound = p.bound;
        assert!(p.error().abs() <= bound, "{} {}: {:.0} against {:.0}", p.source, p.what, p.modelled, p.published);
    }
}

/// The one fitted constant: of the overlaps in [0, 1], the default is the
/// one closest to DeepSeek's decode operating point.
#[test]
fn the_default_overlap_is_the_fit_on_deepseeks_decode() {
    let error = |overlap: f64| {
        let eff = Efficiency { overlap, ..Efficiency::default() };
        calibration::hopper_points(eff)[0].error().abs()
    };
    let best = (0..=20).map(|i| i as f64 / 20.0).min_by(|a, b| error(*a).total_cmp(&error(*b))).unwrap();
    assert_eq!(best, Efficiency::default().overlap);
}

/// Causal attention: each prompt token attends to the ones before it, so a
/// longer prompt costs more per token, on every model (less on the
/// compressed-attention ones, whose per-token work is bounded).
#[test]
fn prefill_cost_per_token_grows_with_input_length() {
    let e = Efficiency::default();
    for (model, hw, ep) in [
        (ModelKind::DeepSeekV3, HardwareKind::H800, 32),
        (ModelKind::V4Flash, HardwareKind::H200, 16),
        (ModelKind::V41Flash, HardwareKind::B200, 64),
    ] {
        let m = model.cost();
        let per_token_us = |length: usize| {
            let step = calibration::prefill_step(&m, ep, length);
            let tokens: usize = step.sequences.iter().map(|s| s.new_tokens).sum();
            step_cost(&hw.spec(), &m, &step, e).total_us / tokens as f64
        };
        let costs: Vec<f64> = [1024, 2048, 4096, 16_384].into_iter().map(per_token_us).collect();
        assert!(costs.windows(2).all(|w| w[1] > w[0]), "{model:?}: {costs:?}");
    }
    // V3's MLA grows the way SGLang measured it: 4K prompts at 0.87 of 1K's rate.
    let ratio = calibration::prefill_per_node(HardwareKind::H100, 32, 4096, e)
        / calibration::prefill_per_node(HardwareKind::H100, 32, 1024, e);
    assert!((0.85..0.95).contains(&ratio), "{ratio}");
}
