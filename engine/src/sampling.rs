// tidy: long file: the sampling chain (penalties, bias, temperature, top-k/p, logprobs) and its one batch-invariant order.
//! Next-token sampling as a pure function of (logits, params, position).
//!
//! Nothing here reads a clock or a shared random generator: the draw for
//! token position `p` of a request comes from a counter-based generator keyed
//! by the request's seed. A request therefore samples the same tokens whatever
//! else shares its batch, and a preempted request that is recomputed picks up
//! exactly where it left off. All reductions run in a fixed order in `f64`,
//! and every ranking breaks ties by the lower token id.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Most alternatives a request may ask to see per token (OpenAI's limit).
pub const MAX_LOGPROBS: usize = 20;

/// How a request chooses its next token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 selects greedy decoding.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 keeps every token.
    pub top_k: usize,
    /// Key of the request's random stream.
    pub seed: u64,
    /// How many of the most likely tokens to report per step, 0..=20.
    pub logprobs: usize,
    /// Added to the logit of each listed token (OpenAI's `logit_bias`, each in
    /// [-100, 100]), sorted by token id, each id once.
    pub logit_bias: Vec<(u32, f32)>,
    /// Subtracted once per earlier occurrence of a token in the output (OpenAI), in [-2, 2].
    pub frequency_penalty: f32,
    /// Subtracted from every token already in the output (OpenAI), in [-2, 2].
    pub presence_penalty: f32,
    /// Divides the positive logits (multiplies the negative ones) of every token
    /// in the prompt or the output (the CTRL penalty as transformers and vLLM
    /// apply it); 1 changes nothing.
    pub repetition_penalty: f32,
    /// Drops tokens less likely than `min_p` × the most likely one, after the
    /// temperature; 0 keeps every token.
    pub min_p: f32,
}

impl Default for SamplingParams {
    /// Greedy decoding, no alternatives reported, logits as the model gives them.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            logprobs: 0,
            logit_bias: Vec::new(),
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            min_p: 0.0,
        }
    }
}

/// Most tokens a request may bias (OpenAI accepts 300; this leaves room).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Largest magnitude of one logit bias (OpenAI's range).
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;
/// Largest repetition penalty accepted (transformers and vLLM accept any
/// positive value; above this every repeated token is effectively banned).
pub const REPETITION_PENALTY_MAX: f32 = 100.0;

/// Why a [`SamplingParams`] was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    InvalidTemperature(f32),
    #[error("top_p must be greater than 0 and at most 1, got {0}")]
    InvalidTopP(f32),
    #[error("logprobs must be at most {MAX_LOGPROBS}, got {0}")]
    TooManyLogprobs(usize),
    #[error("cannot sample from an empty vocabulary")]
    EmptyVocabulary,
    #[error("logit_bias may list at most {MAX_LOGIT_BIAS} tokens, got {0}")]
    TooManyLogitBiases(usize),
    #[error("logit_bias: token {0} is not in the vocabulary of {1} tokens")]
    LogitBiasToken(u32, usize),
    #[error("logit_bias: token {0} is listed twice")]
    LogitBiasDuplicate(u32),
    #[error("logit_bias: the bias of token {0} must be in [-100, 100], got {1}")]
    LogitBiasValue(u32, f32),
    #[error("{0} must be in [-2, 2], got {1}")]
    InvalidPenalty(&'static str, f32),
    #[error("repetition_penalty must be greater than 0 and at most {REPETITION_PENALTY_MAX}, got {0}")]
    InvalidRepetitionPenalty(f32),
    #[error("min_p must be in [0, 1], got {0}")]
    InvalidMinP(f32),
}

