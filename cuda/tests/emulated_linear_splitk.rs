//! The split-K linear kernels (`cuda/kernels/linear_splitk.cu`) on the
//! emulated device: bit for bit against their own definition (the CPU's
//! `column_chain` per slice, the slices' sums added in order), within the
//! reassociation bound of `Linear::forward`, bit for bit `linear_forward`
//! with one split, and, under `split_for_batch`, a row whose bits change
//! with the batch (the batch invariance the portable kernels keep and this
//! variant gives up).

use deepinfer_cuda::ops::linear::{linear_forward, DeviceLinear};
use deepinfer_cuda::ops::linear_splitk::{
    linear_forward_split, linear_forward_split_with_scratch, scratch_len, slice_columns, split_for_batch,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::dtype::f32_to_bf16;
use deepinfer_kernels::linear::column_chain;
use deepinfer_kernels::quantize::quantize_fp8_blocks;
use deepinfer_kernels::{Linear, WeightFormat};

/// SplitMix64 values in [-1, 1), every 37th scaled far out so that a sum in
/// another order differs in its bits.
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
            } else {
                v
            }
        })
        .collect()
}

fn f32_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    Linear::from_f32(rows, cols, values(rows * cols, seed))
}

fn bf16_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    let bytes: Vec<u8> = values(rows * cols, seed).iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
    Linear { rows, cols, format: WeightFormat::Bf16(bytes.into()) }
}

fn fp8_linear(rows: usize, cols: usize, block: usize, seed: u64) -> Linear {
    quantize_fp8_blocks(&values(rows * cols, seed), rows, cols, block).into_fp8_linear(rows, cols, block)
}

/// The formats split-K supports over shapes with tails in every tiling.
fn weights() -> Vec<(String, Linear)> {
    let mut all = Vec::new();
    for (rows, cols) in [(1, 1), (7, 17), (100, 33), (200, 300)] {
        all.push((format!("f32 {rows}x{cols}"), f32_linear(rows, cols, 1 + rows as u64)));
        all.push((format!("bf16 {rows}x{cols}"), bf16_linear(rows, cols, 2 + rows as u64)));
    }
    for (rows, cols, block) in [(256, 256, 128), (200, 300, 128), (7, 17, 128), (129, 100, 32)] {
        all.push((format!("fp8 {rows}x{cols} blocks {block}"), fp8_linear(rows, cols, block, 3 + rows as u64)));
    }
    all
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn dequantized(w: &Linear) -> Vec<Vec<f32>> {
    (0..w.rows)
        .map(|r| {
            let mut row = vec![0.0f32; w.cols];
            w.dequantize_row(r, &mut row);
            row
        })
        .collect()
}

/// What the split kernels compute, on the CPU: per slice of
/// `slice_columns(cols, splits)` columns the CPU's `column_chain`, then the
/// slices' sums added left to right from the first.
fn split_reference(w: &[Vec<f32>], x: &[f32], n: usize, cols: usize, splits: usize) -> Vec<f32> {
    let slice = slice_columns(cols, splits);
    let mut out = Vec::with_capacity(n * w.len());
    for xi in x.chunks_exact(cols.max(1)).take(n) {
        for row in w {
            let part = |s: usize| {
                let (a, b) = ((s * slice).min(cols), ((s + 1) * slice).min(cols));
                column_chain(&xi[a..b], &row[a..b])
            };
            out.push((1..splits).fold(part(0), |acc, s| acc + part(s)));
        }
    }
    out
}

/// Strided x and out inside larger buffers: runs `f` (one of the forward
/// functions) over `n` rows, checks the padding is untouched, returns `[n][rows]`.
fn device_run(gpu: &Gpu, w: &DeviceLinear, x: &[f32], n: usize, f: impl FnOnce(Rows, Rows)) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    let (x_off, x_stride) = (5, cols + 3);
    let (o_off, o_stride) = (2, rows + 7);
    let mut xs = vec![-7.5f32; x_off + n * x_stride];
    for i in 0..n {
        xs[x_off + i * x_stride..][..cols].copy_from_slice(&x[i * cols..][..cols]);
    }
    let xd = gpu.upload(&xs).unwrap();
    let sentinel = f32::from_bits(0x7fc0_1234);
    let od = gpu.upload(&vec![sentinel; o_off + n * o_stride]).unwrap();
    f(Rows::new(&xd, x_off, x_stride), Rows::new(&od, o_off, o_stride));
    let got = gpu.download(&od).unwrap();
    let mut out = Vec::with_capacity(n * rows);
    for (i, v) in got.iter().enumerate() {
        let inside = i >= o_off && (i - o_off) % o_stride < rows && (i - o_off) / o_stride < n;
        if inside {
            out.push(*v);
        } else {
            assert_eq!(v.to_bits(), sentinel.to_bits(), "element {i} outside the output rows was written");
        }
    }
    out
}

