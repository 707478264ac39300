//! The HTTP API: OpenAI Chat Completions and Responses, Anthropic Messages
//! (each streamed as SSE or not), model list, health and Prometheus metrics.
//!
//! Only this module knows HTTP. A request is converted and its prompt encoded
//! with `deepseek-recipe` ([`generate`]), run by the engine thread
//! ([`engine_thread`]), and its generated token ids are turned back into
//! protocol chunks by the recipe's `StreamProcessor`.

pub mod anthropic_out;
pub mod cache_metrics;
pub mod cluster_thread;
pub mod completions;
pub mod constraint;
pub mod engine_thread;
pub mod errors;
pub mod failure;
pub mod fields;
pub mod generate;
pub mod health;
pub mod images;
pub mod inference;
pub mod json_scan;
pub mod limits;
pub mod metrics;
pub mod params;
pub mod protocols;
pub mod retention;
pub mod schema_bounds;
pub mod stops;
pub mod strict;
pub mod tool_grammar;
pub mod usage;
pub mod utility;
pub mod vllm;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deepinfer_engine::engine::EngineConfig;
use deepinfer_engine::model::Model;
use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::{ChatCompletionRequest, ResponsesRequest};
use deepseek_recipe::request::{ConversionOptions, ModelVersion};
use deepseek_recipe_encoding::dsv4::DeepseekV4Encoding;
use deepseek_recipe_encoding::PromptTokenizer;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

use self::constraint::ConstraintFactory;
use self::engine_thread::EngineHandle;
use self::errors::{ApiError, Flavor, Kind};

/// Settings of one server.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The name clients pass as `model`.
    pub model_name: String,
    pub api_key: Option<String>,
    /// Largest request body, in bytes.
    pub max_body_bytes: usize,
    /// Time a connection has to send a request's headers.
    pub header_timeout: std::time::Duration,
    /// Time a request has to send its whole body once its headers are in.
    pub body_timeout: std::time::Duration,
    /// Most generation requests held at once (queued, running or streaming).
    pub max_concurrent: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens_limit: u32,
    /// Thinking mode for requests that do not choose.
    pub default_thinking: bool,
    /// Engine limits; `max_waiting` is the queue beyond which requests get 429.
    pub engine: EngineConfig,
    /// The prompt cache's host and disk tiers.
    pub cache: crate::kv_disk::CacheSetup,
    /// Image limits and URL fetching.
    pub images: images::ImageConfig,
}

/// Everything a handler needs; shared by all of them.
pub struct AppState {
    pub config: ServeConfig,
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub encoding: DeepseekV4Encoding,
    pub conversion: ConversionOptions,
    /// `None` when the tokenizer is not byte-level: structured output is refused.
    pub constraints: Option<ConstraintFactory>,
    /// The model's context, in tokens.
    pub context: usize,
    pub vocab: usize,
    pub eos: u32,
    pub bos: u32,
    pub metrics: PrometheusHandle,
    /// Permits for generation requests in flight.
    pub in_flight: Arc<Semaphore>,
    /// Creation time reported by `/v1/models`.
    pub created: u64,
    /// Source of response ids and default seeds.
    pub counter: AtomicU64,
    pub id_salt: u64,
    /// Whether the model reads images (its image token), or why not.
    pub vision: images::Vision,
    /// The model's `vision_*` keys when it reads images here: each image's
    /// resize plan and span come from them.
    pub vision_config: Option<deepinfer_engine::v41::vision::VisionConfig>,
    /// Spellings of the image token refused in text.
    pub image_placeholders: Vec<String>,
    /// Image decodes running at once, at most one per core.
    pub decoders: Semaphore,
    /// `None` without `--image-fetch`.
    pub fetcher: Option<images::fetch::Fetcher>,
}

