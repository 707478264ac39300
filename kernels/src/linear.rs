//! Linear layers (`y = x · Wᵀ`) over the weight formats of DeepSeek checkpoints.
//!
//! Quantised weights are dequantised inside the kernel, a tile at a time; no
//! full f32 copy of a quantised matrix is ever made. Each output element is one
//! dot product whose reduction order depends only on `cols`, so results are
//! batch-invariant.

use std::ops::Range;

use bytes::Bytes;
use rayon::prelude::*;

use crate::aligned::AlignedF32;
use crate::dtype::{bf16_to_f32, fp8_e4m3_to_f32, FP4_E2M1_VALUES};
use crate::fp4_groups::Fp4Groups;
use crate::fp8_groups::Fp8Groups;
use crate::row_layout::RowLayout;
pub use crate::simd::Isa;
use crate::simd::{prefetch, Backend, EncodedRows, Encoding, ScaleRow};

/// Weight rows dequantised together; every input row reuses them.
const TILE_ROWS: usize = 16;
/// Most columns per block. A dequantised tile block (256 KiB) stays in L2 while
/// all input rows stream past it, and weight rows are read in long sequential
/// runs; this measured faster than L1-sized blocks.
const MAX_BLOCK_COLS: usize = 4096;
/// Most bytes of input rows one pass over the weight tiles multiplies: half
/// the core's L2 ([`crate::cache::l2_bytes`]). Every tile reads all of its
/// pass's rows, so a batch larger than the L2 would stream from L3 or memory
/// once per 16 weight rows (on a core with 15 GB/s of its own, that alone held
/// a 256-row matmul to half the FMA rate); larger batches run in panels, each
/// decoding the weight tiles again, so panels as large as the L2 allows
/// decode least (on a 2 MiB L2, 1 MiB panels instead of 512 KiB made a
/// 256-row f32 matmul 1.2× faster).
fn panel_bytes() -> usize {
    crate::cache::l2_bytes() / 2
}
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
    /// FP4 weights regrouped for the AVX-512 decode kernel (see
    /// [`crate::fp4_groups`]); the same values as the published layout.
    Fp4Grouped(Fp4Groups),
    /// FP8 weights regrouped for the AVX-512 decode kernel (see
    /// [`crate::fp8_groups`]); the same values as the published layout.
    Fp8Grouped(Fp8Groups),
}

