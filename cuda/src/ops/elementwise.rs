//! The small element-wise steps (`cuda/kernels/elementwise.cu`): RoPE,
//! clamped SwiGLU, row sums and scalings, each with the bits of its CPU
//! function in `deepinfer_kernels::ops`.

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Threads per block.
const THREADS: u32 = 256;
/// Most blocks a grid-stride launch uses.
const MAX_BLOCKS: usize = 65535;

/// Asserts that `n` rows of `width` values fit in `rows`' buffer.
fn check_rows(what: &str, rows: &Rows, n: usize, width: usize) {
    if n == 0 {
        return;
    }
    let end = rows.offset + (n - 1) * rows.stride + width;
    assert!(
        end <= rows.buf.len(),
        "{what}: {n} rows of {width} at offset {} stride {} end at {end}, past the buffer's {}",
        rows.offset,
        rows.stride,
        rows.buf.len()
    );
}

fn grid_for(len: usize) -> u32 {
    len.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32
}

/// `deepinfer_kernels::ops::rope_interleaved` as the engine's attention
/// applies it (`Angles::apply`, or `Angles::apply_inverse` with `inverse`):
/// for each row `r < n` and head `h < heads`, the trailing `rope_dim`
/// channels of `x.row(r)[h·head_dim..(h+1)·head_dim]` rotated pair by pair
/// by `cos/sin[r·rope_dim/2..][..rope_dim/2]` (`Rope::cos_sin` of row r's
/// position, computed on the host); `inverse` negates sin. In place. The
/// CPU's bits.
#[allow(clippy::too_many_arguments)]
pub fn rope_rows(
    gpu: &Gpu,
    x: Rows,
    n: usize,
    heads: usize,
    head_dim: usize,
    rope_dim: usize,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    inverse: bool,
) -> Result<(), DeviceError> {
    assert!(rope_dim.is_multiple_of(2), "rope_rows: rope_dim {rope_dim} is odd");
    assert!(rope_dim <= head_dim, "rope_rows: rope_dim {rope_dim} above head_dim {head_dim}");
    check_rows("rope_rows x", &x, n, heads * head_dim);
    let half = rope_dim / 2;
    assert!(cos.len() >= n * half, "rope_rows: cos holds {} values, [n={n}, {half}] needed", cos.len());
    assert!(sin.len() >= n * half, "rope_rows: sin holds {} values, [n={n}, {half}] needed", sin.len());
    assert!(i32::try_from(heads * head_dim).is_ok(), "rope_rows: heads * head_dim does not fit an int");
    if n == 0 || heads == 0 || half == 0 {
        return Ok(());
    }
    gpu.launch(
        "ew_rope_rows",
        (n as u32, 1, 1),
        (128, 1, 1),
        0,
        &[
            x.arg(),
            Arg::I64(x.stride as i64),
            (heads as i32).into(),
            (head_dim as i32).into(),
            (rope_dim as i32).into(),
            cos.arg(),
            sin.arg(),
            (inverse as i32).into(),
        ],
    )
}

/// `deepinfer_kernels::ops::swiglu_clamped` on the first `len` values, in
/// place on `gate`: `gate ← silu(min(gate, limit)) · clamp(up, −limit,
/// limit)`. The CPU's bits.
pub fn swiglu_clamped(
    gpu: &Gpu,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    len: usize,
    limit: f32,
) -> Result<(), DeviceError> {
    assert!(gate.len() >= len, "swiglu_clamped: gate holds {}, len {len}", gate.len());
    assert!(up.len() >= len, "swiglu_clamped: up holds {}, len {len}", up.len());
    if len == 0 {
        return Ok(());
    }
    gpu.launch(
        "ew_swiglu_clamped",
        (grid_for(len), 1, 1),
        (THREADS, 1, 1),
        0,
        &[gate.arg(), up.arg(), Arg::I64(len as i64), limit.into()],
    )
}

/// `out.row(r)[..width] += x.row(r)[..width]` for `r < n`: plain f32 adds
/// (the residual sums).
pub fn add_rows(gpu: &Gpu, out: Rows, x: Rows, n: usize, width: usize) -> Result<(), DeviceError> {
    check_rows("add_rows out", &out, n, width);
    check_rows("add_rows x", &x, n, width);
    assert!(i32::try_from(width).is_ok(), "add_rows: width {width} does not fit an int");
    if n == 0 || width == 0 {
        return Ok(());
    }
    gpu.launch(
        "ew_add_rows",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[out.arg(), Arg::I64(out.stride as i64), x.arg(), Arg::I64(x.stride as i64), (width as i32).into()],
    )
}

/// `deepinfer_kernels::ops::add_scaled(out.row(r), p, x.row(r))` for each
/// `r < n` over `width` values: `out += p · x`, the product rounded before
/// the sum (no fused multiply-add). The CPU's bits.
pub fn add_scaled_rows(gpu: &Gpu, out: Rows, p: f32, x: Rows, n: usize, width: usize) -> Result<(), DeviceError> {
    check_rows("add_scaled_rows out", &out, n, width);
    check_rows("add_scaled_rows x", &x, n, width);
    assert!(i32::try_from(width).is_ok(), "add_scaled_rows: width {width} does not fit an int");
    if n == 0 || width == 0 {
        return Ok(());
    }
    gpu.launch(
        "ew_add_scaled_rows",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[out.arg(), Arg::I64(out.stride as i64), p.into(), x.arg(), Arg::I64(x.stride as i64), (width as i32).into()],
    )
}

/// `x[..len] *= factor` (one rounded product per value, as the CPU's
/// `*v *= factor` loops).
pub fn scale_rows(gpu: &Gpu, x: &DeviceBuffer<f32>, len: usize, factor: f32) -> Result<(), DeviceError> {
    assert!(x.len() >= len, "scale_rows: x holds {}, len {len}", x.len());
    if len == 0 {
        return Ok(());
    }
    gpu.launch("ew_scale", (grid_for(len), 1, 1), (THREADS, 1, 1), 0, &[x.arg(), Arg::I64(len as i64), factor.into()])
}
