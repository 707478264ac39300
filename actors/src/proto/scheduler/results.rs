//! A step's results: checked against what was asked, folded into the
//! policy (sampled tokens, computed blocks stored in the node's cache) and
//! streamed to the router.

use super::*;

impl SchedulerMachine {
    /// One output per sampling item and the snapshots asked for, with a body
    /// that adds up. Items whose request ended since the step was sent may be
    /// answered or not.
    pub(super) fn check_answer(&self, run: &StepRun, worker: u32, answer: Shape<'_>, body: usize) -> bool {
        let Shape { outputs, snapshots, exports, verifications } = answer;
        let vocab = self.ctx.config.vocab_size;
        let mine: BTreeMap<u64, &Item> =
            run.by_worker.get(&worker).into_iter().flatten().map(|&i| (run.items[i].id, &run.items[i])).collect();
        let mut want_body = 0;
        // Each sampling item answers `repeat` tokens (with drafts, `1 +
        // accepted` per step), at consecutive positions in order.
        let repeat = run.repeat.max(1) as u64;
        let Some(tokens) = self.verified_tokens(&mine, repeat, verifications) else { return false };
        let want = |seq: u64| tokens.as_ref().map_or(repeat, |t| t.get(&seq).copied().unwrap_or(0));
        let mut seen: BTreeMap<u64, u64> = BTreeMap::new();
        for o in outputs {
            let Some(it) = mine.get(&o.seq).filter(|it| it.sample) else { return false };
            let n = seen.entry(o.seq).or_default();
            let ok = o.position == it.to as u64 + *n
                && *n < want(o.seq)
                && (o.token as usize) < vocab
                && o.top.iter().all(|t| (t.token as usize) < vocab);
            *n += 1;
            if !ok {
                return false;
            }
            want_body += if it.logits { vocab } else { 0 };
        }
        let mut got = BTreeSet::new();
        for s in snapshots {
            let asked = mine.get(&s.seq).is_some_and(|it| it.snapshots.contains(&(s.block as usize)));
            if !asked || !got.insert((s.seq, s.block as usize)) {
                return false;
            }
            want_body += parts_len(&s.lens);
        }
        // Exports may be left out (too large): the request is then recomputed where it goes.
        let mut exported = BTreeSet::new();
        for x in exports {
            let asked = mine.get(&x.seq).is_some_and(|it| it.export);
            let Some(n) = parts_values(&x.lens).filter(|_| asked && exported.insert(x.seq)) else { return false };
            want_body += n;
        }
        let complete = mine.values().filter(|it| self.alive(it)).all(|it| {
            let answered = seen.get(&it.id).copied().unwrap_or(0) == want(it.id);
            let verified = tokens.is_none() || tokens.as_ref().is_some_and(|t| t.contains_key(&it.id));
            (!it.sample || (answered && verified)) && it.snapshots.iter().all(|&k| got.contains(&(it.id, k)))
        });
        complete && body == want_body
    }

