//! Image input through a real `deepinfer serve` and a real HTTP client: the
//! parts of the three protocols read up to the capability check (tiny-v4 has
//! no vision tower), each limit's 400 naming the field, the typed image token
//! refused, and URL fetching: off by default, and with `--image-fetch` against
//! a local HTTP server (allowed with `--image-fetch-allow`), forbidden
//! addresses, redirects, a slow server and a body over the limit.

mod serve_support;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use reqwest::Client;
use serde_json::{json, Value};
use serve_support::Served;

const CHAT: &str = "/v1/chat/completions";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images").join(name)).unwrap()
}

fn data_url(name: &str, media: &str) -> String {
    format!("data:{media};base64,{}", base64::engine::general_purpose::STANDARD.encode(fixture(name)))
}

fn chelsea() -> String {
    data_url("chelsea.png", "image/png")
}

fn chat_with(parts: Vec<Value>) -> Value {
    json!({"model": "tiny-v4", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]})
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// POST `body` to `path`; the status and the error message (OpenAI's or Anthropic's shape).
async fn post(s: &Served, path: &str, body: &Value) -> (u16, String) {
    let r = Client::new().post(s.url(path)).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    (status, v["error"]["message"].as_str().unwrap_or_default().to_string())
}

async fn refused(s: &Served, path: &str, body: &Value, names: &[&str]) {
    let (status, message) = post(s, path, body).await;
    assert_eq!(status, 400, "{message}");
    for name in names {
        assert!(message.contains(name), "{name:?} not in {message:?}");
    }
}

