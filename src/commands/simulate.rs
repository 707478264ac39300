//! `deepinfer simulate FILE [--seed N] [--speculative off|mtp|dspark] [--cache-sweep SCALES | --find-capacity] [--progress] [--out DIR]`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use deepinfer_engine::speculative::DraftMethod;

use crate::scenario::{default_drafting, Scenario};
use crate::simulate::capacity::{find_capacity_with, Criteria, STEPS_DEFAULT};
use crate::simulate::progress::EVERY_DEFAULT_S;
use crate::simulate::sweep::cache_sweep;
use crate::simulate::{plots, run, Progress};

#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// A scenario file (see simulations/README.md).
    pub scenario: PathBuf,
    /// Seed instead of the scenario's own.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Directory for report.json, report.md and the plots (created if missing).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Speculative decoding instead of the scenario's: `off`, or `mtp` /
    /// `dspark` (the file's `[speculative]` table if it names that method,
    /// else five drafts, adaptive, the default acceptance model).
    #[arg(long)]
    pub speculative: Option<String>,
    /// No progress bar (nor, with --find-capacity, a line per probe).
    #[arg(long, conflicts_with = "progress")]
    pub quiet: bool,
    /// Show progress even when stderr is not a terminal: a plain line every
    /// --progress-every seconds of wall time (simulated seconds done, requests
    /// submitted and running, wall time), for runs whose stderr goes to a log.
    #[arg(long)]
    pub progress: bool,
    /// With --progress: seconds of wall time between two progress lines.
    #[arg(long, default_value_t = EVERY_DEFAULT_S, requires = "progress")]
    pub progress_every: f64,
    /// Instead of one run: hit rate and TTFT against cache capacity, the
    /// file's `[cache]` tiers added one at a time, each at these multiples
    /// of its capacities (e.g. `0.25,0.5,1,2,4`); writes cache_sweep.* into --out.
    #[arg(long, value_delimiter = ',')]
    pub cache_sweep: Option<Vec<f64>>,
    /// Instead of one run: the highest load the deployment sustains within
    /// its SLOs (the traffic's rate scaled, same seed); writes capacity.*
    /// into --out.
    #[arg(long, conflicts_with = "cache_sweep")]
    pub find_capacity: bool,
    /// With --find-capacity: least share of requests within both SLOs for a load to count as sustained.
    #[arg(long, default_value_t = Criteria::default().slo_attainment_min, requires = "find_capacity")]
    pub slo_attainment: f64,
    /// With --find-capacity: bisection steps once the load is bracketed (each halves the bracket's ratio).
    #[arg(long, default_value_t = STEPS_DEFAULT, requires = "find_capacity")]
    pub capacity_steps: u32,
}

pub fn run_command(args: &SimulateArgs) -> anyhow::Result<()> {
    let mut scenario = Scenario::from_file(&args.scenario)?;
    if let Some(m) = &args.speculative {
        let method: DraftMethod = m.parse().map_err(anyhow::Error::msg)?;
        if scenario.speculative.as_ref().is_none_or(|d| d.config.method != method) {
            scenario.speculative = default_drafting(scenario.model, method)
                .map_err(|e| anyhow::anyhow!("{}: --speculative {method}: {e}", scenario.file))?;
        }
    }
    let started = Instant::now();
    if let Some(scales) = &args.cache_sweep {
        if scales.is_empty() || scales.iter().any(|x| !(x.is_finite() && *x > 0.0)) {
            anyhow::bail!("--cache-sweep: give positive multiples, e.g. 0.25,0.5,1,2,4");
        }
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let sweep = cache_sweep(&scenario, scales, args.seed, threads)?;
        let markdown = sweep.to_markdown();
        if let Some(dir) = &args.out {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
            let (hit, ttft) = sweep.plots();
            std::fs::write(dir.join("cache_sweep.json"), sweep.to_json())?;
            std::fs::write(dir.join("cache_sweep.md"), &markdown)?;
            std::fs::write(dir.join("cache_sweep.svg"), hit)?;
            std::fs::write(dir.join("cache_sweep_ttft.svg"), ttft)?;
        }
        print!("{markdown}");
        eprintln!("{} runs in {:.1} s of wall time", sweep.rows.len(), started.elapsed().as_secs_f64());
        return Ok(());
    }
    if args.find_capacity {
        return capacity_command(&scenario, args, started);
    }
    let report = run(&scenario, args.seed, progress(args))?;
    let wall_s = started.elapsed().as_secs_f64();
    let markdown = report.to_markdown();
    if let Some(dir) = &args.out {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        std::fs::write(dir.join("report.json"), report.to_json())
            .with_context(|| format!("cannot write {}", dir.join("report.json").display()))?;
        std::fs::write(dir.join("report.md"), &markdown)?;
        plots::write_all(&report, dir).with_context(|| format!("cannot write plots into {}", dir.display()))?;
    }
    print!("{markdown}");
    eprintln!(
        "simulated {:.0} s in {wall_s:.1} s of wall time: {} events, {:.0} events/s",
        report.simulated_s,
        report.events,
        report.events as f64 / wall_s.max(1e-9)
    );
    if report.requests.lost > 0 || report.requests.token_mismatches > 0 {
        anyhow::bail!(
            "{} requests lost, {} with the wrong number of tokens",
            report.requests.lost,
            report.requests.token_mismatches
        );
    }
    Ok(())
}

/// A bar on a terminal (unless --quiet); with --progress and stderr not a terminal, lines.
fn progress(args: &SimulateArgs) -> Progress {
    let terminal = std::io::stderr().is_terminal();
    match (args.progress, terminal) {
        (true, false) => Progress::lines(args.progress_every, "progress"),
        (true, true) => Progress::Bar,
        (false, _) => Progress::from(terminal && !args.quiet),
    }
}

/// `NAME.json`, `NAME.md` and `NAME.svg` into `dir` (created if missing).
pub fn write_files(dir: &std::path::Path, name: &str, json: &str, markdown: &str, svg: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    for (ext, text) in [("json", json), ("md", markdown), ("svg", svg)] {
        let path = dir.join(format!("{name}.{ext}"));
        std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn capacity_command(scenario: &Scenario, args: &SimulateArgs, started: Instant) -> anyhow::Result<()> {
    let criteria = Criteria { slo_attainment_min: args.slo_attainment };
    let verbose = !args.quiet;
    // Without --progress the probes' runs are silent; each probe's line says how it went.
    let progress = if args.progress { progress(args) } else { Progress::Off };
    let capacity = find_capacity_with(scenario, args.seed, criteria, args.capacity_steps, &progress, |p| {
        if verbose {
            eprintln!("{}", p.summary());
        }
    })
    .map_err(|e| anyhow::anyhow!("{}: {e}", scenario.file))?;
    let markdown = capacity.to_markdown();
    if let Some(dir) = &args.out {
        write_files(dir, "capacity", &capacity.to_json(), &markdown, &capacity.plot())?;
    }
    print!("{markdown}");
    eprintln!("{} runs in {:.1} s of wall time", capacity.probes.len(), started.elapsed().as_secs_f64());
    Ok(())
}
