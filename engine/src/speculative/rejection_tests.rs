//! Statistical checks of the verifiers. Every draw is seeded, so a run is
//! reproducible; the bounds are set at significance 0.001 so that a correct
//! verifier passes and a biased one (see the negative controls) fails.

use super::*;
use crate::sampling::{mix64, sample, token_for_uniform, uniform, SAMPLING_STREAM};

/// Upper 0.001 quantile of the standard normal.
const Z_999: f64 = 3.090_232_306_167_813;
/// Binomial tolerance of an acceptance rate, in standard deviations.
const RATE_SIGMAS: f64 = 4.5;
/// Trials per statistical check.
const TRIALS: u64 = 40_000;

/// Upper 0.001 quantile of chi-square with `df` degrees of freedom by the
/// Wilson–Hilferty approximation, `df (1 − 2/(9 df) + z √(2/(9 df)))³`.
/// In this tail it errs high, so the test is slightly conservative: 3.1%
/// above the tables at 1 degree of freedom, under 1.2% from 5 on.
fn chi2_critical(df: usize) -> f64 {
    let k = df as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + Z_999 * a.sqrt()).powi(3)
}

/// A Pearson chi-square of observed counts against probabilities.
#[derive(Debug)]
struct ChiSquare {
    stat: f64,
    df: usize,
    /// Draws of categories whose probability is 0.
    outside_support: u64,
}

impl ChiSquare {
    fn of(counts: &[u64], probs: &[f64]) -> Self {
        assert_eq!(counts.len(), probs.len());
        let n: u64 = counts.iter().sum();
        let (mut stat, mut categories, mut outside_support) = (0.0, 0, 0);
        for (&c, &p) in counts.iter().zip(probs) {
            if p > 0.0 {
                let want = p * n as f64;
                stat += (c as f64 - want).powi(2) / want;
                categories += 1;
            } else {
                outside_support += c;
            }
        }
        Self { stat, df: categories.max(2) - 1, outside_support }
    }

    fn critical(&self) -> f64 {
        chi2_critical(self.df)
    }

    fn passes(&self) -> bool {
        self.outside_support == 0 && self.stat < self.critical()
    }

    fn report(&self, name: &str) -> String {
        format!(
            "{name}: chi2 {:.2} (df {}, critical {:.2} at 0.001), outside support {}",
            self.stat,
            self.df,
            self.critical(),
            self.outside_support
        )
    }
}

/// Asserts `hits` of `n` is within [`RATE_SIGMAS`] binomial deviations of
/// `expected` (exactly, when `expected` is 0 or 1).
fn assert_rate(name: &str, hits: u64, n: u64, expected: f64) {
    let rate = hits as f64 / n as f64;
    let sigma = (expected * (1.0 - expected) / n as f64).sqrt();
    println!("{name}: rate {rate:.5}, expected {expected:.5} ± {:.5}", RATE_SIGMAS * sigma);
    assert!((rate - expected).abs() <= RATE_SIGMAS * sigma + 1e-12, "{name}: rate {rate}, expected {expected}");
}

fn normalise(weights: &[f64]) -> Vec<f64> {
    let total: f64 = weights.iter().sum();
    weights.iter().map(|w| w / total).collect()
}

fn min_mass(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(a, b)| a.min(*b)).sum()
}

/// Random logits in [-scale, scale) keyed by `key`.
fn logits(vocab: usize, key: u64, scale: f64) -> Vec<f32> {
    (0..vocab as u64).map(|i| ((uniform(key, i) * 2.0 - 1.0) * scale) as f32).collect()
}

fn sampled(temperature: f32, top_p: f32, top_k: usize, min_p: f32) -> SamplingParams {
    SamplingParams { temperature, top_p, top_k, min_p, seed: 0, ..SamplingParams::default() }
}

