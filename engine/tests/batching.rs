//! Continuous batching: a request's tokens and logits do not depend on what
//! shares its steps, on chunked prefill, or on preemption; limits give clear
//! errors; everything a request holds is freed when it ends.

mod support;

use deepinfer_engine::engine::{Engine, EngineConfig, EngineConfigError};
use deepinfer_engine::kv_pool::BlockKind;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::request::{FinishReason, Request, RequestError, RequestStatus};
use deepinfer_engine::sampling::SamplingParams;
use support::*;

/// 64 requests: prompts of 1 to ~200 tokens, 1 to 12 new tokens, greedy and seeded.
fn mixed_requests() -> Vec<Request> {
    (0..64u32)
        .map(|i| {
            let len = 1 + (i as usize * 37) % 197;
            let max_tokens = 1 + (i as usize * 5) % 12;
            let params = if i % 2 == 0 { greedy() } else { seeded(1000 + u64::from(i)) };
            let mut r = request(tokens(len, i), max_tokens, params);
            r.ignore_eos = i % 4 == 1;
            r
        })
        .collect()
}

#[test]
fn sixty_four_mixed_requests_batched_match_each_alone() {
    let model = tiny();
    let requests = mixed_requests();
    // A small token budget: prompts are chunked and share steps with decodes.
    let config = EngineConfig { max_batch_size: 64, max_batch_tokens: 160, ..config(PrefixMode::Off) };
    let (batched, engine) = run_together(&model, config, &requests);
    let stats = engine.scheduler().stats();
    assert!(stats.steps > 20, "prefills were chunked over many steps ({} steps)", stats.steps);
    assert_eq!(stats.preemptions, 0);
    for (i, (r, b)) in requests.iter().zip(&batched).enumerate() {
        assert!(!b.tokens.is_empty());
        assert!(b.tokens.iter().all(|t| t.top.len() == r.params.logprobs));
        assert_same(b, &run_alone(&model, r), &format!("request {i}"));
    }
    // Sampling was really used: some seeded tokens are not the argmax of their logits.
    let argmax = |l: &[f32]| (0..l.len()).fold(0, |best, i| if l[i] > l[best] { i } else { best }) as u32;
    let sampled_off_argmax =
        batched.iter().flat_map(|b| &b.tokens).filter(|t| t.token != argmax(t.logits.as_ref().unwrap())).count();
    assert!(sampled_off_argmax > 0);
    let pool = engine.scheduler().pool_stats();
    assert_eq!(pool.used_bytes, 0, "every block is freed when its request ends");
}

#[test]
fn a_kv_budget_too_small_for_all_requests_preempts_and_keeps_outputs() {
    let model = tiny();
    let requests: Vec<Request> = (0..12u32)
        .map(|i| {
            let mut r = request(
                tokens(60 + 9 * i as usize, 50 + i),
                20,
                if i % 3 == 0 { greedy() } else { seeded(u64::from(i)) },
            );
            r.ignore_eos = true;
            r
        })
        .collect();
    let alone: Vec<_> = requests.iter().map(|r| run_alone(&model, r)).collect();
    for mode in [PrefixMode::Off, PrefixMode::Exact] {
        let probe = Engine::new(&model, config(mode)).unwrap();
        // Room for about three requests at full length, out of twelve.
        let budget = 3 * probe.scheduler().layout().sequence_bytes(60 + 9 * 11 + 20);
        let config = EngineConfig { kv_budget_bytes: budget, max_batch_tokens: 128, ..config(mode) };
        let (batched, engine) = run_together(&model, config, &requests);
        let stats = engine.scheduler().stats();
        assert!(stats.preemptions > 0, "{mode:?}: the budget forced preemption");
        for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
            assert_eq!(b.finished.reason, FinishReason::Length);
            assert_same(b, a, &format!("{mode:?} request {i}"));
        }
        assert!(batched.iter().any(|b| b.finished.preemptions > 0));
        let pool = engine.scheduler().pool_stats();
        assert!(pool.used_bytes <= budget);
        assert_eq!(pool.blocks[BlockKind::Window.index()], 0);
        assert_eq!(pool.blocks[BlockKind::Partial.index()], 0);
    }
}

