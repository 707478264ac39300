//! Image input on the request path: image parts found in the three protocols
//! (`parts`), their bytes loaded from data URLs or fetched (`load`, `fetch`),
//! checked against the limits, refused by a model without a vision tower,
//! decoded off the async workers, and handed on as [`PromptImage`]s: RGB8
//! pixels with a content hash and the prompt position of each image's
//! placeholder. A placeholder typed by the client is refused (`placeholder`).
//! See DESIGN.md ("Images").

pub mod fetch;
pub mod load;
pub mod parts;
pub mod placeholder;

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::{Map, Value};

use super::errors::{ApiError, Flavor};
use super::AppState;
use load::{Checked, Pending};
use parts::Source;

/// Limits on a request's images. The defaults are DeepSeek's API limits where
/// it publishes one (URL length, bytes per image and per request, side).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageLimits {
    /// Most images in one request.
    pub max_images: usize,
    /// Longest image URL, in characters.
    pub max_url_chars: usize,
    /// Most encoded bytes of one image (after base64 decoding, or as fetched).
    pub max_image_bytes: usize,
    /// Most encoded bytes of all a request's images together.
    pub max_request_bytes: usize,
    /// Longest side, in pixels.
    pub max_side: u32,
    /// Most pixels of one image, read from its header before it is decoded
    /// (the decompression-bomb guard).
    pub max_pixels: u64,
    /// Most pixels of all a request's images together (bounds decoded memory).
    pub max_request_pixels: u64,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_images: 16,
            max_url_chars: 8192,
            max_image_bytes: 32 << 20,
            max_request_bytes: 64 << 20,
            max_side: 8192,
            max_pixels: 32 << 20,
            max_request_pixels: 64 << 20,
        }
    }
}

/// How image URLs are fetched, if at all.
#[derive(Clone, Debug, PartialEq)]
pub struct FetchConfig {
    /// Off: an `http(s)` image URL is refused with a 400.
    pub enabled: bool,
    /// Ranges fetched from although the default policy forbids them.
    pub allow: Vec<IpNet>,
    /// Time for all of one request's fetches, redirects and bodies included.
    pub timeout: Duration,
    /// Most redirects followed per image.
    pub max_redirects: usize,
}

impl Default for FetchConfig {
    fn default() -> Self {
        Self { enabled: false, allow: Vec::new(), timeout: Duration::from_secs(10), max_redirects: 3 }
    }
}

/// Image settings of a server.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ImageConfig {
    pub limits: ImageLimits,
    pub fetch: FetchConfig,
}

/// A decoded image: what the model side's preprocessing takes.
#[derive(Clone, PartialEq, Eq)]
pub struct DecodedImage {
    pub width: u32,
    pub height: u32,
    /// `width × height × 3` bytes, rows top to bottom (alpha dropped, the first
    /// frame of an animation).
    pub rgb: Vec<u8>,
    /// SHA-256 of the width and height (little-endian u32s) and the pixels:
    /// equal images, equal hashes, whatever their encoding.
    pub hash: [u8; 32],
}

impl std::fmt::Debug for DecodedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hash: String = self.hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
        write!(f, "DecodedImage({}×{}, sha256 {hash}…)", self.width, self.height)
    }
}

/// An image and the prompt position of its placeholder token, which the model
/// side replaces by the image's span (start, rows, newlines, end).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptImage {
    pub image: Arc<DecodedImage>,
    pub position: usize,
}

/// A request's images in prompt order, decoded; empty for a request without any.
#[derive(Clone, Debug, Default)]
pub struct Gathered {
    pub images: Vec<Arc<DecodedImage>>,
}

/// Whether this server's model reads images: `Ok` with its image token (id
/// and tokenizer spelling), or the refusal naming the model.
pub type Vision = Result<(u32, String), String>;

/// Find, check, load and decode a generation request's images. Order: the
/// parts and every limit that needs no bytes; the bytes (data URLs, then
/// fetches when enabled) and their headers (format, side, pixels); then the
/// model's capability, so that a model without a vision tower refuses before
/// any pixel is decoded; then decoding, on the blocking pool.
pub async fn gather(state: &Arc<AppState>, flavor: Flavor, body: &Arc<bytes::Bytes>) -> Result<Gathered, ApiError> {
    let bad = |m: String| ApiError::bad_request(flavor, m);
    let (st, b) = (state.clone(), body.clone());
    let mut pending = blocking(flavor, move || -> Result<Vec<Pending>, String> {
        // A body that is no JSON object is refused by `prepare`, with its own error.
        let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(&b) else { return Ok(Vec::new()) };
        let config = &st.config.images;
        let mut total = 0usize;
        let mut out = Vec::new();
        for part in parts::find(&obj, config)? {
            if matches!(part.source, Source::Url(_)) && st.fetcher.is_none() {
                return Err(format!(
                    "`{}`: image URLs are not fetched by this server (it was started without --image-fetch); \
                     send the image as a base64 data URL",
                    part.path
                ));
            }
            out.push(load::pending(&part, &config.limits, &mut total)?);
        }
        Ok(out)
    })
    .await?
    .map_err(bad)?;
    if pending.is_empty() {
        return Ok(Gathered::default());
    }
    if let Some(fetcher) = &state.fetcher {
        fetcher.fetch_all(&mut pending, &state.config.images.limits).await.map_err(bad)?;
    }
    let st = state.clone();
    let checked = blocking(flavor, move || load::check_headers(pending, &st.config.images.limits)).await?;
    let checked: Vec<Checked> = checked.map_err(bad)?;
    if let Err(why) = &state.vision {
        return Err(bad(format!("`{}`: {why}", checked[0].path)));
    }
    let _permit = state.decoders.acquire().await.map_err(|e| bad(format!("image decoding stopped: {e}")))?;
    let st = state.clone();
    let images = blocking(flavor, move || {
        checked
            .into_iter()
            .map(|c| load::decode(c, &st.config.images.limits).map(Arc::new))
            .collect::<Result<Vec<_>, String>>()
    })
    .await?
    .map_err(bad)?;
    Ok(Gathered { images })
}

