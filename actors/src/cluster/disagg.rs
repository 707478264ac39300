//! Serving roles of instances (prefill/decode disaggregation) and expert
//! load balancing at run time: the configuration and the pure helpers the
//! router and the schedulers use.
//!
//! Disaggregation: a request is prefilled on a `Prefill` instance, which
//! samples its first token and exports the sequence state; the state moves
//! to a `Decode` instance as a two-part frame (`HandoffMsg::Transfer`: rkyv
//! header + raw f32 body) and decoding continues there from it, bit for bit
//! as if it had stayed. A transfer that is not adopted in time is sent again
//! (at most [`TRANSFER_ATTEMPTS`] times); then the router places the request
//! on another decode instance, which recomputes it (re-prefill). A request
//! is never lost on the way.
//!
//! EPLB: each step's answers carry the rows routed per (layer, expert); the
//! scheduler folds them into the engine's `ExpertLoadTracker` and every
//! `every_steps` steps considers a new table: a few copies moved from the
//! current one when that balances about as well as the balancer's fresh
//! table, else the fresh table renumbered to keep weights where they are,
//! and only when the heaviest device gains at least `min_gain`. The shards
//! read the new copies while the current table serves; the switch happens
//! between steps and frees what the new table leaves out.

use deepinfer_engine::eplb::{EplbError, ExpertLoadTracker};

use crate::cluster::placement::{Placement, PlacementError};

/// What an instance serves: the one name for it, from the topology and
/// scenario files (`role = "prefill" | "decode" | "both"`) to the actors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceKind {
    #[default]
    Both,
    /// Prefills and samples the first token, then hands the request over.
    Prefill,
    /// Takes prefilled requests (and recomputes ones whose transfer failed).
    Decode,
}

impl InstanceKind {
    pub fn prefills(self) -> bool {
        self != InstanceKind::Decode
    }

    pub fn decodes(self) -> bool {
        self != InstanceKind::Prefill
    }
}

/// How the router picks the instance that prefills a new request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PrefillRouting {
    /// The engine's prefill balancer: the longest cached prefix unless that
    /// instance is overloaded, then the least prefill work per GPU.
    #[default]
    CacheAffinity,
    /// Every instance in turn (the baseline).
    RoundRobin,
}

pub use crate::limits::{
    MAX_HANDOFF_BACKLOG, MAX_PENDING_TRANSFERS, TRANSFER_ATTEMPTS, TRANSFER_RATE_FLOOR_BYTES_PER_S, TRANSFER_WINDOW,
};

/// Expert load balancing at run time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EplbConfig {
    /// Steps of an instance between placements.
    pub every_steps: u64,
    /// Weight of the newest step in the moving average of loads.
    pub decay: f64,
    /// Expert copies beyond one per expert, spread over the instance's devices.
    pub redundant: u32,
    /// Least drop of the heaviest device's load (as a multiple of the mean
    /// device's) that is worth moving weights for; 0: any better table.
    pub min_gain: f64,
}

impl Default for EplbConfig {
    fn default() -> Self {
        Self { every_steps: 32, decay: 0.2, redundant: 0, min_gain: 0.05 }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EplbPlacementError {
    #[error(transparent)]
    Eplb(#[from] EplbError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
}

/// The table the tracker's loads call for on `devices` devices. The actor
/// table is shared by every layer, so the loads are summed over layers.
pub fn eplb_table(
    tracker: &mut ExpertLoadTracker,
    devices: u32,
    redundant: u32,
) -> Result<Placement, EplbPlacementError> {
    let experts = tracker.total_loads().len();
    let physical = (experts + redundant as usize).max(devices as usize);
    // Global policy: one group, one node (an instance is one expert-parallel group).
    let p = tracker.rebalance_summed(physical, 1, 1, devices as usize)?;
    let replicas = (0..experts).map(|e| p.gpus_of(0, e).into_iter().map(|g| g as u32).collect()).collect();
    Ok(Placement::new(devices, replicas)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hot_expert_gets_copies_and_every_expert_a_home() {
        let mut t = ExpertLoadTracker::new(2, 4, 1.0, 1);
        // Expert 0 takes most rows in both layers.
        t.record_step(&[90, 5, 3, 2, 80, 10, 5, 5]).unwrap();
        let p = eplb_table(&mut t, 2, 2).unwrap();
        assert_eq!(p.replicas(0), &[0, 1]);
        for e in 1..4 {
            assert_eq!(p.replicas(e).len(), 1);
        }
        assert!(!t.should_rebalance());
    }
}
