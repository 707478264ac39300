//! Images through the serving engine (`deepinfer_engine::images`): a two-image
//! prompt gives the reference's greedy tokens (the oracle fixture
//! `tests/fixtures/oracle/v41/vision-tiny`, whose prefill `oracle_v41_vision.rs`
//! checks bit for bit); chunk boundaries inside a span, precomputed rows and a
//! batch beside a text request change no bit; prefix-cache keys carry the
//! image; requests whose images and spans disagree, and images sent to a model
//! without a tower, are refused with typed errors.

mod support;

use deepinfer_engine::presets_v41::synthetic_image;
use std::path::PathBuf;
use std::sync::Arc;

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::engine::{Completion, Engine, EngineConfig};
use deepinfer_engine::images::{
    block_key, encode_images, expand_placeholders, ImageContent, PromptBuilder, RequestImage, Rgb,
};
use deepinfer_engine::model::Model;
use deepinfer_engine::prefix_cache::{block_hash, PrefixMode};
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::{Request, RequestError};
use deepinfer_engine::v41::vision::{ImageError, VisionConfig};
use support::*;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle/v41/vision-tiny")
}

fn vision(model: &Model) -> VisionConfig {
    model.image_model().expect("a model with a vision tower").config.vision.clone().unwrap()
}

/// The fixture's model, its two-image prompt built from text and pixels, and the reference's greedy tokens.
struct Oracle {
    model: Model,
    prompt: Vec<u32>,
    images: Vec<RequestImage>,
    greedy: Vec<u32>,
}

fn oracle() -> Oracle {
    let dir = fixture_dir();
    let model = Model::load(&dir).unwrap();
    let cfg = vision(&model);
    let bytes = std::fs::read(dir.join("vision.safetensors")).unwrap();
    let tensors = Checkpoint::from_bytes("vision.safetensors", bytes.into()).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        let shape = tensors.get(name).unwrap().shape.to_vec();
        tensors.int_tensor(name, &shape).unwrap().into_iter().map(|v| v as u32).collect()
    };
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("vision.json")).unwrap()).unwrap();
    let want = ints("prompt");
    // Text between the runs of image tokens, one run per image.
    let mut b = PromptBuilder::new(&cfg);
    let mut t = 0;
    for g in meta["images"].as_array().unwrap() {
        let start = t + want[t..].iter().position(|&x| x == cfg.image_token_id).expect("a span per image");
        b.text(&want[t..start]);
        let size = |k: &str| g[k].as_u64().unwrap() as usize;
        let (w, h) = (size("width"), size("height"));
        b.image(&synthetic_image(w, h, size("salt")), w, h).unwrap();
        t = start + want[start..].iter().take_while(|&&x| x == cfg.image_token_id).count();
    }
    b.text(&want[t..]);
    let (prompt, images) = b.finish();
    assert_eq!(prompt, want, "the built prompt is the reference's");
    assert_eq!(images.len(), 2);
    Oracle { model, prompt, images, greedy: ints("decode_tokens") }
}

fn greedy_request(prompt: &[u32], images: &[RequestImage], max_tokens: usize) -> Request {
    let mut r = Request::with_images(prompt.to_vec(), images.to_vec(), max_tokens);
    r.params = greedy();
    r.return_logits = true;
    r.ignore_eos = true;
    r
}

fn run(model: &Model, config: EngineConfig, requests: &[Request]) -> Vec<Completion> {
    run_together(model, config, requests).0
}

fn chunked(max_chunk_tokens: usize) -> EngineConfig {
    EngineConfig { max_chunk_tokens: Some(max_chunk_tokens), ..config(PrefixMode::Off) }
}

#[test]
fn two_images_through_the_engine_give_the_reference_greedy_tokens() {
    let o = oracle();
    let r = greedy_request(&o.prompt, &o.images, o.greedy.len());
    let out = run(&o.model, config(PrefixMode::Exact), &[r]).remove(0);
    assert_eq!(out.token_ids(), o.greedy);
    assert_eq!(out.finished.prompt_tokens, o.prompt.len());
}

