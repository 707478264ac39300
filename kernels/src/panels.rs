//! Weights laid out for the column-order linear kernels.
//!
//! A matrix's rows are cut into groups of [`GROUP_ROWS`] (the last one padded
//! with zero weights) and each group is stored column by column: the 64
//! weights of column `c` are contiguous. A kernel then broadcasts `x[c]`
//! against four 16-lane vectors of outputs, so every output is one chain of
//! fused multiply-adds in column order whatever the path, the batch or the
//! thread count ([`crate::Linear::forward_reference`] is that chain).
//!
//! FP4 weights keep their e2m1 codes and each row's block scales: an output
//! sums each block of x times the e2m1 values, then adds that sum times the
//! row's scale. A lane's scale cannot be folded into a table shared by 64
//! rows, and one multiply per block instead of one per weight keeps the
//! batch-1 decode at the speed of memory.

use bytes::Bytes;

use crate::dtype::{bf16_to_f32, fp8_e4m3_to_f32, FP4_E2M1_VALUES};
use crate::linear::WeightFormat;

/// Output rows per group: four 16-lane vectors.
pub const GROUP_ROWS: usize = 64;

/// 2^120: an e4m3 code shifted under an f32 exponent reads as its value
/// times 2^-120; the AVX-512 decode multiplies it by `scale · 2^120`.
pub(crate) const POW2_120: f32 = 1.329_228e36;

/// One cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// Bytes that start on a cache line, so every 64-byte column of a group is
/// one line.
#[derive(Clone)]
pub(crate) struct Lines {
    lines: Vec<Line>,
    len: usize,
}

impl Lines {
    fn zeroed(len: usize) -> Self {
        Self { lines: vec![Line([0; 64]); len.div_ceil(64)], len }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }

    pub(crate) fn f32s(&self) -> &[f32] {
        // SAFETY: lines are 64-byte aligned, every bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len / 4) }
    }

    fn f32s_mut(&mut self) -> &mut [f32] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len / 4) }
    }

    pub(crate) fn u16s(&self) -> &[u16] {
        // SAFETY: lines are 64-byte aligned, every bit pattern is a u16.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len / 2) }
    }

    fn u16s_mut(&mut self) -> &mut [u16] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len / 2) }
    }
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lines({} bytes)", self.len)
    }
}

/// A weight matrix in groups of 64 rows, column by column.
#[derive(Clone, Debug)]
pub struct Panels {
    rows: usize,
    cols: usize,
    pub(crate) codes: Codes,
    /// Bytes of the published layout: codes, and one byte per scale.
    published_bytes: usize,
}

/// The stored weights of [`Panels`]. Lane `o` of group `g` is row `g · 64 + o`.
#[derive(Clone, Debug)]
pub(crate) enum Codes {
    /// Value of (group `g`, column `c`, lane `o`) at `(g · cols + c) · 64 + o`.
    F32(Lines),
    /// bf16 bits in the order of `F32`.
    Bf16(Lines),
    /// e4m3 codes, 64 bytes a column in the order of `F32` but each lane at
    /// its [`lane_slot`], and each lane's scale over column
    /// block `b` at `(g · col_blocks + b) · 64 + o`. `wide`: no code is NaN and
    /// every `scale · 2^120` is finite, so the AVX-512 decode applies.
    /// `x_scales[g · col_blocks + b]`: `scale · 2^120` where every row of the
    /// group shares a power-of-two scale of at least 2^-120 over block `b`
    /// (x may then carry it), else 0.
    Fp8 { codes: Lines, scales: Vec<f32>, x_scales: Vec<f32>, block_cols: usize, wide: bool },
    /// Column pair `q` of group `g` is the 64 bytes at `(g · cols / 2 + q) · 64`:
    /// lane `o`'s byte (at its [`lane_slot`]) holds its code of column `2q` in the low
    /// nibble and of `2q + 1` in the high one. Each lane's scale over block `b`
    /// is at `(g · blocks + b) · 64 + o`.
    Fp4 { codes: Lines, scales: Vec<f32>, block_cols: usize },
}

