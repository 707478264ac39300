//! Untrusted bytes never panic the node: random, corrupted, truncated and
//! oversized frames are rejected with a typed error; valid frames round-trip.

use deepinfer_actors::wire::{
    decode, decode_with_limit, encode, read_frame, Addr, BlockSnapshot, CacheMsg, CacheTier, Control, DispatchHeader,
    EncodeImage, EncoderMsg, Envelope, ExpertLoad, ExpertResultHeader, ExpertRows, FetchItem, FinishKind, FinishWire,
    HandoffMsg, Heartbeat, ImageData, ImageWire, InstanceMatch, Message, OutputEnd, OutputItem, Outputs, PlacementWire,
    PlanWire, PromoteItem, PromotedBlock, PromotedItem, RequestSpec, ResultStatus, RetentionWire, Role, Sampling,
    SeqOutput, StateExport, StepImage, StepItem, StepOutcome, StepRequest, StepResult, StoredBlock, Submit, TokenBias,
    TokenCount, TokenOut, TopLogprob, Verification, WireError, MAX_FRAME_BYTES,
};
use proptest::prelude::*;

fn addr() -> impl Strategy<Value = Addr> {
    (0u8..8, any::<u32>()).prop_map(|(r, index)| {
        let role = [
            Role::Scheduler,
            Role::Worker,
            Role::Shard,
            Role::Router,
            Role::CacheManager,
            Role::Client,
            Role::Node,
            Role::Encoder,
        ][r as usize];
        Addr { role, index }
    })
}