fn split_forward(gpu: &Gpu, w: &DeviceLinear, x: &[f32], n: usize, splits: usize) -> Vec<f32> {
    device_run(gpu, w, x, n, |xr, or| linear_forward_split(gpu, w, xr, n, or, splits).unwrap())
}

fn portable_forward(gpu: &Gpu, w: &DeviceLinear, x: &[f32], n: usize) -> Vec<f32> {
    device_run(gpu, w, x, n, |xr, or| linear_forward(gpu, w, xr, n, or).unwrap())
}

/// γ_m = m·u / (1 − m·u), u = 2⁻²⁴ (f32 round to nearest).
fn gamma(m: usize) -> f64 {
    let mu = m as f64 * f64::powi(2.0, -24);
    mu / (1.0 - mu)
}

/// The tolerance of a split result against `Linear::forward`, per output:
/// `2·γ_{K+s}·Σ_c |x_c·w_c|` (K columns, s splits, w the dequantised f32
/// weight both sides use). Why: each `fma` rounds once and its product is
/// exact, so an output is a sum of the K exact products through a tree of
/// rounded additions, and a sum whose every term passes at most `d`
/// roundings is within `γ_d·Σ|terms|` of the exact sum (Higham, Accuracy and
/// Stability, §4.2). The CPU's chain has depth ≤ K; a split's term passes
/// ≤ ceil(K/s) fmas of its slice plus s − 1 additions of pass 2, ≤ K + s.
/// Both are within `γ_{K+s}·Σ` of the exact sum, so of each other within
/// twice that. No underflow or overflow occurs with these inputs. (The
/// fixed `1e-5·Σ` would be sound only while `2·γ_{K+s} ≤ 1e-5`, K + s ≲ 83.)
fn tolerance(x: &[f32], w: &[f32], splits: usize) -> f64 {
    let sum: f64 = x.iter().zip(w).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
    // The f64 sum of exact f64 products is itself within K·2⁻⁵³ relative.
    2.0 * gamma(x.len() + splits) * sum * (1.0 + 1e-12)
}

#[test]
fn split_linear_is_its_definition_bit_for_bit_and_within_reassociation_error_of_the_cpu() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut reassociated = 0usize;
    let mut worst = 0.0f64;
    for (what, w) in weights() {
        let dw = DeviceLinear::upload(&gpu, &w).unwrap();
        let rows_f32 = dequantized(&w);
        for n in [1usize, 3, 17] {
            let x = values(n * w.cols, 99 + n as u64);
            let mut expect = vec![0.0f32; n * w.rows];
            w.forward(&x, n, &mut expect);
            for splits in [1usize, 2, 7, 16] {
                let got = split_forward(&gpu, &dw, &x, n, splits);
                let definition = split_reference(&rows_f32, &x, n, w.cols, splits);
                assert_eq!(bits(&got), bits(&definition), "{what}, n = {n}, {splits} splits: the split definition");
                if splits == 1 {
                    assert_eq!(bits(&got), bits(&expect), "{what}, n = {n}, one split: the CPU's bits");
                }
                for i in 0..n {
                    for o in 0..w.rows {
                        let (g, e) = (got[i * w.rows + o], expect[i * w.rows + o]);
                        let tol = tolerance(&x[i * w.cols..][..w.cols], &rows_f32[o], splits);
                        let err = (g as f64 - e as f64).abs();
                        assert!(
                            err <= tol,
                            "{what}, n = {n}, {splits} splits, row {i} output {o}: {g} vs the CPU's {e}, \
                             error {err:e} > {tol:e}"
                        );
                        if tol > 0.0 {
                            worst = worst.max(err / tol);
                        }
                        reassociated += usize::from(g.to_bits() != e.to_bits());
                    }
                }
            }
        }
    }
    // The splits do reassociate: some outputs differ from the CPU's bits.
    assert!(reassociated > 0, "no split result differed from the CPU's chain");
    eprintln!("{reassociated} outputs differ from the CPU's bits; worst error {worst:.3} of the bound");
}

