//! `Linear::forward` and `dot`: bit-exactness against the definition, batch
//! invariance, and agreement of every code path and layout.

mod common;

use common::{all_formats, assert_bits_eq, fp8_codes_without_nan, reference, Rng};
use deepinfer_kernels::linear::{dot, dot_with};
use deepinfer_kernels::{Isa, Linear};

/// Shapes with columns off the 16-lane grid, rows off the 64-row groups, and
/// rows long enough to be split into tiles of 512 columns (whose edges fall
/// inside FP8 scale blocks).
const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (1, 2),
    (3, 17),
    (17, 33),
    (19, 100),
    (5, 255),
    (33, 258),
    (16, 272),
    (7, 518),
    (40, 130),
    (20, 8200),
    (9, 8256),
    (64, 512),
    (129, 1040),
];

fn available() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).collect()
}

/// The documented order written out longhand, independent of the library.
fn dot_definition(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let full = a.len() / 16 * 16;
    for c in 0..a.len() {
        let lane = if c < full { c % 16 } else { c - full };
        acc[lane] = a[c].mul_add(b[c], acc[lane]);
    }
    for width in [8, 4, 2, 1] {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

#[test]
fn dot_follows_the_documented_order_on_every_path() {
    let mut rng = Rng(1);
    for len in (0..=80).chain([255, 256, 257, 1000, 4099]) {
        let (a, b) = (rng.vec(len), rng.vec(len + 3));
        let want = dot_definition(&a, &b[..len]);
        assert_eq!(dot(&a, &b).to_bits(), want.to_bits(), "dot len {len}");
        for isa in available() {
            assert_eq!(dot_with(isa, &a, &b).to_bits(), want.to_bits(), "{isa:?} len {len}");
        }
    }
}

#[test]
fn forward_matches_the_definition_bit_exactly_in_every_layout() {
    let mut rng = Rng(2);
    for &(rows, cols) in SHAPES {
        for (name, lin) in all_formats(rows, cols, &mut rng) {
            let laid_out = lin.clone().into_decode_layout();
            let round_trip = laid_out.clone().into_published();
            for n in [1, 2, 3, 4, 5, 6, 7, 9, 13] {
                let x = rng.vec(n * cols);
                let want = reference(&lin, &x, n);
                for (layout, weights) in [("published", &lin), ("panels", &laid_out), ("round trip", &round_trip)] {
                    let mut out = vec![f32::NAN; n * rows];
                    weights.forward(&x, n, &mut out);
                    assert_bits_eq(&out, &want, &format!("{name} {layout} {rows}x{cols} n={n}"));
                }
            }
        }
    }
}

#[test]
fn every_path_gives_the_same_bits() {
    let mut rng = Rng(3);
    for &(rows, cols) in SHAPES.iter().chain(&[(70, 1030)]) {
        for (name, lin) in all_formats(rows, cols, &mut rng) {
            let lin = lin.into_decode_layout();
            for n in [1, 2, 3, 4, 6, 7] {
                let x = rng.vec(n * cols);
                let mut portable = vec![0.0f32; n * rows];
                lin.forward_with(Isa::Portable, &x, n, &mut portable);
                for isa in available() {
                    let mut out = vec![f32::NAN; n * rows];
                    lin.forward_with(isa, &x, n, &mut out);
                    assert_bits_eq(&out, &portable, &format!("{isa:?} {name} {rows}x{cols} n={n}"));
                }
            }
        }
    }
}

#[test]
fn forward_is_batch_invariant() {
    // Large enough that batches of 33 and 64 rows take the multi-threaded path.
    let (rows, cols) = (250, 264);
    let mut rng = Rng(4);
    for (name, lin) in all_formats(rows, cols, &mut rng) {
        let probe = rng.vec(cols);
        let mut alone = vec![0.0f32; rows];
        lin.forward(&probe, 1, &mut alone);
        for n in [1, 7, 33, 64] {
            for pos in [0, n / 2, n - 1] {
                let mut x = rng.vec(n * cols);
                x[pos * cols..(pos + 1) * cols].copy_from_slice(&probe);
                let mut out = vec![0.0f32; n * rows];
                lin.forward(&x, n, &mut out);
                let got = &out[pos * rows..(pos + 1) * rows];
                assert_bits_eq(got, &alone, &format!("{name} n={n} pos={pos}"));
            }
        }
        let x = rng.vec(64 * cols);
        let mut out = vec![0.0f32; 64 * rows];
        lin.forward(&x, 64, &mut out);
        assert_bits_eq(&out, &reference(&lin, &x, 64), &format!("{name} n=64 vs definition"));
    }
}

#[test]
fn batches_split_into_panels_keep_every_rows_bits() {
    // 8200 columns: a panel (half the L2, at most 2 MiB) holds at most 63
    // rows, so 150 rows run as three panels or more, the last one shorter.
    let (rows, cols, n) = (20, 8200, 150);
    let mut rng = Rng(6);
    for (name, lin) in all_formats(rows, cols, &mut rng) {
        let x = rng.vec(n * cols);
        let mut out = vec![f32::NAN; n * rows];
        lin.forward(&x, n, &mut out);
        assert_bits_eq(&out, &reference(&lin, &x, n), &format!("{name} n={n} in panels"));
    }
}

#[test]
fn thread_count_does_not_change_bits() {
    let mut rng = Rng(5);
    // A few rows split the output groups over the threads (one row, and the
    // fused passes); 24 rows of a 520-column matrix split the groups into
    // strips; 160 rows split the x rows.
    for (rows, cols, n) in [(300, 520, 1), (300, 520, 3), (300, 520, 24), (40, 4200, 160)] {
        assert_thread_count_keeps_bits(rows, cols, n, &mut rng);
    }
}

fn assert_thread_count_keeps_bits(rows: usize, cols: usize, n: usize, rng: &mut Rng) {
    for (name, lin) in all_formats(rows, cols, rng) {
        let lin = lin.into_decode_layout();
        let x = rng.vec(n * cols);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut out = vec![0.0f32; n * rows];
            pool.install(|| lin.forward(&x, n, &mut out));
            out
        };
        let one = run(1);
        for threads in [2, 3, 5] {
            assert_bits_eq(&run(threads), &one, &format!("{name} {rows}x{cols} n={n} threads={threads}"));
            // The same product kept on the calling thread inside a pool.
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            let mut alone = vec![f32::NAN; n * rows];
            pool.install(|| lin.forward_alone(&x, n, &mut alone));
            assert_bits_eq(&alone, &one, &format!("{name} {rows}x{cols} n={n} alone in {threads} threads"));
        }
    }
}

#[test]
fn signed_zeros_and_extremes_keep_their_bits() {
    // Products that underflow to -0.0 leave a -0.0 chain; a chain started
    // from anything but +0.0, or padded columns, would change it.
    for cols in [1, 15, 17, 33, 257] {
        let w: Vec<f32> = (0..2 * cols).map(|c| if c < cols { 1e-30 } else { -3e38 }).collect();
        let lin = Linear::from_f32(2, cols, w);
        let mut x = vec![-1e-30f32; cols];
        x.extend((0..cols).map(|c| [1e-40, -0.0, 7.0, 2e38][c % 4]));
        let want = reference(&lin, &x, 2);
        assert_eq!(want[0].to_bits(), (-0.0f32).to_bits(), "definition gives -0.0");
        for isa in available() {
            let mut out = vec![0.0f32; 4];
            lin.forward_with(isa, &x, 2, &mut out);
            assert_bits_eq(&out, &want, &format!("{isa:?} cols={cols}"));
        }
    }
}

#[test]
fn empty_shapes() {
    let lin = Linear::from_f32(3, 0, vec![]);
    let mut out = vec![f32::NAN; 6];
    lin.forward(&[], 2, &mut out);
    assert!(out.iter().all(|v| v.to_bits() == 0));
    let lin = Linear::from_f32(0, 5, vec![]);
    lin.forward(&[1.0; 10], 2, &mut []);
    let lin = Linear::from_f32(4, 5, vec![1.0; 20]);
    lin.forward(&[], 0, &mut []);
}

/// FP8 weights with NaN codes in some rows only, and scales too large for the
/// AVX-512 decode's `scale · 2^120`: both must take the plain decode.
#[test]
fn fp8_nan_codes_and_huge_scales_keep_the_definition() {
    use bytes::Bytes;
    use deepinfer_kernels::WeightFormat;
    let (rows, cols, block): (usize, usize, usize) = (40, 300, 16);
    let mut rng = Rng(9);
    let data: Vec<u8> = (0..rows * cols)
        .map(|i| {
            let b = rng.next_u64() as u8;
            // Rows 8..16 hold NaN codes (0x7f, 0xff); the others none.
            match (i / cols, b & 0x7f) {
                (8..16, _) if i % 97 == 0 => 0x7f | (b & 0x80),
                (_, 0x7f) => b & 0xf0,
                _ => b,
            }
        })
        .collect();
    let blocks = rows.div_ceil(block) * cols.div_ceil(block);
    let scales = (0..blocks).map(|b| 2f32.powi([-127, -9, 0, 7, 100][b % 5])).collect();
    let lin = Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block, block) };
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    for n in 1..=7 {
        let x: Vec<f32> = rng.vec(n * cols).iter().map(|v| v * 1e-3).collect();
        let want = reference(&lin, &x, n);
        assert!(want.iter().any(|v| v.is_nan()) && want.iter().any(|v| v.is_finite()), "both kinds of rows");
        for isa in available() {
            let mut out = vec![0.0f32; n * rows];
            lin.forward_with(isa, &x, n, &mut out);
            for (k, (g, w)) in out.iter().zip(&want).enumerate() {
                assert!(same(*g, *w), "{isa:?} n={n} element {k}: {g:e} vs {w:e}");
            }
        }
    }
}