fn rows() -> impl Strategy<Value = Vec<ExpertRows>> {
    prop::collection::vec((any::<u32>(), 0u32..64).prop_map(|(expert, rows)| ExpertRows { expert, rows }), 0..6)
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (any::<u64>(), any::<u64>(), any::<u32>(), any::<u32>(), any::<u32>(), any::<u64>(), rows()).prop_map(
            |(pass, step, layer, part, worker, epoch, experts)| {
                Message::Dispatch(DispatchHeader { pass, step, layer, part, worker, epoch, experts })
            }
        ),
        (any::<u64>(), any::<u32>(), rows(), ".{0,20}").prop_map(|(pass, layer, experts, why)| {
            let status = if why.is_empty() { ResultStatus::Ok } else { ResultStatus::Invalid(why) };
            Message::ExpertResult(ExpertResultHeader { pass, step: 1, layer, part: 0, shard: 2, status, experts })
        }),
        (
            any::<u64>(),
            prop::collection::vec(prop::collection::vec(any::<u32>(), 1..3), 0..8),
            prop::collection::vec(any::<u32>(), 0..40)
        )
            .prop_map(|(step, replicas, tokens)| {
                Message::StepRequest(StepRequest {
                    step,
                    attempt: 0,
                    scheduler: 7,
                    placement: PlacementWire { epoch: 3, devices: 4, replicas },
                    items: vec![StepItem {
                        seq: 9,
                        position: 4,
                        tokens,
                        rebuild: false,
                        sampling: sampling(),
                        sample: true,
                        logits: step % 2 == 0,
                        replay_until: 64,
                        restore: vec![vec![1, 16, u32::MAX, u32::MAX]],
                        snapshots: vec![1, 2],
                        export: step % 3 == 0,
                        import: if step % 5 == 0 { vec![4, 0, 12] } else { Vec::new() },
                        drafts: (step % 7) as u32,
                        allowed: if step % 2 == 0 { vec![u32::MAX, 5] } else { Vec::new() },
                        history: vec![TokenCount { token: 3, count: 0 }, TokenCount { token: 8, count: step as u32 }],
                        images: (step % 4 == 1)
                            .then_some(StepImage {
                                start: 3,
                                plan: PlanWire {
                                    width: 9,
                                    height: 9,
                                    best_width: 14,
                                    best_height: 14,
                                    n_vit_h: 1,
                                    n_vit_w: 1,
                                    n_llm_h: 1,
                                    n_llm_w: 1,
                                },
                                hash: step,
                                rows: step % 2 == 0,
                                values: 4,
                            })
                            .into_iter()
                            .collect(),
                    }],
                    release: vec![1, 2],
                    batch_tokens: step % 4096,
                    repeat: 1,
                })
            }),
        (any::<u64>(), prop::collection::vec(any::<u64>(), 0..5), ".{0,10}").prop_map(|(step, ids, why)| {
            let outcome = match ids.len() % 3 {
                0 => StepOutcome::Failed(why),
                1 => StepOutcome::NeedsHistory(ids),
                _ => StepOutcome::Done {
                    outputs: ids
                        .iter()
                        .map(|&seq| SeqOutput { seq, token: 5, logprob: -0.5, position: 7, top: top() })
                        .collect(),
                    snapshots: vec![BlockSnapshot { seq: 1, block: 0, lens: vec![1, 2, 3] }],
                    loads: vec![ExpertLoad { layer: 1, expert: 3, rows: 7 }],
                    exports: ids.iter().map(|&seq| StateExport { seq, lens: vec![3, 0, 8] }).collect(),
                    verifications: ids.iter().map(|&seq| Verification { seq, drafts: 3, accepted: 1 }).collect(),
                },
            };
            Message::StepResult(StepResult { step, attempt: 1, device: 0, outcome })
        }),
        (any::<u64>(), any::<bool>(), any::<u64>()).prop_map(|(incarnation, restarted, time_ns)| Message::Heartbeat(
            Heartbeat { incarnation, restarted, time_ns }
        )),
        prop::collection::vec(any::<u32>(), 0..9)
            .prop_map(|experts| Message::Control(Control::LoadExperts { epoch: 2, experts })),
        (any::<u64>(), prop::collection::vec(any::<u32>(), 0..30), prop::collection::vec(any::<u32>(), 0..5)).prop_map(
            |(id, prompt, generated)| {
                let spec = RequestSpec {
                    id,
                    prompt,
                    max_tokens: 9,
                    sampling: sampling(),
                    stop_token_ids: vec![1],
                    stop_sequences: vec![vec![4, 5]],
                    ignore_eos: false,
                    logits: true,
                    constraint: (id % 3 == 0).then(|| format!("{{\"regex\": \"a{{{id}}}\"}}")),
                    retention: (id % 4 == 1).then_some(RetentionWire { ttl_ms: id, persist: id % 8 == 1 }),
                    priority: (id % 7) as i64 - 3,
                    images: (id % 5 == 2)
                        .then(|| ImageWire {
                            start: 1,
                            plan: PlanWire {
                                width: 30,
                                height: 20,
                                best_width: 28,
                                best_height: 28,
                                n_vit_h: 2,
                                n_vit_w: 2,
                                n_llm_h: 1,
                                n_llm_w: 1,
                            },
                            hash: id,
                            content: if id % 2 == 0 {
                                ImageData::Patches(vec![0.5; 12])
                            } else {
                                ImageData::Rows(vec![-1.0; 8])
                            },
                        })
                        .into_iter()
                        .collect(),
                };
                let decode = (id % 2 == 0).then_some(id as u32);
                let encoder = (id % 3 == 1).then_some(id as u32 / 3);
                Message::Submit(Submit { spec, generated, decode, encoder })
            }
        ),
        prop::collection::vec(any::<u64>(), 0..5).prop_map(|ids| Message::Ack { ids }),
        (any::<u64>(), any::<u32>(), prop::collection::vec(any::<u32>(), 0..12)).prop_map(|(id, instance, lens)| {
            Message::Handoff(match id % 3 {
                0 => HandoffMsg::Adopted { id, instance },
                1 => HandoffMsg::Reroute { id, instance },
                _ => {
                    let spec = RequestSpec {
                        id,
                        prompt: lens.clone(),
                        max_tokens: 4,
                        sampling: sampling(),
                        stop_token_ids: Vec::new(),
                        stop_sequences: Vec::new(),
                        ignore_eos: true,
                        logits: false,
                        constraint: None,
                        retention: None,
                        priority: -3,
                        images: Vec::new(),
                    };
                    HandoffMsg::Transfer {
                        spec: Box::new(spec),
                        generated: vec![5],
                        lens,
                        attempt: instance,
                        router: id as u32,
                    }
                }
            })
        }),
        any::<u64>().prop_map(|id| Message::Cancel { id }),
        (any::<u64>(), any::<u32>(), ".{0,10}").prop_map(|(id, attempt, why)| {
            let plan = PlanWire {
                width: 40,
                height: 30,
                best_width: 42,
                best_height: 28,
                n_vit_h: 2,
                n_vit_w: 3,
                n_llm_h: 1,
                n_llm_w: 1,
            };
            Message::Encoder(match id % 3 {
                0 => EncoderMsg::Encode { id, attempt, images: vec![EncodeImage { hash: id, plan, values: 6 }] },
                1 => EncoderMsg::Encoded { id, attempt, hash: id ^ 5, tokens: 4, dim: attempt % 64, cached: true },
                _ => EncoderMsg::Refused { id, attempt, hash: 3, why },
            })
        }),
        (any::<u64>(), any::<u32>(), ".{0,10}").prop_map(|(id, from, why)| {
            let end = match why.len() % 3 {
                0 => None,
                1 => Some(OutputEnd::Refused(why)),
                _ => Some(OutputEnd::Finished(FinishWire {
                    reason: FinishKind::Error(why),
                    prompt_tokens: 3,
                    completion_tokens: from,
                    cached_tokens: 7,
                    cached_host_tokens: 2,
                    cached_disk_tokens: 3,
                    preemptions: 1,
                })),
            };
            let tokens = vec![TokenOut { token: 3, logprob: -1.0, top: top() }];
            Message::Outputs(Outputs { items: vec![OutputItem { id, from, tokens, logits: false, end, cached: from }] })
        }),
        (any::<u64>(), prop::collection::vec(any::<u64>(), 0..4), prop::collection::vec(any::<u32>(), 0..20)).prop_map(
            |(query, hashes, tokens)| {
                Message::Cache(match query % 8 {
                    0 => CacheMsg::Lookup { query, hashes, tokens },
                    4 => CacheMsg::Persist { instance: 1, hashes },
                    5 => CacheMsg::Promote {
                        query,
                        instance: 0,
                        items: vec![PromoteItem { seq: 2, parent: query, hashes, tokens }],
                    },
                    6 => CacheMsg::Promoted {
                        query,
                        items: vec![PromotedItem {
                            seq: 2,
                            blocks: vec![PromotedBlock { lens: tokens, ttl_ms: query, tier: CacheTier::Disk }],
                        }],
                    },
                    7 => CacheMsg::Matched {
                        query,
                        node: 1,
                        matches: vec![InstanceMatch { instance: 0, blocks: 1, host_blocks: 2, disk_blocks: 3 }],
                        disk_chain: hashes.len() as u32,
                    },
                    1 => CacheMsg::Fetch {
                        query,
                        instance: 1,
                        step: 2,
                        items: vec![FetchItem { seq: 3, hashes, tokens }],
                    },
                    2 => CacheMsg::Store {
                        instance: 0,
                        step: query,
                        blocks: vec![StoredBlock { hash: 1, parent: 0, tokens, lens: vec![0, 0], ttl_ms: 9 }],
                    },
                    _ => CacheMsg::Evict { instance: 2, step: 5, hashes },
                })
            }
        ),
    ]
}

