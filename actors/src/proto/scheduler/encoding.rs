//! Images encoded by an encoder instance before the request is admitted:
//! the router names the encoder (`Submit::encoder`, its image-encoder
//! balancer); this prefill scheduler sends it the patches, holds the request
//! until every image's rows came back (checked: the encoder asked, the
//! attempt, the hash, rows = plan tokens × the model's width), then admits
//! it with rows in place of patches, so its workers run no tower. An
//! encoder that refuses, stays silent past its deadline or whose node
//! membership declares down costs a retry on another live encoder, then
//! encoding on this instance's own workers: never the request.

use super::*;
use crate::limits::MAX_PENDING_ENCODES;
use crate::proto::images::{dim, plan_of};
use crate::wire::{EncodeImage, EncoderMsg, ImageData};

/// A request waiting for its images' rows.
pub(super) struct Encoding {
    submit: Submit,
    encoder: u32,
    attempt: u32,
    /// Encoders asked so far (a retry goes to another).
    tried: BTreeSet<u32>,
    deadline: Duration,
    /// Hashes of the images still without rows.
    waiting: BTreeSet<u64>,
}

/// The requests waiting for encoders.
#[derive(Default)]
pub(super) struct Encodes {
    waiting: BTreeMap<u64, Encoding>,
}

impl Encodes {
    fn images(&self) -> usize {
        self.waiting.values().map(|e| e.waiting.len()).sum()
    }
}

/// Hashes of the images of `spec` that still need the tower.
fn unencoded(spec: &RequestSpec) -> BTreeSet<u64> {
    spec.images.iter().filter(|i| matches!(i.content, ImageData::Patches(_))).map(|i| i.hash).collect()
}

impl SchedulerMachine {
    /// `submit` if it is to be admitted now; `None` when it waits for an
    /// encoder instance (or already does: acknowledged again).
    pub(super) fn encode_first(&mut self, submit: Submit) -> Option<Submit> {
        let id = submit.spec.id;
        if self.encodes.waiting.contains_key(&id) {
            self.send(self.router_of(id), Message::Ack { ids: vec![id] }, &[]);
            return None;
        }
        let Some(encoder) = submit.encoder.filter(|&e| (e as usize) < self.ctx.encoders.len()) else {
            return Some(submit);
        };
        let waiting = unencoded(&submit.spec);
        if waiting.is_empty() || self.live.contains_key(&id) || self.handoffs.contains_key(&id) {
            return Some(submit);
        }
        // Images that do not agree with the prompt are refused by admission.
        let request = request_of(&submit.spec);
        if self.check_images(&submit.spec, &request).is_err() {
            return Some(submit);
        }
        if self.encodes.images() + waiting.len() > MAX_PENDING_ENCODES {
            self.ctx.metrics.images_colocated.fetch_add(waiting.len() as u64, std::sync::atomic::Ordering::Relaxed);
            return Some(submit);
        }
        let e = Encoding { submit, encoder, attempt: 0, tried: BTreeSet::new(), deadline: self.now(), waiting };
        self.encodes.waiting.insert(id, e);
        self.send_encode(id, encoder);
        self.send(self.router_of(id), Message::Ack { ids: vec![id] }, &[]);
        None
    }

    /// Ask `encoder` for the rows of request `id`'s images still waiting.
    fn send_encode(&mut self, id: u64, encoder: u32) {
        let now = self.now();
        let step = self.ctx.timeouts.step;
        let Some(e) = self.encodes.waiting.get_mut(&id) else { return };
        e.attempt += 1;
        e.encoder = encoder;
        e.tried.insert(encoder);
        // The tower's time grows with the images; a deadline per image.
        e.deadline = now + step * (e.waiting.len() as u32).max(1);
        let mut body = Vec::new();
        let mut images = Vec::new();
        for image in e.submit.spec.images.iter().filter(|i| e.waiting.contains(&i.hash)) {
            if let ImageData::Patches(p) = &image.content {
                body.extend_from_slice(p);
                images.push(EncodeImage { hash: image.hash, plan: image.plan, values: p.len() as u32 });
            }
        }
        let (attempt, deadline, n) = (e.attempt, e.deadline, images.len() as u64);
        self.ctx.metrics.images_sent_to_encoders.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        self.ctx.events.record(format_args!("{} asks encoder{encoder} for {n} images of request {id}", self.addr));
        self.send(Addr::encoder(encoder), Message::Encoder(EncoderMsg::Encode { id, attempt, images }), &body);
        self.effects.push(Effect::TickAt(deadline));
    }

