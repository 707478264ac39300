//! Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams,
//! collapsed before each sublayer and mixed back after it.

use deepinfer_kernels::ops::{add_scaled, inv_rms, mix_streams, sigmoid, sinkhorn, softmax};
use deepinfer_kernels::Linear;
use rayon::prelude::*;

use super::rows::{each_token, spread_tokens};
use super::weights::{HyperConnection, HyperHead};
use crate::config::ModelConfig;

/// Mixing weights of one token for one sublayer.
pub struct Mix {
    /// `[hc]` weights on the sublayer output per stream.
    pub post: Vec<f32>,
    /// `[hc, hc]` doubly-stochastic stream mixing (row j = input stream).
    pub comb: Vec<f32>,
}

/// Compute the per-token mixes and the collapsed sublayer input `[n, D]` from streams `[n, hc, D]`.
pub fn pre(h: &HyperConnection, cfg: &ModelConfig, streams: &[f32], n: usize) -> (Vec<Mix>, Vec<f32>) {
    let hc = cfg.hc_mult;
    let d = cfg.hidden_size;
    let outputs = (2 + hc) * hc;
    let mixes = normed_mix(&h.mix, streams, n, hc * d, cfg.rms_norm_eps);
    let mut collapsed = vec![0.0f32; n * d];
    let token = |t: usize, collapsed: &mut [f32]| {
        let m = &mixes[t * outputs..(t + 1) * outputs];
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(m[j] * h.scale[0] + h.base[j]) + cfg.hc_eps).collect();
        let post: Vec<f32> = (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] * h.scale[1] + h.base[hc + j])).collect();
        let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * h.scale[2] + h.base[2 * hc + k]).collect();
        for row in comb.chunks_exact_mut(hc) {
            softmax(row);
            row.iter_mut().for_each(|v| *v += cfg.hc_eps);
        }
        sinkhorn(&mut comb, hc, cfg.hc_sinkhorn_iters, cfg.hc_eps);
        collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], collapsed);
        Mix { post, comb }
    };
    let out: Vec<Mix> = if spread_tokens(n) {
        collapsed.par_chunks_exact_mut(d).enumerate().map(|(t, row)| token(t, row)).collect()
    } else {
        collapsed.chunks_exact_mut(d).enumerate().map(|(t, row)| token(t, row)).collect()
    };
    (out, collapsed)
}

/// `streams[k] ← post[k]·output + Σ_j comb[j][k]·streams[j]` for every token.
pub fn post(mixes: &[Mix], cfg: &ModelConfig, output: &[f32], streams: &mut [f32]) {
    let hc = cfg.hc_mult;
    let d = cfg.hidden_size;
    // Per element: post·o first, then the streams in order, each product
    // rounded before its sum (`mix_streams`, every stream's strip at once).
    let token = |(t, (mix, s)): (usize, (&Mix, &mut [f32]))| {
        mix_streams(s, &output[t * d..(t + 1) * d], &mix.post[..hc], &mix.comb[..hc * hc]);
    };
    let streams = &mut streams[..mixes.len() * hc * d];
    if spread_tokens(mixes.len()) {
        mixes.par_iter().zip(streams.par_chunks_exact_mut(hc * d)).enumerate().for_each(token);
    } else {
        mixes.iter().zip(streams.chunks_exact_mut(hc * d)).enumerate().for_each(token);
    }
}

/// Collapse the streams `[n, hc, D]` into `[n, D]` with a hyper head.
pub fn head(h: &HyperHead, cfg: &ModelConfig, streams: &[f32], n: usize) -> Vec<f32> {
    let hc = cfg.hc_mult;
    let d = cfg.hidden_size;
    let mixes = normed_mix(&h.mix, streams, n, hc * d, cfg.rms_norm_eps);
    let mut out = vec![0.0f32; n * d];
    for t in 0..n {
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(mixes[t * hc + j] * h.scale + h.base[j]) + cfg.hc_eps).collect();
        collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], &mut out[t * d..(t + 1) * d]);
    }
    out
}

/// `mix` of each token's streams `[n, width]` RMS-normalised: the linear of
/// the raw streams, each token's outputs then multiplied by its `1/rms`.
/// The same product as normalising first, without a normalised copy of the
/// streams (a handful of outputs per token to scale instead of `width` inputs).
fn normed_mix(mix: &Linear, streams: &[f32], n: usize, width: usize, eps: f32) -> Vec<f32> {
    let streams = &streams[..n * width];
    let mut mixes = vec![0.0f32; n * mix.rows];
    mix.forward(streams, n, &mut mixes);
    each_token(&mut mixes, mix.rows, |t, row| {
        let inv = inv_rms(&streams[t * width..][..width], eps);
        row.iter_mut().for_each(|v| *v *= inv);
    });
    mixes
}

/// `out = Σ_j pre[j] · stream j`, from zero, each product rounded before its
/// sum (`add_scaled`: 16 lanes where the CPU has them, the same bits).
fn collapse(pre: &[f32], streams: &[f32], out: &mut [f32]) {
    let d = out.len();
    out.fill(0.0);
    for (j, &p) in pre.iter().enumerate() {
        add_scaled(out, p, &streams[j * d..(j + 1) * d]);
    }
}
