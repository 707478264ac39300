//! Every device op of `cuda/src/ops/` at the shapes a GPU runs for
//! DeepSeek-V4-Flash (hidden 4096, 64 heads × 512 with 64 RoPE dims, q_lora
//! 1024, indexer 64 × 128 with top 512, 256 experts top-6 of 2048, vocab
//! 129280, hc 4, Sinkhorn 20) and V4.1-Flash (hidden 5120, q_lora 1280,
//! indexer 32 × 128, 384 experts top-6 of 2304, compress ratios 2 and 1,
//! Engram, DSpark's 128 experts top-3), with 1 to 4 tokens, against the CPU
//! definitions the per-op tests use, bit for bit. The CPU references that are
//! private to the engine (which this crate does not depend on) are faithful
//! copies of its code, as in the per-op tests (`emulated_*.rs`) they come from.
//!
//! The per-op tests run hidden sizes of 16-300; what these add is the real
//! grids (1010 blocks of outputs for the vocabulary head, 64 heads per query),
//! the real per-thread loop lengths and the index arithmetic at real strides.
//! Each test prints its wall time (`-- --nocapture`).

use std::time::Instant;

use deepinfer_cuda::ops::attention::{attend, index_topk, Selection};
use deepinfer_cuda::ops::compressor::{compress_tokens, CompressorSlots, CompressorSnapshot, DeviceCompressor};
use deepinfer_cuda::ops::elementwise::{add_rows, add_scaled_rows, rope_rows, scale_rows, swiglu_clamped};
use deepinfer_cuda::ops::hyper::{hyper_head, hyper_post, hyper_pre};
use deepinfer_cuda::ops::linear::{gather_rows, linear_forward, DeviceLinear};
use deepinfer_cuda::ops::linear_splitk::{linear_forward_split, slice_columns, split_for_batch};
use deepinfer_cuda::ops::moe::{self, combine, route, Routing};
use deepinfer_cuda::ops::norm::rms_norm_rows;
use deepinfer_cuda::ops::sampling::{sample as device_sample, SampleRow};
use deepinfer_cuda::ops::v41::{
    self, dot_f64_rows, fp4_round_trip_rows, fp8_quantize_rows, fp8_round_trip_rows, map_rows, plain_linear,
    quantized_linear, round_bf16_rows, softmax_rows, DeviceRope, RopePositions, Unary,
};
use deepinfer_cuda::ops::v41_model::{
    self, candidate_blocks, compress_pool, engram_gate, engram_gather, hc_mixes, hc_post, hc_pre, index_scores,
    moe_combine, sparse_attention, swiglu, Chosen, DeviceEngramTable, IndexSpan, MixShape, ScoreSqrt, Window,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::{test_gpu, DeviceBuffer, Gpu};
use deepinfer_kernels::act_quant::{self, fp4_round_trip, fp8_quantize_row, fp8_round_trip, round_bf16, Fp4Scale};
use deepinfer_kernels::dtype::{fp8_e4m3_to_f32, ue8m0_to_f32};
use deepinfer_kernels::linear::{column_chain, dot_rows, dot_rows_of};
use deepinfer_kernels::ops::{
    self as kops, add_scaled, add_weighted_rows_heads, inv_rms, mix_streams, rope_interleaved, sigmoid, sinkhorn,
    softmax_with_sink, sqrt_softplus, top_k, Rope, Yarn,
};
use deepinfer_kernels::quantize::Quantized;
use deepinfer_kernels::Linear;

// ---- V4-Flash and V4.1-Flash dimensions ------------------------------------

const V4_HIDDEN: usize = 4096;
const V41_HIDDEN: usize = 5120;
const HEADS: usize = 64;
const HEAD_DIM: usize = 512;
const ROPE_DIM: usize = 64;
const V4_Q_LORA: usize = 1024;
const V41_Q_LORA: usize = 1280;
const WINDOW: usize = 128;
const V4_INDEX_HEADS: usize = 64;
const V41_INDEX_HEADS: usize = 32;
const INDEX_HEAD_DIM: usize = 128;
const INDEX_TOPK: usize = 512;
const VOCAB: usize = 129_280;
const HC: usize = 4;
const SINKHORN_ITERS: usize = 20;

// ---- Helpers -----------------------------------------------------------------

/// SplitMix64, a small deterministic generator.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform in [-scale, scale).
    fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.unit() * scale).collect()
    }
    /// [-1, 1) with every 37th value times 300: sums in another order round otherwise.
    fn spiky(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|i| if i % 37 == 0 { 300.0 * self.unit() } else { self.unit() }).collect()
    }
    /// [`Gen::spiky`] rounded to bf16 (V4.1's activations are bf16-valued).
    fn bf16(&mut self, len: usize) -> Vec<f32> {
        self.spiky(len).into_iter().map(round_bf16).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: {differ} of {} values differ, the first at {i}: device {:e}, CPU {:e}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Prints a test's wall time when it ends.
struct Timer(&'static str, Instant);

impl Timer {
    fn start(name: &'static str) -> Self {
        Timer(name, Instant::now())
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("real_shapes: {} took {:.2} s", self.0, self.1.elapsed().as_secs_f64());
    }
}

/// FP8 e4m3 codes (no NaN) with a UE8M0 scale per `block × block` tile.
fn fp8_weight(g: &mut Gen, rows: usize, cols: usize, block: usize) -> Linear {
    let mut codes = g.bytes(rows * cols);
    codes.iter_mut().filter(|c| **c & 0x7f == 0x7f).for_each(|c| *c &= 0xfe);
    let shape = (rows.div_ceil(block), cols.div_ceil(block));
    let scales: Vec<u8> = (0..shape.0 * shape.1).map(|_| 118 + g.below(12) as u8).collect();
    Quantized { codes, scales, scale_shape: shape }.into_fp8_linear(rows, cols, block)
}

/// FP4 e2m1 codes with a UE8M0 scale per 32 columns of each row.
fn fp4_weight(g: &mut Gen, rows: usize, cols: usize) -> Linear {
    let codes = g.bytes(rows * cols / 2);
    let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 118 + g.below(12) as u8).collect();
    Quantized { codes, scales, scale_shape: (rows, cols / 32) }.into_fp4_linear(rows, cols, 32)
}

/// `linear_forward` of `n` packed rows of `x`.
fn device_linear(gpu: &Gpu, w: &DeviceLinear, x: &[f32], n: usize) -> Vec<f32> {
    let xd = gpu.upload(x).unwrap();
    let od = gpu.upload(&vec![f32::NAN; n * w.rows]).unwrap();
    linear_forward(gpu, w, Rows::packed(&xd, w.cols), n, Rows::packed(&od, w.rows)).unwrap();
    gpu.download(&od).unwrap()
}

fn yarn() -> Yarn {
    Yarn {
        factor: 16.0,
        original_max_position_embeddings: 65536.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.0,
    }
}

/// `rope.cos_sin` of each position, `[positions][half]` each.
fn angles(rope: &Rope, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let half = rope.inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; positions.len() * half], vec![0.0f32; positions.len() * half]);
    for (i, &p) in positions.iter().enumerate() {
        rope.cos_sin(p, &mut cos[i * half..][..half], &mut sin[i * half..][..half]);
    }
    (cos, sin)
}

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

// ---- V4-Flash: mHC -------------------------------------------------------------
// Faithful copies of engine/src/model/hyper.rs (crate-private), from
// emulated_hyper.rs.

struct Mix {
    post: Vec<f32>,
    comb: Vec<f32>,
}

fn cpu_normed_mix(raw: &[f32], rows: usize, streams: &[f32], n: usize, width: usize, eps: f32) -> Vec<f32> {
    let mut mixes = raw[..n * rows].to_vec();
    for (t, row) in mixes.chunks_exact_mut(rows).enumerate() {
        let inv = inv_rms(&streams[t * width..][..width], eps);
        row.iter_mut().for_each(|v| *v *= inv);
    }
    mixes
}

fn cpu_collapse(pre: &[f32], streams: &[f32], out: &mut [f32]) {
    let d = out.len();
    out.fill(0.0);
    for (j, &p) in pre.iter().enumerate() {
        add_scaled(out, p, &streams[j * d..(j + 1) * d]);
    }
}

#[allow(clippy::too_many_arguments)]
fn cpu_hyper_pre(
    raw: &[f32],
    streams: &[f32],
    n: usize,
    hc: usize,
    d: usize,
    scale: [f32; 3],
    base: &[f32],
    eps: f32,
) -> (Vec<Mix>, Vec<f32>) {
    let outputs = (2 + hc) * hc;
    let mixes = cpu_normed_mix(raw, outputs, streams, n, hc * d, eps);
    let mut collapsed = vec![0.0f32; n * d];
    let mut out = Vec::new();
    for (t, row) in collapsed.chunks_exact_mut(d).enumerate() {
        let m = &mixes[t * outputs..(t + 1) * outputs];
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(m[j] * scale[0] + base[j]) + eps).collect();
        let post: Vec<f32> = (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] * scale[1] + base[hc + j])).collect();
        let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k]).collect();
        for r in comb.chunks_exact_mut(hc) {
            kops::softmax(r);
            r.iter_mut().for_each(|v| *v += eps);
        }
        sinkhorn(&mut comb, hc, SINKHORN_ITERS, eps);
        cpu_collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], row);
        out.push(Mix { post, comb });
    }
    (out, collapsed)
}

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

