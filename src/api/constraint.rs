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
//!   the grammar allows but many parsers reject once it overflows a double;
//!   typed numbers are bounded in the schema itself ([`super::schema_bounds`]).
//!
//! The same constraint carries the request's [`Limits`], with or without a
//! grammar: `min_tokens` (EOS and stop ids masked until then) and a thinking
//! budget (`</think>` forced when it is spent).

use std::collections::VecDeque;
use std::sync::Arc;

use anyhow::{anyhow, Context};
use deepinfer_engine::constraint::{ConstraintSource, TokenConstraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{token_bytes_from_tokenizer_json, Matcher, ParserFactory};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::json_scan::JsonScan;
pub use super::limits::Limits;
use super::limits::OneCall;
use super::schema_bounds;
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
        self.build_with(Some(format), max_tokens, thinking, &Limits::default())
    }

    /// A constraint with limits, and a grammar when `format` is given.
    pub fn build_with(
        &self,
        format: Option<&OutputFormat>,
        max_tokens: usize,
        thinking: bool,
        limits: &Limits,
    ) -> Result<Guided, String> {
        let matcher = match format {
            Some(format) => Some(self.matcher(format)?),
            None => None,
        };
        let reserve = (max_tokens / 3).min(MAX_RESERVE);
        let reasoning_left = match (thinking, self.think_end, &matcher, limits.thinking_budget) {
            // A grammar needs room after the reasoning: half of what is left.
            (true, Some(_), Some(_), budget) => {
                let half = max_tokens.saturating_sub(reserve) / 2;
                Some(budget.map_or(half, |b| b.min(half)))
            }
            (true, Some(_), None, budget) => budget,
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
            json: matches!(format, Some(OutputFormat::Json(_))).then(JsonScan::default),
            closer: match format {
                Some(OutputFormat::ToolCalls { .. }) => self.close_tag.zip(self.dsml),
                _ => None,
            },
            calls: match (format, self.close_tag, self.dsml) {
                (Some(OutputFormat::ToolCalls { .. }), Some(close), Some(dsml)) => {
                    let mut close_block = vec![close, dsml];
                    close_block.extend(self.env.tokenize("tool_calls>"));
                    Some(CallBudget { close_block, last_boundary: None, call_cost_max: 0 })
                }
                _ => None,
            },
            one_call: match (limits.one_call, self.close_tag, self.dsml) {
                (false, _, _) => None,
                (true, Some(close_tag), Some(dsml)) => {
                    let mut close_block = self.env.tokenize("\n");
                    let newline_len = close_block.len();
                    close_block.extend([close_tag, dsml]);
                    close_block.extend(self.env.tokenize("tool_calls>"));
                    close_block.push(self.eos);
                    Some(OneCall {
                        dsml,
                        close_block,
                        newline_len,
                        after_close_tag: false,
                        invoke_end: None,
                        forced: VecDeque::new(),
                    })
                }
                _ => {
                    return Err("one tool call cannot be enforced: the tokenizer has no `</` or `｜DSML｜` token".into())
                }
            },
            min_tokens: limits.min_tokens,
            early_stops: [self.eos].into_iter().chain(limits.stop_token_ids.iter().copied()).collect(),
            done: false,
        })
    }

    fn matcher(&self, format: &OutputFormat) -> Result<Matcher, String> {
        let grammar = match format {
            OutputFormat::Json(schema) => {
                let mut schema = schema.clone().unwrap_or_else(|| json!({"type": "object"}));
                schema_bounds::tighten(&mut schema);
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
        Ok(matcher)
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
    format: Option<OutputFormat>,
    thinking: bool,
    #[serde(default)]
    limits: Limits,
}

impl ConstraintFactory {
    /// A constraint for one request and its description; errors as [`Self::build`]'s.
    pub fn build_described(
        &self,
        format: Option<OutputFormat>,
        max_tokens: usize,
        thinking: bool,
        limits: Limits,
    ) -> Result<RequestConstraint, String> {
        let guided = self.build_with(format.as_ref(), max_tokens, thinking, &limits)?;
        let description =
            serde_json::to_string(&Description { format, thinking, limits }).map_err(|e| e.to_string())?;
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
        Ok(Box::new(self.build_with(d.format.as_ref(), max_tokens, d.thinking, &d.limits)?))
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

/// One request's structured-output state.
#[derive(Clone)]
pub struct Guided {
    /// The grammar; `None` when only [`Limits`] apply.
    matcher: Option<Matcher>,
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
    /// Closes the tool-call block after its first call.
    one_call: Option<OneCall>,
    /// Tokens before `early_stops` may be sampled.
    min_tokens: usize,
    /// EOS and the request's stop token ids.
    early_stops: Vec<u32>,
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

impl Guided {
    /// Hold back EOS and the stop ids until `min_tokens`, unless nothing else
    /// is left (a grammar that must end now).
    fn hold_early_stops(&self, logits: &mut [f32]) {
        if self.max_tokens - self.left >= self.min_tokens {
            return;
        }
        let saved: Vec<(usize, f32)> =
            self.early_stops.iter().filter_map(|&t| logits.get(t as usize).map(|&l| (t as usize, l))).collect();
        saved.iter().for_each(|&(t, _)| logits[t] = f32::NEG_INFINITY);
        if !logits.iter().any(|l| l.is_finite()) {
            saved.into_iter().for_each(|(t, l)| logits[t] = l);
        }
    }

    fn grammar_mask(&mut self, logits: &mut [f32]) {
        if let Some(n) = self.reasoning_left {
            match self.think_end {
                Some(end) if n == 0 => Self::only(logits, end),
                // A grammar's answer must follow the reasoning: no EOS inside it.
                _ if self.matcher.is_some() => {
                    if let Some(l) = logits.get_mut(self.eos as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
                _ => {}
            }
            return;
        }
        let Some(matcher) = self.matcher.as_mut() else { return };
        let mask = match matcher.compute_mask() {
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
            // Between two calls: close the block unless another call still fits
            // before the end.
            let used = self.max_tokens - self.left;
            let close = &budget.close_block;
            if matcher.validate_tokens(close).is_ok_and(|n| n == close.len()) {
                if let Some(b) = budget.last_boundary.filter(|&b| b < used) {
                    budget.call_cost_max = budget.call_cost_max.max(used - b);
                }
                budget.last_boundary = Some(used);
                let first_cost = if budget.call_cost_max == 0 { used } else { budget.call_cost_max };
                // Calls differ in length (a random model's by half or more): room for
                // twice the longest so far, or the next call may be cut off.
                if self.left < 2 * first_cost + close.len() + 1 {
                    Self::only(logits, close[0]);
                    return;
                }
            }
        }
        if let (true, Some((close, dsml))) = (wrapping_up, self.closer) {
            if mask.is_allowed(close) && matcher.validate_tokens(&[close, dsml]).is_ok_and(|n| n == 2) {
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
}

impl TokenConstraint for Guided {
    fn allowed(&mut self, logits: &mut [f32]) {
        if let Some(&t) = self.one_call.as_ref().and_then(|o| o.forced.front()) {
            Self::only(logits, t);
            return;
        }
        self.grammar_mask(logits);
        self.hold_early_stops(logits);
    }

    fn accept(&mut self, token: u32) {
        self.left = self.left.saturating_sub(1);
        if let Some(one) = &mut self.one_call {
            one.accept(token, self.env.tok_trie().token(token));
        }
        if let Some(n) = self.reasoning_left {
            self.reasoning_left = if Some(token) == self.think_end { None } else { Some(n.saturating_sub(1)) };
            return;
        }
        let Some(matcher) = self.matcher.as_mut() else { return };
        if token == self.eos || matcher.consume_token(token).is_err() {
            self.done = true;
            return;
        }
        if let Some(scan) = &mut self.json {
            scan.push(self.env.tok_trie().token(token));
        }
        self.done = matcher.is_stopped();
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
