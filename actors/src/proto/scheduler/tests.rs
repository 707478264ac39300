//! The scheduler machine driven by scripted inputs: no actor, runtime or
//! socket; every frame it sends is decoded and checked.

use std::sync::Arc;
use std::time::Duration;

use super::{Effect, Input, SchedulerMachine};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::wire::{
    self, Addr, Control, Envelope, FinishKind, Heartbeat, Message, OutputEnd, SeqOutput, StepOutcome, StepRequest,
    StepResult, Submit,
};

const ROUTER: Addr = Addr::router(0);
const WORKER: Addr = Addr::worker(0);
const SHARD: Addr = Addr::shard(0);

fn ctx() -> Arc<Ctx> {
    crate::proto::test_ctx(1, 8, 1)
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn frame(from: Addr, msg: Message, body: &[f32]) -> Input {
    let to = Addr::scheduler(0);
    let frame = wire::encode(&Envelope { from, to, msg }, body).expect("encodes");
    Input::Net(Delivery::new(from, frame))
}

fn submit(id: u64, prompt: Vec<u32>, max_tokens: u32) -> Input {
    let spec = crate::proto::test_spec(id, prompt, max_tokens);
    frame(ROUTER, Message::Submit(Submit { spec, generated: Vec::new(), decode: None, encoder: None }), &[])
}

/// The machine's effects, with every frame decoded.
// A test's decoded frames: their size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Seen {
    Sent(Addr, Message),
    Other(Effect),
}

fn drain(m: &mut SchedulerMachine) -> Vec<Seen> {
    m.take_effects()
        .into_iter()
        .map(|e| match e {
            Effect::Send { to, frame } => {
                let d = wire::decode(&frame).expect("the machine sends valid frames");
                assert_eq!((d.envelope.from, d.envelope.to), (Addr::scheduler(0), to));
                Seen::Sent(to, d.envelope.msg)
            }
            other => Seen::Other(other),
        })
        .collect()
}

fn step_requests(seen: &[Seen]) -> Vec<StepRequest> {
    seen.iter()
        .filter_map(|s| match s {
            Seen::Sent(to, Message::StepRequest(r)) if *to == WORKER => Some(r.clone()),
            _ => None,
        })
        .collect()
}

fn armed(seen: &[Seen]) -> Option<(Duration, u64)> {
    seen.iter().rev().find_map(|s| match s {
        Seen::Other(Effect::ArmStep { at, serial }) => Some((*at, *serial)),
        _ => None,
    })
}

fn done(r: &StepRequest, token: u32) -> Input {
    let it = &r.items[0];
    let position = it.position + it.tokens.len() as u64;
    let outputs = vec![SeqOutput { seq: it.seq, token, logprob: -0.5, position, top: Vec::new() }];
    let outcome = StepOutcome::Done {
        outputs,
        snapshots: Vec::new(),
        loads: Vec::new(),
        exports: Vec::new(),
        verifications: Vec::new(),
    };
    frame(WORKER, Message::StepResult(StepResult { step: r.step, attempt: r.attempt, device: 0, outcome }), &[])
}

/// A started machine whose start-up effects (cache clear, hello, its table
/// to the shard) are checked and dropped, and the shard's acknowledgement fed.
fn started() -> SchedulerMachine {
    let mut m = SchedulerMachine::start(ms(0), 0, 0, ctx()).expect("starts");
    let seen = drain(&mut m);
    assert!(
        matches!(
            &seen[..],
            [
                Seen::Sent(_, Message::Cache(_)),
                Seen::Sent(r, Message::Heartbeat(_)),
                Seen::Sent(s, Message::Control(Control::LoadExperts { epoch: 0, .. })),
                Seen::Other(Effect::ArmStep { .. })
            ] if *r == ROUTER && *s == SHARD
        ),
        "{seen:?}"
    );
    m.handle(ms(0), frame(SHARD, Message::Control(Control::Loaded { epoch: 0, device: 0 }), &[])).expect("no crash");
    drain(&mut m);
    m
}

/// Submit, then the first step's request to the worker.
fn first_step(m: &mut SchedulerMachine, max_tokens: u32) -> StepRequest {
    m.handle(ms(1), submit(7, (2..20).collect(), max_tokens)).expect("no crash");
    let seen = drain(m);
    assert!(
        matches!(&seen[..], [Seen::Sent(r, Message::Ack { ids }), Seen::Other(Effect::Tick)] if *r == ROUTER && ids == &[7])
    );
    m.handle(ms(1), Input::Tick).expect("no crash");
    let seen = drain(m);
    let reqs = step_requests(&seen);
    assert_eq!(reqs.len(), 1, "{seen:?}");
    assert_eq!(reqs[0].items[0].tokens, (2..20).collect::<Vec<u32>>());
    assert!(armed(&seen).is_some(), "a step request arms the step timer");
    reqs[0].clone()
}

