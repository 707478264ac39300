//! AVX-512BW kernels over [`crate::fp4_groups`]: 32 weights decoded per
//! `vpermw`, each output's 16 lanes accumulated in the reference order
//! (column `c` into lane `c % 16`, by fused multiply-adds in column order).

use std::arch::x86_64::*;

use crate::dtype::FP4_E2M1_VALUES;
use crate::fp4_groups::{CHUNK_COLS, CHUNK_LINES, GROUP_ROWS, SCALE_COLS};
use crate::row_groups::Line;

/// The bf16 of every e2m1 value, twice (`vpermw` reads five index bits; the
/// nibbles above a code leave its fifth bit arbitrary).
const BF16_TABLE: [u16; 32] = {
    let mut table = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        table[i] = (FP4_E2M1_VALUES[i % 16].to_bits() >> 16) as u16;
        i += 1;
    }
    table
};
/// Table words that take the scale step: all but the two zeros (codes 0 and 8).
const NONZERO_WORDS: __mmask32 = 0xFEFE_FEFE;

/// The values of 32 weights of one block: `line`'s words shifted right by
/// `4k` (block `k`) looked up in the table stepped by the block's scale.
/// Returns columns `0..16` and `16..32` of the block as f32.
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[inline(always)]
unsafe fn block_values(table: __m512i, codes: __m512i, step: *const i32) -> (__m512, __m512) {
    let stepped = _mm512_mask_add_epi16(table, NONZERO_WORDS, table, _mm512_set1_epi32(step.read_unaligned()));
    let words = _mm512_permutexvar_epi16(codes, stepped);
    let low = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(0xffff_0000u32 as i32)));
    let high = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words));
    (low, high)
}

/// Step word of row `j`, block `k` of a chunk at `chunk`.
#[inline(always)]
unsafe fn step_ptr(chunk: *const Line, j: usize, k: usize) -> *const i32 {
    chunk.add(GROUP_ROWS).cast::<i32>().add(j * 4 + k)
}

/// The dot products of `MR` input rows with rows `j0..j0 + RP` of one
/// group: `out[i][j]` for x row `i` and group row `j0 + j`, each with the bits
/// of [`crate::linear::dot`] against the row's dequantised values. The
/// `MR × RP` accumulators and `2 · MR` x registers must leave room for the
/// decode within the 32 zmm registers.
///
/// # Safety
/// The CPU must support AVX-512F and BW; `lines` holds `cols / 128` chunks,
/// every x row `cols` values, and `j0 + RP <= 8`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn group_dot<const MR: usize, const RP: usize>(
    lines: &[Line],
    xs: [&[f32]; MR],
    j0: usize,
) -> [[f32; RP]; MR] {
    let cols = xs[0].len();
    assert!(cols.is_multiple_of(CHUNK_COLS) && lines.len() == cols / CHUNK_COLS * CHUNK_LINES, "group of {cols}");
    assert!(xs.iter().all(|x| x.len() == cols) && j0 + RP <= GROUP_ROWS, "x rows, group rows");
    let table = _mm512_loadu_si512(BF16_TABLE.as_ptr().cast());
    let mut acc = [[_mm512_setzero_ps(); RP]; MR];
    for ch in 0..cols / CHUNK_COLS {
        let chunk = lines.as_ptr().add(ch * CHUNK_LINES);
        super::fetch_ahead(chunk.cast(), CHUNK_LINES);
        macro_rules! block {
            ($k:literal) => {{
                let c = ch * CHUNK_COLS + $k * SCALE_COLS;
                // Plain loops, not closures: a closure would not carry the target
                // features and would be called out of line.
                let mut x = [(_mm512_setzero_ps(), _mm512_setzero_ps()); MR];
                for (xi, row) in x.iter_mut().zip(&xs) {
                    *xi = (_mm512_loadu_ps(row.as_ptr().add(c)), _mm512_loadu_ps(row.as_ptr().add(c + 16)));
                }
                for j in 0..RP {
                    let line = _mm512_load_si512(chunk.add(j0 + j).cast());
                    let codes = _mm512_srli_epi16::<{ 4 * $k }>(line);
                    let (low, high) = block_values(table, codes, step_ptr(chunk, j0 + j, $k));
                    for i in 0..MR {
                        acc[i][j] = _mm512_fmadd_ps(x[i].0, low, acc[i][j]);
                        acc[i][j] = _mm512_fmadd_ps(x[i].1, high, acc[i][j]);
                    }
                }
            }};
        }
        block!(0);
        block!(1);
        block!(2);
        block!(3);
    }
    super::avx512::reduce_accumulators(&acc)
}

