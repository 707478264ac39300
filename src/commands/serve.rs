//! `deepinfer serve`: the HTTP API on this process's engine, or as a front
//! end of a running cluster.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::bail;
use clap::{ArgAction, Args};
use deepinfer_engine::engine::EngineConfig;

use crate::api::images::{FetchConfig, ImageConfig, ImageLimits};
use crate::api::{ClusterRunner, Runner, ServeConfig, Server};
use crate::cli::{EngineArgs, ModelArgs};
use crate::cluster::ClusterPlan;
use crate::generation::load_model_with;
use crate::kv_disk::{system_clock, weights_identity, CacheSetup, DiskConfig};
use deepinfer_engine::engine::TierConfig;
use deepinfer_engine::kv_tiers::PersistRule;
use deepinfer_engine::model::RoutedExperts;
use deepinfer_engine::request::MAX_CACHE_TTL_MS;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub source: ModelArgs,
    /// Name clients pass as `model` (default: the preset's or the directory's name).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Serve the model of a topology file: a one-device topology in this
    /// process, a larger one as a front end of its running cluster (started
    /// with `deepinfer launch`), reached over QUIC with the `client` certificate.
    #[arg(long)]
    pub topology: Option<PathBuf>,
    /// Certificate directory of the cluster (default: `certs_dir` of the topology).
    #[arg(long, requires = "topology")]
    pub certs: Option<PathBuf>,
    /// Address to listen on; port 0 picks a free port (printed at start).
    /// Default: the topology's `api_listen`, else 127.0.0.1:8000.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    #[arg(long, env = "DEEPINFER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Thinking mode of requests that do not choose one.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub default_thinking: bool,
    /// Largest request body, in bytes (larger ones get 413).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Time a connection has to send a request's headers before it is closed, in ms.
    #[arg(long, default_value_t = 10_000)]
    pub header_timeout_ms: u64,
    /// Time a request has to send its body once its headers are in (408 past it), in ms.
    #[arg(long, default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// Most generation requests in flight (queued, running or streaming); more get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_concurrent_requests: usize,
    /// Most requests waiting for the engine; more get 429.
    #[arg(long, default_value_t = 512)]
    pub max_queue: usize,
    /// Largest `max_tokens` a request may ask for (default: the model's context).
    #[arg(long)]
    pub max_tokens_limit: Option<u32>,
    /// Stop when standard input closes (how `launch` stops the front end it starts).
    #[arg(long, hide = true)]
    pub exit_with_stdin: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub images: ImageArgs,
}

/// Image input: limits (each defaults to DeepSeek's API limit, or the one
/// stated) and URL fetching, off unless asked for.
#[derive(Args, Debug, Clone)]
pub struct ImageArgs {
    /// Fetch `http(s)` image URLs (off: such a request gets a 400).
    #[arg(long)]
    pub image_fetch: bool,
    /// Fetch from this range although it is loopback, private, link-local,
    /// multicast or unspecified (repeatable; e.g. 127.0.0.1/32 for a local server).
    #[arg(long, value_name = "CIDR", requires = "image_fetch")]
    pub image_fetch_allow: Vec<ipnet::IpNet>,
    /// Time for all of one request's image fetches, in ms [default: 10000].
    #[arg(long)]
    pub image_fetch_timeout_ms: Option<u64>,
    /// Most redirects followed per image URL [default: 3].
    #[arg(long)]
    pub image_fetch_max_redirects: Option<usize>,
    /// Most images in one request [default: 16].
    #[arg(long)]
    pub max_images: Option<usize>,
    /// Longest image URL, in characters [default: 8192].
    #[arg(long)]
    pub max_image_url_chars: Option<usize>,
    /// Most encoded bytes of one image [default: 32 MiB].
    #[arg(long)]
    pub max_image_bytes: Option<usize>,
    /// Most encoded bytes of a request's images together [default: 64 MiB].
    #[arg(long)]
    pub max_image_request_bytes: Option<usize>,
    /// Longest image side, in pixels [default: 8192].
    #[arg(long)]
    pub max_image_side: Option<u32>,
    /// Most pixels of one image, read from its header before decoding [default: 32 Mi].
    #[arg(long)]
    pub max_image_pixels: Option<u64>,
    /// Most pixels of a request's images together [default: 64 Mi].
    #[arg(long)]
    pub max_image_request_pixels: Option<u64>,
}

