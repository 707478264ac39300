//! How many draft tokens each request verifies in a step.
//!
//! Draft `i` of a request counts only if every draft before it was accepted,
//! so it yields a token with the survival probability `S_i = p_1 · … · p_i`,
//! and the target always yields one token more (the correction or the bonus).
//! A draft is worth verifying when the tokens it is expected to add pay for
//! the time it adds to the step, and a step's time depends only on how many
//! tokens the whole batch verifies ([`StepCost`]).
//!
//! Pure functions of their inputs: no clock, no hashing, ties broken by
//! request index, so a batch gets the same lengths wherever it is planned.

/// Most drafts one request verifies in one step; longer drafts and larger
/// limits are cut to it.
pub const MAX_DRAFT_TOKENS: usize = 16;
/// A draft head's estimate rarely exceeds this; when verifying one more
/// token needs a higher survival to pay off, the adaptive policy drafts nothing
/// (the engine and the simulator's modelled workers alike).
pub const SURVIVAL_WORTH_DRAFTING_MAX: f64 = 0.95;
/// Most points a [`StepCost`] holds: one per token count up to 4096.
pub const MAX_COST_POINTS: usize = 4096;

/// Why a [`StepCost`] was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    #[error("a step cost needs at least one point")]
    NoPoints,
    #[error("a step cost may hold at most {MAX_COST_POINTS} points, got {0}")]
    TooManyPoints(usize),
    #[error("step cost point {index}: token counts must be at least 1 and strictly increase, got {tokens}")]
    TokensNotIncreasing { index: usize, tokens: usize },
    #[error("step cost point {index}: time must be finite and greater than 0, got {time_s}")]
    InvalidTime { index: usize, time_s: f64 },
    #[error("step cost point {index}: time {time_s} is less than the previous point's")]
    TimeDecreasing { index: usize, time_s: f64 },
}

/// Measured (or modelled) time of one verification step as a function of the
/// tokens the batch verifies (each request contributes 1 + its drafts).
/// Piecewise linear through sorted points, extended past the last with the
/// last segment's slope (flat for a single point) and held at the first
/// point's time below it, so it is positive and non-decreasing everywhere.
#[derive(Debug, Clone, PartialEq)]
pub struct StepCost {
    /// (verified tokens, step time), tokens strictly increasing from 1 or more.
    points: Vec<(usize, f64)>,
    /// Seconds each token adds past the last point.
    tail_per_token_s: f64,
}

impl StepCost {
    /// A cost through `points` of (verified tokens, step seconds): tokens at
    /// least 1 and strictly increasing, times finite, positive and
    /// non-decreasing, at most [`MAX_COST_POINTS`] points.
    pub fn from_points(points: Vec<(usize, f64)>) -> Result<Self, PolicyError> {
        if points.is_empty() {
            return Err(PolicyError::NoPoints);
        }
        if points.len() > MAX_COST_POINTS {
            return Err(PolicyError::TooManyPoints(points.len()));
        }
        for (index, &(tokens, time_s)) in points.iter().enumerate() {
            let previous = index.checked_sub(1).map(|i| points[i]);
            if tokens == 0 || previous.is_some_and(|(t, _)| t >= tokens) {
                return Err(PolicyError::TokensNotIncreasing { index, tokens });
            }
            if !(time_s.is_finite() && time_s > 0.0) {
                return Err(PolicyError::InvalidTime { index, time_s });
            }
            if previous.is_some_and(|(_, s)| s > time_s) {
                return Err(PolicyError::TimeDecreasing { index, time_s });
            }
        }
        let tail_per_token_s = match points[..] {
            [.., (t0, s0), (t1, s1)] => (s1 - s0) / (t1 - t0) as f64,
            _ => 0.0,
        };
        Ok(Self { points, tail_per_token_s })
    }

    /// `fixed_s + per_token_s × tokens` for one token or more.
    ///
    /// # Panics
    /// If either term is negative or not finite, or a one-token step would be free.
    pub fn linear(fixed_s: f64, per_token_s: f64) -> Self {
        assert!(fixed_s.is_finite() && fixed_s >= 0.0, "fixed step time {fixed_s} must be finite and >= 0");
        assert!(per_token_s.is_finite() && per_token_s >= 0.0, "per-token time {per_token_s} must be finite and >= 0");
        assert!(fixed_s + per_token_s > 0.0, "a step that verifies one token cannot take no time");
        Self { points: vec![(1, fixed_s + per_token_s)], tail_per_token_s: per_token_s }
    }