fn sampling() -> Sampling {
    Sampling {
        temperature: 0.5,
        top_p: 1.0,
        top_k: 0,
        seed: 1,
        logprobs: 2,
        min_p: 0.05,
        logit_bias: vec![TokenBias { token: 3, bias: -100.0 }, TokenBias { token: 7, bias: 2.5 }],
        frequency_penalty: 0.5,
        presence_penalty: -1.0,
        repetition_penalty: 1.2,
    }
}

fn top() -> Vec<TopLogprob> {
    vec![TopLogprob { token: 4, logprob: -0.25 }]
}

fn envelope() -> impl Strategy<Value = Envelope> {
    (addr(), addr(), message()).prop_map(|(from, to, msg)| Envelope { from, to, msg })
}

/// A valid frame, with a body when its kind takes one.
fn frame() -> impl Strategy<Value = (Envelope, Vec<f32>, Vec<u8>)> {
    (envelope(), prop::collection::vec(any::<f32>(), 0..40)).prop_map(|(env, body)| {
        let body = if env.msg.kind().has_body() { body } else { Vec::new() };
        let bytes = encode(&env, &body).expect("encodes");
        (env, body, bytes)
    })
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn valid_frames_round_trip((env, body, bytes) in frame()) {
        let got = decode(&bytes).unwrap();
        prop_assert_eq!(&got.envelope, &env);
        prop_assert_eq!(bits(&got.body), bits(&body));
        let streamed = read_frame(&mut &bytes[..], MAX_FRAME_BYTES).unwrap();
        prop_assert_eq!(&streamed.envelope, &env);
    }

    #[test]
    fn random_bytes_are_rejected_without_panic(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = decode(&bytes);
        let _ = read_frame(&mut &bytes[..], MAX_FRAME_BYTES);
    }

    /// Random bytes behind a plausible prefix and preamble reach the archive validator.
    #[test]
    fn random_headers_are_rejected_without_panic(
        (_, _, good) in frame(),
        junk in prop::collection::vec(any::<u8>(), 0..400),
    ) {
        let mut bytes = good[..20].to_vec();
        let header_len = junk.len() as u32;
        bytes[12..16].copy_from_slice(&header_len.to_le_bytes());
        bytes[16..20].copy_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&junk);
        let pad = (16 - (16 + junk.len()) % 16) % 16;
        bytes.resize(bytes.len() + pad, 0);
        let len = (bytes.len() - 4) as u32;
        bytes[..4].copy_from_slice(&len.to_le_bytes());
        let _ = decode(&bytes);
        let _ = read_frame(&mut &bytes[..], MAX_FRAME_BYTES);
    }

    #[test]
    fn corrupted_frames_never_panic(
        (_, _, mut bytes) in frame(),
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 1..8),
    ) {
        for (at, x) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= x;
        }
        let a = decode(&bytes);
        let b = read_frame(&mut &bytes[..], MAX_FRAME_BYTES);
        prop_assert_eq!(a.is_ok(), b.is_ok());
    }

    #[test]
    fn truncated_frames_are_errors((_, _, bytes) in frame(), cut in any::<prop::sample::Index>()) {
        let n = cut.index(bytes.len());
        let short = &bytes[..n];
        prop_assert!(decode(short).is_err());
        let streamed = read_frame(&mut &short[..], MAX_FRAME_BYTES);
        prop_assert!(matches!(streamed, Err(WireError::Truncated { .. })), "{:?}", streamed);
    }

    #[test]
    fn trailing_bytes_are_errors((_, _, mut bytes) in frame(), extra in prop::collection::vec(any::<u8>(), 1..16)) {
        bytes.extend_from_slice(&extra);
        let got = decode(&bytes);
        prop_assert!(matches!(got, Err(WireError::Trailing(_))), "{:?}", got);
    }

    /// A declared length over the limit is refused before anything is read or allocated.
    #[test]
    fn oversized_frames_are_refused_up_front((_, _, bytes) in frame(), len in (MAX_FRAME_BYTES + 1)..=u32::MAX) {
        let mut big = bytes.clone();
        big[..4].copy_from_slice(&len.to_le_bytes());
        prop_assert_eq!(decode(&big), Err(WireError::TooLarge { len: len as u64, max: MAX_FRAME_BYTES }));
        prop_assert_eq!(
            read_frame(&mut &big[..], MAX_FRAME_BYTES),
            Err(WireError::TooLarge { len: len as u64, max: MAX_FRAME_BYTES })
        );
        let limit = (bytes.len() - 5) as u32;
        let limited = decode_with_limit(&bytes, limit);
        prop_assert!(matches!(limited, Err(WireError::TooLarge { .. })), "{:?}", limited);
    }
}

