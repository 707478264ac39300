//! Linear layers and the embedding lookup (`cuda/kernels/linear.cu`).
//!
//! A [`DeviceLinear`] holds a [`deepinfer_kernels::Linear`]'s weight in its
//! published row-major layout; [`linear_forward`] gives the bits of
//! [`deepinfer_kernels::Linear::forward`] (the chains of
//! [`deepinfer_kernels::Linear::forward_reference`]) for every format and any
//! row count, and [`gather_rows`] those of
//! [`deepinfer_kernels::Linear::dequantize_row`].

use deepinfer_kernels::linear::{Linear, WeightFormat};

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Outputs a block of the forward kernels computes (its threads).
const BLOCK_OUTS: usize = 128;
/// x rows a block of the forward kernels computes.
const BLOCK_ROWS: usize = 4;
/// Threads of a gather block (over a row's columns).
const GATHER_THREADS: u32 = 128;

/// A weight's values in device memory, in the published layout.
#[derive(Debug)]
pub enum DeviceWeights {
    /// `[rows][cols]` f32.
    F32(DeviceBuffer<f32>),
    /// `[rows][cols]` bf16 bits.
    Bf16(DeviceBuffer<u16>),
    /// `[rows][cols]` FP8 e4m3 codes; scales `[ceil(rows / block_rows)][ceil(cols / block_cols)]`.
    Fp8 { codes: DeviceBuffer<u8>, scales: DeviceBuffer<f32>, block_rows: usize, block_cols: usize },
    /// `[rows][cols / 2]` FP4 e2m1 code pairs (even column in the low
    /// nibble); scales `[rows][cols / block_cols]`.
    Fp4 { codes: DeviceBuffer<u8>, scales: DeviceBuffer<f32>, block_cols: usize },
}

/// A weight matrix of `rows` outputs by `cols` inputs on a device.
#[derive(Debug)]
pub struct DeviceLinear {
    pub rows: usize,
    pub cols: usize,
    pub weights: DeviceWeights,
}

impl DeviceLinear {
    /// `w` in device memory, in its published layout (a weight laid out for
    /// the CPU's kernels, [`WeightFormat::Panels`], is published first).
    pub fn upload(gpu: &Gpu, w: &Linear) -> Result<DeviceLinear, DeviceError> {
        let published;
        let w = if matches!(w.format, WeightFormat::Panels(_)) {
            published = w.clone().into_published();
            &published
        } else {
            w
        };
        let (rows, cols) = (w.rows, w.cols);
        assert!(rows <= i32::MAX as usize && cols <= i32::MAX as usize, "a linear of {rows} × {cols} is too large");
        let weights = match &w.format {
            WeightFormat::F32(d) => {
                assert!(d.len() >= rows * cols, "f32 weight of {} values for {rows} × {cols}", d.len());
                DeviceWeights::F32(gpu.upload(&d[..rows * cols])?)
            }
            WeightFormat::Bf16(d) => {
                assert!(d.len() >= rows * cols * 2, "bf16 weight of {} bytes for {rows} × {cols}", d.len());
                let bits: Vec<u16> =
                    d[..rows * cols * 2].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
                DeviceWeights::Bf16(gpu.upload(&bits)?)
            }
            WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } => {
                let (block_rows, block_cols) = (*block_rows, *block_cols);
                assert!(block_rows > 0 && block_cols > 0, "fp8 scale blocks of {block_rows} × {block_cols}");
                assert!(data.len() >= rows * cols, "fp8 weight of {} codes for {rows} × {cols}", data.len());
                let grid = rows.div_ceil(block_rows) * cols.div_ceil(block_cols);
                assert!(scales.len() >= grid, "fp8 weight with {} scales for a grid of {grid}", scales.len());
                DeviceWeights::Fp8 {
                    codes: gpu.upload(&data[..rows * cols])?,
                    scales: gpu.upload(&scales[..grid])?,
                    block_rows,
                    block_cols,
                }
            }
            WeightFormat::Fp4 { data, scales, block_cols } => {
                let block_cols = *block_cols;
                assert!(cols.is_multiple_of(2), "fp4 weight with an odd column count {cols}");
                assert!(
                    block_cols > 0 && cols.is_multiple_of(block_cols),
                    "fp4 blocks of {block_cols} in {cols} columns"
                );
                assert!(data.len() >= rows * cols / 2, "fp4 weight of {} bytes for {rows} × {cols}", data.len());
                let count = rows * (cols / block_cols);
                assert!(scales.len() >= count, "fp4 weight with {} scales for {count} blocks", scales.len());
                DeviceWeights::Fp4 {
                    codes: gpu.upload(&data[..rows * cols / 2])?,
                    scales: gpu.upload(&scales[..count])?,
                    block_cols,
                }
            }
            WeightFormat::Panels(_) => unreachable!("published above"),
        };
        Ok(DeviceLinear { rows, cols, weights })
    }

    /// Bytes of device memory the weight holds (codes and scales).
    pub fn storage_bytes(&self) -> usize {
        match &self.weights {
            DeviceWeights::F32(d) => d.len() * 4,
            DeviceWeights::Bf16(d) => d.len() * 2,
            DeviceWeights::Fp8 { codes, scales, .. } | DeviceWeights::Fp4 { codes, scales, .. } => {
                codes.len() + scales.len() * 4
            }
        }
    }
}

