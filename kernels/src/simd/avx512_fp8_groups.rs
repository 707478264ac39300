//! AVX-512 kernel over [`crate::fp8_groups`]: each output's 16 lanes
//! accumulated in the reference order (column `c` into lane `c % 16`, by
//! fused multiply-adds in column order), read as one sequential stream per
//! group. Codes decode to f32 bits worth value · 2^-120 as in the published
//! layout's kernel, 32 at a time from one sign-extension to words.

use std::arch::x86_64::*;

use crate::fp8_groups::{CHUNK_COLS, GROUP_ROWS, PAIRED_COLS};
use crate::row_groups::Line;

use super::avx512::{scale_on_x, POW2_120};

/// One group of a [`crate::fp8_groups::Fp8Groups`]: its chunks and its scale
/// per column block.
pub(crate) struct GroupRef<'a> {
    pub lines: &'a [Line],
    pub scales: &'a [f32],
    pub block_cols: usize,
}

/// The dot products of `MR` input rows with rows `j0..j0 + RP` of one
/// group: `out[i][j]` for x row `i` and group row `j0 + j`, each with the
/// bits of [`crate::linear::dot`] against the row's dequantised values.
/// `abs_max[i][b]` bounds `|x|` of row `i` over column block `b`. Where a
/// block's scale times 2^120 is a power of two that no `x · factor`
/// overflows, it multiplies x (once for all rows of the pass); otherwise each
/// decoded weight, as the published layout's kernel does. Both give each
/// product `x · value · scale` exactly, so the bits are the same.
///
/// # Safety
/// The CPU must support AVX-512F and BW; the group's codes hold no NaN.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn group_dot<const MR: usize, const RP: usize>(
    group: &GroupRef,
    xs: [&[f32]; MR],
    abs_max: [&[f32]; MR],
    j0: usize,
) -> [[f32; RP]; MR] {
    let cols = xs[0].len();
    let (chunks, blocks) = (cols / CHUNK_COLS, group.scales.len());
    assert!(cols.is_multiple_of(CHUNK_COLS) && group.lines.len() == chunks * GROUP_ROWS, "group of {cols}");
    assert!(group.block_cols.is_multiple_of(CHUNK_COLS) && blocks == cols.div_ceil(group.block_cols), "blocks");
    assert!(xs.iter().all(|x| x.len() == cols) && abs_max.iter().all(|m| m.len() == blocks), "x rows");
    assert!(j0 + RP <= GROUP_ROWS, "group rows {j0}..{}", j0 + RP);
    let mut acc = [[_mm512_setzero_ps(); RP]; MR];
    let chunks_per_block = group.block_cols / CHUNK_COLS;
    for (b, &scale) in group.scales.iter().enumerate() {
        let bound = abs_max.iter().fold(0.0f32, |m, row| m.max(row[b]));
        let chunk_range = b * chunks_per_block..((b + 1) * chunks_per_block).min(chunks);
        match scale_on_x(scale, bound) {
            Some(x_factor) => acc = block_dot::<MR, RP, true>(group, &xs, j0, chunk_range, x_factor, acc),
            None => acc = block_dot::<MR, RP, false>(group, &xs, j0, chunk_range, scale * POW2_120, acc),
        }
    }
    super::avx512::reduce_accumulators(&acc)
}

/// The chunks of one column block: `factor` (the scale times 2^120)
/// multiplies x when `ON_X`, each decoded weight otherwise.
///
/// # Safety
/// As [`group_dot`], whose checks cover every chunk and x column read here.
#[inline(always)]
unsafe fn block_dot<const MR: usize, const RP: usize, const ON_X: bool>(
    group: &GroupRef,
    xs: &[&[f32]; MR],
    j0: usize,
    chunk_range: std::ops::Range<usize>,
    factor: f32,
    mut acc: [[__m512; RP]; MR],
) -> [[__m512; RP]; MR] {
    let factor = _mm512_set1_ps(factor);
    for ch in chunk_range {
        let chunk = group.lines.as_ptr().add(ch * GROUP_ROWS).cast::<u8>();
        super::fetch_ahead(chunk, GROUP_ROWS);
        for half in 0..CHUNK_COLS / PAIRED_COLS {
            let c = ch * CHUNK_COLS + PAIRED_COLS * half;
            let mut x = [(_mm512_setzero_ps(), _mm512_setzero_ps()); MR];
            for (xv, row) in x.iter_mut().zip(xs) {
                let (low, high) = (_mm512_loadu_ps(row.as_ptr().add(c)), _mm512_loadu_ps(row.as_ptr().add(c + 16)));
                *xv = if ON_X { (_mm512_mul_ps(low, factor), _mm512_mul_ps(high, factor)) } else { (low, high) };
            }
            for j in 0..RP {
                let (low, high) = paired_bits(chunk.add((j0 + j) * CHUNK_COLS + PAIRED_COLS * half));
                let (low, high) =
                    if ON_X { (low, high) } else { (_mm512_mul_ps(low, factor), _mm512_mul_ps(high, factor)) };
                for (acc_i, xv) in acc.iter_mut().zip(&x) {
                    acc_i[j] = _mm512_fmadd_ps(xv.0, low, acc_i[j]);
                    acc_i[j] = _mm512_fmadd_ps(xv.1, high, acc_i[j]);
                }
            }
        }
    }
    acc
}

