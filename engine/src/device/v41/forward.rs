//! The V4.1 forward pass on a device: `v41/forward.rs`, `attention.rs`,
//! `ffn.rs` and `engram.rs` step for step over the device's operations,
//! every activation in device memory. The host computes only what decides
//! launches: the Engram table rows of each token (an integer hash of the
//! token ids, as `ModelV41::engram_rows`), the positions and rotary tables,
//! and the routed experts' slots, read back once per layer (as the V4
//! device MoE reads its routes) to gather each expert's rows.

use deepinfer_cuda::ops::linear::{gather_rows as embed_rows, DeviceLinear};
use deepinfer_cuda::ops::moe::gather_rows;
use deepinfer_cuda::ops::v41::{
    fp4_round_trip_rows, fp8_round_trip_rows, map_rows, plain_linear, quantized_linear, rms_norm_rows, rope_rows,
    softmax_rows, DeviceRope, RopePositions, Unary,
};
use deepinfer_cuda::ops::v41_model::{
    candidate_blocks, compress_pool, divide, engram_gate, engram_gather, hc_mixes, hc_post, hc_pre, index_scores,
    index_topk, moe_combine, route, scale_round, sparse_attention, swiglu, Candidates, Chosen, IndexSpan, MixShape,
    ScoreSqrt, Window,
};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};
use deepinfer_kernels::act_quant::Fp4Scale;

use super::state::{Layer, V41Sequence};
use super::weights::{DeviceBlock, DeviceExpert, DeviceHyper, DeviceIndexer, DeviceMoe};
use super::DeviceModelV41;
use crate::model::{Chunk, ChunkOutput, LogitsWanted};
use crate::v41::config::{CandidateRole, LayerPlan, ScoreFunc};

/// One sequence's rows of the flat batch.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// First row in the batch.
    at: usize,
    len: usize,
    /// Position of the first row.
    start: usize,
}

/// The mixes of one sublayer for every row.
struct Mixes {
    pre: DeviceBuffer<f32>,
    post: DeviceBuffer<f32>,
    comb: DeviceBuffer<f32>,
}

/// What a chunk's index sources hand to the layers after them (`attention::Shared`).
#[derive(Default)]
struct Shared {
    /// `[len][topk]` chosen entries ascending, `[len]` their counts.
    selection: Option<(DeviceBuffer<i32>, DeviceBuffer<i32>)>,
    candidates: Option<Candidates>,
}

fn zeros(gpu: &Gpu, len: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
    gpu.zeros::<f32>(len.max(1))
}

/// `rows` rows of `width` from row `first` of `src`, packed.
fn rows_of(
    gpu: &Gpu,
    src: &DeviceBuffer<f32>,
    first: usize,
    rows: usize,
    width: usize,
) -> Result<DeviceBuffer<f32>, DeviceError> {
    let out = zeros(gpu, rows * width)?;
    gpu.copy(src, first * width, &out, 0, rows * width)?;
    Ok(out)
}

/// `quantized_linear` of `n` packed rows into a new buffer.
fn qlinear(gpu: &Gpu, w: &DeviceLinear, x: &DeviceBuffer<f32>, n: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
    let out = zeros(gpu, n * w.rows)?;
    quantized_linear(gpu, w, Rows::packed(x, w.cols), n, Rows::packed(&out, w.rows))?;
    Ok(out)
}

/// `plain_linear` of `n` packed rows into a new buffer.
fn plinear(gpu: &Gpu, w: &DeviceLinear, x: &DeviceBuffer<f32>, n: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
    let out = zeros(gpu, n * w.rows)?;
    plain_linear(gpu, w, Rows::packed(x, w.cols), n, Rows::packed(&out, w.rows))?;
    Ok(out)
}

