//! `y = x · Wᵀ` over [`Panels`]. A few x rows on AVX-512 go through fused
//! kernels that decode each weight in registers once per pass. Larger batches
//! (and every batch on other paths) decode a tile of 64 outputs × a block of
//! columns to f32 once, then run register tiles of six x rows over it. Either
//! way every output is the one chain of [`crate::Linear::forward_reference`],
//! so neither the batch, the path nor the thread count changes a bit.

use std::ops::Range;

use rayon::prelude::*;

use crate::aligned::AlignedF32;
use crate::panels::{decode_tile, Codes, Panels, GROUP_ROWS};
#[cfg(target_arch = "x86_64")]
use crate::simd::avx512_panels::{self, FusedGroups};
use crate::simd::panels_generic::{self, X_ROWS};
use crate::simd::{Backend, Isa};

/// Most columns of a decoded tile: 64 outputs × 512 columns of f32 (128 KiB)
/// stay in L2 while every x row's register tiles pass over them.
const TILE_COLS_MAX: usize = 512;
/// Most x rows of one pass of the fused kernels.
const FUSED_ROWS_MAX: usize = 6;

/// `out[n × rows] = x[n × cols] · Wᵀ` on `backend`.
pub(crate) fn forward(p: &Panels, backend: Backend, x: &[f32], n: usize, out: &mut [f32], parallel_min_fmas: usize) {
    let (rows, cols, groups) = (p.rows(), p.cols(), p.groups());
    assert!(x.len() == n * cols && out.len() == n * rows, "linear of {rows} × {cols}, batch {n}");
    if n == 0 || rows == 0 {
        return;
    }
    if cols == 0 {
        // A chain over no column is its start.
        out.fill(0.0);
        return;
    }
    let fused = fuses(backend, p, n);
    let threads = rayon::current_num_threads();
    if threads > 1 && n * rows * cols >= parallel_min_fmas {
        if !fused && n >= 2 * X_ROWS * threads {
            // Each thread packs, decodes and multiplies for its own x rows.
            let part = n.div_ceil(threads).next_multiple_of(X_ROWS);
            out.par_chunks_mut(part * rows).zip(x.par_chunks(part * cols)).for_each(|(out, x)| {
                run(p, backend, x, x.len() / cols, 0..groups, out, rows, false);
            });
            return;
        }
        if groups > 1 {
            // Each thread owns whole groups of outputs, in two parts a thread:
            // with the workers standing by, longer runs of a group's stream
            // beat finer balancing (medium-v4 decode at batch 1, two threads:
            // 8.4 ms a step with four parts a thread, 7.7–8.1 with two).
            let per = groups.div_ceil(groups.min(2 * threads));
            let parts: Vec<Range<usize>> = (0..groups).step_by(per).map(|g| g..(g + per).min(groups)).collect();
            let width = |gs: &Range<usize>| (gs.end * GROUP_ROWS).min(rows) - gs.start * GROUP_ROWS;
            if n == 1 {
                out.par_chunks_mut(per * GROUP_ROWS).zip(parts).for_each(|(out, gs)| {
                    run(p, backend, x, 1, gs, out, 0, fused);
                });
                return;
            }
            let strips: Vec<(Range<usize>, Vec<f32>)> = parts
                .into_par_iter()
                .map(|gs| {
                    let w = width(&gs);
                    let mut strip = vec![0.0f32; n * w];
                    run(p, backend, x, n, gs.clone(), &mut strip, w, fused);
                    (gs, strip)
                })
                .collect();
            for (gs, strip) in &strips {
                let w = width(gs);
                for (i, src) in strip.chunks_exact(w).enumerate() {
                    out[i * rows + gs.start * GROUP_ROWS..][..w].copy_from_slice(src);
                }
            }
            return;
        }
    }
    run(p, backend, x, n, 0..groups, out, rows, fused);
}

