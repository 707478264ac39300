// tidy: long file: the whole wire schema: every rkyv type and the frame codec, so that one file holds the versioned format.
//! The wire format: every message is a versioned rkyv envelope inside a
//! length-prefixed frame, optionally followed by a raw `f32` body.
//!
//! ```text
//! frame    := len: u32 LE (bytes after this field, ≤ MAX_FRAME_BYTES) payload
//! payload  := preamble header pad body
//! preamble := magic u32 · version u16 · kind u8 · flags u8 · header_len u32 · body_len u32   (16 bytes)
//! header   := rkyv archive of `Envelope`, header_len bytes
//! pad      := zeros up to the next 16-byte boundary of the payload
//! body     := body_len bytes of little-endian f32 (hidden states, expert outputs, logits)
//! ```
//!
//! The preamble is checked before the archive is touched, so a peer speaking
//! another version is told so instead of failing validation. The header is
//! copied into a 16-byte-aligned buffer of exactly its length and validated
//! with bytecheck (`rkyv::access`) before anything reads it. The body stays
//! outside the archive so that large tensors are never re-serialised: a
//! stream reader reads it straight into its destination. Every malformed
//! input is a typed [`WireError`], never a panic.

use std::io::Read;

use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

mod images;
pub use images::*;

/// Version of the envelope layout; bumped on any change to the archived types.
pub const WIRE_VERSION: u16 = 12;
pub use crate::limits::MAX_FRAME_BYTES;
/// "dINF" little-endian.
pub const MAGIC: u32 = u32::from_le_bytes(*b"dINF");
const PREAMBLE: usize = 16;
const ALIGN: usize = 16;

/// What kind of actor an address names.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[rkyv(derive(Debug))]
pub enum Role {
    Scheduler,
    Worker,
    Shard,
    Router,
    CacheManager,
    /// Whoever submits requests (the API front end, the CLI).
    Client,
    /// A node's transport itself: heartbeats and membership news.
    Node,
    /// A node process's operations endpoint: status reports.
    Agent,
    /// An image encoder instance (its index: the encoder's number).
    Encoder,
}

/// An actor's address on the fabric: its role and index (device, instance).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[rkyv(derive(Debug))]
pub struct Addr {
    pub role: Role,
    pub index: u32,
}

impl Addr {
    pub const fn new(role: Role, index: u32) -> Self {
        Self { role, index }
    }
    pub const fn worker(device: u32) -> Self {
        Self::new(Role::Worker, device)
    }
    pub const fn shard(device: u32) -> Self {
        Self::new(Role::Shard, device)
    }
    pub const fn scheduler(instance: u32) -> Self {
        Self::new(Role::Scheduler, instance)
    }
    pub const fn router(index: u32) -> Self {
        Self::new(Role::Router, index)
    }
    pub const fn cache(node: u32) -> Self {
        Self::new(Role::CacheManager, node)
    }
    pub const fn client(index: u32) -> Self {
        Self::new(Role::Client, index)
    }
    pub const fn node(index: u32) -> Self {
        Self::new(Role::Node, index)
    }
    pub const fn agent(node: u32) -> Self {
        Self::new(Role::Agent, node)
    }
    pub const fn encoder(index: u32) -> Self {
        Self::new(Role::Encoder, index)
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let role = match self.role {
            Role::Scheduler => "scheduler",
            Role::Worker => "worker",
            Role::Shard => "shard",
            Role::Router => "router",
            Role::CacheManager => "cache",
            Role::Client => "client",
            Role::Node => "node",
            Role::Agent => "agent",
            Role::Encoder => "encoder",
        };
        write!(f, "{role}{}", self.index)
    }
}

/// How a request picks its tokens (mirror of the engine's `SamplingParams`,
/// which does not derive rkyv: only this crate knows the wire format).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub seed: u64,
    /// Most likely alternatives to report per token.
    pub logprobs: u32,
    /// Drops tokens less likely than this fraction of the most likely one; 0 keeps all.
    pub min_p: f32,
    /// Added to the listed tokens' logits (OpenAI's `logit_bias`), sorted by token, each once.
    pub logit_bias: Vec<TokenBias>,
    /// Penalties over the token history (the engine's `SamplingParams`);
    /// the history travels with each step (`StepItem::history`).
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub repetition_penalty: f32,
}

impl Sampling {
    /// Greedy decoding, nothing reported, logits as the model gives them.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            logprobs: 0,
            min_p: 0.0,
            logit_bias: Vec::new(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

/// A token of a sequence's history and how often it was generated.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct TokenCount {
    pub token: u32,
    pub count: u32,
}

/// One entry of a request's logit bias.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct TokenBias {
    pub token: u32,
    pub bias: f32,
}

/// The expert placement a step runs under: replicas (devices) per logical expert.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PlacementWire {
    pub epoch: u64,
    pub devices: u32,
    pub replicas: Vec<Vec<u32>>,
}

