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
use deepinfer_engine::v41::config::V41Config;
use deepinfer_engine::v41::{parse_token_map, ModelV41};
use tokenizers::Tokenizer;

/// One built-in trained checkpoint.
struct Trained {
    name: &'static str,
    config: &'static str,
    weights: &'static [u8],
    tokenizer: &'static str,
    /// A DeepSeek-V4.1 Engram model's `engram_token_map.json`.
    engram_token_map: Option<&'static str>,
}

const TRAINED: [Trained; 2] = [
    Trained {
        name: "tiny-v4-trained",
        config: include_str!("../assets/tiny-v4-trained/config.json"),
        weights: include_bytes!("../assets/tiny-v4-trained/model.safetensors"),
        tokenizer: include_str!("../assets/tiny-v4-trained/tokenizer.json"),
        engram_token_map: None,
    },
    Trained {
        name: "tiny-v41-trained",
        config: include_str!("../assets/tiny-v41-trained/config.json"),
        weights: include_bytes!("../assets/tiny-v41-trained/model.safetensors"),
        tokenizer: include_str!("../assets/tiny-v41-trained/tokenizer.json"),
        engram_token_map: Some(include_str!("../assets/tiny-v41-trained/engram_token_map.json")),
    },
];

/// Names of the built-in trained models.
pub fn names() -> impl Iterator<Item = &'static str> {
    TRAINED.iter().map(|t| t.name)
}

/// The model and tokenizer of built-in trained model `name`, if there is one.
pub fn load(name: &str) -> Option<anyhow::Result<(Model, Tokenizer)>> {
    let t = TRAINED.iter().find(|t| t.name == name)?;
    Some((|| {
        let label = format!("builtin:{}", t.name);
        let config_file = format!("{label}/config.json");
        let checkpoint = Checkpoint::from_bytes(&format!("{label}/model.safetensors"), Bytes::from_static(t.weights))?;
        let value: serde_json::Value =
            serde_json::from_str(t.config).with_context(|| format!("{config_file}: not valid JSON"))?;
        let model = if V41Config::is_v41(&value) {
            let config = V41Config::from_json_str(t.config, &config_file)?;
            let weights = deepinfer_engine::v41::weights::Weights::load(&checkpoint, &config)?;
            let map_file = format!("{label}/{}", deepinfer_engine::v41::ENGRAM_TOKEN_MAP);
            let token_map = t.engram_token_map.map(|text| parse_token_map(text, &map_file)).transpose()?;
            Model::from_v41(ModelV41::new(config, weights, token_map)?)
        } else {
            let config = ModelConfig::from_json_str(t.config, &config_file)?;
            let weights = Weights::load(&checkpoint, &config)?;
            Model::new(config, weights)
        };
        let tokenizer = Tokenizer::from_bytes(t.tokenizer.as_bytes())
            .map_err(|e| anyhow::anyhow!("{label}/tokenizer.json: {e}"))
            .context("built-in tokenizer")?;
        Ok((model, tokenizer))
    })())
}