/// Groups `gs` of every x row: output `g · 64 + o` of x row `i` at
/// `out[i · stride + (g − gs.start) · 64 + o]`.
#[allow(clippy::too_many_arguments)]
fn run(
    p: &Panels,
    backend: Backend,
    x: &[f32],
    n: usize,
    gs: Range<usize>,
    out: &mut [f32],
    stride: usize,
    fused: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if fused {
        return run_fused(p, x, n, gs, out, stride);
    }
    let _ = fused;
    run_tiles(p, backend, x, n, gs, out, stride);
}

/// Whether a batch of `n` rows runs the fused kernels: AVX-512, few rows,
/// and weights those kernels decode (FP8 without NaN codes or huge scales,
/// FP4 blocks of whole column pairs). More rows share one decoded tile
/// instead of decoding every weight once per pass (f32 needs no decoding, so
/// only one or two rows gain from the fused kernel's two groups at once).
fn fuses(backend: Backend, p: &Panels, n: usize) -> bool {
    if !matches!(backend.isa(), Isa::Avx512) {
        return false;
    }
    match &p.codes {
        Codes::F32(_) => n <= 2,
        Codes::Bf16(_) => n <= 4,
        Codes::Fp8 { wide, .. } => *wide && n <= FUSED_ROWS_MAX,
        Codes::Fp4 { block_cols, .. } => block_cols.is_multiple_of(2) && n <= FUSED_ROWS_MAX,
    }
}

/// [`run`] through the fused kernels: passes of up to six x rows,
/// two groups at once for a single row so that eight chains are in flight.
#[cfg(target_arch = "x86_64")]
fn run_fused(p: &Panels, x: &[f32], n: usize, gs: Range<usize>, out: &mut [f32], stride: usize) {
    let (rows, cols) = (p.rows(), p.cols());
    let mut res = [0.0f32; FUSED_ROWS_MAX * GROUP_ROWS];
    let mut i0 = 0;
    while i0 < n {
        let m = FUSED_ROWS_MAX.min(n - i0);
        let x_rows: [&[f32]; X_ROWS] = std::array::from_fn(|i| &x[(i0 + i.min(m - 1)) * cols..][..cols]);
        // Only FP8's kernel reads it (whether x may carry a block's scale).
        let x_abs_max = match p.codes {
            Codes::Fp8 { .. } => x[i0 * cols..(i0 + m) * cols].iter().fold(0.0f32, |most, v| most.max(v.abs())),
            _ => f32::INFINITY,
        };
        let mut g = gs.start;
        while g < gs.end {
            // Two full groups at once for one row; a last group that is not
            // full runs alone, on the vectors its rows fill.
            let pair = m == 1 && g + 1 < gs.end && (g + 2) * GROUP_ROWS <= rows;
            let vectors = (rows - g * GROUP_ROWS).min(GROUP_ROWS).div_ceil(16);
            let at = FusedGroups { cols, g0: g, x: x_rows, x_abs_max };
            // SAFETY: `fuses` checked AVX-512F and BW; the kernels check their bounds.
            unsafe { fused(&p.codes, pair, m, vectors, &at, &mut res) };
            for gi in 0..1 + usize::from(pair) {
                let width = GROUP_ROWS.min(rows - (g + gi) * GROUP_ROWS);
                let col0 = (g + gi - gs.start) * GROUP_ROWS;
                for i in 0..m {
                    out[(i0 + i) * stride + col0..][..width]
                        .copy_from_slice(&res[(gi * m + i) * GROUP_ROWS..][..width]);
                }
            }
            g += 1 + usize::from(pair);
        }
        i0 += m;
    }
}

