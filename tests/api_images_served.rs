//! Images served end to end by a real `deepinfer serve --model
//! builtin:tiny-v41-vision` and a real HTTP client: scikit-image's
//! `chelsea.png` and `coffee.png` through the three protocols, usage and
//! `/tokenize` counting each image's span, a prefill in small chunks giving
//! the same tokens as one chunk, and the prefix cache keyed by the image: two
//! different images with the same token ids never share KV, the same image
//! again hits.

mod serve_support;

use base64::Engine;
use reqwest::Client;
use serde_json::{json, Value};
use serve_support::Served;

const MODEL: &str = "tiny-v41-vision";
const CHAT: &str = "/v1/chat/completions";
/// The image token of `tiny-v41-vision` (`image_token_id`: the vocabulary's size less two).
const IMAGE_TOKEN: u64 = 1022;

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images").join(name)).unwrap()
}

fn data_url(name: &str) -> String {
    let media = if name.ends_with(".png") { "image/png" } else { "image/jpeg" };
    format!("data:{media};base64,{}", base64::engine::general_purpose::STANDARD.encode(fixture(name)))
}

fn serve(extra: &[&str]) -> Served {
    let mut args = vec!["--model", "builtin:tiny-v41-vision"];
    args.extend_from_slice(extra);
    Served::start(&args)
}

/// A user turn of text, the images, and text after them.
fn messages(images: &[&str]) -> Value {
    let mut parts = vec![json!({"type": "text", "text": "Compare these pictures."})];
    parts.extend(images.iter().map(|name| json!({"type": "image_url", "image_url": {"url": data_url(name)}})));
    parts.push(json!({"type": "text", "text": "Which one is warmer, and why?"}));
    json!([{"role": "user", "content": parts}])
}

/// A request whose tokens are a function of its logits: a fixed seed (thinking
/// mode samples at the protocol's own temperature, so no greedy request here).
fn seeded(images: &[&str], max_tokens: u32) -> Value {
    json!({"model": MODEL, "max_tokens": max_tokens, "seed": 7, "messages": messages(images)})
}

async fn post(s: &Served, path: &str, body: &Value) -> Value {
    let r = Client::new().post(s.url(path)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{path}: {v}");
    v
}

/// The generated text: thinking, then the answer.
fn tokens(v: &Value) -> String {
    let message = &v["choices"][0]["message"];
    let text = |key: &str| message[key].as_str().unwrap_or_default().to_string();
    format!("{}|{}", text("reasoning_content"), text("content"))
}

async fn prompt_ids(s: &Served, images: &[&str]) -> Vec<u64> {
    let v = post(s, "/tokenize", &json!({"messages": messages(images)})).await;
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[tokio::test]
async fn images_are_read_through_each_protocol_and_counted() {
    let s = serve(&[]);
    let ids = prompt_ids(&s, &["chelsea.png", "coffee.png"]).await;
    let spans = ids.iter().filter(|&&t| t == IMAGE_TOKEN).count();
    // Two spans of START + (IMAGE × w + NEWLINE) × h + END, each at least 1×1.
    assert!(spans >= 2 * 4, "{spans} image tokens in {ids:?}");
    let v = post(&s, CHAT, &seeded(&["chelsea.png", "coffee.png"], 4)).await;
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, ids.len(), "usage counts the spans: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");

    let b64 = base64::engine::general_purpose::STANDARD.encode(fixture("coffee.png"));
    let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}});
    let content = json!([block, {"type": "text", "text": "What is in the cup?"}]);
    let count = post(
        &s,
        "/v1/messages/count_tokens",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": content}]}),
    )
    .await;
    let body = json!({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}]});
    let v = post(&s, "/v1/messages", &body).await;
    // Anthropic's input_tokens leaves out the tokens read from or written to the cache.
    let u = &v["usage"];
    let input =
        ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"].map(|k| u[k].as_u64().unwrap());
    assert_eq!(input.iter().sum::<u64>(), count["input_tokens"].as_u64().unwrap(), "{v} {count}");
    // Sampled at the protocol's temperature: it may end before max_tokens.
    assert!(["max_tokens", "end_turn"].contains(&v["stop_reason"].as_str().unwrap()), "{v}");

    let body = json!({"model": MODEL, "max_output_tokens": 16, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."},
        {"type": "input_image", "image_url": data_url("chelsea.png"), "detail": "auto"}]}]});
    let v = post(&s, "/v1/responses", &body).await;
    assert!(["incomplete", "completed"].contains(&v["status"].as_str().unwrap()), "{v}");
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > spans as u64 / 2, "{v}");

    // Four images laid out (the counting routes count, they do not prepare).
    let metrics = Client::new().get(s.url("/metrics")).send().await.unwrap().text().await.unwrap();
    let line = metrics.lines().find(|l| l.starts_with("deepinfer_images_prepared_total")).expect("the images counter");
    assert!(line.ends_with(" 4"), "{line}");
    assert!(metrics.contains("deepinfer_image_prepare_seconds_count 3"), "three requests with images");
}

#[tokio::test]
async fn a_prefill_in_small_chunks_gives_the_tokens_of_one_chunk() {
    let whole = serve(&[]);
    let chunked = serve(&["--max-batch-tokens", "16"]);
    let body = seeded(&["chelsea.png", "coffee.png"], 16);
    let (a, b) = (post(&whole, CHAT, &body).await, post(&chunked, CHAT, &body).await);
    assert_eq!(a["usage"]["completion_tokens"], 16, "{a}");
    assert_eq!(tokens(&a), tokens(&b), "one chunk: {a}\nchunks of 16: {b}");
}

#[tokio::test]
async fn two_images_never_share_kv_and_the_same_image_hits() {
    let s = serve(&[]);
    // chelsea (451×300) and coffee (600×400) have one aspect ratio, so one plan:
    // their prompts are the same token ids, only the pixels differ.
    let (chelsea, coffee) = (prompt_ids(&s, &["chelsea.png"]).await, prompt_ids(&s, &["coffee.png"]).await);
    assert_eq!(chelsea, coffee, "equal plans give equal ids");
    let first_image = chelsea.iter().position(|&t| t == IMAGE_TOKEN).unwrap();
    let span_end = chelsea.iter().rposition(|&t| t == IMAGE_TOKEN).unwrap() + 1;

    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
    let a = post(&s, CHAT, &seeded(&["chelsea.png"], 8)).await;
    let b = post(&s, CHAT, &seeded(&["coffee.png"], 8)).await;
    assert!(cached(&b) <= first_image, "coffee reused {} cached tokens past the image at {first_image}", cached(&b));
    // What coffee.png gives on a server that never saw chelsea.png.
    let fresh = serve(&[]);
    assert_eq!(tokens(&b), tokens(&post(&fresh, CHAT, &seeded(&["coffee.png"], 8)).await), "coffee's own KV");

    let again = post(&s, CHAT, &seeded(&["chelsea.png"], 8)).await;
    assert!(cached(&again) >= span_end, "the same image hit only {} of {span_end} tokens", cached(&again));
    assert_eq!(tokens(&again), tokens(&a), "a hit gives the same tokens");
}
