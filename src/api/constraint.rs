//! Structured output: the engine's [`TokenConstraint`] implemented with
//! llguidance over the model's tokenizer (JSON schema, any JSON object,
//! regular expression, Lark grammar).
//!
//! Two things are added around the grammar so that even a model with random
//! weights returns output that parses:
//!
//! - **Thinking.** In thinking mode the answer follows the reasoning, so the
//!   grammar only starts after `</think>`; the reasoning is free text, with
//!   EOS masked, and `</think>` is forced once half the token budget is spent.
//! - **Wrap-up.** When the tokens left fall to a reserve, an accepting
//!   grammar is ended with EOS, and a JSON grammar keeps only the allowed
//!   tokens that leave the fewest open strings, objects and arrays, so the
//!   document closes before `max_tokens` cuts it.
//! - **Plain numbers.** JSON numbers are written without an exponent, which
//!   the grammar allows but many parsers reject once it overflows a double.

use std::sync::Arc;

use anyhow::{anyhow, Context};
use deepinfer_engine::constraint::{ConstraintSource, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{token_bytes_from_tokenizer_json, Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::tool_grammar::{self, ToolSpec};

/// Longest grammar text (schema, regex or Lark) a request may carry, in bytes.
pub const MAX_GRAMMAR_BYTES: usize = 64 << 10;
/// Most tokens kept back to close the output; at most a third of `max_tokens`.
const MAX_RESERVE: usize = 64;

/// What the output must match.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputFormat {
    /// A JSON value valid under the schema; `None` is any JSON object.
    Json(Option<Value>),
    /// Text matching the whole regular expression.
    Regex(String),
    /// Text derived from a Lark grammar (llguidance's dialect).
    Lark(String),
    /// A forced tool-call block in DeepSeek's DSML format (see [`tool_grammar`]).
    ToolCalls { tools: Vec<ToolSpec>, at_most_one: bool },
}

/// Compiles [`OutputFormat`]s into per-request constraints; one per model.
pub struct ConstraintFactory {
    factory: ParserFactory,
    env: TokEnv,
    eos: u32,
    think_end: Option<u32>,
    /// `｜DSML｜`, which opens and closes every tag of a tool call.
    dsml: Option<u32>,
    /// The single token `</`, which with `｜DSML｜` starts every closing tag.
    close_tag: Option<u32>,
}

/// The tokenizer as llguidance sees it: the bytes of every token id.
struct ModelTokens {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for ModelTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).ok().and_then(|text| self.tokenizer.encode_fast(text, false).ok()) {
            Some(encoding) => encoding.get_ids().to_vec(),
            None => self.trie.greedy_tokenize(s),
        }
    }
}

