//! The row-wise primitives of the forward pass against their formulas.

mod common;

use common::Rng;
use deepinfer_kernels::ops::{
    add_scaled, add_weighted_rows_f64, mix_streams, rms_norm, rope_interleaved, scale_into, sinkhorn, softmax,
    softmax_with_sink, sqrt_softplus, top_k, Rope, Yarn,
};

fn close(got: f32, want: f64, rel: f64) -> bool {
    (got as f64 - want).abs() <= rel * want.abs().max(1e-30)
}

#[test]
fn rms_norm_matches_formula() {
    let mut rng = Rng(20);
    for len in [1, 7, 512, 7168] {
        let x = rng.vec(len);
        let w = rng.vec(len);
        let eps = 1e-6;
        let mean_sq = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / len as f64;
        let inv = 1.0 / (mean_sq + eps as f64).sqrt();
        let mut plain = x.clone();
        rms_norm(&mut plain, None, eps);
        let mut weighted = x.clone();
        rms_norm(&mut weighted, Some(&w), eps);
        for i in 0..len {
            assert!(close(plain[i], x[i] as f64 * inv, 1e-5), "len {len} [{i}]");
            assert!(close(weighted[i], x[i] as f64 * inv * w[i] as f64, 1e-5), "len {len} [{i}] weighted");
        }
    }
}

#[test]
fn rope_interleaved_rotates_pairs_and_preserves_their_norms() {
    let rope = Rope::new(64, 10000.0, None);
    let mut rng = Rng(21);
    for position in [0, 1, 17, 4095, 100_000] {
        let mut cos = vec![0.0f32; 32];
        let mut sin = vec![0.0f32; 32];
        rope.cos_sin(position, &mut cos, &mut sin);
        let x = rng.vec(64);
        let mut y = x.clone();
        rope_interleaved(&mut y, &cos, &sin);
        for i in 0..32 {
            let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
            let (p, q) = (y[2 * i] as f64, y[2 * i + 1] as f64);
            let norm = (a * a + b * b).sqrt();
            assert!(((p * p + q * q).sqrt() - norm).abs() <= 1e-5 * norm.max(1.0), "pos {position} pair {i}");
            let (c, s) = (cos[i] as f64, sin[i] as f64);
            assert!((p - (a * c - b * s)).abs() <= 1e-5 * norm.max(1.0));
            assert!((q - (b * c + a * s)).abs() <= 1e-5 * norm.max(1.0));
        }
        if position == 0 {
            assert_eq!(x, y, "position 0 is the identity");
        }
    }
}

#[test]
fn rope_inverse_frequencies_without_scaling() {
    let rope = Rope::new(128, 10000.0, None);
    for (i, &f) in rope.inv_freq.iter().enumerate() {
        assert!(close(f, 10000f64.powf(-((2 * i) as f64) / 128.0), 1e-6), "pair {i}");
    }
}

#[test]
fn rope_yarn_inverse_frequencies_match_transformers() {
    // From transformers 5.23.0 `modeling_rope_utils._compute_yarn_parameters` with
    // head_dim = 16, rope_theta = 160000, factor = 16,
    // original_max_position_embeddings = 65536, beta_fast = 32, beta_slow = 1,
    // truncate = True (float32 inv_freq, printed as bits). They agree bit for bit.
    const EXPECTED: [u32; 8] = [
        0x3f80_0000, // 1.0
        0x3e64_f92e, // 0.22360679507255554
        0x3d4c_cccd, // 0.05000000074505806
        0x3c37_2dbf, // 0.011180340312421322
        0x3afa_e147, // 0.0019140624208375812
        0x399b_b3af, // 0.0002969777851831168
        0x381b_a5e4, // 3.710937744472176e-05
        0x35ea_77ff, // 1.746928205648146e-06
    ];
    let yarn = Yarn {
        factor: 16.0,
        original_max_position_embeddings: 65536.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.0,
    };
    let rope = Rope::new(16, 160000.0, Some(yarn));
    assert_eq!(rope.inv_freq.len(), 8);
    for (i, (&got, &want)) in rope.inv_freq.iter().zip(&EXPECTED).enumerate() {
        let want = f32::from_bits(want);
        assert_eq!(got.to_bits(), want.to_bits(), "pair {i}: {got:e} vs {want:e}");
    }
}