/// (name, target p, draft q) over 12 tokens.
fn pairs() -> Vec<(&'static str, Vec<f64>, Vec<f64>)> {
    let geometric: Vec<f64> = (0..12).map(|i| 0.7f64.powi(i)).collect();
    let reversed: Vec<f64> = geometric.iter().rev().copied().collect();
    let gapped: Vec<f64> = (0..12).map(|i| if (1..8).contains(&i) { 1.0 + i as f64 } else { 0.0 }).collect();
    let q_lacks: Vec<f64> = (0..12).map(|i| if i < 4 { 0.0 } else { 12.0 - i as f64 }).collect();
    let target = logits(12, 41, 2.5);
    vec![
        ("close", normalise(&geometric), normalise(&geometric.iter().map(|w| w.powf(0.8)).collect::<Vec<_>>())),
        ("far", normalise(&geometric), normalise(&reversed)),
        ("q beyond p's support", normalise(&gapped), vec![1.0 / 12.0; 12]),
        (
            "p beyond q's support",
            normalise(&reversed.iter().map(|w| w + 0.05).collect::<Vec<_>>()),
            normalise(&q_lacks),
        ),
        ("equal", normalise(&geometric), normalise(&geometric)),
        (
            "sampler filters",
            filtered_probs(&target, &sampled(0.8, 1.0, 6, 0.0)),
            filtered_probs(&logits(12, 42, 2.0), &sampled(1.2, 0.85, 0, 0.02)),
        ),
    ]
}

/// A verifier under test: (p, q, draft, u_accept, u_residual) → verdict.
type Verifier = fn(&[f64], &[f64], u32, f64, f64) -> Verdict;

/// `TRIALS` drafts `x ~ q` verified against `p`: output counts and acceptances.
fn run_trials(p: &[f64], q: &[f64], seed: u64, verifier: Verifier) -> (Vec<u64>, u64) {
    let mut counts = vec![0u64; p.len()];
    let mut accepted = 0;
    for t in 0..TRIALS {
        let draft = inverse_cdf(q, stream_uniform(seed, DRAFT_STREAM, t)).unwrap();
        let u_accept = stream_uniform(seed, ACCEPT_STREAM, t);
        let verdict = verifier(p, q, draft, u_accept, stream_uniform(seed, RESIDUAL_STREAM, t));
        counts[verdict.token as usize] += 1;
        accepted += u64::from(verdict.accepted);
    }
    (counts, accepted)
}

#[test]
fn wilson_hilferty_quantiles_match_the_tables() {
    // Upper 0.001 quantiles from the standard tables.
    for (df, table) in [(1, 10.828), (2, 13.816), (3, 16.266), (5, 20.515), (11, 31.264), (15, 37.697), (63, 103.442)] {
        let approx = chi2_critical(df);
        let tolerance = if df >= 5 { 0.012 } else { 0.035 };
        assert!(approx >= table && approx / table - 1.0 < tolerance, "df {df}: {approx} vs {table}");
    }
}

#[test]
fn rejection_sampling_outputs_the_target_distribution() {
    for (i, (name, p, q)) in pairs().into_iter().enumerate() {
        let (counts, accepted) = run_trials(&p, &q, 1000 + i as u64, verify_draft);
        let chi = ChiSquare::of(&counts, &p);
        println!("{}", chi.report(&format!("verify_draft, {name}")));
        assert!(chi.passes(), "{name}: {chi:?} {counts:?}");
        assert_rate(&format!("verify_draft acceptance, {name}"), accepted, TRIALS, min_mass(&p, &q));
    }
}

/// Accepts every draft: the output follows q.
fn accept_always(_: &[f64], _: &[f64], draft: u32, _: f64, _: f64) -> Verdict {
    Verdict { accepted: true, token: draft }
}

/// Redraws a rejected draft from p instead of the residual, a classic slip.
fn redraw_from_target(p: &[f64], q: &[f64], draft: u32, u_accept: f64, u_residual: f64) -> Verdict {
    let verdict = verify_draft(p, q, draft, u_accept, u_residual);
    if verdict.accepted {
        verdict
    } else {
        Verdict { accepted: false, token: inverse_cdf(p, u_residual).unwrap() }
    }
}

