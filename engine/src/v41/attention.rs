//! CSA2 attention of one layer over one sequence chunk: the sliding window,
//! plus (ratio > 0) compressed entries chosen by the two-level indexer. Only
//! KV-source layers compress and publish index keys; index-source layers
//! choose; every other layer reuses the latest choice and its group's KV.
//!
//! The order of the keys each query sees is the reference's (it decides how
//! the blockwise softmax rounds): a chunk that starts the sequence lists, per
//! query, `min(len, window)` window slots from the oldest visible position;
//! any later token lists the whole ring, empty slots first.

use deepinfer_kernels::act_quant::{
    fp4_round_trip, fp8_round_trip, plain_linear, quantized_linear, round_bf16, round_bf16_all, Fp4Scale,
};
use deepinfer_kernels::dequantized_dot::dot_f64_dequantized_tokens;

use super::config::{CandidateRole, LayerPlan, V41Config};
use super::ops::{self, RopeTable};
use super::state::{SourceMark, SourceState, V41State};
use super::weights::{Attention, Compressor, Indexer};

/// What a chunk's index sources hand to the layers after them.
#[derive(Default)]
pub struct Shared {
    /// Per query: chosen compressed entries, ascending.
    pub selection: Option<Vec<Vec<usize>>>,
    /// Per query: which compressed entries the candidate filter keeps.
    pub candidates: Option<Vec<Vec<bool>>>,
}

/// A chunk of `len` tokens starting at `start`.
#[derive(Clone, Copy)]
pub struct Span {
    pub start: usize,
    pub len: usize,
    /// Trailing draft tokens: the state keeps what they overwrite.
    pub drafts: usize,
}

impl Span {
    /// Entries the indexer's top-k ranges over for query `p`, and how many it keeps.
    fn width(&self, p: usize, ratio: usize, cfg: &V41Config) -> (usize, usize) {
        let width = if self.start == 0 { self.len / ratio } else { (p + 1) / ratio };
        (width, cfg.index_topk.min(width))
    }
}

/// Run the attention sublayer on `x` `[len, dim]` (bf16 values).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    cfg: &V41Config,
    layer: usize,
    attn: &Attention,
    rope: &RopeTable,
    x: &[f32],
    span: Span,
    state: &mut V41State,
    shared: &mut Shared,
) -> Vec<f32> {
    let projected = project(cfg, attn, rope, x, &[span]);
    let out = attend_projected(cfg, layer, attn, rope, x, projected.rows(0..span.len), span, state, shared);
    output_projection(cfg, attn, &out, span.len)
}

/// Queries and keys of every row out of the input projections.
pub struct Projected {
    /// `[rows, q_lora_rank]`: the normed low-rank query (the indexer reads it too).
    qr: Vec<f32>,
    /// `[rows, heads · head_dim]`, rotated.
    q: Vec<f32>,
    /// `[rows, head_dim]`: normed, rotated, through FP8 and back.
    kv: Vec<f32>,
    rows: usize,
}

/// One chunk's rows of a [`Projected`].
pub struct ProjectedRows<'a> {
    qr: &'a [f32],
    q: &'a [f32],
    kv: &'a [f32],
}

impl Projected {
    /// Rows `rows` (one chunk's) of every projection.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> ProjectedRows<'_> {
        assert!(rows.end <= self.rows, "rows {rows:?} of {}", self.rows);
        fn part<'a>(v: &'a [f32], rows: &std::ops::Range<usize>, all: usize) -> &'a [f32] {
            let width = v.len() / all.max(1);
            &v[rows.start * width..rows.end * width]
        }
        let n = self.rows;
        ProjectedRows { qr: part(&self.qr, &rows, n), q: part(&self.q, &rows, n), kv: part(&self.kv, &rows, n) }
    }
}

