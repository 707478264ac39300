//! DeepSeek-V4.1's image input against DeepSeek's reference (`inference/vision.py`,
//! `image_processor.py`, `model.py`), on the tiny model `tools/oracle/make_v41_vision.py`
//! writes to `tests/fixtures/oracle/v41/vision-tiny/`: resize plans, Pillow's
//! preprocessing, the tower and the aligner, and a two-image prompt's prefill and
//! greedy decode.
//!
//! Standards: plans and pixels exact; the tower and aligner rows bit-identical
//! (`TOWER_TOLERANCE`: both sides compute the same defined arithmetic, f64 sums
//! rounded once); the logits bit-identical, as in `oracle_v41.rs`.
//!
//! The test fails when a rule is broken (each tried once by changing the code; the
//! prompt is 5 text tokens, image 0's span at 5..15, 2 text tokens, image 1's span at
//! 17..25, 20 text tokens):
//! * the span layout with each row's NEWLINE before its IMAGE slots instead of after
//!   (`vision::span_layout`): `span_layout_matches_token_types` fails (the slots
//!   differ from the fixture's token types) and the prefill logits differ from
//!   position 6 (the first slot after image 0's START) on;
//! * image positions routed with `bias` instead of `bias_vl` (`ffn::route`): the
//!   prefill logits differ from position 5 (image 0's START) on; the reference itself
//!   moves by up to 4.07 (`vision.json`, `rules_switched_off_in_reference`);
//! * the Engram rule off (`forward::engram_entry` giving image positions their token's
//!   compressed id and `apply_engram` leaving their gate on): logits differ from
//!   position 5 on (reference: up to 4.69). With only the look-back change they differ
//!   from position 15, the first text token after image 0 (its n-grams reached into
//!   the span); with only the gate change, from position 5.
//!
//! Pillow-exactness is checked the same way: rounding the pad offset half up instead of
//! half to even moves image 1 by a pixel (9,999 of 11,760 padded bytes differ); a filter
//! support not widened by the downscale factor (no antialiasing) fails
//! `pixels_match_reference` on image 0 and the prefill from position 6.

use deepinfer_engine::presets_v41::synthetic_image;
use std::path::PathBuf;

use deepinfer_engine::checkpoint::Checkpoint;
use deepinfer_engine::v41::vision::{self, pad, plan_image, preprocess, ImageError, SpanSlot, VisionConfig};
use deepinfer_engine::v41::{EmbeddedSpan, ModelV41, Rows};
use serde_json::Value;

/// Max |Δ| allowed between deepinfer's and the reference's tower and aligner rows.
const TOWER_TOLERANCE: f32 = 0.0;
/// Logits must be bit-identical (see `oracle_v41.rs`).
const LOGIT_TOLERANCE: f32 = 0.0;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle/v41/vision-tiny")
}

struct Fixture {
    tensors: Checkpoint,
    meta: Value,
}

impl Fixture {
    fn load() -> Self {
        let d = dir();
        let path = d.join("vision.safetensors");
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let meta = std::fs::read_to_string(d.join("vision.json")).unwrap();
        Self {
            tensors: Checkpoint::from_bytes(&path.display().to_string(), bytes.into()).unwrap(),
            meta: serde_json::from_str(&meta).unwrap(),
        }
    }
    fn floats(&self, name: &str) -> Vec<f32> {
        let shape = self.tensors.get(name).unwrap().shape.to_vec();
        self.tensors.f32_tensor(name, &shape).unwrap()
    }
    fn ints(&self, name: &str) -> Vec<i64> {
        let shape = self.tensors.get(name).unwrap().shape.to_vec();
        self.tensors.int_tensor(name, &shape).unwrap()
    }
    fn images(&self) -> &[Value] {
        self.meta["images"].as_array().unwrap()
    }
}

fn usize_of(v: &Value, key: &str) -> usize {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}")) as usize
}

fn load_model() -> ModelV41 {
    ModelV41::load(&dir()).unwrap_or_else(|e| panic!("vision-tiny: {e}"))
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).fold(0.0f32, |m, (g, w)| m.max((g - w).abs()))
}

/// The published `vision_*` arguments as the fixture records them.
fn published(meta: &Value, image_token_id: u32) -> VisionConfig {
    let a = &meta["published_vision_args"];
    VisionConfig {
        n_layers: usize_of(a, "vision_n_layers").max(1),
        dim: usize_of(a, "vision_dim"),
        n_heads: usize_of(a, "vision_n_heads"),
        inter_dim: usize_of(a, "vision_inter_dim"),
        patch_size: usize_of(a, "vision_patch_size"),
        rope_theta: a["vision_rope_theta"].as_f64().unwrap(),
        downsample_ratio: usize_of(a, "vision_downsample_ratio"),
        max_n_token: usize_of(a, "vision_max_n_token"),
        min_pixels: usize_of(a, "vision_min_pixels"),
        max_wh_ratio: a["vision_max_wh_ratio"].as_u64().map(|v| v as usize),
        image_token_id,
    }
}