/// Asserts that `n` rows of `width` values lie inside `rows`' buffer.
fn check_rows(what: &str, rows: &Rows, n: usize, width: usize) {
    assert!(rows.stride <= i32::MAX as usize, "{what}: a stride of {} is too large", rows.stride);
    let end = rows.offset + (n - 1) * rows.stride + width;
    assert!(
        end <= rows.buf.len(),
        "{what}: {n} rows of {width} at offset {} stride {} end at {end}, past a buffer of {}",
        rows.offset,
        rows.stride,
        rows.buf.len()
    );
}

/// [`Linear::forward`]: `out.row(r)[o] = Σ_c x.row(r)[c] · W[o][c]` for
/// `r < n`, `o < w.rows`, `c < w.cols`, each output the CPU's one chain in
/// column order (FP4: block sums scaled in block order), so the CPU's bits
/// whatever `n`. `x` rows hold `w.cols` values and `out` rows `w.rows` (both
/// may be strided, e.g. column slices of a wider matrix); `n = 0` does nothing.
pub fn linear_forward(gpu: &Gpu, w: &DeviceLinear, x: Rows, n: usize, out: Rows) -> Result<(), DeviceError> {
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    check_rows("linear input", &x, n, w.cols);
    check_rows("linear output", &out, n, w.rows);
    let grid_y = w.rows.div_ceil(BLOCK_OUTS);
    let grid_x = n.div_ceil(BLOCK_ROWS);
    assert!(grid_y <= 65535, "a linear of {} outputs is more than 65535 blocks of {BLOCK_OUTS}", w.rows);
    assert!(grid_x <= i32::MAX as usize, "a batch of {n} rows is too large");
    let tail = [
        x.arg(),
        (x.stride as i32).into(),
        out.arg(),
        (out.stride as i32).into(),
        (n as i32).into(),
        (w.rows as i32).into(),
        (w.cols as i32).into(),
    ];
    let (name, mut args): (&str, Vec<Arg>) = match &w.weights {
        DeviceWeights::F32(d) => ("linear_f32", vec![d.arg()]),
        DeviceWeights::Bf16(d) => ("linear_bf16", vec![d.arg()]),
        DeviceWeights::Fp8 { codes, scales, block_rows, block_cols } => {
            ("linear_fp8", vec![codes.arg(), scales.arg(), (*block_rows as i32).into(), (*block_cols as i32).into()])
        }
        DeviceWeights::Fp4 { codes, scales, block_cols } => {
            ("linear_fp4", vec![codes.arg(), scales.arg(), (*block_cols as i32).into()])
        }
    };
    args.extend(tail);
    gpu.launch(name, (grid_x as u32, grid_y as u32, 1), (BLOCK_OUTS as u32, 1, 1), 0, &args)
}

/// The embedding lookup, [`Linear::dequantize_row`] for each of `n` ids:
/// `out.row(r)` (`w.cols` values) = dequantised weight row
/// `min(ids[r], w.rows - 1)`, the CPU's bits. `n = 0` does nothing.
pub fn gather_rows(
    gpu: &Gpu,
    w: &DeviceLinear,
    ids: &DeviceBuffer<u32>,
    n: usize,
    out: Rows,
) -> Result<(), DeviceError> {
    if n == 0 || w.cols == 0 {
        return Ok(());
    }
    assert!(w.rows > 0, "gather from a weight of no rows");
    assert!(ids.len() >= n, "{n} rows gathered by {} ids", ids.len());
    assert!(n <= i32::MAX as usize, "a gather of {n} rows is too large");
    check_rows("gathered rows", &out, n, w.cols);
    let tail = [ids.arg(), out.arg(), (out.stride as i32).into(), (w.rows as i32).into(), (w.cols as i32).into()];
    let (name, mut args): (&str, Vec<Arg>) = match &w.weights {
        DeviceWeights::F32(d) => ("linear_gather_f32", vec![d.arg()]),
        DeviceWeights::Bf16(d) => ("linear_gather_bf16", vec![d.arg()]),
        DeviceWeights::Fp8 { codes, scales, block_rows, block_cols } => (
            "linear_gather_fp8",
            vec![codes.arg(), scales.arg(), (*block_rows as i32).into(), (*block_cols as i32).into()],
        ),
        DeviceWeights::Fp4 { codes, scales, block_cols } => {
            ("linear_gather_fp4", vec![codes.arg(), scales.arg(), (*block_cols as i32).into()])
        }
    };
    args.extend(tail);
    gpu.launch(name, (n as u32, 1, 1), (GATHER_THREADS, 1, 1), 0, &args)
}
