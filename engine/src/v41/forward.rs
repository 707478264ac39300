//! The V4.1 backbone over one sequence chunk: embed, `hc_mult` streams,
//! Engram before its layers, blocks with single-pass mHC (each sublayer
//! collapses the streams with the `pre` its predecessor computed), the final
//! collapse with the last FFN's `pre`, norm, head.

use deepinfer_kernels::act_quant::{plain_linear, round_bf16};

use super::attention::{self, Shared, Span};
use super::engram;
use super::ffn;
use super::ops::{self, Mix};
use super::state::V41State;
use super::weights::{Block, HyperConnection};
use super::ModelV41;

/// Rows of the final hidden state (or logits) a chunk asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    None,
    Last,
    All,
}

pub struct ChunkResult {
    /// `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// Mean streams at the input of every DSpark target layer, concatenated, `[len, targets · dim]`.
    pub main_hidden: Vec<f32>,
}

impl ModelV41 {
    /// Run `tokens` (positions `state.position..`) through the backbone.
    pub fn forward(&self, tokens: &[u32], state: &mut V41State, rows: Rows) -> ChunkResult {
        let cfg = &self.config;
        let (d, hc, n) = (cfg.dim, cfg.hc_mult, tokens.len());
        assert!(n > 0, "an empty chunk");
        let span = Span { start: state.position, len: n };
        let engram_rows = self.engram_rows(tokens, state);

        let mut streams = vec![0.0f32; n * hc * d];
        let mut row = vec![0.0f32; d];
        for (t, &tok) in tokens.iter().enumerate() {
            self.weights.embed.dequantize_row((tok as usize).min(cfg.vocab_size - 1), &mut row);
            for k in 0..hc {
                streams[(t * hc + k) * d..(t * hc + k + 1) * d].copy_from_slice(&row);
            }
        }
        let mut pre: Vec<Vec<f32>> = vec![one_hot(hc); n];
        let targets = cfg.dspark.as_ref().map_or(&[][..], |s| &s.target_layer_ids[..]);
        let mut main_hidden = vec![0.0f32; n * targets.len() * d];
        let mut shared = Shared::default();
        for (l, block) in self.weights.blocks.iter().enumerate() {
            if let (Some(e), Some(slot)) = (&block.engram, cfg.layers[l].engram) {
                self.apply_engram(e, &engram_rows, slot, &mut streams, n);
            }
            if let Some(i) = targets.iter().position(|&x| x == l) {
                for t in 0..n {
                    let out = &mut main_hidden[(t * targets.len() + i) * d..(t * targets.len() + i + 1) * d];
                    mean_streams(&streams[t * hc * d..(t + 1) * hc * d], hc, out);
                }
            }
            pre = self.block_forward(l, block, &mut streams, &pre, span, state, &mut shared);
        }
        state.position += n;

        let wanted = match rows {
            Rows::None => 0..0,
            Rows::Last => n - 1..n,
            Rows::All => 0..n,
        };
        let m = wanted.len();
        let mut x = vec![0.0f32; m * d];
        for (i, t) in wanted.enumerate() {
            let out = &mut x[i * d..(i + 1) * d];
            ops::hc_pre(&streams[t * hc * d..(t + 1) * hc * d], &pre[t], out);
            ops::rms_norm(out, &self.weights.norm, cfg.norm_eps);
        }
        let mut logits = vec![0.0f32; m * cfg.vocab_size];
        plain_linear(&self.weights.head, &x, m, &mut logits);
        ChunkResult { logits, main_hidden }
    }

