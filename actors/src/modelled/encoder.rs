//! Image encoders in simulation: the stage before prefill that turns a
//! request's images into encoded rows (V4.1's ViT and aligner), either on
//! encoder instances of their own or on the prefill instance itself.
//!
//! With encoder instances, each request's images go to the instance
//! [`pick_encoder`] chooses (pending patches per device, and cache affinity:
//! where the balancer last sent each image). An instance encodes one image
//! per device at a time, first come first served, and keeps what it encoded
//! in an [`EncoderCache`] keyed by the image hash; a hit costs nothing but
//! the transfer (and the wait, if the image is still being encoded there).
//! The rows (the image span at the text model's width, bf16) then cross the
//! scale-out link to the prefill instance; the request is admitted once its
//! last image's rows are there.
//!
//! The stage is driven by the simulate driver on the virtual clock: a
//! request's images are placed when it arrives, which fixes when each
//! encoding starts and ends (devices serve in arrival order, nothing
//! preempts), so the stage is a deterministic function of the arrivals. It
//! is not an actor: the simulated router and schedulers run unchanged, and
//! the request reaches the router when its rows would (see DESIGN.md,
//! "Image encoders").

use std::collections::BTreeMap;

use deepinfer_engine::balance::{pick_encoder, EncoderLoad};
use deepinfer_engine::encoder_cache::EncoderCache;

/// The encoder balancer keeps affinity while the instance's load stays
/// within this share above the least loaded one's, as the prefill balancer does.
pub const ENCODER_AFFINITY_SLACK: f64 = 0.5;

/// One image of a request, priced for the encoder stage.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImageJob {
    /// Content hash: equal hashes are the same image.
    pub hash: u64,
    pub patches: u64,
    /// Positions the image's span takes in the prompt.
    pub tokens: usize,
    /// Device time to encode it, µs.
    pub encode_us: f64,
    /// Bytes of its encoded rows.
    pub rows_bytes: u64,
}

/// An encoder instance of a scenario.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EncoderSpec {
    pub devices: u32,
    /// Bytes of encoded rows its cache keeps.
    pub cache_bytes: u64,
}

/// What one encoder instance did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EncoderStats {
    pub devices: u32,
    pub requests: u64,
    /// Images sent there, and those it encoded (the rest hit its cache).
    pub images: u64,
    pub encoded: u64,
    pub cache_hits: u64,
    pub cache_evictions: u64,
    pub cache_bytes: u64,
    pub cache_capacity: u64,
    /// Device time spent encoding, µs (over all its devices).
    pub busy_us: f64,
    /// Per encoded image: how long it queued for a device, and its encode time, µs.
    pub queue_wait_us: Vec<f64>,
    pub encode_us: Vec<f64>,
}

struct Encoder {
    /// When each device finishes what it was given, µs.
    free_at_us: Vec<u64>,
    /// Encodings not yet done: (done at µs, patches), for the balancer's load.
    in_flight: Vec<(u64, u64)>,
    /// Image hash → when its rows are ready there, µs.
    cache: EncoderCache<u64>,
    stats: EncoderStats,
}

/// When a request's images are ready on its prefill instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placed {
    /// The encoder instance, or `None` when colocated.
    pub encoder: Option<usize>,
    pub ready_us: u64,
}

/// The encoder stage of a simulated cluster.
pub struct EncoderStage {
    encoders: Vec<Encoder>,
    /// Image hash → the encoder the balancer last sent it to (affinity).
    last_sent: BTreeMap<u64, usize>,
    /// The link from an encoder to a prefill instance: bytes/s and latency.
    link_bytes_per_s: f64,
    link_latency_us: f64,
    /// With no encoder instance: images encoded on the prefill instances, and their device time.
    pub colocated_images: u64,
    pub colocated_encode_us: f64,
}

impl EncoderStage {
    /// Encoder instances `specs` (none: colocated), sending rows over a link
    /// of `link_bytes_per_s` (achieved) and `link_latency_us`.
    pub fn new(specs: &[EncoderSpec], link_bytes_per_s: f64, link_latency_us: f64) -> Self {
        let encoders = specs
            .iter()
            .map(|s| Encoder {
                free_at_us: vec![0; s.devices.max(1) as usize],
                in_flight: Vec::new(),
                cache: EncoderCache::new(s.cache_bytes),
                stats: EncoderStats { devices: s.devices.max(1), cache_capacity: s.cache_bytes, ..Default::default() },
            })
            .collect();
        Self {
            encoders,
            last_sent: BTreeMap::new(),
            link_bytes_per_s: link_bytes_per_s.max(1.0),
            link_latency_us: link_latency_us.max(0.0),
            colocated_images: 0,
            colocated_encode_us: 0.0,
        }
    }

    pub fn colocated(&self) -> bool {
        self.encoders.is_empty()
    }