/// Whether x may carry an FP8 scale: `x · (scale · 2^120)` times the code's
/// value · 2^-120 is then exactly x times the dequantised weight. A power of
/// two at least 2^-120 keeps both products exact (the weight stays above
/// 2^-129, where f32 still holds e4m3's bits) as long as `x · scale · 2^120`
/// does not overflow, which the kernel checks per call.
fn carried_by_x(scale: f32) -> bool {
    let exponent = (scale.to_bits() >> 23) & 0xff;
    scale.to_bits() & 0x7f_ffff == 0 && (7..255).contains(&exponent)
}

/// Fill each group's `columns` runs of 64 (`out` holds them group by group)
/// with `put(group, column, run)`, the groups spread over the threads. A
/// run reads one value from each of 64 rows, so consecutive runs reuse the
/// rows' cache lines and every write is sequential.
fn by_group<T: Send>(out: &mut [T], columns: usize, put: impl Fn(usize, usize, &mut [T]) + Sync) {
    use rayon::prelude::*;
    if columns == 0 {
        return;
    }
    out.par_chunks_mut(columns * GROUP_ROWS).enumerate().for_each(|(g, group)| {
        for (c, run) in group.chunks_exact_mut(GROUP_ROWS).enumerate() {
            put(g, c, run);
        }
    });
}

/// Byte of lane `o` within the 64 bytes of an FP8 column or an FP4 column
/// pair. Each 32-byte half widens to 32 words whose even words are lanes
/// `0..16` of the half and odd words lanes `16..32`, so two shifts split the
/// decoded words into two f32 vectors in lane order.
pub(crate) const fn lane_slot(o: usize) -> usize {
    let (half, i) = (o / 32, o % 32);
    32 * half + if i < 16 { 2 * i } else { 2 * (i - 16) + 1 }
}