#[test]
fn plans_match_reference() {
    let f = Fixture::load();
    let model = load_model();
    let tiny = model.config.vision.clone().expect("the fixture has a vision tower");
    let full = published(&f.meta, tiny.image_token_id);
    let mut checked = 0;
    for (which, cfg) in [("published", &full), ("tiny", &tiny)] {
        for want in f.meta["plans"][which].as_array().unwrap() {
            let (w, h) = (usize_of(want, "width"), usize_of(want, "height"));
            let p = plan_image(w, h, cfg).unwrap();
            let got = (p.n_llm_h, p.n_llm_w, p.best_height, p.best_width, p.tokens());
            let expect = (
                usize_of(want, "n_llm_h"),
                usize_of(want, "n_llm_w"),
                usize_of(want, "best_height"),
                usize_of(want, "best_width"),
                usize_of(want, "tokens"),
            );
            assert_eq!(got, expect, "{which} plan of {w}×{h}");
            assert!(p.tokens() <= cfg.max_n_token);
            checked += 1;
        }
    }
    assert!(checked >= 12, "{checked} plans");
    assert_eq!(plan_image(0, 5, &full), Err(ImageError::Empty { width: 0, height: 5 }));
}

#[test]
fn pixels_match_reference() {
    let f = Fixture::load();
    let cfg = load_model().config.vision.clone().unwrap();
    for (i, g) in f.images().iter().enumerate() {
        let (w, h) = (usize_of(g, "width"), usize_of(g, "height"));
        let rgb = synthetic_image(w, h, usize_of(g, "salt"));
        let image = preprocess(&rgb, w, h, &cfg).unwrap();
        let p = image.plan;
        assert_eq!(
            (p.n_vit_h, p.n_vit_w, p.n_llm_h, p.n_llm_w),
            (usize_of(g, "n_vit_h"), usize_of(g, "n_vit_w"), usize_of(g, "n_llm_h"), usize_of(g, "n_llm_w"))
        );
        let padded = pad(&rgb, w, h, p.best_width, p.best_height, 127);
        let want: Vec<u8> = f.ints(&format!("image{i}_padded")).into_iter().map(|v| v as u8).collect();
        let wrong = padded.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(padded.len(), want.len(), "image {i}: padded size");
        assert_eq!(wrong, 0, "image {i}: {wrong} of {} padded bytes differ from Pillow's", want.len());
        let patches = f.floats(&format!("image{i}_patches"));
        assert!(image.patches.iter().zip(&patches).all(|(a, b)| a.to_bits() == b.to_bits()), "image {i}: patches");
        assert_eq!(image.patches.len(), patches.len());
    }
    let err = preprocess(&[0; 5], 2, 1, &cfg).unwrap_err();
    assert!(matches!(err, ImageError::PixelCount { expected: 6, .. }), "{err}");
}

#[test]
fn tower_and_aligner_match_reference() {
    let f = Fixture::load();
    let model = load_model();
    let (cfg, w) = model.vision().unwrap();
    for (i, g) in f.images().iter().enumerate() {
        let (n_h, n_w) = (usize_of(g, "n_vit_h"), usize_of(g, "n_vit_w"));
        let tower = w.tower(cfg, &f.floats(&format!("image{i}_patches")), n_h, n_w);
        let want = f.floats(&format!("image{i}_tower"));
        let d = max_diff(&tower, &want);
        assert!(d <= TOWER_TOLERANCE, "image {i}: tower differs by {d}");
        let rows = w.align(cfg, &want, n_h, n_w);
        let want = f.floats(&format!("image{i}_aligner"));
        let d = max_diff(&rows, &want);
        assert!(d <= TOWER_TOLERANCE, "image {i}: aligner differs by {d}");
        assert!(want.iter().any(|&v| v != 0.0));
    }
}

/// The prompt's image spans: (start, slots) from the fixture's token types.
fn spans_of(types: &[i64]) -> Vec<(usize, Vec<i64>)> {
    let mut spans = Vec::new();
    let mut t = 0;
    while t < types.len() {
        if types[t] == 0 {
            let end = t + types[t..].iter().position(|&x| x == 3).expect("an end") + 1;
            spans.push((t, types[t..end].to_vec()));
            t = end;
        } else {
            assert_eq!(types[t], -1, "position {t} is text or a span's start");
            t += 1;
        }
    }
    spans
}

