//! Loading a model with its tokenizer, prompt encoding (plain and chat), and
//! single-sequence offline generation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use deepinfer_actors::cluster::DraftCosts;
use deepinfer_actors::{ClusterConfig, LocalCluster, Update};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::model::{Model, RoutedExperts};
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::presets::{build, Preset};
pub use deepinfer_engine::request::FinishReason;
use deepinfer_engine::request::Request;
use deepinfer_engine::sampling::SamplingParams;
use deepinfer_engine::speculative::policy::DraftPolicy;
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};
use deepinfer_engine::v41::ModelV41;
use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::backend::Backend;
use crate::tokenizer::{builtin_tokenizer, load_tokenizer};

/// Where a model's forward pass runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// This machine's CPU cores (the engine's own kernels).
    #[default]
    Cpu,
    /// NVIDIA GPU 0, through the CUDA driver (libcuda, loaded at run time).
    Cuda,
    /// The CUDA kernels compiled for this CPU: the GPU's code path without a GPU.
    Emulated,
}

/// The device `choice` names, opened before any model is loaded, so that a
/// machine without CUDA fails at once with one line.
pub fn open_device(choice: DeviceChoice) -> anyhow::Result<Option<deepinfer_cuda::Gpu>> {
    match choice {
        DeviceChoice::Cpu => Ok(None),
        DeviceChoice::Emulated => Ok(Some(deepinfer_cuda::Gpu::emulated())),
        DeviceChoice::Cuda => match deepinfer_cuda::Gpu::cuda(0) {
            Ok(gpu) => Ok(Some(gpu)),
            Err(e) => bail!("--device cuda: {e}"),
        },
    }
}

/// `model` with its forward pass on `gpu` (none: as it is, on the CPU).
pub fn place_model(model: Model, gpu: Option<&deepinfer_cuda::Gpu>) -> anyhow::Result<Model> {
    let Some(gpu) = gpu else { return Ok(model) };
    let name = gpu.name();
    let model = model.on_device(gpu).with_context(|| format!("placing the model on {name}"))?;
    eprintln!("device: {name}, {:.1} MiB of weights", gpu.memory_in_use() as f64 / (1 << 20) as f64);
    Ok(model)
}

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
    load_model_with(spec, seed, tokenizer_path, RoutedExperts::Resident)
}

/// [`load_model`] with a directory's routed experts where `routed` says (a
/// built-in model is built whole in memory either way).
pub fn load_model_with(
    spec: &str,
    seed: u64,
    tokenizer_path: Option<&Path>,
    routed: RoutedExperts,
) -> anyhow::Result<LoadedModel> {
    let mut own_tokenizer = None;
    let (name, model, dir_tokenizer) = match spec.strip_prefix("builtin:") {
        Some(preset_name) => match crate::trained::load(preset_name) {
            Some(loaded) => {
                let (model, tokenizer) = loaded?;
                own_tokenizer = Some(tokenizer);
                (spec.to_string(), model, None)
            }
            None => {
                let Some(preset) = Preset::from_name(preset_name) else {
                    let names: Vec<String> = Preset::ALL
                        .iter()
                        .map(|p| p.name())
                        .chain(crate::trained::names())
                        .map(|n| format!("builtin:{n}"))
                        .collect();
                    bail!("unknown built-in model `{spec}` (known: {})", names.join(", "));
                };
                (spec.to_string(), build(preset, seed)?, None)
            }
        },
        None => {
            let dir = PathBuf::from(spec);
            let model = load_dir(&dir, tokenizer_path, routed)?;
            for notice in &model.weights.notices {
                eprintln!("note: {}: {notice}", dir.display());
            }
            let tokenizer = dir.join("tokenizer.json");
            (dir.display().to_string(), model, tokenizer.exists().then_some(tokenizer))
        }
    };
    let tokenizer = match (tokenizer_path.map(Path::to_path_buf).or(dir_tokenizer), own_tokenizer) {
        (Some(path), _) => load_tokenizer(&path)?,
        (None, Some(own)) => own,
        (None, None) => match model.v41.as_ref().and_then(|m| m.config.vision.as_ref()) {
            Some(vision) => {
                crate::tokenizer::builtin_tokenizer_with_image_token(vision.image_token_id).with_context(|| {
                    format!(
                        "the image token id {} is not a reserved id of the built-in tokenizer",
                        vision.image_token_id
                    )
                })?
            }
            None => builtin_tokenizer(),
        },
    };
    let vocab = tokenizer.get_vocab_size(true);
    if vocab > model.config.vocab_size {
        bail!("tokenizer has {vocab} tokens but the model's vocabulary is {}", model.config.vocab_size);
    }
    Ok(LoadedModel { name, model, tokenizer })
}

