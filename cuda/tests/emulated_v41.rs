//! V4.1's defined arithmetic (`cuda/kernels/v41_rows.cu`, `v41_linear.cu`) on the test device
//! against `deepinfer_kernels::act_quant`, bit for bit: bf16 rounding, FP8
//! quantisation and round trips, FP4 round trips (both scale kinds), the
//! quantised linear (FP8 32 × 32 blocks, FP4 per-32 scales, and BF16/F32
//! weights through the plain product), `plain_linear` over every format, and
//! the f64 dot products. The engine-level ops (`v41::ops`: RMSNorm, softmax,
//! sigmoid/silu/softplus, RoPE) are held to their bits in
//! `engine/tests/device_v41_ops.rs`.

use deepinfer_cuda::ops::linear::DeviceLinear;
use deepinfer_cuda::ops::v41::{
    dot_f64_rows, fp4_round_trip_rows, fp8_quantize_rows, fp8_round_trip_rows, map_rows, plain_linear,
    quantized_linear, round_bf16_rows, Unary,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_kernels::act_quant::{
    self, fp4_round_trip, fp8_quantize_row, fp8_round_trip, quantized_linear_reference, round_bf16, Fp4Scale,
};
use deepinfer_kernels::dtype::f32_to_bf16;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Linear, WeightFormat};

/// SplitMix64 values in [-1, 1), every 37th scaled by 300 and every 53rd by
/// 1e-6, so groups get different scales, subnormal e4m3 codes and sums
/// that another order would round otherwise.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|i| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let v = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 37 == 0 {
                v * 300.0
            } else if i % 53 == 0 {
                v * 1e-6
            } else {
                v
            }
        })
        .collect()
}

/// [`values`] rounded to bf16 (V4.1's activations are bf16-valued).
fn bf16_values(len: usize, seed: u64) -> Vec<f32> {
    values(len, seed).into_iter().map(round_bf16).collect()
}

/// [`values`] times 2^-(i % 24): within every group of 32 the e4m3 codes
/// span their whole range, so a block's products span 2^35 and only an exact
/// sum (not an f32 one) gives the definition's bits.
fn graded(len: usize, seed: u64) -> Vec<f32> {
    values(len, seed).iter().enumerate().map(|(i, v)| round_bf16(v * 2f32.powi(-((i % 24) as i32)))).collect()
}

/// [`values`] times 2^k, k in -40..40 by a second generator: f64 sums of
/// their products cancel, so the order of the f64 additions shows in f32.
fn spread(len: usize, seed: u64) -> Vec<f32> {
    let scale = values(len, seed ^ 0x5555);
    values(len, seed).iter().zip(scale).map(|(v, s)| v * 2f32.powi((s * 40.0) as i32)).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: device {g:e}, CPU {w:e}");
    }
}

/// Special values every element-wise test includes.
const SPECIALS: [f32; 12] =
    [0.0, -0.0, 1.0, -1.0, 1e-40, -3e-39, 3.4e38, -3.4e38, f32::INFINITY, f32::NEG_INFINITY, 0.015625, 448.0];

#[test]
fn round_bf16_rows_match_the_cpu() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut x = values(1000 * 3, 11);
    x.extend(SPECIALS);
    // Ties: every low half exactly 0x8000, odd and even.
    x.extend((0..64u32).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
    x.extend((0..64u32).map(|i| f32::from_bits(0x3f80_0000 + i * 0x0101_0101 % 0x10000)));
    let width = x.len();
    let d = gpu.upload(&x).unwrap();
    round_bf16_rows(&gpu, Rows::packed(&d, width), 1, width).unwrap();
    let want: Vec<f32> = x.iter().map(|&v| round_bf16(v)).collect();
    assert_bits(&gpu.download(&d).unwrap(), &want, "round_bf16");
    // NaN keeps its payload's high bits, quiet.
    let nan = [f32::from_bits(0x7f80_0001), f32::from_bits(0xffa1_2345), f32::NAN];
    let d = gpu.upload(&nan).unwrap();
    map_rows(&gpu, Rows::packed(&d, 3), 1, 3, Unary::RoundBf16).unwrap();
    assert_eq!(bits(&gpu.download(&d).unwrap()), bits(&nan.map(round_bf16)), "NaN");
}