/// One fused kernel call: two groups with one x row, or one group with `m`;
/// f32 and bf16 groups on their first `vectors` vectors only.
///
/// # Safety
/// The CPU must support AVX-512F and BW.
#[cfg(target_arch = "x86_64")]
unsafe fn fused(codes: &Codes, pair: bool, m: usize, vectors: usize, at: &FusedGroups, res: &mut [f32]) {
    macro_rules! shapes {
        ($kernel:ident$(::<$($k:tt),*>)?($($arg:expr),*)) => {
            match (pair, m) {
                (true, 1) => avx512_panels::$kernel::<2, 1 $($(, $k)*)?>($($arg,)* at, res),
                (false, 1) => avx512_panels::$kernel::<1, 1 $($(, $k)*)?>($($arg,)* at, res),
                (false, 2) => avx512_panels::$kernel::<1, 2 $($(, $k)*)?>($($arg,)* at, res),
                (false, 3) => avx512_panels::$kernel::<1, 3 $($(, $k)*)?>($($arg,)* at, res),
                (false, 4) => avx512_panels::$kernel::<1, 4 $($(, $k)*)?>($($arg,)* at, res),
                (false, 5) => avx512_panels::$kernel::<1, 5 $($(, $k)*)?>($($arg,)* at, res),
                (false, 6) => avx512_panels::$kernel::<1, 6 $($(, $k)*)?>($($arg,)* at, res),
                _ => unreachable!("no fused pass of {m} rows (pair {pair})"),
            }
        };
    }
    macro_rules! dense {
        ($bf16:literal, $bytes:expr) => {
            match vectors {
                1 => shapes!(fused_dense::<1, $bf16>($bytes)),
                2 => shapes!(fused_dense::<2, $bf16>($bytes)),
                3 => shapes!(fused_dense::<3, $bf16>($bytes)),
                _ => shapes!(fused_dense::<4, $bf16>($bytes)),
            }
        };
    }
    match codes {
        Codes::F32(values) => dense!(false, values.bytes()),
        Codes::Bf16(bits) => dense!(true, bits.bytes()),
        Codes::Fp8 { codes, scales, x_scales, block_cols, .. } => {
            shapes!(fused_fp8(codes.bytes(), (scales, x_scales), *block_cols))
        }
        Codes::Fp4 { codes, scales, block_cols } => shapes!(fused_fp4(codes.bytes(), scales, *block_cols)),
    }
}

/// Columns per decoded tile: a multiple of every block the tile must hold
/// whole (FP4: its scale blocks and column pairs).
fn tile_cols(p: &Panels) -> usize {
    match p.fp4_block_cols() {
        Some(block) => {
            let unit = if block.is_multiple_of(2) { block } else { 2 * block };
            (TILE_COLS_MAX / unit).max(1) * unit
        }
        None => TILE_COLS_MAX,
    }
}

/// x rows per pass over the tiles: as many as fill half the core's L2 with
/// one tile's columns of them (every tile of a block of columns reads them
/// all), a whole number of register tiles. Each pass decodes the weights again.
fn panel_rows(n: usize, tile_cols: usize) -> usize {
    let most = (crate::cache::l2_bytes() / 2 / (4 * tile_cols)).max(X_ROWS) / X_ROWS * X_ROWS;
    let panels = n.div_ceil(most);
    n.div_ceil(panels).next_multiple_of(X_ROWS)
}

