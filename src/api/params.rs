//! Request fields the recipe does not carry to the engine, read from the raw body:
//! sampling extensions (logit bias, penalties, min-p, top-k), and the rewrites that
//! let the recipe see one spelling (`max_completion_tokens` → `max_tokens`, the
//! Responses `thinking` switch → `reasoning.effort`, Anthropic `output_config.format`).
//! Every error names the field.

use deepinfer_engine::sampling::SamplingParams;
use serde_json::{Map, Value};

use super::constraint::OutputFormat;

/// Sampling settings taken from the raw body.
#[derive(Debug, Default, PartialEq)]
pub struct Extensions {
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Sorted by token id.
    pub logit_bias: Vec<(u32, f32)>,
    pub ignore_eos: bool,
    pub seed: Option<u64>,
}

impl Extensions {
    /// The engine's sampling parameters: these extensions with the protocol's own
    /// temperature, top-p, resolved seed and alternatives per token.
    pub fn sampling(self, temperature: f32, top_p: f32, seed: u64, logprobs: usize) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k: self.top_k,
            seed,
            logprobs,
            logit_bias: self.logit_bias,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            min_p: self.min_p,
        }
    }
}

fn number(body: &Map<String, Value>, key: &str, default: f32) -> Result<f32, String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| format!("`{key}` must be a number, got {v}")),
    }
}

/// Read the sampling extensions (ranges are checked by the engine's validation,
/// which names the field too).
pub fn extensions(body: &Map<String, Value>) -> Result<Extensions, String> {
    let top_k = match body.get("top_k") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().ok_or_else(|| format!("`top_k` must be a non-negative integer, got {v}"))? as usize,
    };
    let ignore_eos = match body.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(v) => v.as_bool().ok_or_else(|| format!("`ignore_eos` must be a boolean, got {v}"))?,
    };
    let seed = match body.get("seed") {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| format!("`seed` must be a non-negative integer, got {v}"))?),
    };
    Ok(Extensions {
        top_k,
        min_p: number(body, "min_p", 0.0)?,
        repetition_penalty: number(body, "repetition_penalty", 1.0)?,
        frequency_penalty: number(body, "frequency_penalty", 0.0)?,
        presence_penalty: number(body, "presence_penalty", 0.0)?,
        logit_bias: logit_bias(body.get("logit_bias"))?,
        ignore_eos,
        seed,
    })
}

/// OpenAI's `logit_bias`: an object from token id (as a string) to a bias.
fn logit_bias(value: Option<&Value>) -> Result<Vec<(u32, f32)>, String> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(v) => return Err(format!("`logit_bias` must be an object of token id to bias, got {v}")),
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let token: u32 = key.trim().parse().map_err(|_| format!("`logit_bias`: key `{key}` is not a token id"))?;
        let bias = bias.as_f64().ok_or_else(|| format!("`logit_bias.{key}` must be a number, got {bias}"))?;
        out.push((token, bias as f32));
    }
    out.sort_by_key(|&(token, _)| token);
    Ok(out)
}

/// Chat Completions: `max_completion_tokens` is what the OpenAI SDK sends; the
/// recipe reads `max_tokens`. Both given must agree.
pub fn fold_max_completion_tokens(body: &mut Map<String, Value>) -> Result<(), String> {
    let Some(value) = body.remove("max_completion_tokens") else { return Ok(()) };
    if value.is_null() {
        return Ok(());
    }
    let n = value
        .as_u64()
        .filter(|&n| n >= 1 && n <= u64::from(u32::MAX))
        .ok_or_else(|| format!("`max_completion_tokens` must be a positive integer, got {value}"))?;
    match body.get("max_tokens") {
        Some(m) if !m.is_null() && m.as_u64() != Some(n) => {
            Err(format!("`max_tokens` ({m}) and `max_completion_tokens` ({n}) disagree; send one"))
        }
        _ => {
            body.insert("max_tokens".into(), Value::from(n));
            Ok(())
        }
    }
}

/// Responses: DeepSeek's `thinking` switch, expressed as `reasoning.effort`, which
/// the recipe reads (`none` disables thinking).
pub fn fold_responses_thinking(body: &mut Map<String, Value>) -> Result<(), String> {
    let Some(thinking) = body.remove("thinking") else { return Ok(()) };
    if thinking.is_null() {
        return Ok(());
    }
    let kind = thinking.get("type").and_then(Value::as_str);
    let effort = body.get("reasoning").and_then(|r| r.get("effort")).and_then(Value::as_str);
    let wanted = match (kind, effort) {
        (Some("disabled"), None | Some("none")) => "none",
        (Some("enabled"), None) => "high",
        (Some("enabled"), Some(e)) if e != "none" => return Ok(()),
        (Some("disabled" | "enabled"), Some(e)) => {
            return Err(format!("`thinking` ({thinking}) contradicts `reasoning.effort` (\"{e}\")"))
        }
        _ => {
            return Err(format!(
                "`thinking` must be {{\"type\": \"enabled\"}} or {{\"type\": \"disabled\"}}, got {thinking}"
            ))
        }
    };
    let reasoning = body.entry("reasoning").or_insert_with(|| Value::Object(Map::new()));
    match reasoning.as_object_mut() {
        Some(r) => {
            r.insert("effort".into(), Value::from(wanted));
            Ok(())
        }
        None => Err(format!("`reasoning` must be an object, got {reasoning}")),
    }
}

