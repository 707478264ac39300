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
use crate::model::{Dispatch, ExpertOutputs};

/// Rows of the final hidden state (or logits) a chunk asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    None,
    Last,
    All,
    /// The last `n` rows (a chunk's drafts and the token before them).
    Tail(usize),
}

impl From<crate::model::LogitsWanted> for Rows {
    fn from(w: crate::model::LogitsWanted) -> Self {
        use crate::model::LogitsWanted;
        match w {
            LogitsWanted::None => Rows::None,
            LogitsWanted::Last => Rows::Last,
            LogitsWanted::All => Rows::All,
            LogitsWanted::Tail(n) => Rows::Tail(n),
        }
    }
}

/// One sequence's chunk for [`ModelV41::begin`].
#[derive(Clone, Copy)]
pub struct ChunkInput<'a> {
    pub tokens: &'a [u32],
    pub state: &'a V41State,
    /// Trailing draft tokens (see `Chunk::drafts`).
    pub drafts: usize,
    /// Image spans inside the chunk (none for text).
    pub spans: &'a [EmbeddedSpan<'a>],
}

/// Embedding rows `[len, dim]` (bf16 values) that replace the token embeddings
/// at chunk positions `offset..offset + len`: an image's span
/// (`ModelV41::span_embeddings`). Those positions route with the routers'
/// image bias and are gaps in Engram's n-grams (no contribution, and the
/// look-back of later tokens stops there).
#[derive(Clone, Copy, Debug)]
pub struct EmbeddedSpan<'a> {
    pub offset: usize,
    pub rows: &'a [f32],
}

pub struct ChunkResult {
    /// `[rows, vocab]`.
    pub logits: Vec<f32>,
    /// Mean streams at the input of every DSpark target layer, concatenated, `[len, targets · dim]`.
    pub main_hidden: Vec<f32>,
}

/// One sequence's part of a pass.
struct SeqPass {
    span: Span,
    tokens: Vec<u32>,
    /// Per token: inside an image span.
    image: Vec<bool>,
    streams: Vec<f32>,
    /// Per token: the `pre` the next sublayer collapses the streams with.
    pre: Vec<Vec<f32>>,
    engram_rows: Vec<Vec<Vec<u64>>>,
    shared: Shared,
    main_hidden: Vec<f32>,
    /// The FFN mixes of the layer in progress.
    ffn_mixes: Vec<Mix>,
}

/// A forward pass over a batch of chunks, driven layer by layer so that the
/// routed experts can run elsewhere (expert parallelism): `attend`, compute
/// the dispatch's experts, `combine`; then `finish`.
pub struct PassV41 {
    seqs: Vec<SeqPass>,
    layer: usize,
    dispatch: Option<Dispatch>,
}

impl PassV41 {
    pub fn layer(&self) -> usize {
        self.layer
    }
}

impl ModelV41 {
    /// Run `tokens` (positions `state.position..`) through the backbone.
    pub fn forward(&self, tokens: &[u32], state: &mut V41State, rows: Rows) -> ChunkResult {
        assert!(!tokens.is_empty(), "an empty chunk");
        self.forward_with(tokens, &[], state, rows)
    }

    /// [`ModelV41::forward`] with image spans inside the chunk.
    pub fn forward_with(
        &self,
        tokens: &[u32],
        spans: &[EmbeddedSpan],
        state: &mut V41State,
        rows: Rows,
    ) -> ChunkResult {
        assert!(!tokens.is_empty(), "an empty chunk");
        let mut pass = self.begin(&[ChunkInput { tokens, state: &*state, drafts: 0, spans }]);
        while !self.is_done(&pass) {
            let dispatch = self.attend(&mut pass, &mut [&mut *state]).clone();
            let outputs = self.run_experts(pass.layer, &dispatch);
            self.combine(&mut pass, &outputs);
        }
        self.finish(pass, &mut [state], rows).pop().expect("one chunk")
    }

