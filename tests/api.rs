//! The HTTP API over a real `deepinfer serve` process: errors in each
//! protocol's shape, limits, API keys, cancellation, streaming, sampling,
//! structured output and metrics.

mod serve_support;

use futures_util::StreamExt;
use reqwest::{Client, StatusCode};
use serde_json::{json, Value};
use serve_support::Served;

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";
const RESPONSES: &str = "/v1/responses";

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({
        "model": "tiny-v4",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "thinking": {"type": "disabled"},
    })
}

fn message(content: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny-v4", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
}

/// A streamed request that runs to the end of the context (about a second
/// on tiny-v4): long enough to hold a slot while the test looks.
fn long_stream() -> Value {
    let mut long = chat("Tell me a long story", 4000);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    long
}

async fn post(client: &Client, s: &Served, path: &str, body: &Value) -> (StatusCode, Value) {
    let r = client.post(s.url(path)).json(body).send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap())
}

async fn post_raw(client: &Client, s: &Served, path: &str, body: &str) -> (StatusCode, Value) {
    let r = client.post(s.url(path)).header("content-type", "application/json").body(body.to_string());
    let r = r.send().await.unwrap();
    let status = r.status();
    (status, r.json().await.unwrap())
}

/// An OpenAI error body of `kind` (and `code`, if given).
fn openai_error(body: &Value, kind: &str, code: Option<&str>) {
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(body["error"].get("param").is_some(), "{body}");
    if let Some(code) = code {
        assert_eq!(body["error"]["code"], code, "{body}");
    }
}

/// An Anthropic error body of `kind`.
fn anthropic_error(body: &Value, kind: &str) {
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
}

/// Text of the content deltas of an OpenAI chat stream, and its last chunk.
/// The streamed content, every chunk, and whether `[DONE]` ended it.
async fn read_chat_stream(r: reqwest::Response) -> (String, Vec<Value>, bool) {
    let text = r.text().await.unwrap();
    let mut content = String::new();
    let mut chunks = Vec::new();
    let mut done = false;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        if let Some(c) = chunk["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
        chunks.push(chunk);
    }
    (content, chunks, done)
}

#[tokio::test]
async fn malformed_bodies_unknown_models_and_routes_get_the_protocols_errors() {
    let s = Served::start(&[]);
    let c = Client::new();
    let (status, body) = post_raw(&c, &s, CHAT, "{not json").await;
    assert_eq!(status, 400);
    openai_error(&body, "invalid_request_error", None);
    assert!(body["error"]["message"].as_str().unwrap().contains("not valid JSON"), "{body}");
    let (status, body) = post_raw(&c, &s, MESSAGES, "[1, 2]").await;
    assert_eq!(status, 400);
    anthropic_error(&body, "invalid_request_error");
    let (status, body) = post(&c, &s, CHAT, &json!({"model": "tiny-v4"})).await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("messages"), "{body}");
    let (status, body) = post(&c, &s, RESPONSES, &json!({"model": "tiny-v4", "input": 7})).await;
    assert_eq!(status, 400);
    openai_error(&body, "invalid_request_error", None);

    let mut unknown = chat("Hi", 4);
    unknown["model"] = json!("gpt-4o");
    let (status, body) = post(&c, &s, CHAT, &unknown).await;
    assert_eq!(status, 404);
    openai_error(&body, "invalid_request_error", Some("model_not_found"));
    let (status, body) = post(&c, &s, RESPONSES, &json!({"model": "nope", "input": "Hi"})).await;
    assert_eq!(status, 404);
    openai_error(&body, "invalid_request_error", Some("model_not_found"));
    let mut unknown = message("Hi", 4);
    unknown["model"] = json!("claude-opus-4");
    let (status, body) = post(&c, &s, MESSAGES, &unknown).await;
    assert_eq!(status, 404);
    anthropic_error(&body, "not_found_error");

    let r = c.get(s.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    openai_error(&r.json().await.unwrap(), "invalid_request_error", Some("unknown_url"));
}