impl AppState {
    /// A 404 unless `model` (when given) names the served model.
    pub fn check_model(&self, flavor: Flavor, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.config.model_name => {
                let message =
                    format!("the model `{m}` does not exist; this server serves `{}`", self.config.model_name);
                Err(ApiError::new(flavor, Kind::ModelNotFound, message))
            }
            _ => Ok(()),
        }
    }

    /// Hand a request to the engine thread and wait until it is queued; its
    /// events follow on the returned receiver.
    pub async fn submit(
        &self,
        flavor: Flavor,
        request: deepinfer_engine::request::Request,
        constraint: Option<constraint::RequestConstraint>,
        arrived: std::time::Instant,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<engine_thread::Event>, ApiError> {
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let submission = engine_thread::Submission { request, constraint, events, arrived };
        self.engine.submit(submission).map_err(|e| match e {
            engine_thread::SubmitError::Busy => {
                ApiError::new(flavor, Kind::RateLimited, "the request queue is full; retry later")
            }
            engine_thread::SubmitError::Stopped => ApiError::new(flavor, Kind::Unavailable, "the engine has stopped"),
        })?;
        match rx.recv().await {
            Some(engine_thread::Event::Queued) => Ok(rx),
            Some(engine_thread::Event::Rejected(e)) => Err(ApiError::engine(flavor, &e)),
            _ => Err(ApiError::new(flavor, Kind::Unavailable, "the engine has stopped")),
        }
    }
}

/// A request body that must be a JSON object.
pub fn parse_object(flavor: Flavor, body: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    let bad = |m: String| ApiError::bad_request(flavor, m);
    match serde_json::from_slice(body).map_err(|e| bad(format!("the body is not valid JSON: {e}")))? {
        serde_json::Value::Object(map) => Ok(map),
        _ => Err(bad("the body must be a JSON object".into())),
    }
}

/// What runs the server's requests.
pub enum Runner {
    /// An engine in this process.
    Engine,
    /// A running cluster.
    Cluster(Box<ClusterRunner>),
}

/// A running cluster, reached as its client (`cluster` connected on `rt`)
/// whose schedulers follow `policy`, and which declares a silent node down
/// after `failure_timeout`.
pub struct ClusterRunner {
    pub rt: tokio::runtime::Runtime,
    pub cluster: deepinfer_actors::Cluster,
    pub policy: EngineConfig,
    pub failure_timeout: std::time::Duration,
}

/// A bound server, ready to run.
pub struct Server {
    listener: tokio::net::TcpListener,
    header_timeout: std::time::Duration,
    router: Router,
    engine_thread: std::thread::JoinHandle<()>,
}

