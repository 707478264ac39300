//! An image's bytes to pixels: base64 payloads decoded within the byte limits,
//! headers read for the format and size (the limits on sides and pixels are
//! checked there, before any pixel is decoded), then the decode itself into
//! RGB8 under the same limits, and the content hash. CPU work: callers run it
//! on the blocking pool.

use std::io::Cursor;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::Engine;
use image::{ImageFormat, ImageReader};
use sha2::{Digest, Sha256};

use super::parts::{ImagePart, Source};
use super::{DecodedImage, ImageLimits};

/// Standard base64, padded or not (clients differ).
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// An image on its way: the path of its field, its URL when it is fetched,
/// and its encoded bytes (empty until fetched).
#[derive(Debug)]
pub struct Pending {
    pub path: String,
    pub url: Option<String>,
    pub bytes: Vec<u8>,
}

/// The bytes of a data part (none for a URL), counted into the request's
/// `total`: each size limit is checked on the payload's length before it is
/// decoded, and again on the decoded bytes.
pub fn pending(part: &ImagePart, limits: &ImageLimits, total: &mut usize) -> Result<Pending, String> {
    let path = &part.path;
    let base64 = match part.source {
        Source::Url(url) => return Ok(Pending { path: path.clone(), url: Some(url.to_string()), bytes: Vec::new() }),
        Source::Data { base64, .. } => base64.trim_end(),
    };
    let estimate = base64.len() / 4 * 3;
    check_bytes(path, estimate, *total, limits)?;
    let bytes = BASE64.decode(base64).map_err(|e| format!("`{path}`: the image's base64 data is invalid: {e}"))?;
    if bytes.is_empty() {
        return Err(format!("`{path}`: the image's data is empty"));
    }
    check_bytes(path, bytes.len(), *total, limits)?;
    *total += bytes.len();
    Ok(Pending { path: path.clone(), url: None, bytes })
}

/// `n` more bytes for the image at `path`, `used` by the request's earlier images.
pub fn check_bytes(path: &str, n: usize, used: usize, limits: &ImageLimits) -> Result<(), String> {
    if n > limits.max_image_bytes {
        return Err(format!(
            "`{path}`: the image is larger than {} bytes (the limit per image)",
            limits.max_image_bytes
        ));
    }
    if used.saturating_add(n) > limits.max_request_bytes {
        return Err(format!(
            "`{path}`: the request's images are larger than {} bytes together (the limit per request)",
            limits.max_request_bytes
        ));
    }
    Ok(())
}

/// An image whose header was read and passed the limits.
#[derive(Debug)]
pub struct Checked {
    pub path: String,
    pub bytes: Vec<u8>,
    pub format: ImageFormat,
    pub width: u32,
    pub height: u32,
}

/// Read each image's header (format from its magic bytes, then its size) and
/// check the side and pixel limits, per image and for the request.
pub fn check_headers(images: Vec<Pending>, limits: &ImageLimits) -> Result<Vec<Checked>, String> {
    let mut pixels_total = 0u64;
    let mut out = Vec::with_capacity(images.len());
    for p in images {
        let path = p.path;
        let reader = reader(&p.bytes, &path)?;
        let format = reader.format().unwrap_or(ImageFormat::Png);
        let (width, height) =
            reader.into_dimensions().map_err(|e| format!("`{path}`: the image's header cannot be read: {e}"))?;
        if width == 0 || height == 0 {
            return Err(format!("`{path}`: the image is {width}×{height} pixels, which has no area"));
        }
        let side = limits.max_side;
        if width > side || height > side {
            return Err(format!("`{path}`: the image is {width}×{height} pixels; a side may be at most {side}"));
        }
        let pixels = u64::from(width) * u64::from(height);
        if pixels > limits.max_pixels {
            return Err(format!(
                "`{path}`: the image is {width}×{height} = {pixels} pixels; the limit is {} per image",
                limits.max_pixels
            ));
        }
        pixels_total += pixels;
        if pixels_total > limits.max_request_pixels {
            return Err(format!(
                "`{path}`: the request's images hold more than {} pixels together (the limit per request)",
                limits.max_request_pixels
            ));
        }
        out.push(Checked { path, bytes: p.bytes, format, width, height });
    }
    Ok(out)
}