#[tokio::test]
async fn bad_parameters_and_prompts_over_the_context_are_400() {
    let s = Served::start(&[]);
    let c = Client::new();
    let with = |extra: Value| {
        let mut body = chat("Say something in json", 8);
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    for (extra, needle) in [
        (json!({"temperature": 5.0}), "temperature"),
        (json!({"top_p": 1.5}), "top_p"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"max_tokens": 5000}), "max_tokens"),
        (json!({"n": 17}), "n"),
        (json!({"top_k": "many"}), "top_k"),
        (json!({"logprobs": true, "top_logprobs": 50}), "top_logprobs"),
        (json!({"stop": 3}), "expected a string or a list"),
        (json!({"ignore_eos": "yes"}), "ignore_eos"),
        (json!({"response_format": {"type": "regex", "regex": "("}}), "output format"),
        (json!({"response_format": {"type": "grammar", "grammar": "start: missing"}}), "output format"),
        (json!({"response_format": {"type": "grammar"}}), "grammar"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "schema",
        ),
    ] {
        let (status, body) = post(&c, &s, CHAT, &with(extra.clone())).await;
        assert_eq!(status, 400, "{extra} → {body}");
        openai_error(&body, "invalid_request_error", None);
        let m = body["error"]["message"].as_str().unwrap().to_lowercase();
        assert!(m.contains(needle), "{extra}: {m}");
    }
    let (status, body) = post(&c, &s, MESSAGES, &json!({"model": "tiny-v4", "messages": [], "max_tokens": 4})).await;
    assert_eq!(status, 400, "{body}");
    anthropic_error(&body, "invalid_request_error");
    let (status, body) = post(
        &c,
        &s,
        MESSAGES,
        &json!({"model": "tiny-v4", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 3}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    anthropic_error(&body, "invalid_request_error");

    // The tiny model's context is 4096 tokens.
    let long: String = (0..5000).map(|i| format!("{i} ")).collect();
    let (status, body) = post(&c, &s, CHAT, &chat(&long, 8)).await;
    assert_eq!(status, 400);
    openai_error(&body, "invalid_request_error", Some("context_length_exceeded"));
    assert!(body["error"]["message"].as_str().unwrap().contains("maximum context length is 4096"), "{body}");
    let (status, body) = post(&c, &s, MESSAGES, &message(&long, 8)).await;
    assert_eq!(status, 400);
    anthropic_error(&body, "invalid_request_error");

    // Still serving after all that.
    let (status, body) = post(&c, &s, CHAT, &chat("Hi", 3)).await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn a_full_queue_and_too_many_requests_in_flight_get_429() {
    let c = Client::new();
    // One running, one waiting: the third is refused.
    let s = Served::start(&["--max-batch-size", "1", "--max-queue", "1"]);
    let long = long_stream();
    let first = c.post(s.url(CHAT)).json(&long).send().await.unwrap();
    assert_eq!(first.status(), 200);
    // A stream's headers come back when it is queued; it takes the one batch
    // slot a moment later, and until then the second would find the queue full.
    s.wait_metric(&c, "deepinfer_running_requests", |v| v == 1.0).await;
    let second = c.post(s.url(CHAT)).json(&long).send().await.unwrap();
    assert_eq!(second.status(), 200);
    s.wait_metric(&c, "deepinfer_queue_depth", |v| v == 1.0).await;
    let (status, body) = post(&c, &s, CHAT, &chat("Hi", 4)).await;
    assert_eq!(status, 429, "{body}");
    openai_error(&body, "rate_limit_error", Some("rate_limit_exceeded"));
    assert!(body["error"]["message"].as_str().unwrap().contains("queue is full"), "{body}");
    let (status, body) = post(&c, &s, MESSAGES, &message("Hi", 4)).await;
    assert_eq!(status, 429);
    anthropic_error(&body, "rate_limit_error");
    drop((first, second));
    s.wait_metric(&c, "deepinfer_running_requests", |v| v == 0.0).await;
    assert_eq!(post(&c, &s, CHAT, &chat("Hi", 2)).await.0, 200, "served again once they left");

    // At most one request in flight.
    let s = Served::start(&["--max-concurrent-requests", "1"]);
    let held = c.post(s.url(CHAT)).json(&long).send().await.unwrap();
    assert_eq!(held.status(), 200);
    let (status, body) = post(&c, &s, CHAT, &chat("Hi", 4)).await;
    assert_eq!(status, 429);
    assert!(body["error"]["message"].as_str().unwrap().contains("in flight"), "{body}");
    drop(held);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let s = Served::start(&["--max-body-bytes", "2048"]);
    let c = Client::new();
    let big = chat(&"word ".repeat(1000), 4);
    let (status, body) = post(&c, &s, CHAT, &big).await;
    assert_eq!(status, 413);
    openai_error(&body, "invalid_request_error", Some("request_too_large"));
    let (status, body) = post(&c, &s, MESSAGES, &message(&"word ".repeat(1000), 4)).await;
    assert_eq!(status, 413);
    anthropic_error(&body, "request_too_large");
    assert_eq!(post(&c, &s, CHAT, &chat("small", 2)).await.0, 200);
}

#[tokio::test]
async fn the_api_key_is_required_when_set() {
    // From the environment variable; the flag works the same.
    let s = Served::start_with_env(&[], &[("DEEPINFER_API_KEY", "sekret")]);
    let c = Client::new();
    let (status, body) = post(&c, &s, CHAT, &chat("Hi", 2)).await;
    assert_eq!(status, 401);
    openai_error(&body, "invalid_request_error", Some("invalid_api_key"));
    let r = c.post(s.url(CHAT)).bearer_auth("wrong").json(&chat("Hi", 2)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c.post(s.url(CHAT)).bearer_auth("sekret").json(&chat("Hi", 2)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let (status, body) = post(&c, &s, MESSAGES, &message("Hi", 2)).await;
    assert_eq!(status, 401);
    anthropic_error(&body, "authentication_error");
    let r = c.post(s.url(MESSAGES)).header("x-api-key", "sekret").json(&message("Hi", 2)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(c.get(s.url("/v1/models")).send().await.unwrap().status(), 401);
    assert_eq!(c.get(s.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.url("/metrics")).send().await.unwrap().status(), 200);
}

#[tokio::test]
async fn a_client_that_disconnects_cancels_its_request_and_frees_its_kv() {
    let s = Served::start(&["--prefix-cache", "off"]);
    let c = Client::new();
    let cancelled = "deepinfer_requests_finished_total{reason=\"cancelled\"}";
    let r = c.post(s.url(CHAT)).json(&long_stream()).send().await.unwrap();
    let mut body = r.bytes_stream();
    body.next().await.unwrap().unwrap();
    body.next().await.unwrap().unwrap();
    s.wait_metric(&c, "deepinfer_running_requests", |v| v == 1.0).await;
    assert!(s.metric(&c, "deepinfer_kv_blocks_in_use").await > 0.0);
    assert!(s.metric(&c, "deepinfer_kv_used_bytes").await > 0.0);
    drop(body);
    s.wait_metric(&c, cancelled, |v| v == 1.0).await;
    s.wait_metric(&c, "deepinfer_running_requests", |v| v == 0.0).await;
    assert_eq!(s.metric(&c, "deepinfer_kv_blocks_in_use").await, 0.0);
    assert_eq!(s.metric(&c, "deepinfer_kv_used_bytes").await, 0.0);

    // A non-streamed request whose client gives up while it runs is cancelled too.
    let mut long = long_stream();
    long["stream"] = json!(false);
    let request = c.post(s.url(CHAT)).json(&long).send();
    let pending = tokio::spawn(request);
    s.wait_metric(&c, "deepinfer_running_requests", |v| v == 1.0).await;
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());
    s.wait_metric(&c, cancelled, |v| v == 2.0).await;
    s.wait_metric(&c, "deepinfer_kv_blocks_in_use", |v| v == 0.0).await;
}

#[tokio::test]
async fn streamed_and_plain_chat_agree_and_stop_sequences_cut_the_text() {
    let s = Served::start(&[]);
    let c = Client::new();
    let mut greedy = chat("Once upon a time", 24);
    greedy["temperature"] = json!(0);
    let (status, plain) = post(&c, &s, CHAT, &greedy).await;
    assert_eq!(status, 200, "{plain}");
    let text = plain["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(plain["usage"]["completion_tokens"].as_u64().unwrap() <= 24);
    assert!(plain["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = c.post(s.url(CHAT)).json(&streamed).send().await.unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let (content, chunks, done) = read_chat_stream(r).await;
    assert!(done, "ends with [DONE]");
    assert_eq!(content, text, "same tokens streamed or not");
    // OpenAI's include_usage: a last chunk with empty choices carries the usage;
    // every other chunk has `usage: null`; the finish reason comes just before.
    let (last, rest) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    assert_eq!(last["usage"]["completion_tokens"], plain["usage"]["completion_tokens"]);
    assert!(rest.iter().all(|c| c["usage"].is_null() && c.as_object().unwrap().contains_key("usage")));
    assert_eq!(rest.last().unwrap()["choices"][0]["finish_reason"], plain["choices"][0]["finish_reason"]);
    // Without it, no chunk carries usage.
    streamed.as_object_mut().unwrap().remove("stream_options");
    let r = c.post(s.url(CHAT)).json(&streamed).send().await.unwrap();
    let (content, chunks, _) = read_chat_stream(r).await;
    assert_eq!(content, text);
    assert!(chunks.iter().all(|c| !c.as_object().unwrap().contains_key("usage")), "{chunks:?}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], plain["choices"][0]["finish_reason"]);

    // A stop sequence taken from the middle of the text cuts it there.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "enough text: {text:?}");
    let stop: String = chars[4..7].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    let mut stopped = greedy.clone();
    stopped["stop"] = json!([stop]);
    let (_, body) = post(&c, &s, CHAT, &stopped).await;
    assert_eq!(body["choices"][0]["message"]["content"], cut, "stop {stop:?}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let mut stopped_stream = stopped.clone();
    stopped_stream["stream"] = json!(true);
    let (content, _, _) = read_chat_stream(c.post(s.url(CHAT)).json(&stopped_stream).send().await.unwrap()).await;
    assert_eq!(content, cut);
}

#[tokio::test]
async fn sampling_parameters_reach_the_engine() {
    let s = Served::start(&[]);
    let c = Client::new();
    let sampled = |seed: u64| {
        let mut b = chat("Write a poem", 16);
        b["temperature"] = json!(1.0);
        b["top_p"] = json!(0.9);
        b["seed"] = json!(seed);
        b
    };
    let text = |b: Value| b["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let a = text(post(&c, &s, CHAT, &sampled(7)).await.1);
    assert_eq!(a, text(post(&c, &s, CHAT, &sampled(7)).await.1), "same seed, same text");
    assert_ne!(a, text(post(&c, &s, CHAT, &sampled(8)).await.1), "another seed, another text");

    // Messages has no `seed` field; the extension keeps runs repeatable there too.
    let mut m = message("Write a poem", 12);
    m["seed"] = json!(3);
    m["top_k"] = json!(20);
    m["thinking"] = json!({"type": "disabled"});
    let (status, first) = post(&c, &s, MESSAGES, &m).await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(first["content"], post(&c, &s, MESSAGES, &m).await.1["content"]);
    assert!(first["usage"]["output_tokens"].as_u64().unwrap() <= 12);

    // max_tokens bounds the output and reports `length`.
    let (_, body) = post(&c, &s, CHAT, &chat("Hi", 3)).await;
    let finish = body["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() <= 3);
    assert!(finish == "length" || finish == "stop", "{body}");
}

#[tokio::test]
async fn regex_grammar_and_json_object_outputs_match() {
    let s = Served::start(&[]);
    let c = Client::new();
    let rx = regex_lite_check;
    for seed in 0..6 {
        let mut b = chat("Answer yes or no", 16);
        b["seed"] = json!(seed);
        b["response_format"] = json!({"type": "regex", "regex": "(yes|no)(, because [a-z]{1,12})?"});
        let (status, body) = post(&c, &s, CHAT, &b).await;
        assert_eq!(status, 200, "{body}");
        let out = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(rx(out), "{out:?}");

        let mut g = chat("Pick", 8);
        g["seed"] = json!(seed);
        g["response_format"] =
            json!({"type": "grammar", "grammar": "start: colour \"!\"\ncolour: \"red\" | \"green\" | \"blue\""});
        let (status, body) = post(&c, &s, CHAT, &g).await;
        assert_eq!(status, 200, "{body}");
        let out = body["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(["red!", "green!", "blue!"].contains(&out), "{out:?}");

        let mut j = chat("Reply in json", 48);
        j["seed"] = json!(seed);
        j["response_format"] = json!({"type": "json_object"});
        let (status, body) = post(&c, &s, CHAT, &j).await;
        assert_eq!(status, 200, "{body}");
        let out = body["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(out).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        assert!(v.is_object(), "{out}");
    }
}

/// `(yes|no)(, because [a-z]{1,12})?`, checked by hand.
fn regex_lite_check(s: &str) -> bool {
    let rest = s.strip_prefix("yes").or_else(|| s.strip_prefix("no"));
    match rest {
        Some("") => true,
        Some(r) => r
            .strip_prefix(", because ")
            .is_some_and(|w| (1..=12).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())),
        None => false,
    }
}

#[tokio::test]
async fn metrics_report_queue_tokens_latency_and_kv() {
    let s = Served::start(&[]);
    let c = Client::new();
    let system =
        "You are the support assistant of Northwind Shipping. Answer briefly and quote the parcel number. ".repeat(4);
    for i in 0..2 {
        let b = json!({
            "model": "tiny-v4",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("Where is parcel {i}?")}],
            "max_tokens": 4,
            "thinking": {"type": "disabled"},
        });
        let (status, body) = post(&c, &s, CHAT, &b).await;
        assert_eq!(status, 200);
        if i == 1 {
            assert!(body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0, "{body}");
        }
    }
    let text = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    for name in [
        "deepinfer_queue_depth",
        "deepinfer_running_requests",
        "deepinfer_kv_used_bytes",
        "deepinfer_kv_budget_bytes",
        "deepinfer_kv_blocks_in_use",
        "deepinfer_prefix_cache_blocks",
        "deepinfer_time_to_first_token_seconds_bucket",
        "deepinfer_inter_token_latency_seconds_count",
        "deepinfer_generation_tokens_total",
        "deepinfer_prompt_tokens_total",
    ] {
        assert!(text.contains(name), "{name} missing from\n{text}");
    }
    let value = |name: &str| serve_support::metric_value(&text, name).unwrap_or(0.0);
    assert_eq!(
        value("deepinfer_requests_finished_total{reason=\"length\"}")
            + value("deepinfer_requests_finished_total{reason=\"stop\"}"),
        2.0
    );
    assert!(value("deepinfer_prefix_cache_hit_tokens_total") > 0.0);
    // A request whose first token is EOS still has a time to first token.
    assert_eq!(value("deepinfer_time_to_first_token_seconds_count"), 2.0, "{text}");
    assert!(value("deepinfer_generation_tokens_total") >= 2.0);
}