/// One sequence's part of a step (one item of the engine scheduler's plan).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct StepItem {
    pub seq: u64,
    /// Tokens the worker's state must already hold; `0` with `rebuild`; with
    /// `restore`, where the restored state starts.
    pub position: u64,
    /// New tokens to feed (the whole history when rebuilding).
    pub tokens: Vec<u32>,
    /// Start from a fresh state (recompute after the worker lost it).
    pub rebuild: bool,
    pub sampling: Sampling,
    /// The item reaches the end of its sequence: sample the next token.
    pub sample: bool,
    /// Return the sampled row's logits.
    pub logits: bool,
    /// Positions below this only rebuild window state (a prefix hit's replay).
    pub replay_until: u64,
    /// Start from these cached blocks' compressed state instead of a held
    /// state: lengths of each block, values in the request body.
    pub restore: Vec<Vec<u32>>,
    /// Blocks whose compressed state to return once computed.
    pub snapshots: Vec<u32>,
    /// Return the whole sequence state after the step (prefill/decode
    /// disaggregation: it moves to a decode instance).
    pub export: bool,
    /// Start from this imported sequence state (lengths as
    /// `deepinfer_engine::transfer::state_to_parts` writes them; values in
    /// the body after the item's restored blocks) positioned at `position`.
    pub import: Vec<u32>,
    /// Most draft tokens the item may verify after its tokens (speculative
    /// decoding; reserved by the scheduler).
    pub drafts: u32,
    /// Tokens the sampled one may be (structured output): one bit per
    /// vocabulary entry, 32 to a word; empty allows every token.
    pub allowed: Vec<u32>,
    /// With penalties: every distinct token of the prompt and the output,
    /// ascending, with its count in the output; empty without.
    pub history: Vec<TokenCount>,
    /// The images whose spans the item's positions reach, in prompt order;
    /// their values follow the item's restored blocks and imported state.
    pub images: Vec<StepImage>,
}

/// Scheduler → worker: run one forward step over these sequences and sample.
/// Body: the values of every item's `restore` blocks, then its `import`,
/// then its images', in item order.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct StepRequest {
    pub step: u64,
    pub attempt: u32,
    /// Instance number of the sending scheduler: a newer one means every
    /// state the worker holds belongs to a scheduler that is gone.
    pub scheduler: u64,
    pub placement: PlacementWire,
    pub items: Vec<StepItem>,
    /// Sequences that finished: drop their state.
    pub release: Vec<u64>,
    /// Tokens of the whole instance's step (every worker's part): modelled
    /// devices price the expert all-to-all from it.
    pub batch_tokens: u64,
    /// Modelled devices only: run this many decode steps as one (every item
    /// decodes; each sampling item answers with this many tokens).
    pub repeat: u32,
}

/// A likely token and its log-probability.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// One sampled token.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct SeqOutput {
    pub seq: u64,
    pub token: u32,
    pub logprob: f32,
    /// Sequence length at which the token was sampled (the sampling position).
    pub position: u64,
    pub top: Vec<TopLogprob>,
}

/// The compressed state of block `block` of `seq`, computed this step.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct BlockSnapshot {
    pub seq: u64,
    pub block: u32,
    /// Lengths of the values (`BlockValues::to_parts`), which follow in the body.
    pub lens: Vec<u32>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum StepOutcome {
    /// One output per sampling item, in item order; the body holds the
    /// logits rows of the items that asked (same order), then every
    /// snapshot's values, then every export's values. `loads`: rows routed
    /// to each (layer, expert) in the step, ascending, for EPLB. With
    /// speculative decoding, `verifications` has one entry per sampling item
    /// and decode step, in step order, and each gives the item
    /// `1 + accepted` outputs in that step.
    Done {
        outputs: Vec<SeqOutput>,
        snapshots: Vec<BlockSnapshot>,
        loads: Vec<ExpertLoad>,
        exports: Vec<StateExport>,
        verifications: Vec<Verification>,
    },
    /// The worker holds no (or a different) state for these sequences: resend them with `rebuild`.
    NeedsHistory(Vec<u64>),
    /// The step could not run; the worker dropped the states it touched.
    Failed(String),
    /// As `Failed`, because `shard` does not hold an expert the step's table
    /// places on it: the shard's table is not the scheduler's (its process
    /// restarted unheard), so the scheduler sends it the table again.
    TableMismatch { shard: u32, why: String },
}

/// Drafts one sampling item verified in one decode step, and how many the target accepted.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Verification {
    pub seq: u64,
    pub drafts: u32,
    pub accepted: u32,
}

/// Rows the router of one layer sent to one expert during a step.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ExpertLoad {
    pub layer: u32,
    pub expert: u32,
    pub rows: u32,
}

/// A sequence's whole state after a step (lengths; values in the body).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct StateExport {
    pub seq: u64,
    pub lens: Vec<u32>,
}