    /// Embed the chunks and hash their n-grams.
    pub fn begin(&self, chunks: &[ChunkInput]) -> PassV41 {
        let cfg = &self.config;
        let (d, hc) = (cfg.dim, cfg.hc_mult);
        let targets = cfg.dspark.as_ref().map_or(0, |s| s.target_layer_ids.len());
        let mut row = vec![0.0f32; d];
        let seqs = chunks
            .iter()
            .map(|&ChunkInput { tokens, state, drafts, spans }| {
                let n = tokens.len();
                // A chunk that starts the sequence lists its keys differently
                // (see `attention`), so drafts never ride on one.
                assert!(drafts == 0 || (state.position > 0 && drafts < n), "drafts follow a real token");
                assert!(drafts < self.config.window_size, "drafts fit the window");
                assert!(state.draft_mark.is_none(), "the previous drafts were accepted or rejected");
                let mut streams = vec![0.0f32; n * hc * d];
                for (t, &tok) in tokens.iter().enumerate() {
                    self.weights.embed.dequantize_row((tok as usize).min(cfg.vocab_size - 1), &mut row);
                    for k in 0..hc {
                        streams[(t * hc + k) * d..(t * hc + k + 1) * d].copy_from_slice(&row);
                    }
                }
                let mut image = vec![false; if spans.is_empty() { 0 } else { n }];
                for s in spans {
                    assert!(
                        s.rows.len().is_multiple_of(d) && s.offset + s.rows.len() / d <= n,
                        "a span inside its chunk"
                    );
                    assert!(drafts == 0, "drafts never ride on a chunk with images");
                    for (t, row) in (s.offset..).zip(s.rows.chunks_exact(d)) {
                        assert!(!image[t], "image spans overlap");
                        image[t] = true;
                        for k in 0..hc {
                            streams[(t * hc + k) * d..(t * hc + k + 1) * d].copy_from_slice(row);
                        }
                    }
                }
                SeqPass {
                    span: Span { start: state.position, len: n, drafts },
                    tokens: tokens.to_vec(),
                    engram_rows: self.engram_rows(tokens, &image, &state.engram_history),
                    image,
                    streams,
                    pre: vec![ops::one_hot(hc); n],
                    shared: Shared::default(),
                    main_hidden: vec![0.0f32; n * targets * d],
                    ffn_mixes: Vec::new(),
                }
            })
            .collect();
        PassV41 { seqs, layer: 0, dispatch: None }
    }

    /// The Engram look-back after `tokens` (image positions marked in `image`, or none) follow `history`.
    fn engram_history_after(&self, history: &[u64], tokens: &[u32], image: &[bool]) -> Vec<u64> {
        let Some(hash) = &self.engram_hash else { return history.to_vec() };
        let mut out = history.to_vec();
        out.extend(tokens.iter().enumerate().map(|(t, &tok)| engram_entry(hash, tok, image, t)));
        let keep = hash.max_ngram_size.min(out.len());
        out.drain(..out.len() - keep);
        out
    }

    pub fn is_done(&self, pass: &PassV41) -> bool {
        pass.layer == self.config.n_layers
    }