#[tokio::test]
async fn images_of_each_protocol_reach_the_capability_check() {
    let s = Served::start(&[]);
    let text = json!({"type": "text", "text": "What is this?"});
    let no_tower = ["has no vision tower", "`tiny-v4`"];
    let body = chat_with(vec![text.clone(), image_part(&chelsea())]);
    refused(&s, CHAT, &body, &[&["`messages[0].content[1].image_url.url`"], &no_tower[..]].concat()).await;
    let coffee = data_url("coffee.jpg", "image/jpeg");
    let part = json!({"type": "image_url", "image_url": {"url": coffee, "detail": "high"}});
    refused(&s, CHAT, &chat_with(vec![part, text.clone()]), &no_tower).await;

    let b64 = base64::engine::general_purpose::STANDARD.encode(fixture("coffee.jpg"));
    let block = json!({"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": b64}});
    let body = json!({"model": "tiny-v4", "max_tokens": 4, "messages": [{"role": "user", "content": [block]}]});
    let r = Client::new().post(s.url("/v1/messages")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("`messages[0].content[0].source.data`") && message.contains("no vision tower"), "{v}");

    let url_block = json!({"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/x.png"}});
    let body = json!({"model": "tiny-v4", "max_tokens": 4, "messages": [{"role": "user", "content": [url_block]}]});
    refused(&s, "/v1/messages", &body, &["`messages[0].content[0].source.url`", "--image-fetch"]).await;

    let input = |part: Value| {
        json!({"model": "tiny-v4", "max_output_tokens": 4, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"}, part]}]})
    };
    let body = input(json!({"type": "input_image", "image_url": chelsea(), "detail": "auto"}));
    refused(&s, "/v1/responses", &body, &["`input[0].content[1].image_url`", "no vision tower"]).await;
    let body = input(json!({"type": "input_image", "file_id": "file-123"}));
    refused(&s, "/v1/responses", &body, &["`input[0].content[1].file_id`", "not supported"]).await;

    let low = json!({"type": "image_url", "image_url": {"url": chelsea(), "detail": "low"}});
    refused(&s, CHAT, &chat_with(vec![low]), &["`messages[0].content[0].image_url.detail`", "\"low\""]).await;
    // /tokenize does not make up image token counts.
    let body = json!({"messages": [{"role": "user", "content": [image_part(&chelsea())]}]});
    refused(&s, "/tokenize", &body, &["`messages[0].content[0].image_url.url`", "no vision tower"]).await;
}

#[tokio::test]
async fn each_limit_is_a_400_naming_the_field_and_the_limit() {
    let s = Served::start(&["--max-images", "2", "--max-image-bytes", "20000", "--max-image-request-bytes", "15000"]);
    let coffee = data_url("coffee.jpg", "image/jpeg");
    let three = chat_with(vec![image_part(&coffee), image_part(&coffee), image_part(&coffee)]);
    refused(&s, CHAT, &three, &["`messages[0].content[2]`", "more than 2 images"]).await;
    let big = chat_with(vec![image_part(&chelsea())]);
    refused(&s, CHAT, &big, &["`messages[0].content[0].image_url.url`", "20000 bytes (the limit per image)"]).await;
    let two = chat_with(vec![image_part(&coffee), image_part(&coffee)]);
    refused(&s, CHAT, &two, &["`messages[0].content[1].image_url.url`", "15000 bytes together"]).await;
    let long = format!("https://example.com/{}", "a".repeat(9000));
    refused(&s, CHAT, &chat_with(vec![image_part(&long)]), &["image_url.url`", "the limit is 8192"]).await;
    let cases = [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a PNG, JPEG, WebP or GIF"),
        ("data:image/png;base64,@@@@", "base64 data is invalid"),
        ("data:text/plain;base64,aGVsbG8=", "\"text/plain\""),
        ("ftp://example.com/a.png", "data URL or an http(s) URL"),
    ];
    for (url, why) in cases {
        refused(&s, CHAT, &chat_with(vec![image_part(url)]), &["`messages[0].content[0].image_url.url`", why]).await;
    }
    let system = json!({"model": "tiny-v4", "max_tokens": 4, "messages": [
        {"role": "system", "content": [image_part(&coffee)]}, {"role": "user", "content": "Hi"}]});
    refused(&s, CHAT, &system, &["`messages[0].content[0]`", "only in the content of user messages"]).await;

    let s = Served::start(&["--max-image-side", "300", "--max-image-pixels", "10000"]);
    let body = chat_with(vec![image_part(&chelsea())]);
    refused(&s, CHAT, &body, &["image_url.url`", "451×300 pixels; a side may be at most 300"]).await;
    let body = chat_with(vec![image_part(&coffee)]);
    refused(&s, CHAT, &body, &["image_url.url`", "26600 pixels; the limit is 10000 per image"]).await;
}

#[tokio::test]
async fn the_image_token_cannot_be_typed() {
    let s = Served::start(&[]);
    let body = json!({"model": "tiny-v4", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "look: <｜image｜> here"}]});
    refused(&s, CHAT, &body, &["`messages[0].content`", "<｜image｜>", "image token"]).await;
    let body = json!({"model": "tiny-v4", "max_tokens": 4, "prompt": "a <｜image｜> b"});
    refused(&s, "/v1/completions", &body, &["`prompt`", "<｜image｜>"]).await;
    let body = json!({"model": "tiny-v4", "max_tokens": 4, "messages": [{"role": "user", "content": "an image"}]});
    assert_eq!(post(&s, CHAT, &body).await.0, 200, "plain text is served");
}

/// A local HTTP server: `/chelsea.png`, `/redirect/N` (N redirects, then the image),
/// `/to/HOST` (a redirect to HOST's `/chelsea.png`), `/slow` (no answer for
/// 10 s), `/stream` (64 MiB without a length; `written` counts what got out)
/// and `/declared` (a 1 GB Content-Length).
struct Origin {
    port: u16,
    written: Arc<AtomicUsize>,
}

