//! From decoded RGB pixels to the tower's patches, as `image_processor.load_image`
//! does it: the resize plan (`plan_image_grid`: scale up to the minimum pixel
//! count, sides to multiples of the patch, a closed-form shrink to the token
//! limit), Pillow's `ImageOps.pad` (aspect-fit with bicubic resampling, grey
//! 127 around it), `(x / 255 − 0.5) / 0.5` rounded to bf16, cut into patches.
//!
//! The resampling is Pillow's own algorithm for 8-bit images (`Resample.c`):
//! a filter whose support grows by the downscale factor (antialiasing),
//! coefficients computed in f64, normalised per output pixel, turned into
//! fixed point with 22 fraction bits, a horizontal pass over the rows the
//! vertical pass reads, then the vertical pass, each clipped to 0..=255.

use deepinfer_kernels::act_quant::round_bf16;

use super::{num_image_tokens, ImageError, VisionConfig};

/// How one image is resized, patched and laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImagePlan {
    /// The decoded image's size.
    pub width: usize,
    pub height: usize,
    /// The pixel size the tower sees (multiples of the patch size).
    pub best_width: usize,
    pub best_height: usize,
    /// The patch grid.
    pub n_vit_h: usize,
    pub n_vit_w: usize,
    /// The aligner's token grid.
    pub n_llm_h: usize,
    pub n_llm_w: usize,
}

impl ImagePlan {
    /// Positions the image's span takes in the prompt.
    pub fn tokens(&self) -> usize {
        num_image_tokens(self.n_llm_h, self.n_llm_w)
    }
}

/// An image ready for the tower.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedImage {
    pub plan: ImagePlan,
    /// `[n_vit_h · n_vit_w, 3, p, p]` bf16 values, patches in reading order.
    pub patches: Vec<f32>,
}

fn llm_grid(best_height: usize, best_width: usize, p: usize, r: usize) -> (usize, usize) {
    ((best_height / p).div_ceil(r), (best_width / p).div_ceil(r))
}

/// `solve_resize_ratio`: the largest aspect-preserving size whose grid fits `max_n_token`.
fn solve_resize_ratio(height: usize, width: usize, p: usize, r: usize, max_n_token: usize) -> (usize, usize) {
    let ratio = height as f64 / width as f64;
    let max_w = ((max_n_token - 2) as f64 / ratio + 0.25).sqrt() - 0.5;
    let max_h = max_w * ratio;
    let cell = p * r;
    if max_w < 1.0 {
        return ((max_n_token - 2) / 2 * cell, cell);
    }
    if max_h < 1.0 {
        return (cell, (max_n_token - 3) * cell);
    }
    let by_w = (max_w.floor() as usize * cell) as f64 / width as f64;
    let by_h = (max_h.floor() as usize * cell) as f64 / height as f64;
    let beta = if by_h < by_w { by_h } else { by_w };
    let side = |s: usize| ((s as f64 * beta / p as f64).floor() as usize) * p;
    (side(height), side(width))
}

/// `plan_image_grid` for an image of `width × height` pixels.
pub fn plan_image(width: usize, height: usize, cfg: &VisionConfig) -> Result<ImagePlan, ImageError> {
    if width == 0 || height == 0 {
        return Err(ImageError::Empty { width, height });
    }
    let (p, r) = (cfg.patch_size, cfg.downsample_ratio);
    let (mut w, mut h) = (width, height);
    if let Some(ratio) = cfg.max_wh_ratio {
        if w > h * ratio {
            w = h * ratio;
        }
    }
    if w * h < cfg.min_pixels {
        // Python's `x ** 0.5`, which is `pow`, not `sqrt`
        let scale = (cfg.min_pixels as f64 / (w * h) as f64).powf(0.5);
        w = (w as f64 * scale) as usize;
        h = (h as f64 * scale) as usize;
    }
    let (mut best_w, mut best_h) =
        ((w as f64 / p as f64).ceil() as usize * p, (h as f64 / p as f64).ceil() as usize * p);
    let (mut n_llm_h, mut n_llm_w) = llm_grid(best_h, best_w, p, r);
    if num_image_tokens(n_llm_h, n_llm_w) > cfg.max_n_token {
        (best_h, best_w) = solve_resize_ratio(h, w, p, r, cfg.max_n_token);
        (n_llm_h, n_llm_w) = llm_grid(best_h, best_w, p, r);
        debug_assert!(num_image_tokens(n_llm_h, n_llm_w) <= cfg.max_n_token);
    }
    Ok(ImagePlan {
        width,
        height,
        best_width: best_w,
        best_height: best_h,
        n_vit_h: best_h / p,
        n_vit_w: best_w / p,
        n_llm_h,
        n_llm_w,
    })
}

/// Plan, resize and pad, normalise and cut `rgb` (`width × height`, row-major, 3 bytes a pixel).
pub fn preprocess(rgb: &[u8], width: usize, height: usize, cfg: &VisionConfig) -> Result<PreparedImage, ImageError> {
    if rgb.len() != width * height * 3 {
        return Err(ImageError::PixelCount { width, height, got: rgb.len(), expected: width * height * 3 });
    }
    let plan = plan_image(width, height, cfg)?;
    let fitted = match cfg.max_wh_ratio {
        Some(r) if width >= r * height => resize(rgb, width, height, plan.best_width, plan.best_height),
        _ => pad(rgb, width, height, plan.best_width, plan.best_height, 127),
    };
    Ok(PreparedImage { plan, patches: patches(&fitted, &plan, cfg.patch_size) })
}

