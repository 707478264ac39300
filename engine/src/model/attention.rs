//! V4 attention: shared-KV multi-query attention over a sliding window plus,
//! on CSA/HCA layers, compressed entries (all visible ones for HCA, the
//! lightning indexer's top-k for CSA), a per-head sink, and the grouped
//! low-rank output projection.

use deepinfer_kernels::linear::{dot_rows, dot_rows_of};
use deepinfer_kernels::ops::{add_weighted_rows_heads, rms_norm, rope_interleaved, softmax_with_sink, top_k, Rope};
use deepinfer_kernels::pooling::softmax_pool_columns;

use rayon::prelude::*;

use super::rows::{each_token, norm_rows, spread_tokens, zeros};
use super::state::{CompressorState, LayerState};
use super::weights::{Attention, Compressor};
use crate::config::ModelConfig;

/// The tokens of one sequence inside the flat batch.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// First row in the flat batch.
    pub start: usize,
    pub len: usize,
    /// Position of the first token.
    pub position: usize,
    /// Rebuilding window state only: the compressors already hold these tokens.
    pub replay: bool,
    /// Trailing tokens that are drafts: the state keeps what they overwrite
    /// so that they can be taken back (`SequenceState::reject_drafts`).
    pub drafts: usize,
}

/// Cos/sin tables for a run of positions.
struct Angles {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Angles {
    fn new(rope: &Rope, positions: &[usize]) -> Self {
        let half = rope.inv_freq.len();
        let (mut cos, mut sin) = (vec![0.0f32; positions.len() * half], vec![0.0f32; positions.len() * half]);
        // Each position's angles alone; a prefill's spread over threads.
        let fill = |((&p, cos), sin): ((&usize, &mut [f32]), &mut [f32])| rope.cos_sin(p, cos, sin);
        if half > 0 && spread_tokens(positions.len()) {
            positions.par_iter().zip(cos.par_chunks_exact_mut(half)).zip(sin.par_chunks_exact_mut(half)).for_each(fill);
        } else if half > 0 {
            positions.iter().zip(cos.chunks_exact_mut(half)).zip(sin.chunks_exact_mut(half)).for_each(fill);
        }
        Self { half, cos, sin }
    }

    /// Rotate the trailing rope channels of `v` by the angles of row `i`.
    fn apply(&self, i: usize, v: &mut [f32]) {
        let r = 2 * self.half;
        let tail = v.len() - r;
        rope_interleaved(
            &mut v[tail..],
            &self.cos[i * self.half..][..self.half],
            &self.sin[i * self.half..][..self.half],
        );
    }