    /// An encoder's answer.
    pub(super) fn on_encoder(&mut self, from: Addr, msg: EncoderMsg, body: Vec<f32>) {
        let (id, attempt, hash) = match &msg {
            EncoderMsg::Encoded { id, attempt, hash, .. } | EncoderMsg::Refused { id, attempt, hash, .. } => {
                (*id, *attempt, *hash)
            }
            EncoderMsg::Encode { .. } => (u64::MAX, 0, 0),
        };
        let width = dim(&self.ctx.model);
        let Some(e) = self
            .encodes
            .waiting
            .get_mut(&id)
            .filter(|e| e.encoder == from.index && e.attempt == attempt && e.waiting.contains(&hash))
        else {
            // Late (a retry went elsewhere), or not ours: nothing to do.
            return;
        };
        match msg {
            EncoderMsg::Encoded { tokens, dim, .. } => {
                let image = e.submit.spec.images.iter_mut().find(|i| i.hash == hash).expect("a waiting image");
                let want = plan_of(&image.plan).tokens();
                if tokens as usize != want || dim as usize != width || body.len() != want * width {
                    bump(&self.ctx.metrics.frames_rejected);
                    self.ctx.events.record(format_args!(
                        "{} rejects rows of image {hash:#x} from {from}: {} values, {tokens} × {dim}, for {want} × {width}",
                        self.addr,
                        body.len()
                    ));
                    return;
                }
                for i in e.submit.spec.images.iter_mut().filter(|i| i.hash == hash) {
                    i.content = ImageData::Rows(body.clone());
                }
                e.waiting.remove(&hash);
                if e.waiting.is_empty() {
                    self.admit_encoded(id);
                }
            }
            EncoderMsg::Refused { why, .. } => {
                self.ctx.events.record(format_args!("{}: {from} refused image {hash:#x}: {why}", self.addr));
                self.encode_elsewhere(id);
            }
            EncoderMsg::Encode { .. } => {}
        }
    }

    /// Every image has its rows (or is left to the workers): admit it.
    fn admit_encoded(&mut self, id: u64) {
        let Some(e) = self.encodes.waiting.remove(&id) else { return };
        let colocated = e.waiting.len() as u64;
        if colocated > 0 {
            self.ctx.metrics.images_colocated.fetch_add(colocated, std::sync::atomic::Ordering::Relaxed);
        }
        self.on_submit(Submit { encoder: None, ..e.submit });
    }

    /// Request `id`'s encoder is lost, silent or refused: another live
    /// encoder not asked yet, else this instance's workers.
    fn encode_elsewhere(&mut self, id: u64) {
        let Some(e) = self.encodes.waiting.get(&id) else { return };
        bump(&self.ctx.metrics.encode_retries);
        let home = self.home;
        let next = (0..self.ctx.encoders.len() as u32)
            .find(|&c| !e.tried.contains(&c) && !self.ctx.durable.is_node_down(home, self.ctx.encoders[c as usize]));
        match next {
            Some(c) => self.send_encode(id, c),
            None => {
                self.ctx.events.record(format_args!("{}: request {id}'s images are encoded here", self.addr));
                self.admit_encoded(id);
            }
        }
    }

    /// Encodes past their deadline, and those whose encoder's node is down, go elsewhere.
    pub(super) fn check_encodes(&mut self, down: Option<u32>) {
        let now = self.now();
        let late: Vec<u64> = self
            .encodes
            .waiting
            .iter()
            .filter(|(_, e)| e.deadline <= now || down.is_some_and(|n| self.ctx.encoders[e.encoder as usize] == n))
            .map(|(&id, _)| id)
            .collect();
        for id in late {
            let encoder = self.encodes.waiting[&id].encoder;
            self.ctx.events.record(format_args!("{}: encoder{encoder} lost request {id}'s images", self.addr));
            self.encode_elsewhere(id);
        }
    }

    /// A cancel of a request waiting for rows.
    pub(super) fn cancel_encoding(&mut self, id: u64) -> bool {
        let Some(e) = self.encodes.waiting.remove(&id) else { return false };
        let item = end_item(id, e.submit.generated.len(), e.submit.spec.prompt.len(), FinishKind::Cancelled);
        self.send_outputs(vec![item], &[]);
        true
    }
}