#[test]
fn a_prompt_longer_than_the_context_fails_alone() {
    let model = tiny();
    let context = model.config.max_position_embeddings;
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    let good_a = request(tokens(30, 1), 6, greedy());
    let good_b = request(tokens(45, 2), 6, seeded(9));
    let a = engine.add_request(good_a.clone()).unwrap();
    let err = engine.add_request(request(tokens(context, 3), 4, greedy())).unwrap_err();
    assert_eq!(err, RequestError::PromptTooLong { len: context, limit: context });
    assert_eq!(
        err.to_string(),
        "the prompt has 4096 tokens but the model's context is 4096 tokens \
         (at most 4095 prompt tokens, leaving room for one generated token)"
    );
    let b = engine.add_request(good_b.clone()).unwrap();
    let mut done = engine.run_to_completion();
    assert_same(&done.remove(&a).unwrap(), &run_alone(&model, &good_a), "first neighbour");
    assert_same(&done.remove(&b).unwrap(), &run_alone(&model, &good_b), "second neighbour");

    // A prompt that fits but leaves less room than max_tokens stops at the context.
    let mut near = request(tokens(context - 5, 4), 50, greedy());
    near.ignore_eos = true;
    near.return_logits = false;
    let id = engine.add_request(near).unwrap();
    let done = engine.run_to_completion();
    assert_eq!(done[&id].tokens.len(), 5);
    assert_eq!(done[&id].finished.reason, FinishReason::Length);
}

#[test]
fn limits_give_clear_errors() {
    let model = tiny();
    let bad = |c: EngineConfig| Engine::new(&model, c).err().expect("rejected");
    assert_eq!(bad(EngineConfig { max_batch_size: 0, ..EngineConfig::default() }), EngineConfigError::BatchSize(0));
    assert_eq!(bad(EngineConfig { max_batch_tokens: 0, ..EngineConfig::default() }), EngineConfigError::BatchTokens(0));
    assert_eq!(bad(EngineConfig { max_waiting: 0, ..EngineConfig::default() }), EngineConfigError::Waiting(0));
    assert!(matches!(
        bad(EngineConfig { block_tokens: Some(24), ..EngineConfig::default() }),
        EngineConfigError::Layout(_)
    ));
    assert!(matches!(
        bad(EngineConfig { kv_budget_bytes: 10, ..EngineConfig::default() }),
        EngineConfigError::KvBudget { .. }
    ));

    let mut engine = Engine::new(&model, EngineConfig { max_waiting: 2, ..EngineConfig::default() }).unwrap();
    let ok = || Request::new(tokens(5, 0), 3);
    assert_eq!(engine.add_request(Request::new(Vec::new(), 3)), Err(RequestError::EmptyPrompt));
    assert_eq!(
        engine.add_request(Request::new(vec![5, 5000], 3)),
        Err(RequestError::TokenOutOfVocabulary { token: 5000, vocab: 1024 })
    );
    assert_eq!(engine.add_request(Request::new(tokens(5, 0), 0)), Err(RequestError::ZeroMaxTokens));
    let hot = ok().with_params(SamplingParams { top_p: 0.0, ..SamplingParams::default() });
    assert!(matches!(engine.add_request(hot), Err(RequestError::Sampling(_))));
    let mut stops = ok();
    stops.stop_sequences = vec![vec![]];
    assert_eq!(engine.add_request(stops), Err(RequestError::BadStopSequence(0)));
    engine.add_request(ok()).unwrap();
    engine.add_request(ok()).unwrap();
    assert_eq!(engine.add_request(ok()), Err(RequestError::QueueFull { limit: 2 }));

    let probe = engine.scheduler().layout().sequence_bytes(1000);
    let mut small = Engine::new(&model, EngineConfig { kv_budget_bytes: probe, ..EngineConfig::default() }).unwrap();
    let err = small.add_request(Request::new(tokens(900, 0), 200)).unwrap_err();
    assert!(matches!(err, RequestError::ExceedsKvBudget { tokens: 1099, .. }), "{err}");
    assert!(small.add_request(Request::new(tokens(900, 0), 100)).is_ok());
}

#[test]
fn requests_move_through_their_states_and_free_everything() {
    let model = tiny();
    let config = EngineConfig { max_batch_tokens: 40, ..config(PrefixMode::Exact) };
    let mut engine = Engine::new(&model, config).unwrap();
    let long = engine.add_request(Request::new(tokens(100, 1), 30)).unwrap();
    let other = engine.add_request(Request::new(tokens(30, 2), 30)).unwrap();
    let s = |e: &Engine<_>, id| e.scheduler().status(id).cloned();
    assert_eq!(s(&engine, long), Some(RequestStatus::Waiting));
    engine.step();
    assert_eq!(s(&engine, long), Some(RequestStatus::Prefilling), "100 tokens take three 40-token steps");
    assert_eq!(s(&engine, other), Some(RequestStatus::Waiting), "the budget went to the first prompt");
    engine.step();
    engine.step();
    assert_eq!(s(&engine, long), Some(RequestStatus::Decoding));
    assert_eq!(s(&engine, other), Some(RequestStatus::Prefilling));
    let held = engine.scheduler().block_table(long).unwrap().get(BlockKind::Compressed).len();
    assert_eq!(held, 2, "100 positions need two 64-position blocks");
    let finished = engine.cancel(long).unwrap();
    assert_eq!(finished.reason, FinishReason::Cancelled);
    assert_eq!(s(&engine, long), None);
    assert_eq!(engine.cancel(long), Err(RequestError::Unknown(long)));
    engine.run_to_completion();
    let pool = engine.scheduler().pool_stats();
    // Only the one cached block of the cancelled prompt is left, unreferenced.
    assert_eq!(engine.scheduler().cached_blocks(), 1);
    assert_eq!(pool.blocks, [0, 1, 1, 0]);
}

