//! Requests in flight: outputs relayed to the client in order (a gap
//! is asked for again), handoffs between prefill and decode instances,
//! deadlines, cancels and lost nodes.

use super::*;
use crate::proto::cursor::{fit, Fit};

impl RouterMachine {
    /// The decode instance took the request over from its prefill instance.
    pub(super) fn on_adopted(&mut self, id: u64, instance: u32) {
        let now = self.now();
        let Some(mut f) = self.flights.get_mut(&id) else {
            // Cancelled (or ended) while its state was on the way: stop it there.
            self.send(Addr::scheduler(instance), Message::Cancel { id }, &[]);
            return;
        };
        if f.decode != Some(instance) && f.instance != instance {
            return;
        }
        if f.instance != instance {
            f.prefilled_on = Some(f.instance);
            f.instance = instance;
        }
        f.decode = None;
        f.attempts = 0;
        f.deadline = now + self.ctx.timeouts.request;
        let cancelled = f.cancelled;
        drop(f);
        self.ctx.events.record(format_args!("router: request {id} decodes on scheduler{instance}"));
        if cancelled {
            self.forward(id);
        }
    }

    /// The prefill instance could not move the request: another decode instance recomputes it.
    pub(super) fn on_reroute(&mut self, from: u32, id: u64, failed: u32) {
        let now = self.now();
        if self.flights.get(&id).is_none_or(|f| f.instance != from) {
            return;
        }
        let target = self.choose_decode(Some(failed)).unwrap_or(failed);
        let mut f = self.flights.get_mut(&id).expect("checked");
        f.prefilled_on = Some(from);
        f.instance = target;
        f.decode = None;
        f.attempts = 0;
        f.deadline = now + self.ctx.timeouts.request;
        drop(f);
        self.ctx.events.record(format_args!("router: request {id} rerouted to scheduler{target}"));
        bump(&self.ctx.metrics.submits_resent);
        self.forward(id);
    }

    pub(super) fn on_outputs(&mut self, from: Addr, out: Outputs, body: Vec<f32>) {
        let vocab = self.ctx.config.vocab_size;
        let Some(items) = out.with_logits(&body, vocab) else {
            bump(&self.ctx.metrics.frames_rejected);
            self.ctx.events.record(format_args!("router rejects outputs of {from}: body does not match"));
            return;
        };
        let now = self.now();
        let mut by_client: BTreeMap<Addr, (Vec<OutputItem>, Vec<f32>)> = BTreeMap::new();
        for (item, logits) in items {
            let id = item.id;
            // Not ours (any more): output of an earlier router's request, or
            // of a request routed again. It is not cancelled: the request may
            // be running there again by now; it ends by itself.
            let mine = |f: &Flight| {
                f.instance == from.index || f.decode == Some(from.index) || f.prefilled_on == Some(from.index)
            };
            if !self.flights.get(&id).is_some_and(mine) {
                continue;
            }
            let mut f = self.flights.get_mut(&id).expect("checked");
            let cancelled = matches!(&item.end, Some(OutputEnd::Finished(w)) if w.reason == FinishKind::Cancelled);
            if cancelled && !f.cancelled {
                // A scheduler's answer to a cancel meant for an earlier life of the request.
                continue;
            }
            let (have, start) = (f.tokens.len(), item.from as usize);
            let skip = match fit(have, start, item.tokens.len()) {
                Fit::Gap => {
                    self.ctx.events.record(format_args!("router missed output {have}..{start} of request {id}"));
                    bump(&self.ctx.metrics.submits_resent);
                    f.deadline = now + self.ctx.timeouts.request;
                    drop(f);
                    self.forward(id);
                    continue;
                }
                Fit::Stale => continue,
                Fit::New { skip } => skip,
            };
            f.tokens.extend(item.tokens[skip..].iter().map(|t| t.token));
            f.attempts = 0;
            f.deadline = now + self.ctx.timeouts.request;
            let client = f.client;
            let mut new = OutputItem {
                id,
                from: have as u32,
                tokens: item.tokens[skip..].to_vec(),
                logits: item.logits,
                end: item.end.clone(),
                // A request decoded elsewhere than it was prefilled reports the prefill's hits.
                cached: item.cached.max(if f.prefilled_on.is_some() { f.cached_tokens as u32 } else { 0 }),
            };
            // A request decoded elsewhere than it was prefilled reports the
            // prefill's cache hits (the lookup at routing time).
            if let (Some(OutputEnd::Finished(w)), Some(_)) = (&mut new.end, f.prefilled_on) {
                w.cached_tokens = w.cached_tokens.max(f.cached_tokens as u32);
            }
            drop(f);
            if item.end.is_some() {
                self.flights.remove(id);
            }
            if new.tokens.is_empty() && new.end.is_none() {
                continue;
            }
            let (items, b) = by_client.entry(client).or_default();
            if item.logits {
                b.extend_from_slice(&logits[skip * vocab..]);
            }
            items.push(new);
        }
        for (client, (items, b)) in by_client {
            self.send_to_client(client, items, &b);
        }
    }