/// Prefill/decode disaggregation: a prefilled request moves to a decode instance.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum HandoffMsg {
    /// Prefill scheduler → decode scheduler: continue this request from its
    /// state (lengths here, values in the body) after `generated`.
    /// `router`: the node whose router owns the request.
    Transfer { spec: Box<RequestSpec>, generated: Vec<u32>, lens: Vec<u32>, attempt: u32, router: u32 },
    /// Decode scheduler → prefill scheduler and router: the request runs here now.
    Adopted { id: u64, instance: u32 },
    /// Prefill scheduler → router: the transfer to `instance` failed; decode it elsewhere.
    Reroute { id: u64, instance: u32 },
}

/// Worker → scheduler.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct StepResult {
    pub step: u64,
    pub attempt: u32,
    pub device: u32,
    pub outcome: StepOutcome,
}

/// Rows of one expert inside a dispatch or result body.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ExpertRows {
    pub expert: u32,
    pub rows: u32,
}

/// Worker → shard: the gathered MoE inputs of some experts for one layer;
/// body `[Σ rows, D]` in the order of `experts`.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct DispatchHeader {
    /// Identifies the worker's forward pass (incarnation and counter), so late answers to an old pass are ignored.
    pub pass: u64,
    pub step: u64,
    pub layer: u32,
    pub part: u32,
    pub worker: u32,
    pub epoch: u64,
    pub experts: Vec<ExpertRows>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum ResultStatus {
    Ok,
    /// The shard does not hold this expert under its current placement.
    NotHeld(u32),
    /// The dispatch was malformed (sizes, indices).
    Invalid(String),
}

/// Shard → worker: outputs `[Σ rows, D]` for a dispatch, same order.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct ExpertResultHeader {
    pub pass: u64,
    pub step: u64,
    pub layer: u32,
    pub part: u32,
    pub shard: u32,
    pub status: ResultStatus,
    pub experts: Vec<ExpertRows>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct Heartbeat {
    /// Cluster-unique number of the sending actor's incarnation.
    pub incarnation: u64,
    /// This incarnation replaces one that failed: work it held is gone.
    pub restarted: bool,
    pub time_ns: u64,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum Control {
    /// Hold exactly these experts from placement `epoch` on.
    LoadExperts {
        epoch: u64,
        experts: Vec<u32>,
    },
    Loaded {
        epoch: u64,
        device: u32,
    },
    /// Shard → scheduler: the table offered (`LoadExperts` or
    /// `PrepareExperts` of `epoch`) is not newer than the one it holds, of
    /// epoch `held`, so it was not taken. Said instead of an acknowledgement:
    /// a scheduler whose epoch counter started again (its process restarted)
    /// numbers its table past `held` and sends it again.
    Behind {
        epoch: u64,
        held: u64,
        device: u32,
    },
    /// Load the weights of these experts for placement `epoch` while the
    /// current table serves: the switch (`LoadExperts` of the same epoch)
    /// then costs no loading.
    PrepareExperts {
        epoch: u64,
        experts: Vec<u32>,
    },
    /// The experts of `epoch` are in memory: `bytes_read` newly read from the
    /// checkpoint in `load_us` microseconds.
    Prepared {
        epoch: u64,
        device: u32,
        bytes_read: u64,
        load_us: u64,
    },
    Ping {
        nonce: u64,
    },
    Pong {
        nonce: u64,
    },
    Shutdown,
    /// Membership: `node` stopped answering for longer than the failure
    /// timeout; its devices' workers and shards are gone.
    NodeDown {
        node: u32,
    },
    /// Membership: `node`, declared dead before, answers again (a restarted
    /// process): its devices take work again.
    NodeUp {
        node: u32,
    },
    /// Client → every router: route nothing new to instances with devices
    /// on `node` (until it restarts); answered with `DrainAck`.
    Drain {
        node: u32,
        nonce: u64,
    },
    DrainAck {
        node: u32,
        nonce: u64,
    },
    /// Client → a node's agent: how are you? Answered with a `StatusReport`.
    StatusQuery {
        nonce: u64,
    },
    StatusReport {
        nonce: u64,
        status: Box<NodeStatus>,
    },
}

/// What a node reports about itself (`deepinfer status`).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct NodeStatus {
    pub node: u32,
    /// When the node process started, in Unix milliseconds: a restarted node has a later one.
    pub started_unix_ms: u64,
    pub uptime_ms: u64,
    /// Nodes this node's membership holds dead.
    pub nodes_down: Vec<u32>,
    pub devices: Vec<DeviceStatus>,
    /// The instances whose scheduler runs here.
    pub instances: Vec<InstanceStatus>,
    /// Forward passes its workers ran and expert dispatches its shards answered.
    pub passes: u64,
    pub dispatches_answered: u64,
    /// Resident memory of the node process (0 where the system does not say).
    pub rss_bytes: u64,
    /// Expert weight bytes its shards read from the checkpoint, and freed, since it started.
    pub expert_bytes_read: u64,
    pub expert_bytes_freed: u64,
    /// Its prompt cache since it started.
    pub cache: NodeCacheStatus,
    /// Drafts its workers verified and the target accepted (speculative decoding).
    pub drafts_verified: u64,
    pub drafts_accepted: u64,
    /// Its image encoders (encoder instances on this node), since it started.
    pub encoders: Vec<EncoderStatus>,
}

