//! The router driven by scripted frames and ticks: every frame it sends is
//! decoded and checked.

use std::sync::Arc;
use std::time::Duration;

use super::{end_item, RouterInput, RouterMachine};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::proto::test_ctx;
use crate::wire::{
    self, Addr, Envelope, FinishKind, Heartbeat, Message, OutputItem, Outputs, RequestSpec, Submit, TokenOut,
};

const CLIENT: Addr = Addr::client(0);
const SCHEDULER: Addr = Addr::scheduler(0);

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn frame(from: Addr, msg: Message) -> RouterInput {
    let bytes = wire::encode(&Envelope { from, to: Addr::router(0), msg }, &[]).expect("encodes");
    RouterInput::Net(Delivery::new(from, bytes))
}

fn spec(id: u64) -> RequestSpec {
    crate::proto::test_spec(id, (2..12).collect(), 8)
}

fn submit(id: u64, generated: Vec<u32>) -> RouterInput {
    frame(CLIENT, Message::Submit(Submit { spec: spec(id), generated, decode: None, encoder: None }))
}

fn outputs(id: u64, from: u32, tokens: &[u32]) -> RouterInput {
    let tokens = tokens.iter().map(|&token| TokenOut { token, logprob: -1.0, top: Vec::new() }).collect();
    let item = OutputItem { id, from, tokens, logits: false, end: None, cached: 0 };
    frame(SCHEDULER, Message::Outputs(Outputs { items: vec![item] }))
}

fn sent(m: &mut RouterMachine) -> Vec<(Addr, Message)> {
    m.take_outgoing()
        .into_iter()
        .map(|o| {
            let d = wire::decode(&o.frame).expect("valid frames");
            assert_eq!(d.envelope.from, Addr::router(0));
            (o.to, d.envelope.msg)
        })
        .collect()
}

/// A router with request 1 routed to scheduler 0 (one instance: no cache lookup).
fn routed(ctx: &Arc<Ctx>) -> RouterMachine {
    let mut m = RouterMachine::start(ms(0), 0, 0, Arc::clone(ctx));
    assert!(matches!(&sent(&mut m)[..], [(CLIENT, Message::Heartbeat(h))] if !h.restarted));
    m.handle(ms(1), submit(1, Vec::new()));
    let out = sent(&mut m);
    assert!(matches!(&out[0], (CLIENT, Message::Ack { ids }) if ids == &[1]), "{out:?}");
    assert!(matches!(&out[1], (SCHEDULER, Message::Submit(s)) if s.spec.id == 1 && s.generated.is_empty()), "{out:?}");
    assert_eq!((out.len(), m.in_flight()), (2, 1));
    m
}