    /// Seconds a step that verifies `tokens` tokens takes.
    pub fn at(&self, tokens: usize) -> f64 {
        let after = self.points.partition_point(|&(t, _)| t <= tokens);
        let Some(&(t0, s0)) = after.checked_sub(1).map(|i| &self.points[i]) else {
            return self.points[0].1;
        };
        match self.points.get(after) {
            Some(&(t1, s1)) => s0 + (s1 - s0) * ((tokens - t0) as f64 / (t1 - t0) as f64),
            None => s0 + self.tail_per_token_s * (tokens - t0) as f64,
        }
    }
}

/// How many drafts each request verifies this step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftPolicy {
    /// No speculation: every request verifies only its own next token.
    Off,
    /// The same number of drafts for every request that has them.
    Fixed(usize),
    /// The lengths that maximise the batch's expected tokens per second.
    Adaptive { max: usize },
}

/// Drafts each request verifies this step.
///
/// `acceptance[r]` holds the acceptance probabilities of request `r`'s drafts
/// in order (possibly none); `limit[r]` is the most drafts the scheduler lets
/// it verify. Each answer is at most `min(limit[r], acceptance[r].len(),`
/// [`MAX_DRAFT_TOKENS`]`)`. `Off` gives zeros and `Fixed(k)` takes `k` within
/// those bounds.
///
/// `Adaptive { max }` (also capping each request at `max`) maximises expected
/// tokens per second, `Σ_r (1 + S_r1 + … + S_rd_r) / cost.at(Σ_r (1 + d_r))`.
/// For a given total of drafts the best choice is the drafts of highest
/// survival, which are prefixes of each request's drafts because survival
/// never increases along a request; and the step time depends on the total
/// alone. So the drafts are ranked by survival (ties: lower request index,
/// then earlier draft) and every prefix of that ranking is scored: exact for
/// any non-decreasing cost, where stopping at the first prefix whose rate
/// falls would be exact only for a linear or convex one. Equal rates keep
/// fewer drafts.
///
/// Probabilities are clamped to [0, 1], NaN read as 0.
///
/// # Panics
/// If `limit` and `acceptance` differ in length.
pub fn choose_lengths(policy: DraftPolicy, acceptance: &[Vec<f64>], limit: &[usize], cost: &StepCost) -> Vec<usize> {
    assert_eq!(acceptance.len(), limit.len(), "one draft limit per request");
    let available = |r: usize| limit[r].min(acceptance[r].len()).min(MAX_DRAFT_TOKENS);
    let requests = acceptance.len();
    match policy {
        DraftPolicy::Off => vec![0; requests],
        DraftPolicy::Fixed(k) => (0..requests).map(|r| available(r).min(k)).collect(),
        DraftPolicy::Adaptive { max } => {
            let caps: Vec<usize> = (0..requests).map(|r| available(r).min(max)).collect();
            best_rate_lengths(acceptance, &caps, cost)
        }
    }
}

/// The adaptive choice of [`choose_lengths`] with each request `r` allowed
/// `caps[r]` drafts.
fn best_rate_lengths(acceptance: &[Vec<f64>], caps: &[usize], cost: &StepCost) -> Vec<usize> {
    let requests = acceptance.len();
    if requests == 0 {
        return Vec::new();
    }
    // Every draft that may be verified as (survival, request). The stable sort
    // keeps a request's equal survivals in draft order.
    let mut ranked: Vec<(f64, usize)> = Vec::new();
    for (r, probs) in acceptance.iter().enumerate() {
        ranked.extend(survival(&probs[..caps[r]]).into_iter().map(|s| (s, r)));
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));

    let mut expected_tokens = requests as f64;
    let mut best_rate = expected_tokens / cost.at(requests);
    let mut best_drafts = 0;
    for (i, &(s, _)) in ranked.iter().enumerate() {
        expected_tokens += s;
        let rate = expected_tokens / cost.at(requests + i + 1);
        if rate > best_rate {
            best_rate = rate;
            best_drafts = i + 1;
        }
    }
    let mut lengths = vec![0; requests];
    for &(_, r) in &ranked[..best_drafts] {
        lengths[r] += 1;
    }
    lengths
}

