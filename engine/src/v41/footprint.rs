//! One token's weights in a DeepSeek-V4.1 forward pass (the denominators of
//! the CPU benchmark's bounds; see [`crate::model::Footprint`]).

use crate::model::footprint::{stored_bytes, Footprint};

use super::weights::{Attention, Block, Expert};
use super::ModelV41;

impl ModelV41 {
    /// One token's weights through the main layers and the head (DSpark
    /// layers excluded), or `None` when the routed experts live on shards.
    /// Engram table rows (a few per token, FP8) are not counted.
    pub fn footprint(&self) -> Option<Footprint> {
        let w = &self.weights;
        if w.blocks.iter().any(|b| b.moe.experts.is_empty()) {
            return None;
        }
        let mut f = Footprint::default();
        for block in &w.blocks {
            add_block(&mut f, block);
        }
        f.add(&w.head, true);
        let embed = stored_bytes(&w.embed);
        f.total_bytes += embed;
        f.active_bytes += embed / w.embed.rows as u64;
        assert!(f.active_bytes <= f.total_bytes && f.active_macs > 0, "footprint of a loaded model");
        Some(f)
    }
}

fn add_block(f: &mut Footprint, block: &Block) {
    // mHC mixes are f32 `[(2 + hc) · hc, hc · dim]`.
    for hc in [&block.hc_attn, &block.hc_ffn] {
        f.add_values(1, hc.mix.len(), 4, true);
    }
    add_attention(f, &block.attn);
    f.add(&block.moe.gate, true);
    add_expert(f, &block.moe.shared, true);
    for (e, expert) in block.moe.experts.iter().enumerate() {
        add_expert(f, expert, e < block.moe.n_activated);
    }
    if let Some(engram) = &block.engram {
        f.add(&engram.wkv, true);
    }
}

fn add_attention(f: &mut Footprint, attn: &Attention) {
    for lin in [&attn.wq_a, &attn.wq_b, &attn.wkv, &attn.wo_a, &attn.wo_b] {
        f.add(lin, true);
    }
    if let Some(c) = &attn.compressor {
        f.add(&c.wkv, true);
        if let Some(gate) = &c.wgate {
            f.add(gate, true);
        }
    }
    if let Some(ix) = &attn.indexer {
        f.add(&ix.wq_b, true);
        f.add(&ix.weights_proj, true);
        if let Some((wk, _)) = &ix.wk {
            f.add(wk, true);
        }
    }
}

fn add_expert(f: &mut Footprint, expert: &Expert, active: bool) {
    for lin in [&expert.w1, &expert.w2, &expert.w3] {
        f.add(lin, active);
    }
}
