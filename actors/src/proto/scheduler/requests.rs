//! The request table: admission from the router, worker choice, ending,
//! cancelling, and each request's chain of block keys.

use super::*;

impl SchedulerMachine {
    pub(super) fn generated(&self, rid: RequestId) -> usize {
        self.policy.tokens(rid).len() - self.policy.request(rid).prompt.len()
    }

    /// `spec`'s constraint advanced over the tokens it already generated;
    /// the error says why the request cannot run.
    pub(super) fn constraint_for(
        &self,
        spec: &RequestSpec,
        generated: &[u32],
    ) -> Result<Option<Box<dyn TokenConstraint>>, String> {
        let Some(description) = &spec.constraint else { return Ok(None) };
        let Some(source) = self.ctx.constraints.as_ref().filter(|_| self.ctx.modelled.is_none()) else {
            return Err("structured output is not available on this cluster".into());
        };
        let mut constraint = source.build(description, spec.max_tokens as usize)?;
        for &token in generated {
            constraint.accept(token);
        }
        Ok(Some(constraint))
    }

    pub(super) fn wants_logits(&self, spec: &RequestSpec) -> bool {
        spec.logits || self.ctx.return_logits
    }

    /// The worker (attention data-parallel rank) for a new request: a prefill
    /// instance evens out prompt tokens per worker, others requests per worker.
    pub(super) fn pick_worker(&self) -> u32 {
        let by_tokens = self.ctx.kind(self.instance) == InstanceKind::Prefill;
        let devices = self.ctx.topology.devices_of(self.instance);
        let first = devices.start;
        devices
            .filter(|d| !self.ctx.durable.is_lost(self.home, *d))
            .min_by_key(|d| {
                let (n, tokens) = self.load.get(d).copied().unwrap_or((0, 0));
                if by_tokens {
                    (tokens, n, *d)
                } else {
                    (n, tokens, *d)
                }
            })
            .unwrap_or(first)
    }

    pub(super) fn assign(&mut self, rid: RequestId, worker: u32, prompt: usize) {
        let load = self.load.entry(worker).or_default();
        load.0 += 1;
        load.1 += prompt;
        self.policy.set_rank(rid, worker);
    }

    /// Forget a request this incarnation served; its worker state can go.
    pub(super) fn forget(&mut self, id: u64) -> Option<Live> {
        let l = self.live.remove(&id)?;
        self.by_rid.remove(&l.rid);
        if let Some((n, tokens)) = self.load.get_mut(&l.worker) {
            *n = n.saturating_sub(1);
            *tokens = tokens.saturating_sub(l.spec.prompt.len());
        }
        self.release.entry(l.worker).or_default().push(id);
        Some(l)
    }

    /// End a live request with an error.
    pub(super) fn fail(&mut self, id: u64, why: &str) -> Option<OutputItem> {
        let l = self.forget(id)?;
        let from = self.generated(l.rid);
        let mut f = self.policy.cancel(l.rid).ok()?;
        f.reason = FinishReason::Error(why.to_string());
        Some(OutputItem {
            id,
            from: from as u32,
            tokens: Vec::new(),
            logits: false,
            end: Some(OutputEnd::Finished(finish_wire(&f))),
            cached: 0,
        })
    }

    pub(super) fn chain(&mut self, id: u64, blocks: usize) -> Vec<u64> {
        let bt = self.ctx.block_tokens;
        let l = self.live.get_mut(&id).expect("live request");
        let tokens = self.policy.tokens(l.rid);
        // Keys chained with the images a block covers: two images never share KV.
        let images = &self.policy.request(l.rid).images;
        while l.hashes.len() < blocks {
            let k = l.hashes.len();
            let parent = l.hashes.last().copied().unwrap_or(0);
            l.hashes.push(block_key(parent, &tokens[k * bt..(k + 1) * bt], k * bt, images));
        }
        l.hashes[..blocks].to_vec()
    }

