//! Image spans on a computing worker: the span rows of a step item's images
//! (given, or computed with the tower here: colocated encoding) and the
//! parts of them each wave's chunks feed as embedding overrides.

use std::ops::Range;
use std::sync::Arc;

use deepinfer_engine::images::{span_rows, ImageContent, RequestImage};
use deepinfer_engine::v41::EmbeddedSpan;

use super::compute::ItemRun;
use super::WorkerMachine;

/// The part of an image span a chunk feeds: where in the chunk, and which
/// of the span's row values.
pub(super) struct SpanPart {
    offset: usize,
    rows: Arc<[f32]>,
    values: Range<usize>,
}

/// The parts of `images`' spans inside positions `range` (the engine's
/// `chunk_spans`, owning its rows).
fn span_parts(images: &[RequestImage], rows: &[Option<Arc<[f32]>>], range: Range<usize>, dim: usize) -> Vec<SpanPart> {
    images
        .iter()
        .zip(rows)
        .filter_map(|(image, rows)| {
            let span = image.span();
            let (a, b) = (span.start.max(range.start), span.end.min(range.end));
            let rows = rows.as_ref().filter(|_| a < b)?;
            let values = (a - span.start) * dim..(b - span.start) * dim;
            Some(SpanPart { offset: a - range.start, rows: Arc::clone(rows), values })
        })
        .collect()
}

/// Every chunk's span parts in wave `wave`, in the order `wave_chunks` lists the items.
pub(super) fn wave_span_parts(items: &[ItemRun], wave: usize, dim: usize) -> Vec<Vec<SpanPart>> {
    items
        .iter()
        .filter_map(|it| {
            let &(a, b, _) = it.segments.get(wave)?;
            Some(span_parts(&it.images, &it.image_rows, a..b, dim))
        })
        .collect()
}

/// The engine's overrides of the parts.
pub(super) fn embedded(parts: &[Vec<SpanPart>]) -> Vec<Vec<EmbeddedSpan<'_>>> {
    parts
        .iter()
        .map(|ps| ps.iter().map(|p| EmbeddedSpan { offset: p.offset, rows: &p.rows[p.values.clone()] }).collect())
        .collect()
}

impl WorkerMachine {
    /// The span rows of a step item's images: given, kept from an earlier
    /// step, or computed with the tower here (colocated encoding). Patches
    /// reach here only with their hash checked, so rows kept by hash are
    /// the rows of these patches.
    pub(super) fn image_rows(&mut self, images: &[RequestImage]) -> Result<Vec<Option<Arc<[f32]>>>, String> {
        let mut out = Vec::with_capacity(images.len());
        for image in images {
            let rows = match &image.content {
                ImageContent::Rows(rows) => Arc::clone(rows),
                ImageContent::Patches(_) => match self.image_cache.get(image.hash) {
                    Some(rows) => Arc::clone(rows),
                    None => {
                        let rows = span_rows(&self.ctx.model, image).map_err(|e| e.to_string())?;
                        self.image_cache.insert(image.hash, Arc::clone(&rows), rows.len() as u64 * 4);
                        rows
                    }
                },
            };
            out.push(Some(rows));
        }
        Ok(out)
    }
}
