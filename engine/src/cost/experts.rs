//! How a step's token-expert pairs spread over the devices of an
//! expert-parallel group: expert popularity per layer (uniform or Zipf, each
//! layer with its own seeded order of experts) and a placement of experts on
//! devices give each device its share of the pairs. The slowest device of each
//! layer sets the pace of the all-to-all, so the step costs the mean over
//! layers of the largest share.

use std::f64::consts::{FRAC_PI_2, TAU};

use crate::eplb;
use crate::sampling::uniform;

/// Most experts or layers a load model takes.
pub const MAX_EXPERTS: usize = 4096;
pub const MAX_LAYERS: usize = 256;
/// Drifting loads are evaluated this many times per `drift_s`…
pub const SAMPLES_PER_DRIFT: f64 = 64.0;
/// …and a window's mean at most this many times.
pub const MAX_WINDOW_SAMPLES: f64 = 256.0;
/// Separate the drift's draws (moving and lasting) from the static order's under one seed.
const DRIFT_STREAM: u64 = 0xd81f_7e5c_0a93_b246;
const LASTING_STREAM: u64 = 0x3c6e_f372_fe94_f82b;

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
                let weights = zipf_weights(experts, s);
                for (rank, &e) in order.iter().enumerate() {
                    row[e] = weights[rank];
                }
            }
            row
        })
        .collect()
}

/// The Zipf weights of ranks `0..experts`, summing to 1.
fn zipf_weights(experts: usize, s: f64) -> Vec<f64> {
    let weights: Vec<f64> = (0..experts).map(|r| 1.0 / ((r + 1) as f64).powf(s.max(0.0))).collect();
    let total: f64 = weights.iter().sum();
    weights.into_iter().map(|w| w / total).collect()
}

/// Expert popularity over simulated time, as real traffic changes which
/// experts are hot. Static unless `drift_s > 0`, `drift_share > 0` and the
/// popularity is Zipf: then each layer ranks its experts by a score with a
/// lasting part and a moving part. At time `t`, with `k = ⌊t / drift_s⌋`
/// and `f` the fraction past it, the moving part of expert `e` is
/// `m = cos(πf/2)·g[k][e] + sin(πf/2)·g[k+1][e]` and its score
/// `√(1−w)·h[e] + √w·m` with `w = drift_share`; `g` and `h` are independent
/// standard normal draws per (seed, layer, expert, `k`). Every score has unit
/// variance; the moving parts of two instants `drift_s` apart are correlated
/// by 1/π ≈ 0.32 on average, `2·drift_s` apart not at all, so two scores far
/// apart are correlated by `1 − w`. The `r`-th highest score gets the Zipf
/// weight of rank `r`: the skew at any instant is the configured one, while
/// which experts carry it changes over about `drift_s`. A pure function of
/// the seed and the time.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertLoads {
    pub popularity: Popularity,
    pub experts: usize,
    pub layers: usize,
    pub seed: u64,
    /// Seconds over which the hot experts change (0: never).
    pub drift_s: f64,
    /// Share of the score's variance that moves (0: none, 1: all).
    pub drift_share: f64,
}

impl ExpertLoads {
    /// A `drift_s` that is not finite and positive means static;
    /// `drift_share` is clamped into [0, 1].
    pub fn new(
        popularity: Popularity,
        experts: usize,
        layers: usize,
        seed: u64,
        drift_s: f64,
        drift_share: f64,
    ) -> Self {
        let drift_s = if drift_s.is_finite() && drift_s > 0.0 { drift_s } else { 0.0 };
        let drift_share = if drift_share.is_finite() { drift_share.clamp(0.0, 1.0) } else { 0.0 };
        let (experts, layers) = (experts.clamp(1, MAX_EXPERTS), layers.clamp(1, MAX_LAYERS));
        Self { popularity, experts, layers, seed, drift_s, drift_share }
    }

