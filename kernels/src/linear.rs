//! Linear layers (`y = x · Wᵀ`) over the weight formats of DeepSeek checkpoints.
//!
//! Each output is one chain of fused multiply-adds over the columns in order
//! ([`Linear::forward_reference`]), whatever the batch, the row's place in
//! it, the thread count or the code path: results are batch-invariant. The
//! kernels read weights laid out by [`Linear::into_decode_layout`]
//! ([`crate::panels`]); quantised weights are decoded inside them, a tile at a
//! time, never into a full f32 copy.

use bytes::Bytes;

use crate::aligned::AlignedF32;
use crate::dtype::{bf16_to_f32, fp8_e4m3_to_f32, FP4_E2M1_VALUES};
use crate::panels::Panels;
use crate::simd::Backend;
pub use crate::simd::Isa;

/// Weight rows of one tile of [`dot_rows`].
const TILE_ROWS: usize = 16;
/// Below this many multiply-adds a call stays on the calling thread. Called on
/// a pool worker ([`crate::workers::on_workers`]), a split of 2^18 (a 512 × 512
/// matrix at batch 1, 128 KiB of FP4 codes) already pays for handing half to
/// another worker; from outside the pool, waking the workers cost more.
const PARALLEL_MIN_FMAS: usize = 1 << 18;

/// How a weight matrix of `rows × cols` (out × in, row-major) is stored.
#[derive(Clone, Debug)]
pub enum WeightFormat {
    F32(Vec<f32>),
    /// Little-endian bf16, `rows * cols * 2` bytes.
    Bf16(Bytes),
    /// FP8 e4m3fn, one byte per weight, with one scale per
    /// `block_rows × block_cols` block: `scales[(r / block_rows) * ceil(cols / block_cols) + c / block_cols]`.
    /// Build it with [`WeightFormat::fp8`], which finds `nan_free`.
    Fp8 {
        data: Bytes,
        scales: Vec<f32>,
        block_rows: usize,
        block_cols: usize,
        /// No code is NaN (0x7f, 0xff): the fused kernels then skip their own
        /// check. Setting it for codes that hold a NaN turns that NaN into a number.
        nan_free: bool,
    },
    /// FP4 e2m1, two weights per byte (even column in the low nibble), one scale per
    /// `block_cols` consecutive columns of a row: `scales[r * (cols / block_cols) + c / block_cols]`.
    Fp4 {
        data: Bytes,
        scales: Vec<f32>,
        block_cols: usize,
    },
    /// Any of the above laid out for the column-order kernels (see
    /// [`crate::panels`]); the same values.
    Panels(Panels),
}

impl WeightFormat {
    /// Whether the weights are codes with block scales (FP8 or FP4, in any layout).
    pub fn is_quantized(&self) -> bool {
        match self {
            WeightFormat::F32(_) | WeightFormat::Bf16(_) => false,
            WeightFormat::Panels(panels) => panels.is_quantized(),
            _ => true,
        }
    }

    /// FP8 weights, with `nan_free` found by looking at every code once.
    pub fn fp8(data: Bytes, scales: Vec<f32>, block_rows: usize, block_cols: usize) -> Self {
        // A branch-free fold per chunk: the whole matrix is read once, at load.
        let nan_free = data.chunks(4096).all(|chunk| !chunk.iter().fold(false, |any, &b| any | (b & 0x7f == 0x7f)));
        WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free }
    }
}

/// A weight matrix of `rows` outputs by `cols` inputs.
#[derive(Clone, Debug)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
}

