//! One phase of the forward pass in a loop, for profilers:
//! `cargo run --release --example forward_profile -- MODEL PHASE SIZE [REPS]`
//! where MODEL is a preset name or a checkpoint directory, PHASE is `prefill`
//! (SIZE = prompt tokens) or `decode` (SIZE = sequences, each holding a
//! 128-token context).

use deepinfer_engine::model::{Chunk, LogitsWanted, Model, SequenceState};
use deepinfer_engine::presets::{build, Preset};

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|i| 2 + ((i * 7919 + salt * 104729) % 1000) as u32).collect()
}

fn main() {
    deepinfer::allocator::keep_freed_pages();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: forward_profile MODEL prefill|decode SIZE [REPS]";
    assert!(args.len() >= 3, "{usage}");
    let model = match Preset::from_name(&args[0]) {
        Some(preset) => build(preset, 1).expect("preset builds"),
        None => Model::load(std::path::Path::new(&args[0])).expect("checkpoint loads"),
    };
    let size: usize = args[2].parse().expect("SIZE is a number");
    let reps: usize = args.get(3).map_or(20, |r| r.parse().expect("REPS is a number"));
    let states: Vec<SequenceState> = (0..size)
        .map(|b| {
            let mut state = model.new_state();
            if args[1] == "decode" {
                model.forward(&mut [Chunk::new(&prompt(128, b), &mut state)], LogitsWanted::None, false);
            }
            state
        })
        .collect();
    for _ in 0..reps {
        let mut states = states.clone();
        let started = std::time::Instant::now();
        match args[1].as_str() {
            "prefill" => {
                let tokens = prompt(size, 0);
                model.forward(&mut [Chunk::new(&tokens, &mut states[0])], LogitsWanted::Last, false);
            }
            "decode" => {
                let next: Vec<[u32; 1]> = (0..size).map(|b| [2 + b as u32]).collect();
                let mut chunks: Vec<Chunk> = states.iter_mut().zip(&next).map(|(s, t)| Chunk::new(&t[..], s)).collect();
                model.forward(&mut chunks, LogitsWanted::Last, false);
            }
            other => panic!("unknown phase {other}; {usage}"),
        }
        eprintln!("{} {size}: {:.2} ms", args[1], started.elapsed().as_secs_f64() * 1e3);
    }
}
