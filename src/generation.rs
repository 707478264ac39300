//! Loading a model with its tokenizer, and single-sequence offline generation.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::sampling::{sample, SamplingParams};
use tokenizers::Tokenizer;

use crate::tokenizer::{builtin_tokenizer, load_tokenizer};

/// A model ready to generate: weights plus the tokenizer that matches them.
pub struct LoadedModel {
    pub name: String,
    pub model: Model,
    pub tokenizer: Tokenizer,
}

/// Load `builtin:<preset>` (built in memory from `seed`) or a Hugging Face directory.
/// The tokenizer is `tokenizer_path` if given, else the directory's
/// `tokenizer.json`, else the built-in one.
pub fn load_model(spec: &str, seed: u64, tokenizer_path: Option<&Path>) -> anyhow::Result<LoadedModel> {
    let (name, model, dir_tokenizer) = match spec.strip_prefix("builtin:") {
        Some(preset_name) => {
            let Some(preset) = Preset::from_name(preset_name) else {
                let names: Vec<String> = Preset::ALL.iter().map(|p| format!("builtin:{}", p.name())).collect();
                bail!("unknown built-in model `{spec}` (known: {})", names.join(", "));
            };
            (spec.to_string(), build(preset, seed)?, None)
        }
        None => {
            let dir = PathBuf::from(spec);
            let model = Model::load(&dir).with_context(|| format!("loading model from {}", dir.display()))?;
            let tokenizer = dir.join("tokenizer.json");
            (dir.display().to_string(), model, tokenizer.exists().then_some(tokenizer))
        }
    };
    let tokenizer = match tokenizer_path.map(Path::to_path_buf).or(dir_tokenizer) {
        Some(path) => load_tokenizer(&path)?,
        None => builtin_tokenizer(),
    };
    let vocab = tokenizer.get_vocab_size(true);
    if vocab > model.config.vocab_size {
        bail!("tokenizer has {vocab} tokens but the model's vocabulary is {}", model.config.vocab_size);
    }
    Ok(LoadedModel { name, model, tokenizer })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Clone, Debug)]
pub struct Completion {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
}

/// Greedy or sampled generation of one sequence: prefill the prompt in one
/// step, then decode one token per step until EOS or `max_tokens`.
/// `on_token` sees each token as it is produced.
pub fn generate(
    model: &Model,
    prompt: &[u32],
    params: &SamplingParams,
    max_tokens: usize,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<Completion> {
    let cfg = &model.config;
    params.validate(cfg.vocab_size)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        bail!("token id {bad} is outside the vocabulary of {}", cfg.vocab_size);
    }
    if prompt.len() + max_tokens > cfg.max_position_embeddings {
        bail!(
            "prompt of {} tokens plus max_tokens {max_tokens} exceeds the context of {} tokens",
            prompt.len(),
            cfg.max_position_embeddings
        );
    }
    let mut state = model.new_state();
    let mut tokens = Vec::new();
    let mut input = prompt.to_vec();
    let mut finish = FinishReason::Length;
    while tokens.len() < max_tokens {
        let position = state.position + input.len();
        let out = model.forward(&mut [Chunk::new(&input, &mut state)], LogitsWanted::Last, false);
        let next = sample(&out[0].logits, params, position as u64).token;
        tokens.push(next);
        on_token(next);
        if next == cfg.eos_token_id {
            finish = FinishReason::Stop;
            break;
        }
        input = vec![next];
    }
    Ok(Completion { prompt_tokens: prompt.to_vec(), tokens, finish })
}

/// Encode a prompt, starting with the model's BOS token.
pub fn encode_prompt(tokenizer: &Tokenizer, model: &Model, text: &str) -> anyhow::Result<Vec<u32>> {
    let encoding = tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("cannot tokenize the prompt: {e}"))?;
    let mut ids = vec![model.config.bos_token_id];
    ids.extend_from_slice(encoding.get_ids());
    Ok(ids)
}
