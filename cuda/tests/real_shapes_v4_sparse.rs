//! V4-Flash's compressors (CSA ratio 4 with overlap, HCA ratio 128), indexer
//! (64 heads × 128, top 512), attention (64 heads × 512 over a 128 window
//! and the chosen entries) and MoE (256 experts top-6, combine at 4096) on
//! the device at the shapes a GPU runs, with 1 to 4 tokens, against the CPU
//! definitions the per-op tests use, bit for bit (see `real_shapes_v4.rs`;
//! the CPU references are in `shapes_support/v4.rs`).
//! Each test prints its wall time (`-- --nocapture`).

mod shapes_support;

use deepinfer_cuda::ops::attention::{attend, index_topk, Selection};
use deepinfer_cuda::ops::compressor::{compress_tokens, CompressorSlots, CompressorSnapshot, DeviceCompressor};
use deepinfer_cuda::ops::moe::{combine, route, Routing};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::{test_gpu, DeviceBuffer, Gpu};
use deepinfer_kernels::ops::{add_scaled, Rope};
use shapes_support::v4::{compress_token, cpu_attend, cpu_index_topk, cpu_route, Compressor, CompressorState};
use shapes_support::{
    angles, assert_bits, yarn, Gen, Timer, HEADS, HEAD_DIM, INDEX_HEAD_DIM, INDEX_TOPK, ROPE_DIM, V4_HIDDEN,
    V4_INDEX_HEADS, VOCAB, WINDOW,
};

// ---- V4-Flash: compressors ---------------------------------------------------

fn assert_state(got: &CompressorSnapshot, want: &CompressorState, what: &str) {
    assert_bits(&got.entries, &want.entries, &format!("{what}: entries"));
    assert_bits(&got.pending_kv, &want.pending_kv, &format!("{what}: pending kv"));
    assert_bits(&got.pending_gate, &want.pending_gate, &format!("{what}: pending gate"));
    for (name, got, want) in
        [("overlap kv", &got.overlap_kv, &want.overlap_kv), ("overlap gate", &got.overlap_gate, &want.overlap_gate)]
    {
        assert_eq!(got.is_some(), want.is_some(), "{what}: {name} held");
        if let (Some(g), Some(w)) = (got, want) {
            assert_bits(g, w, &format!("{what}: {name}"));
        }
    }
}

#[test]
fn v4_compressors_csa_ratio_4_overlap_and_hca_ratio_128_at_dim_512() {
    let _t = Timer::start("v4 compressors");
    let gpu = test_gpu();
    let mut g = Gen(7);
    let eps = 1e-6;
    // (ratio, dim, overlap, tokens the CPU takes first): the CSA compressor,
    // the indexer's own (dim 128) and the HCA one; decode-sized chunks after.
    for (ratio, dim, overlap, before) in
        [(4, HEAD_DIM, true, 598), (4, INDEX_HEAD_DIM, true, 598), (128, HEAD_DIM, false, 383)]
    {
        let width = if overlap { 2 * dim } else { dim };
        let cpu = Compressor {
            ape: g.vec(ratio * width, 1.5),
            norm: g.vec(dim, 0.5).iter().map(|v| 1.0 + v).collect(),
            ratio,
            dim,
            overlap,
        };
        let rope = Rope::new(ROPE_DIM, 160000.0, Some(yarn()));
        let dev = DeviceCompressor::new(&gpu, ratio, dim, overlap, &cpu.ape, &cpu.norm).unwrap();
        let chunks = [1usize, 3, 4];
        let tokens = before + chunks.iter().sum::<usize>();
        let kv = g.vec(tokens * width, 2.0);
        let gate = g.vec(tokens * width, 4.0);
        let mut state = CompressorState::default();
        for t in 0..before {
            compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, eps);
        }
        let overlap_rows = state.overlap_kv.as_deref().zip(state.overlap_gate.as_deref());
        let capacity = tokens / ratio;
        let mut slots = CompressorSlots::upload_from(
            &gpu,
            &dev,
            &state.entries,
            &state.pending_kv,
            &state.pending_gate,
            overlap_rows,
            capacity,
        )
        .unwrap();
        let (kv_d, gate_d) = (gpu.upload(&kv).unwrap(), gpu.upload(&gate).unwrap());
        let mut start = before;
        for len in chunks {
            let rows = |b| Rows::new(b, start * width, width);
            compress_tokens(&gpu, &dev, &mut slots, rows(&kv_d), rows(&gate_d), len, start, &rope, eps).unwrap();
            for t in start..start + len {
                compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, eps);
            }
            start += len;
            let what = format!("compressor ratio {ratio} dim {dim} overlap {overlap} after {start} tokens");
            assert_eq!(slots.count(), state.entries.len() / dim, "{what}: entries");
            assert_state(&slots.download(&gpu).unwrap(), &state, &what);
        }
    }
}

