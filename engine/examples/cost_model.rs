//! The simulator's device cost model against published operating points:
//! DeepSeek's own figures, which set its constants, and other deployments,
//! which only check them.
//!
//! Hopper's points are priced with Hopper's achieved fractions, Blackwell's
//! with SM100's (`cost::blackwell`).
//!
//! `cargo run --release -p deepinfer-engine --example cost_model [OVERLAP]`

use deepinfer_engine::cost::calibration::{blackwell_points, hopper_points, Role};
use deepinfer_engine::cost::{blackwell, Efficiency};

fn main() {
    let mut eff = Efficiency::default();
    if let Some(overlap) = std::env::args().nth(1).and_then(|a| a.parse().ok()) {
        eff.overlap = overlap;
    }
    println!("overlap {:.2}\n", eff.overlap);
    println!("| role | source | point | published | modelled | error |");
    println!("|---|---|---|---:|---:|---:|");
    let mut sm100 = blackwell::efficiency();
    sm100.overlap = eff.overlap;
    for p in hopper_points(eff).into_iter().chain(blackwell_points(sm100)) {
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