/// The input projections of several chunks' tokens at once (`x`: their
/// rows one chunk after another, `spans` their positions): each row gets
/// the bits it gets alone, and the weights are read once for all of them.
pub fn project(cfg: &V41Config, attn: &Attention, rope: &RopeTable, x: &[f32], spans: &[Span]) -> Projected {
    let (hd, rd, heads) = (cfg.head_dim, cfg.rope_head_dim, cfg.n_heads);
    let n: usize = spans.iter().map(|s| s.len).sum();
    assert_eq!(x.len(), n * cfg.dim, "attention input");
    // Each row's position: its chunk's start plus its place in the chunk.
    let positions: Vec<usize> = spans.iter().flat_map(|s| s.start..s.start + s.len).collect();
    let mut qr = quantized_linear(&attn.wq_a, x, n);
    qr.chunks_exact_mut(cfg.q_lora_rank).for_each(|r| ops::rms_norm(r, &attn.q_norm, cfg.norm_eps));
    let mut q = quantized_linear(&attn.wq_b, &qr, n);
    for (row, &p) in q.chunks_exact_mut(heads * hd).zip(&positions) {
        for head in row.chunks_exact_mut(hd) {
            rope.apply(&mut head[hd - rd..], p, false);
        }
    }
    let mut kv = quantized_linear(&attn.wkv, x, n);
    for (row, &p) in kv.chunks_exact_mut(hd).zip(&positions) {
        ops::rms_norm(row, &attn.kv_norm, cfg.norm_eps);
        rope.apply(&mut row[hd - rd..], p, false);
        fp8_round_trip(row);
    }
    Projected { qr, q, kv, rows: n }
}

/// One chunk's attention from its projections (`x` its input rows): the
/// window and the compressed entries, before the output projection
/// (`[len, heads · head_dim]`).
#[allow(clippy::too_many_arguments)]
pub fn attend_projected(
    cfg: &V41Config,
    layer: usize,
    attn: &Attention,
    rope: &RopeTable,
    x: &[f32],
    projected: ProjectedRows<'_>,
    span: Span,
    state: &mut V41State,
    shared: &mut Shared,
) -> Vec<f32> {
    let plan = cfg.layers[layer];
    let (d, hd, rd, heads) = (cfg.dim, cfg.head_dim, cfg.rope_head_dim, cfg.n_heads);
    let n = span.len;
    assert_eq!(x.len(), n * d, "attention input");
    let ProjectedRows { qr, q, kv } = projected;

    // Window rows of positions `base..start + len`.
    let mut window = std::mem::take(&mut state.windows[layer]);
    let base = span.start - window.len() / hd;
    window.extend_from_slice(kv);

    let selection = if plan.ratio > 0 {
        compressed_step(cfg, layer, plan, attn, rope, x, qr, span, state, shared);
        shared.selection.clone().unwrap_or_else(|| vec![Vec::new(); n])
    } else {
        vec![Vec::new(); n]
    };
    let entries: &[f32] = match plan.kv_source {
        Some(src) => &state.sources[src].as_ref().expect("KV source state").entries,
        None => &[],
    };

    let win = cfg.window_size;
    let scale = (hd as f64).powf(-0.5) as f32;
    let mut out = vec![0.0f32; n * heads * hd];
    for t in 0..n {
        let p = span.start + t;
        let oldest = (p + 1).saturating_sub(win);
        let row = |pos: usize| Some(&window[(pos - base) * hd..(pos - base + 1) * hd]);
        let mut keys: Vec<Option<&[f32]>> = Vec::new();
        if span.start == 0 {
            keys.extend((oldest..=p).map(row));
            keys.resize(n.min(win), None);
        } else {
            keys.resize(win - (p + 1 - oldest), None);
            keys.extend((oldest..=p).map(row));
        }
        keys.extend(selection[t].iter().map(|&j| Some(&entries[j * hd..(j + 1) * hd])));
        ops::sparse_attention(
            &q[t * heads * hd..(t + 1) * heads * hd],
            &keys,
            &attn.sink,
            scale,
            &mut out[t * heads * hd..(t + 1) * heads * hd],
        );
        for head in out[t * heads * hd..(t + 1) * heads * hd].chunks_exact_mut(hd) {
            rope.apply(&mut head[hd - rd..], p, true);
        }
    }
    let keep = window.len().min(win * hd);
    if span.drafts > 0 {
        let total = window.len() / hd;
        let (dropped, rows) = crate::model::draft_window_mark(&window, hd, total, keep / hd, span.drafts, win);
        let mark = state.draft_mark.get_or_insert_with(Default::default);
        mark.windows.resize(cfg.n_layers, None);
        mark.windows[layer] = Some((dropped, rows * hd));
    }
    state.windows[layer] = window.split_off(window.len() - keep);
    out
}

