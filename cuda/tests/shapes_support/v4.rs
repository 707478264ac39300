//! V4-Flash's CPU references: the engine's mHC, compressor, indexer,
//! attention, routing and sampling, copied.

use deepinfer_cuda::ops::sampling::SampleRow;
use deepinfer_kernels::linear::{dot_rows, dot_rows_of};
use deepinfer_kernels::ops::{
    self as kops, add_scaled, add_weighted_rows_heads, inv_rms, rope_interleaved, sigmoid, sinkhorn, softmax_with_sink,
    sqrt_softplus, top_k, Rope,
};

use super::SINKHORN_ITERS;

// ---- V4-Flash: mHC -------------------------------------------------------------
// Faithful copies of engine/src/model/hyper.rs (crate-private), from
// emulated_hyper.rs.

#[allow(dead_code)]
pub struct Mix {
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
}

#[allow(dead_code)]
pub fn cpu_normed_mix(raw: &[f32], rows: usize, streams: &[f32], n: usize, width: usize, eps: f32) -> Vec<f32> {
    let mut mixes = raw[..n * rows].to_vec();
    for (t, row) in mixes.chunks_exact_mut(rows).enumerate() {
        let inv = inv_rms(&streams[t * width..][..width], eps);
        row.iter_mut().for_each(|v| *v *= inv);
    }
    mixes
}

#[allow(dead_code)]
pub fn cpu_collapse(pre: &[f32], streams: &[f32], out: &mut [f32]) {
    let d = out.len();
    out.fill(0.0);
    for (j, &p) in pre.iter().enumerate() {
        add_scaled(out, p, &streams[j * d..(j + 1) * d]);
    }
}

#[allow(dead_code, clippy::too_many_arguments)]
pub fn cpu_hyper_pre(
    raw: &[f32],
    streams: &[f32],
    n: usize,
    hc: usize,
    d: usize,
    scale: [f32; 3],
    base: &[f32],
    eps: f32,
) -> (Vec<Mix>, Vec<f32>) {
    let outputs = (2 + hc) * hc;
    let mixes = cpu_normed_mix(raw, outputs, streams, n, hc * d, eps);
    let mut collapsed = vec![0.0f32; n * d];
    let mut out = Vec::new();
    for (t, row) in collapsed.chunks_exact_mut(d).enumerate() {
        let m = &mixes[t * outputs..(t + 1) * outputs];
        let pre: Vec<f32> = (0..hc).map(|j| sigmoid(m[j] * scale[0] + base[j]) + eps).collect();
        let post: Vec<f32> = (0..hc).map(|j| 2.0 * sigmoid(m[hc + j] * scale[1] + base[hc + j])).collect();
        let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * scale[2] + base[2 * hc + k]).collect();
        for r in comb.chunks_exact_mut(hc) {
            kops::softmax(r);
            r.iter_mut().for_each(|v| *v += eps);
        }
        sinkhorn(&mut comb, hc, SINKHORN_ITERS, eps);
        cpu_collapse(&pre, &streams[t * hc * d..(t + 1) * hc * d], row);
        out.push(Mix { post, comb });
    }
    (out, collapsed)
}

// ---- V4-Flash: compressors -----------------------------------------------------
// The engine's `Compressor`, `CompressorState` and private `compress_token`
// (engine/src/model/attention.rs), copied from emulated_compressor.rs.

#[allow(dead_code)]
pub struct Compressor {
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
    pub ratio: usize,
    pub dim: usize,
    pub overlap: bool,
}