// ---- V4-Flash: compressors -----------------------------------------------------
// The engine's `Compressor`, `CompressorState` and private `compress_token`
// (engine/src/model/attention.rs), copied from emulated_compressor.rs.

struct Compressor {
    ape: Vec<f32>,
    norm: Vec<f32>,
    ratio: usize,
    dim: usize,
    overlap: bool,
}

impl Compressor {
    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

#[derive(Clone, Debug, Default)]
struct CompressorState {
    entries: Vec<f32>,
    pending_kv: Vec<f32>,
    pending_gate: Vec<f32>,
    overlap_kv: Option<Vec<f32>>,
    overlap_gate: Option<Vec<f32>>,
}

fn compress_token(c: &Compressor, st: &mut CompressorState, kv: &[f32], gate: &[f32], rope: &Rope, eps: f32) {
    let width = c.width();
    st.pending_kv.extend_from_slice(kv);
    st.pending_gate.extend_from_slice(gate);
    if st.pending_kv.len() < c.ratio * width {
        return;
    }
    let (dim, ratio) = (c.dim, c.ratio);
    let window = st.entries.len() / dim;
    let gates: Vec<f32> = st.pending_gate.iter().zip(&c.ape).map(|(g, a)| g + a).collect();
    let kvs = std::mem::take(&mut st.pending_kv);
    st.pending_gate.clear();
    let earlier = st.overlap_kv.as_deref().zip(st.overlap_gate.as_deref());
    let first_window = (c.overlap && earlier.is_none()).then(|| (vec![0.0f32; dim], vec![f32::NEG_INFINITY; dim]));
    let mut logit_rows: Vec<&[f32]> = Vec::with_capacity(2 * ratio);
    let mut value_rows: Vec<&[f32]> = Vec::with_capacity(2 * ratio);
    if c.overlap {
        for j in 0..ratio {
            let (values, logits) = match (earlier, &first_window) {
                (Some((pk, pg)), _) => (&pk[j * dim..(j + 1) * dim], &pg[j * dim..(j + 1) * dim]),
                (None, Some((no_values, no_logits))) => (&no_values[..], &no_logits[..]),
                (None, None) => unreachable!("a first window has its empty slots"),
            };
            value_rows.push(values);
            logit_rows.push(logits);
        }
    }
    let offset = if c.overlap { dim } else { 0 };
    for j in 0..ratio {
        value_rows.push(&kvs[j * width + offset..][..dim]);
        logit_rows.push(&gates[j * width + offset..][..dim]);
    }
    let mut entry = vec![0.0f32; dim];
    deepinfer_kernels::pooling::softmax_pool_columns(&logit_rows, &value_rows, &mut entry);
    if c.overlap {
        let mut ok = Vec::with_capacity(ratio * dim);
        let mut og = Vec::with_capacity(ratio * dim);
        for j in 0..ratio {
            ok.extend_from_slice(&kvs[j * width..j * width + dim]);
            og.extend_from_slice(&gates[j * width..j * width + dim]);
        }
        st.overlap_kv = Some(ok);
        st.overlap_gate = Some(og);
    }
    kops::rms_norm(&mut entry, Some(&c.norm), eps);
    let half = rope.inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
    if half > 0 {
        rope.cos_sin(window * ratio, &mut cos, &mut sin);
    }
    let tail = entry.len() - 2 * half;
    rope_interleaved(&mut entry[tail..], &cos, &sin);
    st.entries.extend_from_slice(&entry);
}

fn assert_state(got: &CompressorSnapshot, want: &CompressorState, what: &str) {
    assert_bits(&got.entries, &want.entries, &format!("{what}: entries"));
    assert_bits(&got.pending_kv, &want.pending_kv, &format!("{what}: pending kv"));
    assert_bits(&got.pending_gate, &want.pending_gate, &format!("{what}: pending gate"));
    for (name, got, want) in
        [("overlap kv", &got.overlap_kv, &want.overlap_kv), ("overlap gate", &got.overlap_gate, &want.overlap_gate)]
    {
        assert_eq!(got.is_some(), want.is_some(), "{what}: {name} held");
        if let (Some(g), Some(w)) = (got, want) {
            assert_bits(g, w, &format!("{what}: {name}"));
        }
    }
}

#[test]
fn v4_compressors_csa_ratio_4_overlap_and_hca_ratio_128_at_dim_512() {
    let _t = Timer::start("v4 compressors");
    let gpu = test_gpu();
    let mut g = Gen(7);
    let eps = 1e-6;
    // (ratio, dim, overlap, tokens the CPU takes first): the CSA compressor,
    // the indexer's own (dim 128) and the HCA one; decode-sized chunks after.
    for (ratio, dim, overlap, before) in
        [(4, HEAD_DIM, true, 598), (4, INDEX_HEAD_DIM, true, 598), (128, HEAD_DIM, false, 383)]
    {
        let width = if overlap { 2 * dim } else { dim };
        let cpu = Compressor {
            ape: g.vec(ratio * width, 1.5),
            norm: g.vec(dim, 0.5).iter().map(|v| 1.0 + v).collect(),
            ratio,
            dim,
            overlap,
        };
        let rope = Rope::new(ROPE_DIM, 160000.0, Some(yarn()));
        let dev = DeviceCompressor::new(&gpu, ratio, dim, overlap, &cpu.ape, &cpu.norm).unwrap();
        let chunks = [1usize, 3, 4];
        let tokens = before + chunks.iter().sum::<usize>();
        let kv = g.vec(tokens * width, 2.0);
        let gate = g.vec(tokens * width, 4.0);
        let mut state = CompressorState::default();
        for t in 0..before {
            compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, eps);
        }
        let overlap_rows = state.overlap_kv.as_deref().zip(state.overlap_gate.as_deref());
        let capacity = tokens / ratio;
        let mut slots = CompressorSlots::upload_from(
            &gpu,
            &dev,
            &state.entries,
            &state.pending_kv,
            &state.pending_gate,
            overlap_rows,
            capacity,
        )
        .unwrap();
        let (kv_d, gate_d) = (gpu.upload(&kv).unwrap(), gpu.upload(&gate).unwrap());
        let mut start = before;
        for len in chunks {
            let rows = |b| Rows::new(b, start * width, width);
            compress_tokens(&gpu, &dev, &mut slots, rows(&kv_d), rows(&gate_d), len, start, &rope, eps).unwrap();
            for t in start..start + len {
                compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, eps);
            }
            start += len;
            let what = format!("compressor ratio {ratio} dim {dim} overlap {overlap} after {start} tokens");
            assert_eq!(slots.count(), state.entries.len() / dim, "{what}: entries");
            assert_state(&slots.download(&gpu).unwrap(), &state, &what);
        }
    }
}

// ---- V4-Flash: the indexer and the attention ---------------------------------
// The engine's private `index_scores` and `attend_token`
// (engine/src/model/attention.rs), copied from emulated_attention.rs.

