//! One generation request, whatever its protocol: parse and convert it with
//! `deepseek-recipe`, encode the prompt, hand it to the engine thread, and
//! feed the generated token ids to the recipe's `StreamProcessor`, which
//! parses thinking, tool calls and stop sequences into protocol chunks that
//! are sent as SSE events or accumulated into one response.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deepinfer_engine::request::Request;
use deepseek_recipe::request::{ConversationRequest, OutputConstraint, ProtocolRequest};
use deepseek_recipe::response::{Accumulate, ProtocolResponse};
use deepseek_recipe::stream::{ChunkGenerator, StreamProcessor};
use deepseek_recipe_encoding::PromptEncoding;
use futures_util::{stream, Stream, StreamExt};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit};

use super::constraint::{Limits, OutputFormat, RequestConstraint, MAX_GRAMMAR_BYTES};
use super::errors::{ApiError, Flavor, Kind};
use super::failure::{stream_error, Seen};
use super::images::Gathered;
use super::inference::{inference_stream, FailureSlot, Inference};
use super::protocols::Api;
use super::stops::LeadingNewlines;
use super::tool_grammar::ToolSpec;
use super::usage::{patch_reasoning_tokens, Counts, HeldTail, SharedCounts};
use super::vllm::{OutputRules, TokenIdNames};
use super::{anthropic_out, fields, params, parse_object, retention, strict, vllm, AppState};

/// A protocol chunk of request type `P`.
pub type ChunkOf<P> = <<<P as ProtocolRequest>::Response as ProtocolResponse>::ChunkGenerator as ChunkGenerator>::Chunk;

/// A request converted, encoded and ready for the engine.
struct Prepared {
    converted: ConversationRequest,
    request: Request,
    constraint: Option<RequestConstraint>,
    logprobs: bool,
    /// Streamed usage: Chat Completions only when `stream_options.include_usage`.
    include_usage: bool,
    /// Whether the output starts in reasoning (thinking mode, no forced tool call).
    thinking: bool,
    /// Completions asked for (`n`).
    choices: usize,
    /// The response id.
    id: String,
    /// vLLM's rules for the output text.
    rules: OutputRules,
}

/// `POST` handler of every generation route.
pub async fn handle<P>(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    match run::<P>(state, body).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn run<P>(state: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError>
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    let arrived = Instant::now();
    let flavor = P::FLAVOR;
    let body = body.map_err(|e| {
        let kind = if e.status().as_u16() == 413 { Kind::TooLarge } else { Kind::InvalidRequest };
        let message = match kind {
            Kind::TooLarge => format!("the request body is larger than {} bytes", state.config.max_body_bytes),
            _ => e.body_text(),
        };
        ApiError::new(flavor, kind, message)
    })?;
    let permit = state.in_flight.clone().try_acquire_owned().map_err(|_| {
        let limit = state.config.max_concurrent;
        ApiError::new(flavor, Kind::RateLimited, format!("{limit} requests are in flight already; retry later"))
    })?;
    let body = Arc::new(body);
    let images = Arc::new(super::images::gather(&state, flavor, &body).await?);
    let prepared = prepare_blocking::<P>(&state, &body, &images, None).await?;
    let choices = prepared.choices;
    if choices == 1 {
        return answer::<P>(state, prepared, arrived, Some(permit), None).await;
    }
    // The first choice prefills the prompt; the others start once its first token
    // is out, so they find the prompt's blocks in the prefix cache.
    let seed = prepared.request.params.seed;
    if prepared.converted.stream {
        let (include_usage, id) = (prepared.include_usage, prepared.id.clone());
        let (prefilled, ready) = oneshot::channel();
        let (mut chunks, failure, counts) =
            start::<P>(&state, prepared, arrived, Some(permit), Some(prefilled)).await?;
        // Drive the first choice now, so that its first token (which releases the
        // others) arrives before anyone reads the stream; its chunks wait in a channel.
        let (forward, forwarded) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(chunk) = chunks.next().await {
                if forward.send(chunk).is_err() {
                    break;
                }
            }
        });
        let first: ChoiceChunks<P> =
            Box::pin(stream::unfold(forwarded, |mut rx| async move { rx.recv().await.map(|chunk| (chunk, rx)) }));
        let mut streams = vec![(first, failure, counts)];
        let _ = ready.await;
        for i in 1..choices {
            let prepared = prepare_blocking::<P>(&state, &body, &images, Some(mix(seed ^ i as u64))).await?;
            streams.push(start::<P>(&state, prepared, arrived, None, None).await?);
        }
        return Ok(sse_choices::<P>(streams, include_usage, id).into_response());
    }
    let (prefilled, ready) = oneshot::channel();
    // A client that leaves takes its choices with it: dropping the tasks cancels them.
    let mut tasks =
        AbortOnDrop(vec![tokio::spawn(answer_json::<P>(state.clone(), prepared, arrived, None, Some(prefilled)))]);
    let _ = ready.await;
    for i in 1..choices {
        let prepared = prepare_blocking::<P>(&state, &body, &images, Some(mix(seed ^ i as u64))).await?;
        tasks.0.push(tokio::spawn(answer_json::<P>(state.clone(), prepared, arrived, None, None)));
    }
    let mut merged = Value::Null;
    for (i, handle) in tasks.0.iter_mut().enumerate() {
        let value =
            handle.await.map_err(|e| ApiError::new(flavor, Kind::Internal, format!("a choice failed: {e}")))??;
        if i == 0 {
            merged = value;
        } else {
            super::usage::merge_choice(&mut merged, value, i);
        }
    }
    drop(permit);
    Ok(Json(merged).into_response())
}