impl Compressor {
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

#[derive(Clone, Debug, Default)]
#[allow(dead_code)]
pub struct CompressorState {
    pub entries: Vec<f32>,
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub overlap_kv: Option<Vec<f32>>,
    pub overlap_gate: Option<Vec<f32>>,
}

#[allow(dead_code)]
pub fn compress_token(c: &Compressor, st: &mut CompressorState, kv: &[f32], gate: &[f32], rope: &Rope, eps: f32) {
    let width = c.width();
    st.pending_kv.extend_from_slice(kv);
    st.pending_gate.extend_from_slice(gate);
    if st.pending_kv.len() < c.ratio * width {
        return;
    }
    let (dim, ratio) = (c.dim, c.ratio);
    let window = st.entries.len() / dim;
    let gates: Vec<f32> = st.pending_gate.iter().zip(&c.ape).map(|(g, a)| g + a).collect();
    let kvs = std::mem::take(&mut st.pending_kv);
    st.pending_gate.clear();
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
    deepinfer_kernels::pooling::softmax_pool_columns(&logit_rows, &value_rows, &mut entry);
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
    kops::rms_norm(&mut entry, Some(&c.norm), eps);
    let half = rope.inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
    if half > 0 {
        rope.cos_sin(window * ratio, &mut cos, &mut sin);
    }
    let tail = entry.len() - 2 * half;
    rope_interleaved(&mut entry[tail..], &cos, &sin);
    st.entries.extend_from_slice(&entry);
}

// ---- V4-Flash: the indexer and the attention ---------------------------------
// The engine's private `index_scores` and `attend_token`
// (engine/src/model/attention.rs); emulated_attention.rs checks its kernels against these too.

#[allow(dead_code, clippy::too_many_arguments)]
pub fn cpu_index_topk(
    iq: &[f32],
    iw: &[f32],
    ih: usize,
    ihd: usize,
    entries: &[f32],
    position: usize,
    len: usize,
    ratio: usize,
    topk: usize,
) -> Vec<Vec<usize>> {
    (0..len)
        .map(|i| {
            let visible = (position + i + 1) / ratio;
            let q = &iq[i * ih * ihd..];
            let w = &iw[i * ih..];
            let scale = (ihd as f32).powf(-0.5);
            let mut dots = vec![0.0f32; ih * visible];
            dot_rows(&q[..ih * ihd], ih, &entries[..visible * ihd], visible, ihd, &mut dots);
            let scores: Vec<f32> =
                (0..visible).map(|e| (0..ih).map(|h| w[h] * (dots[h * visible + e].max(0.0) * scale)).sum()).collect();
            top_k(&scores, topk.min(visible))
        })
        .collect()
}

#[allow(dead_code, clippy::too_many_arguments)]
pub fn cpu_attend(
    q: &[f32],
    h: usize,
    hd: usize,
    keys: &[f32],
    first_key_position: usize,
    position: usize,
    len: usize,
    window: usize,
    entries: &[f32],
    selected: &[Vec<usize>],
    sink: &[f32],
    scale: f32,
    cos: &[f32],
    sin: &[f32],
    half: usize,
) -> Vec<f32> {
    let mut attn_out = vec![0.0f32; len * h * hd];
    for (i, out_row) in attn_out.chunks_exact_mut(h * hd).enumerate() {
        let pos = position + i;
        let lo = (pos + 1).saturating_sub(window).max(first_key_position);
        let window_keys = &keys[(lo - first_key_position) * hd..(pos + 1 - first_key_position) * hd];
        let keys_of_query: Vec<&[f32]> =
            window_keys.chunks_exact(hd).chain(selected[i].iter().map(|&w| &entries[w * hd..(w + 1) * hd])).collect();
        let nk = keys_of_query.len();
        let mut probs = vec![0.0f32; h * nk];
        dot_rows_of(&q[i * h * hd..(i + 1) * h * hd], h, &keys_of_query, &mut probs, nk);
        for (head, row) in probs.chunks_exact_mut(nk.max(1)).enumerate() {
            row.iter_mut().for_each(|l| *l *= scale);
            softmax_with_sink(row, sink[head]);
        }
        add_weighted_rows_heads(out_row, h, &probs, nk, &keys_of_query);
        for out in out_row.chunks_exact_mut(hd) {
            let tail = out.len() - 2 * half;
            let neg: Vec<f32> = sin[i * half..][..half].iter().map(|s| -s).collect();
            rope_interleaved(&mut out[tail..], &cos[i * half..][..half], &neg);
        }
    }
    attn_out
}

// ---- V4-Flash: MoE -----------------------------------------------------------
// The engine's `route_token` (engine/src/model/moe.rs), copied from emulated_moe.rs.

#[allow(dead_code)]
pub fn cpu_route(
    logits: &[f32],
    hash: Option<(&[i32], u32, usize)>,
    bias: &[f32],
    k: usize,
    scaling: f32,
) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = logits.iter().map(|&v| sqrt_softplus(v)).collect();
    let experts: Vec<usize> = match hash {
        Some((table, token, vocab)) => {
            let id = (token as usize).min(vocab - 1);
            table[id * k..(id + 1) * k].iter().map(|&x| x as usize).collect()
        }
        None => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            top_k(&biased, k)
        }
    };
    let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
    let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
    weights.iter_mut().for_each(|w| *w /= sum);
    weights.iter_mut().for_each(|w| *w *= scaling);
    (experts, weights)
}

