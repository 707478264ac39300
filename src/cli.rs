//! The command line: `deepinfer model init`, `generate`, `serve`, `cluster init-certs`, `launch`, `node`, `status`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{ArgGroup, Args, Parser, Subcommand};
use deepinfer_engine::engine::EngineConfig;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::speculative::policy::DraftPolicy;
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};

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
    /// Generate a completion for a prompt, or for every request of a JSON Lines file, offline.
    Generate(GenerateArgs),
    /// Serve the OpenAI (Chat Completions, Responses) and Anthropic (Messages) HTTP APIs.
    Serve(Box<commands::serve::ServeArgs>),
    /// Simulate a cluster scenario deterministically on this CPU and report what it did.
    Simulate(commands::simulate::SimulateArgs),
    /// Plan a deployment in simulation: the capacity of each layout of N GPUs
    /// (prefill:decode split, expert-parallel degrees, redundant experts) for a
    /// scenario's traffic and SLOs, its cost per million tokens, the frontier.
    Plan(commands::plan::PlanArgs),
    /// Cluster administration (certificates).
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
    /// Start every node of a topology that lives on this machine, each as its
    /// own process; wait until the cluster is ready; stop them all on Ctrl-C or SIGTERM.
    Launch(commands::cluster::LaunchArgs),
    /// Run one node of a topology in this process (multi-host clusters start one per machine).
    Node(commands::cluster::NodeArgs),
    /// Each node of a running cluster: up or not, devices, experts, requests, KV use.
    Status(commands::cluster::StatusArgs),
    /// Stop a node gracefully for a rolling restart: no new requests go to
    /// its instances, running ones finish, then it stops.
    Drain(commands::cluster::DrainArgs),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Write a cluster CA and a certificate per node of a topology (plus `client`), or per name given.
    InitCerts(commands::cluster::InitCertsArgs),
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
    /// Change one key of the preset's config.json, as KEY=JSON (repeatable):
    /// `--set n_routed_experts=128 --set moe_intermediate_size=512`.
    #[arg(long = "set", value_name = "KEY=JSON")]
    pub overrides: Vec<String>,
}

/// The engine's batching and cache limits, shared by batch generation and `serve`.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Most sequences per engine step.
    #[arg(long, default_value_t = 256)]
    pub max_batch_size: usize,
    /// Most tokens per engine step (prompt chunks and decodes together).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// KV cache budget in MiB (requests beyond it are preempted and recomputed).
    #[arg(long, default_value_t = 1024)]
    pub kv_cache_mib: usize,
    /// Prefix cache: `exact` (bit-identical to a cold run), `bounded` (replays one window, faster) or `off`.
    #[arg(long, default_value = "exact", value_parser = ["off", "exact", "bounded"])]
    pub prefix_cache: String,
    /// Speculative decoding: `mtp` (DeepSeek-V4's MTP block drafts), `dspark`
    /// (DeepSeek-V4.1's DSpark layers) or `off`. The output is the same tokens.
    #[arg(long, default_value = "off", value_parser = ["off", "mtp", "dspark"])]
    pub speculative: String,
    /// Most draft tokens a request verifies per step (1 to 16).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub num_draft_tokens: u32,
    /// How many drafts each request verifies: `adaptive` (as many as pay for
    /// themselves, from the drafts' acceptance estimates and the step time
    /// measured at start) or `fixed` (always --num-draft-tokens).
    #[arg(long, default_value = "adaptive", value_parser = ["adaptive", "fixed"])]
    pub draft_length: String,
}

impl EngineArgs {
    /// The engine configuration these flags ask for (other fields at their defaults).
    pub fn to_config(&self) -> anyhow::Result<EngineConfig> {
        let prefix_mode = PrefixMode::from_name(&self.prefix_cache)
            .with_context(|| format!("unknown --prefix-cache `{}` (off, exact, bounded)", self.prefix_cache))?;
        let kv_budget_bytes = self
            .kv_cache_mib
            .checked_mul(1 << 20)
            .with_context(|| format!("--kv-cache-mib {} is too large", self.kv_cache_mib))?;
        Ok(EngineConfig {
            max_batch_size: self.max_batch_size,
            max_batch_tokens: self.max_batch_tokens,
            kv_budget_bytes,
            prefix_mode,
            speculative: self.speculative()?,
            ..EngineConfig::default()
        })
    }

