//! The mixture-of-experts feed-forward: sqrt-softplus routing (hash-routed in
//! the first layers), normalised and scaled top-k weights, and a shared expert.

use deepinfer_kernels::ops::{sqrt_softplus, swiglu_clamped, top_k};

use super::weights::{Mlp, Moe};
use crate::config::{ModelConfig, RoutingKind};

/// Experts chosen for one token and their weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Route every token of `x` `[n, D]`.
pub fn route(moe: &Moe, cfg: &ModelConfig, x: &[f32], tokens: &[u32]) -> Vec<Route> {
    let n = tokens.len();
    let e = cfg.n_routed_experts;
    let k = cfg.experts_per_token;
    let mut logits = vec![0.0f32; n * e];
    moe.gate.forward(x, n, &mut logits);
    (0..n)
        .map(|t| {
            let scores: Vec<f32> = logits[t * e..(t + 1) * e].iter().map(|&v| sqrt_softplus(v)).collect();
            let experts = match moe.routing {
                RoutingKind::Hash => {
                    let table = moe.tid2eid.as_ref().expect("hash layer has tid2eid");
                    let id = (tokens[t] as usize).min(cfg.vocab_size - 1);
                    table[id * k..(id + 1) * k].iter().map(|&x| x as usize).collect()
                }
                RoutingKind::TopK => {
                    let bias = moe.bias.as_ref().expect("top-k layer has a bias");
                    let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
                    top_k(&biased, k)
                }
            };
            let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
            if cfg.norm_topk_prob {
                let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            weights.iter_mut().for_each(|w| *w *= cfg.routed_scaling_factor);
            Route { experts, weights }
        })
        .collect()
}

/// One SwiGLU MLP over `n` rows.
pub fn mlp(m: &Mlp, limit: f32, x: &[f32], n: usize) -> Vec<f32> {
    let inter = m.w1.rows;
    let mut gate = vec![0.0f32; n * inter];
    let mut up = vec![0.0f32; n * inter];
    m.w1.forward(x, n, &mut gate);
    m.w3.forward(x, n, &mut up);
    let mut act = vec![0.0f32; n * inter];
    swiglu_clamped(&gate, &up, limit, &mut act);
    let mut out = vec![0.0f32; n * m.w2.rows];
    m.w2.forward(&act, n, &mut out);
    out
}

/// The MoE output `[n, D]`: routed experts (summed in expert order) plus the shared expert.
pub fn forward(moe: &Moe, cfg: &ModelConfig, x: &[f32], tokens: &[u32]) -> Vec<f32> {
    let d = cfg.hidden_size;
    let n = tokens.len();
    let routes = route(moe, cfg, x, tokens);
    let mut out = vec![0.0f32; n * d];
    for (e, expert) in moe.experts.iter().enumerate() {
        // Rows routed to this expert, with their weights; gathering keeps each row's maths unchanged.
        let picked: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .flat_map(|(t, r)| {
                r.experts.iter().zip(&r.weights).filter(move |(&x, _)| x == e).map(move |(_, &w)| (t, w))
            })
            .collect();
        if picked.is_empty() {
            continue;
        }
        let mut gathered = Vec::with_capacity(picked.len() * d);
        for &(t, _) in &picked {
            gathered.extend_from_slice(&x[t * d..(t + 1) * d]);
        }
        let y = mlp(expert, cfg.swiglu_limit, &gathered, picked.len());
        for (i, &(t, w)) in picked.iter().enumerate() {
            for (o, v) in out[t * d..(t + 1) * d].iter_mut().zip(&y[i * d..(i + 1) * d]) {
                *o += v * w;
            }
        }
    }
    if let Some(shared) = &moe.shared {
        let y = mlp(shared, cfg.swiglu_limit, x, n);
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
    }
    out
}