#[test]
fn stop_tokens_and_stop_sequences_end_generation() {
    let model = tiny();
    let prompt = tokens(20, 7);
    let mut free = Request::new(prompt.clone(), 12);
    free.ignore_eos = true;
    let (out, _) = run_together(&model, config(PrefixMode::Off), std::slice::from_ref(&free));
    let ids = out[0].token_ids();
    assert_eq!(ids.len(), 12);
    assert_eq!(out[0].finished.reason, FinishReason::Length);

    let mut by_sequence = free.clone();
    by_sequence.stop_sequences = vec![vec![999_999], ids[3..5].to_vec()];
    let mut by_token = free.clone();
    by_token.stop_token_ids = vec![ids[6]];
    let (out, _) = run_together(&model, config(PrefixMode::Off), &[by_sequence, by_token]);
    let first_end = (1..=12).find(|&n| ids[..n].ends_with(&ids[3..5])).unwrap();
    assert_eq!(out[0].token_ids(), ids[..first_end]);
    assert_eq!(out[0].finished.reason, FinishReason::Stop);
    let first_stop = ids.iter().position(|&t| t == ids[6]).unwrap();
    assert_eq!(out[1].token_ids(), ids[..=first_stop]);
    assert_eq!(out[1].finished.reason, FinishReason::Stop);
}

/// The logits' bits of a prefill of `prompts` and one decode step after it,
/// computed on a pool of `threads` threads.
fn step_bits_on(threads: usize, model: &deepinfer_engine::model::Model, prompts: &[Vec<u32>]) -> Vec<u32> {
    use deepinfer_engine::model::{Chunk, LogitsWanted};
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let mut states: Vec<_> = prompts.iter().map(|_| model.new_state()).collect();
        let mut chunks: Vec<Chunk> = prompts.iter().zip(&mut states).map(|(p, s)| Chunk::new(p, s)).collect();
        let prefill = model.forward(&mut chunks, LogitsWanted::Last, false);
        let next: Vec<[u32; 1]> = (0..prompts.len()).map(|i| [3 + i as u32]).collect();
        let mut chunks: Vec<Chunk> = states.iter_mut().zip(&next).map(|(s, t)| Chunk::new(&t[..], s)).collect();
        let decode = model.forward(&mut chunks, LogitsWanted::Last, false);
        prefill.into_iter().chain(decode).flat_map(|o| o.logits).map(f32::to_bits).collect()
    })
}

/// Routed experts run side by side on a pool of several threads (and each
/// large matmul splits its rows): the logits of a batch are the same bits
/// on 1, 2 and 3 threads, for DeepSeek-V4 and V4.1.
#[test]
fn thread_count_changes_no_bit_of_a_step() {
    use deepinfer_engine::presets::{build, Preset};
    for (name, model) in [("tiny-v4", tiny()), ("tiny-v41", build(Preset::TinyV41, 5).expect("tiny-v41 builds"))] {
        let prompts: Vec<Vec<u32>> = (0..6).map(|i| tokens(9 + 7 * i, 40 + i as u32)).collect();
        let one = step_bits_on(1, &model, &prompts);
        for threads in [2, 3] {
            assert!(step_bits_on(threads, &model, &prompts) == one, "{name}: {threads} threads");
        }
    }
}

/// A V4.1 shape wide enough that a step spreads its attention heads, its
/// indexer scores, its grouped output projection and its mHC mixing over the
/// thread pool (each above `v41::ops::PARALLEL_MIN_WORK` multiply-adds on a
/// 300-token prompt): the split gives every output to one thread, so no bit moves.
#[test]
fn v41_steps_spread_over_threads_change_no_bit() {
    use deepinfer_engine::presets_v41::{build, config, Shape, TINY};
    let shape = Shape { heads: 16, head_dim: 128, index_heads: 16, index_dim: 64, window: 128, ..TINY };
    let model = build(&config(&shape, "spread-v41"), "spread-v41", 3).expect("the shape builds");
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| tokens(300 - 40 * i, 7 + i as u32)).collect();
    let one = step_bits_on(1, &model, &prompts);
    for threads in [2, 3] {
        assert!(step_bits_on(threads, &model, &prompts) == one, "{threads} threads");
    }
}