/// [`run`] through decoded tiles and register tiles of six x rows.
fn run_tiles(p: &Panels, backend: Backend, x: &[f32], n: usize, gs: Range<usize>, out: &mut [f32], stride: usize) {
    let (rows, cols) = (p.rows(), p.cols());
    let tile_cols = tile_cols(p);
    let panel = panel_rows(n, tile_cols);
    let mut tile = AlignedF32::scratch(if matches!(p.codes, Codes::F32(_)) { 0 } else { tile_cols * GROUP_ROWS });
    let mut spill = [0.0f32; X_ROWS * GROUP_ROWS];
    for p0 in (0..n).step_by(panel) {
        let pn = panel.min(n - p0);
        let tiles = pn.div_ceil(X_ROWS);
        for k0 in (0..cols).step_by(tile_cols) {
            let kc = tile_cols.min(cols - k0);
            for g in gs.clone() {
                let w: &[f32] = match &p.codes {
                    Codes::F32(values) => &values.f32s()[(g * cols + k0) * GROUP_ROWS..][..kc * GROUP_ROWS],
                    codes => {
                        decode_on(backend, codes, cols, g, k0, kc, &mut tile);
                        &tile[..kc * GROUP_ROWS]
                    }
                };
                let fp4_scales = match &p.codes {
                    Codes::Fp4 { scales, block_cols, .. } => {
                        let blocks = cols / block_cols;
                        let first = (g * blocks + k0 / block_cols) * GROUP_ROWS;
                        Some((&scales[first..][..kc / block_cols * GROUP_ROWS], *block_cols))
                    }
                    _ => None,
                };
                let width = GROUP_ROWS.min(rows - g * GROUP_ROWS);
                let col0 = (g - gs.start) * GROUP_ROWS;
                for t in 0..tiles {
                    let m = X_ROWS.min(pn - t * X_ROWS);
                    // Rows past the batch repeat its last; their sums are not computed.
                    let xt: [&[f32]; X_ROWS] = std::array::from_fn(|r| {
                        let i = p0 + t * X_ROWS + r.min(m - 1);
                        &x[i * cols + k0..][..kc]
                    });
                    let first = (p0 + t * X_ROWS) * stride + col0;
                    let kernel = RegisterTile { xs: &xt, w, fp4_scales, kc, fresh: k0 == 0, width };
                    if width == GROUP_ROWS {
                        kernel.run(backend, m, &mut out[first..][..(m - 1) * stride + GROUP_ROWS], stride);
                        continue;
                    }
                    // The last group's padding lanes go to a spill tile.
                    for r in 0..m {
                        spill[r * GROUP_ROWS..][..width].copy_from_slice(&out[first + r * stride..][..width]);
                    }
                    kernel.run(backend, m, &mut spill[..m * GROUP_ROWS], GROUP_ROWS);
                    for r in 0..m {
                        out[first + r * stride..][..width].copy_from_slice(&spill[r * GROUP_ROWS..][..width]);
                    }
                }
            }
        }
    }
    tile.recycle();
}

/// Decode columns `k0..k0 + kc` of group `g` into `tile` on `backend`.
pub(crate) fn decode_on(
    backend: Backend,
    codes: &Codes,
    cols: usize,
    g: usize,
    k0: usize,
    kc: usize,
    tile: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    let first = (g * cols + k0) * GROUP_ROWS;
    let tile = &mut tile[..kc * GROUP_ROWS];
    match (backend.isa(), codes) {
        // SAFETY (all three): `Backend::new` checked AVX-512F and BW.
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Codes::Bf16(bits)) => unsafe {
            avx512_panels::decode_bf16(&bits.u16s()[first..][..kc * GROUP_ROWS], tile)
        },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Codes::Fp8 { codes, scales, block_cols, wide: true, .. }) => unsafe {
            let col_blocks = cols.div_ceil(*block_cols);
            let lane_scales = |c: usize| scales.as_ptr().add((g * col_blocks + (k0 + c) / block_cols) * GROUP_ROWS);
            avx512_panels::decode_fp8(&codes.bytes()[first..][..kc * GROUP_ROWS], kc, lane_scales, tile)
        },
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Codes::Fp4 { codes, .. }) => unsafe {
            avx512_panels::decode_fp4(&codes.bytes()[first / 2..][..kc / 2 * GROUP_ROWS], kc, tile)
        },
        // SAFETY: `Backend::new` checked AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => unsafe { avx2_decode(codes, cols, g, k0, kc, tile) },
        _ => decode_tile(codes, cols, g, k0, kc, tile),
    }
}

