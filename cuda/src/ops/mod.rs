//! Typed launches of the kernels: what a forward pass calls on a [`crate::Gpu`].
//! Each function names the CPU function (in `deepinfer-kernels` or the
//! engine) whose arithmetic it follows; the tests hold them to its bits.

use crate::{Arg, DeviceBuffer};

pub mod attention;
pub mod compressor;
pub mod elementwise;
pub mod hyper;
pub mod linear;
pub mod linear_splitk;
pub mod moe;
pub mod norm;
pub mod sampling;
pub mod v41;
pub mod v41_model;

/// Rows of f32 values in a device buffer: row `r` starts at element
/// `offset + r * stride`.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    pub buf: &'a DeviceBuffer<f32>,
    pub offset: usize,
    pub stride: usize,
}

impl<'a> Rows<'a> {
    /// Packed rows of `width` values from the buffer's start.
    pub fn packed(buf: &'a DeviceBuffer<f32>, width: usize) -> Self {
        Self { buf, offset: 0, stride: width }
    }

    pub fn new(buf: &'a DeviceBuffer<f32>, offset: usize, stride: usize) -> Self {
        Self { buf, offset, stride }
    }

    /// The address of row `r` as a kernel argument.
    pub fn row(&self, r: usize) -> Arg {
        self.buf.at(self.offset + r * self.stride)
    }

    /// The address of the first row.
    pub fn arg(&self) -> Arg {
        self.buf.at(self.offset)
    }
}