    /// One block; returns the `pre` of its FFN mixes (the next block's attention collapse).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block_forward(
        &self,
        layer: usize,
        block: &Block,
        streams: &mut [f32],
        pre: &[Vec<f32>],
        span: Span,
        state: &mut V41State,
        shared: &mut Shared,
    ) -> Vec<Vec<f32>> {
        let cfg = &self.config;
        let (d, hc, n) = (cfg.dim, cfg.hc_mult, span.len);
        let attn_mixes = self.mixes(&block.hc_attn, streams, n);
        let mut x = vec![0.0f32; n * d];
        for t in 0..n {
            let out = &mut x[t * d..(t + 1) * d];
            ops::hc_pre(&streams[t * hc * d..(t + 1) * hc * d], &pre[t], out);
            ops::rms_norm(out, &block.attn_norm, cfg.norm_eps);
        }
        let rope = if cfg.layers.get(layer).is_some_and(|p| p.ratio > 0) { &self.rope_compress } else { &self.rope_main };
        let out = attention::forward(cfg, layer, &block.attn, rope, &x, span, state, shared);
        for t in 0..n {
            ops::hc_post(&mut streams[t * hc * d..(t + 1) * hc * d], &out[t * d..(t + 1) * d], &attn_mixes[t]);
        }

        let ffn_mixes = self.mixes(&block.hc_ffn, streams, n);
        for t in 0..n {
            let out = &mut x[t * d..(t + 1) * d];
            ops::hc_pre(&streams[t * hc * d..(t + 1) * hc * d], &attn_mixes[t].pre, out);
            ops::rms_norm(out, &block.ffn_norm, cfg.norm_eps);
        }
        let out = ffn::forward(cfg, &block.moe, &x, n);
        for t in 0..n {
            ops::hc_post(&mut streams[t * hc * d..(t + 1) * hc * d], &out[t * d..(t + 1) * d], &ffn_mixes[t]);
        }
        ffn_mixes.into_iter().map(|m| m.pre).collect()
    }

    fn mixes(&self, h: &HyperConnection, streams: &[f32], n: usize) -> Vec<Mix> {
        let cfg = &self.config;
        let width = cfg.hc_mult * cfg.dim;
        (0..n)
            .map(|t| {
                ops::hc_mixes(
                    &streams[t * width..(t + 1) * width],
                    &h.mix,
                    &h.scale,
                    &h.base,
                    cfg.hc_mult,
                    cfg.hc_sinkhorn_iters,
                    cfg.norm_eps,
                    cfg.hc_eps,
                )
            })
            .collect()
    }

    /// Per token, per Engram layer, the table rows it looks up; advances the look-back.
    fn engram_rows(&self, tokens: &[u32], state: &mut V41State) -> Vec<Vec<Vec<u64>>> {
        let Some(hash) = &self.engram_hash else { return Vec::new() };
        tokens
            .iter()
            .map(|&tok| {
                state.engram_history.push(hash.compress(tok));
                let keep = hash.max_ngram_size.min(state.engram_history.len());
                let from = state.engram_history.len() - keep;
                state.engram_history.drain(..from);
                hash.rows(&state.engram_history)
            })
            .collect()
    }

    fn apply_engram(&self, e: &super::weights::Engram, rows: &[Vec<Vec<u64>>], slot: usize, streams: &mut [f32], n: usize) {
        let cfg = &self.config;
        let (d, hc) = (cfg.dim, cfg.hc_mult);
        let ecfg = cfg.engram.as_ref().expect("engram config");
        let width = ecfg.hash_cols() * ecfg.head_dim;
        let mut looked_up = vec![0.0f32; n * width];
        for t in 0..n {
            for (c, &r) in rows[t][slot].iter().enumerate() {
                e.table.row(r as usize, &mut looked_up[t * width + c * ecfg.head_dim..t * width + (c + 1) * ecfg.head_dim]);
            }
        }
        let kv = deepinfer_kernels::act_quant::quantized_linear(&e.wkv, &looked_up, n);
        let kv_width = d * (hc + 1);
        for t in 0..n {
            let kv_t = &kv[t * kv_width..(t + 1) * kv_width];
            let value = &kv_t[hc * d..];
            for k in 0..hc {
                let s = &mut streams[(t * hc + k) * d..(t * hc + k + 1) * d];
                let g = engram::gate(s, &kv_t[k * d..(k + 1) * d], &e.weight[k * d..(k + 1) * d], cfg.norm_eps);
                s.iter_mut().zip(value).for_each(|(h, v)| *h = round_bf16(*h + g * v));
            }
        }
    }
}

fn one_hot(hc: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; hc];
    v[0] = 1.0;
    v
}

/// `bf16(mean over the streams)` of one token.
fn mean_streams(streams: &[f32], hc: usize, out: &mut [f32]) {
    let d = out.len();
    for (c, o) in out.iter_mut().enumerate() {
        let total: f64 = (0..hc).map(|k| streams[k * d + c] as f64).sum();
        *o = round_bf16((total / hc as f64) as f32);
    }
}
