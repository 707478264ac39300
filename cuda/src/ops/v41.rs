//! DeepSeek-V4.1's defined arithmetic on the device (`cuda/kernels/v41_rows.cu`,
//! `v41_linear.cu`):
//! bf16 rounding, FP8/FP4 activation quantisation, the quantised and plain
//! linears, f64 dot products, and `engine/src/v41/ops.rs`'s RMSNorm,
//! softmax, element-wise transcendentals and RoPE. Each function names the
//! CPU function whose bits it gives.
//!
//! Rows are [`Rows`] views (`offset + r * stride`), so strided column slices
//! of wider matrices work in place. `n = 0` rows does nothing.

use deepinfer_kernels::act_quant::{Fp4Scale, ACT_BLOCK};

use super::linear::{DeviceLinear, DeviceWeights};
use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Threads of every block (element-wise: over a row's columns or groups).
const THREADS: usize = 128;
/// Outputs and x rows a block of the linear kernels computes.
const LIN_OUTS: usize = 128;
const LIN_ROWS: usize = 4;

/// Asserts that `n > 0` rows of `width` values lie inside `rows`' buffer.
fn check_rows(what: &str, rows: &Rows, n: usize, width: usize) {
    assert!(rows.stride <= i32::MAX as usize, "{what}: a stride of {} is too large", rows.stride);
    assert!(width <= i32::MAX as usize, "{what}: a width of {width} is too large");
    assert!(n <= i32::MAX as usize, "{what}: {n} rows are too many");
    let end = rows.offset + (n - 1) * rows.stride + width;
    assert!(
        end <= rows.buf.len(),
        "{what}: {n} rows of {width} at offset {} stride {} end at {end}, past a buffer of {}",
        rows.offset,
        rows.stride,
        rows.buf.len()
    );
}

/// Blocks of [`THREADS`] covering `count` items (a grid's y), at least one.
fn chunks(what: &str, count: usize) -> u32 {
    let blocks = count.div_ceil(THREADS).max(1);
    assert!(blocks <= 65535, "{what}: {count} items per row are too many");
    blocks as u32
}

/// An element-wise function of [`map_rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    /// [`deepinfer_kernels::act_quant::round_bf16`].
    RoundBf16 = 0,
    /// `ops::exp`: `f32(exp(f64(x)))`, glibc's `exp` ported bit for bit.
    Exp = 1,
    /// `ops::sigmoid`: `f32(1 / (1 + exp(-f64(x))))`.
    Sigmoid = 2,
    /// `ops::silu`: `f32(x / (1 + exp(-x)))` in f64.
    Silu = 3,
    /// `ops::softplus`: `x` above 20, else `f32(log1p(exp(x)))` in f64. The
    /// device's `log1p` is not glibc's: on a GPU it may differ in the last
    /// f64 bit, which almost never survives the rounding to f32.
    Softplus = 4,
    /// `ops::rsqrt`: `f32(1 / sqrt(f64(x)))`.
    Rsqrt = 5,
}

/// `op` applied in place to `n` rows of `width` values of `x`
/// (`engine/src/v41/ops.rs`'s element-wise functions, their bits).
pub fn map_rows(gpu: &Gpu, x: Rows, n: usize, width: usize, op: Unary) -> Result<(), DeviceError> {
    if n == 0 || width == 0 {
        return Ok(());
    }
    check_rows("map_rows", &x, n, width);
    let grid = (n as u32, chunks("map_rows", width), 1);
    let args = [x.arg(), (x.stride as i32).into(), (width as i32).into(), (op as i32).into()];
    gpu.launch("v41_map_rows", grid, (THREADS as u32, 1, 1), 0, &args)
}

/// [`deepinfer_kernels::act_quant::round_bf16_all`] on `n` rows of `width`, in place.
pub fn round_bf16_rows(gpu: &Gpu, x: Rows, n: usize, width: usize) -> Result<(), DeviceError> {
    map_rows(gpu, x, n, width, Unary::RoundBf16)
}

