//! Routing a new request: the prompt's cached prefix asked of every
//! node's cache manager, then the engine's prefill balancer (and, with
//! disaggregation, the decode balancer) over the answers.

use super::*;

/// What a cached block is worth to routing, as a share of a pool hit, by
/// where it waits: host memory, a node's own disk, a disk every node shares
/// (brought up while the request waits, a little slower each).
const HOST_WORTH: f64 = 0.98;
const DISK_WORTH: f64 = 0.95;
const SHARED_DISK_WORTH: f64 = 0.9;

impl RouterMachine {
    pub(super) fn on_submit(&mut self, client: Addr, submit: Submit) {
        let id = submit.spec.id;
        self.send(client, Message::Ack { ids: vec![id] }, &[]);
        let deadline = self.now() + self.ctx.timeouts.request;
        if self.flights.contains_key(&id) {
            let mut f = self.flights.get_mut(&id).expect("present");
            // The client's tokens are authoritative: fewer means an output was lost on the way to it.
            if !f.cancelled {
                f.tokens = submit.generated;
            }
            f.client = client;
            f.deadline = deadline;
            drop(f);
            self.forward(id);
            return;
        }
        if self.routing.values().any(|r| r.submit.spec.id == id) {
            return;
        }
        let ctx = Arc::clone(&self.ctx);
        let topo = &ctx.topology;
        // Keys chained with the request's images, as its scheduler stores them.
        let images = crate::proto::images::key_images(&ctx.model, &submit.spec.images);
        let chain = crate::proto::images::prompt_chain(&submit.spec.prompt, self.ctx.block_tokens, &images);
        let query = self.next_query;
        self.next_query += 1;
        let mut routing = Routing {
            submit,
            client,
            waiting: BTreeSet::new(),
            matched: BTreeMap::new(),
            lower: BTreeMap::new(),
            disk_chain: 0,
            deadline: self.now() + self.ctx.timeouts.control,
        };
        if topo.instances > 1 && self.ctx.engine.prefix_mode != PrefixMode::Off && !chain.is_empty() {
            let tokens = routing.submit.spec.prompt[..chain.len() * self.ctx.block_tokens].to_vec();
            for node in (0..topo.nodes()).filter(|&n| !topo.instances_on(n).is_empty()) {
                let ask = CacheMsg::Lookup { query, hashes: chain.clone(), tokens: tokens.clone() };
                self.send(Addr::cache(node), Message::Cache(ask), &[]);
                routing.waiting.insert(node);
            }
            bump(&self.ctx.metrics.lookups);
        }
        self.routing.insert(query, routing);
        if self.routing[&query].waiting.is_empty() {
            self.decide(query);
        }
    }

    /// Modelled tiers below the device: a prefix continuing in an instance's
    /// host memory, its node's disk or the shared store is read while the
    /// request waits, not recomputed, so it counts as cached, a little less
    /// than on the device (the fastest tier wins a tie, and the shared store,
    /// which every instance sees, favours none).
    pub(super) fn count_lower_tiers(
        &self,
        prompt: &[u32],
        matched: &BTreeMap<u32, u32>,
        candidates: &mut [PrefillCandidate],
    ) {
        let Some(tiers) = self.ctx.modelled.as_ref().and_then(|m| m.tiers.as_ref()) else { return };
        let chain = prompt_chain(prompt, self.ctx.block_tokens);
        let now_ms = self.now().as_millis() as u64;
        for (i, c) in candidates.iter_mut().enumerate() {
            let start = matched.get(&(i as u32)).copied().unwrap_or(0) as usize;
            let mut worth = 0.0;
            for k in start..chain.len() {
                let parent = if k == 0 { 0 } else { chain[k - 1] };
                let Some(tier) = tiers.locate(i as u32, now_ms, chain[k], parent) else { break };
                worth += match tier {
                    SimTier::Device | SimTier::Host => HOST_WORTH,
                    SimTier::Disk => DISK_WORTH,
                    SimTier::Shared => SHARED_DISK_WORTH,
                };
            }
            c.cached_tokens += (worth * self.ctx.block_tokens as f64) as usize;
        }
    }

    /// The nodes' tiers below the pools, as their cache managers answered:
    /// a prefix continuing in a node's host memory or on its disk is brought
    /// up while the request waits, so it counts as cached, a little less than
    /// in the pool. A shared disk serves every instance what any node wrote
    /// there; a node-local one only its own.
    fn count_node_tiers(&self, r: &Routing, candidates: &mut [PrefillCandidate]) {
        let tiers = &self.ctx.cache_tiers;
        if !tiers.any() || self.ctx.modelled.is_some() {
            return;
        }
        let shared = tiers.disk.is_some() && tiers.disk_shared;
        for (i, c) in candidates.iter_mut().enumerate() {
            let i = i as u32;
            let pool = r.matched.get(&i).copied().unwrap_or(0);
            let (host, disk) = r.lower.get(&i).copied().unwrap_or((0, 0));
            let mut worth = HOST_WORTH * host as f64 + DISK_WORTH * disk as f64;
            let covered = pool + host + disk;
            if shared && r.disk_chain > covered {
                worth += SHARED_DISK_WORTH * (r.disk_chain - covered) as f64;
            }
            c.cached_tokens += (worth * self.ctx.block_tokens as f64) as usize;
        }
    }

