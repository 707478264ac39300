//! Exact block sums for batches: a tile of [`TILE_ROWS`] weight rows is
//! decoded once to f64, column by column (each column's rows in three
//! vectors), and every x row of the batch runs through it in register tiles
//! of up to eight x rows × 24 weight rows. Each f64 multiply-add then serves
//! eight products with no decoding in the loop, and a block's 24 × 8 sums come
//! out of the accumulators with no horizontal reduction.
//!
//! FP8 weights decode as value · 2^-1016 against x values · 2^1000 (the
//! [`super::avx512`] trick: a shift and a mask per code); FP4 weights decode
//! to their e2m1 values through a 16-entry table against x's own values.
//! Either way each product is exact in f64 and so is each 32-column block's
//! sum, which then takes the definition's steps: rounded to f32, times x's
//! block scale, times the weight's, added to the row's K-order chain.

use std::arch::x86_64::*;

use super::{Prepared, Weights};
use crate::act_quant::{Fp8Row, ACT_BLOCK};
use crate::dtype::FP4_E2M1_VALUES;

/// Weight rows a tile holds: three vectors of eight f64 lanes.
const TILE_ROWS: usize = 24;
/// Vectors of weight rows in a register tile.
const ROW_VECTORS: usize = TILE_ROWS / 8;
/// Most x rows in one register tile (24 accumulators, three weight vectors
/// and a broadcast fill the 32 registers but for a few).
const X_ROWS_MAX: usize = 8;

/// Every x row's output for weight rows `first..` through the wide tiles,
/// laid out as [`super::rows_outputs`] lays them: `outputs[i * n + t]`. Each tile
/// of 24 rows runs over K in tiles of [`TILE_COLS`] columns,
/// every x row's chains carried from one to the next.
pub(super) fn outputs(weights: &Weights, prepared: &Prepared, first: usize, outputs: &mut [f32]) {
    let n = prepared.acts.len();
    let cols = prepared.acts[0].values.len();
    let (blocks, weight_rows) = (cols / ACT_BLOCK, outputs.len() / n);
    let mut tile = Tile::new();
    // SAFETY (every block below): `block_scaled_product` checked the path's
    // features (AVX-512F and VL among them) and that no FP8 code is NaN; the
    // rows, x groups and scales hold the columns and blocks the calls read.
    let mut chains: Vec<[__m256; TILE_ROWS / 8]> = vec![[unsafe { _mm256_setzero_ps() }; TILE_ROWS / 8]; n];
    for i0 in (0..weight_rows).step_by(TILE_ROWS) {
        let here = TILE_ROWS.min(weight_rows - i0);
        // Rows past the end repeat the last one; their outputs are dropped.
        let row = |i: usize| first + i0 + i.min(here - 1);
        let row_scales: [&[f32]; TILE_ROWS] = std::array::from_fn(|i| weights.scale_row(row(i), blocks));
        chains.iter_mut().for_each(|c| *c = [unsafe { _mm256_setzero_ps() }; TILE_ROWS / 8]);
        for k0 in (0..cols).step_by(TILE_COLS) {
            let kc = TILE_COLS.min(cols - k0);
            let restore = match weights {
                Weights::Fp8 { codes, .. } => {
                    let rows = std::array::from_fn(|i| &codes[row(i) * cols + k0..][..kc]);
                    unsafe { decode_fp8(&rows, kc, &mut tile) };
                    super::avx512::RESTORE
                }
                Weights::Fp4 { codes, .. } => {
                    let rows = std::array::from_fn(|i| &codes[(row(i) * cols + k0) / 2..][..kc / 2]);
                    unsafe { decode_fp4(&rows, kc, &mut tile) };
                    1.0
                }
            };
            tile.set_scales(&row_scales, k0 / ACT_BLOCK);
            for (g, t0) in (0..n).step_by(X_ROWS_MAX).enumerate() {
                let m = X_ROWS_MAX.min(n - t0);
                let xs = &prepared.wide[g][k0 * m..];
                macro_rules! chains {
                    ($m:literal) => {{
                        let a_scales: [&[f32]; $m] =
                            std::array::from_fn(|k| &prepared.a_scales[t0 + k][k0 / ACT_BLOCK..]);
                        let group: &mut [_; $m] = (&mut chains[t0..t0 + $m]).try_into().expect("a group of x rows");
                        unsafe { continue_chains::<$m>(&tile, xs, a_scales, restore, group) };
                    }};
                }
                match m {
                    1 => chains!(1),
                    2 => chains!(2),
                    3 => chains!(3),
                    4 => chains!(4),
                    5 => chains!(5),
                    6 => chains!(6),
                    7 => chains!(7),
                    8 => chains!(8),
                    m => unreachable!("{m} x rows at once"),
                }
            }
        }
        for (t, vectors) in chains.iter().enumerate() {
            // SAFETY: a vector of eight f32 lanes has the layout of `[f32; 8]`
            // (a plain move, where the store intrinsic would be a call here).
            let sums = vectors.map(|v| unsafe { std::mem::transmute::<__m256, [f32; 8]>(v) });
            for (i, &sum) in sums.as_flattened()[..here].iter().enumerate() {
                outputs[(i0 + i) * n + t] = sum;
            }
        }
    }
}