/// `(x / 255 − 0.5) / 0.5` in f32, rounded to bf16, of every byte value.
fn normalised() -> [f32; 256] {
    std::array::from_fn(|v| round_bf16(((v as f32 / 255.0) - 0.5) / 0.5))
}

/// `[patches, 3, p, p]` of a `best_width × best_height` RGB image.
pub fn patches(rgb: &[u8], plan: &ImagePlan, p: usize) -> Vec<f32> {
    let lut = normalised();
    let w = plan.best_width;
    let mut out = Vec::with_capacity(rgb.len());
    for ph in 0..plan.n_vit_h {
        for pw in 0..plan.n_vit_w {
            for c in 0..3 {
                for y in ph * p..(ph + 1) * p {
                    out.extend((pw * p..(pw + 1) * p).map(|x| lut[rgb[(y * w + x) * 3 + c] as usize]));
                }
            }
        }
    }
    out
}

/// Python's `round` (half to even) of a non-negative value.
fn round_even(x: f64) -> usize {
    x.round_ties_even() as usize
}

/// `ImageOps.pad(image, (out_w, out_h), color=(grey,)*3)`: `ImageOps.contain`
/// (bicubic, aspect kept), pasted centred (offsets rounded half to even) on grey.
pub fn pad(rgb: &[u8], width: usize, height: usize, out_w: usize, out_h: usize, grey: u8) -> Vec<u8> {
    let (im_ratio, dest_ratio) = (width as f64 / height as f64, out_w as f64 / out_h as f64);
    let (mut fit_w, mut fit_h) = (out_w, out_h);
    if im_ratio != dest_ratio {
        if im_ratio > dest_ratio {
            fit_h = round_even(height as f64 / width as f64 * out_w as f64);
        } else {
            fit_w = round_even(width as f64 / height as f64 * out_h as f64);
        }
    }
    if (fit_w, fit_h) == (out_w, out_h) {
        return resize(rgb, width, height, out_w, out_h);
    }
    let mut out = vec![grey; out_w * out_h * 3];
    if fit_w == 0 || fit_h == 0 {
        return out;
    }
    let fitted = resize(rgb, width, height, fit_w, fit_h);
    let (x0, y0) = if fit_w != out_w {
        (round_even((out_w - fit_w) as f64 * 0.5), 0)
    } else {
        (0, round_even((out_h - fit_h) as f64 * 0.5))
    };
    for y in 0..fit_h {
        let to = ((y0 + y) * out_w + x0) * 3;
        out[to..to + fit_w * 3].copy_from_slice(&fitted[y * fit_w * 3..(y + 1) * fit_w * 3]);
    }
    out
}

/// Fraction bits of Pillow's fixed-point coefficients (`32 − 8 − 2`).
const PRECISION_BITS: u32 = 22;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for `in_size → out_size`
/// over the whole input: per output pixel, the first input and the fixed-point weights.
fn coefficients(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
    // box = (0, in_size) in single precision, as Pillow holds it
    let scale = (in_size as f32 - 0.0f32) as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ss = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = 0.0 + (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let w: Vec<f64> = (xmin..xmax).map(|x| bicubic((x as f64 - center + 0.5) * ss)).collect();
            let total: f64 = w.iter().fold(0.0, |a, &b| a + b);
            let fixed = w
                .iter()
                .map(|&k| {
                    let k = if total != 0.0 { k / total } else { k };
                    let v = k * (1u32 << PRECISION_BITS) as f64;
                    (if k < 0.0 { -0.5 + v } else { 0.5 + v }) as i32
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `Image.resize((out_w, out_h), BICUBIC)` of an RGB image (Pillow's 8-bit path).
pub fn resize(rgb: &[u8], width: usize, height: usize, out_w: usize, out_h: usize) -> Vec<u8> {
    let round = 1i32 << (PRECISION_BITS - 1);
    let vertical = coefficients(height, out_h);
    // the rows the vertical pass reads
    let first = vertical.first().map_or(0, |v| v.0);
    let last = vertical.last().map_or(0, |v| v.0 + v.1.len());
    let (rows, src, row_w) = if out_w != width {
        let horizontal = coefficients(width, out_w);
        let mut tmp = vec![0u8; (last - first) * out_w * 3];
        for y in first..last {
            let line = &rgb[y * width * 3..(y + 1) * width * 3];
            for (xx, (xmin, k)) in horizontal.iter().enumerate() {
                for c in 0..3 {
                    let acc = k.iter().enumerate().fold(round, |a, (i, &w)| a + line[(xmin + i) * 3 + c] as i32 * w);
                    tmp[((y - first) * out_w + xx) * 3 + c] = clip8(acc);
                }
            }
        }
        (first, tmp, out_w)
    } else {
        (0, rgb.to_vec(), width)
    };
    if out_h == height {
        return src;
    }
    let mut out = vec![0u8; out_h * row_w * 3];
    for (yy, (ymin, k)) in vertical.iter().enumerate() {
        for x in 0..row_w * 3 {
            let acc =
                k.iter().enumerate().fold(round, |a, (i, &w)| a + src[(ymin - rows + i) * row_w * 3 + x] as i32 * w);
            out[yy * row_w * 3 + x] = clip8(acc);
        }
    }
    out
}
