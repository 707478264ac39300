//! FP8 weights regrouped at load for the AVX-512 decode kernel.
//!
//! In the published layout every weight row is its own run of bytes, so a
//! register tile of rows reads as many short interleaved streams as it has
//! rows, and the hardware prefetchers do not run ahead of them: the fused
//! kernel decodes codes from L2 about half again as fast as from memory.
//! Here eight rows form a group, stored as one sequential stream of 64-column
//! chunks (per row one 64-byte line of codes), and a group's rows share one
//! scale per column block (the published 128 × 128 blocks hold whole
//! groups), so a block's scale moves onto x once for all eight rows. Each
//! 32-byte half of a line pairs columns `l` and `16 + l` of its 32 columns,
//! so one sign-extension to words serves 32 weights: the low words become
//! columns `0..16` and the high words columns `16..32`, each by a shift and
//! a mask (the published layout takes a sign-extension per 16). The values,
//! the products and their order are those of the published layout: every
//! output keeps its bits.

use rayon::prelude::*;

use crate::dtype::fp8_e4m3_to_f32;
pub use crate::row_groups::GROUP_ROWS;
use crate::row_groups::{Line, LINE_BYTES};
use crate::simd::Backend;
/// Columns per chunk: one 64-byte line of codes per row.
pub const CHUNK_COLS: usize = LINE_BYTES;
/// Columns whose codes one sign-extension to words reads.
pub(crate) const PAIRED_COLS: usize = 32;

/// The byte of a chunk's line that holds column `c` (`0..64`) of the chunk.
fn line_byte(c: usize) -> usize {
    let (half, within) = (c / PAIRED_COLS, c % PAIRED_COLS);
    PAIRED_COLS * half + if within < 16 { 2 * within } else { 2 * (within - 16) + 1 }
}

/// 32 published codes (column order) as a paired half line: column `l` at
/// byte `2l`, column `16 + l` at byte `2l + 1`.
fn pair_half(codes: &[u8], half: &mut [u8]) {
    for (l, pair) in half.chunks_exact_mut(2).enumerate() {
        (pair[0], pair[1]) = (codes[l], codes[16 + l]);
    }
}

/// The inverse of [`pair_half`].
fn unpair_half(half: &[u8], codes: &mut [u8]) {
    for (l, pair) in half.chunks_exact(2).enumerate() {
        (codes[l], codes[16 + l]) = (pair[0], pair[1]);
    }
}
/// Scales kept are below this: the kernel folds the decode's power of two
/// (2^120) into the scale, which must stay finite.
const SCALE_ABS_LIMIT: f32 = 64.0;
/// Batches up to this many rows run the grouped kernel; larger ones decode a
/// tile of rows into f32 once and share it (through [`decode_span`]).
#[cfg(target_arch = "x86_64")]
const KERNEL_MAX_BATCH: usize = 8;

/// An FP8 e4m3 weight of `rows × cols` in groups of [`GROUP_ROWS`] rows (the
/// last group padded with zero codes), with one scale per group and
/// `block_cols` columns.
#[derive(Clone)]
pub struct Fp8Groups {
    rows: usize,
    cols: usize,
    /// The published scale grid's block, kept to give that grid back.
    block_rows: usize,
    block_cols: usize,
    lines: Vec<Line>,
    /// Scale of group `g`, column block `b` at `g * blocks + b`.
    scales: Vec<f32>,
}

impl std::fmt::Debug for Fp8Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp8Groups({} × {}, {} bytes)", self.rows, self.cols, self.storage_bytes())
    }
}