/// FP8 scales at the edges of the AVX-512 decode (a value times 2^-120,
/// then times `scale · 2^120`): scales that are not powers of two, products
/// that are subnormal, and inputs near overflow keep the definition's bits.
#[test]
fn fp8_scales_at_the_edges_of_the_decode_keep_the_definition() {
    use bytes::Bytes;
    use deepinfer_kernels::WeightFormat;
    let (rows, cols, block): (usize, usize, usize) = (48, 290, 32);
    let mut rng = Rng(11);
    let data = fp8_codes_without_nan(rows * cols, &mut rng);
    let blocks = rows.div_ceil(block) * cols.div_ceil(block);
    let scales: Vec<f32> =
        (0..blocks).map(|b| [2f32.powi(5), 2f32.powi(-121), 2f32.powi(-120), 0.75, 2f32.powi(-8)][b % 5]).collect();
    let lin = Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data), scales, block, block) };
    let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
    // |x| up to 2^3 · 2^125 overflows with the 2^5 scale; 1e-40 is subnormal.
    for magnitude in [1.0f32, 7.9, 8.0, 1e30, 1e-40] {
        for n in [1, 2, 4, 6] {
            let x: Vec<f32> = rng.vec(n * cols).iter().map(|v| v * magnitude).collect();
            let want = reference(&lin, &x, n);
            for isa in available() {
                let mut out = vec![0.0f32; n * rows];
                lin.forward_with(isa, &x, n, &mut out);
                for (k, (g, w)) in out.iter().zip(&want).enumerate() {
                    assert!(same(*g, *w), "{isa:?} |x|~{magnitude:e} n={n} element {k}: {g:e} vs {w:e}");
                }
            }
        }
    }
}

