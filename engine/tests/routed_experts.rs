//! A model loaded with its routed experts left in the checkpoint reads each
//! expert on its own, and computes exactly what the whole model computes:
//! over published naming (FP4/FP8), transformers' fused experts (a sharded
//! save_pretrained) and V4.1, every expert of every main layer.

use std::path::PathBuf;

use deepinfer_engine::model::{Model, RoutedExperts};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle").join(name)
}

/// Seeded rows in [-1, 1).
fn rows(len: usize, salt: u64) -> Vec<f32> {
    let mut s = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn main_layers(model: &Model) -> usize {
    model.v41.as_ref().map_or(model.config.num_layers, |m| m.config.n_layers)
}

fn check(name: &str) {
    let dir = fixture(name);
    let whole = Model::load(&dir).unwrap();
    let sharded = Model::load_with(&dir, RoutedExperts::Elsewhere, None).unwrap();
    assert!(whole.routed_resident() && !sharded.routed_resident());
    match &sharded.v41 {
        Some(m) => assert!(m.weights.blocks.iter().all(|b| b.moe.experts.is_empty())),
        None => assert!(sharded.weights.blocks.iter().all(|b| b.moe.experts.is_empty())),
    }
    let d = whole.config.hidden_size;
    let n = 3;
    for e in 0..whole.config.n_routed_experts as u32 {
        let shared = whole.routed_expert(e).unwrap();
        let read = sharded.routed_expert(e).unwrap();
        assert!(!shared.read && read.read, "{name}: expert {e}");
        assert_eq!(shared.bytes, read.bytes, "{name}: expert {e} bytes");
        assert!(read.bytes > 0);
        for layer in 0..main_layers(&whole) {
            if whole.v41.as_ref().is_some_and(|m| e as usize >= m.config.moe_config(layer).0) {
                continue;
            }
            let x = rows(n * d, (e as u64) << 8 | layer as u64);
            let w = rows(n, 99 + e as u64).iter().map(|v| v.abs() + 0.1).collect::<Vec<_>>();
            let engine = whole.expert_forward_weighted(layer, e as usize, &x, &w);
            let from_shared = whole.routed_forward(&shared, layer, &x, &w);
            let from_read = sharded.routed_forward(&read, layer, &x, &w);
            assert_eq!(engine.len(), n * d);
            assert!(engine == from_shared && engine == from_read, "{name}: expert {e} layer {layer} differs");
        }
    }
}

#[test]
fn an_expert_read_alone_computes_what_the_whole_model_computes_in_published_naming() {
    check("tiny-v4");
}

#[test]
fn an_expert_read_alone_from_fused_sharded_tensors_computes_the_same() {
    check("save-pretrained");
}

#[test]
fn a_v41_expert_read_alone_computes_the_same() {
    check("v41/r1-first-bf16");
}

#[test]
fn a_model_whose_experts_live_elsewhere_refuses_to_run_them_itself() {
    let sharded = Model::load_with(&fixture("tiny-v4"), RoutedExperts::Elsewhere, None).unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let x = vec![0.0; sharded.config.hidden_size];
        sharded.expert_forward(2, 0, &x)
    }));
    assert!(result.is_err());
}
