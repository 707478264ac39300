//! Images between the wire and the engine: a request's images to and from
//! their wire form, the block keys the router and the schedulers chain them
//! into (the engine's own `images::block_key`, so that two images never
//! share cached KV), the images a step item carries, and every check a
//! receiver makes before the engine sees them (sizes against the plan, the
//! plan against the model's, spans inside the prompt, the hash of patches).

use std::ops::Range;
use std::sync::Arc;

use deepinfer_engine::images::{block_key, image_hash, ImageContent, RequestImage};
use deepinfer_engine::model::Model;
use deepinfer_engine::v41::vision::{plan_image, ImagePlan, PreparedImage, VisionConfig};

use crate::wire::{ImageData, ImageWire, PlanWire, StepImage};

/// Largest side a plan on the wire may name: past DeepSeek's 8,192-pixel
/// limit, and small enough that planning it costs nothing.
const MAX_SIDE: u32 = 1 << 16;

pub(crate) fn plan_wire(p: &ImagePlan) -> PlanWire {
    let c = |v: usize| v.min(u32::MAX as usize) as u32;
    PlanWire {
        width: c(p.width),
        height: c(p.height),
        best_width: c(p.best_width),
        best_height: c(p.best_height),
        n_vit_h: c(p.n_vit_h),
        n_vit_w: c(p.n_vit_w),
        n_llm_h: c(p.n_llm_h),
        n_llm_w: c(p.n_llm_w),
    }
}

pub(crate) fn plan_of(p: &PlanWire) -> ImagePlan {
    ImagePlan {
        width: p.width as usize,
        height: p.height as usize,
        best_width: p.best_width as usize,
        best_height: p.best_height as usize,
        n_vit_h: p.n_vit_h as usize,
        n_vit_w: p.n_vit_w as usize,
        n_llm_h: p.n_llm_h as usize,
        n_llm_w: p.n_llm_w as usize,
    }
}

/// The wire form of a request's images (patches or rows copied).
pub(crate) fn images_wire(images: &[RequestImage]) -> Vec<ImageWire> {
    images
        .iter()
        .map(|i| ImageWire {
            start: i.start.min(u32::MAX as usize) as u32,
            plan: plan_wire(&i.plan),
            hash: i.hash,
            content: match &i.content {
                ImageContent::Patches(p) => ImageData::Patches(p.patches.clone()),
                ImageContent::Rows(r) => ImageData::Rows(r.to_vec()),
            },
        })
        .collect()
}

/// The engine's images of a request's wire images (checked by
/// [`check_images`] before the engine is handed them).
pub(crate) fn request_images(images: &[ImageWire]) -> Vec<RequestImage> {
    images
        .iter()
        .map(|i| {
            let plan = plan_of(&i.plan);
            let content = match &i.content {
                ImageData::Patches(p) => ImageContent::Patches(Arc::new(PreparedImage { plan, patches: p.clone() })),
                ImageData::Rows(r) => ImageContent::Rows(r.as_slice().into()),
            };
            RequestImage { start: i.start as usize, plan, hash: i.hash, content }
        })
        .collect()
}

/// The images as far as block keys go (span and hash, no content): what
/// the router needs to ask the caches about a prompt. Plans that are not
/// `model`'s give no keys at all (spans computed from them could be any
/// size); the scheduler refuses such a request.
pub(crate) fn key_images(model: &Model, images: &[ImageWire]) -> Vec<RequestImage> {
    let Ok(cfg) = vision(model) else { return Vec::new() };
    if images.iter().any(|i| check_plan(cfg, &i.plan).is_err()) {
        return Vec::new();
    }
    images
        .iter()
        .map(|i| RequestImage {
            start: i.start as usize,
            plan: plan_of(&i.plan),
            hash: i.hash,
            // `block_key` reads the span and the hash only.
            content: ImageContent::Rows(Arc::from(Vec::new())),
        })
        .collect()
}

/// Key chain of the full blocks of `prompt` that a prefix hit could use
/// (the last token is always computed, as in the engine's admission), each
/// key chained with the images its block covers.
pub(crate) fn prompt_chain(prompt: &[u32], bt: usize, images: &[RequestImage]) -> Vec<u64> {
    let blocks = prompt.len().saturating_sub(1) / bt;
    let mut parent = 0;
    (0..blocks)
        .map(|k| {
            parent = block_key(parent, &prompt[k * bt..(k + 1) * bt], k * bt, images);
            parent
        })
        .collect()
}

/// The vision settings of a model that reads images, or why it does not.
pub(crate) fn vision(model: &Model) -> Result<&VisionConfig, String> {
    let m = model.image_model().map_err(|e| e.to_string())?;
    m.config.vision.as_ref().ok_or_else(|| "the model has no vision settings".to_string())
}

/// The model's text width (the rows of a span are this wide).
pub(crate) fn dim(model: &Model) -> usize {
    model.v41.as_ref().map_or(model.config.hidden_size, |m| m.config.dim)
}

