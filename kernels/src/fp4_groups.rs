//! FP4 weights regrouped at load for the AVX-512 decode kernel.
//!
//! The published layout keeps two e2m1 codes per byte along a row and an f32
//! scale per 32 columns. Decoding it takes four shuffles per 32 weights on
//! AVX-512, and a tile of rows reads as many interleaved streams as it has
//! rows. Here eight rows form a group, stored as one sequential stream of
//! 128-column chunks; a chunk holds, per row, one 64-byte line of 32 words
//! whose nibble `k` is a code of scale block `k`, then each (row, block)'s
//! scale as a bf16 exponent step. A word shifted right by `4k` leaves block
//! `k`'s code under it, one `vpermw` looks 32 codes up in a bf16 table whose
//! exponents already carry the scale (an e2m1 value times a power of two has
//! two significant bits, so bf16 holds it exactly), and the odd and even words
//! become columns `0..16` and `16..32` of the block. One shuffle per 32
//! weights; the products and their order are those of the published layout,
//! so every output keeps its bits.

use rayon::prelude::*;

use crate::dtype::FP4_E2M1_VALUES;
pub use crate::row_groups::GROUP_ROWS;
use crate::row_groups::{Line, LINE_BYTES};
use crate::simd::Backend;
/// Columns per chunk: one 64-byte line of codes per row.
pub const CHUNK_COLS: usize = 128;
/// Columns per scale.
pub const SCALE_COLS: usize = 32;
const BLOCKS_PER_CHUNK: usize = CHUNK_COLS / SCALE_COLS;
/// Lines of one group's chunk: a code line per row, then the 32 (row, block)
/// scale steps as dwords (the step in both halves, so one 32-bit broadcast
/// spreads it over every word).
pub(crate) const CHUNK_LINES: usize = GROUP_ROWS + GROUP_ROWS * BLOCKS_PER_CHUNK * 4 / LINE_BYTES;
/// Scale exponents kept: every e2m1 magnitude (bf16 exponents 126..=129) stays
/// a normal bf16 after the step.
const SCALE_EXP_MIN: i32 = -125;
const SCALE_EXP_MAX: i32 = 125;
/// Most rows a batch may have to run the grouped kernel, each weight decoded
/// once per pass of up to four x rows; larger ones decode a tile of rows
/// into f32 once and share it (the linear's buffered plan, through
/// [`decode_rows`]). The decoded tile pays off sooner on short rows: on an
/// Intel Xeon core (one thread, every row count measured against both
/// plans) the crossover was past 4 rows at 256 columns, past 8 at 512 and
/// past 12 from 1024 columns on (a 16-row tile then wins).
#[cfg(target_arch = "x86_64")]
fn kernel_max_batch(cols: usize) -> usize {
    (cols / 64).clamp(4, 12)
}

/// An FP4 weight of `rows × cols` in groups of [`GROUP_ROWS`] rows (the last
/// group padded with zero codes).
#[derive(Clone)]
pub struct Fp4Groups {
    rows: usize,
    cols: usize,
    lines: Vec<Line>,
}

impl std::fmt::Debug for Fp4Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp4Groups({} × {}, {} bytes)", self.rows, self.cols, self.storage_bytes())
    }
}

/// Word `i` of a row's line holds, in nibble `k`, column `32k + WORD_COLUMN[i]`:
/// odd words columns `0..16` (the high half of each dword, which masking
/// turns into an f32), even words columns `16..32` (shifted up into one).
const WORD_COLUMN: [usize; 32] = {
    let mut column = [0; 32];
    let mut i = 0;
    while i < 32 {
        column[i] = if i % 2 == 1 { i / 2 } else { 16 + i / 2 };
        i += 1;
    }
    column
};

/// The word holding column `column` (`0..32`) of each block: the inverse of
/// [`WORD_COLUMN`].
fn word_of_column(column: usize) -> usize {
    if column < 16 {
        2 * column + 1
    } else {
        2 * (column - 16)
    }
}

/// Word `i` of a code line.
fn line_word(line: &[u8; LINE_BYTES], i: usize) -> u16 {
    u16::from_le_bytes([line[2 * i], line[2 * i + 1]])
}

