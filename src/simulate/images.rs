//! Image traffic in simulation: each arrival's images, drawn from the
//! scenario seed (which requests carry images, how many, their sizes,
//! which recur from the pool), priced with the model's vision tower, and the
//! encoder stage that holds a request back until its images' rows reach
//! the prefill instance (`deepinfer_actors::modelled::encoder`).

use std::collections::BTreeMap;

use deepinfer_actors::modelled::devices::Modelled;
use deepinfer_actors::modelled::encoder::{EncoderStage, ImageJob};
use deepinfer_actors::sim::rng::mix64;
use deepinfer_engine::cost::vision::VisionCost;
use deepinfer_engine::cost::Efficiency;
use deepinfer_engine::traffic::Arrival;
use deepinfer_engine::v41::vision::ImagePlan;

use crate::scenario::{ImageTraffic, InstanceKind, Scenario};

/// Latency of sending encoded rows to a prefill instance, µs (one RDMA write
/// across the scale-out network, as the simulated fabric's default link).
pub const ROWS_LINK_LATENCY_US: f64 = 10.0;

/// Salts keeping the draws of images apart from each other and from other traffic.
const SALT_CARRIES: u64 = 0x696d_6167_6573_0001;
const SALT_IMAGE: u64 = 0x696d_6167_6573_0002;
const SALT_POOL: u64 = 0x696d_6167_6573_0003;

/// A uniform in `[0, 1)` from a hash.
fn unit(h: u64) -> f64 {
    (h >> 11) as f64 / (1u64 << 53) as f64
}

fn pick_size(t: &ImageTraffic, u: f64) -> (usize, usize) {
    let total: f64 = t.sizes.iter().map(|s| s.weight).sum();
    let mut at = u * total;
    for s in &t.sizes {
        if at < s.weight {
            return (s.width, s.height);
        }
        at -= s.weight;
    }
    let last = t.sizes.last().expect("at least one size");
    (last.width, last.height)
}

/// The images of arrival `index`, each priced by `price` (device µs of
/// its plan): a pure function of the seed and the index.
pub fn draw(
    t: &ImageTraffic,
    seed: u64,
    index: u64,
    vision: &VisionCost,
    price: &mut impl FnMut(&ImagePlan) -> f64,
) -> Vec<ImageJob> {
    let r = |salt: u64, k: u64| mix64(seed ^ salt ^ mix64(index.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ k));
    if unit(r(SALT_CARRIES, 0)) >= t.share {
        return Vec::new();
    }
    let n = t.per_request.draw(unit(r(SALT_CARRIES, 1)), unit(r(SALT_CARRIES, 2)));
    (0..n as u64)
        .map(|j| {
            let u = unit(r(SALT_IMAGE, 3 * j));
            // A pool image keeps its hash and its size wherever it recurs.
            let hash = if u < t.repeat_share {
                let p = (unit(r(SALT_IMAGE, 3 * j + 1)) * t.pool as f64) as u64;
                mix64(seed ^ SALT_POOL ^ p) & !(1 << 63)
            } else {
                r(SALT_IMAGE, 3 * j + 2) | 1 << 63
            };
            let (w, h) = pick_size(t, unit(mix64(hash)));
            let plan = vision.plan(w, h).expect("sizes are checked when the scenario is read");
            ImageJob {
                hash,
                patches: (plan.n_vit_h * plan.n_vit_w) as u64,
                tokens: plan.tokens(),
                encode_us: price(&plan),
                rows_bytes: vision.rows_bytes(&plan),
            }
        })
        .collect()
}

