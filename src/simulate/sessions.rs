//! Multi-turn conversations as arrivals: sessions start as a Poisson
//! process; a session may open with one of a few shared system prompts;
//! each turn's prompt is the previous turn's prompt (its whole blocks)
//! followed by the previous answer and a new user message; the next turn
//! arrives a think time after this one.
//!
//! A share of sessions is already under way when the run starts (as in a
//! service running for hours): such a session first arrives with a history
//! of earlier turns and an answer to them. The history was computed before
//! the run, minutes to hours earlier, longer than HBM holds blocks: it is
//! written to the shared store (if any) just before the turn arrives, and no
//! other tier has it.
//!
//! Prompts are lists of block ids (as a Mooncake trace's), turned into
//! tokens by [`super::prompt_of`]. The previous answer gets fresh ids: the
//! modelled devices sample placeholder tokens, which a later prompt cannot
//! quote, so a turn can hit everything up to the previous prompt's last
//! whole block, never the previous answer (DeepSeek's cache would also hold
//! the answer: this under-counts hits by the answers' share).

use deepinfer_actors::sim::rng::Seed;
use deepinfer_engine::traffic::{Arrival, MOONCAKE_BLOCK_TOKENS};

use crate::scenario::Sessions;

/// Ids of system-prompt blocks are below this; fresh ids start here.
const FRESH_IDS: u64 = 1 << 40;

/// Every turn of every session that arrives before `duration_s`, in arrival order.
pub fn arrivals(s: &Sessions, duration_s: f64, seed: u64) -> Vec<Arrival> {
    generate(s, duration_s, seed).0
}

/// [`arrivals`], and for each the whole blocks of history written before the run.
pub fn generate(s: &Sessions, duration_s: f64, seed: u64) -> (Vec<Arrival>, Vec<usize>) {
    let mut rng = Seed(seed).stream("sessions");
    let bt = MOONCAKE_BLOCK_TOKENS;
    let system_blocks = (s.system_prompt_tokens / bt) as u64;
    let end_us = (duration_s.max(0.0) * 1e6) as u64;
    let mut next_id = FRESH_IDS;
    let mut out: Vec<(u64, u64, Arrival, usize)> = Vec::new();
    let mut t = 0.0f64;
    let mut session = 0u64;
    while out.len() < deepinfer_engine::traffic::MAX_ARRIVALS {
        t += -(1.0 - rng.uniform()).ln() / s.rate_per_s.max(1e-9);
        let mut at_us = (t * 1e6) as u64;
        if at_us >= end_us {
            break;
        }
        let turns = s.turns.draw(rng.uniform(), rng.uniform());
        let mut history: Vec<u64> = Vec::new();
        if system_blocks > 0 && rng.chance(s.shared_fraction) {
            let which = rng.below(s.system_prompts.max(1) as u64);
            history.extend((0..system_blocks).map(|j| which * system_blocks + j));
        }
        let mut answer = 0usize;
        let mut earlier = 0;
        if s.resumed_fraction > 0.0 && rng.chance(s.resumed_fraction) {
            let tokens = s.history.draw(rng.uniform(), rng.uniform());
            for _ in 0..tokens / bt {
                history.push(next_id);
                next_id += 1;
            }
            answer = s.output.draw(rng.uniform(), rng.uniform());
            earlier = history.len();
        }
        for turn in 0..turns {
            let user = s.input.draw(rng.uniform(), rng.uniform());
            let output = s.output.draw(rng.uniform(), rng.uniform());
            let think = s.think_s.draw(rng.uniform(), rng.uniform());
            let new = answer + user;
            let input_tokens = history.len() * bt + new;
            let mut prefix_blocks = history.clone();
            for _ in 0..new.div_ceil(bt) {
                prefix_blocks.push(next_id);
                next_id += 1;
            }
            if at_us < end_us {
                out.push((
                    at_us,
                    session * 4096 + turn as u64,
                    Arrival { at_us, input_tokens, output_tokens: output, prefix_blocks: prefix_blocks.clone() },
                    if turn == 0 { earlier } else { 0 },
                ));
            }
            prefix_blocks.truncate(input_tokens / bt);
            history = prefix_blocks;
            answer = output;
            at_us = at_us.saturating_add(think as u64 * 1_000_000);
        }
        session += 1;
    }
    out.sort_by_key(|(at, order, _, _)| (*at, *order));
    out.into_iter().map(|(_, _, a, earlier)| (a, earlier)).unzip()
}

