//! What differs between the protocols besides the recipe's conversion: their
//! field tables, the raw-body rewrites each needs, and their tool-call and
//! streamed-usage rules.

use deepseek_recipe::anthropic::MessagesRequest;
use deepseek_recipe::openai::{ChatCompletionRequest, ResponsesRequest};
use deepseek_recipe::request::ProtocolRequest;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::constraint::OutputFormat;
use super::errors::Flavor;
use super::failure::StreamFailure;
use super::{fields, params};

/// What differs between the three protocols besides the recipe's conversion.
pub trait Api: ProtocolRequest + DeserializeOwned {
    const FLAVOR: Flavor;
    const ID_PREFIX: &'static str;
    /// Every field the protocol's body may carry, and what is done with it.
    const FIELDS: &'static [fields::Field];
    /// Rewrite the raw body into what the recipe reads, taking out the fields
    /// it does not know; returns an output format the recipe cannot express.
    fn rewrite(_raw: &mut Map<String, Value>) -> Result<Option<OutputFormat>, String> {
        Ok(None)
    }
    /// Whether the request forces a call of any of its tools where the recipe's
    /// conversion would let the model choose (Anthropic `tool_choice: any`).
    fn forces_any_tool(_raw: &Map<String, Value>) -> bool {
        false
    }
    /// Whether the request allows more than one tool call per turn.
    fn parallel_tool_calls(raw: &Map<String, Value>) -> Result<bool, String> {
        match raw.get("parallel_tool_calls") {
            None | Some(Value::Null) => Ok(true),
            Some(v) => v.as_bool().ok_or_else(|| format!("`parallel_tool_calls` must be a boolean, got {v}")),
        }
    }
    /// Whether streamed usage follows OpenAI's `stream_options.include_usage`.
    const SPLITS_USAGE: bool = false;
    /// How a stream that failed ends.
    const STREAM_FAILURE: StreamFailure = StreamFailure::ErrorData;
    /// Stream options the protocol has (Chat Completions' `include_usage`).
    fn include_usage(_raw: &Map<String, Value>) -> Result<bool, String> {
        Ok(true)
    }
}

impl Api for ChatCompletionRequest {
    const FLAVOR: Flavor = Flavor::OpenAi;
    const ID_PREFIX: &'static str = "chatcmpl-";
    const FIELDS: &'static [fields::Field] = fields::CHAT_COMPLETIONS;
    const SPLITS_USAGE: bool = true;

    /// `max_completion_tokens`, and `response_format: {"type": "grammar",
    /// "grammar": "<Lark>"}`: a grammar form next to the recipe's `json_object`,
    /// `json_schema` and `regex`.
    fn rewrite(raw: &mut Map<String, Value>) -> Result<Option<OutputFormat>, String> {
        params::fold_max_completion_tokens(raw)?;
        let Some(format) = raw.get("response_format") else { return Ok(None) };
        if format.get("type").and_then(Value::as_str) != Some("grammar") {
            return Ok(None);
        }
        let Some(grammar) = format.get("grammar").and_then(Value::as_str) else {
            return Err("response_format of type `grammar` needs a `grammar` string (Lark syntax)".into());
        };
        let grammar = grammar.to_string();
        raw.remove("response_format");
        Ok(Some(OutputFormat::Lark(grammar)))
    }

    fn include_usage(raw: &Map<String, Value>) -> Result<bool, String> {
        params::include_usage(raw)
    }
}

impl Api for ResponsesRequest {
    const FLAVOR: Flavor = Flavor::OpenAi;
    const ID_PREFIX: &'static str = "resp_";
    const FIELDS: &'static [fields::Field] = fields::RESPONSES;
    const STREAM_FAILURE: StreamFailure = StreamFailure::ResponseFailed;

    fn rewrite(raw: &mut Map<String, Value>) -> Result<Option<OutputFormat>, String> {
        params::fold_responses_thinking(raw)?;
        Ok(None)
    }
}

impl Api for MessagesRequest {
    const FLAVOR: Flavor = Flavor::Anthropic;
    const ID_PREFIX: &'static str = "msg_";
    const FIELDS: &'static [fields::Field] = fields::MESSAGES;
    const STREAM_FAILURE: StreamFailure = StreamFailure::ErrorEvent;

    fn rewrite(raw: &mut Map<String, Value>) -> Result<Option<OutputFormat>, String> {
        params::require_max_tokens(raw)?;
        params::take_output_format(raw)
    }

    fn forces_any_tool(raw: &Map<String, Value>) -> bool {
        raw.get("tool_choice").and_then(|c| c.get("type")).and_then(Value::as_str) == Some("any")
    }

    fn parallel_tool_calls(raw: &Map<String, Value>) -> Result<bool, String> {
        match raw.get("tool_choice").and_then(|c| c.get("disable_parallel_tool_use")) {
            None | Some(Value::Null) => Ok(true),
            Some(v) => v
                .as_bool()
                .map(|disabled| !disabled)
                .ok_or_else(|| format!("`tool_choice.disable_parallel_tool_use` must be a boolean, got {v}")),
        }
    }
}
