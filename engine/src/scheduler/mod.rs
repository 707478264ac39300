// tidy: long file: the batching policy's one step loop (admission, chunking, preemption) reads best whole; blocks and tiers are split out.
//! The step scheduler: request queue, per-step batch formation under a token
//! budget and a batch-size limit, KV block allocation, preemption and prefix
//! cache bookkeeping. It never touches model state: it produces a
//! [`StepPlan`], the [`Engine`](crate::engine::Engine) executes it, and the
//! sampled tokens come back through [`Scheduler::complete`].
//!
//! A step, as in vLLM's scheduler: running requests first, oldest first, each
//! getting the tokens it still needs to feed (one for a decode, a prompt chunk
//! while prefilling) until the token budget runs out; a request whose blocks
//! cannot be allocated first evicts unreferenced cached blocks, then preempts
//! the newest running request (dropped, recomputed later). If nothing was
//! preempted, waiting requests are admitted by priority, then in arrival order, while budget,
//! batch slots and blocks allow; admission looks up the prefix cache.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::config::ModelConfig;
use crate::images::{block_key, check_spans};
use crate::kv_pool::{BlockId, BlockKind, BlockTable, KvLayout, KvPool, LayoutError, PoolStats};
use crate::prefix_cache::{CachedBlocks, EvictedBlock, PrefixCache, PrefixMode, PrefixStats};
use crate::request::{
    FinishReason, Finished, Request, RequestError, RequestId, RequestStatus, MAX_CACHE_TTL_MS, MAX_STOP_SEQUENCES,
    MAX_STOP_SEQUENCE_TOKENS, MAX_STOP_TOKEN_IDS,
};
use crate::speculative::SpeculativeConfig;

/// Most sequences one step may carry.
pub const MAX_BATCH_SIZE: usize = 1 << 16;
/// Most tokens one step may carry.
pub const MAX_BATCH_TOKENS: usize = 1 << 20;
/// Longest waiting queue.
pub const MAX_WAITING: usize = 1 << 20;
/// Largest prefix block, in tokens.
pub const MAX_BLOCK_TOKENS: usize = 4096;
/// Most draft tokens one request verifies per step.
pub const MAX_DRAFT_TOKENS: usize = 16;
/// Waiting requests looked at for one admission when ranks limit a step.
const ADMISSION_SCAN: usize = 256;

/// Limits and policy of one serving instance.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most sequences running at once (and per step).
    pub max_batch_size: usize,
    /// Most tokens per step: decodes, prompt chunks and replays together.
    pub max_batch_tokens: usize,
    /// Most tokens of one sequence per step (its prompt is cut into chunks of
    /// this size); `None`: up to `max_batch_tokens`. With attention data
    /// parallelism it keeps one long prompt from holding up a whole step.
    pub max_chunk_tokens: Option<usize>,
    /// Most tokens per attention data-parallel rank per step (see
    /// [`Scheduler::set_rank`]): the slowest rank paces the step, so ranks
    /// are filled evenly. `None`: no per-rank limit.
    pub max_rank_tokens: Option<usize>,
    /// Most requests waiting for admission; more are refused.
    pub max_waiting: usize,
    /// Bytes of KV state (all four block kinds, cached blocks included).
    pub kv_budget_bytes: usize,
    pub prefix_mode: PrefixMode,
    /// Positions per compressed block and prefix-cache block; `None` picks
    /// [`KvLayout::default_block_tokens`].
    pub block_tokens: Option<usize>,
    /// Positions per window block.
    pub window_block_tokens: usize,
    /// Speculative decoding: each draft a request may verify counts against
    /// `max_batch_tokens` and is reserved in the KV pool before the step.
    pub speculative: SpeculativeConfig,
    /// How long a cached block stays servable after its last use, unless a
    /// request asks otherwise (see [`Retention`](crate::request::Retention)).
    pub cache_ttl_ms: u64,
}