/// Rows of `wo_a` per parallel part of [`output_projection`]: one FP8 scale
/// block of the published checkpoints, so a part scales each token's input once.
const WO_A_ROWS_PER_PART: usize = 128;

/// The grouped low-rank output: each group's heads through its own block of
/// `wo_a`, then `wo_b`. The reference holds `wo_a` in bf16 (its converter
/// dequantises the stored FP8); its codes are read here and give the bits of
/// those bf16 values (`dot_f64_dequantized_tokens`), at a quarter of the bytes of f32.
pub fn output_projection(cfg: &V41Config, attn: &Attention, o: &[f32], n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
    let group_in = cfg.n_heads * cfg.head_dim / groups;
    assert_eq!(o.len(), n * groups * group_in, "output_projection input");
    assert_eq!((attn.wo_a.rows, attn.wo_a.cols), (groups * rank, group_in), "wo_a shape");
    // One (group, run of rows) per part, every token through it: each
    // output is one thread's, in the same order as a token alone.
    let parts: Vec<(usize, usize)> =
        (0..groups).flat_map(|g| (0..rank).step_by(WO_A_ROWS_PER_PART).map(move |r0| (g, r0))).collect();
    let part = |&(g, r0): &(usize, usize)| {
        let rows = WO_A_ROWS_PER_PART.min(rank - r0);
        let inputs: Vec<&[f32]> = (0..n).map(|t| &o[(t * groups + g) * group_in..][..group_in]).collect();
        let mut sums = vec![0.0f64; n * rows];
        dot_f64_dequantized_tokens(&inputs, &attn.wo_a, g * rank + r0, rows, &mut sums);
        sums
    };
    let sums: Vec<Vec<f64>> = if ops::worth_spreading(n * groups * rank * group_in) && parts.len() > 1 {
        parts.par_iter().map(part).collect()
    } else {
        parts.iter().map(part).collect()
    };
    let mut mid = vec![0.0f32; n * groups * rank];
    for (&(g, r0), sums) in parts.iter().zip(&sums) {
        let rows = sums.len() / n;
        for (t, sums) in sums.chunks_exact(rows).enumerate() {
            let at = &mut mid[t * groups * rank + g * rank + r0..][..rows];
            at.iter_mut().zip(sums).for_each(|(m, &s)| *m = round_bf16(s as f32));
        }
    }
    quantized_linear(&attn.wo_b, &mid, n)
}

