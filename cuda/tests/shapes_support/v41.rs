//! V4.1-Flash's CPU references: engine/src/v41's row-wise ops, mHC,
//! indexer, sparse attention and routing, copied.

use deepinfer_kernels::act_quant::{self, round_bf16};
use deepinfer_kernels::ops as kops;

use super::SINKHORN_ITERS;

// ---- V4.1-Flash: row-wise ops -------------------------------------------------
// engine/src/v41/ops.rs's `rms_norm`, `softmax`, `RopeTable` and the mHC
// functions, copied (the engine is not a dependency of this crate).

#[allow(dead_code)]
pub fn v41_mean_square(x: &[f32]) -> f32 {
    (x.iter().map(|&v| (v * v) as f64).sum::<f64>() / x.len() as f64) as f32
}

#[allow(dead_code)]
pub fn v41_sum(values: impl IntoIterator<Item = f32>) -> f32 {
    values.into_iter().map(f64::from).sum::<f64>() as f32
}

#[allow(dead_code)]
pub fn v41_rsqrt(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

#[allow(dead_code)]
pub fn v41_exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

#[allow(dead_code)]
pub fn v41_sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

#[allow(dead_code)]
pub fn v41_silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

#[allow(dead_code)]
pub fn v41_rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let inv = v41_rsqrt(v41_mean_square(x) + eps);
    for (v, w) in x.iter_mut().zip(weight) {
        *v = round_bf16(w * (*v * inv));
    }
}

#[allow(dead_code)]
pub fn v41_softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
    let total: f64 = e.iter().sum();
    e.iter().map(|v| (v / total) as f32).collect()
}

/// `RopeTable::new(..).freqs`.
#[allow(dead_code)]
pub fn v41_rope_freqs(
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
#[allow(dead_code)]
pub fn v41_rope_apply(freqs: &[f32], x: &mut [f32], position: usize, inverse: bool) {
    for (pair, &f) in x.chunks_exact_mut(2).zip(freqs) {
        let angle = (position as f32 * f) as f64;
        let (c, s) = (angle.cos() as f32, angle.sin() as f32);
        let s = if inverse { -s } else { s };
        let (a, b, c, s) = (pair[0] as f64, pair[1] as f64, c as f64, s as f64);
        pair[0] = round_bf16((a * c - b * s) as f32);
        pair[1] = round_bf16((a * s + b * c) as f32);
    }
}

// ---- V4.1-Flash: mHC and Engram ----------------------------------------------

#[allow(dead_code)]
pub struct V41Mix {
    pub pre: Vec<f32>,
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
}

/// `ops::hc_mixes` (with `dot_f64_rows` of the mix rows).
#[allow(dead_code)]
pub fn v41_hc_mixes(streams: &[f32], mix: &[f32], scale: &[f32; 3], base: &[f32], hc: usize, eps: f32) -> V41Mix {
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

/// `ops::top_k_stable`.
#[allow(dead_code)]
pub fn top_k_stable(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (values[a], values[b]);
        y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// `attention::candidate_blocks` (block size 8, the top 2048 blocks).
#[allow(dead_code)]
pub fn candidate_blocks_cpu(scores: &[f32], visible: usize, size: usize, topk_blocks: usize) -> Vec<bool> {
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
#[allow(dead_code)]
pub fn v41_index_scores_cpu(
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

/// `ops::sparse_attention` of one query (heads one after another).
#[allow(dead_code)]
pub fn v41_sparse_attention_cpu(q: &[f32], keys: &[Option<&[f32]>], sink: &[f32], scale: f32, out: &mut [f32]) {
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

// ---- V4.1-Flash: MoE ---------------------------------------------------------

/// `ffn::route` after the score function (`sqrt`: SqrtSoftplus's square root).
#[allow(dead_code)]
pub fn v41_route_cpu(scores: &[f32], bias: &[f32], k: usize, sqrt: bool, scale: f32) -> (Vec<usize>, Vec<f32>) {
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
