//! Endpoints users script against besides generation: one model by id, the
//! server version, tokenize / detokenize (vLLM's shapes) and Anthropic's
//! `count_tokens`. Prompts are rendered exactly as a generation request would be.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::ChatCompletionRequest;
use deepseek_recipe::request::ProtocolRequest;
use deepseek_recipe_encoding::PromptEncoding;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};

use super::errors::{ApiError, Flavor};
use super::images::Gathered;
use super::{model_object, parse_object, AppState};

/// Most token ids `/detokenize` takes in one call.
pub const DETOKENIZE_MAX: usize = 1 << 20;

/// `GET /v1/models/{id}`: the served model, or a 404 in either protocol's shape.
pub async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.check_model(Flavor::OpenAi, Some(&id)) {
        Ok(()) => Json(model_object(&state)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /version`.
pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// The prompt ids a conversation renders to, through the protocol's own
/// conversion, each image as the span of image tokens a generation prefills.
fn render<P: ProtocolRequest + DeserializeOwned>(
    state: &AppState,
    flavor: Flavor,
    mut obj: Map<String, Value>,
    images: &Gathered,
) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad_request(flavor, m);
    super::images::substitute(state, &obj, images).map_err(bad)?;
    obj.entry("model").or_insert_with(|| Value::from(state.config.model_name.clone()));
    // Counting needs no output budget; the conversion wants one.
    obj.entry("max_tokens").or_insert(Value::from(1));
    let request: P = serde_json::from_value(Value::Object(obj)).map_err(|e| bad(format!("invalid request: {e}")))?;
    let converted = request.convert(state.conversion.clone()).map_err(|e| ApiError::conversion(flavor, e))?;
    let prompt = state
        .encoding
        .encode(&converted.conversation)
        .map_err(|e| bad(format!("cannot encode the conversation: {e}")))?;
    Ok(super::images::expand(state, prompt, images).map_err(bad)?.0)
}

/// A counting request's images, found, checked and decoded as a generation's are.
async fn gather(state: &Arc<AppState>, flavor: Flavor, body: Bytes) -> Result<Gathered, ApiError> {
    super::images::gather(state, flavor, &Arc::new(body)).await
}

/// `POST /tokenize`: `{"prompt": "..."}` (raw text, `add_special_tokens` default
/// true) or `{"messages": [...]}` (the chat template) → `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let flavor = Flavor::OpenAi;
    let bad = |m: String| ApiError::bad_request(flavor, m);
    let mut obj = parse_object(flavor, &body)?;
    state.check_model(flavor, obj.get("model").and_then(Value::as_str))?;
    let images = gather(&state, flavor, body).await?;
    let tokens = match (obj.remove("prompt"), obj.contains_key("messages")) {
        (Some(Value::String(prompt)), false) => {
            let special = match obj.remove("add_special_tokens") {
                None | Some(Value::Null) => true,
                Some(v) => v.as_bool().ok_or_else(|| bad("`add_special_tokens` must be a boolean".into()))?,
            };
            if let Some(key) = obj.keys().find(|k| *k != "model") {
                return Err(bad(format!("unknown field `{key}`")));
            }
            let ids = state.tokenizer.encode(prompt, false).map_err(|e| bad(format!("cannot tokenize: {e}")))?;
            let mut out = Vec::with_capacity(ids.len() + 1);
            if special {
                out.push(state.bos);
            }
            out.extend(ids.get_ids());
            out
        }
        (None, true) => render::<ChatCompletionRequest>(&state, flavor, obj, &images)?,
        _ => return Err(bad("give exactly one of `prompt` (a string) and `messages`".into())),
    };
    Ok(Json(json!({"count": tokens.len(), "max_model_len": state.context, "tokens": tokens})))
}

/// `POST /detokenize`: `{"tokens": [ids]}` → `{"prompt": "..."}`.
pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let flavor = Flavor::OpenAi;
    let bad = |m: String| ApiError::bad_request(flavor, m);
    let obj = parse_object(flavor, &body)?;
    state.check_model(flavor, obj.get("model").and_then(Value::as_str))?;
    if let Some(key) = obj.keys().find(|k| *k != "model" && *k != "tokens") {
        return Err(bad(format!("unknown field `{key}`")));
    }
    let Some(Value::Array(items)) = obj.get("tokens") else {
        return Err(bad("`tokens` must be a list of token ids".into()));
    };
    if items.len() > DETOKENIZE_MAX {
        return Err(bad(format!("`tokens` may hold at most {DETOKENIZE_MAX} ids")));
    }
    let mut ids = Vec::with_capacity(items.len());
    for v in items {
        match v.as_u64() {
            Some(id) if (id as usize) < state.vocab => ids.push(id as u32),
            _ => return Err(bad(format!("`tokens`: {v} is not a token id below {}", state.vocab))),
        }
    }
    let prompt = state.tokenizer.decode(&ids, false).map_err(|e| bad(format!("cannot detokenize: {e}")))?;
    Ok(Json(json!({"prompt": prompt})))
}

/// `POST /v1/messages/count_tokens`: the Messages body without `max_tokens` →
/// `{"input_tokens": n}`, counted on the prompt a generation would encode.
pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let flavor = Flavor::Anthropic;
    let obj = parse_object(flavor, &body)?;
    state.check_model(flavor, obj.get("model").and_then(Value::as_str))?;
    const KNOWN: &[&str] = &["model", "messages", "system", "tools", "tool_choice", "thinking"];
    if let Some(key) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(ApiError::bad_request(flavor, format!("unknown field `{key}`")));
    }
    let images = gather(&state, flavor, body).await?;
    let tokens = render::<MessagesRequest>(&state, flavor, obj, &images)?;
    Ok(Json(json!({"input_tokens": tokens.len()})))
}
