//! Prometheus metrics through the `metrics` facade; `GET /metrics` renders them.
//!
//! Each series is exported twice: as `deepinfer_*`, and under the name vLLM gives
//! it (`vllm:*`, with a `model_name` label), so dashboards built for vLLM work
//! unchanged. Token counts are those the responses report (a final EOS that
//! ended a stop is not a token of the response, and is not counted).

use std::sync::OnceLock;
use std::time::Duration;

use deepinfer_engine::request::{Finished, RequestError};
use deepinfer_engine::scheduler::Scheduler;
use deepinfer_engine::speculative::SpeculativeStats;
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
pub const E2E: &str = "deepinfer_e2e_request_latency_seconds";
pub const QUEUE_TIME: &str = "deepinfer_request_queue_time_seconds";
pub const REQUEST_PROMPT_TOKENS: &str = "deepinfer_request_prompt_tokens";
pub const REQUEST_GENERATION_TOKENS: &str = "deepinfer_request_generation_tokens";
pub const SPEC_DRAFTS: &str = "deepinfer_spec_decode_draft_tokens_total";
pub const SPEC_ACCEPTED: &str = "deepinfer_spec_decode_accepted_tokens_total";
pub const SPEC_VERIFICATIONS: &str = "deepinfer_spec_decode_verifications_total";
pub const SPEC_PROPOSED: &str = "deepinfer_spec_decode_proposed_tokens_total";
pub const IMAGES_PREPARED: &str = "deepinfer_images_prepared_total";
pub const IMAGE_TOKENS: &str = "deepinfer_image_tokens_total";
pub const IMAGE_PREPARE: &str = "deepinfer_image_prepare_seconds";

/// vLLM's names for the same series (`vllm:` metrics of vLLM's V1 engine).
pub mod vllm {
    pub const RUNNING: &str = "vllm:num_requests_running";
    pub const WAITING: &str = "vllm:num_requests_waiting";
    pub const KV_USAGE: &str = "vllm:kv_cache_usage_perc";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
    pub const TTFT: &str = "vllm:time_to_first_token_seconds";
    pub const INTER_TOKEN: &str = "vllm:inter_token_latency_seconds";
    pub const E2E: &str = "vllm:e2e_request_latency_seconds";
    pub const QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
    pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
    pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
    pub const PREEMPTIONS: &str = "vllm:num_preemptions_total";
    pub const SUCCESS: &str = "vllm:request_success_total";
    pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
    pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
    pub const SPEC_DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
    pub const SPEC_DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
    pub const SPEC_ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens_total";
}

/// The `model_name` label of the `vllm:` series.
static MODEL_NAME: OnceLock<String> = OnceLock::new();

/// Name the served model in the `vllm:` series (first call wins: one model per process).
pub fn set_model_name(name: &str) {
    let _ = MODEL_NAME.set(name.to_string());
}

fn model() -> String {
    MODEL_NAME.get().cloned().unwrap_or_default()
}

/// Token-count buckets of the request length histograms.
const TOKEN_BUCKETS: &[f64] =
    &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0];

/// Latency buckets, in seconds, from 1 ms to 1 min.
const BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The process-wide recorder (the `metrics` facade has one global recorder).
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let mut builder = PrometheusBuilder::new().set_buckets(BUCKETS).expect("buckets are not empty");
            for name in [
                REQUEST_PROMPT_TOKENS,
                REQUEST_GENERATION_TOKENS,
                vllm::REQUEST_PROMPT_TOKENS,
                vllm::REQUEST_GENERATION_TOKENS,
            ] {
                builder = builder
                    .set_buckets_for_metric(metrics_exporter_prometheus::Matcher::Full(name.into()), TOKEN_BUCKETS)
                    .expect("buckets are not empty");
            }
            let recorder = builder.build_recorder();
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
    describe_histogram!(E2E, Unit::Seconds, "From request arrival to its end");
    describe_histogram!(QUEUE_TIME, Unit::Seconds, "From request arrival to its first scheduled step");
    describe_histogram!(REQUEST_PROMPT_TOKENS, "Prompt tokens per finished request");
    describe_histogram!(REQUEST_GENERATION_TOKENS, "Generated tokens per finished request");
    super::cache_metrics::describe();
    describe_counter!(IMAGES_PREPARED, "Images laid out as spans of generation requests (decoded, planned, resized)");
    describe_counter!(IMAGE_TOKENS, "Prompt tokens of image spans in generation requests");
    describe_histogram!(
        IMAGE_PREPARE,
        Unit::Seconds,
        "Resizing and patching one request's images, off the engine thread"
    );
    describe_counter!(SPEC_PROPOSED, "Draft tokens proposed by the draft head");
    describe_counter!(SPEC_DRAFTS, "Draft tokens the target verified");
    describe_counter!(SPEC_ACCEPTED, "Verified draft tokens the target accepted");
    describe_counter!(SPEC_VERIFICATIONS, "Request-steps that verified at least one draft");
    describe_counter!(vllm::SPEC_DRAFTS, "Verifications (vLLM name)");
    describe_counter!(vllm::SPEC_DRAFT_TOKENS, "Draft tokens verified (vLLM name)");
    describe_counter!(vllm::SPEC_ACCEPTED, "Draft tokens accepted (vLLM name)");
    describe_gauge!(vllm::RUNNING, "Requests running (vLLM name)");
    describe_gauge!(vllm::WAITING, "Requests waiting (vLLM name)");
    describe_gauge!(vllm::KV_USAGE, "KV cache usage, 0 to 1 (vLLM name)");
    describe_counter!(vllm::PROMPT_TOKENS, "Prompt tokens (vLLM name)");
    describe_counter!(vllm::GENERATION_TOKENS, "Generated tokens (vLLM name)");
    describe_histogram!(vllm::TTFT, Unit::Seconds, "Time to first token (vLLM name)");
    describe_histogram!(vllm::INTER_TOKEN, Unit::Seconds, "Inter-token latency (vLLM name)");
    describe_histogram!(vllm::E2E, Unit::Seconds, "End-to-end request latency (vLLM name)");
    describe_histogram!(vllm::QUEUE_TIME, Unit::Seconds, "Queue time (vLLM name)");
    describe_histogram!(vllm::REQUEST_PROMPT_TOKENS, "Prompt tokens per request (vLLM name)");
    describe_histogram!(vllm::REQUEST_GENERATION_TOKENS, "Generated tokens per request (vLLM name)");
    describe_counter!(vllm::PREEMPTIONS, "Preemptions (vLLM name)");
    describe_counter!(vllm::SUCCESS, "Finished requests by finished_reason (vLLM name)");
    describe_counter!(vllm::PREFIX_QUERIES, "Prompt tokens looked up in the prefix cache (vLLM name)");
    describe_counter!(vllm::PREFIX_HITS, "Prompt tokens found in the prefix cache (vLLM name)");
}