impl Panels {
    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(crate) fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP_ROWS)
    }

    /// The weights of a published layout (`rows × cols`, row-major), with the
    /// same values. Panics on a format the published layout cannot hold.
    pub fn pack(rows: usize, cols: usize, format: &WeightFormat) -> Self {
        let groups = rows.div_ceil(GROUP_ROWS);
        let lanes = groups * GROUP_ROWS;
        // (group, lane, row) of every row; padding lanes keep zero weights.
        let lanes_of_rows = || (0..rows).map(|r| (r / GROUP_ROWS, r % GROUP_ROWS, r));
        let live = |g: usize| GROUP_ROWS.min(rows - g * GROUP_ROWS);
        let published_bytes = match format {
            WeightFormat::F32(_) => rows * cols * 4,
            WeightFormat::Bf16(_) => rows * cols * 2,
            WeightFormat::Fp8 { scales, .. } => rows * cols + scales.len(),
            WeightFormat::Fp4 { scales, .. } => rows * cols / 2 + scales.len(),
            WeightFormat::Panels(panels) => panels.published_bytes,
        };
        let codes = match format {
            WeightFormat::F32(d) => {
                assert!(d.len() >= rows * cols, "f32 weight size");
                let mut values = Lines::zeroed(lanes * cols * 4);
                by_group(values.f32s_mut(), cols, |g, c, column| {
                    for (o, v) in column.iter_mut().enumerate().take(live(g)) {
                        *v = d[(g * GROUP_ROWS + o) * cols + c];
                    }
                });
                Codes::F32(values)
            }
            WeightFormat::Bf16(d) => {
                assert!(d.len() >= rows * cols * 2, "bf16 weight size");
                let mut bits = Lines::zeroed(lanes * cols * 2);
                by_group(bits.u16s_mut(), cols, |g, c, column| {
                    for (o, v) in column.iter_mut().enumerate().take(live(g)) {
                        let at = ((g * GROUP_ROWS + o) * cols + c) * 2;
                        *v = u16::from_le_bytes([d[at], d[at + 1]]);
                    }
                });
                Codes::Bf16(bits)
            }
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free } => {
                let (block_rows, block_cols) = (*block_rows, *block_cols);
                let col_blocks = cols.div_ceil(block_cols);
                assert!(data.len() >= rows * cols, "fp8 weight size");
                assert!(scales.len() >= rows.div_ceil(block_rows) * col_blocks, "fp8 scale grid");
                let mut codes = Lines::zeroed(lanes * cols);
                let mut lane_scales = vec![0.0f32; lanes * col_blocks];
                by_group(codes.bytes_mut(), cols, |g, c, column| {
                    for o in 0..live(g) {
                        column[lane_slot(o)] = data[(g * GROUP_ROWS + o) * cols + c];
                    }
                });
                for (g, o, r) in lanes_of_rows() {
                    for b in 0..col_blocks {
                        lane_scales[(g * col_blocks + b) * GROUP_ROWS + o] = scales[(r / block_rows) * col_blocks + b];
                    }
                }
                let wide = *nan_free && lane_scales.iter().all(|s| (s * POW2_120).is_finite());
                let x_scales = (0..groups * col_blocks)
                    .map(|i| {
                        let live = GROUP_ROWS.min(rows - i / col_blocks * GROUP_ROWS);
                        let lanes = &lane_scales[i * GROUP_ROWS..][..live];
                        let shared = lanes.iter().all(|&s| s == lanes[0]);
                        if wide && shared && carried_by_x(lanes[0]) {
                            lanes[0] * POW2_120
                        } else {
                            0.0
                        }
                    })
                    .collect();
                Codes::Fp8 { codes, scales: lane_scales, x_scales, block_cols, wide }
            }
            WeightFormat::Fp4 { data, scales, block_cols } => {
                let block_cols = *block_cols;
                assert!(cols.is_multiple_of(2) && block_cols > 0 && cols.is_multiple_of(block_cols), "fp4 blocks");
                let blocks = cols / block_cols;
                assert!(data.len() >= rows * cols / 2 && scales.len() >= rows * blocks, "fp4 weight size");
                let mut codes = Lines::zeroed(lanes * cols / 2);
                let mut lane_scales = vec![0.0f32; lanes * blocks];
                by_group(codes.bytes_mut(), cols / 2, |g, q, pair| {
                    for o in 0..live(g) {
                        pair[lane_slot(o)] = data[(g * GROUP_ROWS + o) * cols / 2 + q];
                    }
                });
                for (g, o, r) in lanes_of_rows() {
                    for b in 0..blocks {
                        lane_scales[(g * blocks + b) * GROUP_ROWS + o] = scales[r * blocks + b];
                    }
                }
                Codes::Fp4 { codes, scales: lane_scales, block_cols }
            }
            WeightFormat::Panels(panels) => {
                assert!(panels.rows == rows && panels.cols == cols, "panels of another shape");
                return panels.clone();
            }
        };
        Self { rows, cols, codes, published_bytes }
    }

    /// The published layout of these weights, with the same values (FP8
    /// scales one row per scale row).
    pub fn to_published(&self) -> WeightFormat {
        let (rows, cols) = (self.rows, self.cols);
        let at = |r: usize, c: usize| (r / GROUP_ROWS * cols + c) * GROUP_ROWS + r % GROUP_ROWS;
        match &self.codes {
            Codes::F32(values) => {
                let v = values.f32s();
                WeightFormat::F32((0..rows * cols).map(|i| v[at(i / cols.max(1), i % cols.max(1))]).collect())
            }
            Codes::Bf16(bits) => {
                let v = bits.u16s();
                let bytes: Vec<u8> =
                    (0..rows * cols).flat_map(|i| v[at(i / cols.max(1), i % cols.max(1))].to_le_bytes()).collect();
                WeightFormat::Bf16(Bytes::from(bytes))
            }
            Codes::Fp8 { codes, scales, block_cols, .. } => {
                let v = codes.bytes();
                let slot = |r: usize, c: usize| at(r, c) - r % GROUP_ROWS + lane_slot(r % GROUP_ROWS);
                let data: Vec<u8> = (0..rows * cols).map(|i| v[slot(i / cols.max(1), i % cols.max(1))]).collect();
                let col_blocks = cols.div_ceil(*block_cols);
                let row_scales = (0..rows)
                    .flat_map(|r| (0..col_blocks).map(move |b| (r, b)))
                    .map(|(r, b)| scales[(r / GROUP_ROWS * col_blocks + b) * GROUP_ROWS + r % GROUP_ROWS])
                    .collect();
                WeightFormat::fp8(Bytes::from(data), row_scales, 1, *block_cols)
            }
            Codes::Fp4 { codes, scales, block_cols } => {
                let v = codes.bytes();
                let data: Vec<u8> = (0..rows * cols / 2)
                    .map(|i| {
                        let (r, q) = (i / (cols / 2), i % (cols / 2));
                        v[(r / GROUP_ROWS * cols / 2 + q) * GROUP_ROWS + lane_slot(r % GROUP_ROWS)]
                    })
                    .collect();
                let blocks = cols / block_cols;
                let row_scales = (0..rows)
                    .flat_map(|r| (0..blocks).map(move |b| (r, b)))
                    .map(|(r, b)| scales[(r / GROUP_ROWS * blocks + b) * GROUP_ROWS + r % GROUP_ROWS])
                    .collect();
                WeightFormat::Fp4 { data: Bytes::from(data), scales: row_scales, block_cols: *block_cols }
            }
        }
    }

    /// Bytes held (codes and scales, with the last group's padding).
    pub fn storage_bytes(&self) -> usize {
        match &self.codes {
            Codes::F32(v) | Codes::Bf16(v) => v.len,
            Codes::Fp8 { codes, scales, x_scales, .. } => codes.len + (scales.len() + x_scales.len()) * 4,
            Codes::Fp4 { codes, scales, .. } => codes.len + scales.len() * 4,
        }
    }

    /// Bytes of the published layout these weights came from: codes, and
    /// one byte per (power-of-two) scale.
    pub fn published_bytes(&self) -> usize {
        self.published_bytes
    }

    /// Whether the weights are codes with block scales.
    pub fn is_quantized(&self) -> bool {
        matches!(self.codes, Codes::Fp8 { .. } | Codes::Fp4 { .. })
    }

    /// Whether the weights are FP4 codes.
    pub fn is_fp4(&self) -> bool {
        matches!(self.codes, Codes::Fp4 { .. })
    }

    /// FP4's block width, for the block-scaled definition.
    pub(crate) fn fp4_block_cols(&self) -> Option<usize> {
        match &self.codes {
            Codes::Fp4 { block_cols, .. } => Some(*block_cols),
            _ => None,
        }
    }

    /// Row `r`'s weights, dequantised (FP4 with its scale applied).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols, "row {r} of {} × {}", self.rows, self.cols);
        let (g, o, cols) = (r / GROUP_ROWS, r % GROUP_ROWS, self.cols);
        let at = |c: usize| (g * cols + c) * GROUP_ROWS + o;
        match &self.codes {
            Codes::F32(v) => out.iter_mut().enumerate().for_each(|(c, d)| *d = v.f32s()[at(c)]),
            Codes::Bf16(v) => out.iter_mut().enumerate().for_each(|(c, d)| *d = bf16_to_f32(v.u16s()[at(c)])),
            Codes::Fp8 { codes, scales, block_cols, .. } => {
                let col_blocks = cols.div_ceil(*block_cols);
                for (c, d) in out.iter_mut().enumerate() {
                    let scale = scales[(g * col_blocks + c / block_cols) * GROUP_ROWS + o];
                    *d = fp8_e4m3_to_f32(codes.bytes()[at(c) - o + lane_slot(o)]) * scale;
                }
            }
            Codes::Fp4 { scales, block_cols, .. } => {
                let (values, _) = self.fp4_row(r);
                let blocks = cols / block_cols;
                for (c, d) in out.iter_mut().enumerate() {
                    *d = values[c] * scales[(g * blocks + c / block_cols) * GROUP_ROWS + o];
                }
            }
        }
    }

    /// FP4 row `r`: its e2m1 values (unscaled) and its block scales.
    pub(crate) fn fp4_row(&self, r: usize) -> (Vec<f32>, Vec<f32>) {
        let Codes::Fp4 { codes, scales, block_cols } = &self.codes else { panic!("not FP4") };
        let (g, o, cols) = (r / GROUP_ROWS, r % GROUP_ROWS, self.cols);
        let mut values = vec![0.0f32; cols];
        for q in 0..cols / 2 {
            let byte = codes.bytes()[(g * cols / 2 + q) * GROUP_ROWS + lane_slot(o)];
            values[2 * q] = FP4_E2M1_VALUES[(byte & 15) as usize];
            values[2 * q + 1] = FP4_E2M1_VALUES[(byte >> 4) as usize];
        }
        let blocks = cols / block_cols;
        let row_scales = (0..blocks).map(|b| scales[(g * blocks + b) * GROUP_ROWS + o]).collect();
        (values, row_scales)
    }
}

