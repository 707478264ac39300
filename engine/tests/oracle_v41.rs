//! DeepSeek-V4.1 against DeepSeek's reference (`inference/model.py` with its
//! CPU kernel port), on the configs `tools/oracle/make_v41.py` writes to
//! `tests/fixtures/oracle/v41/`: prefill logits, 40 cached greedy decode steps
//! and the DSpark drafts after each, in the reference's bf16 arithmetic.

use std::path::{Path, PathBuf};

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::v41::{ModelV41, Rows};

/// Logits must be bit-identical. Both sides compute the same defined
/// arithmetic (the reference's bf16/FP8/FP4 roundings, with sums and
/// transcendentals in f64: see `tools/oracle/make_v41.py`), so any difference
/// is a defect; and no tolerance would help, because FP8 activation
/// quantisation makes the model chaotic at the ulp level (one flipped e4m3
/// code changes logits by tenths within a few layers).
const TOLERANCE: f32 = 0.0;
/// Greedy steps whose tokens must equal the reference's.
const GREEDY_STEPS: usize = 32;

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle/v41");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 4, "expected at least 4 V4.1 oracle configs in {}", root.display());
    dirs
}

struct Reference {
    tensors: Checkpoint,
}

impl Reference {
    fn load(dir: &Path) -> Self {
        let path = dir.join("reference.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        Self { tensors: Checkpoint::from_bytes(&path.display().to_string(), bytes.into()).unwrap() }
    }
    fn ids(&self, name: &str) -> Vec<u32> {
        let shape = self.tensors.get(name).unwrap().shape.to_vec();
        self.tensors.int_tensor(name, &shape).unwrap().into_iter().map(|v| v as u32).collect()
    }
    fn floats(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let shape = self.tensors.get(name).unwrap().shape.to_vec();
        (self.tensors.f32_tensor(name, &shape).unwrap(), shape)
    }
    fn has(&self, name: &str) -> bool {
        self.tensors.contains(name)
    }
}

/// Max |Δ| relative to max |want|.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs()));
    worst / max_ref
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0 as u32
}

/// Prefill, then the reference's greedy decode steps.
fn check(dir: &Path) {
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let model = ModelV41::load(dir).unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference = Reference::load(dir);
    let vocab = model.config.vocab_size;
    let prompt = reference.ids("prompt");
    let mut state = model.new_state();
    let out = model.forward(&prompt, &mut state, Rows::All);
    let rows = reference.ids("prefill_rows");
    let (want, _) = reference.floats("prefill_logits");
    let got: Vec<f32> =
        rows.iter().flat_map(|&r| out.logits[r as usize * vocab..(r as usize + 1) * vocab].iter().copied()).collect();
    let prefill_error = relative_error(&got, &want);
    assert!(prefill_error <= TOLERANCE, "{name}: prefill logits off by {prefill_error:e} relative");

    let dspark = reference.has("dspark_ids");
    if dspark {
        model.dspark_observe(&out.main_hidden, 0, &mut state);
    }
    let tokens = reference.ids("decode_tokens");
    let (want, _) = reference.floats("decode_logits");
    assert!(tokens.len() > GREEDY_STEPS, "{name}: {} decode steps", tokens.len());
    assert_eq!(tokens[0], argmax(&out.logits[(prompt.len() - 1) * vocab..]), "{name}: first greedy token");
    let mut decode_error = 0.0f32;
    for (i, &tok) in tokens.iter().enumerate() {
        let position = state.position;
        let out = model.forward(&[tok], &mut state, Rows::Last);
        let want_row = &want[i * vocab..(i + 1) * vocab];
        if dspark {
            check_drafts(&name, &model, &reference, i, &out, position, &mut state);
        }
        decode_error = decode_error.max(relative_error(&out.logits, want_row));
        if i < GREEDY_STEPS {
            assert_eq!(argmax(&out.logits), argmax(want_row), "{name}: greedy token of decode step {i}");
        }
    }
    eprintln!("{name}: prefill max rel Δ {prefill_error:.2e}, decode max rel Δ {decode_error:.2e}");
    assert!(decode_error <= TOLERANCE, "{name}: decode logits off by {decode_error:e} relative");
}

