//! The step phases: a step is planned, its cached prefixes fetched, its
//! parts sent to the workers, re-sent when unanswered, and its results
//! gathered.

use super::*;
use crate::proto::images::step_images;

impl SchedulerMachine {
    /// Start a step: faults, a placement change, then the plan.
    pub(super) fn begin_step(&mut self) -> Result<(), Crash> {
        if self.fenced || !matches!(self.phase, Phase::Idle) || !self.policy.has_work() || self.handoffs_full() {
            return Ok(());
        }
        let step = self.ctx.durable.next_step(self.instance);
        for t in self.ctx.faults.external_kills(step) {
            let path = match t {
                Target::Node(n) => format!("node{n}"),
                Target::CacheManager(n) => format!("node{n}/cache{n}"),
                Target::Router => "node0/router0".to_string(),
                _ => continue,
            };
            self.effects.push(Effect::Kill(path));
        }
        // Configured changes switch at their step; a rejoin or EPLB table is
        // prepared first (its experts read while the current table serves).
        let mut change = self.ctx.placement_changes.iter().find(|(s, _)| *s == step).map(|(_, p)| p.clone());
        if change.is_none() {
            change = self.prepared_change();
        }
        if change.is_none() && self.preparing.is_none() {
            if let Some(p) = self.rejoin_change() {
                self.prepare(p, "rejoin");
            } else if let Some(p) = self.eplb_change() {
                self.prepare(p, "eplb");
            }
        }
        if let Some(p) = change {
            let epoch = self.ctx.durable.placement(self.home, self.instance).epoch() + 1;
            self.ctx.durable.set_placement(self.home, self.instance, p.with_epoch(epoch));
            self.ctx.events.record(format_args!("{} placement epoch {epoch}", self.addr));
            self.load_placement(Some(step));
        }
        if self.ctx.faults.kill_point(Target::Scheduler(self.instance), step, 0) {
            return Err(format!("{}: injected crash at step {step}", self.addr).into());
        }
        if matches!(self.phase, Phase::Idle) {
            self.plan(step);
        }
        Ok(())
    }

