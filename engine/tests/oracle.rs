//! The forward pass against the reference implementation: logits recorded by
//! `tools/oracle/make_fixtures.py` (the tiny-v4 preset) and `tools/oracle/make_sweep.py`
//! (a sweep of configs unlike it) from `transformers` 5.23.0 (`DeepseekV4ForCausalLM`,
//! float32) on the same checkpoints.

use std::path::{Path, PathBuf};

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::model::{Chunk, LogitsWanted, Model, MtpChunk};

/// Relative tolerance: max |Δ logit| ≤ TOLERANCE × max |reference logit|.
const TOLERANCE: f32 = 1e-4;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle/tiny-v4")
}

struct Reference {
    tensors: Checkpoint,
}

impl Reference {
    fn load() -> Self {
        Self::load_from(&fixture_dir())
    }
    fn load_from(dir: &Path) -> Self {
        let path = dir.join("reference.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { tensors: Checkpoint::from_bytes(&path.display().to_string(), bytes.into()).unwrap() }
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let t = self.tensors.get(name).unwrap();
        let shape = t.shape.to_vec();
        self.tensors.int_tensor(name, &shape).unwrap().into_iter().map(|v| v as u32).collect()
    }
    fn floats(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let t = self.tensors.get(name).unwrap();
        let shape = t.shape.to_vec();
        (self.tensors.f32_tensor(name, &shape).unwrap(), shape)
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains(name)
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (worst, at) = got
        .iter()
        .zip(want)
        .enumerate()
        .map(|(i, (g, w))| ((g - w).abs(), i))
        .fold((0.0f32, 0), |a, b| if b.0 > a.0 { b } else { a });
    eprintln!("{what}: max |Δ| = {worst:.3e} (relative {:.3e}), max |logit| = {max_ref:.3}", worst / max_ref);
    assert!(
        worst <= TOLERANCE * max_ref,
        "{what}: max |Δ logit| {worst:e} at {at} (got {}, want {}) exceeds {TOLERANCE:e} × {max_ref}",
        got[at],
        want[at]
    );
}

#[test]
fn prefill_and_decode_logits_match_transformers() {
    check_preset(&Model::load(&fixture_dir()).expect("fixture checkpoint loads"));
}

/// The same checks with the forward pass on the device (the emulated one, or
/// the GPU `DEEPINFER_TEST_DEVICE=cuda` names).
#[test]
fn on_the_device_prefill_and_decode_logits_match_transformers() {
    let model = Model::load(&fixture_dir()).expect("fixture checkpoint loads");
    check_preset(&model.on_device(&deepinfer_cuda::test_gpu()).expect("the model goes on the device"));
}

fn check_preset(model: &Model) {
    let reference = Reference::load();
    let mut prompts = 0;
    for i in 0.. {
        let prefix = format!("p{i}");
        if !reference.has(&format!("{prefix}.input_ids")) {
            break;
        }
        prompts += 1;
        let ids = reference.ids(&format!("{prefix}.input_ids"));
        let (want, _) = reference.floats(&format!("{prefix}.prefill_logits"));
        let mut state = model.new_state();
        let out = model.forward(&mut [Chunk::new(&ids, &mut state)], LogitsWanted::All, false);
        assert_close(&format!("{prefix} prefill ({} tokens)", ids.len()), &out[0].logits, &want);

        let steps = reference.ids(&format!("{prefix}.decode_tokens"));
        let (want, shape) = reference.floats(&format!("{prefix}.decode_logits"));
        let vocab = shape[1];
        // Step k feeds decode_tokens[k]: the greedy pick of the previous logits.
        assert_eq!(steps[0], argmax(&out[0].logits[(ids.len() - 1) * vocab..]), "{prefix}: greedy pick after prefill");
        for (k, &fed) in steps.iter().enumerate() {
            let out = model.forward(&mut [Chunk::new(&[fed], &mut state)], LogitsWanted::Last, false);
            assert_close(&format!("{prefix} decode step {k}"), &out[0].logits, &want[k * vocab..(k + 1) * vocab]);
            if let Some(&next) = steps.get(k + 1) {
                assert_eq!(argmax(&out[0].logits), next, "{prefix} decode step {k}: greedy pick");
            }
        }
    }
    assert!(prompts >= 3, "reference has {prompts} prompts");
}

#[test]
fn mtp_logits_match_transformers_building_blocks() {
    let model = Model::load(&fixture_dir()).expect("fixture checkpoint loads");
    let reference = Reference::load();
    let ids = reference.ids("p1.input_ids");
    let (want, _) = reference.floats("p1.mtp_logits");
    let mut state = model.new_state();
    let out = model.forward(&mut [Chunk::new(&ids, &mut state)], LogitsWanted::None, true);
    let width = model.config.hc_mult * model.config.hidden_size;
    let n = ids.len() - 1;
    let logits = model.mtp_forward(&mut [MtpChunk {
        streams: &out[0].streams[..n * width],
        next_tokens: &ids[1..],
        state: &mut state,
    }]);
    assert_close("p1 MTP", &logits[0], &want);
}

/// Every config of the sweep: prefill logits at the stored rows, then 16 cached
/// decode steps fed the reference's greedy tokens, each within the tolerance, and
/// every greedy pick equal.
#[test]
fn sweep_of_configs_matches_transformers() {
    let root = oracle_root().join("sweep");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "the sweep has {} configs", dirs.len());
    check_sweep(&dirs, false);
}

/// The sweep with the forward pass on the device.
#[test]
fn on_the_device_sweep_of_configs_matches_transformers() {
    let root = oracle_root().join("sweep");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists())
        .collect();
    dirs.sort();
    check_sweep(&dirs, true);
}

