//! What one token's forward pass costs in weights: the bytes it reads and the
//! multiply-adds it does in linear layers. These are the denominators of the
//! machine bounds the CPU benchmark reports (decode is bound by reading the
//! active weights, prefill by the matmul units).

use deepinfer_kernels::{Linear, WeightFormat};

use super::weights::{Attention, Block, Compressor, Mlp};
use super::Model;

/// One token's share of a forward pass's weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Weight bytes as the checkpoint stores them (codes plus one byte per
    /// UE8M0 scale) of every linear one token passes through, with
    /// `experts_per_token` routed experts in every layer and the output head.
    pub active_bytes: u64,
    /// Multiply-adds of those linears for one token.
    pub active_macs: u64,
    /// Bytes of every weight of the main layers and the head: what a batch
    /// large enough to touch every expert reads per step.
    pub total_bytes: u64,
    /// The part of `active_bytes` held as FP4 codes (with their scales): a
    /// decode step's kernels spend about twice the instructions per byte on
    /// these as on FP8, so the bench prices each format at its own rate.
    pub active_fp4_bytes: u64,
    /// The part of `active_macs` done against FP4 weights.
    pub active_fp4_macs: u64,
}

impl Footprint {
    pub(crate) fn add(&mut self, lin: &Linear, active: bool) {
        let bytes = stored_bytes(lin);
        self.total_bytes += bytes;
        if active {
            self.active_bytes += bytes;
            self.active_macs += (lin.rows * lin.cols) as u64;
            if is_fp4(lin) {
                self.active_fp4_bytes += bytes;
                self.active_fp4_macs += (lin.rows * lin.cols) as u64;
            }
        }
    }

    fn add_mlp(&mut self, mlp: &Mlp, active: bool) {
        for lin in [&mlp.w1, &mlp.w2, &mlp.w3] {
            self.add(lin, active);
        }
    }

    fn add_compressor(&mut self, c: &Compressor) {
        self.add(&c.wkv, true);
        self.add(&c.wgate, true);
    }

    fn add_attention(&mut self, attn: &Attention) {
        for lin in [&attn.wq_a, &attn.wq_b, &attn.wkv, &attn.wo_b] {
            self.add(lin, true);
        }
        attn.wo_a.iter().for_each(|lin| self.add(lin, true));
        if let Some(c) = &attn.compressor {
            self.add_compressor(c);
        }
        if let Some(ix) = &attn.indexer {
            self.add_compressor(&ix.compressor);
            self.add(&ix.wq_b, true);
            self.add(&ix.weights_proj, true);
        }
    }

    fn add_block(&mut self, block: &Block, experts_per_token: usize) {
        self.add(&block.hc_attn.mix, true);
        self.add(&block.hc_ffn.mix, true);
        self.add_attention(&block.attn);
        self.add(&block.moe.gate, true);
        if let Some(shared) = &block.moe.shared {
            self.add_mlp(shared, true);
        }
        // Experts of one layer share their shape; which ones a token picks does
        // not change what it reads.
        for (e, expert) in block.moe.experts.iter().enumerate() {
            self.add_mlp(expert, e < experts_per_token);
        }
    }
}

impl Footprint {
    /// A weight kept as plain values (`rows × cols`, `bytes_per_value` each
    /// as published), which one token uses whole when `active`.
    pub(crate) fn add_values(&mut self, rows: usize, cols: usize, bytes_per_value: usize, active: bool) {
        let bytes = (rows * cols * bytes_per_value) as u64;
        self.total_bytes += bytes;
        if active {
            self.active_bytes += bytes;
            self.active_macs += (rows * cols) as u64;
        }
    }
}

fn is_fp4(lin: &Linear) -> bool {
    match &lin.format {
        WeightFormat::Fp4 { .. } => true,
        WeightFormat::Panels(p) => p.is_fp4(),
        _ => false,
    }
}

/// Bytes of `lin` as published: codes, and one byte per power-of-two scale.
pub(crate) fn stored_bytes(lin: &Linear) -> u64 {
    let bytes = match &lin.format {
        WeightFormat::F32(d) => d.len() * 4,
        WeightFormat::Bf16(d) => d.len(),
        WeightFormat::Fp8 { data, scales, .. } | WeightFormat::Fp4 { data, scales, .. } => data.len() + scales.len(),
        WeightFormat::Panels(p) => p.published_bytes(),
    };
    bytes as u64
}

impl Model {
    /// One token's weights through the main layers and the head (MTP and
    /// DSpark blocks excluded), or `None` for a model whose routed experts
    /// live on shards.
    pub fn footprint(&self) -> Option<Footprint> {
        if let Some(v41) = &self.v41 {
            return v41.footprint();
        }
        if self.weights.blocks.iter().any(|b| b.moe.experts.is_empty()) {
            return None;
        }
        let mut f = Footprint::default();
        for block in &self.weights.blocks {
            f.add_block(block, self.config.experts_per_token);
        }
        f.add(&self.weights.hc_head.mix, true);
        f.add(&self.weights.head, true);
        // One embedding row per token.
        let embed = stored_bytes(&self.weights.embed);
        f.total_bytes += embed;
        f.active_bytes += embed / self.weights.embed.rows as u64;
        assert!(f.active_bytes <= f.total_bytes && f.active_macs > 0, "footprint of a loaded model");
        Some(f)
    }
}
