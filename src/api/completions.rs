//! OpenAI's legacy Completions (`POST /v1/completions`): raw text in, raw text out,
//! no chat template. `echo` prepends the prompt, `logprobs` (an integer) gives the
//! old per-token shape, `stop` cuts the text where a stop string appears.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deepinfer_engine::request::{FinishReason, Request, TokenOutput};
use futures_util::stream;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::engine_thread::Event;
use super::errors::{ApiError, Flavor, Kind};
use super::failure::{stream_error, Failure, Origin, Seen, StreamFailure};
use super::fields;
use super::{params, parse_object, AppState};

/// Most stop strings a request may give (OpenAI's limit is 4).
const STOPS_MAX: usize = 16;
/// OpenAI's default output length for Completions.
const DEFAULT_MAX_TOKENS: u64 = 16;

/// The generated text so far and how much of it has been sent.
struct Text {
    ids: Vec<u32>,
    sent: usize,
}

/// What one request asked for, past the engine request.
struct Ask {
    echo: Option<String>,
    stops: Vec<String>,
    logprobs: bool,
    include_usage: bool,
}

fn bad(message: String) -> ApiError {
    ApiError::bad_request(Flavor::OpenAi, message)
}

fn prepare(state: &AppState, body: &[u8]) -> Result<(Request, Ask, bool), ApiError> {
    let obj = parse_object(Flavor::OpenAi, body)?;
    state.check_model(Flavor::OpenAi, obj.get("model").and_then(Value::as_str))?;
    fields::check(fields::COMPLETIONS, &obj).map_err(bad)?;
    super::images::placeholder::refuse(&obj, &state.image_placeholders).map_err(bad)?;
    let ext = params::extensions(&obj).map_err(bad)?;
    let prompt_text = prompt(&obj)?;
    let mut prompt_ids = vec![state.bos];
    let encoded =
        state.tokenizer.encode(prompt_text.as_str(), false).map_err(|e| bad(format!("cannot tokenize: {e}")))?;
    prompt_ids.extend(encoded.get_ids());
    let number = |key: &str, default: f64| -> Result<f64, ApiError> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| bad(format!("`{key}` must be a number, got {v}"))),
        }
    };
    let max_tokens = match obj.get("max_tokens") {
        None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .ok_or_else(|| bad(format!("`max_tokens` must be a positive integer, got {v}")))?,
    };
    if max_tokens > u64::from(state.config.max_tokens_limit) {
        return Err(bad(format!(
            "`max_tokens` {max_tokens} is above this server's limit {}",
            state.config.max_tokens_limit
        )));
    }
    let top = match obj.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .filter(|&n| n <= 20)
                .ok_or_else(|| bad(format!("`logprobs` must be an integer in [0, 20], got {v}")))? as usize,
        ),
    };
    let echo = match obj.get("echo") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| bad(format!("`echo` must be a boolean, got {v}")))?,
    };
    if echo && top.is_some() {
        return Err(bad("`echo` with `logprobs` needs the prompt's log-probabilities, which are not computed".into()));
    }
    let stops = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("`stop` must be a string or a list of strings".into()))?,
        Some(v) => return Err(bad(format!("`stop` must be a string or a list of strings, got {v}"))),
    };
    if stops.len() > STOPS_MAX || stops.iter().any(String::is_empty) {
        return Err(bad(format!("`stop` takes 1 to {STOPS_MAX} non-empty strings")));
    }
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| bad(format!("`stream` must be a boolean, got {v}")))?,
    };
    let seed =
        ext.seed.unwrap_or_else(|| super::generate::mix(state.id_salt ^ state.counter.fetch_add(1, Ordering::Relaxed)));
    let ignore_eos = ext.ignore_eos;
    let params = ext.sampling(number("temperature", 1.0)? as f32, number("top_p", 1.0)? as f32, seed, top.unwrap_or(0));
    params.validate(state.vocab).map_err(|e| bad(e.to_string()))?;
    let mut request = Request::new(prompt_ids, max_tokens as usize).with_params(params);
    request.ignore_eos = ignore_eos;
    let include_usage = params::include_usage(&obj).map_err(bad)?;
    Ok((request, Ask { echo: echo.then_some(prompt_text), stops, logprobs: top.is_some(), include_usage }, stream))
}