// ---- V4-Flash: sampling ------------------------------------------------------
// The engine's `sampling::sample(..).token` (engine/src/sampling.rs): its
// `uniform`, `sanitize`, `argmax`, `rank`, `best_ranked`, `filtered_weights`
// and `draw`, copied.

pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub fn uniform(seed: u64, position: u64) -> f64 {
    let start = mix64(seed ^ 0x5a3d_1f0c_8e6b_2497);
    let bits = mix64(start.wrapping_add(position.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

pub fn sanitize(logits: &[f32]) -> Vec<f64> {
    let any_pos_inf = logits.contains(&f32::INFINITY);
    logits
        .iter()
        .map(|&l| {
            if l.is_nan() {
                f64::NEG_INFINITY
            } else if any_pos_inf {
                if l == f32::INFINITY {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            } else {
                f64::from(l)
            }
        })
        .collect()
}

pub fn rank(x: &[f64], a: u32, b: u32) -> std::cmp::Ordering {
    let (la, lb) = (x[a as usize], x[b as usize]);
    lb.partial_cmp(&la).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
}

pub fn best_ranked(x: &[f64], mut ids: Vec<u32>, n: usize) -> Vec<u32> {
    if n == 0 {
        return Vec::new();
    }
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, |&a, &b| rank(x, a, b));
        ids.truncate(n);
    }
    ids.sort_unstable_by(|&a, &b| rank(x, a, b));
    ids
}

pub fn argmax(x: &[f64]) -> u32 {
    let mut best = 0;
    for (id, &l) in x.iter().enumerate() {
        if l > x[best] {
            best = id;
        }
    }
    best as u32
}

#[allow(dead_code)]
pub fn cpu_sample(logits: &[f32], p: &SampleRow) -> u32 {
    let x = sanitize(logits);
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return 0;
    }
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return argmax(&x);
    }
    // filtered_weights
    let temperature = f64::from(p.temperature);
    let weights: Vec<f64> =
        x.iter().map(|&l| if l == f64::NEG_INFINITY { 0.0 } else { ((l - max) / temperature).exp() }).collect();
    let floor = f64::from(p.min_p);
    let mut kept: Vec<u32> =
        (0..x.len() as u32).filter(|&id| weights[id as usize] > 0.0 && weights[id as usize] >= floor).collect();
    let mut reordered = false;
    if p.top_k > 0 && p.top_k < kept.len() {
        kept = best_ranked(&x, kept, p.top_k);
        reordered = true;
    }
    let top_p = f64::from(p.top_p);
    if top_p < 1.0 {
        if !reordered {
            kept.sort_unstable_by(|&a, &b| rank(&x, a, b));
        }
        let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
        let threshold = top_p * total;
        let (mut mass, mut len) = (0.0, 0);
        for &id in &kept {
            if len > 0 && mass >= threshold {
                break;
            }
            mass += weights[id as usize];
            len += 1;
        }
        kept.truncate(len);
        reordered = true;
    }
    if reordered {
        kept.sort_unstable();
    }
    // draw
    let total: f64 = kept.iter().map(|&id| weights[id as usize]).sum();
    let target = uniform(p.seed, p.position) * total;
    let mut cumulative = 0.0;
    for &id in &kept {
        cumulative += weights[id as usize];
        if cumulative > target {
            return id;
        }
    }
    kept.last().copied().unwrap_or_else(|| argmax(&x))
}
