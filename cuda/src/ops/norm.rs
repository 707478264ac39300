//! RMSNorm over rows (`cuda/kernels/norm.cu`).

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
    assert!(n * dim <= x.len(), "rms_norm_rows: {n} rows of {dim} in a buffer of {}", x.len());
    if let Some(w) = weight {
        assert!(w.len() >= dim, "rms_norm_rows: a weight of {} for rows of {dim}", w.len());
    }
    let w = weight.map_or(Arg::Ptr(0), DeviceBuffer::arg);
    gpu.launch("rms_norm_rows", (n as u32, 1, 1), (128, 1, 1), 0, &[x.arg(), w, (dim as i32).into(), eps.into()])
}
