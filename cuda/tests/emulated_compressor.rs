//! The device's KV compressors (`cuda/kernels/compressor.cu`) against the
//! engine's `compress_token`, bit for bit: entries and the pending/overlap
//! state after every chunk, whatever the chunks.

use deepinfer_cuda::ops::compressor::{compress_tokens, CompressorSlots, CompressorSnapshot, DeviceCompressor};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::{DeviceError, Gpu};
use deepinfer_kernels::ops::{rms_norm, rope_interleaved, Rope, Yarn};
use deepinfer_kernels::pooling::softmax_pool_columns;

/// The engine's `Compressor` less its projections (engine/src/model/weights.rs).
struct Compressor {
    ape: Vec<f32>,
    norm: Vec<f32>,
    ratio: usize,
    dim: usize,
    overlap: bool,
}

impl Compressor {
    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

/// The engine's `CompressorState` less its draft mark (engine/src/model/state.rs).
#[derive(Clone, Debug, Default)]
struct CompressorState {
    entries: Vec<f32>,
    pending_kv: Vec<f32>,
    pending_gate: Vec<f32>,
    overlap_kv: Option<Vec<f32>>,
    overlap_gate: Option<Vec<f32>>,
}

impl CompressorState {
    fn count(&self, dim: usize) -> usize {
        self.entries.len() / dim
    }
}

/// A copy of the engine's private `compress_token` (engine/src/model/
/// attention.rs), its `Angles::new(rope, &[p]).apply(0, entry)` written out:
/// `rope.cos_sin` at the window's position, `rope_interleaved` on the
/// trailing channels.
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
    // Angles::new(rope, &[window * ratio]).apply(0, &mut entry)
    let half = rope.inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
    if half > 0 {
        rope.cos_sin(window * ratio, &mut cos, &mut sin);
    }
    let tail = entry.len() - 2 * half;
    rope_interleaved(&mut entry[tail..], &cos, &sin);
    st.entries.extend_from_slice(&entry);
}

/// Deterministic values in `[-scale, scale)`.
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The same length and bits, or a panic naming the first difference.
fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: value {i} of {} is {:e}, the CPU's {:e}", got.len(), got[i], want[i]);
    }
}

fn assert_same(got: &CompressorSnapshot, want: &CompressorState, what: &str) {
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

fn yarn() -> Yarn {
    Yarn {
        factor: 16.0,
        original_max_position_embeddings: 4096.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.25,
    }
}

struct Case {
    ratio: usize,
    dim: usize,
    overlap: bool,
    /// Channels the rope rotates (the trailing ones).
    rope_dim: usize,
    yarn: bool,
}

const TOKENS: usize = 300;
const EPS: f32 = 1e-6;

/// Feed `TOKENS` tokens in chunks of `splits` (cycled) on the device and to
/// the CPU copy; compare after every chunk.
fn run_case(gpu: &Gpu, case: &Case, splits: &[usize], seed: u64) {
    let (ratio, dim, overlap) = (case.ratio, case.dim, case.overlap);
    let width = if overlap { 2 * dim } else { dim };
    let cpu = Compressor {
        ape: values(seed + 1, ratio * width, 1.5),
        norm: values(seed + 2, dim, 1.0).iter().map(|v| 1.0 + 0.5 * v).collect(),
        ratio,
        dim,
        overlap,
    };
    let rope = Rope::new(case.rope_dim, 10000.0, case.yarn.then(yarn));
    let dev = DeviceCompressor::new(gpu, ratio, dim, overlap, &cpu.ape, &cpu.norm).unwrap();
    // Rows at a stride past their width, from an offset: the chunk is a view.
    let stride = width + 5;
    let (offset_kv, offset_gate) = (3, 11);
    let kv_host = values(seed + 3, TOKENS * stride + offset_kv, 2.0);
    let gate_host = values(seed + 4, TOKENS * stride + offset_gate, 4.0);
    let kv_buf = gpu.upload(&kv_host).unwrap();
    let gate_buf = gpu.upload(&gate_host).unwrap();
    let mut slots = CompressorSlots::new(gpu, &dev, TOKENS / ratio).unwrap();
    let mut state = CompressorState::default();
    let (mut start, mut chunk) = (0, 0);
    while start < TOKENS {
        let len = splits[chunk % splits.len()].min(TOKENS - start);
        chunk += 1;
        let kv = Rows::new(&kv_buf, offset_kv + start * stride, stride);
        let gate = Rows::new(&gate_buf, offset_gate + start * stride, stride);
        compress_tokens(gpu, &dev, &mut slots, kv, gate, len, start, &rope, EPS).unwrap();
        for t in start..start + len {
            let kv = &kv_host[offset_kv + t * stride..][..width];
            let gate = &gate_host[offset_gate + t * stride..][..width];
            compress_token(&cpu, &mut state, kv, gate, &rope, EPS);
        }
        start += len;
        let what = format!(
            "ratio {ratio} dim {dim} overlap {overlap} rope {} yarn {} splits {splits:?}: after {start} tokens",
            case.rope_dim, case.yarn
        );
        assert_eq!(slots.count(), state.count(dim), "{what}: count");
        assert_same(&slots.download(gpu).unwrap(), &state, &what);
    }
    assert_eq!(slots.count(), TOKENS / ratio);
}

fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for dim in [16, 64] {
        for (ratio, overlap) in [(4, true), (8, true), (16, false), (128, false)] {
            let yarn = (ratio / 4 + dim / 16) % 2 == 0;
            cases.push(Case { ratio, dim, overlap, rope_dim: dim, yarn });
            cases.push(Case { ratio, dim, overlap, rope_dim: dim / 4, yarn: !yarn });
        }
    }
    // An odd dim: one channel before the rotated ones.
    cases.push(Case { ratio: 4, dim: 7, overlap: true, rope_dim: 6, yarn: false });
    cases.push(Case { ratio: 16, dim: 7, overlap: false, rope_dim: 6, yarn: true });
    cases
}

