//! How a request that was queued ends without an answer, and what each
//! protocol tells its client then. The one place that tells a retryable
//! failure (503 with `Retry-After`: nothing can serve it now, a retry or
//! another front end may) from an internal one (500), writes each
//! protocol's error ending of a stream, and keeps the front end's recent
//! evidence for `/health`.
//!
//! A stream that fails never carries a finish marker first: an SDK that
//! stops at `finish_reason`, `message_stop` or `response.completed` would
//! record an empty success.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::response::sse::Event as SseEvent;
use deepinfer_engine::request::{FinishReason, RequestError};
use serde_json::{json, Value};

use super::errors::{ApiError, Flavor, Kind};

/// Why a queued request ended without an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: Kind,
    pub message: String,
}

/// What ran the request, which decides whether its errors are retryable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// This process's engine: its errors are faults of the model or the
    /// engine, and a retry would meet them again.
    Engine,
    /// A cluster: its errors are lost nodes, steps that failed after their
    /// retries, no instance up; a retry may find one.
    Cluster,
}

/// The engine's own fault on the model's numbers (its scheduler's message),
/// which no retry mends, wherever it ran.
const MODEL_FAULT: &str = "produced no finite logits";

impl Failure {
    /// The failure a finish reason means; `None` for an answer.
    pub fn of_finish(reason: &FinishReason, origin: Origin) -> Option<Self> {
        let (kind, message) = match reason {
            FinishReason::Stop | FinishReason::Length => return None,
            // Handlers that stopped listening never see theirs: this one was
            // cancelled by the server (a draining node, a router giving up).
            FinishReason::Cancelled => (Kind::Unavailable, "the request was cancelled by the server".to_string()),
            FinishReason::Error(e) if origin == Origin::Cluster && !e.contains(MODEL_FAULT) => {
                (Kind::Unavailable, format!("the cluster could not serve the request: {e}"))
            }
            FinishReason::Error(e) => (Kind::Internal, format!("generation failed: {e}")),
        };
        Some(Self { kind, message })
    }

    /// Refused after it was queued (a cluster's scheduler), as a refusal
    /// before would have been answered.
    pub fn refused(e: &RequestError) -> Self {
        let kind = ApiError::engine(Flavor::OpenAi, e).kind;
        Self { kind, message: format!("refused: {e}") }
    }

    /// What runs the requests has stopped.
    pub fn stopped() -> Self {
        Self { kind: Kind::Unavailable, message: "the engine stopped".into() }
    }

    pub fn retryable(&self) -> bool {
        matches!(self.kind, Kind::Unavailable | Kind::RateLimited)
    }

    pub fn api(&self, flavor: Flavor) -> ApiError {
        ApiError::new(flavor, self.kind, self.message.clone())
    }
}

/// How a protocol's stream says it failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamFailure {
    /// OpenAI Chat Completions and Completions: `data: {"error": {...}}`,
    /// on which the `openai` SDK raises `APIError`; no `[DONE]` follows,
    /// since `[DONE]` says the stream completed.
    ErrorData,
    /// Anthropic Messages: `event: error`, on which the `anthropic` SDK raises.
    ErrorEvent,
    /// OpenAI Responses: the terminal `response.failed` event, the response
    /// with `status: failed` and its `error`, in place of `response.completed`.
    ResponseFailed,
}

/// What a stream has sent, for a `response.failed` that continues it.
#[derive(Default)]
pub struct Seen {
    /// The response object of the last lifecycle event (`response.created`, …).
    pub response: Option<Value>,
    pub next_sequence: u64,
    /// An error event was sent already (the processor's own).
    pub failed: bool,
}

impl Seen {
    /// Note one event's data.
    pub fn note(&mut self, data: &Value) {
        if let Some(r) = data.get("response").filter(|r| r.is_object()) {
            self.response = Some(r.clone());
        }
        if let Some(n) = data.get("sequence_number").and_then(Value::as_u64) {
            self.next_sequence = self.next_sequence.max(n + 1);
        }
    }
}

/// The event that ends a stream that failed with `error`.
pub fn stream_error(how: StreamFailure, error: &ApiError, seen: &Seen) -> SseEvent {
    match how {
        StreamFailure::ErrorData => SseEvent::default().data(error.body().to_string()),
        StreamFailure::ErrorEvent => SseEvent::default().event("error").data(error.body().to_string()),
        StreamFailure::ResponseFailed => {
            SseEvent::default().event("response.failed").data(response_failed(error, seen).to_string())
        }
    }
}