    /// The speculative decoding these flags ask for.
    pub fn speculative(&self) -> anyhow::Result<SpeculativeConfig> {
        let method: DraftMethod = self.speculative.parse().map_err(anyhow::Error::msg)?;
        let k = self.num_draft_tokens as usize;
        let policy = match (method, self.draft_length.as_str()) {
            (DraftMethod::Off, _) => DraftPolicy::Off,
            (_, "fixed") => DraftPolicy::Fixed(k),
            (_, "adaptive") => DraftPolicy::Adaptive { max: k },
            (_, other) => anyhow::bail!("unknown --draft-length `{other}` (adaptive, fixed)"),
        };
        Ok(SpeculativeConfig { method, policy })
    }
}

/// Which model to load, shared by the commands that run one.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A Hugging Face model directory, or `builtin:tiny-v4` / `small-v4` / `tiny-v41` / `small-v41`.
    #[arg(long, default_value = "builtin:tiny-v4")]
    pub model: String,
    /// Seed of a built-in model's random weights.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
    /// tokenizer.json to use instead of the model directory's (or the built-in one).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Where the forward pass runs: `cpu`, `cuda` (NVIDIA GPU 0 through the
    /// CUDA driver) or `emulated` (the CUDA kernels compiled for this CPU).
    #[arg(long, default_value = "cpu")]
    pub device: crate::generation::DeviceChoice,
}

#[derive(Args, Debug, Clone)]
#[command(group(ArgGroup::new("source").required(true).args(["prompt", "input"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    pub source: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Batch mode: a JSON Lines file, one request per line (see README).
    #[arg(long, requires = "output")]
    pub input: Option<PathBuf>,
    /// Batch mode: where to write one result line per request, in input order.
    #[arg(long, requires = "input")]
    pub output: Option<PathBuf>,
    /// Most tokens to generate (in batch mode, for lines that do not say).
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
    /// Seed of the sampling stream (in batch mode, lines without a seed use this plus their line number).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the generated token ids too.
    #[arg(long)]
    pub show_tokens: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Devices to run on: more than 1 runs the in-process actor cluster
    /// (one GPU worker and one expert shard per device); the output is the same.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub devices: u32,
    /// Expert-parallel degree with --devices (divides it; default: --devices): the routed
    /// experts are cut into this many groups, each on devices/E devices.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub expert_parallel: Option<u32>,
    /// Submit to the running cluster of this topology file (as a client
    /// endpoint with the `client` certificate) instead of running the model
    /// here; the model is the topology's.
    #[arg(long, conflicts_with_all = ["devices", "expert_parallel", "model"])]
    pub topology: Option<PathBuf>,
    /// Certificate directory with --topology (default: its `certs_dir`).
    #[arg(long, requires = "topology")]
    pub certs: Option<PathBuf>,
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model { command: ModelCommand::Init(args) } => commands::model_init::run(&args),
        Command::Generate(args) => match &args.input {
            Some(_) => commands::batch::run(&args),
            None => commands::generate::run(&args),
        },
        Command::Serve(args) => commands::serve::run(&args),
        Command::Cluster { command: ClusterCommand::InitCerts(args) } => commands::cluster::init_certs(&args),
        Command::Launch(args) => commands::cluster::launch(&args),
        Command::Node(args) => commands::cluster::node(&args),
        Command::Status(args) => commands::cluster::status(&args),
        Command::Drain(args) => commands::cluster::drain(&args),
        Command::Simulate(args) => commands::simulate::run_command(&args),
        Command::Plan(args) => commands::plan::run(&args),
    }
}