/// Whether `model` (served as `name`) reads images, and the image token's
/// spellings refused in text. A cluster reads them as one process does (its
/// prefill workers or its encoder instances run the tower).
pub fn vision_of(
    model: &deepinfer_engine::model::Model,
    tokenizer: &tokenizers::Tokenizer,
    name: &str,
    _cluster: bool,
) -> (Vision, Vec<String>) {
    use deepinfer_engine::v41::vision::ImageError;
    let configured = model.v41.as_ref().and_then(|m| m.config.vision.as_ref()).map(|v| v.image_token_id);
    let id = configured.unwrap_or(deepseek_recipe_core::multimodal::IMAGE_SPECIAL_TOKEN_ID);
    let spellings = placeholder::spellings(tokenizer, id);
    let vision = match model.image_model() {
        Err(ImageError::NoVisionTower(why)) => {
            Err(format!("the model `{name}` has no vision tower, so it reads no images ({why})"))
        }
        Err(e) => Err(format!("the model `{name}` takes no images here: {e}")),
        Ok(_) => match tokenizer.get_added_tokens_decoder().get(&id) {
            Some(token) => Ok((id, token.content.clone())),
            None => {
                Err(format!("the model `{name}` has a vision tower, but its tokenizer has no image token (id {id})"))
            }
        },
    };
    (vision, spellings)
}

/// `work` on the blocking pool; a panic there is a 500, never a crash.
async fn blocking<T: Send + 'static>(flavor: Flavor, work: impl FnOnce() -> T + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::new(flavor, super::errors::Kind::Internal, format!("image preparation failed: {e}")))
}

/// Inside `prepare`, before conversion: refuse a typed placeholder. The
/// image parts stay: the protocol's conversion (as DeepSeek-V4.1-Flash, for a
/// model that reads images) renders each as one image token, marked special,
/// so only a real image part can become one.
pub fn substitute(state: &AppState, obj: &Map<String, Value>, gathered: &Gathered) -> Result<(), String> {
    placeholder::refuse(obj, &state.image_placeholders)?;
    if !gathered.images.is_empty() {
        state.vision.as_ref().map_err(Clone::clone)?;
    }
    Ok(())
}

/// The encoded prompt's image positions: each occurrence of the image token,
/// one per image in order (a typed one was refused before encoding).
pub fn place(state: &AppState, prompt: &[u32], gathered: &Gathered) -> Result<Vec<PromptImage>, String> {
    if gathered.images.is_empty() {
        return Ok(Vec::new());
    }
    let (id, _) = state.vision.as_ref().map_err(Clone::clone)?;
    let positions: Vec<usize> = prompt.iter().enumerate().filter(|(_, t)| **t == *id).map(|(i, _)| i).collect();
    if positions.len() != gathered.images.len() {
        return Err(format!(
            "the prompt holds {} image tokens for {} images (the chat template dropped or repeated an image part)",
            positions.len(),
            gathered.images.len()
        ));
    }
    Ok(gathered
        .images
        .iter()
        .zip(positions)
        .map(|(image, position)| PromptImage { image: image.clone(), position })
        .collect())
}

/// The encoded prompt with each image's placeholder replaced by its span
/// (`START + (IMAGE × w + NEWLINE) × h + END`, all the image token) and the
/// engine's view of each image: its plan, content hash and patches. The
/// resize and normalisation run here, on the caller's (blocking) thread.
pub fn expand(
    state: &AppState,
    prompt: Vec<u32>,
    gathered: &Gathered,
) -> Result<(Vec<u32>, Vec<deepinfer_engine::images::RequestImage>), String> {
    use deepinfer_engine::images::{expand_placeholders, Rgb};
    let placed = place(state, &prompt, gathered)?;
    if placed.is_empty() {
        return Ok((prompt, Vec::new()));
    }
    let cfg = state.vision_config.as_ref().ok_or("the model reads no images here")?;
    let images: Vec<(usize, Rgb)> = placed
        .iter()
        .map(|p| {
            let rgb = Rgb { width: p.image.width as usize, height: p.image.height as usize, pixels: &p.image.rgb };
            (p.position, rgb)
        })
        .collect();
    expand_placeholders(cfg, &prompt, &images).map_err(|e| format!("cannot prepare the images: {e}"))
}