/// [`deepinfer_kernels::act_quant::fp8_quantize_row`] of each of `n` rows
/// of `cols` values (a multiple of 32): `values` (`[n][cols]`, packed) gets
/// the e4m3 values (unscaled), `scales` (`[n][cols / 32]`, packed) the
/// power-of-two scales.
pub fn fp8_quantize_rows(
    gpu: &Gpu,
    x: Rows,
    n: usize,
    cols: usize,
    values: &DeviceBuffer<f32>,
    scales: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    assert!(cols.is_multiple_of(ACT_BLOCK), "FP8 activation rows of {cols} are not a multiple of {ACT_BLOCK}");
    if n == 0 || cols == 0 {
        return Ok(());
    }
    check_rows("fp8_quantize_rows", &x, n, cols);
    assert!(values.len() >= n * cols, "fp8_quantize_rows: values hold {}, need {}", values.len(), n * cols);
    let groups = cols / ACT_BLOCK;
    assert!(scales.len() >= n * groups, "fp8_quantize_rows: scales hold {}, need {}", scales.len(), n * groups);
    let grid = (n as u32, chunks("fp8_quantize_rows", groups), 1);
    let args = [x.arg(), (x.stride as i32).into(), values.arg(), scales.arg(), (cols as i32).into()];
    gpu.launch("v41_fp8_quantize_rows", grid, (THREADS as u32, 1, 1), 0, &args)
}

/// [`deepinfer_kernels::act_quant::fp8_round_trip`] on each of `n` rows of
/// `width` values (a multiple of 32), in place.
pub fn fp8_round_trip_rows(gpu: &Gpu, x: Rows, n: usize, width: usize) -> Result<(), DeviceError> {
    assert!(width.is_multiple_of(ACT_BLOCK), "FP8 round trip of rows of {width}, not a multiple of {ACT_BLOCK}");
    if n == 0 || width == 0 {
        return Ok(());
    }
    check_rows("fp8_round_trip_rows", &x, n, width);
    let grid = (n as u32, chunks("fp8_round_trip_rows", width / ACT_BLOCK), 1);
    let args = [x.arg(), (x.stride as i32).into(), (width as i32).into()];
    gpu.launch("v41_fp8_round_trip_rows", grid, (THREADS as u32, 1, 1), 0, &args)
}

/// [`deepinfer_kernels::act_quant::fp4_round_trip`]`(row, block, scale)` on
/// each of `n` rows of `width` values (a multiple of `block`), in place.
pub fn fp4_round_trip_rows(
    gpu: &Gpu,
    x: Rows,
    n: usize,
    width: usize,
    block: usize,
    scale: Fp4Scale,
) -> Result<(), DeviceError> {
    assert!(block > 0 && width.is_multiple_of(block), "FP4 rows of {width} in groups of {block}");
    if n == 0 || width == 0 {
        return Ok(());
    }
    check_rows("fp4_round_trip_rows", &x, n, width);
    let grid = (n as u32, chunks("fp4_round_trip_rows", width / block), 1);
    let e4m3 = i32::from(scale == Fp4Scale::E4m3);
    let args = [x.arg(), (x.stride as i32).into(), (width as i32).into(), (block as i32).into(), e4m3.into()];
    gpu.launch("v41_fp4_round_trip_rows", grid, (THREADS as u32, 1, 1), 0, &args)
}

/// The grid of the linear kernels over `n` x rows and `rows` outputs.
fn linear_grid(n: usize, rows: usize) -> (u32, u32, u32) {
    let grid_y = rows.div_ceil(LIN_OUTS);
    assert!(grid_y <= 65535, "a linear of {rows} outputs is more than 65535 blocks of {LIN_OUTS}");
    (n.div_ceil(LIN_ROWS) as u32, grid_y as u32, 1)
}

