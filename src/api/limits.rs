//! What a request's constraint enforces besides its output's form (see
//! [`super::constraint`]): vLLM's `min_tokens` with the stop ids, a thinking
//! budget, and one tool call at most where the model chooses.

use std::collections::VecDeque;

/// What a request limits besides its output's form.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Tokens generated before EOS or a stop token id may be (vLLM's `min_tokens`).
    pub min_tokens: usize,
    /// Stop token ids held back with EOS until `min_tokens`.
    pub stop_token_ids: Vec<u32>,
    /// Most reasoning tokens before `</think>` is forced (`thinking.budget_tokens`).
    pub thinking_budget: Option<usize>,
    /// At most one tool call where the model chooses (`auto` without parallel
    /// calls): the block is closed after the first call.
    pub one_call: bool,
}

impl Limits {
    /// Whether the limits need a constraint at all.
    pub fn any(&self) -> bool {
        self.min_tokens > 0 || self.thinking_budget.is_some() || self.one_call
    }
}

/// Watches a free tool-call block for the end of its first call
/// (`</｜DSML｜invoke>`), then forces the block's end and EOS.
#[derive(Clone)]
pub struct OneCall {
    pub dsml: u32,
    /// `\n</｜DSML｜tool_calls>` and EOS, as tokens.
    pub close_block: Vec<u32>,
    /// Tokens of the leading `\n`.
    pub newline_len: usize,
    /// The last token's text ended with `</`.
    pub after_close_tag: bool,
    /// The text after `</｜DSML｜`, while it may still become `invoke>`.
    pub invoke_end: Option<Vec<u8>>,
    pub forced: VecDeque<u32>,
}

impl OneCall {
    pub fn accept(&mut self, token: u32, bytes: &[u8]) {
        const END: &[u8] = b"invoke>";
        if !self.forced.is_empty() {
            self.forced.pop_front();
            return;
        }
        if token == self.dsml {
            self.invoke_end = self.after_close_tag.then(Vec::new);
            self.after_close_tag = false;
            return;
        }
        if let Some(text) = &mut self.invoke_end {
            text.extend_from_slice(bytes);
            if text.starts_with(END) {
                // A newline already written after `invoke>` is not forced again.
                let skip = if text.get(END.len()) == Some(&b'\n') { self.newline_len } else { 0 };
                self.forced = self.close_block.iter().copied().skip(skip).collect();
                self.invoke_end = None;
            } else if !END.starts_with(text) {
                self.invoke_end = None;
            }
        }
        self.after_close_tag = bytes.ends_with(b"</");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watcher() -> OneCall {
        OneCall {
            dsml: 7,
            close_block: vec![10, 5, 7, 8, 1],
            newline_len: 1,
            after_close_tag: false,
            invoke_end: None,
            forced: VecDeque::new(),
        }
    }

    #[test]
    fn the_block_closes_after_the_first_call() {
        let mut w = watcher();
        w.accept(3, b"value</");
        w.accept(7, b"");
        w.accept(4, b"inv");
        assert!(w.forced.is_empty());
        w.accept(9, b"oke>");
        assert_eq!(w.forced, [10, 5, 7, 8, 1]);
        let mut w = watcher();
        w.accept(3, b"</");
        w.accept(7, b"");
        w.accept(9, b"invoke>\n");
        assert_eq!(w.forced, [5, 7, 8, 1], "a newline already written is not forced again");
    }

    #[test]
    fn other_closing_tags_do_not_close_the_block() {
        let mut w = watcher();
        w.accept(3, b"</");
        w.accept(7, b"");
        w.accept(9, b"parameter>\n");
        assert!(w.forced.is_empty() && w.invoke_end.is_none());
    }
}
