//! Prometheus metrics through the `metrics` facade. Names start with
//! `deepinfer_`; `GET /metrics` renders them.

use std::sync::OnceLock;
use std::time::Duration;

use deepinfer_engine::request::{Finished, RequestError};
use deepinfer_engine::scheduler::Scheduler;
use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

pub const QUEUE_DEPTH: &str = "deepinfer_queue_depth";
pub const RUNNING: &str = "deepinfer_running_requests";
pub const KV_USED_BYTES: &str = "deepinfer_kv_used_bytes";
pub const KV_BUDGET_BYTES: &str = "deepinfer_kv_budget_bytes";
pub const KV_BLOCKS: &str = "deepinfer_kv_blocks_in_use";
pub const PREFIX_CACHE_BLOCKS: &str = "deepinfer_prefix_cache_blocks";
pub const TTFT: &str = "deepinfer_time_to_first_token_seconds";
pub const INTER_TOKEN: &str = "deepinfer_inter_token_latency_seconds";
pub const PROMPT_TOKENS: &str = "deepinfer_prompt_tokens_total";
pub const GENERATED_TOKENS: &str = "deepinfer_generation_tokens_total";
pub const PREFIX_HIT_TOKENS: &str = "deepinfer_prefix_cache_hit_tokens_total";
pub const PREEMPTIONS: &str = "deepinfer_preemptions_total";
pub const FINISHED: &str = "deepinfer_requests_finished_total";
pub const REJECTED: &str = "deepinfer_requests_rejected_total";
pub const HTTP_ERRORS: &str = "deepinfer_http_errors_total";

/// Latency buckets, in seconds, from 1 ms to 1 min.
const BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The process-wide recorder (the `metrics` facade has one global recorder).
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder =
                PrometheusBuilder::new().set_buckets(BUCKETS).expect("buckets are not empty").build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (an embedding program); then ours stays empty.
            let _ = metrics::set_global_recorder(recorder);
            describe();
            handle
        })
        .clone()
}

fn describe() {
    describe_gauge!(QUEUE_DEPTH, "Requests waiting for admission to the engine");
    describe_gauge!(RUNNING, "Requests admitted and running in the engine");
    describe_gauge!(KV_USED_BYTES, Unit::Bytes, "KV cache bytes in use (running requests and prefix cache)");
    describe_gauge!(KV_BUDGET_BYTES, Unit::Bytes, "KV cache budget");
    describe_gauge!(KV_BLOCKS, "KV blocks in use, all kinds (running requests and prefix cache)");
    describe_gauge!(PREFIX_CACHE_BLOCKS, "Blocks held by the prefix cache");
    describe_histogram!(TTFT, Unit::Seconds, "From request arrival to its first generated token");
    describe_histogram!(INTER_TOKEN, Unit::Seconds, "Between consecutive generated tokens of a request");
    describe_counter!(PROMPT_TOKENS, "Prompt tokens of admitted requests");
    describe_counter!(GENERATED_TOKENS, "Generated tokens");
    describe_counter!(PREFIX_HIT_TOKENS, "Prompt tokens served by the prefix cache");
    describe_counter!(PREEMPTIONS, "Preemptions of finished requests");
    describe_counter!(FINISHED, "Finished requests by finish reason");
    describe_counter!(REJECTED, "Requests the engine refused, by reason");
    describe_counter!(HTTP_ERRORS, "Error responses by status code");
}

pub fn ttft(d: Duration) {
    histogram!(TTFT).record(d.as_secs_f64());
}

pub fn inter_token(d: Duration) {
    histogram!(INTER_TOKEN).record(d.as_secs_f64());
}

pub fn generated(n: usize) {
    counter!(GENERATED_TOKENS).increment(n as u64);
}

pub fn prompt(n: usize) {
    counter!(PROMPT_TOKENS).increment(n as u64);
}

pub fn finished(f: &Finished) {
    counter!(FINISHED, "reason" => f.reason.as_str()).increment(1);
    counter!(PREFIX_HIT_TOKENS).increment(f.cached_tokens as u64);
    counter!(PREEMPTIONS).increment(u64::from(f.preemptions));
}

pub fn rejected(e: &RequestError) {
    let reason = match e {
        RequestError::QueueFull { .. } => "queue_full",
        RequestError::PromptTooLong { .. } | RequestError::ExceedsKvBudget { .. } => "too_long",
        _ => "invalid",
    };
    counter!(REJECTED, "reason" => reason).increment(1);
}

pub fn http_error(status: u16) {
    counter!(HTTP_ERRORS, "status" => status.to_string()).increment(1);
}

/// Gauges read from the scheduler after each engine step.
pub fn engine_gauges(s: &Scheduler) {
    let pool = s.pool_stats();
    gauge!(QUEUE_DEPTH).set(s.num_waiting() as f64);
    gauge!(RUNNING).set(s.num_running() as f64);
    gauge!(KV_USED_BYTES).set(pool.used_bytes as f64);
    gauge!(KV_BUDGET_BYTES).set(pool.budget_bytes as f64);
    gauge!(KV_BLOCKS).set(pool.blocks.iter().sum::<usize>() as f64);
    gauge!(PREFIX_CACHE_BLOCKS).set(s.cached_blocks() as f64);
}
