//! The mHC hyper-connection kernels (`hyper.cu`) and the element-wise ones
//! (`elementwise.cu`) on the emulated device against the CPU, bit for bit.
//!
//! The engine's `model::hyper::{pre, post, head}` are crate-private (and
//! take the engine's weight structs), so this file holds faithful copies of
//! them (`cpu_pre`, `cpu_post`, `cpu_head`), calling the same public
//! `deepinfer_kernels::ops` functions in the same order. They start, as the
//! kernels do, from the raw product `mix.forward(streams)` (the linear
//! kernel's), which `normed_mix` then scales by each token's `inv_rms`.

use deepinfer_cuda::ops::elementwise::{add_rows, add_scaled_rows, rope_rows, scale_rows, swiglu_clamped};
use deepinfer_cuda::ops::hyper::{hyper_head, hyper_post, hyper_pre};
use deepinfer_cuda::ops::Rows;
use deepinfer_kernels::ops::{self, add_scaled, inv_rms, mix_streams, sigmoid, sinkhorn, softmax, Rope};

/// A small deterministic generator: values in [lo, hi).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32) / (1u64 << 24) as f32
    }
    fn vec(&mut self, len: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..len).map(|_| lo + (hi - lo) * self.next()).collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn assert_bits(got: &[f32], expect: &[f32], what: &str) {
    assert_eq!(got.len(), expect.len(), "{what}: lengths");
    if bits(got) != bits(expect) {
        let i = (0..got.len()).find(|&i| got[i].to_bits() != expect[i].to_bits()).unwrap();
        panic!("{what}: first difference at {i}: got {} expected {}", got[i], expect[i]);
    }
}

// ---- Faithful copies of engine/src/model/hyper.rs (crate-private there) ----

struct Mix {
    post: Vec<f32>,
    comb: Vec<f32>,
}

/// `normed_mix` after `mix.forward`: each token's outputs times its `1/rms`.
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
fn cpu_pre(
    raw: &[f32],
    streams: &[f32],
    n: usize,
    hc: usize,
    d: usize,
    scale: [f32; 3],
    base: &[f32],
    hc_eps: f32,
    rms_eps: f32,
    iters: usize,
) -> (Vec<Mix>, Vec<f32>) {
    let outputs = (2 + hc) * hc;
    let mixes = cpu_normed_mix(raw, outputs, streams, n, hc * d, rms_eps);
    let mut collapsed = vec![0.0f32; n * d];
    let token = |t: usize, collapsed: &mut [f32]| {
        let m = &mixes[t * outputs..(t + 1) * outputs];
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(m[j] * scale[0] + base[j]) + hc_eps).collect();
        let post: Vec<f32> = (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] * scale[1] + base[hc + j])).collect();
        let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k]).collect();
        for row in comb.chunks_exact_mut(hc) {
            softmax(row);
            row.iter_mut().for_each(|v| *v += hc_eps);
        }
        sinkhorn(&mut comb, hc, iters, hc_eps);
        cpu_collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], collapsed);
        Mix { post, comb }
    };
    let out = collapsed.chunks_exact_mut(d).enumerate().map(|(t, row)| token(t, row)).collect();
    (out, collapsed)
}

fn cpu_post(mixes: &[Mix], hc: usize, d: usize, output: &[f32], streams: &mut [f32]) {
    for (t, (mix, s)) in mixes.iter().zip(streams.chunks_exact_mut(hc * d)).enumerate() {
        mix_streams(s, &output[t * d..(t + 1) * d], &mix.post[..hc], &mix.comb[..hc * hc]);
    }
}

#[allow(clippy::too_many_arguments)]
fn cpu_head(
    raw: &[f32],
    streams: &[f32],
    n: usize,
    hc: usize,
    d: usize,
    scale: f32,
    base: &[f32],
    hc_eps: f32,
    rms_eps: f32,
) -> Vec<f32> {
    let mixes = cpu_normed_mix(raw, hc, streams, n, hc * d, rms_eps);
    let mut out = vec![0.0f32; n * d];
    for t in 0..n {
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(mixes[t * hc + j] * scale + base[j]) + hc_eps).collect();
        cpu_collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], &mut out[t * d..(t + 1) * d]);
    }
    out
}

// ---- Tests ----

const HC_EPS: f32 = 1e-6;
const RMS_EPS: f32 = 1e-6;