/// Share of prompt tokens an unbounded cache without TTLs would serve:
/// each arrival's leading blocks seen in an earlier one or written before
/// the run (`earlier[i]` blocks of arrival `i`; whole blocks only).
pub fn ideal_hit_rate(arrivals: &[Arrival], earlier: &[usize]) -> f64 {
    let mut seen = std::collections::BTreeSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for (i, a) in arrivals.iter().enumerate() {
        seen.extend(a.prefix_blocks.iter().take(earlier.get(i).copied().unwrap_or(0)).copied());
        let whole = a.input_tokens / MOONCAKE_BLOCK_TOKENS;
        // The engine caches blocks before the prompt's last token.
        let usable = (a.input_tokens.saturating_sub(1)) / MOONCAKE_BLOCK_TOKENS;
        let shared = a.prefix_blocks.iter().take(usable.min(whole)).take_while(|b| seen.contains(*b)).count();
        hit += shared * MOONCAKE_BLOCK_TOKENS;
        total += a.input_tokens;
        seen.extend(a.prefix_blocks.iter().take(whole).copied());
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_engine::traffic::Lengths;

    fn sessions() -> Sessions {
        Sessions {
            rate_per_s: 2.0,
            input: Lengths::Fixed(700),
            output: Lengths::Fixed(300),
            turns: Lengths::Fixed(3),
            think_s: Lengths::Fixed(10),
            system_prompt_tokens: 1024,
            shared_fraction: 1.0,
            system_prompts: 1,
            resumed_fraction: 0.0,
            history: Lengths::Fixed(1),
        }
    }

    #[test]
    fn turns_extend_the_previous_prompt() {
        let a = arrivals(&sessions(), 100.0, 5);
        assert_eq!(a, arrivals(&sessions(), 100.0, 5), "seeded");
        assert!(a.windows(2).all(|w| w[0].at_us <= w[1].at_us));
        // First turns: the system prompt and 700 new tokens.
        let first: Vec<&Arrival> = a.iter().filter(|x| x.input_tokens == 1024 + 700).collect();
        assert!(first.len() > 100);
        assert!(first.iter().all(|x| x.prefix_blocks[..2] == [0, 1]));
        // A second turn starts with its first turn's three whole blocks.
        let second = a.iter().find(|x| x.input_tokens == 3 * 512 + 300 + 700).expect("a second turn");
        let parent = first.iter().find(|x| x.prefix_blocks[2] == second.prefix_blocks[2]).expect("its first turn");
        assert_eq!(parent.prefix_blocks[..3], second.prefix_blocks[..3]);
        assert_eq!(second.at_us - parent.at_us, 10_000_000);
        let ideal = ideal_hit_rate(&a, &[]);
        assert!(ideal > 0.5 && ideal < 0.9, "{ideal}");
    }

    #[test]
    fn resumed_sessions_bring_a_history_written_earlier() {
        let s = Sessions { resumed_fraction: 0.5, history: Lengths::Fixed(5000), ..sessions() };
        let (a, earlier) = generate(&s, 100.0, 5);
        assert_eq!(a.len(), earlier.len());
        // Resumed first turns: system prompt + 5000 tokens of history (11 whole
        // blocks in all), the last answer and the new message.
        let resumed: Vec<usize> = (0..a.len()).filter(|&i| earlier[i] > 0).collect();
        assert!(resumed.len() > 50, "{}", resumed.len());
        for &i in &resumed {
            assert_eq!(earlier[i], 2 + 5000 / 512);
            assert_eq!(a[i].input_tokens, earlier[i] * 512 + 300 + 700);
        }
        let plain = ideal_hit_rate(&a, &[]);
        assert!(ideal_hit_rate(&a, &earlier) > plain + 0.1, "the histories are hits");
    }
}