    /// Cancel the requests of watched clients silent for longer than
    /// `request_attempts` request timeouts: nobody reads their outputs.
    fn cancel_vanished_clients(&mut self) {
        let now = self.now();
        let silence = self.ctx.timeouts.request * self.ctx.timeouts.request_attempts.max(1);
        let gone: Vec<Addr> =
            self.watched.iter().filter(|(_, &heard)| now.saturating_sub(heard) > silence).map(|(c, _)| *c).collect();
        for client in gone {
            self.watched.remove(&client);
            let ids: Vec<u64> =
                self.flights.iter().filter(|(_, f)| f.client == client && !f.cancelled).map(|(id, _)| *id).collect();
            self.ctx.events.record(format_args!("router: {client} is gone; cancelling its {} requests", ids.len()));
            for id in ids {
                self.flights.get_mut(&id).expect("listed").cancelled = true;
                self.forward(id);
            }
        }
    }

    pub(super) fn on_tick(&mut self) {
        self.cancel_vanished_clients();
        let now = self.now();
        let late: Vec<u64> = self.routing.iter().filter(|(_, r)| r.deadline <= now).map(|(q, _)| *q).collect();
        for q in late {
            self.decide(q);
        }
        let late: Vec<u64> = self.flights.iter().filter(|(_, f)| f.deadline <= now).map(|(id, _)| *id).collect();
        for id in late {
            let mut f = self.flights.get_mut(&id).expect("listed");
            f.attempts += 1;
            f.deadline = now + self.ctx.timeouts.request;
            let give_up = f.attempts > self.ctx.timeouts.request_attempts || (f.cancelled && f.attempts > 1);
            drop(f);
            if give_up {
                let f = self.flights.remove(id).expect("listed");
                if f.cancelled {
                    let item = end_item(id, f.tokens.len(), f.spec.prompt.len(), FinishKind::Cancelled);
                    self.send_to_client(f.client, vec![item], &[]);
                    continue;
                }
                let why = format!(
                    "scheduler{} made no progress on request {id} after {} attempts",
                    f.instance, self.ctx.timeouts.request_attempts
                );
                self.ctx.events.record(format_args!("router: {why}"));
                self.send(Addr::scheduler(f.instance), Message::Cancel { id }, &[]);
                let item = end_item(id, f.tokens.len(), f.spec.prompt.len(), FinishKind::Error(why));
                self.send_to_client(f.client, vec![item], &[]);
                continue;
            }
            bump(&self.ctx.metrics.submits_resent);
            self.forward(id);
        }
    }

    /// Membership declared `node` dead (this router's node says so):
    /// requests on an instance whose scheduler lived there, or bound to
    /// decode on one, are routed again as if just submitted with the tokens
    /// they have (recomputed on the new instance, bit for bit); the dead
    /// instances are `Down` to both balancers. With no instance left they
    /// end with an error.
    pub(super) fn on_node_down(&mut self, node: u32) {
        let topo = &self.ctx.topology;
        let dead: Vec<bool> =
            (0..topo.instances).map(|i| self.ctx.durable.is_lost(self.node, topo.devices_of(i).start)).collect();
        let is_dead = |i: u32| dead.get(i as usize).copied().unwrap_or(false);
        let moved: Vec<u64> = self
            .flights
            .iter()
            .filter(|(_, f)| is_dead(f.instance) || f.decode.is_some_and(is_dead))
            .map(|(id, _)| *id)
            .collect();
        let none_left = dead.iter().all(|&d| d);
        for id in moved {
            let f = self.flights.remove(id).expect("listed");
            let (from, prompt) = (f.tokens.len(), f.spec.prompt.len());
            if f.cancelled || none_left {
                let why = format!("node{node} is down and no serving instance is left");
                let reason = if f.cancelled { FinishKind::Cancelled } else { FinishKind::Error(why) };
                self.send_to_client(f.client, vec![end_item(id, from, prompt, reason)], &[]);
                continue;
            }
            self.ctx
                .events
                .record(format_args!("router moves request {id} off scheduler{} (node{node} down)", f.instance));
            self.on_submit(f.client, Submit { spec: f.spec, generated: f.tokens, decode: None, encoder: None });
        }
    }

    pub(super) fn on_cancel(&mut self, client: Addr, id: u64) {
        if self.flights.contains_key(&id) {
            self.flights.get_mut(&id).expect("present").cancelled = true;
            self.forward(id);
            return;
        }
        let routed =
            self.routing.iter().find(|(_, r)| r.submit.spec.id == id).map(|(q, r)| (*q, r.submit.spec.prompt.len()));
        let prompt = routed.map_or(0, |(_, p)| p);
        if let Some((q, _)) = routed {
            self.routing.remove(&q);
        }
        self.send_to_client(client, vec![end_item(id, 0, prompt, FinishKind::Cancelled)], &[]);
    }
}
