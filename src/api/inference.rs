//! The engine's events for one request as the recipe's inference chunks, with
//! the usage bookkeeping of [`super::usage`].

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use deepinfer_engine::request::FinishReason;
use deepseek_recipe::stream::{InferenceChunk, InferenceFinishReason, InferenceTokenLogprob, PromptUsage};
use futures_util::{stream, Stream};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use super::engine_thread::Event;
use super::failure::{Failure, Origin};
use super::stops::{Fed, LeadingNewlines, StopStrings};
use super::usage::{HeldTail, SharedCounts};

/// Where a request's failure is told to its handler.
pub type FailureSlot = Arc<Mutex<Option<Failure>>>;

/// The engine's events for one request, as the recipe's inference chunks.
pub struct Inference {
    pub rx: mpsc::UnboundedReceiver<Event>,
    pub queue: VecDeque<InferenceChunk>,
    pub ready: bool,
    pub finished: bool,
    pub prompt_tokens: usize,
    pub logprobs: bool,
    /// EOS is never output text (it only appears with `ignore_eos`).
    pub eos: u32,
    pub think_end: Option<u32>,
    /// Stop token ids whose text is left out of the output, like EOS's.
    pub drop_ids: Vec<u32>,
    /// Stop strings matched here rather than by the output parser (vLLM's rules).
    pub stops: Option<StopStrings>,
    /// With log-probabilities: leading newlines held for the next token.
    pub leading: Option<LeadingNewlines>,
    /// The tokens the processor's decoder holds, sent as text when output ends.
    pub tail: HeldTail,
    pub counts: SharedCounts,
    /// Why generation failed, if it did: set as the stream ends, so that what
    /// the recipe's processor makes of the end (a finish chunk) can be told
    /// from the answer before it and left out.
    pub failure: FailureSlot,
    /// The failure, until the stream ends.
    pub failed: Option<Failure>,
    /// Held while the request lives: dropping the stream releases it.
    pub _permit: Option<OwnedSemaphorePermit>,
    /// Told when the first token arrives (the prompt is prefilled) or the request ends.
    pub first_token: Option<oneshot::Sender<()>>,
}

impl Inference {
    /// Hand generated tokens to the output parser.
    fn push_tokens(&mut self, tokens: Vec<deepinfer_engine::request::TokenOutput>) {
        if tokens.is_empty() {
            return;
        }
        let logprobs = self.logprobs.then(|| {
            tokens.iter().map(|t| InferenceTokenLogprob { logprob: t.logprob, top_logprobs: t.top.clone() }).collect()
        });
        self.tail.push(&tokens);
        let token_ids: Vec<u32> = tokens.iter().map(|t| t.token).collect();
        self.queue.push_back(InferenceChunk::Tokens { token_ids, logprobs });
    }

    fn ready(&mut self, prompt_tokens: usize, cached_tokens: usize) {
        if !self.ready {
            self.ready = true;
            let prompt_usage = PromptUsage { prompt_tokens, prompt_cache_hit_tokens: cached_tokens };
            self.queue.push_back(InferenceChunk::Ready { system_fingerprint: None, prompt_usage });
        }
    }

    /// End with `failure`. Ready first, so that a stream has begun (a
    /// Responses stream's `response.created`) before its error.
    fn fail(&mut self, failure: Failure) {
        self.ready(self.prompt_tokens, 0);
        self.failed = Some(failure);
        self.finished = true;
    }
}

pub fn inference_stream(inference: Inference) -> impl Stream<Item = InferenceChunk> + Send + 'static {
    stream::unfold(inference, |mut s| async move {
        loop {
            if let Some(chunk) = s.queue.pop_front() {
                return Some((chunk, s));
            }
            if s.finished {
                if let Some(f) = s.failed.take() {
                    *s.failure.lock().expect("not poisoned") = Some(f);
                }
                return None;
            }
            match s.rx.recv().await {
                Some(Event::Tokens { mut tokens, cached_tokens }) => {
                    if let Some(first) = s.first_token.take() {
                        let _ = first.send(());
                    }
                    s.ready(s.prompt_tokens, cached_tokens);
                    let generated = tokens.len();
                    tokens.retain(|t| t.token != s.eos && !s.drop_ids.contains(&t.token));
                    {
                        let mut counts = s.counts.lock().expect("not poisoned");
                        tokens.iter().for_each(|t| counts.push(t.token, s.think_end));
                    }
                    let eos = generated - tokens.len();
                    if eos > 0 {
                        // Counted in usage, without text.
                        s.queue.push_back(InferenceChunk::Text { content: String::new(), token_count: eos });
                    }
                    let mut stopped = None;
                    if let Some(stops) = s.stops.as_mut() {
                        tokens = match stops.feed(tokens) {
                            Fed::Release(release) => release,
                            Fed::Stop { release, text, tokens } => {
                                stopped = Some((text, tokens));
                                release
                            }
                        };
                    }
                    if let Some(lead) = s.leading.as_mut() {
                        tokens = lead.feed(tokens);
                    }
                    if stopped.is_some() {
                        tokens.extend(s.leading.as_mut().map(LeadingNewlines::finish).unwrap_or_default());
                    }
                    s.push_tokens(tokens);
                    if let Some((content, token_count)) = stopped {
                        // The text up to the cut, then the end: later tokens are not read.
                        s.queue.push_back(InferenceChunk::Text { content, token_count });
                        s.queue.push_back(InferenceChunk::Finish { finish_reason: InferenceFinishReason::Stop });
                        s.finished = true;
                    }
                }
                Some(Event::Finished(f)) => {
                    s.ready(f.prompt_tokens, f.cached_tokens);
                    s.counts.lock().expect("not poisoned").cached_by_tier = Some(f.cached_tokens_by_tier);
                    let finish_reason = match &f.reason {
                        FinishReason::Stop => InferenceFinishReason::Stop,
                        FinishReason::Length => InferenceFinishReason::Length,
                        // Failures come as `Event::Failed`; never let one pass as an answer.
                        reason => {
                            s.fail(Failure::of_finish(reason, Origin::Engine).expect("not an answer"));
                            continue;
                        }
                    };
                    let mut held = s.stops.as_mut().map(StopStrings::finish).unwrap_or_default();
                    if let Some(lead) = s.leading.as_mut() {
                        held = lead.feed(held);
                        held.extend(lead.finish());
                    }
                    s.push_tokens(held);
                    // Tokens ending inside a character still count, and their bytes
                    // show as the replacement character.
                    if let Some((content, token_count, logprobs)) = s.tail.take() {
                        if s.logprobs {
                            s.counts.lock().expect("not poisoned").tail_logprobs = logprobs;
                        }
                        s.queue.push_back(InferenceChunk::Text { content, token_count });
                    }
                    s.queue.push_back(InferenceChunk::Finish { finish_reason });
                    s.finished = true;
                }
                Some(Event::Failed(f)) => s.fail(f),
                // Refused where it was sent after it was queued (a cluster's scheduler).
                Some(Event::Rejected(e)) => s.fail(Failure::refused(&e)),
                Some(Event::Queued) => {}
                None => s.fail(Failure::stopped()),
            }
        }
    })
}
