//! V4.1-Flash's device ops at the shapes a GPU runs (hidden 5120, q_lora 1280,
//! indexer 32 × 128, hc 4, Sinkhorn 20, Engram), with 1 to 4 tokens, against
//! the CPU definitions the per-op tests use, bit for bit: the linears and
//! activation quantisers, the row-wise ops, mHC and Engram.
//! `real_shapes_v41_sparse.rs` holds the compressor, indexer, attention and
//! MoE; `shapes_support/v41.rs` the CPU references (see `real_shapes_v4.rs`).
//! Each test prints its wall time (`-- --nocapture`).

mod shapes_support;

use deepinfer_cuda::ops::linear::DeviceLinear;
use deepinfer_cuda::ops::v41::{
    self, dot_f64_rows, fp4_round_trip_rows, fp8_quantize_rows, fp8_round_trip_rows, map_rows, plain_linear,
    quantized_linear, round_bf16_rows, softmax_rows, DeviceRope, RopePositions, Unary,
};
use deepinfer_cuda::ops::v41_model::{
    self, engram_gate, engram_gather, hc_mixes, hc_post, hc_pre, DeviceEngramTable, MixShape,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::test_gpu;
use deepinfer_kernels::act_quant::{self, fp4_round_trip, fp8_quantize_row, fp8_round_trip, round_bf16, Fp4Scale};
use deepinfer_kernels::dtype::{fp8_e4m3_to_f32, ue8m0_to_f32};
use deepinfer_kernels::Linear;
use shapes_support::v41::{
    v41_exp, v41_hc_mixes, v41_mean_square, v41_rms_norm, v41_rope_apply, v41_rope_freqs, v41_rsqrt, v41_sigmoid,
    v41_silu, v41_softmax, v41_sum, V41Mix,
};
use shapes_support::{
    assert_bits, fp4_weight, fp8_weight, Gen, Timer, HC, HEADS, HEAD_DIM, INDEX_HEAD_DIM, INDEX_TOPK, ROPE_DIM,
    SINKHORN_ITERS, V41_HIDDEN, V41_INDEX_HEADS, V41_Q_LORA,
};

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

// ---- V4.1-Flash: row-wise ops ------------------------------------------------

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
