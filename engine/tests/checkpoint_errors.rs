//! A checkpoint that is not exactly the model gets an error naming the file and
//! the tensor: missing, unknown or doubly spelled tensors, and shard indexes that
//! disagree with their shards. Each case edits a copy of a committed fixture in a
//! temporary directory.

use std::path::{Path, PathBuf};

use deepinfer_engine::model::Model;
use safetensors::tensor::{serialize, TensorView};
use safetensors::Dtype;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle").join(name)
}

/// A fresh copy of a fixture directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn copy_of(name: &str, label: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("deepinfer-ckpt-{label}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(fixture(name)).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
        Self(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_tensor(path: &Path, name: &str, shape: &[usize]) {
    let count: usize = shape.iter().product();
    let bytes = vec![0u8; count * 4];
    let view = TensorView::new(Dtype::F32, shape.to_vec(), &bytes).unwrap();
    std::fs::write(path, serialize([(name, view)], None).unwrap()).unwrap();
}

fn load_error(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn an_unknown_tensor_names_its_file_and_itself() {
    let scratch = Scratch::copy_of("sweep/single-head", "unknown");
    let extra = scratch.path().join("model-extra.safetensors");
    write_tensor(&extra, "layers.0.attn.lora_a.weight", &[2, 2]);
    let err = load_error(scratch.path());
    assert!(err.contains("model-extra.safetensors") && err.contains("`layers.0.attn.lora_a.weight`"), "{err}");
    assert!(err.contains("not part of this model"), "{err}");
}

#[test]
fn two_spellings_of_one_tensor_are_refused() {
    let scratch = Scratch::copy_of("sweep/single-head", "twice");
    write_tensor(&scratch.path().join("model-more.safetensors"), "model.embed_tokens.weight", &[256, 32]);
    let err = load_error(scratch.path());
    assert!(err.contains("`model.embed_tokens.weight`") && err.contains("`embed.weight`"), "{err}");
}

#[test]
fn a_missing_tensor_is_named() {
    let scratch = Scratch::copy_of("save-pretrained", "missing");
    // Drop a tensor from the index and rewrite its shard without it: the loader then
    // asks for it and finds it nowhere.
    let index_path = scratch.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let shard = index["weight_map"]["model.norm.weight"].as_str().unwrap().to_string();
    index["weight_map"].as_object_mut().unwrap().remove("model.norm.weight");
    std::fs::write(&index_path, index.to_string()).unwrap();
    let bytes = std::fs::read(scratch.path().join(&shard)).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, TensorView)> =
        tensors.tensors().into_iter().filter(|(n, _)| n != "model.norm.weight").collect();
    std::fs::write(scratch.path().join(&shard), serialize(kept, None).unwrap()).unwrap();
    let err = load_error(scratch.path());
    assert!(err.contains("no tensor named `norm.weight`"), "{err}");
}

#[test]
fn a_shard_index_that_disagrees_with_its_shards_is_refused() {
    let scratch = Scratch::copy_of("save-pretrained", "index");
    let index_path = scratch.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).unwrap();
    let index: serde_json::Value = serde_json::from_str(&text).unwrap();
    let first_shard = index["weight_map"]["head.weight"].as_str().unwrap().to_string();

    // A listed shard that is not there.
    std::fs::remove_file(scratch.path().join(&first_shard)).unwrap();
    let err = load_error(scratch.path());
    assert!(err.contains("model.safetensors.index.json") && err.contains(&first_shard), "{err}");

    // A tensor placed in the wrong shard.
    std::fs::copy(fixture("save-pretrained").join(&first_shard), scratch.path().join(&first_shard)).unwrap();
    let other_shard = index["weight_map"]["model.norm.weight"].as_str().unwrap().to_string();
    assert_ne!(other_shard, first_shard);
    let moved =
        text.replace(&format!("\"head.weight\": \"{first_shard}\""), &format!("\"head.weight\": \"{other_shard}\""));
    std::fs::write(&index_path, moved).unwrap();
    let err = load_error(scratch.path());
    assert!(err.contains("`head.weight`") && err.contains(&other_shard), "{err}");

    // A shard path outside the directory.
    let escaped = text.replace(&format!("\"head.weight\": \"{first_shard}\""), "\"head.weight\": \"../x.safetensors\"");
    std::fs::write(&index_path, escaped).unwrap();
    let err = load_error(scratch.path());
    assert!(err.contains("not a .safetensors file beside the index"), "{err}");
}