/// Strided rows: every `n` rows of `width` sit at `stride` with `pad` before.
fn strided(rows: &[f32], n: usize, width: usize, stride: usize, pad: usize) -> Vec<f32> {
    let mut out = vec![7.5f32; pad + n * stride];
    for r in 0..n {
        out[pad + r * stride..][..width].copy_from_slice(&rows[r * width..][..width]);
    }
    out
}

fn unstride(buf: &[f32], n: usize, width: usize, stride: usize, pad: usize) -> Vec<f32> {
    (0..n).flat_map(|r| buf[pad + r * stride..][..width].to_vec()).collect()
}

#[test]
fn fp8_quantize_rows_match_fp8_quantize_row() {
    let gpu = deepinfer_cuda::test_gpu();
    for (n, cols) in [(1usize, 32usize), (3, 64), (17, 96), (2, 1024), (1, 4096)] {
        let mut x = bf16_values(n * cols, 100 + cols as u64);
        // A zero group (amax floored at 1e-4), a tiny one, saturation.
        x[..32.min(cols)].iter_mut().for_each(|v| *v = 0.0);
        if cols >= 64 {
            x[32..64].iter_mut().enumerate().for_each(|(i, v)| *v = round_bf16(i as f32 * 1e-7));
        }
        let (stride, pad) = (cols + 5, 3);
        let d = gpu.upload(&strided(&x, n, cols, stride, pad)).unwrap();
        let values = gpu.zeros::<f32>(n * cols).unwrap();
        let scales = gpu.zeros::<f32>(n * cols / 32).unwrap();
        fp8_quantize_rows(&gpu, Rows::new(&d, pad, stride), n, cols, &values, &scales).unwrap();
        let (mut want_v, mut want_s) = (Vec::new(), Vec::new());
        for row in x.chunks_exact(cols) {
            let q = fp8_quantize_row(row);
            want_v.extend(q.values);
            want_s.extend(q.scales);
        }
        assert_bits(&gpu.download(&values).unwrap(), &want_v, &format!("fp8 values {n}x{cols}"));
        assert_bits(&gpu.download(&scales).unwrap(), &want_s, &format!("fp8 scales {n}x{cols}"));
    }
}

#[test]
fn fp8_round_trip_rows_match_fp8_round_trip() {
    let gpu = deepinfer_cuda::test_gpu();
    for (n, width) in [(1usize, 32usize), (3, 64), (17, 96), (3, 1024)] {
        let mut x = bf16_values(n * width, 200 + width as u64);
        x[0] = 1e30;
        x[1] = -0.0;
        let (stride, pad) = (width + 32, 1);
        let d = gpu.upload(&strided(&x, n, width, stride, pad)).unwrap();
        fp8_round_trip_rows(&gpu, Rows::new(&d, pad, stride), n, width).unwrap();
        let mut want = x.clone();
        want.chunks_exact_mut(width).for_each(fp8_round_trip);
        let got = gpu.download(&d).unwrap();
        assert_bits(&unstride(&got, n, width, stride, pad), &want, &format!("fp8 round trip {n}x{width}"));
        assert!(got[..pad].iter().all(|&v| v == 7.5), "padding untouched");
    }
}

#[test]
fn fp4_round_trip_rows_match_fp4_round_trip() {
    let gpu = deepinfer_cuda::test_gpu();
    for scale in [Fp4Scale::Ue8m0, Fp4Scale::E4m3] {
        for (n, width, block) in [(1usize, 32usize, 32usize), (3, 64, 16), (17, 96, 32), (3, 1024, 16), (2, 128, 32)] {
            let mut x = bf16_values(n * width, 300 + width as u64 + block as u64);
            // A zero group, a group of tiny values, a huge value, ties on the grid.
            x[..block].iter_mut().for_each(|v| *v = 0.0);
            if n * width >= 3 * block {
                x[block..2 * block].iter_mut().enumerate().for_each(|(i, v)| *v = i as f32 * 1e-38);
                x[2 * block] = 6.0;
                for (i, v) in x[2 * block + 1..3 * block].iter_mut().enumerate() {
                    *v = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0][i % 10];
                }
            }
            x[n * width - 1] = 1e35;
            let stride = width + 3;
            let d = gpu.upload(&strided(&x, n, width, stride, 0)).unwrap();
            fp4_round_trip_rows(&gpu, Rows::new(&d, 0, stride), n, width, block, scale).unwrap();
            let mut want = x.clone();
            want.chunks_exact_mut(width).for_each(|r| fp4_round_trip(r, block, scale));
            let got = unstride(&gpu.download(&d).unwrap(), n, width, stride, 0);
            assert_bits(&got, &want, &format!("fp4 {scale:?} {n}x{width} / {block}"));
        }
    }
}

