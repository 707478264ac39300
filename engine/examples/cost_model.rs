//! The simulator's device cost model at DeepSeek's published operating points.
//!
//! `cargo run --release -p deepinfer-engine --example cost_model`

use deepinfer_engine::cost::{step_cost, DeviceStep, Efficiency, HardwareKind, ModelKind, SeqWork};

fn decode(model: ModelKind, hw: HardwareKind, ep: usize, batch: usize, context: usize) {
    let m = model.cost();
    let slots = m.experts + if ep > m.experts { ep } else { 32.min(ep) };
    let step = DeviceStep {
        sequences: vec![SeqWork { new_tokens: 1, context }; batch],
        expert_tokens: batch * m.experts_per_token,
        experts_hit: slots.div_ceil(ep),
        expert_parallel: ep,
        devices_per_node: hw.spec().scale_up_domain,
    };
    let c = step_cost(&hw.spec(), &m, &step, Efficiency::default());
    println!(
        "| {} | {} | decode EP{ep}, {batch} seqs × {context} ctx | {:.1} ms (compute {:.1}, HBM {:.1}, network {:.1}) | {:.0} tok/s per user, {:.0} per GPU |",
        m.name,
        hw.name(),
        c.total_us / 1e3,
        c.compute_us / 1e3,
        c.memory_us / 1e3,
        c.network_us / 1e3,
        1e6 / c.total_us,
        batch as f64 * 1e6 / c.total_us
    );
}

fn prefill(model: ModelKind, hw: HardwareKind, ep: usize, seqs: usize, new: usize, cached: usize) {
    let m = model.cost();
    let step = DeviceStep {
        sequences: vec![SeqWork { new_tokens: new, context: cached }; seqs],
        expert_tokens: seqs * new * m.experts_per_token,
        experts_hit: (m.experts + 32).div_ceil(ep),
        expert_parallel: ep,
        devices_per_node: hw.spec().scale_up_domain,
    };
    let c = step_cost(&hw.spec(), &m, &step, Efficiency::default());
    let computed = (seqs * new) as f64 * 1e6 / c.total_us;
    let with_hits = (seqs * (new + cached)) as f64 * 1e6 / c.total_us;
    println!(
        "| {} | {} | prefill EP{ep}, {seqs} × ({new} new + {cached} cached) | {:.1} ms (compute {:.1}, HBM {:.1}, network {:.1}) | {:.0} computed, {:.0} incl. cache hits, tok/s per GPU |",
        m.name,
        hw.name(),
        c.total_us / 1e3,
        c.compute_us / 1e3,
        c.memory_us / 1e3,
        c.network_us / 1e3,
        computed,
        with_hits
    );
}

fn main() {
    println!("| model | hardware | step | step time | throughput |");
    println!("|---|---|---|---|---|");
    decode(ModelKind::DeepSeekV3, HardwareKind::H800, 144, 96, 4096);
    prefill(ModelKind::DeepSeekV3, HardwareKind::H800, 32, 4, 2048, 2560);
    decode(ModelKind::V4Flash, HardwareKind::H200, 16, 64, 8192);
    decode(ModelKind::V41Flash, HardwareKind::B200, 64, 128, 8192);
    prefill(ModelKind::V41Flash, HardwareKind::B200, 64, 8, 4096, 4096);
    decode(ModelKind::V41Flash, HardwareKind::Gb200, 64, 128, 8192);
    decode(ModelKind::V4Flash, HardwareKind::Ascend950, 16, 64, 8192);
}
