//! Images on the serving path: what a [`Request`] carries for each image
//! ([`RequestImage`]), building a prompt with image spans from text and
//! decoded pixels ([`PromptBuilder`], [`expand_placeholders`]), the checks that
//! spans and images agree ([`check_request`]), the prefix-cache key of a block
//! that covers an image ([`block_key`]), and the span's embedding rows the
//! engine feeds in place of the token embeddings ([`span_rows`], [`encode_images`]).
//! See `v41/DESIGN.md` ("Images", serving path).

use std::ops::Range;
use std::sync::Arc;

use crate::model::Model;
use crate::prefix_cache::{block_hash, xxh64};
use crate::request::Request;
use crate::v41::vision::{plan_image, preprocess, ImageError, ImagePlan, PreparedImage, VisionConfig};
use crate::v41::EmbeddedSpan;

/// One image of a request: its span in the prompt and what fills it.
///
/// The prompt holds the span laid out (`START + (IMAGE × n_llm_w + NEWLINE) ×
/// n_llm_h + END`), every position carrying the model's `image_token_id`;
/// build both with [`PromptBuilder`] or [`expand_placeholders`].
#[derive(Clone, Debug, PartialEq)]
pub struct RequestImage {
    /// Prompt position of the span's first token (its START).
    pub start: usize,
    /// The resize plan of the decoded image; the span takes `plan.tokens()` positions.
    pub plan: ImagePlan,
    /// The image's content key: [`image_hash`] of its prepared pixels and plan.
    /// The prefix cache keys every block that covers the span with it, so equal
    /// keys must mean equal pixels.
    pub hash: u64,
    pub content: ImageContent,
}

/// What fills an image's span.
#[derive(Clone, PartialEq)]
pub enum ImageContent {
    /// The resized, normalised patches: the engine runs the tower and the
    /// aligner the first time a step feeds part of the span, and keeps the
    /// rows until the request ends.
    Patches(Arc<PreparedImage>),
    /// The span's embedding rows `[plan.tokens(), dim]` (bf16 values), computed
    /// ahead of the engine ([`encode_images`]), e.g. on a worker thread.
    Rows(Arc<[f32]>),
}

impl std::fmt::Debug for ImageContent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageContent::Patches(p) => write!(f, "Patches({} values)", p.patches.len()),
            ImageContent::Rows(r) => write!(f, "Rows({} values)", r.len()),
        }
    }
}

impl RequestImage {
    /// Plan, resize and patch `rgb` (`width × height`, 3 bytes a pixel, rows top
    /// to bottom) for a span starting at prompt position `start`.
    pub fn prepare(
        cfg: &VisionConfig,
        start: usize,
        rgb: &[u8],
        width: usize,
        height: usize,
    ) -> Result<Self, ImageError> {
        let prepared = preprocess(rgb, width, height, cfg)?;
        Ok(Self {
            start,
            plan: prepared.plan,
            hash: image_hash(&prepared),
            content: ImageContent::Patches(Arc::new(prepared)),
        })
    }

    /// The prompt positions the span takes.
    pub fn span(&self) -> Range<usize> {
        self.start..self.start + self.plan.tokens()
    }
}

/// XXH64 of the plan (its eight sizes as little-endian u64s) and the patches'
/// f32 bits: equal patches and plans, equal keys, whatever the image's encoding.
pub fn image_hash(image: &PreparedImage) -> u64 {
    let p = &image.plan;
    let mut bytes = Vec::with_capacity(64 + 4 * image.patches.len());
    for v in [p.width, p.height, p.best_width, p.best_height, p.n_vit_h, p.n_vit_w, p.n_llm_h, p.n_llm_w] {
        bytes.extend_from_slice(&(v as u64).to_le_bytes());
    }
    for x in &image.patches {
        bytes.extend_from_slice(&x.to_bits().to_le_bytes());
    }
    xxh64(&bytes)
}

/// Builds a prompt of text and images in order: each image's span laid out in
/// the ids, and its [`RequestImage`].
pub struct PromptBuilder<'c> {
    cfg: &'c VisionConfig,
    prompt: Vec<u32>,
    images: Vec<RequestImage>,
}