#[allow(clippy::too_many_arguments)]
fn cpu_index_topk(
    iq: &[f32],
    iw: &[f32],
    ih: usize,
    ihd: usize,
    entries: &[f32],
    position: usize,
    len: usize,
    ratio: usize,
    topk: usize,
) -> Vec<Vec<usize>> {
    (0..len)
        .map(|i| {
            let visible = (position + i + 1) / ratio;
            let q = &iq[i * ih * ihd..];
            let w = &iw[i * ih..];
            let scale = (ihd as f32).powf(-0.5);
            let mut dots = vec![0.0f32; ih * visible];
            dot_rows(&q[..ih * ihd], ih, &entries[..visible * ihd], visible, ihd, &mut dots);
            let scores: Vec<f32> =
                (0..visible).map(|e| (0..ih).map(|h| w[h] * (dots[h * visible + e].max(0.0) * scale)).sum()).collect();
            top_k(&scores, topk.min(visible))
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn cpu_attend(
    q: &[f32],
    h: usize,
    hd: usize,
    keys: &[f32],
    first_key_position: usize,
    position: usize,
    len: usize,
    window: usize,
    entries: &[f32],
    selected: &[Vec<usize>],
    sink: &[f32],
    scale: f32,
    cos: &[f32],
    sin: &[f32],
    half: usize,
) -> Vec<f32> {
    let mut attn_out = vec![0.0f32; len * h * hd];
    for (i, out_row) in attn_out.chunks_exact_mut(h * hd).enumerate() {
        let pos = position + i;
        let lo = (pos + 1).saturating_sub(window).max(first_key_position);
        let window_keys = &keys[(lo - first_key_position) * hd..(pos + 1 - first_key_position) * hd];
        let keys_of_query: Vec<&[f32]> =
            window_keys.chunks_exact(hd).chain(selected[i].iter().map(|&w| &entries[w * hd..(w + 1) * hd])).collect();
        let nk = keys_of_query.len();
        let mut probs = vec![0.0f32; h * nk];
        dot_rows_of(&q[i * h * hd..(i + 1) * h * hd], h, &keys_of_query, &mut probs, nk);
        for (head, row) in probs.chunks_exact_mut(nk.max(1)).enumerate() {
            row.iter_mut().for_each(|l| *l *= scale);
            softmax_with_sink(row, sink[head]);
        }
        add_weighted_rows_heads(out_row, h, &probs, nk, &keys_of_query);
        for out in out_row.chunks_exact_mut(hd) {
            let tail = out.len() - 2 * half;
            let neg: Vec<f32> = sin[i * half..][..half].iter().map(|s| -s).collect();
            rope_interleaved(&mut out[tail..], &cos[i * half..][..half], &neg);
        }
    }
    attn_out
}

/// The device's `index_topk` of `len` queries from `position` over
/// `entries` (64 heads × 128), checked against the CPU's selection; returns
/// the device's buffers and the selection.
fn check_v4_index_topk(
    gpu: &Gpu,
    g: &mut Gen,
    entries: &[f32],
    position: usize,
    len: usize,
) -> (DeviceBuffer<i32>, DeviceBuffer<i32>, Vec<Vec<usize>>) {
    let (ih, ihd, ratio, topk) = (V4_INDEX_HEADS, INDEX_HEAD_DIM, 4, INDEX_TOPK);
    let iq = g.vec(len * ih * ihd, 1.0);
    let iw = g.vec(len * ih, 0.125);
    let want = cpu_index_topk(&iq, &iw, ih, ihd, entries, position, len, ratio, topk);
    let (iqd, iwd, ed) = (gpu.upload(&iq).unwrap(), gpu.upload(&iw).unwrap(), gpu.upload(entries).unwrap());
    let selected = gpu.upload(&vec![7i32; len * topk]).unwrap();
    let counts = gpu.upload(&vec![-7i32; len]).unwrap();
    index_topk(
        gpu,
        Rows::packed(&iqd, ih * ihd),
        Rows::packed(&iwd, ih),
        ih,
        ihd,
        &ed,
        position,
        len,
        ratio,
        topk,
        &selected,
        &counts,
    )
    .unwrap();
    let (got, got_counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for (i, want) in want.iter().enumerate() {
        let what = format!("index_topk at {position} query {i} (visible {})", (position + i + 1) / ratio);
        assert_eq!(got_counts[i] as usize, want.len(), "{what}: count");
        let chosen: Vec<usize> = got[i * topk..][..want.len()].iter().map(|&v| v as usize).collect();
        assert_eq!(&chosen, want, "{what}: selection");
        assert!(got[i * topk + want.len()..(i + 1) * topk].iter().all(|&v| v == -1), "{what}: unused slots");
    }
    (selected, counts, want)
}

#[test]
fn v4_indexer_top_512_of_600_to_2000_entries_with_64_heads_of_128() {
    let _t = Timer::start("v4 indexer");
    let gpu = test_gpu();
    let mut g = Gen(8);
    // Visible entries 600..601 and 1999..2000; distinct entries, then entries
    // repeating every 5 rows (exact ties of the scores).
    for (position, len) in [(2399usize, 2usize), (7996, 4)] {
        let count = (position + len) / 4;
        let distinct = g.vec(count * INDEX_HEAD_DIM, 1.0);
        check_v4_index_topk(&gpu, &mut g, &distinct, position, len);
        let repeating: Vec<f32> = (0..count * INDEX_HEAD_DIM).map(|v| distinct[v % (5 * INDEX_HEAD_DIM)]).collect();
        check_v4_index_topk(&gpu, &mut g, &repeating, position, len);
    }
}

/// What a chunk attends to after its window.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Window,
    Hca { ratio: usize },
    Csa,
}

fn check_v4_attend(gpu: &Gpu, g: &mut Gen, position: usize, len: usize, kind: Kind) {
    let (h, hd) = (HEADS, HEAD_DIM);
    let half = ROPE_DIM / 2;
    let cached = position.min(WINDOW - 1);
    let first_key_position = position - cached;
    let keys = g.vec((cached + len) * hd, 1.0);
    let q = g.vec(len * h * hd, 1.0);
    let sink = g.vec(h, 2.0);
    let scale = (hd as f32).powf(-0.5);
    let rope = Rope::new(ROPE_DIM, 160000.0, Some(yarn()));
    let (cos, sin) = angles(&rope, &(position..position + len).collect::<Vec<_>>());
    let ratio = match kind {
        Kind::Hca { ratio } => ratio,
        _ => 4,
    };
    let n_entries = (position + len) / ratio;
    let entries = g.vec(n_entries * hd, 3.0);
    let (qd, kd, ed, sd) = (
        gpu.upload(&q).unwrap(),
        gpu.upload(&keys).unwrap(),
        gpu.upload(&entries).unwrap(),
        gpu.upload(&sink).unwrap(),
    );
    let (cd, snd) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
    let out = gpu.upload(&vec![f32::NAN; len * h * hd]).unwrap();
    let index;
    let (selected, selection) = match kind {
        Kind::Window => (vec![Vec::new(); len], Selection::None),
        Kind::Hca { ratio } => {
            ((0..len).map(|i| (0..(position + i + 1) / ratio).collect()).collect(), Selection::AllVisible { ratio })
        }
        Kind::Csa => {
            let index_entries = g.vec(n_entries * INDEX_HEAD_DIM, 1.0);
            index = check_v4_index_topk(gpu, g, &index_entries, position, len);
            assert!(index.2.iter().all(|s| s.len() == INDEX_TOPK), "512 entries chosen");
            let selection = Selection::Chosen { ratio, selected: &index.0, counts: &index.1, stride: INDEX_TOPK };
            (index.2.clone(), selection)
        }
    };
    let want = cpu_attend(
        &q,
        h,
        hd,
        &keys,
        first_key_position,
        position,
        len,
        WINDOW,
        &entries,
        &selected,
        &sink,
        scale,
        &cos,
        &sin,
        half,
    );
    attend(
        gpu,
        Rows::packed(&qd, h * hd),
        h,
        hd,
        &kd,
        first_key_position,
        position,
        len,
        WINDOW,
        Some(&ed),
        selection,
        &sd,
        scale,
        &cd,
        &snd,
        ROPE_DIM,
        Rows::packed(&out, h * hd),
    )
    .unwrap();
    assert_bits(&gpu.download(&out).unwrap(), &want, &format!("attend {kind:?} at {position} x {len}"));
}

#[test]
fn v4_attention_64_heads_of_512_over_a_128_window_and_512_chosen_entries() {
    let _t = Timer::start("v4 attention");
    let gpu = test_gpu();
    let mut g = Gen(9);
    check_v4_attend(&gpu, &mut g, 2399, 2, Kind::Csa);
    check_v4_attend(&gpu, &mut g, 5119, 3, Kind::Hca { ratio: 128 });
    check_v4_attend(&gpu, &mut g, 0, 4, Kind::Window);
    check_v4_attend(&gpu, &mut g, 1000, 1, Kind::Window);
}

// ---- V4-Flash: MoE -----------------------------------------------------------
// The engine's `route_token` (engine/src/model/moe.rs), copied from emulated_moe.rs.

fn cpu_route(
    logits: &[f32],
    hash: Option<(&[i32], u32, usize)>,
    bias: &[f32],
    k: usize,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&v| sqrt_softplus(v)).collect();
    let experts: Vec<usize> = match hash {
        Some((table, token, vocab)) => {
            let id = (token as usize).min(vocab - 1);
            table[id * k..(id + 1) * k].iter().map(|&x| x as usize).collect()
        }
        None => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            top_k(&biased, k)
        }
    };
    let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
    let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
    weights.iter_mut().for_each(|w| *w /= sum);
    weights.iter_mut().for_each(|w| *w *= scaling);
    (experts, weights)
}

#[test]
fn v4_routing_256_experts_top_6_by_score_and_by_hash_over_the_vocabulary() {
    let _t = Timer::start("v4 routing");
    let gpu = test_gpu();
    let mut g = Gen(10);
    let (n, e, k) = (4, 256, 6);
    // Logits on a coarse grid (ties), plus the softplus branch above 20.
    let mut logits: Vec<f32> = (0..n * e).map(|_| (g.below(33) as f32 - 16.0) * 0.25).collect();
    logits[5] = 25.0;
    logits[e + 7] = -120.0;
    let bias: Vec<f32> = (0..e).map(|_| g.below(5) as f32 * 0.0625).collect();
    let table: Vec<i32> = (0..VOCAB * k).map(|_| g.below(e) as i32).collect();
    let tokens: Vec<u32> = vec![0, VOCAB as u32 - 1, VOCAB as u32, 77_777];
    let (ld, bd, td, tokd) = (
        gpu.upload(&logits).unwrap(),
        gpu.upload(&bias).unwrap(),
        gpu.upload(&table).unwrap(),
        gpu.upload(&tokens).unwrap(),
    );
    for hash in [false, true] {
        let (experts, weights) = (gpu.zeros::<i32>(n * k).unwrap(), gpu.zeros::<f32>(n * k).unwrap());
        let mode = if hash {
            Routing::Hash { tid2eid: &td, tokens: &tokd, vocab: VOCAB }
        } else {
            Routing::TopK { bias: &bd }
        };
        route(&gpu, &ld, n, e, k, mode, true, 1.5, &experts, &weights).unwrap();
        let (got_e, got_w) = (gpu.download(&experts).unwrap(), gpu.download(&weights).unwrap());
        for t in 0..n {
            let h = hash.then_some((&table[..], tokens[t], VOCAB));
            let (want_e, want_w) = cpu_route(&logits[t * e..(t + 1) * e], h, &bias, k, 1.5);
            let ge: Vec<usize> = got_e[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
            assert_eq!(ge, want_e, "experts of token {t}, hash {hash}");
            assert_bits(&got_w[t * k..(t + 1) * k], &want_w, &format!("weights of token {t}, hash {hash}"));
        }
    }
}

#[test]
fn v4_combine_of_6_experts_at_4096() {
    let _t = Timer::start("v4 combine");
    let gpu = test_gpu();
    let mut g = Gen(11);
    let (n, k, d) = (3, 6, V4_HIDDEN);
    // Unsorted experts, one repeated within a token.
    let mut experts: Vec<i32> = (0..n * k).map(|_| g.below(256) as i32).collect();
    experts[3] = experts[1];
    let weights = g.vec(n * k, 1.5);
    let routed = g.vec(n * k * d, 8.0);
    let shared = g.vec(n * d, 3.0);
    let (rd, ed, wd, sd) = (
        gpu.upload(&routed).unwrap(),
        gpu.upload(&experts).unwrap(),
        gpu.upload(&weights).unwrap(),
        gpu.upload(&shared).unwrap(),
    );
    for shared_on in [false, true] {
        let mut want = vec![0.0f32; n * d];
        for (t, o) in want.chunks_exact_mut(d).enumerate() {
            let r = &experts[t * k..(t + 1) * k];
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by_key(|&slot| (r[slot], slot));
            for slot in order {
                add_scaled(o, weights[t * k + slot], &routed[(t * k + slot) * d..][..d]);
            }
            if shared_on {
                add_scaled(o, 1.0, &shared[t * d..(t + 1) * d]);
            }
        }
        let out = gpu.upload(&vec![f32::NAN; n * d]).unwrap();
        combine(&gpu, &rd, &ed, &wd, shared_on.then(|| Rows::packed(&sd, d)), n, k, d, Rows::packed(&out, d)).unwrap();
        assert_bits(&gpu.download(&out).unwrap(), &want, &format!("combine, shared {shared_on}"));
    }
}

// ---- V4-Flash: sampling ------------------------------------------------------
// The engine's `sampling::sample(..).token` (engine/src/sampling.rs): its
// `uniform`, `sanitize`, `argmax`, `rank`, `best_ranked`, `filtered_weights`
// and `draw`, copied.

fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn uniform(seed: u64, position: u64) -> f64 {
    let start = mix64(seed ^ 0x5a3d_1f0c_8e6b_2497);
    let bits = mix64(start.wrapping_add(position.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn sanitize(logits: &[f32]) -> Vec<f64> {
    let any_pos_inf = logits.contains(&f32::INFINITY);
    logits
        .iter()
        .map(|&l| {
            if l.is_nan() {
                f64::NEG_INFINITY
            } else if any_pos_inf {
                if l == f32::INFINITY {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            } else {
                f64::from(l)
            }
        })
        .collect()
}

fn rank(x: &[f64], a: u32, b: u32) -> std::cmp::Ordering {
    let (la, lb) = (x[a as usize], x[b as usize]);
    lb.partial_cmp(&la).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
}

fn best_ranked(x: &[f64], mut ids: Vec<u32>, n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, |&a, &b| rank(x, a, b));
        ids.truncate(n);
    }
    ids.sort_unstable_by(|&a, &b| rank(x, a, b));
    ids
}

fn argmax(x: &[f64]) -> u32 {
    let mut best = 0;
    for (id, &l) in x.iter().enumerate() {
        if l > x[best] {
            best = id;
        }
    }
    best as u32
}

fn cpu_sample(logits: &[f32], p: &SampleRow) -> u32 {
    let x = sanitize(logits);
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return 0;
    }
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return argmax(&x);
    }
    // filtered_weights
    let temperature = f64::from(p.temperature);
    let weights: Vec<f64> =
        x.iter().map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { ((l - max) / temperature).exp() }).collect();
    let floor = f64::from(p.min_p);
    let mut kept: Vec<u32> =
        (0..x.len() as u32).filter(|&id| weights[id as usize] > 0.0 && weights[id as usize] >= floor).collect();
    let mut reordered = false;
    if p.top_k > 0 && p.top_k < kept.len() {
        kept = best_ranked(&x, kept, p.top_k);
        reordered = true;
    }
    let top_p = f64::from(p.top_p);
    if top_p < 1.0 {
        if !reordered {
            kept.sort_unstable_by(|&a, &b| rank(&x, a, b));
        }
        let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
        let threshold = top_p * total;
        let (mut mass, mut len) = (0.0, 0);
        for &id in &kept {
            if len > 0 && mass >= threshold {
                break;
            }
            mass += weights[id as usize];
            len += 1;
        }
        kept.truncate(len);
        reordered = true;
    }
    if reordered {
        kept.sort_unstable();
    }
    // draw
    let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
    let target = uniform(p.seed, p.position) * total;
    let mut cumulative = 0.0;
    for &id in &kept {
        cumulative += weights[id as usize];
        if cumulative > target {
            return id;
        }
    }
    kept.last().copied().unwrap_or_else(|| argmax(&x))
}

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

// ---- V4.1-Flash: linears and activation quantisers --------------------------

#[test]
fn v41_quantized_and_plain_linears_at_5120_and_1280() {
    let _t = Timer::start("v4.1 linears");
    let gpu = test_gpu();
    let mut g = Gen(21);
    // Dense FP8 in 32 × 32 blocks, routed experts FP4 per 32 (inter 2304).
    let quantized = [
        ("wq_a fp8 1280x5120", fp8_weight(&mut g, V41_Q_LORA, V41_HIDDEN, 32), 3),
        ("wq_b fp8 4096x1280", fp8_weight(&mut g, V41_INDEX_HEADS * INDEX_HEAD_DIM, V41_Q_LORA, 32), 2),
        ("expert w1 fp4 2304x5120", fp4_weight(&mut g, 2304, V41_HIDDEN), 2),
        ("expert w2 fp4 5120x2304", fp4_weight(&mut g, V41_HIDDEN, 2304), 1),
    ];
    for (what, w, n) in &quantized {
        let x = g.bf16(n * w.cols);
        let want = act_quant::quantized_linear(w, &x, *n);
        let dw = DeviceLinear::upload(&gpu, w).unwrap();
        let (xd, od) = (gpu.upload(&x).unwrap(), gpu.upload(&vec![f32::NAN; n * w.rows]).unwrap());
        quantized_linear(&gpu, &dw, Rows::packed(&xd, w.cols), *n, Rows::packed(&od, w.rows)).unwrap();
        assert_bits(&gpu.download(&od).unwrap(), &want, &format!("quantized_linear {what}, n = {n}"));
    }
    // The plain f64 product: the compressor's projections (FP8) and the router's gate (F32, 384 experts).
    let plain = [
        ("compressor wkv fp8 512x5120", fp8_weight(&mut g, HEAD_DIM, V41_HIDDEN, 32), 3),
        ("gate f32 384x5120", Linear::from_f32(384, V41_HIDDEN, g.vec(384 * V41_HIDDEN, 0.05)), 2),
    ];
    for (what, w, n) in &plain {
        let x = g.bf16(n * w.cols);
        let mut want = vec![0.0f32; n * w.rows];
        act_quant::plain_linear(w, &x, *n, &mut want);
        let dw = DeviceLinear::upload(&gpu, w).unwrap();
        let (xd, od) = (gpu.upload(&x).unwrap(), gpu.upload(&vec![f32::NAN; n * w.rows]).unwrap());
        plain_linear(&gpu, &dw, Rows::packed(&xd, w.cols), *n, Rows::packed(&od, w.rows)).unwrap();
        assert_bits(&gpu.download(&od).unwrap(), &want, &format!("plain_linear {what}, n = {n}"));
    }
}

#[test]
fn v41_quantisers_elementwise_and_dots_at_5120_1280_and_the_kv_and_indexer_widths() {
    let _t = Timer::start("v4.1 quantisers");
    let gpu = test_gpu();
    let mut g = Gen(22);
    let n = 3;
    let x = g.bf16(n * V41_HIDDEN);
    let (values, scales) = (gpu.zeros::<f32>(n * V41_HIDDEN).unwrap(), gpu.zeros::<f32>(n * V41_HIDDEN / 32).unwrap());
    let xd = gpu.upload(&x).unwrap();
    fp8_quantize_rows(&gpu, Rows::packed(&xd, V41_HIDDEN), n, V41_HIDDEN, &values, &scales).unwrap();
    let rows: Vec<_> = x.chunks_exact(V41_HIDDEN).map(fp8_quantize_row).collect();
    let want_values: Vec<f32> = rows.iter().flat_map(|r| r.values.clone()).collect();
    let want_scales: Vec<f32> = rows.iter().flat_map(|r| r.scales.clone()).collect();
    assert_bits(&gpu.download(&values).unwrap(), &want_values, "fp8_quantize_rows 3 x 5120: values");
    assert_bits(&gpu.download(&scales).unwrap(), &want_scales, "fp8_quantize_rows 3 x 5120: scales");

    let x = g.bf16(n * V41_Q_LORA);
    let xd = gpu.upload(&x).unwrap();
    fp8_round_trip_rows(&gpu, Rows::packed(&xd, V41_Q_LORA), n, V41_Q_LORA).unwrap();
    let mut want = x.clone();
    fp8_round_trip(&mut want);
    assert_bits(&gpu.download(&xd).unwrap(), &want, "fp8_round_trip_rows 3 x 1280");

    // Compressed KV (512 in groups of 16, e4m3 scales) and the indexer's
    // queries (32 heads × 128 in groups of 32, UE8M0 scales).
    for (width, block, scale) in
        [(HEAD_DIM, 16, Fp4Scale::E4m3), (V41_INDEX_HEADS * INDEX_HEAD_DIM, 32, Fp4Scale::Ue8m0)]
    {
        let x = g.bf16(n * width);
        let xd = gpu.upload(&x).unwrap();
        fp4_round_trip_rows(&gpu, Rows::packed(&xd, width), n, width, block, scale).unwrap();
        let mut want = x.clone();
        want.chunks_exact_mut(width).for_each(|r| fp4_round_trip(r, block, scale));
        assert_bits(&gpu.download(&xd).unwrap(), &want, &format!("fp4_round_trip_rows {n} x {width} by {block}"));
    }

    let x = g.vec(n * V41_HIDDEN, 100.0);
    let xd = gpu.upload(&x).unwrap();
    round_bf16_rows(&gpu, Rows::packed(&xd, V41_HIDDEN), n, V41_HIDDEN).unwrap();
    let want: Vec<f32> = x.iter().map(|&v| round_bf16(v)).collect();
    assert_bits(&gpu.download(&xd).unwrap(), &want, "round_bf16_rows 3 x 5120");

    // The element-wise transcendentals over rows of 5120 (softplus, whose
    // log1p is the device's own, is held to glibc's in the engine's tests).
    type Cpu = fn(f32) -> f32;
    let cases: [(Unary, Cpu); 4] =
        [(Unary::Exp, v41_exp), (Unary::Sigmoid, v41_sigmoid), (Unary::Silu, v41_silu), (Unary::Rsqrt, v41_rsqrt)];
    for (op, cpu) in cases {
        let x = g.vec(n * V41_HIDDEN, 30.0);
        let xd = gpu.upload(&x).unwrap();
        map_rows(&gpu, Rows::packed(&xd, V41_HIDDEN), n, V41_HIDDEN, op).unwrap();
        let want: Vec<f32> = x.iter().map(|&v| cpu(v)).collect();
        let got = gpu.download(&xd).unwrap();
        let same = |a: f32, b: f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
        let bad = (0..want.len()).find(|&i| !same(got[i], want[i]));
        assert!(bad.is_none(), "{op:?} over 3 x 5120: element {bad:?}");
    }

    // The indexer's weights (64 tokens × 32 heads, scaled and rounded) and
    // the router's temperature over 4 tokens × 384 experts.
    let w = g.vec(64 * V41_INDEX_HEADS, 3.0);
    let wd = gpu.upload(&w).unwrap();
    let factor = ((INDEX_HEAD_DIM as f64).powf(-0.5) * (V41_INDEX_HEADS as f64).powf(-0.5)) as f32;
    v41_model::scale_round(&gpu, &wd, w.len(), factor).unwrap();
    let want: Vec<f32> = w.iter().map(|&v| round_bf16(v * factor)).collect();
    assert_bits(&gpu.download(&wd).unwrap(), &want, "scale_round 64 x 32");
    let logits = g.vec(4 * 384, 8.0);
    let ld = gpu.upload(&logits).unwrap();
    v41_model::divide(&gpu, &ld, logits.len(), 1.7).unwrap();
    let want: Vec<f32> = logits.iter().map(|&v| v / 1.7).collect();
    assert_bits(&gpu.download(&ld).unwrap(), &want, "divide 4 x 384");

    // f64 dots of 64 query heads of 512 with 512 listed keys out of 2000
    // (indices past the keys read the last), as the attention's scores.
    let (heads, keys, listed) = (HEADS, 2000usize, INDEX_TOPK);
    let q = g.bf16(heads * HEAD_DIM);
    let k = g.bf16(keys * HEAD_DIM);
    let mut index: Vec<u32> = (0..listed).map(|_| g.below(keys) as u32).collect();
    index[7] = keys as u32 + 5;
    let (qd, kd, id) = (gpu.upload(&q).unwrap(), gpu.upload(&k).unwrap(), gpu.upload(&index).unwrap());
    let (o64, o32) = (gpu.zeros::<f64>(heads * listed).unwrap(), gpu.zeros::<f32>(heads * listed).unwrap());
    let (qr, kr) = (Rows::packed(&qd, HEAD_DIM), Rows::packed(&kd, HEAD_DIM));
    dot_f64_rows(&gpu, qr, heads, kr, keys, Some(&id), listed, HEAD_DIM, Some(&o64), Some(&o32)).unwrap();
    let want: Vec<f64> = (0..heads * listed)
        .map(|at| {
            let (h, j) = (at / listed, (index[at % listed] as usize).min(keys - 1));
            act_quant::dot_f64(&q[h * HEAD_DIM..(h + 1) * HEAD_DIM], &k[j * HEAD_DIM..(j + 1) * HEAD_DIM])
        })
        .collect();
    let got64 = gpu.download(&o64).unwrap();
    assert!(got64.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "dot_f64_rows 64 x 512 listed: f64");
    let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
    assert_bits(&gpu.download(&o32).unwrap(), &want32, "dot_f64_rows 64 x 512 listed: f32");
}

// ---- V4.1-Flash: row-wise ops -------------------------------------------------
// engine/src/v41/ops.rs's `rms_norm`, `softmax`, `RopeTable` and the mHC
// functions, copied (the engine is not a dependency of this crate).

fn v41_mean_square(x: &[f32]) -> f32 {
    (x.iter().map(|&v| (v * v) as f64).sum::<f64>() / x.len() as f64) as f32
}

fn v41_sum(values: impl IntoIterator<Item = f32>) -> f32 {
    values.into_iter().map(f64::from).sum::<f64>() as f32
}

fn v41_rsqrt(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

fn v41_exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

fn v41_sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

fn v41_silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

fn v41_rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv = v41_rsqrt(v41_mean_square(x) + eps);
    for (v, w) in x.iter_mut().zip(weight) {
        *v = round_bf16(w * (*v * inv));
    }
}

fn v41_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
    let total: f64 = e.iter().sum();
    e.iter().map(|v| (v / total) as f32).collect()
}

