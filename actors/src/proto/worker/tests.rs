//! The worker machine driven by scripted frames, with real shard machines
//! answering its dispatches: its tokens are the single-device engine's, and
//! lost dispatches, duplicate requests, restarted schedulers, malformed
//! results and bad requests each get the answer the protocol promises.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::constraint::{allowed_tokens, TokenConstraint};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::request::Request;
use deepinfer_engine::sampling::{token_history, SamplingParams};

use super::{Effect, Input, WorkerMachine};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::proto::shard::{ShardEffect, ShardMachine};
use crate::proto::{test_ctx, Outgoing};
use crate::wire::{
    self, Addr, Envelope, ExpertResultHeader, Message, ResultStatus, Sampling, StepItem, StepOutcome, StepRequest,
    StepResult, Verification,
};

const SCHEDULER: Addr = Addr::scheduler(0);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Two devices, one instance: dispatches go to both shards.
struct Rig {
    ctx: Arc<Ctx>,
    worker: WorkerMachine,
    shards: BTreeMap<u32, ShardMachine>,
    now: Duration,
}

/// What the worker left, with frames decoded (a test's log: size does not matter).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
enum Seen {
    Sent(Addr, Message, Vec<u8>),
    Armed { pass: u64, layer: u32, round: u32 },
    Other(Effect),
}

impl Rig {
    fn new() -> Self {
        Self::with_ctx(test_ctx(2, 8, 1))
    }

    fn with_ctx(ctx: Arc<crate::cluster::ctx::Ctx>) -> Self {
        let mut worker = WorkerMachine::start(Duration::ZERO, 0, 0, Arc::clone(&ctx));
        let hello = worker.take_effects();
        assert!(matches!(&hello[..], [Effect::Send(Outgoing { to: SCHEDULER, .. })]), "greets its scheduler");
        let shards = (0..2).map(|d| (d, ShardMachine::start(d, 0, Arc::clone(&ctx)))).collect();
        Rig { ctx, worker, shards, now: Duration::ZERO }
    }

    fn feed(&mut self, from: Addr, msg: Message, body: &[f32]) -> Vec<Seen> {
        let frame = wire::encode(&Envelope { from, to: Addr::worker(0), msg }, body).expect("encodes");
        self.worker.handle(self.now, Input::Net(Delivery::new(from, frame))).expect("no crash");
        self.drain()
    }

    fn drain(&mut self) -> Vec<Seen> {
        self.worker
            .take_effects()
            .into_iter()
            .map(|e| match e {
                Effect::Send(Outgoing { to, frame }) => {
                    let d = wire::decode(&frame).expect("the worker sends valid frames");
                    Seen::Sent(to, d.envelope.msg, frame)
                }
                Effect::ArmDispatch { pass, layer, round, .. } => Seen::Armed { pass, layer, round },
                other => Seen::Other(other),
            })
            .collect()
    }

    fn request(&mut self, req: StepRequest) -> Vec<Seen> {
        self.feed(SCHEDULER, Message::StepRequest(req), &[])
    }

    /// Deliver every dispatch to its shard and every answer back, until the
    /// worker answers its scheduler; `drop` loses the first dispatch of a layer.
    fn run(&mut self, mut seen: Vec<Seen>, mut drop: impl FnMut(u32) -> bool) -> StepResult {
        loop {
            let mut next = Vec::new();
            for s in seen {
                match s {
                    Seen::Sent(to, Message::StepResult(r), ..) if to == SCHEDULER => return r,
                    Seen::Sent(to, Message::Dispatch(h), frame) => {
                        if drop(h.layer) {
                            continue;
                        }
                        let shard = self.shards.get_mut(&to.index).expect("a shard of the instance");
                        shard.handle(Delivery::new(Addr::worker(0), frame)).expect("no crash");
                        for e in shard.take_effects() {
                            if let ShardEffect::Send(o) = e {
                                let d = Delivery::new(to, o.frame);
                                self.worker.handle(self.now, Input::Net(d)).expect("no crash");
                                next.extend(self.drain());
                            }
                        }
                    }
                    Seen::Armed { pass, layer, round } if drop(u32::MAX) => {
                        self.now += ms(100);
                        self.worker.handle(self.now, Input::Timeout { pass, layer, round }).expect("no crash");
                        next.extend(self.drain());
                    }
                    _ => {}
                }
            }
            assert!(!next.is_empty(), "the step stalled");
            seen = next;
        }
    }

