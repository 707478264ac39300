//! `deepinfer plan FILE [--gpus N] [--gpu-hour-usd P] [--prefill-sizes ..] [--decode-sizes ..] [--colocated-sizes ..] [--redundant ..] [--cache-tiers ..] [--kv-dtypes ..] [--encoders ..] [--progress] [--out DIR]`.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use deepinfer_actors::cluster::disagg::InstanceKind;

use crate::scenario::Scenario;
use crate::simulate::capacity::Criteria;
use crate::simulate::plan::{plan, CacheTiers, KvDtype, PlanSpace, Search};
use crate::simulate::progress::EVERY_DEFAULT_S;

/// DeepSeek's own assumption for its V3/R1 cost analysis: an H800 leased at $2 an hour.
pub const GPU_HOUR_USD_DEFAULT: f64 = 2.0;

#[derive(Args, Debug, Clone)]
pub struct PlanArgs {
    /// A scenario file: its model, hardware, traffic and SLOs are planned for (see simulations/README.md).
    pub scenario: PathBuf,
    /// GPUs every layout uses (default: the file's).
    #[arg(long)]
    pub gpus: Option<u32>,
    /// Price of one GPU-hour in dollars, for the cost per million tokens
    /// (default: $2, DeepSeek's H800 lease assumption).
    #[arg(long, default_value_t = GPU_HOUR_USD_DEFAULT)]
    pub gpu_hour_usd: f64,
    /// Devices of one prefill instance (its expert-parallel degree) to try (default: the file's).
    #[arg(long, value_delimiter = ',')]
    pub prefill_sizes: Vec<u32>,
    /// Devices of one decode instance to try (default: the file's).
    #[arg(long, value_delimiter = ',')]
    pub decode_sizes: Vec<u32>,
    /// Devices of one colocated instance to try, for files without disaggregation (default: the file's).
    #[arg(long, value_delimiter = ',')]
    pub colocated_sizes: Vec<u32>,
    /// Redundant expert slots per instance to try (default: the file's).
    #[arg(long, value_delimiter = ',')]
    pub redundant: Vec<usize>,
    /// Prompt-cache tiers to try, of those the file's `[cache]` configures:
    /// `device` (the device's prefix cache only), `host`, `all` (default: the file's as they are).
    #[arg(long, value_delimiter = ',')]
    pub cache_tiers: Vec<CacheTiers>,
    /// KV cache formats to try: `bf16`, `fp8`, `fp4` (V4.1's own layout) —
    /// those the model has (default: the file's `[engine] kv_dtype`).
    #[arg(long, value_delimiter = ',')]
    pub kv_dtypes: Vec<KvDtype>,
    /// Image-encoder instances to try, each like the file's first `role =
    /// "encoder"` instance (0: images encoded on the prefill instances;
    /// default: the file's count). Needs `[images]` traffic.
    #[arg(long, value_delimiter = ',')]
    pub encoders: Vec<u32>,
    /// Seed instead of the scenario's own.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Least share of requests within both SLOs for a load to count as sustained.
    #[arg(long, default_value_t = Criteria::default().slo_attainment_min)]
    pub slo_attainment: f64,
    /// Bisection steps of each layout's capacity search once bracketed.
    #[arg(long, default_value_t = 3)]
    pub capacity_steps: u32,
    /// Besides a line per layout: a line on stderr per capacity probe, and
    /// one every --progress-every seconds of wall time while a probe runs.
    #[arg(long)]
    pub progress: bool,
    /// With --progress: seconds of wall time between two lines of a running probe.
    #[arg(long, default_value_t = EVERY_DEFAULT_S, requires = "progress")]
    pub progress_every: f64,
    /// Directory for plan.json, plan.md and plan.svg (created if missing).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The sizes the file's instances of `kind` have, in order, once each.
fn file_sizes(s: &Scenario, kind: InstanceKind) -> Vec<u32> {
    let mut sizes: Vec<u32> = s.instances.iter().filter(|(k, _)| *k == kind).map(|(_, d)| *d).collect();
    sizes.dedup();
    sizes
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    let s = Scenario::from_file(&args.scenario)?;
    let or_file = |given: &[u32], kind| if given.is_empty() { file_sizes(&s, kind) } else { given.to_vec() };
    let space = PlanSpace {
        gpus: args.gpus.unwrap_or_else(|| s.instances.iter().map(|(_, d)| d).sum()),
        prefill_sizes: or_file(&args.prefill_sizes, InstanceKind::Prefill),
        decode_sizes: or_file(&args.decode_sizes, InstanceKind::Decode),
        colocated_sizes: or_file(&args.colocated_sizes, InstanceKind::Both),
        redundant: if args.redundant.is_empty() { vec![s.redundant_experts] } else { args.redundant.clone() },
        cache_tiers: args.cache_tiers.clone(),
        kv_dtypes: args.kv_dtypes.clone(),
        encoders: args.encoders.clone(),
    };
    let criteria = Criteria { slo_attainment_min: args.slo_attainment };
    anyhow::ensure!(
        criteria.slo_attainment_min > 0.0 && criteria.slo_attainment_min <= 1.0,
        "--slo-attainment is a share in (0, 1]"
    );
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let progress_every_s = args.progress.then_some(args.progress_every);
    let search = Search { seed: args.seed, criteria, steps: args.capacity_steps, threads, progress_every_s };
    let p = plan(&s, &space, args.gpu_hour_usd, search, |c| {
        let got =
            c.capacity.as_ref().map_or("no load held".to_string(), |_| format!("{:.0} tok/s per GPU", c.tok_s_per_gpu));
        eprintln!("{}: {got} ({:.1} s)", c.layout.label, started.elapsed().as_secs_f64());
    })
    .map_err(|e| anyhow::anyhow!("{}: {e}", s.file))?;
    let markdown = p.to_markdown();
    if let Some(dir) = &args.out {
        super::simulate::write_files(dir, "plan", &p.to_json(), &markdown, &p.plot())?;
    }
    print!("{markdown}");
    eprintln!("{} layouts in {:.1} s of wall time", p.candidates.len(), started.elapsed().as_secs_f64());
    Ok(())
}