/// An image encoder instance's counters.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct EncoderStatus {
    pub encoder: u32,
    /// Images whose rows it computed with the tower.
    pub images_encoded: u64,
    /// Images its cache answered without the tower.
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Images waiting for the tower now.
    pub queue_images: u64,
    /// Time the tower ran, in microseconds.
    pub encode_us: u64,
}

/// A node's prompt cache counters, in blocks.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct NodeCacheStatus {
    /// Restores served from the pool store (requests, not blocks).
    pub pool_hits: u64,
    /// Blocks moved to host memory by a pool's eviction.
    pub host_blocks_in: u64,
    /// Blocks brought back up for a waiting request, from host memory and from disk.
    pub host_hit_blocks: u64,
    pub disk_hit_blocks: u64,
    /// Blocks handed to the disk tier's writer.
    pub blocks_persisted: u64,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct DeviceStatus {
    pub device: u32,
    pub instance: u32,
    /// Routed experts its shard holds.
    pub experts: u32,
    /// Bytes of their weights.
    pub expert_bytes: u64,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct InstanceStatus {
    pub instance: u32,
    pub running: u64,
    pub waiting: u64,
    pub kv_used_bytes: u64,
    pub kv_budget_bytes: u64,
    pub placement_epoch: u64,
}

/// A generation request as it travels client → router → scheduler.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct RequestSpec {
    /// Chosen by the client, unique in the cluster; also the sequence id on workers.
    pub id: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub sampling: Sampling,
    pub stop_token_ids: Vec<u32>,
    pub stop_sequences: Vec<Vec<u32>>,
    pub ignore_eos: bool,
    /// Return every generated token's logits row.
    pub logits: bool,
    /// What the output must match (structured output, forced tool calls),
    /// as the front end describes it to the cluster's constraint source.
    pub constraint: Option<String>,
    /// How long its prompt's blocks stay cached, and whether they may go to
    /// disk (`prompt_cache_retention`, `cache_control.ttl`); `None`: the defaults.
    pub retention: Option<RetentionWire>,
    /// Admission order at its scheduler: lower first, ties by arrival
    /// (vLLM's `priority`; 0 by default).
    pub priority: i64,
    /// Its images, in prompt order (their spans laid out in `prompt`).
    pub images: Vec<ImageWire>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct RetentionWire {
    pub ttl_ms: u64,
    pub persist: bool,
}

/// "Make sure this request is running, and send me its output from token
/// `generated.len()` on." Idempotent: a receiver that holds the request
/// with exactly these tokens only acknowledges; one that holds it with a
/// different count restarts it from `generated` (recompute is bit-identical,
/// so tokens a lost message carried are produced again); one that does not
/// hold it starts it, resumed after `generated`.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Submit {
    pub spec: RequestSpec,
    pub generated: Vec<u32>,
    /// Once it has sampled, hand it (with its state) to this decode instance.
    pub decode: Option<u32>,
    /// Have its images encoded by this encoder instance (none: on the prefill workers).
    pub encoder: Option<u32>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum FinishKind {
    Stop,
    Length,
    Cancelled,
    Error(String),
}

/// Mirror of the engine's `Finished`.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct FinishWire {
    pub reason: FinishKind,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    /// Of those, brought up from host memory and from disk for this request.
    pub cached_host_tokens: u32,
    pub cached_disk_tokens: u32,
    pub preemptions: u32,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub enum OutputEnd {
    Finished(FinishWire),
    /// The scheduler refused the request (it can never run): why.
    Refused(String),
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct TokenOut {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

/// New output of one request: tokens `from..from + tokens.len()` of its
/// completion (a finish always travels with the last token).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct OutputItem {
    pub id: u64,
    pub from: u32,
    pub tokens: Vec<TokenOut>,
    /// One logits row per token follows in the body.
    pub logits: bool,
    pub end: Option<OutputEnd>,
    /// Prompt tokens the prefix cache served; set on items with tokens.
    pub cached: u32,
}

/// Scheduler → router → client, once per step. Body: the logits rows of the
/// items that carry them, in item order.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Outputs {
    pub items: Vec<OutputItem>,
}

impl Outputs {
    /// Each item with its logits rows from `body` (`vocab` values for each
    /// token of an item that asked for them, in item order); `None` when the
    /// body does not add up.
    pub fn with_logits(self, body: &[f32], vocab: usize) -> Option<impl Iterator<Item = (OutputItem, &[f32])>> {
        let rows: usize = self.items.iter().filter(|i| i.logits).map(|i| i.tokens.len()).sum();
        if rows.checked_mul(vocab)? != body.len() {
            return None;
        }
        let mut at = 0;
        Some(self.items.into_iter().map(move |item| {
            let n = if item.logits { item.tokens.len() * vocab } else { 0 };
            let logits = &body[at..at + n];
            at += n;
            (item, logits)
        }))
    }
}

/// One cached block's identity and content, stored with its values.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct StoredBlock {
    /// Key of the block: the engine's hash chain over every token up to its end.
    pub hash: u64,
    pub parent: u64,
    pub tokens: Vec<u32>,
    pub lens: Vec<u32>,
    /// How long the block stays servable after its last use (the storing request's retention).
    pub ttl_ms: u64,
}

