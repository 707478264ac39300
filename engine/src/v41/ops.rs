//! Row-wise arithmetic of the V4.1 forward pass, in the reference's order of
//! f32 operations and bf16 roundings: RMSNorm, RoPE, mHC mixing, the blockwise
//! online-softmax attention over a list of keys.
//!
//! What the reference leaves to its libraries (the order of a sum, the last
//! bit of `exp`) is defined here as the f64 result rounded once to f32: every
//! dot product and reduction accumulates in f64, every transcendental is
//! evaluated in f64. Element-wise f32 arithmetic is IEEE on both sides.

use deepinfer_kernels::act_quant::round_bf16;

/// `bf16(weight · x · rsqrt(mean(x²) + eps))` of a bf16-valued row, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    assert_eq!(x.len(), weight.len(), "rms_norm weight");
    let inv = rsqrt(mean_square(x) + eps);
    for (v, w) in x.iter_mut().zip(weight) {
        *v = round_bf16(w * (*v * inv));
    }
}

/// `mean(x²)`: f32 squares, summed in f64.
pub fn mean_square(x: &[f32]) -> f32 {
    (x.iter().map(|&v| (v * v) as f64).sum::<f64>() / x.len() as f64) as f32
}

/// Σ in f64, rounded once.
pub fn sum(values: impl IntoIterator<Item = f32>) -> f32 {
    values.into_iter().map(f64::from).sum::<f64>() as f32
}

pub fn rsqrt(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

pub fn exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// torch's softplus (linear above 20), in f64.
pub fn softplus(x: f32) -> f32 {
    let x = x as f64;
    (if x > 20.0 { x } else { x.exp().ln_1p() }) as f32
}

/// Softmax of a row in f64, rounded once per element.
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let max = x.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
    let e: Vec<f64> = x.iter().map(|&v| (v as f64 - max).exp()).collect();
    let total: f64 = e.iter().sum();
    e.iter().map(|v| (v / total) as f32).collect()
}

/// Rotary tables of one attention kind, f32 as the reference computes them
/// (YaRN without an attention factor when `original_seq_len > 0`).
pub struct RopeTable {
    pub freqs: Vec<f32>,
}

impl RopeTable {
    pub fn new(dim: usize, base: f64, original_seq_len: usize, factor: f64, beta_fast: f64, beta_slow: f64) -> Self {
        let half = dim / 2;
        let mut freqs: Vec<f32> =
            (0..half).map(|i| 1.0 / base.powf(((2 * i) as f32 / dim as f32) as f64) as f32).collect();
        if original_seq_len > 0 {
            let corrected = |rotations: f64| {
                dim as f64 * (original_seq_len as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * base.ln())
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
        Self { freqs }
    }

    /// Rotate the pairs of `x` (a bf16-valued slice of `2 · freqs.len()`) to
    /// `position` (or back, `inverse`), rounding the result to bf16.
    pub fn apply(&self, x: &mut [f32], position: usize, inverse: bool) {
        assert_eq!(x.len(), 2 * self.freqs.len(), "rope slice");
        for (pair, &f) in x.chunks_exact_mut(2).zip(&self.freqs) {
            let angle = (position as f32 * f) as f64;
            let (c, s) = (angle.cos() as f32, angle.sin() as f32);
            let s = if inverse { -s } else { s };
            let (a, b, c, s) = (pair[0] as f64, pair[1] as f64, c as f64, s as f64);
            pair[0] = round_bf16((a * c - b * s) as f32);
            pair[1] = round_bf16((a * s + b * c) as f32);
        }
    }
}

/// mHC coefficients of one token for one sublayer.
pub struct Mix {
    pub pre: Vec<f32>,
    pub post: Vec<f32>,
    /// `[hc, hc]`: `comb[i · hc + j]` weighs input stream `i` into output stream `j`.
    pub comb: Vec<f32>,
}

/// The mHC constants of a model.
#[derive(Clone, Copy, Debug)]
pub struct MixShape {
    pub hc: usize,
    pub iters: usize,
    pub norm_eps: f32,
    pub hc_eps: f32,
}

/// The mixes of one token from its streams `[hc · dim]` (bf16 values).
pub fn hc_mixes(streams: &[f32], mix: &[f32], scale: &[f32; 3], base: &[f32], shape: MixShape) -> Mix {
    let MixShape { hc, iters, norm_eps, hc_eps } = shape;
    let inv = rsqrt(mean_square(streams) + norm_eps);
    let mut sums = vec![0.0f64; mix.len() / streams.len()];
    deepinfer_kernels::act_quant::dot_f64_rows(streams, mix, &mut sums);
    let m: Vec<f32> = sums.iter().map(|&s| s as f32 * inv).collect();
    let pre = (0..hc).map(|j| sigmoid(m[j] * scale[0] + base[j]) + hc_eps).collect();
    let post = (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] * scale[1] + base[hc + j])).collect();
    let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k]).collect();
    for row in comb.chunks_exact_mut(hc) {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        row.iter_mut().for_each(|v| *v = exp(*v - max));
        let total = sum(row.iter().copied());
        row.iter_mut().for_each(|v| *v = *v / total + hc_eps);
    }
    normalize_columns(&mut comb, hc, hc_eps);
    for _ in 1..iters {
        for row in comb.chunks_exact_mut(hc) {
            let total = sum(row.iter().copied()) + hc_eps;
            row.iter_mut().for_each(|v| *v /= total);
        }
        normalize_columns(&mut comb, hc, hc_eps);
    }
    Mix { pre, post, comb }
}