impl EngineConfig {
    /// How long blocks `request` computes or hits stay servable.
    pub fn ttl_ms(&self, request: &Request) -> u64 {
        request.retention.map_or(self.cache_ttl_ms, |r| r.ttl_ms)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch_size: 256,
            max_batch_tokens: 2048,
            max_chunk_tokens: None,
            max_rank_tokens: None,
            max_waiting: 4096,
            kv_budget_bytes: 1 << 30,
            prefix_mode: PrefixMode::Exact,
            block_tokens: None,
            window_block_tokens: 16,
            speculative: SpeculativeConfig::default(),
            cache_ttl_ms: crate::request::DEFAULT_CACHE_TTL_MS,
        }
    }
}

/// Why an [`EngineConfig`] was rejected.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineConfigError {
    #[error("max_batch_size must be 1 to {MAX_BATCH_SIZE}, got {0}")]
    BatchSize(usize),
    #[error("max_batch_tokens must be 1 to {MAX_BATCH_TOKENS}, got {0}")]
    BatchTokens(usize),
    #[error("max_waiting must be 1 to {MAX_WAITING}, got {0}")]
    Waiting(usize),
    #[error("num_draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {0}")]
    DraftTokens(usize),
    #[error("{0}")]
    Speculative(String),
    #[error("block_tokens must be at most {MAX_BLOCK_TOKENS}, got {0}")]
    BlockTokensTooLarge(usize),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error("a KV budget of {budget} bytes cannot hold even one token of one sequence ({needed} bytes)")]
    KvBudget { budget: usize, needed: usize },
}

/// One request's share of a step: feed tokens `[from, to)` of its sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledItem {
    pub id: RequestId,
    pub from: usize,
    pub to: usize,
    /// Positions below this rebuild window state only (a prefix hit's replay).
    pub replay_until: usize,
    /// `to` reaches the end of the sequence: sample the token at position `to`.
    pub sample: bool,
    /// Set on (re)admission: the state starts from these cached blocks'
    /// compressed state (none: a fresh state) at position `from`.
    pub start: Option<Vec<BlockId>>,
    /// Blocks `k` whose end `(k + 1) · block_tokens` lies in `(from, to]`
    /// and that should be offered to the prefix cache once computed.
    pub snapshots: Vec<usize>,
    /// Most draft tokens the item may verify after `to` (reserved in the KV
    /// pool and the token budget); only sampling items of decoding requests
    /// get any.
    pub drafts: usize,
}

/// What one step does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub items: Vec<ScheduledItem>,
    /// Requests preempted this step: drop their state.
    pub preempted: Vec<RequestId>,
    /// Cached blocks evicted (or expired) since the last plan: drop their
    /// stored values, or move them to a lower tier.
    pub evicted: Vec<EvictedBlock>,
    /// Requests that cannot run at all.
    pub failed: Vec<(RequestId, Finished)>,
}

/// A token sampled for a scheduled item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SampledToken {
    pub id: RequestId,
    pub token: u32,
    /// False when the logits row had no finite value.
    pub ok: bool,
}

/// Outcome of offering a computed block to the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// Newly cached under this block: store its values there.
    New(BlockId),
    /// The same content was cached already; the request now shares that block.
    Shared(BlockId),
    /// Not cached (caching off, out of order, or a key collision).
    Skipped,
}

/// Counters of the scheduler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub steps: u64,
    pub admissions: u64,
    pub preemptions: u64,
    /// Tokens fed to the model, replays and recomputation included.
    pub computed_tokens: u64,
    pub generated_tokens: u64,
    pub finished: u64,
}

/// What the scheduler needs to know about the model.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ModelLimits {
    vocab: usize,
    eos: u32,
    context: usize,
    replay: usize,
    /// Most drafts one chunk may carry: the window ring must hold them.
    draft_window: usize,
}

#[derive(Debug)]
struct Seq {
    request: Request,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    status: RequestStatus,
    /// Tokens the model state holds (its position).
    computed: usize,
    /// Positions below this are a prefix hit's replay.
    replay_until: usize,
    blocks: BlockTable,
    /// Key chain over the full blocks of `tokens` computed so far (images mixed in, see `images::block_key`).
    hashes: Vec<u64>,
    /// Leading compressed blocks that are in the prefix cache.
    registered: usize,
    cached_tokens: usize,
    preemptions: u32,
    /// Positions a state computed elsewhere holds (see `add_prefilled`); 0 once it is gone.
    imported: usize,
    /// Attention data-parallel rank that computes it.
    rank: u32,
}