/// The survival a draft needs to be worth making at a batch of `running`
/// requests: with the adaptive policy, a chain stops at the first draft
/// whose survival is below what it costs relative to the step, that is one
/// more verified token and (MTP) one request's share of a chain step. Adding
/// a draft with survival S to a step of b tokens pays exactly when
/// (b + S) / (step + cost) > b / step. Other policies draft whatever the
/// survival (0).
pub fn min_survival(policy: DraftPolicy, running: usize, step_cost: &StepCost, draft_cost: Option<&StepCost>) -> f64 {
    match policy {
        DraftPolicy::Adaptive { .. } => {
            let b = running.max(1);
            let step = step_cost.at(b);
            let verify_s = step_cost.at(b + 1) - step;
            let draft_s = draft_cost.map_or(0.0, |cost| cost.at(b) / b as f64);
            b as f64 * (verify_s + draft_s) / step
        }
        _ => 0.0,
    }
}

/// A probability as the policy reads it: clamped to [0, 1], NaN (and -0) as 0.
fn clamp_probability(p: f64) -> f64 {
    if p > 0.0 {
        p.min(1.0)
    } else {
        0.0
    }
}

/// Survival `S_i = p_1 · … · p_i`: the probability that drafts 1..=i are all
/// accepted. Never increases along the drafts.
pub fn survival(acceptance: &[f64]) -> Vec<f64> {
    let mut s = 1.0;
    acceptance
        .iter()
        .map(|&p| {
            s *= clamp_probability(p);
            s
        })
        .collect()
}

/// Expected tokens from verifying the first `drafts` drafts: `1 + Σ_{i<d} S_i`.
///
/// # Panics
/// If `drafts` exceeds `acceptance.len()`.
pub fn expected_tokens(acceptance: &[f64], drafts: usize) -> f64 {
    assert!(drafts <= acceptance.len(), "{drafts} drafts but {} acceptance probabilities", acceptance.len());
    1.0 + survival(&acceptance[..drafts]).iter().sum::<f64>()
}