#[test]
fn hyper_pre_post_and_head_match_the_engine_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Lcg(7);
    for hc in [2usize, 3, 4] {
        for d in [16usize, 64, 100] {
            for n in [1usize, 5] {
                for iters in [10usize, 20] {
                    let what = format!("hc {hc} d {d} n {n} iters {iters}");
                    let outputs = (2 + hc) * hc;
                    let streams = g.vec(n * hc * d, -3.0, 3.0);
                    // Raw products of a linear over hc·d inputs: sizeable values.
                    let raw = g.vec(n * outputs, -20.0, 20.0);
                    let base = g.vec(outputs, -1.0, 1.0);
                    let scale = [0.5 + g.next(), 0.5 + g.next(), 0.5 + g.next()];
                    let (mixes, collapsed) = cpu_pre(&raw, &streams, n, hc, d, scale, &base, HC_EPS, RMS_EPS, iters);

                    let raw_d = gpu.upload(&raw).unwrap();
                    let streams_d = gpu.upload(&streams).unwrap();
                    let base_d = gpu.upload(&base).unwrap();
                    let post_d = gpu.zeros::<f32>(n * hc).unwrap();
                    let comb_d = gpu.zeros::<f32>(n * hc * hc).unwrap();
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
                        HC_EPS,
                        RMS_EPS,
                        iters,
                        &post_d,
                        &comb_d,
                        &collapsed_d,
                    )
                    .unwrap();
                    let post: Vec<f32> = mixes.iter().flat_map(|m| m.post.clone()).collect();
                    let comb: Vec<f32> = mixes.iter().flat_map(|m| m.comb.clone()).collect();
                    assert_bits(&gpu.download(&post_d).unwrap(), &post, &format!("pre post {what}"));
                    assert_bits(&gpu.download(&comb_d).unwrap(), &comb, &format!("pre comb {what}"));
                    assert_bits(&gpu.download(&collapsed_d).unwrap(), &collapsed, &format!("pre collapsed {what}"));

                    // post: the sublayer's output mixed back into the streams.
                    let output = g.vec(n * d, -2.0, 2.0);
                    let mut expect = streams.clone();
                    cpu_post(&mixes, hc, d, &output, &mut expect);
                    let output_d = gpu.upload(&output).unwrap();
                    hyper_post(&gpu, &post_d, &comb_d, &output_d, &streams_d, n, hc, d).unwrap();
                    assert_bits(&gpu.download(&streams_d).unwrap(), &expect, &format!("post {what}"));

                    // head: its own hc mixes of the (new) streams.
                    let raw_head = g.vec(n * hc, -20.0, 20.0);
                    let base_head = g.vec(hc, -1.0, 1.0);
                    let scale_head = 0.5 + g.next();
                    let expect = cpu_head(&raw_head, &expect, n, hc, d, scale_head, &base_head, HC_EPS, RMS_EPS);
                    let raw_head_d = gpu.upload(&raw_head).unwrap();
                    let base_head_d = gpu.upload(&base_head).unwrap();
                    let out_d = gpu.zeros::<f32>(n * d).unwrap();
                    hyper_head(
                        &gpu,
                        &raw_head_d,
                        &streams_d,
                        n,
                        hc,
                        d,
                        scale_head,
                        &base_head_d,
                        HC_EPS,
                        RMS_EPS,
                        &out_d,
                    )
                    .unwrap();
                    assert_bits(&gpu.download(&out_d).unwrap(), &expect, &format!("head {what}"));
                }
            }
        }
    }
}

#[test]
fn hyper_post_covers_columns_past_one_block() {
    // d above the 128 columns of one block, with a tail.
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Lcg(11);
    for (hc, d, n) in [(4usize, 300usize, 3usize), (3, 129, 2), (1, 7, 1)] {
        let post = g.vec(n * hc, 0.0, 2.0);
        let comb = g.vec(n * hc * hc, 0.0, 1.0);
        let output = g.vec(n * d, -2.0, 2.0);
        let streams = g.vec(n * hc * d, -3.0, 3.0);
        let mut expect = streams.clone();
        for t in 0..n {
            mix_streams(
                &mut expect[t * hc * d..(t + 1) * hc * d],
                &output[t * d..(t + 1) * d],
                &post[t * hc..(t + 1) * hc],
                &comb[t * hc * hc..(t + 1) * hc * hc],
            );
        }
        let (post_d, comb_d, output_d, streams_d) = (
            gpu.upload(&post).unwrap(),
            gpu.upload(&comb).unwrap(),
            gpu.upload(&output).unwrap(),
            gpu.upload(&streams).unwrap(),
        );
        hyper_post(&gpu, &post_d, &comb_d, &output_d, &streams_d, n, hc, d).unwrap();
        assert_bits(&gpu.download(&streams_d).unwrap(), &expect, &format!("post hc {hc} d {d} n {n}"));
    }
}