/// The leading blocks of one sequence, to fetch: keys and their tokens
/// (`hashes.len()` blocks), which the cache compares before answering.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct FetchItem {
    pub seq: u64,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
}

/// The values of a fetched chain (lengths per block; values in the body),
/// or nothing when any block is missing.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct FetchedItem {
    pub seq: u64,
    pub found: bool,
    pub lens: Vec<Vec<u32>>,
}

#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct InstanceMatch {
    pub instance: u32,
    /// Leading blocks the instance's device pool caches.
    pub blocks: u32,
    /// Blocks after those in the node's host memory, then on its disk.
    pub host_blocks: u32,
    pub disk_blocks: u32,
}

/// Blocks of a waiting request's prefix that its scheduler's pool lacks,
/// to bring up from host memory or disk: a chain from some block on (its
/// first block's parent, the keys, their tokens).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PromoteItem {
    pub seq: u64,
    pub parent: u64,
    pub hashes: Vec<u64>,
    pub tokens: Vec<u32>,
}

/// One block brought up: its lengths (values in the body), how long it
/// stays servable from now, and the tier it came from.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PromotedBlock {
    pub lens: Vec<u32>,
    pub ttl_ms: u64,
    pub tier: CacheTier,
}

/// Where a cached block was found.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[rkyv(derive(Debug))]
pub enum CacheTier {
    Host,
    Disk,
}

/// The leading run of a [`PromoteItem`]'s blocks that a lower tier held.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct PromotedItem {
    pub seq: u64,
    pub blocks: Vec<PromotedBlock>,
}

/// The cache manager's protocol: schedulers store, evict and fetch block
/// values; the router asks how much of a prompt each instance has cached.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum CacheMsg {
    /// Body: each block's values, in order.
    Store {
        instance: u32,
        step: u64,
        blocks: Vec<StoredBlock>,
    },
    Evict {
        instance: u32,
        step: u64,
        hashes: Vec<u64>,
    },
    /// A (re)started scheduler: forget the instance's blocks.
    Clear {
        instance: u32,
    },
    Fetch {
        query: u64,
        instance: u32,
        step: u64,
        items: Vec<FetchItem>,
    },
    /// Body: the values of the found items, in order.
    Fetched {
        query: u64,
        items: Vec<FetchedItem>,
    },
    Lookup {
        query: u64,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
    },
    Matched {
        query: u64,
        node: u32,
        matches: Vec<InstanceMatch>,
        /// Leading blocks of the prompt the node knows are on its disk tier
        /// (a shared one serves every node).
        disk_chain: u32,
    },
    /// Write these blocks of the instance (a chain, in order) to the disk
    /// tier, up to the first one the cache lacks: a persist point.
    Persist {
        instance: u32,
        hashes: Vec<u64>,
    },
    /// Bring the blocks of waiting requests up from host memory or disk.
    Promote {
        query: u64,
        instance: u32,
        items: Vec<PromoteItem>,
    },
    /// Body: the values of every promoted block, in order.
    Promoted {
        query: u64,
        items: Vec<PromotedItem>,
    },
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub enum Message {
    StepRequest(StepRequest),
    StepResult(StepResult),
    Dispatch(DispatchHeader),
    ExpertResult(ExpertResultHeader),
    Heartbeat(Heartbeat),
    Control(Control),
    Submit(Submit),
    Cancel {
        id: u64,
    },
    /// These requests are known and running (an answer to `Submit`).
    Ack {
        ids: Vec<u64>,
    },
    Outputs(Outputs),
    Cache(CacheMsg),
    Handoff(HandoffMsg),
    Encoder(EncoderMsg),
}

/// The message kinds, as the preamble's `kind` byte names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum MsgKind {
    StepRequest = 1,
    StepResult = 2,
    Dispatch = 3,
    ExpertResult = 4,
    Heartbeat = 5,
    Control = 6,
    Submit = 7,
    Cancel = 8,
    Ack = 9,
    Outputs = 10,
    Cache = 11,
    Handoff = 12,
    Encoder = 13,
}

