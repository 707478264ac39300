//! Speculative decoding on modelled devices: which drafts the target
//! accepts, what the draft head believes about them, and how a worker's
//! sampling items move through the decode steps of one event.
//!
//! A request's proposal after a step of length `at` holds one draft per
//! position. Draft `j`'s own acceptance probability `q_j` is drawn from a
//! Beta distribution with the scenario's mean `p_j` for that position (and a
//! spread: some drafts are near certain, some hopeless); it is accepted when
//! a uniform falls below `q_j`. The head's estimate is `q_j` plus Gaussian
//! noise, clamped to [0, 1]: what DSpark's confidence head (or the MTP
//! draft's own probability) tells the policy. Every draw is a function of
//! (seed, sequence, `at`, draft) alone, so the outcome does not depend on the
//! batch, the worker, a resend or a rebuild.
//!
//! The verification length comes from the engine's own policy
//! ([`choose_lengths`]) over the worker's sampling items, and the scheduler
//! completes the accepted tokens one by one as `Engine::verify` does.

use std::sync::atomic::{AtomicU64, Ordering};

use deepinfer_engine::cost::Efficiency;
use deepinfer_engine::speculative::policy::{choose_lengths, DraftPolicy, StepCost, MAX_DRAFT_TOKENS};
use deepinfer_engine::speculative::SpeculativeConfig;

use crate::sim::rng::mix64;

/// How a scenario's drafts are accepted.
#[derive(Clone, Debug, PartialEq)]
pub struct AcceptanceModel {
    /// Mean probability that draft `i` is accepted given draft `i − 1` was,
    /// per draft position; positions past the list take its last entry.
    pub acceptance: Vec<f64>,
    /// Spread of a draft's own probability around its position's mean, in
    /// [0, 1): its standard deviation as a share of the largest a mean of `p`
    /// allows, `√(p(1 − p))`. 0: every draft of a position is alike.
    pub spread: f64,
    /// Standard deviation of the draft head's estimate around the draft's own probability.
    pub confidence_noise: f64,
}

impl AcceptanceModel {
    /// Mean conditional acceptance of draft position `j` (from 0).
    pub fn mean(&self, j: usize) -> f64 {
        let last = self.acceptance.last().copied().unwrap_or(0.0);
        self.acceptance.get(j).copied().unwrap_or(last).clamp(0.0, 1.0)
    }
}

/// Speculative decoding of a modelled cluster: the engine's configuration
/// (method, most drafts, fixed or adaptive) and the acceptance model.
#[derive(Clone, Debug, PartialEq)]
pub struct Drafting {
    pub config: SpeculativeConfig,
    pub acceptance: AcceptanceModel,
}

/// Counters of the drafting a modelled cluster did, as its schedulers completed it.
#[derive(Debug, Default)]
pub struct DraftCounters {
    /// Request-steps of decoding requests (with or without drafts).
    pub decode_steps: AtomicU64,
    /// Drafts proposed after a step for requests still running.
    pub proposed: AtomicU64,
    /// Request-steps that verified at least one draft.
    pub verifications: AtomicU64,
    pub verified: AtomicU64,
    pub accepted: AtomicU64,
    /// Tokens the verifications produced (accepted drafts plus the target's own).
    pub verification_tokens: AtomicU64,
    /// Verifications by number of drafts verified (index 0 unused).
    pub by_length: [AtomicU64; MAX_DRAFT_TOKENS + 1],
}

/// A plain copy of [`DraftCounters`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DraftTotals {
    pub decode_steps: u64,
    pub proposed: u64,
    pub verifications: u64,
    pub verified: u64,
    pub accepted: u64,
    pub verification_tokens: u64,
    pub by_length: Vec<u64>,
}

impl DraftCounters {
    pub fn totals(&self) -> DraftTotals {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DraftTotals {
            decode_steps: get(&self.decode_steps),
            proposed: get(&self.proposed),
            verifications: get(&self.verifications),
            verified: get(&self.verified),
            accepted: get(&self.accepted),
            verification_tokens: get(&self.verification_tokens),
            by_length: self.by_length.iter().map(get).collect(),
        }
    }

    /// One decoding request-step that verified `drafts`, of which `accepted`,
    /// producing `tokens`.
    pub fn record(&self, drafts: usize, accepted: usize, tokens: usize) {
        let add = |a: &AtomicU64, n: usize| a.fetch_add(n as u64, Ordering::Relaxed);
        add(&self.decode_steps, 1);
        if drafts > 0 {
            add(&self.verifications, 1);
            add(&self.verified, drafts);
            add(&self.accepted, accepted);
            add(&self.verification_tokens, tokens);
            add(&self.by_length[drafts.min(MAX_DRAFT_TOKENS)], 1);
        }
    }

