//! The time a verification step takes on this machine, by tokens verified,
//! and the time of drafting (an MTP chain step, a DSpark block) by requests,
//! measured once at start for the adaptive draft-length policy (the engine
//! never reads a clock; the measurement is made here and handed to it).

use std::time::Instant;

use deepinfer_engine::model::{Chunk, LogitsWanted, Model, MtpChunk};
use deepinfer_engine::speculative::policy::StepCost;

/// Tokens per measured step: decodes with up to a few drafts each, for
/// batches from one request to a few dozen.
const MEASURED_TOKENS: [usize; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];
/// Timings per point; the fastest is kept (the others saw interference).
const REPEATS: usize = 3;
/// Positions each measured sequence already holds.
const HISTORY_TOKENS: usize = 64;

/// Time one forward pass over `tokens` decode positions spread over
/// sequences of at most `per_sequence` tokens each, for each point up to
/// `max_tokens`.
pub fn measure(model: &Model, max_tokens: usize, per_sequence: usize) -> StepCost {
    assert!(per_sequence >= 1 && max_tokens >= 1, "something to measure");
    let history = history();
    let mut base = model.new_state();
    model.forward(&mut [Chunk::new(&history, &mut base)], LogitsWanted::None, false);
    cost_by_points(max_tokens, |tokens| {
        let sequences = tokens.div_ceil(per_sequence);
        let mut states: Vec<_> = (0..sequences).map(|_| base.clone()).collect();
        let feeds: Vec<Vec<u32>> =
            (0..sequences).map(|s| vec![7; per_sequence.min(tokens - s * per_sequence)]).collect();
        let mut chunks: Vec<Chunk> = states.iter_mut().zip(&feeds).map(|(st, f)| Chunk::new(f, st)).collect();
        let started = Instant::now();
        model.forward(&mut chunks, LogitsWanted::Tail(per_sequence), true);
        started.elapsed().as_secs_f64()
    })
}

/// Time one step of an MTP draft chain (the MTP block over one token per
/// request, with its logits) for each point of requests up to `max_requests`,
/// or `None` for a model without an MTP block.
pub fn measure_mtp_chain(model: &Model, max_requests: usize) -> Option<StepCost> {
    if !model.has_mtp() {
        return None;
    }
    let history = history();
    let mut base = model.new_state();
    let main = model.forward(&mut [Chunk::new(&history, &mut base)], LogitsWanted::None, true);
    let streams = &main[0].streams;
    // The MTP block sees the history too, as in a running request.
    let (past_streams, last_stream) = streams.split_at(streams.len() / HISTORY_TOKENS * (HISTORY_TOKENS - 1));
    let next = &history[1..];
    model.mtp_forward(&mut [MtpChunk { streams: past_streams, next_tokens: next, state: &mut base }]);
    Some(cost_by_points(max_requests, |requests| {
        let mut states: Vec<_> = (0..requests).map(|_| base.clone()).collect();
        let mut chunks: Vec<MtpChunk> =
            states.iter_mut().map(|state| MtpChunk { streams: last_stream, next_tokens: &[7], state }).collect();
        let started = Instant::now();
        model.mtp_forward_rows(&mut chunks, LogitsWanted::All);
        started.elapsed().as_secs_f64()
    }))
}

/// Time DSpark's draft block takes for one request (it runs per request), as
/// a cost by requests drafted for, or `None` for a model without DSpark.
pub fn measure_dspark(model: &Model) -> Option<StepCost> {
    let v41 = model.v41.as_ref().filter(|m| m.config.dspark.is_some())?;
    let history = history();
    let mut state = model.new_state();
    model.forward(&mut [Chunk::new(&history, &mut state)], LogitsWanted::None, false);
    let v41_state = state.v41.as_ref().expect("a V4.1 state");
    let one_s = fastest(REPEATS * 3, || {
        let started = Instant::now();
        std::hint::black_box(v41.dspark_propose(7, HISTORY_TOKENS - 1, v41_state));
        started.elapsed().as_secs_f64()
    });
    Some(StepCost::linear(0.0, one_s))
}

/// The tokens every measured sequence already holds.
fn history() -> Vec<u32> {
    (0..HISTORY_TOKENS as u32).map(|i| 2 + (i * 37) % 500).collect()
}

/// The fastest of `runs` timings (the others saw interference), never zero.
fn fastest(runs: usize, mut time_s: impl FnMut() -> f64) -> f64 {
    (0..runs).map(|_| time_s()).fold(f64::INFINITY, f64::min).max(1e-9)
}

/// A cost through the fastest timing of `time_s(k)` at each measured point
/// `k` up to `max`, made non-decreasing.
fn cost_by_points(max: usize, mut time_s: impl FnMut(usize) -> f64) -> StepCost {
    let mut points: Vec<(usize, f64)> = Vec::new();
    for k in MEASURED_TOKENS.into_iter().filter(|&k| k <= max.max(1)) {
        let best = fastest(REPEATS, || time_s(k));
        let previous = points.last().map_or(0.0, |&(_, t)| t);
        points.push((k, best.max(previous)));
    }
    StepCost::from_points(points).expect("measured points increase")
}