/// `RopeTable::new(..).freqs`.
fn v41_rope_freqs(
    dim: usize,
    base: f64,
    original_seq_len: usize,
    factor: f64,
    beta_fast: f64,
    beta_slow: f64,
) -> Vec<f32> {
    let half = dim / 2;
    let mut freqs: Vec<f32> = (0..half).map(|i| 1.0 / base.powf(((2 * i) as f32 / dim as f32) as f64) as f32).collect();
    if original_seq_len > 0 {
        let corrected = |rotations: f64| {
            dim as f64 * (original_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
        };
        let low = corrected(beta_fast).floor().max(0.0);
        let high = corrected(beta_slow).ceil().min(dim as f64 - 1.0);
        let span = (high - low).max(1e-3) as f32;
        for (i, f) in freqs.iter_mut().enumerate() {
            let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
            let smooth = 1.0 - ramp;
            *f = *f / factor as f32 * (1.0 - smooth) + *f * smooth;
        }
    }
    freqs
}

/// `RopeTable::apply`.
fn v41_rope_apply(freqs: &[f32], x: &mut [f32], position: usize, inverse: bool) {
    for (pair, &f) in x.chunks_exact_mut(2).zip(freqs) {
        let angle = (position as f32 * f) as f64;
        let (c, s) = (angle.cos() as f32, angle.sin() as f32);
        let s = if inverse { -s } else { s };
        let (a, b, c, s) = (pair[0] as f64, pair[1] as f64, c as f64, s as f64);
        pair[0] = round_bf16((a * c - b * s) as f32);
        pair[1] = round_bf16((a * s + b * c) as f32);
    }
}

#[test]
fn v41_rms_norm_softmax_and_rope_at_real_widths() {
    let _t = Timer::start("v4.1 rows");
    let gpu = test_gpu();
    let mut g = Gen(23);
    for (n, dim) in [(4, V41_HIDDEN), (4, V41_Q_LORA), (2 * HEADS, HEAD_DIM), (3, HEAD_DIM), (2 * 32, INDEX_HEAD_DIM)] {
        let x = g.bf16(n * dim);
        let w: Vec<f32> = g.bf16(dim).iter().map(|v| 1.0 + v).collect();
        let stride = dim + 9;
        let mut padded = vec![0.5f32; n * stride];
        for r in 0..n {
            padded[r * stride..][..dim].copy_from_slice(&x[r * dim..][..dim]);
        }
        let (d, wd) = (gpu.upload(&padded).unwrap(), gpu.upload(&w).unwrap());
        v41::rms_norm_rows(&gpu, Rows::new(&d, 0, stride), n, dim, &wd, 1e-6).unwrap();
        let mut want = x.clone();
        want.chunks_exact_mut(dim).for_each(|r| v41_rms_norm(r, &w, 1e-6));
        let got = gpu.download(&d).unwrap();
        let got: Vec<f32> = (0..n).flat_map(|r| got[r * stride..][..dim].to_vec()).collect();
        assert_bits(&got, &want, &format!("v4.1 rms_norm {n} x {dim}"));
    }
    // The router's softmax over 384 experts, the compressor's over its 2 slots.
    for (n, width) in [(4, 384), (3, 2)] {
        let x = g.vec(n * width, 6.0);
        let d = gpu.upload(&x).unwrap();
        softmax_rows(&gpu, Rows::packed(&d, width), n, width).unwrap();
        let want: Vec<f32> = x.chunks_exact(width).flat_map(v41_softmax).collect();
        assert_bits(&gpu.download(&d).unwrap(), &want, &format!("v4.1 softmax {n} x {width}"));
    }
    // Queries of 64 heads × 512 rotated on their last 64 channels, the
    // indexer's 32 × 128, compressed entries of ratio 2, listed positions.
    let freqs = v41_rope_freqs(ROPE_DIM, 160000.0, 65536, 16.0, 32.0, 1.0);
    let positions = 70_000;
    let rope = DeviceRope::new(&gpu, &freqs, positions).unwrap();
    for (n, heads, hd, first, step) in [
        (3, HEADS, HEAD_DIM, 65_530usize, 1usize),
        (2, V41_INDEX_HEADS, INDEX_HEAD_DIM, 69_998, 1),
        (4, 1, HEAD_DIM, 2 * 30_000, 2),
    ] {
        let x = g.bf16(n * heads * hd);
        for inverse in [false, true] {
            let d = gpu.upload(&x).unwrap();
            let at = RopePositions::Affine { first, step };
            v41::rope_rows(&gpu, &rope, Rows::packed(&d, heads * hd), n, heads, hd, hd - ROPE_DIM, at, inverse)
                .unwrap();
            let mut want = x.clone();
            for (t, row) in want.chunks_exact_mut(heads * hd).enumerate() {
                for head in row.chunks_exact_mut(hd) {
                    v41_rope_apply(&freqs, &mut head[hd - ROPE_DIM..], first + t * step, inverse);
                }
            }
            let what = format!("v4.1 rope {n} x {heads} x {hd} from {first} inverse {inverse}");
            assert_bits(&gpu.download(&d).unwrap(), &want, &what);
        }
    }
    let listed: Vec<u32> = vec![69_999, 0, 12_345, 65_536];
    let pd = gpu.upload(&listed).unwrap();
    let x = g.bf16(listed.len() * HEAD_DIM);
    let d = gpu.upload(&x).unwrap();
    let at = RopePositions::Each(&pd);
    v41::rope_rows(&gpu, &rope, Rows::packed(&d, HEAD_DIM), listed.len(), 1, HEAD_DIM, HEAD_DIM - ROPE_DIM, at, true)
        .unwrap();
    let mut want = x.clone();
    for (e, &p) in want.chunks_exact_mut(HEAD_DIM).zip(&listed) {
        v41_rope_apply(&freqs, &mut e[HEAD_DIM - ROPE_DIM..], p as usize, true);
    }
    assert_bits(&gpu.download(&d).unwrap(), &want, "v4.1 rope at listed positions");
}

// ---- V4.1-Flash: mHC and Engram ----------------------------------------------

struct V41Mix {
    pre: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
}

/// `ops::hc_mixes` (with `dot_f64_rows` of the mix rows).
fn v41_hc_mixes(streams: &[f32], mix: &[f32], scale: &[f32; 3], base: &[f32], hc: usize, eps: f32) -> V41Mix {
    let inv = v41_rsqrt(v41_mean_square(streams) + eps);
    let mut sums = vec![0.0f64; mix.len() / streams.len()];
    act_quant::dot_f64_rows(streams, mix, &mut sums);
    let m: Vec<f32> = sums.iter().map(|&s| s as f32 * inv).collect();
    let pre = (0..hc).map(|j| v41_sigmoid(m[j] * scale[0] + base[j]) + eps).collect();
    let post = (0..hc).map(|j| 2.0 * v41_sigmoid(m[hc + j] * scale[1] + base[hc + j])).collect();
    let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k]).collect();
    for row in comb.chunks_exact_mut(hc) {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        row.iter_mut().for_each(|v| *v = v41_exp(*v - max));
        let total = v41_sum(row.iter().copied());
        row.iter_mut().for_each(|v| *v = *v / total + eps);
    }
    let columns = |comb: &mut [f32]| {
        for j in 0..hc {
            let total = v41_sum((0..hc).map(|i| comb[i * hc + j])) + eps;
            (0..hc).for_each(|i| comb[i * hc + j] /= total);
        }
    };
    columns(&mut comb);
    for _ in 1..SINKHORN_ITERS {
        for row in comb.chunks_exact_mut(hc) {
            let total = v41_sum(row.iter().copied()) + eps;
            row.iter_mut().for_each(|v| *v /= total);
        }
        columns(&mut comb);
    }
    V41Mix { pre, post, comb }
}