/// Every arrival's images (empty without `[images]`), priced on the
/// scenario's hardware; their tokens are added to the arrival's prompt (the
/// text follows the images).
pub fn images_of(s: &Scenario, arrivals: &mut [Arrival]) -> Vec<Vec<ImageJob>> {
    let (Some(t), Some(vision)) = (&s.images, VisionCost::of(s.model)) else {
        return vec![Vec::new(); arrivals.len()];
    };
    let hw = s.hardware.spec();
    let eff = Efficiency::for_hardware(s.hardware);
    let mut by_grid: BTreeMap<(usize, usize), f64> = BTreeMap::new();
    let mut price =
        |p: &ImagePlan| *by_grid.entry((p.n_vit_h, p.n_vit_w)).or_insert_with(|| vision.encode_us(p, &hw, eff));
    arrivals
        .iter_mut()
        .enumerate()
        .map(|(i, a)| {
            let jobs = draw(t, s.seed, i as u64, &vision, &mut price);
            a.input_tokens += jobs.iter().map(|j| j.tokens).sum::<usize>();
            jobs
        })
        .collect()
}

/// Count an arrival's `images` and their wait in the time series' slice `slot`.
pub fn record(buckets: &mut Vec<super::Bucket>, slot: usize, images: usize, waited_us: u64) {
    if images == 0 {
        return;
    }
    if buckets.len() <= slot {
        buckets.resize(slot + 1, super::Bucket::default());
    }
    buckets[slot].images += images as u64;
    buckets[slot].images_ready_max_us = buckets[slot].images_ready_max_us.max(waited_us);
}

/// The encoder stage as the driver uses it: requests held until their images' rows are ready.
pub struct ImageStage {
    pub jobs: Vec<Vec<ImageJob>>,
    pub stage: EncoderStage,
    /// Prefill-capable instances and their devices: colocated encoding is spread over them.
    prefill: Vec<(u32, u32)>,
    /// (ready at µs, arrival index) of requests waiting for their images.
    pub waiting: BTreeMap<(u64, usize), ()>,
    /// Per arrival: µs from arrival to its images' rows at the prefill instance.
    pub waited_us: Vec<u64>,
}

impl ImageStage {
    pub fn new(s: &Scenario, jobs: Vec<Vec<ImageJob>>) -> Self {
        let hw = s.hardware.spec();
        let eff = Efficiency::for_hardware(s.hardware);
        let prefill = s
            .instances
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| *k != InstanceKind::Decode)
            .map(|(i, &(_, d))| (i as u32, d))
            .collect();
        let waited_us = vec![0; jobs.len()];
        Self {
            jobs,
            stage: EncoderStage::new(&s.encoders, hw.scale_out_bytes_per_s() * eff.network, ROWS_LINK_LATENCY_US),
            prefill,
            waiting: BTreeMap::new(),
            waited_us,
        }
    }

    /// Arrival `index` at `now_us`: `true` when it may be submitted now,
    /// otherwise it waits in `waiting`.
    pub fn arrive(&mut self, index: usize, now_us: u64, modelled: Option<&Modelled>) -> bool {
        let (placed, colocated_us) = self.stage.place(now_us, &self.jobs[index]);
        if colocated_us > 0.0 {
            // Data-parallel over every prefill device: each instance's steps carry its share.
            let devices: u32 = self.prefill.iter().map(|&(_, d)| d).sum();
            if let Some(m) = modelled {
                for &(instance, _) in &self.prefill {
                    m.add_colocated_encode(instance, colocated_us / devices.max(1) as f64);
                }
            }
        }
        self.waited_us[index] = placed.ready_us - now_us;
        if placed.ready_us <= now_us {
            return true;
        }
        self.waiting.insert((placed.ready_us, index), ());
        false
    }

    /// The next request whose images are ready by `now_us`.
    pub fn ready(&mut self, now_us: u64) -> Option<usize> {
        let (&(at, index), _) = self.waiting.first_key_value()?;
        if at > now_us {
            return None;
        }
        self.waiting.remove(&(at, index));
        Some(index)
    }

    pub fn next_ready_us(&self) -> Option<u64> {
        self.waiting.keys().next().map(|&(at, _)| at)
    }
}