impl ImageArgs {
    pub fn config(&self) -> anyhow::Result<ImageConfig> {
        let (l, f) = (ImageLimits::default(), FetchConfig::default());
        let limits = ImageLimits {
            max_images: self.max_images.unwrap_or(l.max_images),
            max_url_chars: self.max_image_url_chars.unwrap_or(l.max_url_chars),
            max_image_bytes: self.max_image_bytes.unwrap_or(l.max_image_bytes),
            max_request_bytes: self.max_image_request_bytes.unwrap_or(l.max_request_bytes),
            max_side: self.max_image_side.unwrap_or(l.max_side),
            max_pixels: self.max_image_pixels.unwrap_or(l.max_pixels),
            max_request_pixels: self.max_image_request_pixels.unwrap_or(l.max_request_pixels),
        };
        let fetch = FetchConfig {
            enabled: self.image_fetch,
            allow: self.image_fetch_allow.clone(),
            timeout: self.image_fetch_timeout_ms.map_or(f.timeout, std::time::Duration::from_millis),
            max_redirects: self.image_fetch_max_redirects.unwrap_or(f.max_redirects),
        };
        if fetch.timeout.is_zero() || limits.max_url_chars == 0 || limits.max_image_bytes == 0 || limits.max_side == 0 {
            bail!("--image-fetch-timeout-ms, --max-image-url-chars, --max-image-bytes and --max-image-side must be at least 1");
        }
        Ok(ImageConfig { limits, fetch })
    }
}

/// The prompt cache's tiers below the KV pool.
#[derive(Args, Debug, Clone)]
pub struct CacheArgs {
    /// Directory of the prompt cache's disk tier (a local disk, or a mount
    /// several servers share); cached prompts survive restarts there. Off when absent.
    #[arg(long)]
    pub kv_cache_dir: Option<PathBuf>,
    /// Most GiB of block files this server keeps in --kv-cache-dir.
    #[arg(long, default_value_t = 64)]
    pub kv_cache_disk_gib: u64,
    /// Host memory for prompt cache blocks evicted from the KV pool, in MiB (0: none).
    #[arg(long, default_value_t = 2048)]
    pub host_cache_mib: usize,
    /// How long a cached prompt stays servable after its last use, in seconds
    /// (requests may ask for less or more: `prompt_cache_retention`, `cache_control.ttl`).
    #[arg(long, default_value_t = 72 * 3600)]
    pub prompt_cache_ttl_secs: u64,
    /// Persist long prompts to disk every this many blocks, besides each prompt's and output's end.
    #[arg(long, default_value_t = 16)]
    pub persist_interval_blocks: usize,
}

