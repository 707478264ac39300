//! V4.1's mixture of experts: noaux_tc routing on every layer (the bias picks,
//! the unbiased scores weigh), SwiGLU experts with the routing weight applied
//! before the down projection, one shared expert, all clamped.

use deepinfer_kernels::act_quant::{plain_linear, quantized_linear, round_bf16_all};

use super::config::{ScoreFunc, V41Config};
use super::ops::{self, top_k_stable};
use super::weights::{Expert, Moe};
use crate::model::{Dispatch, ExpertOutputs, Route};

/// Route `n` rows; a row marked in `image` (an image span's position) picks its
/// experts with the router's image bias `bias_vl` instead of `bias` (its weights
/// still come from the unbiased scores). `image` is empty or one flag per row.
pub fn route(cfg: &V41Config, moe: &Moe, x: &[f32], n: usize, image: &[bool]) -> Vec<Route> {
    assert!(image.is_empty() || image.len() == n, "one image flag per row");
    let e = moe.experts.len();
    let mut logits = vec![0.0f32; n * e];
    plain_linear(&moe.gate, x, n, &mut logits);
    logits
        .chunks_exact(e)
        .enumerate()
        .map(|(t, row)| {
            let row: Vec<f32> = row.iter().map(|v| v / cfg.gate_temp).collect();
            let scores: Vec<f32> = match cfg.score_func {
                ScoreFunc::Softmax => ops::softmax(&row),
                ScoreFunc::Sigmoid => row.iter().map(|&v| ops::sigmoid(v)).collect(),
                ScoreFunc::SqrtSoftplus => row.iter().map(|&v| ops::softplus(v).sqrt()).collect(),
            };
            let bias = match (&moe.bias_vl, image.get(t)) {
                (Some(vl), Some(true)) => vl,
                (None, Some(true)) => panic!("image rows routed by a router without bias_vl"),
                _ => &moe.bias,
            };
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let experts = top_k_stable(&biased, moe.n_activated);
            let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
            if cfg.norm_topk_prob && moe.n_activated > 1 {
                let sum = ops::sum(weights.iter().copied()) + 1e-20;
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            weights.iter_mut().for_each(|w| *w *= cfg.route_scale);
            Route { experts, weights }
        })
        .collect()
}

/// One expert over `rows` (bf16 values), each scaled by its routing weight
/// (`None` for the shared expert) before the down projection.
pub fn expert_forward(cfg: &V41Config, expert: &Expert, x: &[f32], weights: Option<&[f32]>) -> Vec<f32> {
    let n = x.len() / cfg.dim;
    let inter = expert.w1.rows;
    let gate = quantized_linear(&expert.w1, x, n);
    let up = quantized_linear(&expert.w3, x, n);
    let limit = cfg.swiglu_limit;
    let mut act: Vec<f32> = gate
        .iter()
        .zip(&up)
        .enumerate()
        .map(|(i, (&g, &u))| {
            let (g, u) = if limit > 0.0 { (g.min(limit), u.clamp(-limit, limit)) } else { (g, u) };
            let h = ops::silu(g) * u;
            match weights {
                Some(w) => w[i / inter] * h,
                None => h,
            }
        })
        .collect();
    round_bf16_all(&mut act);
    quantized_linear(&expert.w2, &act, n)
}

/// The MoE output `[n, dim]` (bf16 values): routed outputs (weight already
/// applied) summed in f32 in ascending expert order, then the shared expert.
pub fn combine(cfg: &V41Config, moe: &Moe, dispatch: &Dispatch, outputs: &ExpertOutputs) -> Vec<f32> {
    assert!(outputs.is_complete(), "every routed slot has an output");
    let d = cfg.dim;
    let n = dispatch.routes.len();
    let mut y = vec![0.0f32; n * d];
    for (t, r) in dispatch.routes.iter().enumerate() {
        let mut order: Vec<usize> = (0..r.experts.len()).collect();
        order.sort_by_key(|&slot| (r.experts[slot], slot));
        let row = &mut y[t * d..(t + 1) * d];
        for slot in order {
            row.iter_mut().zip(outputs.slot(t, slot)).for_each(|(a, b)| *a += b);
        }
    }
    let shared = expert_forward(cfg, &moe.shared, &dispatch.x, None);
    y.iter_mut().zip(&shared).for_each(|(a, b)| *a += b);
    round_bf16_all(&mut y);
    y
}

/// Route, run every expert here and combine (the DSpark layers).
pub fn forward(cfg: &V41Config, moe: &Moe, x: &[f32], n: usize) -> Vec<f32> {
    let dispatch = Dispatch { hidden_size: cfg.dim, x: x.to_vec(), routes: route(cfg, moe, x, n, &[]) };
    let mut outputs = ExpertOutputs::new(&dispatch, moe.n_activated);
    for (e, pairs) in dispatch.rows_by_expert() {
        let weights: Vec<f32> = pairs.iter().map(|&(t, slot)| dispatch.routes[t].weights[slot]).collect();
        let out = expert_forward(cfg, &moe.experts[e], &dispatch.gather(&pairs), Some(&weights));
        outputs.store_owned(&pairs, out);
    }
    combine(cfg, moe, &dispatch, &outputs)
}