    pub(super) fn plan(&mut self, step: u64) {
        self.tiers_before_plan(step);
        let mut plan = self.policy.schedule();
        self.publish_gauges();
        let mut ended = Vec::new();
        self.settle(step, &mut plan, &mut ended);
        let mut items = Vec::with_capacity(plan.items.len());
        for it in plan.items {
            let Some(&id) = self.by_rid.get(&it.id) else { continue };
            self.tiers_admitted(id, &it);
            if it.start.is_some() {
                // (Re)admitted: a fresh or restored state.
                self.live.get_mut(&id).expect("live").plain = false;
            }
            // Admitted past 0 without cached blocks: from a state another instance computed.
            let imported = it.from > 0 && it.start.as_ref().is_some_and(Vec::is_empty);
            let import = if imported { self.live.get_mut(&id).and_then(|l| l.import.take()) } else { None };
            let vocab = self.ctx.config.vocab_size;
            let allowed = match self.live.get_mut(&id).and_then(|l| l.constraint.as_deref_mut()) {
                Some(c) if it.sample => allowed_tokens(c, vocab),
                _ => Vec::new(),
            };
            let l = &self.live[&id];
            let history = if it.sample && penalised(&l.spec.sampling) {
                let (prompt, output) = self.policy.tokens(it.id).split_at(l.spec.prompt.len());
                token_history(prompt, output).into_iter().map(|(token, count)| TokenCount { token, count }).collect()
            } else {
                Vec::new()
            };
            let hit = it.start.as_deref().unwrap_or_default();
            let mut restore: Option<Vec<u64>> = hit.iter().map(|b| self.cached.get(b).copied()).collect();
            if imported && import.is_none() {
                restore = None;
            }
            let s = &l.spec.sampling;
            let export = it.sample && l.decode.is_some();
            let drafts = self.draft_allowance(it.drafts, !allowed.is_empty(), export);
            items.push(Item {
                import,
                export,
                logits: it.sample && self.wants_logits(&l.spec),
                sampling: s.clone(),
                allowed,
                history,
                id,
                rid: it.id,
                worker: l.worker,
                from: it.from,
                to: it.to,
                replay_until: it.replay_until,
                sample: it.sample,
                rebuild: restore.is_none(),
                restore: restore.unwrap_or_default(),
                values: None,
                snapshots: it.snapshots,
                drafts,
            });
            let pushed = items.last().expect("pushed");
            if !pushed.rebuild {
                self.count_tier_hits(id, &pushed.restore);
            }
        }
        let mut run = StepRun {
            step,
            items,
            by_worker: BTreeMap::new(),
            placement: PlacementWire { epoch: 0, devices: 0, replicas: Vec::new() },
            batch_tokens: 0,
            repeat: 1,
            pending: BTreeMap::new(),
            answers: BTreeMap::new(),
            received: 0,
            ended,
        };
        if run.items.is_empty() {
            // Nothing can run now: wait for new input rather than spin.
            self.send_outputs(run.ended, &[]);
            self.phase = Phase::Idle;
            return;
        }
        for it in run.items.iter_mut().filter(|it| !it.restore.is_empty()) {
            if it.restore.iter().all(|h| self.recent.contains_key(h)) {
                let mut lens = Vec::with_capacity(it.restore.len());
                let mut data = Vec::new();
                for h in &it.restore {
                    let (l, v) = &self.recent[h];
                    lens.push(l.clone());
                    data.extend_from_slice(v);
                }
                it.values = Some((lens, data));
            }
        }
        let fetch: Vec<usize> = run
            .items
            .iter()
            .enumerate()
            .filter(|(_, it)| !it.restore.is_empty() && it.values.is_none())
            .map(|(i, _)| i)
            .collect();
        if fetch.is_empty() {
            self.send_all(run);
            return;
        }
        let bt = self.ctx.block_tokens;
        let fetch_items = fetch
            .iter()
            .map(|&i| {
                let it = &run.items[i];
                let tokens = self.policy.tokens(it.rid)[..it.restore.len() * bt].to_vec();
                FetchItem { seq: it.id, hashes: it.restore.clone(), tokens }
            })
            .collect();
        let query = self.queries;
        self.queries += 1;
        let msg = CacheMsg::Fetch { query, instance: self.instance, step, items: fetch_items };
        self.send(self.cache, Message::Cache(msg), &[]);
        let deadline = self.now() + self.ctx.timeouts.control;
        self.phase = Phase::Fetching { run, query, deadline };
        self.arm(deadline);
    }

    /// The cache answered (or did not): items without their blocks' values recompute from position 0.
    pub(super) fn fetched(&mut self, mut run: StepRun, found: Vec<FetchedItem>, body: Vec<f32>) {
        let mut values: BTreeMap<u64, (Vec<Vec<u32>>, Vec<f32>)> = BTreeMap::new();
        let mut at = 0;
        for f in found.into_iter().filter(|f| f.found) {
            let n: usize = f.lens.iter().map(|l| parts_len(l)).sum();
            let Some(v) = body.get(at..at + n) else { break };
            at += n;
            values.insert(f.seq, (f.lens, v.to_vec()));
        }
        let mut missed = false;
        for it in run.items.iter_mut().filter(|it| !it.restore.is_empty() && it.values.is_none()) {
            match values.remove(&it.id) {
                Some(v) if v.0.len() == it.restore.len() => it.values = Some(v),
                _ => {
                    it.rebuild = true;
                    missed = true;
                }
            }
        }
        if missed {
            // The store lost blocks the engine counts on: forget them all, so
            // they are computed and stored again instead of missing again.
            self.policy.clear_prefix_cache();
            self.cached.clear();
            self.recent.clear();
            self.tiers_cleared();
            self.ctx.events.record(format_args!("{} prefix blocks missing: cache index cleared", self.addr));
        }
        self.send_all(run);
    }

    pub(super) fn send_all(&mut self, mut run: StepRun) {
        for it in run.items.iter().filter(|it| it.rebuild) {
            if let Some(l) = self.live.get_mut(&it.id) {
                l.plain = true;
            }
        }
        run.by_worker.clear();
        for (i, it) in run.items.iter().enumerate() {
            run.by_worker.entry(it.worker).or_default().push(i);
        }
        run.placement = self.placement_wire();
        run.batch_tokens = run.items.iter().map(|it| (it.to - it.from) as u64).sum();
        run.repeat = self.decode_repeat(&run.items);
        let workers: Vec<u32> = run.by_worker.keys().copied().collect();
        let deadline = self.now() + self.ctx.timeouts.step;
        for w in workers {
            let release = self.release.remove(&w).unwrap_or_default();
            run.pending.insert(w, Pending { attempt: 0, deadline, release });
            if !self.send_step(&run, w) {
                run.pending.remove(&w);
            }
        }
        if run.pending.is_empty() {
            self.complete(run);
            return;
        }
        self.phase = Phase::Running(run);
        self.arm(deadline);
    }