/// Every row's column 1 made equal to its column 0, and columns 30 and 31 of
/// every 32 set to 4: with x's columns 0 and 1 at ±2^50 (the plain product)
/// or its columns 30 and 31 at ±100 (the quantised one) the large products
/// cancel exactly, so only the definition's order of f64 additions (lanes
/// combined as defined; a block summed exactly) gives its bits.
fn paired(mut v: Vec<f32>, cols: usize) -> Vec<f32> {
    for r in v.chunks_exact_mut(cols) {
        if cols >= 2 {
            r[1] = r[0];
        }
        for g in r.chunks_exact_mut(32) {
            (g[30], g[31]) = (4.0, 4.0);
        }
    }
    v
}

fn f32_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    Linear::from_f32(rows, cols, paired(spread(rows * cols, seed), cols))
}

fn bf16_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    let bytes: Vec<u8> =
        paired(spread(rows * cols, seed), cols).iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
    Linear { rows, cols, format: WeightFormat::Bf16(bytes.into()) }
}

fn fp8_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    quantize_fp8_blocks(&paired(graded(rows * cols, seed), cols), rows, cols, 32).into_fp8_linear(rows, cols, 32)
}

fn fp4_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    quantize_fp4_rows(&paired(graded(rows * cols, seed), cols), rows, cols, 32).into_fp4_linear(rows, cols, 32)
}

/// Weights of every format with cols a multiple of 32 (the quantised linear's).
fn weights() -> Vec<(String, Linear)> {
    let mut all = Vec::new();
    for (rows, cols) in [(1usize, 32usize), (7, 64), (129, 96), (200, 1000 / 32 * 32), (33, 1024)] {
        let seed = (rows * 31 + cols) as u64;
        all.push((format!("fp8 {rows}x{cols}"), fp8_linear(rows, cols, seed)));
        all.push((format!("fp4 {rows}x{cols}"), fp4_linear(rows, cols, seed + 1)));
        all.push((format!("bf16 {rows}x{cols}"), bf16_linear(rows, cols, seed + 2)));
        all.push((format!("f32 {rows}x{cols}"), f32_linear(rows, cols, seed + 3)));
    }
    all
}

#[test]
fn quantized_linear_matches_the_cpu_for_every_format_and_batch() {
    let gpu = deepinfer_cuda::test_gpu();
    for (what, w) in weights() {
        let dw = DeviceLinear::upload(&gpu, &w).unwrap();
        for n in [1usize, 3, 17] {
            let mut x = graded(n * w.cols, 7 + n as u64);
            x.chunks_exact_mut(32).for_each(|g| (g[30], g[31]) = (100.0, -100.0));
            let want = act_quant::quantized_linear(&w, &x, n);
            if n == 3 {
                assert_bits(&quantized_linear_reference(&w, &x, n), &want, &format!("{what}: CPU paths"));
            }
            // Strided input and output rows.
            let (xs, os) = (w.cols + 32, w.rows + 3);
            let xd = gpu.upload(&strided(&x, n, w.cols, xs, 2)).unwrap();
            let od = gpu.zeros::<f32>(1 + n * os).unwrap();
            quantized_linear(&gpu, &dw, Rows::new(&xd, 2, xs), n, Rows::new(&od, 1, os)).unwrap();
            let got = unstride(&gpu.download(&od).unwrap(), n, w.rows, os, 1);
            assert_bits(&got, &want, &format!("quantized_linear {what}, n {n}"));
        }
    }
}

