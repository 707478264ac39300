//! Prefill/decode disaggregation: a prefilled request leaves with its
//! state for a decode instance, which adopts it (or recomputes it).

use std::sync::atomic::Ordering;

use super::*;

/// Why a prefill instance gives up on moving a request's state and has it
/// recomputed on a decode instance instead.
#[derive(Clone, Copy, Debug)]
pub(super) enum Reroute {
    /// No state was exported (too large for the step's answer).
    NoState,
    /// The state does not fit a frame.
    Frame,
    /// The handoff table is full.
    Backlog,
    /// Not adopted after every transfer attempt.
    Unadopted,
}

impl SchedulerMachine {
    /// A request prefilled here leaves for its decode instance with its state;
    /// without one (too large to export) the router places it for recompute.
    /// Its transfer waits its turn in the target's window.
    pub(super) fn hand_off(&mut self, id: u64, state: Option<(Vec<u32>, Vec<f32>)>) {
        let Some(target) = self.live.get(&id).and_then(|l| l.decode) else { return };
        let Some(l) = self.forget(id) else { return };
        // Its last output comes from the decode instance, which knows nothing of these hits.
        self.forget_tier_hits(id);
        let generated = self.policy.tokens(l.rid)[l.spec.prompt.len()..].to_vec();
        let _ = self.policy.cancel(l.rid);
        match state {
            Some(_) if self.handoffs.len() >= MAX_HANDOFF_BACKLOG => self.reroute(id, target, Reroute::Backlog),
            Some((lens, values)) => {
                let since = self.now();
                let bytes = (values.len() * 4) as u64;
                let h =
                    Handoff { spec: l.spec, generated, lens, values, target, attempt: 0, since, sent: false, bytes };
                bump(&self.ctx.metrics.handovers);
                self.handoffs.insert(id, h);
                self.queued.entry(target).or_default().push_back(id);
                self.ctx.metrics.handoffs_pending_peak.fetch_max(self.handoffs.len() as u64, Ordering::Relaxed);
                self.pump_transfers(target);
            }
            None => self.reroute(id, target, Reroute::NoState),
        }
    }

    /// Sends the transfers waiting for `target` while its window has room.
    pub(super) fn pump_transfers(&mut self, target: u32) {
        while self.in_flight.get(&target).map_or(0, |f| f.0) < TRANSFER_WINDOW {
            let Some(queue) = self.queued.get_mut(&target) else { break };
            let id = queue.pop_front().expect("queues are removed when empty");
            if queue.is_empty() {
                self.queued.remove(&target);
            }
            if !self.send_transfer(id) {
                self.take_handoff(id);
                self.reroute(id, target, Reroute::Frame);
            }
        }
    }

    /// Sends (or sends again) request `id`'s state and arms its deadline: the
    /// control timeout plus the time the bytes in flight to its target, its
    /// own included, take at the slowest assumed rate. False when the state
    /// does not fit a frame.
    fn send_transfer(&mut self, id: u64) -> bool {
        let Some(h) = self.handoffs.get_mut(&id) else { return true };
        let msg = HandoffMsg::Transfer {
            spec: Box::new(h.spec.clone()),
            generated: h.generated.clone(),
            lens: h.lens.clone(),
            attempt: h.attempt,
            router: self.owners.get(&id).copied().unwrap_or(self.last_router),
        };
        let to = Addr::scheduler(h.target);
        self.ctx.events.record(format_args!("{} transfers request {id} to {to} (attempt {})", self.addr, h.attempt));
        let (target, attempt, values) = (h.target, h.attempt, std::mem::take(&mut h.values));
        let sent = self.send(to, Message::Handoff(msg), &values);
        let h = self.handoffs.get_mut(&id).expect("present");
        h.values = values;
        if !sent {
            return false;
        }
        if !h.sent {
            h.sent = true;
            let f = self.in_flight.entry(target).or_default();
            f.0 += 1;
            f.1 += h.bytes;
        }
        let ahead = self.in_flight[&target].1;
        let drain =
            Duration::from_nanos((ahead as u128 * 1_000_000_000 / TRANSFER_RATE_FLOOR_BYTES_PER_S as u128) as u64);
        let at = self.now() + self.ctx.timeouts.control + drain;
        self.effects.push(Effect::ArmTransfer { id, attempt, at });
        true
    }

    /// Request `id` leaves the handoff table (adopted, given up or
    /// cancelled): its window slot or its place in the queue is freed, and a
    /// prefill paused on the backlog may run again. The caller pumps its target.
    pub(super) fn take_handoff(&mut self, id: u64) -> Option<Handoff> {
        let h = self.handoffs.remove(&id)?;
        if h.sent {
            let f = self.in_flight.get_mut(&h.target).expect("a sent transfer holds a slot");
            f.0 -= 1;
            f.1 -= h.bytes;
            if f.0 == 0 {
                self.in_flight.remove(&h.target);
            }
            self.effects.push(Effect::DisarmTransfer(id));
        } else if let Some(q) = self.queued.get_mut(&h.target) {
            q.retain(|&x| x != id);
            if q.is_empty() {
                self.queued.remove(&h.target);
            }
        }
        if self.handoffs.len() + 1 == MAX_PENDING_TRANSFERS {
            self.tick();
        }
        Some(h)
    }

    /// The backlog of finished prefills is at its limit: no step starts
    /// (prefill admission waits) until adoptions bring it below.
    pub(super) fn handoffs_full(&self) -> bool {
        self.handoffs.len() >= MAX_PENDING_TRANSFERS
    }