    /// The item's request is still the one it was planned for (not ended, cancelled or restarted since).
    pub(super) fn alive(&self, it: &Item) -> bool {
        self.by_rid.get(&it.rid) == Some(&it.id)
    }

    /// Send (again) `worker`'s part of the step; false if none of it is still wanted.
    /// The table sent with step requests. Modelled devices price the
    /// all-to-all from the expected expert loads and need no table.
    pub(super) fn placement_wire(&self) -> PlacementWire {
        let p = self.ctx.durable.placement(self.home, self.instance);
        if self.ctx.modelled.is_some() {
            PlacementWire { epoch: p.epoch(), devices: p.devices(), replicas: Vec::new() }
        } else {
            p.to_wire()
        }
    }

    pub(super) fn send_step(&mut self, run: &StepRun, worker: u32) -> bool {
        let p = &run.pending[&worker];
        let mut body = Vec::new();
        let items: Vec<StepItem> = run
            .by_worker
            .get(&worker)
            .into_iter()
            .flatten()
            .map(|&i| &run.items[i])
            .filter(|it| self.alive(it))
            .map(|it| {
                let tokens = self.policy.tokens(it.rid);
                let plain = self.live.get(&it.id).is_some_and(|l| l.plain);
                let (position, restore, replay_until) = match (&it.values, it.rebuild) {
                    (_, true) => (0, Vec::new(), 0),
                    (Some((lens, data)), false) => {
                        body.extend_from_slice(data);
                        (it.from, lens.clone(), it.replay_until)
                    }
                    (None, false) => (it.from, Vec::new(), if plain { 0 } else { it.replay_until }),
                };
                let import = match (&it.import, it.rebuild) {
                    (Some((lens, data)), false) => {
                        body.extend_from_slice(data);
                        lens.clone()
                    }
                    _ => Vec::new(),
                };
                // The images the item's positions reach travel with it: a
                // worker keeps no image between steps.
                let images = step_images(&self.policy.request(it.rid).images, position..it.to, &mut body);
                StepItem {
                    seq: it.id,
                    position: position as u64,
                    tokens: tokens[position..it.to].to_vec(),
                    rebuild: it.rebuild,
                    sampling: it.sampling.clone(),
                    sample: it.sample,
                    logits: it.logits,
                    replay_until: replay_until as u64,
                    restore,
                    snapshots: it.snapshots.iter().map(|&k| k as u32).collect(),
                    export: it.export,
                    import,
                    drafts: self.drafts_to_send(it, position, replay_until),
                    allowed: it.allowed.clone(),
                    history: it.history.clone(),
                    images,
                }
            })
            .collect();
        if items.is_empty() {
            return false;
        }
        let req = StepRequest {
            step: run.step,
            attempt: p.attempt,
            scheduler: self.number,
            placement: run.placement.clone(),
            items,
            release: p.release.clone(),
            batch_tokens: run.batch_tokens,
            repeat: run.repeat,
        };
        self.send(Addr::worker(worker), Message::StepRequest(req), &body);
        true
    }

    pub(super) fn rearm_running(&mut self) {
        if let Phase::Running(run) = &self.phase {
            if let Some(d) = run.pending.values().map(|p| p.deadline).min() {
                self.arm(d);
            }
        }
    }