/// A reader of PNG, JPEG, WebP or GIF bytes (recognised by their magic bytes).
fn reader<'a>(bytes: &'a [u8], path: &str) -> Result<ImageReader<Cursor<&'a [u8]>>, String> {
    let unsupported = || format!("`{path}`: the data is not a PNG, JPEG, WebP or GIF image");
    let reader = ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|_| unsupported())?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => Ok(reader),
        _ => Err(unsupported()),
    }
}

/// Decode a checked image into RGB8 (alpha dropped, the first frame of an
/// animation), within the sides its header gave and memory for its pixels.
pub fn decode(image: Checked, limits: &ImageLimits) -> Result<DecodedImage, String> {
    let path = &image.path;
    let mut reader = reader(&image.bytes, path)?;
    let mut bounds = image::Limits::default();
    bounds.max_image_width = Some(image.width.min(limits.max_side));
    bounds.max_image_height = Some(image.height.min(limits.max_side));
    // RGBA at 16 bits per channel is the widest decoded form.
    bounds.max_alloc = Some(u64::from(image.width) * u64::from(image.height) * 8 + (1 << 20));
    reader.limits(bounds);
    let decoded = reader.decode().map_err(|e| format!("`{path}`: the image cannot be decoded: {e}"))?;
    let rgb = decoded.to_rgb8();
    let (width, height) = rgb.dimensions();
    let rgb = rgb.into_raw();
    Ok(DecodedImage { width, height, hash: content_hash(width, height, &rgb), rgb })
}

/// SHA-256 of the width, height (little-endian u32s) and RGB8 pixels.
pub fn content_hash(width: u32, height: u32, rgb: &[u8]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(width.to_le_bytes());
    h.update(height.to_le_bytes());
    h.update(rgb);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, ImageFormat::Png).unwrap();
        out.into_inner()
    }

    fn checked(bytes: Vec<u8>, limits: &ImageLimits) -> Result<Vec<Checked>, String> {
        check_headers(vec![Pending { path: "p".into(), url: None, bytes }], limits)
    }

    #[test]
    fn pixels_and_hash_of_a_png() {
        let limits = ImageLimits::default();
        let c = checked(png(3, 2), &limits).unwrap().pop().unwrap();
        let d = decode(c, &limits).unwrap();
        assert_eq!((d.width, d.height), (3, 2));
        assert_eq!(&d.rgb[..6], &[0, 0, 7, 1, 0, 7]);
        assert_eq!(d.hash, content_hash(3, 2, &d.rgb));
        assert_ne!(d.hash, content_hash(2, 3, &d.rgb), "the shape is part of the hash");
    }

    #[test]
    fn sides_and_pixels_are_limited_from_the_header() {
        let limits = ImageLimits { max_side: 16, max_pixels: 100, max_request_pixels: 150, ..ImageLimits::default() };
        assert!(checked(png(17, 1), &limits).unwrap_err().contains("a side may be at most 16"));
        assert!(checked(png(11, 10), &limits).unwrap_err().contains("the limit is 100 per image"));
        checked(png(10, 10), &limits).unwrap();
        let two = vec![
            Pending { path: "a".into(), url: None, bytes: png(10, 10) },
            Pending { path: "b".into(), url: None, bytes: png(10, 10) },
        ];
        assert!(check_headers(two, &limits).unwrap_err().starts_with("`b`: the request's images hold more than 150"));
        assert!(checked(b"GIF89a".to_vec(), &limits).unwrap_err().contains("header cannot be read"));
        assert!(checked(b"%PDF-1.4 not an image".to_vec(), &limits).unwrap_err().contains("not a PNG, JPEG"));
    }

    #[test]
    fn a_header_that_lies_about_its_size_does_not_decode() {
        // A PNG whose IHDR claims 4×4 but whose data holds 3×2 pixels.
        let mut bytes = png(3, 2);
        bytes[16..24].copy_from_slice(&[0, 0, 0, 4, 0, 0, 0, 4]);
        let limits = ImageLimits::default();
        match checked(bytes, &limits) {
            Ok(mut c) => assert!(decode(c.pop().unwrap(), &limits).is_err()),
            Err(e) => assert!(e.contains("header"), "{e}"),
        }
    }
}