/// One register tile's inputs: x rows from the tile's first column, a decoded tile of weights
/// (and FP4's lane scales with their block width), and whether the outputs
/// start from +0.0.
struct RegisterTile<'a> {
    xs: &'a [&'a [f32]; X_ROWS],
    w: &'a [f32],
    fp4_scales: Option<(&'a [f32], usize)>,
    kc: usize,
    fresh: bool,
    /// Outputs of the 64 that are real (a last group's rows); the lanes past
    /// them are the caller's to drop.
    width: usize,
}

impl RegisterTile<'_> {
    /// Continue `m` rows of outputs `out[r · stride..][..64]` (of which the
    /// AVX-512 tiles of a narrow last group write only the first 16 or 32).
    fn run(&self, backend: Backend, m: usize, out: &mut [f32], stride: usize) {
        let Self { xs, w, fp4_scales, kc, fresh, width } = *self;
        let _ = width; // read by the AVX-512 arms only
                       // `kernel::<M>` for the `m` rows (`kernel::<M, V>` after `vectors V`).
        macro_rules! rows {
            ($m:expr $(, vectors $v:literal)?; $kernel:path, $($arg:expr),*) => {{
                use $kernel as kernel;
                match $m {
                    1 => kernel::<1 $(, $v)?>($($arg),*),
                    2 => kernel::<2 $(, $v)?>($($arg),*),
                    3 => kernel::<3 $(, $v)?>($($arg),*),
                    4 => kernel::<4 $(, $v)?>($($arg),*),
                    5 => kernel::<5 $(, $v)?>($($arg),*),
                    6 => kernel::<6 $(, $v)?>($($arg),*),
                    rows => unreachable!("a register tile of {rows} rows"),
                }
            }};
        }
        match (backend.isa(), fp4_scales) {
            // SAFETY (every arm below): `Backend::new` checked the CPU features.
            #[cfg(target_arch = "x86_64")]
            // A narrow last group computes only the vectors its rows fill.
            (Isa::Avx512, None) if width <= 16 => unsafe {
                rows!(m, vectors 1; avx512_panels::plain, xs, w, kc, out, stride, fresh)
            },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, None) if width <= 32 => unsafe {
                rows!(m, vectors 2; avx512_panels::plain, xs, w, kc, out, stride, fresh)
            },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, None) => unsafe { rows!(m, vectors 4; avx512_panels::plain, xs, w, kc, out, stride, fresh) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, Some((scales, block))) => unsafe {
                rows!(m; avx512_panels::block_scaled, xs, w, scales, block, kc, out, stride, fresh)
            },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, None) => unsafe { rows!(m; avx2_plain, xs, w, kc, out, stride, fresh) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Some((scales, block))) => unsafe {
                rows!(m; avx2_block_scaled, xs, w, scales, block, kc, out, stride, fresh)
            },
            (_, None) => rows!(m; panels_generic::plain, xs, w, kc, out, stride, fresh),
            (_, Some((scales, block))) => {
                rows!(m; panels_generic::block_scaled, xs, w, scales, block, kc, out, stride, fresh)
            }
        }
    }
}

/// The generic tiles and decode compiled for AVX2 + FMA.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_plain<const M: usize>(
    xs: &[&[f32]; X_ROWS],
    w: &[f32],
    kc: usize,
    out: &mut [f32],
    stride: usize,
    fresh: bool,
) {
    panels_generic::plain::<M>(xs, w, kc, out, stride, fresh)
}

/// See [`avx2_plain`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn avx2_block_scaled<const M: usize>(
    xs: &[&[f32]; X_ROWS],
    w: &[f32],
    scales: &[f32],
    block: usize,
    kc: usize,
    out: &mut [f32],
    stride: usize,
    fresh: bool,
) {
    panels_generic::block_scaled::<M>(xs, w, scales, block, kc, out, stride, fresh)
}

/// See [`avx2_plain`].
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_decode(codes: &Codes, cols: usize, g: usize, k0: usize, kc: usize, tile: &mut [f32]) {
    decode_tile(codes, cols, g, k0, kc, tile)
}
