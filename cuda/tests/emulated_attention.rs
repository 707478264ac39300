//! The attention core on the emulated device against the CPU, bit for bit.
//!
//! `index_scores` and `attend_token` are private to the engine
//! (`engine/src/model/attention.rs`); the CPU references `cpu_index_topk`
//! and `cpu_attend` are the faithful copies of their per-query loops that
//! the real-shape tests use too (`shapes_support::v4`).

mod shapes_support;

use deepinfer_cuda::ops::attention::{attend, index_topk, Selection};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::ops::Rope;
use shapes_support::v4::{cpu_attend, cpu_index_topk};

/// A small deterministic generator of values in [-1, 1).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Device `index_topk`, checked against the CPU; returns the device's selection and counts.
#[allow(clippy::too_many_arguments)]
fn check_index_topk(
    gpu: &Gpu,
    iq: &[f32],
    iw: &[f32],
    ih: usize,
    ihd: usize,
    entries: &[f32],
    position: usize,
    len: usize,
    ratio: usize,
    topk: usize,
) -> (deepinfer_cuda::DeviceBuffer<i32>, deepinfer_cuda::DeviceBuffer<i32>, Vec<Vec<usize>>) {
    let expect = cpu_index_topk(iq, iw, ih, ihd, entries, position, len, ratio, topk);
    let (iqd, iwd, ed) = (gpu.upload(iq).unwrap(), gpu.upload(iw).unwrap(), gpu.upload(entries).unwrap());
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
    for (i, want) in expect.iter().enumerate() {
        let what = format!("ih {ih} ihd {ihd} position {position} len {len} ratio {ratio} topk {topk}, query {i}");
        assert_eq!(got_counts[i] as usize, want.len(), "{what}: count");
        let row = &got[i * topk..(i + 1) * topk];
        let chosen: Vec<usize> = row[..want.len()].iter().map(|&v| v as usize).collect();
        assert_eq!(&chosen, want, "{what}: selection");
        assert!(row[want.len()..].iter().all(|&v| v == -1), "{what}: unused slots");
    }
    (selected, counts, expect)
}

#[test]
fn index_topk_matches_the_cpu_including_ties() {
    let gpu = Gpu::emulated();
    let mut g = Lcg(1);
    // (ih, ihd, position, len, ratio, topk)
    let cases = [
        (1, 16, 0, 1, 4, 4),
        (4, 16, 0, 37, 4, 3),
        (4, 7, 0, 37, 4, 64),
        (8, 64, 0, 200, 4, 16),
        (2, 17, 130, 1, 4, 8),
        (8, 16, 511, 1, 4, 100),
        (8, 16, 511, 1, 4, 17),
        (2, 32, 4000, 3, 4, 64),
        (3, 16, 60, 20, 128, 2),
        (2, 16, 20, 5, 1, 0),
    ];
    for &(ih, ihd, position, len, ratio, topk) in &cases {
        let count = (position + len) / ratio;
        let iq = g.values(len * ih * ihd);
        let iw = g.values(len * ih);
        // Distinct entries, then entries repeating every 5 (exact ties of
        // non-zero scores), then zero queries (every score exactly 0), and
        // a NaN weight (every score NaN).
        let distinct = g.values(count * ihd);
        let repeating: Vec<f32> = (0..count * ihd).map(|v| distinct[v % (5 * ihd)]).collect();
        check_index_topk(&gpu, &iq, &iw, ih, ihd, &distinct, position, len, ratio, topk);
        check_index_topk(&gpu, &iq, &iw, ih, ihd, &repeating, position, len, ratio, topk);
        let zeros = vec![0.0f32; len * ih * ihd];
        check_index_topk(&gpu, &zeros, &iw, ih, ihd, &distinct, position, len, ratio, topk);
        let mut nan_w = iw.clone();
        nan_w[0] = f32::NAN;
        check_index_topk(&gpu, &iq, &nan_w, ih, ihd, &repeating, position, len, ratio, topk);
        // Negative weights: scores ≤ 0, many exactly -0 or +0.
        let neg_w: Vec<f32> = iw.iter().map(|w| -w.abs()).collect();
        check_index_topk(&gpu, &iq, &neg_w, ih, ihd, &repeating, position, len, ratio, topk);
    }
}

/// What a chunk attends to after its windows.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Window,
    Hca,
    Csa { topk: usize },
}