    /// The engine's prefill balancer over what the router knows: prompts
    /// that have produced no token yet are the queued prefill work.
    pub(super) fn decide(&mut self, query: u64) {
        let Some(r) = self.routing.remove(&query) else { return };
        let topo = &self.ctx.topology;
        let policy = PrefillPolicy::default();
        let mut candidates: Vec<PrefillCandidate> = (0..topo.instances)
            .map(|i| PrefillCandidate {
                health: self.health(i, self.ctx.kind(i).prefills()),
                gpus: topo.devices_of(i).len() as u32,
                queued_cost: 0.0,
                requests: 0,
                cached_tokens: r.matched.get(&i).copied().unwrap_or(0) as usize * self.ctx.block_tokens,
            })
            .collect();
        if candidates.iter().all(|c| c.health != Health::Up) {
            // Nowhere to run it: say so now rather than after every retry.
            let (id, spec) = (r.submit.spec.id, &r.submit.spec);
            let why = format!(
                "no serving instance is up: every scheduler's node is down or draining (as {} sees it)",
                self.addr
            );
            self.ctx.events.record(format_args!("router ends request {id}: {why}"));
            let item = end_item(id, r.submit.generated.len(), spec.prompt.len(), FinishKind::Error(why));
            self.send_to_client(r.client, vec![item], &[]);
            return;
        }
        self.count_lower_tiers(&r.submit.spec.prompt, &r.matched, &mut candidates);
        self.count_node_tiers(&r, &mut candidates);
        for (i, c) in candidates.iter_mut().enumerate() {
            c.requests += self.flights.routed_to(i as u32) as u32;
            c.queued_cost += self.flights.queued_cost(i as u32);
        }
        let instance = match self.ctx.prefill_routing {
            PrefillRouting::CacheAffinity => choose_prefill(&policy, &candidates, r.submit.spec.prompt.len()),
            PrefillRouting::RoundRobin => {
                self.round_robin.choose(&candidates.iter().map(|c| c.health).collect::<Vec<_>>())
            }
        }
        .unwrap_or(0) as u32;
        let cached_tokens = candidates.get(instance as usize).map_or(0, |c| c.cached_tokens);
        let decode = (!self.ctx.kind(instance).decodes()).then(|| self.choose_decode(None)).flatten();
        let encoder = self.choose_encoder(&r.submit.spec);
        let id = r.submit.spec.id;
        self.ctx.events.record(format_args!(
            "router sends request {id} to scheduler{instance} ({} cached blocks)",
            r.matched.get(&instance).copied().unwrap_or(0)
        ));
        let f = Flight {
            spec: r.submit.spec,
            instance,
            cached_tokens,
            decode,
            encoder,
            prefilled_on: None,
            tokens: r.submit.generated,
            client: r.client,
            cancelled: false,
            attempts: 0,
            deadline: self.now() + self.ctx.timeouts.request,
        };
        self.flights.insert(id, f);
        self.forward(id);
    }

    /// Instance `i` as this router sees it: `Down` once its scheduler's
    /// node is declared dead, `Draining` while one of its nodes drains (or
    /// it does not do the work asked, `serves` false), else `Up`.
    fn health(&self, i: u32, serves: bool) -> Health {
        let topo = &self.ctx.topology;
        // A router cut off with a minority trusts no instance: clients go to the majority's routers.
        if self.ctx.durable.is_lost(self.node, topo.devices_of(i).start) || self.ctx.durable.in_minority(self.node) {
            Health::Down
        } else if !serves || topo.devices_of(i).any(|d| self.draining.contains(&topo.node_of_device(d))) {
            Health::Draining
        } else {
            Health::Up
        }
    }

    /// The engine's decode balancer over the router's view: requests and
    /// their KV per instance; `exclude` (a failed transfer's target) only if
    /// another instance decodes.
    pub(super) fn choose_decode(&self, exclude: Option<u32>) -> Option<u32> {
        let topo = &self.ctx.topology;
        let first = self.ctx.engine_for(0);
        let policy =
            DecodePolicy { max_requests_per_gpu: (first.max_batch_size as u32).div_ceil(topo.size_of(0).max(1)) };
        let mut candidates: Vec<DecodeCandidate> = (0..topo.instances)
            .map(|i| DecodeCandidate {
                health: self.health(i, self.ctx.kind(i).decodes()),
                gpus: topo.size_of(i).max(1),
                kv_used: 0,
                kv_capacity: self.ctx.engine_for(i).kv_budget_bytes as u64,
                requests: 0,
            })
            .collect();
        for (i, c) in candidates.iter_mut().enumerate() {
            let load = self.flights.decode_load(i as u32);
            c.requests += load.requests as u32;
            c.kv_used += load.kv_bytes;
        }
        let pick = |c: &[DecodeCandidate]| choose_decode(&policy, c, 0).map(|i| i as u32);
        let fallback = pick(&candidates);
        if let Some(c) = exclude.and_then(|x| candidates.get_mut(x as usize)) {
            c.health = Health::Down;
        }
        pick(&candidates).or(fallback)
    }
}