#[test]
fn encoding_refuses_frames_over_the_limit() {
    let env = Envelope {
        from: Addr::worker(0),
        to: Addr::shard(1),
        msg: Message::Dispatch(DispatchHeader {
            pass: 0,
            step: 0,
            layer: 0,
            part: 0,
            worker: 0,
            epoch: 0,
            experts: vec![ExpertRows { expert: 0, rows: 1 }],
        }),
    };
    let body = vec![0f32; MAX_FRAME_BYTES as usize / 4];
    assert!(matches!(encode(&env, &body), Err(WireError::TooLarge { .. })));
}

/// Seeds for the `fuzz/` target: `DEEPINFER_FUZZ_SEEDS=DIR cargo test -p
/// deepinfer-actors --test wire_props -- --ignored write_fuzz_seeds` writes
/// 256 valid frames of every kind (deterministic) into DIR.
#[test]
#[ignore]
fn write_fuzz_seeds() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let dir = std::path::PathBuf::from(std::env::var("DEEPINFER_FUZZ_SEEDS").expect("DEEPINFER_FUZZ_SEEDS=DIR"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut runner = TestRunner::deterministic();
    for i in 0..256 {
        let (_, _, bytes) = frame().new_tree(&mut runner).unwrap().current();
        std::fs::write(dir.join(format!("seed-{i:03}")), bytes).unwrap();
    }
}