impl MsgKind {
    pub const ALL: [MsgKind; 13] = [
        MsgKind::StepRequest,
        MsgKind::StepResult,
        MsgKind::Dispatch,
        MsgKind::ExpertResult,
        MsgKind::Heartbeat,
        MsgKind::Control,
        MsgKind::Submit,
        MsgKind::Cancel,
        MsgKind::Ack,
        MsgKind::Outputs,
        MsgKind::Cache,
        MsgKind::Handoff,
        MsgKind::Encoder,
    ];

    pub fn from_u8(v: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|k| *k as u8 == v)
    }

    /// Kinds that may carry a raw body.
    pub fn has_body(self) -> bool {
        matches!(
            self,
            MsgKind::Dispatch
                | MsgKind::ExpertResult
                | MsgKind::StepResult
                | MsgKind::StepRequest
                | MsgKind::Outputs
                | MsgKind::Cache
                | MsgKind::Handoff
                | MsgKind::Encoder
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            MsgKind::StepRequest => "step-request",
            MsgKind::StepResult => "step-result",
            MsgKind::Dispatch => "dispatch",
            MsgKind::ExpertResult => "expert-result",
            MsgKind::Heartbeat => "heartbeat",
            MsgKind::Control => "control",
            MsgKind::Submit => "submit",
            MsgKind::Cancel => "cancel",
            MsgKind::Ack => "ack",
            MsgKind::Outputs => "outputs",
            MsgKind::Cache => "cache",
            MsgKind::Handoff => "handoff",
            MsgKind::Encoder => "encoder",
        }
    }
}

impl Message {
    pub fn kind(&self) -> MsgKind {
        match self {
            Message::StepRequest(_) => MsgKind::StepRequest,
            Message::StepResult(_) => MsgKind::StepResult,
            Message::Dispatch(_) => MsgKind::Dispatch,
            Message::ExpertResult(_) => MsgKind::ExpertResult,
            Message::Heartbeat(_) => MsgKind::Heartbeat,
            Message::Control(_) => MsgKind::Control,
            Message::Submit(_) => MsgKind::Submit,
            Message::Cancel { .. } => MsgKind::Cancel,
            Message::Ack { .. } => MsgKind::Ack,
            Message::Outputs(_) => MsgKind::Outputs,
            Message::Cache(_) => MsgKind::Cache,
            Message::Handoff(_) => MsgKind::Handoff,
            Message::Encoder(_) => MsgKind::Encoder,
        }
    }
}

impl ArchivedMessage {
    pub fn kind(&self) -> MsgKind {
        match self {
            ArchivedMessage::StepRequest(_) => MsgKind::StepRequest,
            ArchivedMessage::StepResult(_) => MsgKind::StepResult,
            ArchivedMessage::Dispatch(_) => MsgKind::Dispatch,
            ArchivedMessage::ExpertResult(_) => MsgKind::ExpertResult,
            ArchivedMessage::Heartbeat(_) => MsgKind::Heartbeat,
            ArchivedMessage::Control(_) => MsgKind::Control,
            ArchivedMessage::Submit(_) => MsgKind::Submit,
            ArchivedMessage::Cancel { .. } => MsgKind::Cancel,
            ArchivedMessage::Ack { .. } => MsgKind::Ack,
            ArchivedMessage::Outputs(_) => MsgKind::Outputs,
            ArchivedMessage::Cache(_) => MsgKind::Cache,
            ArchivedMessage::Handoff(_) => MsgKind::Handoff,
            ArchivedMessage::Encoder(_) => MsgKind::Encoder,
        }
    }
}

/// Every message on the wire.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct Envelope {
    pub from: Addr,
    pub to: Addr,
    pub msg: Message,
}

/// A decoded, validated frame.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded {
    pub envelope: Envelope,
    pub body: Vec<f32>,
}

impl Decoded {
    pub fn kind(&self) -> MsgKind {
        self.envelope.msg.kind()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("frame truncated: {needed} bytes needed, {got} present")]
    Truncated { needed: u64, got: u64 },
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: u64, max: u32 },
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    #[error("unsupported wire version {got} (this node speaks {WIRE_VERSION})")]
    UnsupportedVersion { got: u16 },
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("unknown frame flags {0:#04x}")]
    UnknownFlags(u8),
    #[error("frame layout does not add up: prefix says {len} bytes, header {header} + body {body} need {needed}")]
    Layout { len: u64, header: u32, body: u32, needed: u64 },
    #[error("non-zero padding between header and body")]
    Padding,
    #[error("a {0} frame carries no body")]
    UnexpectedBody(&'static str),
    #[error("body of {0} bytes is not a whole number of f32")]
    BodyNotFloats(u32),
    #[error("{0} trailing bytes after the frame")]
    Trailing(u64),
    #[error("header failed validation: {0}")]
    Invalid(String),
    #[error("preamble says {preamble}, the archive holds {archived}")]
    KindMismatch { preamble: &'static str, archived: &'static str },
    #[error("cannot encode: {0}")]
    Encode(String),
    #[error("i/o: {0}")]
    Io(String),
}