impl Server {
    /// Start what runs the requests and bind `addr` (port 0 picks a free port).
    pub async fn bind(
        model: Arc<Model>,
        tokenizer: Tokenizer,
        config: ServeConfig,
        addr: SocketAddr,
        runner: Runner,
    ) -> anyhow::Result<Self> {
        let context = model.config.max_position_embeddings;
        let vocab = model.config.vocab_size;
        let eos = model.config.eos_token_id;
        let bos = model.config.bos_token_id;
        let constraints = match ConstraintFactory::new(&tokenizer, vocab, eos) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!("deepinfer: structured output disabled: {e:#}");
                None
            }
        };
        metrics::set_model_name(&config.model_name);
        let cluster = matches!(runner, Runner::Cluster(_));
        let (vision, image_placeholders) = images::vision_of(&model, &tokenizer, &config.model_name, cluster);
        let fetcher = config.images.fetch.enabled.then(|| images::fetch::Fetcher::new(&config.images.fetch));
        let fetcher = fetcher.transpose().context("cannot set up image fetching")?;
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        // Installed before the engine thread starts, which reports from its first moment.
        let metrics_handle = metrics::handle();
        let (engine, engine_thread) = match runner {
            Runner::Engine => engine_thread::spawn(Arc::clone(&model), config.engine.clone(), config.cache.clone())?,
            Runner::Cluster(c) => {
                let ClusterRunner { rt, cluster, policy, failure_timeout } = *c;
                cluster_thread::spawn(rt, cluster, &model, policy, (config.max_concurrent, failure_timeout))?
            }
        };
        let model_version = if vision.is_ok() { ModelVersion::DeepseekV41Flash } else { ModelVersion::DeepseekV4Pro };
        let conversion = ConversionOptions::new()
            // A model that reads images converts as V4.1-Flash, the version whose
            // image parts become image tokens (V4 turns them into text).
            .with_model_versions_by_name([(config.model_name.clone(), model_version)])
            .with_default_thinking_mode(config.default_thinking)
            .with_thinking_max_tokens_upper_bound(config.max_tokens_limit)
            .with_non_thinking_max_tokens_upper_bound(config.max_tokens_limit);
        let encoding = DeepseekV4Encoding::new().with_tokenizer(PromptTokenizer::new(&tokenizer));
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let state = Arc::new(AppState {
            in_flight: Arc::new(Semaphore::new(config.max_concurrent)),
            engine,
            tokenizer: Arc::new(tokenizer),
            encoding,
            conversion,
            constraints,
            context,
            vocab,
            eos,
            bos,
            metrics: metrics_handle,
            created: now.as_secs(),
            counter: AtomicU64::new(0),
            id_salt: now.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32),
            vision_config: vision.is_ok().then(|| model.v41.as_ref().and_then(|m| m.config.vision.clone())).flatten(),
            vision,
            image_placeholders,
            decoders: Semaphore::new(cores),
            fetcher,
            config,
        });
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        let header_timeout = state.config.header_timeout;
        Ok(Self { listener, header_timeout, router: router(state), engine_thread })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serve until `shutdown` resolves, then let the engine thread finish.
    ///
    /// Each connection gets `header_timeout` to send a request head: a client
    /// that never finishes its headers is closed, not kept forever.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> anyhow::Result<()> {
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let header_timeout = self.header_timeout;
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let (stream, _peer) = tokio::select! {
                accepted = self.listener.accept() => match accepted {
                    Ok(pair) => pair,
                    // Out of descriptors and the like: wait a little, keep serving.
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                },
                () = &mut shutdown => break,
            };
            let service = hyper_util::service::TowerToHyperService::new(self.router.clone());
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let watched = graceful.watch(connection);
            tokio::spawn(async move {
                let _ = watched.await;
            });
        }
        drop(self.router);
        graceful.shutdown().await;
        // The router (and with it every engine handle) is gone: the thread ends.
        let _ = tokio::task::spawn_blocking(move || self.engine_thread.join()).await;
        Ok(())
    }
}

/// The routes, with the body limit and the API key check.
pub fn router(state: Arc<AppState>) -> Router {
    let max_body = state.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(generate::handle::<ChatCompletionRequest>).fallback(method_not_allowed))
        .route("/v1/responses", post(generate::handle::<ResponsesRequest>).fallback(method_not_allowed))
        .route("/v1/completions", post(completions::handle).fallback(method_not_allowed))
        .route("/v1/messages", post(generate::handle::<MessagesRequest>).fallback(method_not_allowed))
        .route("/v1/models", get(models).fallback(method_not_allowed))
        .route("/v1/models/{id}", get(utility::model).fallback(method_not_allowed))
        .route("/v1/messages/count_tokens", post(utility::count_tokens).fallback(method_not_allowed))
        .route("/tokenize", post(utility::tokenize).fallback(method_not_allowed))
        .route("/detokenize", post(utility::detokenize).fallback(method_not_allowed))
        .route("/version", get(utility::version).fallback(method_not_allowed))
        .route("/health", get(health::ready).fallback(method_not_allowed))
        .route("/health/ready", get(health::ready).fallback(method_not_allowed))
        .route("/health/live", get(health::live).fallback(method_not_allowed))
        .route("/metrics", get(render_metrics).fallback(method_not_allowed))
        .fallback(not_found)
        // Outermost last: the API key is checked before any body is read.
        .layer(middleware::from_fn_with_state(state.clone(), check_body_headers))
        .layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// The protocol of a path, for its error bodies.