impl Seq {
    fn extend_hashes(&mut self, blocks: usize, block_tokens: usize) {
        while self.hashes.len() < blocks {
            let k = self.hashes.len();
            let parent = self.hashes.last().copied().unwrap_or(0);
            let tokens = &self.tokens[k * block_tokens..(k + 1) * block_tokens];
            self.hashes.push(block_key(parent, tokens, k * block_tokens, &self.request.images));
        }
    }

    fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    fn finished(&self, reason: FinishReason) -> Finished {
        Finished {
            reason,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.tokens.len() - self.prompt_len,
            cached_tokens: self.cached_tokens,
            cached_tokens_by_tier: [self.cached_tokens, 0, 0],
            preemptions: self.preemptions,
        }
    }
}

/// The scheduler of one serving instance.
#[derive(Debug)]
pub struct Scheduler {
    config: EngineConfig,
    limits: ModelLimits,
    mode: PrefixMode,
    pool: KvPool,
    cache: PrefixCache,
    seqs: BTreeMap<RequestId, Seq>,
    waiting: VecDeque<RequestId>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<RequestId>,
    next_id: u64,
    stats: SchedulerStats,
    /// The injected time cache TTLs are measured against.
    now_ms: u64,
    /// Waiting requests not to admit yet (their prefix is being fetched).
    held: BTreeSet<RequestId>,
    /// Expired blocks freed on release, reported with the next plan.
    dropped: Vec<EvictedBlock>,
}

