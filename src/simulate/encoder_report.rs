//! What the image encoders did: per encoder instance, the images it was
//! sent and encoded, its utilisation, how long images queued for a device,
//! encode times and its cache's hit rate; or, with no encoder instance, the
//! device time encoding took on the prefill instances.

use deepinfer_actors::modelled::encoder::EncoderStats;
use serde::Serialize;

use super::report::Percentiles;
use super::RunData;

/// The encoder side of a run, before it is summarised.
#[derive(Clone, Debug, Default)]
pub struct EncoderRun {
    pub instances: Vec<EncoderStats>,
    pub colocated_images: u64,
    pub colocated_encode_us: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EncoderInstanceReport {
    pub devices: u32,
    pub requests: u64,
    /// Images sent there, those it encoded, and those its cache served.
    pub images: u64,
    pub encoded: u64,
    pub cache_hits: u64,
    pub cache_hit_rate: f64,
    pub cache_evictions: u64,
    pub cache_used_gib: f64,
    pub cache_gib: f64,
    /// Device time encoding over device time simulated.
    pub utilisation: f64,
    /// Of each encoded image: waiting for a device, and encoding, ms.
    pub queue_wait_ms: Percentiles,
    pub encode_ms: Percentiles,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EncoderReport {
    /// `instances` (encoder instances of their own) or `colocated` (on the prefill instances).
    pub mode: String,
    pub requests_with_images: u64,
    pub images: u64,
    pub image_tokens: u64,
    /// Requests with images: arrival to their last image's rows at the prefill instance, ms.
    pub images_ready_ms: Percentiles,
    pub instances: Vec<EncoderInstanceReport>,
    /// Over every encoder instance (devices summed).
    pub total: EncoderInstanceReport,
    /// Colocated: device-seconds of encoding the prefill instances' steps carried.
    pub colocated_encode_device_s: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn instance(st: &EncoderStats, simulated_s: f64) -> EncoderInstanceReport {
    let ms = |v: &[f64]| Percentiles::of(&sorted(v.iter().map(|us| us / 1e3).collect()));
    EncoderInstanceReport {
        devices: st.devices,
        requests: st.requests,
        images: st.images,
        encoded: st.encoded,
        cache_hits: st.cache_hits,
        cache_hit_rate: if st.images == 0 { 0.0 } else { st.cache_hits as f64 / st.images as f64 },
        cache_evictions: st.cache_evictions,
        cache_used_gib: st.cache_bytes as f64 / GIB,
        cache_gib: st.cache_capacity as f64 / GIB,
        utilisation: st.busy_us / (st.devices.max(1) as f64 * simulated_s.max(1e-9) * 1e6),
        queue_wait_ms: ms(&st.queue_wait_us),
        encode_ms: ms(&st.encode_us),
    }
}

impl EncoderReport {
    pub fn new(d: &RunData) -> Option<Self> {
        let run = d.encoders.as_ref()?;
        let with: Vec<_> = d.traces.iter().filter(|t| t.images > 0).collect();
        let all = run.instances.iter().fold(EncoderStats::default(), |mut a, s| {
            a.devices += s.devices;
            a.requests += s.requests;
            a.images += s.images;
            a.encoded += s.encoded;
            a.cache_hits += s.cache_hits;
            a.cache_evictions += s.cache_evictions;
            a.cache_bytes += s.cache_bytes;
            a.cache_capacity += s.cache_capacity;
            a.busy_us += s.busy_us;
            a.queue_wait_us.extend(&s.queue_wait_us);
            a.encode_us.extend(&s.encode_us);
            a
        });
        Some(Self {
            mode: if run.instances.is_empty() { "colocated" } else { "instances" }.into(),
            requests_with_images: with.len() as u64,
            images: with.iter().map(|t| t.images as u64).sum(),
            image_tokens: with.iter().map(|t| t.image_tokens as u64).sum(),
            images_ready_ms: Percentiles::of(&sorted(with.iter().map(|t| t.images_ready_us as f64 / 1e3).collect())),
            instances: run.instances.iter().map(|s| instance(s, d.simulated_s)).collect(),
            total: instance(&all, d.simulated_s),
            colocated_encode_device_s: run.colocated_encode_us / 1e6,
        })
    }

    pub fn to_markdown(&self) -> String {
        let mut md = format!(
            "\n## Image encoders\n\n{} requests carried {} images ({} image tokens); their rows were at the prefill \
             instance {:.1} / {:.1} / {:.1} ms (p50 / p90 / p99) after arrival.\n\n",
            self.requests_with_images,
            self.images,
            self.image_tokens,
            self.images_ready_ms.p50,
            self.images_ready_ms.p90,
            self.images_ready_ms.p99
        );
        if self.mode == "colocated" {
            md += &format!(
                "No encoder instance: the prefill instances encoded them, {:.1} device-seconds added to their \
                 prefill steps.\n",
                self.colocated_encode_device_s
            );
            return md;
        }
        md += "| encoder | devices | images | encoded | cache hits | hit rate | utilisation | queue wait ms p50 / p99 \
               | encode ms mean / p99 | cache GiB used / size |\n|---|---|---|---|---|---|---|---|---|---|\n";
        let row = |name: String, e: &EncoderInstanceReport| {
            format!(
                "| {name} | {} | {} | {} | {} | {:.1}% | {:.1}% | {:.1} / {:.1} | {:.1} / {:.1} | {:.2} / {:.1} |\n",
                e.devices,
                e.images,
                e.encoded,
                e.cache_hits,
                e.cache_hit_rate * 100.0,
                e.utilisation * 100.0,
                e.queue_wait_ms.p50,
                e.queue_wait_ms.p99,
                e.encode_ms.mean,
                e.encode_ms.p99,
                e.cache_used_gib,
                e.cache_gib
            )
        };
        for (i, e) in self.instances.iter().enumerate() {
            md += &row(format!("encoder {i}"), e);
        }
        md += &row("**all**".into(), &self.total);
        md
    }
}