/// One row's 32 words of a chunk from its 64 bytes of published pairs.
/// Block `k`'s 16 bytes, read as a little-endian integer, hold its 32 codes
/// as nibbles in column order.
fn chunk_words(pairs: &[u8; CHUNK_COLS / 2]) -> [u16; 32] {
    let mut words = [0u16; 32];
    for k in 0..BLOCKS_PER_CHUNK {
        let block = u128::from_le_bytes(pairs[16 * k..][..16].try_into().expect("16 bytes"));
        for (i, word) in words.iter_mut().enumerate() {
            *word |= ((block >> (4 * WORD_COLUMN[i])) as u16 & 0xf) << (4 * k);
        }
    }
    words
}

/// The bf16 exponent step of scale `s`, if `s` is a power of two in range.
fn scale_step(s: f32) -> Option<u16> {
    let bits = s.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32 - 127;
    let power_of_two = bits >> 31 == 0 && bits & 0x7f_ffff == 0 && (bits >> 23) & 0xff != 0;
    (power_of_two && (SCALE_EXP_MIN..=SCALE_EXP_MAX).contains(&exp)).then_some((exp << 7) as i16 as u16)
}

/// The scale whose [`scale_step`] is `step`.
fn step_scale(step: u16) -> f32 {
    let exp = (step as i16 as i32) >> 7;
    f32::from_bits(((exp + 127) as u32) << 23)
}

impl Fp4Groups {
    /// Regroup published FP4 weights (`data`: two codes per byte, even column
    /// in the low nibble; `scales`: one per `block_cols` columns of a row).
    /// `None` unless the scales cover 32 columns, `cols` is a whole number of
    /// chunks and every scale is a power of two that bf16 holds with every
    /// e2m1 magnitude.
    pub fn pack(rows: usize, cols: usize, data: &[u8], scales: &[f32], block_cols: usize) -> Option<Self> {
        if block_cols != SCALE_COLS || cols == 0 || !cols.is_multiple_of(CHUNK_COLS) {
            return None;
        }
        assert!(data.len() >= rows * cols / 2 && scales.len() >= rows * cols / SCALE_COLS, "fp4 weight size");
        let steps: Vec<u16> =
            scales[..rows * cols / SCALE_COLS].iter().map(|&s| scale_step(s)).collect::<Option<_>>()?;
        let chunks = cols / CHUNK_COLS;
        let groups = rows.div_ceil(GROUP_ROWS);
        let mut lines = vec![Line([0; LINE_BYTES]); groups * chunks * CHUNK_LINES];
        lines.par_chunks_mut(chunks * CHUNK_LINES).enumerate().for_each(|(g, group)| {
            for (ch, chunk) in group.chunks_exact_mut(CHUNK_LINES).enumerate() {
                let (codes, scale_lines) = chunk.split_at_mut(GROUP_ROWS);
                for (j, line) in codes.iter_mut().enumerate() {
                    let r = g * GROUP_ROWS + j;
                    if r >= rows {
                        break;
                    }
                    let pairs = &data[r * cols / 2 + ch * CHUNK_COLS / 2..][..CHUNK_COLS / 2];
                    let words = chunk_words(pairs.try_into().expect("a chunk of pairs"));
                    for (bytes, word) in line.0.chunks_exact_mut(2).zip(words) {
                        bytes.copy_from_slice(&word.to_le_bytes());
                    }
                    for k in 0..BLOCKS_PER_CHUNK {
                        let step = steps[r * cols / SCALE_COLS + ch * BLOCKS_PER_CHUNK + k] as u32;
                        let at = (j * BLOCKS_PER_CHUNK + k) * 4;
                        scale_lines[at / LINE_BYTES].0[at % LINE_BYTES..][..4]
                            .copy_from_slice(&(step | step << 16).to_le_bytes());
                    }
                }
            }
        });
        Some(Self { rows, cols, lines })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (codes, scale steps and the padding rows of the last group).
    pub fn storage_bytes(&self) -> usize {
        self.lines.len() * LINE_BYTES
    }

    /// The lines of group `g`: its chunks in column order.
    pub(crate) fn group_lines(&self, g: usize) -> &[Line] {
        let per_group = self.cols / CHUNK_COLS * CHUNK_LINES;
        &self.lines[g * per_group..][..per_group]
    }

    /// Row `r`'s code line in chunk `ch`.
    fn row_line(&self, r: usize, ch: usize) -> &[u8; LINE_BYTES] {
        &self.group_lines(r / GROUP_ROWS)[ch * CHUNK_LINES + r % GROUP_ROWS].0
    }

    /// Row `r`'s scale step of block `b` (columns `32b..32b + 32`).
    fn row_step(&self, r: usize, b: usize) -> u16 {
        let chunk = &self.group_lines(r / GROUP_ROWS)[b / BLOCKS_PER_CHUNK * CHUNK_LINES..][..CHUNK_LINES];
        let at = (r % GROUP_ROWS * BLOCKS_PER_CHUNK + b % BLOCKS_PER_CHUNK) * 4;
        let bytes = &chunk[GROUP_ROWS + at / LINE_BYTES].0[at % LINE_BYTES..];
        u16::from_le_bytes([bytes[0], bytes[1]])
    }

    /// The FP4 code of column `c` of row `r`.
    pub fn code(&self, r: usize, c: usize) -> u8 {
        assert!(r < self.rows && c < self.cols, "({r}, {c}) outside {} × {}", self.rows, self.cols);
        let line = self.row_line(r, c / CHUNK_COLS);
        let k = (c % CHUNK_COLS) / SCALE_COLS;
        ((line_word(line, word_of_column(c % SCALE_COLS)) >> (4 * k)) & 0xf) as u8
    }

    /// The scale of columns `32b..32b + 32` of row `r`.
    pub fn scale(&self, r: usize, b: usize) -> f32 {
        assert!(r < self.rows && b < self.cols / SCALE_COLS, "scale ({r}, {b})");
        step_scale(self.row_step(r, b))
    }

    /// Columns `k0..k0 + dst.len()` of row `r`, dequantised to exactly the
    /// values of the published layout. `k0` and the length are multiples of 16.
    pub(crate) fn decode_span_portable(&self, r: usize, k0: usize, dst: &mut [f32]) {
        assert!(k0.is_multiple_of(16) && dst.len().is_multiple_of(16) && k0 + dst.len() <= self.cols, "fp4 span");
        for (piece, out) in dst.chunks_exact_mut(16).enumerate() {
            let c0 = k0 + 16 * piece;
            let line = self.row_line(r, c0 / CHUNK_COLS);
            let k = (c0 % CHUNK_COLS) / SCALE_COLS;
            let scale = step_scale(self.row_step(r, c0 / SCALE_COLS));
            for (m, o) in out.iter_mut().enumerate() {
                let word = line_word(line, word_of_column(c0 % SCALE_COLS + m));
                *o = FP4_E2M1_VALUES[((word >> (4 * k)) & 0xf) as usize] * scale;
            }
        }
    }

    /// Row `r` dequantised (the values of [`crate::Linear::dequantize_row`]
    /// on the published layout).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row {r} of {} × {}", self.rows, self.cols);
        self.decode_span_portable(r, 0, out);
    }

