//! `strict: true` on a JSON schema (response format or tool), enforced by the
//! grammar over the schema as written rather than by the recipe's strict
//! normalisation, whose schema subset is narrower than OpenAI's and vLLM's
//! (it refuses `format`, `const`, `enum` without `type`, a top-level array, and
//! strict tools beside non-strict ones). The flag is taken out of the body
//! before conversion, and what strict mode means for the output is kept: an
//! object has no properties beyond those it lists.

use deepseek_recipe_core::conversation::ResponseFormat;
use serde_json::{Map, Value};

/// Which schemas of a request were strict.
#[derive(Debug, Default, PartialEq)]
pub struct Strict {
    pub response_format: bool,
    /// Names of the strict tools.
    pub tools: Vec<String>,
}

/// Take `strict` out of the response format and the tools of `body`.
pub fn take(body: &mut Map<String, Value>) -> Strict {
    let mut strict = Strict::default();
    // Chat Completions `response_format.json_schema`; Responses `text.format`.
    for (outer, inner) in [("response_format", "json_schema"), ("text", "format")] {
        let format = body.get_mut(outer).and_then(|f| f.get_mut(inner)).and_then(Value::as_object_mut);
        if let Some(flag) = format.and_then(|f| f.remove("strict")) {
            strict.response_format |= flag == Value::Bool(true);
        }
    }
    if let Some(Value::Array(tools)) = body.get_mut("tools") {
        for tool in tools.iter_mut() {
            // Chat Completions nests the function; Responses and Messages do not.
            let def = match tool.get("function").is_some() {
                true => tool.get_mut("function"),
                false => Some(tool),
            };
            let Some(def) = def.and_then(Value::as_object_mut) else { continue };
            if def.remove("strict") == Some(Value::Bool(true)) {
                if let Some(name) = def.get("name").and_then(Value::as_str) {
                    strict.tools.push(name.to_string());
                }
            }
        }
    }
    strict
}

impl Strict {
    /// The schema to enforce for a JSON response: the one the client wrote,
    /// closed to extra properties when strict.
    pub fn json_target(&self, written: &ResponseFormat, converted: Option<&Value>) -> Option<Value> {
        let mut schema = match written {
            ResponseFormat::JsonSchema(original) => Some(original.clone()),
            _ => converted.cloned(),
        };
        if let (true, Some(s)) = (self.response_format, schema.as_mut()) {
            close_objects(s);
        }
        schema
    }

    /// A tool's parameters to enforce, closed when the tool is strict.
    pub fn tool_parameters(&self, name: &str, parameters: &Value) -> Value {
        let mut parameters = parameters.clone();
        if self.tools.iter().any(|t| t == name) {
            close_objects(&mut parameters);
        }
        parameters
    }
}

/// Forbid properties an object schema does not list, unless it says otherwise.
pub fn close_objects(schema: &mut Value) {
    let Some(obj) = schema.as_object_mut() else { return };
    if let Some(Value::Object(properties)) = obj.get_mut("properties") {
        properties.values_mut().for_each(close_objects);
        obj.entry("additionalProperties").or_insert(Value::Bool(false));
    }
    for key in ["items", "additionalProperties", "not"] {
        if let Some(sub) = obj.get_mut(key) {
            close_objects(sub);
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(subs)) = obj.get_mut(key) {
            subs.iter_mut().for_each(close_objects);
        }
    }
    for key in ["$defs", "definitions", "$def"] {
        if let Some(Value::Object(defs)) = obj.get_mut(key) {
            defs.values_mut().for_each(close_objects);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn strict_flags_are_taken_and_remembered() {
        let mut body = json!({
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {}}},
            "tools": [{"type": "function", "function": {"name": "a", "strict": true}},
                      {"type": "function", "function": {"name": "b", "strict": false}}]
        })
        .as_object()
        .unwrap()
        .clone();
        let s = take(&mut body);
        assert_eq!(s, Strict { response_format: true, tools: vec!["a".into()] });
        assert!(body["response_format"]["json_schema"].get("strict").is_none());
        assert!(body["tools"][1]["function"].get("strict").is_none());
    }

    #[test]
    fn strict_schemas_are_closed() {
        let s = Strict { response_format: true, tools: vec!["a".into()] };
        let p = s.tool_parameters(
            "a",
            &json!({"type": "object", "properties": {"x": {"type": "object", "properties": {}}}}),
        );
        assert_eq!(p["additionalProperties"], false);
        assert_eq!(p["properties"]["x"]["additionalProperties"], false);
        assert_eq!(s.tool_parameters("b", &json!({"properties": {}})), json!({"properties": {}}));
    }
}
