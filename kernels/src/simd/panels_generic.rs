//! The column-order register tiles in plain Rust. Paths without hand-written
//! tiles (AVX2 + FMA, NEON, portable) compile these with their own target
//! features. Each output is `acc = fma(x[c], w[c], acc)` in column order, so
//! vectorising over a group's 64 lanes, by any width, changes no bit.

use crate::panels::GROUP_ROWS;

/// Most x rows of a register tile.
pub(crate) const X_ROWS: usize = 6;
/// Outputs a generic tile keeps in its accumulators at once.
const SLICE: usize = 16;

/// The first `M` x rows (`xs[r][c]`) against 64 outputs (`w[c · 64 + o]`)
/// over `kc` columns, continuing `out[r · stride + o]` (from +0.0 when `fresh`).
#[inline(always)]
pub(crate) fn plain<const M: usize>(
    xs: &[&[f32]; X_ROWS],
    w: &[f32],
    kc: usize,
    out: &mut [f32],
    stride: usize,
    fresh: bool,
) {
    assert!((1..=X_ROWS).contains(&M) && xs[..M].iter().all(|x| x.len() >= kc), "tile x rows");
    assert!(w.len() >= kc * GROUP_ROWS, "tile weights");
    assert!(out.len() >= (M - 1) * stride + GROUP_ROWS, "tile outputs");
    for s in (0..GROUP_ROWS).step_by(SLICE) {
        let mut acc = [[0.0f32; SLICE]; M];
        if !fresh {
            for (r, a) in acc.iter_mut().enumerate() {
                a.copy_from_slice(&out[r * stride + s..][..SLICE]);
            }
        }
        chain(&mut acc, xs, 0, w, s, kc);
        for (r, a) in acc.iter().enumerate() {
            out[r * stride + s..][..SLICE].copy_from_slice(a);
        }
    }
}

/// [`plain`] for FP4 block scales: each block of `block_cols` columns is a
/// chain from +0.0, then `out = fma(block sum, scale, out)` with the lane's
/// scale of that block (`scales[b · 64 + o]` for the tile's blocks).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_scaled<const M: usize>(
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
    for s in (0..GROUP_ROWS).step_by(SLICE) {
        let mut total = [[0.0f32; SLICE]; M];
        if !fresh {
            for (r, t) in total.iter_mut().enumerate() {
                t.copy_from_slice(&out[r * stride + s..][..SLICE]);
            }
        }
        for b in 0..kc / block_cols {
            let mut block = [[0.0f32; SLICE]; M];
            let c0 = b * block_cols;
            chain(&mut block, xs, c0, &w[c0 * GROUP_ROWS..], s, block_cols);
            let lane_scales = &scales[b * GROUP_ROWS + s..][..SLICE];
            for (t, p) in total.iter_mut().zip(&block) {
                for ((tv, &pv), &sv) in t.iter_mut().zip(p).zip(lane_scales) {
                    *tv = pv.mul_add(sv, *tv);
                }
            }
        }
        for (r, t) in total.iter().enumerate() {
            out[r * stride + s..][..SLICE].copy_from_slice(t);
        }
    }
}

/// Continue `acc[r][o]` (outputs `s..s + 16` of the tile) over `kc` columns
/// of x from `c0` and of `w` from its start.
#[inline(always)]
fn chain<const M: usize>(
    acc: &mut [[f32; SLICE]; M],
    xs: &[&[f32]; X_ROWS],
    c0: usize,
    w: &[f32],
    s: usize,
    kc: usize,
) {
    let rows: [&[f32]; M] = std::array::from_fn(|r| &xs[r][c0..c0 + kc]);
    for (c, wc) in w.chunks_exact(GROUP_ROWS).take(kc).enumerate() {
        let wv: &[f32; SLICE] = wc[s..s + SLICE].try_into().expect("a slice of 16 lanes");
        for (a, x) in acc.iter_mut().zip(&rows) {
            let b = x[c];
            for (av, &wl) in a.iter_mut().zip(wv) {
                *av = b.mul_add(wl, *av);
            }
        }
    }
}