fn pad_to_align(n: u64) -> u64 {
    (ALIGN as u64 - n % ALIGN as u64) % ALIGN as u64
}

/// Encode a message (and its body, for kinds that carry one) as a frame.
pub fn encode(envelope: &Envelope, body: &[f32]) -> Result<Vec<u8>, WireError> {
    let kind = envelope.msg.kind();
    if !body.is_empty() && !kind.has_body() {
        return Err(WireError::UnexpectedBody(kind.name()));
    }
    let header = rkyv::to_bytes::<rancor::Error>(envelope).map_err(|e| WireError::Encode(e.to_string()))?;
    let header_len = header.len() as u64;
    let body_len = body.len() as u64 * 4;
    let pad = pad_to_align(PREAMBLE as u64 + header_len);
    let len = PREAMBLE as u64 + header_len + pad + body_len;
    if len > MAX_FRAME_BYTES as u64 {
        return Err(WireError::TooLarge { len, max: MAX_FRAME_BYTES });
    }
    let mut out = Vec::with_capacity(4 + len as usize);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.push(kind as u8);
    out.push(0);
    out.extend_from_slice(&(header_len as u32).to_le_bytes());
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.resize(out.len() + pad as usize, 0);
    for v in body {
        out.extend_from_slice(&v.to_le_bytes());
    }
    Ok(out)
}

/// The checked fixed part of a payload.
#[derive(Clone, Copy, Debug)]
struct Preamble {
    kind: MsgKind,
    header_len: u32,
    body_len: u32,
    pad: u64,
}

fn parse_preamble(p: &[u8; PREAMBLE], len: u64) -> Result<Preamble, WireError> {
    let word = |i: usize| u32::from_le_bytes([p[i], p[i + 1], p[i + 2], p[i + 3]]);
    let magic = word(0);
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([p[4], p[5]]);
    if version != WIRE_VERSION {
        return Err(WireError::UnsupportedVersion { got: version });
    }
    let kind = MsgKind::from_u8(p[6]).ok_or(WireError::UnknownKind(p[6]))?;
    if p[7] != 0 {
        return Err(WireError::UnknownFlags(p[7]));
    }
    let (header_len, body_len) = (word(8), word(12));
    let pad = pad_to_align(PREAMBLE as u64 + header_len as u64);
    let needed = PREAMBLE as u64 + header_len as u64 + pad + body_len as u64;
    if needed != len {
        return Err(WireError::Layout { len, header: header_len, body: body_len, needed });
    }
    if body_len > 0 && !kind.has_body() {
        return Err(WireError::UnexpectedBody(kind.name()));
    }
    if body_len % 4 != 0 {
        return Err(WireError::BodyNotFloats(body_len));
    }
    Ok(Preamble { kind, header_len, body_len, pad })
}

fn check_len(len: u32, max: u32) -> Result<u64, WireError> {
    if len > max {
        return Err(WireError::TooLarge { len: len as u64, max });
    }
    if (len as usize) < PREAMBLE {
        return Err(WireError::Truncated { needed: PREAMBLE as u64, got: len as u64 });
    }
    Ok(len as u64)
}

