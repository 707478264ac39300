//! Load generator for `deepinfer serve`: N concurrent streaming Chat
//! Completions requests; reports errors, time to first token and throughput.
//!
//! ```sh
//! cargo run --release -- serve --listen 127.0.0.1:8000 &
//! cargo run --release --example loadgen -- --url http://127.0.0.1:8000 --concurrency 200 --requests 200
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use futures_util::StreamExt;
use serde_json::{json, Value};

#[derive(Parser, Debug)]
struct Args {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Model name to send.
    #[arg(long, default_value = "tiny-v4")]
    model: String,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Requests in all.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Tokens generated per request (EOS ignored, so every request makes exactly this many).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// API key, if the server wants one.
    #[arg(long)]
    api_key: Option<String>,
}

/// What one request measured.
struct Outcome {
    ttft: Duration,
    total: Duration,
    completion_tokens: u64,
}

async fn one(client: &reqwest::Client, args: &Args, i: usize) -> Result<Outcome, String> {
    let system = "You are the support assistant of Northwind Shipping. Answer in one or two short sentences, \
                  quote the parcel number, and offer to open a ticket when a parcel is late.";
    let body = json!({
        "model": args.model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("Where is parcel {i}?")}],
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "seed": i,
        "stream": true,
        "stream_options": {"include_usage": true},
        "thinking": {"type": "disabled"},
        "ignore_eos": true,
    });
    let start = Instant::now();
    let mut request = client.post(format!("{}/v1/chat/completions", args.url)).json(&body);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request.send().await.map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("HTTP {}: {}", response.status(), response.text().await.unwrap_or_default()));
    }
    let mut body = response.bytes_stream();
    let mut buffer = String::new();
    let (mut ttft, mut tokens, mut done) = (None, None, false);
    while let Some(bytes) = body.next().await {
        buffer.push_str(&String::from_utf8_lossy(&bytes.map_err(|e| e.to_string())?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else { continue };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let chunk: Value = serde_json::from_str(data).map_err(|e| format!("bad chunk {data}: {e}"))?;
            if chunk.get("error").is_some() {
                return Err(format!("stream error: {data}"));
            }
            // The first chunk is sent with the first generated token.
            ttft.get_or_insert_with(|| start.elapsed());
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n);
            }
        }
    }
    match (ttft, tokens, done) {
        (Some(ttft), Some(completion_tokens), true) => Ok(Outcome { ttft, total: start.elapsed(), completion_tokens }),
        _ => Err("the stream ended early".into()),
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let client = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build().expect("client");
    let start = Instant::now();
    let results: Vec<Result<Outcome, String>> = futures_util::stream::iter(0..args.requests)
        .map(|i| {
            let (client, args) = (&client, &args);
            async move { one(client, args, i).await }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;
    let wall = start.elapsed().as_secs_f64();
    let mut errors = Vec::new();
    let mut ttft = Vec::new();
    let mut per_request = Vec::new();
    let mut tokens = 0;
    for r in results {
        match r {
            Ok(o) => {
                ttft.push(o.ttft.as_secs_f64() * 1e3);
                let decode = (o.total - o.ttft).as_secs_f64();
                if o.completion_tokens > 1 && decode > 0.0 {
                    per_request.push((o.completion_tokens - 1) as f64 / decode);
                }
                tokens += o.completion_tokens;
            }
            Err(e) => errors.push(e),
        }
    }
    ttft.sort_by(f64::total_cmp);
    per_request.sort_by(f64::total_cmp);
    println!(
        "{} requests, concurrency {}, {} tokens each: {} ok, {} errors in {wall:.2} s",
        args.requests,
        args.concurrency,
        args.max_tokens,
        ttft.len(),
        errors.len()
    );
    println!(
        "TTFT ms: p50 {:.1}, p90 {:.1}, p99 {:.1}, max {:.1}",
        percentile(&ttft, 50.0),
        percentile(&ttft, 90.0),
        percentile(&ttft, 99.0),
        ttft.last().copied().unwrap_or(f64::NAN)
    );
    println!(
        "throughput: {tokens} generated tokens, {:.0} tokens/s; per request after the first token: p50 {:.1} tokens/s",
        tokens as f64 / wall,
        percentile(&per_request, 50.0)
    );
    for e in errors.iter().take(5) {
        println!("error: {e}");
    }
    if !errors.is_empty() {
        std::process::exit(1);
    }
}