#[test]
fn biased_verifiers_fail_the_same_check() {
    // Output law of each wrong verifier, to decide where the test has power:
    // a Pearson statistic then averages df + TRIALS · Σ (r − p)² / p.
    let accept_always_law = |_: &[f64], q: &[f64]| q.to_vec();
    let redraw_law = |p: &[f64], q: &[f64]| {
        let beta = min_mass(p, q);
        p.iter().zip(q).map(|(a, b)| a.min(*b) + (1.0 - beta) * a).collect::<Vec<f64>>()
    };
    type Law = fn(&[f64], &[f64]) -> Vec<f64>;
    let wrong: [(&str, Verifier, Law); 2] =
        [("accept always", accept_always, accept_always_law), ("redraw from p", redraw_from_target, redraw_law)];
    for (wrong_name, verifier, law) in wrong {
        let mut checked = 0;
        for (i, (name, p, q)) in pairs().into_iter().enumerate() {
            let r = law(&p, &q);
            let out_of_support = r.iter().zip(&p).any(|(&ri, &pi)| pi == 0.0 && ri > 0.0);
            let shift: f64 = r.iter().zip(&p).filter(|(_, &pi)| pi > 0.0).map(|(ri, pi)| (ri - pi).powi(2) / pi).sum();
            if !out_of_support && shift * (TRIALS as f64) < 100.0 {
                continue;
            }
            let (counts, _) = run_trials(&p, &q, 1000 + i as u64, verifier);
            let chi = ChiSquare::of(&counts, &p);
            println!("{}", chi.report(&format!("negative control {wrong_name}, {name}")));
            assert!(!chi.passes(), "{wrong_name} on {name} passed: {chi:?}");
            if !out_of_support {
                assert!(chi.stat > chi.critical(), "{wrong_name} on {name}: {chi:?}");
            }
            checked += 1;
        }
        assert!(checked >= 3, "{wrong_name}: only {checked} pairs where the check has power");
    }
}

/// A toy target and drafter whose distributions depend on the context, as a
/// language model's do. Both go through the sampler's filters, so their
/// supports differ.
struct Toy {
    vocab: usize,
    target_params: SamplingParams,
    draft_params: SamplingParams,
}

impl Toy {
    fn context_key(context: &[u32]) -> u64 {
        context.iter().fold(mix64(0x70), |h, &t| mix64(h ^ (u64::from(t) + 1).wrapping_mul(GOLDEN_GAMMA)))
    }

    fn target(&self, context: &[u32]) -> Vec<f64> {
        filtered_probs(&logits(self.vocab, Self::context_key(context), 2.0), &self.target_params)
    }

    /// The target's logits plus noise: a drafter that is right on average.
    fn draft(&self, context: &[u32]) -> Vec<f64> {
        let key = Self::context_key(context);
        let noisy: Vec<f32> = logits(self.vocab, key, 2.0)
            .iter()
            .zip(logits(self.vocab, key ^ 0x5bd1, 1.0))
            .map(|(a, b)| a + b)
            .collect();
        filtered_probs(&noisy, &self.draft_params)
    }

    /// Drafts after `context` and the rows to verify them:
    /// `(drafts, target rows, draft rows)`.
    fn propose(
        &self,
        context: &[u32],
        drafts: usize,
        seed: u64,
        position: u64,
    ) -> (Vec<u32>, Vec<Vec<f64>>, Vec<Vec<f64>>) {
        let mut extended = context.to_vec();
        let (mut tokens, mut p_rows, mut q_rows) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..drafts {
            let q = self.draft(&extended);
            let token = inverse_cdf(&q, stream_uniform(seed, DRAFT_STREAM, position + i as u64)).unwrap();
            p_rows.push(self.target(&extended));
            q_rows.push(q);
            tokens.push(token);
            extended.push(token);
        }
        p_rows.push(self.target(&extended));
        (tokens, p_rows, q_rows)
    }

    /// Exact probability that at least k drafts are accepted, for k = 0..=drafts:
    /// Σ over draft prefixes of Π min(p, q) along them.
    fn accepted_at_least(&self, drafts: usize) -> Vec<f64> {
        fn walk(toy: &Toy, context: &mut Vec<u32>, weight: f64, drafts: usize, at_least: &mut [f64]) {
            at_least[context.len()] += weight;
            if context.len() == drafts {
                return;
            }
            let (p, q) = (toy.target(context), toy.draft(context));
            for x in 0..toy.vocab as u32 {
                let w = p[x as usize].min(q[x as usize]);
                if w > 0.0 {
                    context.push(x);
                    walk(toy, context, weight * w, drafts, at_least);
                    context.pop();
                }
            }
        }
        let mut at_least = vec![0.0; drafts + 1];
        walk(self, &mut Vec::new(), 1.0, drafts, &mut at_least);
        at_least
    }
}

fn chain_uniforms(seed: u64, position: u64) -> impl Fn(usize) -> (f64, f64) {
    move |i| {
        let at = position + i as u64;
        (stream_uniform(seed, ACCEPT_STREAM, at), stream_uniform(seed, RESIDUAL_STREAM, at))
    }
}