/// Validate an aligned header and turn it into an owned envelope.
fn open_header(header: &AlignedVec, kind: MsgKind) -> Result<Envelope, WireError> {
    let archived =
        rkyv::access::<ArchivedEnvelope, rancor::Error>(header).map_err(|e| WireError::Invalid(e.to_string()))?;
    let archived_kind = archived.msg.kind();
    if archived_kind != kind {
        return Err(WireError::KindMismatch { preamble: kind.name(), archived: archived_kind.name() });
    }
    rkyv::deserialize::<Envelope, rancor::Error>(archived).map_err(|e| WireError::Invalid(e.to_string()))
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Decode exactly one frame (length prefix included) from `bytes`.
pub fn decode(bytes: &[u8]) -> Result<Decoded, WireError> {
    decode_with_limit(bytes, MAX_FRAME_BYTES)
}

/// [`decode`] with a smaller frame limit.
pub fn decode_with_limit(bytes: &[u8], max: u32) -> Result<Decoded, WireError> {
    let got = bytes.len() as u64;
    let Some(prefix) = bytes.first_chunk::<4>() else {
        return Err(WireError::Truncated { needed: 4, got });
    };
    let len = check_len(u32::from_le_bytes(*prefix), max)?;
    let total = 4 + len;
    if got < total {
        return Err(WireError::Truncated { needed: total, got });
    }
    if got > total {
        return Err(WireError::Trailing(got - total));
    }
    let payload = &bytes[4..];
    let pre = parse_preamble(payload[..PREAMBLE].try_into().expect("16 bytes checked"), len)?;
    let h0 = PREAMBLE;
    let h1 = h0 + pre.header_len as usize;
    let b0 = h1 + pre.pad as usize;
    if payload[h1..b0].iter().any(|&b| b != 0) {
        return Err(WireError::Padding);
    }
    let mut header = AlignedVec::<16>::with_capacity(pre.header_len as usize);
    header.extend_from_slice(&payload[h0..h1]);
    let envelope = open_header(&header, pre.kind)?;
    Ok(Decoded { envelope, body: floats(&payload[b0..]) })
}

/// Only the kind of a frame, from its preamble (no archive access): for
/// transports that route or inject faults by kind.
pub fn peek_kind(bytes: &[u8]) -> Result<MsgKind, WireError> {
    let needed = 4 + PREAMBLE as u64;
    if (bytes.len() as u64) < needed {
        return Err(WireError::Truncated { needed, got: bytes.len() as u64 });
    }
    MsgKind::from_u8(bytes[10]).ok_or(WireError::UnknownKind(bytes[10]))
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], at: u64, total: u64) -> Result<(), WireError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => WireError::Truncated { needed: total, got: at },
        _ => WireError::Io(e.to_string()),
    })
}

/// Read one frame from a byte stream. The declared length is checked against
/// `max` before anything is allocated; the header lands in an aligned buffer
/// of exactly its length and the body goes straight into its `Vec<f32>`.
pub fn read_frame(r: &mut impl Read, max: u32) -> Result<Decoded, WireError> {
    let mut prefix = [0u8; 4];
    read_exact(r, &mut prefix, 0, 4)?;
    let len = check_len(u32::from_le_bytes(prefix), max)?;
    let total = 4 + len;
    let mut pre = [0u8; PREAMBLE];
    read_exact(r, &mut pre, 4, total)?;
    let p = parse_preamble(&pre, len)?;
    let mut at = 4 + PREAMBLE as u64;
    let mut header = AlignedVec::<16>::with_capacity(p.header_len as usize);
    header.resize(p.header_len as usize, 0);
    read_exact(r, &mut header, at, total)?;
    at += p.header_len as u64;
    let mut pad = [0u8; ALIGN];
    read_exact(r, &mut pad[..p.pad as usize], at, total)?;
    if pad.iter().any(|&b| b != 0) {
        return Err(WireError::Padding);
    }
    at += p.pad;
    let envelope = open_header(&header, p.kind)?;
    let mut body = vec![0f32; p.body_len as usize / 4];
    let mut chunk = [0u8; 4096];
    let mut filled = 0;
    while filled < body.len() {
        let n = (body.len() - filled).min(chunk.len() / 4);
        read_exact(r, &mut chunk[..n * 4], at, total)?;
        for (dst, src) in body[filled..filled + n].iter_mut().zip(chunk.chunks_exact(4)) {
            *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
        }
        filled += n;
        at += n as u64 * 4;
    }
    Ok(Decoded { envelope, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatch() -> Envelope {
        Envelope {
            from: Addr::worker(1),
            to: Addr::shard(2),
            msg: Message::Dispatch(DispatchHeader {
                pass: 7,
                step: 3,
                layer: 4,
                part: 0,
                worker: 1,
                epoch: 0,
                experts: vec![ExpertRows { expert: 5, rows: 2 }],
            }),
        }
    }

    #[test]
    fn round_trip_with_body() {
        let body: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
        let frame = encode(&dispatch(), &body).unwrap();
        let got = decode(&frame).unwrap();
        assert_eq!(got.envelope, dispatch());
        assert_eq!(got.body, body);
        assert_eq!(read_frame(&mut &frame[..], MAX_FRAME_BYTES).unwrap(), got);
        assert_eq!(peek_kind(&frame).unwrap(), MsgKind::Dispatch);
    }

    #[test]
    fn body_on_a_bodiless_kind_is_refused() {
        let env = Envelope { from: Addr::worker(0), to: Addr::worker(1), msg: Message::Control(Control::Shutdown) };
        assert_eq!(encode(&env, &[1.0]), Err(WireError::UnexpectedBody("control")));
    }

    #[test]
    fn version_and_kind_are_checked_before_the_archive() {
        let mut frame = encode(&dispatch(), &[]).unwrap();
        let other = WIRE_VERSION as u8 + 1;
        frame[8] = other;
        assert_eq!(decode(&frame), Err(WireError::UnsupportedVersion { got: u16::from(other) }));
        let mut frame = encode(&dispatch(), &[]).unwrap();
        frame[10] = MsgKind::Control as u8;
        assert!(matches!(decode(&frame), Err(WireError::KindMismatch { .. })));
    }
}
