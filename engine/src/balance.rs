//! Load balancing across serving instances, as plain functions that the
//! router of a real cluster and the simulator share.
//!
//! - [`choose_prefill`]: prefill goes where the prompt's prefix is already
//!   cached (the longest cached prefix wins), unless that instance's load
//!   would exceed the least-loaded choice by more than a configured slack;
//!   otherwise to the least load. Load is queued prefill work per GPU, where
//!   a request's work grows with its new tokens and with the context each of
//!   them attends to.
//! - [`choose_decode`]: decode goes where the binding resource (KV bytes or
//!   batch slots per GPU) is least used after placing the request.
//! - [`pick_encoder`]: an image request's encodings go to the image-encoder
//!   instance that holds most of its images (cache affinity: the balancer
//!   remembers where it last sent each image, so a repeated image finds its
//!   encoding cached), unless that instance's pending patches per device,
//!   with the request, exceed the least-loaded live encoder's by more than a
//!   slack; otherwise to the least pending patches per device. Patches, not
//!   images, are the load: a ViT's cost grows with its patch count (and
//!   faster, through the attention's quadratic term), and image sizes differ
//!   by an order of magnitude.
//! - [`RoundRobin`]: the baseline to compare against.
//!
//! Every policy skips instances that are down or draining and breaks ties by
//! the lowest index; inputs are slices indexed by instance, so nothing
//! depends on hash order.

/// Whether an instance takes new requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Health {
    #[default]
    Up,
    /// Finishing what it has; takes nothing new.
    Draining,
    Down,
}

/// Relative cost of prefilling `new` tokens after `cached` tokens of context:
/// one unit per token for the weights (projections, experts), plus attention
/// over the context each token sees (`cached + i` for the i-th new token),
/// where `attention_tokens` of context cost as much as the weights do.
pub fn prefill_cost(new: usize, cached: usize, attention_tokens: f64) -> f64 {
    let n = new as f64;
    // Σ_{i<n} (cached + i) = n·cached + n(n−1)/2.
    let context = n * cached as f64 + n * (n - 1.0).max(0.0) / 2.0;
    n + if attention_tokens > 0.0 { context / attention_tokens } else { 0.0 }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillPolicy {
    /// The instance with the longest cached prefix is kept while its load,
    /// with the request, is at most `(1 + slack)` times the least load.
    pub slack: f64,
    /// Context length whose attention costs as much as a token's weights.
    pub attention_tokens: f64,
}

impl Default for PrefillPolicy {
    fn default() -> Self {
        Self { slack: 0.5, attention_tokens: 8192.0 }
    }
}

/// One instance as the prefill balancer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct PrefillCandidate {
    pub health: Health,
    /// Attention data-parallel GPUs of the instance (at least one is assumed).
    pub gpus: u32,
    /// Prefill work queued or running there, in [`prefill_cost`] units.
    pub queued_cost: f64,
    /// Requests in flight there (any phase): the last tie-break before the index.
    pub requests: u32,
    /// Tokens of this request's prompt already cached there.
    pub cached_tokens: usize,
}

/// The instance to prefill a `prompt_tokens`-token prompt on, or `None` when
/// every instance is down or draining.
pub fn choose_prefill(policy: &PrefillPolicy, candidates: &[PrefillCandidate], prompt_tokens: usize) -> Option<usize> {
    // The last prompt token is always computed (it produces the first logits).
    let load_after = |c: &PrefillCandidate| {
        let cached = c.cached_tokens.min(prompt_tokens.saturating_sub(1));
        let own = prefill_cost(prompt_tokens - cached, cached, policy.attention_tokens);
        (c.queued_cost + own) / c.gpus.max(1) as f64
    };
    let up: Vec<(usize, f64)> = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| c.health == Health::Up)
        .map(|(i, c)| (i, load_after(c)))
        .collect();
    let least =
        up.iter().min_by(|a, b| a.1.total_cmp(&b.1).then(candidates[a.0].requests.cmp(&candidates[b.0].requests)))?;
    let affinity = up
        .iter()
        .filter(|(i, _)| candidates[*i].cached_tokens > 0)
        .min_by_key(|(i, _)| std::cmp::Reverse(candidates[*i].cached_tokens));
    if let Some(&(i, load)) = affinity {
        if load <= least.1 * (1.0 + policy.slack.max(0.0)) {
            return Some(i);
        }
    }
    Some(least.0)
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePolicy {
    /// Sequences one GPU decodes at once at most (its batch slots).
    pub max_requests_per_gpu: u32,
}

