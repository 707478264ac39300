//! Proposing the next drafts of decoding requests after a step, from the
//! hidden rows that step computed.
//!
//! MTP (V4) needs, for position `i`, the target's final streams at `i` and
//! the token at `i + 1`; its own window state advances only over real
//! tokens (it catches up on the step's accepted positions, bounded by its
//! window), and the chain of further drafts, which feeds each draft's output
//! streams back as the next position's, runs on a copy that is then
//! discarded. DSpark (V4.1) reads the target's windows of the DSpark target
//! layers; when the step's drafts were rejected, the accepted positions are
//! observed into a copy of those windows.

use super::Proposal;
use crate::constraint::TokenConstraint;
use crate::model::state::LayerState;
use crate::model::{LogitsWanted, Model, MtpChunk, SequenceState};
use crate::sampling::{adjust_logits_from_history, sample, token_history, SamplingParams};

/// How one request picks its drafts: exactly as it will pick the target's
/// token at that position (adjustments, constraint, greedy or its own
/// uniform), so that a draft is accepted when the target agrees.
pub struct Chooser<'a> {
    pub params: &'a SamplingParams,
    /// The penalties' view of the sequence ([`token_history`]: every distinct
    /// prompt token, ascending, with its count in the output), then the
    /// drafts chosen; empty when the request adjusts no logits.
    pub history: Vec<(u32, u32)>,
    /// A copy of the request's constraint, advanced over the drafts.
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

impl<'a> Chooser<'a> {
    /// A chooser for a request whose prompt and output so far are these.
    pub fn new(params: &'a SamplingParams, prompt: &[u32], output: &[u32]) -> Self {
        let history = if params.adjusts_logits() { token_history(prompt, output) } else { Vec::new() };
        Self { params, history, constraint: None }
    }

    /// The draft for `position` from its logits row, and its probability.
    fn choose(&mut self, position: usize, row: &mut [f32]) -> (u32, f64) {
        if self.params.adjusts_logits() {
            adjust_logits_from_history(row, self.params, &self.history);
        }
        if let Some(c) = &mut self.constraint {
            c.allowed(row);
        }
        let s = sample(row, self.params, position as u64);
        if let Some(c) = &mut self.constraint {
            c.accept(s.token);
        }
        if self.params.adjusts_logits() {
            count_output_token(&mut self.history, s.token);
        }
        let p = f64::from(s.logprob).exp();
        (s.token, if p.is_finite() { p } else { 0.0 })
    }
}

/// Add one output occurrence of `token` to a [`token_history`].
pub fn count_output_token(history: &mut Vec<(u32, u32)>, token: u32) {
    match history.binary_search_by_key(&token, |&(t, _)| t) {
        Ok(i) => history[i].1 += 1,
        Err(i) => history.insert(i, (token, 1)),
    }
}

/// One request to draft for.
pub struct DraftInput<'a> {
    pub state: &'a mut SequenceState,
    /// Hidden rows of the step's chunk (MTP: final streams; DSpark: its
    /// target layers' means), for positions `rows_from..`.
    pub rows: &'a [f32],
    pub rows_from: usize,
    /// The sequence from position `tokens_from` (at or before `rows_from`);
    /// its last token is the target's newest, not yet fed.
    pub tokens: &'a [u32],
    pub tokens_from: usize,
    /// Most drafts wanted.
    pub count: usize,
    /// A chain of drafts stops once the chance that all of them are accepted
    /// falls below this: the next one could not pay for its verification.
    pub min_survival: f64,
    pub chooser: Chooser<'a>,
}

impl DraftInput<'_> {
    /// The position of the target's newest token.
    fn end(&self) -> usize {
        assert!(self.tokens_from <= self.rows_from, "the tokens cover the rows");
        self.tokens_from + self.tokens.len() - 1
    }
}

/// Propose drafts for every input; one proposal per input, in order.
pub fn draft_next(model: &Model, inputs: &mut [DraftInput]) -> Vec<Proposal> {
    if model.is_v41() {
        inputs.iter_mut().map(|input| dspark(model, input)).collect()
    } else {
        mtp(model, inputs)
    }
}

fn dspark(model: &Model, input: &mut DraftInput) -> Proposal {
    let m = model.v41.as_ref().expect("a V4.1 model");
    let end = input.end();
    let state = input.state.v41.as_ref().expect("a V4.1 state");
    let at = end + 1;
    if input.count == 0 {
        return Proposal { at, tokens: Vec::new(), acceptance: Vec::new() };
    }
    let copy;
    let windows = if state.position == end {
        &state.dspark_windows
    } else {
        // The step's drafts were rejected: the accepted positions from the
        // state's end onwards are only in this step's rows.
        assert!(state.position < end && state.position >= input.rows_from, "accepted rows are this step's");
        let width = row_width(m);
        let mut w = state.dspark_windows.clone();
        let rows = &input.rows[(state.position - input.rows_from) * width..(end - input.rows_from) * width];
        m.dspark_observe_windows(rows, state.position, &mut w);
        copy = w;
        &copy
    };
    let chooser = &mut input.chooser;
    let drafts = m.dspark_propose_with(input.tokens[end - input.tokens_from], end - 1, windows, &mut |i, row| {
        if i < input.count {
            chooser.choose(at + i, row).0
        } else {
            // Past what will be verified: no need to mirror the target.
            crate::v41::ops::argmax(row)
        }
    });
    let n = input.count.min(drafts.tokens.len());
    Proposal {
        at,
        tokens: drafts.tokens[..n].to_vec(),
        acceptance: drafts.confidence[..n].iter().map(|&c| super::policy::sigmoid(c)).collect(),
    }
}