    fn step(&self, step: u64, items: Vec<StepItem>) -> StepRequest {
        StepRequest {
            step,
            attempt: 0,
            scheduler: 1,
            placement: self.ctx.durable.placement(0, 0).to_wire(),
            items,
            release: Vec::new(),
            batch_tokens: 0,
            repeat: 1,
        }
    }
}

fn item(seq: u64, position: u64, tokens: Vec<u32>) -> StepItem {
    StepItem {
        seq,
        position,
        tokens,
        rebuild: false,
        sampling: Sampling::greedy(),
        sample: true,
        logits: false,
        replay_until: 0,
        restore: Vec::new(),
        snapshots: Vec::new(),
        export: false,
        import: Vec::new(),
        drafts: 0,
        allowed: Vec::new(),
        history: Vec::new(),
        images: Vec::new(),
    }
}

fn prompt() -> Vec<u32> {
    (0..21).map(|i| 3 + (i * 37) % 400).collect()
}

/// The single-device engine's greedy tokens for `prompt`.
fn engine_tokens(ctx: &Ctx, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut engine = Engine::new(&*ctx.model, EngineConfig::default()).expect("an engine");
    let params = SamplingParams { temperature: 0.0, ..Default::default() };
    let request = Request { ignore_eos: true, ..Request::new(prompt.to_vec(), n).with_params(params) };
    engine.add_request(request).expect("admitted");
    let mut tokens = Vec::new();
    while engine.has_work() {
        for u in engine.step() {
            tokens.extend(u.tokens.iter().map(|t| t.token));
        }
    }
    tokens
}

fn tokens_of(r: &StepResult) -> Vec<u32> {
    match &r.outcome {
        StepOutcome::Done { outputs, .. } => outputs.iter().map(|o| o.token).collect(),
        other => panic!("a finished step: {other:?}"),
    }
}

fn failure(r: &StepResult) -> &str {
    match &r.outcome {
        StepOutcome::Failed(why) | StepOutcome::TableMismatch { why, .. } => why,
        other => panic!("a failed step: {other:?}"),
    }
}

#[test]
fn prefill_and_decode_sample_the_engines_tokens() {
    let mut rig = Rig::new();
    let want = engine_tokens(&rig.ctx, &prompt(), 3);
    let first = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let r = rig.run(first, |_| false);
    let mut got = tokens_of(&r);
    for step in 2..=3 {
        let position = (prompt().len() + got.len() - 1) as u64;
        let seen = rig.request(rig.step(step, vec![item(7, position, vec![*got.last().unwrap()])]));
        got.extend(tokens_of(&rig.run(seen, |_| false)));
    }
    assert_eq!(got, want, "bit for bit the engine's greedy tokens");
}

/// Allows the even tokens below 200, as a structured-output grammar would a set.
struct EvenTokens;