#[test]
fn v41_mhc_hc_4_of_5120_and_engram() {
    let _t = Timer::start("v4.1 mHC and Engram");
    let gpu = test_gpu();
    let mut g = Gen(24);
    let (n, hc, d, eps) = (2, HC, V41_HIDDEN, 1e-6f32);
    let mixes = (2 + hc) * hc;
    let streams = g.bf16(n * hc * d);
    let mix: Vec<f32> = g.vec(mixes * hc * d, 0.02);
    let base = g.vec(mixes, 1.0);
    let scale = [0.7f32, 1.1, 0.9];
    // The mixing products on the device (`dot_f64_rows` rounded once), then the mixes.
    let (sd, md) = (gpu.upload(&streams).unwrap(), gpu.upload(&mix).unwrap());
    let raw = gpu.zeros::<f32>(n * mixes).unwrap();
    dot_f64_rows(
        &gpu,
        Rows::packed(&sd, hc * d),
        n,
        Rows::packed(&md, hc * d),
        mixes,
        None,
        mixes,
        hc * d,
        None,
        Some(&raw),
    )
    .unwrap();
    let want_raw: Vec<f32> = streams
        .chunks_exact(hc * d)
        .flat_map(|s| mix.chunks_exact(hc * d).map(|m| act_quant::dot_f64(s, m) as f32).collect::<Vec<_>>())
        .collect();
    assert_bits(&gpu.download(&raw).unwrap(), &want_raw, "mixing products (dot_f64_rows over 20480)");
    let shape = MixShape { hc, dim: d, iters: SINKHORN_ITERS, norm_eps: eps, hc_eps: eps, scale };
    let bd = gpu.upload(&base).unwrap();
    let (pre, post, comb) =
        (gpu.zeros::<f32>(n * hc).unwrap(), gpu.zeros::<f32>(n * hc).unwrap(), gpu.zeros::<f32>(n * hc * hc).unwrap());
    hc_mixes(&gpu, &raw, &sd, n, shape, &bd, &pre, &post, &comb).unwrap();
    let want: Vec<V41Mix> =
        streams.chunks_exact(hc * d).map(|s| v41_hc_mixes(s, &mix, &scale, &base, hc, eps)).collect();
    let flat = |f: fn(&V41Mix) -> &Vec<f32>| want.iter().flat_map(|m| f(m).clone()).collect::<Vec<f32>>();
    assert_bits(&gpu.download(&pre).unwrap(), &flat(|m| &m.pre), "hc_mixes pre");
    assert_bits(&gpu.download(&post).unwrap(), &flat(|m| &m.post), "hc_mixes post");
    assert_bits(&gpu.download(&comb).unwrap(), &flat(|m| &m.comb), "hc_mixes comb");

    // hc_pre: bf16(Σ_i f64(pre[i] · stream i)).
    let out = gpu.zeros::<f32>(n * d).unwrap();
    hc_pre(&gpu, &sd, &pre, n, hc, d, &out).unwrap();
    let mut want_pre = vec![0.0f32; n * d];
    for (t, o) in want_pre.chunks_exact_mut(d).enumerate() {
        let s = &streams[t * hc * d..(t + 1) * hc * d];
        for (c, o) in o.iter_mut().enumerate() {
            *o = round_bf16(v41_sum(want[t].pre.iter().enumerate().map(|(i, &p)| p * s[i * d + c])));
        }
    }
    assert_bits(&gpu.download(&out).unwrap(), &want_pre, "hc_pre");

    // hc_post: streams[j] ← bf16(post[j] · output + Σ_i comb[i][j] · residual[i]).
    let output = g.bf16(n * d);
    let od = gpu.upload(&output).unwrap();
    hc_post(&gpu, &sd, &od, &post, &comb, n, hc, d).unwrap();
    let mut want_streams = streams.clone();
    for (t, s) in want_streams.chunks_exact_mut(hc * d).enumerate() {
        let residual = s.to_vec();
        let mix = &want[t];
        for j in 0..hc {
            for c in 0..d {
                let mixed = v41_sum((0..hc).map(|i| mix.comb[i * hc + j] * residual[i * d + c]));
                s[j * d + c] = round_bf16(mix.post[j] * output[t * d + c] + mixed);
            }
        }
    }
    assert_bits(&gpu.download(&sd).unwrap(), &want_streams, "hc_post");

    // Engram: rows of a 100003 × 256 FP8 table (ids past it read the last),
    // then each stream's gate against its key and the value added.
    let (rows, dim) = (100_003usize, 256usize);
    let mut values = g.bytes(rows * dim);
    values.iter_mut().filter(|c| **c & 0x7f == 0x7f).for_each(|c| *c &= 0xfe);
    let scales: Vec<u8> = (0..rows * dim / 32).map(|_| 118 + g.below(12) as u8).collect();
    let table = DeviceEngramTable::upload(&gpu, rows, dim, &values, &scales).unwrap();
    let ids: Vec<u32> = vec![0, 99_999, rows as u32 - 1, rows as u32, u32::MAX, 31_337, 8];
    let idd = gpu.upload(&ids).unwrap();
    let looked_up = gpu.zeros::<f32>(ids.len() * dim).unwrap();
    engram_gather(&gpu, &table, &idd, ids.len(), &looked_up).unwrap();
    let want_rows: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            let r = (id as usize).min(rows - 1);
            (0..dim).map(move |c| (r, c))
        })
        .map(|(r, c)| round_bf16(fp8_e4m3_to_f32(values[r * dim + c]) * ue8m0_to_f32(scales[(r * dim + c) / 32])))
        .collect();
    assert_bits(&gpu.download(&looked_up).unwrap(), &want_rows, "engram_gather");

    let kv = g.bf16(n * (hc + 1) * d);
    let weight: Vec<f32> = g.bf16(hc * d).iter().map(|v| 1.0 + 0.1 * v).collect();
    let (kvd, wd) = (gpu.upload(&kv).unwrap(), gpu.upload(&weight).unwrap());
    let mut want_streams2 = want_streams.clone();
    for t in 0..n {
        let kv_t = &kv[t * (hc + 1) * d..(t + 1) * (hc + 1) * d];
        let value = &kv_t[hc * d..];
        for k in 0..hc {
            let s = &mut want_streams2[(t * hc + k) * d..(t * hc + k + 1) * d];
            // engram::gate
            let key = &kv_t[k * d..(k + 1) * d];
            let w = &weight[k * d..(k + 1) * d];
            let rstd = v41_rsqrt(v41_mean_square(s) + eps) * v41_rsqrt(v41_mean_square(key) + eps);
            let dot = v41_sum(s.iter().zip(w).zip(key).map(|((h, w), k)| h * w * k));
            let dot = dot * rstd * (d as f64).powf(-0.5) as f32;
            let gate = v41_sigmoid(dot.abs().max(1e-6).sqrt().copysign(dot));
            s.iter_mut().zip(value).for_each(|(h, v)| *h = round_bf16(*h + gate * v));
        }
    }
    engram_gate(&gpu, &sd, &kvd, &wd, n, hc, d, eps).unwrap();
    assert_bits(&gpu.download(&sd).unwrap(), &want_streams2, "engram_gate");
}

