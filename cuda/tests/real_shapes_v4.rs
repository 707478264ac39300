//! V4-Flash's dense device ops at the shapes a GPU runs (hidden 4096, 64
//! heads × 512 with 64 RoPE dims, q_lora 1024, vocab 129280, hc 4, Sinkhorn
//! 20), with 1 to 4 tokens, against the CPU definitions the per-op tests
//! use, bit for bit: the linears, the vocabulary head and embedding, the
//! row-wise ops, mHC and sampling. `real_shapes_v4_sparse.rs` holds the
//! compressors, indexer, attention and MoE, `real_shapes_v41*.rs` V4.1-Flash,
//! and `shapes_support/` the dimensions, generators and CPU references.
//!
//! The per-op tests run hidden sizes of 16-300; what these add is the real
//! grids (1010 blocks of outputs for the vocabulary head, 64 heads per query),
//! the real per-thread loop lengths and the index arithmetic at real strides.
//! Each test prints its wall time (`-- --nocapture`).

mod shapes_support;

use deepinfer_cuda::ops::elementwise::{add_rows, add_scaled_rows, rope_rows, scale_rows, swiglu_clamped};
use deepinfer_cuda::ops::hyper::{hyper_head, hyper_post, hyper_pre};
use deepinfer_cuda::ops::linear::{gather_rows, DeviceLinear};
use deepinfer_cuda::ops::linear_splitk::{linear_forward_split, slice_columns, split_for_batch};
use deepinfer_cuda::ops::moe;
use deepinfer_cuda::ops::norm::rms_norm_rows;
use deepinfer_cuda::ops::sampling::{sample as device_sample, SampleRow};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::test_gpu;
use deepinfer_kernels::linear::column_chain;
use deepinfer_kernels::ops::{self as kops, add_scaled, mix_streams, rope_interleaved, sigmoid, Rope};
use shapes_support::v4::{cpu_collapse, cpu_hyper_pre, cpu_normed_mix, cpu_sample};
use shapes_support::{
    angles, assert_bits, device_linear, fp4_weight, fp8_weight, yarn, Gen, Timer, HC, HEADS, HEAD_DIM, INDEX_HEAD_DIM,
    ROPE_DIM, SINKHORN_ITERS, V4_HIDDEN, V4_INDEX_HEADS, V4_Q_LORA, VOCAB,
};

// ---- V4-Flash: linears -------------------------------------------------------

#[test]
fn v4_linears_fp8_128_blocks_and_fp4_per_32_at_4096_wide_shapes() {
    let _t = Timer::start("v4 linears");
    let gpu = test_gpu();
    let mut g = Gen(1);
    let cases = [
        ("wq_a fp8 1024x4096", fp8_weight(&mut g, V4_Q_LORA, V4_HIDDEN, 128), 4),
        ("wkv fp8 512x4096", fp8_weight(&mut g, HEAD_DIM, V4_HIDDEN, 128), 3),
        ("wo_b fp8 4096x8192", fp8_weight(&mut g, V4_HIDDEN, 8 * 1024, 128), 1),
        ("expert w1 fp4 2048x4096", fp4_weight(&mut g, 2048, V4_HIDDEN), 2),
        ("expert w2 fp4 4096x2048", fp4_weight(&mut g, V4_HIDDEN, 2048), 2),
    ];
    for (what, w, n) in &cases {
        let x = g.spiky(n * w.cols);
        let mut want = vec![0.0f32; n * w.rows];
        w.forward(&x, *n, &mut want);
        let dw = DeviceLinear::upload(&gpu, w).unwrap();
        assert_bits(&device_linear(&gpu, &dw, &x, *n), &want, &format!("{what}, n = {n}"));
    }
    // The split-K variant at the split its policy picks for wq_a (16), held
    // to its own definition (per-slice chains, then the slices in order).
    let (w, n) = (&cases[0].1, 2);
    let splits = split_for_batch(n, w.rows);
    assert!(splits > 1, "wq_a at n = {n} splits");
    let x = g.spiky(n * w.cols);
    let slice = slice_columns(w.cols, splits);
    let mut row = vec![0.0f32; w.cols];
    let mut want = vec![0.0f32; n * w.rows];
    for o in 0..w.rows {
        w.dequantize_row(o, &mut row);
        for i in 0..n {
            let xi = &x[i * w.cols..][..w.cols];
            let part = |s: usize| {
                let (a, b) = ((s * slice).min(w.cols), ((s + 1) * slice).min(w.cols));
                column_chain(&xi[a..b], &row[a..b])
            };
            want[i * w.rows + o] = (1..splits).fold(part(0), |acc, s| acc + part(s));
        }
    }
    let dw = DeviceLinear::upload(&gpu, w).unwrap();
    let (xd, od) = (gpu.upload(&x).unwrap(), gpu.zeros::<f32>(n * w.rows).unwrap());
    linear_forward_split(&gpu, &dw, Rows::packed(&xd, w.cols), n, Rows::packed(&od, w.rows), splits).unwrap();
    assert_bits(&gpu.download(&od).unwrap(), &want, &format!("wq_a split-K in {splits}"));
}

