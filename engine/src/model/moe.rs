//! The mixture-of-experts feed-forward: sqrt-softplus routing (hash-routed in
//! the first layers), normalised and scaled top-k weights, and a shared expert.

use deepinfer_kernels::ops::{add_scaled, sqrt_softplus, swiglu_clamped, top_k};
use deepinfer_kernels::Linear;
use rayon::prelude::*;

use super::rows::{each_token, spread_tokens, with_scratch, zeros};
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
    // Each token's route alone; a prefill's spread over threads.
    let route_token = |t: usize| {
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
    };
    if spread_tokens(n) {
        (0..n).into_par_iter().map(route_token).collect()
    } else {
        (0..n).map(route_token).collect()
    }
}

/// Whether one MLP's linears may split over the pool's threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// Large products split over the pool.
    Pool,
    /// Everything on the calling thread: the MLP is one of many running side
    /// by side, which keep the threads busy without splitting.
    Caller,
}

impl Threads {
    fn forward(self, linear: &Linear, x: &[f32], n: usize, out: &mut [f32]) {
        match self {
            Threads::Pool => linear.forward(x, n, out),
            Threads::Caller => linear.forward_alone(x, n, out),
        }
    }
}

/// One SwiGLU MLP over `n` rows.
pub fn mlp(m: &Mlp, limit: f32, x: &[f32], n: usize, threads: Threads) -> Vec<f32> {
    let inter = m.w1.rows;
    let mut out = zeros(n * m.w2.rows);
    // Gate and up are written whole by their linears and dead after the
    // down projection, so they live in the thread's scratch.
    with_scratch(2 * n * inter, |gate_up| {
        let (gate, up) = gate_up.split_at_mut(n * inter);
        threads.forward(&m.w1, x, n, gate);
        threads.forward(&m.w3, x, n, up);
        // Element by element (the activation takes the gate's place), so a
        // long pass spreads its rows over threads.
        if threads == Threads::Pool && spread_tokens(n) {
            gate.par_chunks_mut(inter).zip(up.par_chunks(inter)).for_each(|(g, u)| swiglu_clamped(g, u, limit));
        } else {
            swiglu_clamped(gate, up, limit);
        }
        threads.forward(&m.w2, gate, n, &mut out);
    });
    out
}

/// The routed half of one layer's MoE for one step: the normalised rows and
/// where each goes. Expert parallelism ships the rows of each expert to the
/// shard that holds it and brings back `[rows, D]` outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatch {
    pub hidden_size: usize,
    /// `[n, D]` MoE inputs.
    pub x: Vec<f32>,
    pub routes: Vec<Route>,
}

impl Dispatch {
    /// `(row, slot)` pairs routed to `expert`, in row then slot order.
    pub fn rows_for(&self, expert: usize) -> Vec<(usize, usize)> {
        let mut rows = Vec::new();
        for (t, r) in self.routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                if e == expert {
                    rows.push((t, slot));
                }
            }
        }
        rows
    }

    /// Every hit expert, ascending, with its `(row, slot)` pairs in row then
    /// slot order ([`Dispatch::rows_for`] of each), from one pass over the routes.
    pub fn rows_by_expert(&self) -> Vec<(usize, Vec<(usize, usize)>)> {
        let experts = self.routes.iter().flat_map(|r| r.experts.iter()).max().map_or(0, |&e| e + 1);
        let mut rows: Vec<Vec<(usize, usize)>> = vec![Vec::new(); experts];
        for (t, r) in self.routes.iter().enumerate() {
            for (slot, &e) in r.experts.iter().enumerate() {
                rows[e].push((t, slot));
            }
        }
        rows.into_iter().enumerate().filter(|(_, pairs)| !pairs.is_empty()).collect()
    }

    /// The input rows of `pairs`, gathered `[pairs.len(), D]`.
    pub fn gather(&self, pairs: &[(usize, usize)]) -> Vec<f32> {
        let d = self.hidden_size;
        let mut out = Vec::with_capacity(pairs.len() * d);
        for &(t, _) in pairs {
            out.extend_from_slice(&self.x[t * d..(t + 1) * d]);
        }
        out
    }

    /// The routing weight of each of `pairs`.
    pub fn weights_of(&self, pairs: &[(usize, usize)]) -> Vec<f32> {
        pairs.iter().map(|&(t, slot)| self.routes[t].weights[slot]).collect()
    }

    /// Experts used by at least one row, ascending.
    pub fn experts_hit(&self) -> Vec<usize> {
        let mut hit: Vec<usize> = self.routes.iter().flat_map(|r| r.experts.iter().copied()).collect();
        hit.sort_unstable();
        hit.dedup();
        hit
    }
}