/// The reference prefills a span in one chunk; a chunk boundary inside a span
/// (down to one token a step), rows computed ahead, and a text request in the
/// same batch give the same bits.
#[test]
fn chunk_boundaries_inside_spans_change_no_bit() {
    let o = oracle();
    let r = greedy_request(&o.prompt, &o.images, 6);
    let whole = run(&o.model, config(PrefixMode::Off), std::slice::from_ref(&r)).remove(0);
    assert_eq!(whole.token_ids(), o.greedy[..6]);
    let spans: Vec<_> = o.images.iter().map(RequestImage::span).collect();
    for chunk in [1, 3, 7] {
        // some boundary falls strictly inside a span
        assert!(spans.iter().any(|s| (s.start + 1..s.end).any(|t| t % chunk == 0)));
        let out = run(&o.model, chunked(chunk), std::slice::from_ref(&r)).remove(0);
        assert_same(&whole, &out, &format!("chunks of {chunk}"));
    }
    let mut ahead = r.clone();
    encode_images(&o.model, &mut ahead.images).unwrap();
    assert!(ahead.images.iter().all(|i| matches!(i.content, ImageContent::Rows(_))));
    let text = greedy_request(&o.prompt[..5], &[], 4);
    let out = run(&o.model, chunked(4), &[text, ahead]);
    assert_same(&whole, &out[1], "rows computed ahead, beside a text request");
}

/// Two same-sized images in the same text (same token ids) and a 10-token
/// text head on the tiny vision preset with 8-token blocks.
fn preset_prompt(model: &Model, salt: usize) -> (Vec<u32>, Vec<RequestImage>) {
    let cfg = vision(model);
    let mut b = PromptBuilder::new(&cfg);
    b.text(&tokens(10, 5)).image(&synthetic_image(200, 120, salt), 200, 120).unwrap().text(&tokens(20, 6));
    b.finish()
}

#[test]
fn prefix_cache_keys_carry_the_image() {
    let model = build(Preset::TinyV41Vision, 3).unwrap();
    let bt = 8;
    let cfg = EngineConfig { block_tokens: Some(bt), ..config(PrefixMode::Exact) };
    let (prompt, x) = preset_prompt(&model, 0);
    let (prompt_y, y) = preset_prompt(&model, 9);
    assert_eq!(prompt, prompt_y, "the same token ids");
    assert_ne!(x[0].hash, y[0].hash);
    let span = x[0].span();
    assert!(span.start % bt != 0 && span.end / bt > span.start / bt + 1, "the span crosses blocks");
    let (a, b, c) = (greedy_request(&prompt, &x, 5), greedy_request(&prompt, &y, 5), greedy_request(&prompt, &x, 5));
    let mut engine = Engine::new(&model, cfg).unwrap();
    let mut outs = Vec::new();
    for r in [&a, &b, &c] {
        let id = engine.add_request(r.clone()).unwrap();
        outs.push(engine.run_to_completion().remove(&id).unwrap());
    }
    let full = (prompt.len() - 1) / bt * bt;
    assert_eq!(outs[0].finished.cached_tokens, 0);
    assert_eq!(outs[1].finished.cached_tokens, span.start / bt * bt, "another image hits only the text before it");
    assert_eq!(outs[2].finished.cached_tokens, full, "the same image hits through and after its span");
    assert_same(&outs[1], &run_alone(&model, &b), "image y after image x's blocks");
    assert_same(&outs[2], &outs[0], "image x from the cache");
    assert_ne!(outs[0].token_ids(), outs[1].token_ids(), "the images matter");
}

#[test]
fn text_blocks_keep_their_keys_and_image_blocks_chain() {
    let model = build(Preset::TinyV41Vision, 3).unwrap();
    let (prompt, x) = preset_prompt(&model, 0);
    let (_, y) = preset_prompt(&model, 9);
    let bt = 8;
    let chain = |images: &[RequestImage]| -> Vec<u64> {
        let mut keys: Vec<u64> = Vec::new();
        for (k, block) in prompt.chunks_exact(bt).enumerate() {
            keys.push(block_key(keys.last().copied().unwrap_or(0), block, k * bt, images));
        }
        keys
    };
    let (text, kx, ky) = (chain(&[]), chain(&x), chain(&y));
    let mut parent = 0;
    for (k, block) in prompt.chunks_exact(bt).enumerate() {
        parent = block_hash(parent, block);
        assert_eq!(text[k], parent, "block {k}: a text key is the token hash");
    }
    let first = x[0].span().start / bt;
    assert_eq!(kx[..first], text[..first], "blocks before the span");
    for k in first..kx.len() {
        assert!(kx[k] != text[k] && kx[k] != ky[k], "block {k} covers or follows the image");
    }
}

fn refused(engine: &mut Engine<&Model>, r: Request) -> ImageError {
    match engine.add_request(r) {
        Err(RequestError::Image(e)) => e,
        other => panic!("not refused for its images: {other:?}"),
    }
}

