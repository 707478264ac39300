use super::*;
use crate::presets::Preset;

fn scheduler(config: EngineConfig) -> Scheduler {
    Scheduler::new(&Preset::TinyV4.config(), config).unwrap()
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 2 + i % 900).collect()
}

/// Execute a plan without a model: every sampling item gets `token`.
fn run(s: &mut Scheduler, token: u32) -> (StepPlan, Vec<(RequestId, Finished)>) {
    let plan = s.schedule();
    let sampled: Vec<SampledToken> =
        plan.items.iter().filter(|i| i.sample).map(|i| SampledToken { id: i.id, token, ok: true }).collect();
    let done = s.complete(&sampled);
    (plan, done)
}

fn spans(plan: &StepPlan) -> Vec<(u64, usize, usize, bool)> {
    plan.items.iter().map(|i| (i.id.0, i.from, i.to, i.sample)).collect()
}

#[test]
fn a_prefilled_request_starts_where_its_imported_state_ends() {
    let mut s = scheduler(EngineConfig { prefix_mode: PrefixMode::Exact, ..EngineConfig::default() });
    let id = s.add_prefilled(Request::new(prompt(100), 4), &[7]).unwrap();
    let (plan, done) = run(&mut s, 9);
    // Nothing recomputed: one decode token at position 100, from no cached blocks.
    assert_eq!(spans(&plan), vec![(id.0, 100, 101, true)]);
    assert_eq!(plan.items[0].start, Some(Vec::new()));
    assert!(done.is_empty());
    assert_eq!(s.tokens(id)[100..], [7, 9]);
    assert_eq!(s.stats().computed_tokens, 1);
    assert_eq!(s.prefix_stats().lookups, 0);
    // Preempted, the state is gone: it is recomputed from position 0.
    let mut plan = StepPlan::default();
    s.preempt(id, &mut plan);
    let (plan, _) = run(&mut s, 9);
    assert_eq!(spans(&plan), vec![(id.0, 0, 102, true)]);
}

#[test]
fn the_token_budget_chunks_prefills_and_mixes_them_with_decodes() {
    let mut s = scheduler(EngineConfig { max_batch_tokens: 32, prefix_mode: PrefixMode::Off, ..Default::default() });
    s.add(Request::new(prompt(50), 5)).unwrap();
    s.add(Request::new(prompt(10), 5)).unwrap();
    assert_eq!(spans(&run(&mut s, 7).0), [(0, 0, 32, false)]);
    assert_eq!(spans(&run(&mut s, 7).0), [(0, 32, 50, true), (1, 0, 10, true)]);
    assert_eq!(spans(&run(&mut s, 7).0), [(0, 50, 51, true), (1, 10, 11, true)]);
    assert_eq!(s.tokens(RequestId(1)), [&prompt(10)[..], &[7, 7]].concat());
}

#[test]
fn the_batch_size_limits_running_requests() {
    let mut s = scheduler(EngineConfig { max_batch_size: 2, ..Default::default() });
    for max_tokens in [1, 3, 3] {
        s.add(Request::new(prompt(5), max_tokens)).unwrap();
    }
    let (plan, done) = run(&mut s, 9);
    assert_eq!(spans(&plan).len(), 2);
    assert_eq!(done.len(), 1, "the first request wanted one token");
    assert_eq!(done[0].1.reason, FinishReason::Length);
    let (plan, _) = run(&mut s, 9);
    assert_eq!(spans(&plan), [(1, 5, 6, true), (2, 0, 5, true)]);
}

#[test]
fn eos_stops_unless_ignored() {
    let mut s = scheduler(EngineConfig::default());
    let eos = Preset::TinyV4.config().eos_token_id;
    s.add(Request::new(prompt(5), 4)).unwrap();
    let mut r = Request::new(prompt(6), 4);
    r.ignore_eos = true;
    s.add(r).unwrap();
    let (_, done) = run(&mut s, eos);
    assert_eq!(done.len(), 1);
    assert_eq!(
        (done[0].0, done[0].1.reason.clone(), done[0].1.completion_tokens),
        (RequestId(0), FinishReason::Stop, 1)
    );
    let (_, done) = run(&mut s, eos);
    assert!(done.is_empty());
}

