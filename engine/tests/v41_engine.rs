//! DeepSeek-V4.1 in the engine: chunking, batching and the serving loop never
//! change a sequence's bits.

use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::presets::{build, Preset};

fn model() -> Model {
    build(Preset::TinyV41, 3).expect("tiny-v41 builds")
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 2 + (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97) >> 7) % 1000).collect()
}

/// Logits `[len, vocab]` of `tokens` fed in chunks of `chunk` tokens.
fn logits_in_chunks(m: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut state = m.new_state();
    let mut out = Vec::new();
    for part in tokens.chunks(chunk) {
        out.extend(m.forward(&mut [Chunk::new(part, &mut state)], LogitsWanted::All, false).remove(0).logits);
    }
    out
}

/// The preset's window (16) plus its chosen entries (16) fit one 64-slot block
/// of the attention's online softmax, so the order its keys are listed in
/// (which differs between a chunk at position 0 and later tokens, as in the
/// reference) cannot change a rounding: every chunking gives the same bits.
#[test]
fn incremental_decoding_and_chunked_prefill_equal_one_prefill() {
    let m = model();
    let tokens = prompt(180, 1);
    let whole = logits_in_chunks(&m, &tokens, tokens.len());
    assert_eq!(logits_in_chunks(&m, &tokens, 1), whole, "token by token");
    assert_eq!(logits_in_chunks(&m, &tokens, 37), whole, "chunks of 37");
}

#[test]
fn a_sequence_in_a_batch_computes_as_alone() {
    let m = model();
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(20 + 31 * i, i as u32)).collect();
    let alone: Vec<Vec<f32>> = prompts.iter().map(|p| logits_in_chunks(&m, p, p.len())).collect();
    let mut states: Vec<_> = prompts.iter().map(|_| m.new_state()).collect();
    let mut chunks: Vec<Chunk> = prompts.iter().zip(states.iter_mut()).map(|(p, s)| Chunk::new(p, s)).collect();
    let batched = m.forward(&mut chunks, LogitsWanted::All, false);
    for (i, out) in batched.iter().enumerate() {
        assert_eq!(out.logits, alone[i], "sequence {i}");
    }
}

/// A written tiny-v41 directory whose config is then edited by `edit`.
fn directory_with(name: &str, edit: impl Fn(&mut serde_json::Value)) -> std::path::PathBuf {
    use deepinfer_engine::presets::serialize;
    use deepinfer_engine::presets_v41::{random_checkpoint, token_map_json};
    let dir = std::env::temp_dir().join(format!("deepinfer-v41-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config = Preset::TinyV41.config_json();
    let tensors = random_checkpoint(&Preset::TinyV41.v41_config(), 1);
    std::fs::write(dir.join("model.safetensors"), serialize(&tensors)).unwrap();
    std::fs::write(dir.join("engram_token_map.json"), token_map_json(1024).to_string()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    dir
}

fn load_error(dir: &std::path::Path) -> String {
    let err = Model::load(dir).err().expect("the load fails").to_string();
    let _ = std::fs::remove_dir_all(dir);
    err
}

#[test]
fn bad_v41_configs_and_checkpoints_name_the_file_and_key() {
    let dir = directory_with("no-source", |c| c["kv_source_layers"] = serde_json::json!([4]));
    let err = load_error(&dir);
    assert!(err.contains("config.json") && err.contains("compress_ratios") && err.contains("no KV source"), "{err}");

    let dir = directory_with("few-blocks", |c| c["candidate_topk_blocks"] = serde_json::json!(2));
    let err = load_error(&dir);
    assert!(err.contains("candidate_topk_blocks") && err.contains("fewer than index_topk"), "{err}");

    let dir = directory_with("bad-ratio", |c| c["compress_ratios"] = serde_json::json!([0, 2, 2, 2, 1, 1, 1, 1]));
    let err = load_error(&dir);
    assert!(err.contains("compress_ratios"), "{err}");

    let dir = directory_with("wrong-shape", |c| c["dim"] = serde_json::json!(96));
    let err = load_error(&dir);
    assert!(err.contains("model.safetensors") && err.contains("shape"), "{err}");

    let dir = directory_with("no-map", |_| {});
    std::fs::remove_file(dir.join("engram_token_map.json")).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("engram_token_map.json") && err.contains("tokenizer.json"), "{err}");
}
