//! Exact token accounting around the recipe's stream processor: tokens are
//! tokens, whatever their bytes.
//!
//! - The processor's decoder holds back plain tokens whose text ends inside a
//!   UTF-8 character until the character completes; a request that ends there
//!   would lose those tokens from its content and its count. [`HeldTail`] mirrors
//!   that buffer so the tail can be sent as text when the request finishes.
//! - The processor counts reasoning tokens by re-tokenizing the reasoning text,
//!   which need not give the tokens generated; [`Counts`] records the generated
//!   ones and [`patch_reasoning_tokens`] writes them into the response's usage.

use std::sync::{Arc, Mutex};

use deepinfer_engine::request::TokenOutput;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

/// The plain tokens the processor's decoder is holding, in the same way it does.
pub struct HeldTail {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    /// Their log-probabilities: (logprob, top alternatives) per id.
    logprobs: Vec<(f32, Vec<(u32, f32)>)>,
}

impl HeldTail {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self { tokenizer, ids: Vec::new(), logprobs: Vec::new() }
    }

    fn decode(&self) -> String {
        self.tokenizer.decode(&self.ids, false).unwrap_or_default()
    }

    /// Follow one batch of token ids as the decoder sees it: a special token
    /// flushes what is held, and at the end of a batch the held tokens are
    /// released once their text is non-empty and ends in a whole character.
    pub fn push(&mut self, tokens: &[TokenOutput]) {
        for t in tokens {
            if self.is_added(t.token) {
                self.ids.clear();
                self.logprobs.clear();
            } else {
                self.ids.push(t.token);
                self.logprobs.push((t.logprob, t.top.clone()));
            }
        }
        let text = self.decode();
        if !text.is_empty() && !text.ends_with(REPLACEMENT_CHARACTER) {
            self.ids.clear();
            self.logprobs.clear();
        }
    }

    /// The recipe decodes every added token (chat markers, `</think>`, DSML) alone.
    fn is_added(&self, id: u32) -> bool {
        self.tokenizer.get_added_vocabulary().get_added_tokens_decoder().contains_key(&id)
    }

    /// What is still held at the end of the output: its (lossy) text, and its
    /// tokens' log-probabilities as Chat Completions entries.
    pub fn take(&mut self) -> Option<(String, usize, Vec<Value>)> {
        if self.ids.is_empty() {
            return None;
        }
        let text = self.decode();
        let entry = |id: u32, logprob: f32| {
            let bytes = token_bytes(&self.tokenizer, id);
            json!({"token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes})
        };
        let entries = self
            .ids
            .iter()
            .zip(&self.logprobs)
            .map(|(&id, (logprob, top))| {
                let mut e = entry(id, *logprob);
                e["top_logprobs"] = Value::Array(top.iter().map(|&(t, lp)| entry(t, lp)).collect());
                e
            })
            .collect();
        let n = self.ids.len();
        self.ids.clear();
        self.logprobs.clear();
        Some((text, n, entries))
    }
}

/// The bytes of one token of a byte-level BPE vocabulary (GPT-2's byte-to-char
/// map inverted); the token's own text when it is not byte-level.
fn token_bytes(tokenizer: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(piece) = tokenizer.id_to_token(id) else { return Vec::new() };
    piece.chars().map(byte_of_char).collect::<Option<Vec<u8>>>().unwrap_or_else(|| piece.into_bytes())
}

/// GPT-2's byte-level alphabet: printable bytes stand for themselves, the others
/// are shifted to 256 + their rank.
fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let code = c as u32;
    if printable(code) {
        return Some(code as u8);
    }
    let rank = code.checked_sub(256)?;
    (0u32..=255).filter(|&b| !printable(b)).nth(rank as usize).map(|b| b as u8)
}

/// Generated-token counts of one request, read when its usage is written.
#[derive(Debug, Default)]
pub struct Counts {
    /// Tokens generated before `</think>` (all of them while thinking has not ended).
    pub reasoning: usize,
    /// Whether `</think>` has been generated.
    pub thinking_over: bool,
    /// Whether the request started in thinking mode.
    pub thinking: bool,
    /// Log-probability entries of the tokens held back to the end (see [`HeldTail`]).
    pub tail_logprobs: Vec<Value>,
    /// Prompt tokens served by each cache tier (device, host, disk), once finished.
    pub cached_by_tier: Option<[usize; 3]>,
}

pub type SharedCounts = Arc<Mutex<Counts>>;

impl Counts {
    /// Count one generated token.
    pub fn push(&mut self, token: u32, think_end: Option<u32>) {
        if !self.thinking || self.thinking_over {
            return;
        }
        if Some(token) == think_end {
            self.thinking_over = true;
        } else {
            self.reasoning += 1;
        }
    }
}

/// Write the generated reasoning count into every usage object of `value`
/// (Chat Completions `completion_tokens_details`, Responses `output_tokens_details`).
pub fn patch_reasoning_tokens(value: &mut Value, counts: &Counts) {
    patch_tail_logprobs(value, counts);
    patch_reasoning_tokens_in(value, counts);
    if let Some(tiers) = counts.cached_by_tier {
        patch_cache_tiers(value, tiers, 0);
    }
}

