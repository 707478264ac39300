//! How long a request's prompt stays cached, in each protocol's own words:
//! OpenAI's `prompt_cache_retention` (`in_memory`, `24h`) and Anthropic's
//! `cache_control` (`{"type": "ephemeral", "ttl": "5m" | "1h"}`, at the top
//! level or on any block). Caching itself is automatic: every prefix is
//! cached; these fields only set how long, and whether it may reach disk.

use deepinfer_engine::request::Retention;
use serde_json::{Map, Value};

const MINUTE_MS: u64 = 60_000;
const HOUR_MS: u64 = 60 * MINUTE_MS;
/// Deepest nesting searched for `cache_control` blocks.
const MAX_DEPTH: usize = 32;

/// OpenAI: `in_memory` keeps the prompt in memory (device and host) for up
/// to an hour and never writes it to disk; `24h` keeps it 24 hours after its
/// last use, disk included. The field is taken out of the body.
pub fn openai(body: &mut Map<String, Value>) -> Result<Option<Retention>, String> {
    match body.remove("prompt_cache_retention") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s == "in_memory" => Ok(Some(Retention { ttl_ms: HOUR_MS, persist: false })),
        Some(Value::String(s)) if s == "24h" => Ok(Some(Retention { ttl_ms: 24 * HOUR_MS, persist: true })),
        Some(other) => Err(format!("`prompt_cache_retention` must be \"in_memory\" or \"24h\", got {other}")),
    }
}

/// Anthropic: the longest `ttl` of every `cache_control` in the request (a
/// block without `ttl` means 5 minutes). The top-level field is taken out
/// of the body; block-level ones stay where the protocol puts them.
pub fn anthropic(body: &mut Map<String, Value>) -> Result<Option<Retention>, String> {
    let mut longest: Option<u64> = None;
    if let Some(top) = body.remove("cache_control") {
        if !top.is_null() {
            longest = Some(ttl_of(&top, "cache_control")?);
        }
    }
    for key in ["system", "messages", "tools"] {
        if let Some(v) = body.get(key) {
            find(v, key, 0, &mut longest)?;
        }
    }
    Ok(longest.map(|ttl_ms| Retention { ttl_ms, persist: true }))
}

fn find(v: &Value, path: &str, depth: usize, longest: &mut Option<u64>) -> Result<(), String> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    match v {
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                find(item, &format!("{path}[{i}]"), depth + 1, longest)?;
            }
        }
        Value::Object(map) => {
            for (k, item) in map {
                let here = format!("{path}.{k}");
                if k == "cache_control" && !item.is_null() {
                    let ttl = ttl_of(item, &here)?;
                    *longest = Some(longest.map_or(ttl, |l| l.max(ttl)));
                } else {
                    find(item, &here, depth + 1, longest)?;
                }
            }
        }
        _ => {}
    }
    Ok(())
}

fn ttl_of(v: &Value, path: &str) -> Result<u64, String> {
    let obj = v.as_object().ok_or_else(|| format!("`{path}` must be an object, got {v}"))?;
    if let Some(k) = obj.keys().find(|k| *k != "type" && *k != "ttl") {
        return Err(format!("`{path}.{k}` is not a cache_control field (type, ttl)"));
    }
    if obj.get("type").and_then(Value::as_str) != Some("ephemeral") {
        return Err(format!("`{path}.type` must be \"ephemeral\""));
    }
    match obj.get("ttl") {
        None | Some(Value::Null) => Ok(5 * MINUTE_MS),
        Some(Value::String(s)) if s == "5m" => Ok(5 * MINUTE_MS),
        Some(Value::String(s)) if s == "1h" => Ok(HOUR_MS),
        Some(other) => Err(format!("`{path}.ttl` must be \"5m\" or \"1h\", got {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn openai_values() {
        let mut b = body(json!({"prompt_cache_retention": "24h"}));
        assert_eq!(openai(&mut b), Ok(Some(Retention { ttl_ms: 24 * HOUR_MS, persist: true })));
        assert!(b.is_empty(), "taken out");
        let mut b = body(json!({"prompt_cache_retention": "in_memory"}));
        assert_eq!(openai(&mut b), Ok(Some(Retention { ttl_ms: HOUR_MS, persist: false })));
        assert_eq!(openai(&mut body(json!({}))), Ok(None));
        assert!(openai(&mut body(json!({"prompt_cache_retention": "7d"}))).unwrap_err().contains("in_memory"));
    }

    #[test]
    fn anthropic_takes_the_longest_ttl_anywhere() {
        let mut b = body(json!({
            "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "u", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
        }));
        assert_eq!(anthropic(&mut b), Ok(Some(Retention { ttl_ms: HOUR_MS, persist: true })));
        let mut b = body(json!({"cache_control": {"type": "ephemeral"}}));
        assert_eq!(anthropic(&mut b).unwrap().unwrap().ttl_ms, 5 * MINUTE_MS);
        assert!(b.is_empty());
        let bad = anthropic(&mut body(
            json!({"messages": [{"content": [{"cache_control": {"type": "ephemeral", "ttl": "2h"}}]}]}),
        ));
        assert!(bad.unwrap_err().contains("messages[0].content[0].cache_control.ttl"));
        assert!(anthropic(&mut body(json!({"cache_control": {"type": "persistent"}}))).is_err());
        assert_eq!(anthropic(&mut body(json!({"messages": []}))), Ok(None));
    }
}