#[test]
fn a_request_runs_to_its_length_and_is_reported_to_the_router() {
    let mut m = started();
    let req = first_step(&mut m, 2);
    m.handle(ms(2), done(&req, 42)).expect("no crash");
    let seen = drain(&mut m);
    let out: Vec<_> = seen
        .iter()
        .filter_map(|s| match s {
            Seen::Sent(to, Message::Outputs(o)) if *to == ROUTER => Some(o.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].items[0].tokens[0].token, 42);
    assert!(out[0].items[0].end.is_none());
    assert!(seen.iter().any(|s| matches!(s, Seen::Other(Effect::Tick))));
    // The second token ends it at its length.
    m.handle(ms(3), Input::Tick).expect("no crash");
    let req = step_requests(&drain(&mut m)).pop().expect("a decode step");
    assert_eq!(req.items[0].tokens, vec![42]);
    m.handle(ms(4), done(&req, 43)).expect("no crash");
    let ended = drain(&mut m).into_iter().find_map(|s| match s {
        Seen::Sent(_, Message::Outputs(o)) => o.items.into_iter().next(),
        _ => None,
    });
    let ended = ended.expect("outputs");
    assert!(
        matches!(ended.end, Some(OutputEnd::Finished(f)) if f.reason == FinishKind::Length && f.completion_tokens == 2)
    );
    // Nothing is left to run: a tick is a no-op.
    m.handle(ms(5), Input::Tick).expect("no crash");
    assert!(drain(&mut m).is_empty());
}

#[test]
fn a_lost_step_request_is_sent_again_then_its_requests_fail() {
    let mut m = started();
    let req = first_step(&mut m, 4);
    let attempts = m.ctx.timeouts.step_attempts;
    let mut now = ms(1);
    let mut serial = m.serial;
    for attempt in 1..attempts {
        // A timer that fires early (or a stale serial) changes nothing.
        m.handle(now, Input::Timeout(serial + 100)).expect("no crash");
        assert!(drain(&mut m).is_empty());
        now += m.ctx.timeouts.step;
        m.handle(now, Input::Timeout(serial)).expect("no crash");
        let seen = drain(&mut m);
        let again = step_requests(&seen);
        assert_eq!(again.len(), 1, "attempt {attempt}: {seen:?}");
        assert_eq!((again[0].step, again[0].attempt), (req.step, attempt));
        assert_eq!(again[0].items, req.items, "the same work again");
        serial = armed(&seen).expect("re-armed").1;
    }
    now += m.ctx.timeouts.step;
    m.handle(now, Input::Timeout(serial)).expect("no crash");
    let failed = drain(&mut m).into_iter().find_map(|s| match s {
        Seen::Sent(_, Message::Outputs(o)) => o.items.into_iter().next(),
        _ => None,
    });
    let end = failed.expect("the request ends").end;
    assert!(matches!(&end, Some(OutputEnd::Finished(f)) if matches!(f.reason, FinishKind::Error(_))), "{end:?}");
}

#[test]
fn a_duplicate_or_foreign_result_is_ignored() {
    let mut m = started();
    let req = first_step(&mut m, 4);
    m.handle(ms(2), done(&req, 42)).expect("no crash");
    let first = drain(&mut m);
    assert!(first.iter().any(|s| matches!(s, Seen::Sent(_, Message::Outputs(_)))));
    // The same result again (a duplicated frame): no second token.
    m.handle(ms(2), done(&req, 42)).expect("no crash");
    assert!(drain(&mut m).is_empty());
    // A result from a worker of no instance here is counted and dropped.
    let rejected = m.ctx.metrics.snapshot().frames_rejected;
    let stranger = frame(Addr::worker(9), Message::Ack { ids: vec![1] }, &[]);
    m.handle(ms(3), stranger).expect("no crash");
    assert!(drain(&mut m).is_empty());
    assert_eq!(m.ctx.metrics.snapshot().frames_rejected, rejected + 1);
    // A frame that does not decode is counted too, and never panics.
    m.handle(ms(3), Input::Net(Delivery::new(WORKER, vec![1, 2, 3]))).expect("no crash");
    assert_eq!(m.ctx.metrics.snapshot().frames_rejected, rejected + 2);
}

#[test]
fn a_restarted_worker_gets_the_step_again_with_the_history() {
    let mut m = started();
    let req = first_step(&mut m, 4);
    m.handle(ms(2), done(&req, 42)).expect("no crash");
    drain(&mut m);
    m.handle(ms(3), Input::Tick).expect("no crash");
    let decode = step_requests(&drain(&mut m)).pop().expect("a decode step");
    assert!(!decode.items[0].rebuild);
    let hello = Heartbeat { incarnation: 99, restarted: true, time_ns: 0 };
    m.handle(ms(4), frame(WORKER, Message::Heartbeat(hello), &[])).expect("no crash");
    let again = step_requests(&drain(&mut m)).pop().expect("sent again");
    assert_eq!((again.step, again.attempt), (decode.step, 1));
    // The new worker holds no state for the sequence and says so.
    let lost = StepResult { step: again.step, attempt: 1, device: 0, outcome: StepOutcome::NeedsHistory(vec![7]) };
    m.handle(ms(5), frame(WORKER, Message::StepResult(lost), &[])).expect("no crash");
    let again = step_requests(&drain(&mut m)).pop().expect("sent again");
    assert_eq!((again.step, again.attempt), (decode.step, 2));
    assert!(again.items[0].rebuild);
    let mut history: Vec<u32> = (2..20).collect();
    history.push(42);
    assert_eq!(again.items[0].tokens, history, "the whole history, recomputed");
}

#[test]
fn the_same_inputs_give_the_same_effects() {
    let run = || {
        let mut m = started();
        let req = first_step(&mut m, 3);
        m.handle(ms(2), done(&req, 42)).expect("no crash");
        m.handle(ms(3), Input::Tick).expect("no crash");
        format!("{:?}", m.take_effects())
    };
    assert_eq!(run(), run());
}

#[test]
#[should_panic(expected = "time went backwards")]
fn time_never_goes_backwards() {
    let mut m = started();
    m.handle(ms(5), Input::Tick).expect("no crash");
    let _ = m.handle(ms(4), Input::Tick);
}

/// A scheduler whose process restarted numbers its tables from the
/// configured one while the shards hold a later epoch from its predecessor:
/// a shard that says so gets the current table again, numbered past what it
/// holds, before any step runs; a stale answer changes nothing.
#[test]
fn a_shard_holding_a_later_epoch_gets_the_table_again_numbered_past_it() {
    let mut m = SchedulerMachine::start(ms(0), 0, 0, ctx()).expect("starts");
    drain(&mut m);
    let behind = Control::Behind { epoch: 0, held: 7, device: 0 };
    m.handle(ms(1), frame(SHARD, Message::Control(behind), &[])).expect("no crash");
    let seen = drain(&mut m);
    assert!(
        seen.iter().any(
            |s| matches!(s, Seen::Sent(to, Message::Control(Control::LoadExperts { epoch: 8, .. })) if *to == SHARD)
        ),
        "{seen:?}"
    );
    // A request waits for the acknowledgement of epoch 8, then runs.
    m.handle(ms(2), submit(7, (2..20).collect(), 3)).expect("no crash");
    assert!(step_requests(&drain(&mut m)).is_empty(), "no step before the shard holds the table");
    m.handle(ms(3), frame(SHARD, Message::Control(Control::Loaded { epoch: 8, device: 0 }), &[])).expect("no crash");
    drain(&mut m);
    m.handle(ms(3), Input::Tick).expect("no crash");
    let step = step_requests(&drain(&mut m)).pop().expect("the step runs once the table is held");
    assert_eq!(step.placement.epoch, 8);
    // An answer about an epoch not past the current one is a late frame: nothing happens.
    let stale = Control::Behind { epoch: 3, held: 8, device: 0 };
    m.handle(ms(4), frame(SHARD, Message::Control(stale), &[])).expect("no crash");
    let seen = drain(&mut m);
    assert!(
        !seen.iter().any(|s| matches!(s, Seen::Sent(_, Message::Control(Control::LoadExperts { .. })))),
        "{seen:?}"
    );
}

/// A shard that starts (a restarted node process) reads its process's copy
/// of the table; its scheduler sends it the current one.
#[test]
fn a_started_shard_is_sent_the_current_table() {
    let mut m = started();
    m.handle(ms(1), frame(SHARD, Message::Heartbeat(Heartbeat { incarnation: 3, restarted: true, time_ns: 0 }), &[]))
        .expect("no crash");
    let seen = drain(&mut m);
    assert!(
        matches!(&seen[..], [Seen::Sent(to, Message::Control(Control::LoadExperts { epoch: 0, .. }))] if *to == SHARD),
        "{seen:?}"
    );
}

/// A request's admission priority crosses the wire into the engine request
/// the instance's scheduler queues (the engine's own tests order by it).
#[test]
fn a_submitted_priority_reaches_the_engine_request() {
    let mut spec = crate::proto::test_spec(7, (2..20).collect(), 3);
    spec.priority = -5;
    let frame = wire::encode(
        &Envelope {
            from: ROUTER,
            to: Addr::scheduler(0),
            msg: Message::Submit(Submit { spec, generated: Vec::new(), decode: None, encoder: None }),
        },
        &[],
    )
    .expect("encodes");
    let Message::Submit(s) = wire::decode(&frame).expect("decodes").envelope.msg else { panic!("a submit") };
    assert_eq!(super::request_of(&s.spec).priority, -5);
}