/// Per-slot outputs of the routed experts, `[n, k, D]` through
/// [`ExpertOutputs::slot`], filled as experts or shards answer. Each answer
/// is kept as it came, so no `[n, k, D]` buffer is zeroed and copied into on
/// one thread while the others wait (a prefill's is megabytes a layer).
#[derive(Clone, Debug)]
pub struct ExpertOutputs {
    k: usize,
    d: usize,
    /// The answers as stored, `[rows, D]` each.
    blocks: Vec<Vec<f32>>,
    /// Where slot `t * k + slot` lives: (answer, row); `None` until answered.
    at: Vec<Option<(u32, u32)>>,
}

impl ExpertOutputs {
    pub fn new(dispatch: &Dispatch, k: usize) -> Self {
        let n = dispatch.routes.len();
        Self { k, d: dispatch.hidden_size, blocks: Vec::new(), at: vec![None; n * k] }
    }

    /// Store `y` `[pairs.len(), D]`, the outputs for `pairs` from `rows_for`.
    pub fn store(&mut self, pairs: &[(usize, usize)], y: &[f32]) {
        self.store_owned(pairs, y.to_vec());
    }

    /// [`ExpertOutputs::store`], keeping `y` itself. A slot stored again
    /// (a replayed answer) reads the later answer.
    pub fn store_owned(&mut self, pairs: &[(usize, usize)], y: Vec<f32>) {
        assert_eq!(y.len(), pairs.len() * self.d, "expert output rows");
        let block = u32::try_from(self.blocks.len()).expect("answers per step fit u32");
        for (row, &(t, slot)) in pairs.iter().enumerate() {
            assert!(slot < self.k && t * self.k + slot < self.at.len(), "slot ({t}, {slot}) outside the dispatch");
            self.at[t * self.k + slot] = Some((block, row as u32));
        }
        self.blocks.push(y);
    }

    pub fn is_complete(&self) -> bool {
        self.at.iter().all(Option::is_some)
    }

    /// The output `[D]` of routing slot `slot` of row `t`. Panics if that
    /// slot has no answer yet.
    pub fn slot(&self, t: usize, slot: usize) -> &[f32] {
        let (block, row) = self.at[t * self.k + slot].unwrap_or_else(|| panic!("slot ({t}, {slot}) has no output"));
        &self.blocks[block as usize][row as usize * self.d..][..self.d]
    }
}

/// Equal when the same slots hold the same values, however they were stored.
impl PartialEq for ExpertOutputs {
    fn eq(&self, other: &Self) -> bool {
        let slots = self.at.len();
        (self.k, self.d, slots) == (other.k, other.d, other.at.len())
            && (0..slots).all(|i| match (self.at[i], other.at[i]) {
                (None, None) => true,
                (Some(_), Some(_)) => self.slot(i / self.k, i % self.k) == other.slot(i / self.k, i % self.k),
                _ => false,
            })
    }
}

/// Compute `expert`'s outputs for its rows of a dispatch.
pub fn expert_forward(moe: &Moe, cfg: &ModelConfig, expert: usize, x_rows: &[f32], threads: Threads) -> Vec<f32> {
    let n = x_rows.len() / cfg.hidden_size;
    mlp(&moe.experts[expert], cfg.swiglu_limit, x_rows, n, threads)
}

/// Run every routed expert locally.
pub fn run_all_experts(moe: &Moe, cfg: &ModelConfig, dispatch: &Dispatch) -> ExpertOutputs {
    assert!(!moe.experts.is_empty(), "the routed experts of this model live on expert shards");
    run_hit_experts(dispatch, cfg.experts_per_token, |e, pairs, threads| {
        expert_forward(moe, cfg, e, &dispatch.gather(pairs), threads)
    })
}

/// One expert's rows `(token, slot)` and their outputs.
type ExpertRun = (Vec<(usize, usize)>, Vec<f32>);

/// Hit experts per thread from which each expert runs whole on one thread:
/// enough to keep every thread busy without splitting any expert's products.
const EXPERTS_PER_THREAD_ALONE_MIN: usize = 4;

