//! Built-in trained checkpoints: small models trained on real text (see
//! `tools/train/`), compiled into the binary so that `builtin:<name>` works
//! on any machine, without files or downloads. Their draft heads predict
//! something, so speculative decoding accepts drafts and demos read as text.

use anyhow::Context;
use bytes::Bytes;
use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::config::ModelConfig;
use deepinfer_engine::model::weights::Weights;
use deepinfer_engine::model::Model;
use tokenizers::Tokenizer;

/// One built-in trained checkpoint.
struct Trained {
    name: &'static str,
    config: &'static str,
    weights: &'static [u8],
    tokenizer: &'static str,
}

const TRAINED: [Trained; 1] = [Trained {
    name: "tiny-v4-trained",
    config: include_str!("../assets/tiny-v4-trained/config.json"),
    weights: include_bytes!("../assets/tiny-v4-trained/model.safetensors"),
    tokenizer: include_str!("../assets/tiny-v4-trained/tokenizer.json"),
}];

/// Names of the built-in trained models.
pub fn names() -> impl Iterator<Item = &'static str> {
    TRAINED.iter().map(|t| t.name)
}

/// The model and tokenizer of built-in trained model `name`, if there is one.
pub fn load(name: &str) -> Option<anyhow::Result<(Model, Tokenizer)>> {
    let t = TRAINED.iter().find(|t| t.name == name)?;
    Some((|| {
        let label = format!("builtin:{}", t.name);
        let config = ModelConfig::from_json_str(t.config, &format!("{label}/config.json"))?;
        let checkpoint = Checkpoint::from_bytes(&format!("{label}/model.safetensors"), Bytes::from_static(t.weights))?;
        let weights = Weights::load(&checkpoint, &config)?;
        let tokenizer = Tokenizer::from_bytes(t.tokenizer.as_bytes())
            .map_err(|e| anyhow::anyhow!("{label}/tokenizer.json: {e}"))
            .context("built-in tokenizer")?;
        Ok((Model::new(config, weights), tokenizer))
    })())
}