    /// The published layout back: `(codes, scales)`.
    pub fn to_published(&self) -> (Vec<u8>, Vec<f32>) {
        let (rows, cols) = (self.rows, self.cols);
        let mut data = vec![0u8; rows * cols / 2];
        for (r, row) in data.chunks_exact_mut(cols / 2).enumerate() {
            // The inverse of `chunk_words`: each word's nibbles back to their columns.
            for (ch, pairs) in row.chunks_exact_mut(CHUNK_COLS / 2).enumerate() {
                let line = self.row_line(r, ch);
                for (i, &column) in WORD_COLUMN.iter().enumerate() {
                    for k in 0..BLOCKS_PER_CHUNK {
                        let (c, code) = (SCALE_COLS * k + column, (line_word(line, i) >> (4 * k)) as u8 & 0xf);
                        pairs[c / 2] |= code << (4 * (c % 2));
                    }
                }
            }
        }
        let blocks = cols / SCALE_COLS;
        let scales = (0..rows * blocks).map(|i| self.scale(i / blocks, i % blocks)).collect();
        (data, scales)
    }
}

/// `out[i * rows + r]` for `n` rows of `x` (row-major) with the grouped
/// kernel, spread over threads by groups above `parallel_min_fmas`
/// multiply-adds. `false` (nothing written) where the kernel does not apply:
/// no AVX-512BW, or a batch better served by decoded tiles.
pub(crate) fn forward_decoded(
    groups: &Fp4Groups,
    backend: Backend,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    parallel_min_fmas: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(backend.isa(), crate::Isa::Avx512 | crate::Isa::Avx512Vbmi) && n <= kernel_max_batch(groups.cols) {
        let (rows, cols) = (groups.rows, groups.cols);
        assert!(x.len() == n * cols && out.len() == n * rows, "grouped fp4 forward");
        crate::row_groups::forward_by_groups(rows, n, out, n * rows * cols >= parallel_min_fmas, |g, sums| {
            // SAFETY: the backend's path has AVX-512F and BW (checked by
            // `Backend::new`); the group holds `cols / 128` chunks and each x row `cols` values.
            unsafe { group_sums_into(groups.group_lines(g), x, n, cols, sums) }
        });
        return true;
    }
    let _ = (groups, backend, x, n, out, parallel_min_fmas);
    false
}

