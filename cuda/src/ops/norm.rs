//! RMSNorm over rows (`cuda/kernels/norm.cu`).

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// [`deepinfer_kernels::ops::rms_norm`] on each of `n` rows of `dim` values,
/// in place; `weight` of `dim` values or none. The CPU's bits.
pub fn rms_norm_rows(
    gpu: &Gpu,
    x: &DeviceBuffer<f32>,
    n: usize,
    dim: usize,
    weight: Option<&DeviceBuffer<f32>>,
    eps: f32,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    let _ = Rows::packed(x, dim);
    let w = weight.map_or(Arg::Ptr(0), DeviceBuffer::arg);
    gpu.launch("rms_norm_rows", (n as u32, 1, 1), (128, 1, 1), 0, &[x.arg(), w, (dim as i32).into(), eps.into()])
}