    /// Rotate back (angle negated).
    fn apply_inverse(&self, i: usize, v: &mut [f32]) {
        let r = 2 * self.half;
        let tail = v.len() - r;
        let neg: Vec<f32> = self.sin[i * self.half..][..self.half].iter().map(|s| -s).collect();
        rope_interleaved(&mut v[tail..], &self.cos[i * self.half..][..self.half], &neg);
    }
}

fn project(w: &deepinfer_kernels::Linear, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = zeros(n * w.rows);
    w.forward(x, n, &mut out);
    out
}

/// What a ring of `ring` rows must keep aside so that the last `drafts` of
/// its `total` rows `keys` can be taken back once it holds only the last
/// `keep`: the rows before the drafts that the trim drops but a ring without
/// the drafts would hold, and the draft rows the trimmed ring ends with.
pub(crate) fn draft_window_mark(
    keys: &[f32],
    dim: usize,
    total: usize,
    keep: usize,
    drafts: usize,
    ring: usize,
) -> (Vec<f32>, usize) {
    assert!(drafts <= keep && keep <= total, "the ring holds every draft row ({drafts} of {keep})");
    let before = total - drafts;
    let ring_start = before - ring.min(before);
    let kept_start = total - keep;
    debug_assert!(ring_start <= kept_start);
    (keys[ring_start * dim..kept_start * dim].to_vec(), drafts)
}

/// Feed one token's projections into a compressor; emits an entry when its window closes.
fn compress_token(c: &Compressor, st: &mut CompressorState, kv: &[f32], gate: &[f32], rope: &Rope, eps: f32) {
    let width = c.width();
    st.pending_kv.extend_from_slice(kv);
    st.pending_gate.extend_from_slice(gate);
    if st.pending_kv.len() < c.ratio * width {
        return;
    }
    let dim = c.dim;
    let ratio = c.ratio;
    let window = st.count(dim);
    // Gate logits of this window with the per-slot bias.
    let gates: Vec<f32> = st.pending_gate.iter().zip(&c.ape).map(|(g, a)| g + a).collect();
    let kvs = std::mem::take(&mut st.pending_kv);
    st.pending_gate.clear();
    // Each channel's softmax over the window's slots, then its values
    // weighted by it, whole rows of channels at a time. With overlap, the
    // previous window's first series comes first; before the first window,
    // slots that take no weight stand in for it.
    let earlier = st.overlap_kv.as_deref().zip(st.overlap_gate.as_deref());
    let first_window = (c.overlap && earlier.is_none()).then(|| (vec![0.0f32; dim], vec![f32::NEG_INFINITY; dim]));
    let mut logit_rows: Vec<&[f32]> = Vec::with_capacity(2 * ratio);
    let mut value_rows: Vec<&[f32]> = Vec::with_capacity(2 * ratio);
    if c.overlap {
        for j in 0..ratio {
            let (values, logits) = match (earlier, &first_window) {
                (Some((pk, pg)), _) => (&pk[j * dim..(j + 1) * dim], &pg[j * dim..(j + 1) * dim]),
                (None, Some((no_values, no_logits))) => (&no_values[..], &no_logits[..]),
                (None, None) => unreachable!("a first window has its empty slots"),
            };
            value_rows.push(values);
            logit_rows.push(logits);
        }
    }
    let offset = if c.overlap { dim } else { 0 };
    for j in 0..ratio {
        value_rows.push(&kvs[j * width + offset..][..dim]);
        logit_rows.push(&gates[j * width + offset..][..dim]);
    }
    let mut entry = vec![0.0f32; dim];
    softmax_pool_columns(&logit_rows, &value_rows, &mut entry);
    if c.overlap {
        let mut ok = Vec::with_capacity(ratio * dim);
        let mut og = Vec::with_capacity(ratio * dim);
        for j in 0..ratio {
            ok.extend_from_slice(&kvs[j * width..j * width + dim]);
            og.extend_from_slice(&gates[j * width..j * width + dim]);
        }
        st.overlap_kv = Some(ok);
        st.overlap_gate = Some(og);
    }
    rms_norm(&mut entry, Some(&c.norm), eps);
    Angles::new(rope, &[window * ratio]).apply(0, &mut entry);
    st.entries.extend_from_slice(&entry);
}

/// Run every token of `x` `[n, D]` through `c`, in order within each segment.
fn run_compressor(
    c: &Compressor,
    x: &[f32],
    n: usize,
    segments: &[Segment],
    states: &mut [&mut CompressorState],
    rope: &Rope,
    eps: f32,
) {
    let width = c.width();
    let kv = project(&c.wkv, x, n);
    let gate = project(&c.wgate, x, n);
    for (seg, st) in segments.iter().zip(states.iter_mut()) {
        if seg.replay {
            continue;
        }
        let first_draft = seg.start + seg.len - seg.drafts;
        for t in seg.start..seg.start + seg.len {
            if seg.drafts > 0 && t == first_draft {
                st.mark_drafts();
            }
            compress_token(c, st, &kv[t * width..(t + 1) * width], &gate[t * width..(t + 1) * width], rope, eps);
        }
    }
}

/// Attention sublayer over the flat batch `x` `[n, D]`; returns `[n, D]`.
pub fn forward(
    a: &Attention,
    cfg: &ModelConfig,
    rope: &Rope,
    x: &[f32],
    segments: &[Segment],
    states: &mut [&mut LayerState],
) -> Vec<f32> {
    let n: usize = segments.iter().map(|s| s.len).sum();
    let (h, hd) = (cfg.num_heads, cfg.head_dim);
    let eps = cfg.rms_norm_eps;
    let positions: Vec<usize> = segments.iter().flat_map(|s| s.position..s.position + s.len).collect();
    let angles = Angles::new(rope, &positions);

    let mut q_res = project(&a.wq_a, x, n);
    norm_rows(&mut q_res, cfg.q_lora_rank, Some(&a.q_norm), eps);
    let mut q = project(&a.wq_b, &q_res, n);
    each_token(&mut q, h * hd, |t, row| {
        for head in row.chunks_exact_mut(hd) {
            rms_norm(head, None, eps);
            angles.apply(t, head);
        }
    });
    let mut kv = project(&a.wkv, x, n);
    each_token(&mut kv, hd, |t, row| {
        rms_norm(row, Some(&a.kv_norm), eps);
        angles.apply(t, row);
    });

    // The compressor and the indexer (its own compressor, queries and
    // per-head weights, for CSA layers) read the same inputs and write
    // apart, so they run side by side: each compressor steps its tokens in
    // order on one thread.
    let (mut compressors, mut indexers): (Vec<_>, Vec<_>) =
        states.iter_mut().map(|s| (s.compressor.as_mut(), s.indexer.as_mut())).unzip();
    let compress = || {
        if let Some(c) = &a.compressor {
            let mut cs: Vec<&mut CompressorState> =
                compressors.iter_mut().map(|s| s.as_deref_mut().expect("compressed layer state")).collect();
            run_compressor(c, x, n, segments, &mut cs, rope, eps);
        }
    };
    let index = || {
        let ix = a.indexer.as_ref()?;
        let mut cs: Vec<&mut CompressorState> =
            indexers.iter_mut().map(|s| s.as_deref_mut().expect("CSA layer state")).collect();
        run_compressor(&ix.compressor, x, n, segments, &mut cs, rope, eps);
        let ihd = cfg.index_head_dim;
        let mut iq = project(&ix.wq_b, &q_res, n);
        each_token(&mut iq, cfg.index_n_heads * ihd, |t, row| {
            for head in row.chunks_exact_mut(ihd) {
                angles.apply(t, head);
            }
        });
        let mut iw = project(&ix.weights_proj, x, n);
        let scale = (cfg.index_n_heads as f32).powf(-0.5);
        iw.iter_mut().for_each(|v| *v *= scale);
        Some((iq, iw))
    };
    let ((), index) = rayon::join(compress, index);

    let window = cfg.sliding_window;
    let scale = (hd as f32).powf(-0.5);
    let mut attn_out = zeros(n * h * hd);
    for (seg, st) in segments.iter().zip(states.iter_mut()) {
        // Keys (= values): the cached tail of the window, then this chunk's.
        let cached = st.window.len() / hd;
        let mut keys = std::mem::take(&mut st.window);
        keys.extend_from_slice(&kv[seg.start * hd..(seg.start + seg.len) * hd]);
        let first_key_position = seg.position - cached;
        let entries = st.compressor.as_ref().map(|c| &c.entries[..]);
        let index_entries = st.indexer.as_ref().map(|c| &c.entries[..]);
        // Each query token is independent once the keys exist; large chunks
        // spread them over threads (each row's arithmetic is unchanged).
        let attend_token = |i: usize, out_row: &mut [f32]| {
            let t = seg.start + i;
            let pos = seg.position + i;
            let lo = (pos + 1).saturating_sub(window).max(first_key_position);
            let window_keys = &keys[(lo - first_key_position) * hd..(pos + 1 - first_key_position) * hd];
            let selected: Vec<usize> = match (a.kind.compress_ratio(), entries) {
                (Some(ratio), Some(_)) => {
                    let visible = (pos + 1) / ratio;
                    match (&index, index_entries) {
                        (Some((iq, iw)), Some(ie)) => {
                            let scores = index_scores(
                                cfg,
                                &iq[t * cfg.index_n_heads * cfg.index_head_dim..],
                                &iw[t * cfg.index_n_heads..],
                                ie,
                                visible,
                            );
                            top_k(&scores, cfg.index_topk.min(visible))
                        }
                        _ => (0..visible).collect(),
                    }
                }
                _ => Vec::new(),
            };
            let e = entries.unwrap_or(&[]);
            // The window's keys, then the chosen entries, read in place.
            let keys_of_query: Vec<&[f32]> =
                window_keys.chunks_exact(hd).chain(selected.iter().map(|&w| &e[w * hd..(w + 1) * hd])).collect();
            let nk = keys_of_query.len();
            // Every head scores the same keys (one KV head): all heads' scores
            // at once, each the bits of its own `dot`, a row of `nk` a head.
            let heads_q = &q[t * h * hd..(t + 1) * h * hd];
            let mut probs = vec![0.0f32; h * nk];
            dot_rows_of(heads_q, h, &keys_of_query, &mut probs, nk);
            for (head, row) in probs.chunks_exact_mut(nk.max(1)).enumerate() {
                row.iter_mut().for_each(|l| *l *= scale);
                softmax_with_sink(row, a.sink[head]);
            }
            // Every head's weighted values at once (the same sums per head).
            add_weighted_rows_heads(out_row, h, &probs, nk, &keys_of_query);
            for out in out_row.chunks_exact_mut(hd) {
                angles.apply_inverse(t, out);
            }
        };
        each_token(&mut attn_out[seg.start * h * hd..(seg.start + seg.len) * h * hd], h * hd, attend_token);
        // Keep the last `window − 1` keys for the next step.
        let total = keys.len() / hd;
        let keep = total.min(window - 1);
        if seg.drafts > 0 {
            let (dropped, rows) = draft_window_mark(&keys, hd, total, keep, seg.drafts, window - 1);
            st.draft_window_dropped = Some(dropped);
            st.draft_rows = rows;
        }
        keys.drain(..(total - keep) * hd);
        st.window = keys;
    }

    // Grouped low-rank output projection.
    let groups = a.wo_a.len();
    let group_in = h * hd / groups;
    let mut grouped = zeros(n * groups * cfg.o_lora_rank);
    for (g, w) in a.wo_a.iter().enumerate() {
        let mut input = Vec::with_capacity(n * group_in);
        for t in 0..n {
            input.extend_from_slice(&attn_out[t * h * hd + g * group_in..][..group_in]);
        }
        let y = project(w, &input, n);
        for t in 0..n {
            grouped[t * groups * cfg.o_lora_rank + g * cfg.o_lora_rank..][..cfg.o_lora_rank]
                .copy_from_slice(&y[t * cfg.o_lora_rank..(t + 1) * cfg.o_lora_rank]);
        }
    }
    project(&a.wo_b, &grouped, n)
}

/// Lightning-indexer scores of one query over the first `visible` entries:
/// `Σ_h w_h · relu(q_h · k) / sqrt(index_head_dim)`.
fn index_scores(cfg: &ModelConfig, q: &[f32], w: &[f32], entries: &[f32], visible: usize) -> Vec<f32> {
    let (heads, ihd) = (cfg.index_n_heads, cfg.index_head_dim);
    let scale = (ihd as f32).powf(-0.5);
    // Every head against every entry in register tiles, each the bits of its `dot`.
    let mut dots = vec![0.0f32; heads * visible];
    dot_rows(&q[..heads * ihd], heads, &entries[..visible * ihd], visible, ihd, &mut dots);
    (0..visible).map(|e| (0..heads).map(|h| w[h] * (dots[h * visible + e].max(0.0) * scale)).sum()).collect()
}
