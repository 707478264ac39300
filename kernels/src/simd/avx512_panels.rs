//! AVX-512 column-order kernels over [`crate::panels`]: register tiles of up
//! to six x rows × 64 outputs on decoded f32 tiles, the tiles' decoders, and
//! fused kernels for a few x rows that decode each weight in registers once
//! per pass. Every output is the chain of [`crate::Linear::forward_reference`].

use std::arch::x86_64::*;

use super::fetch_ahead;
use super::panels_generic::X_ROWS;
use crate::dtype::FP4_E2M1_VALUES;
use crate::panels::{GROUP_ROWS, POW2_120};

/// Vectors per group of 64 outputs.
const VECTORS: usize = GROUP_ROWS / 16;
/// The bf16 of every e2m1 value, twice (`vpermw` reads five index bits; the
/// high nibble under a low one leaves the fifth bit arbitrary).
const BF16_TABLE: [u16; 32] = {
    let mut table = [0u16; 32];
    let mut i = 0;
    while i < 32 {
        table[i] = (FP4_E2M1_VALUES[i % 16].to_bits() >> 16) as u16;
        i += 1;
    }
    table
};
/// bf16 sign, exponent and the three mantissa bits of an e4m3 code shifted
/// left by 4 (after sign extension to 16 bits): its value times 2^-120.
const FP8_FIELDS: i16 = 0x87f0u16 as i16;

/// The first `M` x rows (`xs[r][c]`) against the first `16 · V` of a
/// tile's 64 outputs (`w[c · 64 + o]`) over `kc` columns, continuing
/// `out[r · stride + o]` (from +0.0 when `fresh`): each x value broadcast
/// against `V` vectors. `V` is 4 but for a last group of 32 rows or fewer
/// (mHC's 24-row mixes), which computes only the vectors its rows fill.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn plain<const M: usize, const V: usize>(
    xs: &[&[f32]; X_ROWS],
    w: &[f32],
    kc: usize,
    out: &mut [f32],
    stride: usize,
    fresh: bool,
) {
    assert!((1..=X_ROWS).contains(&M) && xs[..M].iter().all(|x| x.len() >= kc), "tile x rows");
    assert!((1..=VECTORS).contains(&V) && w.len() >= kc * GROUP_ROWS, "tile weights");
    assert!(out.len() >= (M - 1) * stride + 16 * V, "tile outputs");
    let mut acc = [[_mm512_setzero_ps(); V]; M];
    if !fresh {
        load_rows(&mut acc, out, stride);
    }
    chain(&mut acc, &x_rows(xs, 0), w.as_ptr(), kc);
    store_rows(&acc, out, stride);
}

/// [`plain`] with FP4 block scales: each block of `block_cols` columns is a
/// chain from +0.0, then `out = fma(block sum, scale, out)` with the lane's
/// scale of that block (`scales[b · 64 + o]`). The tile runs one half of
/// its 64 lanes at a time, so the block sums and totals of six x rows stay
/// in registers. (Over all 64 lanes at once, totals in registers left room
/// for three x rows, each weight read from L2 twice as often; totals in an
/// L1 buffer ran as fast on one thread and 9% slower on two.)
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn block_scaled<const M: usize>(
    xs: &[&[f32]; X_ROWS],
    w: &[f32],
    scales: &[f32],
    block_cols: usize,
    kc: usize,
    out: &mut [f32],
    stride: usize,
    fresh: bool,
) {
    assert!((1..=X_ROWS).contains(&M) && xs[..M].iter().all(|x| x.len() >= kc), "tile x rows");
    assert!(w.len() >= kc * GROUP_ROWS, "tile weights");
    assert!(kc.is_multiple_of(block_cols) && scales.len() >= kc / block_cols * GROUP_ROWS, "tile blocks");
    assert!(out.len() >= (M - 1) * stride + GROUP_ROWS, "tile outputs");
    for half in 0..2 {
        let lane0 = 32 * half;
        let mut totals = [[_mm512_setzero_ps(); 2]; M];
        if !fresh {
            load_rows(&mut totals, &out[lane0..], stride);
        }
        for b in 0..kc / block_cols {
            let c0 = b * block_cols;
            let mut block = [[_mm512_setzero_ps(); 2]; M];
            chain(&mut block, &x_rows(xs, c0), w.as_ptr().add(c0 * GROUP_ROWS + lane0), block_cols);
            let s = scales.as_ptr().add(b * GROUP_ROWS + lane0);
            for v in 0..2 {
                let sv = _mm512_loadu_ps(s.add(16 * v));
                for (t, p) in totals.iter_mut().zip(&block) {
                    t[v] = _mm512_fmadd_ps(p[v], sv, t[v]);
                }
            }
        }
        store_rows(&totals, &mut out[lane0..], stride);
    }
}