impl WeightFormat {
    /// Whether the weights are codes with block scales (FP8 or FP4, in any layout).
    pub fn is_quantized(&self) -> bool {
        !matches!(self, WeightFormat::F32(_) | WeightFormat::Bf16(_))
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
            WeightFormat::Fp4Grouped(groups) => groups.storage_bytes(),
            WeightFormat::Fp8Grouped(groups) => groups.storage_bytes(),
        }
    }

    /// This weight in the layout the fastest kernel of this CPU reads: FP4
    /// and FP8 regrouped ([`Fp4Groups`], [`Fp8Groups`]) where AVX-512BW
    /// decodes them, when their shapes and scales allow; otherwise unchanged. The values, and every output's bits, stay
    /// the same.
    pub fn into_decode_layout(self) -> Self {
        let regroup = matches!(Isa::detect(), Isa::Avx512 | Isa::Avx512Vbmi);
        match &self.format {
            WeightFormat::Fp4 { data, scales, block_cols } if regroup => {
                match Fp4Groups::pack(self.rows, self.cols, data, scales, *block_cols) {
                    Some(groups) => Self { format: WeightFormat::Fp4Grouped(groups), ..self },
                    None => self,
                }
            }
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free } if regroup => {
                let block = (*block_rows, *block_cols);
                match Fp8Groups::pack(self.rows, self.cols, data, scales, block, *nan_free) {
                    Some(groups) => Self { format: WeightFormat::Fp8Grouped(groups), ..self },
                    None => self,
                }
            }
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
            WeightFormat::Fp4 { data, scales, block_cols } => {
                let blocks_per_row = cols / block_cols;
                let scale_row = &scales[r * blocks_per_row..][..blocks_per_row];
                let packed = &data[r * cols / 2..(r + 1) * cols / 2];
                for (i, &b) in packed.iter().enumerate() {
                    let c = 2 * i;
                    let s = scale_row[c / block_cols];
                    out[c] = FP4_E2M1_VALUES[(b & 0xf) as usize] * s;
                    out[c + 1] = FP4_E2M1_VALUES[(b >> 4) as usize] * s;
                }
            }
            WeightFormat::Fp4Grouped(groups) => groups.dequantize_row(r, out),
            WeightFormat::Fp8Grouped(groups) => groups.dequantize_row(r, out),
        }
    }

    /// `out[n × rows] = x[n × cols] · Wᵀ`.
    ///
    /// Each output element has exactly the bits of [`dot`] of its input row and the
    /// dequantised weight row, whatever `n`, the row's position in the batch, the
    /// number of threads, or the [`Isa`] in use.
    pub fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_on(Backend::detected(), x, n, out);
    }

    /// [`Linear::forward`] on a chosen code path (for tests and benchmarks; the
    /// result is the same on every path). Panics if this CPU lacks `isa`.
    pub fn forward_with(&self, isa: Isa, x: &[f32], n: usize, out: &mut [f32]) {
        self.forward_on(Backend::new(isa), x, n, out);
    }

    fn forward_on(&self, backend: Backend, x: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(x.len(), n * self.cols, "linear input");
        assert_eq!(out.len(), n * self.rows, "linear output");
        self.check_format();
        let rows = self.rows;
        if n == 0 || rows == 0 {
            return;
        }
        let decoded = match &self.format {
            WeightFormat::Fp4Grouped(groups) => {
                crate::fp4_groups::forward_decoded(groups, backend, x, n, out, PARALLEL_MIN_FMAS)
            }
            WeightFormat::Fp8Grouped(groups) => {
                crate::fp8_groups::forward_decoded(groups, backend, x, n, out, PARALLEL_MIN_FMAS)
            }
            _ => false,
        };
        if decoded {
            return;
        }
        let (cols, threads) = (self.cols, rayon::current_num_threads());
        if threads > 1 && n.div_ceil(panel_rows(n, cols)) >= threads && n * rows * cols >= PARALLEL_MIN_FMAS {
            // A batch of at least a panel per thread splits by input rows: each
            // thread packs and multiplies its own rows into its own output rows.
            // The weights are decoded once per panel either way, and nothing is
            // packed or copied back on one thread while the others wait.
            let part = n.div_ceil(threads);
            // Every thread already has its part: no part splits again.
            out.par_chunks_mut(part * rows).zip(x.par_chunks(part * cols)).for_each(|(out, x)| {
                self.forward_packed_here(backend, x, x.len() / cols, out, false);
            });
            return;
        }
        self.forward_packed_here(backend, x, n, out, true);
    }

    /// [`Linear::forward_packed`] of `x` packed by this thread.
    fn forward_packed_here(&self, backend: Backend, x: &[f32], n: usize, out: &mut [f32], spread: bool) {
        // Input rows regrouped column block by column block, so the rows a block
        // multiplies are contiguous instead of `cols` apart (a power-of-two stride
        // would map them all onto the same cache sets). One row, or rows of one
        // block that start on a cache line, are already in that order: read in
        // place (a row that does not start on a line would cross two lines
        // with every load, which costs more than the copy).
        let in_order = n == 1 || (block_width(self.cols) >= self.cols && x.as_ptr().cast::<u8>().align_offset(64) == 0);
        let packed = (!in_order).then(|| pack_blocks(x, n, self.cols));
        self.forward_packed(backend, packed.as_deref().unwrap_or(x), n, out, spread);
        if let Some(packed) = packed {
            packed.recycle();
        }
    }

    /// [`Linear::forward_on`] through the register tiles, on `x` laid out by
    /// [`pack_blocks`], spread over the pool's threads when `spread` and large
    /// enough.
    fn forward_packed(&self, backend: Backend, x: &[f32], n: usize, out: &mut [f32], spread: bool) {
        let rows = self.rows;
        let threads = rayon::current_num_threads();
        if !spread || threads == 1 || rows < 2 * TILE_ROWS || n * rows * self.cols < PARALLEL_MIN_FMAS {
            self.forward_rows(backend, x, n, 0..rows, out, rows);
            return;
        }
        // Each thread owns whole output columns (weight rows), so every element is
        // still one dot product computed by one thread in the fixed order.
        let chunk = rows.div_ceil(4 * threads).next_multiple_of(TILE_ROWS);
        if n == 1 {
            out.par_chunks_mut(chunk).enumerate().for_each(|(c, o)| {
                let start = c * chunk;
                self.forward_rows(backend, x, 1, start..start + o.len(), o, o.len());
            });
            return;
        }
        let strips: Vec<Vec<f32>> = (0..rows.div_ceil(chunk))
            .into_par_iter()
            .map(|c| {
                let range = c * chunk..((c + 1) * chunk).min(rows);
                let width = range.len();
                let mut strip = vec![0.0f32; n * width];
                self.forward_rows(backend, x, n, range, &mut strip, width);
                strip
            })
            .collect();
        for (c, strip) in strips.iter().enumerate() {
            let width = strip.len() / n;
            for (i, src) in strip.chunks_exact(width).enumerate() {
                out[i * rows + c * chunk..][..width].copy_from_slice(src);
            }
        }
    }

    /// Panics on layouts the kernels cannot address.
    fn check_format(&self) {
        let (rows, cols) = (self.rows, self.cols);
        match &self.format {
            WeightFormat::F32(d) => assert!(d.len() >= rows * cols, "f32 weight size"),
            WeightFormat::Bf16(d) => assert!(d.len() >= rows * cols * 2, "bf16 weight size"),
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } => {
                assert!(data.len() >= rows * cols, "fp8 weight size");
                let blocks = rows.div_ceil(*block_rows) * cols.div_ceil(*block_cols);
                assert!(scales.len() >= blocks, "fp8 scale grid");
            }
            WeightFormat::Fp4 { data, scales, block_cols } => {
                assert!(cols.is_multiple_of(2), "fp4 weight needs an even column count");
                assert!(data.len() >= rows * cols / 2, "fp4 weight size");
                assert!(scales.len() >= rows * (cols / block_cols), "fp4 scales");
            }
            WeightFormat::Fp4Grouped(groups) => assert!(groups.rows() == rows && groups.cols() == cols, "fp4 groups"),
            WeightFormat::Fp8Grouped(groups) => assert!(groups.rows() == rows && groups.cols() == cols, "fp8 groups"),
        }
    }

    /// Output rows `range` of every input row: `out[i * out_stride + (r - range.start)]`.
    /// `x` is laid out by [`pack_blocks`].
    fn forward_rows(
        &self,
        backend: Backend,
        x: &[f32],
        n: usize,
        range: Range<usize>,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let cols = self.cols;
        let width = block_width(cols);
        let plan = self.plan(backend, n);
        let layout = match plan {
            Plan::Fused(_) => Some(RowLayout::of(self)),
            _ => None,
        };
        // One cache line of padding per row keeps the tile's rows in different cache sets.
        let stride = width + 16;
        let mut wbuf = match plan {
            // Every span a tile reads is decoded into it first.
            Plan::Buffered => AlignedF32::scratch(TILE_ROWS * stride),
            _ => AlignedF32::zeroed(0),
        };
        // Lane accumulators of (input row i, tile row j) at (i * TILE_ROWS + j) * 16.
        let acc_stride = TILE_ROWS * 16;
        // Each tile's accumulators start fresh (the register tiles' first block,
        // or zeroed below for the fused kernels).
        let mut acc = AlignedF32::scratch(panel_rows(n, cols).min(n) * acc_stride);
        let mut xs: Vec<&[f32]> = Vec::with_capacity(n);
        // Largest |x| of each column block, which lets FP8 tiles move their
        // block scale onto x (one pass over x, shared by every tile).
        let codes_nan_free = matches!(self.format, WeightFormat::Fp8 { nan_free: true, .. });
        let x_abs_max: Vec<f32> = match plan {
            Plan::Fused(Encoding::Fp8) => (0..cols)
                .step_by(width)
                .map(|k0| x[n * k0..][..n * width.min(cols - k0)].iter().fold(0.0f32, |m, v| m.max(v.abs())))
                .collect(),
            _ => vec![f32::INFINITY; cols.div_ceil(width)],
        };
        let panel = panel_rows(n, cols);
        for p0 in (0..n).step_by(panel) {
            let pn = panel.min(n - p0);
            let acc = &mut acc[..pn * acc_stride];
            for t0 in range.clone().step_by(TILE_ROWS) {
                let tile = TILE_ROWS.min(range.end - t0);
                // Rows past the tile's end repeat its first row; their sums are discarded.
                let row = |j: usize| t0 + if j < tile { j } else { 0 };
                if matches!(plan, Plan::Fused(_)) {
                    // The register tiles start a tile's first column block from zero;
                    // the fused kernels add to what the buffer holds.
                    acc.fill(0.0);
                }
                for (block, k0) in (0..cols).step_by(width).enumerate() {
                    let kc = width.min(cols - k0);
                    xs.clear();
                    xs.extend(x[n * k0 + p0 * kc..][..pn * kc].chunks_exact(kc));
                    if let (Plan::Fused(encoding), Some(layout)) = (plan, &layout) {
                        let x_abs_max = x_abs_max[block];
                        let (_, nr) = backend.fused_shape(n).expect("fused plan");
                        for g in (0..tile).step_by(nr) {
                            let mut codes = [&[][..]; TILE_ROWS];
                            let mut scales = [ScaleRow::NONE; TILE_ROWS];
                            for j in 0..nr {
                                (codes[j], scales[j]) = layout.span(row(g + j), k0, kc);
                            }
                            let (codes, scales) = (&codes[..nr], &scales[..nr]);
                            // The next group's rows are fetched while this one computes:
                            // a group's rows are short interleaved streams that the
                            // hardware prefetchers do not run ahead of.
                            let next = (t0 + g + nr).min(range.end)..(t0 + g + 2 * nr).min(range.end);
                            let mut ahead = [&[][..]; TILE_ROWS];
                            for (slot, r) in ahead.iter_mut().zip(next.clone()) {
                                let (codes, scales) = layout.span(r, k0, kc);
                                *slot = codes;
                                if encoding == Encoding::Fp4 {
                                    prefetch(scales.row);
                                }
                            }
                            let ahead = &ahead[..next.len()];
                            let rows = EncodedRows { encoding, codes, scales, k0, ahead, x_abs_max, codes_nan_free };
                            backend.micro_encoded(&xs, rows, &mut acc[g * 16..], acc_stride);
                        }
                        continue;
                    }
                    match &self.format {
                        // A tile's rows are decoded together, in the groups' stored order.
                        WeightFormat::Fp8Grouped(groups) if plan == Plan::Buffered => {
                            crate::fp8_groups::decode_rows(groups, backend, t0..t0 + tile, (k0, kc), &mut wbuf, stride);
                        }
                        WeightFormat::Fp4Grouped(groups) if plan == Plan::Buffered => {
                            crate::fp4_groups::decode_rows(groups, backend, t0..t0 + tile, (k0, kc), &mut wbuf, stride);
                        }
                        _ if plan == Plan::Buffered => {
                            for (j, dst) in wbuf.chunks_exact_mut(stride).take(tile).enumerate() {
                                self.dequantize_span(backend, t0 + j, k0, &mut dst[..kc]);
                            }
                        }
                        _ => {}
                    }
                    let mut ws: [&[f32]; TILE_ROWS] = [&[]; TILE_ROWS];
                    for (j, w) in ws.iter_mut().enumerate() {
                        *w = match &self.format {
                            WeightFormat::F32(d) if plan == Plan::Direct => &d[row(j) * cols + k0..][..kc],
                            _ => &wbuf[(row(j) - t0) * stride..][..kc],
                        };
                    }
                    backend.micro_tiles(&xs, &ws, tile, acc, TILE_ROWS * 16, k0 == 0);
                }
                store_tile_sums(backend, acc, tile, &mut out[p0 * out_stride + t0 - range.start..], out_stride);
            }
        }
        acc.recycle();
        wbuf.recycle();
    }

    /// How [`Linear::forward_rows`] reads the weights for a batch of `n` rows.
    fn plan(&self, backend: Backend, n: usize) -> Plan {
        // When one register tile covers every input row, each weight is used by a
        // single kernel call: decode it in registers (or read f32 in place) rather
        // than writing a dequantised copy. Larger batches reuse a dequantised tile.
        let fused = |encoding, block| {
            if backend.fused_shape(n).is_some() && backend.fuses(encoding, block) {
                Plan::Fused(encoding)
            } else {
                Plan::Buffered
            }
        };
        match &self.format {
            WeightFormat::F32(_) if backend.block_shape(n).0 >= n => Plan::Direct,
            WeightFormat::F32(_) => Plan::Buffered,
            WeightFormat::Bf16(_) => fused(Encoding::Bf16, 16),
            WeightFormat::Fp8 { block_cols, .. } => fused(Encoding::Fp8, *block_cols),
            WeightFormat::Fp4 { block_cols, .. } => fused(Encoding::Fp4, *block_cols),
            WeightFormat::Fp4Grouped(_) | WeightFormat::Fp8Grouped(_) => Plan::Buffered,
        }
    }

    /// Dequantise columns `k0..k0 + dst.len()` of row `r`, with the same values as
    /// [`Linear::dequantize_row`].
    fn dequantize_span(&self, backend: Backend, r: usize, k0: usize, dst: &mut [f32]) {
        match &self.format {
            WeightFormat::F32(d) => return dst.copy_from_slice(&d[r * self.cols + k0..][..dst.len()]),
            WeightFormat::Fp4Grouped(groups) => return crate::fp4_groups::decode_span(groups, backend, r, k0, dst),
            WeightFormat::Fp8Grouped(groups) => return crate::fp8_groups::decode_span(groups, backend, r, k0, dst),
            _ => {}
        }
        let (codes, scales) = RowLayout::of(self).span(r, k0, dst.len());
        match &self.format {
            WeightFormat::Bf16(_) => backend.bf16_span(codes, dst),
            WeightFormat::Fp8 { .. } => backend.fp8_span(codes, k0, scales, dst),
            _ => backend.fp4_span(codes, k0, scales, dst),
        }
    }
}

