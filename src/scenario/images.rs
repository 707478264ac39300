//! Image traffic and image-encoder instances in a scenario: the `[images]`
//! table (which requests carry images, how many, their sizes, how often an
//! image repeats) and `[[instance]] role = "encoder"` (see
//! simulations/README.md, "Images and encoder instances").

use deepinfer_actors::modelled::encoder::EncoderSpec;
use deepinfer_engine::cost::vision::VisionCost;
use deepinfer_engine::cost::{HardwareKind, ModelKind};
use deepinfer_engine::traffic::Lengths;
use serde::Deserialize;
use toml::Spanned;

use super::LengthSpec;
use crate::config_file::FileError;

const GIB: f64 = (1u64 << 30) as f64;
/// An encoder instance's cache when the file gives none.
pub const DEFAULT_ENCODER_CACHE_GIB: f64 = 4.0;
/// Share of a device's HBM kept for activations (as for the text model's instances).
const HBM_RESERVE: f64 = 0.1;
/// Most images one request may carry, and most images in the repeated pool.
const MAX_IMAGES_PER_REQUEST: usize = 64;
const MAX_POOL: u32 = 10_000_000;
/// Longest image side a scenario may ask for (DeepSeek's API limit).
const MAX_SIDE: usize = 8192;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ImagesSpec {
    /// Images in a request that carries any (at least 1).
    pub per_request: Spanned<LengthSpec>,
    /// Share of requests that carry images.
    #[serde(default)]
    pub share: Option<Spanned<f64>>,
    /// Image sizes, `"WxH"`, each with a relative weight.
    pub sizes: Spanned<Vec<SizeSpec>>,
    /// Share of images drawn from a pool of images that recur (the same
    /// screenshot or logo again); the others are new.
    #[serde(default)]
    pub repeat_share: Option<Spanned<f64>>,
    /// Images in that pool.
    #[serde(default)]
    pub pool: Option<Spanned<u32>>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SizeSpec {
    pub size: String,
    #[serde(default = "one")]
    pub weight: f64,
}

fn one() -> f64 {
    1.0
}

/// One image size of the traffic, with its relative weight.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ImageSize {
    pub width: usize,
    pub height: usize,
    pub weight: f64,
}

/// The checked `[images]` table.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageTraffic {
    pub share: f64,
    pub per_request: Lengths,
    pub sizes: Vec<ImageSize>,
    pub repeat_share: f64,
    pub pool: u32,
}

type Err<'a> = &'a dyn Fn(std::ops::Range<usize>, String) -> FileError;

fn no_tower(model: ModelKind) -> String {
    format!("{} has no vision tower: images need V4.1-Flash", model.cost().name)
}

impl ImagesSpec {
    pub fn traffic(&self, model: ModelKind, err: Err) -> Result<ImageTraffic, FileError> {
        let vision = VisionCost::of(model).ok_or_else(|| err(self.per_request.span(), no_tower(model)))?;
        let per = self.per_request.get_ref();
        per.check().map_err(|m| err(self.per_request.span(), m))?;
        let per_request = per.lengths();
        let most = match per_request {
            Lengths::Fixed(n) => n,
            Lengths::Uniform { max, .. } | Lengths::LogNormal { max, .. } => max,
        };
        if most > MAX_IMAGES_PER_REQUEST {
            return Err(err(self.per_request.span(), format!("at most {MAX_IMAGES_PER_REQUEST} images a request")));
        }
        let share = |v: &Option<Spanned<f64>>, default: f64| match v {
            None => Ok(default),
            Some(x) if (0.0..=1.0).contains(x.get_ref()) => Ok(*x.get_ref()),
            Some(x) => Err(err(x.span(), "must be in [0, 1]".into())),
        };
        let mut sizes = Vec::new();
        for s in self.sizes.get_ref() {
            let bad = || {
                err(
                    self.sizes.span(),
                    format!(
                        "`{}`: a size is \"WIDTHxHEIGHT\" in pixels, each 1 to {MAX_SIDE}, with a positive weight",
                        s.size
                    ),
                )
            };
            let (w, h) = s.size.split_once(['x', 'X', '×']).ok_or_else(bad)?;
            let (width, height): (usize, usize) =
                (w.trim().parse().map_err(|_| bad())?, h.trim().parse().map_err(|_| bad())?);
            let fits = (1..=MAX_SIDE).contains(&width) && (1..=MAX_SIDE).contains(&height);
            if !(fits && s.weight.is_finite() && s.weight > 0.0) {
                return Err(bad());
            }
            vision.plan(width, height).map_err(|e| err(self.sizes.span(), format!("`{}`: {e}", s.size)))?;
            sizes.push(ImageSize { width, height, weight: s.weight });
        }
        if sizes.is_empty() {
            return Err(err(self.sizes.span(), "give at least one size".into()));
        }
        let pool = self.pool.as_ref().map_or(Ok(100), |p| {
            if (1..=MAX_POOL).contains(p.get_ref()) {
                Ok(*p.get_ref())
            } else {
                Err(err(p.span(), format!("must be 1 to {MAX_POOL}")))
            }
        })?;
        Ok(ImageTraffic {
            share: share(&self.share, 1.0)?,
            per_request,
            sizes,
            repeat_share: share(&self.repeat_share, 0.0)?,
            pool,
        })
    }
}

/// An `[[instance]] role = "encoder"`: checked against the model and the hardware.
pub fn encoder_spec(
    model: ModelKind,
    hardware: HardwareKind,
    devices: &Spanned<u32>,
    cache_gib: Option<&Spanned<f64>>,
    role_span: std::ops::Range<usize>,
    err: Err,
) -> Result<EncoderSpec, FileError> {
    let vision = VisionCost::of(model).ok_or_else(|| err(role_span, no_tower(model)))?;
    let n = *devices.get_ref();
    if n == 0 {
        return Err(err(devices.span(), "must be at least 1".into()));
    }
    let hw = hardware.spec();
    // Every device holds the tower; the cache takes what is left of the instance's HBM.
    let room = n as f64 * (hw.hbm_bytes() * (1.0 - HBM_RESERVE) - vision.weight_bytes());
    let gib = cache_gib.map_or(DEFAULT_ENCODER_CACHE_GIB, |c| *c.get_ref());
    if !(gib.is_finite() && gib >= 0.0 && gib * GIB <= room) {
        let span = cache_gib.map_or(devices.span(), |c| c.span());
        return Err(err(span, format!("must be 0 to {:.0} GiB (the instance's HBM after the tower)", room / GIB)));
    }
    Ok(EncoderSpec { devices: n, cache_bytes: (gib * GIB) as u64 })
}