/// Tasks aborted when dropped (the request's future was dropped: the client left).
struct AbortOnDrop<T>(Vec<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.iter().for_each(tokio::task::JoinHandle::abort);
    }
}

async fn prepare_blocking<P: Api>(
    state: &Arc<AppState>,
    body: &Arc<Bytes>,
    images: &Arc<Gathered>,
    seed: Option<u64>,
) -> Result<Prepared, ApiError> {
    let (state, body, images) = (state.clone(), body.clone(), images.clone());
    tokio::task::spawn_blocking(move || prepare::<P>(&state, &body, &images, seed))
        .await
        .map_err(|e| ApiError::new(P::FLAVOR, Kind::Internal, format!("request preparation failed: {e}")))?
}

/// Run one prepared request: streamed, or accumulated into one response.
async fn answer<P>(
    state: Arc<AppState>,
    prepared: Prepared,
    arrived: Instant,
    permit: Option<OwnedSemaphorePermit>,
    first_token: Option<oneshot::Sender<()>>,
) -> Result<Response, ApiError>
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    if !prepared.converted.stream {
        return Ok(Json(answer_json::<P>(state, prepared, arrived, permit, first_token).await?).into_response());
    }
    let include_usage = prepared.include_usage;
    let (chunks, failure, counts) = start::<P>(&state, prepared, arrived, permit, first_token).await?;
    Ok(sse::<P>(chunks, failure, include_usage, counts).into_response())
}

/// Run one prepared request to its whole response, as JSON.
async fn answer_json<P>(
    state: Arc<AppState>,
    prepared: Prepared,
    arrived: Instant,
    permit: Option<OwnedSemaphorePermit>,
    first_token: Option<oneshot::Sender<()>>,
) -> Result<Value, ApiError>
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    let flavor = P::FLAVOR;
    let prompt_tokens = prepared.request.prompt.len();
    let (id, model) = (prepared.id.clone(), state.config.model_name.clone());
    let (chunks, failure, counts) = start::<P>(&state, prepared, arrived, permit, first_token).await?;
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut response = P::Response::new(id, model, created, prompt_tokens, 0);
    let mut chunks = std::pin::pin!(chunks);
    let mut tool_inputs = anthropic_out::ToolInputs::default();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| ApiError::new(flavor, Kind::Internal, e.to_string()))?;
        // The recipe's accumulator makes an input that does not parse `{}`: refuse it instead.
        if flavor == Flavor::Anthropic {
            let event = serde_json::to_value(&chunk).unwrap_or_default();
            tool_inputs.check(&event).map_err(|e| ApiError::new(flavor, Kind::Internal, e))?;
        }
        response.accumulate(chunk);
    }
    if let Some(f) = failure.lock().expect("not poisoned").take() {
        return Err(f.api(flavor));
    }
    let mut value = serde_json::to_value(&response)
        .map_err(|e| ApiError::new(flavor, Kind::Internal, format!("cannot serialise the response: {e}")))?;
    patch_reasoning_tokens(&mut value, &counts.lock().expect("not poisoned"));
    anthropic_out::patch(flavor, &mut value);
    Ok(value)
}

