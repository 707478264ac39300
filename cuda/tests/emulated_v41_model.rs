//! The V4.1 model kernels whose control flow is their own (`v41_model.cu`, `v41_indexer.cu`)
//! against faithful copies of the engine's definitions (the engine crate is
//! not a dependency of this one): the indexer's top-k (`ops::top_k_stable`,
//! then ascending and cut at the visible entries, `attention::choose`), the
//! candidate blocks (`attention::candidate_blocks`) and the router
//! (`ffn::route` after its score function), bit for bit on the emulated
//! device, over widths 1 to 300 with many equal scores. The arithmetic of
//! the whole pass is held to the CPU engine's bits end to end by
//! `tests/device.rs` and `engine/tests/oracle_v41.rs`.

use deepinfer_cuda::ops::v41_model::{candidate_blocks, index_topk, route, IndexSpan, ScoreSqrt};
use deepinfer_cuda::test_gpu;

/// Deterministic values with many ties (a few distinct bf16-like levels, ±0, -inf).
fn scores(len: usize, seed: u64) -> Vec<f32> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 11 {
                0 => f32::NEG_INFINITY,
                1 => -0.0,
                2 => 0.0,
                _ => ((x >> 8) % 9) as f32 * 0.25 - 1.0,
            }
        })
        .collect()
}

/// `engine/src/v41/ops.rs` `top_k_stable`.
fn top_k_stable(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| {
        let (x, y) = (values[a], values[b]);
        y.partial_cmp(&x).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// `attention::candidate_blocks`.
fn candidate_blocks_cpu(scores: &[f32], visible: usize, size: usize, topk_blocks: usize) -> Vec<bool> {
    let blocks = scores.len().div_ceil(size);
    let mut best: Vec<f32> = (0..blocks)
        .map(|b| scores[b * size..((b + 1) * size).min(scores.len())].iter().fold(f32::NEG_INFINITY, |a, &s| a.max(s)))
        .collect();
    if visible > 0 {
        best[(visible - 1) / size] = f32::INFINITY;
    }
    let mut keep = vec![false; scores.len()];
    for b in top_k_stable(&best, topk_blocks.min(blocks)) {
        if best[b] > f32::NEG_INFINITY {
            keep[b * size..((b + 1) * size).min(scores.len())].iter_mut().for_each(|k| *k = true);
        }
    }
    keep
}

fn width(span: IndexSpan, t: usize) -> usize {
    if span.start == 0 {
        span.len / span.ratio
    } else {
        (span.start + t + 1) / span.ratio
    }
}

#[test]
fn index_topk_and_candidate_blocks_are_the_cpus() {
    let gpu = test_gpu();
    for (start, len, ratio, topk) in [
        (0, 1, 1, 4),
        (0, 7, 1, 3),
        (0, 17, 2, 16),
        (5, 3, 1, 2),
        (40, 1, 1, 7),
        (100, 9, 4, 16),
        (0, 300, 1, 64),
        (290, 4, 2, 100),
    ] {
        let span = IndexSpan { start, len, ratio };
        let stride = span.max_width().max(1);
        let mut host = vec![f32::NAN; len * stride];
        for t in 0..len {
            let w = width(span, t);
            host[t * stride..t * stride + w].copy_from_slice(&scores(w, (start * 31 + t) as u64 + 7));
        }
        let dev = gpu.upload(&host).unwrap();
        let selected = gpu.zeros::<i32>(len * topk).unwrap();
        let counts = gpu.zeros::<i32>(len).unwrap();
        index_topk(&gpu, &dev, stride, span, topk, &selected, &counts).unwrap();
        let (selected, counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
        let keep = candidate_blocks(&gpu, &dev, stride, span, 8, 3).unwrap();
        let (mask, mask_len) = (gpu.download(&keep.keep).unwrap(), gpu.download(&keep.keep_len).unwrap());
        for t in 0..len {
            let w = width(span, t);
            let row = &host[t * stride..t * stride + w];
            let visible = (start + t + 1) / ratio;
            let mut want: Vec<usize> = top_k_stable(row, topk.min(w)).into_iter().filter(|&j| j < visible).collect();
            want.sort_unstable();
            let got: Vec<usize> =
                selected[t * topk..t * topk + counts[t] as usize].iter().map(|&j| j as usize).collect();
            assert_eq!(got, want, "span {start}+{len} ratio {ratio} top {topk}: query {t}");
            let want_keep = candidate_blocks_cpu(row, visible, 8, 3);
            let got_keep: Vec<bool> = mask[t * keep.stride..t * keep.stride + w].iter().map(|&k| k != 0).collect();
            assert_eq!(mask_len[t] as usize, w);
            assert_eq!(got_keep, want_keep, "span {start}+{len} ratio {ratio}: candidates of query {t}");
        }
    }
}

/// `ffn::route` after the score function (`sqrt`: SqrtSoftplus's square root).
fn route_cpu(scores: &[f32], bias: &[f32], k: usize, sqrt: bool, norm: bool, scale: f32) -> (Vec<usize>, Vec<f32>) {
    let scores: Vec<f32> = scores.iter().map(|&s| if sqrt { s.sqrt() } else { s }).collect();
    let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let experts = top_k_stable(&biased, k);
    let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
    if norm && k > 1 {
        let sum = weights.iter().map(|&w| w as f64).sum::<f64>() as f32 + 1e-20;
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= scale);
    (experts, weights)
}

#[test]
fn route_is_the_cpus() {
    let gpu = test_gpu();
    for (n, e, k, sqrt, norm) in
        [(1, 8, 2, true, true), (7, 17, 3, false, true), (17, 16, 1, true, false), (5, 100, 6, false, false)]
    {
        let raw: Vec<f32> =
            scores(n * e, 99 + e as u64).iter().map(|v| if v.is_finite() { v.abs() + 0.1 } else { 0.5 }).collect();
        let bias: Vec<f32> = scores(e, 5).iter().map(|v| if v.is_finite() { *v * 0.125 } else { 0.0 }).collect();
        let (s, b) = (gpu.upload(&raw).unwrap(), gpu.upload(&bias).unwrap());
        let (experts, weights) = (gpu.zeros::<i32>(n * k).unwrap(), gpu.zeros::<f32>(n * k).unwrap());
        let root = if sqrt { ScoreSqrt::Yes } else { ScoreSqrt::No };
        route(&gpu, &s, &b, n, e, k, root, norm, 1.5, &experts, &weights).unwrap();
        let (experts, weights) = (gpu.download(&experts).unwrap(), gpu.download(&weights).unwrap());
        for t in 0..n {
            let (want_e, want_w) = route_cpu(&raw[t * e..(t + 1) * e], &bias, k, sqrt, norm, 1.5);
            let got_e: Vec<usize> = experts[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
            assert_eq!(got_e, want_e, "{n} x {e} top {k}: token {t}");
            let bits = |w: &[f32]| w.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&weights[t * k..(t + 1) * k]), bits(&want_w), "{n} x {e} top {k}: token {t}'s weights");
        }
    }
}