    pub fn propose(&self, drafts: usize) {
        self.proposed.fetch_add(drafts as u64, Ordering::Relaxed);
    }
}

/// Counter-based draws for one draft of one proposal.
struct Draws {
    key: u64,
    next: u64,
}

const TRUTH: u64 = 1;
const ESTIMATE: u64 = 2;
const ACCEPT: u64 = 3;

impl Draws {
    fn new(seed: u64, stream: u64, seq: u64, at: usize, j: usize) -> Self {
        let key = mix64(seed ^ mix64(stream ^ mix64(seq ^ mix64(((at as u64) << 5) ^ j as u64))));
        Self { key, next: 0 }
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        self.next += 1;
        let bits = mix64(self.key.wrapping_add(self.next.wrapping_mul(0x9e37_79b9_7f4a_7c15))) >> 11;
        (bits as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Marsaglia's polar method).
    fn normal(&mut self) -> f64 {
        for _ in 0..64 {
            let (u, v) = (2.0 * self.uniform() - 1.0, 2.0 * self.uniform() - 1.0);
            let s = u * u + v * v;
            if s > 0.0 && s < 1.0 {
                return u * (-2.0 * s.ln() / s).sqrt();
            }
        }
        0.0
    }

    /// Gamma(`shape`, 1) (Marsaglia and Tsang; below shape 1, boosted).
    fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let boost = self.uniform().powf(1.0 / shape);
            return self.gamma(shape + 1.0) * boost;
        }
        let a = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * a).sqrt();
        // Rejections are rare (under 5% at shape 1); the cap only bounds the loop.
        for _ in 0..64 {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.uniform();
            if u < 1.0 - 0.0331 * x.powi(4) || u.ln() < 0.5 * x * x + a * (1.0 - v + v.ln()) {
                return a * v;
            }
        }
        shape
    }
}

impl Drafting {
    /// Most drafts one request proposes and verifies.
    pub fn max_drafts(&self) -> usize {
        self.config.max_drafts()
    }

    /// Draft `j`'s own acceptance probability in the proposal after length `at`.
    pub fn truth(&self, seed: u64, seq: u64, at: usize, j: usize) -> f64 {
        let p = self.acceptance.mean(j);
        let spread = self.acceptance.spread.clamp(0.0, 0.999);
        if p <= 0.0 || p >= 1.0 || spread <= 0.0 {
            return p;
        }
        // Beta with mean p and variance spread² · p(1 − p).
        let k = 1.0 / (spread * spread) - 1.0;
        let mut d = Draws::new(seed, TRUTH, seq, at, j);
        let x = d.gamma(p * k);
        let y = d.gamma((1.0 - p) * k);
        if x + y > 0.0 {
            x / (x + y)
        } else {
            p
        }
    }

    /// What the draft head estimates for draft `j` whose own probability is `q`.
    pub fn estimate(&self, seed: u64, seq: u64, at: usize, j: usize, q: f64) -> f64 {
        let sigma = self.acceptance.confidence_noise;
        if sigma <= 0.0 {
            return q;
        }
        (q + sigma * Draws::new(seed, ESTIMATE, seq, at, j).normal()).clamp(0.0, 1.0)
    }

    /// Whether the target accepts draft `j` whose own probability is `q`.
    pub fn accepts(&self, seed: u64, seq: u64, at: usize, j: usize, q: f64) -> bool {
        Draws::new(seed, ACCEPT, seq, at, j).uniform() < q
    }
}

/// The engine scheduler's draft limits that a worker can know: the context,
/// the window ring, and (prefix cache on) block ends. `max_tokens` is not
/// among them: where it cuts, the scheduler clamps, and the request ends
/// with that step either way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftLimits {
    pub context: usize,
    pub window: usize,
    /// Positions per prefix block when the prefix cache is on.
    pub block_tokens: Option<usize>,
}

impl DraftLimits {
    /// Drafts a request may verify after a step ending at `to` (as `Scheduler::draft_allowance`).
    pub fn allowance(&self, most: usize, to: usize) -> usize {
        let a = most.min(self.context.saturating_sub(to + 1)).min(self.window);
        match self.block_tokens {
            Some(bt) if to.is_multiple_of(bt) => 0,
            Some(bt) => a.min((to / bt + 1) * bt - to - 1),
            None => a,
        }
    }
}

