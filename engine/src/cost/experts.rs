//! How a step's token-expert pairs spread over the devices of an
//! expert-parallel group: expert popularity per layer (uniform or Zipf, each
//! layer with its own seeded order of experts) and a placement of experts on
//! devices give each device its share of the pairs. The slowest device of each
//! layer sets the pace of the all-to-all, so the step costs the mean over
//! layers of the largest share.

use crate::eplb;
use crate::sampling::uniform;

/// Most experts or layers a load model takes.
pub const MAX_EXPERTS: usize = 4096;
pub const MAX_LAYERS: usize = 256;

/// How often each routed expert is chosen.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Popularity {
    Uniform,
    /// The `r`-th most popular expert of a layer gets weight `1 / r^s`.
    Zipf {
        s: f64,
    },
}

/// Fraction of a layer's token-expert pairs each expert receives: `[layer][expert]`, rows summing to 1.
pub fn layer_loads(popularity: Popularity, experts: usize, layers: usize, seed: u64) -> Vec<Vec<f64>> {
    let (experts, layers) = (experts.clamp(1, MAX_EXPERTS), layers.clamp(1, MAX_LAYERS));
    (0..layers)
        .map(|layer| {
            let mut row = vec![1.0 / experts as f64; experts];
            if let Popularity::Zipf { s } = popularity {
                // A seeded shuffle of ranks per layer (Fisher-Yates on the counter-based stream).
                let mut order: Vec<usize> = (0..experts).collect();
                for i in (1..experts).rev() {
                    let u = uniform(seed ^ 0x005e_ed0f_1a7e, (layer * MAX_EXPERTS + i) as u64);
                    let j = ((u * (i + 1) as f64) as usize).min(i);
                    order.swap(i, j);
                }
                let weights: Vec<f64> = (0..experts).map(|r| 1.0 / ((r + 1) as f64).powf(s.max(0.0))).collect();
                let total: f64 = weights.iter().sum();
                for (rank, &e) in order.iter().enumerate() {
                    row[e] = weights[rank] / total;
                }
            }
            row
        })
        .collect()
}

/// Each device's share of the token-expert pairs, per layer.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceShares {
    /// `[layer][device]`, rows summing to 1.
    pub shares: Vec<Vec<f64>>,
    /// Expert slots (logical experts and replicas) each device holds.
    pub slots_per_device: usize,
    /// Mean over layers of the largest device share (1/devices when balanced).
    pub max_share: f64,
}

impl DeviceShares {
    /// Experts in contiguous ranges, one copy each (plain expert parallelism).
    pub fn contiguous(loads: &[Vec<f64>], devices: usize) -> Self {
        let devices = devices.max(1);
        let shares = loads
            .iter()
            .map(|row| {
                let mut d = vec![0.0; devices];
                for (e, &l) in row.iter().enumerate() {
                    d[e * devices / row.len().max(1)] += l;
                }
                d
            })
            .collect();
        let experts = loads.first().map_or(0, Vec::len);
        Self::new(shares, experts.div_ceil(devices))
    }

    fn new(shares: Vec<Vec<f64>>, slots_per_device: usize) -> Self {
        let layers = shares.len().max(1) as f64;
        let max_share = shares.iter().map(|row| row.iter().cloned().fold(0.0, f64::max)).sum::<f64>() / layers;
        Self { shares, slots_per_device, max_share }
    }

    /// The devices of an EPLB placement (an expert's load splits evenly over its replicas).
    pub fn from_placement(loads: &[Vec<f64>], placement: &eplb::Placement) -> Self {
        let shares = (0..placement.phy_to_log.len()).map(|l| placement.gpu_loads(l, &loads[l])).collect();
        Self::new(shares, placement.slots_per_gpu())
    }

    pub fn devices(&self) -> usize {
        self.shares.first().map_or(0, Vec::len)
    }

    /// Each device's share averaged over layers.
    pub fn mean_shares(&self) -> Vec<f64> {
        let layers = self.shares.len().max(1) as f64;
        let mut out = vec![0.0; self.devices()];
        for row in &self.shares {
            for (o, v) in out.iter_mut().zip(row) {
                *o += v / layers;
            }
        }
        out
    }

    /// Max over mean of the per-layer device loads, averaged over layers (1.0 is perfect balance).
    pub fn imbalance(&self) -> f64 {
        self.max_share * self.devices() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_popularity_on_contiguous_experts_is_balanced() {
        let loads = layer_loads(Popularity::Uniform, 256, 4, 1);
        let d = DeviceShares::contiguous(&loads, 64);
        assert!((d.imbalance() - 1.0).abs() < 1e-9);
        assert_eq!(d.slots_per_device, 4);
    }

    #[test]
    fn zipf_is_seeded_per_layer_and_skewed() {
        let a = layer_loads(Popularity::Zipf { s: 1.2 }, 256, 3, 7);
        assert_eq!(a, layer_loads(Popularity::Zipf { s: 1.2 }, 256, 3, 7));
        assert_ne!(a[0], a[1], "each layer has its own order");
        for row in &a {
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        }
        let plain = DeviceShares::contiguous(&a, 64);
        assert!(plain.imbalance() > 5.0, "{}", plain.imbalance());
        // DeepSeek's balancer with 64 redundant slots evens it out.
        let p = eplb::rebalance(&a, 256 + 64, 8, 8, 64).unwrap();
        let balanced = DeviceShares::from_placement(&a, &p);
        assert!(balanced.imbalance() < plain.imbalance() / 2.0, "{}", balanced.imbalance());
        assert!((balanced.mean_shares().iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}