/// Columns `k0..k0 + kc` of group `g` as f32, column by column into `tile`
/// (`kc · 64` values; FP4: the e2m1 values, unscaled). The plain-Rust decode
/// every path can run; `F32` needs none (its values are read in place).
#[inline(always)]
pub(crate) fn decode_tile(codes: &Codes, cols: usize, g: usize, k0: usize, kc: usize, tile: &mut [f32]) {
    let tile = &mut tile[..kc * GROUP_ROWS];
    let first = (g * cols + k0) * GROUP_ROWS;
    match codes {
        Codes::F32(values) => tile.copy_from_slice(&values.f32s()[first..][..kc * GROUP_ROWS]),
        Codes::Bf16(bits) => {
            for (d, &b) in tile.iter_mut().zip(&bits.u16s()[first..]) {
                *d = f32::from_bits(u32::from(b) << 16);
            }
        }
        Codes::Fp8 { codes, scales, block_cols, .. } => {
            let col_blocks = cols.div_ceil(*block_cols);
            let codes = &codes.bytes()[first..];
            for (c, column) in tile.chunks_exact_mut(GROUP_ROWS).enumerate() {
                let lane_scales = &scales[(g * col_blocks + (k0 + c) / block_cols) * GROUP_ROWS..][..GROUP_ROWS];
                let column_codes = &codes[c * GROUP_ROWS..][..GROUP_ROWS];
                for (o, (d, &s)) in column.iter_mut().zip(lane_scales).enumerate() {
                    *d = fp8_e4m3_to_f32(column_codes[lane_slot(o)]) * s;
                }
            }
        }
        Codes::Fp4 { codes, .. } => {
            assert!(k0.is_multiple_of(2) && kc.is_multiple_of(2), "fp4 tiles hold column pairs");
            let codes = &codes.bytes()[(g * cols / 2 + k0 / 2) * GROUP_ROWS..];
            for (q, pair) in tile.chunks_exact_mut(2 * GROUP_ROWS).enumerate() {
                let bytes = &codes[q * GROUP_ROWS..][..GROUP_ROWS];
                let (even, odd) = pair.split_at_mut(GROUP_ROWS);
                for o in 0..GROUP_ROWS {
                    let b = bytes[lane_slot(o)];
                    even[o] = FP4_E2M1_VALUES[(b & 15) as usize];
                    odd[o] = FP4_E2M1_VALUES[(b >> 4) as usize];
                }
            }
        }
    }
}