// ---- V4.1-Flash: compressor, indexer, attention -------------------------------

#[test]
fn v41_compressor_pool_of_ratio_2_at_512() {
    let _t = Timer::start("v4.1 compressor");
    let gpu = test_gpu();
    let mut g = Gen(25);
    let (groups, ratio, hd) = (3, 2, HEAD_DIM);
    let kv = g.vec(groups * ratio * hd, 2.0);
    let score = g.vec(groups * ratio * hd, 6.0);
    let (kd, sd, out) = (gpu.upload(&kv).unwrap(), gpu.upload(&score).unwrap(), gpu.zeros::<f32>(groups * hd).unwrap());
    compress_pool(&gpu, &kd, &sd, groups, ratio, hd, &out).unwrap();
    // attention::compress's pooling of one closed group.
    let mut want = vec![0.0f32; groups * hd];
    for gi in 0..groups {
        for ch in 0..hd {
            let s: Vec<f32> = (0..ratio).map(|i| score[(gi * ratio + i) * hd + ch]).collect();
            let w = v41_softmax(&s);
            want[gi * hd + ch] = round_bf16(v41_sum((0..ratio).map(|i| kv[(gi * ratio + i) * hd + ch] * w[i])));
        }
    }
    assert_bits(&gpu.download(&out).unwrap(), &want, "compress_pool ratio 2 x 512");
}