/// Logistic function of a confidence logit without overflow at either end;
/// NaN reads as 0, no confidence.
pub fn sigmoid(logit: f32) -> f64 {
    let x = f64::from(logit);
    if x.is_nan() {
        0.0
    } else if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::uniform;

    fn adaptive(acceptance: &[Vec<f64>], cost: &StepCost) -> Vec<usize> {
        let limit = vec![MAX_DRAFT_TOKENS; acceptance.len()];
        choose_lengths(DraftPolicy::Adaptive { max: MAX_DRAFT_TOKENS }, acceptance, &limit, cost)
    }

    /// Expected tokens per second of `lengths`, summed per request.
    fn rate(acceptance: &[Vec<f64>], lengths: &[usize], cost: &StepCost) -> f64 {
        let expected: f64 = acceptance.iter().zip(lengths).map(|(a, &d)| expected_tokens(a, d)).sum();
        expected / cost.at(lengths.iter().map(|d| 1 + d).sum())
    }

    #[test]
    fn off_and_fixed_respect_limits_and_available_drafts() {
        let acceptance = vec![vec![0.9; 5], vec![], vec![0.5; 2], vec![0.99; 40]];
        let limit = [3, 4, 4, 100];
        let cost = StepCost::linear(1.0, 0.01);
        assert_eq!(choose_lengths(DraftPolicy::Off, &acceptance, &limit, &cost), [0, 0, 0, 0]);
        assert_eq!(choose_lengths(DraftPolicy::Fixed(4), &acceptance, &limit, &cost), [3, 0, 2, 4]);
        assert_eq!(choose_lengths(DraftPolicy::Fixed(0), &acceptance, &limit, &cost), [0, 0, 0, 0]);
        // A request never verifies more than MAX_DRAFT_TOKENS drafts.
        assert_eq!(choose_lengths(DraftPolicy::Fixed(usize::MAX), &acceptance, &limit, &cost), [3, 0, 2, 16]);
        let adaptive = choose_lengths(DraftPolicy::Adaptive { max: 2 }, &acceptance, &limit, &cost);
        assert_eq!(adaptive, [2, 0, 2, 2]);
        assert!(choose_lengths(DraftPolicy::Adaptive { max: 8 }, &[], &[], &cost).is_empty());
    }

    #[test]
    fn adaptive_skips_drafts_that_cost_more_than_they_yield() {
        let acceptance = vec![vec![0.95, 0.9, 0.9], vec![0.99; 4], vec![0.8]];
        // Each verified token costs as much as a whole step: never worth it.
        assert_eq!(adaptive(&acceptance, &StepCost::linear(0.001, 1.0)), [0, 0, 0]);
        // Nearly free tokens: verify everything.
        assert_eq!(adaptive(&acceptance, &StepCost::linear(1.0, 1e-4)), [3, 4, 1]);
        // In between, the likelier drafts go first: the six best survivals
        // (0.99, 0.98, 0.97, 0.96, 0.95, 0.855) give 8.706 tokens in 6.4 s, and
        // the seventh (0.8) would lower the rate from 1.3603 to 1.3580.
        assert_eq!(adaptive(&acceptance, &StepCost::linear(1.0, 0.6)), [2, 4, 0]);
    }

    #[test]
    fn adaptive_ties_go_to_the_lower_request_index() {
        // Worth one draft of survival 0.5 (2.5/1.2 > 2/1) but not two (3/2 < 2.5/1.2).
        let cost = StepCost::from_points(vec![(2, 1.0), (3, 1.2), (4, 2.0)]).unwrap();
        assert_eq!(adaptive(&[vec![0.5], vec![0.5]], &cost), [1, 0]);
        assert_eq!(adaptive(&[vec![], vec![0.5], vec![0.5]], &StepCost::linear(1.0, 0.0)), [0, 1, 1]);
        // Equal rates keep fewer drafts: a certain draft costing exactly its worth.
        let cost = StepCost::from_points(vec![(1, 1.0), (2, 2.0)]).unwrap();
        assert_eq!(adaptive(&[vec![1.0]], &cost), [0]);
    }

    #[test]
    fn adaptive_looks_past_an_expensive_first_draft_when_cost_is_concave() {
        // The second verified token doubles the step; the next fourteen are free.
        // The first draft alone lowers the rate (1.9/2 < 1/1), the whole run
        // raises it (about 8.4/2), so stopping at the first drop would be wrong.
        let cost = StepCost::from_points(vec![(1, 1.0), (2, 2.0), (17, 2.0)]).unwrap();
        assert_eq!(adaptive(&[vec![0.9; 16]], &cost), [16]);
        assert!(rate(&[vec![0.9; 16]], &[16], &cost) > 4.0);
    }

    #[test]
    fn adaptive_follows_a_permutation_of_the_requests() {
        for case in 0..200u64 {
            let requests = 2 + (uniform(case, 0) * 6.0) as usize;
            let acceptance: Vec<Vec<f64>> = (0..requests as u64)
                .map(|r| {
                    let len = (uniform(case, 100 + r) * 9.0) as usize;
                    (0..len as u64).map(|i| 0.3 + 0.7 * uniform(case, 1000 + 100 * r + i)).collect()
                })
                .collect();
            let limit: Vec<usize> = (0..requests as u64).map(|r| (uniform(case, 200 + r) * 10.0) as usize).collect();
            let cost = StepCost::linear(1.0, 0.05 + 0.3 * uniform(case, 1));
            let policy = DraftPolicy::Adaptive { max: 2 + case as usize % 10 };
            let lengths = choose_lengths(policy, &acceptance, &limit, &cost);
            // A deterministic shuffle: order the requests by a hash of their index.
            let mut order: Vec<usize> = (0..requests).collect();
            order.sort_by(|&a, &b| uniform(case, 500 + a as u64).total_cmp(&uniform(case, 500 + b as u64)));
            let shuffled: Vec<Vec<f64>> = order.iter().map(|&r| acceptance[r].clone()).collect();
            let shuffled_limit: Vec<usize> = order.iter().map(|&r| limit[r]).collect();
            let shuffled_lengths = choose_lengths(policy, &shuffled, &shuffled_limit, &cost);
            for (i, &r) in order.iter().enumerate() {
                assert_eq!(shuffled_lengths[i], lengths[r], "case {case}: {lengths:?} vs {shuffled_lengths:?}");
            }
            assert_eq!(choose_lengths(policy, &acceptance, &limit, &cost), lengths);
        }
    }

    /// A cost through 1..=`len` tokens whose per-token increments are `slopes`.
    fn cost_from_increments(base_s: f64, slopes: &[f64]) -> StepCost {
        let mut points = vec![(1, base_s)];
        for (i, &slope) in slopes.iter().enumerate() {
            points.push((i + 2, points[i].1 + slope));
        }
        StepCost::from_points(points).unwrap()
    }

    #[test]
    fn adaptive_equals_the_exhaustive_optimum_on_small_batches() {
        let mut shapes_seen = [0usize; 4];
        for case in 0..3000u64 {
            let u = |i: u64| uniform(case, i);
            let requests = 1 + (u(0) * 3.0) as usize;
            let acceptance: Vec<Vec<f64>> = (0..requests as u64)
                .map(|r| {
                    let len = (u(10 + r) * 5.0) as usize;
                    // Some certain and some impossible drafts among the random ones.
                    (0..len as u64).map(|i| (u(100 + 10 * r + i) * 1.2 - 0.1).clamp(0.0, 1.0)).collect()
                })
                .collect();
            let limit: Vec<usize> = (0..requests as u64).map(|r| (u(20 + r) * 6.0) as usize).collect();
            let max = 1 + (u(1) * 5.0) as usize;
            let shape = case as usize % 4;
            shapes_seen[shape] += 1;
            let mut slopes: Vec<f64> = (0..20u64).map(|i| u(300 + i) * 0.6).collect();
            let cost = match shape {
                0 => StepCost::linear(u(2) * 2.0, u(3) * 0.8),
                // Concave: increments shrink.
                1 => {
                    slopes.sort_by(|a, b| b.total_cmp(a));
                    cost_from_increments(0.05 + u(2), &slopes)
                }
                // Convex: increments grow.
                2 => {
                    slopes.sort_by(f64::total_cmp);
                    cost_from_increments(0.05 + u(2), &slopes)
                }
                // Flat until a knee, then linear, as a memory-bound step turns compute-bound.
                _ => {
                    let knee = 1 + (u(4) * 8.0) as usize;
                    StepCost::from_points(vec![(knee, 1.0), (knee + 1, 1.0 + u(5))]).unwrap()
                }
            };
            let policy = DraftPolicy::Adaptive { max };
            let lengths = choose_lengths(policy, &acceptance, &limit, &cost);
            let caps: Vec<usize> = (0..requests).map(|r| limit[r].min(acceptance[r].len()).min(max)).collect();
            for (&d, &cap) in lengths.iter().zip(&caps) {
                assert!(d <= cap, "case {case}: {lengths:?} over {caps:?}");
            }
            // Every combination of lengths within the caps.
            let mut best = 0.0f64;
            let mut combo = vec![0usize; requests];
            loop {
                best = best.max(rate(&acceptance, &combo, &cost));
                let Some(r) = (0..requests).find(|&r| combo[r] < caps[r]) else { break };
                combo[r] += 1;
                combo[..r].iter_mut().for_each(|d| *d = 0);
            }
            let got = rate(&acceptance, &lengths, &cost);
            assert!(got >= best * (1.0 - 1e-12), "case {case} shape {shape}: {lengths:?} rate {got}, optimum {best}");
        }
        assert!(shapes_seen.iter().all(|&n| n >= 700));
    }

    #[test]
    fn probabilities_are_clamped_and_nan_is_zero() {
        assert_eq!(survival(&[0.5, f64::NAN, 0.5]), [0.5, 0.0, 0.0]);
        assert_eq!(survival(&[2.0, -1.0]), [1.0, 0.0]);
        assert_eq!(survival(&[f64::INFINITY, 0.5, f64::NEG_INFINITY]), [1.0, 0.5, 0.0]);
        assert_eq!(survival(&[]), Vec::<f64>::new());
        let cost = StepCost::linear(1.0, 1e-3);
        assert_eq!(adaptive(&[vec![f64::NAN, 0.9], vec![1.5, -0.0]], &cost), [0, 1]);
    }

    #[test]
    fn expected_tokens_sum_survivals() {
        let a = [0.8, 0.5, 0.25];
        assert_eq!(survival(&a), [0.8, 0.4, 0.1]);
        assert_eq!(expected_tokens(&a, 0), 1.0);
        assert!((expected_tokens(&a, 2) - 2.2).abs() < 1e-15);
        assert!((expected_tokens(&a, 3) - 2.3).abs() < 1e-15);
        assert_eq!(expected_tokens(&[1.0; 16], 16), 17.0);
    }

    #[test]
    fn sigmoid_is_finite_at_both_ends() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(f32::NAN), 0.0);
        assert_eq!(sigmoid(f32::MAX), 1.0);
        assert_eq!(sigmoid(f32::MIN), 0.0);
        assert!(sigmoid(-100.0) > 0.0 && sigmoid(-100.0) < 1e-43);
        for x in [-30.0f32, -2.5, -0.1, 0.1, 2.5, 30.0] {
            assert!((sigmoid(x) + sigmoid(-x) - 1.0).abs() < 1e-15, "{x}");
            assert!((sigmoid(x) - 1.0 / (1.0 + (-f64::from(x)).exp())).abs() < 1e-15, "{x}");
        }
    }

    #[test]
    fn step_cost_interpolates_and_extends() {
        let cost = StepCost::from_points(vec![(4, 1.0), (8, 2.0), (16, 2.0), (32, 6.0)]).unwrap();
        assert_eq!(cost.at(0), 1.0);
        assert_eq!(cost.at(1), 1.0);
        assert_eq!(cost.at(4), 1.0);
        assert_eq!(cost.at(6), 1.5);
        assert_eq!(cost.at(8), 2.0);
        assert_eq!(cost.at(12), 2.0);
        assert_eq!(cost.at(24), 4.0);
        assert_eq!(cost.at(32), 6.0);
        // Past the last point with the last slope, 0.25 s per token.
        assert_eq!(cost.at(40), 8.0);
        let single = StepCost::from_points(vec![(10, 3.0)]).unwrap();
        assert_eq!((single.at(1), single.at(10), single.at(1000)), (3.0, 3.0, 3.0));
        let linear = StepCost::linear(0.5, 0.25);
        for tokens in [1, 2, 7, 100] {
            assert_eq!(linear.at(tokens), 0.5 + 0.25 * tokens as f64);
        }
    }

    #[test]
    fn step_cost_refuses_bad_points() {
        use PolicyError::*;
        let from = StepCost::from_points;
        assert_eq!(from(vec![]), Err(NoPoints));
        assert_eq!(from(vec![(0, 1.0)]), Err(TokensNotIncreasing { index: 0, tokens: 0 }));
        assert_eq!(from(vec![(2, 1.0), (2, 1.0)]), Err(TokensNotIncreasing { index: 1, tokens: 2 }));
        assert_eq!(from(vec![(3, 1.0), (2, 1.0)]), Err(TokensNotIncreasing { index: 1, tokens: 2 }));
        assert_eq!(from(vec![(1, 0.0)]), Err(InvalidTime { index: 0, time_s: 0.0 }));
        assert_eq!(from(vec![(1, 1.0), (2, f64::INFINITY)]), Err(InvalidTime { index: 1, time_s: f64::INFINITY }));
        assert!(matches!(from(vec![(1, f64::NAN)]), Err(InvalidTime { index: 0, .. })));
        assert_eq!(from(vec![(1, 2.0), (2, 1.0)]), Err(TimeDecreasing { index: 1, time_s: 1.0 }));
        let many: Vec<(usize, f64)> = (1..=MAX_COST_POINTS + 1).map(|t| (t, t as f64)).collect();
        assert_eq!(from(many[..MAX_COST_POINTS].to_vec()).map(|c| c.at(MAX_COST_POINTS)), Ok(4096.0));
        assert_eq!(from(many), Err(TooManyPoints(MAX_COST_POINTS + 1)));
        assert_eq!(
            from(vec![(1, 2.0), (2, 1.0)]).unwrap_err().to_string(),
            "step cost point 1: time 1 is less than the previous point's"
        );
    }

    #[test]
    #[should_panic(expected = "cannot take no time")]
    fn a_free_linear_step_is_refused() {
        StepCost::linear(0.0, 0.0);
    }
}