    /// Place a request's `images` arriving at `now_us`. Colocated: nothing
    /// waits here (the caller adds the returned device time to the prefill
    /// instances' steps) and `ready_us` is `now_us`.
    pub fn place(&mut self, now_us: u64, images: &[ImageJob]) -> (Placed, f64) {
        if images.is_empty() {
            return (Placed { encoder: None, ready_us: now_us }, 0.0);
        }
        if self.colocated() {
            let device_us: f64 = images.iter().map(|i| i.encode_us).sum();
            self.colocated_images += images.len() as u64;
            self.colocated_encode_us += device_us;
            return (Placed { encoder: None, ready_us: now_us }, device_us);
        }
        let loads: Vec<EncoderLoad> = self
            .encoders
            .iter_mut()
            .enumerate()
            .map(|(i, e)| {
                e.in_flight.retain(|&(done, _)| done > now_us);
                EncoderLoad {
                    alive: true,
                    devices: e.free_at_us.len() as u32,
                    pending_patches: e.in_flight.iter().map(|&(_, p)| p).sum(),
                    cached: images.iter().filter(|im| self.last_sent.get(&im.hash) == Some(&i)).count(),
                }
            })
            .collect();
        let patches: u64 = images.iter().map(|i| i.patches).sum();
        let chosen = pick_encoder(&loads, patches, ENCODER_AFFINITY_SLACK).expect("encoder instances never fail here");
        let e = &mut self.encoders[chosen];
        e.stats.requests += 1;
        let mut ready_us = now_us;
        for im in images {
            e.stats.images += 1;
            let rows_at = match e.cache.get(im.hash) {
                Some(&ready) => ready.max(now_us),
                None => {
                    let device = (0..e.free_at_us.len()).min_by_key(|&d| (e.free_at_us[d], d)).expect("a device");
                    let start = e.free_at_us[device].max(now_us);
                    let done = start + im.encode_us.ceil() as u64;
                    e.free_at_us[device] = done;
                    e.in_flight.push((done, im.patches));
                    e.cache.insert(im.hash, done, im.rows_bytes);
                    e.stats.encoded += 1;
                    e.stats.busy_us += im.encode_us;
                    e.stats.queue_wait_us.push((start - now_us) as f64);
                    e.stats.encode_us.push(im.encode_us);
                    done
                }
            };
            self.last_sent.insert(im.hash, chosen);
            let transfer = self.link_latency_us + im.rows_bytes as f64 / self.link_bytes_per_s * 1e6;
            ready_us = ready_us.max(rows_at + transfer.ceil() as u64);
        }
        (Placed { encoder: Some(chosen), ready_us }, 0.0)
    }

    /// What each encoder instance did so far.
    pub fn stats(&self) -> Vec<EncoderStats> {
        self.encoders
            .iter()
            .map(|e| EncoderStats {
                cache_hits: e.cache.hits(),
                cache_evictions: e.cache.evictions(),
                cache_bytes: e.cache.bytes(),
                ..e.stats.clone()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(hash: u64, encode_us: f64) -> ImageJob {
        ImageJob { hash, patches: 1000, tokens: 100, encode_us, rows_bytes: 1_000_000 }
    }

    fn stage(encoders: u32, devices: u32) -> EncoderStage {
        let specs: Vec<EncoderSpec> =
            (0..encoders).map(|_| EncoderSpec { devices, cache_bytes: 100_000_000 }).collect();
        // 1 GB/s, 10 µs: a 1 MB image's rows take 1,010 µs.
        EncoderStage::new(&specs, 1e9, 10.0)
    }

    #[test]
    fn images_queue_on_a_busy_device_and_their_rows_cross_the_link() {
        let mut s = stage(1, 1);
        let (p, colocated_us) = s.place(0, &[image(1, 5000.0)]);
        assert_eq!((p.encoder, p.ready_us, colocated_us), (Some(0), 6010, 0.0));
        // The second request's image waits for the device.
        let (p, _) = s.place(1000, &[image(2, 5000.0)]);
        assert_eq!(p.ready_us, 11_010);
        let st = &s.stats()[0];
        assert_eq!(st.queue_wait_us, vec![0.0, 4000.0]);
        assert_eq!((st.images, st.encoded, st.busy_us), (2, 2, 10_000.0));
    }

    #[test]
    fn a_repeated_image_hits_the_cache_of_the_encoder_that_has_it() {
        let mut s = stage(2, 1);
        let (a, _) = s.place(0, &[image(7, 5000.0)]);
        // One device, and idle: the same image twice in a request is encoded once.
        let (b, _) = s.place(10_000, &[image(7, 5000.0), image(7, 5000.0)]);
        assert_eq!((b.encoder, b.ready_us), (a.encoder, 11_010));
        let st = &s.stats()[a.encoder.unwrap()];
        assert_eq!((st.requests, st.images, st.encoded, st.cache_hits), (2, 3, 1, 2));
        // While image 8 is still being encoded, a repeat of it waits for the same encoding.
        let mut one = stage(1, 1);
        let (c, _) = one.place(20_000, &[image(8, 5000.0)]);
        let (d, _) = one.place(20_100, &[image(8, 5000.0)]);
        assert_eq!(d.ready_us, c.ready_us);
        assert_eq!(one.stats()[0].encoded, 1);
    }

    #[test]
    fn affinity_gives_way_to_an_idle_encoder_beyond_the_slack() {
        let mut s = stage(2, 1);
        let (a, _) = s.place(0, &[image(7, 5000.0)]);
        // Encoder a is still busy: 2,000 patches after against 1,000 is beyond the 0.5 slack.
        let (b, _) = s.place(100, &[image(7, 5000.0)]);
        assert_ne!(a.encoder, b.encoder);
        assert_eq!(b.ready_us, 100 + 6010);
    }

    #[test]
    fn more_encoders_spread_the_load() {
        let run = |encoders| {
            let mut s = stage(encoders, 1);
            (0..8u64).map(|i| s.place(i * 100, &[image(i, 5000.0)]).0.ready_us - i * 100).max().unwrap()
        };
        assert!(run(4) < run(2) && run(2) < run(1), "{} {} {}", run(1), run(2), run(4));
    }

    #[test]
    fn colocated_returns_the_device_time_and_waits_for_nothing() {
        let mut s = stage(0, 1);
        let (p, us) = s.place(500, &[image(1, 3000.0), image(2, 2000.0)]);
        assert_eq!((p.encoder, p.ready_us, us), (None, 500, 5000.0));
        assert_eq!((s.colocated_images, s.colocated_encode_us), (2, 5000.0));
        assert!(s.stats().is_empty());
    }
}