#[test]
fn images_that_disagree_with_their_spans_are_refused() {
    let model = build(Preset::TinyV41Vision, 3).unwrap();
    let cfg = vision(&model);
    let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
    let (prompt, images) = preset_prompt(&model, 0);
    let two = {
        let mut b = PromptBuilder::new(&cfg);
        b.image(&synthetic_image(30, 45, 1), 30, 45)
            .unwrap()
            .text(&[7])
            .image(&synthetic_image(60, 40, 0), 60, 40)
            .unwrap();
        b.finish()
    };
    let with = |f: &dyn Fn(&mut Vec<u32>, &mut Vec<RequestImage>)| {
        let (mut p, mut i) = (prompt.clone(), images.clone());
        f(&mut p, &mut i);
        Request::with_images(p, i, 2)
    };
    let cases: Vec<(&str, Request)> = vec![
        ("span shifted", with(&|_, i| i[0].start += 1)),
        ("span past the end", with(&|p, i| i[0].start = p.len() - 2)),
        ("a text token inside the span", with(&|p, i| p[i[0].start + 1] = 7)),
        ("an image token outside the span", with(&|p, _| p[0] = cfg.image_token_id)),
        ("a plan not the model's", with(&|_, i| i[0].plan.width += 40)),
        ("a hash not the patches'", with(&|_, i| i[0].hash ^= 1)),
        ("rows of the wrong size", with(&|_, i| i[0].content = ImageContent::Rows(Arc::from(vec![0.0; 3])))),
        ("a stray image token in text", Request::new(vec![5, cfg.image_token_id, 6], 2)),
        ("images out of order", {
            let (p, mut i) = two.clone();
            i.swap(0, 1);
            Request::with_images(p, i, 2)
        }),
    ];
    for (what, r) in cases {
        let e = refused(&mut engine, r);
        assert!(matches!(e, ImageError::Mismatch(_)), "{what}: {e}");
    }
    assert!(!engine.has_work(), "nothing refused was queued");
    let (p, i) = two;
    engine.add_request(Request::with_images(p, i, 2)).expect("the same images in order are taken");
}

#[test]
fn models_without_a_tower_refuse_images() {
    let vision_model = build(Preset::TinyV41Vision, 3).unwrap();
    let (prompt, images) = preset_prompt(&vision_model, 0);
    for preset in [Preset::TinyV41, Preset::TinyV4] {
        let model = build(preset, 3).unwrap();
        let mut engine = Engine::new(&model, config(PrefixMode::Exact)).unwrap();
        let e = refused(&mut engine, Request::with_images(prompt.clone(), images.clone(), 2));
        assert!(matches!(e, ImageError::NoVisionTower(_)), "{}: {e}", preset.name());
        engine.add_request(Request::new(prompt.clone(), 2)).expect("the same ids as text are taken");
    }
}

#[test]
fn placeholders_expand_to_the_builders_prompt() {
    let model = build(Preset::TinyV41Vision, 3).unwrap();
    let cfg = vision(&model);
    let (a, b) = (synthetic_image(60, 40, 0), synthetic_image(30, 45, 1));
    let mut builder = PromptBuilder::new(&cfg);
    builder.text(&[5, 6]).image(&a, 60, 40).unwrap().text(&[7]).image(&b, 30, 45).unwrap().text(&[8]);
    let want = builder.finish();
    let id = cfg.image_token_id;
    let placed = [(2, Rgb { width: 60, height: 40, pixels: &a }), (4, Rgb { width: 30, height: 45, pixels: &b })];
    let got = expand_placeholders(&cfg, &[5, 6, id, 7, id, 8], &placed).unwrap();
    assert_eq!(got, want);
    let err = expand_placeholders(&cfg, &[5, 6, 9, 7, id, 8], &placed).unwrap_err();
    assert!(matches!(err, ImageError::Mismatch(_)), "{err}");
}

/// `model init --preset tiny-v41-vision` writes these files; loaded back, the
/// model takes images and serves the same tokens as the built-in one.
#[test]
fn the_vision_preset_loads_from_its_files() {
    let preset = Preset::TinyV41Vision;
    let dir = std::env::temp_dir().join(format!("deepinfer-v41-vision-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = preset.config_json();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tensors = deepinfer_engine::presets_v41::random_checkpoint(&preset.v41_config(), 3);
    std::fs::write(dir.join("model.safetensors"), deepinfer_engine::presets::serialize(&tensors)).unwrap();
    let map = deepinfer_engine::presets_v41::token_map_json(config["vocab_size"].as_u64().unwrap() as usize);
    std::fs::write(dir.join(deepinfer_engine::v41::ENGRAM_TOKEN_MAP), map.to_string()).unwrap();
    let loaded = Model::load(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    let loaded = loaded.unwrap();
    let built = build(preset, 3).unwrap();
    assert_eq!(vision(&loaded), vision(&built));
    let (prompt, images) = preset_prompt(&built, 0);
    let r = greedy_request(&prompt, &images, 3);
    assert_same(&run_alone(&loaded, &r), &run_alone(&built, &r), "loaded and built");
}
