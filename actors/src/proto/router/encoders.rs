//! The image-encoder balancer: which encoder instance encodes a new
//! request's images (the engine's `balance::pick_encoder`): the least
//! pending ViT patches per device, unless an encoder that was sent most of
//! the request's images before (its cache likely holds their rows) is
//! within the slack of it. Pending patches are those of the flights routed
//! to an encoder that have no token yet (their prefill has not finished).

use std::collections::{BTreeMap, VecDeque};

use deepinfer_engine::balance::{pick_encoder, EncoderLoad};

use super::RouterMachine;
use crate::limits::MAX_ENCODER_AFFINITY;
use crate::wire::{ImageData, ImageWire, RequestSpec};

/// How much more loaded than the least loaded encoder the one holding a
/// request's images may be and still get them (its tower runs nothing).
const AFFINITY_SLACK: f64 = 0.5;

/// The encoder each recent image hash was sent to, bounded (oldest forgotten first).
#[derive(Default)]
pub(super) struct Affinity {
    by_hash: BTreeMap<u64, u32>,
    order: VecDeque<u64>,
}

impl Affinity {
    fn record(&mut self, hash: u64, encoder: u32) {
        if self.by_hash.insert(hash, encoder).is_none() {
            self.order.push_back(hash);
        }
        while self.order.len() > MAX_ENCODER_AFFINITY {
            if let Some(old) = self.order.pop_front() {
                self.by_hash.remove(&old);
            }
        }
    }
}

/// ViT patches an image takes to encode (none once its rows are known).
pub(super) fn patches(image: &ImageWire) -> u64 {
    match image.content {
        ImageData::Patches(_) => u64::from(image.plan.n_vit_h) * u64::from(image.plan.n_vit_w),
        ImageData::Rows(_) => 0,
    }
}

impl RouterMachine {
    /// The encoder for `spec`'s images; `None` without encoder instances,
    /// without images to encode, or with every encoder's node down or
    /// draining (the prefill workers encode them).
    pub(super) fn choose_encoder(&mut self, spec: &RequestSpec) -> Option<u32> {
        if self.ctx.encoders.is_empty() || !spec.images.iter().any(|i| patches(i) > 0) {
            return None;
        }
        // Plans that are not the model's are refused by the scheduler; they
        // never reach an encoder (and their sizes are not summed).
        if crate::proto::images::key_images(&self.ctx.model, &spec.images).is_empty() {
            return None;
        }
        let need: u64 = spec.images.iter().map(patches).sum();
        let mut pending = vec![0u64; self.ctx.encoders.len()];
        for (_, f) in self.flights.iter() {
            if let Some(e) = f.encoder.filter(|_| f.tokens.is_empty()) {
                if let Some(p) = pending.get_mut(e as usize) {
                    // Flights name an encoder only once their plans were checked.
                    *p = p.saturating_add(f.spec.images.iter().map(patches).sum::<u64>());
                }
            }
        }
        let loads: Vec<EncoderLoad> = (0..self.ctx.encoders.len())
            .map(|e| {
                let node = self.ctx.encoders[e];
                EncoderLoad {
                    alive: !self.ctx.durable.is_node_down(self.node, node) && !self.draining.contains(&node),
                    devices: 1,
                    pending_patches: pending[e],
                    cached: spec
                        .images
                        .iter()
                        .filter(|i| self.affinity.by_hash.get(&i.hash) == Some(&(e as u32)))
                        .count(),
                }
            })
            .collect();
        let chosen = pick_encoder(&loads, need, AFFINITY_SLACK)? as u32;
        for image in &spec.images {
            self.affinity.record(image.hash, chosen);
        }
        self.ctx.events.record(format_args!("router sends request {}'s images to encoder{chosen}", spec.id));
        Some(chosen)
    }
}