#[test]
fn rope_rows_matches_the_engines_angles_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Lcg(3);
    // (n, heads, head_dim, rope_dim, row stride beyond heads·head_dim, offset)
    for (n, heads, head_dim, rope_dim, pad, offset) in [
        (1usize, 1usize, 8usize, 8usize, 0usize, 0usize),
        (5, 3, 64, 16, 7, 3),
        (7, 2, 100, 64, 0, 1),
        (17, 4, 36, 2, 5, 0),
    ] {
        let rope = Rope::new(rope_dim, 10000.0, None);
        let half = rope_dim / 2;
        let positions: Vec<usize> = (0..n).map(|i| 3 + 37 * i).collect();
        let (mut cos, mut sin) = (vec![0.0f32; n * half], vec![0.0f32; n * half]);
        for (i, &p) in positions.iter().enumerate() {
            rope.cos_sin(p, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
        }
        let stride = heads * head_dim + pad;
        let x = g.vec(offset + n * stride, -2.0, 2.0);
        for inverse in [false, true] {
            // `Angles::apply` / `apply_inverse` on every head of every row.
            let mut expect = x.clone();
            for r in 0..n {
                for h in 0..heads {
                    let v = &mut expect[offset + r * stride + h * head_dim..][..head_dim];
                    let tail = head_dim - rope_dim;
                    let c = &cos[r * half..][..half];
                    let s: Vec<f32> = if inverse {
                        sin[r * half..][..half].iter().map(|s| -s).collect()
                    } else {
                        sin[r * half..][..half].to_vec()
                    };
                    ops::rope_interleaved(&mut v[tail..], c, &s);
                }
            }
            let x_d = gpu.upload(&x).unwrap();
            let (cos_d, sin_d) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
            rope_rows(&gpu, Rows::new(&x_d, offset, stride), n, heads, head_dim, rope_dim, &cos_d, &sin_d, inverse)
                .unwrap();
            assert_bits(&gpu.download(&x_d).unwrap(), &expect, &format!("rope n {n} heads {heads} inverse {inverse}"));
        }
    }
}

#[test]
fn swiglu_clamped_matches_the_cpu_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Lcg(5);
    for len in [1usize, 7, 17, 100, 256, 257, 1000] {
        for limit in [7.0f32, 0.75] {
            let mut gate = g.vec(len, -120.0, 20.0);
            let mut up = g.vec(len, -12.0, 12.0);
            // Edges: exp overflow and underflow, the clamps, NaN passed through clamp.
            let edges = [(-200.0f32, 1.0f32), (200.0, -200.0), (0.0, f32::NAN), (-0.0, 3.0), (limit, limit)];
            for (i, &(a, b)) in edges.iter().enumerate().take(len) {
                gate[i] = a;
                up[i] = b;
            }
            let mut expect = gate.clone();
            ops::swiglu_clamped(&mut expect, &up, limit);
            let (gate_d, up_d) = (gpu.upload(&gate).unwrap(), gpu.upload(&up).unwrap());
            swiglu_clamped(&gpu, &gate_d, &up_d, len, limit).unwrap();
            assert_bits(&gpu.download(&gate_d).unwrap(), &expect, &format!("swiglu len {len} limit {limit}"));
        }
    }
}

#[test]
fn add_rows_scale_rows_and_add_scaled_rows_match_the_cpu_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Lcg(9);
    for (n, width, pad_out, pad_x) in [(1usize, 1usize, 0usize, 0usize), (5, 7, 3, 0), (3, 17, 0, 5), (2, 300, 1, 2)] {
        let (so, sx) = (width + pad_out, width + pad_x);
        let out = g.vec(2 + n * so, -4.0, 4.0);
        let x = g.vec(1 + n * sx, -4.0, 4.0);
        let p = 0.3 + g.next();
        let (out_d, x_d) = (gpu.upload(&out).unwrap(), gpu.upload(&x).unwrap());

        let mut expect = out.clone();
        for r in 0..n {
            for c in 0..width {
                expect[2 + r * so + c] += x[1 + r * sx + c];
            }
        }
        add_rows(&gpu, Rows::new(&out_d, 2, so), Rows::new(&x_d, 1, sx), n, width).unwrap();
        assert_bits(&gpu.download(&out_d).unwrap(), &expect, &format!("add_rows n {n} width {width}"));

        for r in 0..n {
            add_scaled(&mut expect[2 + r * so..][..width], p, &x[1 + r * sx..][..width]);
        }
        add_scaled_rows(&gpu, Rows::new(&out_d, 2, so), p, Rows::new(&x_d, 1, sx), n, width).unwrap();
        assert_bits(&gpu.download(&out_d).unwrap(), &expect, &format!("add_scaled_rows n {n} width {width}"));

        let len = expect.len() - 1;
        expect[..len].iter_mut().for_each(|v| *v *= p);
        scale_rows(&gpu, &out_d, len, p).unwrap();
        assert_bits(&gpu.download(&out_d).unwrap(), &expect, &format!("scale_rows len {len}"));
    }
}