/// [`fused_fp4`]'s totals, aligned to cache lines.
#[repr(align(64))]
struct Totals([f32; X_ROWS * GROUP_ROWS]);

/// The x rows' columns from `c0` on.
#[inline(always)]
unsafe fn x_rows<const M: usize>(xs: &[&[f32]; X_ROWS], c0: usize) -> [*const f32; M] {
    std::array::from_fn(|r| xs[r].as_ptr().add(c0))
}

/// Continue `acc` over `kc` columns of x rows and a decoded tile: `V`
/// vectors of each 64-lane column from `w` on.
#[inline(always)]
unsafe fn chain<const M: usize, const V: usize>(
    acc: &mut [[__m512; V]; M],
    xs: &[*const f32; M],
    w: *const f32,
    kc: usize,
) {
    for c in 0..kc {
        let wp = w.add(c * GROUP_ROWS);
        let mut wv = [_mm512_setzero_ps(); V];
        for (v, wvv) in wv.iter_mut().enumerate() {
            *wvv = _mm512_loadu_ps(wp.add(16 * v));
        }
        for (a, x) in acc.iter_mut().zip(xs) {
            let b = _mm512_set1_ps(*x.add(c));
            for (av, wvv) in a.iter_mut().zip(&wv) {
                *av = _mm512_fmadd_ps(b, *wvv, *av);
            }
        }
    }
}

#[inline(always)]
unsafe fn load_rows<const M: usize, const V: usize>(acc: &mut [[__m512; V]; M], out: &[f32], stride: usize) {
    for (r, a) in acc.iter_mut().enumerate() {
        for (v, av) in a.iter_mut().enumerate() {
            *av = _mm512_loadu_ps(out.as_ptr().add(r * stride + 16 * v));
        }
    }
}

#[inline(always)]
unsafe fn store_rows<const M: usize, const V: usize>(acc: &[[__m512; V]; M], out: &mut [f32], stride: usize) {
    for (r, a) in acc.iter().enumerate() {
        for (v, av) in a.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * stride + 16 * v), *av);
        }
    }
}

/// bf16 bits to f32, 16 at a time (`src.len() == tile.len()`, a multiple of 16).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn decode_bf16(src: &[u16], tile: &mut [f32]) {
    assert!(src.len() == tile.len() && tile.len().is_multiple_of(16), "bf16 tile");
    for i in (0..tile.len()).step_by(16) {
        tile.as_mut_ptr().add(i).cast::<__m512>().write_unaligned(bf16x16(src.as_ptr().add(i)));
    }
}

#[inline(always)]
unsafe fn bf16x16(p: *const u16) -> __m512 {
    let words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words))
}

/// Columns of e4m3 codes (64 a column) times each lane's scale, into `tile`:
/// `codes` from the tile's first column, `scales(c)` the 64 lane scales of its
/// column `c` (no NaN code, every `scale · 2^120` finite).
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn decode_fp8(codes: &[u8], kc: usize, scales: impl Fn(usize) -> *const f32, tile: &mut [f32]) {
    assert!(codes.len() >= kc * GROUP_ROWS && tile.len() >= kc * GROUP_ROWS, "fp8 tile");
    let mut wide = [_mm512_setzero_ps(); VECTORS];
    let mut last_scales = std::ptr::null();
    for c in 0..kc {
        let s = scales(c);
        if s != last_scales {
            for (v, wv) in wide.iter_mut().enumerate() {
                *wv = _mm512_mul_ps(_mm512_loadu_ps(s.add(16 * v)), _mm512_set1_ps(POW2_120));
            }
            last_scales = s;
        }
        for half in 0..2 {
            let [low, high] = fp8_half(codes.as_ptr().add(c * GROUP_ROWS), half);
            let dst = tile.as_mut_ptr().add(c * GROUP_ROWS + 32 * half);
            _mm512_storeu_ps(dst, _mm512_mul_ps(low, wide[2 * half]));
            _mm512_storeu_ps(dst.add(16), _mm512_mul_ps(high, wide[2 * half + 1]));
        }
    }
}

