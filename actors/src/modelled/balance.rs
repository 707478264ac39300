//! Expert balance of a modelled instance over simulated time. The true
//! expert loads drift ([`ExpertLoads`]); the placement lags them: DeepSeek's
//! EPLB places the experts every `rebalance_s` from the mean loads of the
//! period before (a balancer counting routed tokens over its window), and
//! each step is priced with the loads of its moment on the placement in
//! force. What the steps met is recorded, so the report measures balance
//! instead of assuming it.
//!
//! The loads are evaluated once per [`ExpertLoads::sample_s`] (shared by the
//! instances through [`LoadCache`]), not per step. Static loads are placed
//! once, as before: rebalancing them would give the same placement.

use std::sync::{Arc, Mutex};

use deepinfer_engine::cost::experts::{DeviceShares, ExpertLoads};
use deepinfer_engine::eplb;

/// A layer-by-expert load matrix.
pub type Loads = Arc<Vec<Vec<f64>>>;

/// The loads of the current sample slice, computed once for every instance.
#[derive(Debug)]
pub struct LoadCache {
    pub loads: ExpertLoads,
    cell: Mutex<Option<(i64, Loads)>>,
}

impl LoadCache {
    pub fn new(loads: ExpertLoads) -> Self {
        Self { loads, cell: Mutex::new(None) }
    }

    /// The sample slice `t_s` falls in (0 for static loads).
    pub fn slice_of(&self, t_s: f64) -> i64 {
        let s = self.loads.sample_s();
        if s.is_finite() {
            (t_s / s).floor() as i64
        } else {
            0
        }
    }

    /// The loads at the start of `slice`.
    pub fn slice(&self, slice: i64) -> Loads {
        let mut cell = self.cell.lock().unwrap_or_else(|e| e.into_inner());
        match &*cell {
            Some((s, l)) if *s == slice => Arc::clone(l),
            _ => {
                let s = self.loads.sample_s();
                let l = Arc::new(self.loads.at(if s.is_finite() { slice as f64 * s } else { 0.0 }));
                *cell = Some((slice, Arc::clone(&l)));
                l
            }
        }
    }
}

/// Where an instance's experts are.
#[derive(Clone, Debug)]
enum Layout {
    /// Contiguous ranges, one copy each, over this many devices.
    Contiguous(usize),
    Eplb(eplb::Placement),
}

impl Layout {
    fn shares(&self, loads: &[Vec<f64>]) -> DeviceShares {
        match self {
            Layout::Contiguous(devices) => DeviceShares::contiguous(loads, *devices),
            Layout::Eplb(p) => DeviceShares::from_placement(loads, p),
        }
    }
}

/// Loads a slice of time priced steps with.
#[derive(Clone, Debug, PartialEq)]
pub struct BalanceSample {
    pub t_s: f64,
    /// Max over mean device load, averaged over layers.
    pub imbalance: f64,
    /// Steps priced in the slice (a decode event counts its steps).
    pub steps: u64,
}

/// What an instance's steps met.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BalanceStats {
    /// Placements made after the first.
    pub rebalances: u64,
    /// One per sample slice in which the instance stepped, in time order.
    pub samples: Vec<BalanceSample>,
    /// At each rebalance: the imbalance of the new placement (from the
    /// period before) on the loads of that moment, and of a placement made
    /// from those loads themselves (what a balancer without lag would reach).
    pub at_rebalance: Vec<(f64, f64)>,
}

/// One instance's placement and what its steps met.
#[derive(Debug)]
pub struct ExpertBalance {
    layout: Layout,
    redundant: usize,
    devices: usize,
    per_node: usize,
    rebalance_s: f64,
    drifts: bool,
    /// The period the placement was made for.
    period: i64,
    /// The slice `shares` were computed for.
    slice: i64,
    shares: Arc<DeviceShares>,
    pub stats: BalanceStats,
}

impl ExpertBalance {
    /// The placement at time 0: contiguous experts without redundant slots;
    /// otherwise EPLB from the mean loads of the period before the start
    /// (`rebalance_s > 0`), or from the loads at the start, kept for the whole
    /// run (`rebalance_s = 0`).
    pub fn new(
        cache: &LoadCache,
        rebalance_s: f64,
        redundant: usize,
        devices: usize,
        per_node: usize,
    ) -> Result<Self, String> {
        let drifts = cache.loads.drifts();
        let rebalance_s = if drifts && rebalance_s.is_finite() && rebalance_s > 0.0 { rebalance_s } else { 0.0 };
        let now = cache.slice(0);
        let seen = if rebalance_s > 0.0 { cache.loads.mean(-rebalance_s, 0.0) } else { now.to_vec() };
        let layout = place(&seen, redundant, devices.max(1), per_node)?;
        let shares = Arc::new(layout.shares(&now));
        Ok(Self {
            layout,
            redundant,
            devices: devices.max(1),
            per_node,
            rebalance_s,
            drifts,
            period: 0,
            slice: 0,
            shares,
            stats: BalanceStats::default(),
        })
    }