/// Every `usage` object gets `prompt_cache_tokens_by_tier`: the cached prompt
/// tokens by the tier they came from (a deepinfer extension).
fn patch_cache_tiers(value: &mut Value, tiers: [usize; 3], depth: usize) {
    if depth > 4 {
        return;
    }
    let Value::Object(map) = value else { return };
    for (key, child) in map.iter_mut() {
        match child {
            Value::Object(usage) if key == "usage" => {
                let by_tier = json!({"device": tiers[0], "host": tiers[1], "disk": tiers[2]});
                usage.insert("prompt_cache_tokens_by_tier".into(), by_tier);
            }
            Value::Object(_) => patch_cache_tiers(child, tiers, depth + 1),
            _ => {}
        }
    }
}

/// The held-back tokens' log-probabilities join the output that ended: in Chat
/// Completions the choice with a finish reason (a whole response, or the chunk
/// carrying it); in Responses the last `output_text` part of a finished response
/// (the response itself, or the `response.completed` event's).
fn patch_tail_logprobs(value: &mut Value, counts: &Counts) {
    if counts.tail_logprobs.is_empty() {
        return;
    }
    let response = if value.get("response").is_some() { &mut value["response"] } else { &mut *value };
    if response.get("object").and_then(Value::as_str) == Some("response") {
        let parts = response["output"].as_array_mut().into_iter().flatten().filter(|i| i["type"] == "message");
        let last = parts
            .flat_map(|i| i["content"].as_array_mut().into_iter().flatten())
            .filter(|c| c["type"] == "output_text")
            .last();
        if let Some(logprobs) = last.and_then(|part| part["logprobs"].as_array_mut()) {
            logprobs.extend(counts.tail_logprobs.iter().cloned());
        }
        return;
    }
    let Some(choices) = value.get_mut("choices").and_then(Value::as_array_mut) else { return };
    for choice in choices.iter_mut().filter(|c| !c["finish_reason"].is_null()) {
        let logprobs = &mut choice["logprobs"];
        if logprobs.is_null() {
            *logprobs = json!({"content": []});
        }
        if let Some(content) = logprobs["content"].as_array_mut() {
            content.extend(counts.tail_logprobs.iter().cloned());
        } else if logprobs["content"].is_null() {
            logprobs["content"] = Value::Array(counts.tail_logprobs.clone());
        }
    }
}

fn patch_reasoning_tokens_in(value: &mut Value, counts: &Counts) {
    match value {
        Value::Object(map) => {
            for (key, child) in map.iter_mut() {
                if matches!(key.as_str(), "completion_tokens_details" | "output_tokens_details") {
                    if let Some(details) = child.as_object_mut() {
                        if details.contains_key("reasoning_tokens") {
                            let n = if counts.thinking { counts.reasoning } else { 0 };
                            details.insert("reasoning_tokens".into(), Value::from(n));
                        }
                    }
                } else {
                    patch_reasoning_tokens_in(child, counts);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| patch_reasoning_tokens_in(v, counts)),
        _ => {}
    }
}

/// Add choice `index` of another completion to a Chat Completions response:
/// its choice, its completion tokens (the prompt is counted once).
pub fn merge_choice(into: &mut Value, other: Value, index: usize) {
    if let Some(mut choice) = other["choices"].get(0).cloned() {
        choice["index"] = Value::from(index);
        if let Some(choices) = into["choices"].as_array_mut() {
            choices.push(choice);
        }
    }
    for key in ["completion_tokens", "total_tokens"] {
        let add = other["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        if let Some(v) = into["usage"][key].as_u64() {
            into["usage"][key] = Value::from(v + add);
        }
    }
    if let Some(r) = into["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64() {
        let add = other["usage"]["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap_or(0);
        into["usage"]["completion_tokens_details"]["reasoning_tokens"] = Value::from(r + add);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::builtin_tokenizer;
    use serde_json::json;

    #[test]
    fn an_incomplete_character_is_held_and_released() {
        let tok = Arc::new(builtin_tokenizer());
        // "é" is two bytes; a byte-level vocabulary may split it.
        let ids = tok.encode("é", false).unwrap().get_ids().to_vec();
        let mut tail = HeldTail::new(tok.clone());
        let out = |id: u32| TokenOutput { token: id, logprob: -0.5, top: vec![(id, -0.5)], logits: None };
        let a: Vec<TokenOutput> = tok.encode("a", false).unwrap().get_ids().iter().map(|&i| out(i)).collect();
        tail.push(&a);
        assert!(tail.take().is_none(), "whole characters are not held");
        if ids.len() > 1 {
            tail.push(&[out(ids[0])]);
            let (text, n, entries) = tail.take().expect("half a character is held");
            assert_eq!(n, 1);
            assert!(text.ends_with(REPLACEMENT_CHARACTER), "{text:?}");
            assert_eq!(entries[0]["bytes"], json!([0xc3]), "the first byte of é");
        }
    }

    #[test]
    fn reasoning_tokens_are_the_generated_ones() {
        let mut c = Counts { thinking: true, ..Counts::default() };
        for t in [5, 6, 7, 99, 8, 9] {
            c.push(t, Some(99));
        }
        assert_eq!(c.reasoning, 3);
        let mut v = json!({"usage": {"completion_tokens": 6, "completion_tokens_details": {"reasoning_tokens": 40}}});
        patch_reasoning_tokens(&mut v, &c);
        assert_eq!(v["usage"]["completion_tokens_details"]["reasoning_tokens"], 3);
    }
}