/// Submit a prepared request and return its protocol chunks.
async fn start<P>(
    state: &Arc<AppState>,
    prepared: Prepared,
    arrived: Instant,
    permit: Option<OwnedSemaphorePermit>,
    first_token: Option<oneshot::Sender<()>>,
) -> Result<(ChoiceChunks<P>, FailureSlot, SharedCounts), ApiError>
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    let flavor = P::FLAVOR;
    let Prepared { converted, request, constraint, logprobs, thinking, id, mut rules, .. } = prepared;
    let prompt_tokens = request.prompt.len();
    let rx = state.submit(flavor, request, constraint, arrived).await?;
    let model = state.config.model_name.clone();
    let generator = P::chunk_generator(&converted, id, model);
    let processor = StreamProcessor::new(generator, converted.parsing_options);
    let processor = match rules.token_ids {
        true => processor.with_tokenizer(TokenIdNames(state.tokenizer.clone())),
        false => processor.with_tokenizer(state.tokenizer.clone()),
    };
    let failure: FailureSlot = Arc::new(Mutex::new(None));
    let counts: SharedCounts = Arc::new(Mutex::new(Counts { thinking, ..Counts::default() }));
    let inference = inference_stream(Inference {
        rx,
        queue: VecDeque::new(),
        ready: false,
        finished: false,
        prompt_tokens,
        logprobs,
        eos: state.eos,
        think_end: state.tokenizer.token_to_id("</think>"),
        drop_ids: std::mem::take(&mut rules.drop_ids),
        stops: rules.stop_strings(state.tokenizer.clone()),
        leading: logprobs
            .then(|| LeadingNewlines::new(state.tokenizer.clone(), state.tokenizer.token_to_id("</think>"))),
        tail: HeldTail::new(state.tokenizer.clone()),
        counts: counts.clone(),
        failure: failure.clone(),
        failed: None,
        _permit: permit,
        first_token,
    });
    Ok((Box::pin(processor.into_protocol_stream(inference)), failure, counts))
}

/// Protocol chunks as server-sent events. A failure ends the stream with
/// the protocol's error ([`super::failure::StreamFailure`]) in place of what the recipe's
/// processor makes of the end (its finish chunks); an answer ends with the
/// protocol's last event (`[DONE]` for OpenAI chat).
fn sse<P>(
    chunks: impl Stream<Item = Result<ChunkOf<P>, deepseek_recipe::stream::StreamError>> + Send + 'static,
    failure: FailureSlot,
    include_usage: bool,
    counts: SharedCounts,
) -> impl IntoResponse
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    let flavor = P::FLAVOR;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (seen_in, failure_in) = (seen.clone(), failure.clone());
    let mut tool_inputs = anthropic_out::ToolInputs::default();
    // The slot is set as the inference ends: every chunk made after that is the processor's ending.
    let answered = chunks.take_while(move |_| std::future::ready(failure_in.lock().expect("not poisoned").is_none()));
    let events = answered.flat_map(move |chunk| {
        let events = match chunk {
            // After an error event nothing follows (not even the processor's stop events).
            Ok(_) if seen_in.lock().expect("not poisoned").failed => Vec::new(),
            Ok(chunk) => {
                let name = P::Response::sse_event_name(&chunk);
                let mut value =
                    serde_json::to_value(&chunk).unwrap_or_else(|e| serde_json::json!({"error": e.to_string()}));
                patch_reasoning_tokens(&mut value, &counts.lock().expect("not poisoned"));
                anthropic_out::patch(flavor, &mut value);
                // A tool input that does not parse ends the stream with an error, never as a tool_use.
                if flavor == Flavor::Anthropic {
                    if let Err(why) = tool_inputs.check(&value) {
                        let mut seen = seen_in.lock().expect("not poisoned");
                        seen.failed = true;
                        let error = ApiError::new(flavor, Kind::Internal, why);
                        return stream::iter(vec![stream_error(P::STREAM_FAILURE, &error, &seen)]);
                    }
                }
                seen_in.lock().expect("not poisoned").note(&value);
                let values = if P::SPLITS_USAGE { split_usage(value, include_usage) } else { vec![value] };
                values
                    .into_iter()
                    .map(|v| {
                        let event = SseEvent::default().data(v.to_string());
                        match name {
                            Some(name) => event.event(name),
                            None => event,
                        }
                    })
                    .collect()
            }
            Err(e) => {
                // The processor ends after its error: nothing else follows.
                let error = ApiError::new(flavor, Kind::Internal, e.to_string());
                let mut seen = seen_in.lock().expect("not poisoned");
                seen.failed = true;
                vec![stream_error(P::STREAM_FAILURE, &error, &seen)]
            }
        };
        stream::iter(events)
    });
    let tail = stream::once(async move {
        let mut out = Vec::new();
        let seen = seen.lock().expect("not poisoned");
        if let Some(f) = failure.lock().expect("not poisoned").take() {
            out.push(stream_error(P::STREAM_FAILURE, &f.api(flavor), &seen));
        } else if !seen.failed {
            if let Some(done) = P::Response::sse_done_data() {
                out.push(SseEvent::default().data(done));
            }
        }
        stream::iter(out)
    })
    .flatten();
    let all = events.chain(tail).map(Ok::<_, Infallible>);
    Sse::new(all).keep_alive(KeepAlive::default())
}