/// Every expert a dispatch hits, through `expert(e, rows, threads)`: side by
/// side on the thread pool (a decode step's few rows leave each matmul too
/// small to split), each output still computed by one thread in its fixed
/// order and stored in expert order, so threads change no bit. With many
/// experts and none holding more than a thread's share of the rows, each
/// runs on one thread ([`Threads::Caller`]); else its products may split.
pub(crate) fn run_hit_experts(
    dispatch: &Dispatch,
    k: usize,
    expert: impl Fn(usize, &[(usize, usize)], Threads) -> Vec<f32> + Sync,
) -> ExpertOutputs {
    let mut outputs = ExpertOutputs::new(dispatch, k);
    let hit = dispatch.rows_by_expert();
    let pool = rayon::current_num_threads();
    let rows_total: usize = hit.iter().map(|(_, pairs)| pairs.len()).sum();
    let rows_most = hit.iter().map(|(_, pairs)| pairs.len()).max().unwrap_or(0);
    let threads = if pool > 1 && hit.len() >= EXPERTS_PER_THREAD_ALONE_MIN * pool && rows_most * pool <= rows_total {
        Threads::Caller
    } else {
        Threads::Pool
    };
    let run = |(e, pairs): (usize, Vec<(usize, usize)>)| {
        let y = expert(e, &pairs, threads);
        (pairs, y)
    };
    let results: Vec<ExpertRun> = if pool == 1 || hit.len() == 1 {
        hit.into_iter().map(run).collect()
    } else {
        hit.into_par_iter().map(run).collect()
    };
    for (pairs, y) in results {
        outputs.store_owned(&pairs, y);
    }
    outputs
}

/// The MoE output `[n, D]`: routed outputs weighted and summed in ascending
/// expert order (so the bits do not depend on where experts ran), plus the
/// shared expert.
pub fn combine(moe: &Moe, cfg: &ModelConfig, dispatch: &Dispatch, outputs: &ExpertOutputs) -> Vec<f32> {
    assert!(outputs.is_complete(), "every routed slot has an output");
    let d = cfg.hidden_size;
    let n = dispatch.routes.len();
    let shared = moe.shared.as_ref().map(|shared| mlp(shared, cfg.swiglu_limit, &dispatch.x, n, Threads::Pool));
    let mut out = zeros(n * d);
    each_token(&mut out, d, |t, o| {
        let r = &dispatch.routes[t];
        let mut order: Vec<usize> = (0..r.experts.len()).collect();
        order.sort_by_key(|&slot| (r.experts[slot], slot));
        for slot in order {
            let y = outputs.slot(t, slot);
            let w = r.weights[slot];
            add_scaled(o, w, y);
        }
        if let Some(y) = &shared {
            // `o += y`: times one is exact, so these are the bits of the plain sum.
            add_scaled(o, 1.0, &y[t * d..(t + 1) * d]);
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatch(n: usize, d: usize) -> Dispatch {
        let routes = (0..n).map(|t| Route { experts: vec![t % 3, 3 + t % 2], weights: vec![0.5, 0.5] }).collect();
        Dispatch { hidden_size: d, x: vec![0.0; n * d], routes }
    }

    #[test]
    fn rows_by_expert_are_each_hit_experts_rows_for() {
        let mut d = dispatch(7, 2);
        d.routes[3].experts = vec![9, 0];
        let want: Vec<(usize, Vec<(usize, usize)>)> = d.experts_hit().into_iter().map(|e| (e, d.rows_for(e))).collect();
        assert_eq!(d.rows_by_expert(), want);
        assert!(Dispatch { hidden_size: 2, x: vec![], routes: vec![] }.rows_by_expert().is_empty());
    }

    #[test]
    fn expert_outputs_read_each_slot_from_the_answer_that_filled_it() {
        let (n, k, d) = (4, 2, 3);
        let dispatch = dispatch(n, d);
        let mut outputs = ExpertOutputs::new(&dispatch, k);
        let value = |t: usize, slot: usize| (0..d).map(|c| (100 * t + 10 * slot + c) as f32).collect::<Vec<f32>>();
        // Every expert's rows, stored in descending expert order.
        for e in (0..5).rev() {
            let pairs = dispatch.rows_for(e);
            assert!(!outputs.is_complete());
            outputs.store(&pairs, &pairs.iter().flat_map(|&(t, slot)| value(t, slot)).collect::<Vec<f32>>());
        }
        assert!(outputs.is_complete());
        for t in 0..n {
            for slot in 0..k {
                assert_eq!(outputs.slot(t, slot), value(t, slot), "slot ({t}, {slot})");
            }
        }
        // The same values stored one slot at a time compare equal; a replayed
        // answer with other values replaces the first and compares unequal.
        let mut one_by_one = ExpertOutputs::new(&dispatch, k);
        for t in 0..n {
            for slot in 0..k {
                one_by_one.store_owned(&[(t, slot)], value(t, slot));
            }
        }
        assert_eq!(one_by_one, outputs);
        one_by_one.store_owned(&[(2, 1)], vec![-1.0; d]);
        assert_eq!(one_by_one.slot(2, 1), [-1.0; 3]);
        assert_ne!(one_by_one, outputs);
    }

    #[test]
    #[should_panic(expected = "outside the dispatch")]
    fn expert_outputs_refuse_a_slot_outside_the_dispatch() {
        let mut outputs = ExpertOutputs::new(&dispatch(2, 3), 2);
        outputs.store_owned(&[(2, 0)], vec![0.0; 3]);
    }
}