#[test]
fn chain_first_token_and_accepted_length_follow_the_exact_law() {
    let toy = Toy { vocab: 12, target_params: sampled(0.9, 1.0, 10, 0.0), draft_params: sampled(1.2, 0.9, 0, 0.0) };
    for drafts in [2usize, 3] {
        let seed = 7000 + drafts as u64;
        let (mut first, mut lengths) = (vec![0u64; toy.vocab], vec![0u64; drafts + 1]);
        for t in 0..TRIALS {
            let position = t * 16;
            let (tokens, p_rows, q_rows) = toy.propose(&[], drafts, seed, position);
            let (accepted, out) = verify_chain(&p_rows, &q_rows, &tokens, chain_uniforms(seed, position));
            assert_eq!(out.len(), accepted + 1);
            assert_eq!(out[..accepted], tokens[..accepted]);
            first[out[0] as usize] += 1;
            lengths[accepted] += 1;
        }
        let chi = ChiSquare::of(&first, &toy.target(&[]));
        println!("{}", chi.report(&format!("verify_chain {drafts} drafts, first token")));
        assert!(chi.passes(), "{chi:?} {first:?}");

        let at_least = toy.accepted_at_least(drafts);
        let exact: Vec<f64> = (0..=drafts).map(|k| at_least[k] - at_least.get(k + 1).unwrap_or(&0.0)).collect();
        let chi = ChiSquare::of(&lengths, &exact);
        println!("{}", chi.report(&format!("verify_chain {drafts} drafts, accepted length {exact:.4?}")));
        assert!(chi.passes(), "{chi:?} {lengths:?} vs {exact:?}");
    }
}

#[test]
fn chain_decoding_follows_the_target_law_of_whole_sequences() {
    // Four tokens, three steps deep: 64 sequences, each likely enough for a
    // Pearson test; top-k 3 makes some of them impossible.
    let toy = Toy { vocab: 4, target_params: sampled(1.0, 1.0, 3, 0.0), draft_params: sampled(1.3, 1.0, 0, 0.0) };
    let length = 3;
    let seed = 77;
    let mut counts = vec![0u64; 64];
    let mut position = 0;
    for _ in 0..TRIALS {
        let mut sequence = Vec::new();
        while sequence.len() < length {
            let (tokens, p_rows, q_rows) = toy.propose(&sequence, 2, seed, position);
            let (_, out) = verify_chain(&p_rows, &q_rows, &tokens, chain_uniforms(seed, position));
            sequence.extend(out);
            position += 3;
        }
        counts[sequence[..length].iter().fold(0, |i, &t| i * 4 + t as usize)] += 1;
    }
    let exact: Vec<f64> = (0..64usize)
        .map(|i| {
            let sequence = [(i / 16) as u32, (i / 4 % 4) as u32, (i % 4) as u32];
            (0..length).map(|k| toy.target(&sequence[..k])[sequence[k] as usize]).product()
        })
        .collect();
    let smallest = exact.iter().filter(|&&e| e > 0.0).fold(f64::INFINITY, |a, &b| a.min(b));
    assert!(smallest * TRIALS as f64 >= 5.0, "a cell expects {} draws", smallest * TRIALS as f64);
    let chi = ChiSquare::of(&counts, &exact);
    println!("{}", chi.report("verify_chain, 3-token sequences"));
    assert!(chi.passes(), "{chi:?} {counts:?}");
}

#[test]
fn coupled_acceptance_matches_shared_uniform_draws() {
    for (i, (name, p, q)) in pairs().into_iter().enumerate() {
        let expected = coupled_acceptance(&p, &q);
        assert!(expected <= min_mass(&p, &q) + 1e-12, "{name}: {expected}");
        let (mut counts, mut agreed) = (vec![0u64; p.len()], 0);
        for t in 0..TRIALS {
            let u = uniform(2000 + i as u64, t);
            let (draft, target) = (inverse_cdf(&q, u).unwrap(), inverse_cdf(&p, u).unwrap());
            agreed += u64::from(draft == target);
            counts[target as usize] += 1;
        }
        assert_rate(&format!("coupled acceptance, {name}"), agreed, TRIALS, expected);
        let chi = ChiSquare::of(&counts, &p);
        println!("{}", chi.report(&format!("coupled output, {name}")));
        assert!(chi.passes(), "{name}: {chi:?}");
    }
    // Through the sampler itself: target and drafter sample the same position
    // of the same seed, as the engine's coupled verification does.
    for case in 0..4u64 {
        let params = SamplingParams { seed: 90 + case, ..sampled(0.7 + 0.2 * case as f32, 0.95, 40, 0.0) };
        let target = logits(64, 300 + case, 3.0);
        let drafter: Vec<f32> = target.iter().zip(logits(64, 400 + case, 1.5)).map(|(a, b)| a + b).collect();
        let expected = coupled_acceptance(&filtered_probs(&target, &params), &filtered_probs(&drafter, &params));
        let agreed = (0..TRIALS).filter(|&t| sample(&target, &params, t).token == sample(&drafter, &params, t).token);
        assert_rate(
            &format!("coupled acceptance through sample(), case {case}"),
            agreed.count() as u64,
            TRIALS,
            expected,
        );
    }
}