/// The 32 codes of a paired half line at `p` (byte `2l` column `l`, byte
/// `2l + 1` column `16 + l`) as f32 bits worth value · 2^-120: columns
/// `0..16` and `16..32`. Sign-extended to words, a dword holds column `l` in
/// its low word and `16 + l` in its high word; shifting a word's code under
/// the f32 exponent field (by 20 or 4) leaves its sign copies on bits 31..27,
/// and the mask keeps one sign bit and the magnitude (bits 26..20).
///
/// # Safety
/// The CPU must support AVX-512F and BW, and `p` must point at 32 readable
/// bytes holding no NaN code.
#[inline(always)]
unsafe fn paired_bits(p: *const u8) -> (__m512, __m512) {
    let words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p.cast()));
    let mask = _mm512_set1_epi32(0x87f0_0000u32 as i32);
    let low = _mm512_and_si512(_mm512_slli_epi32::<20>(words), mask);
    let high = _mm512_and_si512(_mm512_slli_epi32::<4>(words), mask);
    (_mm512_castsi512_ps(low), _mm512_castsi512_ps(high))
}

/// Columns `k0..k0 + len` of rows `rows` of a group, dequantised: row
/// `rows.start + i` at `out[i * stride..][..len]`; `k0` and `len` are
/// multiples of 16. The rows are walked together, chunk by chunk, so the
/// group's lines are read in their stored order. Each value is the decoded
/// bits times the scale times 2^120: one rounding of `value · scale`, as
/// published.
///
/// # Safety
/// The CPU must support AVX-512F and BW; the group's codes hold no NaN.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn decode_rows(
    group: &GroupRef,
    rows: std::ops::Range<usize>,
    (k0, len): (usize, usize),
    out: &mut [f32],
    stride: usize,
) {
    let end = k0 + len;
    assert!(rows.end <= GROUP_ROWS && k0.is_multiple_of(16) && end.is_multiple_of(16), "span {k0}..{end}");
    assert!(end.div_ceil(CHUNK_COLS) * GROUP_ROWS <= group.lines.len(), "span past the group's chunks");
    assert!(end.div_ceil(group.block_cols) <= group.scales.len(), "span past the group's scales");
    assert!(rows.is_empty() || out.len() >= (rows.len() - 1) * stride + len, "rows past the output");
    let dst = out.as_mut_ptr();
    let mut c = k0;
    while c < end {
        let b = c / group.block_cols;
        let factor = _mm512_set1_ps(group.scales[b] * POW2_120);
        let stop = ((b + 1) * group.block_cols).min(end);
        while c < stop {
            let within = c % CHUNK_COLS;
            // A span may start or end on the second 16 columns of a pair.
            let (first_half, second_half) = match within.is_multiple_of(PAIRED_COLS) {
                false => (false, true),
                true => (true, c + PAIRED_COLS <= stop),
            };
            let chunk = group.lines.as_ptr().add(c / CHUNK_COLS * GROUP_ROWS).cast::<u8>();
            for (i, j) in rows.clone().enumerate() {
                let (low, high) = paired_bits(chunk.add(j * CHUNK_COLS + within / PAIRED_COLS * PAIRED_COLS));
                let at = dst.add(i * stride + c - k0);
                if first_half {
                    _mm512_storeu_ps(at, _mm512_mul_ps(low, factor));
                }
                if second_half {
                    _mm512_storeu_ps(at.add(if first_half { 16 } else { 0 }), _mm512_mul_ps(high, factor));
                }
            }
            c += if first_half && second_half { PAIRED_COLS } else { 16 };
        }
    }
}
