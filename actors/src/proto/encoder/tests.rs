//! The encoder machine with scripted frames: rows equal the engine's span
//! rows, a repeat is answered from the cache without the tower, and
//! requests whose images do not add up are refused or rejected whole.

use std::sync::Arc;
use std::time::Duration;

use deepinfer_engine::images::{span_rows, RequestImage};
use deepinfer_engine::presets::{build, Preset};

use super::*;
use crate::proto::images::plan_wire;
use crate::wire::{self, Envelope};

const SCHEDULER: Addr = Addr::scheduler(0);

fn machine() -> (EncoderMachine, RequestImage) {
    let model = Arc::new(build(Preset::TinyV41Vision, 3).expect("the vision preset builds"));
    let cfg = model.image_model().unwrap().config.vision.clone().unwrap();
    let rgb: Vec<u8> = (0..60 * 40 * 3).map(|i| (i * 7 % 251) as u8).collect();
    let image = RequestImage::prepare(&cfg, 0, &rgb, 60, 40).unwrap();
    let mut c = crate::cluster::ClusterConfig::new(1, 1);
    c.encoder_nodes = vec![0];
    let ctx = crate::cluster::build_ctx(model, &c, crate::cluster::in_process_env(&c)).expect("a valid cluster");
    (EncoderMachine::start(Duration::ZERO, 0, 0, ctx), image)
}

fn encode(image: &RequestImage, hash: u64, patches: &[f32], attempt: u32) -> Input {
    let images = vec![EncodeImage { hash, plan: plan_wire(&image.plan), values: patches.len() as u32 }];
    let msg = Message::Encoder(EncoderMsg::Encode { id: 7, attempt, images });
    let frame = wire::encode(&Envelope { from: SCHEDULER, to: Addr::encoder(0), msg }, patches).unwrap();
    Input::Net(Delivery::new(SCHEDULER, frame))
}

fn patches(image: &RequestImage) -> Vec<f32> {
    match &image.content {
        deepinfer_engine::images::ImageContent::Patches(p) => p.patches.clone(),
        _ => unreachable!("prepared images carry patches"),
    }
}

/// Every frame sent, decoded, and whether a `Work` was asked for.
fn drain(m: &mut EncoderMachine) -> (Vec<(EncoderMsg, Vec<f32>)>, bool) {
    let mut sent = Vec::new();
    let mut work = false;
    for e in m.take_effects() {
        match e {
            Effect::Send(o) => {
                let d = wire::decode(&o.frame).unwrap();
                assert_eq!(o.to, SCHEDULER);
                let Message::Encoder(msg) = d.envelope.msg else { panic!("an encoder message") };
                sent.push((msg, d.body));
            }
            Effect::Work => work = true,
            Effect::Busy(_) => {}
        }
    }
    (sent, work)
}

#[test]
fn rows_are_the_engines_and_a_repeat_comes_from_the_cache() {
    let (mut m, image) = machine();
    let want = span_rows(&m.ctx.model, &image).unwrap();
    m.handle(Duration::ZERO, encode(&image, image.hash, &patches(&image), 1)).unwrap();
    let (sent, work) = drain(&mut m);
    assert!(sent.is_empty() && work && m.queued() == 1, "queued, work asked for");
    m.handle(Duration::ZERO, Input::Work).unwrap();
    let (sent, work) = drain(&mut m);
    assert!(!work && m.queued() == 0);
    let tokens = image.plan.tokens() as u32;
    assert!(
        matches!(sent[0].0, EncoderMsg::Encoded { id: 7, attempt: 1, cached: false, tokens: t, .. } if t == tokens)
    );
    assert_eq!(
        sent[0].1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    m.handle(Duration::ZERO, encode(&image, image.hash, &patches(&image), 2)).unwrap();
    let (sent, work) = drain(&mut m);
    assert!(!work, "no tower run for a cached image");
    assert!(matches!(sent[0].0, EncoderMsg::Encoded { attempt: 2, cached: true, .. }));
    assert_eq!(sent[0].1.len(), want.len());
    let c = m.counters();
    assert_eq!((c.images_encoded, c.cache_hits, c.cache_misses), (1, 1, 1));
}

#[test]
fn images_that_do_not_add_up_are_refused() {
    let (mut m, image) = machine();
    let p = patches(&image);
    m.handle(Duration::ZERO, encode(&image, image.hash ^ 1, &p, 1)).unwrap();
    let (sent, _) = drain(&mut m);
    assert!(matches!(&sent[0].0, EncoderMsg::Refused { why, .. } if why.contains("hash")), "{sent:?}");
    m.handle(Duration::ZERO, encode(&image, image.hash, &p[1..], 1)).unwrap();
    let (sent, _) = drain(&mut m);
    assert!(matches!(&sent[0].0, EncoderMsg::Refused { why, .. } if why.contains("patch values")), "{sent:?}");
    // A body that is not what the header says: rejected whole, nothing answered.
    let images = vec![EncodeImage { hash: 1, plan: plan_wire(&image.plan), values: 5 }];
    let msg = Message::Encoder(EncoderMsg::Encode { id: 8, attempt: 1, images });
    let frame = wire::encode(&Envelope { from: SCHEDULER, to: Addr::encoder(0), msg }, &[0.0; 4]).unwrap();
    m.handle(Duration::ZERO, Input::Net(Delivery::new(SCHEDULER, frame))).unwrap();
    assert_eq!(drain(&mut m), (Vec::new(), false));
    assert_eq!(m.queued(), 0);
}