pub fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// With `--api-key`, every route but the health probes and `/metrics` needs it, as
/// `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic).
async fn require_api_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = &state.config.api_key else { return next.run(request).await };
    let path = request.uri().path();
    let open = matches!(path, "/health" | "/health/ready" | "/health/live" | "/metrics");
    if open || presented_key(request.headers()) == Some(key.as_str()) {
        return next.run(request).await;
    }
    let flavor = flavor_of(path);
    ApiError::new(flavor, Kind::Unauthorized, "missing or invalid API key").into_response()
}

fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// The one model, in a shape both SDKs read: OpenAI's list (`object`,
/// `created`, `owned_by`) and Anthropic's (`type`, `display_name`,
/// `created_at`, `has_more`).
async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let name = &state.config.model_name;
    Json(json!({
        "object": "list",
        "data": [model_object(&state)],
        "has_more": false,
        "first_id": name,
        "last_id": name,
    }))
}

/// The served model as both SDKs read one.
pub fn model_object(state: &AppState) -> serde_json::Value {
    let name = &state.config.model_name;
    json!({
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "deepinfer",
        "type": "model",
        "display_name": name,
        "created_at": rfc3339(state.created),
        "max_model_len": state.context,
    })
}

/// `YYYY-MM-DDTHH:MM:SSZ` of a Unix time (days to civil date: H. Hinnant's algorithm).
fn rfc3339(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    state.metrics.run_upkeep();
    if let Some(disk) = &state.engine.disk_stats {
        cache_metrics::update_disk(disk);
    }
    let text = state.metrics.render();
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

/// Before a body is read: a declared `Content-Length` over the limit is a 413 at
/// once, and a body that is not JSON (`Content-Type` other than
/// `application/json`, when one is given) a 415. Then the body is read within
/// `body_timeout` (408 past it) and the limit (413), so no handler waits on a client.
async fn check_body_headers(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let flavor = flavor_of(request.uri().path());
    let headers = request.headers();
    let limit = state.config.max_body_bytes;
    if let Some(length) = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()) {
        match length.trim().parse::<u64>() {
            Ok(n) if n > limit as u64 => {
                let message = format!("the request body is larger than {limit} bytes (Content-Length {n})");
                return ApiError::new(flavor, Kind::TooLarge, message).into_response();
            }
            Ok(_) => {}
            Err(_) => {
                let message = format!("Content-Length `{length}` is not a number");
                return ApiError::new(flavor, Kind::InvalidRequest, message).into_response();
            }
        }
    }
    if request.method() == axum::http::Method::POST {
        if let Some(kind) = headers.get(header::CONTENT_TYPE) {
            let media = kind.to_str().unwrap_or("").split(';').next().unwrap_or("").trim().to_ascii_lowercase();
            if media != "application/json" {
                let message = format!("the body must be JSON (Content-Type: application/json), not `{media}`");
                return ApiError::new(flavor, Kind::UnsupportedMediaType, message).into_response();
            }
        }
        let (parts, body) = request.into_parts();
        let read = axum::body::to_bytes(body, limit);
        let bytes = match tokio::time::timeout(state.config.body_timeout, read).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(_)) => {
                let message = format!("the request body is larger than {limit} bytes, or was cut off");
                return ApiError::new(flavor, Kind::TooLarge, message).into_response();
            }
            Err(_) => {
                let secs = state.config.body_timeout.as_secs_f64();
                let message = format!("the request body did not arrive within {secs} s");
                return ApiError::new(flavor, Kind::Timeout, message).into_response();
            }
        };
        return next.run(Request::from_parts(parts, axum::body::Body::from(bytes))).await;
    }
    next.run(request).await
}

async fn method_not_allowed(request: Request) -> Response {
    let path = request.uri().path().to_string();
    let message = format!("{} is not allowed on {path}", request.method());
    ApiError::new(flavor_of(&path), Kind::MethodNotAllowed, message).into_response()
}

async fn not_found(request: Request) -> Response {
    let path = request.uri().path().to_string();
    ApiError::new(flavor_of(&path), Kind::NotFound, format!("no route for {} {path}", request.method())).into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_796_050_954), "2026-11-30T15:02:34Z");
    }
}