/// The compressed half of a layer: compress (KV sources), choose (index sources).
#[allow(clippy::too_many_arguments)]
fn compressed_step(
    cfg: &V41Config,
    layer: usize,
    plan: LayerPlan,
    attn: &Attention,
    rope: &RopeTable,
    x: &[f32],
    qr: &[f32],
    span: Span,
    state: &mut V41State,
    shared: &mut Shared,
) {
    let ratio = plan.ratio;
    let latents = match &attn.compressor {
        Some(c) => {
            let src = state.sources[layer].as_mut().expect("KV source state");
            let (latents, pending) = compress(cfg, c, ratio, x, span, src);
            if let Some((pending_kv, pending_score)) = pending {
                // The groups the real tokens close keep their entries and keys.
                let groups = (span.start + span.len - span.drafts) / ratio;
                let has_keys = matches!(&attn.indexer, Some(Indexer { wk: Some(_), .. }));
                let mark = state.draft_mark.get_or_insert_with(Default::default);
                mark.sources.resize(cfg.n_layers, None);
                mark.sources[layer] = Some(SourceMark {
                    entries_len: groups * cfg.head_dim,
                    keys_len: if has_keys { groups * cfg.index_head_dim } else { 0 },
                    pending_kv,
                    pending_score,
                });
            }
            latents
        }
        None => Vec::new(),
    };
    let group_src = plan.kv_source.expect("compressed layer has a KV source");
    let (hd, rd) = (cfg.head_dim, cfg.rope_head_dim);
    // Index keys come from the latent before its rotation.
    let first_group = state.sources[group_src].as_ref().expect("KV source state").entries.len() / hd;
    if let Some(Indexer { wk: Some((wk, k_norm)), .. }) = &attn.indexer {
        let m = latents.len() / hd;
        let mut keys = quantized_linear(wk, &latents, m);
        for (g, k) in keys.chunks_exact_mut(cfg.index_head_dim).enumerate() {
            ops::rms_norm(k, k_norm, cfg.norm_eps);
            let ihd = cfg.index_head_dim;
            rope.apply(&mut k[ihd - rd..], (first_group + g) * ratio, false);
            fp4_round_trip(k, 32, Fp4Scale::Ue8m0);
        }
        state.sources[layer].as_mut().unwrap().keys.extend_from_slice(&keys);
    }
    if plan.runs_indexer(layer) {
        let indexer = attn.indexer.as_ref().expect("index source has an indexer");
        let keys = &state.sources[group_src].as_ref().unwrap().keys;
        let end = span.start + span.len;
        shared.selection = Some(if end / ratio == 0 {
            vec![Vec::new(); span.len]
        } else {
            choose(cfg, plan, indexer, rope, x, qr, span, keys, shared)
        });
    }
    if !latents.is_empty() {
        let mut entries = latents;
        for (g, e) in entries.chunks_exact_mut(hd).enumerate() {
            rope.apply(&mut e[hd - rd..], (first_group + g) * ratio, false);
            fp4_round_trip(e, 16, Fp4Scale::E4m3);
        }
        state.sources[layer].as_mut().unwrap().entries.extend_from_slice(&entries);
    }
}

/// Feed the chunk's tokens to a compressor; returns the latents (normalised,
/// not yet rotated) of the groups the chunk completes and, when the chunk
/// ends in drafts, the open group's rows before the first draft.
#[allow(clippy::type_complexity)]
fn compress(
    cfg: &V41Config,
    c: &Compressor,
    ratio: usize,
    x: &[f32],
    span: Span,
    src: &mut SourceState,
) -> (Vec<f32>, Option<(Vec<f32>, Vec<f32>)>) {
    let (d, hd, n) = (cfg.dim, cfg.head_dim, span.len);
    let first_draft = n - span.drafts;
    let mut mark = (span.drafts > 0).then(Default::default);
    let mut latents = Vec::new();
    match &c.wgate {
        None => {
            latents = quantized_linear(&c.wkv, x, n);
            latents.chunks_exact_mut(hd).for_each(|r| ops::rms_norm(r, &c.norm, cfg.norm_eps));
        }
        Some(wgate) => {
            let mut kv = vec![0.0f32; n * hd];
            let mut score = vec![0.0f32; n * hd];
            plain_linear(&c.wkv, x, n, &mut kv);
            plain_linear(wgate, x, n, &mut score);
            assert!(x.len() == n * d);
            for t in 0..n {
                if span.drafts > 0 && t == first_draft {
                    mark = Some((src.pending_kv.clone(), src.pending_score.clone()));
                }
                src.pending_kv.extend_from_slice(&kv[t * hd..(t + 1) * hd]);
                src.pending_score.extend_from_slice(&score[t * hd..(t + 1) * hd]);
                if (span.start + t + 1).is_multiple_of(ratio) {
                    let mut pooled = vec![0.0f32; hd];
                    for (ch, out) in pooled.iter_mut().enumerate() {
                        let s: Vec<f32> = (0..ratio).map(|i| src.pending_score[i * hd + ch]).collect();
                        let weights = ops::softmax(&s);
                        *out = ops::sum((0..ratio).map(|i| src.pending_kv[i * hd + ch] * weights[i]));
                    }
                    round_bf16_all(&mut pooled);
                    ops::rms_norm(&mut pooled, &c.norm, cfg.norm_eps);
                    latents.extend_from_slice(&pooled);
                    src.pending_kv.clear();
                    src.pending_score.clear();
                }
            }
        }
    }
    (latents, mark)
}