/// Anthropic: `max_tokens` is required by the Messages API.
pub fn require_max_tokens(body: &Map<String, Value>) -> Result<(), String> {
    match body.get("max_tokens") {
        None | Some(Value::Null) => Err("`max_tokens`: field required".into()),
        Some(_) => Ok(()),
    }
}

/// Anthropic structured outputs: `output_config.format` `{"type": "json_schema",
/// "schema": {...}}`, taken out of the body (the recipe reads only `effort`).
pub fn take_output_format(body: &mut Map<String, Value>) -> Result<Option<OutputFormat>, String> {
    let Some(config) = body.get_mut("output_config").and_then(Value::as_object_mut) else { return Ok(None) };
    if let Some(key) = config.keys().find(|k| *k != "format" && *k != "effort") {
        return Err(format!("unknown field `output_config.{key}`"));
    }
    let Some(format) = config.remove("format") else { return Ok(None) };
    if format.is_null() {
        return Ok(None);
    }
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => match format.get("schema") {
            Some(schema @ Value::Object(_)) => Ok(Some(OutputFormat::Json(Some(schema.clone())))),
            _ => Err("`output_config.format.schema` must be a JSON Schema object".into()),
        },
        _ => {
            Err(format!("`output_config.format` must be {{\"type\": \"json_schema\", \"schema\": ...}}, got {format}"))
        }
    }
}

/// Most completions one request may ask for (`n`).
pub const CHOICES_MAX: usize = 16;

/// `n`, taken out of the body (the recipe accepts only 1): 1 to [`CHOICES_MAX`].
pub fn choices(body: &mut Map<String, Value>) -> Result<usize, String> {
    match body.remove("n") {
        None | Some(Value::Null) => Ok(1),
        Some(v) => v
            .as_u64()
            .filter(|&n| (1..=CHOICES_MAX as u64).contains(&n))
            .map(|n| n as usize)
            .ok_or_else(|| format!("`n` must be an integer from 1 to {CHOICES_MAX}, got {v}")),
    }
}

/// Chat Completions `stream_options`: only `include_usage` exists here.
pub fn include_usage(body: &Map<String, Value>) -> Result<bool, String> {
    let Some(options) = body.get("stream_options").filter(|v| !v.is_null()) else { return Ok(false) };
    let options = options.as_object().ok_or_else(|| format!("`stream_options` must be an object, got {options}"))?;
    if let Some(key) = options.keys().find(|k| *k != "include_usage") {
        return Err(format!("`stream_options.{key}` is not supported"));
    }
    match options.get("include_usage") {
        None | Some(Value::Null) => Ok(false),
        Some(v) => v.as_bool().ok_or_else(|| format!("`stream_options.include_usage` must be a boolean, got {v}")),
    }
}

/// Content parts that carry something other than text or an image, in any of
/// the three protocols: files (a PDF), documents and audio. Image parts are
/// read by `images`.
const ATTACHMENT_PARTS: &[&str] = &["file", "input_file", "document", "input_audio", "audio"];

/// The model reads text and (with a vision tower) images: a request with
/// another attachment is refused with the part's place, never answered with a
/// placeholder in its stead.
pub fn refuse_attachments(body: &Map<String, Value>) -> Result<(), String> {
    fn find(value: &Value, path: &mut String, depth: usize) -> Option<String> {
        // Content nests a few levels (message → content → block → tool result); bound the walk.
        if depth > 8 {
            return None;
        }
        match value {
            Value::Object(map) => {
                if let Some(kind) = map.get("type").and_then(Value::as_str).filter(|t| ATTACHMENT_PARTS.contains(t)) {
                    return Some(format!("`{path}` is a `{kind}` part"));
                }
                map.iter().find_map(|(k, v)| {
                    let len = path.len();
                    path.push_str(&format!(".{k}"));
                    let found = find(v, path, depth + 1);
                    path.truncate(len);
                    found
                })
            }
            Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                let found = find(v, path, depth + 1);
                path.truncate(len);
                found
            }),
            _ => None,
        }
    }
    for key in ["messages", "input", "system"] {
        if let Some(part) = body.get(key).and_then(|v| find(v, &mut key.to_string(), 0)) {
            return Err(format!("{part}, which this server does not read (it takes text and images only)"));
        }
    }
    Ok(())
}

/// Anthropic `document` blocks of plain text are text the model reads: they
/// become text blocks (the title first), so that only unreadable ones are refused.
pub fn inline_text_documents(body: &mut Map<String, Value>) {
    let Some(Value::Array(messages)) = body.get_mut("messages") else { return };
    for content in messages.iter_mut().filter_map(|m| m.get_mut("content")).filter_map(Value::as_array_mut) {
        for block in content.iter_mut() {
            let is_text_document = block.get("type").and_then(Value::as_str) == Some("document")
                && block["source"].get("type").and_then(Value::as_str) == Some("text");
            let Some(data) = block["source"].get("data").and_then(Value::as_str).filter(|_| is_text_document) else {
                continue;
            };
            let text = match block.get("title").and_then(Value::as_str) {
                Some(title) => format!("{title}\n\n{data}"),
                None => data.to_string(),
            };
            *block = serde_json::json!({"type": "text", "text": text});
        }
    }
}

