//! `deepinfer_cuda::ops::v41`'s row-wise kernels against the engine's
//! `v41::ops` (RMSNorm, softmax, exp/sigmoid/silu/softplus/rsqrt, `dot`, and
//! `RopeTable::apply` as V4.1's attention applies it), bit for bit, on the
//! test device (`DEEPINFER_TEST_DEVICE=cuda` runs them on a GPU, where the
//! element-wise test checks the device's `log1p` against glibc's over many
//! inputs).

use deepinfer_cuda::ops::v41::{
    dot_f64_rows, map_rows, rms_norm_rows, rope_rows, softmax_rows, DeviceRope, RopePositions, Unary,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_engine::v41::ops::{self, RopeTable};
use deepinfer_kernels::act_quant::round_bf16;

/// SplitMix64 values in [-1, 1), every 37th scaled by 300.
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

fn bf16_values(len: usize, seed: u64) -> Vec<f32> {
    values(len, seed).into_iter().map(round_bf16).collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: device {g:e}, CPU {w:e}");
    }
}

#[test]
fn elementwise_transcendentals_match_v41_ops() {
    let gpu = deepinfer_cuda::test_gpu();
    // Many inputs over the ranges the model meets (and past them), the
    // softplus switch at 20, exp's overflow and underflow, special values.
    let mut x: Vec<f32> =
        values(1 << 17, 1).iter().enumerate().map(|(i, v)| v * [1.0, 8.0, 40.0, 800.0][i % 4]).collect();
    x.extend((0..4000).map(|i| 19.9 + i as f32 * 5e-5));
    x.extend([0.0, -0.0, 20.0, 1e-30, -1e-30, 88.7, 89.0, -745.2, 710.0, f32::INFINITY, f32::NEG_INFINITY, f32::MAX]);
    let width = x.len();
    type Cpu = fn(f32) -> f32;
    let cases: [(Unary, Cpu); 5] = [
        (Unary::Exp, ops::exp),
        (Unary::Sigmoid, ops::sigmoid),
        (Unary::Silu, ops::silu),
        (Unary::Softplus, ops::softplus),
        (Unary::Rsqrt, ops::rsqrt),
    ];
    for (op, cpu) in cases {
        let d = gpu.upload(&x).unwrap();
        map_rows(&gpu, Rows::packed(&d, width), 1, width, op).unwrap();
        let want: Vec<f32> = x.iter().map(|&v| cpu(v)).collect();
        let got = gpu.download(&d).unwrap();
        let differ: Vec<String> = (0..width)
            .filter(|&i| got[i].to_bits() != want[i].to_bits() && !(got[i].is_nan() && want[i].is_nan()))
            .take(5)
            .map(|i| format!("x {:e}: device {:e}, CPU {:e}", x[i], got[i], want[i]))
            .collect();
        assert!(differ.is_empty(), "{op:?}: {differ:?}");
    }
}

#[test]
fn rms_norm_rows_match_v41_rms_norm() {
    let gpu = deepinfer_cuda::test_gpu();
    for (n, dim) in [(1usize, 1usize), (3, 7), (17, 64), (2, 100), (3, 1024), (1, 4096)] {
        let x = bf16_values(n * dim, dim as u64);
        let w: Vec<f32> = bf16_values(dim, 3 + dim as u64).iter().map(|v| 1.0 + v).collect();
        let stride = dim + 9;
        let mut padded = vec![0.5f32; n * stride];
        for r in 0..n {
            padded[r * stride..][..dim].copy_from_slice(&x[r * dim..][..dim]);
        }
        let d = gpu.upload(&padded).unwrap();
        let wd = gpu.upload(&w).unwrap();
        rms_norm_rows(&gpu, Rows::new(&d, 0, stride), n, dim, &wd, 1e-6).unwrap();
        let mut want = x.clone();
        want.chunks_exact_mut(dim).for_each(|r| ops::rms_norm(r, &w, 1e-6));
        let got = gpu.download(&d).unwrap();
        let got: Vec<f32> = (0..n).flat_map(|r| got[r * stride..][..dim].to_vec()).collect();
        assert_bits(&got, &want, &format!("rms_norm {n}x{dim}"));
    }
}

#[test]
fn softmax_rows_match_v41_softmax() {
    let gpu = deepinfer_cuda::test_gpu();
    for (n, width) in [(1usize, 1usize), (5, 2), (3, 4), (17, 16), (2, 128), (3, 1000)] {
        let mut x: Vec<f32> = values(n * width, 50 + width as u64).iter().map(|v| v * 0.2).collect();
        x[0] = f32::NEG_INFINITY;
        let d = gpu.upload(&x).unwrap();
        softmax_rows(&gpu, Rows::packed(&d, width), n, width).unwrap();
        let want: Vec<f32> = x.chunks_exact(width).flat_map(ops::softmax).collect();
        assert_bits(&gpu.download(&d).unwrap(), &want, &format!("softmax {n}x{width}"));
    }
}