fn relayed(out: &[(Addr, Message)]) -> Vec<(u32, Vec<u32>)> {
    out.iter()
        .filter_map(|(to, msg)| match msg {
            Message::Outputs(o) if *to == CLIENT => {
                Some(o.items.iter().map(|i| (i.from, i.tokens.iter().map(|t| t.token).collect())).collect::<Vec<_>>())
            }
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn outputs_reach_the_client_once_and_in_order_and_a_gap_is_asked_for_again() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = routed(&ctx);
    m.handle(ms(2), outputs(1, 0, &[40, 41]));
    assert_eq!(relayed(&sent(&mut m)), vec![(0, vec![40, 41])]);
    // A duplicate and an overlap: only what is new goes on.
    m.handle(ms(3), outputs(1, 0, &[40, 41]));
    assert!(relayed(&sent(&mut m)).is_empty());
    m.handle(ms(3), outputs(1, 1, &[41, 42]));
    assert_eq!(relayed(&sent(&mut m)), vec![(2, vec![42])]);
    // Token 4 arrives without token 3: the scheduler is asked again from 3.
    m.handle(ms(4), outputs(1, 4, &[44]));
    let out = sent(&mut m);
    assert!(relayed(&out).is_empty());
    assert!(matches!(&out[..], [(SCHEDULER, Message::Submit(s))] if s.generated == vec![40, 41, 42]), "{out:?}");
}

#[test]
fn a_restarted_scheduler_gets_its_requests_again_with_their_tokens() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = routed(&ctx);
    m.handle(ms(2), outputs(1, 0, &[40]));
    sent(&mut m);
    m.handle(ms(3), frame(SCHEDULER, Message::Heartbeat(Heartbeat { incarnation: 9, restarted: true, time_ns: 0 })));
    let out = sent(&mut m);
    assert!(
        matches!(&out[..], [(SCHEDULER, Message::Submit(s))] if s.spec.id == 1 && s.generated == vec![40]),
        "{out:?}"
    );
}

#[test]
fn a_request_without_progress_is_resent_then_ends_with_an_error() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = routed(&ctx);
    let (wait, attempts) = (ctx.timeouts.request, ctx.timeouts.request_attempts);
    let mut now = ms(1);
    for _ in 0..attempts {
        now += wait;
        m.handle(now, RouterInput::Tick);
        assert!(matches!(&sent(&mut m)[..], [(SCHEDULER, Message::Submit(_))]), "resent");
    }
    now += wait;
    m.handle(now, RouterInput::Tick);
    let out = sent(&mut m);
    assert!(matches!(&out[0], (SCHEDULER, Message::Cancel { id: 1 })), "{out:?}");
    let ended = match &out[1] {
        (CLIENT, Message::Outputs(o)) => o.items[0].clone(),
        other => panic!("{other:?}"),
    };
    let want = end_item(1, 0, 10, FinishKind::Error(String::new()));
    assert_eq!((ended.id, ended.from), (want.id, want.from));
    assert!(matches!(ended.end, Some(wire::OutputEnd::Finished(f)) if matches!(f.reason, FinishKind::Error(_))));
    assert_eq!(m.in_flight(), 0);
}

#[test]
fn a_cancel_goes_to_the_scheduler_and_its_answer_to_the_client() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = routed(&ctx);
    m.handle(ms(2), frame(CLIENT, Message::Cancel { id: 1 }));
    assert!(matches!(&sent(&mut m)[..], [(SCHEDULER, Message::Cancel { id: 1 })]));
    let item = end_item(1, 0, 10, FinishKind::Cancelled);
    m.handle(ms(3), frame(SCHEDULER, Message::Outputs(Outputs { items: vec![item] })));
    let out = sent(&mut m);
    assert!(matches!(&out[..], [(CLIENT, Message::Outputs(o))] if o.items[0].end.is_some()), "{out:?}");
    assert_eq!(m.in_flight(), 0);
}

#[test]
fn the_requests_of_a_client_that_went_silent_are_cancelled_and_a_live_one_keeps_its_own() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = routed(&ctx);
    let alive = |t: u64| frame(CLIENT, Message::Heartbeat(Heartbeat { incarnation: 0, restarted: false, time_ns: t }));
    m.handle(ms(2), alive(2));
    let silence = ctx.timeouts.request * ctx.timeouts.request_attempts;
    // Keepalives hold it: nothing is cancelled however long the request runs.
    let mut t = ms(2);
    while t < ms(2) + silence * 2 {
        t += ctx.timeouts.request / 4;
        m.handle(t, alive(t.as_millis() as u64));
        m.handle(t, RouterInput::Tick);
        m.handle(t, outputs(1, 0, &[]));
        assert!(sent(&mut m).iter().all(|(_, msg)| !matches!(msg, Message::Cancel { .. })), "at {t:?}");
    }
    // Then it goes silent: past the limit its request is cancelled at the scheduler.
    m.handle(t + silence, RouterInput::Tick);
    assert!(sent(&mut m).iter().all(|(_, msg)| !matches!(msg, Message::Cancel { .. })), "not yet");
    m.handle(t + silence + ms(1), RouterInput::Tick);
    let out = sent(&mut m);
    assert!(out.iter().any(|(to, msg)| *to == SCHEDULER && matches!(msg, Message::Cancel { id: 1 })), "{out:?}");
}