impl Linear {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(data.len(), rows * cols, "f32 weight of {rows}x{cols}");
        Self { rows, cols, format: WeightFormat::F32(data) }
    }

    /// Bytes this weight occupies in memory.
    pub fn storage_bytes(&self) -> usize {
        match &self.format {
            WeightFormat::F32(d) => d.len() * 4,
            WeightFormat::Bf16(d) => d.len(),
            WeightFormat::Fp8 { data, scales, .. } | WeightFormat::Fp4 { data, scales, .. } => {
                data.len() + scales.len() * 4
            }
            WeightFormat::Panels(panels) => panels.storage_bytes(),
        }
    }

    /// This weight in the layout the kernels read ([`Panels`]), on every
    /// CPU: the values, and every output's bits, stay the same. A weight in a
    /// published layout is laid out afresh by every [`Linear::forward`] call.
    pub fn into_decode_layout(self) -> Self {
        if matches!(self.format, WeightFormat::Panels(_)) {
            return self;
        }
        self.check_format();
        let panels = Panels::pack(self.rows, self.cols, &self.format);
        Self { format: WeightFormat::Panels(panels), ..self }
    }

    /// This weight in its published layout (row-major codes; FP8 scales one
    /// row per scale row when it was laid out for the kernels).
    pub fn into_published(self) -> Self {
        match &self.format {
            WeightFormat::Panels(panels) => Self { format: panels.to_published(), ..self },
            _ => self,
        }
    }

    /// Dequantise row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.cols);
        let cols = self.cols;
        match &self.format {
            WeightFormat::F32(d) => out.copy_from_slice(&d[r * cols..(r + 1) * cols]),
            WeightFormat::Bf16(d) => {
                let bytes = &d[r * cols * 2..(r + 1) * cols * 2];
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } => {
                let blocks_per_row = cols.div_ceil(*block_cols);
                let scale_row = &scales[(r / block_rows) * blocks_per_row..][..blocks_per_row];
                for (c, (o, &b)) in out.iter_mut().zip(&data[r * cols..(r + 1) * cols]).enumerate() {
                    *o = fp8_e4m3_to_f32(b) * scale_row[c / block_cols];
                }
            }
            WeightFormat::Fp4 { .. } => {
                let (values, scales, block_cols) = self.fp4_row(r).expect("an FP4 row");
                for (c, o) in out.iter_mut().enumerate() {
                    *o = values[c] * scales[c / block_cols];
                }
            }
            WeightFormat::Panels(panels) => panels.dequantize_row(r, out),
        }
    }

    /// FP4 row `r` as its e2m1 values (unscaled), its block scales and the
    /// block width; `None` for other formats.
    fn fp4_row(&self, r: usize) -> Option<(Vec<f32>, Vec<f32>, usize)> {
        match &self.format {
            WeightFormat::Fp4 { data, scales, block_cols } => {
                let cols = self.cols;
                let values = data[r * cols / 2..(r + 1) * cols / 2]
                    .iter()
                    .flat_map(|&b| [FP4_E2M1_VALUES[(b & 15) as usize], FP4_E2M1_VALUES[(b >> 4) as usize]])
                    .collect();
                let blocks = cols / block_cols;
                Some((values, scales[r * blocks..(r + 1) * blocks].to_vec(), *block_cols))
            }
            WeightFormat::Panels(panels) => panels.fp4_block_cols().map(|block| {
                let (values, scales) = panels.fp4_row(r);
                (values, scales, block)
            }),
            _ => None,
        }
    }

    /// `out[n × rows] = x[n × cols] · Wᵀ`.
    ///
    /// Each output element has exactly the bits of [`Linear::forward_reference`],
    /// whatever `n`, the row's position in the batch, the number of threads,
    /// or the [`Isa`] in use.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_on(Backend::detected(), x, n, out, PARALLEL_MIN_FMAS);
    }

    /// [`Linear::forward`] on the calling thread alone, for one of many
    /// products running side by side on the pool (a prefill's routed
    /// experts): split further, each thread would decode the same weights
    /// for its share of the rows. The same bits as [`Linear::forward`].
    pub fn forward_alone(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_on(Backend::detected(), x, n, out, usize::MAX);
    }

    /// [`Linear::forward`] on a chosen code path (for tests and benchmarks; the
    /// result is the same on every path). Panics if this CPU lacks `isa`.
    pub fn forward_with(&self, isa: Isa, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_on(Backend::new(isa), x, n, out, PARALLEL_MIN_FMAS);
    }

    fn forward_on(&self, backend: Backend, x: &[f32], n: usize, out: &mut [f32], parallel_min_fmas: usize) {
        assert_eq!(x.len(), n * self.cols, "linear input");
        assert_eq!(out.len(), n * self.rows, "linear output");
        self.check_format();
        match &self.format {
            WeightFormat::Panels(panels) => crate::column_order::forward(panels, backend, x, n, out, parallel_min_fmas),
            published => {
                let panels = Panels::pack(self.rows, self.cols, published);
                crate::column_order::forward(&panels, backend, x, n, out, parallel_min_fmas)
            }
        }
    }

    /// The definition [`Linear::forward`] computes, in plain Rust: for FP4,
    /// `out = fma(block sum, scale, out)` over the row's scale blocks in
    /// order, each block sum a chain `s = fma(x[c], e2m1[c], s)` from +0.0;
    /// for every other format one chain `out = fma(x[c], w[c], out)` from
    /// +0.0 over the dequantised row ([`Linear::dequantize_row`]).
    pub fn forward_reference(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "linear input");
        let (rows, cols) = (self.rows, self.cols);
        let mut out = vec![0.0f32; n * rows];
        let mut row = vec![0.0f32; cols];
        for r in 0..rows {
            let fp4 = self.fp4_row(r);
            if fp4.is_none() {
                self.dequantize_row(r, &mut row);
            }
            for (i, xi) in x.chunks_exact(cols.max(1)).take(n).enumerate() {
                out[i * rows + r] = match &fp4 {
                    Some((values, scales, block)) => block_scaled_chain(xi, values, scales, *block),
                    None => column_chain(xi, &row),
                };
            }
        }
        out
    }

    /// Panics on layouts the kernels cannot address.
    fn check_format(&self) {
        let (rows, cols) = (self.rows, self.cols);
        match &self.format {
            WeightFormat::F32(d) => assert!(d.len() >= rows * cols, "f32 weight size"),
            WeightFormat::Bf16(d) => assert!(d.len() >= rows * cols * 2, "bf16 weight size"),
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } => {
                assert!(*block_rows > 0 && *block_cols > 0, "fp8 scale blocks");
                assert!(data.len() >= rows * cols, "fp8 weight size");
                let blocks = rows.div_ceil(*block_rows) * cols.div_ceil(*block_cols);
                assert!(scales.len() >= blocks, "fp8 scale grid");
            }
            WeightFormat::Fp4 { data, scales, block_cols } => {
                assert!(cols.is_multiple_of(2), "fp4 weight needs an even column count");
                assert!(*block_cols > 0 && cols.is_multiple_of(*block_cols), "fp4 scale blocks divide the row");
                assert!(data.len() >= rows * cols / 2, "fp4 weight size");
                assert!(scales.len() >= rows * (cols / block_cols), "fp4 scales");
            }
            WeightFormat::Panels(panels) => assert!(panels.rows() == rows && panels.cols() == cols, "panels' shape"),
        }
    }
}