#[test]
fn softmax_with_sink_matches_formula_and_leaves_mass_to_the_sink() {
    let logits = [1.0f32, 2.0, f32::NEG_INFINITY, 0.5, -3.0];
    for sink in [1.5f32, -10.0, 5.0] {
        let mut p = logits;
        softmax_with_sink(&mut p, sink);
        let denom = (sink as f64).exp() + logits.iter().map(|&l| (l as f64).exp()).sum::<f64>();
        for (i, &l) in logits.iter().enumerate() {
            assert!(close(p[i], (l as f64).exp() / denom, 1e-6), "sink {sink} [{i}]");
        }
        assert_eq!(p[2], 0.0, "-inf gets no mass");
        let sum: f32 = p.iter().sum();
        assert!(sum < 1.0, "sink {sink}: sum {sum}");
        assert!(close(sum, 1.0 - (sink as f64).exp() / denom, 1e-6));
    }
    // A -inf sink takes nothing: plain softmax.
    let mut a = logits;
    let mut b = logits;
    softmax_with_sink(&mut a, f32::NEG_INFINITY);
    softmax(&mut b);
    assert_eq!(a, b);
}

/// The softmaxes give the bits of their serial definition (the maximum
/// folded in order from the sink) on every length, with `-inf`, zeros of
/// both signs and ties among the logits.
#[test]
fn softmaxes_give_the_bits_of_the_serial_definition() {
    fn serial(logits: &mut [f32], sink: f32) {
        let max = logits.iter().fold(sink, |m, &v| m.max(v));
        logits.iter_mut().for_each(|v| *v -= max);
        let exps: Vec<f32> = logits.iter().map(|&v| deepinfer_kernels::exp::exp(v)).collect();
        logits.copy_from_slice(&exps);
        let sum = deepinfer_kernels::exp::exp(sink - max) + deepinfer_kernels::ops::sum_lanes(logits);
        let inv = 1.0 / sum;
        logits.iter_mut().for_each(|v| *v *= inv);
    }
    let mut seed = 7u64;
    let mut next = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        seed >> 33
    };
    for len in 0..70 {
        for sink in [f32::NEG_INFINITY, -0.0, 0.0, 1.5] {
            let logits: Vec<f32> = (0..len)
                .map(|_| match next() % 9 {
                    0 => f32::NEG_INFINITY,
                    1 => 0.0,
                    2 => -0.0,
                    3 => 2.0,
                    r => (r as f32 - 5.0) * 0.37 + (next() % 1000) as f32 * 1e-3,
                })
                .collect();
            let (mut got, mut want) = (logits.clone(), logits.clone());
            softmax_with_sink(&mut got, sink);
            serial(&mut want, sink);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&got), bits(&want), "softmax_with_sink, length {len}, sink {sink}");
            if sink == f32::NEG_INFINITY {
                let mut plain = logits.clone();
                softmax(&mut plain);
                assert_eq!(bits(&plain), bits(&want), "softmax, length {len}");
            }
        }
    }
}

#[test]
fn sqrt_softplus_matches_torch() {
    // torch.sqrt(torch.nn.functional.softplus(x)) in float32, torch 2.15.0 on CPU.
    const CASES: [(f32, u32); 11] = [
        (-30.0, 0x34a4_3ae5),
        (-5.0, 0x3da7_d3f3),
        (-1.0, 0x3f0f_485c),
        (0.0, 0x3f55_224c),
        (0.5, 0x3f7c_a8fa),
        (1.0, 0x3f92_af5a),
        (5.0, 0x400f_3455),
        (19.9, 0x408e_c008),
        (20.0, 0x408f_1bbd),
        (20.5, 0x4090_e2dc),
        (50.0, 0x40e2_4630),
    ];
    for (x, want) in CASES {
        let (got, want) = (sqrt_softplus(x), f32::from_bits(want));
        // torch's vectorised exp/log1p may round differently by one ulp (it does at 0).
        let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
        assert!(ulps <= 1, "x = {x}: {got:e} vs torch {want:e}");
    }
}

#[test]
fn top_k_prefers_larger_values_then_lower_indices() {
    let v = [1.0, 3.0, 3.0, 2.0, 3.0, f32::NAN, -1.0];
    assert_eq!(top_k(&v, 2), vec![1, 2]);
    assert_eq!(top_k(&v, 4), vec![1, 2, 4, 3]);
    assert_eq!(top_k(&v, 7), vec![1, 2, 4, 3, 0, 6, 5], "NaN sorts last");
    assert_eq!(top_k(&v, 20).len(), 7);
    assert!(top_k(&v, 0).is_empty());
    assert_eq!(top_k(&[0.0, -0.0, 0.0], 3), vec![0, 1, 2], "-0 equals +0: ties go to the lower index");
    assert_eq!(top_k(&[-0.0, 0.5, 0.0, -1.0], 2), vec![1, 0]);
}