impl Scheduler {
    pub fn new(cfg: &ModelConfig, config: EngineConfig) -> Result<Self, EngineConfigError> {
        if !(1..=MAX_BATCH_SIZE).contains(&config.max_batch_size) {
            return Err(EngineConfigError::BatchSize(config.max_batch_size));
        }
        if !(1..=MAX_BATCH_TOKENS).contains(&config.max_batch_tokens) {
            return Err(EngineConfigError::BatchTokens(config.max_batch_tokens));
        }
        if config.speculative.max_drafts() > MAX_DRAFT_TOKENS {
            return Err(EngineConfigError::DraftTokens(config.speculative.max_drafts()));
        }
        if !(1..=MAX_WAITING).contains(&config.max_waiting) {
            return Err(EngineConfigError::Waiting(config.max_waiting));
        }
        let block_tokens = config.block_tokens.unwrap_or_else(|| KvLayout::default_block_tokens(cfg));
        if block_tokens > MAX_BLOCK_TOKENS {
            return Err(EngineConfigError::BlockTokensTooLarge(block_tokens));
        }
        let layout = KvLayout::new(cfg, block_tokens, config.window_block_tokens)?;
        let needed = layout.sequence_bytes(1);
        if config.kv_budget_bytes < needed {
            return Err(EngineConfigError::KvBudget { budget: config.kv_budget_bytes, needed });
        }
        // Without compressed layers there is nothing to cache.
        let mode = if layout.bytes(BlockKind::Compressed) == 0 { PrefixMode::Off } else { config.prefix_mode };
        let limits = ModelLimits {
            vocab: cfg.vocab_size,
            eos: cfg.eos_token_id,
            context: cfg.max_position_embeddings,
            replay: mode.replay_tokens(cfg),
            draft_window: cfg.sliding_window.saturating_sub(2),
        };
        Ok(Self {
            pool: KvPool::new(layout, config.kv_budget_bytes),
            config,
            limits,
            mode,
            cache: PrefixCache::new(),
            seqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            stats: SchedulerStats::default(),
            now_ms: 0,
            held: BTreeSet::new(),
            dropped: Vec::new(),
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Compute `id` on attention data-parallel rank `rank` (see `max_rank_tokens`).
    pub fn set_rank(&mut self, id: RequestId, rank: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.rank = rank;
        }
    }

    fn remove_waiting(&mut self, id: RequestId) {
        if let Some(at) = self.waiting.iter().position(|&w| w == id) {
            self.waiting.remove(at);
        }
    }

    fn chunk_tokens(&self) -> usize {
        self.config.max_chunk_tokens.unwrap_or(usize::MAX).max(1)
    }

    pub fn prefix_mode(&self) -> PrefixMode {
        self.mode
    }

    pub fn layout(&self) -> &KvLayout {
        self.pool.layout()
    }

    /// Tokens recomputed before a prefix hit's boundary.
    pub fn replay_tokens(&self) -> usize {
        self.limits.replay
    }

    pub fn stats(&self) -> &SchedulerStats {
        &self.stats
    }

    pub fn prefix_stats(&self) -> &PrefixStats {
        &self.cache.stats
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Blocks held by the prefix cache.
    pub fn cached_blocks(&self) -> usize {
        self.cache.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    fn seq(&self, id: RequestId) -> &Seq {
        self.seqs.get(&id).unwrap_or_else(|| panic!("request {id} is not known"))
    }

    /// Prompt and generated tokens of a live request.
    pub fn tokens(&self, id: RequestId) -> &[u32] {
        &self.seq(id).tokens
    }

    pub fn request(&self, id: RequestId) -> &Request {
        &self.seq(id).request
    }

    pub fn status(&self, id: RequestId) -> Option<&RequestStatus> {
        self.seqs.get(&id).map(|s| &s.status)
    }

    pub fn block_table(&self, id: RequestId) -> Option<&BlockTable> {
        self.seqs.get(&id).map(|s| &s.blocks)
    }

    /// Prompt tokens of a live request whose state came from the prefix cache on its first admission.
    pub fn cached_tokens(&self, id: RequestId) -> Option<usize> {
        self.seqs.get(&id).map(|s| s.cached_tokens)
    }

    /// Queue a request, or say why it can never run.
    pub fn add(&mut self, request: Request) -> Result<RequestId, RequestError> {
        self.validate(&request)?;
        if self.waiting.len() >= self.config.max_waiting {
            return Err(RequestError::QueueFull { limit: self.config.max_waiting });
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let tokens = request.prompt.clone();
        let prompt_len = tokens.len();
        self.seqs.insert(
            id,
            Seq {
                request,
                tokens,
                prompt_len,
                status: RequestStatus::Waiting,
                computed: 0,
                replay_until: 0,
                blocks: BlockTable::default(),
                hashes: Vec::new(),
                registered: 0,
                cached_tokens: 0,
                preemptions: 0,
                imported: 0,
                rank: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Queue a request that had already generated `generated` when the
    /// instance serving it was lost: prompt and those tokens are recomputed
    /// (bit-identical, the forward pass is chunking-invariant), stop
    /// conditions and `max_tokens` count them as output. The caller keeps
    /// `generated` shorter than `max_tokens` and inside the context.
    pub fn add_resumed(&mut self, request: Request, generated: &[u32]) -> Result<RequestId, RequestError> {
        let vocab = self.limits.vocab;
        if let Some(&token) = generated.iter().find(|&&t| t as usize >= vocab) {
            return Err(RequestError::TokenOutOfVocabulary { token, vocab });
        }
        let len = request.prompt.len() + generated.len();
        if !generated.is_empty() && len >= self.limits.context {
            return Err(RequestError::PromptTooLong { len, limit: self.limits.context });
        }
        let id = self.add(request)?;
        self.seqs.get_mut(&id).expect("just added").tokens.extend_from_slice(generated);
        Ok(id)
    }

    /// Queue a request whose state was computed on another instance
    /// (prefill/decode disaggregation): the state handed over with it holds
    /// every token of prompt + `generated` but the last. On admission it
    /// starts there: an item from that position with `start: Some([])` (the
    /// only admission past position 0 without cached blocks), so the caller
    /// installs the state instead of computing. If it is preempted the state
    /// is gone and it recomputes from position 0 like any request.
    pub fn add_prefilled(&mut self, request: Request, generated: &[u32]) -> Result<RequestId, RequestError> {
        let id = self.add_resumed(request, generated)?;
        let seq = self.seqs.get_mut(&id).expect("just added");
        seq.imported = seq.tokens.len() - 1;
        Ok(id)
    }

    /// Forget every cached block, as when the store holding their values is
    /// lost: unreferenced blocks are freed and returned (drop their values);
    /// blocks that running requests hold stay theirs, no longer shared.
    pub fn clear_prefix_cache(&mut self) -> Vec<BlockId> {
        let mut old = std::mem::take(&mut self.cache);
        let mut freed = Vec::new();
        while let Some(e) = old.evict_lru() {
            self.pool.free(e.blocks.compressed);
            if let Some(ix) = e.blocks.indexer {
                self.pool.free(ix);
            }
            freed.push(e.blocks.compressed);
        }
        self.cache.stats = old.stats;
        freed
    }

    /// Why [`Self::add`] would refuse `r` whatever the queue holds, if it
    /// would: a front end checks requests it sends elsewhere with it.
    pub fn validate(&self, r: &Request) -> Result<(), RequestError> {
        let limits = &self.limits;
        if r.prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if let Some(&token) = r.prompt.iter().find(|&&t| t as usize >= limits.vocab) {
            return Err(RequestError::TokenOutOfVocabulary { token, vocab: limits.vocab });
        }
        if r.prompt.len() >= limits.context {
            return Err(RequestError::PromptTooLong { len: r.prompt.len(), limit: limits.context });
        }
        if r.max_tokens == 0 {
            return Err(RequestError::ZeroMaxTokens);
        }
        check_spans(r.prompt.len(), &r.images)?;
        r.params.validate(limits.vocab)?;
        if r.stop_sequences.len() > MAX_STOP_SEQUENCES {
            return Err(RequestError::TooManyStopSequences(r.stop_sequences.len()));
        }
        if let Some(s) = r.stop_sequences.iter().find(|s| s.is_empty() || s.len() > MAX_STOP_SEQUENCE_TOKENS) {
            return Err(RequestError::BadStopSequence(s.len()));
        }
        if let Some(ttl) = r.retention.map(|r| r.ttl_ms).filter(|t| !(1..=MAX_CACHE_TTL_MS).contains(t)) {
            return Err(RequestError::BadRetention(ttl));
        }
        if r.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(RequestError::TooManyStopTokenIds(r.stop_token_ids.len()));
        }
        // The last generated token is never fed, so the state holds at most this many.
        let tokens = (r.prompt.len() + r.max_tokens - 1).min(limits.context);
        let needed = self.pool.layout().sequence_bytes(tokens);
        if needed > self.config.kv_budget_bytes {
            return Err(RequestError::ExceedsKvBudget { needed, tokens, budget: self.config.kv_budget_bytes });
        }
        Ok(())
    }

    /// Form the next step.
    pub fn schedule(&mut self) -> StepPlan {
        self.plan_step(true)
    }

    /// Form the next step of the running requests only, admitting none (a
    /// simulator that advances several decode steps as one event).
    pub fn schedule_running(&mut self) -> StepPlan {
        self.plan_step(false)
    }

    fn plan_step(&mut self, admit: bool) -> StepPlan {
        self.stats.steps += 1;
        let mut plan = StepPlan { evicted: std::mem::take(&mut self.dropped), ..StepPlan::default() };
        for e in self.cache.expire(self.now_ms) {
            self.free_cached(e.blocks);
            plan.evicted.push(e);
        }
        let mut budget = self.config.max_batch_tokens;
        let per_rank = self.config.max_rank_tokens.unwrap_or(usize::MAX).max(1);
        let mut rank_used: BTreeMap<u32, usize> = BTreeMap::new();
        let room = |used: &BTreeMap<u32, usize>, rank: u32| per_rank - used.get(&rank).copied().unwrap_or(0);
        let mut i = 0;
        while i < self.running.len() && budget > 0 && plan.items.len() < self.config.max_batch_size {
            let id = self.running[i];
            let seq = self.seq(id);
            let (from, rank) = (seq.computed, seq.rank);
            let cap = room(&rank_used, rank);
            if cap == 0 {
                // Its rank is full this step; it runs in the next.
                i += 1;
                continue;
            }
            let to = from + (seq.tokens.len() - from).min(budget).min(self.chunk_tokens()).min(cap);
            let drafts = self.draft_allowance(id, to).min(budget - (to - from)).min(cap - (to - from));
            if !self.reserve(id, to + drafts, &mut plan) {
                // It preempted itself: it was the newest, nothing follows it.
                break;
            }
            let mut item = self.item(id, from, to, None);
            item.drafts = drafts;
            plan.items.push(item);
            budget -= to - from + drafts;
            *rank_used.entry(rank).or_default() += to - from + drafts;
            i += 1;
        }
        // Admitting while preempting would only thrash.
        if admit && plan.preempted.is_empty() && plan.failed.is_empty() {
            while budget > 0 && self.running.len() < self.config.max_batch_size {
                // The most urgent waiting request whose rank has room: lowest
                // `priority`, then arrival (`min_by_key` keeps the first of equals).
                let Some(id) = self
                    .waiting
                    .iter()
                    .take(ADMISSION_SCAN)
                    .copied()
                    .filter(|id| !self.held.contains(id) && room(&rank_used, self.seq(*id).rank) > 0)
                    .min_by_key(|id| self.seq(*id).request.priority)
                else {
                    break;
                };
                let rank = self.seq(id).rank;
                match self.admit(id, budget.min(room(&rank_used, rank)), &mut plan) {
                    Some(n) => {
                        budget -= n;
                        *rank_used.entry(rank).or_default() += n;
                    }
                    None => break,
                }
            }
        }
        // The plan is executed before the next call: the states will hold `to` tokens.
        for item in &plan.items {
            self.seqs.get_mut(&item.id).expect("scheduled request is known").computed = item.to;
            self.stats.computed_tokens += (item.to - item.from) as u64;
        }
        plan
    }

    /// Draft tokens request `id` may verify after a step ending at `to`: only
    /// when that step samples a decoding request; never past `max_tokens` or
    /// the context; and with the prefix cache on, never up to the end of a
    /// block, whose state must be snapshotted where a step ends.
    fn draft_allowance(&self, id: RequestId, to: usize) -> usize {
        let seq = self.seq(id);
        let k = self.config.speculative.max_drafts();
        if k == 0 || to != seq.tokens.len() || seq.tokens.len() <= seq.prompt_len {
            return 0;
        }
        let generated = seq.tokens.len() - seq.prompt_len;
        let mut allowance = k
            .min(seq.request.max_tokens.saturating_sub(generated + 1))
            .min(self.limits.context.saturating_sub(to + 1))
            .min(self.limits.draft_window);
        if self.mode != PrefixMode::Off {
            // A block ending at `to` is snapshotted after this step's forward
            // pass, so no draft may follow it; nor may one reach the next end.
            let bt = self.layout().block_tokens;
            allowance = if to.is_multiple_of(bt) { 0 } else { allowance.min((to / bt + 1) * bt - to - 1) };
        }
        allowance
    }

    /// The state of `id` kept the `n` drafts its last step verified (all of
    /// them were accepted): it now holds every token but the newest.
    pub fn accept_drafts(&mut self, id: RequestId, n: usize) {
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        seq.computed += n;
        assert_eq!(seq.computed + 1, seq.tokens.len(), "accepted drafts are the tokens before the newest");
        self.stats.computed_tokens += n as u64;
    }

    fn item(&self, id: RequestId, from: usize, to: usize, start: Option<Vec<BlockId>>) -> ScheduledItem {
        let seq = self.seq(id);
        let bt = self.layout().block_tokens;
        let snapshots = if self.mode == PrefixMode::Off {
            Vec::new()
        } else {
            // Boundaries b·bt in (from, to] of blocks not cached yet (a hit's
            // replay lies inside cached blocks).
            (from / bt + 1..=to / bt).filter(|&b| b > seq.registered).map(|b| b - 1).collect()
        };
        ScheduledItem {
            id,
            from,
            to,
            replay_until: seq.replay_until,
            sample: to == seq.tokens.len(),
            start,
            snapshots,
            drafts: 0,
        }
    }

    /// Release everything of `id` and forget it.
    fn finish(&mut self, id: RequestId, reason: FinishReason) -> Finished {
        self.release_blocks(id);
        self.held.remove(&id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        let seq = self.seqs.remove(&id).expect("known request");
        self.stats.finished += 1;
        seq.finished(reason)
    }

    /// Cancel a queued or running request, freeing everything it holds.
    pub fn cancel(&mut self, id: RequestId) -> Result<Finished, RequestError> {
        if !self.seqs.contains_key(&id) {
            return Err(RequestError::Unknown(id));
        }
        Ok(self.finish(id, FinishReason::Cancelled))
    }

    /// Offer block `k` of `id`, just computed, to the prefix cache.
    pub fn register_block(&mut self, id: RequestId, k: usize) -> Registration {
        let bt = self.layout().block_tokens;
        let Some(seq) = self.seqs.get_mut(&id) else { return Registration::Skipped };
        if self.mode == PrefixMode::Off || k != seq.registered || seq.computed < (k + 1) * bt {
            return Registration::Skipped;
        }
        seq.extend_hashes(k + 1, bt);
        let hash = seq.hashes[k];
        let parent = if k == 0 { 0 } else { seq.hashes[k - 1] };
        let tokens = &seq.tokens[k * bt..(k + 1) * bt];
        let (ci, ii) = (BlockKind::Compressed.index(), BlockKind::Indexer.index());
        let own = CachedBlocks { compressed: seq.blocks.tables[ci][k], indexer: seq.blocks.tables[ii].get(k).copied() };
        let keep_until = self.now_ms.saturating_add(self.config.ttl_ms(&seq.request));
        if let Some(shared) = self.cache.get(self.now_ms, hash, parent, tokens) {
            // Same content cached already: share it and free the private copy.
            self.pool.retain(shared.compressed);
            self.cache.referenced(shared.compressed);
            self.cache.extend(shared.compressed, keep_until);
            seq.blocks.tables[ci][k] = shared.compressed;
            self.pool.release(own.compressed);
            self.pool.free(own.compressed);
            if let (Some(mine), Some(theirs)) = (own.indexer, shared.indexer) {
                self.pool.retain(theirs);
                seq.blocks.tables[ii][k] = theirs;
                self.pool.release(mine);
                self.pool.free(mine);
            }
            seq.registered += 1;
            Registration::Shared(shared.compressed)
        } else if self.cache.insert(hash, parent, tokens, own, keep_until) {
            seq.registered += 1;
            Registration::New(own.compressed)
        } else {
            Registration::Skipped
        }
    }

    /// Record the tokens sampled this step; returns the requests that finished.
    pub fn complete(&mut self, sampled: &[SampledToken]) -> Vec<(RequestId, Finished)> {
        let mut done = Vec::new();
        for s in sampled {
            let Some(seq) = self.seqs.get_mut(&s.id) else { continue };
            seq.tokens.push(s.token);
            seq.status = RequestStatus::Decoding;
            self.stats.generated_tokens += 1;
            let r = &seq.request;
            let reason = if !s.ok {
                Some(FinishReason::Error(format!(
                    "the model produced no finite logits at position {}",
                    seq.tokens.len() - 1
                )))
            } else if (s.token == self.limits.eos && !r.ignore_eos)
                || r.stop_token_ids.contains(&s.token)
                || r.stop_sequences.iter().any(|q| seq.output().ends_with(q))
            {
                Some(FinishReason::Stop)
            } else if seq.tokens.len() - seq.prompt_len >= r.max_tokens || seq.tokens.len() >= self.limits.context {
                Some(FinishReason::Length)
            } else {
                None
            };
            if let Some(reason) = reason {
                done.push((s.id, reason));
            }
        }
        done.into_iter().map(|(id, reason)| (id, self.finish(id, reason))).collect()
    }
}

mod blocks;
mod tiers;

#[cfg(test)]
mod tests;