#[allow(clippy::too_many_arguments)]
fn check_attend(
    gpu: &Gpu,
    g: &mut Lcg,
    h: usize,
    hd: usize,
    rope_dim: usize,
    window: usize,
    position: usize,
    len: usize,
    kind: Kind,
) {
    let ratio = 4;
    // The rows a sequence keeps (window − 1) before the chunk, then the chunk's.
    let cached = position.min(window - 1);
    let first_key_position = position - cached;
    let key_rows = cached + len;
    let keys = g.values(key_rows * hd);
    let q = g.values(len * h * hd);
    let sink: Vec<f32> = g.values(h).iter().map(|v| 2.0 * v).collect();
    let scale = (hd as f32).powf(-0.5);
    let half = rope_dim / 2;
    let rope = Rope::new(rope_dim, 10000.0, None);
    let (mut cos, mut sin) = (vec![0.0f32; len * half], vec![0.0f32; len * half]);
    for i in 0..len {
        rope.cos_sin(position + i, &mut cos[i * half..][..half], &mut sin[i * half..][..half]);
    }
    let n_entries = (position + len) / ratio;
    let entries: Vec<f32> = g.values(n_entries * hd).iter().map(|v| 3.0 * v).collect();

    let (qd, kd, ed, sd) = (
        gpu.upload(&q).unwrap(),
        gpu.upload(&keys).unwrap(),
        gpu.upload(&entries).unwrap(),
        gpu.upload(&sink).unwrap(),
    );
    let (cd, snd) = (gpu.upload(&cos).unwrap(), gpu.upload(&sin).unwrap());
    let out = gpu.upload(&vec![f32::NAN; len * h * hd]).unwrap();
    let what = format!("h {h} hd {hd} rope {rope_dim} window {window} position {position} len {len} {kind:?}");

    let index;
    let (selected, selection) = match kind {
        Kind::Window => (vec![Vec::new(); len], Selection::None),
        Kind::Hca => {
            ((0..len).map(|i| (0..(position + i + 1) / ratio).collect()).collect(), Selection::AllVisible { ratio })
        }
        Kind::Csa { topk } => {
            // The indexer's own queries and entries (ih 2, ihd 16), chosen on the device.
            let (ih, ihd) = (2, 16);
            let iq = g.values(len * ih * ihd);
            let iw = g.values(len * ih);
            let ie: Vec<f32> = (0..n_entries * ihd).map(|v| ((v % (7 * ihd)) as f32 * 0.37).sin()).collect();
            index = check_index_topk(gpu, &iq, &iw, ih, ihd, &ie, position, len, ratio, topk);
            let selection = Selection::Chosen { ratio, selected: &index.0, counts: &index.1, stride: topk };
            (index.2.clone(), selection)
        }
    };
    let expect = cpu_attend(
        &q,
        h,
        hd,
        &keys,
        first_key_position,
        position,
        len,
        window,
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
        window,
        Some(&ed),
        selection,
        &sd,
        scale,
        &cd,
        &snd,
        rope_dim,
        Rows::packed(&out, h * hd),
    )
    .unwrap();
    let got = gpu.download(&out).unwrap();
    for (i, (g, e)) in got.chunks_exact(h * hd).zip(expect.chunks_exact(h * hd)).enumerate() {
        assert_eq!(bits(g), bits(e), "{what}: query {i}");
    }
}

/// (h, hd, rope_dim): every head count with both head sizes and rope widths.
const HEADS: [(usize, usize, usize); 8] =
    [(1, 16, 8), (2, 64, 16), (4, 16, 16), (8, 64, 8), (1, 64, 16), (2, 16, 8), (4, 64, 8), (8, 16, 16)];

#[test]
fn attend_over_the_window_alone_matches_the_cpu() {
    let gpu = Gpu::emulated();
    let mut g = Lcg(2);
    let mut n = 0;
    for window in [4, 8, 128] {
        for (position, len) in [(0, 1), (0, 37), (0, 200), (5, 1), (130, 1), (511, 1)] {
            let (h, hd, rope) = HEADS[n % HEADS.len()];
            n += 1;
            check_attend(&gpu, &mut g, h, hd, rope, window, position, len, Kind::Window);
        }
    }
}

#[test]
fn attend_with_every_visible_entry_matches_the_cpu() {
    let gpu = Gpu::emulated();
    let mut g = Lcg(3);
    let mut n = 3;
    for window in [4, 8, 128] {
        for (position, len) in [(0, 1), (0, 37), (0, 200), (5, 1), (130, 1), (511, 1)] {
            let (h, hd, rope) = HEADS[n % HEADS.len()];
            n += 1;
            check_attend(&gpu, &mut g, h, hd, rope, window, position, len, Kind::Hca);
        }
    }
}

#[test]
fn attend_with_the_indexers_choice_matches_the_cpu() {
    let gpu = Gpu::emulated();
    let mut g = Lcg(4);
    let mut n = 5;
    for window in [4, 8, 128] {
        for (position, len) in [(0, 1), (0, 37), (0, 200), (5, 1), (130, 1), (511, 1)] {
            // topk below and above the visible entries.
            for topk in [3, 64] {
                let (h, hd, rope) = HEADS[n % HEADS.len()];
                n += 1;
                check_attend(&gpu, &mut g, h, hd, rope, window, position, len, Kind::Csa { topk });
            }
        }
    }
}

#[test]
fn every_head_size_and_rope_width_matches_the_cpu() {
    let gpu = Gpu::emulated();
    let mut g = Lcg(5);
    for h in [1, 2, 4, 8] {
        for (hd, rope) in [(16, 8), (16, 16), (64, 8), (64, 16)] {
            check_attend(&gpu, &mut g, h, hd, rope, 8, 17, 7, Kind::Csa { topk: 3 });
            check_attend(&gpu, &mut g, h, hd, rope, 128, 130, 1, Kind::Hca);
        }
    }
}