impl Fp8Groups {
    /// Regroup published FP8 weights (`data`: one code per byte, row-major;
    /// `scales`: one per `block_rows × block_cols` block, row-major over the
    /// block grid). `None` unless the codes hold no NaN, `cols` is a whole
    /// number of chunks, the blocks are whole chunks wide, every group's rows
    /// share each block's scale, and every scale is below 64 in magnitude.
    pub fn pack(
        rows: usize,
        cols: usize,
        data: &[u8],
        scales: &[f32],
        (block_rows, block_cols): (usize, usize),
        nan_free: bool,
    ) -> Option<Self> {
        let chunked = cols > 0 && cols.is_multiple_of(CHUNK_COLS) && block_cols.is_multiple_of(CHUNK_COLS);
        if !nan_free || rows == 0 || block_rows == 0 || block_cols == 0 || !chunked {
            return None;
        }
        let blocks = cols.div_ceil(block_cols);
        assert!(data.len() >= rows * cols, "fp8 weight size");
        assert!(scales.len() >= rows.div_ceil(block_rows) * blocks, "fp8 scale grid");
        let published = |r: usize, b: usize| scales[(r / block_rows) * blocks + b];
        let groups = rows.div_ceil(GROUP_ROWS);
        let mut group_scales = Vec::with_capacity(groups * blocks);
        for g in 0..groups {
            let members = g * GROUP_ROWS..((g + 1) * GROUP_ROWS).min(rows);
            for b in 0..blocks {
                let scale = published(members.start, b);
                let shared = members.clone().all(|r| published(r, b).to_bits() == scale.to_bits());
                // NaN compares false, so only finite scales under the limit pass.
                let foldable = scale.abs() < SCALE_ABS_LIMIT;
                if !shared || !foldable {
                    return None;
                }
                group_scales.push(scale);
            }
        }
        let chunks = cols / CHUNK_COLS;
        let mut lines = vec![Line([0; LINE_BYTES]); groups * chunks * GROUP_ROWS];
        lines.par_chunks_mut(chunks * GROUP_ROWS).enumerate().for_each(|(g, group)| {
            for (ch, chunk) in group.chunks_exact_mut(GROUP_ROWS).enumerate() {
                for (j, line) in chunk.iter_mut().enumerate().take(rows.saturating_sub(g * GROUP_ROWS)) {
                    let codes = &data[(g * GROUP_ROWS + j) * cols + ch * CHUNK_COLS..][..CHUNK_COLS];
                    for (codes, half) in codes.chunks_exact(PAIRED_COLS).zip(line.0.chunks_exact_mut(PAIRED_COLS)) {
                        pair_half(codes, half);
                    }
                }
            }
        });
        Some(Self { rows, cols, block_rows, block_cols, lines, scales: group_scales })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Columns per scale.
    pub fn block_cols(&self) -> usize {
        self.block_cols
    }

    /// Rows per scale in the published grid.
    pub fn block_rows(&self) -> usize {
        self.block_rows
    }

    /// Scales in the published grid.
    pub fn published_scale_count(&self) -> usize {
        self.rows.div_ceil(self.block_rows) * self.blocks()
    }

    /// Bytes held (codes with the padding rows of the last group, and scales).
    pub fn storage_bytes(&self) -> usize {
        self.lines.len() * LINE_BYTES + self.scales.len() * 4
    }

    fn blocks(&self) -> usize {
        self.cols.div_ceil(self.block_cols)
    }

    /// The lines of group `g`: its chunks in column order, eight lines each.
    fn group_lines(&self, g: usize) -> &[Line] {
        let per_group = self.cols / CHUNK_COLS * GROUP_ROWS;
        &self.lines[g * per_group..][..per_group]
    }

    /// The scales of group `g`, one per column block.
    fn group_scales(&self, g: usize) -> &[f32] {
        &self.scales[g * self.blocks()..][..self.blocks()]
    }

    /// The FP8 code of column `c` of row `r`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        assert!(r < self.rows && c < self.cols, "({r}, {c}) outside {} × {}", self.rows, self.cols);
        self.row_line(r, c / CHUNK_COLS)[line_byte(c % CHUNK_COLS)]
    }

    /// Row `r`'s line in chunk `ch`.
    fn row_line(&self, r: usize, ch: usize) -> &[u8; LINE_BYTES] {
        &self.group_lines(r / GROUP_ROWS)[ch * GROUP_ROWS + r % GROUP_ROWS].0
    }

    /// The scale of columns `b * block_cols..` of row `r`.
    pub fn scale(&self, r: usize, b: usize) -> f32 {
        assert!(r < self.rows && b < self.blocks(), "scale ({r}, {b})");
        self.group_scales(r / GROUP_ROWS)[b]
    }

    /// Row `r` dequantised (the values of [`crate::Linear::dequantize_row`]
    /// on the published layout).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row {r} of {} × {}", self.rows, self.cols);
        for (c, o) in out.iter_mut().enumerate() {
            *o = fp8_e4m3_to_f32(self.code(r, c)) * self.scale(r, c / self.block_cols);
        }
    }

    /// The published layout back: codes, and the scales of the
    /// `block_rows × block_cols` grid.
    pub fn to_published(&self) -> (Vec<u8>, Vec<f32>) {
        let mut data = vec![0u8; self.rows * self.cols];
        for (r, row) in data.chunks_exact_mut(self.cols).enumerate() {
            for (ch, piece) in row.chunks_exact_mut(CHUNK_COLS).enumerate() {
                for (half, codes) in
                    self.row_line(r, ch).chunks_exact(PAIRED_COLS).zip(piece.chunks_exact_mut(PAIRED_COLS))
                {
                    unpair_half(half, codes);
                }
            }
        }
        let scales = (0..self.published_scale_count())
            .map(|i| self.scale(i / self.blocks() * self.block_rows, i % self.blocks()))
            .collect();
        (data, scales)
    }
}