/// The prompt: a string, or a list holding one string.
fn prompt(obj: &Map<String, Value>) -> Result<String, ApiError> {
    match obj.get("prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            Ok(items[0].as_str().unwrap().to_string())
        }
        Some(Value::Array(_)) => {
            Err(bad("`prompt` must be a string or a list of one string (one completion per request)".into()))
        }
        _ => Err(bad("`prompt` is required: a string".into())),
    }
}

impl Text {
    /// New text that is safe to send: whole characters, cut at a stop string.
    /// Returns the piece and whether a stop string ended the output.
    fn advance(&mut self, state: &AppState, stops: &[String], last: bool) -> (String, bool) {
        let all = state.tokenizer.decode(&self.ids, false).unwrap_or_default();
        if let Some(cut) = stops.iter().filter_map(|s| all.find(s.as_str())).min() {
            let piece = all.get(self.sent..cut).unwrap_or("").to_string();
            self.sent = cut.max(self.sent);
            return (piece, true);
        }
        // Hold back a partial character, and enough to still see a stop string form.
        let hold = if last { 0 } else { stops.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0) };
        let mut end = all.len().saturating_sub(hold);
        if !last && all.ends_with('\u{FFFD}') {
            end = end.min(all.len() - '\u{FFFD}'.len_utf8());
        }
        while !all.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.sent {
            return (String::new(), false);
        }
        let piece = all[self.sent..end].to_string();
        self.sent = end;
        (piece, false)
    }
}