/// The plain product of any weight format, `round` to bf16 or not.
fn plain(gpu: &Gpu, w: &DeviceLinear, x: Rows, n: usize, out: Rows, round: bool) -> Result<(), DeviceError> {
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    check_rows("linear input", &x, n, w.cols.max(1));
    check_rows("linear output", &out, n, w.rows);
    let tail = [
        x.arg(),
        (x.stride as i32).into(),
        out.arg(),
        (out.stride as i32).into(),
        (n as i32).into(),
        (w.rows as i32).into(),
        (w.cols as i32).into(),
        i32::from(round).into(),
    ];
    let (name, mut args): (&str, Vec<Arg>) = match &w.weights {
        DeviceWeights::F32(d) => ("v41_plain_linear_f32", vec![d.arg()]),
        DeviceWeights::Bf16(d) => ("v41_plain_linear_bf16", vec![d.arg()]),
        DeviceWeights::Fp8 { codes, scales, block_rows, block_cols } => (
            "v41_plain_linear_fp8",
            vec![codes.arg(), scales.arg(), (*block_rows as i32).into(), (*block_cols as i32).into()],
        ),
        DeviceWeights::Fp4 { codes, scales, block_cols } => {
            ("v41_plain_linear_fp4", vec![codes.arg(), scales.arg(), (*block_cols as i32).into()])
        }
    };
    args.extend(tail);
    gpu.launch(name, linear_grid(n, w.rows), (LIN_OUTS as u32, 1, 1), 0, &args)
}

/// [`deepinfer_kernels::act_quant::plain_linear`]: `out.row(r)[o] =
/// f32(dot_f64(x.row(r), W[o] dequantised))` for `r < n`, `o < w.rows`, any
/// weight format (FP8 and FP4 dequantised as `Linear::dequantize_row` does).
/// `x` rows hold `w.cols` values, `out` rows `w.rows`; not rounded to bf16.
pub fn plain_linear(gpu: &Gpu, w: &DeviceLinear, x: Rows, n: usize, out: Rows) -> Result<(), DeviceError> {
    plain(gpu, w, x, n, out, false)
}

/// [`deepinfer_kernels::act_quant::quantized_linear`] (the bits of
/// `quantized_linear_reference`): bf16 outputs `out.row(r)[o]` of `n`
/// bf16-valued input rows of `w.cols`. FP8 weights (scale blocks 32 wide
/// along K, any height) and FP4 weights (a scale per 32 columns) take each
/// row through [`fp8_quantize_rows`] (into scratch buffers allocated here)
/// and the block-scaled product; F32 and BF16 weights take [`plain_linear`]
/// rounded to bf16.
pub fn quantized_linear(gpu: &Gpu, w: &DeviceLinear, x: Rows, n: usize, out: Rows) -> Result<(), DeviceError> {
    let (name, weight_args): (&str, Vec<Arg>) = match &w.weights {
        DeviceWeights::F32(_) | DeviceWeights::Bf16(_) => return plain(gpu, w, x, n, out, true),
        DeviceWeights::Fp8 { codes, scales, block_rows, block_cols } => {
            assert_eq!(*block_cols, ACT_BLOCK, "FP8 weight scale blocks must be {ACT_BLOCK} wide along K");
            ("v41_quantized_linear_fp8", vec![codes.arg(), scales.arg(), (*block_rows as i32).into()])
        }
        DeviceWeights::Fp4 { codes, scales, block_cols } => {
            assert_eq!(*block_cols, ACT_BLOCK, "FP4 weight scale blocks must be {ACT_BLOCK} wide along K");
            ("v41_quantized_linear_fp4", vec![codes.arg(), scales.arg()])
        }
    };
    assert!(w.cols.is_multiple_of(ACT_BLOCK), "a quantised linear of {} columns, not a multiple of 32", w.cols);
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    check_rows("quantized_linear output", &out, n, w.rows);
    let values = gpu.zeros::<f32>(n * w.cols)?;
    let scales = gpu.zeros::<f32>((n * w.cols / ACT_BLOCK).max(1))?;
    fp8_quantize_rows(gpu, x, n, w.cols, &values, &scales)?;
    let mut args = weight_args;
    args.extend([
        values.arg(),
        scales.arg(),
        out.arg(),
        (out.stride as i32).into(),
        (n as i32).into(),
        (w.rows as i32).into(),
        (w.cols as i32).into(),
    ]);
    gpu.launch(name, linear_grid(n, w.rows), (LIN_OUTS as u32, 1, 1), 0, &args)
}

