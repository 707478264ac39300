//! V4.1-Flash's compressor (ratio 2), indexer (32 heads × 128, top 512 of
//! 2048 candidate blocks), sparse attention (64 heads × 512 over a 128
//! window and 512 entries) and MoE (384 experts top-6, DSpark's 128 top-3,
//! SwiGLU at 2304, combine at 5120) on the device at the shapes a GPU runs,
//! against the CPU definitions the per-op tests use, bit for bit (see
//! `real_shapes_v4.rs`; the CPU references are in `shapes_support/v41.rs`).
//! Each test prints its wall time (`-- --nocapture`).

mod shapes_support;

use deepinfer_cuda::ops::v41_model::{
    self, candidate_blocks, compress_pool, index_scores, moe_combine, sparse_attention, swiglu, Chosen, IndexSpan,
    ScoreSqrt, Window,
};
use deepinfer_cuda::test_gpu;
use deepinfer_kernels::act_quant::round_bf16;
use shapes_support::v41::{
    candidate_blocks_cpu, top_k_stable, v41_index_scores_cpu, v41_route_cpu, v41_silu, v41_softmax,
    v41_sparse_attention_cpu, v41_sum,
};
use shapes_support::{
    assert_bits, Gen, Timer, HEADS, HEAD_DIM, INDEX_HEAD_DIM, INDEX_TOPK, V41_HIDDEN, V41_INDEX_HEADS, WINDOW,
};

// ---- V4.1-Flash: compressor, indexer, attention -------------------------------

#[test]
fn v41_compressor_pool_of_ratio_2_at_512() {
    let _t = Timer::start("v4.1 compressor");
    let gpu = test_gpu();
    let mut g = Gen(25);
    let (groups, ratio, hd) = (3, 2, HEAD_DIM);
    let kv = g.vec(groups * ratio * hd, 2.0);
    let score = g.vec(groups * ratio * hd, 6.0);
    let (kd, sd, out) = (gpu.upload(&kv).unwrap(), gpu.upload(&score).unwrap(), gpu.zeros::<f32>(groups * hd).unwrap());
    compress_pool(&gpu, &kd, &sd, groups, ratio, hd, &out).unwrap();
    // attention::compress's pooling of one closed group.
    let mut want = vec![0.0f32; groups * hd];
    for gi in 0..groups {
        for ch in 0..hd {
            let s: Vec<f32> = (0..ratio).map(|i| score[(gi * ratio + i) * hd + ch]).collect();
            let w = v41_softmax(&s);
            want[gi * hd + ch] = round_bf16(v41_sum((0..ratio).map(|i| kv[(gi * ratio + i) * hd + ch] * w[i])));
        }
    }
    assert_bits(&gpu.download(&out).unwrap(), &want, "compress_pool ratio 2 x 512");
}