/// `ops::top_k_stable`.
fn top_k_stable(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (values[a], values[b]);
        y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// `attention::candidate_blocks` (block size 8, the top 2048 blocks).
fn candidate_blocks_cpu(scores: &[f32], visible: usize, size: usize, topk_blocks: usize) -> Vec<bool> {
    let blocks = scores.len().div_ceil(size);
    let mut best: Vec<f32> = (0..blocks)
        .map(|b| scores[b * size..((b + 1) * size).min(scores.len())].iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s)))
        .collect();
    if visible > 0 {
        best[(visible - 1) / size] = f32::INFINITY;
    }
    let mut keep = vec![false; scores.len()];
    for b in top_k_stable(&best, topk_blocks.min(blocks)) {
        if best[b] > f32::NEG_INFINITY {
            keep[b * size..((b + 1) * size).min(scores.len())].iter_mut().for_each(|k| *k = true);
        }
    }
    keep
}

/// `attention::choose`'s score of every entry for one query (before the candidates' mask).
fn v41_index_scores_cpu(
    keys: &[f32],
    q: &[f32],
    w: &[f32],
    ih: usize,
    ihd: usize,
    width: usize,
    visible: usize,
) -> Vec<f32> {
    (0..width)
        .map(|j| {
            if j >= visible {
                return f32::NEG_INFINITY;
            }
            let mut dots = vec![0.0f64; ih];
            act_quant::dot_f64_rows(&keys[j * ihd..(j + 1) * ihd], q, &mut dots);
            round_bf16(v41_sum((0..ih).map(|h| round_bf16(round_bf16(dots[h] as f32).max(0.0) * w[h]))))
        })
        .collect()
}

#[test]
fn v41_indexer_32_heads_of_128_top_512_with_2048_candidate_blocks() {
    let _t = Timer::start("v4.1 indexer");
    let gpu = test_gpu();
    let mut g = Gen(26);
    let (ih, ihd, topk, size, topk_blocks) = (V41_INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK, 8, 2048);
    // Keys on a coarse grid so that scores tie; 20001 entries = 2501 blocks
    // of 8, more than the 2048 candidate blocks kept.
    let entries = 20_001;
    let keys: Vec<f32> = (0..entries * ihd).map(|_| round_bf16((g.below(9) as f32 - 4.0) * 0.25)).collect();
    let kd = gpu.upload(&keys).unwrap();
    let (ratio, start, len) = (1usize, 19_999usize, 2usize);
    let span = IndexSpan { start, len, ratio };
    let stride = span.max_width();
    let q = g.bf16(len * ih * ihd);
    let w: Vec<f32> = g.vec(len * ih, 0.1).iter().map(|&v| round_bf16(v)).collect();
    let (qd, wd) = (gpu.upload(&q).unwrap(), gpu.upload(&w).unwrap());
    // The candidate source: its scores, then the blocks it keeps.
    let scores = gpu.upload(&vec![f32::NAN; len * stride]).unwrap();
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, None, &scores, stride).unwrap();
    let got_scores = gpu.download(&scores).unwrap();
    let cands = candidate_blocks(&gpu, &scores, stride, span, size, topk_blocks).unwrap();
    let (mask, mask_len) = (gpu.download(&cands.keep).unwrap(), gpu.download(&cands.keep_len).unwrap());
    let mut keeps = Vec::new();
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let want = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        assert_bits(&got_scores[t * stride..][..width], &want, &format!("index scores of query {t}"));
        let keep = candidate_blocks_cpu(&want, visible, size, topk_blocks);
        assert!(keep.iter().filter(|&&k| !k).count() > 0, "some blocks are not candidates");
        assert_eq!(mask_len[t] as usize, width);
        let got: Vec<bool> = mask[t * cands.stride..][..width].iter().map(|&k| k != 0).collect();
        assert_eq!(got, keep, "candidate blocks of query {t}");
        keeps.push(keep);
    }
    // A consumer at the same span (new queries): scores masked by the
    // candidates, then the top 512, ascending.
    let q = g.bf16(len * ih * ihd);
    let w: Vec<f32> = g.vec(len * ih, 0.1).iter().map(|&v| round_bf16(v)).collect();
    let (qd, wd) = (gpu.upload(&q).unwrap(), gpu.upload(&w).unwrap());
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, Some(&cands), &scores, stride).unwrap();
    let (selected, counts) = (gpu.zeros::<i32>(len * topk).unwrap(), gpu.zeros::<i32>(len).unwrap());
    v41_model::index_topk(&gpu, &scores, stride, span, topk, &selected, &counts).unwrap();
    let (selected, counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let mut scores = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        scores.iter_mut().zip(&keeps[t]).filter(|(_, &k)| !k).for_each(|(s, _)| *s = f32::NEG_INFINITY);
        let mut want: Vec<usize> =
            top_k_stable(&scores, topk.min(width)).into_iter().filter(|&j| j < visible).collect();
        want.sort_unstable();
        let got: Vec<usize> = selected[t * topk..][..counts[t] as usize].iter().map(|&j| j as usize).collect();
        assert_eq!(got, want, "consumer top {topk} of query {t}");
    }
    // An encoder layer (ratio 2): 1000 and 1001 entries, the top 512.
    let (ratio, start) = (2usize, 1999usize);
    let span = IndexSpan { start, len, ratio };
    let stride = span.max_width();
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, None, &scores, stride).unwrap();
    let (selected, counts) = (gpu.zeros::<i32>(len * topk).unwrap(), gpu.zeros::<i32>(len).unwrap());
    v41_model::index_topk(&gpu, &scores, stride, span, topk, &selected, &counts).unwrap();
    let (selected, counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let scores = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        let mut want: Vec<usize> =
            top_k_stable(&scores, topk.min(width)).into_iter().filter(|&j| j < visible).collect();
        want.sort_unstable();
        let got: Vec<usize> = selected[t * topk..][..counts[t] as usize].iter().map(|&j| j as usize).collect();
        assert_eq!(got, want, "ratio 2 top {topk} of query {t}");
    }
}