#[test]
fn coupled_acceptance_overlaps_the_two_cdfs() {
    assert_eq!(coupled_acceptance(&[0.5, 0.5], &[0.25, 0.75]), 0.75);
    // Same mass, one token apart: the intervals never meet, though Σ min(p, q) = 0.5.
    assert_eq!(coupled_acceptance(&[0.5, 0.5, 0.0], &[0.0, 0.5, 0.5]), 0.0);
    assert_eq!(coupled_acceptance(&[0.0, 1.0], &[1.0, 0.0]), 0.0);
    let p = normalise(&[3.0, 1.0, 4.0, 1.0, 5.0]);
    assert!((coupled_acceptance(&p, &p) - 1.0).abs() < 1e-15);
    // Unnormalised rows are normalised; rows with no mass never agree.
    assert_eq!(coupled_acceptance(&[2.0, 2.0], &[0.25, 0.75]), 0.75);
    assert_eq!(coupled_acceptance(&[0.0, 0.0], &[0.5, 0.5]), 0.0);
}

#[test]
fn filtered_probs_is_the_distribution_sample_draws_from() {
    let sweep = 2048;
    let mut near_boundary = 0;
    for case in 0..300u64 {
        let vocab = 8 + (case as usize * 7) % 57;
        let mut row = logits(vocab, 5000 + case, 1.0 + (case % 6) as f64);
        if case % 3 == 0 {
            // Ties, and tokens the sampler must never pick.
            row.iter_mut().for_each(|l| *l = (*l * 2.0).round() / 2.0);
            row[case as usize % vocab] = f32::NEG_INFINITY;
            row[(case as usize + 3) % vocab] = f32::NAN;
        }
        let random = |i: u64| uniform(case, i) as f32;
        let params = SamplingParams {
            temperature: if case % 10 == 0 { 0.0 } else { 0.2 + 1.8 * random(0) },
            top_k: if case % 2 == 0 { 0 } else { 1 + (random(1) * (vocab + 3) as f32) as usize },
            top_p: if case % 5 < 2 { 1.0 } else { 0.2 + 0.8 * random(2) },
            min_p: if case % 4 == 0 { 0.3 * random(3) } else { 0.0 },
            seed: case,
            ..SamplingParams::default()
        };
        let probs = filtered_probs(&row, &params);
        assert!(probs.iter().all(|&p| p >= 0.0));
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-12, "case {case}");
        let boundaries: Vec<f64> = probs
            .iter()
            .scan(0.0, |c, &p| {
                *c += p;
                Some(*c)
            })
            .collect();
        for j in 0..sweep {
            let u = (j as f64 + 0.5) / sweep as f64;
            let (sampler, inverse) = (token_for_uniform(&row, &params, u), inverse_cdf(&probs, u).unwrap());
            if sampler != inverse {
                // Normalising first may round a boundary differently.
                assert!(boundaries.iter().any(|b| (b - u).abs() < 1e-12), "case {case} u {u}: {sampler} vs {inverse}");
                near_boundary += 1;
            }
        }
        for position in 0..64 {
            let drawn = sample(&row, &params, position).token;
            assert_eq!(drawn, token_for_uniform(&row, &params, uniform(case, position)), "case {case}");
            assert!(probs[drawn as usize] > 0.0, "case {case}: drew {drawn} outside {probs:?}");
        }
    }
    println!("filtered_probs sweep: {near_boundary} of {} draws differ, all at a CDF boundary", 300 * sweep);
    assert!(near_boundary <= 3);
    assert!(filtered_probs(&[], &sampled(1.0, 1.0, 0, 0.0)).is_empty());
    assert_eq!(filtered_probs(&[f32::NAN, f32::NEG_INFINITY], &sampled(1.0, 1.0, 0, 0.0)), [1.0, 0.0]);
    assert_eq!(filtered_probs(&[0.1, 3.0, 3.0], &SamplingParams::default()), [0.0, 1.0, 0.0]);
}