impl<'c> PromptBuilder<'c> {
    pub fn new(cfg: &'c VisionConfig) -> Self {
        Self { cfg, prompt: Vec::new(), images: Vec::new() }
    }

    /// Append text token ids.
    pub fn text(&mut self, ids: &[u32]) -> &mut Self {
        self.prompt.extend_from_slice(ids);
        self
    }

    /// Append an image (RGB8, `width × height`): its span of `image_token_id`s.
    pub fn image(&mut self, rgb: &[u8], width: usize, height: usize) -> Result<&mut Self, ImageError> {
        let image = RequestImage::prepare(self.cfg, self.prompt.len(), rgb, width, height)?;
        self.prompt.extend(std::iter::repeat_n(self.cfg.image_token_id, image.plan.tokens()));
        self.images.push(image);
        Ok(self)
    }

    /// The prompt ids and the images, in prompt order.
    pub fn finish(self) -> (Vec<u32>, Vec<RequestImage>) {
        (self.prompt, self.images)
    }
}

/// A decoded image: `width × height` pixels of 3 bytes, rows top to bottom.
#[derive(Clone, Copy, Debug)]
pub struct Rgb<'a> {
    pub width: usize,
    pub height: usize,
    pub pixels: &'a [u8],
}

/// A prompt whose images each stand as one `image_token_id` at the given
/// positions (ascending, as a chat template leaves them), with each
/// placeholder replaced by its image's span. A position that does not hold
/// the image token, or positions out of order, are refused.
pub fn expand_placeholders(
    cfg: &VisionConfig,
    prompt: &[u32],
    images: &[(usize, Rgb)],
) -> Result<(Vec<u32>, Vec<RequestImage>), ImageError> {
    let mut b = PromptBuilder::new(cfg);
    let mut at = 0;
    for &(position, image) in images {
        if position < at || prompt.get(position) != Some(&cfg.image_token_id) {
            return Err(ImageError::Mismatch(format!(
                "placeholder position {position} does not hold the image token {} after position {at}",
                cfg.image_token_id
            )));
        }
        b.text(&prompt[at..position]);
        b.image(image.pixels, image.width, image.height)?;
        at = position + 1;
    }
    b.text(&prompt[at..]);
    Ok(b.finish())
}

/// The spans lie inside the prompt, in order, without overlap.
pub fn check_spans(prompt_len: usize, images: &[RequestImage]) -> Result<(), ImageError> {
    let mut end = 0;
    for (i, image) in images.iter().enumerate() {
        let span = image.span();
        if span.start < end {
            return Err(ImageError::Mismatch(format!(
                "image {i}'s span starts at {} inside the previous span (images are in prompt order)",
                span.start
            )));
        }
        if span.end > prompt_len {
            return Err(ImageError::Mismatch(format!(
                "image {i}'s span {span:?} ends past the prompt's {prompt_len} tokens"
            )));
        }
        end = span.end;
    }
    Ok(())
}

