//! `deepinfer simulate FILE [--seed N] [--speculative off|mtp|dspark] [--out DIR]`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use deepinfer_engine::speculative::DraftMethod;

use crate::scenario::{default_drafting, Scenario};
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
    /// Speculative decoding instead of the scenario's: `off`, or `mtp` /
    /// `dspark` (the file's `[speculative]` table if it names that method,
    /// else five drafts, adaptive, the default acceptance model).
    #[arg(long)]
    pub speculative: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
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