impl CacheArgs {
    /// The tiers these flags ask for, for a model loaded from `spec` with `seed`.
    pub fn setup(&self, spec: &str, seed: u64) -> anyhow::Result<CacheSetup> {
        let ttl_ms = self.prompt_cache_ttl_secs.saturating_mul(1000);
        if !(1..=MAX_CACHE_TTL_MS).contains(&ttl_ms) {
            bail!(
                "--prompt-cache-ttl-secs must be 1 to {}, got {}",
                MAX_CACHE_TTL_MS / 1000,
                self.prompt_cache_ttl_secs
            );
        }
        let disk = self.kv_cache_dir.as_ref().map(|dir| DiskConfig {
            dir: dir.clone(),
            capacity_bytes: self.kv_cache_disk_gib.saturating_mul(1 << 30),
            weights_identity: weights_identity(spec, seed),
        });
        let host_bytes = self.host_cache_mib.saturating_mul(1 << 20);
        let persist = PersistRule { interval_blocks: self.persist_interval_blocks };
        Ok(CacheSetup { tiers: TierConfig { host_bytes, disk: disk.is_some(), persist }, disk, clock: system_clock() })
    }
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    let gpu = crate::generation::open_device(args.source.device)?;
    if gpu.is_some() && args.topology.is_some() {
        bail!("--device {:?} serves from this process's engine: not with --topology", args.source.device);
    }
    let default_listen = || SocketAddr::from(([127, 0, 0, 1], 8000));
    // A one-device topology is served by this process's engine, drafting as its table says.
    let mut topology_drafting = None;
    let (model_spec, listen, plan) = match &args.topology {
        None => (args.source.model.clone(), args.listen.unwrap_or_else(default_listen), None),
        Some(path) => {
            if args.engine.speculative != "off" {
                bail!("--speculative with --topology: the cluster drafts as its topology's [cluster.speculative] says");
            }
            let plan = ClusterPlan::load(path)?;
            let listen = args.listen.unwrap_or_else(|| plan.api_listen());
            topology_drafting = Some(plan.base_config().engine.speculative);
            // A cluster with an image encoder instance is fronted even with one serving device.
            let fronted = plan.devices() > 1 || !plan.encoder_nodes.is_empty();
            (plan.model_spec(), listen, fronted.then_some(plan))
        }
    };
    // A front end of a cluster computes nothing: the shards hold the routed experts.
    let routed = if plan.is_some() { RoutedExperts::Elsewhere } else { RoutedExperts::Resident };
    let mut loaded = load_model_with(&model_spec, args.source.model_seed, args.source.tokenizer.as_deref(), routed)?;
    loaded.model = crate::generation::place_model(loaded.model, gpu.as_ref())?;
    let context = loaded.model.config.max_position_embeddings;
    let mut config = serve_config(args, &loaded.name, context, (&model_spec, args.source.model_seed))?;
    if let Some(speculative) = topology_drafting {
        speculative.check(&loaded.model).map_err(anyhow::Error::msg)?;
        config.engine.speculative = speculative;
    }
    let model = Arc::new(loaded.model);
    let runner = match &plan {
        None => Runner::Engine,
        Some(plan) => {
            let (rt, cluster) = crate::cluster::connect_client(plan, args.certs.as_deref(), Arc::clone(&model))?;
            let (policy, failure_timeout) = (plan.base_config().engine, plan.failure_timeout);
            Runner::Cluster(Box::new(ClusterRunner { rt, cluster, policy, failure_timeout }))
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("http").build()?;
    runtime.block_on(async move {
        let name = config.model_name.clone();
        let server = Server::bind(model, loaded.tokenizer, config, listen, runner).await?;
        let addr = server.local_addr()?;
        match &plan {
            None => eprintln!("deepinfer: serving `{name}` on http://{addr}"),
            Some(p) => eprintln!(
                "deepinfer: serving `{name}` from cluster {} ({} nodes, {} devices) on http://{addr}",
                p.name(),
                p.nodes.len(),
                p.devices()
            ),
        }
        server.run(shutdown_signal(args.exit_with_stdin)).await
    })
}

fn serve_config(
    args: &ServeArgs,
    loaded_name: &str,
    context: usize,
    (model_spec, model_seed): (&str, u64),
) -> anyhow::Result<ServeConfig> {
    if args.max_concurrent_requests == 0
        || args.max_body_bytes == 0
        || args.max_tokens_limit == Some(0)
        || args.header_timeout_ms == 0
        || args.body_timeout_ms == 0
    {
        bail!(
            "--max-concurrent-requests, --max-body-bytes, --max-tokens-limit, --header-timeout-ms and \
             --body-timeout-ms must be at least 1"
        );
    }
    Ok(ServeConfig {
        model_name: args.served_model_name.clone().unwrap_or_else(|| served_name(loaded_name)),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: args.max_body_bytes,
        header_timeout: std::time::Duration::from_millis(args.header_timeout_ms),
        body_timeout: std::time::Duration::from_millis(args.body_timeout_ms),
        max_concurrent: args.max_concurrent_requests,
        max_tokens_limit: args.max_tokens_limit.unwrap_or(context.min(u32::MAX as usize) as u32),
        default_thinking: args.default_thinking,
        engine: EngineConfig {
            max_waiting: args.max_queue,
            cache_ttl_ms: args.cache.prompt_cache_ttl_secs.saturating_mul(1000),
            ..args.engine.to_config()?
        },
        cache: args.cache.setup(model_spec, model_seed)?,
        images: args.images.config()?,
    })
}

/// `builtin:tiny-v4` → `tiny-v4`; a directory → its last component.
fn served_name(loaded: &str) -> String {
    match loaded.strip_prefix("builtin:") {
        Some(preset) => preset.to_string(),
        None => {
            let path = std::path::Path::new(loaded);
            path.file_name().map_or_else(|| loaded.to_string(), |n| n.to_string_lossy().into_owned())
        }
    }
}

async fn shutdown_signal(exit_with_stdin: bool) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let stdin_closed = async move {
        if !exit_with_stdin {
            return std::future::pending().await;
        }
        let _ =
            tokio::task::spawn_blocking(|| std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())).await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
        () = stdin_closed => {},
    }
    eprintln!("deepinfer: shutting down");
}
