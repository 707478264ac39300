//! The V4 forward pass on a device: the CPU pass (`model/forward.rs`,
//! `attention.rs`, `moe.rs`, `hyper.rs`) step for step over the device's
//! operations (`deepinfer_cuda::ops`), every value in device memory. Each
//! operation follows its CPU kernel's definition, so a step's logits are the
//! CPU engine's bits, whatever the batch.

use deepinfer_cuda::ops::attention::{attend, index_topk, Selection};
use deepinfer_cuda::ops::compressor::{compress_tokens, CompressorSlots};
use deepinfer_cuda::ops::elementwise::{rope_rows, scale_rows, swiglu_clamped};
use deepinfer_cuda::ops::hyper::{hyper_head, hyper_post, hyper_pre};
use deepinfer_cuda::ops::linear::{gather_rows as embed_rows, linear_forward, DeviceLinear};
use deepinfer_cuda::ops::moe::{combine, gather_rows, route, Routing};
use deepinfer_cuda::ops::norm::rms_norm_rows;
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};
use deepinfer_kernels::ops::Rope;

use super::state::{reserve, DeviceLayer};
use super::weights::{DeviceAttention, DeviceBlock, DeviceCompressorWeights, DeviceHead, DeviceMlp, DeviceMoe};
use super::DeviceModel;
use crate::config::{AttentionKind, RoutingKind};
use crate::model::{ChunkOutput, LogitsWanted};

/// One sequence's tokens in the flat batch (as `model::attention::Segment`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    pub start: usize,
    pub len: usize,
    pub position: usize,
    pub replay: bool,
}

/// Cos/sin of every token's position for one rotary table, on the device.
struct Angles {
    cos: DeviceBuffer<f32>,
    sin: DeviceBuffer<f32>,
}

impl Angles {
    fn new(gpu: &Gpu, rope: &Rope, positions: &[usize]) -> Result<Self, DeviceError> {
        let half = rope.inv_freq.len();
        let mut cos = vec![0.0f32; positions.len() * half];
        let mut sin = vec![0.0f32; positions.len() * half];
        if half > 0 {
            for ((&p, c), s) in positions.iter().zip(cos.chunks_exact_mut(half)).zip(sin.chunks_exact_mut(half)) {
                rope.cos_sin(p, c, s);
            }
        }
        Ok(Self { cos: gpu.upload(&cos)?, sin: gpu.upload(&sin)? })
    }
}

fn project(gpu: &Gpu, w: &DeviceLinear, x: Rows, n: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
    let out = gpu.zeros::<f32>(n * w.rows)?;
    linear_forward(gpu, w, x, n, Rows::packed(&out, w.rows))?;
    Ok(out)
}

