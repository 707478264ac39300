//! A Lark grammar (llguidance's dialect) for a forced tool call in DeepSeek's DSML
//! format, as `deepseek-recipe` renders and parses it:
//!
//! ```text
//! <｜DSML｜invoke name="NAME">
//! <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
//! <｜DSML｜parameter name="KEY" string="false">JSON</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! The prompt already ends inside `<｜DSML｜tool_calls>` (the recipe renders a
//! required choice that way), so the grammar starts at the first `invoke`. Plain
//! string parameters are raw text (as the model was trained to write them); every
//! other parameter is JSON under its own schema (`%json`, tightened by
//! [`schema_bounds`] so that numbers stay within a double), so the arguments parse
//! and validate. Required parameters always appear, optional ones may, in the
//! schema's property order.

use serde_json::Value;

use deepseek_recipe::request::{ConversationRequest, OutputConstraint};
use deepseek_recipe_core::tools::ToolChoice;

use super::schema_bounds;

/// Most calls in one forced block.
pub const MAX_CALLS: usize = 8;
/// Longest raw string argument when the schema sets no `maxLength`: a bound keeps
/// the call short enough to close within the token budget.
pub const STRING_CHARS_MAX: u64 = 64;

/// One tool a forced call may use: its name and its parameters' JSON schema.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub parameters: Value,
}

/// A Lark literal of `text`.
fn literal(text: &str) -> String {
    serde_json::to_string(text).expect("a string serialises")
}

/// Whether a property is a plain string the model writes as raw text.
fn raw_string(schema: &Value) -> bool {
    let Some(obj) = schema.as_object() else { return false };
    obj.get("type").and_then(Value::as_str) == Some("string")
        && obj.keys().all(|k| matches!(k.as_str(), "type" | "description" | "title" | "maxLength" | "minLength"))
}

/// The grammar; `dsml` is the token id of `｜DSML｜`. `at_most_one` limits the
/// block to one call. Errors name the tool and the property.
pub fn lark(tools: &[ToolSpec], dsml: u32, at_most_one: bool) -> Result<String, String> {
    if tools.is_empty() {
        return Err("a forced tool call needs at least one tool".into());
    }
    let d = format!("<[{dsml}]>");
    let calls = if at_most_one { 1 } else { MAX_CALLS };
    let mut out = format!("start: invoke{{1,{calls}}} \"</\" {d} \"tool_calls>\"\n");
    let names: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    out.push_str(&format!("invoke: {}\n", names.join(" | ")));
    for (i, tool) in tools.iter().enumerate() {
        let params = tool.parameters.as_object();
        let properties = params.and_then(|p| p.get("properties")).and_then(Value::as_object);
        let required: Vec<&str> = params
            .and_then(|p| p.get("required"))
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = Vec::new();
        for (j, (key, schema)) in properties.into_iter().flatten().enumerate() {
            let rule = format!("param_{i}_{j}");
            let open = format!("\"<\" {d} {}", literal(&format!("parameter name=\"{key}\" ")));
            let close = format!("\"</\" {d} \"parameter>\\n\"");
            let value = if raw_string(schema) {
                let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
                let max = schema.get("maxLength").and_then(Value::as_u64).unwrap_or(STRING_CHARS_MAX);
                if min > max {
                    return Err(format!("tool `{}`: property `{key}` has minLength above maxLength", tool.name));
                }
                format!("\"string=\\\"true\\\">\" /[^<]{{{min},{max}}}/")
            } else {
                let mut schema = schema.clone();
                schema_bounds::tighten(&mut schema);
                if let Some(obj) = schema.as_object_mut() {
                    obj.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                }
                format!("\"string=\\\"false\\\">\" %json {schema}")
            };
            out.push_str(&format!("{rule}: {open} {value} {close}\n"));
            body.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
        }
        if let Some(missing) = required.iter().find(|r| !properties.is_some_and(|p| p.contains_key(**r))) {
            return Err(format!("tool `{}`: required parameter `{missing}` has no schema in `properties`", tool.name));
        }
        let head = literal(&format!("invoke name=\"{}\">\n", tool.name));
        out.push_str(&format!("{}: \"<\" {d} {head} {} \"</\" {d} \"invoke>\\n\"\n", names[i], body.join(" ")));
    }
    Ok(out)
}

/// Make a converted request call one of its tools, as a required choice does:
/// the prompt opens the tool-call block and the output is constrained to calls.
pub fn force_tool_call(converted: &mut ConversationRequest) -> Result<(), String> {
    if converted.conversation.thinking_mode {
        return Err("thinking mode does not support this tool_choice; disable thinking to force a tool call".into());
    }
    converted.conversation.tool_choice = ToolChoice::Required;
    converted.parsing_options.starts_in_tool_calls = true;
    converted.inference_options.output_constraint =
        Some(OutputConstraint::ToolCalls { tools: converted.conversation.tools.clone(), required: true });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plain_strings_are_raw_and_the_rest_json() {
        let tools = [ToolSpec {
            name: "get_weather".into(),
            parameters: json!({
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
                "required": ["city"]
            }),
        }];
        let g = lark(&tools, 7, true).unwrap();
        assert!(g.starts_with("start: invoke{1,1} \"</\" <[7]> \"tool_calls>\"\n"), "{g}");
        assert!(g.contains(r#""string=\"true\">" /[^<]{0,20}/"#), "{g}");
        assert!(g.contains(r#""string=\"false\">" %json {"type":"integer""#), "{g}");
        assert!(g.contains("param_0_0 param_0_1?"), "city required, days optional: {g}");
    }

    #[test]
    fn a_required_parameter_without_a_schema_is_named() {
        let tools = [ToolSpec { name: "f".into(), parameters: json!({"properties": {}, "required": ["x"]}) }];
        assert!(lark(&tools, 7, false).unwrap_err().contains("`x`"));
    }
}