fn normalize_columns(comb: &mut [f32], hc: usize, eps: f32) {
    for j in 0..hc {
        let total = sum((0..hc).map(|i| comb[i * hc + j])) + eps;
        (0..hc).for_each(|i| comb[i * hc + j] /= total);
    }
}

/// `bf16(Σ_i pre[i] · streams[i])`.
pub fn hc_pre(streams: &[f32], pre: &[f32], out: &mut [f32]) {
    let d = out.len();
    for (c, o) in out.iter_mut().enumerate() {
        *o = round_bf16(sum(pre.iter().enumerate().map(|(i, &p)| p * streams[i * d + c])));
    }
}

/// `streams[j] ← bf16(post[j] · output + Σ_i comb[i][j] · streams[i])`.
///
/// Each `mixed` is [`sum`]'s: f32 products added in f64 in stream order from
/// the same start, computed a whole row of channels at a time.
pub fn hc_post(streams: &mut [f32], output: &[f32], mix: &Mix) {
    let d = output.len();
    let hc = mix.post.len();
    assert!(streams.len() == hc * d && mix.comb.len() == hc * hc, "hc_post shapes");
    let residual = streams.to_vec();
    let start = std::iter::empty::<f64>().sum::<f64>();
    let mut mixed = vec![start; d];
    for j in 0..hc {
        mixed.fill(start);
        for i in 0..hc {
            let weight = mix.comb[i * hc + j];
            for (m, &r) in mixed.iter_mut().zip(&residual[i * d..(i + 1) * d]) {
                *m += f64::from(weight * r);
            }
        }
        let row = &mut streams[j * d..(j + 1) * d];
        for ((s, &o), &m) in row.iter_mut().zip(output).zip(&mixed) {
            *s = round_bf16(mix.post[j] * o + m as f32);
        }
    }
}

/// Dot product accumulated in f64 (exact products), rounded once.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    deepinfer_kernels::act_quant::dot_f64(a, b) as f32
}

/// Keys are visited in blocks of this many list slots.
const ATTENTION_BLOCK: usize = 64;

/// Multiply-adds from which a row-wise step spreads its independent outputs
/// (attention heads, indexer entries, projection parts, tokens' mixing) over
/// the thread pool. Each output is computed by one thread in its own order,
/// so the split changes no bit; below this, waking the pool costs more than
/// it saves.
pub const PARALLEL_MIN_WORK: usize = 1 << 16;