impl Default for DecodePolicy {
    fn default() -> Self {
        Self { max_requests_per_gpu: 256 }
    }
}

/// One instance as the decode balancer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct DecodeCandidate {
    pub health: Health,
    pub gpus: u32,
    /// KV bytes (or blocks) in use and the capacity, summed over the instance's GPUs.
    pub kv_used: u64,
    pub kv_capacity: u64,
    /// Requests decoding there.
    pub requests: u32,
}

/// The instance to decode a request needing `kv_need` more KV on, or `None`
/// when no instance that is up has room for it. The score is the fuller of
/// the two resources after placing the request (KV fraction, batch-slot
/// fraction): decode throughput stops at whichever runs out first; ties go to
/// fewer requests per GPU, then the lowest index.
pub fn choose_decode(policy: &DecodePolicy, candidates: &[DecodeCandidate], kv_need: u64) -> Option<usize> {
    let slots = |c: &DecodeCandidate| c.gpus.max(1) as u64 * policy.max_requests_per_gpu.max(1) as u64;
    candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            c.health == Health::Up
                && c.kv_used.saturating_add(kv_need) <= c.kv_capacity
                && (c.requests as u64) < slots(c)
        })
        .map(|(i, c)| {
            let kv = (c.kv_used + kv_need) as f64 / c.kv_capacity.max(1) as f64;
            let batch = (c.requests as u64 + 1) as f64 / slots(c) as f64;
            let per_gpu = c.requests as f64 / c.gpus.max(1) as f64;
            (i, kv.max(batch), per_gpu)
        })
        .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.total_cmp(&b.2)).then(a.0.cmp(&b.0)))
        .map(|(i, _, _)| i)
}

/// One image-encoder instance as the encoder balancer sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EncoderLoad {
    /// Up and taking work (not down, not draining).
    pub alive: bool,
    /// Devices of the instance (at least one is assumed).
    pub devices: u32,
    /// ViT patches queued or encoding there.
    pub pending_patches: u64,
    /// How many of this request's images the balancer last sent there (affinity).
    pub cached: usize,
}

/// The encoder instance to encode a request's images on, or `None` when no
/// encoder is alive. `request_patches` is the request's own patch count:
/// loads compare after placing it, so an idle encoder with the images cached
/// is not beaten by an idle one without them. The encoder holding most of
/// the images wins while its load is at most `(1 + slack)` times the least
/// load; otherwise the least load; ties go to the lowest index.
pub fn pick_encoder(encoders: &[EncoderLoad], request_patches: u64, slack: f64) -> Option<usize> {
    let load_after = |e: &EncoderLoad| (e.pending_patches + request_patches) as f64 / e.devices.max(1) as f64;
    let alive = || encoders.iter().enumerate().filter(|(_, e)| e.alive);
    // `min_by` keeps the first of equals: the lowest index.
    let (least, least_load) = alive().map(|(i, e)| (i, load_after(e))).min_by(|a, b| a.1.total_cmp(&b.1))?;
    let affinity = alive().filter(|(_, e)| e.cached > 0).min_by_key(|(i, e)| (std::cmp::Reverse(e.cached), *i));
    if let Some((i, e)) = affinity {
        if load_after(e) <= least_load * (1.0 + slack.max(0.0)) {
            return Some(i);
        }
    }
    Some(least)
}

