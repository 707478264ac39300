use super::*;

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
        devices_per_node: 8,
    }
}

/// DeepSeek's published V3/R1 decode deployment (H800, EP144): 20–22 tokens/s
/// per user and about 14.8k output tokens/s per 8-GPU node. The roofline should
/// land within a factor of two of that with a plausible batch.
#[test]
fn v3_decode_on_h800_is_near_the_published_operating_point() {
    let hw = HardwareKind::H800.spec();
    let v3 = ModelKind::DeepSeekV3.cost();
    let batch = 96;
    let cost = step_cost(&hw, &v3, &decode_step(batch, 4096, 144), Efficiency::default());
    let per_user = 1e6 / cost.total_us;
    let per_node = 8.0 * batch as f64 * per_user;
    assert!((10.0..45.0).contains(&per_user), "{per_user:.1} tok/s per user, {cost:?}");
    assert!((7_000.0..30_000.0).contains(&per_node), "{per_node:.0} tok/s per node, {cost:?}");
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
    let idle =
        DeviceStep { sequences: vec![], expert_tokens: 0, experts_hit: 0, expert_parallel: 8, devices_per_node: 8 };
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