#[test]
fn v4_vocabulary_head_and_embedding_of_129280_rows() {
    let _t = Timer::start("v4 vocabulary head");
    let gpu = test_gpu();
    let mut g = Gen(2);
    // 129280 × 4096 FP8 codes: 1010 blocks of 128 outputs, 529M weights.
    let w = fp8_weight(&mut g, VOCAB, V4_HIDDEN, 128);
    let dw = DeviceLinear::upload(&gpu, &w).unwrap();
    let x = g.spiky(V4_HIDDEN);
    let mut want = vec![0.0f32; VOCAB];
    w.forward(&x, 1, &mut want);
    assert_bits(&device_linear(&gpu, &dw, &x, 1), &want, "vocabulary head, n = 1");
    // The embedding lookup from the same table, ids past it reading its last row.
    let ids: Vec<u32> = vec![0, 1, 128, 64_640, VOCAB as u32 - 1, VOCAB as u32, u32::MAX];
    let idd = gpu.upload(&ids).unwrap();
    let out = gpu.zeros::<f32>(ids.len() * V4_HIDDEN).unwrap();
    gather_rows(&gpu, &dw, &idd, ids.len(), Rows::packed(&out, V4_HIDDEN)).unwrap();
    let got = gpu.download(&out).unwrap();
    let mut row = vec![0.0f32; V4_HIDDEN];
    for (i, &id) in ids.iter().enumerate() {
        w.dequantize_row((id as usize).min(VOCAB - 1), &mut row);
        assert_bits(&got[i * V4_HIDDEN..][..V4_HIDDEN], &row, &format!("embedding of id {id}"));
    }
}

// ---- V4-Flash: row-wise ops ----------------------------------------------------

#[test]
fn v4_rms_norm_of_hidden_q_lora_kv_and_head_rows() {
    let _t = Timer::start("v4 rms_norm");
    let gpu = test_gpu();
    let mut g = Gen(3);
    // (rows, dim): 4 tokens' hidden and q_lora rows, 2 tokens × 64 heads of
    // 512 (q), 3 kv rows, 4 tokens × 64 indexer heads of 128.
    for (n, dim) in [(4, V4_HIDDEN), (4, V4_Q_LORA), (2 * HEADS, HEAD_DIM), (3, HEAD_DIM), (4 * 64, INDEX_HEAD_DIM)] {
        let x = g.spiky(n * dim);
        let w: Vec<f32> = g.vec(dim, 0.5).iter().map(|v| 1.0 + v).collect();
        for weight in [Some(&w), None] {
            let mut want = x.clone();
            want.chunks_exact_mut(dim).for_each(|r| kops::rms_norm(r, weight.map(|w| &w[..]), 1e-6));
            let xd = gpu.upload(&x).unwrap();
            let wd = gpu.upload(&w).unwrap();
            rms_norm_rows(&gpu, &xd, n, dim, weight.map(|_| &wd), 1e-6).unwrap();
            let what = format!("rms_norm {n} x {dim} weight {}", weight.is_some());
            assert_bits(&gpu.download(&xd).unwrap(), &want, &what);
        }
    }
}

