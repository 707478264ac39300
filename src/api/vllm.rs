//! The request fields a vLLM client sends besides OpenAI's, read from the raw
//! body and taken out of it (with the rewrites that give the recipe its own
//! spelling): `chat_template_kwargs`, `structured_outputs` and the older
//! `guided_*`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output`,
//! `return_tokens_as_token_ids`, `add_generation_prompt`,
//! `continue_final_message`, `truncate_prompt_tokens`, `priority`,
//! `request_id`; and OpenAI's `developer` role, which is `system` for every
//! model but o1. Meanings follow vLLM's `ChatCompletionRequest`; every error
//! names the field.

use std::sync::Arc;

use deepseek_recipe::request::ConversationRequest;
use deepseek_recipe::stream::StreamTokenizer;
use deepseek_recipe_core::tools::ToolChoice;
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use super::constraint::OutputFormat;
use super::stops::StopStrings;

/// Longest `request_id`, in bytes.
pub const REQUEST_ID_MAX: usize = 256;
/// Most `stop_token_ids` (as the engine's limit).
pub const STOP_TOKEN_IDS_MAX: usize = deepinfer_engine::request::MAX_STOP_TOKEN_IDS;

/// vLLM's fields of one request.
#[derive(Debug, PartialEq)]
pub struct Vllm {
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub include_stop_str_in_output: bool,
    pub return_tokens_as_token_ids: bool,
    /// `add_generation_prompt: false` without `continue_final_message`: the
    /// prompt ends after the last message, without the assistant's opening.
    pub strip_generation_prompt: bool,
    pub truncate_prompt_tokens: Option<Truncation>,
    pub priority: i64,
    pub request_id: Option<String>,
    /// `structured_outputs` or a `guided_*` field.
    pub format: Option<OutputFormat>,
    /// The field that gave `format`, for errors.
    pub format_field: Option<&'static str>,
}

/// `truncate_prompt_tokens`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Truncation {
    /// Keep the last `n` prompt tokens.
    Last(usize),
    /// `-1`: keep what fits the model's context.
    Context,
}

impl Truncation {
    /// `prompt` with at most the tokens this keeps, the last ones.
    pub fn apply(self, prompt: &mut Vec<u32>, context: usize) {
        let keep = match self {
            Truncation::Last(n) => n,
            Truncation::Context => context,
        };
        if prompt.len() > keep {
            prompt.drain(..prompt.len() - keep);
        }
    }
}

fn flag(body: &mut Map<String, Value>, key: &str, default: bool) -> Result<bool, String> {
    match body.remove(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_bool().ok_or_else(|| format!("`{key}` must be a boolean, got {v}")),
    }
}

/// Take vLLM's fields out of `body` and apply the rewrites; `body` is left
/// with what the recipe reads.
pub fn take(body: &mut Map<String, Value>) -> Result<Vllm, String> {
    developer_is_system(body);
    template_kwargs(body)?;
    let (format, format_field) = match structured(body)? {
        Some((format, field)) => (Some(format), Some(field)),
        None => (None, None),
    };
    let min_tokens = match body.remove("min_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_u64().ok_or_else(|| format!("`min_tokens` must be a non-negative integer, got {v}"))? as usize,
    };
    let stop_token_ids = match body.remove("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) if ids.len() <= STOP_TOKEN_IDS_MAX => ids
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| format!("`stop_token_ids` must be token ids, got {ids:?}"))?,
        Some(v) => {
            return Err(format!("`stop_token_ids` must be a list of at most {STOP_TOKEN_IDS_MAX} token ids, got {v}"))
        }
    };
    let include_stop_str_in_output = flag(body, "include_stop_str_in_output", false)?;
    let return_tokens_as_token_ids = flag(body, "return_tokens_as_token_ids", false)?;
    let generation_prompt_given = body.get("add_generation_prompt").is_some_and(|v| !v.is_null());
    let add_generation_prompt = flag(body, "add_generation_prompt", true)?;
    let continue_final = flag(body, "continue_final_message", false)?;
    if continue_final {
        if generation_prompt_given && add_generation_prompt {
            return Err("`continue_final_message` and `add_generation_prompt` cannot both be true".into());
        }
        continue_final_message(body)?;
    }
    let truncate_prompt_tokens = match body.remove("truncate_prompt_tokens") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_i64() {
            Some(-1) => Some(Truncation::Context),
            Some(n) if n >= 1 => Some(Truncation::Last(n as usize)),
            _ => return Err(format!("`truncate_prompt_tokens` must be -1 or a positive integer, got {v}")),
        },
    };
    let priority = match body.remove("priority") {
        None | Some(Value::Null) => 0,
        Some(v) => v.as_i64().ok_or_else(|| format!("`priority` must be an integer, got {v}"))?,
    };
    let request_id = match body.remove("request_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id))
            if !id.is_empty() && id.len() <= REQUEST_ID_MAX && id.chars().all(|c| c.is_ascii_graphic()) =>
        {
            Some(id)
        }
        Some(v) => {
            return Err(format!(
                "`request_id` must be 1 to {REQUEST_ID_MAX} printable ASCII characters without spaces, got {v}"
            ))
        }
    };
    // vLLM's default; only `true` exists here (the output parser reads the special tokens).
    body.remove("skip_special_tokens");
    Ok(Vllm {
        min_tokens,
        stop_token_ids,
        include_stop_str_in_output,
        return_tokens_as_token_ids,
        strip_generation_prompt: !add_generation_prompt && !continue_final,
        truncate_prompt_tokens,
        priority,
        request_id,
        format,
        format_field,
    })
}