#[test]
fn dot_rows_gives_each_pair_the_bits_of_dot() {
    let mut rng = Rng(10);
    for (n, rows, cols) in [(1, 1, 1), (16, 128, 128), (3, 37, 100), (7, 17, 512), (32, 5, 24)] {
        let (x, w) = (rng.vec(n * cols), rng.vec(rows * cols));
        let mut out = vec![f32::NAN; n * rows];
        deepinfer_kernels::linear::dot_rows(&x, n, &w, rows, cols, &mut out);
        for i in 0..n {
            for r in 0..rows {
                let want = dot(&x[i * cols..][..cols], &w[r * cols..][..cols]);
                assert_eq!(out[i * rows + r].to_bits(), want.to_bits(), "n={n} rows={rows} cols={cols} ({i}, {r})");
            }
        }
    }
}

#[test]
fn dot_rows_of_writes_each_pair_the_bits_of_dot_at_its_stride() {
    let mut rng = Rng(14);
    for (n, rows, cols, stride) in [(1, 1, 1, 1), (16, 130, 128, 200), (3, 37, 100, 37), (5, 17, 24, 40), (2, 3, 0, 5)]
    {
        let (x, w) = (rng.vec(n * cols), rng.vec(rows * cols));
        let row_refs: Vec<&[f32]> = (0..rows).rev().map(|r| &w[r * cols..][..cols]).collect();
        let mut out = vec![f32::NAN; (n - 1) * stride + rows];
        deepinfer_kernels::linear::dot_rows_of(&x, n, &row_refs, &mut out, stride);
        for i in 0..n {
            for (r, row) in row_refs.iter().enumerate() {
                let want = dot(&x[i * cols..][..cols], row);
                assert_eq!(out[i * stride + r].to_bits(), want.to_bits(), "n={n} rows={rows} ({i}, {r})");
            }
            // Between rows of the output, nothing is written.
            let gap = if i + 1 < n { stride - rows } else { 0 };
            assert!(out[i * stride + rows..][..gap].iter().all(|v| v.is_nan()), "n={n} gap after {i}");
        }
    }
}

