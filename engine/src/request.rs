//! Requests: what a caller submits, the states a request moves through, and
//! what it gets back.

use std::fmt;

use crate::images::RequestImage;
use crate::sampling::{SamplingError, SamplingParams};
use crate::v41::vision::ImageError;

/// Most stop sequences one request may carry.
pub const MAX_STOP_SEQUENCES: usize = 16;
/// Most tokens in one stop sequence.
pub const MAX_STOP_SEQUENCE_TOKENS: usize = 64;
/// Most extra stop token ids one request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// How long cached blocks stay servable when no request says otherwise: 72 hours.
pub const DEFAULT_CACHE_TTL_MS: u64 = 72 * 3600 * 1000;
/// Longest retention a request may ask for: 30 days.
pub const MAX_CACHE_TTL_MS: u64 = 30 * 24 * 3600 * 1000;

/// How long a request's prompt blocks stay cached, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// Servable this long after their last use (at most [`MAX_CACHE_TTL_MS`]).
    pub ttl_ms: u64,
    /// May be written to the disk tier (false: device and host memory only).
    pub persist: bool,
}

/// Engine-assigned id of a request, in order of submission.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// A generation request, in token ids.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// Most tokens to generate (at least 1). Generation also stops when the
    /// sequence fills the model's context.
    pub max_tokens: usize,
    /// Tokens that end generation, besides EOS.
    pub stop_token_ids: Vec<u32>,
    /// Token sequences that end generation when the output ends with one.
    pub stop_sequences: Vec<Vec<u32>>,
    /// Keep generating after EOS.
    pub ignore_eos: bool,
    /// Return the full logits row of every generated token (tests, debugging).
    pub return_logits: bool,
    /// Cache retention of its blocks; `None`: the engine's default.
    pub retention: Option<Retention>,
    /// Admission order: a lower value is admitted first, ties in arrival
    /// order (vLLM's `priority`; 0 by default).
    pub priority: i64,
    /// The prompt's images in prompt order, each filling its span of image
    /// tokens (see [`crate::images`]); empty for text.
    pub images: Vec<RequestImage>,
}

impl Request {
    /// A greedy request with no stop conditions but EOS and `max_tokens`.
    pub fn new(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            params: SamplingParams::default(),
            max_tokens,
            stop_token_ids: Vec::new(),
            stop_sequences: Vec::new(),
            ignore_eos: false,
            return_logits: false,
            retention: None,
            priority: 0,
            images: Vec::new(),
        }
    }

    /// A greedy request whose prompt holds these images' spans
    /// ([`crate::images::PromptBuilder`] builds both).
    pub fn with_images(prompt: Vec<u32>, images: Vec<RequestImage>, max_tokens: usize) -> Self {
        Self { images, ..Self::new(prompt, max_tokens) }
    }

    pub fn with_params(mut self, params: SamplingParams) -> Self {
        self.params = params;
        self
    }
}

/// Why a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop sequence.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The caller cancelled it.
    Cancelled,
    /// It cannot continue; the message says why.
    Error(String),
}

impl FinishReason {
    /// The name used in APIs and result files.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Error(_) => "error",
        }
    }
}

/// Where a live request is in its life. A request that finishes (stop,
/// length, cancelled, error) is reported once with a [`Finished`] record and
/// forgotten, with every block it held released.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued, never run.
    Waiting,
    /// Its prompt (or, after preemption, prompt and output) is being fed in chunks.
    Prefilling,
    /// Generating one token per step.
    Decoding,
    /// Evicted to make room; queued to be recomputed from its tokens.
    Preempted,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenOutput {
    pub token: u32,
    /// Log-probability of `token` under the model (before temperature and filters).
    pub logprob: f32,
    /// The `params.logprobs` most likely tokens with their log-probabilities.
    pub top: Vec<(u32, f32)>,
    /// The logits row the token was sampled from, if the request asked for it.
    pub logits: Option<Vec<f32>>,
}

/// Summary of a finished request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose compressed state came from the prefix cache on first admission.
    pub cached_tokens: usize,
    /// The same tokens by the tier they were found in (device, host, disk).
    pub cached_tokens_by_tier: [usize; 3],
    /// Times the request was preempted and recomputed.
    pub preemptions: u32,
}

/// What one step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestUpdate {
    pub id: RequestId,
    /// Tokens generated this step (zero or one).
    pub tokens: Vec<TokenOutput>,
    pub finished: Option<Finished>,
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfVocabulary { token: u32, vocab: usize },
    #[error(
        "the prompt has {len} tokens but the model's context is {limit} tokens \
         (at most {} prompt tokens, leaving room for one generated token)",
        limit - 1
    )]
    PromptTooLong { len: usize, limit: usize },
    #[error("max_tokens must be at least 1")]
    ZeroMaxTokens,
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("at most {MAX_STOP_SEQUENCES} stop sequences, got {0}")]
    TooManyStopSequences(usize),
    #[error("a stop sequence must have 1 to {MAX_STOP_SEQUENCE_TOKENS} tokens, got {0}")]
    BadStopSequence(usize),
    #[error("at most {MAX_STOP_TOKEN_IDS} stop token ids, got {0}")]
    TooManyStopTokenIds(usize),
    #[error("the waiting queue is full ({limit} requests); retry after some finish")]
    QueueFull { limit: usize },
    #[error(
        "the request needs {needed} bytes of KV cache at {tokens} tokens but the whole pool is {budget} bytes; \
         shorten the prompt or max_tokens, or enlarge the KV budget"
    )]
    ExceedsKvBudget { needed: usize, tokens: usize, budget: usize },
    #[error("no request {0} is queued or running")]
    Unknown(RequestId),
    /// Refused where it was sent to run (a cluster's scheduler), for this reason.
    #[error("{0}")]
    Refused(String),
    #[error("a cache retention must be 1 ms to {MAX_CACHE_TTL_MS} ms, got {0} ms")]
    BadRetention(u64),
    /// The model takes no images, or the images do not match the prompt.
    #[error(transparent)]
    Image(#[from] ImageError),
}
