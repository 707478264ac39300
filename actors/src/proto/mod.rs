//! Protocol machines: each actor's logic, sans-IO. A machine is handed the
//! time and one input and leaves effects for its shell in
//! [`crate::actor`]; no ractor, tokio, clock or socket appears below this
//! folder (a tidy test checks it), so a machine is tested with scripted
//! inputs alone.

pub mod cache;
pub mod cursor;
pub mod encoder;
pub mod images;
pub mod membership;
pub mod router;
pub mod scheduler;
pub mod shard;
pub mod worker;

/// A frame a machine asks its shell to send (from the machine's own address).
#[derive(Debug, PartialEq)]
pub struct Outgoing {
    pub to: crate::wire::Addr,
    pub frame: Vec<u8>,
}

/// `msg` from `from` to `to`, encoded; `None` (logged) if it cannot be,
/// which the sender treats as a lost message.
pub(crate) fn encode(
    events: &crate::sim::events::EventLog,
    from: crate::wire::Addr,
    to: crate::wire::Addr,
    msg: crate::wire::Message,
    body: &[f32],
) -> Option<Outgoing> {
    match crate::wire::encode(&crate::wire::Envelope { from, to, msg }, body) {
        Ok(frame) => Some(Outgoing { to, frame }),
        Err(e) => {
            events.record(format_args!("{from} cannot encode for {to}: {e}"));
            None
        }
    }
}

/// The engine's sampling parameters a wire `Sampling` stands for. The wire
/// carries no logit processing: `Cluster::submit` refuses it.
pub(crate) fn sampling_params(s: &crate::wire::Sampling) -> deepinfer_engine::sampling::SamplingParams {
    deepinfer_engine::sampling::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k as usize,
        seed: s.seed,
        logprobs: s.logprobs as usize,
        min_p: s.min_p,
        logit_bias: s.logit_bias.iter().map(|b| (b.token, b.bias)).collect(),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        repetition_penalty: s.repetition_penalty,
    }
}

/// The wire form of a request's sampling parameters (the inverse of [`sampling_params`]).
pub(crate) fn sampling_wire(p: &deepinfer_engine::sampling::SamplingParams) -> crate::wire::Sampling {
    crate::wire::Sampling {
        temperature: p.temperature,
        top_p: p.top_p,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        seed: p.seed,
        logprobs: p.logprobs.min(u32::MAX as usize) as u32,
        min_p: p.min_p,
        logit_bias: p.logit_bias.iter().map(|&(token, bias)| crate::wire::TokenBias { token, bias }).collect(),
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        repetition_penalty: p.repetition_penalty,
    }
}

/// A greedy request of the machine tests: `prompt`, up to `max_tokens`, EOS ignored.
#[cfg(test)]
pub(crate) fn test_spec(id: u64, prompt: Vec<u32>, max_tokens: u32) -> crate::wire::RequestSpec {
    crate::wire::RequestSpec {
        id,
        prompt,
        max_tokens,
        sampling: crate::wire::Sampling::greedy(),
        stop_token_ids: Vec::new(),
        stop_sequences: Vec::new(),
        ignore_eos: true,
        logits: false,
        constraint: None,
        retention: None,
        priority: 0,
        images: Vec::new(),
    }
}

/// What every machine test is handed: the tiny V4 model on `devices`
/// devices, `per_node` to a node, in `instances` equal instances.
#[cfg(test)]
pub(crate) fn test_ctx(devices: u32, per_node: u32, instances: u32) -> std::sync::Arc<crate::cluster::ctx::Ctx> {
    test_ctx_with(devices, per_node, instances, Default::default())
}

/// [`test_ctx`] with the nodes' prompt-cache tiers below the pools.
#[cfg(test)]
pub(crate) fn test_ctx_with(
    devices: u32,
    per_node: u32,
    instances: u32,
    cache_tiers: crate::cluster::NodeCacheTiers,
) -> std::sync::Arc<crate::cluster::ctx::Ctx> {
    use deepinfer_engine::presets::{build, Preset};
    let model = std::sync::Arc::new(build(Preset::TinyV4, 7).expect("tiny-v4 builds"));
    let mut cfg = crate::cluster::ClusterConfig::new(devices, devices / instances);
    cfg.devices_per_node = per_node;
    cfg.instances = instances;
    cfg.cache_tiers = cache_tiers;
    crate::cluster::build_ctx(model, &cfg, crate::cluster::in_process_env(&cfg)).expect("a valid test cluster")
}

/// [`test_ctx`] whose computing workers draft with tiny-v4's MTP block, `k` drafts a step.
#[cfg(test)]
pub(crate) fn test_ctx_drafting(devices: u32, k: usize) -> std::sync::Arc<crate::cluster::ctx::Ctx> {
    use deepinfer_engine::presets::{build, Preset};
    use deepinfer_engine::speculative::{policy::DraftPolicy, DraftMethod, SpeculativeConfig};
    let model = std::sync::Arc::new(build(Preset::TinyV4, 7).expect("tiny-v4 builds"));
    let mut cfg = crate::cluster::ClusterConfig::new(devices, devices);
    cfg.engine.speculative = SpeculativeConfig { method: DraftMethod::Mtp, policy: DraftPolicy::Fixed(k) };
    crate::cluster::build_ctx(model, &cfg, crate::cluster::in_process_env(&cfg)).expect("a valid test cluster")
}

/// The machine must stop: its supervisor restarts the actor (an injected
/// crash, or a lost node it cannot serve around without starting over).
#[derive(Debug, PartialEq, Eq)]
pub struct Crash(pub String);

impl From<String> for Crash {
    fn from(why: String) -> Self {
        Self(why)
    }
}

impl std::fmt::Display for Crash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