/// Values per row of DSpark's target hidden state.
fn row_width(m: &crate::v41::ModelV41) -> usize {
    m.config.dspark.as_ref().map_or(1, |d| d.target_layer_ids.len()) * m.config.dim
}

fn mtp(model: &Model, inputs: &mut [DraftInput]) -> Vec<Proposal> {
    let cfg = &model.config;
    let width = cfg.hc_mult * cfg.hidden_size;
    let window = cfg.sliding_window;
    let mut proposals: Vec<Proposal> =
        inputs.iter().map(|i| Proposal { at: i.end() + 1, tokens: Vec::new(), acceptance: Vec::new() }).collect();

    // Catch up on the real positions this step computed; the last one's
    // logits give the first draft.
    let mut spans = Vec::with_capacity(inputs.len());
    for input in inputs.iter_mut() {
        let end = input.end();
        let st = &mut *input.state;
        if st.mtp_position < input.rows_from || st.mtp_position >= end {
            // Its history is not in this step's rows (a new, restored or moved
            // state): restart the window on the positions that fill it.
            st.mtp[0] = LayerState::default();
            st.mtp_position = input.rows_from.max(end.saturating_sub(window - 1));
        }
        spans.push((st.mtp_position, end));
    }
    let mut chunks: Vec<MtpChunk> = inputs
        .iter_mut()
        .zip(&spans)
        .map(|(input, &(start, end))| MtpChunk {
            streams: &input.rows[(start - input.rows_from) * width..(end - input.rows_from) * width],
            next_tokens: &input.tokens[start + 1 - input.tokens_from..=end - input.tokens_from],
            state: &mut *input.state,
        })
        .collect();
    let outputs = model.mtp_forward_rows(&mut chunks, LogitsWanted::Last);
    drop(chunks);

    // The chain runs on copies of the MTP state, restored afterwards.
    let saved: Vec<(LayerState, usize)> =
        inputs.iter().map(|i| (i.state.mtp[0].clone(), i.state.mtp_position)).collect();
    let mut last: Vec<(Vec<f32>, u32)> = Vec::with_capacity(inputs.len());
    for ((input, out), proposal) in inputs.iter_mut().zip(outputs).zip(&mut proposals) {
        let mut row = out.logits;
        let stream = out.streams[out.streams.len() - width..].to_vec();
        if input.count == 0 {
            last.push((stream, 0));
            continue;
        }
        let (token, p) = input.chooser.choose(proposal.at, &mut row);
        proposal.tokens.push(token);
        proposal.acceptance.push(p);
        if p < input.min_survival {
            input.count = 1;
        }
        last.push((stream, token));
    }
    let rounds = inputs.iter().map(|i| i.count).max().unwrap_or(0);
    for j in 1..rounds {
        let live: Vec<usize> = (0..inputs.len()).filter(|&i| inputs[i].count > j).collect();
        let mut chunks = Vec::with_capacity(live.len());
        let mut inputs_live: Vec<&mut DraftInput> =
            inputs.iter_mut().enumerate().filter(|(i, _)| live.contains(i)).map(|(_, x)| x).collect();
        for (input, &i) in inputs_live.iter_mut().zip(&live) {
            chunks.push(MtpChunk {
                streams: &last[i].0,
                next_tokens: std::slice::from_ref(&last[i].1),
                state: &mut *input.state,
            });
        }
        let outputs = model.mtp_forward_rows(&mut chunks, LogitsWanted::Last);
        drop(chunks);
        for ((input, &i), out) in inputs_live.iter_mut().zip(&live).zip(outputs) {
            let mut row = out.logits;
            let proposal = &mut proposals[i];
            let (token, p) = input.chooser.choose(proposal.at + j, &mut row);
            proposal.tokens.push(token);
            proposal.acceptance.push(p);
            if super::policy::survival(&proposal.acceptance).last().is_some_and(|&s| s < input.min_survival) {
                input.count = j + 1;
            }
            last[i] = (out.streams, token);
        }
    }
    for (input, (layer, position)) in inputs.iter_mut().zip(saved) {
        input.state.mtp[0] = layer;
        input.state.mtp_position = position;
    }
    proposals
}
