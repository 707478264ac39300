//! Stop strings matched on the generated text here, before the output parser,
//! where a request asks for vLLM's rules, which the parser's matching cannot
//! follow: `min_tokens` (no stop string counts before that many tokens) and
//! `include_stop_str_in_output` (the text ends after the stop string, not
//! before it). As in vLLM, the whole generated text is matched.
//!
//! Tokens whose text might still become part of a stop string are held back;
//! on a match, the tokens wholly before the cut go on as tokens and the text
//! from them to the cut as one text piece, and the request ends.

use std::collections::VecDeque;
use std::sync::Arc;

use deepinfer_engine::request::TokenOutput;
use tokenizers::Tokenizer;

const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

/// The stop strings of one request and the tokens held back for them.
pub struct StopStrings {
    stops: Vec<String>,
    /// Longest stop string, in bytes.
    longest: usize,
    include: bool,
    min_tokens: usize,
    tokenizer: Arc<Tokenizer>,
    /// Tokens generated so far (EOS excluded).
    generated: usize,
    /// Tokens not yet released, with the end of each one's text in `text`.
    held: VecDeque<(TokenOutput, usize)>,
    /// The text of the held tokens.
    text: String,
}

/// What one batch of tokens gives.
pub enum Fed {
    /// These tokens may go on.
    Release(Vec<TokenOutput>),
    /// A stop string ended the output: `release` goes on, then `text`, the text
    /// up to the cut of the `tokens` tokens after them; nothing follows.
    Stop { release: Vec<TokenOutput>, text: String, tokens: usize },
}

impl StopStrings {
    pub fn new(stops: Vec<String>, include: bool, min_tokens: usize, tokenizer: Arc<Tokenizer>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            longest,
            include,
            min_tokens,
            tokenizer,
            generated: 0,
            held: VecDeque::new(),
            text: String::new(),
        }
    }

    /// Follow a batch of generated tokens.
    pub fn feed(&mut self, tokens: Vec<TokenOutput>) -> Fed {
        let mut release = Vec::new();
        for t in tokens {
            self.generated += 1;
            let before = self.text.len();
            self.held.push_back((t, 0));
            let ids: Vec<u32> = self.held.iter().map(|(t, _)| t.token).collect();
            self.text = self.tokenizer.decode(&ids, true).unwrap_or_default();
            let end = self.text.len();
            if let Some(last) = self.held.back_mut() {
                last.1 = end;
            }
            if self.generated >= self.min_tokens {
                // Only a stop string that ends in this token's text is new.
                let from = floor_boundary(&self.text, before.saturating_sub(self.longest.saturating_sub(1)));
                if let Some((start, stop_end)) = self.find(from) {
                    let cut = if self.include { stop_end } else { start };
                    let mut cut_from = 0;
                    while self.held.front().is_some_and(|&(_, e)| e <= cut) {
                        let (t, e) = self.held.pop_front().expect("checked");
                        cut_from = e;
                        release.push(t);
                    }
                    let text = self.text[cut_from..cut].to_string();
                    return Fed::Stop { release, text, tokens: self.held.len() };
                }
            }
            release.extend(self.release_safe());
        }
        Fed::Release(release)
    }

    /// Everything still held, at the end of the output.
    pub fn finish(&mut self) -> Vec<TokenOutput> {
        self.text.clear();
        self.held.drain(..).map(|(t, _)| t).collect()
    }

    /// The earliest stop string in the held text that ends after `from`.
    fn find(&self, from: usize) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, from + i + s.len())))
            .min()
    }

    /// Release the held tokens whose text can no longer be part of a stop
    /// string, up to a whole character.
    fn release_safe(&mut self) -> Vec<TokenOutput> {
        let safe = self.text.len().saturating_sub(self.longest.saturating_sub(1));
        let mut cut = 0;
        let mut out = Vec::new();
        while let Some(&(_, e)) = self.held.front() {
            if e > safe || !self.text.is_char_boundary(e) || self.text[..e].ends_with(REPLACEMENT_CHARACTER) {
                break;
            }
            out.push(self.held.pop_front().expect("checked").0);
            cut = e;
        }
        if cut > 0 {
            self.text.drain(..cut);
            self.held.iter_mut().for_each(|(_, e)| *e -= cut);
        }
        out
    }
}

