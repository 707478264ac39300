//! Verifying draft tokens against the target model's distribution.
//!
//! Two schemes for a sampled request. *Rejection sampling* (Leviathan et al.
//! 2023; Chen et al. 2023) accepts a draft `x ~ q` with probability
//! `min(1, p(x)/q(x))` and otherwise draws from the residual `max(0, p − q)`:
//! the output follows `p` exactly and a draft is accepted with probability
//! `Σ min(p, q)`, the most any verifier can reach. *Coupled* verification
//! draws the draft with the very uniform the target's sampler uses at that
//! position and accepts when both land on the same token: the output is the
//! target's own sample, so a request decodes exactly the tokens it would
//! without drafts, at the lower acceptance [`coupled_acceptance`].
//!
//! Distributions are `f64` over the whole vocabulary. Every draw walks an
//! inverse CDF in token-id order, as the sampler does, so it is a pure
//! function of the distribution and one uniform from a named stream of the
//! request's seed.

use crate::sampling::{self, SamplingParams, GOLDEN_GAMMA};
use crate::speculative::policy::MAX_DRAFT_TOKENS;

/// Stream of the uniforms a drafter samples its drafts with under rejection sampling.
pub const DRAFT_STREAM: u64 = 0xd1b5_4a32_d192_ed03;
/// Stream of the uniforms that accept or reject drafts.
pub const ACCEPT_STREAM: u64 = 0x8cb9_2ba7_2f3d_8dd7;
/// Stream of the uniforms that draw a rejected draft's replacement.
pub const RESIDUAL_STREAM: u64 = 0xabc9_8388_fb8f_ac03;

/// Uniform in `[0, 1)` for `position` of the request keyed by `seed`, in the
/// named `stream`: the construction of [`sampling::uniform`] with another
/// stream constant, so these draws never reuse the sampler's.
pub fn stream_uniform(seed: u64, stream: u64, position: u64) -> f64 {
    let start = sampling::mix64(seed ^ stream);
    let bits = sampling::mix64(start.wrapping_add(position.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)));
    // The top 53 bits fill an f64 mantissa exactly.
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The distribution [`sampling::sample`] draws from: every filter applied
/// (temperature, min-p, top-k, top-p) and renormalised, zero outside the kept
/// tokens. Greedy parameters give a one-hot on the argmax (ties to the lower
/// id), and so does a row with no usable logit, on token 0 as the sampler
/// answers. Empty logits give an empty distribution.
pub fn filtered_probs(logits: &[f32], params: &SamplingParams) -> Vec<f64> {
    let x = sampling::sanitize(logits);
    let mut probs = vec![0.0; x.len()];
    if x.is_empty() {
        return probs;
    }
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (kept, weights) = if max == f64::NEG_INFINITY || params.is_greedy() {
        (Vec::new(), Vec::new())
    } else {
        sampling::filtered_weights(&x, max, params)
    };
    if kept.is_empty() {
        probs[sampling::argmax(&x) as usize] = 1.0;
        return probs;
    }
    // Summed in id order, as the sampler sums.
    let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
    for &id in &kept {
        probs[id as usize] = weights[id as usize] / total;
    }
    probs
}

/// Inverse-CDF draw in id order: the first token whose cumulative weight
/// exceeds `u` (in [0, 1)) times the total. Weights need not be normalised;
/// negative and NaN weights count as 0. `None` when no weight is positive.
pub fn inverse_cdf(weights: &[f64], u: f64) -> Option<u32> {
    let weight = |w: f64| if w > 0.0 { w } else { 0.0 };
    let total: f64 = weights.iter().map(|&w| weight(w)).sum();
    // A sum of non-negative numbers, never NaN.
    if total <= 0.0 {
        return None;
    }
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last = None;
    for (id, &w) in weights.iter().enumerate() {
        if weight(w) > 0.0 {
            cumulative += w;
            last = Some(id as u32);
            if cumulative > target {
                break;
            }
        }
    }
    // Without a break, rounding put `target` at `total`: the last token with
    // weight, as the sampler answers.
    last
}

/// Outcome of verifying one draft token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the draft was kept.
    pub accepted: bool,
    /// The token to emit: the draft when accepted, its replacement otherwise.
    pub token: u32,
}