#[test]
fn add_scaled_rounds_the_product_before_the_sum() {
    let mut rng = Rng(11);
    for len in [0, 1, 15, 16, 17, 130] {
        let (v, start) = (rng.vec(len), rng.vec(len));
        let p = 0.3f32;
        let mut out = start.clone();
        deepinfer_kernels::ops::add_scaled(&mut out, p, &v);
        for k in 0..len {
            let want = start[k] + p * v[k];
            assert_eq!(out[k].to_bits(), want.to_bits(), "len {len} element {k}");
        }
    }
}

#[test]
fn scale_into_gives_the_bits_of_the_plain_product() {
    let mut rng = Rng(12);
    for len in [0, 1, 15, 16, 17, 130] {
        let v = rng.vec(len);
        let p = -1.7f32;
        let mut out = vec![f32::NAN; len];
        deepinfer_kernels::ops::scale_into(&mut out, p, &v);
        for k in 0..len {
            assert_eq!(out[k].to_bits(), (p * v[k]).to_bits(), "len {len} element {k}");
        }
    }
}

#[test]
fn add_weighted_rows_is_one_fused_chain_per_output_in_row_order() {
    let mut rng = Rng(12);
    for d in [0, 1, 16, 17, 64, 100, 128, 200, 512] {
        for rows in [0, 1, 3, 130] {
            let (weights, values, start) = (rng.vec(rows), rng.vec(rows * d), rng.vec(d));
            let mut want = start.clone();
            for k in 0..rows {
                for j in 0..d {
                    want[j] = weights[k].mul_add(values[k * d + j], want[j]);
                }
            }
            let row_refs: Vec<&[f32]> = (0..rows).map(|k| &values[k * d..(k + 1) * d]).collect();
            let mut got = start.clone();
            deepinfer_kernels::ops::add_weighted_rows(&mut got, &weights, &row_refs);
            assert_bits_eq(&got, &want, &format!("d {d} rows {rows}"));
        }
    }
}

#[test]
fn add_weighted_rows_heads_gives_each_head_the_bits_of_its_own_call() {
    let mut rng = Rng(13);
    for heads in [1, 3, 4, 5, 8, 16] {
        for d in [1, 64, 100, 128] {
            for rows in [0, 1, 7, 130] {
                // Each head's weights sit in a row of `stride`, past its `rows`.
                let stride = rows + heads % 3;
                let (weights, values, start) = (rng.vec(heads * stride), rng.vec(rows * d), rng.vec(heads * d));
                let row_refs: Vec<&[f32]> = (0..rows).map(|k| &values[k * d..(k + 1) * d]).collect();
                let mut want = start.clone();
                for h in 0..heads {
                    let out = &mut want[h * d..(h + 1) * d];
                    deepinfer_kernels::ops::add_weighted_rows(out, &weights[h * stride..][..rows], &row_refs);
                }
                let mut got = start.clone();
                deepinfer_kernels::ops::add_weighted_rows_heads(&mut got, heads, &weights, stride, &row_refs);
                assert_bits_eq(&got, &want, &format!("heads {heads} d {d} rows {rows}"));
            }
        }
    }
}

#[test]
fn fp8_weights_know_whether_a_code_is_nan() {
    use bytes::Bytes;
    use deepinfer_kernels::WeightFormat;
    let nan_free = |data: Vec<u8>| match WeightFormat::fp8(Bytes::from(data), vec![1.0], 1, 1) {
        WeightFormat::Fp8 { nan_free, .. } => nan_free,
        _ => unreachable!("an FP8 format"),
    };
    // Every code but the two NaNs, and each NaN alone at the start, inside and
    // at the end of a long matrix (past the 4096-byte chunks the check folds).
    let finite: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).cycle().take(10_000).collect();
    assert!(nan_free(finite.clone()));
    for nan in [0x7f, 0xff] {
        for at in [0, 4095, 4096, 9_999] {
            let mut data = finite.clone();
            data[at] = nan;
            assert!(!nan_free(data), "code {nan:#x} at {at}");
        }
    }
}
