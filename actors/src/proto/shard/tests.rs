//! The expert shard driven by scripted frames: its answers are the model's
//! expert outputs, and malformed or misplaced dispatches are refused with a
//! status, never a panic.

use std::sync::Arc;

use super::{ShardEffect, ShardMachine};
use crate::cluster::ctx::Ctx;
use crate::net::transport::Delivery;
use crate::proto::{test_ctx, Outgoing};
use crate::wire::{self, Addr, Control, DispatchHeader, Envelope, ExpertRows, Message, ResultStatus};

const WORKER: Addr = Addr::worker(0);

fn frame(msg: Message, body: &[f32]) -> Delivery {
    Delivery::new(WORKER, wire::encode(&Envelope { from: WORKER, to: Addr::shard(0), msg }, body).expect("encodes"))
}

fn answers(m: &mut ShardMachine) -> Vec<(Message, Vec<f32>)> {
    m.take_effects()
        .into_iter()
        .filter_map(|e| match e {
            ShardEffect::Send(Outgoing { to, frame }) => {
                assert_eq!(to, WORKER);
                let d = wire::decode(&frame).expect("valid frames");
                Some((d.envelope.msg, d.body))
            }
            ShardEffect::Busy(_) | ShardEffect::Read { .. } => None,
        })
        .collect()
}

fn dispatch(layer: u32, experts: Vec<ExpertRows>, body: &[f32]) -> Delivery {
    let h = DispatchHeader { pass: 1, step: 3, layer, part: 0, worker: 0, epoch: 0, experts };
    frame(Message::Dispatch(h), body)
}

fn status(out: &[(Message, Vec<f32>)]) -> ResultStatus {
    match out {
        [(Message::ExpertResult(r), _)] => r.status.clone(),
        other => panic!("one result: {other:?}"),
    }
}

/// A started shard whose hello (asking its scheduler for the current table) is checked and dropped.
fn shard(ctx: &Arc<Ctx>) -> ShardMachine {
    let mut m = ShardMachine::start(0, 0, Arc::clone(ctx));
    let hello: Vec<Addr> = m
        .take_effects()
        .into_iter()
        .filter_map(|e| match e {
            ShardEffect::Send(Outgoing { to, frame }) => {
                assert!(matches!(wire::decode(&frame).expect("valid").envelope.msg, Message::Heartbeat(_)));
                Some(to)
            }
            _ => None,
        })
        .collect();
    assert_eq!(hello, vec![Addr::scheduler(0)]);
    m
}

#[test]
fn a_dispatch_is_answered_with_the_models_expert_outputs() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = shard(&ctx);
    let (model, d) = (&ctx.model, ctx.model.config.hidden_size);
    let layer = ctx.model.config.num_layers as u32 - 1;
    let rows: Vec<f32> = (0..3 * d).map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5).collect();
    let mut body = rows.clone();
    if model.experts_take_weights() {
        body.extend([0.25f32, 0.5, 1.0]);
    }
    m.handle(dispatch(layer, vec![ExpertRows { expert: 1, rows: 3 }], &body)).expect("no crash");
    let out = answers(&mut m);
    assert_eq!(status(&out), ResultStatus::Ok);
    let want = if model.experts_take_weights() {
        model.expert_forward_weighted(layer as usize, 1, &rows, &[0.25, 0.5, 1.0])
    } else {
        model.expert_forward(layer as usize, 1, &rows)
    };
    assert_eq!(out[0].1, want, "bit for bit the model's");
}

#[test]
fn malformed_and_misplaced_dispatches_are_refused() {
    let ctx = test_ctx(1, 8, 1);
    let mut m = shard(&ctx);
    let (d, layers, experts) =
        (ctx.model.config.hidden_size, ctx.model.config.num_layers as u32, ctx.model.config.n_routed_experts as u32);
    let width = d + usize::from(ctx.model.experts_take_weights());
    let body = vec![0.0; width];
    let one = |expert| vec![ExpertRows { expert, rows: 1 }];
    m.handle(dispatch(layers, one(0), &body)).expect("no crash");
    assert!(matches!(status(&answers(&mut m)), ResultStatus::Invalid(_)), "a layer past the model");
    m.handle(dispatch(0, one(experts), &body)).expect("no crash");
    assert!(matches!(status(&answers(&mut m)), ResultStatus::Invalid(_)), "an expert past the model");
    m.handle(dispatch(0, one(0), &body[1..])).expect("no crash");
    assert!(matches!(status(&answers(&mut m)), ResultStatus::Invalid(_)), "a body that does not add up");
    // A newer table without expert 0; an older one changes nothing and is
    // answered with the epoch held, never acknowledged as loaded; so is a
    // preparation of a table not newer than the one held.
    m.handle(frame(Message::Control(Control::LoadExperts { epoch: 5, experts: vec![1] }), &[])).expect("no crash");
    m.handle(frame(Message::Control(Control::LoadExperts { epoch: 4, experts: vec![0] }), &[])).expect("no crash");
    m.handle(frame(Message::Control(Control::PrepareExperts { epoch: 5, experts: vec![0] }), &[])).expect("no crash");
    let acks = answers(&mut m);
    assert!(
        matches!(
            &acks[..],
            [
                (Message::Control(Control::Loaded { epoch: 5, .. }), _),
                (Message::Control(Control::Behind { epoch: 4, held: 5, device: 0 }), _),
                (Message::Control(Control::Behind { epoch: 5, held: 5, device: 0 }), _)
            ]
        ),
        "{acks:?}"
    );
    m.handle(dispatch(0, one(0), &body)).expect("no crash");
    assert_eq!(status(&answers(&mut m)), ResultStatus::NotHeld(0));
    m.handle(frame(Message::Control(Control::Ping { nonce: 8 }), &[])).expect("no crash");
    assert!(matches!(&answers(&mut m)[..], [(Message::Control(Control::Pong { nonce: 8 }), _)]));
}