impl Origin {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let written = Arc::new(AtomicUsize::new(0));
        let w = written.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(64).flatten() {
                let w = w.clone();
                std::thread::spawn(move || Self::answer(stream, port, &w));
            }
        });
        Self { port, written }
    }

    fn answer(mut stream: TcpStream, port: u16, written: &AtomicUsize) {
        let mut line = String::new();
        let mut reader = BufReader::new(stream.try_clone().unwrap());
        reader.read_line(&mut line).unwrap();
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        while reader.read_line(&mut line).map(|n| n > 2).unwrap_or(false) {
            line.clear();
        }
        let redirect = |to: String| {
            format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        };
        let head = match path.as_str() {
            "/chelsea.png" => {
                let png = fixture("chelsea.png");
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    png.len()
                );
                let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&png));
                return;
            }
            "/slow" => {
                std::thread::sleep(Duration::from_secs(10));
                return;
            }
            "/declared" => "HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n".to_string(),
            "/stream" => {
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n");
                let chunk = vec![0u8; 64 << 10];
                for _ in 0..1024 {
                    if stream.write_all(&chunk).is_err() {
                        return;
                    }
                    written.fetch_add(chunk.len(), Ordering::SeqCst);
                }
                return;
            }
            p if p.starts_with("/redirect/") => match p["/redirect/".len()..].parse::<u32>().unwrap_or(0) {
                0 | 1 => redirect("/chelsea.png".into()),
                n => redirect(format!("/redirect/{}", n - 1)),
            },
            p if p.starts_with("/to/") => redirect(format!("http://{}:{port}/chelsea.png", &p[4..])),
            _ => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string(),
        };
        let _ = stream.write_all(head.as_bytes());
        std::thread::sleep(Duration::from_millis(200));
    }

    fn url(&self, host: &str, path: &str) -> String {
        format!("http://{host}:{}{path}", self.port)
    }
}

#[tokio::test]
async fn image_urls_are_fetched_within_the_limits_from_allowed_addresses_only() {
    let origin = Origin::start();
    let s = Served::start(&[
        "--image-fetch",
        "--image-fetch-allow",
        "127.0.0.1/32",
        "--image-fetch-timeout-ms",
        "1500",
        "--image-fetch-max-redirects",
        "2",
        "--max-image-bytes",
        "1000000",
    ]);
    let fetch = |url: String| chat_with(vec![image_part(&url)]);
    let at = "`messages[0].content[0].image_url.url`";
    // Fetched, its header read: then refused because tiny-v4 has no tower.
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/chelsea.png")), &[at, "no vision tower"]).await;
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/redirect/2")), &[at, "no vision tower"]).await;
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/redirect/3")), &[at, "redirects more than 2 times"]).await;
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/nothing")), &[at, "404"]).await;
    for host in ["127.0.0.2", "[::1]", "0.0.0.0"] {
        refused(&s, CHAT, &fetch(origin.url(host, "/chelsea.png")), &[at, "does not fetch from"]).await;
    }
    let hop = format!("/to/{}", "127.0.0.2");
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", &hop)), &[at, "127.0.0.2 is an address"]).await;

    let started = Instant::now();
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/slow")), &[at, "longer than 1500 ms"]).await;
    assert!(started.elapsed() < Duration::from_secs(8), "the timeout cut the fetch: {:?}", started.elapsed());
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/declared")), &[at, "1000000 bytes (the limit per image)"]).await;
    refused(&s, CHAT, &fetch(origin.url("127.0.0.1", "/stream")), &[at, "1000000 bytes (the limit per image)"]).await;
    std::thread::sleep(Duration::from_millis(500));
    let written = origin.written.load(Ordering::SeqCst);
    assert!(written < 16 << 20, "the body was read on past the limit: {written} of 64 MiB written");

    // Without an allowed range, a name that resolves to loopback is refused after resolution.
    let s = Served::start(&["--image-fetch"]);
    let body = fetch(origin.url("localhost", "/chelsea.png"));
    refused(&s, CHAT, &body, &[at, "`localhost` resolves to", "does not fetch from"]).await;
}