impl TokenConstraint for EvenTokens {
    fn allowed(&mut self, logits: &mut [f32]) {
        for (t, l) in logits.iter_mut().enumerate() {
            if t % 2 == 1 || t >= 200 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    fn accept(&mut self, _token: u32) {}
    fn is_done(&self) -> bool {
        false
    }
}

#[test]
fn a_mask_bias_and_penalties_sample_what_the_engine_samples() {
    let mut rig = Rig::new();
    let vocab = rig.ctx.config.vocab_size;
    let params = SamplingParams {
        temperature: 0.9,
        seed: 3,
        logprobs: 2,
        logit_bias: vec![(4, 3.0), (10, -100.0)],
        frequency_penalty: 1.5,
        presence_penalty: 0.5,
        repetition_penalty: 1.3,
        min_p: 0.01,
        ..Default::default()
    };
    let mut engine = Engine::new(&*rig.ctx.model, EngineConfig::default()).expect("an engine");
    let request = Request { ignore_eos: true, ..Request::new(prompt(), 4).with_params(params.clone()) };
    engine.add_constrained_request(request, Box::new(EvenTokens)).expect("admitted");
    let mut want = Vec::new();
    while engine.has_work() {
        for u in engine.step() {
            want.extend(u.tokens.iter().map(|t| (t.token, t.logprob.to_bits())));
        }
    }
    let sampling = Sampling {
        temperature: params.temperature,
        seed: params.seed,
        logprobs: 2,
        logit_bias: params.logit_bias.iter().map(|&(token, bias)| wire::TokenBias { token, bias }).collect(),
        frequency_penalty: params.frequency_penalty,
        presence_penalty: params.presence_penalty,
        repetition_penalty: params.repetition_penalty,
        min_p: params.min_p,
        ..Sampling::greedy()
    };
    let mut got: Vec<(u32, u32)> = Vec::new();
    for step in 1..=4u64 {
        let output: Vec<u32> = got.iter().map(|g| g.0).collect();
        let history = token_history(&prompt(), &output)
            .into_iter()
            .map(|(token, count)| wire::TokenCount { token, count })
            .collect();
        let (position, tokens) = match output.last() {
            None => (0, prompt()),
            Some(&t) => ((prompt().len() + output.len() - 1) as u64, vec![t]),
        };
        let allowed = allowed_tokens(&mut EvenTokens, vocab);
        let it = StepItem { sampling: sampling.clone(), allowed, history, ..item(7, position, tokens) };
        let seen = rig.request(rig.step(step, vec![it]));
        match &rig.run(seen, |_| false).outcome {
            StepOutcome::Done { outputs, .. } => got.extend(outputs.iter().map(|o| (o.token, o.logprob.to_bits()))),
            other => panic!("a finished step: {other:?}"),
        }
    }
    assert_eq!(got, want, "tokens and logprobs to the bit");
    assert!(got.iter().all(|&(t, _)| t % 2 == 0 && t < 200 && t != 10), "{got:?}");
}

#[test]
fn a_lost_dispatch_is_resent_and_the_tokens_do_not_change() {
    let mut rig = Rig::new();
    let want = engine_tokens(&rig.ctx, &prompt(), 1);
    let first = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    // Layer 1's first dispatch is lost; the timer's round resends it.
    let mut lost = false;
    let r = rig.run(first, |layer| match layer {
        1 if !lost => {
            lost = true;
            true
        }
        u32::MAX => lost,
        _ => false,
    });
    assert!(lost);
    assert_eq!(tokens_of(&r), want);
    assert!(rig.ctx.metrics.dispatch_resends.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

#[test]
fn silent_shards_fail_the_step_after_the_last_round_and_stale_timers_do_nothing() {
    let mut rig = Rig::new();
    let seen = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let (pass, layer) = seen
        .iter()
        .find_map(|s| match s {
            Seen::Armed { pass, layer, round: 0 } => Some((*pass, *layer)),
            _ => None,
        })
        .expect("the dispatch timer is armed");
    // A timer of another pass or round is stale.
    rig.worker.handle(ms(1), Input::Timeout { pass: pass + 1, layer, round: 0 }).unwrap();
    rig.worker.handle(ms(1), Input::Timeout { pass, layer, round: 3 }).unwrap();
    assert!(rig.drain().is_empty(), "stale timers leave nothing");
    let attempts = rig.ctx.timeouts.dispatch_attempts;
    for round in 0..attempts {
        rig.worker.handle(ms(10 + round as u64), Input::Timeout { pass, layer, round }).unwrap();
        let seen = rig.drain();
        if round + 1 < attempts {
            let resent = seen.iter().filter(|s| matches!(s, Seen::Sent(_, Message::Dispatch(_), ..))).count();
            assert!(resent >= 1, "round {round} resends the unanswered parts");
            continue;
        }
        let r = seen
            .iter()
            .find_map(|s| match s {
                Seen::Sent(SCHEDULER, Message::StepResult(r), ..) => Some(r.clone()),
                _ => None,
            })
            .expect("the step fails");
        assert!(failure(&r).contains("did not answer layer"), "{r:?}");
        assert!(seen.iter().any(|s| matches!(s, Seen::Other(Effect::Disarm))));
    }
}

#[test]
fn a_duplicate_request_gets_the_same_answer_without_recomputing() {
    let mut rig = Rig::new();
    let first = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let r = rig.run(first, |_| false);
    let passes = rig.ctx.metrics.passes.load(std::sync::atomic::Ordering::Relaxed);
    let again = rig.request(StepRequest { attempt: 1, ..rig.step(1, vec![item(7, 0, prompt())]) });
    match &again[..] {
        [Seen::Sent(SCHEDULER, Message::StepResult(dup), ..)] => assert_eq!(dup, &r),
        other => panic!("one resent answer: {other:?}"),
    }
    assert_eq!(rig.ctx.metrics.passes.load(std::sync::atomic::Ordering::Relaxed), passes, "nothing recomputed");
    // An older step than the last answered one is stale.
    assert!(rig.request(rig.step(0, vec![item(7, 0, prompt())])).is_empty());
}

#[test]
fn a_restarted_scheduler_starts_every_sequence_over() {
    let mut rig = Rig::new();
    let first = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let token = tokens_of(&rig.run(first, |_| false))[0];
    let position = prompt().len() as u64;
    // A request of an older scheduler incarnation is ignored.
    let old = StepRequest { scheduler: 0, ..rig.step(2, vec![item(7, position, vec![token])]) };
    assert!(rig.request(old).is_empty());
    // A newer one finds no state to continue: the worker asks for the history.
    let newer = StepRequest { scheduler: 2, ..rig.step(1, vec![item(7, position, vec![token])]) };
    match &rig.request(newer)[..] {
        [Seen::Sent(SCHEDULER, Message::StepResult(r), ..)] => {
            assert_eq!(r.outcome, StepOutcome::NeedsHistory(vec![7]));
        }
        other => panic!("a history request: {other:?}"),
    }
}

#[test]
fn bad_requests_are_refused_whole_with_a_reason() {
    let mut rig = Rig::new();
    let bt = rig.ctx.block_tokens as u32;
    let snapshot_beyond = StepItem { snapshots: vec![bt * 4], ..item(2, 0, prompt()) };
    let cases = [
        (vec![item(1, 0, prompt()), item(1, 0, prompt())], "listed twice"),
        (vec![item(1, 0, Vec::new())], "no tokens"),
        (vec![StepItem { rebuild: true, ..item(1, 5, prompt()) }], "a rebuild starts at position 0"),
        (vec![snapshot_beyond], "snapshots"),
        (vec![StepItem { drafts: 2, ..item(1, 0, prompt()) }], "verifies at most 0"),
        (vec![StepItem { replay_until: 16, ..item(1, 0, prompt()) }], "replay without a restored state"),
        (vec![StepItem { import: vec![1, 2], ..item(1, 4, prompt()) }], "imported state"),
    ];
    for (step, (items, reason)) in cases.into_iter().enumerate() {
        let seen = rig.request(rig.step(step as u64 + 1, items));
        match &seen[..] {
            [Seen::Sent(SCHEDULER, Message::StepResult(r), ..)] => {
                assert!(failure(r).contains(reason), "{reason:?} in {:?}", failure(r));
            }
            other => panic!("one refusal for {reason:?}: {other:?}"),
        }
    }
    let repeated = StepRequest { repeat: 3, ..rig.step(20, vec![item(1, 0, prompt())]) };
    assert!(
        matches!(&rig.request(repeated)[..], [Seen::Sent(_, Message::StepResult(r), ..)] if failure(r).contains("runs one"))
    );
    // A body that is not what the items announce.
    let frame = rig.feed(SCHEDULER, Message::StepRequest(rig.step(21, vec![item(1, 0, prompt())])), &[1.0]);
    assert!(matches!(&frame[..], [Seen::Sent(_, Message::StepResult(r), ..)] if failure(r).contains("body values")));
}

#[test]
fn malformed_or_foreign_results_are_ignored_and_a_refusing_shard_fails_the_step() {
    let mut rig = Rig::new();
    let seen = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let h = seen
        .iter()
        .find_map(|s| match s {
            Seen::Sent(_, Message::Dispatch(h), ..) => Some(h.clone()),
            _ => None,
        })
        .expect("a dispatch");
    let result = |shard: u32, status: ResultStatus| ExpertResultHeader {
        pass: h.pass,
        step: h.step,
        layer: h.layer,
        part: h.part,
        shard,
        status,
        experts: h.experts.clone(),
    };
    let ctx = Arc::clone(&rig.ctx);
    let rejected = || ctx.metrics.frames_rejected.load(std::sync::atomic::Ordering::Relaxed);
    let before = rejected();
    // The right part from the right shard, but too few values.
    let target = seen
        .iter()
        .find_map(|s| match s {
            Seen::Sent(to, Message::Dispatch(d), ..) if d.part == h.part => Some(to.index),
            _ => None,
        })
        .unwrap();
    assert!(rig.feed(Addr::shard(target), Message::ExpertResult(result(target, ResultStatus::Ok)), &[0.5]).is_empty());
    assert_eq!(rejected(), before + 1, "counted");
    // From a shard the part was not sent to.
    let other = 1 - target;
    assert!(rig.feed(Addr::shard(other), Message::ExpertResult(result(other, ResultStatus::Ok)), &[]).is_empty());
    // A shard that no longer holds the expert: the step fails naming the
    // shard (its scheduler sends it the table again), its timer goes.
    let seen = rig.feed(Addr::shard(target), Message::ExpertResult(result(target, ResultStatus::NotHeld(3))), &[]);
    assert!(seen.iter().any(|s| matches!(s, Seen::Sent(SCHEDULER, Message::StepResult(r), ..)
        if failure(r).contains("does not hold expert 3") && matches!(r.outcome, StepOutcome::TableMismatch { shard, .. } if shard == target))));
    assert!(seen.iter().any(|s| matches!(s, Seen::Other(Effect::Disarm))));
}

/// A drafting worker verifies the drafts its own step proposed, answers
/// `1 + accepted` tokens and a verification, and refuses drafts it cannot
/// hold (a replay, a rebuild, a restored or imported state, past the
/// window or the context) with a reason rather than crashing.
#[test]
fn a_drafting_worker_verifies_its_proposals_and_refuses_drafts_it_cannot_hold() {
    let mut rig = Rig::with_ctx(crate::proto::test_ctx_drafting(2, 3));
    let first = rig.request(rig.step(1, vec![item(7, 0, prompt())]));
    let answer = rig.run(first, |_| false);
    let token = tokens_of(&answer)[0];
    let position = prompt().len() as u64;
    let StepOutcome::Done { verifications, .. } = &answer.outcome else { panic!("done: {answer:?}") };
    assert_eq!(verifications, &vec![Verification { seq: 7, drafts: 0, accepted: 0 }]);
    let window = rig.ctx.model.config.sliding_window as u32;
    let context = rig.ctx.config.max_position_embeddings as u64;
    let cont = |drafts| StepItem { drafts, ..item(7, position, vec![token]) };
    let cases = [
        (StepItem { replay_until: position + 1, ..cont(2) }, "drafts only follow"),
        (StepItem { rebuild: true, position: 0, tokens: [prompt(), vec![token]].concat(), ..cont(2) }, "drafts only"),
        (cont(window), "verifies at most"),
        (StepItem { position: context - 2, ..cont(2) }, "drafts only follow"),
        (StepItem { sample: false, ..cont(1) }, "drafts only follow"),
    ];
    for (step, (it, reason)) in cases.into_iter().enumerate() {
        let seen = rig.request(rig.step(step as u64 + 2, vec![it]));
        match &seen[..] {
            [Seen::Sent(SCHEDULER, Message::StepResult(r), ..)] => {
                assert!(failure(r).contains(reason), "{reason:?} in {:?}", failure(r));
            }
            other => panic!("one refusal for {reason:?}: {other:?}"),
        }
    }
    // The proposal is still held: a proper continuation verifies its drafts.
    let next = rig.request(rig.step(10, vec![cont(3)]));
    let answer = rig.run(next, |_| false);
    let StepOutcome::Done { outputs, verifications, .. } = &answer.outcome else { panic!("done: {answer:?}") };
    assert_eq!(verifications.len(), 1);
    let v = &verifications[0];
    assert_eq!(v.drafts, 3, "the step's proposal was verified");
    assert_eq!(outputs.len(), 1 + v.accepted as usize);
    let positions: Vec<u64> = outputs.iter().map(|o| o.position).collect();
    assert_eq!(positions, (position + 1..position + 2 + u64::from(v.accepted)).collect::<Vec<_>>());
}

/// A computing worker with images: a prompt with an image span sampled in
/// one step gives the engine's first token; images whose hash, value count
/// or span does not hold are refused before any layer runs.
#[test]
fn a_step_with_an_image_samples_the_engines_token_and_bad_images_are_refused() {
    use deepinfer_engine::images::{PromptBuilder, RequestImage};
    use deepinfer_engine::presets::{build, Preset};

    let model = Arc::new(build(Preset::TinyV41Vision, 3).expect("the vision preset builds"));
    let cfg = crate::cluster::ClusterConfig { devices_per_node: 8, ..crate::cluster::ClusterConfig::new(2, 2) };
    let ctx = crate::cluster::build_ctx(Arc::clone(&model), &cfg, crate::cluster::in_process_env(&cfg)).unwrap();
    let vision = model.image_model().unwrap().config.vision.clone().unwrap();
    let rgb: Vec<u8> = (0..70 * 50 * 3).map(|i| (i * 13 % 253) as u8).collect();
    let mut b = PromptBuilder::new(&vision);
    b.text(&[5, 6, 7]).image(&rgb, 70, 50).unwrap().text(&[8, 9]);
    let (prompt, images): (Vec<u32>, Vec<RequestImage>) = b.finish();
    let mut engine = Engine::new(&*model, EngineConfig::default()).expect("an engine");
    let mut r = Request::with_images(prompt.clone(), images.clone(), 1);
    r.ignore_eos = true;
    let id = engine.add_request(r).unwrap();
    let want = engine.run_to_completion().remove(&id).unwrap().token_ids();

    let mut rig = Rig::with_ctx(ctx);
    let mut body = Vec::new();
    let step_images = crate::proto::images::step_images(&images, 0..prompt.len(), &mut body);
    let item = StepItem { images: step_images.clone(), ..item(1, 0, prompt.clone()) };
    let step = rig.step(1, vec![item.clone()]);
    let seen = rig.feed(SCHEDULER, Message::StepRequest(step), &body);
    assert_eq!(tokens_of(&rig.run(seen, |_| false)), want, "the engine's token");

    let mut bad_hash = step_images.clone();
    bad_hash[0].hash ^= 1;
    let mut outside = step_images.clone();
    outside[0].start = prompt.len() as u32;
    let cases = [
        (bad_hash, body.clone(), "hash"),
        (step_images.clone(), body[1..].to_vec(), "body"),
        (outside, body.clone(), "misses positions"),
    ];
    for (n, (images, body, want)) in cases.into_iter().enumerate() {
        let item = StepItem { seq: 10 + n as u64, images, ..item.clone() };
        let step = rig.step(2 + n as u64, vec![item]);
        let seen = rig.feed(SCHEDULER, Message::StepRequest(step), &body);
        let why = seen.iter().find_map(|s| match s {
            Seen::Sent(_, Message::StepResult(StepResult { outcome: StepOutcome::Failed(why), .. }), _) => Some(why),
            _ => None,
        });
        assert!(why.is_some_and(|w| w.contains(want)), "{want}: {seen:?}");
    }
}