/// [`deepinfer_kernels::act_quant::dot_f64_rows`] / `dot_f64_each` for
/// several `a`: for `i < na`, `j < m`, element `i * m + j` of `out64` (the
/// f64 sums, the bits of `dot_f64`) and of `out32` (rounded once: `ops::dot`)
/// is `dot_f64(a.row(i), b.row(index[j]))` (`index` none: `b.row(j)`), every
/// row `cols` long. `b` must hold `b_rows` rows; a device index past them
/// reads the last. Either output may be none.
#[allow(clippy::too_many_arguments)]
pub fn dot_f64_rows(
    gpu: &Gpu,
    a: Rows,
    na: usize,
    b: Rows,
    b_rows: usize,
    index: Option<&DeviceBuffer<u32>>,
    m: usize,
    cols: usize,
    out64: Option<&DeviceBuffer<f64>>,
    out32: Option<&DeviceBuffer<f32>>,
) -> Result<(), DeviceError> {
    if na == 0 || m == 0 {
        return Ok(());
    }
    check_rows("dot_f64_rows a", &a, na, cols);
    match index {
        Some(ix) => {
            assert!(ix.len() >= m, "dot_f64_rows: {} indices for {m} rows", ix.len());
            assert!(b_rows > 0, "dot_f64_rows: indexed rows of an empty b");
        }
        None => assert!(b_rows >= m, "dot_f64_rows: {m} rows of a b of {b_rows}"),
    }
    check_rows("dot_f64_rows b", &b, b_rows, cols);
    for (what, len) in [("out64", out64.map(|o| o.len())), ("out32", out32.map(|o| o.len()))] {
        if let Some(len) = len {
            assert!(len >= na * m, "dot_f64_rows: {what} holds {len}, need {}", na * m);
        }
    }
    let args = [
        a.arg(),
        (a.stride as i32).into(),
        b.arg(),
        (b.stride as i32).into(),
        (b_rows.min(i32::MAX as usize) as i32).into(),
        index.map_or(Arg::Ptr(0), DeviceBuffer::arg),
        (m as i32).into(),
        (cols as i32).into(),
        out64.map_or(Arg::Ptr(0), DeviceBuffer::arg),
        out32.map_or(Arg::Ptr(0), DeviceBuffer::arg),
    ];
    gpu.launch("v41_dot_f64_rows", (na as u32, chunks("dot_f64_rows", m), 1), (THREADS as u32, 1, 1), 0, &args)
}

/// `engine/src/v41/ops.rs` `rms_norm` on each of `n` rows of `dim` values,
/// in place, `weight` of `dim` values: the mean square in f64 (element
/// order), `rsqrt` in f64, outputs bf16.
pub fn rms_norm_rows(
    gpu: &Gpu,
    x: Rows,
    n: usize,
    dim: usize,
    weight: &DeviceBuffer<f32>,
    eps: f32,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    assert!(dim > 0, "rms_norm of empty rows");
    assert!(weight.len() >= dim, "rms_norm weight of {} for rows of {dim}", weight.len());
    check_rows("rms_norm_rows", &x, n, dim);
    let args = [x.arg(), (x.stride as i32).into(), weight.arg(), (dim as i32).into(), eps.into()];
    gpu.launch("v41_rms_norm_rows", (n as u32, 1, 1), (THREADS as u32, 1, 1), 0, &args)
}

/// `engine/src/v41/ops.rs` `softmax` of each of `n` rows of `width` values,
/// in place (f64 exponentials, their sum in element order, each output
/// rounded once).
pub fn softmax_rows(gpu: &Gpu, x: Rows, n: usize, width: usize) -> Result<(), DeviceError> {
    if n == 0 || width == 0 {
        return Ok(());
    }
    check_rows("softmax_rows", &x, n, width);
    let args = [x.arg(), (x.stride as i32).into(), (width as i32).into()];
    gpu.launch("v41_softmax_rows", (n as u32, 1, 1), (THREADS as u32, 1, 1), 0, &args)
}