/// Half `half` of a column of e4m3 codes (none NaN; lanes at their
/// [`crate::panels::lane_slot`]) as f32 values times 2^-120: lanes
/// `32·half..32·half + 16` and `32·half + 16..32·half + 32`. Each code is
/// sign-extended to a word and shifted under a bf16 exponent, 32 at a time.
#[inline(always)]
unsafe fn fp8_half(p: *const u8, half: usize) -> [__m512; 2] {
    let words = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p.add(32 * half).cast()));
    let bf16 = _mm512_and_si512(_mm512_slli_epi16::<4>(words), _mm512_set1_epi16(FP8_FIELDS));
    [
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(bf16)),
        _mm512_castsi512_ps(_mm512_and_si512(bf16, _mm512_set1_epi32(0xffff_0000u32 as i32))),
    ]
}

/// Column pairs of FP4 codes (64 bytes a pair, lanes in [`crate::panels::lane_slot`]
/// order) as their e2m1 values, unscaled, into `tile` (`kc` columns).
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn decode_fp4(codes: &[u8], kc: usize, tile: &mut [f32]) {
    assert!(kc.is_multiple_of(2) && codes.len() >= kc / 2 * GROUP_ROWS && tile.len() >= kc * GROUP_ROWS, "fp4 tile");
    let table = _mm512_loadu_si512(BF16_TABLE.as_ptr().cast());
    for q in 0..kc / 2 {
        let dst = tile.as_mut_ptr().add(2 * q * GROUP_ROWS);
        for half in 0..2 {
            let [e0, e1, o0, o1] = fp4_half(codes.as_ptr().add(q * GROUP_ROWS), half, table);
            _mm512_storeu_ps(dst.add(32 * half), e0);
            _mm512_storeu_ps(dst.add(32 * half + 16), e1);
            _mm512_storeu_ps(dst.add(GROUP_ROWS + 32 * half), o0);
            _mm512_storeu_ps(dst.add(GROUP_ROWS + 32 * half + 16), o1);
        }
    }
}

/// Half `half` (lanes `32·half..32·half + 32`) of a column pair: the e2m1
/// values of its even column (lanes 0..16 and 16..32 of the half) and of its
/// odd column, unscaled.
#[inline(always)]
unsafe fn fp4_half(p: *const u8, half: usize, table: __m512i) -> [__m512; 4] {
    let upper = _mm512_set1_epi32(0xffff_0000u32 as i32);
    let raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(32 * half).cast()));
    let low = _mm512_permutexvar_epi16(raw, table);
    let high = _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(raw), table);
    // Even words are lanes 0..16 of the half, odd words lanes 16..32.
    [
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(low)),
        _mm512_castsi512_ps(_mm512_and_si512(low, upper)),
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(high)),
        _mm512_castsi512_ps(_mm512_and_si512(high, upper)),
    ]
}

/// Where a fused kernel reads its weights: `G` consecutive groups from `g0`,
/// each `cols` columns.
pub(crate) struct FusedGroups<'a> {
    pub cols: usize,
    pub g0: usize,
    pub x: [&'a [f32]; X_ROWS],
    /// No `|x|` of the pass's rows exceeds this.
    pub x_abs_max: f32,
}

/// `G` groups of f32 (or, with `BF16`, bf16) weights against `M` x rows over
/// every column, the first `V` vectors of each group (a last group of at most
/// `16 · V` rows computes no padding): `res[(gi · M + m) · 64 + o]`. `bytes`
/// are the weights' stored bytes.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn fused_dense<const G: usize, const M: usize, const V: usize, const BF16: bool>(
    bytes: &[u8],
    at: &FusedGroups,
    res: &mut [f32],
) {
    let cols = at.cols;
    let width = if BF16 { 2 } else { 4 };
    assert!(V <= VECTORS && bytes.len() >= (at.g0 + G) * cols * GROUP_ROWS * width, "fused weights");
    assert!(res.len() >= G * M * GROUP_ROWS, "fused results");
    assert!(at.x[..M].iter().all(|x| x.len() >= cols), "fused x rows");
    let mut acc = [[[_mm512_setzero_ps(); V]; M]; G];
    for c in 0..cols {
        let mut b = [_mm512_setzero_ps(); M];
        for (bm, x) in b.iter_mut().zip(&at.x) {
            *bm = _mm512_set1_ps(*x.get_unchecked(c));
        }
        for (gi, ag) in acc.iter_mut().enumerate() {
            let src = bytes.as_ptr().add(((at.g0 + gi) * cols + c) * GROUP_ROWS * width);
            fetch_ahead(src, (V * 16 * width).div_ceil(64));
            for v in 0..V {
                let w = if BF16 { bf16x16(src.add(32 * v).cast()) } else { _mm512_load_ps(src.add(64 * v).cast()) };
                for (am, bm) in ag.iter_mut().zip(&b) {
                    am[v] = _mm512_fmadd_ps(*bm, w, am[v]);
                }
            }
        }
    }
    store_groups(&acc, res);
}

