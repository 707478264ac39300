//! The prefill balancers of `engine/src/balance.rs` on a multi-turn workload,
//! in a small fluid model (not the cluster simulator): 8 instances of one
//! GPU, each draining its queue of prefill work at a fixed rate and holding
//! an LRU prefix cache of 64-token blocks. Sessions send turns whose prompt
//! is the whole conversation so far, so a turn finds its prefix cached where
//! the previous turn ran. Prints prefill tokens computed, prefix-hit share
//! and time to first token (queue wait + own prefill) per policy.
//!
//! `cargo run --release -p deepinfer-engine --example balance_policies`

use std::collections::BTreeMap;

use deepinfer_engine::balance::{choose_prefill, prefill_cost, Health, PrefillCandidate, PrefillPolicy, RoundRobin};

const INSTANCES: usize = 8;
const BLOCK: usize = 64;
/// Prefill work (in `prefill_cost` units, ≈ tokens) one instance does per second.
const RATE: f64 = 4_000.0;
const CACHE_BLOCKS: usize = 3_000;
const ATTENTION_TOKENS: f64 = 8192.0;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.next()).ln()
    }
}

/// A turn: arrival time, prompt blocks (ids), prompt tokens.
struct Turn {
    at: f64,
    blocks: Vec<u64>,
    tokens: usize,
}

fn workload() -> Vec<Turn> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut turns = Vec::new();
    let mut next_block = 0u64;
    let mut start = 0.0;
    for _ in 0..400 {
        start += rng.exp(0.3);
        // A shared system prompt of 8 blocks, then the conversation.
        let mut blocks: Vec<u64> = (0..8).map(|b| 1_000_000 + b).collect();
        let mut at = start;
        for _ in 0..1 + (rng.next() * 6.0) as usize {
            let new = 200 + (rng.next() * 1800.0) as usize;
            let tokens = blocks.len() * BLOCK + new;
            // Blocks of this turn's prompt (the last partial one is never cached).
            while blocks.len() < tokens / BLOCK {
                blocks.push(next_block);
                next_block += 1;
            }
            turns.push(Turn { at, blocks: blocks.clone(), tokens });
            // The answer becomes part of the next prompt.
            let answer = 100 + (rng.next() * 400.0) as usize;
            for _ in 0..(tokens % BLOCK + answer) / BLOCK {
                blocks.push(next_block);
                next_block += 1;
            }
            at += 5.0 + rng.exp(20.0);
        }
    }
    turns.sort_by(|a, b| a.at.total_cmp(&b.at));
    turns
}

#[derive(Default)]
struct Instance {
    queued: f64,
    /// Block → last use; and use → block, for LRU eviction.
    cache: BTreeMap<u64, u64>,
    lru: BTreeMap<u64, u64>,
}

impl Instance {
    fn cached_tokens(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|b| self.cache.contains_key(b)).count() * BLOCK
    }

    fn insert(&mut self, blocks: &[u64], clock: &mut u64) {
        for &b in blocks {
            *clock += 1;
            if let Some(old) = self.cache.insert(b, *clock) {
                self.lru.remove(&old);
            }
            self.lru.insert(*clock, b);
        }
        while self.cache.len() > CACHE_BLOCKS {
            let (&t, &b) = self.lru.iter().next().expect("non-empty");
            self.lru.remove(&t);
            self.cache.remove(&b);
        }
    }
}

enum Policy {
    RoundRobin,
    /// Least load, blind to the caches.
    LeastLoad,
    Balanced(f64),
}

fn run(policy: &Policy, turns: &[Turn]) -> (f64, f64, f64, f64) {
    let mut inst: Vec<Instance> = (0..INSTANCES).map(|_| Instance::default()).collect();
    let mut rr = RoundRobin::default();
    let mut clock = 0u64;
    let (mut computed, mut prompt, mut last) = (0.0, 0.0, 0.0);
    let mut ttft = Vec::with_capacity(turns.len());
    for t in turns {
        for i in inst.iter_mut() {
            i.queued = (i.queued - RATE * (t.at - last)).max(0.0);
        }
        last = t.at;
        let cached: Vec<usize> = inst.iter().map(|i| i.cached_tokens(&t.blocks).min(t.tokens - 1)).collect();
        let candidates = |blind: bool| -> Vec<PrefillCandidate> {
            inst.iter()
                .zip(&cached)
                .map(|(i, &c)| PrefillCandidate {
                    health: Health::Up,
                    gpus: 1,
                    queued_cost: i.queued,
                    requests: 0,
                    cached_tokens: if blind { 0 } else { c },
                })
                .collect()
        };
        let k = match policy {
            Policy::RoundRobin => rr.choose(&[Health::Up; INSTANCES]),
            Policy::LeastLoad => {
                let p = PrefillPolicy { slack: 0.0, attention_tokens: ATTENTION_TOKENS };
                choose_prefill(&p, &candidates(true), t.tokens)
            }
            Policy::Balanced(slack) => {
                let p = PrefillPolicy { slack: *slack, attention_tokens: ATTENTION_TOKENS };
                choose_prefill(&p, &candidates(false), t.tokens)
            }
        }
        .expect("an instance is up");
        let own = prefill_cost(t.tokens - cached[k], cached[k], ATTENTION_TOKENS);
        inst[k].queued += own;
        ttft.push(inst[k].queued / RATE);
        inst[k].insert(&t.blocks, &mut clock);
        computed += (t.tokens - cached[k]) as f64;
        prompt += t.tokens as f64;
    }
    ttft.sort_by(f64::total_cmp);
    let mean = ttft.iter().sum::<f64>() / ttft.len() as f64;
    let p99 = ttft[(ttft.len() * 99 / 100).min(ttft.len() - 1)];
    (computed, 1.0 - computed / prompt, mean, p99)
}

fn main() {
    let turns = workload();
    let tokens: usize = turns.iter().map(|t| t.tokens).sum();
    let span = turns.last().map_or(1.0, |t| t.at);
    println!("{} turns over {span:.0} s, {tokens} prompt tokens, {INSTANCES} instances", turns.len());
    println!("| policy | prefill tokens computed | prefix-hit share | TTFT mean (s) | TTFT p99 (s) |");
    println!("|---|---:|---:|---:|---:|");
    for (name, policy) in [
        ("round robin", Policy::RoundRobin),
        ("least load (cache-blind)", Policy::LeastLoad),
        ("cached prefix, slack 0 (least load after hits)", Policy::Balanced(0.0)),
        ("cached prefix, slack 0.5 (default)", Policy::Balanced(0.5)),
        ("cached prefix, slack 4", Policy::Balanced(4.0)),
    ] {
        let (computed, hit, mean, p99) = run(&policy, &turns);
        println!("| {name} | {computed:.0} | {:.1}% | {mean:.2} | {p99:.2} |", hit * 100.0);
    }
}
