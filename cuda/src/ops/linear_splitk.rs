//! Split-K linear layers (`cuda/kernels/linear_splitk.cu`): the speed-first
//! variant of [`super::linear::linear_forward`], there to measure the cost of
//! batch invariance, not for the engine.
//!
//! [`linear_forward_split`] computes [`deepinfer_kernels::Linear::forward`]
//! with the columns cut into `splits` slices: each slice is the portable
//! chain (`acc = fma(x[c], w[c], acc)` in column order from +0.0) over its
//! columns into a scratch `[splits][n][w.rows]`, then a second pass adds the
//! partial sums left to right in split order (no atomics). With `splits = 1`
//! it is the portable kernel's arithmetic, the CPU's bits; with more, the
//! sums are reassociated, so the bits depend on `splits`, and a caller that
//! picks `splits` from the batch ([`split_for_batch`]) gives a row different
//! bits in different batches. Supports F32, BF16 and FP8 weights (any scale
//! block shape); FP4 (block-scaled chains) is not implemented.

use super::linear::{DeviceLinear, DeviceWeights};
use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Outputs a pass-1 block computes (its threads), as in `linear.cu`.
const BLOCK_OUTS: usize = 128;
/// x rows a pass-1 block computes, as in `linear.cu`.
const BLOCK_ROWS: usize = 4;
/// Threads of a pass-2 block (over a row's outputs).
const REDUCE_THREADS: usize = 128;
/// Streaming multiprocessors of an H100 SXM.
pub const H100_SMS: usize = 132;
/// Pass-1 blocks [`split_for_batch`] aims for: two per H100 SM.
pub const TARGET_BLOCKS: usize = 2 * H100_SMS;
/// The most splits [`split_for_batch`] picks: past it the second pass and
/// the partial sums' traffic outweigh the occupancy gained.
pub const MAX_SPLITS: usize = 16;

/// A speed-first split policy (what an engine that does not promise batch
/// invariance does): the portable kernel launches
/// `base = ceil(n / 4) · ceil(rows / 128)` blocks for `n` x rows and `rows`
/// outputs; if `base ≥ 264` (2 × 132 H100 SMs) the GPU is full and the
/// answer is 1 (no split), otherwise the smallest power of two `s` with
/// `base · s ≥ 264`, at most 16. E.g. a 4096-output linear: 16 splits at
/// n = 1..4, 8 at n = 5..8, 4 at n = 9..16, 2 at n = 17..32, 1 from n = 33
/// on. `n` or `rows` of 0 gives 1. It ignores the column count (a slice may
/// be short or empty when `cols` is small).
pub fn split_for_batch(n: usize, rows: usize) -> usize {
    let base = n.div_ceil(BLOCK_ROWS) * rows.div_ceil(BLOCK_OUTS);
    if base == 0 || base >= TARGET_BLOCKS {
        return 1;
    }
    TARGET_BLOCKS.div_ceil(base).next_power_of_two().min(MAX_SPLITS)
}

/// Columns in each split's slice: `ceil(cols / splits)` (the last slices may
/// be shorter or empty; an empty slice's partial sum is +0.0).
pub fn slice_columns(cols: usize, splits: usize) -> usize {
    cols.div_ceil(splits)
}