/// The `response.failed` event's data: the response as last sent, failed.
fn response_failed(error: &ApiError, seen: &Seen) -> Value {
    let code = match error.kind {
        Kind::Internal | Kind::Unavailable => "server_error",
        Kind::RateLimited => "rate_limit_exceeded",
        _ => "invalid_prompt",
    };
    let mut response = seen.response.clone().unwrap_or_else(|| json!({"object": "response", "output": []}));
    response["status"] = json!("failed");
    response["error"] = json!({"code": code, "message": error.message});
    json!({"type": "response.failed", "sequence_number": seen.next_sequence, "response": response})
}

/// The shortest time a retryable failure keeps `/health` not ready: long
/// enough for a load balancer probing every few seconds to see it.
const EVIDENCE_MIN: Duration = Duration::from_secs(10);

/// The front end's own evidence of whether it can serve: the last request
/// that ended, if it failed with a retryable error. The next answer clears
/// it, and it expires after `window`, so a front end that was taken out of
/// rotation is tried again.
pub struct Evidence {
    window: Duration,
    last_failure: Mutex<Option<(Instant, String)>>,
}

impl Evidence {
    /// Evidence kept for `failure_timeout` (at least [`EVIDENCE_MIN`]).
    pub fn new(failure_timeout: Duration) -> Self {
        Self { window: failure_timeout.max(EVIDENCE_MIN), last_failure: Mutex::new(None) }
    }

    /// A request ended: with an answer (`None`) or with `failure`.
    pub fn record(&self, failure: Option<&Failure>) {
        let mut last = self.last_failure.lock().unwrap_or_else(|e| e.into_inner());
        match failure {
            None => *last = None,
            Some(f) if f.retryable() => *last = Some((Instant::now(), f.message.clone())),
            // A bad request or a model fault says nothing about serving.
            Some(_) => {}
        }
    }

    /// Forget the failures seen: what caused them is known to be over.
    pub fn clear(&self) {
        self.record(None);
    }

    /// Why the last request failed, if it did within the window.
    pub fn failing(&self) -> Option<String> {
        let last = self.last_failure.lock().unwrap_or_else(|e| e.into_inner());
        let (at, why) = last.as_ref()?;
        let ago = at.elapsed();
        (ago < self.window).then(|| format!("the last request failed {} ms ago: {why}", ago.as_millis()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_no_failures_and_a_cluster_error_is_retryable_unless_the_model_failed() {
        assert_eq!(Failure::of_finish(&FinishReason::Stop, Origin::Cluster), None);
        assert_eq!(Failure::of_finish(&FinishReason::Length, Origin::Engine), None);
        let lost = FinishReason::Error("node1 is down and no serving instance is left".into());
        assert_eq!(Failure::of_finish(&lost, Origin::Cluster).unwrap().kind, Kind::Unavailable);
        assert_eq!(Failure::of_finish(&lost, Origin::Engine).unwrap().kind, Kind::Internal);
        let nan = FinishReason::Error("the model produced no finite logits at position 3".into());
        assert_eq!(Failure::of_finish(&nan, Origin::Cluster).unwrap().kind, Kind::Internal);
        assert!(Failure::of_finish(&FinishReason::Cancelled, Origin::Engine).unwrap().retryable());
        assert_eq!(Failure::refused(&RequestError::QueueFull { limit: 1 }).kind, Kind::RateLimited);
        assert_eq!(Failure::refused(&RequestError::Refused("bad schema".into())).kind, Kind::InvalidRequest);
    }

    #[test]
    fn evidence_is_the_last_outcome_within_its_window() {
        let e = Evidence::new(Duration::ZERO);
        assert_eq!(e.failing(), None);
        let lost = Failure { kind: Kind::Unavailable, message: "no serving instance".into() };
        e.record(Some(&lost));
        assert!(e.failing().is_some_and(|w| w.contains("no serving instance")));
        // A model fault or a bad request keeps the evidence as it was.
        e.record(Some(&Failure { kind: Kind::Internal, message: "nan".into() }));
        assert!(e.failing().is_some());
        e.record(None);
        assert_eq!(e.failing(), None);
        let short = Evidence { window: Duration::ZERO, last_failure: Mutex::new(None) };
        short.record(Some(&lost));
        assert_eq!(short.failing(), None, "expired");
    }

    #[test]
    fn a_failed_response_continues_the_stream_it_ends() {
        let mut seen = Seen::default();
        seen.note(&json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress", "output": []}}));
        seen.note(&json!({"type": "response.output_text.delta", "sequence_number": 4, "delta": "x"}));
        let error = ApiError::new(Flavor::OpenAi, Kind::Unavailable, "node lost");
        let data = response_failed(&error, &seen);
        assert_eq!(data["sequence_number"], 5);
        assert_eq!(data["response"]["id"], "resp_1");
        assert_eq!(data["response"]["status"], "failed");
        assert_eq!(data["response"]["error"], json!({"code": "server_error", "message": "node lost"}));
    }
}