#[test]
fn one_split_has_the_bits_of_linear_forward() {
    let gpu = deepinfer_cuda::test_gpu();
    for (what, w) in weights() {
        let dw = DeviceLinear::upload(&gpu, &w).unwrap();
        for n in [1usize, 3, 17] {
            let x = values(n * w.cols, 5 + n as u64);
            let portable = portable_forward(&gpu, &dw, &x, n);
            let split = split_forward(&gpu, &dw, &x, n, 1);
            assert_eq!(bits(&split), bits(&portable), "{what}, n = {n}");
            // The scratch variant with no scratch (one split needs none).
            let empty = gpu.zeros::<f32>(1).unwrap();
            assert_eq!(scratch_len(&dw, n, 1), 0);
            let again = device_run(&gpu, &dw, &x, n, |xr, or| {
                linear_forward_split_with_scratch(&gpu, &dw, xr, n, or, 1, &empty).unwrap()
            });
            assert_eq!(bits(&again), bits(&portable), "{what}, n = {n}, with scratch");
        }
    }
}

#[test]
fn split_for_batch_fills_an_h100_at_decode_and_does_not_split_at_prefill() {
    let policy: Vec<usize> =
        [1usize, 4, 5, 8, 9, 16, 17, 32, 33, 256].iter().map(|&n| split_for_batch(n, 4096)).collect();
    assert_eq!(policy, [16, 16, 8, 8, 4, 4, 2, 2, 1, 1]);
    assert_eq!(split_for_batch(1, 7168), 8); // 56 blocks: 264 / 56 → 5 → 8
    assert_eq!(split_for_batch(1, 128), 16); // capped
    assert_eq!(split_for_batch(0, 4096), 1);
    assert_eq!(split_for_batch(1, 0), 1);
    for n in 1..200 {
        for rows in [128usize, 1000, 4096, 18432] {
            let s = split_for_batch(n, rows);
            let base = n.div_ceil(4) * rows.div_ceil(128);
            assert!(s.is_power_of_two() && s <= 16);
            assert!(base * s >= 264 || s == 16, "n {n} rows {rows}: {s} splits leave the GPU short");
            assert!(s == 1 || base * (s / 2) < 264, "n {n} rows {rows}: {s} splits are more than needed");
        }
    }
}

/// The point of the variant: under a batch-dependent split policy the same
/// x row gets different bits alone (decode) and in batches, whereas
/// `linear_forward` gives it the same bits in every batch.
#[test]
fn split_for_batch_gives_a_row_different_bits_in_different_batches() {
    let gpu = deepinfer_cuda::test_gpu();
    let (rows, cols) = (1024, 256);
    let w = fp8_linear(rows, cols, 128, 31);
    let dw = DeviceLinear::upload(&gpu, &w).unwrap();
    let batch = 132;
    let x = values(batch * cols, 32);
    let row0 = &x[..cols];
    let mut cpu = vec![0.0f32; rows];
    w.forward(row0, 1, &mut cpu);
    let mut seen: Vec<(usize, usize, Vec<f32>)> = Vec::new();
    for n in [1usize, 40, batch] {
        let splits = split_for_batch(n, rows);
        let out = split_forward(&gpu, &dw, &x[..n * cols], n, splits);
        let first = out[..rows].to_vec();
        let portable = portable_forward(&gpu, &dw, &x[..n * cols], n);
        assert_eq!(bits(&portable[..rows]), bits(&cpu), "linear_forward, n = {n}: the same bits in any batch");
        seen.push((n, splits, first));
    }
    assert_eq!(seen.iter().map(|s| s.1).collect::<Vec<_>>(), [16, 4, 1], "the policy's splits");
    // n = 132 fills the GPU without a split: the CPU's bits.
    assert_eq!(bits(&seen[2].2), bits(&cpu), "n = {batch}, one split");
    for (n, splits, got) in &seen[..2] {
        let differ = got.iter().zip(&cpu).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert!(differ > 0, "n = {n} ({splits} splits): the row kept its bits");
        eprintln!(
            "row 0 alone vs in a batch of {n} ({splits} splits): {differ} of {rows} outputs differ from n = {batch}"
        );
    }
    let between = seen[0].2.iter().zip(&seen[1].2).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert!(between > 0, "n = 1 and n = 40 gave row 0 the same bits");
}