    /// The loads change over time.
    pub fn drifts(&self) -> bool {
        self.drift_s > 0.0 && self.drift_share > 0.0 && matches!(self.popularity, Popularity::Zipf { .. })
    }

    /// Seconds between evaluations of drifting loads (infinite when static).
    pub fn sample_s(&self) -> f64 {
        if self.drifts() {
            self.drift_s / SAMPLES_PER_DRIFT
        } else {
            f64::INFINITY
        }
    }

    /// Fraction of each layer's token-expert pairs each expert receives at
    /// `t_s`: `[layer][expert]`, rows summing to 1.
    pub fn at(&self, t_s: f64) -> Vec<Vec<f64>> {
        let (Popularity::Zipf { s }, true) = (self.popularity, self.drifts() && t_s.is_finite()) else {
            return layer_loads(self.popularity, self.experts, self.layers, self.seed);
        };
        let x = t_s / self.drift_s;
        let k = x.floor();
        let (a, b) = ((x - k) * FRAC_PI_2).sin_cos();
        let k = k as i64;
        let (lasting, moving) = ((1.0 - self.drift_share).sqrt(), self.drift_share.sqrt());
        let weights = zipf_weights(self.experts, s);
        (0..self.layers)
            .map(|layer| {
                let score: Vec<f64> = (0..self.experts)
                    .map(|e| {
                        let m = b * self.normal(DRIFT_STREAM, layer, e, k)
                            + a * self.normal(DRIFT_STREAM, layer, e, k.wrapping_add(1));
                        let h = if lasting > 0.0 { self.normal(LASTING_STREAM, layer, e, 0) } else { 0.0 };
                        lasting * h + moving * m
                    })
                    .collect();
                let mut order: Vec<usize> = (0..self.experts).collect();
                order.sort_by(|&i, &j| score[j].total_cmp(&score[i]).then(i.cmp(&j)));
                let mut row = vec![0.0; self.experts];
                for (rank, &e) in order.iter().enumerate() {
                    row[e] = weights[rank];
                }
                row
            })
            .collect()
    }

    /// The mean of the loads over `[from_s, to_s)`, sampled at the middle of
    /// each slice of [`Self::sample_s`] (or of [`MAX_WINDOW_SAMPLES`] equal
    /// slices, if more): what a balancer that counts the tokens routed over
    /// that window sees.
    pub fn mean(&self, from_s: f64, to_s: f64) -> Vec<Vec<f64>> {
        if !self.drifts() || to_s.is_nan() || from_s.is_nan() || to_s <= from_s {
            return self.at(from_s);
        }
        let n = ((to_s - from_s) / self.sample_s()).ceil().clamp(1.0, MAX_WINDOW_SAMPLES) as usize;
        let step = (to_s - from_s) / n as f64;
        let mut sum = vec![vec![0.0; self.experts]; self.layers];
        for i in 0..n {
            for (acc, row) in sum.iter_mut().zip(self.at(from_s + (i as f64 + 0.5) * step)) {
                for (a, v) in acc.iter_mut().zip(row) {
                    *a += v / n as f64;
                }
            }
        }
        sum
    }

    /// The standard normal draw `[k][expert]` of `layer` in `stream` (Box-Muller on the counter-based stream).
    fn normal(&self, stream: u64, layer: usize, expert: usize, k: i64) -> f64 {
        let cell = (k as u64)
            .wrapping_mul((MAX_LAYERS * MAX_EXPERTS) as u64)
            .wrapping_add((layer * MAX_EXPERTS + expert) as u64)
            .wrapping_mul(2);
        let stream = self.seed ^ stream;
        let (u1, u2) = (uniform(stream, cell), uniform(stream, cell.wrapping_add(1)));
        (-2.0 * (1.0 - u1).ln()).sqrt() * (TAU * u2).cos()
    }
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

    /// Experts among the `n` most loaded of `row`.
    fn top(row: &[f64], n: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        idx.truncate(n);
        idx.sort_unstable();
        idx
    }