/// Values an image's patches take under `plan`.
pub(crate) fn patch_values(cfg: &VisionConfig, plan: &ImagePlan) -> usize {
    plan.n_vit_h.saturating_mul(plan.n_vit_w).saturating_mul(3 * cfg.patch_size * cfg.patch_size)
}

/// Whether `plan` is the model's own plan of an image of its size: a plan
/// from the network is believed only after this (its sizes bound everything else).
pub(crate) fn check_plan(cfg: &VisionConfig, plan: &PlanWire) -> Result<ImagePlan, String> {
    if plan.width == 0 || plan.height == 0 || plan.width > MAX_SIDE || plan.height > MAX_SIDE {
        return Err(format!("an image of {}×{} pixels", plan.width, plan.height));
    }
    let want = plan_image(plan.width as usize, plan.height as usize, cfg).map_err(|e| e.to_string())?;
    if want != plan_of(plan) {
        return Err(format!("its plan is not the model's plan of a {}×{} image", plan.width, plan.height));
    }
    Ok(want)
}

/// Check a request's images against `model` and the prompt: the engine's
/// own `check_request` does the spans, tokens and sizes once the plans are
/// known to be the model's (which bounds every size it computes).
pub(crate) fn check_images(model: &Model, prompt_len: usize, images: &[ImageWire]) -> Result<(), String> {
    if images.is_empty() {
        return Ok(());
    }
    let cfg = vision(model)?;
    for (i, image) in images.iter().enumerate() {
        check_plan(cfg, &image.plan).map_err(|why| format!("image {i}: {why}"))?;
        let end = (image.start as usize).saturating_add(plan_of(&image.plan).tokens());
        if end > prompt_len {
            return Err(format!("image {i}'s span ends at {end}, past the prompt's {prompt_len} tokens"));
        }
    }
    Ok(())
}

/// The images of `images` whose spans meet positions `range`, with their
/// values appended to `body` (patches, or rows once encoded).
pub(crate) fn step_images(images: &[RequestImage], range: Range<usize>, body: &mut Vec<f32>) -> Vec<StepImage> {
    images
        .iter()
        .filter(|i| i.span().start < range.end && i.span().end > range.start)
        .map(|i| {
            let (rows, values): (bool, &[f32]) = match &i.content {
                ImageContent::Patches(p) => (false, &p.patches),
                ImageContent::Rows(r) => (true, r),
            };
            body.extend_from_slice(values);
            StepImage {
                start: i.start.min(u32::MAX as usize) as u32,
                plan: plan_wire(&i.plan),
                hash: i.hash,
                rows,
                values: values.len().min(u32::MAX as usize) as u32,
            }
        })
        .collect()
}

/// Values a step item's images take in its body, once each image's plan
/// is known to be the model's: `None` (with why) otherwise.
pub(crate) fn step_image_values(model: &Model, images: &[StepImage]) -> Result<usize, String> {
    if images.is_empty() {
        return Ok(0);
    }
    let cfg = vision(model)?;
    let dim = dim(model);
    let mut total = 0usize;
    for (i, image) in images.iter().enumerate() {
        let plan = check_plan(cfg, &image.plan).map_err(|why| format!("image {i}: {why}"))?;
        let want = if image.rows { plan.tokens().saturating_mul(dim) } else { patch_values(cfg, &plan) };
        if image.values as usize != want {
            return Err(format!("image {i}: {} values for a plan of {want}", image.values));
        }
        total = total.saturating_add(want);
    }
    Ok(total)
}

/// The engine's images of a step item, from its checked wire images and
/// their values: spans in order, each meeting positions `range`, inside
/// `context`, patches whose hash is the image's.
pub(crate) fn step_request_images(
    images: &[StepImage],
    values: &[f32],
    range: Range<usize>,
    context: usize,
) -> Result<Vec<RequestImage>, String> {
    let mut at = 0usize;
    let mut end = 0usize;
    let mut out = Vec::with_capacity(images.len());
    for (i, image) in images.iter().enumerate() {
        let plan = plan_of(&image.plan);
        let span = image.start as usize..(image.start as usize).saturating_add(plan.tokens());
        if span.start < end || span.end > context || span.start >= range.end || span.end <= range.start {
            return Err(format!("image {i}'s span {span:?} is out of order or misses positions {range:?}"));
        }
        end = span.end;
        let data = values.get(at..at + image.values as usize).ok_or("image values past the body")?;
        at += image.values as usize;
        let content = if image.rows {
            ImageContent::Rows(data.into())
        } else {
            let prepared = PreparedImage { plan, patches: data.to_vec() };
            if image_hash(&prepared) != image.hash {
                return Err(format!("image {i}: its hash is not the hash of its patches"));
            }
            ImageContent::Patches(Arc::new(prepared))
        };
        out.push(RequestImage { start: span.start, plan, hash: image.hash, content });
    }
    Ok(out)
}