/// `acc = fma(x[c], w[c], acc)` for every column in order, from +0.0: the
/// chain of every output of a linear that is not FP4.
pub fn column_chain(x: &[f32], w: &[f32]) -> f32 {
    x.iter().zip(w).fold(0.0f32, |acc, (a, b)| a.mul_add(*b, acc))
}

/// An FP4 output: each block of `block` columns summed as a [`column_chain`]
/// of x and the unscaled e2m1 values, then `out = fma(sum, scale, out)` in
/// block order, from +0.0.
pub fn block_scaled_chain(x: &[f32], values: &[f32], scales: &[f32], block: usize) -> f32 {
    x.chunks(block)
        .zip(values.chunks(block))
        .zip(scales)
        .fold(0.0f32, |out, ((xb, vb), &s)| column_chain(xb, vb).mul_add(s, out))
}

/// Dot product with a fixed reduction order: 16 lane accumulators over the
/// length (column `c` of each 16-column chunk into lane `c % 16`, tail columns
/// into lanes `0..`), each updated with a fused multiply-add, then a fixed pairwise
/// tree. Every path (SIMD or not) keeps this order, so the path never changes the bits.
///
/// Uses the first `a.len()` elements of `b`.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    Backend::detected().dot(a, b)
}

/// `out[i * rows + r] = dot(x_i, w_r)` for `n` rows `x_i` and `rows` rows `w_r`,
/// all `cols` wide: the bits of [`dot`] for every pair, computed in register
/// tiles (attention scores of many heads against shared keys).
pub fn dot_rows(x: &[f32], n: usize, w: &[f32], rows: usize, cols: usize, out: &mut [f32]) {
    assert!(x.len() == n * cols && w.len() == rows * cols, "dot_rows inputs");
    assert_eq!(out.len(), n * rows, "dot_rows output");
    dot_rows_by(x, n, rows, cols, |r| &w[r * cols..][..cols], out, rows);
}