    /// The current layer up to the routed experts: Engram, attention, the FFN's
    /// collapse, norm and routing. Returns what the experts must compute.
    pub fn attend<'p>(&self, pass: &'p mut PassV41, states: &mut [&mut V41State]) -> &'p Dispatch {
        assert!(pass.dispatch.is_none() && !self.is_done(pass), "attend once per layer");
        assert_eq!(states.len(), pass.seqs.len(), "one state per chunk");
        let cfg = &self.config;
        let (d, hc, l) = (cfg.dim, cfg.hc_mult, pass.layer);
        let block = &self.weights.blocks[l];
        let targets = cfg.dspark.as_ref().map_or(&[][..], |s| &s.target_layer_ids[..]);
        // Per chunk: Engram, the draft layers' hidden, the streams collapsed for
        // attention (every chunk's rows one after another in `x_cat`).
        let mut attn_mixes: Vec<Vec<Mix>> = Vec::with_capacity(pass.seqs.len());
        let mut x_cat: Vec<f32> = Vec::new();
        for seq in pass.seqs.iter_mut() {
            let n = seq.span.len;
            if let (Some(e), Some(slot)) = (&block.engram, cfg.layers[l].engram) {
                self.apply_engram(e, &seq.engram_rows, &seq.image, slot, &mut seq.streams, n);
            }
            if let Some(i) = targets.iter().position(|&x| x == l) {
                for t in 0..n {
                    let out = &mut seq.main_hidden[(t * targets.len() + i) * d..(t * targets.len() + i + 1) * d];
                    mean_streams(&seq.streams[t * hc * d..(t + 1) * hc * d], hc, out);
                }
            }
            let (mixes, x) = self.attention_input(block, &seq.streams, &seq.pre);
            attn_mixes.push(mixes);
            x_cat.extend_from_slice(&x);
        }
        // Every chunk's tokens through the projections together (each row keeps
        // the bits it gets alone); each chunk's own attention in between.
        let rope = if cfg.layers[l].ratio > 0 { &self.rope_compress } else { &self.rope_main };
        let spans: Vec<Span> = pass.seqs.iter().map(|s| s.span).collect();
        let projected = attention::project(cfg, &block.attn, rope, &x_cat, &spans);
        let mut attended = Vec::with_capacity(x_cat.len() / d * cfg.n_heads * cfg.head_dim);
        let mut at = 0;
        for (seq, state) in pass.seqs.iter_mut().zip(states.iter_mut()) {
            let x = &x_cat[at * d..(at + seq.span.len) * d];
            let rows = projected.rows(at..at + seq.span.len);
            let out = attention::attend_projected(cfg, l, &block.attn, rope, x, rows, seq.span, state, &mut seq.shared);
            attended.extend_from_slice(&out);
            at += seq.span.len;
        }
        let y = attention::output_projection(cfg, &block.attn, &attended, x_cat.len() / d);
        let mut x_all = Vec::with_capacity(x_cat.len());
        let mut at = 0;
        for (seq, attn_mixes) in pass.seqs.iter_mut().zip(&attn_mixes) {
            let n = seq.span.len;
            let (mixes, x) = self.after_attention(block, &mut seq.streams, &y[at * d..(at + n) * d], attn_mixes);
            seq.ffn_mixes = mixes;
            x_all.extend_from_slice(&x);
            at += n;
        }
        let n_all = x_all.len() / d;
        let image: Vec<bool> = if pass.seqs.iter().all(|s| s.image.is_empty()) {
            Vec::new()
        } else {
            pass.seqs
                .iter()
                .flat_map(|s| if s.image.is_empty() { vec![false; s.span.len] } else { s.image.clone() })
                .collect()
        };
        let routes = ffn::route(cfg, &block.moe, &x_all, n_all, &image);
        pass.dispatch.insert(Dispatch { hidden_size: d, x: x_all, routes })
    }

    /// Finish the current layer with the routed experts' outputs (routing weight applied).
    pub fn combine(&self, pass: &mut PassV41, outputs: &ExpertOutputs) {
        let dispatch = pass.dispatch.take().expect("attend before combine");
        let d = self.config.dim;
        let y = ffn::combine(&self.config, &self.weights.blocks[pass.layer].moe, &dispatch, outputs);
        let mut at = 0;
        for seq in &mut pass.seqs {
            let n = seq.span.len;
            let mixes = std::mem::take(&mut seq.ffn_mixes);
            seq.pre = self.mix_ffn_output(&mut seq.streams, &y[at * d..(at + n) * d], mixes);
            at += n;
        }
        pass.layer += 1;
    }

    /// Run every routed expert of a dispatch here.
    pub fn run_experts(&self, layer: usize, dispatch: &Dispatch) -> ExpertOutputs {
        let moe = &self.weights.blocks[layer].moe;
        assert!(!moe.experts.is_empty(), "the routed experts of this model live on expert shards");
        // Block-scaled products split by weight rows, so a split decodes
        // nothing twice: they keep the pool whatever the experts' count.
        crate::model::moe::run_hit_experts(dispatch, moe.n_activated, |e, pairs, _threads| {
            let weights: Vec<f32> = pairs.iter().map(|&(t, slot)| dispatch.routes[t].weights[slot]).collect();
            ffn::expert_forward(&self.config, &moe.experts[e], &dispatch.gather(pairs), Some(&weights))
        })
    }

    /// Outputs `[rows, dim]` of routed expert `expert` of `layer` for input rows, each
    /// scaled by its routing weight before the down projection.
    pub fn expert_forward(&self, layer: usize, expert: usize, x_rows: &[f32], weights: &[f32]) -> Vec<f32> {
        ffn::expert_forward(&self.config, &self.weights.blocks[layer].moe.experts[expert], x_rows, Some(weights))
    }

    /// After the last layer: logits per chunk; advances the states.
    pub fn finish(&self, pass: PassV41, states: &mut [&mut V41State], rows: impl Into<Rows>) -> Vec<ChunkResult> {
        let rows = rows.into();
        assert!(self.is_done(&pass), "every layer ran");
        let cfg = &self.config;
        let (d, hc) = (cfg.dim, cfg.hc_mult);
        pass.seqs
            .into_iter()
            .zip(states.iter_mut())
            .map(|(seq, state)| {
                let n = seq.span.len;
                if seq.span.drafts > 0 {
                    let mark = state.draft_mark.get_or_insert_with(Default::default);
                    mark.position = state.position + n - seq.span.drafts;
                    mark.engram_history =
                        self.engram_history_after(&state.engram_history, &seq.tokens[..n - seq.span.drafts], &[]);
                }
                state.position += n;
                state.engram_history = self.engram_history_after(&state.engram_history, &seq.tokens, &seq.image);
                let wanted = match rows {
                    Rows::None => 0..0,
                    Rows::Last => n - 1..n,
                    Rows::All => 0..n,
                    Rows::Tail(k) => n.saturating_sub(k)..n,
                };
                let m = wanted.len();
                let mut x = vec![0.0f32; m * d];
                for (i, t) in wanted.enumerate() {
                    let out = &mut x[i * d..(i + 1) * d];
                    ops::hc_pre(&seq.streams[t * hc * d..(t + 1) * hc * d], &seq.pre[t], out);
                    ops::rms_norm(out, &self.weights.norm, cfg.norm_eps);
                }
                let mut logits = vec![0.0f32; m * cfg.vocab_size];
                plain_linear(&self.weights.head, &x, m, &mut logits);
                ChunkResult { logits, main_hidden: seq.main_hidden }
            })
            .collect()
    }

    /// Single-pass mHC around an attention: collapse the streams with the
    /// previous sublayer's `pre`, norm, `attend`, mix back; then the FFN's mixes
    /// and its collapsed, normalised input (collapsed with attention's `pre`).
    pub(super) fn mixed_attention(
        &self,
        block: &Block,
        streams: &mut [f32],
        pre: &[Vec<f32>],
        attend: impl FnOnce(&[f32]) -> Vec<f32>,
    ) -> (Vec<Mix>, Vec<f32>) {
        let (attn_mixes, x) = self.attention_input(block, streams, pre);
        let out = attend(&x);
        self.after_attention(block, streams, &out, &attn_mixes)
    }

    /// Attention's mixes and its input: the streams collapsed with the
    /// previous sublayer's `pre`, normed.
    fn attention_input(&self, block: &Block, streams: &[f32], pre: &[Vec<f32>]) -> (Vec<Mix>, Vec<f32>) {
        let cfg = &self.config;
        let (d, hc, n) = (cfg.dim, cfg.hc_mult, pre.len());
        let attn_mixes = self.mixes(&block.hc_attn, streams, n);
        let mut x = vec![0.0f32; n * d];
        for t in 0..n {
            let out = &mut x[t * d..(t + 1) * d];
            ops::hc_pre(&streams[t * hc * d..(t + 1) * hc * d], &pre[t], out);
            ops::rms_norm(out, &block.attn_norm, cfg.norm_eps);
        }
        (attn_mixes, x)
    }

    /// Attention's output `out` mixed back into the streams; then the FFN's
    /// mixes and its input, collapsed with attention's `pre` and normed.
    fn after_attention(
        &self,
        block: &Block,
        streams: &mut [f32],
        out: &[f32],
        attn_mixes: &[Mix],
    ) -> (Vec<Mix>, Vec<f32>) {
        let cfg = &self.config;
        let (d, hc, n) = (cfg.dim, cfg.hc_mult, attn_mixes.len());
        post_all(streams, out, attn_mixes);
        let ffn_mixes = self.mixes(&block.hc_ffn, streams, n);
        let mut x = vec![0.0f32; n * d];
        for t in 0..n {
            let out = &mut x[t * d..(t + 1) * d];
            ops::hc_pre(&streams[t * hc * d..(t + 1) * hc * d], &attn_mixes[t].pre, out);
            ops::rms_norm(out, &block.ffn_norm, cfg.norm_eps);
        }
        (ffn_mixes, x)
    }

    /// Mix the FFN's output `y` back into the streams; returns the next sublayer's `pre`.
    pub(super) fn mix_ffn_output(&self, streams: &mut [f32], y: &[f32], mixes: Vec<Mix>) -> Vec<Vec<f32>> {
        post_all(streams, y, &mixes);
        mixes.into_iter().map(|m| m.pre).collect()
    }

    fn mixes(&self, h: &HyperConnection, streams: &[f32], n: usize) -> Vec<Mix> {
        let cfg = &self.config;
        let width = cfg.hc_mult * cfg.dim;
        (0..n)
            .map(|t| ops::hc_mixes(&streams[t * width..(t + 1) * width], &h.mix, &h.scale, &h.base, cfg.mix_shape()))
            .collect()
    }

    /// Per token, per Engram layer, the table rows it looks up, after the look-back `history`.
    fn engram_rows(&self, tokens: &[u32], image: &[bool], history: &[u64]) -> Vec<Vec<Vec<u64>>> {
        let Some(hash) = &self.engram_hash else { return Vec::new() };
        let mut window: Vec<u64> = history.to_vec();
        tokens
            .iter()
            .enumerate()
            .map(|(t, &tok)| {
                window.push(engram_entry(hash, tok, image, t));
                let keep = hash.max_ngram_size.min(window.len());
                window.drain(..window.len() - keep);
                hash.rows(&window)
            })
            .collect()
    }

    fn apply_engram(
        &self,
        e: &super::weights::Engram,
        rows: &[Vec<Vec<u64>>],
        image: &[bool],
        slot: usize,
        streams: &mut [f32],
        n: usize,
    ) {
        let cfg = &self.config;
        let (d, hc) = (cfg.dim, cfg.hc_mult);
        let ecfg = cfg.engram.as_ref().expect("engram config");
        let width = ecfg.hash_cols() * ecfg.head_dim;
        let mut looked_up = vec![0.0f32; n * width];
        for t in 0..n {
            for (c, &r) in rows[t][slot].iter().enumerate() {
                e.table.row(
                    r as usize,
                    &mut looked_up[t * width + c * ecfg.head_dim..t * width + (c + 1) * ecfg.head_dim],
                );
            }
        }
        let kv = deepinfer_kernels::act_quant::quantized_linear(&e.wkv, &looked_up, n);
        let kv_width = d * (hc + 1);
        for t in 0..n {
            let kv_t = &kv[t * kv_width..(t + 1) * kv_width];
            let value = &kv_t[hc * d..];
            for k in 0..hc {
                let s = &mut streams[(t * hc + k) * d..(t * hc + k + 1) * d];
                // an image position's gate is masked to 0 (its stream keeps its bits)
                let g = if image.get(t) == Some(&true) {
                    0.0
                } else {
                    engram::gate(s, &kv_t[k * d..(k + 1) * d], &e.weight[k * d..(k + 1) * d], cfg.norm_eps)
                };
                s.iter_mut().zip(value).for_each(|(h, v)| *h = round_bf16(*h + g * v));
            }
        }
    }
}