fn check_sweep(dirs: &[PathBuf], on_device: bool) {
    let mut failures = Vec::new();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let result = std::panic::catch_unwind(|| check_sweep_config(dir, on_device));
        if result.is_err() {
            failures.push(name);
        }
    }
    assert!(failures.is_empty(), "configs that leave the reference: {failures:?}");
}

fn oracle_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle")
}

fn check_sweep_config(dir: &Path, on_device: bool) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let mut model = Model::load(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    if on_device {
        model = model.on_device(&deepinfer_cuda::test_gpu()).unwrap_or_else(|e| panic!("{name} on the device: {e}"));
    }
    check_against_reference(&model, &Reference::load_from(dir), &name);
}

/// Prefill logits at the stored rows, then cached decode steps fed the reference's
/// greedy tokens (at least 16), each within the tolerance, every greedy pick equal.
fn check_against_reference(model: &Model, reference: &Reference, name: &str) {
    let vocab = model.config.vocab_size;
    for i in 0.. {
        let prefix = format!("p{i}");
        if !reference.has(&format!("{prefix}.input_ids")) {
            assert!(i > 0, "{name}: no prompts");
            break;
        }
        let ids = reference.ids(&format!("{prefix}.input_ids"));
        let rows = reference.ids(&format!("{prefix}.prefill_rows"));
        let (want, _) = reference.floats(&format!("{prefix}.prefill_logits"));
        let mut state = model.new_state();
        let out = model.forward(&mut [Chunk::new(&ids, &mut state)], LogitsWanted::All, false);
        let got: Vec<f32> =
            rows.iter().flat_map(|&r| out[0].logits[r as usize * vocab..][..vocab].iter().copied()).collect();
        assert_close(&format!("{name} {prefix} prefill ({} tokens)", ids.len()), &got, &want);

        let steps = reference.ids(&format!("{prefix}.decode_tokens"));
        let (want, _) = reference.floats(&format!("{prefix}.decode_logits"));
        assert!(steps.len() >= 16, "{name}: {} decode steps", steps.len());
        let last = &out[0].logits[(ids.len() - 1) * vocab..];
        assert_eq!(steps[0], argmax(last), "{name} {prefix}: greedy pick after prefill");
        for (k, &fed) in steps.iter().enumerate() {
            let out = model.forward(&mut [Chunk::new(&[fed], &mut state)], LogitsWanted::Last, false);
            let what = format!("{name} {prefix} decode step {k}");
            assert_close(&what, &out[0].logits, &want[k * vocab..(k + 1) * vocab]);
            if let Some(&next) = steps.get(k + 1) {
                assert_eq!(argmax(&out[0].logits), next, "{what}: greedy pick");
            }
        }
    }
}

/// What transformers' `save_pretrained` writes (`model.` prefix, `embed_tokens`,
/// `hc_head.hc_*`, `attn.norm`, seven BF16 shards with an index, a config announcing
/// an MTP layer it has no tensors for) loads and gives transformers' greedy tokens.
#[test]
fn save_pretrained_checkpoint_matches_transformers() {
    let dir = oracle_root().join("save-pretrained");
    let model = Model::load(&dir).expect("save_pretrained checkpoint loads");
    assert!(!model.has_mtp());
    assert_eq!(model.weights.notices.len(), 1, "{:?}", model.weights.notices);
    assert!(model.weights.notices[0].contains("no mtp.0.* tensors"), "{}", model.weights.notices[0]);
    check_against_reference(&model, &Reference::load_from(&dir), "save-pretrained");
}

/// The same weights as a raw `state_dict` dump: transformers' module names and routed
/// experts fused into `gate_up_proj` / `down_proj`.
#[test]
fn state_dict_dump_with_fused_experts_matches_transformers() {
    let model = Model::load(&oracle_root().join("state-dict")).expect("state_dict dump loads");
    let reference = Reference::load_from(&oracle_root().join("save-pretrained"));
    check_against_reference(&model, &reference, "state-dict");
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}