/// [`fused_dense`] for FP8 weights (no NaN code, every `scale · 2^120` finite):
/// each code decoded as its value times 2^-120 and multiplied by its lane's
/// `scale · 2^120`, which is the definition's product exactly. Where a
/// group's rows share their scale over a block (`x_scales`, see
/// [`crate::panels`]) and x times it cannot overflow, x carries it instead:
/// one multiply per x value, none per weight, the same products.
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fused_fp8<const G: usize, const M: usize>(
    codes: &[u8],
    (scales, x_scales): (&[f32], &[f32]),
    block_cols: usize,
    at: &FusedGroups,
    res: &mut [f32],
) {
    let cols = at.cols;
    let col_blocks = cols.div_ceil(block_cols);
    assert!(codes.len() >= (at.g0 + G) * cols * GROUP_ROWS && res.len() >= G * M * GROUP_ROWS, "fused fp8");
    assert!(scales.len() >= (at.g0 + G) * col_blocks * GROUP_ROWS, "fused fp8 scales");
    assert!(x_scales.len() >= (at.g0 + G) * col_blocks, "fused fp8 x scales");
    assert!(at.x[..M].iter().all(|x| x.len() >= cols), "fused x rows");
    let mut acc = [[[_mm512_setzero_ps(); VECTORS]; M]; G];
    for blk in 0..col_blocks {
        let columns = blk * block_cols..((blk + 1) * block_cols).min(cols);
        let mut carried = [0.0f32; G];
        for (gi, s) in carried.iter_mut().enumerate() {
            *s = x_scales[(at.g0 + gi) * col_blocks + blk];
        }
        let x_carries = carried.iter().all(|&s| s != 0.0 && (at.x_abs_max as f64) * (s.abs() as f64) < f32::MAX as f64);
        if x_carries {
            for c in columns {
                for (gi, ag) in acc.iter_mut().enumerate() {
                    let mut b = [_mm512_setzero_ps(); M];
                    for (bm, x) in b.iter_mut().zip(&at.x) {
                        *bm = _mm512_set1_ps(*x.get_unchecked(c) * carried[gi]);
                    }
                    let src = codes.as_ptr().add(((at.g0 + gi) * cols + c) * GROUP_ROWS);
                    fetch_ahead(src, 1);
                    for half in 0..2 {
                        let [low, high] = fp8_half(src, half);
                        for (am, bm) in ag.iter_mut().zip(&b) {
                            am[2 * half] = _mm512_fmadd_ps(*bm, low, am[2 * half]);
                            am[2 * half + 1] = _mm512_fmadd_ps(*bm, high, am[2 * half + 1]);
                        }
                    }
                }
            }
            continue;
        }
        let mut wide = [[_mm512_setzero_ps(); VECTORS]; G];
        for (gi, wg) in wide.iter_mut().enumerate() {
            let s = scales.as_ptr().add(((at.g0 + gi) * col_blocks + blk) * GROUP_ROWS);
            for (v, wv) in wg.iter_mut().enumerate() {
                *wv = _mm512_mul_ps(_mm512_loadu_ps(s.add(16 * v)), _mm512_set1_ps(POW2_120));
            }
        }
        for c in columns {
            let mut b = [_mm512_setzero_ps(); M];
            for (bm, x) in b.iter_mut().zip(&at.x) {
                *bm = _mm512_set1_ps(*x.get_unchecked(c));
            }
            for (gi, ag) in acc.iter_mut().enumerate() {
                let src = codes.as_ptr().add(((at.g0 + gi) * cols + c) * GROUP_ROWS);
                fetch_ahead(src, 1);
                for half in 0..2 {
                    let [low, high] = fp8_half(src, half);
                    let (low, high) =
                        (_mm512_mul_ps(low, wide[gi][2 * half]), _mm512_mul_ps(high, wide[gi][2 * half + 1]));
                    for (am, bm) in ag.iter_mut().zip(&b) {
                        am[2 * half] = _mm512_fmadd_ps(*bm, low, am[2 * half]);
                        am[2 * half + 1] = _mm512_fmadd_ps(*bm, high, am[2 * half + 1]);
                    }
                }
            }
        }
    }
    store_groups(&acc, res);
}

