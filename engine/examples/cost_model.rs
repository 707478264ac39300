//! The simulator's device cost model against published operating points:
//! DeepSeek's own figures, which set its constants, and other deployments,
//! which only check them.
//!
//! `cargo run --release -p deepinfer-engine --example cost_model [OVERLAP]`

use deepinfer_engine::cost::calibration::{points, Role};
use deepinfer_engine::cost::Efficiency;

fn main() {
    let mut eff = Efficiency::default();
    if let Some(overlap) = std::env::args().nth(1).and_then(|a| a.parse().ok()) {
        eff.overlap = overlap;
    }
    println!("overlap {:.2}\n", eff.overlap);
    println!("| role | source | point | published | modelled | error |");
    println!("|---|---|---|---:|---:|---:|");
    for p in points(eff) {
        let role = match p.role {
            Role::Calibration => "sets",
            Role::Check => "checks",
        };
        println!(
            "| {role} | {} | {} | {:.0} {} | {:.0} | {:+.1}% |",
            p.source,
            p.what,
            p.published,
            p.unit,
            p.modelled,
            p.error() * 100.0
        );
    }
}