#[test]
fn span_layout_matches_token_types() {
    let f = Fixture::load();
    let spans = spans_of(&f.ints("token_types"));
    assert_eq!(spans.len(), f.images().len());
    for ((_, types), g) in spans.iter().zip(f.images()) {
        let slots = vision::span_layout(usize_of(g, "n_llm_h"), usize_of(g, "n_llm_w"));
        let ours: Vec<i64> = slots
            .iter()
            .map(|s| match s {
                SpanSlot::Start => 0,
                SpanSlot::Image => 1,
                SpanSlot::NewLine => 2,
                SpanSlot::End => 3,
            })
            .collect();
        assert_eq!(&ours, types);
    }
}

#[test]
fn two_images_prefill_and_decode_match_reference() {
    let f = Fixture::load();
    let model = load_model();
    let cfg = model.config.vision.clone().unwrap();
    let vocab = model.config.vocab_size;
    let prompt: Vec<u32> = f.ints("prompt").into_iter().map(|v| v as u32).collect();
    let types = f.ints("token_types");
    // the whole chain from pixels: preprocessing, tower, aligner, span layout
    let mut rows = Vec::new();
    for ((start, _), g) in spans_of(&types).iter().zip(f.images()) {
        let (w, h) = (usize_of(g, "width"), usize_of(g, "height"));
        let image = preprocess(&synthetic_image(w, h, usize_of(g, "salt")), w, h, &cfg).unwrap();
        let aligned = model.encode_image(&image).unwrap();
        let embeds = model.span_embeddings(&image.plan, &aligned).unwrap();
        assert_eq!(embeds.len(), image.plan.tokens() * model.config.dim);
        assert!(prompt[*start..*start + image.plan.tokens()].iter().all(|&t| t == cfg.image_token_id));
        rows.push((*start, embeds));
    }
    let spans: Vec<EmbeddedSpan> = rows.iter().map(|(offset, r)| EmbeddedSpan { offset: *offset, rows: r }).collect();
    let mut state = model.new_state();
    let out = model.forward_with(&prompt, &spans, &mut state, Rows::All);
    let want = f.floats("prefill_logits");
    assert_eq!(out.logits.len(), want.len());
    let first_bad = (0..prompt.len()).find(|&t| {
        max_diff(&out.logits[t * vocab..(t + 1) * vocab], &want[t * vocab..(t + 1) * vocab]) > LOGIT_TOLERANCE
    });
    assert_eq!(
        first_bad,
        None,
        "prefill logits differ from position {first_bad:?} on (spans at {:?})",
        spans_of(&types).iter().map(|s| s.0).collect::<Vec<_>>()
    );
    let tokens: Vec<u32> = f.ints("decode_tokens").into_iter().map(|v| v as u32).collect();
    let want = f.floats("decode_logits");
    for (i, &tok) in tokens.iter().enumerate() {
        let expected_tok =
            argmax(if i == 0 { &out.logits[(prompt.len() - 1) * vocab..] } else { &want[(i - 1) * vocab..i * vocab] });
        assert_eq!(tok, expected_tok, "greedy token {i}");
        let got = model.forward(&[tok], &mut state, Rows::Last);
        let d = max_diff(&got.logits, &want[i * vocab..(i + 1) * vocab]);
        assert!(d <= LOGIT_TOLERANCE, "decode step {i}: logits differ by {d}");
    }
    assert!(tokens.len() >= 16);
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0 as u32
}

#[test]
fn models_without_a_tower_refuse_images() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle");
    for name in ["tiny-v4", "v41/r2-across-swa"] {
        let model = deepinfer_engine::model::Model::load(&root.join(name)).unwrap();
        let err = model.image_model().err().unwrap_or_else(|| panic!("{name} took images"));
        assert!(matches!(err, ImageError::NoVisionTower(_)), "{name}: {err}");
    }
    let model = deepinfer_engine::model::Model::load(&dir()).unwrap();
    assert!(model.image_model().unwrap().vision().is_ok());
}

#[test]
fn a_model_without_vision_refuses_images() {
    let text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/oracle/v41/r2-across-swa");
    let model = ModelV41::load(&text).unwrap();
    let err = model.vision().err().expect("no vision tower");
    assert!(matches!(err, ImageError::NoVisionTower(_)), "{err}");
    let image = vision::PreparedImage {
        plan: plan_image(20, 20, &load_model().config.vision.unwrap()).unwrap(),
        patches: Vec::new(),
    };
    assert!(matches!(model.encode_image(&image), Err(ImageError::NoVisionTower(_))));
}