/// How the generated tokens become output text, per vLLM's fields.
#[derive(Default)]
pub struct OutputRules {
    /// Stop token ids whose text is left out (`include_stop_str_in_output` false).
    pub drop_ids: Vec<u32>,
    /// Stop strings matched before the output parser: (strings, include them, min_tokens).
    pub stops: Option<(Vec<String>, bool, usize)>,
    /// Log-probability tokens as `token_id:N`.
    pub token_ids: bool,
}

impl OutputRules {
    pub fn stop_strings(&mut self, tokenizer: Arc<Tokenizer>) -> Option<StopStrings> {
        let (stops, include, min_tokens) = self.stops.take()?;
        Some(StopStrings::new(stops, include, min_tokens, tokenizer))
    }
}

impl Vllm {
    /// The output rules; takes the recipe's stop strings where vLLM's rules
    /// for them differ from the output parser's.
    pub fn output_rules(&self, recipe_stops: &mut Vec<String>) -> OutputRules {
        let own_stops = (self.min_tokens > 0 || self.include_stop_str_in_output) && !recipe_stops.is_empty();
        OutputRules {
            drop_ids: if self.include_stop_str_in_output { Vec::new() } else { self.stop_token_ids.clone() },
            stops: own_stops.then(|| (std::mem::take(recipe_stops), self.include_stop_str_in_output, self.min_tokens)),
            token_ids: self.return_tokens_as_token_ids,
        }
    }

    /// The output format: the protocol's (`grammar`, or a `response_format` the
    /// recipe reads in `raw`) or vLLM's, never both.
    pub fn merge_format(
        &mut self,
        grammar: Option<OutputFormat>,
        raw: &Map<String, Value>,
    ) -> Result<Option<OutputFormat>, String> {
        let Some(format) = self.format.take() else { return Ok(grammar) };
        let field = self.format_field.unwrap_or("structured_outputs");
        let response_format = raw
            .get("response_format")
            .is_some_and(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"));
        if grammar.is_some() || response_format {
            return Err(format!("`{field}` and `response_format` both ask for an output format; send one"));
        }
        Ok(Some(format))
    }

    /// The prompt as vLLM's fields shape it: without the generation prompt,
    /// truncated to its last tokens.
    pub fn shape_prompt(
        &self,
        prompt: &mut Vec<u32>,
        converted: &ConversationRequest,
        tokenizer: &Tokenizer,
        context: usize,
    ) -> Result<(), String> {
        if self.strip_generation_prompt {
            if converted.conversation.tool_choice == ToolChoice::Required && !converted.conversation.tools.is_empty() {
                return Err(
                    "`add_generation_prompt` = false cannot force a tool call, which opens the assistant's turn".into(),
                );
            }
            // The template's generation prompt: `<｜Assistant｜>` and `<think>` or `</think>`.
            let opening: Vec<Option<u32>> =
                ["<｜Assistant｜>", "<think>", "</think>"].iter().map(|t| tokenizer.token_to_id(t)).collect();
            let n = prompt.len();
            if n >= 2 && Some(prompt[n - 2]) == opening[0] && [opening[1], opening[2]].contains(&Some(prompt[n - 1])) {
                prompt.truncate(n - 2);
            }
        }
        if let Some(t) = self.truncate_prompt_tokens {
            t.apply(prompt, context);
        }
        Ok(())
    }
}

/// The tokenizer as the output parser sees it, but with every token of the
/// log-probabilities named `token_id:N` (vLLM's `return_tokens_as_token_ids`).
pub struct TokenIdNames(pub Arc<Tokenizer>);

impl StreamTokenizer for TokenIdNames {
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, String> {
        self.0.decode_ids(ids, skip_special_tokens)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        Some(format!("token_id:{id}"))
    }

    fn count_tokens(&self, text: &str) -> Option<usize> {
        self.0.count_tokens(text)
    }