/// DSpark after decode step `i`: the target's main hidden state, the drafts, their logits and confidences.
fn check_drafts(
    name: &str,
    model: &ModelV41,
    reference: &Reference,
    i: usize,
    out: &deepinfer_engine::v41::ChunkResult,
    position: usize,
    state: &mut deepinfer_engine::v41::V41State,
) {
    let ds = model.config.dspark.as_ref().unwrap();
    let (vocab, block) = (model.config.vocab_size, ds.block_size);
    let (hidden, shape) = reference.floats("dspark_main_hidden");
    let width = shape[1];
    assert_eq!(out.main_hidden, hidden[i * width..(i + 1) * width], "{name}: DSpark target state at step {i}");
    model.dspark_observe(&out.main_hidden, position, state);
    let drafts = model.dspark_propose(argmax(&out.logits), position, state);
    let ids = reference.ids("dspark_ids");
    assert_eq!(drafts.tokens, ids[i * (block + 1) + 1..(i + 1) * (block + 1)], "{name}: DSpark drafts at step {i}");
    let (logits, _) = reference.floats("dspark_logits");
    let error = relative_error(&drafts.logits, &logits[i * block * vocab..(i + 1) * block * vocab]);
    assert!(error <= TOLERANCE, "{name}: DSpark logits at step {i} off by {error:e} relative");
    let (confidence, _) = reference.floats("dspark_confidence");
    assert_eq!(drafts.confidence, confidence[i * block..(i + 1) * block], "{name}: DSpark confidence at step {i}");
}

#[test]
fn v41_logits_and_greedy_tokens_match_the_reference() {
    for dir in fixtures() {
        check(&dir);
    }
}

/// Prefill, then the reference's decode steps, with the forward pass on the
/// device (the emulated one, or a GPU with `DEEPINFER_TEST_DEVICE=cuda`):
/// the same logits bit for bit. DSpark drafts are not checked here: a
/// device model drafts nothing (speculative decoding is refused for it).
fn check_on_device(dir: &Path) {
    use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
    let name = dir.file_name().unwrap().to_string_lossy().to_string();
    let model = Model::from_v41(ModelV41::load(dir).unwrap_or_else(|e| panic!("{name}: {e}")))
        .on_device(&deepinfer_cuda::test_gpu())
        .unwrap_or_else(|e| panic!("{name} on the device: {e}"));
    let reference = Reference::load(dir);
    let vocab = model.config.vocab_size;
    let prompt = reference.ids("prompt");
    let mut state = model.new_state();
    let out = model.forward(&mut [Chunk::new(&prompt, &mut state)], LogitsWanted::All, false).remove(0);
    let rows = reference.ids("prefill_rows");
    let (want, _) = reference.floats("prefill_logits");
    let got: Vec<f32> =
        rows.iter().flat_map(|&r| out.logits[r as usize * vocab..(r as usize + 1) * vocab].iter().copied()).collect();
    let prefill_error = relative_error(&got, &want);
    assert!(prefill_error <= TOLERANCE, "{name} on the device: prefill logits off by {prefill_error:e} relative");
    let tokens = reference.ids("decode_tokens");
    let (want, _) = reference.floats("decode_logits");
    assert_eq!(tokens[0], argmax(&out.logits[(prompt.len() - 1) * vocab..]), "{name} on the device: first token");
    let mut decode_error = 0.0f32;
    for (i, &tok) in tokens.iter().enumerate() {
        let out = model.forward(&mut [Chunk::new(&[tok], &mut state)], LogitsWanted::Last, false).remove(0);
        let want_row = &want[i * vocab..(i + 1) * vocab];
        decode_error = decode_error.max(relative_error(&out.logits, want_row));
        if i < GREEDY_STEPS {
            assert_eq!(argmax(&out.logits), argmax(want_row), "{name} on the device: greedy token of step {i}");
        }
    }
    eprintln!("{name} on the device: prefill max rel Δ {prefill_error:.2e}, decode max rel Δ {decode_error:.2e}");
    assert!(decode_error <= TOLERANCE, "{name} on the device: decode logits off by {decode_error:e} relative");
}

#[test]
fn on_the_device_v41_logits_and_greedy_tokens_match_the_reference() {
    for dir in fixtures() {
        check_on_device(&dir);
    }
}