/// Several choices of one Chat Completions request as one stream: each chunk
/// renumbered to its choice under the first choice's id, usage summed into one
/// final chunk (with `include_usage`), then `[DONE]`. A failure of any choice
/// ends the whole stream with the error.
fn sse_choices<P>(
    streams: Vec<(ChoiceChunks<P>, FailureSlot, SharedCounts)>,
    include_usage: bool,
    id: String,
) -> impl IntoResponse
where
    P: Api,
    ChunkOf<P>: Serialize + Send + 'static,
{
    let flavor = P::FLAVOR;
    let usages: Arc<Mutex<Vec<Option<Value>>>> = Arc::new(Mutex::new(vec![None; streams.len()]));
    let mut failures = Vec::new();
    let mut mapped = Vec::new();
    for (index, (chunks, failure, counts)) in streams.into_iter().enumerate() {
        failures.push(failure);
        let (usages, id) = (usages.clone(), id.clone());
        mapped.push(chunks.map(move |chunk| match chunk {
            Ok(chunk) => {
                let mut value =
                    serde_json::to_value(&chunk).unwrap_or_else(|e| serde_json::json!({"error": e.to_string()}));
                patch_reasoning_tokens(&mut value, &counts.lock().expect("not poisoned"));
                value["id"] = Value::from(id.clone());
                if let Some(choices) = value["choices"].as_array_mut() {
                    choices.iter_mut().for_each(|c| c["index"] = Value::from(index));
                }
                if let Some(usage) = value.as_object_mut().and_then(|o| o.remove("usage")).filter(|u| !u.is_null()) {
                    usages.lock().expect("not poisoned")[index] = Some(usage);
                }
                let empty = value["choices"].as_array().is_some_and(Vec::is_empty);
                if include_usage {
                    value["usage"] = Value::Null;
                }
                (!empty).then(|| SseEvent::default().data(value.to_string()))
            }
            Err(e) => {
                let error = ApiError::new(flavor, Kind::Internal, e.to_string());
                Some(stream_error(P::STREAM_FAILURE, &error, &Seen::default()))
            }
        }));
    }
    let failures = Arc::new(failures);
    let watched = failures.clone();
    let failed = move || watched.iter().any(|f| f.lock().expect("not poisoned").is_some());
    let events =
        stream::select_all(mapped).take_while(move |_| std::future::ready(!failed())).filter_map(|e| async move { e });
    let tail = stream::once(async move {
        if let Some(f) = failures.iter().find_map(|f| f.lock().expect("not poisoned").take()) {
            return stream::iter(vec![stream_error(P::STREAM_FAILURE, &f.api(flavor), &Seen::default())]);
        }
        let mut out = Vec::new();
        let usages = usages.lock().expect("not poisoned");
        if let (true, Some(Some(first))) = (include_usage, usages.first()) {
            let mut usage = first.clone();
            let extra: u64 = usages.iter().skip(1).flatten().filter_map(|u| u["completion_tokens"].as_u64()).sum();
            for key in ["completion_tokens", "total_tokens"] {
                if let Some(v) = usage[key].as_u64() {
                    usage[key] = Value::from(v + extra);
                }
            }
            let last = serde_json::json!({"id": id, "object": "chat.completion.chunk", "choices": [], "usage": usage});
            out.push(SseEvent::default().data(last.to_string()));
        }
        out.push(SseEvent::default().data("[DONE]"));
        stream::iter(out)
    })
    .flatten();
    Sse::new(events.chain(tail).map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default())
}

