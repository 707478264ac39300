//! Device time in simulation: how long a worker's attention and a shard's
//! experts would take on a real accelerator for a real model, from the
//! engine's cost model (`deepinfer_engine::cost`). The tiny model still
//! computes every token; only the virtual clock is advanced.

use std::time::Duration;

use deepinfer_engine::cost::{
    step_cost, DeviceStep, Efficiency, Hardware, HardwareKind, ModelCost, ModelKind, SeqWork, StepCost,
};

use crate::cluster::topology::Topology;

/// Which accelerator and model the simulated devices stand for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceCostModel {
    pub hardware: HardwareKind,
    pub model: ModelKind,
    pub efficiency: Efficiency,
}

impl DeviceCostModel {
    /// With the cost model's default efficiency.
    pub fn new(hardware: HardwareKind, model: ModelKind) -> Self {
        Self { hardware, model, efficiency: Efficiency::default() }
    }
}

/// A [`DeviceCostModel`] resolved for one cluster: figures of the hardware
/// and the model, the topology, and the layers of the model that computes.
#[derive(Clone, Debug)]
pub struct DeviceCost {
    pub spec: DeviceCostModel,
    pub hardware: Hardware,
    pub model: ModelCost,
    /// Devices sharing the routed experts (an instance), and per node.
    pub expert_parallel: usize,
    pub devices_per_node: usize,
    /// MoE layers of the computing model: one dispatch stands for
    /// `model.moe_layers() / layers` layers of the modelled one.
    pub layers: usize,
}

/// Microseconds as a whole number of nanoseconds.
pub(crate) fn micros(us: f64) -> Duration {
    if us.is_finite() && us > 0.0 {
        Duration::from_nanos((us * 1e3).round() as u64)
    } else {
        Duration::ZERO
    }
}

impl DeviceCost {
    pub fn new(spec: DeviceCostModel, topology: &Topology, layers: usize) -> Self {
        Self {
            spec,
            hardware: spec.hardware.spec(),
            model: spec.model.cost(),
            expert_parallel: topology.size_of(0).max(1) as usize,
            devices_per_node: topology.per_node.max(1) as usize,
            layers: layers.max(1),
        }
    }

    /// A worker's pass over `sequences` without the routed experts:
    /// attention, dense layers, KV reads, dispatch traffic, per-layer overhead.
    pub fn attention(&self, sequences: &[SeqWork]) -> StepCost {
        let step = DeviceStep {
            sequences: sequences.to_vec(),
            expert_tokens: 0,
            experts_hit: 0,
            expert_parallel: self.expert_parallel,
            scale_up_domain: self.devices_per_node,
            offloaded_expert_share: 0.0,
        };
        step_cost(&self.hardware, &self.model, &step, self.spec.efficiency)
    }

    pub fn attention_time(&self, sequences: &[SeqWork]) -> Duration {
        micros(self.attention(sequences).total_us)
    }

    /// One dispatch to a shard: `rows` token-expert pairs over `experts`
    /// distinct experts of one layer, the roofline of their FLOPs and
    /// weight reads, scaled to the modelled model's share of MoE layers.
    pub fn experts_us(&self, rows: usize, experts: usize) -> f64 {
        if rows == 0 {
            return 0.0;
        }
        let (m, hw, eff) = (&self.model, &self.hardware, self.spec.efficiency);
        let moe = m.moe_layers().max(1) as f64;
        let layers = moe / self.layers as f64;
        let compute_s =
            rows as f64 * m.expert_flops_per_token() * layers / (m.expert_format.flops(hw) * eff.expert_gemm);
        let memory_s =
            experts as f64 * m.expert_weight_bytes_all_layers() / moe * layers / hw.hbm_bytes_per_s() / eff.memory;
        compute_s.max(memory_s) * 1e6
    }

    pub fn experts_time(&self, rows: usize, experts: usize) -> Duration {
        micros(self.experts_us(rows, experts))
    }
}