/// [`dot_rows`] against rows held apart (a window's keys and the compressed
/// entries a query chose), pair `(i, r)` written at `out[i * stride + r]`.
pub fn dot_rows_of(x: &[f32], n: usize, rows: &[&[f32]], out: &mut [f32], stride: usize) {
    let cols = x.len().checked_div(n).unwrap_or(0);
    assert!(x.len() == n * cols && rows.iter().all(|r| r.len() == cols), "dot_rows_of inputs");
    dot_rows_by(x, n, rows.len(), cols, |r| rows[r], out, stride);
}

fn dot_rows_by<'w>(
    x: &[f32],
    n: usize,
    rows: usize,
    cols: usize,
    row: impl Fn(usize) -> &'w [f32],
    out: &mut [f32],
    stride: usize,
) {
    if n == 0 || rows == 0 {
        return;
    }
    assert!(stride >= rows && out.len() >= (n - 1) * stride + rows, "dot_rows output");
    if cols == 0 {
        // A dot product over no column is +0.0.
        (0..n).for_each(|i| out[i * stride..][..rows].fill(0.0));
        return;
    }
    let backend = Backend::detected();
    let xs: Vec<&[f32]> = x.chunks_exact(cols.max(1)).take(n).collect();
    // Every tile starts its accumulators fresh.
    let mut acc = AlignedF32::scratch(n * TILE_ROWS * 16);
    for t0 in (0..rows).step_by(TILE_ROWS) {
        let tile = TILE_ROWS.min(rows - t0);
        // Rows past the tile's end repeat its first row; their sums are discarded.
        let ws: [&[f32]; TILE_ROWS] = std::array::from_fn(|j| row(t0 + if j < tile { j } else { 0 }));
        backend.micro_tiles(&xs, &ws, tile, &mut acc, TILE_ROWS * 16, true);
        store_tile_sums(backend, &acc, tile, &mut out[t0..], stride);
    }
    acc.recycle();
}

/// Reduce each input row's tile of accumulators and write its first `tile`
/// sums to `out[i * out_stride..]`.
fn store_tile_sums(backend: Backend, acc: &[f32], tile: usize, out: &mut [f32], out_stride: usize) {
    let acc_stride = TILE_ROWS * 16;
    for (i, lanes) in acc.chunks_exact(acc_stride).enumerate() {
        let sums = backend.reduce_tile(lanes.try_into().expect("a tile"));
        let dst = &mut out[i * out_stride..][..tile];
        match <&mut [f32; TILE_ROWS]>::try_from(&mut *dst) {
            // A whole tile is a fixed-size store, not a call to `memcpy`.
            Ok(whole) => *whole = sums,
            Err(_) => dst.copy_from_slice(&sums[..tile]),
        }
    }
}

/// [`dot`] on a chosen code path. Panics if this CPU lacks `isa`.
pub fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    Backend::new(isa).dot(a, b)
}

#[cfg(test)]
#[path = "linear_tests.rs"]
mod tests;