#[test]
fn v41_indexer_32_heads_of_128_top_512_with_2048_candidate_blocks() {
    let _t = Timer::start("v4.1 indexer");
    let gpu = test_gpu();
    let mut g = Gen(26);
    let (ih, ihd, topk, size, topk_blocks) = (V41_INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK, 8, 2048);
    // Keys on a coarse grid so that scores tie; 20001 entries = 2501 blocks
    // of 8, more than the 2048 candidate blocks kept.
    let entries = 20_001;
    let keys: Vec<f32> = (0..entries * ihd).map(|_| round_bf16((g.below(9) as f32 - 4.0) * 0.25)).collect();
    let kd = gpu.upload(&keys).unwrap();
    let (ratio, start, len) = (1usize, 19_999usize, 2usize);
    let span = IndexSpan { start, len, ratio };
    let stride = span.max_width();
    let q = g.bf16(len * ih * ihd);
    let w: Vec<f32> = g.vec(len * ih, 0.1).iter().map(|&v| round_bf16(v)).collect();
    let (qd, wd) = (gpu.upload(&q).unwrap(), gpu.upload(&w).unwrap());
    // The candidate source: its scores, then the blocks it keeps.
    let scores = gpu.upload(&vec![f32::NAN; len * stride]).unwrap();
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, None, &scores, stride).unwrap();
    let got_scores = gpu.download(&scores).unwrap();
    let cands = candidate_blocks(&gpu, &scores, stride, span, size, topk_blocks).unwrap();
    let (mask, mask_len) = (gpu.download(&cands.keep).unwrap(), gpu.download(&cands.keep_len).unwrap());
    let mut keeps = Vec::new();
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let want = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        assert_bits(&got_scores[t * stride..][..width], &want, &format!("index scores of query {t}"));
        let keep = candidate_blocks_cpu(&want, visible, size, topk_blocks);
        assert!(keep.iter().filter(|&&k| !k).count() > 0, "some blocks are not candidates");
        assert_eq!(mask_len[t] as usize, width);
        let got: Vec<bool> = mask[t * cands.stride..][..width].iter().map(|&k| k != 0).collect();
        assert_eq!(got, keep, "candidate blocks of query {t}");
        keeps.push(keep);
    }
    // A consumer at the same span (new queries): scores masked by the
    // candidates, then the top 512, ascending.
    let q = g.bf16(len * ih * ihd);
    let w: Vec<f32> = g.vec(len * ih, 0.1).iter().map(|&v| round_bf16(v)).collect();
    let (qd, wd) = (gpu.upload(&q).unwrap(), gpu.upload(&w).unwrap());
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, Some(&cands), &scores, stride).unwrap();
    let (selected, counts) = (gpu.zeros::<i32>(len * topk).unwrap(), gpu.zeros::<i32>(len).unwrap());
    v41_model::index_topk(&gpu, &scores, stride, span, topk, &selected, &counts).unwrap();
    let (selected, counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let mut scores = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        scores.iter_mut().zip(&keeps[t]).filter(|(_, &k)| !k).for_each(|(s, _)| *s = f32::NEG_INFINITY);
        let mut want: Vec<usize> =
            top_k_stable(&scores, topk.min(width)).into_iter().filter(|&j| j < visible).collect();
        want.sort_unstable();
        let got: Vec<usize> = selected[t * topk..][..counts[t] as usize].iter().map(|&j| j as usize).collect();
        assert_eq!(got, want, "consumer top {topk} of query {t}");
    }
    // An encoder layer (ratio 2): 1000 and 1001 entries, the top 512.
    let (ratio, start) = (2usize, 1999usize);
    let span = IndexSpan { start, len, ratio };
    let stride = span.max_width();
    index_scores(&gpu, &kd, &qd, &wd, ih, ihd, span, None, &scores, stride).unwrap();
    let (selected, counts) = (gpu.zeros::<i32>(len * topk).unwrap(), gpu.zeros::<i32>(len).unwrap());
    v41_model::index_topk(&gpu, &scores, stride, span, topk, &selected, &counts).unwrap();
    let (selected, counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for t in 0..len {
        let (width, visible) = ((start + t + 1) / ratio, (start + t + 1) / ratio);
        let scores = v41_index_scores_cpu(
            &keys,
            &q[t * ih * ihd..(t + 1) * ih * ihd],
            &w[t * ih..(t + 1) * ih],
            ih,
            ihd,
            width,
            visible,
        );
        let mut want: Vec<usize> =
            top_k_stable(&scores, topk.min(width)).into_iter().filter(|&j| j < visible).collect();
        want.sort_unstable();
        let got: Vec<usize> = selected[t * topk..][..counts[t] as usize].iter().map(|&j| j as usize).collect();
        assert_eq!(got, want, "ratio 2 top {topk} of query {t}");
    }
}

#[test]
fn v41_sparse_attention_64_heads_of_512_over_a_128_window_and_512_entries() {
    let _t = Timer::start("v4.1 attention");
    let gpu = test_gpu();
    let mut g = Gen(27);
    let (heads, hd) = (HEADS, HEAD_DIM);
    let scale = (hd as f64).powf(-0.5) as f32;
    let sink = g.vec(heads, 2.0);
    let sd = gpu.upload(&sink).unwrap();
    let n_entries = 2000;
    let entries = g.bf16(n_entries * hd);
    let ed = gpu.upload(&entries).unwrap();
    // (start, len, chosen per query): a decode step deep in a sequence with
    // 512 entries each, and a chunk that starts the sequence with none.
    for (start, len, chosen) in [(2000usize, 2usize, INDEX_TOPK), (0, 3, 0)] {
        let base = start.saturating_sub(WINDOW);
        let rows = start + len - base;
        let window_keys = g.bf16(rows * hd);
        let q = g.bf16(len * heads * hd);
        let selection: Vec<Vec<usize>> = (0..len)
            .map(|_| {
                let mut s: Vec<usize> = Vec::new();
                while s.len() < chosen {
                    let j = g.below(n_entries);
                    if !s.contains(&j) {
                        s.push(j);
                    }
                }
                s.sort_unstable();
                s
            })
            .collect();
        let mut want = vec![0.0f32; len * heads * hd];
        for t in 0..len {
            // attention::attend_projected's key list.
            let p = start + t;
            let oldest = (p + 1).saturating_sub(WINDOW);
            let row = |pos: usize| Some(&window_keys[(pos - base) * hd..(pos - base + 1) * hd]);
            let mut keys: Vec<Option<&[f32]>> = Vec::new();
            if start == 0 {
                keys.extend((oldest..=p).map(row));
                keys.resize(len.min(WINDOW), None);
            } else {
                keys.resize(WINDOW - (p + 1 - oldest), None);
                keys.extend((oldest..=p).map(row));
            }
            keys.extend(selection[t].iter().map(|&j| Some(&entries[j * hd..(j + 1) * hd])));
            v41_sparse_attention_cpu(
                &q[t * heads * hd..(t + 1) * heads * hd],
                &keys,
                &sink,
                scale,
                &mut want[t * heads * hd..(t + 1) * heads * hd],
            );
        }
        let (qd, kd) = (gpu.upload(&q).unwrap(), gpu.upload(&window_keys).unwrap());
        let stride = chosen.max(1);
        let mut sel = vec![-1i32; len * stride];
        for (t, s) in selection.iter().enumerate() {
            for (i, &j) in s.iter().enumerate() {
                sel[t * stride + i] = j as i32;
            }
        }
        let (seld, cd) = (gpu.upload(&sel).unwrap(), gpu.upload(&vec![chosen as i32; len]).unwrap());
        let out = gpu.upload(&vec![f32::NAN; len * heads * hd]).unwrap();
        let window = Window { keys: &kd, base, start, len, win: WINDOW };
        let chosen_entries = (chosen > 0).then_some(Chosen { entries: &ed, selected: &seld, counts: &cd, stride });
        sparse_attention(&gpu, &qd, heads, hd, window, chosen_entries, &sd, scale, &out).unwrap();
        assert_bits(
            &gpu.download(&out).unwrap(),
            &want,
            &format!("sparse_attention at {start} x {len}, {chosen} chosen"),
        );
    }
}

