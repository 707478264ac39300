//! Messages responses as Anthropic writes them, past what the recipe does:
//! tool-use ids are `toolu_…` (the recipe's are OpenAI's `call_…`), and a tool
//! input that does not parse is an error, never the empty object the recipe's
//! accumulator falls back to.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::errors::Flavor;

/// Prefix of the recipe's tool-call ids, and of Anthropic's.
const OPENAI_PREFIX: &str = "call_";
const ANTHROPIC_PREFIX: &str = "toolu_";

/// Rename the tool-use ids of a Messages response or stream event.
pub fn patch(flavor: Flavor, value: &mut Value) {
    if flavor == Flavor::Anthropic {
        rename_ids(value, 0);
    }
}

fn rename_ids(value: &mut Value, depth: usize) {
    // Tool-use blocks sit at most three levels deep (event → message → content → block).
    if depth > 4 {
        return;
    }
    match value {
        Value::Object(obj) => {
            if obj.get("type").and_then(Value::as_str) == Some("tool_use") {
                if let Some(Value::String(id)) = obj.get_mut("id") {
                    if let Some(rest) = id.strip_prefix(OPENAI_PREFIX) {
                        *id = format!("{ANTHROPIC_PREFIX}{rest}");
                    }
                }
            }
            obj.values_mut().for_each(|v| rename_ids(v, depth + 1));
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rename_ids(v, depth + 1)),
        _ => {}
    }
}

/// Ids this server wrote, sent back in a conversation's history, in the
/// recipe's spelling again (which reads a marker at a fixed place in them).
pub fn restore_ids(body: &mut Map<String, Value>) {
    let Some(Value::Array(messages)) = body.get_mut("messages") else { return };
    for block in messages.iter_mut().filter_map(|m| m.get_mut("content")).filter_map(Value::as_array_mut).flatten() {
        let key = match block.get("type").and_then(Value::as_str) {
            Some("tool_use") => "id",
            Some("tool_result") => "tool_use_id",
            _ => continue,
        };
        if let Some(Value::String(id)) = block.get_mut(key) {
            // Ours only: `toolu_` then the recipe's two-digit call index.
            let ours = id.strip_prefix(ANTHROPIC_PREFIX).filter(|rest| {
                rest.len() > 3 && rest.as_bytes()[..2].iter().all(u8::is_ascii_digit) && rest.as_bytes()[2] == b'_'
            });
            if let Some(rest) = ours {
                *id = format!("{OPENAI_PREFIX}{rest}");
            }
        }
    }
}

/// The tool inputs of a Messages stream, each checked to parse when its block ends.
#[derive(Default)]
pub struct ToolInputs {
    partial: HashMap<u64, String>,
}

impl ToolInputs {
    /// Follow one stream event; an error when a tool input is not a JSON object.
    pub fn check(&mut self, event: &Value) -> Result<(), String> {
        let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
        match event.get("type").and_then(Value::as_str) {
            Some("content_block_delta") => {
                if let Some(part) = event["delta"].get("partial_json").and_then(Value::as_str) {
                    self.partial.entry(index).or_default().push_str(part);
                }
            }
            Some("content_block_stop") => {
                if let Some(json) = self.partial.remove(&index) {
                    match serde_json::from_str::<Value>(&json) {
                        Ok(Value::Object(_)) => {}
                        _ => return Err(format!("the model's tool input does not parse as a JSON object: {json}")),
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_use_ids_are_anthropic_s_and_come_back() {
        let mut v = json!({"content": [{"type": "tool_use", "id": "call_00_abc1234", "input": {}}]});
        patch(Flavor::Anthropic, &mut v);
        assert_eq!(v["content"][0]["id"], "toolu_00_abc1234");
        let mut body =
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_00_abc1234"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_00_abc1234"},
                                         {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9"}]}]})
            .as_object()
            .unwrap()
            .clone();
        restore_ids(&mut body);
        assert_eq!(body["messages"][0]["content"][0]["id"], "call_00_abc1234");
        assert_eq!(body["messages"][1]["content"][0]["tool_use_id"], "call_00_abc1234");
        assert_eq!(body["messages"][1]["content"][1]["tool_use_id"], "toolu_01A09q90qw90lq917835lq9");
    }

    #[test]
    fn a_tool_input_that_does_not_parse_is_an_error() {
        let mut t = ToolInputs::default();
        t.check(&json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"x\": 1e99999"}})).unwrap();
        assert!(t.check(&json!({"type": "content_block_stop", "index": 1})).is_err());
        t.check(&json!({"type": "content_block_delta", "index": 2, "delta": {"partial_json": "{\"x\": 1}"}})).unwrap();
        t.check(&json!({"type": "content_block_stop", "index": 2})).unwrap();
    }
}