/// Columns `k0..k0 + out.len()` of row `j` of a group (`lines`: its chunks),
/// dequantised; `k0` and the length are multiples of 16.
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn decode_span(lines: &[Line], j: usize, k0: usize, out: &mut [f32]) {
    let end = k0 + out.len();
    assert!(j < GROUP_ROWS && k0.is_multiple_of(16) && end.is_multiple_of(16), "span {k0}..{end}");
    assert!(end.div_ceil(CHUNK_COLS) * CHUNK_LINES <= lines.len(), "span past the group's chunks");
    let table = _mm512_loadu_si512(BF16_TABLE.as_ptr().cast());
    let dst = out.as_mut_ptr();
    let mut c = k0;
    while c < end {
        let (chunk, within) = (lines.as_ptr().add(c / CHUNK_COLS * CHUNK_LINES), c % CHUNK_COLS);
        let k = within / SCALE_COLS;
        let line = _mm512_load_si512(chunk.add(j).cast());
        let codes = _mm512_srl_epi16(line, _mm_cvtsi32_si128(4 * k as i32));
        let (low, high) = block_values(table, codes, step_ptr(chunk, j, k));
        let at = dst.add(c - k0);
        if !within.is_multiple_of(SCALE_COLS) {
            _mm512_storeu_ps(at, high);
            c += 16;
        } else if c + SCALE_COLS <= end {
            _mm512_storeu_ps(at, low);
            _mm512_storeu_ps(at.add(16), high);
            c += SCALE_COLS;
        } else {
            _mm512_storeu_ps(at, low);
            c += 16;
        }
    }
}

/// Columns `k0..k0 + len` of rows `rows` of a group (`lines`: its chunks),
/// dequantised: row `rows.start + i` at `out[i * stride..][..len]`; `k0` and
/// `len` are multiples of 16. The span's whole chunks are walked chunk by
/// chunk, every row of a chunk in turn, so the group's lines are read once
/// each in their stored order (row by row, a row's lines are ten apart, and
/// each is loaded once per block); a partial chunk at either end goes
/// through [`decode_span`]. The values are [`decode_span`]'s.
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn decode_rows(
    lines: &[Line],
    rows: std::ops::Range<usize>,
    (k0, len): (usize, usize),
    out: &mut [f32],
    stride: usize,
) {
    let end = k0 + len;
    assert!(rows.end <= GROUP_ROWS && k0.is_multiple_of(16) && end.is_multiple_of(16), "span {k0}..{end}");
    assert!(end.div_ceil(CHUNK_COLS) * CHUNK_LINES <= lines.len(), "span past the group's chunks");
    assert!(rows.is_empty() || out.len() >= (rows.len() - 1) * stride + len, "rows past the output");
    let whole = k0.next_multiple_of(CHUNK_COLS)..end / CHUNK_COLS * CHUNK_COLS;
    if whole.start >= whole.end {
        for (i, j) in rows.enumerate() {
            decode_span(lines, j, k0, &mut out[i * stride..][..len]);
        }
        return;
    }
    for (i, j) in rows.clone().enumerate() {
        let row = &mut out[i * stride..][..len];
        decode_span(lines, j, k0, &mut row[..whole.start - k0]);
        decode_span(lines, j, whole.end, &mut row[whole.end - k0..]);
    }
    let table = _mm512_loadu_si512(BF16_TABLE.as_ptr().cast());
    let dst = out.as_mut_ptr();
    for c in whole.step_by(CHUNK_COLS) {
        let chunk = lines.as_ptr().add(c / CHUNK_COLS * CHUNK_LINES);
        super::fetch_ahead(chunk.cast(), CHUNK_LINES);
        for (i, j) in rows.clone().enumerate() {
            let line = _mm512_load_si512(chunk.add(j).cast());
            let at = dst.add(i * stride + c - k0);
            macro_rules! block {
                ($k:literal) => {{
                    let codes = _mm512_srli_epi16::<{ 4 * $k }>(line);
                    let (low, high) = block_values(table, codes, step_ptr(chunk, j, $k));
                    _mm512_storeu_ps(at.add($k * SCALE_COLS), low);
                    _mm512_storeu_ps(at.add($k * SCALE_COLS + 16), high);
                }};
            }
            block!(0);
            block!(1);
            block!(2);
            block!(3);
        }
    }
}