/// A model directory; a DeepSeek-V4.1 Engram model without `engram_token_map.json`
/// derives its compressed vocabulary from the tokenizer (`tokenizer_path` or the
/// directory's `tokenizer.json`).
fn load_dir(dir: &Path, tokenizer_path: Option<&Path>, routed: RoutedExperts) -> anyhow::Result<Model> {
    let context = || format!("loading model from {}", dir.display());
    let mut token_map = None;
    if ModelV41::needs_token_map(dir) {
        let tokenizer = tokenizer_path.map(Path::to_path_buf).unwrap_or_else(|| dir.join("tokenizer.json"));
        if tokenizer.is_file() {
            token_map = Some(crate::engram_vocab::token_map_of_file(&tokenizer)?.0);
        }
    }
    Model::load_with(dir, routed, token_map).with_context(context)
}

#[derive(Clone, Debug)]
pub struct Completion {
    pub prompt_tokens: Vec<u32>,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
}

/// The engine [`generate`] runs: a batch of one, no prefix cache, drafting
/// as asked (its step time measured now, before anything is timed).
pub fn single_engine(model: &Model, speculative: SpeculativeConfig) -> anyhow::Result<Engine<&Model>> {
    let config =
        EngineConfig { max_batch_size: 1, prefix_mode: PrefixMode::Off, speculative, ..EngineConfig::default() };
    new_engine(model, config)
}

