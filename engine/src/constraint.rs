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
