//! Every request field of the three protocols, and what the server does with it:
//! honoured, or refused with a 400 that names it. A field nobody listed is refused
//! too, so nothing a client sends is accepted and then ignored.
//!
//! The tables are the source of README's field table (a test keeps the two equal).

use serde_json::{Map, Value};

/// What the server does with one request field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Treatment {
    /// Does what the protocol says.
    Honoured(&'static str),
    /// Identifies the caller or the request and by definition changes no output.
    Identifier,
    /// Accepted only with one of these values (JSON text, e.g. `"1"`, `"false"`,
    /// `"\"auto\""`); anything else is a 400 saying why.
    Only(&'static [&'static str], &'static str),
    /// Always a 400 saying why.
    Refused(&'static str),
}

/// One top-level field of a protocol's request body.
#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub treatment: Treatment,
}

const fn honoured(name: &'static str, how: &'static str) -> Field {
    Field { name, treatment: Treatment::Honoured(how) }
}
const fn identifier(name: &'static str) -> Field {
    Field { name, treatment: Treatment::Identifier }
}
const fn only(name: &'static str, values: &'static [&'static str], why: &'static str) -> Field {
    Field { name, treatment: Treatment::Only(values, why) }
}
const fn refused(name: &'static str, why: &'static str) -> Field {
    Field { name, treatment: Treatment::Refused(why) }
}

const NO_STORE: &str = "this server keeps no stored responses";
const NO_AUDIO: &str = "the model reads and writes text only";
const NO_SERVER_TOOLS: &str = "this server runs no tools of its own; pass client tools in `tools`";
const ONE_TIER: &str = "this server has one service tier";

/// Extensions every protocol accepts (as vLLM does).
const EXTENSIONS: &[Field] = &[
    honoured("top_k", "keeps the k most likely tokens (0: all)"),
    honoured("min_p", "drops tokens below min_p × the most likely one's probability"),
    honoured("repetition_penalty", "divides the logits of tokens seen in the prompt or output (> 0, 1: off)"),
    honoured("ignore_eos", "generates past EOS up to the token limit"),
    honoured("seed", "seeds the request's own random stream: same seed, same tokens"),
];

/// OpenAI Chat Completions (`POST /v1/chat/completions`).
pub const CHAT_COMPLETIONS: &[Field] = &[
    honoured("model", "must name the served model"),
    honoured("messages", "the conversation, in DeepSeek's chat template"),
    honoured("max_tokens", "limits generated tokens, thinking included"),
    honoured("max_completion_tokens", "as `max_tokens` (both given: they must agree)"),
    honoured("temperature", "scales the logits (0: greedy)"),
    honoured("top_p", "nucleus sampling"),
    honoured("frequency_penalty", "lowers a token's logit by this much per earlier use in the output"),
    honoured("presence_penalty", "lowers the logit of every token already in the output"),
    honoured("logit_bias", "adds a bias in [-100, 100] to the listed token ids"),
    honoured("logprobs", "log-probability of each output token"),
    honoured("top_logprobs", "that many alternatives per token (needs `logprobs`)"),
    honoured("stop", "up to 16 stop strings"),
    honoured("stream", "server-sent events"),
    honoured("stream_options", "`include_usage`: a final chunk with usage and no choices"),
    honoured("response_format", "text, json_object, json_schema, regex or grammar, enforced while sampling"),
    honoured("tools", "function tools, in DeepSeek's tool-call format"),
    honoured("tool_choice", "none, auto, or required / a named function: a valid call enforced while sampling"),
    honoured("parallel_tool_calls", "false: one call at most (exactly one with a forced choice)"),
    honoured("reasoning_effort", "`none` turns thinking off"),
    honoured("thinking", "DeepSeek's `{\"type\": \"enabled\"|\"disabled\"}`; `budget_tokens` ends thinking there"),
    honoured(
        "n",
        "1 to 16 completions; the others reuse the first's prompt blocks from the prefix cache (not with `stream`)",
    ),
    only("modalities", &["[\"text\"]"], NO_AUDIO),
    only("store", &["false"], NO_STORE),
    only("service_tier", &["\"auto\"", "\"default\""], ONE_TIER),
    only("best_of", &["1"], "one completion per request"),
    only("echo", &["false"], "Chat Completions returns no prompt; use /v1/completions"),
    identifier("user"),
    identifier("safety_identifier"),
    identifier("prompt_cache_key"),
    identifier("metadata"),
    refused("audio", NO_AUDIO),
    refused("prediction", "predicted outputs are not supported"),
    refused("functions", "deprecated by OpenAI; use `tools`"),
    refused("function_call", "deprecated by OpenAI; use `tool_choice`"),
    refused("web_search_options", NO_SERVER_TOOLS),
    refused("verbosity", "the model has no verbosity control"),
    honoured(
        "prompt_cache_retention",
        "`in_memory`: cached in memory for an hour after last use, never on disk; `24h`: 24 hours, disk included",
    ),
    // vLLM's extensions, with vLLM's meanings.
    honoured("chat_template_kwargs", "`thinking` or `enable_thinking` (a boolean) switches thinking; any other key is a 400"),
    honoured(
        "structured_outputs",
        "`json` (a schema), `regex`, `choice`, `grammar` (Lark) or `json_object`, enforced while sampling; `whitespace_pattern` and `structural_tag` are a 400",
    ),
    honoured("guided_json", "as `structured_outputs.json`"),
    honoured("guided_regex", "as `structured_outputs.regex`"),
    honoured("guided_choice", "as `structured_outputs.choice`"),
    honoured("guided_grammar", "as `structured_outputs.grammar`"),
    honoured("min_tokens", "EOS, `stop_token_ids` and stop strings are held back until this many tokens"),
    honoured("stop_token_ids", "generation ends at any of these tokens, whose text is left out"),
    honoured("include_stop_str_in_output", "the stop string or stop token that ended the output stays at its end"),
    only("skip_special_tokens", &["true"], "special tokens are the chat format's structure, read by the output parser"),
    honoured("return_tokens_as_token_ids", "log-probability tokens are written `token_id:N`"),
    honoured("add_generation_prompt", "false: the prompt ends after the last message, without the assistant's opening"),
    honoured("continue_final_message", "the last message, the assistant's, is continued rather than answered"),
    honoured("truncate_prompt_tokens", "keeps the prompt's last k tokens (-1: as many as the context holds)"),
    honoured("priority", "admission order in the scheduler's queue (each instance's, on a cluster): lower first, ties in arrival order"),
    honoured("request_id", "the response id is `chatcmpl-` and this id"),
];

/// OpenAI Responses (`POST /v1/responses`).
pub const RESPONSES: &[Field] = &[
    honoured("model", "must name the served model"),
    honoured("input", "the conversation: a string or input items"),
    honoured("instructions", "a system message before the input"),
    honoured("max_output_tokens", "limits generated tokens, thinking included"),
    honoured("temperature", "scales the logits (0: greedy)"),
    honoured("top_p", "nucleus sampling"),
    honoured("top_logprobs", "log-probabilities with that many alternatives"),
    honoured("stream", "server-sent events"),
    honoured("text", "`format`: text, json_object or json_schema, enforced while sampling"),
    honoured("tools", "function tools, in DeepSeek's tool-call format"),
    honoured("tool_choice", "none, auto, required or a named function"),
    honoured("reasoning", "`effort: none` turns thinking off"),
    honoured("thinking", "DeepSeek's `{\"type\": \"enabled\"|\"disabled\"}`, as `reasoning.effort`"),
    honoured("frequency_penalty", "as in Chat Completions"),
    honoured("presence_penalty", "as in Chat Completions"),
    honoured("logit_bias", "as in Chat Completions"),
    only("store", &["false"], NO_STORE),
    only("background", &["false"], NO_STORE),
    only("service_tier", &["\"auto\"", "\"default\""], ONE_TIER),
    only("truncation", &["\"disabled\""], "a prompt longer than the context is refused, never truncated"),
    only("parallel_tool_calls", &["true"], "any number of tool calls per turn"),
    identifier("user"),
    identifier("safety_identifier"),
    identifier("prompt_cache_key"),
    identifier("metadata"),
    refused("previous_response_id", NO_STORE),
    refused("conversation", NO_STORE),
    refused("prompt", "stored prompt templates are not kept here"),
    refused("include", "no extra output items are available"),
    refused("max_tool_calls", "not enforced; count the calls client-side"),
    refused("stream_options", "no stream options are supported for Responses"),
    honoured(
        "prompt_cache_retention",
        "`in_memory`: cached in memory for an hour after last use, never on disk; `24h`: 24 hours, disk included",
    ),
];

/// Anthropic Messages (`POST /v1/messages`).
pub const MESSAGES: &[Field] = &[
    honoured("model", "must name the served model"),
    honoured("messages", "the conversation, in DeepSeek's chat template"),
    honoured("system", "the system prompt"),
    honoured("max_tokens", "required; limits generated tokens, thinking included"),
    honoured("temperature", "scales the logits (0: greedy)"),
    honoured("top_p", "nucleus sampling"),
    honoured("stop_sequences", "stop strings"),
    honoured("stream", "server-sent events"),
    honoured("tools", "client tools, in DeepSeek's tool-call format"),
    honoured("tool_choice", "auto, none, or any / tool: a valid call enforced while sampling; `disable_parallel_tool_use`: at most one call"),
    honoured("thinking", "enabled or disabled; `budget_tokens` ends thinking there"),
    honoured("output_config", "`effort`; `format` json_schema enforced while sampling"),
    identifier("metadata"),
    honoured(
        "cache_control",
        "`ttl` 5m (default) or 1h, here or on any block: the prompt stays cached that long after last use",
    ),
    only("service_tier", &["\"auto\"", "\"standard_only\""], ONE_TIER),
    refused("container", NO_SERVER_TOOLS),
    refused("mcp_servers", NO_SERVER_TOOLS),
    refused("context_management", "the conversation is used as sent"),
];

/// OpenAI legacy Completions (`POST /v1/completions`).
pub const COMPLETIONS: &[Field] = &[
    honoured("model", "must name the served model"),
    honoured("prompt", "raw text (or a list of one string), no chat template"),
    honoured("max_tokens", "limits generated tokens (default 16)"),
    honoured("temperature", "scales the logits (0: greedy)"),
    honoured("top_p", "nucleus sampling"),
    honoured("frequency_penalty", "as in Chat Completions"),
    honoured("presence_penalty", "as in Chat Completions"),
    honoured("logit_bias", "as in Chat Completions"),
    honoured("logprobs", "that many alternatives per token, in the legacy shape"),
    honoured("echo", "the prompt precedes the completion (not with `logprobs`)"),
    honoured("stop", "up to 16 stop strings; the text ends before the first"),
    honoured("stream", "server-sent events"),
    honoured("stream_options", "`include_usage`: a final chunk with usage and no choices"),
    only("n", &["1"], "one completion per request"),
    only("best_of", &["1"], "one completion per request"),
    identifier("user"),
    refused("suffix", "insertion is not supported"),
];

/// Every field `table` lists plus the extensions.
pub fn all(table: &'static [Field]) -> impl Iterator<Item = &'static Field> {
    table.iter().chain(EXTENSIONS)
}

/// Refuse any field of `body` the table refuses or does not know.
pub fn check(table: &'static [Field], body: &Map<String, Value>) -> Result<(), String> {
    // Iterate the body in its own (sorted) key order: the first offending key is reported.
    for (key, value) in body {
        let Some(field) = all(table).find(|f| f.name == key) else {
            return Err(format!("unknown field `{key}`"));
        };
        match field.treatment {
            Treatment::Honoured(_) | Treatment::Identifier => {}
            Treatment::Only(_, _) if value.is_null() => {}
            Treatment::Only(values, why) => {
                let accepted = values.iter().any(|v| serde_json::from_str::<Value>(v).is_ok_and(|v| &v == value));
                if !accepted {
                    return Err(format!("`{key}` = {value} is not supported: {why}"));
                }
            }
            Treatment::Refused(_) if value.is_null() => {}
            Treatment::Refused(why) => return Err(format!("`{key}` is not supported: {why}")),
        }
    }
    Ok(())
}

/// The README table of one protocol: `| field | treatment |` rows.
pub fn markdown_rows(table: &'static [Field]) -> String {
    let mut out = String::new();
    for f in all(table) {
        let text = match f.treatment {
            Treatment::Honoured(how) => format!("honoured: {how}"),
            Treatment::Identifier => "accepted: an identifier, changes no output".to_string(),
            Treatment::Only(values, why) => format!("only {}; otherwise 400 ({why})", values.join(" or ")),
            Treatment::Refused(why) => format!("400 ({why})"),
        };
        out.push_str(&format!("| `{}` | {} |\n", f.name, text.replace('|', "\\|")));
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
    fn unknown_and_refused_fields_are_named() {
        let err = check(CHAT_COMPLETIONS, &body(json!({"model": "m", "messages": [], "bogus": 1}))).unwrap_err();
        assert_eq!(err, "unknown field `bogus`");
        let err = check(CHAT_COMPLETIONS, &body(json!({"audio": {"voice": "x"}}))).unwrap_err();
        assert!(err.starts_with("`audio` is not supported"), "{err}");
        let err = check(CHAT_COMPLETIONS, &body(json!({"store": true}))).unwrap_err();
        assert!(err.contains("`store` = true"), "{err}");
        let err = check(COMPLETIONS, &body(json!({"n": 2}))).unwrap_err();
        assert!(err.contains("`n` = 2"), "{err}");
        let err = check(MESSAGES, &body(json!({"mcp_servers": []}))).unwrap_err();
        assert!(err.contains("mcp_servers"), "{err}");
    }

    #[test]
    fn neutral_values_of_limited_fields_pass() {
        let ok = json!({"n": 1, "store": false, "echo": false, "best_of": 1, "service_tier": "auto",
                        "modalities": ["text"], "audio": null, "user": "u", "top_k": 5});
        check(CHAT_COMPLETIONS, &body(ok)).unwrap();
        check(RESPONSES, &body(json!({"truncation": "disabled", "store": false}))).unwrap();
    }

    /// README's field tables are these tables (regenerate: `DEEPINFER_WRITE_FIELDS=1`).
    #[test]
    fn readme_tables_are_the_code_tables() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md");
        let readme = std::fs::read_to_string(path).unwrap();
        let mut missing = Vec::new();
        for (title, table) in [
            ("Chat Completions", CHAT_COMPLETIONS),
            ("Responses", RESPONSES),
            ("Messages", MESSAGES),
            ("Completions", COMPLETIONS),
        ] {
            let rows = markdown_rows(table);
            if std::env::var("DEEPINFER_WRITE_FIELDS").is_ok() {
                println!("<!-- {title} -->\n{rows}");
            }
            if !readme.contains(&rows) {
                missing.push(title);
            }
        }
        assert!(missing.is_empty(), "README.md's field tables differ from the code for {missing:?}");
    }

    #[test]
    fn no_field_is_listed_twice() {
        for table in [CHAT_COMPLETIONS, RESPONSES, MESSAGES, COMPLETIONS] {
            let mut names: Vec<&str> = all(table).map(|f| f.name).collect();
            let n = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), n);
        }
    }
}