/// A tool choice that forces a call needs tools to call.
pub fn check_tool_choice(body: &Map<String, Value>) -> Result<(), String> {
    let Some(choice) = body.get("tool_choice").filter(|c| !c.is_null()) else { return Ok(()) };
    let forces = match choice {
        Value::String(c) => c == "required",
        Value::Object(c) => matches!(c.get("type").and_then(Value::as_str), Some("function" | "any" | "tool")),
        _ => false,
    };
    let has_tools = body.get("tools").and_then(Value::as_array).is_some_and(|t| !t.is_empty());
    if forces && !has_tools {
        return Err(format!("`tool_choice` = {choice} forces a tool call, but `tools` is empty or missing"));
    }
    Ok(())
}

/// `thinking.budget_tokens`: most reasoning tokens before the end of thinking is forced.
pub fn thinking_budget(body: &Map<String, Value>) -> Result<Option<usize>, String> {
    let Some(thinking) = body.get("thinking").filter(|t| !t.is_null()) else { return Ok(None) };
    match thinking.get("budget_tokens") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("`thinking.budget_tokens` must be a positive integer, got {v}")),
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
    fn max_completion_tokens_becomes_max_tokens() {
        let mut b = body(json!({"max_completion_tokens": 5}));
        fold_max_completion_tokens(&mut b).unwrap();
        assert_eq!(b, body(json!({"max_tokens": 5})));
        let mut b = body(json!({"max_completion_tokens": "5"}));
        assert!(fold_max_completion_tokens(&mut b).unwrap_err().contains("max_completion_tokens"));
        let mut b = body(json!({"max_completion_tokens": 5, "max_tokens": 6}));
        assert!(fold_max_completion_tokens(&mut b).unwrap_err().contains("disagree"));
        let mut b = body(json!({"max_completion_tokens": 0}));
        assert!(fold_max_completion_tokens(&mut b).is_err());
    }

    #[test]
    fn logit_bias_is_parsed_and_sorted() {
        let e = extensions(&body(json!({"logit_bias": {"9": -100, "3": 2.5}}))).unwrap();
        assert_eq!(e.logit_bias, vec![(3, 2.5), (9, -100.0)]);
        assert!(extensions(&body(json!({"logit_bias": {"x": 1}}))).unwrap_err().contains("`x`"));
        assert!(extensions(&body(json!({"min_p": "0.1"}))).unwrap_err().contains("min_p"));
    }

    #[test]
    fn responses_thinking_becomes_reasoning_effort() {
        let mut b = body(json!({"thinking": {"type": "disabled"}}));
        fold_responses_thinking(&mut b).unwrap();
        assert_eq!(b, body(json!({"reasoning": {"effort": "none"}})));
        let mut b = body(json!({"thinking": {"type": "disabled"}, "reasoning": {"effort": "high"}}));
        assert!(fold_responses_thinking(&mut b).unwrap_err().contains("contradicts"));
    }

    #[test]
    fn attachments_other_than_images_are_refused_by_their_place() {
        let chat = body(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}));
        refuse_attachments(&chat).unwrap();
        let pdf = body(json!({"messages": [{"role": "user", "content": [
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"}}]}]}));
        assert!(refuse_attachments(&pdf).unwrap_err().contains("`file` part"));
        let doc = body(json!({"messages": [{"role": "user", "content": [{"type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}));
        assert!(refuse_attachments(&doc).unwrap_err().contains("`document` part"));
        let text = body(json!({"messages": [{"role": "user", "content": "an image of a cat"}]}));
        refuse_attachments(&text).unwrap();
        let mut doc = doc;
        inline_text_documents(&mut doc);
        assert_eq!(doc["messages"][0]["content"][0], json!({"type": "text", "text": "x"}));
        refuse_attachments(&doc).unwrap();
    }

    #[test]
    fn a_forced_tool_choice_needs_tools() {
        assert!(check_tool_choice(&body(json!({"tool_choice": "required"}))).unwrap_err().contains("tools"));
        assert!(check_tool_choice(&body(json!({"tool_choice": {"type": "any"}, "tools": []}))).is_err());
        check_tool_choice(&body(json!({"tool_choice": "auto"}))).unwrap();
        check_tool_choice(&body(json!({"tool_choice": "required", "tools": [{}]}))).unwrap();
    }

    #[test]
    fn anthropic_output_format_is_taken_out() {
        let mut b = body(json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}));
        let f = take_output_format(&mut b).unwrap();
        assert!(matches!(f, Some(OutputFormat::Json(Some(_)))));
        assert_eq!(b, body(json!({"output_config": {}})));
        let mut b = body(json!({"output_config": {"colour": 1}}));
        assert!(take_output_format(&mut b).unwrap_err().contains("output_config.colour"));
    }
}