#[test]
fn sinkhorn_makes_rows_and_columns_sum_to_one() {
    let mut rng = Rng(22);
    for n in [2, 4, 8] {
        let mut m: Vec<f32> = (0..n * n).map(|_| rng.uniform().exp()).collect();
        sinkhorn(&mut m, n, 20, 1e-6);
        for k in 0..n {
            let row: f32 = m[k * n..(k + 1) * n].iter().sum();
            let col: f32 = (0..n).map(|r| m[r * n + k]).sum();
            assert!((row - 1.0).abs() < 1e-3, "n {n} row {k}: {row}");
            assert!((col - 1.0).abs() < 1e-4, "n {n} col {k}: {col}");
        }
        assert!(m.iter().all(|&v| v > 0.0));
    }
}

/// The 4 × 4 path (mHC's streams) against the general loop written out:
/// a column pass, then rows and columns in turn, sums from +0.0 in order.
#[test]
fn sinkhorn_of_four_streams_gives_the_bits_of_the_general_loop() {
    // Each line (a column when `at(line, k) = k * 4 + line`, a row when
    // `line * 4 + k`) summed from +0.0 in order, then divided by its sum + eps.
    let normalize = |m: &mut [f32], eps: f32, at: fn(usize, usize) -> usize| {
        for line in 0..4 {
            let mut s = 0.0f32;
            for k in 0..4 {
                s += m[at(line, k)];
            }
            for k in 0..4 {
                m[at(line, k)] /= s + eps;
            }
        }
    };
    let definition = |m: &mut [f32], iters: usize, eps: f32| {
        normalize(m, eps, |column, k| k * 4 + column);
        for _ in 1..iters {
            normalize(m, eps, |row, k| row * 4 + k);
            normalize(m, eps, |column, k| k * 4 + column);
        }
    };
    let mut rng = Rng(23);
    for iters in [0, 1, 2, 7, 20] {
        for eps in [0.0, 1e-6, 0.3] {
            for spread in [1.0f32, 30.0] {
                let start: Vec<f32> = (0..16).map(|_| (rng.uniform() * spread).exp()).collect();
                let (mut got, mut want) = (start.clone(), start.clone());
                sinkhorn(&mut got, 4, iters, eps);
                definition(&mut want, iters, eps);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got), bits(&want), "iters {iters} eps {eps} spread {spread}");
            }
        }
    }
}

/// The weighted f64 sum of rows gives the bits of the serial loop (product
/// rounded, then added, row after row) for every length, with values whose
/// exponents spread far enough that another order or a fused multiply-add
/// would round differently.
#[test]
fn weighted_f64_rows_give_the_bits_of_the_serial_loop() {
    let mut rng = Rng(31);
    for d in (0..70).chain([256, 257]) {
        for rows in [0, 1, 3, 64] {
            let values: Vec<Vec<f32>> = (0..rows)
                .map(|_| (0..d).map(|_| rng.uniform() * 2f32.powi((rng.uniform() * 40.0) as i32 - 20)).collect())
                .collect();
            let weights: Vec<f64> = (0..rows).map(|_| rng.uniform() as f64 / 3.0).collect();
            let start: Vec<f64> = (0..d).map(|_| rng.uniform() as f64 * 1e-3).collect();
            let row_refs: Vec<&[f32]> = values.iter().map(|r| r.as_slice()).collect();
            let mut want = start.clone();
            for (&w, row) in weights.iter().zip(&values) {
                for (o, &v) in want.iter_mut().zip(row) {
                    *o += w * v as f64;
                }
            }
            let mut got = start.clone();
            add_weighted_rows_f64(&mut got, &weights, &row_refs);
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "d {d}, {rows} rows");
        }
    }
}

/// mHC's post-mix gives the bits of its separate passes (each output
/// stream scaled from the sublayer output, then every old stream added in
/// order) for four streams and for three, at every length up to 40 and one
/// past a thousand.
#[test]
fn mixed_streams_give_the_bits_of_the_separate_passes() {
    let mut rng = Rng(32);
    for hc in [4, 3] {
        for d in (0..41).chain([1029]) {
            let spread = |rng: &mut Rng| rng.uniform() * 2f32.powi((rng.uniform() * 30.0) as i32);
            let streams: Vec<f32> = (0..hc * d).map(|_| spread(&mut rng)).collect();
            let o: Vec<f32> = (0..d).map(|_| spread(&mut rng)).collect();
            let post: Vec<f32> = (0..hc).map(|_| rng.uniform()).collect();
            let comb: Vec<f32> = (0..hc * hc).map(|_| rng.uniform()).collect();
            let mut want = vec![0.0f32; hc * d];
            for (k, dst) in want.chunks_exact_mut(d.max(1)).enumerate().take(hc) {
                scale_into(dst, post[k], &o);
                for j in 0..hc {
                    add_scaled(dst, comb[j * hc + k], &streams[j * d..(j + 1) * d]);
                }
            }
            let mut got = streams.clone();
            mix_streams(&mut got, &o, &post, &comb);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "hc {hc}, d {d}");
        }
    }
}
