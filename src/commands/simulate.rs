//! `deepinfer simulate FILE [--seed N] [--out DIR]`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use crate::scenario::Scenario;
use crate::simulate::{plots, run};

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
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run_command(args: &SimulateArgs) -> anyhow::Result<()> {
    let scenario = Scenario::from_file(&args.scenario)?;
    let started = Instant::now();
    let report = run(&scenario, args.seed, !args.quiet && std::io::stderr().is_terminal())?;
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
    eprintln!("simulated {:.0} s in {wall_s:.1} s of wall time", report.simulated_s);
    if report.requests.lost > 0 || report.requests.token_mismatches > 0 {
        anyhow::bail!(
            "{} requests lost, {} with the wrong number of tokens",
            report.requests.lost,
            report.requests.token_mismatches
        );
    }
    Ok(())
}