/// [`fused_dense`] for FP4 weights with an even `block_cols`: each block is a
/// chain of x times the e2m1 values from +0.0, added to the output times the
/// lane's scale. Each block runs one half of the group's lanes at a time and
/// its totals wait in L1, so the registers hold six x rows' block sums and
/// broadcasts: one decode of the weights serves up to six rows (with totals
/// in registers, passes held two rows, and a 6-row batch ran 72 against 110
/// GFLOP/s now).
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn fused_fp4<const G: usize, const M: usize>(
    codes: &[u8],
    scales: &[f32],
    block_cols: usize,
    at: &FusedGroups,
    res: &mut [f32],
) {
    let cols = at.cols;
    let blocks = cols / block_cols;
    assert!(block_cols.is_multiple_of(2) && cols.is_multiple_of(block_cols), "fp4 blocks of column pairs");
    assert!(codes.len() >= (at.g0 + G) * cols / 2 * GROUP_ROWS && res.len() >= G * M * GROUP_ROWS, "fused fp4");
    assert!(scales.len() >= (at.g0 + G) * blocks * GROUP_ROWS, "fused fp4 scales");
    assert!(at.x[..M].iter().all(|x| x.len() >= cols), "fused x rows");
    assert!(G * M <= X_ROWS, "fused fp4 totals");
    let table = _mm512_loadu_si512(BF16_TABLE.as_ptr().cast());
    // The totals wait in L1: the registers hold the block sums of up to six
    // x rows (one half of the lanes), their broadcasts and a decoded half.
    let mut totals = Totals([0.0; X_ROWS * GROUP_ROWS]);
    let t = totals.0.as_mut_ptr();
    for blk in 0..blocks {
        // One half of the group's lanes at a time: the block sums of six x
        // rows and their broadcasts then fit the registers.
        for half in 0..2 {
            let mut block = [[[_mm512_setzero_ps(); 2]; M]; G];
            for q in blk * block_cols / 2..(blk + 1) * block_cols / 2 {
                let mut even_x = [_mm512_setzero_ps(); M];
                let mut odd_x = [_mm512_setzero_ps(); M];
                for ((e, o), x) in even_x.iter_mut().zip(odd_x.iter_mut()).zip(&at.x) {
                    *e = _mm512_set1_ps(*x.get_unchecked(2 * q));
                    *o = _mm512_set1_ps(*x.get_unchecked(2 * q + 1));
                }
                for (gi, bg) in block.iter_mut().enumerate() {
                    let src = codes.as_ptr().add(((at.g0 + gi) * cols / 2 + q) * GROUP_ROWS);
                    if half == 0 {
                        fetch_ahead(src, 1);
                    }
                    let [e0, e1, o0, o1] = fp4_half(src, half, table);
                    for ((bm, ex), ox) in bg.iter_mut().zip(&even_x).zip(&odd_x) {
                        bm[0] = _mm512_fmadd_ps(*ex, e0, bm[0]);
                        bm[1] = _mm512_fmadd_ps(*ex, e1, bm[1]);
                        bm[0] = _mm512_fmadd_ps(*ox, o0, bm[0]);
                        bm[1] = _mm512_fmadd_ps(*ox, o1, bm[1]);
                    }
                }
            }
            for (gi, bg) in block.iter().enumerate() {
                let s = scales.as_ptr().add(((at.g0 + gi) * blocks + blk) * GROUP_ROWS + 32 * half);
                for v in 0..2 {
                    let sv = _mm512_loadu_ps(s.add(16 * v));
                    for (m, bm) in bg.iter().enumerate() {
                        let at = t.add((gi * M + m) * GROUP_ROWS + 32 * half + 16 * v);
                        _mm512_store_ps(at, _mm512_fmadd_ps(bm[v], sv, _mm512_load_ps(at)));
                    }
                }
            }
        }
    }
    res[..G * M * GROUP_ROWS].copy_from_slice(&totals.0[..G * M * GROUP_ROWS]);
}

#[inline(always)]
unsafe fn store_groups<const G: usize, const M: usize, const V: usize>(acc: &[[[__m512; V]; M]; G], res: &mut [f32]) {
    for (gi, ag) in acc.iter().enumerate() {
        for (m, am) in ag.iter().enumerate() {
            for (v, av) in am.iter().enumerate() {
                _mm512_storeu_ps(res.as_mut_ptr().add((gi * M + m) * GROUP_ROWS + 16 * v), *av);
            }
        }
    }
}