impl DeviceModelV41 {
    /// [`crate::model::Model::forward`] of a V4.1 model on the device.
    pub(crate) fn forward(
        &self,
        chunks: &mut [Chunk],
        wanted: LogitsWanted,
        keep_streams: bool,
    ) -> Result<Vec<ChunkOutput>, DeviceError> {
        let _ = keep_streams; // No DSpark hidden rows on a device (see the module docs).
        let mut spans = Vec::with_capacity(chunks.len());
        let mut at = 0;
        for c in chunks.iter() {
            assert_eq!(c.drafts, 0, "a device model verifies no drafts (speculative decoding is refused for it)");
            assert!(!c.replay && !c.tokens.is_empty(), "V4.1 chunks are non-empty and never replayed");
            assert!(!c.state.has_drafts(), "no drafts pending");
            spans.push(Span { at, len: c.tokens.len(), start: c.state.position });
            at += c.tokens.len();
        }
        let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        let handles: Vec<_> =
            chunks.iter().map(|c| c.state.device.clone().expect("a device model runs on device states")).collect();
        let mut guards: Vec<_> = handles.iter().map(|h| h.lock()).collect();
        let mut seqs: Vec<&mut V41Sequence> = guards
            .iter_mut()
            .map(|g| g.v41.as_deref_mut().expect("a V4.1 device model runs on V4.1 device states"))
            .collect();
        let logits = self.pass(&tokens, &spans, &mut seqs, wanted)?;
        for (seq, span) in seqs.iter_mut().zip(&spans) {
            seq.engram_history = self.engram_history_after(&seq.engram_history, &tokens[span.at..span.at + span.len]);
        }
        drop(seqs);
        drop(guards);
        for c in chunks.iter_mut() {
            c.state.position += c.tokens.len();
        }
        Ok(logits.into_iter().map(|logits| ChunkOutput { logits, streams: Vec::new() }).collect())
    }

    /// `ModelV41::engram_history_after`.
    fn engram_history_after(&self, history: &[u64], tokens: &[u32]) -> Vec<u64> {
        let Some(hash) = &self.engram_hash else { return history.to_vec() };
        let mut out = history.to_vec();
        out.extend(tokens.iter().map(|&t| hash.compress(t)));
        let keep = hash.max_ngram_size.min(out.len());
        out.drain(..out.len() - keep);
        out
    }

    /// Per Engram layer, the table rows every batch row looks up, flat (`ModelV41::engram_rows`).
    fn engram_rows(&self, tokens: &[u32], spans: &[Span], seqs: &[&mut V41Sequence]) -> Vec<Vec<u32>> {
        let Some(hash) = &self.engram_hash else { return Vec::new() };
        let mut per_layer = vec![Vec::new(); hash.multipliers.len()];
        for (span, seq) in spans.iter().zip(seqs) {
            let mut window = seq.engram_history.clone();
            for &tok in &tokens[span.at..span.at + span.len] {
                window.push(hash.compress(tok));
                let keep = hash.max_ngram_size.min(window.len());
                window.drain(..window.len() - keep);
                for (slot, rows) in hash.rows(&window).into_iter().enumerate() {
                    per_layer[slot].extend(rows.into_iter().map(|r| r.min(u32::MAX as u64) as u32));
                }
            }
        }
        per_layer
    }

