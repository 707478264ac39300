//! What drafting costs a step: the draft head of speculative decoding as a
//! small model of its own, priced by the same roofline as the target.
//!
//! - MTP (DeepSeek-V3, V4-Flash): one transformer layer of the target's shape
//!   (attention, the MoE layer with the target's experts, the output head),
//!   run once per draft, one token per request each time: the chain is
//!   sequential, so each draft pays the layer's weights and launch overhead.
//! - DSpark (V4.1-Flash): three window-only blocks with their own MoE (128
//!   experts, top-3) and the output head, run once over the whole block of
//!   drafts (its Markov and confidence heads are small beside the output head
//!   and are left out).

use super::model::{Attention, ModelCost, ModelKind};
use super::{step_cost, DeviceStep, Efficiency, Hardware, SeqWork, StepCost};
use crate::speculative::DraftMethod;

/// DSpark's draft blocks in the released V4.1-Flash.
const DSPARK_LAYERS: usize = 3;
const DSPARK_EXPERTS: usize = 128;
const DSPARK_EXPERTS_PER_TOKEN: usize = 3;

/// The draft head of one model and method.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftHead {
    pub method: DraftMethod,
    /// The head's layers as a model (its experts, its output head).
    pub model: ModelCost,
    /// Drafts proposed per request and step.
    pub drafts: usize,
}

impl DraftHead {
    /// The head `method` adds to `target`, proposing `drafts` tokens per
    /// request; `None` when the model has no such head (MTP on V4.1-Flash,
    /// DSpark before it) or `method` is off.
    pub fn new(target: &ModelCost, method: DraftMethod, drafts: usize) -> Option<Self> {
        let mut model = target.clone();
        model.dense_layers = 0;
        match (method, target.kind) {
            (DraftMethod::Mtp, ModelKind::DeepSeekV3 | ModelKind::V4Flash) => {
                model.layers = 1;
                if let Attention::V4 { csa_layers, hca_layers, .. } = &mut model.attention {
                    // The window part of the layer; its compressed entries are left out.
                    (*csa_layers, *hca_layers) = (0, 0);
                }
            }
            (DraftMethod::Dspark, ModelKind::V41Flash) => {
                model.layers = DSPARK_LAYERS;
                model.experts = DSPARK_EXPERTS;
                model.experts_per_token = DSPARK_EXPERTS_PER_TOKEN;
                if let Attention::V41(a) = &mut model.attention {
                    a.window_layers = DSPARK_LAYERS;
                    (a.ratio2_layers, a.ratio1_layers, a.ratio2_sources, a.ratio1_sources) = (0, 0, 0, 0);
                    (a.ratio2_index_sources, a.ratio1_index_sources, a.candidate_consumers) = (0, 0, 0);
                    a.engram_layers = 0;
                }
            }
            _ => return None,
        }
        Some(Self { method, model, drafts })
    }

    /// Whether `method` has a draft head on `target`.
    pub fn exists(target: ModelKind, method: DraftMethod) -> bool {
        Self::new(&target.cost(), method, 1).is_some()
    }

    /// Device time to propose `drafts` (an MTP chain may stop early; a
    /// DSpark block is always whole) for requests of the given contexts on one
    /// device of an `expert_parallel` group whose ranks all draft alike.
    pub fn cost(
        &self,
        hw: &Hardware,
        contexts: &[usize],
        drafts: usize,
        expert_parallel: usize,
        scale_up_domain: usize,
        eff: Efficiency,
    ) -> StepCost {
        let (passes, tokens) = match self.method {
            DraftMethod::Mtp => (drafts.min(self.drafts), 1),
            _ => (1, self.drafts),
        };
        let ep = expert_parallel.max(1);
        let sequences: Vec<SeqWork> = contexts.iter().map(|&context| SeqWork { new_tokens: tokens, context }).collect();
        let total: usize = sequences.iter().map(|s| s.new_tokens).sum();
        let step = DeviceStep {
            // Every rank sends as many rows as this one, spread evenly over the group.
            expert_tokens: total * self.model.experts_per_token,
            experts_hit: self.model.experts.div_ceil(ep),
            sequences,
            expert_parallel: ep,
            scale_up_domain,
            // The draft head is dense: nothing of it is offloaded.
            offloaded_expert_share: 0.0,
        };
        let one = step_cost(hw, &self.model, &step, eff);
        let k = passes as f64;
        StepCost {
            compute_us: one.compute_us * k,
            memory_us: one.memory_us * k,
            network_us: one.network_us * k,
            overhead_us: one.overhead_us * k,
            total_us: one.total_us * k,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::HardwareKind;

    fn decode(model: &ModelCost, batch: usize, ep: usize) -> f64 {
        let step = DeviceStep {
            sequences: vec![SeqWork { new_tokens: 1, context: 4096 }; batch],
            expert_tokens: batch * model.experts_per_token,
            experts_hit: model.experts.div_ceil(ep),
            expert_parallel: ep,
            scale_up_domain: 8,
            offloaded_expert_share: 0.0,
        };
        step_cost(&HardwareKind::B200.spec(), model, &step, Efficiency::default()).total_us
    }

    #[test]
    fn heads_exist_where_the_models_have_them() {
        assert!(DraftHead::exists(ModelKind::DeepSeekV3, DraftMethod::Mtp));
        assert!(DraftHead::exists(ModelKind::V4Flash, DraftMethod::Mtp));
        assert!(!DraftHead::exists(ModelKind::V41Flash, DraftMethod::Mtp));
        assert!(DraftHead::exists(ModelKind::V41Flash, DraftMethod::Dspark));
        assert!(!DraftHead::exists(ModelKind::V4Flash, DraftMethod::Dspark));
        assert!(!DraftHead::exists(ModelKind::V41Flash, DraftMethod::Off));
    }

    #[test]
    fn drafting_costs_a_fraction_of_a_decode_step() {
        let hw = HardwareKind::B200.spec();
        let eff = Efficiency::default();
        let contexts = vec![4096; 64];
        for (kind, method) in [(ModelKind::V4Flash, DraftMethod::Mtp), (ModelKind::V41Flash, DraftMethod::Dspark)] {
            let target = kind.cost();
            let step = decode(&target, 64, 64);
            let one = DraftHead::new(&target, method, 1).unwrap().cost(&hw, &contexts, 1, 64, 8, eff).total_us;
            let head = DraftHead::new(&target, method, 5).unwrap();
            let five = head.cost(&hw, &contexts, 5, 64, 8, eff).total_us;
            // A chain that stops after two drafts pays two passes; a block is whole.
            let two = head.cost(&hw, &contexts, 2, 64, 8, eff).total_us;
            let want = if method == DraftMethod::Mtp { 2.0 * one } else { five };
            assert!((two - want).abs() < 1e-9 * want, "{kind:?}: {two} vs {want}");
            assert!(one > 0.0 && one < 0.25 * step, "{kind:?}: {one:.0} µs to draft, {step:.0} µs a step");
            match method {
                // Five chained passes cost five times one.
                DraftMethod::Mtp => assert!((five / one - 5.0).abs() < 1e-9, "{five} vs {one}"),
                // One pass over a block of five shares its weight reads.
                _ => assert!(five < 4.0 * one, "{five} vs {one}"),
            }
        }
    }
}