/// Whether `work` multiply-adds in independent parts are worth the pool.
pub fn worth_spreading(work: usize) -> bool {
    work >= PARALLEL_MIN_WORK && rayon::current_num_threads() > 1
}

/// Attention of one query (`heads × head_dim`, bf16 values) over a list of
/// key/value rows where `None` marks an empty slot, with an attention sink:
/// online softmax over blocks of 64 slots, probabilities rounded to bf16
/// against the running maximum before they weigh the values, output bf16.
/// Heads run side by side on the thread pool when the work is large enough.
pub fn sparse_attention(q: &[f32], keys: &[Option<&[f32]>], sink: &[f32], scale: f32, out: &mut [f32]) {
    use rayon::prelude::*;
    let heads = sink.len();
    assert!(heads > 0 && q.len().is_multiple_of(heads) && out.len() == q.len(), "sparse_attention shapes");
    let d = q.len() / heads;
    let head = |(h, out): (usize, &mut [f32])| attend_head(&q[h * d..(h + 1) * d], keys, sink[h], scale, out);
    if heads > 1 && worth_spreading(2 * heads * keys.len() * d) {
        out.par_chunks_mut(d).enumerate().for_each(head);
    } else {
        out.chunks_mut(d).enumerate().for_each(head);
    }
}

/// One head of [`sparse_attention`].
fn attend_head(qh: &[f32], keys: &[Option<&[f32]>], sink: f32, scale: f32, out: &mut [f32]) {
    let d = qh.len();
    let mut acc = vec![0.0f32; d];
    let mut sum_exp = 0.0f32;
    let mut max = -1e30f32;
    // Reused by every block: the filled slots' keys and their dot products.
    let (mut filled, mut dots): (Vec<&[f32]>, Vec<f64>) = (Vec::new(), Vec::new());
    for block in keys.chunks(ATTENTION_BLOCK) {
        // Filled slots' dot products four at a time, then every slot's score.
        filled.clear();
        filled.extend(block.iter().flatten().copied());
        dots.clear();
        dots.resize(filled.len(), 0.0);
        deepinfer_kernels::act_quant::dot_f64_each(qh, &filled, &mut dots);
        let mut dots = dots.iter();
        let scores: Vec<f32> = block
            .iter()
            .map(|k| k.map_or(f32::NEG_INFINITY, |_| *dots.next().expect("one dot per filled slot") as f32 * scale))
            .collect();
        let new_max = scores.iter().fold(max, |a, &b| a.max(b));
        let rescale = exp(max - new_max);
        max = new_max;
        let p: Vec<f32> = scores.iter().map(|s| exp(s - max)).collect();
        sum_exp = sum_exp * rescale + sum(p.iter().copied());
        // The filled slots' bf16 probabilities against their values, in slot order.
        let weights: Vec<f64> =
            block.iter().zip(&p).filter(|(k, _)| k.is_some()).map(|(_, &pk)| round_bf16(pk) as f64).collect();
        let mut weighted = vec![0.0f64; d];
        deepinfer_kernels::ops::add_weighted_rows_f64(&mut weighted, &weights, &filled);
        acc.iter_mut().zip(&weighted).for_each(|(a, &w)| *a = *a * rescale + w as f32);
    }
    sum_exp += exp(sink - max);
    for (o, a) in out.iter_mut().zip(&acc) {
        *o = round_bf16(a / sum_exp);
    }
}

/// Indices of the `k` largest values, higher value first and equal values by
/// lower index (a stable order; −0 equals +0).
pub fn top_k_stable(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (values[a], values[b]);
        y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// The `pre` that collapses the streams into the first one (before layer 0).
pub fn one_hot(hc: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; hc];
    v[0] = 1.0;
    v
}

/// Index of the largest value, the first of equal ones (torch's `argmax`).
pub fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a }).0 as u32
}
