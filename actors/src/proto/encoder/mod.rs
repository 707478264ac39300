//! The image encoder's protocol machine, sans-IO: one per encoder instance.
//! A prefill scheduler sends `Encode` with a request's images (plans and
//! hashes in the header, patches in the body); each image is checked (its
//! plan the model's, its patch count the plan's, its patches' hash the
//! one named), answered at once from the encoder cache when the cache holds
//! its rows, else queued. The tower runs one image per `Input::Work` (the
//! shell feeds `Work` back as the machine asks), so the queue stays
//! observable and a kill between images loses only what was queued; each
//! image's rows go back to the scheduler as `Encoded` (header + rows body)
//! and into the cache. Nothing is retried here: a scheduler that hears
//! nothing in time, or hears the encoder's node is down, asks another
//! encoder or encodes on its own workers (see DESIGN.md).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::encoder_cache::EncoderCache;
use deepinfer_engine::images::image_hash;
use deepinfer_engine::v41::vision::PreparedImage;

use super::images::{check_plan, dim, patch_values, vision};
use super::{Crash, Outgoing};
use crate::cluster::ctx::Ctx;
use crate::limits::{ENCODER_CACHE_BYTES, MAX_ENCODER_QUEUE, MAX_ENCODE_IMAGES};
use crate::net::transport::Delivery;
use crate::sim::events::bump;
use crate::sim::faults::Target;
use crate::wire::{Addr, EncodeImage, EncoderMsg, Message, Role};

#[cfg(test)]
mod tests;

/// What the machine reacts to.
#[derive(Debug)]
pub enum Input {
    Net(Delivery),
    /// Encode the next queued image.
    Work,
}

/// What the machine asks its shell to do, in order.
#[derive(Debug, PartialEq)]
pub enum Effect {
    /// The device is busy this long (modelled device time, on a virtual
    /// clock with a cost model): the shell sleeps before what follows.
    Busy(Duration),
    Send(Outgoing),
    /// Feed `Input::Work` back (after the frames before it are sent).
    Work,
}

/// One queued image.
struct Job {
    reply_to: Addr,
    id: u64,
    attempt: u32,
    hash: u64,
    image: PreparedImage,
}

/// What an encoder has done since it started (its shell publishes them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub images_encoded: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub refused: u64,
}

pub struct EncoderMachine {
    index: u32,
    addr: Addr,
    now: Duration,
    effects: Vec<Effect>,
    queue: VecDeque<Job>,
    /// A `Work` is outstanding: the queue drains without asking again.
    working: bool,
    cache: EncoderCache<Arc<[f32]>>,
    counters: Counters,
    /// Images taken from the queue (the fault-injection points).
    started: u64,
    ctx: Arc<Ctx>,
}

impl EncoderMachine {
    pub fn start(now: Duration, index: u32, incarnation: u32, ctx: Arc<Ctx>) -> Self {
        let addr = Addr::encoder(index);
        ctx.events.record(format_args!("{addr} up (incarnation {incarnation})"));
        Self {
            index,
            addr,
            now,
            effects: Vec::new(),
            queue: VecDeque::new(),
            working: false,
            cache: EncoderCache::new(ENCODER_CACHE_BYTES),
            counters: Counters::default(),
            started: 0,
            ctx,
        }
    }

    pub fn addr(&self) -> Addr {
        self.addr
    }

    pub fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    /// Images waiting for the tower.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// React to one input at `now`.
    pub fn handle(&mut self, now: Duration, input: Input) -> Result<(), Crash> {
        assert!(now >= self.now, "time runs forward");
        self.now = now;
        let result = match input {
            Input::Net(d) => {
                self.on_frame(d);
                Ok(())
            }
            Input::Work => {
                self.working = false;
                self.work()
            }
        };
        if !self.queue.is_empty() && !self.working {
            self.working = true;
            self.effects.push(Effect::Work);
        }
        assert!(self.queue.len() <= MAX_ENCODER_QUEUE, "{}: the queue is bounded", self.addr);
        result
    }

    fn send(&mut self, to: Addr, msg: Message, body: &[f32]) {
        if let Some(o) = super::encode(&self.ctx.events, self.addr, to, msg, body) {
            self.effects.push(Effect::Send(o));
        }
    }

    fn refuse(&mut self, to: Addr, id: u64, attempt: u32, hash: u64, why: String) {
        self.counters.refused += 1;
        self.ctx.events.record(format_args!("{} refuses image {hash:#x} of request {id}: {why}", self.addr));
        self.send(to, Message::Encoder(EncoderMsg::Refused { id, attempt, hash, why }), &[]);
    }

    fn on_frame(&mut self, d: Delivery) {
        let Some(m) = self.ctx.open(self.addr, &d) else { return };
        let from = m.envelope.from;
        match (from.role, m.envelope.msg) {
            (Role::Scheduler, Message::Encoder(EncoderMsg::Encode { id, attempt, images })) => {
                self.on_encode(from, id, attempt, &images, m.body)
            }
            (_, Message::Heartbeat(_)) => {}
            (_, other) => {
                bump(&self.ctx.metrics.frames_rejected);
                self.ctx.events.record(format_args!("{} ignores {:?} from {from}", self.addr, other.kind()));
            }
        }
    }