/// How weights reach the register tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// f32 rows read in place.
    Direct,
    /// Quantised rows decoded inside the kernel.
    Fused(Encoding),
    /// A tile of rows dequantised into a buffer, then shared by every input row.
    Buffered,
}

/// Input rows per panel of a batch of `n` rows `cols` wide: equal panels of
/// at most [`panel_bytes`] (and at least one register tile of rows).
fn panel_rows(n: usize, cols: usize) -> usize {
    let most = (panel_bytes() / (4 * cols.max(1))).max(6);
    let panels = n.div_ceil(most).max(1);
    n.div_ceil(panels)
}

/// Width of the column blocks of a `cols`-wide matrix: equal blocks of at most
/// [`MAX_BLOCK_COLS`], each a multiple of 16 so every block starts on lane 0.
fn block_width(cols: usize) -> usize {
    let blocks = cols.div_ceil(MAX_BLOCK_COLS).max(1);
    cols.div_ceil(blocks).next_multiple_of(16).max(16)
}

/// `x[n × cols]` regrouped by column block: block `k0..k0 + kc` of row `i` at
/// `n * k0 + i * kc`. For `n == 1` this is `x` itself.
fn pack_blocks(x: &[f32], n: usize, cols: usize) -> AlignedF32 {
    let mut packed = AlignedF32::reused(n * cols);
    let width = block_width(cols);
    for k0 in (0..cols).step_by(width) {
        let kc = width.min(cols - k0);
        for i in 0..n {
            packed.extend_from_slice(&x[i * cols + k0..][..kc]);
        }
    }
    packed
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
    if n == 0 || rows == 0 {
        return;
    }
    let backend = Backend::detected();
    let xs: Vec<&[f32]> = x.chunks_exact(cols.max(1)).take(n).collect();
    // Every tile starts its accumulators fresh.
    let mut acc = AlignedF32::scratch(n * TILE_ROWS * 16);
    for t0 in (0..rows).step_by(TILE_ROWS) {
        let tile = TILE_ROWS.min(rows - t0);
        // Rows past the tile's end repeat its first row; their sums are discarded.
        let ws: [&[f32]; TILE_ROWS] = std::array::from_fn(|j| &w[(t0 + if j < tile { j } else { 0 }) * cols..][..cols]);
        backend.micro_tiles(&xs, &ws, tile, &mut acc, TILE_ROWS * 16, true);
        store_tile_sums(backend, &acc, tile, &mut out[t0..], rows);
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