    pub(super) fn on_submit(&mut self, submit: Submit) {
        let Some(submit) = self.encode_first(submit) else { return };
        let Submit { spec, generated, decode, .. } = submit;
        let id = spec.id;
        let mut worker = None;
        if self.handoffs.contains_key(&id) {
            // Prefilled and on its way to a decode instance: that is progress.
            self.send(self.router_of(id), Message::Ack { ids: vec![id] }, &[]);
            return;
        }
        if let Some(l) = self.live.get_mut(&id) {
            l.decode = decode;
            let l = &self.live[&id];
            if self.generated(l.rid) == generated.len() {
                self.send(self.router_of(id), Message::Ack { ids: vec![id] }, &[]);
                self.tick();
                return;
            }
            // The router has a different count: recompute from what it has.
            let l = self.forget(id).expect("live");
            let _ = self.policy.cancel(l.rid);
            bump(&self.ctx.metrics.requests_restarted);
            self.ctx.events.record(format_args!("{} restarts request {id} at {} tokens", self.addr, generated.len()));
            worker = Some(l.worker);
        }
        let context = self.ctx.config.max_position_embeddings;
        if !generated.is_empty()
            && (generated.len() >= spec.max_tokens as usize || spec.prompt.len() + generated.len() >= context)
        {
            let item = end_item(id, generated.len(), spec.prompt.len(), FinishKind::Length);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let constraint = match self.constraint_for(&spec, &generated) {
            Ok(c) => c,
            Err(why) => {
                let end = Some(OutputEnd::Refused(why));
                let item =
                    OutputItem { id, from: generated.len() as u32, tokens: Vec::new(), logits: false, end, cached: 0 };
                self.send_outputs(vec![item], &[]);
                return;
            }
        };
        let request = request_of(&spec);
        if let Err(why) = self.check_images(&spec, &request) {
            let end = Some(OutputEnd::Refused(why));
            let item =
                OutputItem { id, from: generated.len() as u32, tokens: Vec::new(), logits: false, end, cached: 0 };
            self.send_outputs(vec![item], &[]);
            return;
        }
        let added = if generated.is_empty() {
            self.policy.add(request)
        } else {
            bump(&self.ctx.metrics.requests_resumed);
            self.policy.add_resumed(request, &generated)
        };
        match added {
            Err(e) => {
                let item = OutputItem {
                    id,
                    from: generated.len() as u32,
                    tokens: Vec::new(),
                    logits: false,
                    end: Some(OutputEnd::Refused(e.to_string())),
                    cached: 0,
                };
                self.send_outputs(vec![item], &[]);
            }
            Ok(rid) => {
                let worker = worker.unwrap_or_else(|| self.pick_worker());
                self.assign(rid, worker, spec.prompt.len());
                self.by_rid.insert(rid, id);
                let persist = self.policy.cache_persist(rid);
                let live = Live { decode, ..Live::new(rid, worker, spec, constraint, persist) };
                self.live.insert(id, live);
                self.tiers_arrived(rid);
                self.promote_arrived(rid);
                self.send(self.router_of(id), Message::Ack { ids: vec![id] }, &[]);
                self.tick();
            }
        }
    }

    /// A request's images checked before the engine sees them: plans the
    /// model's (which bounds every size), then the engine's own rule (spans,
    /// image tokens, sizes, hashes of patches).
    pub(super) fn check_images(&self, spec: &RequestSpec, request: &Request) -> Result<(), String> {
        if spec.images.is_empty() {
            return Ok(());
        }
        crate::proto::images::check_images(&self.ctx.model, spec.prompt.len(), &spec.images)?;
        deepinfer_engine::images::check_request(&self.ctx.model, request).map_err(|e| e.to_string())
    }

    pub(super) fn on_cancel(&mut self, id: u64) {
        if let Some(h) = self.take_handoff(id) {
            self.pump_transfers(h.target);
            let item = end_item(id, h.generated.len(), h.spec.prompt.len(), FinishKind::Cancelled);
            self.send_outputs(vec![item], &[]);
            return;
        }
        let item = match self.forget(id) {
            Some(l) => {
                let from = self.generated(l.rid);
                match self.policy.cancel(l.rid) {
                    Ok(f) => OutputItem {
                        id,
                        from: from as u32,
                        tokens: Vec::new(),
                        logits: false,
                        end: Some(OutputEnd::Finished(finish_wire(&f))),
                        cached: 0,
                    },
                    Err(_) => end_item(id, from, l.spec.prompt.len(), FinishKind::Cancelled),
                }
            }
            None => end_item(id, 0, 0, FinishKind::Cancelled),
        };
        self.send_outputs(vec![item], &[]);
    }
}