// ---- V4-Flash: the indexer and the attention ---------------------------------

/// The device's `index_topk` of `len` queries from `position` over
/// `entries` (64 heads × 128), checked against the CPU's selection; returns
/// the device's buffers and the selection.
fn check_v4_index_topk(
    gpu: &Gpu,
    g: &mut Gen,
    entries: &[f32],
    position: usize,
    len: usize,
) -> (DeviceBuffer<i32>, DeviceBuffer<i32>, Vec<Vec<usize>>) {
    let (ih, ihd, ratio, topk) = (V4_INDEX_HEADS, INDEX_HEAD_DIM, 4, INDEX_TOPK);
    let iq = g.vec(len * ih * ihd, 1.0);
    let iw = g.vec(len * ih, 0.125);
    let want = cpu_index_topk(&iq, &iw, ih, ihd, entries, position, len, ratio, topk);
    let (iqd, iwd, ed) = (gpu.upload(&iq).unwrap(), gpu.upload(&iw).unwrap(), gpu.upload(entries).unwrap());
    let selected = gpu.upload(&vec![7i32; len * topk]).unwrap();
    let counts = gpu.upload(&vec![-7i32; len]).unwrap();
    index_topk(
        gpu,
        Rows::packed(&iqd, ih * ihd),
        Rows::packed(&iwd, ih),
        ih,
        ihd,
        &ed,
        position,
        len,
        ratio,
        topk,
        &selected,
        &counts,
    )
    .unwrap();
    let (got, got_counts) = (gpu.download(&selected).unwrap(), gpu.download(&counts).unwrap());
    for (i, want) in want.iter().enumerate() {
        let what = format!("index_topk at {position} query {i} (visible {})", (position + i + 1) / ratio);
        assert_eq!(got_counts[i] as usize, want.len(), "{what}: count");
        let chosen: Vec<usize> = got[i * topk..][..want.len()].iter().map(|&v| v as usize).collect();
        assert_eq!(&chosen, want, "{what}: selection");
        assert!(got[i * topk + want.len()..(i + 1) * topk].iter().all(|&v| v == -1), "{what}: unused slots");
    }
    (selected, counts, want)
}

#[test]
fn v4_indexer_top_512_of_600_to_2000_entries_with_64_heads_of_128() {
    let _t = Timer::start("v4 indexer");
    let gpu = test_gpu();
    let mut g = Gen(8);
    // Visible entries 600..601 and 1999..2000; distinct entries, then entries
    // repeating every 5 rows (exact ties of the scores).
    for (position, len) in [(2399usize, 2usize), (7996, 4)] {
        let count = (position + len) / 4;
        let distinct = g.vec(count * INDEX_HEAD_DIM, 1.0);
        check_v4_index_topk(&gpu, &mut g, &distinct, position, len);
        let repeating: Vec<f32> = (0..count * INDEX_HEAD_DIM).map(|v| distinct[v % (5 * INDEX_HEAD_DIM)]).collect();
        check_v4_index_topk(&gpu, &mut g, &repeating, position, len);
    }
}