/// A generation request's images laid out: how many, their spans' tokens, the time it took.
pub fn images_prepared(images: usize, tokens: usize, took: Duration) {
    counter!(IMAGES_PREPARED).increment(images as u64);
    counter!(IMAGE_TOKENS).increment(tokens as u64);
    histogram!(IMAGE_PREPARE).record(took.as_secs_f64());
}

pub fn ttft(d: Duration) {
    histogram!(TTFT).record(d.as_secs_f64());
    histogram!(vllm::TTFT, "model_name" => model()).record(d.as_secs_f64());
}

pub fn inter_token(d: Duration) {
    histogram!(INTER_TOKEN).record(d.as_secs_f64());
    histogram!(vllm::INTER_TOKEN, "model_name" => model()).record(d.as_secs_f64());
}

pub fn queue_time(d: Duration) {
    histogram!(QUEUE_TIME).record(d.as_secs_f64());
    histogram!(vllm::QUEUE_TIME, "model_name" => model()).record(d.as_secs_f64());
}

pub fn generated(n: usize) {
    counter!(GENERATED_TOKENS).increment(n as u64);
    counter!(vllm::GENERATION_TOKENS, "model_name" => model()).increment(n as u64);
}

pub fn prompt(n: usize) {
    counter!(PROMPT_TOKENS).increment(n as u64);
    counter!(vllm::PROMPT_TOKENS, "model_name" => model()).increment(n as u64);
}

/// A request ended; `e2e` since it arrived, `generated` tokens as its response counts them.
pub fn finished(f: &Finished, e2e: Duration, generated: usize) {
    counter!(FINISHED, "reason" => f.reason.as_str()).increment(1);
    counter!(PREFIX_HIT_TOKENS).increment(f.cached_tokens as u64);
    counter!(PREEMPTIONS).increment(u64::from(f.preemptions));
    histogram!(E2E).record(e2e.as_secs_f64());
    histogram!(REQUEST_PROMPT_TOKENS).record(f.prompt_tokens as f64);
    histogram!(REQUEST_GENERATION_TOKENS).record(generated as f64);
    let m = model();
    counter!(vllm::SUCCESS, "model_name" => m.clone(), "finished_reason" => f.reason.as_str()).increment(1);
    counter!(vllm::PREEMPTIONS, "model_name" => m.clone()).increment(u64::from(f.preemptions));
    counter!(vllm::PREFIX_QUERIES, "model_name" => m.clone()).increment(f.prompt_tokens as u64);
    counter!(vllm::PREFIX_HITS, "model_name" => m.clone()).increment(f.cached_tokens as u64);
    histogram!(vllm::E2E, "model_name" => m.clone()).record(e2e.as_secs_f64());
    histogram!(vllm::REQUEST_PROMPT_TOKENS, "model_name" => m.clone()).record(f.prompt_tokens as f64);
    histogram!(vllm::REQUEST_GENERATION_TOKENS, "model_name" => m).record(generated as f64);
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
    let m = model();
    gauge!(vllm::RUNNING, "model_name" => m.clone()).set(s.num_running() as f64);
    gauge!(vllm::WAITING, "model_name" => m.clone()).set(s.num_waiting() as f64);
    let usage = if pool.budget_bytes == 0 { 0.0 } else { pool.used_bytes as f64 / pool.budget_bytes as f64 };
    gauge!(vllm::KV_USAGE, "model_name" => m).set(usage);
}

/// Speculative decoding's running totals, read from the engine after each step.
pub fn speculative(s: &SpeculativeStats) {
    counter!(SPEC_PROPOSED).absolute(s.proposed);
    counter!(SPEC_DRAFTS).absolute(s.verified);
    counter!(SPEC_ACCEPTED).absolute(s.accepted);
    counter!(SPEC_VERIFICATIONS).absolute(s.verifications);
    let m = model();
    counter!(vllm::SPEC_DRAFTS, "model_name" => m.clone()).absolute(s.verifications);
    counter!(vllm::SPEC_DRAFT_TOKENS, "model_name" => m.clone()).absolute(s.verified);
    counter!(vllm::SPEC_ACCEPTED, "model_name" => m).absolute(s.accepted);
}