impl SamplingParams {
    /// Checks the parameters for a model with `vocab` token ids. A `top_k` or
    /// `logprobs` above `vocab` is allowed and acts as `vocab`.
    pub fn validate(&self, vocab: usize) -> Result<(), SamplingError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(SamplingError::InvalidTemperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::InvalidTopP(self.top_p));
        }
        if self.logprobs > MAX_LOGPROBS {
            return Err(SamplingError::TooManyLogprobs(self.logprobs));
        }
        if vocab == 0 {
            return Err(SamplingError::EmptyVocabulary);
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SamplingError::TooManyLogitBiases(self.logit_bias.len()));
        }
        for (i, &(token, bias)) in self.logit_bias.iter().enumerate() {
            if token as usize >= vocab {
                return Err(SamplingError::LogitBiasToken(token, vocab));
            }
            if i > 0 && self.logit_bias[i - 1].0 >= token {
                return Err(SamplingError::LogitBiasDuplicate(token));
            }
            if !(-LOGIT_BIAS_LIMIT..=LOGIT_BIAS_LIMIT).contains(&bias) {
                return Err(SamplingError::LogitBiasValue(token, bias));
            }
        }
        for (name, value) in
            [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)]
        {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingError::InvalidPenalty(name, value));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= REPETITION_PENALTY_MAX) {
            return Err(SamplingError::InvalidRepetitionPenalty(self.repetition_penalty));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::InvalidMinP(self.min_p));
        }
        Ok(())
    }

    /// Whether the logits are changed before sampling (bias or penalties).
    pub fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Whether this request decodes greedily.
    pub fn is_greedy(&self) -> bool {
        // NaN also takes the deterministic path.
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

/// Applies the request's logit bias and penalties to one row, in this order:
/// bias, repetition penalty (over `prompt` and `output`), then frequency and
/// presence penalties (over `output` only, as OpenAI defines them). A pure
/// function of its inputs, so a request's row never depends on its batch.
pub fn adjust_logits(row: &mut [f32], params: &SamplingParams, prompt: &[u32], output: &[u32]) {
    for &(token, bias) in &params.logit_bias {
        if let Some(l) = row.get_mut(token as usize) {
            *l += bias;
        }
    }
    let r = params.repetition_penalty;
    if r != 1.0 {
        // One pass over the history with a vocabulary-sized mark: linear in the
        // prompt, where sorting a long prompt every step would not be.
        let mut seen = vec![false; row.len()];
        for &token in prompt.iter().chain(output) {
            if let (Some(mark), Some(l)) = (seen.get_mut(token as usize), row.get_mut(token as usize)) {
                if !*mark {
                    *mark = true;
                    *l = if *l > 0.0 { *l / r } else { *l * r };
                }
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: Vec<u32> = output.to_vec();
        counts.sort_unstable();
        for run in counts.chunk_by(|a, b| a == b) {
            if let Some(l) = row.get_mut(run[0] as usize) {
                *l -= params.frequency_penalty * run.len() as f32 + params.presence_penalty;
            }
        }
    }
}

/// What the penalties of [`adjust_logits`] look at, for a sampler that has
/// no token history (a cluster's worker): every distinct token of `prompt`
/// and `output`, ascending, with how often it occurs in `output`.
pub fn token_history(prompt: &[u32], output: &[u32]) -> Vec<(u32, u32)> {
    let mut counts: BTreeMap<u32, u32> = prompt.iter().map(|&t| (t, 0)).collect();
    for &t in output {
        *counts.entry(t).or_default() += 1;
    }
    counts.into_iter().collect()
}

/// [`adjust_logits`] from a [`token_history`] instead of the tokens: the same
/// operations on the same values, so the same row to the bit.
pub fn adjust_logits_from_history(row: &mut [f32], params: &SamplingParams, history: &[(u32, u32)]) {
    for &(token, bias) in &params.logit_bias {
        if let Some(l) = row.get_mut(token as usize) {
            *l += bias;
        }
    }
    let r = params.repetition_penalty;
    if r != 1.0 {
        for &(token, _) in history {
            if let Some(l) = row.get_mut(token as usize) {
                *l = if *l > 0.0 { *l / r } else { *l * r };
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        for &(token, count) in history.iter().filter(|(_, count)| *count > 0) {
            if let Some(l) = row.get_mut(token as usize) {
                *l -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    /// The chosen token id.
    pub token: u32,
    /// Log-probability of `token` under the model's own distribution
    /// (log-softmax of the raw logits, before temperature, top-k or top-p).
    pub logprob: f32,
    /// The `min(logprobs, vocab)` most likely tokens with their
    /// log-probabilities, most likely first, ties by lower id.
    pub top: Vec<(u32, f32)>,
}

/// SplitMix64's output function: a bijective 64-bit mix with full avalanche.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The golden-ratio increment of SplitMix64.
pub(crate) const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
/// Separates the sampling stream from any other use of the same seed.
pub(crate) const SAMPLING_STREAM: u64 = 0x5a3d_1f0c_8e6b_2497;

/// Uniform draw in `[0, 1)` for token `position` of the request keyed by
/// `seed`: element `position` of a SplitMix64 sequence whose start is the
/// hashed seed, so it can be computed for any position without state.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let start = mix64(seed ^ SAMPLING_STREAM);
    let bits = mix64(start.wrapping_add(position.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)));
    // The top 53 bits fill an f64 mantissa exactly.
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Logits as `f64` with NaN read as -inf. When some logits are +inf those
/// tokens share all the mass equally, which is the limit of the softmax.
pub(crate) fn sanitize(logits: &[f32]) -> Vec<f64> {
    let any_pos_inf = logits.contains(&f32::INFINITY);
    logits
        .iter()
        .map(|&l| {
            if l.is_nan() {
                f64::NEG_INFINITY
            } else if any_pos_inf {
                if l == f32::INFINITY {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            } else {
                f64::from(l)
            }
        })
        .collect()
}

/// Ranking of tokens: larger logit first, then lower id. Ranking by logit
/// rather than by scaled probability keeps the order exact even where
/// temperature scaling rounds two probabilities to the same value.
fn rank(x: &[f64], a: u32, b: u32) -> Ordering {
    let (la, lb) = (x[a as usize], x[b as usize]);
    // No NaN survives `sanitize`, so `partial_cmp` always answers.
    lb.partial_cmp(&la).unwrap_or(Ordering::Equal).then(a.cmp(&b))
}

/// The `n` best-ranked ids of `ids`, in rank order.
fn best_ranked(x: &[f64], mut ids: Vec<u32>, n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, |&a, &b| rank(x, a, b));
        ids.truncate(n);
    }
    ids.sort_unstable_by(|&a, &b| rank(x, a, b));
    ids
}

/// Chooses the next token from one row of logits.
///
/// Greedy (`temperature == 0`) takes the highest logit, ties to the lower id.
/// Otherwise the distribution is softmax(logits / temperature), restricted
/// to the `top_k` best tokens, then to the nucleus: the best-ranked tokens
/// whose mass reaches `top_p` of what top-k left. The kept tokens are
/// renormalised and walked in id order against [`uniform`]`(seed, position)`,
/// so the filters only decide membership and e.g. `top_k = vocab` draws
/// exactly what `top_k = 0` draws.
///
/// Never panics. NaN logits count as -inf; if no token has a usable logit
/// (all -inf or NaN, or `logits` is empty) the result is token 0 with
/// log-probability -inf, and callers should treat that row as broken.
/// Parameters are expected to have passed [`SamplingParams::validate`];
/// out-of-range values still give a deterministic token.
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> Sampled {
    let x = sanitize(logits);
    let n_top = params.logprobs.min(x.len());
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return Sampled {
            token: 0,
            logprob: f32::NEG_INFINITY,
            top: (0..n_top as u32).map(|id| (id, f32::NEG_INFINITY)).collect(),
        };
    }

    // log-sum-exp of the raw logits, summed in id order.
    let sum: f64 = x.iter().map(|&l| (l - max).exp()).sum();
    let log_norm = max + sum.ln();
    let logprob = |id: u32| (x[id as usize] - log_norm) as f32;

    let token = if params.is_greedy() { argmax(&x) } else { draw(&x, max, params, uniform(params.seed, position)) };

    let top = if n_top == 0 {
        Vec::new()
    } else {
        best_ranked(&x, (0..x.len() as u32).collect(), n_top).into_iter().map(|id| (id, logprob(id))).collect()
    };
    Sampled { token, logprob: logprob(token), top }
}

/// Highest logit, first (lowest) id on ties.
pub(crate) fn argmax(x: &[f64]) -> u32 {
    let mut best = 0;
    for (id, &l) in x.iter().enumerate() {
        if l > x[best] {
            best = id;
        }
    }
    best as u32
}

/// Temperature, top-k, top-p, then an inverse-CDF draw with `u` in [0, 1).
/// `x` has at least one finite logit and `max` is the largest.
fn draw(x: &[f64], max: f64, params: &SamplingParams, u: f64) -> u32 {
    let (kept, weights) = filtered_weights(x, max, params);
    let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    for &id in &kept {
        cumulative += weights[id as usize];
        if cumulative > target {
            return id;
        }
    }
    // Only reachable when rounding puts `target` at `total`. `kept` holds at
    // least the best token, whose weight is exp(0) = 1.
    kept.last().copied().unwrap_or_else(|| argmax(x))
}

/// The tokens [`draw`] chooses among, in id order, and the unnormalised
/// weights of the whole vocabulary: temperature, min-p, top-k, then top-p.
/// Shared with speculative verification, which needs the same distribution.
pub(crate) fn filtered_weights(x: &[f64], max: f64, params: &SamplingParams) -> (Vec<u32>, Vec<f64>) {
    let temperature = f64::from(params.temperature);
    let weights: Vec<f64> =
        x.iter().map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { ((l - max) / temperature).exp() }).collect();
    // Tokens whose weight underflowed to zero can never be drawn; min-p drops
    // those below `min_p` of the best (whose weight is exp(0) = 1).
    let floor = f64::from(params.min_p);
    let mut kept: Vec<u32> =
        (0..x.len() as u32).filter(|&id| weights[id as usize] > 0.0 && weights[id as usize] >= floor).collect();

    let mut reordered = false;
    if params.top_k > 0 && params.top_k < kept.len() {
        kept = best_ranked(x, kept, params.top_k);
        reordered = true;
    }
    let top_p = f64::from(params.top_p);
    if top_p < 1.0 {
        if !reordered {
            kept.sort_unstable_by(|&a, &b| rank(x, a, b));
        }
        let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
        let threshold = top_p * total;
        // Smallest best-ranked prefix whose mass reaches the threshold; the
        // best token is always kept.
        let mut mass = 0.0;
        let mut len = 0;
        for &id in &kept {
            if len > 0 && mass >= threshold {
                break;
            }
            mass += weights[id as usize];
            len += 1;
        }
        kept.truncate(len);
        reordered = true;
    }
    if reordered {
        kept.sort_unstable();
    }
    (kept, weights)
}

/// The token [`sample`] chooses when its uniform draw is `u` instead of
/// [`uniform`]`(seed, position)`: lets a verifier walk the sampler's own
/// inverse CDF.
#[cfg(test)]
pub(crate) fn token_for_uniform(logits: &[f32], params: &SamplingParams, u: f64) -> u32 {
    let x = sanitize(logits);
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        0
    } else if params.is_greedy() {
        argmax(&x)
    } else {
        draw(&x, max, params, u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_p, top_k, seed, ..SamplingParams::default() }
    }

    /// Deterministic pseudo-random logits in [-scale, scale).
    fn random_logits(n: usize, seed: u64, scale: f64) -> Vec<f32> {
        (0..n as u64).map(|i| ((uniform(seed, i) * 2.0 - 1.0) * scale) as f32).collect()
    }

    fn softmax(logits: &[f32], temperature: f64) -> Vec<f64> {
        let max = logits.iter().map(|&l| f64::from(l)).fold(f64::MIN, f64::max);
        let w: Vec<f64> = logits.iter().map(|&l| ((f64::from(l) - max) / temperature).exp()).collect();
        let s: f64 = w.iter().sum();
        w.iter().map(|v| v / s).collect()
    }

    /// Pearson chi-square of `n` draws (positions 0..n) against `expected`.
    /// Tokens with zero expected probability must never be drawn.
    fn chi_square(logits: &[f32], p: &SamplingParams, expected: &[f64], n: u64) -> f64 {
        let mut counts = vec![0u64; logits.len()];
        for pos in 0..n {
            counts[sample(logits, p, pos).token as usize] += 1;
        }
        let mut stat = 0.0;
        for (&c, &e) in counts.iter().zip(expected) {
            if e == 0.0 {
                assert_eq!(c, 0, "drew a token outside the support: {counts:?}");
            } else {
                let want = e * n as f64;
                stat += (c as f64 - want).powi(2) / want;
            }
        }
        stat
    }

    // 99.99th percentile of chi-square with 5 degrees of freedom is 25.7;
    // the draws are seeded, so this never flakes, and a wrong distribution
    // lands in the hundreds or thousands.
    const CHI2_BOUND_5DF: f64 = 26.0;
    const LOGITS6: [f32; 6] = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0];

    #[test]
    fn default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!(p.validate(10), Ok(()));
    }

    #[test]
    fn validate_rejects_bad_params() {
        let ok = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            top_k: 50,
            seed: 1,
            logprobs: MAX_LOGPROBS,
            ..SamplingParams::default()
        };
        assert_eq!(ok.validate(8), Ok(()));
        for t in [-0.1, f32::NAN, f32::INFINITY] {
            let p = SamplingParams { temperature: t, ..ok.clone() };
            assert!(matches!(p.validate(8), Err(SamplingError::InvalidTemperature(_))));
        }
        for top_p in [0.0, -0.5, 1.0001, f32::NAN] {
            let p = SamplingParams { top_p, ..ok.clone() };
            assert!(matches!(p.validate(8), Err(SamplingError::InvalidTopP(_))));
        }
        let p = SamplingParams { logprobs: 21, ..ok.clone() };
        assert_eq!(p.validate(8), Err(SamplingError::TooManyLogprobs(21)));
        assert_eq!(ok.validate(0), Err(SamplingError::EmptyVocabulary));
        let msg = SamplingParams { temperature: -1.0, ..ok.clone() }.validate(8).unwrap_err().to_string();
        assert_eq!(msg, "temperature must be a finite number >= 0, got -1");
        let msg = SamplingParams { top_p: 0.0, ..ok }.validate(8).unwrap_err().to_string();
        assert_eq!(msg, "top_p must be greater than 0 and at most 1, got 0");
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let n = 100_000u64;
        let mut buckets = [0u64; 16];
        let mut sum = 0.0;
        for pos in 0..n {
            let u = uniform(7, pos);
            assert!((0.0..1.0).contains(&u));
            buckets[(u * 16.0) as usize] += 1;
            sum += u;
        }
        assert!((sum / n as f64 - 0.5).abs() < 0.005);
        let want = n as f64 / 16.0;
        let stat: f64 = buckets.iter().map(|&c| (c as f64 - want).powi(2) / want).sum();
        // 99.99th percentile for 15 degrees of freedom is 42.
        assert!(stat < 42.0, "chi-square {stat}");
    }

    #[test]
    fn draws_differ_across_positions_and_seeds() {
        let mut seen = std::collections::BTreeSet::new();
        for seed in 0..16u64 {
            for pos in 0..1000u64 {
                assert!(seen.insert(uniform(seed, pos).to_bits()), "repeat at {seed}/{pos}");
            }
        }
        // Adjacent seeds are uncorrelated, not shifted copies of each other.
        assert_ne!(uniform(0, 1), uniform(1, 0));
        assert_ne!(uniform(0, 0), uniform(1, 0));

        let logits = vec![0.0f32; 32];
        let draws =
            |seed| -> Vec<u32> { (0..64).map(|pos| sample(&logits, &params(1.0, 1.0, 0, seed), pos).token).collect() };
        let a = draws(1);
        assert_ne!(a, draws(2));
        let distinct: std::collections::BTreeSet<_> = a.iter().collect();
        assert!(distinct.len() > 16, "{a:?}");
    }

    #[test]
    fn sampling_is_deterministic() {
        let logits = random_logits(1000, 3, 4.0);
        let p = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
            seed: 12345,
            logprobs: 5,
            ..SamplingParams::default()
        };
        for pos in 0..50 {
            let a = sample(&logits, &p, pos);
            let b = sample(&logits.clone(), &p.clone(), pos);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn greedy_takes_argmax_with_lowest_id_on_ties() {
        let p = SamplingParams::default();
        assert_eq!(sample(&[0.1, 3.0, -2.0, 3.0], &p, 0).token, 1);
        assert_eq!(sample(&[-0.0, 0.0], &p, 0).token, 0);
        assert_eq!(sample(&[5.0], &p, 9).token, 0);
        let logits = random_logits(4096, 11, 10.0);
        let best = (0..logits.len()).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap();
        for pos in 0..10 {
            assert_eq!(sample(&logits, &p, pos).token as usize, best);
        }
    }

    #[test]
    fn frequencies_match_softmax() {
        let p = params(1.0, 1.0, 0, 2024);
        let expected = softmax(&LOGITS6, 1.0);
        let stat = chi_square(&LOGITS6, &p, &expected, 50_000);
        assert!(stat < CHI2_BOUND_5DF, "chi-square {stat}");
        // The same draws are far from a wrong distribution.
        let uniform6 = vec![1.0 / 6.0; 6];
        assert!(chi_square(&LOGITS6, &p, &uniform6, 50_000) > 1000.0);
    }

    #[test]
    fn temperature_scales_the_distribution() {
        for temperature in [0.5f32, 2.0] {
            let p = params(temperature, 1.0, 0, 99);
            let expected = softmax(&LOGITS6, f64::from(temperature));
            let stat = chi_square(&LOGITS6, &p, &expected, 50_000);
            assert!(stat < CHI2_BOUND_5DF, "T={temperature}: chi-square {stat}");
        }
        // A very low temperature is greedy in practice; a huge one is near uniform.
        for pos in 0..200 {
            assert_eq!(sample(&LOGITS6, &params(1e-4, 1.0, 0, 5), pos).token, 0);
        }
        let stat = chi_square(&LOGITS6, &params(1e6, 1.0, 0, 5), &[1.0 / 6.0; 6], 30_000);
        assert!(stat < CHI2_BOUND_5DF, "chi-square {stat}");
    }

    #[test]
    fn top_k_and_top_p_restrict_and_renormalise() {
        // Probabilities 0.4, 0.25, 0.15, 0.1, 0.06, 0.04.
        let probs = [0.4f64, 0.25, 0.15, 0.1, 0.06, 0.04];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let renorm = |keep: usize| -> Vec<f64> {
            let mass: f64 = probs[..keep].iter().sum();
            (0..6).map(|i| if i < keep { probs[i] / mass } else { 0.0 }).collect()
        };
        // 3 kept: 2 degrees of freedom, 99.99th percentile 18.4.
        let stat = chi_square(&logits, &params(1.0, 1.0, 3, 17), &renorm(3), 30_000);
        assert!(stat < 19.0, "top_k: chi-square {stat}");
        // 0.4 + 0.25 = 0.65 < 0.7, so the nucleus needs the third token.
        let stat = chi_square(&logits, &params(1.0, 0.7, 0, 18), &renorm(3), 30_000);
        assert!(stat < 19.0, "top_p: chi-square {stat}");
        // top-p applies to what top-k left: 0.7 of {0.4, 0.25} needs both.
        let stat = chi_square(&logits, &params(1.0, 0.7, 2, 19), &renorm(2), 30_000);
        // 1 degree of freedom, 99.99th percentile 15.1.
        assert!(stat < 16.0, "top_k+top_p: chi-square {stat}");
        // The nucleus keeps the smallest prefix reaching top_p.
        for pos in 0..500 {
            assert!(sample(&logits, &params(1.0, 0.5, 0, 20), pos).token <= 1);
            assert_eq!(sample(&logits, &params(1.0, 0.3, 0, 20), pos).token, 0);
        }
    }

    #[test]
    fn filters_that_keep_everything_change_nothing() {
        let logits = random_logits(300, 21, 3.0);
        for pos in 0..200 {
            let plain = sample(&logits, &params(0.9, 1.0, 0, 8), pos).token;
            assert_eq!(sample(&logits, &params(0.9, 1.0, 300, 8), pos).token, plain);
            assert_eq!(sample(&logits, &params(0.9, 1.0, 5000, 8), pos).token, plain);
        }
    }

    #[test]
    fn top_k_one_equals_greedy() {
        for seed in 0..20u64 {
            let logits = random_logits(2000, seed, 5.0);
            let greedy = sample(&logits, &SamplingParams::default(), 0).token;
            for pos in 0..20 {
                let p = params(1.5, 1.0, 1, seed);
                assert_eq!(sample(&logits, &p, pos).token, greedy);
            }
        }
        // Ties keep the lowest id, as greedy does.
        let tied = [1.0f32, 4.0, 4.0, 0.0];
        for pos in 0..50 {
            assert_eq!(sample(&tied, &params(1.0, 1.0, 1, 3), pos).token, 1);
        }
    }

    #[test]
    fn tiny_top_p_equals_greedy() {
        for seed in 0..20u64 {
            let logits = random_logits(2000, seed + 100, 5.0);
            let greedy = sample(&logits, &SamplingParams::default(), 0).token;
            for pos in 0..20 {
                let p = params(1.0, 1e-6, 0, seed);
                assert_eq!(sample(&logits, &p, pos).token, greedy);
            }
        }
        let tied = [1.0f32, 4.0, 4.0, 0.0];
        for pos in 0..50 {
            assert_eq!(sample(&tied, &params(1.0, 1e-6, 0, 3), pos).token, 1);
        }
    }

    #[test]
    fn logprobs_cover_the_vocab_and_ignore_sampling_settings() {
        let logits = [0.3f32, -1.2, 2.5, 2.5, 0.0, -7.0, 1.1, 0.9];
        let mut p = params(0.6, 0.8, 3, 4);
        p.logprobs = logits.len();
        for pos in 0..30 {
            let s = sample(&logits, &p, pos);
            assert_eq!(s.top.len(), logits.len());
            let total: f64 = s.top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
            assert!((total - 1.0).abs() < 1e-6, "sum {total}");
            // Descending, ties by lower id.
            assert_eq!(s.top[0].0, 2);
            assert_eq!(s.top[1].0, 3);
            for w in s.top.windows(2) {
                assert!(w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0));
            }
            // The chosen token's logprob is the unmodified one.
            let expected = softmax(&logits, 1.0)[s.token as usize].ln() as f32;
            assert!((s.logprob - expected).abs() < 1e-6);
            let listed = s.top.iter().find(|&&(id, _)| id == s.token).unwrap().1;
            assert_eq!(listed, s.logprob);
        }
        // Fewer alternatives than asked when the vocabulary is smaller.
        p.logprobs = 20;
        assert_eq!(sample(&logits, &p, 0).top.len(), logits.len());
        p.logprobs = 2;
        assert_eq!(sample(&logits, &p, 0).top.len(), 2);
        p.logprobs = 0;
        assert!(sample(&logits, &p, 0).top.is_empty());
    }

    #[test]
    fn nan_and_infinite_logits_never_panic() {
        let mut p = params(1.0, 0.9, 0, 1);
        p.logprobs = 3;
        // NaN counts as -inf.
        let logits = [f32::NAN, 1.0, f32::NAN, f32::NEG_INFINITY];
        for pos in 0..100 {
            let s = sample(&logits, &p, pos);
            assert_eq!(s.token, 1);
            assert_eq!(s.logprob, 0.0);
            assert_eq!(s.top[0], (1, 0.0));
            assert_eq!(s.top[1], (0, f32::NEG_INFINITY));
        }
        assert_eq!(sample(&logits, &SamplingParams::default(), 0).token, 1);

        // Nothing usable: token 0, logprob -inf.
        for bad in [vec![f32::NAN; 5], vec![f32::NEG_INFINITY; 5], vec![f32::NAN, f32::NEG_INFINITY], vec![]] {
            for q in [p.clone(), SamplingParams::default()] {
                let s = sample(&bad, &q, 3);
                assert_eq!(s.token, 0);
                assert_eq!(s.logprob, f32::NEG_INFINITY);
                assert!(s.top.iter().all(|&(_, lp)| lp == f32::NEG_INFINITY));
            }
        }

        // +inf logits share all the mass.
        let logits = [0.0f32, f32::INFINITY, 5.0, f32::INFINITY, f32::NAN];
        let mut counts = [0u32; 5];
        for pos in 0..1000 {
            let s = sample(&logits, &params(1.0, 1.0, 0, 2), pos);
            assert!((s.logprob - 0.5f32.ln()).abs() < 1e-6);
            counts[s.token as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2] + counts[4], 0);
        assert!(counts[1] > 400 && counts[3] > 400, "{counts:?}");
        assert_eq!(sample(&logits, &SamplingParams::default(), 0).token, 1);

        // Extreme but finite logits and temperatures stay finite.
        let logits = [f32::MAX, f32::MIN, 0.0, f32::MAX];
        for t in [f32::MIN_POSITIVE, 1e-30, 1.0, 1e30, f32::MAX] {
            let s = sample(&logits, &params(t, 0.5, 2, 6), 0);
            assert!(s.token == 0 || s.token == 3);
            assert!(!s.logprob.is_nan());
        }
    }

    #[test]
    fn unvalidated_params_still_give_a_token() {
        let logits = random_logits(64, 5, 2.0);
        let greedy = sample(&logits, &SamplingParams::default(), 0).token;
        // Non-positive or NaN temperature is greedy, and so is a nucleus of
        // no mass.
        for (t, top_p) in [(f32::NAN, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, -3.0)] {
            let s = sample(&logits, &params(t, top_p, 0, 1), 0);
            assert_eq!(s.token, greedy, "t={t} top_p={top_p}");
        }
        // NaN or oversized top_p and infinite temperature keep every token.
        for (t, top_p) in [(1.0, f32::NAN), (1.0, 1.5), (f32::INFINITY, 1.0)] {
            let s = sample(&logits, &params(t, top_p, 0, 1), 0);
            assert!((s.token as usize) < logits.len());
        }
    }
    #[test]
    fn the_history_gives_the_row_the_tokens_give_to_the_bit() {
        for seed in 0..40u64 {
            let vocab = 64;
            let pick = |n: u64, salt: u64| -> Vec<u32> {
                (0..n).map(|i| (uniform(seed ^ salt, i) * vocab as f64) as u32 % (vocab as u32 - 4)).collect()
            };
            let prompt = pick(1 + seed % 30, 1);
            let output = pick(seed % 17, 2);
            let params = SamplingParams {
                logit_bias: vec![(1, 2.5), (9, -100.0)],
                frequency_penalty: [0.0, 0.5, -1.25][seed as usize % 3],
                presence_penalty: [0.0, 1.5][seed as usize % 2],
                repetition_penalty: [1.0, 1.3, 0.7][seed as usize % 3],
                ..SamplingParams::default()
            };
            let logits = random_logits(vocab, seed, 4.0);
            let (mut a, mut b) = (logits.clone(), logits);
            adjust_logits(&mut a, &params, &prompt, &output);
            adjust_logits_from_history(&mut b, &params, &token_history(&prompt, &output));
            let bits = |r: &[f32]| r.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "seed {seed}");
        }
    }

    #[test]
    fn logit_bias_and_penalties_follow_their_definitions() {
        let p = SamplingParams {
            logit_bias: vec![(0, 1.5)],
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut row = vec![1.0, 4.0, -2.0, 3.0, 5.0];
        // Prompt has 1 and 2; output has 3 twice and 2 once.
        adjust_logits(&mut row, &p, &[1, 2], &[3, 2, 3]);
        assert_eq!(row[0], 2.5, "bias only");
        assert_eq!(row[1], 2.0, "repetition divides a positive logit");
        assert_eq!(row[2], -4.0 - 0.5 - 0.25, "repetition multiplies a negative one, then one occurrence");
        assert_eq!(row[3], 1.5 - 2.0 * 0.5 - 0.25, "two occurrences");
        assert_eq!(row[4], 5.0, "unseen, unbiased");
        assert!(!SamplingParams::default().adjusts_logits());
    }

    #[test]
    fn min_p_one_keeps_only_the_best_and_bad_values_are_refused() {
        let logits = random_logits(64, 5, 2.0);
        let greedy = sample(&logits, &SamplingParams::default(), 0).token;
        for seed in 0..50 {
            let p = SamplingParams { temperature: 1.0, seed, min_p: 1.0, ..SamplingParams::default() };
            assert_eq!(sample(&logits, &p, seed).token, greedy);
        }
        let bad = [
            SamplingParams { min_p: 1.5, ..SamplingParams::default() },
            SamplingParams { repetition_penalty: 0.0, ..SamplingParams::default() },
            SamplingParams { frequency_penalty: 2.5, ..SamplingParams::default() },
            SamplingParams { logit_bias: vec![(3, 1.0), (3, 2.0)], ..SamplingParams::default() },
            SamplingParams { logit_bias: vec![(99, 1.0)], ..SamplingParams::default() },
            SamplingParams { logit_bias: vec![(1, 101.0)], ..SamplingParams::default() },
        ];
        for p in bad {
            assert!(p.validate(64).is_err(), "{p:?}");
        }
    }
}
