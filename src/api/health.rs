//! Health, as Kubernetes probes read it: `/health/live` (liveness) says the
//! process serves HTTP and what runs its requests has not stopped — restart
//! it otherwise; `/health` and `/health/ready` (readiness) say it can serve a
//! request now — send it none otherwise. Readiness is false while the
//! cluster is unreachable (`Cluster::down_reason`, polled by the cluster
//! driver) and while the last request failed with a retryable error within
//! the failure timeout ([`super::failure::Evidence`]), so it never says ok
//! while every request fails. Each answer reads two locks: cheap to probe.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::AppState;

/// Why `state` cannot serve a request now, if it cannot.
pub fn not_ready(state: &AppState) -> Option<String> {
    if !state.engine.is_alive() {
        return Some("the engine stopped".into());
    }
    state.engine.unavailable().or_else(|| state.engine.evidence.failing())
}

/// `GET /health`, `GET /health/ready`: 200 `{"status": "ok"}`, or 503
/// `{"status": "unavailable", "reason": …}`.
pub async fn ready(State(state): State<Arc<AppState>>) -> Response {
    match not_ready(&state) {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(reason) => {
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unavailable", "reason": reason}))).into_response()
        }
    }
}

/// `GET /health/live`: 200 while the engine (or the cluster driver) runs,
/// whether or not the cluster behind it can serve: restarting a front end
/// does not bring a cluster back.
pub async fn live(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        let body = json!({"status": "unavailable", "reason": "the engine stopped"});
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}
