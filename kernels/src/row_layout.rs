//! Where each row of a published quantised weight (bf16, FP8 blocks, FP4
//! rows) keeps its codes and scales, for the kernels that read spans of rows.

use crate::linear::{Linear, WeightFormat};
use crate::simd::{Encoding, ScaleRow};

/// Where each row of a quantised weight keeps its codes and scales, worked out
/// once per call so that finding a row's span costs no division (a tile asks
/// for up to 24 spans, and small matrices have many tiles).
pub(crate) struct RowLayout<'a> {
    encoding: Encoding,
    codes: &'a [u8],
    scales: &'a [f32],
    /// Code bytes per row.
    row_bytes: usize,
    /// Columns per scale, and scales per scale row.
    scale_block: usize,
    scales_per_row: usize,
    /// Weight rows per scale row, as a shift (FP8 blocks are powers of two in
    /// every published layout) or a divisor.
    rows_per_scale_row: usize,
    rows_per_scale_row_shift: Option<u32>,
}

impl<'a> RowLayout<'a> {
    pub(crate) fn of(lin: &'a Linear) -> Self {
        let cols = lin.cols;
        let (encoding, codes, scales, scale_block, scales_per_row, rows_per_scale_row): (_, &[u8], &[f32], _, _, _) =
            match &lin.format {
                WeightFormat::F32(_) | WeightFormat::Fp4Grouped(_) | WeightFormat::Fp8Grouped(_) => {
                    unreachable!("not read by spans")
                }
                WeightFormat::Bf16(d) => (Encoding::Bf16, d, &[], 16, 0, 1),
                WeightFormat::Fp8 { data, scales, block_rows, block_cols, .. } => {
                    (Encoding::Fp8, data, scales, *block_cols, cols.div_ceil(*block_cols), *block_rows)
                }
                WeightFormat::Fp4 { data, scales, block_cols } => {
                    (Encoding::Fp4, data, scales, *block_cols, cols / block_cols, 1)
                }
            };
        let shift = rows_per_scale_row.is_power_of_two().then(|| rows_per_scale_row.trailing_zeros());
        let row_bytes = encoding.bytes(cols);
        Self {
            encoding,
            codes,
            scales,
            row_bytes,
            scale_block,
            scales_per_row,
            rows_per_scale_row,
            rows_per_scale_row_shift: shift,
        }
    }

    /// Columns `k0..k0 + len` (`k0` a multiple of 16) of row `r` as stored,
    /// with the row's scales.
    #[inline(always)]
    pub(crate) fn span(&self, r: usize, k0: usize, len: usize) -> (&'a [u8], ScaleRow<'a>) {
        // `k0` is a multiple of 16, so an FP4 span covers whole bytes.
        let start = r * self.row_bytes + self.encoding.bytes(k0);
        let codes = &self.codes[start..start + self.encoding.bytes(len)];
        let scale_row = match self.rows_per_scale_row_shift {
            Some(shift) => r >> shift,
            None => r / self.rows_per_scale_row,
        };
        let row = &self.scales[scale_row * self.scales_per_row..][..self.scales_per_row];
        let scales = ScaleRow { row, block: self.scale_block, pairs: self.encoding == Encoding::Fp4 };
        (codes, scales)
    }
}