    /// Check every image before any is queued: the request is refused whole
    /// when its frame does not add up, image by image when one does not.
    fn on_encode(&mut self, from: Addr, id: u64, attempt: u32, images: &[EncodeImage], body: Vec<f32>) {
        let cfg = match vision(&self.ctx.model) {
            Ok(cfg) => cfg.clone(),
            Err(why) => {
                for i in images.iter().take(MAX_ENCODE_IMAGES) {
                    self.refuse(from, id, attempt, i.hash, why.clone());
                }
                return;
            }
        };
        let total: u64 = images.iter().map(|i| u64::from(i.values)).sum();
        if images.len() > MAX_ENCODE_IMAGES || total != body.len() as u64 {
            bump(&self.ctx.metrics.frames_rejected);
            self.ctx.events.record(format_args!(
                "{} rejects an encode of {} images and {total} values with {} body values",
                self.addr,
                images.len(),
                body.len()
            ));
            return;
        }
        let mut at = 0usize;
        for image in images {
            let patches = &body[at..at + image.values as usize];
            at += image.values as usize;
            let plan = match check_plan(&cfg, &image.plan) {
                Ok(plan) => plan,
                Err(why) => {
                    self.refuse(from, id, attempt, image.hash, why);
                    continue;
                }
            };
            if patch_values(&cfg, &plan) != patches.len() {
                let why = format!("{} patch values for a plan of {}", patches.len(), patch_values(&cfg, &plan));
                self.refuse(from, id, attempt, image.hash, why);
                continue;
            }
            if let Some(rows) = self.cache.get(image.hash).cloned() {
                self.counters.cache_hits += 1;
                self.reply(from, id, attempt, image.hash, &rows, true);
                continue;
            }
            self.counters.cache_misses += 1;
            let prepared = PreparedImage { plan, patches: patches.to_vec() };
            if image_hash(&prepared) != image.hash {
                self.refuse(from, id, attempt, image.hash, "its hash is not the hash of its patches".into());
                continue;
            }
            if self.queue.len() >= MAX_ENCODER_QUEUE {
                self.refuse(from, id, attempt, image.hash, format!("{MAX_ENCODER_QUEUE} images queued already"));
                continue;
            }
            self.queue.push_back(Job { reply_to: from, id, attempt, hash: image.hash, image: prepared });
        }
    }

    fn reply(&mut self, to: Addr, id: u64, attempt: u32, hash: u64, rows: &[f32], cached: bool) {
        let dim = dim(&self.ctx.model);
        let tokens = (rows.len() / dim.max(1)).min(u32::MAX as usize) as u32;
        let msg = EncoderMsg::Encoded { id, attempt, hash, tokens, dim: dim as u32, cached };
        self.send(to, Message::Encoder(msg), rows);
    }

    /// The tower's time on the modelled device, when the cluster models
    /// device time: the cost model's price of the modelled model's published
    /// tower for an image of this size (as workers price the modelled
    /// model's layers while the small one computes). `None`: the wall
    /// clock's own time, or a modelled model without a tower.
    fn device_time(&self, plan: &deepinfer_engine::v41::vision::ImagePlan) -> Option<Duration> {
        let dc = self.ctx.device_cost.as_ref()?;
        let cost = deepinfer_engine::cost::vision::VisionCost::of(dc.spec.model)?;
        let published = cost.plan(plan.width, plan.height).ok()?;
        let us = cost.encode_us(&published, &dc.hardware, dc.spec.efficiency);
        Some(Duration::from_nanos((us * 1e3).clamp(0.0, 1e15) as u64))
    }

    /// Run the tower and the aligner on the oldest queued image.
    fn work(&mut self) -> Result<(), Crash> {
        let Some(job) = self.queue.pop_front() else { return Ok(()) };
        self.started += 1;
        if self.ctx.faults.kill_point(Target::Encoder(self.index), self.started, 0) {
            return Err(Crash(format!("{}: injected crash at image {}", self.addr, self.started)));
        }
        let rows = self.ctx.model.image_model().and_then(|m| {
            let aligned = m.encode_image(&job.image)?;
            m.span_embeddings(&job.image.plan, &aligned)
        });
        match rows {
            Ok(rows) => {
                if let Some(busy) = self.device_time(&job.image.plan) {
                    self.effects.push(Effect::Busy(busy));
                }
                let rows: Arc<[f32]> = rows.into();
                self.counters.images_encoded += 1;
                self.cache.insert(job.hash, Arc::clone(&rows), rows.len() as u64 * 4);
                self.reply(job.reply_to, job.id, job.attempt, job.hash, &rows, false);
            }
            Err(e) => self.refuse(job.reply_to, job.id, job.attempt, job.hash, e.to_string()),
        }
        Ok(())
    }
}
