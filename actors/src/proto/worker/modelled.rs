//! A worker on a modelled device: it checks a step request as a computing
//! worker would, keeps only each sequence's position, and answers after the
//! step's modelled time with placeholder tokens and empty block snapshots
//! (the prefix cache then tracks which blocks exist, not their values).

use std::time::Duration;

use deepinfer_engine::cost::SeqWork;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::speculative::policy::{DraftPolicy, StepCost};
use deepinfer_engine::speculative::DraftMethod;

use super::validate::{check_request, Device};
use super::{Effect, WorkerMachine};
use crate::modelled::cost::micros;
use crate::modelled::devices::Modelled;
use crate::modelled::drafting::{
    chain_length, min_survival, run_event, step_cost_between, DraftLimits, Drafting, Lane, LaneStep,
    SURVIVAL_WORTH_DRAFTING_MAX,
};
use crate::sim::events::bump;
use crate::wire::{
    Addr, BlockSnapshot, Message, SeqOutput, StateExport, StepOutcome, StepRequest, StepResult, Verification,
};

/// The token a modelled device "samples": any id that is not special, fixed by sequence and position.
fn placeholder(seq: u64, position: usize, vocab: usize) -> u32 {
    let span = vocab.saturating_sub(1024).max(1) as u64;
    let h = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (position as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    (1000 + (h >> 17) % span).min(vocab.saturating_sub(1) as u64) as u32
}

impl WorkerMachine {
    pub(super) fn modelled_step(&mut self, from: Addr, req: StepRequest, m: &Modelled) {
        let positions = &self.positions;
        let held = |seq| positions.get(&seq).copied();
        let missing = match check_request(&req, &self.ctx.config, self.ctx.block_tokens, Device::Modelled, held) {
            Ok(missing) => missing,
            Err(why) => return self.refuse(from, &req, why),
        };
        if !missing.is_empty() {
            return self.needs_history(from, &req, missing);
        }
        let cfg = &self.ctx.config;
        let bt = self.ctx.block_tokens;
        let repeat = req.repeat.max(1) as usize;
        let mut work = Vec::with_capacity(req.items.len());
        let mut decode = Vec::with_capacity(req.items.len());
        let mut imported = 0;
        let mut outputs = Vec::new();
        let mut snapshots = Vec::new();
        let mut exports = Vec::new();
        let mut verifications = Vec::new();
        // Speculative decoding: every sampling item is a lane (index into `work`).
        let drafting = m.drafting();
        let mut lanes: Vec<(usize, Lane, bool)> = Vec::new();
        for it in &req.items {
            let (position, end) = (it.position as usize, it.position as usize + it.tokens.len());
            if it.rebuild {
                bump(&self.ctx.metrics.sequences_rebuilt);
            }
            if !it.import.is_empty() {
                imported += position;
            }
            if it.export {
                // Positions only: the decode instance's modelled worker continues from them.
                exports.push(StateExport { seq: it.seq, lens: vec![end as u32, 0] });
            }
            snapshots.extend(it.snapshots.iter().map(|&block| BlockSnapshot { seq: it.seq, block, lens: Vec::new() }));
            if drafting.is_some() && it.sample {
                // The engine proposes after every sampling step: a state that
                // continues has its proposal, a new or rebuilt one has none.
                let continues = position > 0 && it.restore.is_empty() && it.import.is_empty() && !it.rebuild;
                let lane =
                    Lane { seq: it.seq, from: position, to: end, allowance: it.drafts as usize, proposal: continues };
                lanes.push((work.len(), lane, !it.export));
                work.push(SeqWork { new_tokens: it.tokens.len(), context: position });
                continue;
            }
            work.push(SeqWork { new_tokens: it.tokens.len(), context: position });
            // The further steps of an event decode one token each, priced at their middle context.
            decode.push(SeqWork { new_tokens: 1, context: end + (repeat - 1) / 2 });
            self.positions.insert(it.seq, end + repeat - 1);
            if it.sample {
                for at in end..end + repeat {
                    let token = placeholder(it.seq, at, cfg.vocab_size);
                    outputs.push(SeqOutput { seq: it.seq, token, logprob: 0.0, position: at as u64, top: Vec::new() });
                }
            }
        }
        let topo = &self.ctx.topology;
        let instance = topo.instance_of(self.device);
        let ep = topo.size_of(instance) as usize;
        // The expert loads of this moment on the placement in force; the
        // instance's first worker counts the step for the balance record.
        let counted = if topo.devices_of(instance).start == self.device { repeat as u64 } else { 0 };
        m.advance(instance, self.now, counted);
        let cost_us = match drafting {
            Some(d) if !lanes.is_empty() => {
                let limits = DraftLimits {
                    context: cfg.max_position_embeddings,
                    window: cfg.sliding_window.saturating_sub(2),
                    block_tokens: (self.ctx.engine.prefix_mode != PrefixMode::Off).then_some(bt),
                };
                let event = Event { m, d, instance, ep, batch_tokens: req.batch_tokens as usize, imported, repeat };
                let (steps, cost_us) = event.run(&lanes, &mut work, &decode, limits);
                for (l, (_, lane, _)) in lanes.iter().enumerate() {
                    let mut position = lane.from;
                    for row in &steps {
                        let s = row[l];
                        let to = s.from + s.fed;
                        for at in to..=to + s.accepted {
                            let token = placeholder(lane.seq, at, cfg.vocab_size);
                            outputs.push(SeqOutput {
                                seq: lane.seq,
                                token,
                                logprob: 0.0,
                                position: at as u64,
                                top: Vec::new(),
                            });
                        }
                        verifications.push(Verification {
                            seq: lane.seq,
                            drafts: s.drafts as u32,
                            accepted: s.accepted as u32,
                        });
                        position = if s.drafts > 0 && s.accepted == s.drafts { to + s.drafts } else { to };
                    }
                    self.positions.insert(lane.seq, position);
                }
                cost_us
            }
            _ => {
                let mut cost = m.step(instance, ep, &work, req.batch_tokens as usize, imported);
                if repeat > 1 {
                    // Recomputed or transferred state comes once; the other steps only decode.
                    cost.total_us +=
                        (repeat - 1) as f64 * m.step(instance, ep, &decode, req.batch_tokens as usize, 0).total_us;
                }
                cost.total_us
            }
        };
        let slow = self.ctx.faults.slowdown(self.device) * m.model.layers as u32;
        let time: Duration = micros(cost_us * self.ctx.faults.slow_factor(self.device)) + slow;
        let result = StepResult {
            step: req.step,
            attempt: req.attempt,
            device: self.device,
            outcome: StepOutcome::Done { outputs, snapshots, loads: Vec::new(), exports, verifications },
        };
        let Some(out) = crate::proto::encode(&self.ctx.events, self.addr, from, Message::StepResult(result), &[])
        else {
            return self.refuse(from, &req, "cannot encode the result".into());
        };
        self.last = Some((req.scheduler, req.step, out.frame.clone()));
        self.modelled_due = Some((req.step, self.now + time));
        self.effects.push(Effect::SendLater { after: time, out });
    }
}

/// One worker's event with speculative decoding, to price.
struct Event<'a> {
    m: &'a Modelled,
    d: &'a Drafting,
    instance: u32,
    ep: usize,
    /// Tokens the instance's step feeds (every worker's part, drafts not included).
    batch_tokens: usize,
    imported: usize,
    repeat: usize,
}