/// What a chunk attends to after its window.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Window,
    Hca { ratio: usize },
    Csa,
}

fn check_v4_attend(gpu: &Gpu, g: &mut Gen, position: usize, len: usize, kind: Kind) {
    let (h, hd) = (HEADS, HEAD_DIM);
    let half = ROPE_DIM / 2;
    let cached = position.min(WINDOW - 1);
    let first_key_position = position - cached;
    let keys = g.vec((cached + len) * hd, 1.0);
    let q = g.vec(len * h * hd, 1.0);
    let sink = g.vec(h, 2.0);
    let scale = (hd as f32).powf(-0.5);
    let rope = Rope::new(ROPE_DIM, 160000.0, Some(yarn()));
    let (cos, sin) = angles(&rope, &(position..position + len).collect::<Vec<_>>());
    let ratio = match kind {
        Kind::Hca { ratio } => ratio,
        _ => 4,
    };
    let n_entries = (position + len) / ratio;
    let entries = g.vec(n_entries * hd, 3.0);
    let (qd, kd, ed, sd) = (
        gpu.upload(&q).unwrap(),
        gpu.upload(&keys).unwrap(),
        gpu.upload(&entries).unwrap(),
        gpu.upload(&sink).unwrap(),
    );
    let (cd, snd) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
    let out = gpu.upload(&vec![f32::NAN; len * h * hd]).unwrap();
    let index;
    let (selected, selection) = match kind {
        Kind::Window => (vec![Vec::new(); len], Selection::None),
        Kind::Hca { ratio } => {
            ((0..len).map(|i| (0..(position + i + 1) / ratio).collect()).collect(), Selection::AllVisible { ratio })
        }
        Kind::Csa => {
            let index_entries = g.vec(n_entries * INDEX_HEAD_DIM, 1.0);
            index = check_v4_index_topk(gpu, g, &index_entries, position, len);
            assert!(index.2.iter().all(|s| s.len() == INDEX_TOPK), "512 entries chosen");
            let selection = Selection::Chosen { ratio, selected: &index.0, counts: &index.1, stride: INDEX_TOPK };
            (index.2.clone(), selection)
        }
    };
    let want = cpu_attend(
        &q,
        h,
        hd,
        &keys,
        first_key_position,
        position,
        len,
        WINDOW,
        &entries,
        &selected,
        &sink,
        scale,
        &cos,
        &sin,
        half,
    );
    attend(
        gpu,
        Rows::packed(&qd, h * hd),
        h,
        hd,
        &kd,
        first_key_position,
        position,
        len,
        WINDOW,
        Some(&ed),
        selection,
        &sd,
        scale,
        &cd,
        &snd,
        ROPE_DIM,
        Rows::packed(&out, h * hd),
    )
    .unwrap();
    assert_bits(&gpu.download(&out).unwrap(), &want, &format!("attend {kind:?} at {position} x {len}"));
}

#[test]
fn v4_attention_64_heads_of_512_over_a_128_window_and_512_chosen_entries() {
    let _t = Timer::start("v4 attention");
    let gpu = test_gpu();
    let mut g = Gen(9);
    check_v4_attend(&gpu, &mut g, 2399, 2, Kind::Csa);
    check_v4_attend(&gpu, &mut g, 5119, 3, Kind::Hca { ratio: 128 });
    check_v4_attend(&gpu, &mut g, 0, 4, Kind::Window);
    check_v4_attend(&gpu, &mut g, 1000, 1, Kind::Window);
}

// ---- V4-Flash: MoE -----------------------------------------------------------

