//! The command line: `deepinfer model init`, `deepinfer generate`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::commands;

#[derive(Parser, Debug)]
#[command(name = "deepinfer", version, about = "Inference runtime for DeepSeek mixture-of-experts models")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create or inspect model checkpoints.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate a completion for a prompt, offline.
    Generate(GenerateArgs),
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Write a random checkpoint of a built-in preset (config.json, model.safetensors, tokenizer.json).
    Init(InitArgs),
}

#[derive(Args, Debug)]
pub struct InitArgs {
    /// Preset to write: tiny-v4 (every V4 feature, hidden 64) or small-v4 (hidden 1024, 32 experts).
    #[arg(long, default_value = "tiny-v4")]
    pub preset: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory to write into (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Copy this tokenizer.json instead of writing the built-in byte-level BPE
    /// (its vocabulary must fit the preset's).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// A Hugging Face model directory, or `builtin:tiny-v4` / `builtin:small-v4`.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Seed of a built-in model's random weights.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
    /// tokenizer.json to use instead of the model directory's (or the built-in one).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// 0 samples greedily.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampling stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the generated token ids too.
    #[arg(long)]
    pub show_tokens: bool,
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model { command: ModelCommand::Init(args) } => commands::model_init::run(&args),
        Command::Generate(args) => commands::generate::run(&args),
    }
}
