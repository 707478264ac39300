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

use serde_json::Value;
use tokenizers::Tokenizer;

const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

/// The plain tokens the processor's decoder is holding, in the same way it does.
pub struct HeldTail {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
}

impl HeldTail {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self { tokenizer, ids: Vec::new() }
    }

    fn decode(&self) -> String {
        self.tokenizer.decode(&self.ids, false).unwrap_or_default()
    }

    /// Follow one batch of token ids as the decoder sees it: a special token
    /// flushes what is held, and at the end of a batch the held tokens are
    /// released once their text is non-empty and ends in a whole character.
    pub fn push(&mut self, ids: &[u32]) {
        for &id in ids {
            if self.is_added(id) {
                self.ids.clear();
            } else {
                self.ids.push(id);
            }
        }
        let text = self.decode();
        if !text.is_empty() && !text.ends_with(REPLACEMENT_CHARACTER) {
            self.ids.clear();
        }
    }

    /// The recipe decodes every added token (chat markers, `</think>`, DSML) alone.
    fn is_added(&self, id: u32) -> bool {
        self.tokenizer.get_added_vocabulary().get_added_tokens_decoder().contains_key(&id)
    }

    /// What is still held at the end of the output: its (lossy) text and count.
    pub fn take(&mut self) -> Option<(String, usize)> {
        if self.ids.is_empty() {
            return None;
        }
        let text = self.decode();
        let n = self.ids.len();
        self.ids.clear();
        Some((text, n))
    }
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
                    patch_reasoning_tokens(child, counts);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| patch_reasoning_tokens(v, counts)),
        _ => {}
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
        let a = tok.encode("a", false).unwrap().get_ids().to_vec();
        tail.push(&a);
        assert!(tail.take().is_none(), "whole characters are not held");
        if ids.len() > 1 {
            tail.push(&ids[..1]);
            let (text, n) = tail.take().expect("half a character is held");
            assert_eq!(n, 1);
            assert!(text.ends_with(REPLACEMENT_CHARACTER), "{text:?}");
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