    fn pass(
        &self,
        tokens: &[u32],
        spans: &[Span],
        seqs: &mut [&mut V41Sequence],
        wanted: LogitsWanted,
    ) -> Result<Vec<Vec<f32>>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let (d, hc) = (cfg.dim, cfg.hc_mult);
        let n = tokens.len();
        let ids: Vec<u32> = tokens.iter().map(|&t| t.min(cfg.vocab_size as u32 - 1)).collect();
        let ids = gpu.upload(&ids)?;
        let streams = zeros(gpu, n * hc * d)?;
        for k in 0..hc {
            embed_rows(gpu, &self.weights.embed, &ids, n, Rows::new(&streams, k * d, hc * d))?;
        }
        let positions: Vec<u32> = spans.iter().flat_map(|s| (s.start..s.start + s.len).map(|p| p as u32)).collect();
        let positions = gpu.upload(&positions)?;
        let end = spans.iter().map(|s| s.start + s.len).max().unwrap_or(0);
        let rope_main = self.rope_main.table(gpu, end)?;
        let rope_compress = self.rope_compress.table(gpu, end)?;
        let mut one_hot = vec![0.0f32; n * hc];
        one_hot.iter_mut().step_by(hc).for_each(|v| *v = 1.0);
        let mut pre = gpu.upload(&one_hot)?;
        let engram_rows = self.engram_rows(tokens, spans, seqs);
        let engram_rows: Vec<DeviceBuffer<u32>> =
            engram_rows.iter().map(|r| gpu.upload(r)).collect::<Result<_, _>>()?;
        let mut shared: Vec<Shared> = spans.iter().map(|_| Shared::default()).collect();
        for (l, block) in self.weights.blocks.iter().enumerate() {
            let rope = if cfg.layers[l].ratio > 0 { &*rope_compress } else { &*rope_main };
            pre = self.layer(l, block, &streams, &pre, &engram_rows, &positions, spans, seqs, &mut shared, rope)?;
        }
        // Every span's wanted rows through the final collapse, norm and head
        // at once, one download.
        let picks: Vec<(usize, usize)> = spans
            .iter()
            .map(|span| {
                let rows = wanted.rows(span.len);
                (span.at + rows.start, rows.len())
            })
            .collect();
        let m: usize = picks.iter().map(|p| p.1).sum();
        let mut logits = if m == 0 {
            Vec::new()
        } else {
            let s = zeros(gpu, m * hc * d)?;
            let p = zeros(gpu, m * hc)?;
            let mut at = 0;
            for &(first, count) in &picks {
                gpu.copy(&streams, first * hc * d, &s, at * hc * d, count * hc * d)?;
                gpu.copy(&pre, first * hc, &p, at * hc, count * hc)?;
                at += count;
            }
            let x = zeros(gpu, m * d)?;
            hc_pre(gpu, &s, &p, m, hc, d, &x)?;
            rms_norm_rows(gpu, Rows::packed(&x, d), m, d, &self.weights.norm, cfg.norm_eps)?;
            let logits = plinear(gpu, &self.weights.head, &x, m)?;
            gpu.download_range(&logits, 0, m * cfg.vocab_size)?
        }
        .into_iter();
        Ok(picks.iter().map(|&(_, count)| logits.by_ref().take(count * cfg.vocab_size).collect()).collect())
    }

    /// The mixes of `n` rows' streams for sublayer `h` (`ModelV41::mixes`).
    fn mixes(&self, h: &DeviceHyper, streams: &DeviceBuffer<f32>, n: usize) -> Result<Mixes, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let hc = cfg.hc_mult;
        let raw = plinear(gpu, &h.mix, streams, n)?;
        let m = Mixes { pre: zeros(gpu, n * hc)?, post: zeros(gpu, n * hc)?, comb: zeros(gpu, n * hc * hc)? };
        let shape = MixShape {
            hc,
            dim: cfg.dim,
            iters: cfg.hc_sinkhorn_iters,
            norm_eps: cfg.norm_eps,
            hc_eps: cfg.hc_eps,
            scale: h.scale,
        };
        hc_mixes(gpu, &raw, streams, n, shape, &h.base, &m.pre, &m.post, &m.comb)?;
        Ok(m)
    }

    /// `bf16(rms_norm(hc_pre(streams, pre)))` of `n` rows.
    fn collapse(
        &self,
        streams: &DeviceBuffer<f32>,
        pre: &DeviceBuffer<f32>,
        norm: &DeviceBuffer<f32>,
        n: usize,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let (gpu, d) = (&self.gpu, self.cfg.dim);
        let x = zeros(gpu, n * d)?;
        hc_pre(gpu, streams, pre, n, self.cfg.hc_mult, d, &x)?;
        rms_norm_rows(gpu, Rows::packed(&x, d), n, d, norm, self.cfg.norm_eps)?;
        Ok(x)
    }

    /// One layer over the batch (`ModelV41::attend` then `combine`); returns the next sublayer's `pre`.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        l: usize,
        block: &DeviceBlock,
        streams: &DeviceBuffer<f32>,
        pre: &DeviceBuffer<f32>,
        engram_rows: &[DeviceBuffer<u32>],
        positions: &DeviceBuffer<u32>,
        spans: &[Span],
        seqs: &mut [&mut V41Sequence],
        shared: &mut [Shared],
        rope: &DeviceRope,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let (d, hc, n) = (cfg.dim, cfg.hc_mult, positions.len());
        let (h, hd, rd) = (cfg.n_heads, cfg.head_dim, cfg.rope_head_dim);
        let eps = cfg.norm_eps;
        if let (Some(e), Some(slot)) = (&block.engram, cfg.layers[l].engram) {
            let ecfg = cfg.engram.as_ref().expect("engram config");
            let width = ecfg.hash_cols() * ecfg.head_dim;
            let looked_up = zeros(gpu, n * width)?;
            engram_gather(gpu, &e.table, &engram_rows[slot], n * ecfg.hash_cols(), &looked_up)?;
            let kv = qlinear(gpu, &e.wkv, &looked_up, n)?;
            engram_gate(gpu, streams, &kv, &e.weight, n, hc, d, eps)?;
        }
        let attn_mixes = self.mixes(&block.hc_attn, streams, n)?;
        let x = self.collapse(streams, pre, &block.attn_norm, n)?;

        // The input projections of every row (`attention::project`).
        let a = &block.attn;
        let qr = qlinear(gpu, &a.wq_a, &x, n)?;
        rms_norm_rows(gpu, Rows::packed(&qr, cfg.q_lora_rank), n, cfg.q_lora_rank, &a.q_norm, eps)?;
        let q = qlinear(gpu, &a.wq_b, &qr, n)?;
        let each = RopePositions::Each(positions);
        rope_rows(gpu, rope, Rows::packed(&q, h * hd), n, h, hd, hd - rd, each, false)?;
        let kv = qlinear(gpu, &a.wkv, &x, n)?;
        rms_norm_rows(gpu, Rows::packed(&kv, hd), n, hd, &a.kv_norm, eps)?;
        rope_rows(gpu, rope, Rows::packed(&kv, hd), n, 1, hd, hd - rd, each, false)?;
        fp8_round_trip_rows(gpu, Rows::packed(&kv, hd), n, hd)?;

        let attended = zeros(gpu, n * h * hd)?;
        for ((span, seq), shared) in spans.iter().zip(seqs.iter_mut()).zip(shared.iter_mut()) {
            let out = self.attend_span(l, block, *span, &x, &qr, &q, &kv, seq, shared, rope)?;
            gpu.copy(&out, 0, &attended, span.at * h * hd, span.len * h * hd)?;
        }

        // The grouped output projection (`attention::output_projection`).
        let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
        let group_in = h * hd / groups;
        let mid = zeros(gpu, n * groups * rank)?;
        for (g, w) in a.wo_a.iter().enumerate() {
            quantized_linear(
                gpu,
                w,
                Rows::new(&attended, g * group_in, h * hd),
                n,
                Rows::new(&mid, g * rank, groups * rank),
            )?;
        }
        let y = qlinear(gpu, &a.wo_b, &mid, n)?;

        hc_post(gpu, streams, &y, &attn_mixes.post, &attn_mixes.comb, n, hc, d)?;
        let ffn_mixes = self.mixes(&block.hc_ffn, streams, n)?;
        let x = self.collapse(streams, &attn_mixes.pre, &block.ffn_norm, n)?;
        let y = self.moe(&block.moe, &x, n)?;
        hc_post(gpu, streams, &y, &ffn_mixes.post, &ffn_mixes.comb, n, hc, d)?;
        Ok(ffn_mixes.pre)
    }

    /// One chunk's attention (`attention::attend_projected`) from the batch's
    /// projections: `[len, heads · head_dim]`, rotated back.
    #[allow(clippy::too_many_arguments)]
    fn attend_span(
        &self,
        l: usize,
        block: &DeviceBlock,
        span: Span,
        x: &DeviceBuffer<f32>,
        qr: &DeviceBuffer<f32>,
        q: &DeviceBuffer<f32>,
        kv: &DeviceBuffer<f32>,
        seq: &mut V41Sequence,
        shared: &mut Shared,
        rope: &DeviceRope,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let plan = cfg.layers[l];
        let (h, hd, rd, win) = (cfg.n_heads, cfg.head_dim, cfg.rope_head_dim, cfg.window_size);
        let len = span.len;
        // Window rows of positions `base..start + len`.
        let cached = seq.layers[l].window_rows;
        let keys = zeros(gpu, (cached + len) * hd)?;
        gpu.copy(&seq.layers[l].window, 0, &keys, 0, cached * hd)?;
        gpu.copy(kv, span.at * hd, &keys, cached * hd, len * hd)?;
        let base = span.start - cached;

        if plan.ratio > 0 {
            self.compressed_step(l, plan, block, span, x, qr, seq, shared, rope)?;
        }
        let q_span = rows_of(gpu, q, span.at, len, h * hd)?;
        let out = zeros(gpu, len * h * hd)?;
        let window = Window { keys: &keys, base, start: span.start, len, win };
        let chosen = match (plan.ratio > 0, plan.kv_source, &shared.selection) {
            (true, Some(src), Some((selected, counts))) => {
                let source = seq.layers[src].source.as_ref().expect("KV source state");
                Some((source, selected, counts))
            }
            _ => None,
        };
        let chosen = chosen.map(|(source, selected, counts)| Chosen {
            entries: &source.entries.buf,
            selected,
            counts,
            stride: cfg.index_topk,
        });
        let scale = (hd as f64).powf(-0.5) as f32;
        sparse_attention(gpu, &q_span, h, hd, window, chosen, &block.attn.sink, scale, &out)?;
        let first = RopePositions::Affine { first: span.start, step: 1 };
        rope_rows(gpu, rope, Rows::packed(&out, h * hd), len, h, hd, hd - rd, first, true)?;
        // Keep the last `window_size` rows.
        let total = cached + len;
        let keep = total.min(win);
        let layer: &mut Layer = &mut seq.layers[l];
        gpu.copy(&keys, (total - keep) * hd, &layer.window, 0, keep * hd)?;
        layer.window_rows = keep;
        Ok(out)
    }

    /// `attention::compressed_step`: compress (KV sources), publish index
    /// keys, choose (index sources), append the entries.
    #[allow(clippy::too_many_arguments)]
    fn compressed_step(
        &self,
        l: usize,
        plan: LayerPlan,
        block: &DeviceBlock,
        span: Span,
        x: &DeviceBuffer<f32>,
        qr: &DeviceBuffer<f32>,
        seq: &mut V41Sequence,
        shared: &mut Shared,
        rope: &DeviceRope,
    ) -> Result<(), DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let (d, hd, ihd, rd) = (cfg.dim, cfg.head_dim, cfg.index_head_dim, cfg.rope_head_dim);
        let ratio = plan.ratio;
        let len = span.len;
        let eps = cfg.norm_eps;
        let x_span = rows_of(gpu, x, span.at, len, d)?;
        // The latents (normalised, not yet rotated) of the groups the chunk closes.
        let latents = match &block.attn.compressor {
            Some(c) => Some(match &c.wgate {
                None => {
                    let latents = qlinear(gpu, &c.wkv, &x_span, len)?;
                    rms_norm_rows(gpu, Rows::packed(&latents, hd), len, hd, &c.norm, eps)?;
                    (latents, len)
                }
                Some(wgate) => {
                    let kv = plinear(gpu, &c.wkv, &x_span, len)?;
                    let score = plinear(gpu, wgate, &x_span, len)?;
                    let src = seq.layers[l].source.as_mut().expect("KV source state");
                    let total = src.pending + len;
                    let groups = total / ratio;
                    let all_kv = zeros(gpu, total * hd)?;
                    let all_score = zeros(gpu, total * hd)?;
                    for (all, pending, new) in
                        [(&all_kv, &src.pending_kv, &kv), (&all_score, &src.pending_score, &score)]
                    {
                        gpu.copy(pending, 0, all, 0, src.pending * hd)?;
                        gpu.copy(new, 0, all, src.pending * hd, len * hd)?;
                    }
                    let pooled = zeros(gpu, groups * hd)?;
                    compress_pool(gpu, &all_kv, &all_score, groups, ratio, hd, &pooled)?;
                    rms_norm_rows(gpu, Rows::packed(&pooled, hd), groups, hd, &c.norm, eps)?;
                    let left = total - groups * ratio;
                    gpu.copy(&all_kv, groups * ratio * hd, &src.pending_kv, 0, left * hd)?;
                    gpu.copy(&all_score, groups * ratio * hd, &src.pending_score, 0, left * hd)?;
                    src.pending = left;
                    (pooled, groups)
                }
            }),
            None => None,
        };
        let group_src = plan.kv_source.expect("compressed layer has a KV source");
        let first_group = seq.layers[group_src].source.as_ref().expect("KV source state").entries.rows;
        let at_groups = RopePositions::Affine { first: first_group * ratio, step: ratio };
        if let (Some((latents, m)), Some(DeviceIndexer { wk: Some((wk, k_norm)), .. })) =
            (&latents, &block.attn.indexer)
        {
            let m = *m;
            if m > 0 {
                let keys = qlinear(gpu, wk, latents, m)?;
                rms_norm_rows(gpu, Rows::packed(&keys, ihd), m, ihd, k_norm, eps)?;
                rope_rows(gpu, rope, Rows::packed(&keys, ihd), m, 1, ihd, ihd - rd, at_groups, false)?;
                fp4_round_trip_rows(gpu, Rows::packed(&keys, ihd), m, ihd, 32, Fp4Scale::Ue8m0)?;
                seq.layers[l].source.as_mut().expect("KV source state").keys.append(gpu, &keys, m)?;
            }
        }
        if plan.runs_indexer(l) {
            let indexer = block.attn.indexer.as_ref().expect("index source has an indexer");
            shared.selection = if (span.start + len) / ratio == 0 {
                None
            } else {
                let keys = &seq.layers[group_src].source.as_ref().expect("KV source state").keys.buf;
                Some(self.choose(plan, indexer, span, &x_span, qr, keys, shared, rope)?)
            };
        }
        if let Some((entries, m)) = latents {
            if m > 0 {
                rope_rows(gpu, rope, Rows::packed(&entries, hd), m, 1, hd, hd - rd, at_groups, false)?;
                fp4_round_trip_rows(gpu, Rows::packed(&entries, hd), m, hd, 16, Fp4Scale::E4m3)?;
                seq.layers[l].source.as_mut().expect("KV source state").entries.append(gpu, &entries, m)?;
            }
        }
        Ok(())
    }

    /// `attention::choose`: per query the chosen entries, ascending, and their count.
    #[allow(clippy::too_many_arguments)]
    fn choose(
        &self,
        plan: LayerPlan,
        indexer: &DeviceIndexer,
        span: Span,
        x_span: &DeviceBuffer<f32>,
        qr: &DeviceBuffer<f32>,
        keys: &DeviceBuffer<f32>,
        shared: &mut Shared,
        rope: &DeviceRope,
    ) -> Result<(DeviceBuffer<i32>, DeviceBuffer<i32>), DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let (ih, ihd, rd, len) = (cfg.index_n_heads, cfg.index_head_dim, cfg.rope_head_dim, span.len);
        let qr_span = rows_of(gpu, qr, span.at, len, cfg.q_lora_rank)?;
        let q = qlinear(gpu, &indexer.wq_b, &qr_span, len)?;
        let first = RopePositions::Affine { first: span.start, step: 1 };
        rope_rows(gpu, rope, Rows::packed(&q, ih * ihd), len, ih, ihd, ihd - rd, first, false)?;
        fp4_round_trip_rows(gpu, Rows::packed(&q, ih * ihd), len, ih * ihd, 32, Fp4Scale::Ue8m0)?;
        let factor = ((ihd as f64).powf(-0.5) * (ih as f64).powf(-0.5)) as f32;
        let weights = qlinear(gpu, &indexer.weights_proj, x_span, len)?;
        scale_round(gpu, &weights, len * ih, factor)?;
        let ispan = IndexSpan { start: span.start, len, ratio: plan.ratio };
        let stride = ispan.max_width().max(1);
        let scores = zeros(gpu, len * stride)?;
        let candidates = match plan.candidate {
            CandidateRole::Consumer => {
                Some(shared.candidates.as_ref().expect("candidate source ran before its consumers"))
            }
            _ => None,
        };
        index_scores(gpu, keys, &q, &weights, ih, ihd, ispan, candidates, &scores, stride)?;
        if plan.candidate == CandidateRole::Source {
            shared.candidates = Some(candidate_blocks(
                gpu,
                &scores,
                stride,
                ispan,
                cfg.candidate_block_size,
                cfg.candidate_topk_blocks,
            )?);
        }
        let selected = gpu.zeros::<i32>(len * cfg.index_topk)?;
        let counts = gpu.zeros::<i32>(len)?;
        index_topk(gpu, &scores, stride, ispan, cfg.index_topk, &selected, &counts)?;
        Ok((selected, counts))
    }

    /// `ffn::expert_forward` over `rows` packed rows, `weights` per row or none (the shared expert).
    fn expert(
        &self,
        e: &DeviceExpert,
        x: &DeviceBuffer<f32>,
        rows: usize,
        weights: Option<&DeviceBuffer<f32>>,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let gate = qlinear(gpu, &e.w1, x, rows)?;
        let up = qlinear(gpu, &e.w3, x, rows)?;
        swiglu(gpu, &gate, &up, weights, rows, e.w1.rows, self.cfg.swiglu_limit)?;
        qlinear(gpu, &e.w2, &gate, rows)
    }

    /// The MoE of `n` rows (`ffn::route`, the experts, `ffn::combine`).
    fn moe(&self, m: &DeviceMoe, x: &DeviceBuffer<f32>, n: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.cfg;
        let (d, e, k) = (cfg.dim, m.experts.len(), m.k);
        let scores = plinear(gpu, &m.gate, x, n)?;
        divide(gpu, &scores, n * e, cfg.gate_temp)?;
        let sqrt = match cfg.score_func {
            ScoreFunc::Softmax => {
                softmax_rows(gpu, Rows::packed(&scores, e), n, e)?;
                ScoreSqrt::No
            }
            ScoreFunc::Sigmoid => {
                map_rows(gpu, Rows::packed(&scores, e), n, e, Unary::Sigmoid)?;
                ScoreSqrt::No
            }
            ScoreFunc::SqrtSoftplus => {
                // softplus is f64 `ln_1p` on the CPU; a GPU's `log1p` may differ
                // in its last f64 bit, so the scores are computed on the host.
                let mut host = gpu.download(&scores)?;
                host.iter_mut().for_each(|v| *v = crate::v41::ops::softplus(*v));
                gpu.write(&scores, 0, &host)?;
                ScoreSqrt::Yes
            }
        };
        let experts = gpu.zeros::<i32>(n * k)?;
        let weights = zeros(gpu, n * k)?;
        route(gpu, &scores, &m.bias, n, e, k, sqrt, cfg.norm_topk_prob, cfg.route_scale, &experts, &weights)?;
        // Which slots each expert takes: the routes come to the host once.
        let chosen = gpu.download(&experts)?;
        let mut by_expert: Vec<Vec<i32>> = vec![Vec::new(); e];
        for (slot, &ex) in chosen.iter().enumerate() {
            by_expert[ex as usize].push(slot as i32);
        }
        // Each hit expert's outputs land in one buffer, expert after expert;
        // one gather then puts every (token, slot) row in its place.
        let outputs = zeros(gpu, n * k * d)?;
        let mut place = vec![0i32; n * k];
        let mut at = 0usize;
        for (expert, slots) in by_expert.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            let count = slots.len();
            let rows: Vec<i32> = slots.iter().map(|&s| s / k as i32).collect();
            let rows = gpu.upload(&rows)?;
            let slots_dev = gpu.upload(slots)?;
            let xe = zeros(gpu, count * d)?;
            gather_rows(gpu, Rows::packed(x, d), &rows, count, d, Rows::packed(&xe, d))?;
            let we = zeros(gpu, count)?;
            gather_rows(gpu, Rows::packed(&weights, 1), &slots_dev, count, 1, Rows::packed(&we, 1))?;
            let ye = self.expert(&m.experts[expert], &xe, count, Some(&we))?;
            gpu.copy(&ye, 0, &outputs, at * d, count * d)?;
            for (j, &slot) in slots.iter().enumerate() {
                place[slot as usize] = (at + j) as i32;
            }
            at += count;
        }
        let routed = zeros(gpu, n * k * d)?;
        let place = gpu.upload(&place)?;
        gather_rows(gpu, Rows::packed(&outputs, d), &place, n * k, d, Rows::packed(&routed, d))?;
        let shared = self.expert(&m.shared, x, n, None)?;
        let out = zeros(gpu, n * d)?;
        moe_combine(gpu, &routed, &experts, &shared, n, k, d, &out)?;
        Ok(out)
    }
}