// ---- V4.1-Flash: MoE ---------------------------------------------------------

#[test]
fn v41_moe_route_384_top_6_and_dspark_128_top_3_swiglu_2304_combine_5120() {
    let _t = Timer::start("v4.1 MoE");
    let gpu = test_gpu();
    let mut g = Gen(28);
    let n = 4;
    // 384 routed experts top-6 (the main model), 128 top-3 (DSpark's draft layers).
    for (e, k) in [(384usize, 6usize), (128, 3)] {
        // Softplus outputs on a coarse grid (ties), their square roots the scores.
        let raw: Vec<f32> = (0..n * e).map(|_| (1 + g.below(12)) as f32 * 0.125).collect();
        let bias: Vec<f32> = (0..e).map(|_| g.below(4) as f32 * 0.03125).collect();
        let (s, b) = (gpu.upload(&raw).unwrap(), gpu.upload(&bias).unwrap());
        let (experts, weights) = (gpu.zeros::<i32>(n * k).unwrap(), gpu.zeros::<f32>(n * k).unwrap());
        v41_model::route(&gpu, &s, &b, n, e, k, ScoreSqrt::Yes, true, 1.5, &experts, &weights).unwrap();
        let (experts, weights) = (gpu.download(&experts).unwrap(), gpu.download(&weights).unwrap());
        for t in 0..n {
            let (want_e, want_w) = v41_route_cpu(&raw[t * e..(t + 1) * e], &bias, k, true, 1.5);
            let got_e: Vec<usize> = experts[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
            assert_eq!(got_e, want_e, "{e} experts top {k}: token {t}");
            assert_bits(&weights[t * k..(t + 1) * k], &want_w, &format!("{e} experts top {k}: token {t}'s weights"));
        }
    }
    // The routed rows' activation: 6 rows of 2304, clamped at 10, weighted.
    let (rows, inter, limit) = (6, 2304, 10.0f32);
    let gate = g.vec(rows * inter, 30.0);
    let up = g.vec(rows * inter, 30.0);
    let w = g.vec(rows, 1.0);
    let (gd, ud, wd) = (gpu.upload(&gate).unwrap(), gpu.upload(&up).unwrap(), gpu.upload(&w).unwrap());
    swiglu(&gpu, &gd, &ud, Some(&wd), rows, inter, limit).unwrap();
    let want: Vec<f32> = (0..rows * inter)
        .map(|i| round_bf16(w[i / inter] * (v41_silu(gate[i].min(limit)) * up[i].clamp(-limit, limit))))
        .collect();
    assert_bits(&gpu.download(&gd).unwrap(), &want, "swiglu 6 x 2304");
    // combine: 2 tokens × 6 slots of 5120, then the shared expert.
    let (n, k, d) = (2, 6, V41_HIDDEN);
    let mut experts: Vec<i32> = (0..n * k).map(|_| g.below(384) as i32).collect();
    experts[2] = experts[4];
    let routed = g.bf16(n * k * d);
    let shared = g.bf16(n * d);
    let (rd, ed, sd) = (gpu.upload(&routed).unwrap(), gpu.upload(&experts).unwrap(), gpu.upload(&shared).unwrap());
    let out = gpu.zeros::<f32>(n * d).unwrap();
    moe_combine(&gpu, &rd, &ed, &sd, n, k, d, &out).unwrap();
    let mut want = vec![0.0f32; n * d];
    for (t, row) in want.chunks_exact_mut(d).enumerate() {
        let mut order: Vec<usize> = (0..k).collect();
        order.sort_by_key(|&slot| (experts[t * k + slot], slot));
        for slot in order {
            row.iter_mut().zip(&routed[(t * k + slot) * d..][..d]).for_each(|(a, b)| *a += b);
        }
        row.iter_mut().zip(&shared[t * d..(t + 1) * d]).for_each(|(a, b)| *a = round_bf16(*a + b));
    }
    assert_bits(&gpu.download(&out).unwrap(), &want, "moe_combine 2 x 6 x 5120");
}
