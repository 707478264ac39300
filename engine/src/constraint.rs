//! Constrained sampling: a per-request hook that restricts which tokens may
//! be sampled next (structured output: JSON schemas, regular expressions,
//! grammars). The engine knows nothing of the grammar; it only masks and
//! reports.

/// Restricts the tokens one request may sample.
///
/// The engine calls [`allowed`](Self::allowed) on the logits row of every
/// token the request samples, then [`accept`](Self::accept) with the token
/// chosen. When [`is_done`](Self::is_done) turns true after a token, the
/// request finishes with [`FinishReason::Stop`](crate::request::FinishReason::Stop)
/// right after it. Preemption does not reset a constraint: the request's
/// generated tokens survive recomputation, and so does its state.
pub trait TokenConstraint: Send {
    /// Set the logits of tokens that may not come next to `-inf`. A row left
    /// with no finite logit ends the request with an error.
    fn allowed(&mut self, logits: &mut [f32]);
    /// Record the token sampled from the masked row.
    fn accept(&mut self, token: u32);
    /// Nothing more may follow the tokens accepted so far.
    fn is_done(&self) -> bool;
    /// An independent copy in the same state, which speculative decoding
    /// advances over draft tokens to mask them; `None` if it cannot be copied
    /// (its drafts are then not masked, and the target rejects any it forbids).
    fn fork(&self) -> Option<Box<dyn TokenConstraint>> {
        None
    }
}

/// Builds a request's constraint from the description a front end sent with
/// it, where the constraint runs away from the front end (a cluster's
/// schedulers). The description's format is the front end's and the
/// source's business alone. What it builds must mask by token alone, never
/// by the logits' values: the mask is taken before the row exists.
pub trait ConstraintSource: Send + Sync {
    /// A fresh constraint for a request that may generate `max_tokens`; the
    /// error says what is wrong with `spec`.
    fn build(&self, spec: &str, max_tokens: usize) -> Result<Box<dyn TokenConstraint>, String>;
}

/// The tokens `constraint` allows next over a vocabulary of `vocab`: one bit
/// per token, 32 to a word, as a masked row of zeros shows them.
pub fn allowed_tokens(constraint: &mut dyn TokenConstraint, vocab: usize) -> Vec<u32> {
    let mut row = vec![0.0f32; vocab];
    constraint.allowed(&mut row);
    let mut words = vec![0u32; vocab.div_ceil(32)];
    for (token, logit) in row.iter().enumerate() {
        if logit.is_finite() {
            words[token / 32] |= 1 << (token % 32);
        }
    }
    words
}