/// The cos and sin tables `RopeTable::apply` computes for positions
/// `0..positions` (`[positions][freqs.len()]` each): `f32(cos(f64(p as f32 *
/// f)))` and the same for sin, with the host's libm.
pub fn rope_cos_sin(freqs: &[f32], positions: usize) -> (Vec<f32>, Vec<f32>) {
    let mut cos = Vec::with_capacity(positions * freqs.len());
    let mut sin = Vec::with_capacity(positions * freqs.len());
    for p in 0..positions {
        for &f in freqs {
            let angle = (p as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// A V4.1 `RopeTable`'s cos/sin for positions `0..positions` in device memory.
#[derive(Debug)]
pub struct DeviceRope {
    pub cos: DeviceBuffer<f32>,
    pub sin: DeviceBuffer<f32>,
    /// Pairs rotated (`RopeTable::freqs.len()`).
    pub half: usize,
    pub positions: usize,
}

impl DeviceRope {
    /// The tables of `freqs` (`RopeTable::freqs`) for positions `0..positions`.
    pub fn new(gpu: &Gpu, freqs: &[f32], positions: usize) -> Result<DeviceRope, DeviceError> {
        assert!(positions > 0 && positions <= i32::MAX as usize, "a rope table of {positions} positions");
        let (cos, sin) = rope_cos_sin(freqs, positions);
        Ok(DeviceRope { cos: gpu.upload(&cos)?, sin: gpu.upload(&sin)?, half: freqs.len(), positions })
    }
}

/// Where each row of [`rope_rows`] sits.
#[derive(Clone, Copy, Debug)]
pub enum RopePositions<'a> {
    /// Row `r` at `first + r * step` (a chunk's tokens: step 1; compressed
    /// entries of ratio `k`: `first = first_group * k`, step `k`).
    Affine { first: usize, step: usize },
    /// Row `r` at `positions[r]` (a position past the table takes its last).
    Each(&'a DeviceBuffer<u32>),
}

/// `RopeTable::apply(x, position, inverse)` on `heads` slices of each of `n`
/// rows: the slice of head `h` of row `r` is `2 · rope.half` values from
/// `x.row(r)[h * head_stride + offset]` (V4.1's attention: `head_stride =
/// head_dim`, `offset = head_dim - rope_head_dim`). In place, outputs bf16.
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    gpu: &Gpu,
    rope: &DeviceRope,
    x: Rows,
    n: usize,
    heads: usize,
    head_stride: usize,
    offset: usize,
    positions: RopePositions,
    inverse: bool,
) -> Result<(), DeviceError> {
    if n == 0 || heads == 0 || rope.half == 0 {
        return Ok(());
    }
    assert!(
        offset + 2 * rope.half <= head_stride || heads == 1,
        "rope slices of {} at {offset} overlap heads of {head_stride}",
        2 * rope.half
    );
    check_rows("rope_rows", &x, n, (heads - 1) * head_stride + offset + 2 * rope.half);
    let (index, first, step) = match positions {
        RopePositions::Affine { first, step } => {
            let last = first + (n - 1) * step;
            assert!(last < rope.positions, "rope position {last} past a table of {}", rope.positions);
            (Arg::Ptr(0), first as i32, step as i32)
        }
        RopePositions::Each(p) => {
            assert!(p.len() >= n, "rope_rows: {} positions for {n} rows", p.len());
            (p.arg(), 0, 0)
        }
    };
    let args = [
        x.arg(),
        (x.stride as i32).into(),
        (heads as i32).into(),
        (head_stride as i32).into(),
        (offset as i32).into(),
        (rope.half as i32).into(),
        rope.cos.arg(),
        rope.sin.arg(),
        (rope.positions as i32).into(),
        index,
        first.into(),
        step.into(),
        i32::from(inverse).into(),
    ];
    gpu.launch("v41_rope_rows", (n as u32, 1, 1), (THREADS as u32, 1, 1), 0, &args)
}