    /// The shares of the placement in force on the loads of the slice last priced.
    pub fn shares(&self) -> Arc<DeviceShares> {
        Arc::clone(&self.shares)
    }

    /// Replace the current shares (until the loads' next slice).
    pub fn set_shares(&mut self, shares: DeviceShares) {
        self.shares = Arc::new(shares);
    }

    /// Bring the placement and the shares to `t_s` and count `steps` priced
    /// there; returns the shares to price them with.
    pub fn advance(&mut self, cache: &LoadCache, t_s: f64, steps: u64) -> Arc<DeviceShares> {
        if self.drifts {
            let eplb = matches!(self.layout, Layout::Eplb(_));
            let period = if self.rebalance_s > 0.0 { (t_s / self.rebalance_s).floor() as i64 } else { 0 };
            if eplb && period > self.period {
                self.rebalance(cache, period);
            }
            let slice = cache.slice_of(t_s);
            if slice != self.slice {
                self.slice = slice;
                self.shares = Arc::new(self.layout.shares(&cache.slice(slice)));
            }
        }
        let t = if self.drifts { self.slice as f64 * cache.loads.sample_s() } else { 0.0 };
        match self.stats.samples.last_mut() {
            Some(last) if last.t_s == t => last.steps += steps,
            _ => self.stats.samples.push(BalanceSample { t_s: t, imbalance: self.shares.imbalance(), steps }),
        }
        self.shares()
    }

    /// EPLB for `period` from the mean loads of the period before.
    fn rebalance(&mut self, cache: &LoadCache, period: i64) {
        let at = period as f64 * self.rebalance_s;
        let seen = cache.loads.mean(at - self.rebalance_s, at);
        let (Ok(layout), Ok(fresh)) = (
            place(&seen, self.redundant, self.devices, self.per_node),
            place(&cache.loads.at(at), self.redundant, self.devices, self.per_node),
        ) else {
            return; // The first placement of these shapes succeeded: not reached.
        };
        let now = cache.loads.at(at);
        self.stats.at_rebalance.push((layout.shares(&now).imbalance(), fresh.shares(&now).imbalance()));
        self.stats.rebalances += 1;
        self.layout = layout;
        self.period = period;
        // The shares follow at the next slice check.
        self.slice = i64::MIN;
    }
}

/// Contiguous experts, or DeepSeek's EPLB with `redundant` extra slots.
fn place(loads: &[Vec<f64>], redundant: usize, devices: usize, per_node: usize) -> Result<Layout, String> {
    if redundant == 0 {
        return Ok(Layout::Contiguous(devices));
    }
    let experts = loads.first().map_or(0, Vec::len);
    // Round the slots up to a multiple of the devices, as a real deployment would.
    let physical = (experts + redundant).div_ceil(devices) * devices;
    // The global policy: the hierarchical one keeps dispatch inside nodes
    // (node-limited routing), which the step cost does not credit, so it
    // would only show its worse balance.
    let nodes = devices.div_ceil(per_node.max(1));
    let p = eplb::rebalance(loads, physical, 1, nodes, devices).map_err(|e| e.to_string())?;
    Ok(Layout::Eplb(p))
}

/// The shares of a placement made once from `loads` and priced on them.
pub fn place_shares(
    loads: &[Vec<f64>],
    redundant: usize,
    devices: usize,
    per_node: usize,
) -> Result<DeviceShares, String> {
    Ok(place(loads, redundant, devices.max(1), per_node)?.shares(loads))
}

#[cfg(test)]
mod tests {
    use deepinfer_engine::cost::experts::Popularity;

    use super::*;

    /// A V3-sized layer count is not needed to see the effect: 256 experts,
    /// 4 layers, EP64 with 32 redundant slots, Zipf 0.6 of which a tenth
    /// moves (the scenario defaults).
    fn cache(drift_s: f64, share: f64) -> LoadCache {
        LoadCache::new(ExpertLoads::new(Popularity::Zipf { s: 0.6 }, 256, 4, 11, drift_s, share))
    }

    /// Step-weighted mean imbalance of the samples.
    fn mean(stats: &BalanceStats) -> f64 {
        let steps: u64 = stats.samples.iter().map(|s| s.steps).sum();
        stats.samples.iter().map(|s| s.imbalance * s.steps as f64).sum::<f64>() / steps as f64
    }