/// The x values times `scale` in f64 for the wide tiles, in groups of up to
/// [`X_ROWS_MAX`] rows, each group's values column by column (`group[c * m + t]`).
pub(super) fn interleaved(acts: &[Fp8Row], scale: f64) -> Vec<Vec<f64>> {
    acts.chunks(X_ROWS_MAX)
        .map(|group| {
            let (m, cols) = (group.len(), group[0].values.len());
            let mut values = vec![0.0f64; cols * m];
            for (t, row) in group.iter().enumerate() {
                for (at, &v) in values[t..].iter_mut().step_by(m).zip(&row.values) {
                    *at = v as f64 * scale;
                }
            }
            values
        })
        .collect()
}

/// Columns a tile holds: 24 rows of them in f64 (24 KiB) stay in L1 while
/// every x row of the batch passes.
const TILE_COLS: usize = 128;

/// A weight tile as the register tiles read it: `values[c * 24 + r]` for
/// column `c` and tile row `r` (each column's rows on whole cache lines), and
/// `scales[b * 24 + r]` for K block `b`.
struct Tile {
    buf: Vec<f64>,
    start: usize,
    cols: usize,
    scales: Vec<f32>,
}

impl Tile {
    fn new() -> Self {
        let buf = vec![0.0f64; TILE_COLS * TILE_ROWS + 8];
        let start = (8 - (buf.as_ptr() as usize / 8) % 8) % 8;
        Self { buf, start, cols: 0, scales: vec![0.0; TILE_COLS / ACT_BLOCK * TILE_ROWS] }
    }

    /// Columns decoded now.
    fn cols(&self) -> usize {
        self.cols
    }

    fn values(&self) -> &[f64] {
        &self.buf[self.start..][..self.cols * TILE_ROWS]
    }

    /// Room for `cols` columns, cache-line aligned.
    fn values_mut(&mut self, cols: usize) -> &mut [f64] {
        assert!(cols <= TILE_COLS && cols.is_multiple_of(ACT_BLOCK), "{cols} columns in a tile");
        self.cols = cols;
        &mut self.buf[self.start..][..cols * TILE_ROWS]
    }

    /// Tile rows' block scales from K block `first`: `row_scales[r]` holds row `r`'s.
    fn set_scales(&mut self, row_scales: &[&[f32]; TILE_ROWS], first: usize) {
        let blocks = self.cols / ACT_BLOCK;
        for (b, column) in self.scales.chunks_exact_mut(TILE_ROWS).enumerate().take(blocks) {
            column.iter_mut().zip(row_scales).for_each(|(s, row)| *s = row[first + b]);
        }
    }
}

/// Decode `cols` columns of FP8 rows (`rows[r]`: the tile row's codes from
/// the tile's first column, no NaN) as value · 2^-1016, eight rows and 32
/// columns at a time.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn decode_fp8(rows: &[&[u8]; TILE_ROWS], cols: usize, tile: &mut Tile) {
    assert!(rows.iter().all(|r| r.len() >= cols), "fp8 tile rows");
    let out = tile.values_mut(cols).as_mut_ptr();
    for v in 0..ROW_VECTORS {
        let eight: [*const u8; 8] = std::array::from_fn(|i| rows[8 * v + i].as_ptr());
        for c0 in (0..cols).step_by(ACT_BLOCK) {
            // Lane i of groups[g]: row i's eight codes at columns c0 + 8g...
            let groups = super::avx512::transpose_block(&eight, c0);
            for (g, &packed) in groups.iter().enumerate() {
                let at = |j: usize| out.add((c0 + 8 * g + j) * TILE_ROWS + 8 * v);
                _mm512_storeu_pd(at(0), super::avx512::fp8_lane_byte::<56>(packed));
                _mm512_storeu_pd(at(1), super::avx512::fp8_lane_byte::<48>(packed));
                _mm512_storeu_pd(at(2), super::avx512::fp8_lane_byte::<40>(packed));
                _mm512_storeu_pd(at(3), super::avx512::fp8_lane_byte::<32>(packed));
                _mm512_storeu_pd(at(4), super::avx512::fp8_lane_byte::<24>(packed));
                _mm512_storeu_pd(at(5), super::avx512::fp8_lane_byte::<16>(packed));
                _mm512_storeu_pd(at(6), super::avx512::fp8_lane_byte::<8>(packed));
                _mm512_storeu_pd(at(7), super::avx512::fp8_lane_byte::<0>(packed));
            }
        }
    }
}