impl ConstraintFactory {
    /// `vocab` is the model's vocabulary, which may be larger than the
    /// tokenizer's; ids past the tokenizer are never allowed.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: u32) -> anyhow::Result<Self> {
        let text = tokenizer.to_string(false).map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))?;
        let parsed: Value = serde_json::from_str(&text)?;
        let mut words = token_bytes_from_tokenizer_json(&parsed).context("structured output needs a byte-level BPE")?;
        // Added tokens (chat markers, `<think>`, DSML) are never grammar text:
        // the output parser reads them only as tokens.
        for (id, added) in tokenizer.get_added_tokens_decoder() {
            if let Some(w) = words.get_mut(id as usize) {
                *w = [&[TokTrie::SPECIAL_TOKEN_MARKER], added.content.as_bytes()].concat();
            }
        }
        anyhow::ensure!(words.len() <= vocab, "tokenizer has {} tokens, model {vocab}", words.len());
        while words.len() < vocab {
            let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            w.extend_from_slice(format!("<[{}]>", words.len()).as_bytes());
            words.push(w);
        }
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(ModelTokens { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.set_stderr_log_level(0);
        factory.quiet();
        let think_end = tokenizer.token_to_id("</think>");
        let close_tag = match tokenizer.encode_fast("</", false) {
            Ok(e) if e.get_ids().len() == 1 => Some(e.get_ids()[0]),
            _ => None,
        };
        Ok(Self { factory, env, eos, think_end, dsml: tokenizer.token_to_id("｜DSML｜"), close_tag })
    }

    /// A fresh constraint for one request. Errors describe what is wrong with
    /// the format, for the client.
    pub fn build(&self, format: &OutputFormat, max_tokens: usize, thinking: bool) -> Result<Guided, String> {
        let grammar = match format {
            OutputFormat::Json(schema) => {
                let mut schema = schema.clone().unwrap_or_else(|| json!({"type": "object"}));
                if let Some(obj) = schema.as_object_mut() {
                    // Compact JSON: a random model would otherwise spend its budget on whitespace.
                    obj.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            OutputFormat::Regex(rx) => TopLevelGrammar::from_regex(rx),
            OutputFormat::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            OutputFormat::ToolCalls { tools, at_most_one } => {
                let dsml = self.dsml.ok_or("tool calls cannot be forced: the tokenizer has no `｜DSML｜` token")?;
                TopLevelGrammar::from_lark(tool_grammar::lark(tools, dsml, *at_most_one)?)
            }
        };
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            return Err(format!("the output format cannot be compiled: {}", first_line(&e)));
        }
        let reserve = (max_tokens / 3).min(MAX_RESERVE);
        let reasoning_left = match (thinking, self.think_end) {
            (true, Some(_)) => Some(max_tokens.saturating_sub(reserve) / 2),
            _ => None,
        };
        Ok(Guided {
            matcher,
            env: self.env.clone(),
            eos: self.eos,
            think_end: self.think_end,
            reasoning_left,
            left: max_tokens,
            max_tokens,
            reserve,
            json: matches!(format, OutputFormat::Json(_)).then(JsonScan::default),
            closer: match format {
                OutputFormat::ToolCalls { .. } => self.close_tag.zip(self.dsml),
                _ => None,
            },
            calls: match (format, self.close_tag, self.dsml) {
                (OutputFormat::ToolCalls { .. }, Some(close), Some(dsml)) => {
                    let mut close_block = vec![close, dsml];
                    close_block.extend(self.env.tokenize("tool_calls>"));
                    Some(CallBudget { close_block, last_boundary: None, call_cost_max: 0 })
                }
                _ => None,
            },
            done: false,
        })
    }
}

/// A request's constraint, with the description that builds it again
/// where the request runs away from this process (a cluster's schedulers).
pub struct RequestConstraint {
    pub guided: Guided,
    pub description: String,
}

/// What [`ConstraintFactory::describe`] writes and its [`ConstraintSource`] reads.
#[derive(serde::Serialize, serde::Deserialize)]
struct Description {
    format: OutputFormat,
    thinking: bool,
}

impl ConstraintFactory {
    /// A constraint for one request and its description; errors as [`Self::build`]'s.
    pub fn build_described(
        &self,
        format: OutputFormat,
        max_tokens: usize,
        thinking: bool,
    ) -> Result<RequestConstraint, String> {
        let guided = self.build(&format, max_tokens, thinking)?;
        let description = serde_json::to_string(&Description { format, thinking }).map_err(|e| e.to_string())?;
        Ok(RequestConstraint { guided, description })
    }
}

impl ConstraintSource for ConstraintFactory {
    fn build(&self, spec: &str, max_tokens: usize) -> Result<Box<dyn TokenConstraint>, String> {
        if spec.len() > 2 * MAX_GRAMMAR_BYTES + 1024 {
            return Err(format!("a constraint description of {} bytes", spec.len()));
        }
        let d: Description =
            serde_json::from_str(spec).map_err(|e| format!("the constraint description does not parse: {e}"))?;
        Ok(Box::new(ConstraintFactory::build(self, &d.format, max_tokens, d.thinking)?))
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// Open strings, objects and arrays of the JSON written so far.
#[derive(Clone, Debug, Default)]
struct JsonScan {
    stack: Vec<u8>,
    in_string: bool,
    escaped: bool,
    in_number: bool,
}

impl JsonScan {
    /// Append `bytes`; false if they put an exponent into a number.
    fn push(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'e' | b'E' if self.in_number => return false,
                b'0'..=b'9' | b'-' | b'+' | b'.' => self.in_number = true,
                _ => self.in_number = false,
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.stack.push(b),
                b'}' | b']' => {
                    self.stack.pop();
                }
                _ => {}
            }
        }
        true
    }

    /// Whether `bytes` may follow: no exponent in a number.
    fn admits(&self, bytes: &[u8]) -> bool {
        // Only bytes outside strings can matter; most tokens inside a string stay there.
        (self.in_string && !bytes.contains(&b'"')) || self.clone().push(bytes)
    }

    /// How much is open: lower is closer to a complete document.
    fn depth(&self) -> usize {
        self.stack.len() + usize::from(self.in_string)
    }

    /// Rank of appending `bytes` when wrapping up: fewest open, then tokens
    /// that reach a separator or closer (they end numbers and literals).
    fn rank_after(&self, bytes: &[u8]) -> (usize, bool) {
        let mut next = self.clone();
        let mut structural = false;
        for &b in bytes {
            if !next.in_string && matches!(b, b',' | b':' | b'}' | b']') {
                structural = true;
            }
            next.push(std::slice::from_ref(&b));
        }
        (next.depth(), !structural)
    }
}

/// One request's structured-output state.
#[derive(Clone)]
pub struct Guided {
    matcher: Matcher,
    env: TokEnv,
    eos: u32,
    think_end: Option<u32>,
    /// `Some(n)` while reasoning: `n` tokens before `</think>` is forced.
    reasoning_left: Option<usize>,
    /// Tokens left before `max_tokens`.
    left: usize,
    max_tokens: usize,
    /// Tokens kept back to close the output.
    reserve: usize,
    json: Option<JsonScan>,
    /// Tool calls: `</` and `｜DSML｜`, the start of every closing tag. Wrapping
    /// up, the next tag is closed wherever the grammar allows it, so the block
    /// ends (optional parameters and further calls left out) within the budget.
    closer: Option<(u32, u32)>,
    /// Tool calls: what the calls so far cost, to end the block while another fits.
    calls: Option<CallBudget>,
    done: bool,
}

/// The cost of the calls in a forced tool-call block.
#[derive(Clone)]
struct CallBudget {
    /// `</｜DSML｜tool_calls>` as tokens.
    close_block: Vec<u32>,
    /// Tokens used when the block last could have been closed (after a call).
    last_boundary: Option<usize>,
    /// Most tokens one call has taken.
    call_cost_max: usize,
}

impl Guided {
    fn only(logits: &mut [f32], keep: u32) {
        for (id, l) in logits.iter_mut().enumerate() {
            if id != keep as usize {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

impl TokenConstraint for Guided {
    fn allowed(&mut self, logits: &mut [f32]) {
        if let Some(n) = self.reasoning_left {
            match self.think_end {
                Some(end) if n == 0 => Self::only(logits, end),
                _ => {
                    if let Some(l) = logits.get_mut(self.eos as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            return;
        }
        let mask = match self.matcher.compute_mask() {
            Ok(mask) => mask,
            Err(_) => {
                // Nothing can be allowed; the engine ends the request with an error.
                logits.fill(f32::NEG_INFINITY);
                return;
            }
        };
        let trie = self.env.tok_trie();
        let wrapping_up = self.left <= self.reserve;
        if wrapping_up && mask.is_allowed(self.eos) {
            Self::only(logits, self.eos);
            return;
        }
        if let Some(budget) = &mut self.calls {
            // Between two calls: close the block unless another call as long as
            // the longest so far still fits before the end.
            let used = self.max_tokens - self.left;
            let close = &budget.close_block;
            if self.matcher.validate_tokens(close).is_ok_and(|n| n == close.len()) {
                if let Some(b) = budget.last_boundary.filter(|&b| b < used) {
                    budget.call_cost_max = budget.call_cost_max.max(used - b);
                }
                budget.last_boundary = Some(used);
                let first_cost = if budget.call_cost_max == 0 { used } else { budget.call_cost_max };
                if self.left < first_cost + close.len() + 1 {
                    Self::only(logits, close[0]);
                    return;
                }
            }
        }
        if let (true, Some((close, dsml))) = (wrapping_up, self.closer) {
            if mask.is_allowed(close) && self.matcher.validate_tokens(&[close, dsml]).is_ok_and(|n| n == 2) {
                Self::only(logits, close);
                return;
            }
        }
        let json_ok = |scan: &JsonScan, t: u32| t == self.eos || scan.admits(trie.token(t));
        let best = match (&self.json, wrapping_up) {
            (Some(scan), true) => (0..logits.len() as u32)
                .filter(|&t| mask.is_allowed(t) && !trie.is_special_token(t) && json_ok(scan, t))
                .map(|t| scan.rank_after(trie.token(t)))
                .min(),
            _ => None,
        };
        for (id, l) in logits.iter_mut().enumerate() {
            let t = id as u32;
            let keep = mask.is_allowed(t)
                && match (&self.json, best) {
                    (Some(scan), Some(best)) => {
                        !trie.is_special_token(t) && json_ok(scan, t) && scan.rank_after(trie.token(t)) == best
                    }
                    (Some(scan), None) => json_ok(scan, t),
                    (None, _) => true,
                };
            if !keep {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    fn accept(&mut self, token: u32) {
        self.left = self.left.saturating_sub(1);
        if let Some(n) = self.reasoning_left {
            self.reasoning_left = if Some(token) == self.think_end { None } else { Some(n.saturating_sub(1)) };
            return;
        }
        if token == self.eos || self.matcher.consume_token(token).is_err() {
            self.done = true;
            return;
        }
        if let Some(scan) = &mut self.json {
            scan.push(self.env.tok_trie().token(token));
        }
        self.done = self.matcher.is_stopped();
    }

    fn is_done(&self) -> bool {
        self.done
    }

    fn fork(&self) -> Option<Box<dyn TokenConstraint>> {
        Some(Box::new(self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use deepinfer_engine::sampling::{sample, SamplingParams};

    use super::*;
    use crate::tokenizer::builtin_tokenizer;

    fn factory() -> (ConstraintFactory, Tokenizer) {
        let tok = builtin_tokenizer();
        let vocab = tok.get_vocab_size(true);
        (ConstraintFactory::new(&tok, vocab, 1).unwrap(), tok)
    }

    /// Run a constraint against pseudo-random logits until done or out of budget.
    fn drive(g: &mut Guided, vocab: usize, max_tokens: usize, seed: u64) -> Vec<u32> {
        let params = SamplingParams { temperature: 1.0, seed, ..SamplingParams::default() };
        let mut out = Vec::new();
        for pos in 0..max_tokens {
            let mut logits: Vec<f32> = (0..vocab)
                .map(|i| ((i as u64 * 2654435761 + seed * 97 + pos as u64 * 31) % 1000) as f32 / 100.0)
                .collect();
            g.allowed(&mut logits);
            let s = sample(&logits, &params, pos as u64);
            assert!(s.logprob.is_finite(), "no token allowed after {out:?}");
            g.accept(s.token);
            if s.token == 1 {
                break;
            }
            out.push(s.token);
            if g.is_done() {
                break;
            }
        }
        out
    }

    #[test]
    fn json_schema_output_always_parses_within_the_budget() {
        let (f, tok) = factory();
        let schema = json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["name", "age"]
        });
        for seed in 0..20 {
            let mut g = f.build(&OutputFormat::Json(Some(schema.clone())), 60, false).unwrap();
            let ids = drive(&mut g, 1024, 60, seed);
            let text = tok.decode(&ids, false).unwrap();
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
            assert!(v["name"].is_string() && v["age"].is_number(), "{text}");
        }
    }

    #[test]
    fn thinking_comes_before_the_grammar() {
        let (f, tok) = factory();
        let think_end = tok.token_to_id("</think>").unwrap();
        let mut g = f.build(&OutputFormat::Regex("(yes|no)".into()), 40, true).unwrap();
        let ids = drive(&mut g, 1024, 40, 3);
        let end = ids.iter().position(|&t| t == think_end).expect("`</think>` is forced");
        assert!(end <= 20, "within half the budget: {end}");
        let answer = tok.decode(&ids[end + 1..], false).unwrap();
        assert!(answer == "yes" || answer == "no", "{answer:?}");
    }

    #[test]
    fn forced_tool_calls_close_within_the_budget() {
        let (f, tok) = factory();
        let tools = vec![ToolSpec {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["city", "days"]}),
        }];
        for seed in 0..20 {
            let format = OutputFormat::ToolCalls { tools: tools.clone(), at_most_one: seed % 2 == 0 };
            let mut g = f.build(&format, 160, false).unwrap();
            let ids = drive(&mut g, 1024, 160, seed);
            let text = tok.decode(&ids, false).unwrap();
            assert!(g.is_done() || text.ends_with("tool_calls>"), "seed {seed}: unfinished {text:?}");
            assert!(text.starts_with("<｜DSML｜invoke name=\"get_weather\">\n"), "{text:?}");
            let calls = text.matches("invoke name=").count();
            assert!(calls >= 1 && (seed % 2 == 1 || calls == 1), "seed {seed}: {calls} calls");
        }
    }

    #[test]
    fn bad_formats_are_reported() {
        let (f, _) = factory();
        assert!(f.build(&OutputFormat::Regex("(".into()), 10, false).is_err());
        assert!(f.build(&OutputFormat::Lark("start: undefined_rule".into()), 10, false).is_err());
        assert!(f.build(&OutputFormat::Json(Some(json!({"type": "nonsense"}))), 10, false).is_err());
        assert!(f.build(&OutputFormat::Lark("start: \"a\" | \"b\"".into()), 10, false).is_ok());
    }
}