#[test]
fn stream_uniform_extends_the_samplers_construction() {
    for (seed, position) in [(0, 0), (7, 3), (u64::MAX, 12345)] {
        assert_eq!(stream_uniform(seed, SAMPLING_STREAM, position), uniform(seed, position));
    }
    let streams = [SAMPLING_STREAM, DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM];
    let n = 50_000u64;
    for (a, &stream) in streams.iter().enumerate() {
        let mut buckets = [0u64; 16];
        for t in 0..n {
            buckets[(stream_uniform(3, stream, t) * 16.0) as usize] += 1;
        }
        let chi = ChiSquare::of(&buckets, &[1.0 / 16.0; 16]);
        assert!(chi.passes(), "stream {stream:#x}: {chi:?}");
        // Streams of one seed are uncorrelated position by position.
        for &other in &streams[a + 1..] {
            let mean_product: f64 =
                (0..n).map(|t| (stream_uniform(3, stream, t) - 0.5) * (stream_uniform(3, other, t) - 0.5)).sum::<f64>()
                    / n as f64;
            // Each product has variance 1/144.
            assert!(
                mean_product.abs() < RATE_SIGMAS / 12.0 / (n as f64).sqrt(),
                "{stream:#x}/{other:#x}: {mean_product}"
            );
        }
    }
}

#[test]
fn verify_draft_edge_cases() {
    let p = [0.5, 0.5, 0.0, 0.0];
    // q(x) = 0 < p(x): always accepted; p(x) = 0: never, and the replacement is in p's support.
    for u in [0.0, 0.5, 0.999_999] {
        assert_eq!(verify_draft(&p, &[0.0, 0.2, 0.8, 0.0], 0, u, 0.3), Verdict { accepted: true, token: 0 });
        let verdict = verify_draft(&p, &[0.0, 0.2, 0.8, 0.0], 2, u, u);
        assert!(!verdict.accepted && verdict.token < 2, "{verdict:?}");
        // p == q: every draft in the support is accepted.
        assert!(verify_draft(&p, &p, 1, u, 0.3).accepted);
    }
    // An impossible draft against p == q: drawn from p instead of the empty residual.
    assert_eq!(verify_draft(&p, &p, 3, 0.1, 0.75), Verdict { accepted: false, token: 1 });
    assert_eq!(verify_draft(&[0.0; 4], &p, 3, 0.1, 0.75), Verdict { accepted: false, token: 3 });
    // Residual [0, 0.3, 0, 0.2] normalised: 0.6 then 0.4, in id order.
    let (p, q) = ([0.2, 0.5, 0.1, 0.2], [0.5, 0.2, 0.3, 0.0]);
    assert_eq!(verify_draft(&p, &q, 0, 0.5, 0.59).token, 1);
    assert_eq!(verify_draft(&p, &q, 0, 0.5, 0.61).token, 3);
    assert!(verify_draft(&p, &q, 0, 0.39, 0.61).accepted);

    // A chain accepted to the end gains the bonus token from the last row.
    let rows = vec![vec![0.0, 1.0], vec![0.0, 1.0], vec![1.0, 0.0]];
    let (accepted, tokens) = verify_chain(&rows, &rows[..2], &[1, 1], |_| (0.5, 0.5));
    assert_eq!((accepted, tokens), (2, vec![1, 1, 0]));
    let (accepted, tokens) = verify_chain(&rows, &[vec![1.0, 0.0], vec![0.0, 1.0]], &[0, 1], |_| (0.5, 0.5));
    assert_eq!((accepted, tokens), (0, vec![1]));
    assert_eq!(verify_chain(&rows[2..], &[], &[], |_| (0.5, 0.5)), (0, vec![0]));
    assert_eq!(inverse_cdf(&[0.0, f64::NAN, -1.0], 0.5), None);
    assert_eq!(inverse_cdf(&[0.0, 2.0, 0.0, 2.0], 0.5), Some(3));
}

#[test]
#[should_panic(expected = "one target row per draft")]
fn verify_chain_refuses_rows_that_do_not_match_the_drafts() {
    let rows = [vec![0.5, 0.5]];
    verify_chain(&rows, &rows, &[0], |_| (0.5, 0.5));
}