/// Round robin over the instances that are up: the baseline.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl RoundRobin {
    pub fn choose(&mut self, health: &[Health]) -> Option<usize> {
        let n = health.len();
        let i = (0..n).map(|k| (self.next + k) % n).find(|&i| health[i] == Health::Up)?;
        self.next = (i + 1) % n;
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefill(queued: f64, cached: usize) -> PrefillCandidate {
        PrefillCandidate { health: Health::Up, gpus: 1, queued_cost: queued, requests: 0, cached_tokens: cached }
    }

    #[test]
    fn prefill_cost_counts_weights_and_attention() {
        // 4 new tokens after 10 cached: 4 + (10+11+12+13)/2 = 4 + 23.
        assert_eq!(prefill_cost(4, 10, 2.0), 27.0);
        assert_eq!(prefill_cost(4, 10, 0.0), 4.0);
        assert_eq!(prefill_cost(0, 10, 2.0), 0.0);
        assert!(prefill_cost(100, 1000, 8192.0) > prefill_cost(100, 0, 8192.0));
    }

    #[test]
    fn prefill_prefers_the_longest_cached_prefix_within_the_slack() {
        let p = PrefillPolicy { slack: 0.5, attention_tokens: 0.0 };
        // 100-token prompt; instance 1 holds 64 cached tokens and a little queue.
        // Loads after: [0 + 100, 20 + 36, 0 + 100] → instance 1 (longest prefix, and lighter anyway).
        let c = [prefill(0.0, 0), prefill(20.0, 64), prefill(0.0, 32)];
        assert_eq!(choose_prefill(&p, &c, 100), Some(1));
        // Instance 1 loaded: 200 + 36 = 236 > 1.5 × 68 (instance 2: 0 + 68) → least load wins.
        let c = [prefill(0.0, 0), prefill(200.0, 64), prefill(0.0, 32)];
        assert_eq!(choose_prefill(&p, &c, 100), Some(2));
        // Within the slack: 60 + 36 = 96 ≤ 1.5 × 68 = 102 → affinity holds.
        let c = [prefill(0.0, 0), prefill(60.0, 64), prefill(0.0, 32)];
        assert_eq!(choose_prefill(&p, &c, 100), Some(1));
        // Equal cached prefixes: the lowest index.
        let c = [prefill(0.0, 0), prefill(0.0, 64), prefill(0.0, 64)];
        assert_eq!(choose_prefill(&p, &c, 100), Some(1));
    }

    #[test]
    fn prefill_least_load_is_per_gpu_and_ties_go_to_fewer_requests_then_lowest_index() {
        let p = PrefillPolicy { slack: 0.0, attention_tokens: 0.0 };
        let mut c = [prefill(300.0, 0), prefill(500.0, 0)];
        c[1].gpus = 4; // (500 + 10) / 4 < 310
        assert_eq!(choose_prefill(&p, &c, 10), Some(1));
        let mut c = [prefill(0.0, 0), prefill(0.0, 0), prefill(0.0, 0)];
        c[0].requests = 3;
        c[1].requests = 1;
        c[2].requests = 1;
        assert_eq!(choose_prefill(&p, &c, 10), Some(1));
    }

    #[test]
    fn prefill_skips_down_and_draining_instances() {
        let p = PrefillPolicy::default();
        let mut c = [prefill(0.0, 64), prefill(0.0, 0), prefill(1000.0, 0)];
        c[0].health = Health::Draining;
        c[1].health = Health::Down;
        assert_eq!(choose_prefill(&p, &c, 100), Some(2));
        c[2].health = Health::Down;
        assert_eq!(choose_prefill(&p, &c, 100), None);
        assert_eq!(choose_prefill(&p, &[], 100), None);
    }

    #[test]
    fn prefill_never_counts_the_last_token_as_cached() {
        let p = PrefillPolicy { slack: 0.0, attention_tokens: 0.0 };
        // A fully cached 64-token prompt still computes one token: cost 1, not 0.
        let c = [prefill(0.5, 64), prefill(0.0, 0)];
        assert_eq!(choose_prefill(&p, &c, 64), Some(0));
    }

    fn decode(used: u64, requests: u32) -> DecodeCandidate {
        DecodeCandidate { health: Health::Up, gpus: 1, kv_used: used, kv_capacity: 100, requests }
    }

    #[test]
    fn decode_balances_the_binding_resource() {
        let p = DecodePolicy { max_requests_per_gpu: 10 };
        // KV after: 0.6 / 0.3; batch after: 0.2 / 0.9 → scores 0.6 / 0.9.
        let c = [decode(50, 1), decode(20, 8)];
        assert_eq!(choose_decode(&p, &c, 10), Some(0));
        // Same scores (0.5): fewer requests per GPU wins, then the lowest index.
        let c = [decode(40, 4), decode(40, 2), decode(40, 2)];
        assert_eq!(choose_decode(&p, &c, 10), Some(1));
        // No room: the full instance is skipped; nothing fits → None.
        let c = [decode(95, 0), decode(10, 9)];
        assert_eq!(choose_decode(&p, &c, 10), Some(1));
        let c = [decode(95, 0), decode(10, 10)];
        assert_eq!(choose_decode(&p, &c, 10), None);
    }

    #[test]
    fn decode_skips_instances_that_are_not_up() {
        let p = DecodePolicy::default();
        let mut c = [decode(0, 0), decode(90, 5)];
        c[0].health = Health::Draining;
        assert_eq!(choose_decode(&p, &c, 1), Some(1));
        c[1].health = Health::Down;
        assert_eq!(choose_decode(&p, &c, 1), None);
    }

    fn encoder(pending: u64, cached: usize) -> EncoderLoad {
        EncoderLoad { alive: true, devices: 1, pending_patches: pending, cached }
    }

    #[test]
    fn encoder_affinity_holds_within_the_slack() {
        // Request of 100 patches; encoder 1 holds 2 of its images, encoder 2 holds 1.
        // Loads after: 100, 150, 100 → 150 ≤ 1.5 × 100: affinity to 1.
        let e = [encoder(0, 0), encoder(50, 2), encoder(0, 1)];
        assert_eq!(pick_encoder(&e, 100, 0.5), Some(1));
        // 251 > 150: too loaded, the least loaded (lowest index of equals) wins.
        let e = [encoder(0, 0), encoder(151, 2), encoder(0, 1)];
        assert_eq!(pick_encoder(&e, 100, 0.5), Some(0));
        // Idle encoders: the one with the images, even with no slack.
        let e = [encoder(0, 0), encoder(0, 1)];
        assert_eq!(pick_encoder(&e, 100, 0.0), Some(1));
        // Equal affinity: the lowest index.
        let e = [encoder(0, 0), encoder(0, 1), encoder(0, 1)];
        assert_eq!(pick_encoder(&e, 100, 0.5), Some(1));
    }

    #[test]
    fn encoder_load_is_pending_patches_per_device() {
        let mut e = [encoder(300, 0), encoder(500, 0)];
        e[1].devices = 4; // (500 + 10) / 4 < 310
        assert_eq!(pick_encoder(&e, 10, 0.5), Some(1));
        let e = [encoder(7, 0), encoder(7, 0), encoder(3, 0)];
        assert_eq!(pick_encoder(&e, 10, 0.5), Some(2));
        let e = [encoder(7, 0), encoder(7, 0)];
        assert_eq!(pick_encoder(&e, 10, 0.5), Some(0));
    }

    #[test]
    fn encoder_skips_the_dead_and_none_when_none_is_alive() {
        let mut e = [encoder(0, 3), encoder(1000, 0)];
        e[0].alive = false;
        assert_eq!(pick_encoder(&e, 10, 0.5), Some(1));
        e[1].alive = false;
        assert_eq!(pick_encoder(&e, 10, 0.5), None);
        assert_eq!(pick_encoder(&[], 10, 0.5), None);
    }

    #[test]
    fn round_robin_cycles_over_instances_that_are_up() {
        let mut rr = RoundRobin::default();
        let h = [Health::Up, Health::Down, Health::Up, Health::Draining];
        let picks: Vec<_> = (0..5).map(|_| rr.choose(&h)).collect();
        assert_eq!(picks, vec![Some(0), Some(2), Some(0), Some(2), Some(0)]);
        assert_eq!(rr.choose(&[Health::Down]), None);
        assert_eq!(RoundRobin::default().choose(&[]), None);
    }
}
