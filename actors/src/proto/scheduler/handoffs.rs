//! Prefill/decode disaggregation: a prefilled request leaves with its
//! state for a decode instance, which adopts it (or recomputes it).

use super::*;

impl SchedulerMachine {
    /// A request prefilled here leaves for its decode instance with its state;
    /// without one (too large to export) the router places it for recompute.
    pub(super) fn hand_off(&mut self, id: u64, state: Option<(Vec<u32>, Vec<f32>)>) {
        let Some(target) = self.live.get(&id).and_then(|l| l.decode) else { return };
        let Some(l) = self.forget(id) else { return };
        // Its last output comes from the decode instance, which knows nothing of these hits.
        self.forget_tier_hits(id);
        let generated = self.policy.tokens(l.rid)[l.spec.prompt.len()..].to_vec();
        let _ = self.policy.cancel(l.rid);
        match state {
            Some((lens, values)) if self.handoffs.len() < MAX_PENDING_TRANSFERS => {
                let h = Handoff { spec: l.spec, generated, lens, values, target, attempt: 0 };
                bump(&self.ctx.metrics.handovers);
                self.handoffs.insert(id, h);
                self.send_transfer(id);
            }
            _ => self.reroute(id, target, "no state to transfer"),
        }
    }

    pub(super) fn send_transfer(&mut self, id: u64) {
        let Some(h) = self.handoffs.get_mut(&id) else { return };
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
        if !sent {
            self.handoffs.remove(&id);
            self.reroute(id, target, "the state does not fit a frame");
            return;
        }
        if let Some(h) = self.handoffs.get_mut(&id) {
            h.values = values;
        }
        let at = self.now() + self.ctx.timeouts.control;
        self.effects.push(Effect::ArmTransfer { id, attempt, at });
    }

    pub(super) fn reroute(&mut self, id: u64, target: u32, why: &str) {
        bump(&self.ctx.metrics.requests_restarted);
        self.ctx.events.record(format_args!("{} reroutes request {id} away from scheduler{target}: {why}", self.addr));
        let msg = HandoffMsg::Reroute { id, instance: target };
        self.send(self.router_of(id), Message::Handoff(msg), &[]);
    }

    pub(super) fn on_transfer_timeout(&mut self, id: u64, attempt: u32) {
        let Some(h) = self.handoffs.get_mut(&id).filter(|h| h.attempt == attempt) else { return };
        h.attempt += 1;
        if h.attempt < TRANSFER_ATTEMPTS {
            self.send_transfer(id);
            return;
        }
        let h = self.handoffs.remove(&id).expect("present");
        self.reroute(id, h.target, &format!("not adopted after {TRANSFER_ATTEMPTS} transfers"));
    }

    pub(super) fn on_adopted(&mut self, id: u64, instance: u32) {
        if self.handoffs.get(&id).is_some_and(|h| h.target == instance) {
            self.handoffs.remove(&id);
            self.owners.remove(&id);
            self.effects.push(Effect::DisarmTransfer(id));
            self.ctx.events.record(format_args!("{} request {id} adopted by scheduler{instance}", self.addr));
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