/// Token `t`'s look-back entry: its compressed id, or [`engram::DEAD`] inside an image span.
fn engram_entry(hash: &engram::EngramHash, tok: u32, image: &[bool], t: usize) -> u64 {
    if image.get(t) == Some(&true) {
        engram::DEAD
    } else {
        hash.compress(tok)
    }
}

/// `bf16(mean over the streams)` of one token.
fn mean_streams(streams: &[f32], hc: usize, out: &mut [f32]) {
    let d = out.len();
    for (c, o) in out.iter_mut().enumerate() {
        let total: f64 = (0..hc).map(|k| streams[k * d + c] as f64).sum();
        *o = round_bf16((total / hc as f64) as f32);
    }
}

/// [`ops::hc_post`] for every token (`outputs[t · dim..]` into token `t`'s
/// streams); tokens side by side on the thread pool when there is enough work.
fn post_all(streams: &mut [f32], outputs: &[f32], mixes: &[Mix]) {
    use rayon::prelude::*;
    let n = mixes.len();
    if n == 0 {
        return;
    }
    assert!(outputs.len().is_multiple_of(n) && streams.len().is_multiple_of(n), "hc_post rows");
    let (d, per_token) = (outputs.len() / n, streams.len() / n);
    let post = |((s, o), mix): ((&mut [f32], &[f32]), &Mix)| ops::hc_post(s, o, mix);
    if ops::worth_spreading(streams.len() * (per_token / d)) && n > 1 {
        streams.par_chunks_mut(per_token).zip(outputs.par_chunks(d)).zip(mixes).for_each(post);
    } else {
        streams.chunks_mut(per_token).zip(outputs.chunks(d)).zip(mixes).for_each(post);
    }
}