    fn shared(a: &[usize], b: &[usize]) -> usize {
        a.iter().filter(|e| b.contains(e)).count()
    }

    #[test]
    fn drifting_loads_are_seeded_zipf_at_every_instant_and_change_over_the_drift_time() {
        let zipf = Popularity::Zipf { s: 1.2 };
        let d = ExpertLoads::new(zipf, 256, 4, 7, 600.0, 1.0);
        assert!(d.drifts());
        assert_eq!(d.sample_s(), 600.0 / SAMPLES_PER_DRIFT);
        let mut sorted_static: Vec<f64> = layer_loads(zipf, 256, 1, 7)[0].clone();
        sorted_static.sort_by(f64::total_cmp);
        for t in [-300.0, 0.0, 17.5, 1234.0] {
            let a = d.at(t);
            assert_eq!(a, ExpertLoads::new(zipf, 256, 4, 7, 600.0, 1.0).at(t), "a function of seed and time");
            assert_ne!(a, ExpertLoads::new(zipf, 256, 4, 8, 600.0, 1.0).at(t), "the seed matters");
            assert_ne!(a[0], a[1], "each layer drifts on its own");
            for row in &a {
                assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-9);
                // The same Zipf weights, on other experts.
                let mut sorted = row.clone();
                sorted.sort_by(f64::total_cmp);
                assert_eq!(sorted, sorted_static);
            }
        }
        // Nearby instants keep most hot experts; two drift times apart they are unrelated.
        let now = top(&d.at(1000.0)[0], 16);
        assert!(shared(&now, &top(&d.at(1005.0)[0], 16)) >= 12);
        let mut far = 0;
        for layer in 0..4 {
            far += shared(&top(&d.at(1000.0)[layer], 16), &top(&d.at(2200.0)[layer], 16));
        }
        // 16 of 256 by chance share one expert on average: 4 over 4 layers.
        assert!(far <= 12, "{far} of 64 hot experts still hot two drift times later");
        // With a lasting part, many of the hot experts stay hot.
        let part = ExpertLoads::new(zipf, 256, 4, 7, 600.0, 0.25);
        let mut kept = 0;
        for layer in 0..4 {
            kept += shared(&top(&part.at(1000.0)[layer], 16), &top(&part.at(2200.0)[layer], 16));
        }
        assert!(kept >= 24, "{kept} of 64 hot experts still hot with three quarters of the score lasting");
    }

    #[test]
    fn static_popularity_ignores_time_and_the_window_mean_smooths_drift() {
        let zipf = Popularity::Zipf { s: 1.2 };
        let fixed = layer_loads(zipf, 256, 3, 7);
        for d in [
            ExpertLoads::new(zipf, 256, 3, 7, 0.0, 1.0),
            ExpertLoads::new(zipf, 256, 3, 7, f64::NAN, 1.0),
            ExpertLoads::new(zipf, 256, 3, 7, 600.0, 0.0),
        ] {
            assert!(!d.drifts() && d.sample_s().is_infinite());
            assert_eq!(d.at(0.0), fixed);
            assert_eq!(d.at(5000.0), fixed);
            assert_eq!(d.mean(0.0, 600.0), fixed);
        }
        let uniform = ExpertLoads::new(Popularity::Uniform, 256, 3, 7, 600.0, 1.0);
        assert!(!uniform.drifts());
        assert_eq!(uniform.at(123.0), layer_loads(Popularity::Uniform, 256, 3, 7));
        // Averaged over a long window, the hot experts take turns: the mean is flatter than any instant.
        let d = ExpertLoads::new(zipf, 256, 3, 7, 60.0, 1.0);
        let mean = d.mean(0.0, 1200.0);
        let peak = |l: &[Vec<f64>]| l[0].iter().cloned().fold(0.0, f64::max);
        assert!(peak(&mean) < peak(&d.at(600.0)) / 2.0, "{} vs {}", peak(&mean), peak(&d.at(600.0)));
        assert!((mean[0].iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }
}