/// `out[i * rows + r]` for `n` rows of `x` (row-major) with the grouped
/// kernel, spread over threads by groups above `parallel_min_fmas`
/// multiply-adds. `false` (nothing written) where the kernel does not apply:
/// no AVX-512BW, or a batch better served by decoded tiles.
pub(crate) fn forward_decoded(
    groups: &Fp8Groups,
    backend: Backend,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    parallel_min_fmas: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(backend.isa(), crate::Isa::Avx512 | crate::Isa::Avx512Vbmi) && n <= KERNEL_MAX_BATCH {
        let (rows, cols, blocks) = (groups.rows, groups.cols, groups.blocks());
        assert!(x.len() == n * cols && out.len() == n * rows, "grouped fp8 forward");
        // Largest |x| of each (x row, column block): whether a block's scale
        // can move onto x without changing a bit.
        let abs_max: Vec<f32> = x
            .chunks_exact(cols)
            .flat_map(|row| row.chunks(groups.block_cols).map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs()))))
            .collect();
        assert_eq!(abs_max.len(), n * blocks, "one bound per x row and block");
        crate::row_groups::forward_by_groups(rows, n, out, n * rows * cols >= parallel_min_fmas, |g, sums| {
            // SAFETY: the backend's path has AVX-512F and BW (checked by
            // `Backend::new`); the group holds `cols / 64` chunks, each x row
            // `cols` values and each bound row `blocks` values.
            unsafe { group_sums_into(groups, g, x, &abs_max, n, sums) }
        });
        return true;
    }
    let _ = (groups, backend, x, n, out, parallel_min_fmas);
    false
}

/// Every x row's dot products with the eight rows of group `g`, into
/// `sums[i * 8 + j]`: passes of up to four x rows against as many group rows
/// as their accumulators leave registers for.
///
/// # Safety
/// As [`crate::simd::avx512_fp8_groups::group_dot`].
#[cfg(target_arch = "x86_64")]
unsafe fn group_sums_into(groups: &Fp8Groups, g: usize, x: &[f32], abs_max: &[f32], n: usize, sums: &mut [f32]) {
    use crate::row_groups::{pass_rows, store_pass};
    use crate::simd::avx512_fp8_groups::{group_dot, GroupRef};
    let (cols, blocks) = (groups.cols, groups.blocks());
    let group =
        GroupRef { lines: groups.group_lines(g), scales: groups.group_scales(g), block_cols: groups.block_cols };
    let mut i0 = 0;
    while i0 < n {
        let part = pass_rows(n - i0);
        let row = |i: usize| &x[(i0 + i) * cols..][..cols];
        let bound = |i: usize| &abs_max[(i0 + i) * blocks..][..blocks];
        macro_rules! passes {
            ($mr:literal, $rp:literal) => {{
                for j0 in (0..GROUP_ROWS).step_by($rp) {
                    let got = group_dot::<$mr, $rp>(&group, std::array::from_fn(row), std::array::from_fn(bound), j0);
                    store_pass(sums, (i0, j0), &got);
                }
            }};
        }
        match part {
            1 => passes!(1, 8),
            2 => passes!(2, 8),
            3 => passes!(3, 4),
            _ => passes!(4, 4),
        }
        i0 += part;
    }
}

/// Columns `k0..k0 + dst.len()` of row `r` dequantised (multiples of 16), on
/// the backend's path.
pub(crate) fn decode_span(groups: &Fp8Groups, backend: Backend, r: usize, k0: usize, dst: &mut [f32]) {
    let len = dst.len();
    decode_rows(groups, backend, r..r + 1, (k0, len), dst, len);
}

/// Columns `k0..k0 + len` of rows `rows` dequantised (multiples of 16): row
/// `rows.start + i` at `dst[i * stride..][..len]`. Rows of one group are
/// decoded together, in the order the group stores its lines.
pub(crate) fn decode_rows(
    groups: &Fp8Groups,
    backend: Backend,
    rows: std::ops::Range<usize>,
    (k0, len): (usize, usize),
    dst: &mut [f32],
    stride: usize,
) {
    let end = k0 + len;
    assert!(
        rows.end <= groups.rows && k0.is_multiple_of(16) && end.is_multiple_of(16) && end <= groups.cols,
        "fp8 span"
    );
    assert!(rows.is_empty() || dst.len() >= (rows.len() - 1) * stride + len, "rows past the output");
    #[cfg(target_arch = "x86_64")]
    if matches!(backend.isa(), crate::Isa::Avx512 | crate::Isa::Avx512Vbmi) {
        crate::row_groups::by_group(rows, |g, within, first| {
            let group = crate::simd::avx512_fp8_groups::GroupRef {
                lines: groups.group_lines(g),
                scales: groups.group_scales(g),
                block_cols: groups.block_cols,
            };
            let out = &mut dst[first * stride..];
            // SAFETY: as in `forward_decoded`; the kernel asserts the span's bounds.
            unsafe { crate::simd::avx512_fp8_groups::decode_rows(&group, within, (k0, len), out, stride) };
        });
        return;
    }
    // Elsewhere (tests of this layout on every path) one value at a time.
    let _ = backend;
    for (i, r) in rows.enumerate() {
        for (c, o) in (k0..end).zip(dst[i * stride..][..len].iter_mut()) {
            *o = fp8_e4m3_to_f32(groups.code(r, c)) * groups.scale(r, c / groups.block_cols);
        }
    }
}
