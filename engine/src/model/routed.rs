//! Routed experts one at a time: what an expert shard holds. A model loaded
//! with its routed experts left in the checkpoint ([`RoutedExperts::Elsewhere`])
//! reads an expert's weights, in every main layer, only when a shard asks.

use std::sync::Arc;

use deepinfer_kernels::Linear;

use super::weights::{Loader, Mlp, RoutedExperts};
use super::{LoadError, Model};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::v41::weights::{Expert, Loader as LoaderV41};

/// One routed expert's weights in every main MoE layer.
pub struct RoutedExpert {
    pub id: u32,
    layers: ExpertLayers,
    /// Bytes of its weights as stored.
    pub bytes: u64,
    /// Whether they were read from the checkpoint (else shared with a resident model).
    pub read: bool,
}

enum ExpertLayers {
    V4(Vec<Arc<Mlp>>),
    /// `None` where the layer has fewer experts.
    V41(Vec<Option<Arc<Expert>>>),
}

fn linear_bytes(parts: [&Linear; 3]) -> u64 {
    parts.iter().map(|l| l.storage_bytes() as u64).sum()
}

impl Model {
    /// Whether the main layers' routed experts are in the model (else in its checkpoint).
    pub fn routed_resident(&self) -> bool {
        self.expert_source.is_none()
    }

    /// Expert `id` in every main layer: shared with the model when its experts
    /// are resident, else read from the checkpoint into memory of its own
    /// (freed when the last holder drops it).
    pub fn routed_expert(&self, id: u32) -> Result<RoutedExpert, LoadError> {
        let experts = self.config.n_routed_experts;
        assert!((id as usize) < experts, "expert {id} of {experts}");
        let e = id as usize;
        let (layers, read) = match (&self.v41, &self.expert_source) {
            (None, None) => {
                (ExpertLayers::V4(self.weights.blocks.iter().map(|b| Arc::clone(&b.moe.experts[e])).collect()), false)
            }
            (None, Some(ck)) => {
                let loader = Loader { ck, cfg: &self.config };
                let layers = (0..self.config.num_layers)
                    .map(|l| loader.routed_expert(&format!("layers.{l}.ffn"), e).map(Arc::new))
                    .collect::<Result<_, CheckpointError>>()?;
                (ExpertLayers::V4(layers), true)
            }
            (Some(m), None) => {
                let layers = m.weights.blocks.iter().map(|b| b.moe.experts.get(e).cloned()).collect();
                (ExpertLayers::V41(layers), false)
            }
            (Some(m), Some(ck)) => {
                let loader = LoaderV41 { ck, cfg: &m.config };
                let layers = (0..m.config.n_layers)
                    .map(|l| {
                        let (count, _) = m.config.moe_config(l);
                        (e < count)
                            .then(|| loader.expert(&format!("layers.{l}.ffn.experts.{e}")).map(Arc::new))
                            .transpose()
                    })
                    .collect::<Result<_, CheckpointError>>()?;
                (ExpertLayers::V41(layers), true)
            }
        };
        let bytes = match &layers {
            ExpertLayers::V4(ls) => ls.iter().map(|m| linear_bytes([&m.w1, &m.w2, &m.w3])).sum(),
            ExpertLayers::V41(ls) => ls.iter().flatten().map(|x| linear_bytes([&x.w1, &x.w2, &x.w3])).sum(),
        };
        Ok(RoutedExpert { id, layers, bytes, read })
    }

    /// Output rows `[n, D]` of `expert` in `layer` for input rows `x`; `weights`
    /// (one per row) for models whose experts apply the routing weight.
    pub fn routed_forward(&self, expert: &RoutedExpert, layer: usize, x: &[f32], weights: &[f32]) -> Vec<f32> {
        match (&expert.layers, &self.v41) {
            (ExpertLayers::V4(ls), None) => {
                let n = x.len() / self.config.hidden_size;
                super::moe::mlp(&ls[layer], self.config.swiglu_limit, x, n, super::moe::Threads::Pool)
            }
            (ExpertLayers::V41(ls), Some(m)) => {
                let weights_of = ls[layer].as_ref().expect("the layer has this expert");
                crate::v41::ffn::expert_forward(&m.config, weights_of, x, Some(weights))
            }
            _ => panic!("expert {} was loaded for another model", expert.id),
        }
    }

    /// Load a Hugging Face directory with its routed experts where `routed` says;
    /// `token_map`: a V4.1 Engram model's compressed vocabulary, when its
    /// directory has no map file.
    pub fn load_with(
        dir: &std::path::Path,
        routed: RoutedExperts,
        token_map: Option<Vec<u32>>,
    ) -> Result<Self, LoadError> {
        let v41 = super::is_v41_dir(dir)?;
        let mut model = match routed {
            RoutedExperts::Resident if v41 => {
                return Ok(Self::from_v41(crate::v41::ModelV41::load_routed(dir, token_map, routed)?))
            }
            RoutedExperts::Resident => return Self::load(dir),
            RoutedExperts::Elsewhere if v41 => {
                Self::from_v41(crate::v41::ModelV41::load_routed(dir, token_map, routed)?)
            }
            RoutedExperts::Elsewhere => {
                let config = crate::config::ModelConfig::from_file(&dir.join("config.json"))?;
                let checkpoint = Checkpoint::open(dir)?;
                let weights = super::weights::Weights::load_with(&checkpoint, &config, routed)?;
                Self::new(config, weights)
            }
        };
        model.expert_source = Some(Arc::new(Checkpoint::open_for_reads(dir)?));
        Ok(model)
    }
}