    fn is_special_token(&self, id: u32) -> bool {
        self.0.is_special_token(id)
    }
}

/// OpenAI's `developer` messages are system messages for every model but o1.
fn developer_is_system(body: &mut Map<String, Value>) {
    for key in ["messages", "input"] {
        if let Some(Value::Array(items)) = body.get_mut(key) {
            for item in items.iter_mut().filter_map(Value::as_object_mut) {
                if item.get("role").and_then(Value::as_str) == Some("developer") {
                    item.insert("role".into(), Value::from("system"));
                }
            }
        }
    }
}

/// `chat_template_kwargs`: DeepSeek's template reads `thinking` (vLLM's switch
/// for DeepSeek) or `enable_thinking` (the name other templates use); it
/// becomes DeepSeek's `thinking` field. Any other key is refused by name.
fn template_kwargs(body: &mut Map<String, Value>) -> Result<(), String> {
    let kwargs = match body.remove("chat_template_kwargs") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(kwargs)) => kwargs,
        Some(v) => return Err(format!("`chat_template_kwargs` must be an object, got {v}")),
    };
    let mut thinking = None;
    for (key, value) in &kwargs {
        match key.as_str() {
            "thinking" | "enable_thinking" => {
                let on = value
                    .as_bool()
                    .ok_or_else(|| format!("`chat_template_kwargs.{key}` must be a boolean, got {value}"))?;
                if thinking.is_some_and(|t| t != on) {
                    return Err("`chat_template_kwargs.thinking` and `enable_thinking` disagree".into());
                }
                thinking = Some(on);
            }
            _ => {
                return Err(format!(
                    "`chat_template_kwargs.{key}` is not supported: DeepSeek's template reads only `thinking` (or `enable_thinking`)"
                ))
            }
        }
    }
    let Some(on) = thinking else { return Ok(()) };
    let wanted = if on { "enabled" } else { "disabled" };
    match body.get("thinking").filter(|t| !t.is_null()) {
        Some(t) if t.get("type").and_then(Value::as_str) != Some(wanted) => {
            Err(format!("`chat_template_kwargs` asks for thinking {wanted}, but `thinking` is {t}"))
        }
        Some(_) => Ok(()),
        None => {
            body.insert("thinking".into(), serde_json::json!({"type": wanted}));
            Ok(())
        }
    }
}

/// `continue_final_message`: the last message, the assistant's, is continued
/// (the recipe's `prefix`), without its end of turn.
fn continue_final_message(body: &mut Map<String, Value>) -> Result<(), String> {
    let last = body.get_mut("messages").and_then(Value::as_array_mut).and_then(|m| m.last_mut());
    match last.and_then(Value::as_object_mut) {
        Some(m) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
            m.insert("prefix".into(), Value::Bool(true));
            Ok(())
        }
        _ => Err("`continue_final_message` needs the last message to be the assistant's".into()),
    }
}

/// Keys of `structured_outputs` that only tune how vLLM's backends compile,
/// and what is done with them here.
fn structured_option(key: &str, value: &Value) -> Result<(), String> {
    match (key, value) {
        // The grammar already writes compact JSON and never falls back to another engine.
        ("disable_any_whitespace" | "disable_fallback", Value::Bool(_)) => Ok(()),
        (_, Value::Null) => Ok(()),
        ("disable_additional_properties", Value::Bool(false)) => Ok(()),
        ("whitespace_pattern", _) => Err("`structured_outputs.whitespace_pattern` is not supported: the JSON grammar writes no whitespace".into()),
        ("structural_tag", _) => Err("`structured_outputs.structural_tag` is not supported; use `json`, `regex`, `choice` or `grammar`".into()),
        ("disable_additional_properties", _) => Err("`structured_outputs.disable_additional_properties` is not supported; set `additionalProperties: false` in the schema".into()),
        (other, _) => Err(format!("`structured_outputs.{other}` is not supported")),
    }
}