impl DeviceModel {
    /// Run the flat batch of `tokens` (sequences as `spans`) through every
    /// layer; returns each span's logits rows and, if asked, its final streams.
    pub(crate) fn pass(
        &self,
        tokens: &[u32],
        spans: &[Span],
        states: &mut [&mut Vec<DeviceLayer>],
        wanted: LogitsWanted,
        keep_streams: bool,
    ) -> Result<Vec<ChunkOutput>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.config;
        let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
        let n = tokens.len();
        let ids = gpu.upload(tokens)?;
        let streams = gpu.zeros::<f32>(n * hc * d)?;
        for k in 0..hc {
            embed_rows(gpu, &self.weights.embed, &ids, n, Rows::new(&streams, k * d, hc * d))?;
        }
        let positions: Vec<usize> = spans.iter().flat_map(|s| s.position..s.position + s.len).collect();
        let main = Angles::new(gpu, &self.rope_main, &positions)?;
        let compress = Angles::new(gpu, &self.rope_compress, &positions)?;
        for (l, block) in self.weights.blocks.iter().enumerate() {
            let angles = match block.attn.kind {
                AttentionKind::Window => &main,
                _ => &compress,
            };
            let rope = match block.attn.kind {
                AttentionKind::Window => &self.rope_main,
                _ => &self.rope_compress,
            };
            let mut layers: Vec<&mut DeviceLayer> = states.iter_mut().map(|s| &mut s[l]).collect();
            self.block(block, &streams, &ids, n, spans, &mut layers, angles, rope)?;
        }
        // Every span's wanted rows through the heads at once, one download.
        let picks: Vec<(usize, usize)> = spans
            .iter()
            .map(|span| {
                let rows = wanted.rows(span.len);
                (span.start + rows.start, rows.len())
            })
            .collect();
        let mut logits = self.logits(&streams, &picks)?.into_iter();
        let vocab = cfg.vocab_size;
        spans
            .iter()
            .zip(&picks)
            .map(|(span, &(_, rows))| {
                let logits: Vec<f32> = logits.by_ref().take(rows * vocab).collect();
                let streams = if keep_streams {
                    gpu.download_range(&streams, span.start * hc * d, span.len * hc * d)?
                } else {
                    Vec::new()
                };
                Ok(ChunkOutput { logits, streams })
            })
            .collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        block: &DeviceBlock,
        streams: &DeviceBuffer<f32>,
        ids: &DeviceBuffer<u32>,
        n: usize,
        spans: &[Span],
        layers: &mut [&mut DeviceLayer],
        angles: &Angles,
        rope: &Rope,
    ) -> Result<(), DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.config;
        let d = cfg.hidden_size;
        let (post, comb, x) = self.hyper_pre(&block.hc_attn, streams, n)?;
        rms_norm_rows(gpu, &x, n, d, Some(&block.attn_norm), cfg.rms_norm_eps)?;
        let out = self.attention(&block.attn, &x, n, spans, layers, angles, rope)?;
        hyper_post(gpu, &post, &comb, &out, streams, n, cfg.hc_mult, d)?;

        let (post, comb, x) = self.hyper_pre(&block.hc_ffn, streams, n)?;
        rms_norm_rows(gpu, &x, n, d, Some(&block.ffn_norm), cfg.rms_norm_eps)?;
        let out = self.moe(&block.moe, &x, ids, n)?;
        hyper_post(gpu, &post, &comb, &out, streams, n, cfg.hc_mult, d)?;
        Ok(())
    }

    /// `hyper::pre`: the mixes and the collapsed sublayer input `[n, D]`.
    #[allow(clippy::type_complexity)]
    fn hyper_pre(
        &self,
        h: &super::weights::DeviceHyper,
        streams: &DeviceBuffer<f32>,
        n: usize,
    ) -> Result<(DeviceBuffer<f32>, DeviceBuffer<f32>, DeviceBuffer<f32>), DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.config;
        let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
        let raw = project(gpu, &h.mix, Rows::packed(streams, hc * d), n)?;
        let post = gpu.zeros::<f32>(n * hc)?;
        let comb = gpu.zeros::<f32>(n * hc * hc)?;
        let x = gpu.zeros::<f32>(n * d)?;
        hyper_pre(
            gpu,
            &raw,
            streams,
            n,
            hc,
            d,
            h.scale,
            &h.base,
            cfg.hc_eps,
            cfg.rms_norm_eps,
            cfg.hc_sinkhorn_iters,
            &post,
            &comb,
            &x,
        )?;
        Ok((post, comb, x))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        a: &DeviceAttention,
        x: &DeviceBuffer<f32>,
        n: usize,
        spans: &[Span],
        layers: &mut [&mut DeviceLayer],
        angles: &Angles,
        rope: &Rope,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.config;
        let (d, h, hd, rd) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rope_dim);
        let eps = cfg.rms_norm_eps;
        let xr = Rows::packed(x, d);

        let q_res = project(gpu, &a.wq_a, xr, n)?;
        rms_norm_rows(gpu, &q_res, n, cfg.q_lora_rank, Some(&a.q_norm), eps)?;
        let q = project(gpu, &a.wq_b, Rows::packed(&q_res, cfg.q_lora_rank), n)?;
        rms_norm_rows(gpu, &q, n * h, hd, None, eps)?;
        rope_rows(gpu, Rows::packed(&q, h * hd), n, h, hd, rd, &angles.cos, &angles.sin, false)?;
        let kv = project(gpu, &a.wkv, xr, n)?;
        rms_norm_rows(gpu, &kv, n, hd, Some(&a.kv_norm), eps)?;
        rope_rows(gpu, Rows::packed(&kv, hd), n, 1, hd, rd, &angles.cos, &angles.sin, false)?;

        if let Some(c) = &a.compressor {
            let mut slots = layers.iter_mut().map(|l| l.compressor.as_mut().expect("a compressed layer's state"));
            self.compress(c, xr, n, spans, &mut slots, rope)?;
        }
        let index = match &a.indexer {
            Some(ix) => {
                let mut slots = layers.iter_mut().map(|l| l.indexer.as_mut().expect("a CSA layer's indexer state"));
                self.compress(&ix.compressor, xr, n, spans, &mut slots, rope)?;
                let (ih, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
                let iq = project(gpu, &ix.wq_b, Rows::packed(&q_res, cfg.q_lora_rank), n)?;
                rope_rows(gpu, Rows::packed(&iq, ih * ihd), n, ih, ihd, rd, &angles.cos, &angles.sin, false)?;
                let iw = project(gpu, &ix.weights_proj, xr, n)?;
                scale_rows(gpu, &iw, n * ih, (ih as f32).powf(-0.5))?;
                Some((iq, iw))
            }
            None => None,
        };

        let window = cfg.sliding_window;
        let scale = (hd as f32).powf(-0.5);
        let attn_out = gpu.zeros::<f32>(n * h * hd)?;
        for (span, layer) in spans.iter().zip(layers.iter_mut()) {
            let cached = layer.window_rows;
            let total = cached + span.len;
            let keys = gpu.zeros::<f32>(total * hd)?;
            gpu.copy(&layer.window, 0, &keys, 0, cached * hd)?;
            gpu.copy(&kv, span.start * hd, &keys, cached * hd, span.len * hd)?;
            let first_key_position = span.position - cached;
            let q_rows = Rows::new(&q, span.start * h * hd, h * hd);
            let out_rows = Rows::new(&attn_out, span.start * h * hd, h * hd);
            // This span's queries' angles, from its first row.
            let half = rd / 2;
            let cos = gpu.zeros::<f32>(span.len * half)?;
            let sin = gpu.zeros::<f32>(span.len * half)?;
            gpu.copy(&angles.cos, span.start * half, &cos, 0, span.len * half)?;
            gpu.copy(&angles.sin, span.start * half, &sin, 0, span.len * half)?;
            let (cos, sin) = (&cos, &sin);
            match (a.kind, &index) {
                (AttentionKind::Csa { ratio }, Some((iq, iw))) => {
                    let (ih, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
                    let topk = cfg.index_topk.max(1);
                    let selected = gpu.zeros::<i32>(span.len * topk)?;
                    let counts = gpu.zeros::<i32>(span.len)?;
                    let ie = layer.indexer.as_ref().expect("a CSA layer's indexer state");
                    index_topk(
                        gpu,
                        Rows::new(iq, span.start * ih * ihd, ih * ihd),
                        Rows::new(iw, span.start * ih, ih),
                        ih,
                        ihd,
                        ie.entries(),
                        span.position,
                        span.len,
                        ratio,
                        cfg.index_topk,
                        &selected,
                        &counts,
                    )?;
                    let entries = layer.compressor.as_ref().expect("a compressed layer's state").entries();
                    let selection = Selection::Chosen { ratio, selected: &selected, counts: &counts, stride: topk };
                    attend(
                        gpu,
                        q_rows,
                        h,
                        hd,
                        &keys,
                        first_key_position,
                        span.position,
                        span.len,
                        window,
                        Some(entries),
                        selection,
                        &a.sink,
                        scale,
                        cos,
                        sin,
                        rd,
                        out_rows,
                    )?;
                }
                (AttentionKind::Hca { ratio }, _) => {
                    let entries = layer.compressor.as_ref().expect("a compressed layer's state").entries();
                    attend(
                        gpu,
                        q_rows,
                        h,
                        hd,
                        &keys,
                        first_key_position,
                        span.position,
                        span.len,
                        window,
                        Some(entries),
                        Selection::AllVisible { ratio },
                        &a.sink,
                        scale,
                        cos,
                        sin,
                        rd,
                        out_rows,
                    )?;
                }
                _ => {
                    attend(
                        gpu,
                        q_rows,
                        h,
                        hd,
                        &keys,
                        first_key_position,
                        span.position,
                        span.len,
                        window,
                        None,
                        Selection::None,
                        &a.sink,
                        scale,
                        cos,
                        sin,
                        rd,
                        out_rows,
                    )?;
                }
            }
            // Keep the last `window − 1` keys for the next step.
            let keep = total.min(window - 1);
            gpu.copy(&keys, (total - keep) * hd, &layer.window, 0, keep * hd)?;
            layer.window_rows = keep;
        }

        // Grouped low-rank output projection.
        let groups = a.wo_a.len();
        let group_in = h * hd / groups;
        let rank = cfg.o_lora_rank;
        let grouped = gpu.zeros::<f32>(n * groups * rank)?;
        for (g, w) in a.wo_a.iter().enumerate() {
            linear_forward(
                gpu,
                w,
                Rows::new(&attn_out, g * group_in, h * hd),
                n,
                Rows::new(&grouped, g * rank, groups * rank),
            )?;
        }
        let _ = d;
        project(gpu, &a.wo_b, Rows::packed(&grouped, groups * rank), n)
    }

    /// Project `x` through a compressor and feed each span that is not a
    /// replay to its sequence's slots (`slots`, one per span, in order).
    fn compress(
        &self,
        c: &DeviceCompressorWeights,
        x: Rows,
        n: usize,
        spans: &[Span],
        slots: &mut dyn Iterator<Item = &mut CompressorSlots>,
        rope: &Rope,
    ) -> Result<(), DeviceError> {
        let gpu = &self.gpu;
        let width = c.wkv.rows;
        let kv = project(gpu, &c.wkv, x, n)?;
        let gate = project(gpu, &c.wgate, x, n)?;
        for (span, slots) in spans.iter().zip(slots) {
            if span.replay {
                continue;
            }
            reserve(gpu, slots, (slots.pending() + span.len) / c.pooling.ratio)?;
            let rows = |buf| Rows::new(buf, span.start * width, width);
            compress_tokens(
                gpu,
                &c.pooling,
                slots,
                rows(&kv),
                rows(&gate),
                span.len,
                span.position,
                rope,
                self.config.rms_norm_eps,
            )?;
        }
        Ok(())
    }

    fn mlp(&self, m: &DeviceMlp, x: Rows, n: usize) -> Result<DeviceBuffer<f32>, DeviceError> {
        let out = self.gpu.zeros::<f32>(n * m.w2.rows)?;
        self.mlp_into(m, x, n, Rows::packed(&out, m.w2.rows))?;
        Ok(out)
    }

    /// The SwiGLU MLP of `n` rows of `x`, written to `out`'s rows.
    fn mlp_into(&self, m: &DeviceMlp, x: Rows, n: usize, out: Rows) -> Result<(), DeviceError> {
        let gpu = &self.gpu;
        let inter = m.w1.rows;
        let gate = project(gpu, &m.w1, x, n)?;
        let up = project(gpu, &m.w3, x, n)?;
        swiglu_clamped(gpu, &gate, &up, n * inter, self.config.swiglu_limit)?;
        linear_forward(gpu, &m.w2, Rows::packed(&gate, inter), n, out)
    }

    fn moe(
        &self,
        m: &DeviceMoe,
        x: &DeviceBuffer<f32>,
        ids: &DeviceBuffer<u32>,
        n: usize,
    ) -> Result<DeviceBuffer<f32>, DeviceError> {
        let gpu = &self.gpu;
        let cfg = &self.config;
        let (d, e, k) = (cfg.hidden_size, cfg.n_routed_experts, cfg.experts_per_token);
        let logits = project(gpu, &m.gate, Rows::packed(x, d), n)?;
        let experts = gpu.zeros::<i32>(n * k)?;
        let weights = gpu.zeros::<f32>(n * k)?;
        let routing = match m.routing {
            RoutingKind::Hash => Routing::Hash {
                tid2eid: m.tid2eid.as_ref().expect("a hash layer's table"),
                tokens: ids,
                vocab: cfg.vocab_size,
            },
            RoutingKind::TopK => Routing::TopK { bias: m.bias.as_ref().expect("a top-k layer's bias") },
        };
        route(gpu, &logits, n, e, k, routing, cfg.norm_topk_prob, cfg.routed_scaling_factor, &experts, &weights)?;
        // Which rows each expert takes: the routes come to the host once.
        let chosen = gpu.download(&experts)?;
        let mut by_expert: Vec<Vec<i32>> = vec![Vec::new(); e];
        for (slot, &ex) in chosen.iter().enumerate() {
            by_expert[ex as usize].push(slot as i32);
        }
        // Every hit expert's input rows, expert after expert, in one gather;
        // each expert's outputs land in its part of one buffer; one gather
        // then puts every (token, slot) row in its place.
        let mut rows = Vec::with_capacity(n * k);
        let mut place = vec![0i32; n * k];
        let mut parts = Vec::new();
        for (expert, slots) in by_expert.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            parts.push((expert, rows.len(), slots.len()));
            for &slot in slots {
                place[slot as usize] = rows.len() as i32;
                rows.push(slot / k as i32);
            }
        }
        let rows_dev = gpu.upload(&rows)?;
        let inputs = gpu.zeros::<f32>(rows.len() * d)?;
        gather_rows(gpu, Rows::packed(x, d), &rows_dev, rows.len(), d, Rows::packed(&inputs, d))?;
        let outputs = gpu.zeros::<f32>(n * k * d)?;
        for (expert, at, count) in parts {
            self.mlp_into(&m.experts[expert], Rows::new(&inputs, at * d, d), count, Rows::new(&outputs, at * d, d))?;
        }
        let routed = gpu.zeros::<f32>(n * k * d)?;
        let place = gpu.upload(&place)?;
        gather_rows(gpu, Rows::packed(&outputs, d), &place, n * k, d, Rows::packed(&routed, d))?;
        let shared = match &m.shared {
            Some(s) => Some(self.mlp(s, Rows::packed(x, d), n)?),
            None => None,
        };
        let out = gpu.zeros::<f32>(n * d)?;
        combine(
            gpu,
            &routed,
            &experts,
            &weights,
            shared.as_ref().map(|s| Rows::packed(s, d)),
            n,
            k,
            d,
            Rows::packed(&out, d),
        )?;
        Ok(out)
    }

    /// The hyper head, norm and vocabulary head of the rows `picks` names
    /// (`(first, count)` runs of tokens), in that order, brought back at once.
    fn logits(&self, streams: &DeviceBuffer<f32>, picks: &[(usize, usize)]) -> Result<Vec<f32>, DeviceError> {
        let rows: usize = picks.iter().map(|p| p.1).sum();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let gpu = &self.gpu;
        let cfg = &self.config;
        let (d, hc) = (cfg.hidden_size, cfg.hc_mult);
        let head: &DeviceHead = &self.weights.hc_head;
        let packed = gpu.zeros::<f32>(rows * hc * d)?;
        let mut at = 0;
        for &(first, count) in picks {
            gpu.copy(streams, first * hc * d, &packed, at * hc * d, count * hc * d)?;
            at += count;
        }
        let raw = project(gpu, &head.mix, Rows::packed(&packed, hc * d), rows)?;
        let x = gpu.zeros::<f32>(rows * d)?;
        hyper_head(gpu, &raw, &packed, rows, hc, d, head.scale, &head.base, cfg.hc_eps, cfg.rms_norm_eps, &x)?;
        rms_norm_rows(gpu, &x, rows, d, Some(&self.weights.norm), cfg.rms_norm_eps)?;
        let logits = project(gpu, &self.weights.head, Rows::packed(&x, d), rows)?;
        gpu.download(&logits)
    }
}