#[test]
fn plain_linear_matches_the_cpu_for_every_format() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut all = weights();
    // Columns that leave a tail of the eight lanes and of the 32-column tiles.
    for (rows, cols) in [(5usize, 1usize), (9, 7), (17, 17), (130, 100), (3, 1001)] {
        all.push((format!("f32 {rows}x{cols}"), f32_linear(rows, cols, 40 + cols as u64)));
        all.push((format!("bf16 {rows}x{cols}"), bf16_linear(rows, cols, 41 + cols as u64)));
    }
    all.push(("fp8 100x300 blocks 128".into(), {
        let v = values(100 * 300, 5);
        quantize_fp8_blocks(&v, 100, 300, 128).into_fp8_linear(100, 300, 128)
    }));
    all.push((
        "fp4 17x48 blocks 16".into(),
        quantize_fp4_rows(&values(17 * 48, 6), 17, 48, 16).into_fp4_linear(17, 48, 16),
    ));
    for (what, w) in all {
        let dw = DeviceLinear::upload(&gpu, &w).unwrap();
        for n in [1usize, 3, 17] {
            let mut x = spread(n * w.cols, 9 + n as u64);
            if w.cols >= 2 {
                x.chunks_exact_mut(w.cols).for_each(|r| (r[0], r[1]) = (2f32.powi(50), -(2f32.powi(50))));
            }
            let mut want = vec![0.0f32; n * w.rows];
            act_quant::plain_linear(&w, &x, n, &mut want);
            let xd = gpu.upload(&x).unwrap();
            let od = gpu.zeros::<f32>(n * w.rows).unwrap();
            plain_linear(&gpu, &dw, Rows::packed(&xd, w.cols), n, Rows::packed(&od, w.rows)).unwrap();
            assert_bits(&gpu.download(&od).unwrap(), &want, &format!("plain_linear {what}, n {n}"));
        }
    }
}

#[test]
fn dot_f64_rows_match_dot_f64_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    for (na, m, cols) in [(1usize, 1usize, 1usize), (3, 5, 7), (4, 17, 64), (2, 9, 100), (1, 130, 512), (3, 4, 1027)] {
        // Values over many binades: f64 sums in another order differ.
        let a: Vec<f32> = values(na * cols, cols as u64)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 41) as i32 - 20))
            .collect();
        let b: Vec<f32> = values(m * cols, 1 + cols as u64)
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 29) as i32 - 14))
            .collect();
        let ad = gpu.upload(&a).unwrap();
        let bd = gpu.upload(&b).unwrap();
        let o64 = gpu.zeros::<f64>(na * m).unwrap();
        let o32 = gpu.zeros::<f32>(na * m).unwrap();
        dot_f64_rows(
            &gpu,
            Rows::packed(&ad, cols),
            na,
            Rows::packed(&bd, cols),
            m,
            None,
            m,
            cols,
            Some(&o64),
            Some(&o32),
        )
        .unwrap();
        let mut want = vec![0.0f64; m];
        let (g64, g32) = (gpu.download(&o64).unwrap(), gpu.download(&o32).unwrap());
        for i in 0..na {
            let ai = &a[i * cols..(i + 1) * cols];
            act_quant::dot_f64_rows(ai, &b, &mut want);
            for j in 0..m {
                assert_eq!(g64[i * m + j].to_bits(), want[j].to_bits(), "{na}x{m}x{cols}: ({i}, {j}) f64");
                assert_eq!(g32[i * m + j].to_bits(), (want[j] as f32).to_bits(), "{na}x{m}x{cols}: ({i}, {j}) f32");
                let single = act_quant::dot_f64(ai, &b[j * cols..(j + 1) * cols]);
                assert_eq!(single.to_bits(), want[j].to_bits(), "dot_f64 and dot_f64_rows agree");
            }
        }
        // Indexed rows (keys scattered in a cache), reversed with repeats.
        let index: Vec<u32> = (0..m as u32).rev().chain([0, 0]).collect();
        let id = gpu.upload(&index).unwrap();
        let o64 = gpu.zeros::<f64>(na * index.len()).unwrap();
        dot_f64_rows(
            &gpu,
            Rows::packed(&ad, cols),
            na,
            Rows::packed(&bd, cols),
            m,
            Some(&id),
            index.len(),
            cols,
            Some(&o64),
            None,
        )
        .unwrap();
        let g64 = gpu.download(&o64).unwrap();
        for i in 0..na {
            let rows: Vec<&[f32]> = index.iter().map(|&j| &b[j as usize * cols..][..cols]).collect();
            let mut want = vec![0.0f64; rows.len()];
            act_quant::dot_f64_each(&a[i * cols..(i + 1) * cols], &rows, &mut want);
            for (j, w) in want.iter().enumerate() {
                assert_eq!(g64[i * index.len() + j].to_bits(), w.to_bits(), "indexed {na}x{m}x{cols}: ({i}, {j})");
            }
        }
    }
}