#[test]
fn v4_rope_on_64_heads_of_512_and_the_indexers_128() {
    let _t = Timer::start("v4 rope");
    let gpu = test_gpu();
    let mut g = Gen(4);
    let positions = [0usize, 127, 65_535, 1_048_575];
    let n = positions.len();
    for (rope, what) in
        [(Rope::new(ROPE_DIM, 10000.0, None), "theta 1e4"), (Rope::new(ROPE_DIM, 160000.0, Some(yarn())), "yarn")]
    {
        let (cos, sin) = angles(&rope, &positions);
        let half = ROPE_DIM / 2;
        for (heads, head_dim) in [(HEADS, HEAD_DIM), (V4_INDEX_HEADS, INDEX_HEAD_DIM), (1, HEAD_DIM)] {
            // Rows strided past their heads, from an offset.
            let (offset, stride) = (3, heads * head_dim + 5);
            let x = g.vec(offset + n * stride, 4.0);
            for inverse in [false, true] {
                let mut want = x.clone();
                for r in 0..n {
                    let s: Vec<f32> = sin[r * half..][..half].iter().map(|&v| if inverse { -v } else { v }).collect();
                    for h in 0..heads {
                        let v = &mut want[offset + r * stride + h * head_dim..][..head_dim];
                        rope_interleaved(&mut v[head_dim - ROPE_DIM..], &cos[r * half..][..half], &s);
                    }
                }
                let (xd, cd, sd) = (gpu.upload(&x).unwrap(), gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
                rope_rows(&gpu, Rows::new(&xd, offset, stride), n, heads, head_dim, ROPE_DIM, &cd, &sd, inverse)
                    .unwrap();
                let what = format!("rope {what} {heads} x {head_dim} inverse {inverse}");
                assert_bits(&gpu.download(&xd).unwrap(), &want, &what);
            }
        }
    }
}

#[test]
fn v4_elementwise_swiglu_residuals_and_dispatch_at_4096() {
    let _t = Timer::start("v4 element-wise");
    let gpu = test_gpu();
    let mut g = Gen(5);
    // 6 routed rows of the experts' 2048, clamped at 10.
    let len = 6 * 2048;
    let gate = g.vec(len, 30.0);
    let up = g.vec(len, 30.0);
    let mut want = gate.clone();
    kops::swiglu_clamped(&mut want, &up, 10.0);
    let (gd, ud) = (gpu.upload(&gate).unwrap(), gpu.upload(&up).unwrap());
    swiglu_clamped(&gpu, &gd, &ud, len, 10.0).unwrap();
    assert_bits(&gpu.download(&gd).unwrap(), &want, "swiglu 6 x 2048");

    let n = 4;
    let (so, sx) = (V4_HIDDEN + 3, V4_HIDDEN + 1);
    let out = g.vec(2 + n * so, 4.0);
    let x = g.vec(1 + n * sx, 4.0);
    let (od, xd) = (gpu.upload(&out).unwrap(), gpu.upload(&x).unwrap());
    let mut want = out.clone();
    for r in 0..n {
        for c in 0..V4_HIDDEN {
            want[2 + r * so + c] += x[1 + r * sx + c];
        }
    }
    add_rows(&gpu, Rows::new(&od, 2, so), Rows::new(&xd, 1, sx), n, V4_HIDDEN).unwrap();
    assert_bits(&gpu.download(&od).unwrap(), &want, "add_rows 4 x 4096");
    for r in 0..n {
        add_scaled(&mut want[2 + r * so..][..V4_HIDDEN], 0.7, &x[1 + r * sx..][..V4_HIDDEN]);
    }
    add_scaled_rows(&gpu, Rows::new(&od, 2, so), 0.7, Rows::new(&xd, 1, sx), n, V4_HIDDEN).unwrap();
    assert_bits(&gpu.download(&od).unwrap(), &want, "add_scaled_rows 4 x 4096");
    let all = want.len();
    want.iter_mut().for_each(|v| *v *= 1.5);
    scale_rows(&gpu, &od, all, 1.5).unwrap();
    assert_bits(&gpu.download(&od).unwrap(), &want, "scale_rows");

    // Dispatch: 4 tokens' rows gathered for their 6 experts each.
    let rows: Vec<i32> = (0..n * 6).map(|_| g.below(n) as i32).collect();
    let rd = gpu.upload(&rows).unwrap();
    let gathered = gpu.zeros::<f32>(rows.len() * V4_HIDDEN).unwrap();
    moe::gather_rows(&gpu, Rows::new(&xd, 1, sx), &rd, rows.len(), V4_HIDDEN, Rows::packed(&gathered, V4_HIDDEN))
        .unwrap();
    let want: Vec<f32> = rows.iter().flat_map(|&r| x[1 + r as usize * sx..][..V4_HIDDEN].to_vec()).collect();
    assert_bits(&gpu.download(&gathered).unwrap(), &want, "moe gather_rows 24 x 4096");
}

// ---- V4-Flash: mHC -----------------------------------------------------------

#[test]
fn v4_hyper_connections_hc_4_of_4096_with_20_sinkhorn_iterations() {
    let _t = Timer::start("v4 mHC");
    let gpu = test_gpu();
    let mut g = Gen(6);
    let (n, hc, d, eps) = (3, HC, V4_HIDDEN, 1e-6f32);
    let outputs = (2 + hc) * hc;
    let streams = g.vec(n * hc * d, 3.0);
    let raw = g.vec(n * outputs, 20.0);
    let base = g.vec(outputs, 1.0);
    let scale = [0.7, 1.1, 0.9];
    let (mixes, collapsed) = cpu_hyper_pre(&raw, &streams, n, hc, d, scale, &base, eps);
    let (raw_d, streams_d, base_d) =
        (gpu.upload(&raw).unwrap(), gpu.upload(&streams).unwrap(), gpu.upload(&base).unwrap());
    let (post_d, comb_d) = (gpu.zeros::<f32>(n * hc).unwrap(), gpu.zeros::<f32>(n * hc * hc).unwrap());
    let collapsed_d = gpu.zeros::<f32>(n * d).unwrap();
    hyper_pre(
        &gpu,
        &raw_d,
        &streams_d,
        n,
        hc,
        d,
        scale,
        &base_d,
        eps,
        eps,
        SINKHORN_ITERS,
        &post_d,
        &comb_d,
        &collapsed_d,
    )
    .unwrap();
    let post: Vec<f32> = mixes.iter().flat_map(|m| m.post.clone()).collect();
    let comb: Vec<f32> = mixes.iter().flat_map(|m| m.comb.clone()).collect();
    assert_bits(&gpu.download(&post_d).unwrap(), &post, "hyper_pre post");
    assert_bits(&gpu.download(&comb_d).unwrap(), &comb, "hyper_pre comb");
    assert_bits(&gpu.download(&collapsed_d).unwrap(), &collapsed, "hyper_pre collapsed");

    let output = g.vec(n * d, 2.0);
    let mut want = streams.clone();
    for (t, (mix, s)) in mixes.iter().zip(want.chunks_exact_mut(hc * d)).enumerate() {
        mix_streams(s, &output[t * d..(t + 1) * d], &mix.post, &mix.comb);
    }
    let output_d = gpu.upload(&output).unwrap();
    hyper_post(&gpu, &post_d, &comb_d, &output_d, &streams_d, n, hc, d).unwrap();
    assert_bits(&gpu.download(&streams_d).unwrap(), &want, "hyper_post");

    let raw_head = g.vec(n * hc, 20.0);
    let base_head = g.vec(hc, 1.0);
    let mixes = cpu_normed_mix(&raw_head, hc, &want, n, hc * d, eps);
    let mut head = vec![0.0f32; n * d];
    for t in 0..n {
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(mixes[t * hc + j] * 0.8 + base_head[j]) + eps).collect();
        cpu_collapse(&pre, &want[t * hc * d..(t + 1) * hc * d], &mut head[t * d..(t + 1) * d]);
    }
    let (raw_head_d, base_head_d) = (gpu.upload(&raw_head).unwrap(), gpu.upload(&base_head).unwrap());
    let out_d = gpu.zeros::<f32>(n * d).unwrap();
    hyper_head(&gpu, &raw_head_d, &streams_d, n, hc, d, 0.8, &base_head_d, eps, eps, &out_d).unwrap();
    assert_bits(&gpu.download(&out_d).unwrap(), &head, "hyper_head");
}

