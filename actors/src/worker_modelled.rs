//! A worker on a modelled device: it checks a step request as a computing
//! worker would, keeps only each sequence's position, and answers after the
//! step's modelled time with placeholder tokens and empty block snapshots
//! (the prefix cache then tracks which blocks exist, not their values).

use std::collections::BTreeSet;
use std::time::Duration;

use deepinfer_engine::cost::SeqWork;
use tokio::task::JoinHandle;

use super::{params, WorkerState};
use crate::cost::micros;
use crate::events::bump;
use crate::modelled::Modelled;
use crate::wire::{Addr, BlockSnapshot, Message, SeqOutput, StateExport, StepOutcome, StepRequest, StepResult};

/// A step whose answer is on its way; dropping it (a newer step, a crash) cancels the answer.
pub(super) struct ModelledRun {
    pub step: u64,
    reply: JoinHandle<()>,
}

impl ModelledRun {
    /// The answer has not been sent yet.
    pub fn pending(&self) -> bool {
        !self.reply.is_finished()
    }
}

impl Drop for ModelledRun {
    fn drop(&mut self) {
        self.reply.abort();
    }
}

/// The token a modelled device "samples": any id that is not special, fixed by sequence and position.
fn placeholder(seq: u64, position: usize, vocab: usize) -> u32 {
    let span = vocab.saturating_sub(1024).max(1) as u64;
    let h = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (position as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    (1000 + (h >> 17) % span).min(vocab.saturating_sub(1) as u64) as u32
}

impl WorkerState {
    pub(super) fn modelled_step(&mut self, from: Addr, req: StepRequest, m: &Modelled) {
        let cfg = &self.ctx.config;
        let bt = self.ctx.block_tokens;
        let fail = |me: &Self, why: String| {
            me.reply(from, req.step, req.attempt, StepOutcome::Failed(why), &[]);
        };
        let repeat = req.repeat.max(1) as usize;
        if repeat > 1 && req.items.iter().any(|it| !it.sample) {
            return fail(self, format!("{repeat} repeated steps need every item to sample"));
        }
        let mut seen = BTreeSet::new();
        let mut missing = Vec::new();
        for it in &req.items {
            let (position, end) = (it.position as usize, (it.position as usize).saturating_add(it.tokens.len()));
            let bad = if it.tokens.is_empty() {
                Some("no tokens".to_string())
            } else if !seen.insert(it.seq) {
                Some("listed twice".to_string())
            } else if end > cfg.max_position_embeddings {
                Some("exceeds the context".to_string())
            } else if it.logits {
                Some("a modelled device computes no logits".to_string())
            } else if it.snapshots.iter().any(|&k| (k as usize + 1) * bt > end) {
                Some(format!("snapshots {:?} beyond {end}", it.snapshots))
            } else {
                params(&it.sampling).validate(cfg.vocab_size).err().map(|e| e.to_string())
            };
            if let Some(why) = bad {
                return fail(self, format!("sequence {}: {why}", it.seq));
            }
            let continues = position > 0 && it.restore.is_empty() && it.import.is_empty() && !it.rebuild;
            if continues && self.positions.get(&it.seq) != Some(&position) {
                missing.push(it.seq);
            }
        }
        if !missing.is_empty() {
            self.ctx.events.record(format_args!("{} needs history of {missing:?} for step {}", self.addr, req.step));
            self.reply(from, req.step, req.attempt, StepOutcome::NeedsHistory(missing), &[]);
            return;
        }
        let mut work = Vec::with_capacity(req.items.len());
        let mut decode = Vec::with_capacity(req.items.len());
        let mut imported = 0;
        let mut outputs = Vec::new();
        let mut snapshots = Vec::new();
        let mut exports = Vec::new();
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
            snapshots.extend(it.snapshots.iter().map(|&block| BlockSnapshot { seq: it.seq, block, lens: Vec::new() }));
        }
        let topo = &self.ctx.topology;
        let instance = topo.instance_of(self.device);
        let ep = topo.size_of(instance) as usize;
        let mut cost = m.step(instance, ep, &work, req.batch_tokens as usize, imported);
        if repeat > 1 {
            // Recomputed or transferred state comes once; the other steps only decode.
            cost.total_us += (repeat - 1) as f64 * m.step(instance, ep, &decode, req.batch_tokens as usize, 0).total_us;
        }
        let slow = self.ctx.faults.slowdown(self.device) * m.model.layers as u32;
        let time: Duration = micros(cost.total_us * self.ctx.faults.slow_factor(self.device)) + slow;
        let result = StepResult {
            step: req.step,
            attempt: req.attempt,
            device: self.device,
            outcome: StepOutcome::Done { outputs, snapshots, loads: Vec::new(), exports },
        };
        let Ok(frame) = crate::wire::encode(
            &crate::wire::Envelope { from: self.addr, to: from, msg: Message::StepResult(result) },
            &[],
        ) else {
            return fail(self, "cannot encode the result".into());
        };
        self.last = Some((req.scheduler, req.step, frame.clone()));
        let (ctx, me) = (std::sync::Arc::clone(&self.ctx), self.addr);
        let reply = tokio::spawn(async move {
            ctx.clock.sleep(time).await;
            ctx.send_frame(me, from, frame);
        });
        self.modelled_run = Some(ModelledRun { step: req.step, reply });
    }
}
