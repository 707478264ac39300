//! Compute kernels for deepinfer: dtypes, quantised weight formats and the
//! numeric primitives of the DeepSeek-V4 forward pass.
//!
//! Every kernel is *batch-invariant*: the bits of one row's result depend only
//! on that row's inputs, never on how many rows were computed together or where
//! the row sits in the batch. The reduction order of each dot product is fixed.
//!
//! The linear kernels choose a code path at run time ([`Isa`]: AVX-512F with
//! or without VBMI, AVX2 + FMA, NEON on aarch64, or portable Rust); every path
//! produces the same bits. Where AVX-512BW decodes them, FP4 and FP8 weights
//! are regrouped at load ([`fp4_groups`], [`fp8_groups`]) with the same values.

pub mod act_quant;
mod aligned;
pub mod block_scaled;
pub mod cache;
pub mod dequantized_dot;
pub mod dtype;
pub mod exp;
pub mod fp4_groups;
pub mod fp8_groups;
pub mod linear;
pub mod ops;
pub mod quantize;
mod row_groups;
mod row_layout;
mod simd;
pub mod workers;

pub use linear::{Isa, Linear, WeightFormat};
