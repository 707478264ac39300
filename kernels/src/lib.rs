//! Compute kernels for deepinfer: dtypes, quantised weight formats and the
//! numeric primitives of the DeepSeek-V4 forward pass.
//!
//! Every kernel is *batch-invariant*: the bits of one row's result depend only
//! on that row's inputs, never on how many rows were computed together or where
//! the row sits in the batch. The reduction order of each sum is fixed: a
//! linear's output is one chain of fused multiply-adds over the columns in
//! order ([`Linear::forward_reference`]), a [`linear::dot`] 16 lane chains and
//! a fixed tree.
//!
//! The kernels choose a code path at run time ([`Isa`]: AVX-512F and BW,
//! AVX2 + FMA, NEON on aarch64, or portable Rust); every path
//! produces the same bits. Linear weights are laid out at load in groups of
//! 64 rows, column by column ([`panels`]), with the same values.

pub mod act_quant;
mod aligned;
pub mod block_scaled;
pub mod cache;
mod column_order;
pub mod dequantized_dot;
pub mod dtype;
pub mod exp;
pub mod linear;
pub mod ops;
pub mod panels;
pub mod pooling;
pub mod quantize;
mod simd;
pub mod workers;

pub use linear::{Isa, Linear, WeightFormat};
