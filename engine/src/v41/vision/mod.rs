//! DeepSeek-V4.1's image input (`inference/vision.py`, `image_processor.py`):
//! the resize plan and Pillow-exact preprocessing (`preprocess`), the ViT and
//! the 3×3 aligner (`tower`), and the layout of an image's token span. The text
//! model takes the span as embedding rows that replace the token embeddings
//! ([`super::EmbeddedSpan`]); see DESIGN.md ("Images").

pub mod erf;
pub mod preprocess;
pub mod tower;

use serde_json::Value;

use crate::config::{ConfigError, Reader};

pub use preprocess::{pad, plan_image, preprocess, resize, ImagePlan, PreparedImage};
pub use tower::VisionWeights;

/// The vision tower's hyper-parameters (`ModelArgs.vision_*`, `image_token_id`).
/// Absent keys take `ModelArgs`' defaults, which are the published values.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub n_layers: usize,
    pub dim: usize,
    pub n_heads: usize,
    pub inter_dim: usize,
    pub patch_size: usize,
    pub rope_theta: f64,
    /// The aligner merges `downsample_ratio × downsample_ratio` patches into one token.
    pub downsample_ratio: usize,
    /// Most tokens one image's span may take (start, rows, newlines and end).
    pub max_n_token: usize,
    /// Smaller images are scaled up to about this many pixels first.
    pub min_pixels: usize,
    /// Wider images are stretched to fit rather than padded (`None`: never).
    pub max_wh_ratio: Option<usize>,
    /// The id every position of an image span carries.
    pub image_token_id: u32,
}

impl VisionConfig {
    /// `None` when `vision_n_layers` is absent or 0 (a text-only model).
    pub(crate) fn read(r: &Reader) -> Result<Option<Self>, ConfigError> {
        let n_layers = r.opt_usize("vision_n_layers")?.unwrap_or(0);
        if n_layers == 0 {
            return Ok(None);
        }
        let or = |key: &str, default: usize| -> Result<usize, ConfigError> {
            let v = r.opt_usize(key)?.unwrap_or(default);
            if v == 0 {
                return Err(r.invalid(key, "must be at least 1"));
            }
            Ok(v)
        };
        let dim = or("vision_dim", 1024)?;
        let n_heads = or("vision_n_heads", 16)?;
        if !dim.is_multiple_of(n_heads) || !(dim / n_heads).is_multiple_of(4) {
            return Err(r.invalid(
                "vision_n_heads",
                format!("{n_heads} heads must split vision_dim {dim} into heads of a multiple of 4 (2D RoPE)"),
            ));
        }
        let max_wh_ratio = match r.get("vision_max_wh_ratio") {
            None | Some(Value::Null) => None,
            Some(_) => Some(or("vision_max_wh_ratio", 1)?),
        };
        let cfg = Self {
            n_layers,
            dim,
            n_heads,
            inter_dim: or("vision_inter_dim", 2816)?,
            patch_size: or("vision_patch_size", 14)?,
            rope_theta: r.f64_or("vision_rope_theta", 10000.0)?,
            downsample_ratio: or("vision_downsample_ratio", 3)?,
            max_n_token: or("vision_max_n_token", 1024)?,
            min_pixels: r.opt_usize("vision_min_pixels")?.unwrap_or(544 * 544),
            max_wh_ratio,
            image_token_id: r.token_id("image_token_id", 129264)?,
        };
        if cfg.max_n_token < 4 {
            return Err(r.invalid("vision_max_n_token", "an image needs at least 4 tokens (start, one, newline, end)"));
        }
        Ok(Some(cfg))
    }

    pub fn head_dim(&self) -> usize {
        self.dim / self.n_heads
    }
}

/// Why a request's images cannot be served; the API answers these with a 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    #[error("this model takes no images: {0}")]
    NoVisionTower(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("an image of {width}×{height} pixels has no area")]
    Empty { width: usize, height: usize },
    #[error("{got} bytes of RGB pixels for a {width}×{height} image (expected {expected})")]
    PixelCount { width: usize, height: usize, got: usize, expected: usize },
    /// A request's images and its prompt's image spans disagree.
    #[error("the request's images do not match its prompt: {0}")]
    Mismatch(String),
}

/// What each position of an image span holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanSlot {
    /// The learned `image_start` vector.
    Start,
    /// The next aligner row, in reading order.
    Image,
    /// The learned `image_newline` vector, after every row of the grid.
    NewLine,
    /// The learned `image_end` vector.
    End,
}

/// `START + (IMAGE × n_llm_w + NEWLINE) × n_llm_h + END` (`image_token_types`).
pub fn span_layout(n_llm_h: usize, n_llm_w: usize) -> Vec<SpanSlot> {
    let mut slots = Vec::with_capacity(num_image_tokens(n_llm_h, n_llm_w));
    slots.push(SpanSlot::Start);
    for _ in 0..n_llm_h {
        slots.extend(std::iter::repeat_n(SpanSlot::Image, n_llm_w));
        slots.push(SpanSlot::NewLine);
    }
    slots.push(SpanSlot::End);
    slots
}

/// Positions an image of this token grid takes in the prompt.
pub fn num_image_tokens(n_llm_h: usize, n_llm_w: usize) -> usize {
    n_llm_h * (n_llm_w + 1) + 2
}

impl super::ModelV41 {
    /// The vision tower and its config, or why this model takes no images.
    pub fn vision(&self) -> Result<(&VisionConfig, &VisionWeights), ImageError> {
        match (&self.config.vision, &self.weights.vision) {
            (Some(c), Some(w)) => Ok((c, w)),
            _ => Err(ImageError::NoVisionTower(
                "the checkpoint's config.json has no vision tower (vision_n_layers is 0 or absent)".into(),
            )),
        }
    }

    /// The aligner rows `[n_llm_h · n_llm_w, dim]` (bf16 values) of one prepared image.
    pub fn encode_image(&self, image: &PreparedImage) -> Result<Vec<f32>, ImageError> {
        let (cfg, w) = self.vision()?;
        let p = &image.plan;
        let features = w.tower(cfg, &image.patches, p.n_vit_h, p.n_vit_w);
        Ok(w.align(cfg, &features, p.n_vit_h, p.n_vit_w))
    }

    /// The embedding rows `[tokens, dim]` of an image's span: the learned
    /// start, newline and end vectors around the aligner rows (`merge_image_embeddings`).
    pub fn span_embeddings(&self, plan: &ImagePlan, aligner_rows: &[f32]) -> Result<Vec<f32>, ImageError> {
        let (_, w) = self.vision()?;
        let d = self.config.dim;
        assert_eq!(aligner_rows.len(), plan.n_llm_h * plan.n_llm_w * d, "one aligner row per grid cell");
        let mut rows = aligner_rows.chunks_exact(d);
        let mut out = Vec::with_capacity(plan.tokens() * d);
        for slot in span_layout(plan.n_llm_h, plan.n_llm_w) {
            out.extend_from_slice(match slot {
                SpanSlot::Start => &w.image_start,
                SpanSlot::Image => rows.next().expect("a row per image slot"),
                SpanSlot::NewLine => &w.image_newline,
                SpanSlot::End => &w.image_end,
            });
        }
        Ok(out)
    }
}