/// Every x row's dot products with the eight rows of a group, into
/// `sums[i * 8 + j]`. A pass takes up to four x rows and as many group rows
/// as their accumulators leave registers for (1 × 8, 2 × 8, 3 × 4, 4 × 2);
/// six x rows in one pass (6 × 1) spilled and ran slower than two of three.
///
/// # Safety
/// As [`crate::simd::avx512_groups::group_dot`].
#[cfg(target_arch = "x86_64")]
unsafe fn group_sums_into(lines: &[Line], x: &[f32], n: usize, cols: usize, sums: &mut [f32]) {
    use crate::row_groups::{pass_rows, store_pass};
    use crate::simd::avx512_groups::group_dot;
    // Each pass with as many group rows as its accumulators leave registers for.
    let mut i0 = 0;
    while i0 < n {
        let part = pass_rows(n - i0);
        let row = |i: usize| &x[(i0 + i) * cols..][..cols];
        macro_rules! passes {
            ($mr:literal, $rp:literal) => {{
                for j0 in (0..GROUP_ROWS).step_by($rp) {
                    let got = group_dot::<$mr, $rp>(lines, std::array::from_fn(|i| row(i)), j0);
                    store_pass(sums, (i0, j0), &got);
                }
            }};
        }
        match part {
            1 => passes!(1, 8),
            2 => passes!(2, 8),
            3 => passes!(3, 4),
            _ => passes!(4, 2),
        }
        i0 += part;
    }
}

/// Columns `k0..k0 + len` of rows `rows` dequantised (multiples of 16): row
/// `rows.start + i` at `dst[i * stride..][..len]`. On AVX-512 the rows of one
/// group are decoded together, in the order the group stores its lines.
pub(crate) fn decode_rows(
    groups: &Fp4Groups,
    backend: Backend,
    rows: std::ops::Range<usize>,
    (k0, len): (usize, usize),
    dst: &mut [f32],
    stride: usize,
) {
    assert!(rows.end <= groups.rows, "rows {rows:?} of {}", groups.rows);
    assert!(rows.is_empty() || dst.len() >= (rows.len() - 1) * stride + len, "rows past the output");
    #[cfg(target_arch = "x86_64")]
    if matches!(backend.isa(), crate::Isa::Avx512 | crate::Isa::Avx512Vbmi) {
        assert!(k0.is_multiple_of(16) && len.is_multiple_of(16) && k0 + len <= groups.cols, "fp4 span");
        crate::row_groups::by_group(rows, |g, within, first| {
            let out = &mut dst[first * stride..];
            // SAFETY: as in `forward_decoded`; the kernel asserts the span's bounds.
            unsafe { crate::simd::avx512_groups::decode_rows(groups.group_lines(g), within, (k0, len), out, stride) };
        });
        return;
    }
    for (i, r) in rows.enumerate() {
        decode_span(groups, backend, r, k0, &mut dst[i * stride..][..len]);
    }
}

/// Columns `k0..k0 + dst.len()` of row `r` dequantised (multiples of 16), on
/// the backend's path.
pub(crate) fn decode_span(groups: &Fp4Groups, backend: Backend, r: usize, k0: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if matches!(backend.isa(), crate::Isa::Avx512 | crate::Isa::Avx512Vbmi) {
        assert!(k0.is_multiple_of(16) && dst.len().is_multiple_of(16) && k0 + dst.len() <= groups.cols, "fp4 span");
        // SAFETY: as in `forward_decoded`; the kernel asserts the span's bounds.
        unsafe { crate::simd::avx512_groups::decode_span(groups.group_lines(r / GROUP_ROWS), r % GROUP_ROWS, k0, dst) };
        return;
    }
    let _ = backend;
    groups.decode_span_portable(r, k0, dst);
}