/// Newline tokens at the start of the answer (or of the answer after
/// `</think>`), held until the next token: the output parser drops leading
/// newlines, and a newline piece dropped alone takes its log-probability
/// with it, where sent in one piece with the next token's text it keeps it.
pub struct LeadingNewlines {
    tokenizer: Arc<Tokenizer>,
    think_end: Option<u32>,
    /// Still at the start of the answer or the reasoning.
    at_start: bool,
    held: Vec<TokenOutput>,
}

impl LeadingNewlines {
    pub fn new(tokenizer: Arc<Tokenizer>, think_end: Option<u32>) -> Self {
        Self { tokenizer, think_end, at_start: true, held: Vec::new() }
    }

    /// The tokens that may go on now.
    pub fn feed(&mut self, tokens: Vec<TokenOutput>) -> Vec<TokenOutput> {
        let mut out = Vec::new();
        for t in tokens {
            let think_end = Some(t.token) == self.think_end;
            if self.at_start && !think_end {
                let text = self.tokenizer.decode(&[t.token], false).unwrap_or_default();
                if !text.is_empty() && text.chars().all(|c| c == '\n') {
                    self.held.push(t);
                    continue;
                }
                self.at_start = false;
            }
            out.append(&mut self.held);
            // The answer after the reasoning starts afresh.
            self.at_start |= think_end;
            out.push(t);
        }
        out
    }

    /// What is held at the end of the output.
    pub fn finish(&mut self) -> Vec<TokenOutput> {
        std::mem::take(&mut self.held)
    }
}

fn floor_boundary(text: &str, mut i: usize) -> usize {
    while i > 0 && !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::builtin_tokenizer;

    fn outputs(tok: &Tokenizer, text: &str) -> Vec<TokenOutput> {
        let ids = tok.encode_fast(text, false).unwrap().get_ids().to_vec();
        ids.into_iter().map(|token| TokenOutput { token, logprob: 0.0, top: Vec::new(), logits: None }).collect()
    }

    /// Feed `text` token by token; the released text, the stop's text piece and
    /// the tokens it stands for.
    fn run(text: &str, stop: &str, include: bool, min_tokens: usize) -> (String, Option<(String, usize)>) {
        let tok = Arc::new(builtin_tokenizer());
        let mut s = StopStrings::new(vec![stop.into()], include, min_tokens, tok.clone());
        let mut released = Vec::new();
        for t in outputs(&tok, text) {
            match s.feed(vec![t]) {
                Fed::Release(r) => released.extend(r.iter().map(|t| t.token)),
                Fed::Stop { release, text, tokens } => {
                    released.extend(release.iter().map(|t| t.token));
                    return (tok.decode(&released, true).unwrap(), Some((text, tokens)));
                }
            }
        }
        released.extend(s.finish().iter().map(|t| t.token));
        (tok.decode(&released, true).unwrap(), None)
    }

    #[test]
    fn the_text_ends_before_or_after_the_stop_string() {
        let (text, stop) = run("one two three four", "three", false, 0);
        assert_eq!(text + &stop.unwrap().0, "one two ");
        let (text, stop) = run("one two three four", "three", true, 0);
        assert_eq!(text + &stop.unwrap().0, "one two three");
    }

    #[test]
    fn leading_newlines_wait_for_the_next_token() {
        let tok = Arc::new(builtin_tokenizer());
        let mut lead = LeadingNewlines::new(tok.clone(), None);
        let newline = outputs(&tok, "\n");
        assert!(lead.feed(newline.clone()).is_empty());
        assert!(lead.feed(newline).is_empty());
        let next = outputs(&tok, "Hi");
        assert_eq!(lead.feed(next.clone()).len(), 2 + next.len(), "held newlines go with the next token");
        assert_eq!(lead.feed(outputs(&tok, "\n")).len(), 1, "only at the start");
    }

    #[test]
    fn no_stop_string_counts_before_min_tokens() {
        let tok = builtin_tokenizer();
        let n = tok.encode_fast("one two", false).unwrap().get_ids().len();
        let (text, stop) = run("one two one two", "one", false, n + 1);
        assert_eq!(text + &stop.unwrap().0, "one two ");
        let (text, stop) = run("one two", "one", false, 99);
        assert_eq!((text.as_str(), stop), ("one two", None));
    }
}