/// One sampling item of a worker's step, followed through the event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    pub seq: u64,
    /// The item feeds `[from, to)` and samples at `to`.
    pub from: usize,
    pub to: usize,
    /// Drafts the scheduler allows in the event's first step.
    pub allowance: usize,
    /// The request has a proposal to verify in the first step.
    pub proposal: bool,
}

/// What one lane did in one decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaneStep {
    /// Tokens fed before the drafts, and where they start.
    pub from: usize,
    pub fed: usize,
    pub drafts: usize,
    pub accepted: usize,
}

/// The decode steps of one event: `steps[s][lane]`. Each step every lane
/// verifies the drafts the policy picks within its allowance and produces
/// `1 + accepted` tokens; a lane whose drafts were all accepted keeps them,
/// otherwise the accepted ones are fed again with its next step (the engine's
/// rollback). `cost` prices the step by tokens verified for the adaptive
/// policy; an MTP chain stops after the draft whose estimated survival falls
/// below `min_survival` (the engine's drafter).
pub fn run_event(
    drafting: &Drafting,
    seed: u64,
    lanes: &[Lane],
    repeat: usize,
    limits: DraftLimits,
    cost: &StepCost,
    min_survival: f64,
) -> Vec<Vec<LaneStep>> {
    let most = drafting.max_drafts();
    // The fixed policy reads only how many drafts there are, not the head's estimates.
    let adaptive = matches!(drafting.config.policy, DraftPolicy::Adaptive { .. });
    let mut at: Vec<(usize, usize)> = lanes.iter().map(|l| (l.from, l.to)).collect();
    let (mut truths, mut estimates) = (vec![Vec::new(); lanes.len()], vec![Vec::new(); lanes.len()]);
    let mut allowed = vec![0; lanes.len()];
    let mut steps = Vec::with_capacity(repeat);
    for s in 0..repeat {
        for (i, (l, &(_, to))) in lanes.iter().zip(&at).enumerate() {
            let (has, allowance) =
                if s == 0 { (l.proposal, l.allowance.min(most)) } else { (true, limits.allowance(most, to)) };
            allowed[i] = if has { allowance } else { 0 };
            let (q, e): (&mut Vec<f64>, &mut Vec<f64>) = (&mut truths[i], &mut estimates[i]);
            q.clear();
            e.clear();
            q.extend((0..allowed[i]).map(|j| drafting.truth(seed, l.seq, to, j)));
            if adaptive {
                e.extend(q.iter().enumerate().map(|(j, &q)| drafting.estimate(seed, l.seq, to, j, q)));
                if min_survival > 0.0 {
                    let chain = chain_length(e, min_survival);
                    q.truncate(chain);
                    e.truncate(chain);
                    allowed[i] = chain;
                }
            }
        }
        let believed = if adaptive { &estimates } else { &truths };
        let lengths = choose_lengths(drafting.config.policy, believed, &allowed, cost);
        let mut row = Vec::with_capacity(lanes.len());
        for (i, l) in lanes.iter().enumerate() {
            let (from, to) = at[i];
            let d = lengths[i];
            let a = (0..d).take_while(|&j| drafting.accepts(seed, l.seq, to, j, truths[i][j])).count();
            row.push(LaneStep { from, fed: to - from, drafts: d, accepted: a });
            at[i] = if d > 0 && a == d { (to + d, to + d + 1) } else { (to, to + 1 + a) };
        }
        steps.push(row);
    }
    steps
}

pub use deepinfer_engine::speculative::policy::SURVIVAL_WORTH_DRAFTING_MAX;

/// Drafts an MTP chain proposes: it stops after the first whose survival
/// (by the estimates) is below `min_survival`.
pub fn chain_length(estimates: &[f64], min_survival: f64) -> usize {
    let mut survival = 1.0;
    for (j, &p) in estimates.iter().enumerate() {
        survival *= p;
        if survival < min_survival {
            return j + 1;
        }
    }
    estimates.len()
}

/// The survival below which the engine's adaptive MTP chain stops: what one
/// more verified token costs relative to the step, at a batch of `requests`.
pub fn min_survival(cost: &StepCost, requests: usize) -> f64 {
    let b = requests.max(1);
    let step = cost.at(b);
    b as f64 * (cost.at(b + 1) - step) / step
}