/// Rejection sampling of one `draft` drawn from `q` against the target `p`.
///
/// Accepts when `u_accept · q(draft) < p(draft)`, i.e. with probability
/// `min(1, p/q)` (always when `q(draft) = 0 < p(draft)`, never when
/// `p(draft) = 0`); otherwise draws from the residual `max(0, p − q)` with
/// `u_residual`. The residual is all zero only when `p ≤ q` everywhere, which
/// for two normalised rows means `p == q` up to rounding: then the
/// replacement is drawn from `p` itself, so a token outside `p`'s support is
/// never emitted, and the draft is returned only if `p` is all zero too.
/// The two uniforms must be independent of the draw of `draft`.
///
/// # Panics
/// If `p` and `q` differ in length or `draft` is outside them.
pub fn verify_draft(p: &[f64], q: &[f64], draft: u32, u_accept: f64, u_residual: f64) -> Verdict {
    assert_eq!(p.len(), q.len(), "target and draft distributions over different vocabularies");
    let x = draft as usize;
    assert!(x < p.len(), "draft token {draft} outside a vocabulary of {}", p.len());
    if u_accept * q[x] < p[x] {
        return Verdict { accepted: true, token: draft };
    }
    let residual: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect();
    let token = inverse_cdf(&residual, u_residual).or_else(|| inverse_cdf(p, u_residual)).unwrap_or(draft);
    Verdict { accepted: false, token }
}

/// Rejection sampling of a chain of drafts: `drafts[i]` was drawn from
/// `q_rows[i]`, and `p_rows[i]` is the target's distribution at that draft
/// (given the drafts before it). Verifies in order and stops at the first
/// rejection, whose replacement ends the output; if every draft is accepted,
/// a bonus token is drawn from the last of the `drafts.len() + 1` target rows
/// with the first uniform of `uniforms(drafts.len())` (token 0 if that row
/// is all zero, as the sampler answers a broken row).
///
/// `uniforms(i)` gives `(u_accept, u_residual)` for output position `i`,
/// e.g. from [`ACCEPT_STREAM`] and [`RESIDUAL_STREAM`] at the token's
/// position. Returns the accepted count and the emitted tokens, always one
/// more than the accepted count.
///
/// # Panics
/// If the rows do not match the drafts, or there are more than
/// [`MAX_DRAFT_TOKENS`] drafts.
pub fn verify_chain(
    p_rows: &[Vec<f64>],
    q_rows: &[Vec<f64>],
    drafts: &[u32],
    uniforms: impl Fn(usize) -> (f64, f64),
) -> (usize, Vec<u32>) {
    assert!(drafts.len() <= MAX_DRAFT_TOKENS, "{} drafts, at most {MAX_DRAFT_TOKENS}", drafts.len());
    assert_eq!(p_rows.len(), drafts.len() + 1, "one target row per draft and one for the bonus token");
    assert_eq!(q_rows.len(), drafts.len(), "one draft row per draft");
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (i, &draft) in drafts.iter().enumerate() {
        let (u_accept, u_residual) = uniforms(i);
        let verdict = verify_draft(&p_rows[i], &q_rows[i], draft, u_accept, u_residual);
        tokens.push(verdict.token);
        if !verdict.accepted {
            return (i, tokens);
        }
    }
    let (u_bonus, _) = uniforms(drafts.len());
    tokens.push(inverse_cdf(&p_rows[drafts.len()], u_bonus).unwrap_or(0));
    (drafts.len(), tokens)
}

/// Acceptance of coupled verification: the probability that inverse-CDF
/// draws (id order) from `p` and from `q` with one shared uniform land on the
/// same token, `Σ_i |[P_{i-1}, P_i) ∩ [Q_{i-1}, Q_i)|` over the cumulative
/// sums. At most `Σ min(p, q)`; equal to 1 when `p == q`. Rows are
/// normalised first (negative and NaN entries count as 0); 0 if either has
/// no mass.
///
/// # Panics
/// If `p` and `q` differ in length.
pub fn coupled_acceptance(p: &[f64], q: &[f64]) -> f64 {
    assert_eq!(p.len(), q.len(), "target and draft distributions over different vocabularies");
    let weight = |w: f64| if w > 0.0 { w } else { 0.0 };
    let p_total: f64 = p.iter().map(|&w| weight(w)).sum();
    let q_total: f64 = q.iter().map(|&w| weight(w)).sum();
    if p_total <= 0.0 || q_total <= 0.0 {
        return 0.0;
    }
    let (mut p_cumulative, mut q_cumulative) = (0.0, 0.0);
    let (mut p_low, mut q_low) = (0.0f64, 0.0f64);
    let mut overlap = 0.0;
    for (&pi, &qi) in p.iter().zip(q) {
        p_cumulative += weight(pi);
        q_cumulative += weight(qi);
        let (p_high, q_high) = (p_cumulative / p_total, q_cumulative / q_total);
        overlap += (p_high.min(q_high) - p_low.max(q_low)).max(0.0);
        (p_low, q_low) = (p_high, q_high);
    }
    overlap.min(1.0)
}

#[cfg(test)]
#[path = "rejection_tests.rs"]
mod tests;