#[test]
fn one_chunk_matches_compress_token_bit_for_bit() {
    let gpu = Gpu::emulated();
    for (i, case) in cases().iter().enumerate() {
        run_case(&gpu, case, &[TOKENS], 100 + i as u64);
    }
}

#[test]
fn split_chunks_match_compress_token_bit_for_bit() {
    let gpu = Gpu::emulated();
    for (i, case) in cases().iter().enumerate() {
        run_case(&gpu, case, &[1, 7, 100, 17, 3, 172], 100 + i as u64);
        // Decoding: one token at a time, then a window's worth at once.
        run_case(&gpu, case, &[1, 1, 1, 2, case.ratio, 1], 100 + i as u64);
    }
}

#[test]
fn a_state_moved_from_the_cpu_carries_on_bit_for_bit() {
    let gpu = Gpu::emulated();
    for (ratio, dim, overlap) in [(4usize, 16usize, true), (16, 64, false)] {
        let width = if overlap { 2 * dim } else { dim };
        let cpu = Compressor { ape: values(7, ratio * width, 1.0), norm: values(8, dim, 1.0), ratio, dim, overlap };
        let rope = Rope::new(dim, 10000.0, Some(yarn()));
        let dev = DeviceCompressor::new(&gpu, ratio, dim, overlap, &cpu.ape, &cpu.norm).unwrap();
        let kv = values(9, 100 * width, 2.0);
        let gate = values(10, 100 * width, 3.0);
        let mut state = CompressorState::default();
        // 41 tokens on the CPU (an open window), the rest on the device.
        for t in 0..41 {
            compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, EPS);
        }
        let overlap_rows = state.overlap_kv.as_deref().zip(state.overlap_gate.as_deref());
        let mut slots = CompressorSlots::upload_from(
            &gpu,
            &dev,
            &state.entries,
            &state.pending_kv,
            &state.pending_gate,
            overlap_rows,
            100 / ratio,
        )
        .unwrap();
        assert_same(&slots.download(&gpu).unwrap(), &state, "uploaded");
        let kv_buf = gpu.upload(&kv[41 * width..]).unwrap();
        let gate_buf = gpu.upload(&gate[41 * width..]).unwrap();
        compress_tokens(
            &gpu,
            &dev,
            &mut slots,
            Rows::packed(&kv_buf, width),
            Rows::packed(&gate_buf, width),
            59,
            41,
            &rope,
            EPS,
        )
        .unwrap();
        for t in 41..100 {
            compress_token(&cpu, &mut state, &kv[t * width..][..width], &gate[t * width..][..width], &rope, EPS);
        }
        assert_same(&slots.download(&gpu).unwrap(), &state, &format!("ratio {ratio} moved"));
    }
}

#[test]
fn passing_the_capacity_is_an_error_that_leaves_the_state() {
    let gpu = Gpu::emulated();
    let (ratio, dim) = (4, 16);
    let dev =
        DeviceCompressor::new(&gpu, ratio, dim, true, &values(1, ratio * 2 * dim, 1.0), &values(2, dim, 1.0)).unwrap();
    let rope = Rope::new(dim, 10000.0, None);
    let kv = gpu.upload(&values(3, 20 * 2 * dim, 1.0)).unwrap();
    let gate = gpu.upload(&values(4, 20 * 2 * dim, 1.0)).unwrap();
    let mut slots = CompressorSlots::new(&gpu, &dev, 2).unwrap();
    let rows = |b| Rows::packed(b, 2 * dim);
    compress_tokens(&gpu, &dev, &mut slots, rows(&kv), rows(&gate), 6, 0, &rope, EPS).unwrap();
    let before = slots.download(&gpu).unwrap();
    assert_eq!((slots.count(), slots.pending()), (1, 2));
    // 6 + 6 tokens would close a third window.
    let err = compress_tokens(&gpu, &dev, &mut slots, rows(&kv), rows(&gate), 6, 6, &rope, EPS).unwrap_err();
    assert!(matches!(err, DeviceError::BadLaunch { .. }), "{err}");
    assert_eq!(slots.download(&gpu).unwrap(), before);
    compress_tokens(&gpu, &dev, &mut slots, rows(&kv), rows(&gate), 5, 6, &rope, EPS).unwrap();
    assert_eq!((slots.count(), slots.pending()), (2, 3));
}