/// Decode `cols` columns of FP4 rows (`rows[r]`: the tile row's code bytes
/// from the tile's first column, even columns in the low nibbles) to their
/// e2m1 values, eight rows and 32 columns at a time.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn decode_fp4(rows: &[&[u8]; TILE_ROWS], cols: usize, tile: &mut Tile) {
    assert!(rows.iter().all(|r| 2 * r.len() >= cols), "fp4 tile rows");
    let values: [f64; 16] = std::array::from_fn(|code| FP4_E2M1_VALUES[code] as f64);
    let (low_codes, high_codes) = (_mm512_loadu_pd(values.as_ptr()), _mm512_loadu_pd(values.as_ptr().add(8)));
    // Quadwords 2i and 2i + 1 of the two 4-row vectors: row i's first and last eight bytes.
    let first_halves = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
    let last_halves = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
    let out = tile.values_mut(cols).as_mut_ptr();
    for v in 0..ROW_VECTORS {
        for c0 in (0..cols).step_by(ACT_BLOCK) {
            // Sixteen bytes (32 columns) of each of eight rows, four rows a vector.
            let load = |i: usize| _mm_loadu_si128(rows[8 * v + i].as_ptr().add(c0 / 2).cast());
            let quad = |i: usize| {
                let low = _mm512_inserti32x4::<1>(_mm512_castsi128_si512(load(i)), load(i + 1));
                _mm512_inserti32x4::<3>(_mm512_inserti32x4::<2>(low, load(i + 2)), load(i + 3))
            };
            let (first4, last4) = (quad(0), quad(4));
            let halves = [
                _mm512_permutex2var_epi64(first4, first_halves, last4),
                _mm512_permutex2var_epi64(first4, last_halves, last4),
            ];
            for (h, &packed) in halves.iter().enumerate() {
                macro_rules! column {
                    ($j:literal) => {{
                        // Column c0 + 16h + j is nibble j of each lane; the
                        // table reads the index's low four bits only.
                        let code = _mm512_srli_epi64::<{ 4 * $j }>(packed);
                        let value = _mm512_permutex2var_pd(low_codes, code, high_codes);
                        _mm512_storeu_pd(out.add((c0 + 16 * h + $j) * TILE_ROWS + 8 * v), value);
                    }};
                }
                column!(0);
                column!(1);
                column!(2);
                column!(3);
                column!(4);
                column!(5);
                column!(6);
                column!(7);
                column!(8);
                column!(9);
                column!(10);
                column!(11);
                column!(12);
                column!(13);
                column!(14);
                column!(15);
            }
        }
    }
}

/// The K-order chains of the tile's 24 weight rows with `M` x rows continued
/// over the tile's columns: lane `l` of `chains[t][v]` is weight row `8v + l`
/// with x row `t`. `xs[c * M + t]` is x row `t`'s value at the tile's column
/// `c` in the tile's scale (FP8: times 2^1000): one stream for all `M` rows.
/// `restore` turns a block's f64 sum into the true one (a power of two),
/// `a_scales[t]` are x row `t`'s scales of the tile's blocks.
///
/// # Safety
/// The CPU must support AVX-512F and VL.
#[target_feature(enable = "avx512f,avx512vl")]
unsafe fn continue_chains<const M: usize>(
    tile: &Tile,
    xs: &[f64],
    a_scales: [&[f32]; M],
    restore: f64,
    chains: &mut [[__m256; ROW_VECTORS]; M],
) {
    let cols = tile.cols();
    let blocks = cols / ACT_BLOCK;
    assert!(xs.len() >= cols * M && a_scales.iter().all(|a| a.len() >= blocks), "x rows");
    assert!(tile.scales.len() >= blocks * TILE_ROWS, "tile scales");
    let (w, ws, xs) = (tile.values().as_ptr(), tile.scales.as_ptr(), xs.as_ptr());
    let restore = _mm512_set1_pd(restore);
    for b in 0..blocks {
        let mut acc = [[_mm512_setzero_pd(); ROW_VECTORS]; M];
        for c in b * ACT_BLOCK..(b + 1) * ACT_BLOCK {
            let column: [__m512d; ROW_VECTORS] = std::array::from_fn(|v| _mm512_loadu_pd(w.add(c * TILE_ROWS + 8 * v)));
            for (t, acc) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_pd(*xs.add(c * M + t));
                for (a, &w) in acc.iter_mut().zip(&column) {
                    *a = _mm512_fmadd_pd(w, x, *a);
                }
            }
        }
        let w_scales: [__m256; ROW_VECTORS] = std::array::from_fn(|v| _mm256_loadu_ps(ws.add(b * TILE_ROWS + 8 * v)));
        for (t, (acc, chain)) in acc.iter().zip(chains.iter_mut()).enumerate() {
            let a_scale = _mm256_set1_ps(*a_scales[t].get_unchecked(b));
            for v in 0..ROW_VECTORS {
                // The definition's order: the rounded sum, times x's scale, times the weight's.
                let sum = _mm512_cvtpd_ps(_mm512_mul_pd(acc[v], restore));
                chain[v] = _mm256_add_ps(chain[v], _mm256_mul_ps(_mm256_mul_ps(sum, a_scale), w_scales[v]));
            }
        }
    }
}