    pub(super) fn reroute(&mut self, id: u64, target: u32, why: Reroute) {
        let m = &self.ctx.metrics;
        bump(&m.requests_restarted);
        bump(match why {
            Reroute::NoState | Reroute::Frame => &m.reroutes_no_state,
            Reroute::Backlog => &m.reroutes_backlog,
            Reroute::Unadopted => &m.reroutes_unadopted,
        });
        self.ctx
            .events
            .record(format_args!("{} reroutes request {id} away from scheduler{target}: {why:?}", self.addr));
        let msg = HandoffMsg::Reroute { id, instance: target };
        self.send(self.router_of(id), Message::Handoff(msg), &[]);
    }

    pub(super) fn on_transfer_timeout(&mut self, id: u64, attempt: u32) {
        let Some(h) = self.handoffs.get_mut(&id).filter(|h| h.attempt == attempt && h.sent) else { return };
        h.attempt += 1;
        let target = h.target;
        let why = if h.attempt < TRANSFER_ATTEMPTS {
            bump(&self.ctx.metrics.transfers_resent);
            if self.send_transfer(id) {
                return;
            }
            Reroute::Frame
        } else {
            Reroute::Unadopted
        };
        self.take_handoff(id);
        self.reroute(id, target, why);
        self.pump_transfers(target);
    }

    pub(super) fn on_adopted(&mut self, id: u64, instance: u32) {
        if self.handoffs.get(&id).is_some_and(|h| h.target == instance && h.sent) {
            let h = self.take_handoff(id).expect("present");
            self.ctx.metrics.handoff_wait.record(self.now().saturating_sub(h.since));
            self.owners.remove(&id);
            self.ctx.events.record(format_args!("{} request {id} adopted by scheduler{instance}", self.addr));
            self.pump_transfers(instance);
        }
    }

    /// A prefilled request arrives: it continues here from its state. A state
    /// that does not check out is recomputed instead; either way it is adopted.
    pub(super) fn on_transfer(
        &mut self,
        from: Addr,
        spec: RequestSpec,
        generated: Vec<u32>,
        lens: Vec<u32>,
        values: Vec<f32>,
    ) {
        let id = spec.id;
        let adopted = Message::Handoff(HandoffMsg::Adopted { id, instance: self.instance });
        if self.live.contains_key(&id) {
            // A repeated (or late) transfer of a request already running here:
            // it may have moved on since; only the answer was lost.
            self.send(from, adopted.clone(), &[]);
            self.send(self.router_of(id), adopted, &[]);
            return;
        }
        let cfg = &self.ctx.model.config;
        let position = spec.prompt.len() + generated.len();
        if generated.len() >= spec.max_tokens as usize || position >= self.ctx.config.max_position_embeddings {
            // Nothing is left to generate (a peer that should have finished it).
            self.send(from, adopted.clone(), &[]);
            self.send(self.router_of(id), adopted, &[]);
            let item = end_item(id, generated.len(), spec.prompt.len(), FinishKind::Length);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let checked = if generated.is_empty() || parts_values(&lens) != Some(values.len()) {
            Err("lengths do not match the body".to_string())
        } else if self.ctx.modelled.is_some() {
            // Modelled devices move positions, not values.
            Ok(())
        } else {
            self.ctx.model.state_from_parts(&lens, &values, cfg.max_position_embeddings).and_then(|s| {
                if s.position + 1 == position {
                    Ok(())
                } else {
                    Err(format!("state at {} for {position} tokens", s.position))
                }
            })
        };
        let constraint = match self.constraint_for(&spec, &generated) {
            Ok(c) => c,
            Err(why) => {
                self.send(from, adopted.clone(), &[]);
                self.send(self.router_of(id), adopted, &[]);
                let end = Some(OutputEnd::Refused(why));
                let item =
                    OutputItem { id, from: generated.len() as u32, tokens: Vec::new(), logits: false, end, cached: 0 };
                self.send_outputs(vec![item], &[]);
                return;
            }
        };
        let request = request_of(&spec);
        let added = match &checked {
            Ok(()) => self.policy.add_prefilled(request, &generated),
            Err(why) => {
                bump(&self.ctx.metrics.handoff_recomputes);
                self.ctx.events.record(format_args!("{} recomputes request {id}: {why}", self.addr));
                if generated.is_empty() {
                    self.policy.add(request)
                } else {
                    self.policy.add_resumed(request, &generated)
                }
            }
        };
        self.send(from, adopted.clone(), &[]);
        self.send(self.router_of(id), adopted, &[]);
        match added {
            Err(e) => {
                let end = Some(OutputEnd::Refused(e.to_string()));
                let item =
                    OutputItem { id, from: generated.len() as u32, tokens: Vec::new(), logits: false, end, cached: 0 };
                self.send_outputs(vec![item], &[]);
            }
            Ok(rid) => {
                self.tiers_imported(rid);
                let worker = self.pick_worker();
                self.assign(rid, worker, spec.prompt.len());
                self.by_rid.insert(rid, id);
                let import = checked.is_ok().then_some((lens, values));
                self.ctx.events.record(format_args!("{} adopts request {id} at {position} tokens", self.addr));
                let persist = self.policy.cache_persist(rid);
                let live = Live { import, ..Live::new(rid, worker, spec, constraint, persist) };
                self.live.insert(id, live);
                self.tick();
            }
        }
    }
}