/// `ops::sparse_attention` of one query (heads one after another).
fn v41_sparse_attention_cpu(q: &[f32], keys: &[Option<&[f32]>], sink: &[f32], scale: f32, out: &mut [f32]) {
    let d = q.len() / sink.len();
    for (h, out) in out.chunks_mut(d).enumerate() {
        let qh = &q[h * d..(h + 1) * d];
        let mut acc = vec![0.0f32; d];
        let mut sum_exp = 0.0f32;
        let mut max = -1e30f32;
        for block in keys.chunks(64) {
            let filled: Vec<&[f32]> = block.iter().flatten().copied().collect();
            let mut dots = vec![0.0f64; filled.len()];
            act_quant::dot_f64_each(qh, &filled, &mut dots);
            let mut dots = dots.iter();
            let scores: Vec<f32> =
                block.iter().map(|k| k.map_or(f32::NEG_INFINITY, |_| *dots.next().unwrap() as f32 * scale)).collect();
            let new_max = scores.iter().fold(max, |a, &b| a.max(b));
            let rescale = v41_exp(max - new_max);
            max = new_max;
            let p: Vec<f32> = scores.iter().map(|s| v41_exp(s - max)).collect();
            sum_exp = sum_exp * rescale + v41_sum(p.iter().copied());
            let weights: Vec<f64> =
                block.iter().zip(&p).filter(|(k, _)| k.is_some()).map(|(_, &pk)| round_bf16(pk) as f64).collect();
            let mut weighted = vec![0.0f64; d];
            kops::add_weighted_rows_f64(&mut weighted, &weights, &filled);
            acc.iter_mut().zip(&weighted).for_each(|(a, &w)| *a = *a * rescale + w as f32);
        }
        sum_exp += v41_exp(sink[h] - max);
        for (o, a) in out.iter_mut().zip(&acc) {
            *o = round_bf16(a / sum_exp);
        }
    }
}

#[test]
fn v41_sparse_attention_64_heads_of_512_over_a_128_window_and_512_entries() {
    let _t = Timer::start("v4.1 attention");
    let gpu = test_gpu();
    let mut g = Gen(27);
    let (heads, hd) = (HEADS, HEAD_DIM);
    let scale = (hd as f64).powf(-0.5) as f32;
    let sink = g.vec(heads, 2.0);
    let sd = gpu.upload(&sink).unwrap();
    let n_entries = 2000;
    let entries = g.bf16(n_entries * hd);
    let ed = gpu.upload(&entries).unwrap();
    // (start, len, chosen per query): a decode step deep in a sequence with
    // 512 entries each, and a chunk that starts the sequence with none.
    for (start, len, chosen) in [(2000usize, 2usize, INDEX_TOPK), (0, 3, 0)] {
        let base = start.saturating_sub(WINDOW);
        let rows = start + len - base;
        let window_keys = g.bf16(rows * hd);
        let q = g.bf16(len * heads * hd);
        let selection: Vec<Vec<usize>> = (0..len)
            .map(|_| {
                let mut s: Vec<usize> = Vec::new();
                while s.len() < chosen {
                    let j = g.below(n_entries);
                    if !s.contains(&j) {
                        s.push(j);
                    }
                }
                s.sort_unstable();
                s
            })
            .collect();
        let mut want = vec![0.0f32; len * heads * hd];
        for t in 0..len {
            // attention::attend_projected's key list.
            let p = start + t;
            let oldest = (p + 1).saturating_sub(WINDOW);
            let row = |pos: usize| Some(&window_keys[(pos - base) * hd..(pos - base + 1) * hd]);
            let mut keys: Vec<Option<&[f32]>> = Vec::new();
            if start == 0 {
                keys.extend((oldest..=p).map(row));
                keys.resize(len.min(WINDOW), None);
            } else {
                keys.resize(WINDOW - (p + 1 - oldest), None);
                keys.extend((oldest..=p).map(row));
            }
            keys.extend(selection[t].iter().map(|&j| Some(&entries[j * hd..(j + 1) * hd])));
            v41_sparse_attention_cpu(
                &q[t * heads * hd..(t + 1) * heads * hd],
                &keys,
                &sink,
                scale,
                &mut want[t * heads * hd..(t + 1) * heads * hd],
            );
        }
        let (qd, kd) = (gpu.upload(&q).unwrap(), gpu.upload(&window_keys).unwrap());
        let stride = chosen.max(1);
        let mut sel = vec![-1i32; len * stride];
        for (t, s) in selection.iter().enumerate() {
            for (i, &j) in s.iter().enumerate() {
                sel[t * stride + i] = j as i32;
            }
        }
        let (seld, cd) = (gpu.upload(&sel).unwrap(), gpu.upload(&vec![chosen as i32; len]).unwrap());
        let out = gpu.upload(&vec![f32::NAN; len * heads * hd]).unwrap();
        let window = Window { keys: &kd, base, start, len, win: WINDOW };
        let chosen_entries = (chosen > 0).then_some(Chosen { entries: &ed, selected: &seld, counts: &cd, stride });
        sparse_attention(&gpu, &qd, heads, hd, window, chosen_entries, &sd, scale, &out).unwrap();
        assert_bits(
            &gpu.download(&out).unwrap(),
            &want,
            &format!("sparse_attention at {start} x {len}, {chosen} chosen"),
        );
    }
}

// ---- V4.1-Flash: MoE ---------------------------------------------------------

/// `ffn::route` after the score function (`sqrt`: SqrtSoftplus's square root).
fn v41_route_cpu(scores: &[f32], bias: &[f32], k: usize, sqrt: bool, scale: f32) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = scores.iter().map(|&s| if sqrt { s.sqrt() } else { s }).collect();
    let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let experts = top_k_stable(&biased, k);
    let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
    if k > 1 {
        let sum = v41_sum(weights.iter().copied()) + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= scale);
    (experts, weights)
}

#[test]
fn v41_moe_route_384_top_6_and_dspark_128_top_3_swiglu_2304_combine_5120() {
    let _t = Timer::start("v4.1 MoE");
    let gpu = test_gpu();
    let mut g = Gen(28);
    let n = 4;
    // 384 routed experts top-6 (the main model), 128 top-3 (DSpark's draft layers).
    for (e, k) in [(384usize, 6usize), (128, 3)] {
        // Softplus outputs on a coarse grid (ties), their square roots the scores.
        let raw: Vec<f32> = (0..n * e).map(|_| (1 + g.below(12)) as f32 * 0.125).collect();
        let bias: Vec<f32> = (0..e).map(|_| g.below(4) as f32 * 0.03125).collect();
        let (s, b) = (gpu.upload(&raw).unwrap(), gpu.upload(&bias).unwrap());
        let (experts, weights) = (gpu.zeros::<i32>(n * k).unwrap(), gpu.zeros::<f32>(n * k).unwrap());
        v41_model::route(&gpu, &s, &b, n, e, k, ScoreSqrt::Yes, true, 1.5, &experts, &weights).unwrap();
        let (experts, weights) = (gpu.download(&experts).unwrap(), gpu.download(&weights).unwrap());
        for t in 0..n {
            let (want_e, want_w) = v41_route_cpu(&raw[t * e..(t + 1) * e], &bias, k, true, 1.5);
            let got_e: Vec<usize> = experts[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
            assert_eq!(got_e, want_e, "{e} experts top {k}: token {t}");
            assert_bits(&weights[t * k..(t + 1) * k], &want_w, &format!("{e} experts top {k}: token {t}'s weights"));
        }
    }
    // The routed rows' activation: 6 rows of 2304, clamped at 10, weighted.
    let (rows, inter, limit) = (6, 2304, 10.0f32);
    let gate = g.vec(rows * inter, 30.0);
    let up = g.vec(rows * inter, 30.0);
    let w = g.vec(rows, 1.0);
    let (gd, ud, wd) = (gpu.upload(&gate).unwrap(), gpu.upload(&up).unwrap(), gpu.upload(&w).unwrap());
    swiglu(&gpu, &gd, &ud, Some(&wd), rows, inter, limit).unwrap();
    let want: Vec<f32> = (0..rows * inter)
        .map(|i| round_bf16(w[i / inter] * (v41_silu(gate[i].min(limit)) * up[i].clamp(-limit, limit))))
        .collect();
    assert_bits(&gpu.download(&gd).unwrap(), &want, "swiglu 6 x 2304");
    // combine: 2 tokens × 6 slots of 5120, then the shared expert.
    let (n, k, d) = (2, 6, V41_HIDDEN);
    let mut experts: Vec<i32> = (0..n * k).map(|_| g.below(384) as i32).collect();
    experts[2] = experts[4];
    let routed = g.bf16(n * k * d);
    let shared = g.bf16(n * d);
    let (rd, ed, sd) = (gpu.upload(&routed).unwrap(), gpu.upload(&experts).unwrap(), gpu.upload(&shared).unwrap());
    let out = gpu.zeros::<f32>(n * d).unwrap();
    moe_combine(&gpu, &rd, &ed, &sd, n, k, d, &out).unwrap();
    let mut want = vec![0.0f32; n * d];
    for (t, row) in want.chunks_exact_mut(d).enumerate() {
        let mut order: Vec<usize> = (0..k).collect();
        order.sort_by_key(|&slot| (experts[t * k + slot], slot));
        for slot in order {
            row.iter_mut().zip(&routed[(t * k + slot) * d..][..d]).for_each(|(a, b)| *a += b);
        }
        row.iter_mut().zip(&shared[t * d..(t + 1) * d]).for_each(|(a, b)| *a = round_bf16(*a + b));
    }
    assert_bits(&gpu.download(&out).unwrap(), &want, "moe_combine 2 x 6 x 5120");
}