    #[test]
    fn drifting_skew_leaves_eplb_behind_between_rebalances() {
        let c = cache(600.0, 0.1);
        let mut b = ExpertBalance::new(&c, 600.0, 32, 64, 8).unwrap();
        // One step a second for an hour.
        for t in 0..3600 {
            b.advance(&c, t as f64, 1);
        }
        let s = &b.stats;
        assert_eq!(s.rebalances, 5, "every 600 s after the first placement");
        assert_eq!(s.samples.iter().map(|x| x.steps).sum::<u64>(), 3600);
        assert!(s.samples.len() >= 60, "{} slices", s.samples.len());
        let between = mean(s);
        assert!(between > 1.1, "mean imbalance between rebalances {between:.3}");
        // Right after each rebalance the placement fits better than on
        // average, and one made from the loads of that moment fits best.
        let n = s.at_rebalance.len() as f64;
        let lagged = s.at_rebalance.iter().map(|x| x.0).sum::<f64>() / n;
        let fresh = s.at_rebalance.iter().map(|x| x.1).sum::<f64>() / n;
        assert!(fresh < lagged && fresh < between, "fresh {fresh:.3}, lagged {lagged:.3}, between {between:.3}");
        assert!(fresh < 1.05, "a placement from the current loads balances them: {fresh:.3}");
    }

    #[test]
    fn static_loads_are_placed_once_as_before() {
        let c = cache(0.0, 1.0);
        let mut b = ExpertBalance::new(&c, 600.0, 32, 64, 8).unwrap();
        let once = place_shares(&c.loads.at(0.0), 32, 64, 8).unwrap();
        for t in [0.0, 700.0, 5000.0] {
            assert_eq!(*b.advance(&c, t, 2), once);
        }
        assert_eq!(b.stats.rebalances, 0);
        assert_eq!(b.stats.samples, vec![BalanceSample { t_s: 0.0, imbalance: once.imbalance(), steps: 6 }]);
        // Drift without a period: placed once from the loads at the start, and
        // the balance decays as the hot experts move.
        let c = cache(600.0, 1.0);
        let mut b = ExpertBalance::new(&c, 0.0, 32, 64, 8).unwrap();
        let start = b.advance(&c, 0.0, 1).imbalance();
        let later = b.advance(&c, 1800.0, 1).imbalance();
        assert!(later > start * 1.5, "{start:.3} → {later:.3}");
        assert_eq!(b.stats.rebalances, 0);
    }

    #[test]
    fn contiguous_experts_follow_the_drift_without_rebalancing() {
        let c = cache(600.0, 1.0);
        let mut b = ExpertBalance::new(&c, 600.0, 0, 64, 8).unwrap();
        let a = b.advance(&c, 0.0, 1);
        let later = b.advance(&c, 900.0, 1);
        assert_eq!(*a, DeviceShares::contiguous(&c.loads.at(0.0), 64));
        assert_eq!(*later, DeviceShares::contiguous(&c.slice(c.slice_of(900.0)), 64));
        assert_ne!(a, later);
        assert_eq!(b.stats.rebalances, 0);
    }
}

/// The table of `simulations/README.md` ("Expert balance over time"): `cargo
/// test -p deepinfer-actors --lib expert_balance_sweep -- --ignored --nocapture`.
#[cfg(test)]
mod sweep {
    use deepinfer_engine::cost::experts::Popularity;

    use super::*;

    #[test]
    #[ignore = "prints a table"]
    fn expert_balance_sweep() {
        for zipf in [0.6, 1.2] {
            for share in [0.1, 0.25, 0.5, 1.0] {
                for (devices, red) in [(32usize, 32usize), (64, 32), (144, 32)] {
                    let c = LoadCache::new(ExpertLoads::new(Popularity::Zipf { s: zipf }, 256, 8, 11, 600.0, share));
                    let mut b = ExpertBalance::new(&c, 600.0, red, devices, 8).unwrap();
                    for t in 0..3600 {
                        b.advance(&c, t as f64, 1);
                    }
                    let s = &b.stats;
                    let mean = s.samples.iter().map(|x| x.imbalance * x.steps as f64).sum::<f64>() / 3600.0;
                    let n = s.at_rebalance.len() as f64;
                    let fresh = s.at_rebalance.iter().map(|x| x.1).sum::<f64>() / n;
                    let lag = s.at_rebalance.iter().map(|x| x.0).sum::<f64>() / n;
                    eprintln!("zipf {zipf} share {share} EP{devices} red {red}: between {mean:.3} at {lag:.3} fresh {fresh:.3}");
                }
            }
        }
    }
}