/// A step cost for the policy from two priced points, the batch without
/// drafts and with `per_lane` drafts for each of `lanes`: kernel time and
/// all-to-all time grow linearly with the tokens and combine as the cost
/// model combines them. Tokens count as the policy counts them, one per
/// lane plus its drafts; times in seconds.
pub fn step_cost_between(
    lanes: usize,
    per_lane: usize,
    base: &deepinfer_engine::cost::StepCost,
    full: &deepinfer_engine::cost::StepCost,
    eff: &Efficiency,
) -> StepCost {
    let span = lanes * per_lane;
    let at = |d: usize| {
        let f = if span == 0 { 0.0 } else { d as f64 / span as f64 };
        let lerp = |a: f64, b: f64| a + (b - a) * f;
        let kernels = lerp(base.compute_us + base.memory_us, full.compute_us + full.memory_us);
        let network = lerp(base.network_us, full.network_us);
        (eff.total_us(kernels, network, base.overhead_us) * 1e-6).max(1e-9)
    };
    let stride = span.div_ceil(64).max(1);
    let mut points: Vec<(usize, f64)> = Vec::new();
    let mut d = 0;
    loop {
        let t = at(d);
        let t = points.last().map_or(t, |&(_, prev)| t.max(prev));
        points.push((lanes.max(1) + d, t));
        if d >= span {
            break;
        }
        d = (d + stride).min(span);
    }
    StepCost::from_points(points).unwrap_or_else(|_| StepCost::linear(1.0, 0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_engine::speculative::policy::expected_tokens;
    use deepinfer_engine::speculative::DraftMethod;

    fn drafting(policy: DraftPolicy, acceptance: Vec<f64>, spread: f64, noise: f64) -> Drafting {
        Drafting {
            config: SpeculativeConfig { method: DraftMethod::Dspark, policy },
            acceptance: AcceptanceModel { acceptance, spread, confidence_noise: noise },
        }
    }

    #[test]
    fn drawn_probabilities_have_the_scenario_means() {
        let p = vec![0.9, 0.6, 0.3];
        let d = drafting(DraftPolicy::Fixed(3), p.clone(), 0.5, 0.1);
        let n = 40_000;
        for (j, &want) in p.iter().enumerate() {
            let mean = (0..n).map(|s| d.truth(5, s, 100, j)).sum::<f64>() / n as f64;
            assert!((mean - want).abs() < 0.01, "position {j}: mean {mean:.4}, want {want}");
            let var = (0..n).map(|s| (d.truth(5, s, 100, j) - want).powi(2)).sum::<f64>() / n as f64;
            let want_var = 0.25 * want * (1.0 - want);
            assert!((var / want_var - 1.0).abs() < 0.1, "position {j}: variance {var:.4}, want {want_var:.4}");
            let accepted = (0..n).filter(|&s| d.accepts(5, s, 100, j, d.truth(5, s, 100, j))).count();
            assert!((accepted as f64 / n as f64 - want).abs() < 0.01, "position {j}: {accepted} of {n}");
        }
        // No spread: every draft of a position has its mean; past the list, the last entry.
        let flat = drafting(DraftPolicy::Fixed(3), p, 0.0, 0.0);
        assert_eq!(flat.truth(1, 2, 3, 1), 0.6);
        assert_eq!(flat.truth(1, 2, 3, 7), 0.3);
        assert_eq!(flat.estimate(1, 2, 3, 1, 0.6), 0.6);
    }

    #[test]
    fn a_fixed_event_yields_the_expected_acceptance_length() {
        let p = vec![0.85, 0.75, 0.65];
        let d = drafting(DraftPolicy::Fixed(3), p.clone(), 0.5, 0.1);
        let limits = DraftLimits { context: 1 << 20, window: 126, block_tokens: None };
        let lanes: Vec<Lane> =
            (0..500).map(|s| Lane { seq: s, from: 99, to: 100, allowance: 3, proposal: true }).collect();
        let steps = run_event(&d, 3, &lanes, 16, limits, &StepCost::linear(1.0, 0.0), 0.0);
        let (mut verifications, mut tokens) = (0, 0);
        for (s, row) in steps.iter().enumerate() {
            for (l, st) in row.iter().enumerate() {
                assert_eq!(st.drafts, 3);
                assert!(st.accepted <= 3);
                verifications += 1;
                tokens += 1 + st.accepted;
                // A lane continues where its last step left it.
                if s > 0 {
                    let prev = steps[s - 1][l];
                    let to = prev.from + prev.fed;
                    if prev.accepted == prev.drafts {
                        assert_eq!((st.from, st.fed), (to + prev.drafts, 1));
                    } else {
                        assert_eq!((st.from, st.fed), (to, 1 + prev.accepted));
                    }
                }
            }
        }
        let length = tokens as f64 / verifications as f64;
        let want = expected_tokens(&p, 3);
        assert!((length - want).abs() < 0.03, "acceptance length {length:.3}, model {want:.3}");
        // The same inputs give the same event.
        assert_eq!(run_event(&d, 3, &lanes, 16, limits, &StepCost::linear(1.0, 0.0), 0.0), steps);
    }

    #[test]
    fn the_adaptive_policy_skips_drafts_the_head_doubts_when_they_cost() {
        let p = vec![0.85, 0.75, 0.65, 0.55, 0.45];
        let limits = DraftLimits { context: 1 << 20, window: 126, block_tokens: None };
        let lanes: Vec<Lane> =
            (0..64).map(|s| Lane { seq: s, from: 999, to: 1000, allowance: 5, proposal: true }).collect();
        // Each verified token costs a tenth of the fixed part of a step.
        let cost = StepCost::linear(1.0, 0.1);
        let waste = |policy| {
            let steps = run_event(&drafting(policy, p.clone(), 0.5, 0.1), 9, &lanes, 32, limits, &cost, 0.0);
            let (v, a) = steps.iter().flatten().fold((0, 0), |(v, a), s| (v + s.drafts, a + s.accepted));
            1.0 - a as f64 / v as f64
        };
        let (fixed, adaptive) = (waste(DraftPolicy::Fixed(5)), waste(DraftPolicy::Adaptive { max: 5 }));
        assert!(adaptive < 0.8 * fixed, "wasted verification: fixed {fixed:.3}, adaptive {adaptive:.3}");
    }

    #[test]
    fn an_mtp_chain_stops_where_its_survival_cannot_pay() {
        assert_eq!(chain_length(&[0.9, 0.8, 0.4, 0.9], 0.3), 3);
        assert_eq!(chain_length(&[0.9, 0.8, 0.5, 0.9], 0.3), 4);
        assert_eq!(chain_length(&[0.9, 0.8], 0.3), 2);
        assert_eq!(chain_length(&[0.1, 0.9], 0.3), 1);
        // One more token costs a tenth of a 10-request step: 10 · 0.1 / 2.0.
        assert!((min_survival(&StepCost::linear(1.0, 0.1), 10) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn limits_follow_the_engine_scheduler() {
        let l = DraftLimits { context: 1000, window: 6, block_tokens: Some(512) };
        assert_eq!(l.allowance(5, 100), 5);
        assert_eq!(l.allowance(8, 100), 6);
        assert_eq!(l.allowance(5, 509), 2);
        assert_eq!(l.allowance(5, 512), 0);
        assert_eq!(l.allowance(5, 997), 2);
        let off = DraftLimits { block_tokens: None, ..l };
        assert_eq!(off.allowance(5, 511), 5);
    }

    #[test]
    fn a_step_cost_between_two_points_combines_kernels_and_all_to_all_as_the_cost_model_does() {
        let c = |kernels_us: f64, network_us: f64| deepinfer_engine::cost::StepCost {
            compute_us: kernels_us,
            memory_us: 0.0,
            network_us,
            overhead_us: 100.0,
            total_us: 0.0,
        };
        let hidden = Efficiency { overlap: 1.0, ..Efficiency::default() };
        // Network-bound until the kernel line crosses it halfway.
        let cost = step_cost_between(10, 4, &c(100.0, 300.0), &c(500.0, 300.0), &hidden);
        assert!((cost.at(10) - 400e-6).abs() < 1e-12);
        assert!((cost.at(30) - 400e-6).abs() < 1e-12);
        assert!((cost.at(50) - 600e-6).abs() < 1e-12);
        // Nothing hidden: the two add up.
        let serial = Efficiency { overlap: 0.0, ..Efficiency::default() };
        let cost = step_cost_between(10, 4, &c(100.0, 300.0), &c(500.0, 300.0), &serial);
        assert!((cost.at(30) - 700e-6).abs() < 1e-12);
        assert_eq!(step_cost_between(3, 0, &c(1.0, 1.0), &c(1.0, 1.0), &serial).at(3), 102e-6);
    }
}