// ---- V4-Flash: sampling ------------------------------------------------------

#[test]
fn v4_sampling_over_129280_tokens_greedy_and_with_temperature_top_k_top_p_min_p() {
    let _t = Timer::start("v4 sampling");
    let gpu = test_gpu();
    let mut g = Gen(12);
    let smooth = g.vec(VOCAB, 12.0);
    // A coarse grid: many tokens tie, the maximum among them.
    let grid: Vec<f32> = (0..VOCAB).map(|_| (g.below(17) as f32 - 8.0) * 0.5).collect();
    let rows = [
        (smooth.clone(), SampleRow::greedy()),
        (grid.clone(), SampleRow::greedy()),
        (smooth.clone(), SampleRow { temperature: 0.7, top_k: 0, top_p: 0.9, min_p: 0.0, seed: 1, position: 5 }),
        (grid.clone(), SampleRow { temperature: 1.0, top_k: 50, top_p: 1.0, min_p: 0.0, seed: 2, position: 900 }),
        (
            smooth.clone(),
            SampleRow { temperature: 1.3, top_k: 0, top_p: 0.95, min_p: 0.05, seed: 3, position: 1 << 20 },
        ),
        (grid, SampleRow { temperature: 0.6, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 4, position: 7 }),
        (smooth, SampleRow { temperature: 2.0, top_k: 20_000, top_p: 0.5, min_p: 0.0, seed: 5, position: 3 }),
    ];
    let stride = VOCAB + 3;
    let mut flat = vec![0.0f32; 1 + rows.len() * stride];
    for (r, (l, _)) in rows.iter().enumerate() {
        flat[1 + r * stride..][..VOCAB].copy_from_slice(l);
    }
    let buf = gpu.upload(&flat).unwrap();
    let params: Vec<SampleRow> = rows.iter().map(|(_, p)| *p).collect();
    let out = gpu.zeros::<u32>(rows.len()).unwrap();
    device_sample(&gpu, Rows::new(&buf, 1, stride), VOCAB, &params, &out).unwrap();
    let got = gpu.download(&out).unwrap();
    for (r, (l, p)) in rows.iter().enumerate() {
        assert_eq!(got[r], cpu_sample(l, p), "row {r}: {p:?}");
    }
}