/// Greedy or sampled generation of one sequence on `backend` (the engine
/// with a batch of one, or a cluster: the same tokens, bit for bit).
/// `on_token` sees each token as it is produced. Generation ends at EOS,
/// `max_tokens` or the end of the model's context.
pub fn generate(
    backend: &mut dyn Backend,
    prompt: &[u32],
    params: &SamplingParams,
    max_tokens: usize,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<Completion> {
    let id = backend.submit(Request::new(prompt.to_vec(), max_tokens).with_params(params.clone()));
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Length;
    while let Some(updates) = backend.next_updates() {
        for update in updates {
            match update {
                Update::Tokens { id: i, tokens: new, .. } if i == id => {
                    for t in new {
                        tokens.push(t.token);
                        on_token(t.token);
                    }
                }
                Update::Finished { id: i, finished } if i == id => finish = finished.reason,
                Update::Refused { id: i, reason } if i == id => bail!("{reason}"),
                _ => {}
            }
        }
    }
    if let FinishReason::Error(message) = finish {
        bail!("generation failed: {message}");
    }
    Ok(Completion { prompt_tokens: prompt.to_vec(), tokens, finish })
}

/// An engine for `config`; with the adaptive draft-length policy, the step
/// time it weighs drafts against is measured on this machine first.
pub fn new_engine<M: std::ops::Deref<Target = Model>>(model: M, config: EngineConfig) -> anyhow::Result<Engine<M>> {
    let costs = measured_draft_costs(&model, &config);
    let mut engine = Engine::new(model, config)?;
    if let Some(costs) = costs {
        engine.set_step_cost(costs.step);
        if let Some(cost) = costs.draft {
            engine.set_draft_cost(cost);
        }
    }
    Ok(engine)
}

/// With the adaptive draft-length policy: a step's time by tokens verified
/// and drafting's time by requests, measured on this machine now (the
/// engine and a cluster's computing workers weigh drafts against them);
/// `None` for any other policy.
pub fn measured_draft_costs(model: &Model, config: &EngineConfig) -> Option<DraftCosts> {
    let spec = config.speculative;
    if !matches!(spec.policy, DraftPolicy::Adaptive { .. }) || spec.method == DraftMethod::Off {
        return None;
    }
    let per_sequence = spec.max_drafts() + 1;
    let max_tokens = (config.max_batch_size * per_sequence).min(config.max_batch_tokens);
    let step = crate::step_cost::measure(model, max_tokens, per_sequence);
    let draft = match spec.method {
        DraftMethod::Mtp => crate::step_cost::measure_mtp_chain(model, config.max_batch_size),
        DraftMethod::Dspark => crate::step_cost::measure_dspark(model),
        DraftMethod::Off => None,
    };
    Some(DraftCosts { step, draft })
}

/// Start the in-process cluster of `--devices N --expert-parallel E` (E
/// defaults to N) with `engine` as every scheduler's policy; the model moves
/// into it, shared by every device.
pub fn start_cluster(
    model: Model,
    devices: u32,
    expert_parallel: Option<u32>,
    engine: EngineConfig,
) -> anyhow::Result<LocalCluster> {
    let ep = expert_parallel.unwrap_or(devices);
    let mut cfg = ClusterConfig::new(devices, ep);
    if let Some(costs) = measured_draft_costs(&model, &engine) {
        cfg.draft_costs = costs;
    }
    cfg.engine = engine;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(devices as usize);
    LocalCluster::start(Arc::new(model), cfg, threads)
        .with_context(|| format!("cannot start {devices} devices with expert parallelism {ep}"))
}

/// Encode a prompt, starting with the model's BOS token.
pub fn encode_prompt(tokenizer: &Tokenizer, model: &Model, text: &str) -> anyhow::Result<Vec<u32>> {
    let encoding = tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("cannot tokenize the prompt: {e}"))?;
    let mut ids = vec![model.config.bos_token_id];
    ids.extend_from_slice(encoding.get_ids());
    Ok(ids)
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// Token ids of a conversation in DeepSeek's chat format, ending where the
/// assistant's reply starts:
/// `<｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜>{reply}<｜end▁of▁sentence｜>…<｜User｜>{user}<｜Assistant｜>`.
/// System messages must come first; the last message must be the user's.
pub fn encode_chat(tokenizer: &Tokenizer, model: &Model, messages: &[ChatMessage]) -> anyhow::Result<Vec<u32>> {
    let marker = |name: &str| {
        tokenizer.token_to_id(name).with_context(|| format!("the tokenizer has no `{name}` token for chat messages"))
    };
    let (user, assistant) = (marker("<｜User｜>")?, marker("<｜Assistant｜>")?);
    let encode = |text: &str| -> anyhow::Result<Vec<u32>> {
        let e = tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("cannot tokenize a message: {e}"))?;
        Ok(e.get_ids().to_vec())
    };
    match messages.last() {
        None => bail!("`messages` is empty"),
        Some(m) if m.role != "user" => bail!("the last message must be from the user, not `{}`", m.role),
        Some(_) => {}
    }
    let mut ids = vec![model.config.bos_token_id];
    let mut seen_turn = false;
    for m in messages {
        match m.role.as_str() {
            "system" if seen_turn => bail!("system messages must come before the conversation"),
            "system" => ids.extend(encode(&m.content)?),
            "user" => {
                ids.push(user);
                ids.extend(encode(&m.content)?);
                ids.push(assistant);
            }
            "assistant" => {
                if !seen_turn {
                    bail!("the conversation must start with a user message");
                }
                ids.extend(encode(&m.content)?);
                ids.push(model.config.eos_token_id);
            }
            other => bail!("unknown message role `{other}` (expected system, user or assistant)"),
        }
        seen_turn |= m.role != "system";
    }
    Ok(ids)
}