    /// Ask `worker` again (rebuilding what it lost), or give up on its requests.
    pub(super) fn retry(&mut self, run: &mut StepRun, worker: u32, why: &str) {
        let Some(p) = run.pending.get_mut(&worker) else { return };
        p.attempt += 1;
        if p.attempt >= self.ctx.timeouts.step_attempts {
            let reason = format!("step {} on worker{worker} failed after {} attempts: {why}", run.step, p.attempt);
            self.ctx.events.record(format_args!("{reason}"));
            run.pending.remove(&worker);
            let ids: Vec<u64> = run.items.iter().filter(|it| it.worker == worker).map(|it| it.id).collect();
            for id in ids {
                if let Some(item) = self.fail(id, &reason) {
                    run.ended.push(item);
                }
            }
            return;
        }
        bump(&self.ctx.metrics.step_resends);
        self.ctx.events.record(format_args!("resend step {} to worker{worker}: {why}", run.step));
        for it in run.items.iter().filter(|it| it.worker == worker && it.rebuild) {
            if let Some(l) = self.live.get_mut(&it.id) {
                l.plain = true;
            }
        }
        p.deadline = self.now() + self.ctx.timeouts.step;
        if !self.send_step(run, worker) {
            run.pending.remove(&worker);
        }
    }

    pub(super) fn on_result(&mut self, from: Addr, r: StepResult, body: Vec<f32>) -> Result<(), Crash> {
        let Phase::Running(mut run) = std::mem::replace(&mut self.phase, Phase::Idle) else { return Ok(()) };
        let worker = from.index;
        if r.step != run.step || r.device != worker || !run.pending.contains_key(&worker) {
            self.phase = Phase::Running(run);
            return Ok(());
        }
        run.received += 1;
        if self.ctx.faults.kill_point(Target::Scheduler(self.instance), run.step, run.received) {
            return Err(format!("{}: injected crash at step {} result {}", self.addr, run.step, run.received).into());
        }
        match r.outcome {
            StepOutcome::Done { outputs, snapshots, loads, exports, verifications } => {
                let shape = Shape {
                    outputs: &outputs,
                    snapshots: &snapshots,
                    exports: &exports,
                    verifications: &verifications,
                };
                if self.check_answer(&run, worker, shape, body.len()) {
                    run.pending.remove(&worker);
                    run.answers.insert(worker, Answer { outputs, snapshots, loads, exports, verifications, body });
                } else {
                    self.ctx
                        .events
                        .record(format_args!("ignoring a malformed result of step {} from worker{worker}", run.step));
                }
            }
            StepOutcome::NeedsHistory(ids) => {
                for it in run.items.iter_mut().filter(|it| it.worker == worker && ids.contains(&it.id)) {
                    it.rebuild = true;
                }
                self.retry(&mut run, worker, "worker lost sequence state");
            }
            StepOutcome::Failed(why) => {
                for it in run.items.iter_mut().filter(|it| it.worker == worker) {
                    it.rebuild = true;
                }
                self.retry(&mut run, worker, &why);
            }
            StepOutcome::TableMismatch { shard, why } => {
                // The table goes out now; the step again only after the
                // shard had a control timeout to take it (or say it holds a
                // later one), so that retries are not spent racing it.
                self.on_shard_started(shard);
                for it in run.items.iter_mut().filter(|it| it.worker == worker) {
                    it.rebuild = true;
                }
                self.ctx
                    .events
                    .record(format_args!("{}: step {} waits for shard{shard}'s table: {why}", self.addr, run.step));
                let deadline = self.now() + self.ctx.timeouts.control;
                if let Some(p) = run.pending.get_mut(&worker) {
                    p.deadline = deadline;
                }
            }
        }
        if run.pending.is_empty() {
            self.complete(run);
        } else {
            self.phase = Phase::Running(run);
            self.rearm_running();
        }
        Ok(())
    }
}

/// Whether sampling needs the token history (any penalty set).
fn penalised(s: &Sampling) -> bool {
    s.frequency_penalty != 0.0 || s.presence_penalty != 0.0 || s.repetition_penalty != 1.0
}

impl SchedulerMachine {
    /// The instance's KV use and requests, for observers (status, reports).
    pub(super) fn publish_gauges(&self) {
        let pool = self.policy.pool_stats();
        let g = &self.ctx.durable.gauges()[self.instance as usize];
        g.kv_used_bytes.store(pool.used_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        g.kv_budget_bytes.store(pool.budget_bytes as u64, std::sync::atomic::Ordering::Relaxed);
        g.running.store(self.policy.num_running() as u64, std::sync::atomic::Ordering::Relaxed);
        g.waiting.store(self.policy.num_waiting() as u64, std::sync::atomic::Ordering::Relaxed);
    }
}