#[test]
fn v4_routing_256_experts_top_6_by_score_and_by_hash_over_the_vocabulary() {
    let _t = Timer::start("v4 routing");
    let gpu = test_gpu();
    let mut g = Gen(10);
    let (n, e, k) = (4, 256, 6);
    // Logits on a coarse grid (ties), plus the softplus branch above 20.
    let mut logits: Vec<f32> = (0..n * e).map(|_| (g.below(33) as f32 - 16.0) * 0.25).collect();
    logits[5] = 25.0;
    logits[e + 7] = -120.0;
    let bias: Vec<f32> = (0..e).map(|_| g.below(5) as f32 * 0.0625).collect();
    let table: Vec<i32> = (0..VOCAB * k).map(|_| g.below(e) as i32).collect();
    let tokens: Vec<u32> = vec![0, VOCAB as u32 - 1, VOCAB as u32, 77_777];
    let (ld, bd, td, tokd) = (
        gpu.upload(&logits).unwrap(),
        gpu.upload(&bias).unwrap(),
        gpu.upload(&table).unwrap(),
        gpu.upload(&tokens).unwrap(),
    );
    for hash in [false, true] {
        let (experts, weights) = (gpu.zeros::<i32>(n * k).unwrap(), gpu.zeros::<f32>(n * k).unwrap());
        let mode = if hash {
            Routing::Hash { tid2eid: &td, tokens: &tokd, vocab: VOCAB }
        } else {
            Routing::TopK { bias: &bd }
        };
        route(&gpu, &ld, n, e, k, mode, true, 1.5, &experts, &weights).unwrap();
        let (got_e, got_w) = (gpu.download(&experts).unwrap(), gpu.download(&weights).unwrap());
        for t in 0..n {
            let h = hash.then_some((&table[..], tokens[t], VOCAB));
            let (want_e, want_w) = cpu_route(&logits[t * e..(t + 1) * e], h, &bias, k, 1.5);
            let ge: Vec<usize> = got_e[t * k..(t + 1) * k].iter().map(|&x| x as usize).collect();
            assert_eq!(ge, want_e, "experts of token {t}, hash {hash}");
            assert_bits(&got_w[t * k..(t + 1) * k], &want_w, &format!("weights of token {t}, hash {hash}"));
        }
    }
}

#[test]
fn v4_combine_of_6_experts_at_4096() {
    let _t = Timer::start("v4 combine");
    let gpu = test_gpu();
    let mut g = Gen(11);
    let (n, k, d) = (3, 6, V4_HIDDEN);
    // Unsorted experts, one repeated within a token.
    let mut experts: Vec<i32> = (0..n * k).map(|_| g.below(256) as i32).collect();
    experts[3] = experts[1];
    let weights = g.vec(n * k, 1.5);
    let routed = g.vec(n * k * d, 8.0);
    let shared = g.vec(n * d, 3.0);
    let (rd, ed, wd, sd) = (
        gpu.upload(&routed).unwrap(),
        gpu.upload(&experts).unwrap(),
        gpu.upload(&weights).unwrap(),
        gpu.upload(&shared).unwrap(),
    );
    for shared_on in [false, true] {
        let mut want = vec![0.0f32; n * d];
        for (t, o) in want.chunks_exact_mut(d).enumerate() {
            let r = &experts[t * k..(t + 1) * k];
            let mut order: Vec<usize> = (0..k).collect();
            order.sort_by_key(|&slot| (r[slot], slot));
            for slot in order {
                add_scaled(o, weights[t * k + slot], &routed[(t * k + slot) * d..][..d]);
            }
            if shared_on {
                add_scaled(o, 1.0, &shared[t * d..(t + 1) * d]);
            }
        }
        let out = gpu.upload(&vec![f32::NAN; n * d]).unwrap();
        combine(&gpu, &rd, &ed, &wd, shared_on.then(|| Rows::packed(&sd, d)), n, k, d, Rows::packed(&out, d)).unwrap();
        assert_bits(&gpu.download(&out).unwrap(), &want, &format!("combine, shared {shared_on}"));
    }
}