/// The two-level indexer: per query, the entries of the top-k index scores
/// (inside the candidate blocks for consumers), ascending.
#[allow(clippy::too_many_arguments)]
fn choose(
    cfg: &V41Config,
    plan: LayerPlan,
    indexer: &Indexer,
    rope: &RopeTable,
    x: &[f32],
    qr: &[f32],
    span: Span,
    keys: &[f32],
    shared: &mut Shared,
) -> Vec<Vec<usize>> {
    let (ih, ihd, rd, n, ratio) = (cfg.index_n_heads, cfg.index_head_dim, cfg.rope_head_dim, span.len, plan.ratio);
    let mut q = quantized_linear(&indexer.wq_b, qr, n);
    for (t, row) in q.chunks_exact_mut(ih * ihd).enumerate() {
        for head in row.chunks_exact_mut(ihd) {
            rope.apply(&mut head[ihd - rd..], span.start + t, false);
            fp4_round_trip(head, 32, Fp4Scale::Ue8m0);
        }
    }
    let factor = ((ihd as f64).powf(-0.5) * (ih as f64).powf(-0.5)) as f32;
    let mut weights = quantized_linear(&indexer.weights_proj, x, n);
    weights.iter_mut().for_each(|w| *w = round_bf16(*w * factor));

    let mut selections = Vec::with_capacity(n);
    let mut candidates = Vec::new();
    for t in 0..n {
        let p = span.start + t;
        let visible = (p + 1) / ratio;
        let (width, topk) = span.width(p, ratio, cfg);
        let score = |j: usize| {
            if j >= visible {
                return f32::NEG_INFINITY;
            }
            let k = &keys[j * ihd..(j + 1) * ihd];
            // Every head's dot with this key, four heads at a time.
            let mut dots = vec![0.0f64; ih];
            deepinfer_kernels::act_quant::dot_f64_rows(k, &q[t * ih * ihd..(t + 1) * ih * ihd], &mut dots);
            round_bf16(ops::sum((0..ih).map(|h| {
                let s = round_bf16(dots[h] as f32).max(0.0);
                round_bf16(s * weights[t * ih + h])
            })))
        };
        // Each entry's score is one thread's: spreading them changes no bit.
        let mut scores: Vec<f32> = if ops::worth_spreading(visible.min(width) * ih * ihd) {
            use rayon::prelude::*;
            (0..width).into_par_iter().map(score).collect()
        } else {
            (0..width).map(score).collect()
        };
        match plan.candidate {
            CandidateRole::Source => candidates.push(candidate_blocks(&scores, visible, cfg)),
            CandidateRole::Consumer => {
                let keep = &shared.candidates.as_ref().expect("candidate source ran before its consumers")[t];
                for (s, &k) in scores.iter_mut().zip(keep) {
                    if !k {
                        *s = f32::NEG_INFINITY;
                    }
                }
            }
            CandidateRole::None => {}
        }
        let mut chosen: Vec<usize> = ops::top_k_stable(&scores, topk).into_iter().filter(|&j| j < visible).collect();
        chosen.sort_unstable();
        selections.push(chosen);
    }
    if plan.candidate == CandidateRole::Source {
        shared.candidates = Some(candidates);
    }
    selections
}

/// Level one: the `candidate_topk_blocks` blocks with the best entry, the
/// newest (partly filled) block always kept; returns a mask over the entries.
fn candidate_blocks(scores: &[f32], visible: usize, cfg: &V41Config) -> Vec<bool> {
    let size = cfg.candidate_block_size;
    let blocks = scores.len().div_ceil(size);
    let mut best: Vec<f32> = (0..blocks)
        .map(|b| scores[b * size..((b + 1) * size).min(scores.len())].iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s)))
        .collect();
    if visible > 0 {
        best[(visible - 1) / size] = f32::INFINITY;
    }
    let mut keep = vec![false; scores.len()];
    for b in ops::top_k_stable(&best, cfg.candidate_topk_blocks.min(blocks)) {
        if best[b] > f32::NEG_INFINITY {
            keep[b * size..((b + 1) * size).min(scores.len())].iter_mut().for_each(|k| *k = true);
        }
    }
    keep
}