/// Queries as the attention rotates them (every head's last `rd` values at
/// its token's position, and back), and compressed keys at `group · ratio`.
#[test]
fn rope_rows_match_rope_table_apply() {
    let gpu = deepinfer_cuda::test_gpu();
    let tables = [
        ("plain", RopeTable::new(64, 10000.0, 0, 1.0, 32.0, 1.0)),
        ("yarn", RopeTable::new(64, 160000.0, 4096, 16.0, 32.0, 1.0)),
        ("small", RopeTable::new(8, 10000.0, 0, 1.0, 32.0, 1.0)),
    ];
    for (what, rope) in &tables {
        let rd = 2 * rope.freqs.len();
        let positions = 5000;
        let dev = DeviceRope::new(&gpu, &rope.freqs, positions).unwrap();
        for (n, heads, hd, start) in [(1usize, 1usize, rd, 0usize), (3, 4, rd + 64, 7), (17, 3, rd + 32, 4000)] {
            let x = bf16_values(n * heads * hd, (n * hd + start) as u64);
            for inverse in [false, true] {
                let d = gpu.upload(&x).unwrap();
                let rows = Rows::packed(&d, heads * hd);
                let at = RopePositions::Affine { first: start, step: 1 };
                rope_rows(&gpu, &dev, rows, n, heads, hd, hd - rd, at, inverse).unwrap();
                let mut want = x.clone();
                for (t, row) in want.chunks_exact_mut(heads * hd).enumerate() {
                    for head in row.chunks_exact_mut(hd) {
                        rope.apply(&mut head[hd - rd..], start + t, inverse);
                    }
                }
                assert_bits(&gpu.download(&d).unwrap(), &want, &format!("{what} rope {n}x{heads}x{hd} at {start}"));
            }
        }
        // Compressed entries of ratio 4 from group 3, then explicit positions.
        let (n, hd, ratio) = (7usize, rd + 16, 4usize);
        let x = bf16_values(n * hd, 99);
        let d = gpu.upload(&x).unwrap();
        let at = RopePositions::Affine { first: 3 * ratio, step: ratio };
        rope_rows(&gpu, &dev, Rows::packed(&d, hd), n, 1, hd, hd - rd, at, false).unwrap();
        let mut want = x.clone();
        for (g, e) in want.chunks_exact_mut(hd).enumerate() {
            rope.apply(&mut e[hd - rd..], (3 + g) * ratio, false);
        }
        assert_bits(&gpu.download(&d).unwrap(), &want, &format!("{what} rope of compressed entries"));
        let pos: Vec<u32> = vec![4999, 0, 17, 17, 1234, 2, 600];
        let pd = gpu.upload(&pos).unwrap();
        let d = gpu.upload(&x).unwrap();
        rope_rows(&gpu, &dev, Rows::packed(&d, hd), n, 1, hd, hd - rd, RopePositions::Each(&pd), true).unwrap();
        let mut want = x.clone();
        for (e, &p) in want.chunks_exact_mut(hd).zip(&pos) {
            rope.apply(&mut e[hd - rd..], p as usize, true);
        }
        assert_bits(&gpu.download(&d).unwrap(), &want, &format!("{what} rope at listed positions"));
    }
}

/// `ops::dot` as the attention takes it: one head's query against its keys.
#[test]
fn dot_rows_match_v41_dot() {
    let gpu = deepinfer_cuda::test_gpu();
    for (heads, keys, hd) in [(1usize, 1usize, 1usize), (4, 17, 64), (3, 100, 512), (2, 7, 129)] {
        let q = bf16_values(heads * hd, hd as u64);
        let k = bf16_values(keys * hd, 1 + hd as u64);
        let (qd, kd) = (gpu.upload(&q).unwrap(), gpu.upload(&k).unwrap());
        let out = gpu.zeros::<f32>(heads * keys).unwrap();
        let (qr, kr) = (Rows::packed(&qd, hd), Rows::packed(&kd, hd));
        dot_f64_rows(&gpu, qr, heads, kr, keys, None, keys, hd, None, Some(&out)).unwrap();
        let want: Vec<f32> = (0..heads)
            .flat_map(|h| (0..keys).map(move |j| (h, j)))
            .map(|(h, j)| ops::dot(&q[h * hd..(h + 1) * hd], &k[j * hd..(j + 1) * hd]))
            .collect();
        assert_bits(&gpu.download(&out).unwrap(), &want, &format!("dot {heads}x{keys}x{hd}"));
    }
}