/// The protocol chunks of one choice.
type ChoiceChunks<P> =
    std::pin::Pin<Box<dyn Stream<Item = Result<ChunkOf<P>, deepseek_recipe::stream::StreamError>> + Send>>;

/// OpenAI's streamed usage: without `include_usage` no chunk carries it; with it,
/// every chunk has `usage: null` and one more chunk after the last carries the
/// usage with empty `choices`.
fn split_usage(mut chunk: Value, include_usage: bool) -> Vec<Value> {
    let Some(obj) = chunk.as_object_mut() else { return vec![chunk] };
    let usage = obj.remove("usage").filter(|u| !u.is_null());
    if !include_usage {
        return vec![chunk];
    }
    obj.insert("usage".into(), Value::Null);
    let Some(usage) = usage else { return vec![chunk] };
    let mut last = obj.clone();
    last.insert("choices".into(), Value::Array(Vec::new()));
    last.insert("usage".into(), usage);
    vec![chunk, Value::Object(last)]
}

/// Validate, convert and encode one request (CPU work, off the reactor).
fn prepare<P: Api>(state: &AppState, body: &[u8], images: &Gathered, seed: Option<u64>) -> Result<Prepared, ApiError> {
    let flavor = P::FLAVOR;
    let bad = |m: String| ApiError::bad_request(flavor, m);
    let mut obj = parse_object(flavor, body)?;
    state.check_model(flavor, obj.get("model").and_then(Value::as_str))?;
    fields::check(P::FIELDS, &obj).map_err(bad)?;
    params::inline_text_documents(&mut obj);
    params::refuse_attachments(&obj).map_err(bad)?;
    super::images::substitute(state, &obj, images).map_err(bad)?;
    params::check_tool_choice(&obj).map_err(bad)?;
    let mut vllm = vllm::take(&mut obj).map_err(bad)?;
    let strict = strict::take(&mut obj);
    if flavor == Flavor::Anthropic {
        anthropic_out::restore_ids(&mut obj);
    }
    let thinking_budget = params::thinking_budget(&obj).map_err(bad)?;
    // Fields the recipe does not carry: sampling extensions (some protocols lack
    // `seed` and `top_k`; `ignore_eos` gives fixed output lengths, as in vLLM).
    let ext = params::extensions(&obj).map_err(bad)?;
    let parallel_calls = P::parallel_tool_calls(&obj).map_err(bad)?;
    let forces_any_tool = P::forces_any_tool(&obj);
    let include_usage = P::include_usage(&obj).map_err(bad)?;
    let choices = params::choices(&mut obj).map_err(bad)?;
    let retention = match flavor {
        Flavor::OpenAi => retention::openai(&mut obj),
        Flavor::Anthropic => retention::anthropic(&mut obj),
    }
    .map_err(bad)?;
    let grammar = P::rewrite(&mut obj).map_err(bad)?;
    let grammar = vllm.merge_format(grammar, &obj).map_err(bad)?;
    let request: P = serde_json::from_value(Value::Object(obj)).map_err(|e| bad(format!("invalid request: {e}")))?;
    let mut converted = request.convert(state.conversion.clone()).map_err(|e| ApiError::conversion(flavor, e))?;
    if forces_any_tool && !converted.conversation.tools.is_empty() {
        super::tool_grammar::force_tool_call(&mut converted).map_err(bad)?;
    }
    let mut prompt = state
        .encoding
        .encode(&converted.conversation)
        .map_err(|e| bad(format!("cannot encode the conversation: {e}")))?;
    vllm.shape_prompt(&mut prompt, &converted, &state.tokenizer, state.context).map_err(bad)?;
    // Each image's placeholder becomes its span (the resize runs here, off the
    // engine thread); the context and `max_tokens` then count the span's tokens.
    let started = Instant::now();
    let (prompt, images) = super::images::expand(state, prompt, images).map_err(bad)?;
    if !images.is_empty() {
        let tokens = images.iter().map(|i| i.plan.tokens()).sum();
        super::metrics::images_prepared(images.len(), tokens, started.elapsed());
    }
    let max_tokens = converted
        .resolve_max_tokens(prompt.len().min(u32::MAX as usize) as u32, state.context.min(u32::MAX as usize) as u32)
        .map_err(|e| ApiError::conversion(flavor, e))?;
    if vllm.min_tokens > max_tokens as usize {
        return Err(bad(format!("`min_tokens` ({}) is more than `max_tokens` ({max_tokens})", vllm.min_tokens)));
    }
    let rules = vllm.output_rules(&mut converted.parsing_options.stop_sequences);

    let options = &converted.inference_options;
    // Without a seed each request draws its own stream, as a hosted API does.
    let seed = seed
        .or(options.seed)
        .or(ext.seed)
        .unwrap_or_else(|| mix(state.id_salt ^ state.counter.fetch_add(1, Ordering::Relaxed)));
    let top = if options.logprobs { usize::from(options.top_logprobs.unwrap_or(0)) } else { 0 };
    let ignore_eos = ext.ignore_eos;
    let params = ext.sampling(options.temperature.unwrap_or(1.0), options.top_p.unwrap_or(1.0), seed, top);
    params.validate(state.vocab).map_err(|e| bad(e.to_string()))?;

    let format = match (&options.output_constraint, grammar) {
        (_, Some(g)) => Some(g),
        (Some(OutputConstraint::Json { schema }), None) => {
            Some(OutputFormat::Json(strict.json_target(&converted.conversation.response_format, schema.as_ref())))
        }
        (Some(OutputConstraint::Regex(rx)), None) => Some(OutputFormat::Regex(rx.clone())),
        // A required or named choice: the prompt ends inside the tool-call block,
        // and the grammar makes the output a valid call of the given tools.
        (Some(OutputConstraint::ToolCalls { tools, required: true }), None) => Some(OutputFormat::ToolCalls {
            tools: tools
                .iter()
                .map(|t| ToolSpec { name: t.name.clone(), parameters: strict.tool_parameters(&t.name, &t.parameters) })
                .collect(),
            at_most_one: !parallel_calls,
        }),
        // With `auto` the model chooses; its calls are parsed from the output
        // (one at most without parallel calls: see `Limits::one_call`).
        (Some(OutputConstraint::ToolCalls { .. }) | None, None) => None,
    };
    let parsing = &converted.parsing_options;
    let thinking =
        !parsing.starts_in_tool_calls && parsing.thinking_initial_stage.is_some_and(|s| s.starts_in_reasoning());
    let limits = Limits {
        min_tokens: vllm.min_tokens,
        stop_token_ids: vllm.stop_token_ids.clone(),
        thinking_budget: thinking_budget.filter(|_| thinking),
        one_call: !parallel_calls
            && matches!(options.output_constraint, Some(OutputConstraint::ToolCalls { required: false, .. })),
    };
    let constraint: Option<RequestConstraint> = match format {
        None if !limits.any() => None,
        format => {
            let size = match &format {
                None => 0,
                Some(OutputFormat::Json(schema)) => schema.as_ref().map_or(0, |s| s.to_string().len()),
                Some(OutputFormat::Regex(s) | OutputFormat::Lark(s)) => s.len(),
                Some(OutputFormat::ToolCalls { tools, .. }) => {
                    tools.iter().map(|t| t.parameters.to_string().len()).sum()
                }
            };
            if size > MAX_GRAMMAR_BYTES {
                return Err(bad(format!("the output format is larger than {MAX_GRAMMAR_BYTES} bytes")));
            }
            let factory = state
                .constraints
                .as_ref()
                .ok_or_else(|| bad("structured output is not available: the tokenizer is not byte-level".into()))?;
            Some(factory.build_described(format, max_tokens as usize, thinking, limits).map_err(bad)?)
        }
    };
    let mut request = Request::new(prompt, max_tokens as usize).with_params(params);
    request.ignore_eos = ignore_eos;
    request.retention = retention;
    request.stop_token_ids = vllm.stop_token_ids;
    request.priority = vllm.priority;
    request.images = images;
    let logprobs = options.logprobs;
    let n = state.counter.fetch_add(1, Ordering::Relaxed);
    let id = match vllm.request_id {
        // vLLM's response id: the protocol's prefix and the caller's id.
        Some(rid) => format!("{}{rid}", P::ID_PREFIX),
        None => format!("{}{:016x}{:08x}", P::ID_PREFIX, mix(state.id_salt ^ n), n & 0xffff_ffff),
    };
    Ok(Prepared { converted, request, constraint, logprobs, include_usage, thinking, choices, id, rules })
}

/// SplitMix64's finaliser: spreads a counter into an id or a seed.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
