//! EPLB on a skewed load: 256 experts per layer with Zipf(s = 1.2) popularity
//! (a different random ranking per layer), 8 nodes. Prints the max/mean GPU
//! load before (experts in order, 256 / GPUs per GPU, no replicas) and after.
//! Slots that do not divide over the GPUs (256 + 32 on 64) give the first
//! GPUs of each node one slot more.
//!
//! `cargo run --release -p deepinfer-engine --example eplb_skew`

use deepinfer_engine::eplb::{imbalance, rebalance};

const EXPERTS: usize = 256;
const LAYERS: usize = 58;
const ZIPF_S: f64 = 1.2;

fn main() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let load: Vec<Vec<f64>> = (0..LAYERS)
        .map(|_| {
            let mut rank: Vec<usize> = (0..EXPERTS).collect();
            for i in (1..EXPERTS).rev() {
                rank.swap(i, (next() % (i as u64 + 1)) as usize);
            }
            // 1e6 tokens per layer, split by Zipf popularity.
            let norm: f64 = (1..=EXPERTS).map(|r| (r as f64).powf(-ZIPF_S)).sum();
            rank.iter().map(|&r| 1e6 * ((r + 1) as f64).powf(-ZIPF_S) / norm).collect()
        })
        .collect();
    println!(
        "| GPUs | redundant | slots/GPU (max) | max/mean before | after, hierarchical (8 groups, 8 nodes) | after, global |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for (gpus, redundant) in [(64, 32), (64, 64), (64, 128), (32, 32), (128, 128)] {
        let nodes = 8;
        let placement = rebalance(&load, EXPERTS + redundant, 8, nodes, gpus).expect("valid shape");
        let global = rebalance(&load, EXPERTS + redundant, 1, 1, gpus).expect("valid shape");
        let (mut before, mut after, mut after_global) = (0.0, 0.0, 0.0);
        for (l, layer) in load.iter().enumerate() {
            let per_gpu = EXPERTS / gpus;
            let naive: Vec<f64> = (0..gpus).map(|g| layer[g * per_gpu..(g + 1) * per_gpu].iter().sum()).collect();
            before += imbalance(&naive);
            after += imbalance(&placement.gpu_loads(l, layer));
            after_global += imbalance(&global.gpu_loads(l, layer));
        }
        println!(
            "| {gpus} | {redundant} | {} | {:.2} | {:.2} | {:.2} |",
            placement.slots_per_gpu(),
            before / LAYERS as f64,
            after / LAYERS as f64,
            after_global / LAYERS as f64
        );
    }
}