fn logprobs_json(state: &AppState, tokens: &[TokenOutput], offset: usize) -> Value {
    let text = |id: u32| state.tokenizer.decode(&[id], false).unwrap_or_default();
    let mut at = offset;
    let mut offsets = Vec::new();
    for t in tokens {
        offsets.push(at);
        at += text(t.token).len();
    }
    json!({
        "tokens": tokens.iter().map(|t| text(t.token)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect::<Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// `POST /v1/completions`.
pub async fn handle(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Arc<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let permit = state.in_flight.clone().try_acquire_owned().map_err(|_| {
        ApiError::new(Flavor::OpenAi, Kind::RateLimited, "too many requests are in flight already; retry later")
    })?;
    let (request, ask, streamed) = prepare(&state, &body)?;
    let prompt_tokens = request.prompt.len();
    let rx = state.submit(Flavor::OpenAi, request, None, arrived).await?;
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let id = format!("cmpl-{:016x}{:08x}", super::generate::mix(state.id_salt ^ n), n & 0xffff_ffff);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let model = state.config.model_name.clone();
    let eos = state.eos;
    let chunk = move |text: String, logprobs: Value, finish: Option<&str>| {
        json!({"id": id, "object": "text_completion", "created": created, "model": model,
               "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]})
    };
    let events = async_stream(state.clone(), rx, ask, prompt_tokens, eos);
    if streamed {
        let include_usage = events.ask.include_usage;
        let out = stream::unfold((events, chunk, false, permit), move |(mut ev, chunk, done, permit)| async move {
            if done {
                return None;
            }
            let (piece, tokens, finish, usage) = match ev.next().await {
                Ok(step) => step,
                // The error ends the stream: no finish reason, no `[DONE]` (see `failure`).
                Err(f) => {
                    let error = stream_error(StreamFailure::ErrorData, &f.api(Flavor::OpenAi), &Seen::default());
                    return Some((stream::iter(vec![Ok::<_, Infallible>(error)]), (ev, chunk, true, permit)));
                }
            };
            let logprobs =
                if ev.ask.logprobs { logprobs_json(&ev.state, &tokens, ev.offset - piece.len()) } else { Value::Null };
            let mut events = vec![chunk(piece, logprobs, finish.as_deref())];
            if let (Some(usage), true) = (&usage, include_usage) {
                let mut last = events[0].clone();
                last["choices"] = json!([]);
                last["usage"] = usage.clone();
                events.push(last);
            }
            let mut data: Vec<SseEvent> = events.into_iter().map(|v| SseEvent::default().data(v.to_string())).collect();
            if finish.is_some() {
                data.push(SseEvent::default().data("[DONE]"));
            }
            let data: Vec<Result<SseEvent, Infallible>> = data.into_iter().map(Ok).collect();
            Some((stream::iter(data), (ev, chunk, finish.is_some(), permit)))
        });
        use futures_util::StreamExt;
        return Ok(Sse::new(out.flatten()).keep_alive(KeepAlive::default()).into_response());
    }
    let mut events = events;
    let mut text = String::new();
    let mut all_tokens = Vec::new();
    loop {
        let (piece, tokens, finish, usage) = events.next().await.map_err(|f| f.api(Flavor::OpenAi))?;
        text.push_str(&piece);
        all_tokens.extend(tokens);
        if let (Some(finish), Some(usage)) = (finish, usage) {
            let logprobs =
                if events.ask.logprobs { logprobs_json(&state, &all_tokens, events.echo_len) } else { Value::Null };
            let mut body = chunk(text, logprobs, Some(&finish));
            body["usage"] = usage;
            drop(permit);
            return Ok(Json(body).into_response());
        }
    }
}

/// The engine's events for one completion, as text pieces.
struct Events {
    state: Arc<AppState>,
    rx: mpsc::UnboundedReceiver<Event>,
    ask: Ask,
    text: Text,
    prompt_tokens: usize,
    completion_tokens: usize,
    eos: u32,
    /// Bytes sent so far (for `text_offset`).
    offset: usize,
    echo_len: usize,
    echoed: bool,
    finished: bool,
}

fn async_stream(
    state: Arc<AppState>,
    rx: mpsc::UnboundedReceiver<Event>,
    ask: Ask,
    prompt_tokens: usize,
    eos: u32,
) -> Events {
    let echo_len = ask.echo.as_ref().map_or(0, String::len);
    Events {
        state,
        rx,
        ask,
        text: Text { ids: Vec::new(), sent: 0 },
        prompt_tokens,
        completion_tokens: 0,
        eos,
        offset: 0,
        echo_len,
        echoed: false,
        finished: false,
    }
}

/// A piece of text, its tokens, and at the end the finish reason and usage.
type Step = (String, Vec<TokenOutput>, Option<String>, Option<Value>);

impl Events {
    /// The next piece of the completion, or why it failed.
    async fn next(&mut self) -> Result<Step, Failure> {
        let mut piece = String::new();
        if !self.echoed {
            self.echoed = true;
            piece = self.ask.echo.clone().unwrap_or_default();
        }
        let usage = |s: &Self| json!({"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens, "total_tokens": s.prompt_tokens + s.completion_tokens});
        if self.finished {
            return Ok((piece, Vec::new(), Some("stop".into()), Some(usage(self))));
        }
        loop {
            match self.rx.recv().await {
                Some(Event::Tokens { tokens, .. }) => {
                    self.completion_tokens += tokens.len();
                    let kept: Vec<TokenOutput> = tokens.into_iter().filter(|t| t.token != self.eos).collect();
                    self.text.ids.extend(kept.iter().map(|t| t.token));
                    let (more, stopped) = self.text.advance(&self.state, &self.ask.stops, false);
                    piece.push_str(&more);
                    self.offset += piece.len();
                    if stopped {
                        self.finished = true;
                        return Ok((piece, kept, Some("stop".into()), Some(usage(self))));
                    }
                    return Ok((piece, kept, None, None));
                }
                Some(Event::Finished(f)) => {
                    let reason = match &f.reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                        // Failures come as `Event::Failed`; never let one pass as an answer.
                        other => return Err(Failure::of_finish(other, Origin::Engine).expect("not an answer")),
                    };
                    self.finished = true;
                    let (more, _) = self.text.advance(&self.state, &self.ask.stops, true);
                    piece.push_str(&more);
                    self.offset += piece.len();
                    self.completion_tokens = f.completion_tokens;
                    return Ok((piece, Vec::new(), Some(reason.into()), Some(usage(self))));
                }
                Some(Event::Failed(f)) => return Err(f),
                // Refused where it was sent after it was queued (a cluster's scheduler).
                Some(Event::Rejected(e)) => return Err(Failure::refused(&e)),
                Some(Event::Queued) => {}
                None => return Err(Failure::stopped()),
            }
        }
    }
}