/// The one output format of `structured_outputs` or the `guided_*` fields.
fn structured(body: &mut Map<String, Value>) -> Result<Option<(OutputFormat, &'static str)>, String> {
    let mut found: Vec<(OutputFormat, &'static str)> = Vec::new();
    if let Some(so) = body.remove("structured_outputs").filter(|v| !v.is_null()) {
        let so = so.as_object().ok_or_else(|| format!("`structured_outputs` must be an object, got {so}"))?;
        for (key, value) in so {
            let field: &'static str = match key.as_str() {
                "json" => "structured_outputs.json",
                "regex" => "structured_outputs.regex",
                "choice" => "structured_outputs.choice",
                "grammar" => "structured_outputs.grammar",
                "json_object" => "structured_outputs.json_object",
                _ => {
                    structured_option(key, value)?;
                    continue;
                }
            };
            if let Some(format) = format_of(field, value)? {
                found.push((format, field));
            }
        }
    }
    for field in ["guided_json", "guided_regex", "guided_choice", "guided_grammar"] {
        if let Some(value) = body.remove(field).filter(|v| !v.is_null()) {
            if let Some(format) = format_of(field, &value)? {
                found.push((format, field));
            }
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => {
            let names: Vec<String> = found.iter().map(|(_, f)| format!("`{f}`")).collect();
            Err(format!("only one structured output may be asked for, got {}", names.join(", ")))
        }
    }
}

fn format_of(field: &'static str, value: &Value) -> Result<Option<OutputFormat>, String> {
    let kind = field.rsplit(['.', '_']).next().unwrap_or(field);
    match (kind, value) {
        ("json", Value::Object(_)) => Ok(Some(OutputFormat::Json(Some(value.clone())))),
        // vLLM takes the schema as JSON text too.
        ("json", Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(schema @ Value::Object(_)) => Ok(Some(OutputFormat::Json(Some(schema)))),
            _ => Err(format!("`{field}` must be a JSON schema (an object, or its JSON text)")),
        },
        ("object", Value::Bool(true)) => Ok(Some(OutputFormat::Json(None))),
        ("object", Value::Bool(false)) => Ok(None),
        ("regex", Value::String(rx)) => Ok(Some(OutputFormat::Regex(rx.clone()))),
        ("grammar", Value::String(lark)) => Ok(Some(OutputFormat::Lark(lark.clone()))),
        ("choice", Value::Array(items)) if !items.is_empty() => {
            let choices = items
                .iter()
                .map(|c| c.as_str().map(escape_regex))
                .collect::<Option<Vec<String>>>()
                .ok_or_else(|| format!("`{field}` must be a list of strings"))?;
            Ok(Some(OutputFormat::Regex(format!("(?:{})", choices.join("|")))))
        }
        ("choice", _) => Err(format!("`{field}` must be a non-empty list of strings")),
        ("object", _) => Err(format!("`{field}` must be a boolean")),
        (_, _) => Err(format!("`{field}` must be a string, got {value}")),
    }
}

/// `text` as a regular expression that matches only itself.
fn escape_regex(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn template_kwargs_become_thinking_and_unknown_keys_are_named() {
        let mut b = body(json!({"chat_template_kwargs": {"enable_thinking": false}}));
        take(&mut b).unwrap();
        assert_eq!(b, body(json!({"thinking": {"type": "disabled"}})));
        let mut b = body(json!({"chat_template_kwargs": {"thinking": true, "tools_first": 1}}));
        assert!(take(&mut b).unwrap_err().contains("`chat_template_kwargs.tools_first`"));
        let mut b = body(json!({"chat_template_kwargs": {"thinking": true}, "thinking": {"type": "disabled"}}));
        assert!(take(&mut b).is_err());
    }

    #[test]
    fn structured_outputs_and_guided_fields_are_one_format() {
        let mut b = body(json!({"structured_outputs": {"choice": ["a.b", "c"], "disable_fallback": true}}));
        assert_eq!(take(&mut b).unwrap().format, Some(OutputFormat::Regex("(?:a\\.b|c)".into())));
        let mut b = body(json!({"guided_json": "{\"type\": \"object\"}"}));
        assert_eq!(take(&mut b).unwrap().format, Some(OutputFormat::Json(Some(json!({"type": "object"})))));
        let mut b = body(json!({"guided_regex": "a+", "guided_choice": ["x"]}));
        assert!(take(&mut b).unwrap_err().contains("only one"));
        let mut b = body(json!({"structured_outputs": {"structural_tag": "{}"}}));
        assert!(take(&mut b).unwrap_err().contains("structural_tag"));
    }

    #[test]
    fn messages_are_rewritten_for_the_recipe() {
        let mut b = body(json!({"messages": [{"role": "developer", "content": "d"},
            {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
            "continue_final_message": true}));
        let v = take(&mut b).unwrap();
        assert!(!v.strip_generation_prompt, "the continued message has no opening to strip");
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["messages"][2]["prefix"], true);
        let mut b = body(json!({"messages": [{"role": "user", "content": "u"}], "continue_final_message": true}));
        assert!(take(&mut b).unwrap_err().contains("continue_final_message"));
    }

    #[test]
    fn truncation_keeps_the_last_tokens() {
        let mut p = vec![1, 2, 3, 4];
        Truncation::Last(2).apply(&mut p, 100);
        assert_eq!(p, [3, 4]);
        let mut b = body(json!({"truncate_prompt_tokens": 0}));
        assert!(take(&mut b).unwrap_err().contains("truncate_prompt_tokens"));
    }
}