/// Elements of scratch [`linear_forward_split_with_scratch`] needs:
/// `splits · n · w.rows` for `splits > 1`, none for `splits = 1`.
pub fn scratch_len(w: &DeviceLinear, n: usize, splits: usize) -> usize {
    if splits <= 1 {
        0
    } else {
        splits * n * w.rows
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

/// [`deepinfer_kernels::Linear::forward`] split `splits` ways along the
/// columns, allocating its scratch (`splits · n · w.rows` f32) on every call;
/// see [`linear_forward_split_with_scratch`]. `x` rows hold `w.cols` values,
/// `out` rows `w.rows` (both may be strided); `n = 0` does nothing.
pub fn linear_forward_split(
    gpu: &Gpu,
    w: &DeviceLinear,
    x: Rows,
    n: usize,
    out: Rows,
    splits: usize,
) -> Result<(), DeviceError> {
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    let scratch = gpu.zeros::<f32>(scratch_len(w, n, splits).max(1))?;
    linear_forward_split_with_scratch(gpu, w, x, n, out, splits, &scratch)
}

/// `out.row(r)[o] = Σ_c x.row(r)[c] · W[o][c]` for `r < n`, `o < w.rows`,
/// as [`deepinfer_kernels::Linear::forward`] but split along the columns:
/// split `s < splits` sums the columns `[s·slice, (s+1)·slice)` (`slice` =
/// [`slice_columns`]) as the portable chain into `scratch[s][r][o]`
/// (`[splits][n][w.rows]` f32, at least [`scratch_len`] elements), then
/// `out = scratch[0] + scratch[1] + ...` left to right. `splits = 1` writes
/// `out` in one pass (no scratch used) with the bits of
/// [`super::linear::linear_forward`]; more splits reassociate the sum
/// (within f32 rounding of it, not its bits). F32, BF16 and FP8 weights.
pub fn linear_forward_split_with_scratch(
    gpu: &Gpu,
    w: &DeviceLinear,
    x: Rows,
    n: usize,
    out: Rows,
    splits: usize,
    scratch: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if n == 0 || w.rows == 0 {
        return Ok(());
    }
    assert!((1..=65535).contains(&splits), "{splits} splits: expected 1..=65535");
    check_rows("split linear input", &x, n, w.cols);
    check_rows("split linear output", &out, n, w.rows);
    let grid_y = w.rows.div_ceil(BLOCK_OUTS);
    let grid_x = n.div_ceil(BLOCK_ROWS);
    assert!(grid_y <= 65535, "a linear of {} outputs is more than 65535 blocks of {BLOCK_OUTS}", w.rows);
    assert!(n <= i32::MAX as usize, "a batch of {n} rows is too large");
    let slice = slice_columns(w.cols, splits);
    // Pass 1's destination: `out` itself for one split, else the scratch.
    let (part, part_stride, split_stride) = if splits == 1 {
        (out.arg(), out.stride, 0usize)
    } else {
        let need = scratch_len(w, n, splits);
        assert!(
            scratch.len() >= need,
            "split scratch of {} f32 for {splits} × {n} × {} partials",
            scratch.len(),
            w.rows
        );
        (scratch.arg(), w.rows, n * w.rows)
    };
    let tail = [
        x.arg(),
        (x.stride as i32).into(),
        part,
        (part_stride as i32).into(),
        Arg::I64(split_stride as i64),
        (n as i32).into(),
        (w.rows as i32).into(),
        (w.cols as i32).into(),
        (slice as i32).into(),
    ];
    let (name, mut args): (&str, Vec<Arg>) = match &w.weights {
        DeviceWeights::F32(d) => ("linear_splitk_f32", vec![d.arg()]),
        DeviceWeights::Bf16(d) => ("linear_splitk_bf16", vec![d.arg()]),
        DeviceWeights::Fp8 { codes, scales, block_rows, block_cols } => (
            "linear_splitk_fp8",
            vec![codes.arg(), scales.arg(), (*block_rows as i32).into(), (*block_cols as i32).into()],
        ),
        DeviceWeights::Fp4 { .. } => panic!("split-K linear: FP4 weights are not implemented"),
    };
    args.extend(tail);
    gpu.launch(name, (grid_x as u32, grid_y as u32, splits as u32), (BLOCK_OUTS as u32, 1, 1), 0, &args)?;
    if splits == 1 {
        return Ok(());
    }
    let reduce_y = w.rows.div_ceil(REDUCE_THREADS);
    gpu.launch(
        "linear_splitk_reduce",
        (n as u32, reduce_y as u32, 1),
        (REDUCE_THREADS as u32, 1, 1),
        0,
        &[
            scratch.arg(),
            (w.rows as i32).into(),
            Arg::I64((n * w.rows) as i64),
            (splits as i32).into(),
            out.arg(),
            (out.stride as i32).into(),
            (w.rows as i32).into(),
        ],
    )
}
