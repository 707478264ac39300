//! The MoE kernels against the CPU's definitions, bit for bit. The engine's
//! `model::moe::{route, combine}` need its weights and config types (the
//! engine is not a dependency of this crate), so the references below are
//! faithful copies of their per-token bodies over the same public kernels
//! (`sqrt_softplus`, `top_k`, `add_scaled`).

use deepinfer_cuda::ops::moe::{combine, gather_rows, route, Routing};
use deepinfer_cuda::ops::Rows;
use deepinfer_kernels::ops::{add_scaled, sqrt_softplus, top_k};

/// A small deterministic generator (SplitMix64).
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-scale, scale).
    fn f32(&mut self, scale: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The engine's `route_token` (engine/src/model/moe.rs) for one token.
fn cpu_route(
    logits: &[f32],
    hash: Option<(&[i32], u32, usize)>,
    bias: &[f32],
    k: usize,
    norm: bool,
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
    if norm {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= scaling);
    (experts, weights)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn route_matches_the_engine_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Gen(1);
    for e in [4usize, 8, 12, 32] {
        for k in [1usize, 2, 4, 6] {
            if k > e {
                continue;
            }
            for n in [1usize, 7, 17] {
                // Logits on a coarse grid so that scores (and biased scores) tie,
                // plus the branch above 20, large negatives and a NaN.
                let mut logits: Vec<f32> = (0..n * e).map(|_| (g.below(9) as f32 - 4.0) * 0.5).collect();
                for _ in 0..n {
                    let i = g.below(n * e);
                    logits[i] = [25.0, -120.0, 20.0, f32::NAN, g.f32(30.0)][g.below(5)];
                }
                let bias: Vec<f32> =
                    (0..e).map(|i| if i % 3 == 0 { 0.0 } else { (g.below(3) as f32) * 0.25 }).collect();
                let vocab = 11;
                let table: Vec<i32> = (0..vocab * k).map(|_| g.below(e) as i32).collect();
                // Tokens past the vocabulary read its last row.
                let tokens: Vec<u32> = (0..n).map(|_| g.below(vocab + 3) as u32).collect();
                let ld = gpu.upload(&logits).unwrap();
                let bd = gpu.upload(&bias).unwrap();
                let td = gpu.upload(&table).unwrap();
                let tokd = gpu.upload(&tokens).unwrap();
                for hash in [false, true] {
                    for norm in [false, true] {
                        for scaling in [1.0f32, 2.5] {
                            let experts = gpu.zeros::<i32>(n * k).unwrap();
                            let weights = gpu.zeros::<f32>(n * k).unwrap();
                            let mode = if hash {
                                Routing::Hash { tid2eid: &td, tokens: &tokd, vocab }
                            } else {
                                Routing::TopK { bias: &bd }
                            };
                            route(&gpu, &ld, n, e, k, mode, norm, scaling, &experts, &weights).unwrap();
                            let got_e = gpu.download(&experts).unwrap();
                            let got_w = gpu.download(&weights).unwrap();
                            for t in 0..n {
                                let h = hash.then_some((&table[..], tokens[t], vocab));
                                let (want_e, want_w) =
                                    cpu_route(&logits[t * e..(t + 1) * e], h, &bias, k, norm, scaling);
                                let what = format!("e {e} k {k} n {n} token {t} hash {hash} norm {norm} x{scaling}");
                                let ge: Vec<usize> = got_e[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
                                assert_eq!(ge, want_e, "experts, {what}");
                                assert_eq!(bits(&got_w[t * k..(t + 1) * k]), bits(&want_w), "weights, {what}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn top_k_routing_breaks_ties_by_the_lower_expert() {
    let gpu = deepinfer_cuda::test_gpu();
    // Every score equal: the first k experts, in order.
    let (n, e, k) = (2, 8, 4);
    let logits = vec![0.5f32; n * e];
    let bias = vec![0.0f32; e];
    let ld = gpu.upload(&logits).unwrap();
    let bd = gpu.upload(&bias).unwrap();
    let experts = gpu.zeros::<i32>(n * k).unwrap();
    let weights = gpu.zeros::<f32>(n * k).unwrap();
    route(&gpu, &ld, n, e, k, Routing::TopK { bias: &bd }, true, 1.0, &experts, &weights).unwrap();
    assert_eq!(gpu.download(&experts).unwrap(), vec![0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn gather_rows_copies_the_named_rows() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Gen(2);
    for d in [1usize, 7, 17, 100, 300] {
        let n = 5;
        let x: Vec<f32> = (0..n * (d + 3)).map(|_| g.f32(4.0)).collect();
        let rows: Vec<i32> = vec![3, 0, 3, 4, 1, 1, 2];
        let count = rows.len();
        let xd = gpu.upload(&x).unwrap();
        let rd = gpu.upload(&rows).unwrap();
        let out = gpu.zeros::<f32>(count * d).unwrap();
        gather_rows(&gpu, Rows::new(&xd, 0, d + 3), &rd, count, d, Rows::packed(&out, d)).unwrap();
        let got = gpu.download(&out).unwrap();
        let want: Vec<f32> = rows.iter().flat_map(|&r| x[r as usize * (d + 3)..][..d].to_vec()).collect();
        assert_eq!(bits(&got), bits(&want), "d {d}");
    }
}

#[test]
fn combine_matches_the_engine_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Gen(3);
    for k in 1usize..=6 {
        for d in [1usize, 7, 17, 100, 257] {
            for shared_on in [false, true] {
                let n = 5;
                let e = 16;
                // Unsorted experts, some repeated within a token.
                let experts: Vec<i32> = (0..n * k).map(|_| g.below(e) as i32).collect();
                let weights: Vec<f32> = (0..n * k).map(|_| g.f32(1.5)).collect();
                let routed: Vec<f32> = (0..n * k * d).map(|_| g.f32(8.0)).collect();
                let shared: Vec<f32> = (0..n * d).map(|_| g.f32(3.0)).collect();
                // The engine's combine for one token (engine/src/model/moe.rs).
                let mut want = vec![0.0f32; n * d];
                for (t, o) in want.chunks_exact_mut(d).enumerate() {
                    let r = &experts[t * k..(t + 1) * k];
                    let mut order: Vec<usize> = (0..k).collect();
                    order.sort_by_key(|&slot| (r[slot] as usize, slot));
                    for slot in order {
                        add_scaled(o, weights[t * k + slot], &routed[(t * k + slot) * d..][..d]);
                    }
                    if shared_on {
                        add_scaled(o, 1.0, &shared[t * d..(t + 1) * d]);
                    }
                }
                let rd = gpu.upload(&routed).unwrap();
                let ed = gpu.upload(&experts).unwrap();
                let wd = gpu.upload(&weights).unwrap();
                let sd = gpu.upload(&shared).unwrap();
                // Output rows strided inside a larger buffer, filled with junk first.
                let out = gpu.upload(&vec![f32::NAN; 2 + n * (d + 1)]).unwrap();
                let shared_rows = shared_on.then(|| Rows::packed(&sd, d));
                combine(&gpu, &rd, &ed, &wd, shared_rows, n, k, d, Rows::new(&out, 2, d + 1)).unwrap();
                let got = gpu.download(&out).unwrap();
                for t in 0..n {
                    assert_eq!(
                        bits(&got[2 + t * (d + 1)..][..d]),
                        bits(&want[t * d..(t + 1) * d]),
                        "k {k} d {d} shared {shared_on} token {t}"
                    );
                }
            }
        }
    }
}