    pub(super) fn complete(&mut self, run: StepRun) {
        let vocab = self.ctx.config.vocab_size;
        let bt = self.ctx.block_tokens;
        let StepRun { step, items, answers, mut ended, repeat, .. } = run;
        self.record_loads(&answers);
        // A sequence appears once per step.
        let mut index = SeqSlots::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            index.get_or_insert(it.id, i);
        }
        let of = |seq: u64, worker: u32| index.get(seq).filter(|&i| items[i].worker == worker);
        let mut exported: BTreeMap<u64, (Vec<u32>, Vec<f32>)> = BTreeMap::new();
        // Per worker: outputs by sequence, with their logits rows; snapshots with their values.
        let mut sampled_rows: BySeq<SampledRow> = BySeq::default();
        let mut verified: BySeq<Verification> = BySeq::default();
        let mut snaps: Vec<Snap> = Vec::new();
        for (worker, a) in answers {
            for v in a.verifications {
                verified.push(v.seq, v);
            }
            let mut at = 0;
            for o in a.outputs {
                let wants = of(o.seq, worker).is_some_and(|i| items[i].logits);
                let row = wants.then(|| {
                    at += vocab;
                    a.body[at - vocab..at].to_vec()
                });
                sampled_rows.push(o.seq, (o, row));
            }
            for s in a.snapshots {
                let n = parts_len(&s.lens);
                let values = a.body[at..at + n].to_vec();
                at += n;
                let Some(i) = of(s.seq, worker) else { continue };
                let it = &items[i];
                let k = s.block as usize;
                let wave = step_segments(it.from, it.to, it.replay_until, &it.snapshots, bt)
                    .iter()
                    .position(|&(_, end, _)| end == (k + 1) * bt)
                    .unwrap_or(usize::MAX);
                snaps.push(Snap { wave, item: i, block: k, lens: s.lens, values });
            }
            for x in a.exports {
                let n = parts_values(&x.lens).unwrap_or(0);
                let values = a.body[at..at + n].to_vec();
                at += n;
                exported.insert(x.seq, (x.lens, values));
            }
        }
        // The order the engine registers blocks in: wave by wave, items in plan order.
        snaps.sort_by_key(|s| (s.wave, s.item, s.block));
        let mut stores = Vec::new();
        let mut store_body = Vec::new();
        let mut persists = Vec::new();
        let rule = self.ctx.cache_tiers.persist;
        self.recent.clear();
        for Snap { item: i, block: k, lens, values, .. } in snaps {
            let it = &items[i];
            if !self.alive(it) {
                continue;
            }
            if let Registration::New(b) = self.policy.register_block(it.rid, k) {
                let chain = self.chain(it.id, k + 1);
                let parent = if k == 0 { 0 } else { chain[k - 1] };
                self.cached.insert(b, chain[k]);
                self.tiers_computed(chain[k], parent);
                stores.push(StoredBlock {
                    hash: chain[k],
                    parent,
                    tokens: self.policy.tokens(it.rid)[k * bt..(k + 1) * bt].to_vec(),
                    lens: lens.clone(),
                    ttl_ms: self.policy.cache_ttl_ms(it.rid),
                });
                store_body.extend_from_slice(&values);
                self.recent.insert(chain[k], (lens, values));
                // A persist point of the prompt: the chain up to here goes to disk.
                let prompt_blocks = self.live[&it.id].spec.prompt.len().saturating_sub(1) / bt;
                if let Some(n) = rule.point(k, prompt_blocks).filter(|_| self.live[&it.id].persist) {
                    persists.push(chain[..n].to_vec());
                }
            }
        }
        if !stores.is_empty() {
            let msg = CacheMsg::Store { instance: self.instance, step, blocks: stores };
            self.send(self.cache, Message::Cache(msg), &store_body);
        }
        for chain in persists {
            self.persist_chain(chain);
        }
        // Sampling items, then (modelled decode events) the further decode
        // steps the workers ran as one: each is planned and completed here as
        // the engine would have, step by step.
        let mut current: Vec<(u64, RequestId, usize)> =
            items.iter().filter(|it| it.sample && self.alive(it)).map(|it| (it.id, it.rid, it.drafts)).collect();
        let mut outs = Outs::default();
        let drafting = self.ctx.modelled.clone().filter(|m| m.drafting().is_some());
        for sub in 0..repeat.max(1) {
            if sub > 0 {
                current = self.plan_decode_substep(step, &mut ended);
            }
            if let Some(m) = &drafting {
                self.complete_verified(m, &current, &mut sampled_rows, &mut verified, &mut outs);
                continue;
            }
            if self.drafting() {
                self.complete_drafted(&current, &mut sampled_rows, &mut verified, &mut outs);
                continue;
            }
            let mut sampled = Vec::with_capacity(current.len());
            let mut satisfied = Vec::new();
            for &(id, rid, _) in &current {
                let Some((o, row)) = sampled_rows.pop(id) else { continue };
                sampled.push(SampledToken { id: rid, token: o.token, ok: o.logprob.is_finite() });
                if let Some(c) = self.live.get_mut(&id).and_then(|l| l.constraint.as_deref_mut()) {
                    c.accept(o.token);
                    if c.is_done() {
                        satisfied.push(id);
                    }
                }
                outs.push(id, self.generated(rid), self.policy.cached_tokens(rid).unwrap_or(0), o, row);
            }
            for (rid, f) in self.policy.complete(&sampled) {
                let Some(&id) = self.by_rid.get(&rid) else { continue };
                // The end of a model turn: its whole computed chain goes to disk.
                if let Some(l) = self.forget(id).filter(|l| l.persist) {
                    self.persist_chain(l.hashes);
                }
                outs.finish(id, &f);
            }
            // A constraint that admits nothing more ends its request as a stop, as in the engine.
            for id in satisfied {
                let Some(l) = self.forget(id) else { continue };
                if let Ok(mut f) = self.policy.cancel(l.rid) {
                    f.reason = FinishReason::Stop;
                    outs.finish(id, &f);
                }
            }
        }
        let mut body = Vec::new();
        for (item, row) in outs.items {
            if let Some(row) = row {
                body.extend_from_slice(&row);
            }
            ended.push(item);
        }
        self.send_outputs(ended, &body);
        // After the outputs: the router has the first token before the decode instance speaks.
        let leaving: Vec<u64> = items.iter().filter(|it| it.export && self.alive(it)).map(|it| it.id).collect();
        for id in leaving {
            let state = exported.remove(&id);
            self.hand_off(id, state);
        }
        self.phase = Phase::Idle;
        self.publish_gauges();
        self.tick();
    }

    /// Fold the step's routed rows into the load tracker (malformed entries are ignored).
    pub(super) fn record_loads(&mut self, answers: &BTreeMap<u32, Answer>) {
        let Some(tracker) = self.eplb.as_mut() else { return };
        let (layers, experts) = (self.ctx.model.config.num_layers, self.ctx.model.config.n_routed_experts);
        let mut rows = vec![0u32; layers * experts];
        for x in answers.values().flat_map(|a| &a.loads) {
            if (x.layer as usize) < layers && (x.expert as usize) < experts {
                let r = &mut rows[x.layer as usize * experts + x.expert as usize];
                *r = r.saturating_add(x.rows);
            }
        }
        if rows.iter().any(|&r| r > 0) {
            let _ = tracker.record_step(&rows);
        }
    }

    /// What a plan ends besides its items: failed requests (their final
    /// outputs join `ended`), preempted states to release, evicted cached blocks.
    pub(super) fn settle(&mut self, step: u64, plan: &mut StepPlan, ended: &mut Vec<OutputItem>) {
        for (rid, f) in std::mem::take(&mut plan.failed) {
            let Some(&id) = self.by_rid.get(&rid) else { continue };
            self.forget(id);
            ended.push(OutputItem {
                id,
                from: f.completion_tokens as u32,
                tokens: Vec::new(),
                logits: false,
                end: Some(OutputEnd::Finished(finish_wire(&f))),
                cached: 0,
            });
        }
        for rid in &plan.preempted {
            if let Some(l) = self.by_rid.get(rid).and_then(|id| self.live.get(id)) {
                self.release.entry(l.worker).or_default().push(l.spec.id);
            }
        }
        self.tiers_evicted(&plan.evicted);
        let evicted: Vec<u64> = plan.evicted.iter().filter_map(|e| self.cached.remove(&e.blocks.compressed)).collect();
        self.promoted_evicted(&evicted);
        if !evicted.is_empty() {
            let msg = CacheMsg::Evict { instance: self.instance, step, hashes: evicted };
            self.send(self.cache, Message::Cache(msg), &[]);
        }
    }

    /// The next decode step of a multi-step event: plan it (running
    /// requests only), register the blocks it completes (valueless, as
    /// modelled devices store them) and return its sampling items.
    pub(super) fn plan_decode_substep(
        &mut self,
        step: u64,
        ended: &mut Vec<OutputItem>,
    ) -> Vec<(u64, RequestId, usize)> {
        let bt = self.ctx.block_tokens;
        let mut plan = self.policy.schedule_running();
        self.settle(step, &mut plan, ended);
        let mut stores = Vec::new();
        let mut current = Vec::with_capacity(plan.items.len());
        for it in &plan.items {
            let Some(&id) = self.by_rid.get(&it.id) else { continue };
            for &k in &it.snapshots {
                if let Registration::New(b) = self.policy.register_block(it.id, k) {
                    let chain = self.chain(id, k + 1);
                    self.cached.insert(b, chain[k]);
                    self.tiers_computed(chain[k], if k == 0 { 0 } else { chain[k - 1] });
                    stores.push(StoredBlock {
                        hash: chain[k],
                        parent: if k == 0 { 0 } else { chain[k - 1] },
                        tokens: self.policy.tokens(it.id)[k * bt..(k + 1) * bt].to_vec(),
                        lens: Vec::new(),
                        ttl_ms: self.policy.cache_ttl_ms(it.id),
                    });
                }
            }
            if it.sample {
                current.push((id, it.id, it.drafts));
            }
        }
        if !stores.is_empty() {
            let msg = CacheMsg::Store { instance: self.instance, step, blocks: stores };
            self.send(self.cache, Message::Cache(msg), &[]);
        }
        current
    }

    /// Decode steps to run as one event: more than one only for modelled
    /// devices, a plan where every item decodes one token (transferred
    /// requests included), and room in the KV budget.
    pub(super) fn decode_repeat(&self, items: &[Item]) -> u32 {
        let Some(m) = &self.ctx.modelled else { return 1 };
        let most = m.spec.decode_steps_per_event.max(1) as usize;
        if most == 1 || items.is_empty() {
            return 1;
        }
        let context = self.ctx.config.max_position_embeddings;
        let drafts = m.drafting().map_or(0, |d| d.max_drafts());
        if drafts > 0 && !self.room_for_drafts(items, drafts) {
            return 1;
        }
        let mut repeat = most;
        for it in items {
            // With drafts, a decode step also feeds again the drafts a rejection took back.
            let decodes =
                it.to == it.from + 1 || (drafts > 0 && it.to - it.from <= drafts && self.generated(it.rid) > 0);
            let plain = it.sample && decodes && it.restore.is_empty() && !it.rebuild && !it.export;
            // A request that finishes within the event drops out of the later
            // steps (its extra tokens are discarded), so length is no limit.
            let Some(l) = self.live.get(&it.id).filter(|_| plain) else { return 1 };
            if !l.spec.ignore_eos || !l.spec.stop_token_ids.is_empty() || !l.spec.stop_sequences.is_empty() {
                return 1;
            }
            repeat = repeat.min(context.saturating_sub(it.to + 1));
        }
        let pool = self.policy.pool_stats();
        let layout = self.policy.layout();
        let growth = repeat * (1 + drafts);
        let needed = items.len().saturating_mul(layout.sequence_bytes(growth + layout.block_tokens));
        if needed > pool.budget_bytes.saturating_sub(pool.used_bytes) {
            return 1;
        }
        repeat.max(1) as u32
    }
}