#[test]
fn preemption_takes_the_newest_and_requeues_it_first() {
    let cfg = Preset::TinyV4.config();
    let layout = KvLayout::new(&cfg, 64, 16).unwrap();
    // Two sequences of up to 64 positions fit, plus one more compressed
    // and indexer block: not a third sequence.
    let budget = 2 * layout.sequence_bytes(64) + layout.bytes(BlockKind::Compressed) + layout.bytes(BlockKind::Indexer);
    let mut s = scheduler(EngineConfig { kv_budget_bytes: budget, prefix_mode: PrefixMode::Off, ..Default::default() });
    for _ in 0..3 {
        s.add(Request::new(prompt(60), 20)).unwrap();
    }
    let (plan, _) = run(&mut s, 5);
    assert_eq!(plan.items.len(), 2, "the third does not fit");
    assert_eq!(s.status(RequestId(2)), Some(&RequestStatus::Waiting));
    // Decoding past 64 positions needs a second compressed block each.
    let mut preempted = None;
    for _ in 0..10 {
        let (plan, _) = run(&mut s, 5);
        if let Some(&id) = plan.preempted.first() {
            preempted = Some(id);
            break;
        }
    }
    assert_eq!(preempted, Some(RequestId(1)), "the newest running request goes");
    assert_eq!(s.status(RequestId(1)), Some(&RequestStatus::Preempted));
    assert_eq!(s.waiting.front(), Some(&RequestId(1)), "ahead of the never-run request");
    assert!(s.block_table(RequestId(1)).unwrap().is_empty());
    // Once there is room again it recomputes prompt and output in one go.
    let generated = s.tokens(RequestId(1)).len();
    s.cancel(RequestId(0)).unwrap();
    let (plan, _) = run(&mut s, 5);
    assert_eq!(spans(&plan)[0], (1, 0, generated, true));
}

#[test]
fn snapshots_mark_the_block_ends_a_step_crosses() {
    let mut s = scheduler(EngineConfig { max_batch_tokens: 100, ..Default::default() });
    s.add(Request::new(prompt(300), 2)).unwrap();
    let plan = s.schedule();
    assert_eq!(plan.items[0].snapshots, [0]);
    let plan = s.schedule();
    assert_eq!(plan.items[0].snapshots, [1, 2], "ends at 128 and 192 in (100, 200]");
}

#[test]
fn a_resumed_request_recomputes_its_output_and_counts_it() {
    let mut s = scheduler(EngineConfig { prefix_mode: PrefixMode::Off, ..Default::default() });
    let mut r = Request::new(prompt(5), 4);
    r.stop_sequences = vec![vec![7, 8]];
    let id = s.add_resumed(r, &[9, 7]).unwrap();
    assert_eq!(s.tokens(id), [&prompt(5)[..], &[9, 7]].concat());
    let (plan, done) = run(&mut s, 8);
    assert_eq!(spans(&plan), [(id.0, 0, 7, true)], "prompt and resumed output in one prefill");
    assert_eq!(done.len(), 1, "the stop sequence spans resumed and new output");
    assert_eq!((done[0].1.reason.clone(), done[0].1.completion_tokens), (FinishReason::Stop, 3));
    assert!(matches!(
        s.add_resumed(Request::new(prompt(5), 4), &[5000]),
        Err(RequestError::TokenOutOfVocabulary { .. })
    ));
}

#[test]
fn clearing_the_prefix_cache_frees_unused_blocks_and_keeps_running_ones() {
    // Execute a step, offering every computed block to the cache.
    fn run(s: &mut Scheduler, token: u32) {
        let plan = s.schedule();
        for it in &plan.items {
            for &k in &it.snapshots {
                s.register_block(it.id, k);
            }
        }
        let sampled: Vec<SampledToken> =
            plan.items.iter().filter(|i| i.sample).map(|i| SampledToken { id: i.id, token, ok: true }).collect();
        s.complete(&sampled);
    }
    let mut s = scheduler(EngineConfig::default());
    let free0 = s.pool_stats();
    s.add(Request::new(prompt(200), 1)).unwrap();
    run(&mut s, 5);
    assert_eq!(s.cached_blocks(), 3);
    let b = s.add(Request::new(prompt(200), 3)).unwrap();
    run(&mut s, 5);
    assert_eq!(s.prefix_stats().hits, 1);
    assert_eq!(s.clear_prefix_cache().len(), 0, "the running request holds every cached block");
    assert_eq!(s.cached_blocks(), 0);
    s.cancel(b).unwrap();
    assert_eq!(s.pool_stats(), free0, "released blocks are freed, not cached");
    s.add(Request::new(prompt(200), 1)).unwrap();
    run(&mut s, 5);
    assert_eq!(s.clear_prefix_cache().len(), 3);
    assert_eq!((s.pool_stats(), s.prefix_stats().hits), (free0, 1), "a miss after clearing");
}

#[test]
fn lower_priority_values_are_admitted_first_and_ties_by_arrival() {
    let mut s = scheduler(EngineConfig { max_batch_size: 1, ..Default::default() });
    let late = |p: i64| Request { priority: p, ..Request::new(prompt(5), 1) };
    let a = s.add(late(0)).unwrap();
    let b = s.add(late(-1)).unwrap();
    let c = s.add(late(-1)).unwrap();
    let mut order = Vec::new();
    for _ in 0..3 {
        let plan = s.schedule();
        order.push(plan.items[0].id);
        let sampled: Vec<SampledToken> =
            plan.items.iter().filter(|i| i.sample).map(|i| SampledToken { id: i.id, token: 3, ok: true }).collect();
        s.complete(&sampled);
    }
    assert_eq!(order, [b, c, a]);
}