/// Whether `model` can serve `request`'s images and they agree with its
/// prompt: a model with a vision tower on the CPU; spans in order inside the
/// prompt, each the plan of its image under the model's `vision_*` keys, every
/// span position and no other carrying `image_token_id`; the content of the
/// plan's size, and patches whose hash is the image's. A text request on a
/// model without images passes untouched.
pub fn check_request(model: &Model, request: &Request) -> Result<(), ImageError> {
    let vision = model.v41.as_ref().and_then(|m| m.config.vision.as_ref());
    if request.images.is_empty() && vision.is_none() {
        return Ok(());
    }
    if !request.images.is_empty() {
        model.image_model()?;
    }
    let cfg = vision.expect("a model that takes images has a vision config");
    check_spans(request.prompt.len(), &request.images)?;
    let mismatch = |i: usize, what: String| Err(ImageError::Mismatch(format!("image {i}: {what}")));
    let mut spans = request.images.iter().map(RequestImage::span).peekable();
    for (t, &token) in request.prompt.iter().enumerate() {
        while spans.peek().is_some_and(|s| s.end <= t) {
            spans.next();
        }
        let inside = spans.peek().is_some_and(|s| s.contains(&t));
        if inside != (token == cfg.image_token_id) {
            return Err(ImageError::Mismatch(if inside {
                format!("position {t} of an image span holds token {token}, not the image token {}", cfg.image_token_id)
            } else {
                format!("position {t} holds the image token {} outside every image span", cfg.image_token_id)
            }));
        }
    }
    let dim = model.v41.as_ref().expect("a V4.1 model").config.dim;
    for (i, image) in request.images.iter().enumerate() {
        let p = image.plan;
        if plan_image(p.width, p.height, cfg)? != p {
            return mismatch(i, format!("its plan is not the model's plan of a {}×{} image", p.width, p.height));
        }
        match &image.content {
            ImageContent::Patches(prepared) => {
                let want = p.n_vit_h * p.n_vit_w * 3 * cfg.patch_size * cfg.patch_size;
                if prepared.plan != p || prepared.patches.len() != want {
                    return mismatch(i, format!("{} patch values for a plan of {want}", prepared.patches.len()));
                }
                if image_hash(prepared.as_ref()) != image.hash {
                    return mismatch(i, "its hash is not the hash of its patches".into());
                }
            }
            ImageContent::Rows(rows) => {
                if rows.len() != p.tokens() * dim {
                    return mismatch(i, format!("{} row values for a span of {} × {dim}", rows.len(), p.tokens()));
                }
            }
        }
    }
    Ok(())
}

/// Key of the token block at positions `at..at + tokens.len()` whose
/// predecessor's key is `parent`: [`block_hash`] for a block that covers no
/// image; else that key chained, per image the block covers, with the image's
/// hash, where its span starts relative to the block, and its length. Every
/// later block's key follows through `parent`.
pub fn block_key(parent: u64, tokens: &[u32], at: usize, images: &[RequestImage]) -> u64 {
    let mut key = block_hash(parent, tokens);
    let block = at..at + tokens.len();
    for image in images {
        let span = image.span();
        if span.start >= block.end || span.end <= block.start {
            continue;
        }
        let mut bytes = Vec::with_capacity(32);
        bytes.extend_from_slice(&key.to_le_bytes());
        bytes.extend_from_slice(&image.hash.to_le_bytes());
        bytes.extend_from_slice(&(span.start as i64 - at as i64).to_le_bytes());
        bytes.extend_from_slice(&(span.len() as u64).to_le_bytes());
        key = xxh64(&bytes);
    }
    key
}

/// The embedding rows `[plan.tokens(), dim]` of an image's span: the given
/// rows, or the tower and aligner run on its patches.
pub fn span_rows(model: &Model, image: &RequestImage) -> Result<Arc<[f32]>, ImageError> {
    match &image.content {
        ImageContent::Rows(rows) => Ok(rows.clone()),
        ImageContent::Patches(prepared) => {
            let m = model.image_model()?;
            let aligned = m.encode_image(prepared)?;
            Ok(m.span_embeddings(&image.plan, &aligned)?.into())
        }
    }
}

/// Run the tower for every image given as patches, leaving its rows instead
/// (the hash stays): for a caller that encodes images off the engine's thread.
pub fn encode_images(model: &Model, images: &mut [RequestImage]) -> Result<(), ImageError> {
    for image in images.iter_mut() {
        if matches!(image.content, ImageContent::Patches(_)) {
            image.content = ImageContent::Rows(span_rows(model, image)?);
        }
    }
    Ok(())
}

/// The parts of image spans (with their rows, `[span.len(), dim]` each) that
/// fall in positions `range`, as embedding overrides of the chunk starting at `range.start`.
pub fn chunk_spans<'r>(
    images: &[RequestImage],
    rows: &'r [Option<Arc<[f32]>>],
    range: Range<usize>,
    dim: usize,
) -> Vec<EmbeddedSpan<'r>> {
    images
        .iter()
        .zip(rows)
        .filter_map(|(image, rows)| {
            let span = image.span();
            let (a, b) = (span.start.max(range.start), span.end.min(range.end));
            if a >= b {
                return None;
            }
            let rows = rows.as_deref().expect("the rows of a span the step feeds");
            Some(EmbeddedSpan { offset: a - range.start, rows: &rows[(a - span.start) * dim..(b - span.start) * dim] })
        })
        .collect()
}
