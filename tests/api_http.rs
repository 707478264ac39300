//! HTTP-level behaviour of `deepinfer serve` with a real client and raw sockets:
//! JSON bodies for every error status (405, 415, early 413, 429 with
//! `Retry-After`), images refused by a model without a vision tower.

mod serve_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use reqwest::Client;
use serde_json::{json, Value};
use serve_support::Served;

const CHAT: &str = "/v1/chat/completions";
const MESSAGES: &str = "/v1/messages";

fn chat(prompt: &str, max_tokens: u32) -> Value {
    json!({"model": "tiny-v4", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
           "thinking": {"type": "disabled"}})
}

/// `host:port` of a served base URL.
fn addr(s: &Served) -> String {
    s.base.trim_start_matches("http://").to_string()
}

#[tokio::test]
async fn wrong_methods_and_media_types_get_json_errors() {
    let s = Served::start(&[]);
    let c = Client::new();
    let r = c.get(s.url(CHAT)).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    let r = c.delete(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 405);

    let text = chat("Hi", 2).to_string();
    let r = c.post(s.url(CHAT)).header("content-type", "text/plain").body(text.clone()).send().await.unwrap();
    assert_eq!(r.status(), 415);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("text/plain"), "{body}");
    let r = c.post(s.url(MESSAGES)).header("content-type", "application/x-www-form-urlencoded").body("a=b").send();
    let r = r.await.unwrap();
    assert_eq!(r.status(), 415);
    assert_eq!(r.json::<Value>().await.unwrap()["type"], "error");
    // JSON with parameters in its media type is JSON.
    let r = c.post(s.url(CHAT)).header("content-type", "application/json; charset=utf-8").body(text).send().await;
    assert_eq!(r.unwrap().status(), 200);
}

#[test]
fn a_declared_oversized_body_is_refused_before_it_is_sent() {
    let s = Served::start(&["--max-body-bytes", "4096"]);
    let mut stream = TcpStream::connect(addr(&s)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // Headers only: a server that waited for the gigabyte would never answer.
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n",
        addr(&s)
    );
    stream.write_all(head.as_bytes()).unwrap();
    let mut answer = vec![0u8; 4096];
    let n = stream.read(&mut answer).expect("answered without the body");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("request_too_large") && answer.contains("1000000000"), "{answer}");
}

#[tokio::test]
async fn a_429_says_when_to_retry() {
    let s = Served::start(&["--max-concurrent-requests", "1"]);
    let c = Client::new();
    let mut long = chat("Tell me a long story", 2000);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let held = c.post(s.url(CHAT)).json(&long).send().await.unwrap();
    assert_eq!(held.status(), 200);
    let r = c.post(s.url(CHAT)).json(&chat("Hi", 2)).send().await.unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "rate_limit_error");
    drop(held);
}

#[tokio::test]
async fn images_to_a_model_without_a_vision_tower_are_refused() {
    let s = Served::start(&[]);
    let c = Client::new();
    let png = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/images/chelsea.png")).unwrap();
    let data = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, png);
    let image = json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}});
    let body = json!({"model": "tiny-v4", "max_tokens": 4,
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]});
    let r = c.post(s.url(CHAT)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("has no vision tower"), "{body}");
    let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}});
    let body = json!({"model": "tiny-v4", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]});
    let r = c.post(s.url(MESSAGES)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn clients_that_never_finish_their_headers_do_not_stop_others_and_are_closed() {
    let s = Served::start(&["--header-timeout-ms", "1500"]);
    let started = std::time::Instant::now();
    let mut slow = Vec::new();
    for i in 0..100 {
        let mut stream = TcpStream::connect(addr(&s)).unwrap();
        // Half of them send part of a request head, the others nothing at all.
        if i % 2 == 0 {
            stream.write_all(format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: appl").as_bytes()).unwrap();
        }
        slow.push(stream);
    }
    let c = Client::new();
    let r = c.post(s.url(CHAT)).json(&chat("Hi", 4)).send().await.unwrap();
    assert_eq!(r.status(), 200, "served while 100 connections stall");
    assert!(started.elapsed() < Duration::from_millis(1500), "served before the stalled ones time out");
    // Each stalled connection is closed once its time is up: a read ends.
    for mut stream in slow {
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 512];
        match stream.read(&mut buf) {
            // EOF, or an error status before the close.
            Ok(n) => assert!(n == 0 || buf.starts_with(b"HTTP/1.1"), "{:?}", &buf[..n]),
            Err(e) => assert!(
                e.kind() == std::io::ErrorKind::ConnectionReset,
                "stalled connection still open after {:?}: {e}",
                started.elapsed()
            ),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn metrics_count_what_the_responses_report_under_vllm_names_too() {
    let s = Served::start(&[]);
    let c = Client::new();
    let (mut prompt, mut generated) = (0u64, 0u64);
    for (i, max_tokens) in [3u32, 9, 17, 30].into_iter().enumerate() {
        let mut body = chat(&format!("Request number {i}"), max_tokens);
        body["seed"] = json!(i);
        let r: Value = c.post(s.url(CHAT)).json(&body).send().await.unwrap().json().await.unwrap();
        prompt += r["usage"]["prompt_tokens"].as_u64().unwrap();
        generated += r["usage"]["completion_tokens"].as_u64().unwrap();
    }
    let r: Value = c
        .post(s.url(MESSAGES))
        .json(&json!({"model": "tiny-v4", "max_tokens": 12, "messages": [{"role": "user", "content": "Hi"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    prompt +=
        r["usage"]["input_tokens"].as_u64().unwrap() + r["usage"]["cache_read_input_tokens"].as_u64().unwrap_or(0);
    generated += r["usage"]["output_tokens"].as_u64().unwrap();

    let label = "{model_name=\"tiny-v4\"}";
    // Gauges are set after the engine step that finished the last request.
    s.wait_metric(&c, &format!("vllm:num_requests_running{label}"), |v| v == 0.0).await;
    let text = c.get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let value = |name: &str| serve_support::metric_value(&text, name).unwrap_or_else(|| panic!("{name} missing"));
    assert_eq!(value("deepinfer_generation_tokens_total"), generated as f64, "responses say {generated}");
    assert_eq!(value(&format!("vllm:generation_tokens_total{label}")), generated as f64);
    assert_eq!(value(&format!("vllm:prompt_tokens_total{label}")), prompt as f64);
    assert_eq!(value(&format!("vllm:num_requests_running{label}")), 0.0);
    assert_eq!(value(&format!("vllm:num_requests_waiting{label}")), 0.0);
    for histogram in [
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
    ] {
        assert_eq!(value(&format!("{histogram}{label}")), 5.0, "{histogram}");
    }
    assert_eq!(value(&format!("vllm:request_generation_tokens_sum{label}")), generated as f64);
    assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"tiny-v4\"}"), "{text}");
}

#[tokio::test]
async fn a_body_that_never_arrives_gets_408_and_others_are_served() {
    let s = Served::start(&["--body-timeout-ms", "800"]);
    let mut stalled = TcpStream::connect(addr(&s)).unwrap();
    let head = format!(
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\": "
    );
    stalled.write_all(head.as_bytes()).unwrap();
    let c = Client::new();
    let r = c.post(s.url(CHAT)).json(&chat("Hi", 4)).send().await.unwrap();
    assert_eq!(r.status(), 200, "served while a body stalls");
    stalled.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = vec![0u8; 4096];
    let n = stalled.read(&mut answer).expect("answered after the body timeout");
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("request_timeout"), "{answer}");
}
