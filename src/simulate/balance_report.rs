//! Expert balance as the steps met it: per instance, the imbalance (max over
//! mean device load of each layer, averaged over layers) weighted by the
//! steps priced with it, how many EPLB rebalances there were, and — at each
//! rebalance — how the new placement (from the period before) fits the loads
//! of that moment beside one made from those loads themselves.

use deepinfer_actors::modelled::balance::BalanceStats;
use serde::Serialize;

use super::RunData;
use crate::scenario::Scenario;

/// One instance's measured balance.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct InstanceBalance {
    pub instance: usize,
    /// Placements after the first.
    pub rebalances: u64,
    /// Imbalance per step: mean, median, 99th percentile, highest.
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    /// Means over the rebalances: the new placement on the loads of its
    /// moment, and a placement made from those loads (no lag). 0 without rebalances.
    pub at_rebalance: f64,
    pub fresh_placement: f64,
}

/// Expert balance over the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BalanceReport {
    /// Seconds over which the hot experts change (0: static loads), and the
    /// share of popularity that moves.
    pub drift_s: f64,
    pub drift_share: f64,
    /// Seconds between EPLB placements (0: placed once).
    pub rebalance_s: f64,
    pub instances: Vec<InstanceBalance>,
}

/// Step-weighted percentile `p` of `(value, weight)` pairs sorted by value.
fn weighted(sorted: &[(f64, u64)], p: f64) -> f64 {
    let total: u64 = sorted.iter().map(|x| x.1).sum();
    let want = (p * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0;
    for &(v, w) in sorted {
        seen += w;
        if seen >= want {
            return v;
        }
    }
    sorted.last().map_or(1.0, |x| x.0)
}

/// The step-weighted mean imbalance of `stats`; `otherwise` without steps.
pub fn mean_imbalance(stats: &BalanceStats, otherwise: f64) -> f64 {
    let steps: u64 = stats.samples.iter().map(|s| s.steps).sum();
    match stats.samples.as_slice() {
        [] => return otherwise,
        [one] => return one.imbalance,
        _ if steps == 0 => return otherwise,
        _ => {}
    }
    stats.samples.iter().map(|s| s.imbalance * s.steps as f64).sum::<f64>() / steps as f64
}

impl InstanceBalance {
    pub fn new(instance: usize, stats: &BalanceStats) -> Self {
        let mut v: Vec<(f64, u64)> = stats.samples.iter().map(|s| (s.imbalance, s.steps)).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        let n = stats.at_rebalance.len().max(1) as f64;
        Self {
            instance,
            rebalances: stats.rebalances,
            mean: mean_imbalance(stats, 1.0),
            p50: weighted(&v, 0.5),
            p99: weighted(&v, 0.99),
            max: v.iter().filter(|x| x.1 > 0).map(|x| x.0).fold(1.0, f64::max),
            at_rebalance: stats.at_rebalance.iter().map(|x| x.0).sum::<f64>() / n,
            fresh_placement: stats.at_rebalance.iter().map(|x| x.1).sum::<f64>() / n,
        }
    }
}

impl BalanceReport {
    /// `None` when the run recorded no balance (no modelled devices).
    pub fn new(s: &Scenario, d: &RunData) -> Option<Self> {
        if d.expert_balance.is_empty() {
            return None;
        }
        let instances = d.expert_balance.iter().enumerate().map(|(i, b)| InstanceBalance::new(i, b)).collect();
        Some(Self {
            drift_s: s.expert_drift_s,
            drift_share: s.expert_drift_share,
            rebalance_s: s.rebalance_s,
            instances,
        })
    }

    /// A section of `report.md`; empty for static loads (the instance
    /// table's expert column says it all).
    pub fn to_markdown(&self) -> String {
        if self.drift_s <= 0.0 {
            return String::new();
        }
        let every = if self.rebalance_s > 0.0 {
            format!("EPLB places the experts every {:.0} s from the mean loads of the period before", self.rebalance_s)
        } else {
            "the experts are placed once, from the loads at the start".to_string()
        };
        let mut md = format!(
            "\nExpert balance over time: {:.0}% of expert popularity moves, over about {:.0} s; {every}. \
             Imbalance is the busiest device's load over the mean, per step:\n\n\
             | instance | rebalances | mean | p50 | p99 | max | new placement at a rebalance | placed from that moment's loads |\n\
             |---|---|---|---|---|---|---|---|\n",
            self.drift_share * 100.0,
            self.drift_s
        );
        for x in &self.instances {
            let (at, fresh) = if x.rebalances > 0 {
                (format!("{:.2}", x.at_rebalance), format!("{:.2}", x.fresh_placement))
            } else {
                ("–".to_string(), "–".to_string())
            };
            md += &format!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {at} | {fresh} |\n",
                x.instance, x.rebalances, x.mean, x.p50, x.p99, x.max
            );
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use deepinfer_actors::modelled::balance::BalanceSample;

    use super::*;

    #[test]
    fn percentiles_weigh_each_imbalance_by_its_steps() {
        let sample = |imbalance, steps| BalanceSample { t_s: 0.0, imbalance, steps };
        let stats = BalanceStats {
            rebalances: 2,
            samples: vec![sample(1.5, 1), sample(1.1, 98), sample(2.0, 1), sample(3.0, 0)],
            at_rebalance: vec![(1.2, 1.05), (1.4, 1.01)],
        };
        let b = InstanceBalance::new(3, &stats);
        assert!((b.mean - (1.5 + 1.1 * 98.0 + 2.0) / 100.0).abs() < 1e-12);
        assert_eq!((b.p50, b.p99, b.max), (1.1, 1.5, 2.0), "a slice without steps does not count");
        assert!((b.at_rebalance - 1.3).abs() < 1e-12 && (b.fresh_placement - 1.03).abs() < 1e-12);
        let r = BalanceReport { drift_s: 600.0, drift_share: 0.1, rebalance_s: 60.0, instances: vec![b] };
        let md = r.to_markdown();
        assert!(
            md.contains("10% of expert popularity moves, over about 600 s")
                && md.contains("every 60 s")
                && md.contains("| 3 | 2 | 1.11 | 1.10 | 1.50 | 2.00 | 1.30 | 1.03 |"),
            "{md}"
        );
        assert!(BalanceReport { drift_s: 0.0, ..r }.to_markdown().is_empty());
    }
}
