//! The forward pass gives the same bits however a sequence is cut into steps
//! and whatever else shares its batch.

use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::presets::{build, Preset};

fn tiny() -> Model {
    build(Preset::TinyV4, 7).expect("tiny-v4 builds")
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 2 + (i.wrapping_mul(2654435761).wrapping_add(salt * 97) >> 7) % 1000).collect()
}

/// Logits of every position, with the sequence fed in the given chunk sizes.
fn run_chunked(model: &Model, tokens: &[u32], chunks: &[usize]) -> Vec<f32> {
    let mut state = model.new_state();
    let mut logits = Vec::new();
    let mut at = 0;
    for &len in chunks {
        let out = model.forward(&mut [Chunk::new(&tokens[at..at + len], &mut state)], LogitsWanted::All, false);
        logits.extend_from_slice(&out[0].logits);
        at += len;
    }
    assert_eq!(at, tokens.len());
    logits
}

#[test]
fn incremental_decoding_matches_full_forward() {
    let model = tiny();
    let tokens = prompt(70, 1);
    let full = run_chunked(&model, &tokens, &[70]);
    assert!(full.iter().all(|v| v.is_finite()));
    let mut steps = vec![40];
    steps.extend(std::iter::repeat_n(1, 30));
    assert_eq!(run_chunked(&model, &tokens, &steps), full, "prefill 40 then 30 single steps");
    assert_eq!(run_chunked(&model, &tokens, &[3, 17, 1, 9, 33, 7]), full, "uneven chunks");
    assert_eq!(run_chunked(&model, &tokens, &vec![1; 70]), full, "one token at a time");
}

#[test]
fn a_sequence_logits_do_not_depend_on_its_batch() {
    let model = tiny();
    let a = prompt(37, 2);
    let b = prompt(13, 3);
    let c = prompt(70, 4);
    let alone = run_chunked(&model, &a, &[37]);
    let (mut sa, mut sb, mut sc) = (model.new_state(), model.new_state(), model.new_state());
    let out = model.forward(
        &mut [Chunk::new(&b, &mut sb), Chunk::new(&a, &mut sa), Chunk::new(&c, &mut sc)],
        LogitsWanted::All,
        false,
    );
    assert_eq!(out[1].logits, alone);
    assert_eq!(out[0].logits, run_chunked(&model, &b, &[13]));
}

#[test]
fn mtp_block_runs_and_is_incremental() {
    let model = tiny();
    assert!(model.has_mtp());
    let tokens = prompt(30, 5);
    let mut state = model.new_state();
    let out = model.forward(&mut [Chunk::new(&tokens, &mut state)], LogitsWanted::None, true);
    let streams = &out[0].streams;
    let width = model.config.hc_mult * model.config.hidden_size;
    let full = model.mtp_forward(&mut [deepinfer_engine::model::MtpChunk {
        streams: &streams[..29 * width],
        next_tokens: &tokens[1..],
        state: &mut state,
    }]);
    assert_eq!(full[0].len(), 29 * model.config.vocab_size);
    let mut state2 = model.new_state();
    model.forward(&mut [Chunk::new(&tokens, &mut state2)], LogitsWanted::None, false);
    let mut pieces = Vec::new();
    for (lo, hi) in [(0, 20), (20, 21), (21, 29)] {
        let part = model.mtp_forward(&mut [deepinfer_engine::model::MtpChunk {
            streams: &streams[lo * width..hi * width],
            next_tokens: &tokens[lo + 1..hi + 1],
            state: &mut state2,
        }]);
        pieces.extend_from_slice(&part[0]);
    }
    assert_eq!(pieces, full[0]);
}

/// A state rebuilt from the compressors' state at a prefix boundary plus a
/// replay of the dependency cone (every layer has a sliding window, so
/// `layers × (window − 1)` tokens) matches a cold run bit for bit.
#[test]
fn replaying_the_dependency_cone_rebuilds_the_window_state_exactly() {
    let model = tiny();
    let tokens = prompt(90, 6);
    let boundary = 80;
    let mut cold = model.new_state();
    model.forward(&mut [Chunk::new(&tokens[..boundary], &mut cold)], LogitsWanted::None, false);

    let cone = model.config.num_layers * (model.config.sliding_window - 1);
    let mut warm = model.new_state();
    for (w, c) in warm.layers.iter_mut().zip(&cold.layers) {
        w.compressor = c.compressor.clone();
        w.indexer = c.indexer.clone();
    }
    warm.position = boundary - cone;
    let mut replay = Chunk::new(&tokens[boundary - cone..boundary], &mut warm);
    replay.replay = true;
    model.forward(&mut [replay], LogitsWanted::None, false);
    assert_eq!(warm.layers, cold.layers);

    let rest_cold = model.forward(&mut [Chunk::new(&tokens[boundary..], &mut cold)], LogitsWanted::All, false);
    let rest_warm = model.forward(&mut [Chunk::new(&tokens[boundary..], &mut warm)], LogitsWanted::All, false);
    assert_eq!(rest_warm[0].logits, rest_cold[0].logits);

    // One token short of the cone, the deepest window is not exact any more.
    let mut short = model.new_state();
    let mut cold2 = model.new_state();
    model.forward(&mut [Chunk::new(&tokens[..boundary], &mut cold2)], LogitsWanted::None, false);
    for (w, c) in short.layers.iter_mut().zip(&cold2.layers) {
        w.compressor = c.compressor.clone();
        w.indexer = c.indexer.clone();
    }
    short.position = boundary - cone + 1;
    let mut replay = Chunk::new(&tokens[boundary - cone + 1..boundary], &mut short);
    replay.replay = true;
    model.forward(&mut [replay], LogitsWanted::None, false);
    assert_ne!(short.layers, cold2.layers);
}

/// Driving the pass layer by layer, with the routed experts computed in any
/// order and in any grouping (as expert shards would), gives the same bits.
#[test]
fn experts_computed_anywhere_combine_to_the_same_logits() {
    use deepinfer_engine::model::ExpertOutputs;
    let model = tiny();
    let a = prompt(37, 8);
    let b = prompt(5, 9);
    let (mut sa, mut sb) = (model.new_state(), model.new_state());
    let want = model.forward(&mut [Chunk::new(&a, &mut sa), Chunk::new(&b, &mut sb)], LogitsWanted::All, false);

    let (mut sa, mut sb) = (model.new_state(), model.new_state());
    let mut chunks = [Chunk::new(&a, &mut sa), Chunk::new(&b, &mut sb)];
    let mut pass = model.begin_pass(&chunks);
    while !pass.is_done() {
        let layer = pass.layer();
        let dispatch = model.attend(&mut pass, &mut chunks).clone();
        let mut outputs = ExpertOutputs::new(&dispatch, model.config.experts_per_token);
        // Two "shards": odd experts first, highest first, then the even ones.
        let mut order = dispatch.experts_hit();
        order.sort_by_key(|&e| (e % 2 == 0, std::cmp::Reverse(e)));
        for e in order {
            let pairs = dispatch.rows_for(e);
            outputs.store(&pairs, &model.expert_forward(layer, e, &dispatch.gather(&pairs)));
        }
        model.combine(&mut pass, &outputs);
    }
    let got = model.finish_pass(pass, &mut chunks, LogitsWanted::All, false);
    assert_eq!(got[0].logits, want[0].logits);
    assert_eq!(got[1].logits, want[1].logits);
}
