//! Prefill of a 512-token prompt on `small-v4`, for profilers.
//!
//! `cargo run --release --example prefill_profile`

use deepinfer_engine::model::{Chunk, LogitsWanted};
use deepinfer_engine::presets::{build, Preset};

fn main() {
    let model = build(Preset::SmallV4, 1).expect("preset builds");
    let tokens: Vec<u32> = (0..512).map(|i| 2 + (i * 7919 % 1000) as u32).collect();
    for _ in 0..8 {
        let started = std::time::Instant::now();
        let mut state = model.new_state();
        model.forward(&mut [Chunk::new(&tokens, &mut state)], LogitsWanted::Last, false);
        eprintln!("prefill 512 tokens: {:.1} ms", started.elapsed().as_secs_f64() * 1e3);
    }
}