impl Event<'_> {
    /// Run the lanes (index into `work`, lane, drafts after the step)
    /// through the event's decode steps; returns what each did and the
    /// event's device time in µs. The first step is priced as planned, with
    /// its drafts in `work`; the others at each lane's mean tokens and
    /// context; the draft head after every step. The instance's tokens are
    /// scaled from this worker's, as every rank drafts alike.
    fn run(
        &self,
        lanes: &[(usize, Lane, bool)],
        work: &mut [SeqWork],
        decode: &[SeqWork],
        limits: DraftLimits,
    ) -> (Vec<Vec<LaneStep>>, f64) {
        let (m, most) = (self.m, self.d.max_drafts());
        let fed: usize = work.iter().map(|w| w.new_tokens).sum();
        let scale = self.batch_tokens as f64 / fed.max(1) as f64;
        let price = |work: &[SeqWork], tokens: usize, imported: usize| {
            m.step(self.instance, self.ep, work, (tokens as f64 * scale).round() as usize, imported)
        };
        let may_verify = self.repeat > 1 || lanes.iter().any(|(_, l, _)| l.proposal && l.allowance > 0);
        let may_propose = lanes.iter().any(|&(_, _, stays)| stays);
        let adaptive = matches!(self.d.config.policy, DraftPolicy::Adaptive { .. });
        let cost = if adaptive && (may_verify || may_propose) {
            // The policy weighs drafts against this step's time by tokens verified.
            let base = price(work, fed, self.imported);
            let mut full = work.to_vec();
            for &(i, _, _) in lanes {
                full[i].new_tokens += most;
            }
            let all = price(&full, fed + lanes.len() * most, self.imported);
            step_cost_between(lanes.len(), most, &base, &all, &m.spec.efficiency)
        } else {
            StepCost::linear(1.0, 0.0)
        };
        // The engine's adaptive drafting: nothing is proposed when no draft
        // could pay for its verification at this batch (decided here for the
        // whole event), and an MTP chain stops where its drafts cannot pay:
        // fewer drafts to verify, fewer sequential passes of the head (as the
        // acceptance model's means would stop it).
        let min = if adaptive { min_survival(&cost, lanes.len()) } else { 0.0 };
        let proposes = min < SURVIVAL_WORTH_DRAFTING_MAX;
        let chain = (self.d.config.method == DraftMethod::Mtp && adaptive && proposes).then_some(min);
        let mut plain: Vec<Lane> = lanes.iter().map(|&(_, l, _)| l).collect();
        let mut limits = limits;
        if !proposes {
            plain.iter_mut().for_each(|l| l.proposal = false);
            limits.window = 0;
        }
        let steps = run_event(self.d, m.spec.seed, &plain, self.repeat, limits, &cost, chain.unwrap_or(0.0));
        let mut drafts = 0;
        for (&(i, _, _), s) in lanes.iter().zip(&steps[0]) {
            work[i].new_tokens += s.drafts;
            drafts += s.drafts;
        }
        let mut total_us = price(work, fed + drafts, self.imported).total_us;
        if self.repeat > 1 {
            let later = (self.repeat - 1) as f64;
            let mut mean: Vec<SeqWork> = decode.to_vec();
            let first = mean.len();
            let mut exact = 0.0;
            for l in 0..lanes.len() {
                let (tokens, context) =
                    steps[1..].iter().fold((0, 0), |(t, c), row| (t + row[l].fed + row[l].drafts, c + row[l].from));
                exact += tokens as f64 / later;
                mean.push(SeqWork { new_tokens: tokens / (self.repeat - 1), context: context / (self.repeat - 1) });
            }
            // Hand out the fractions so that the steps' tokens add up.
            let floor: usize = mean[first..].iter().map(|w| w.new_tokens).sum();
            for w in mean[first..].iter_mut().take((exact.round() as usize).saturating_sub(floor)) {
                w.new_tokens += 1;
            }
            let tokens = mean.iter().map(|w| w.new_tokens).sum();
            total_us += later * price(&mean, tokens, 0).total_us;
        }
        // The draft head proposes after every step for the requests that stay.
        let contexts: Vec<usize> = lanes
            .iter()
            .zip(&steps[0])
            .filter(|((_, _, stays), _)| *stays)
            .map(|(_, s)| s.from + s.fed + s.drafts)
            .collect();
        let passes = match chain {
            Some(min) => {
                let means: Vec<f64> = (0..most).map(|j| self.d.acceptance.mean(j)).collect();
                chain_length(&means, min)
            }
            None if proposes => most,
            None => 0,
        };
        total_us += self.repeat as f64 * m.draft_cost(self.instance, self.ep, &contexts, passes);
        (steps, total_us)
    }
}
