//! The KV compressors of compressed attention (CSA/HCA) with one sequence's
//! state in device memory (`cuda/kernels/compressor.cu`).
//!
//! The engine's `compress_token` (engine/src/model/attention.rs) fed token by
//! token, on a chunk's projected rows: every window that closes becomes one
//! entry (gated softmax pool over the window's slots, with overlap the
//! previous window's first series first; `rms_norm` with the compressor's
//! weight; interleaved RoPE on the trailing channels at position
//! `window_index * ratio`, cos/sin from [`Rope::cos_sin`] on the host). The
//! CPU's bits.

use deepinfer_kernels::ops::Rope;

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Threads of a compressor block.
const THREADS: u32 = 128;

/// One compressor's weights on the device (the engine's `Compressor` less its
/// projections, which the linear kernels apply before [`compress_tokens`]).
pub struct DeviceCompressor {
    /// Tokens per window (per entry).
    pub ratio: usize,
    /// Channels of an entry.
    pub dim: usize,
    /// Whether each window pools the previous window's first series too
    /// (then every token projects to `2 * dim` channels: the first series,
    /// for the next window, then this window's).
    pub overlap: bool,
    /// Per-slot gate bias, `[ratio, width]`.
    ape: DeviceBuffer<f32>,
    /// The entries' RMSNorm weight, `[dim]`.
    norm: DeviceBuffer<f32>,
}

impl DeviceCompressor {
    /// Upload a compressor's slot bias `ape` (`[ratio, width]`, width =
    /// `dim * (1 + overlap)`) and norm weight (`[dim]`).
    pub fn new(
        gpu: &Gpu,
        ratio: usize,
        dim: usize,
        overlap: bool,
        ape: &[f32],
        norm: &[f32],
    ) -> Result<Self, DeviceError> {
        assert!(ratio > 0 && dim > 0, "a compressor of ratio {ratio} and dim {dim}");
        let width = if overlap { 2 * dim } else { dim };
        assert_eq!(ape.len(), ratio * width, "ape is [ratio {ratio}, width {width}]");
        assert_eq!(norm.len(), dim, "norm is [dim {dim}]");
        assert!(
            ratio * width <= i32::MAX as usize,
            "a window of {ratio} × {width} channels is past the kernels' int indices"
        );
        Ok(Self { ratio, dim, overlap, ape: gpu.upload(ape)?, norm: gpu.upload(norm)? })
    }

    /// Channels each token projects to: `dim`, twice with overlap.
    pub fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }
}

/// One sequence's compressor state in device memory (the engine's
/// `CompressorState`): the open window's projected tokens, the last closed
/// window's first series (with overlap), and the emitted entries.
pub struct CompressorSlots {
    ratio: usize,
    dim: usize,
    width: usize,
    capacity: usize,
    /// `[ratio, width]` each; the first `pending` rows hold the open window.
    pending_kv: DeviceBuffer<f32>,
    pending_gate: DeviceBuffer<f32>,
    /// `[ratio, dim]` each: the last closed window's first series, the gate
    /// with its slot bias; valid when `has_overlap`.
    overlap_kv: DeviceBuffer<f32>,
    overlap_gate: DeviceBuffer<f32>,
    /// `[capacity, dim]`; the first `count` rows are emitted entries.
    entries: DeviceBuffer<f32>,
    pending: usize,
    has_overlap: bool,
    count: usize,
}

/// A [`CompressorSlots`] on the host, shaped like the engine's
/// `CompressorState`: `entries` `[count, dim]`, `pending_kv`/`pending_gate`
/// `[pending, width]`, the overlap `[ratio, dim]` each or none.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressorSnapshot {
    pub entries: Vec<f32>,
    pub pending_kv: Vec<f32>,
    pub pending_gate: Vec<f32>,
    pub overlap_kv: Option<Vec<f32>>,
    pub overlap_gate: Option<Vec<f32>>,
}

fn capacity_error(kernel: &str, needed: usize, capacity: usize) -> DeviceError {
    DeviceError::BadLaunch {
        kernel: kernel.to_string(),
        detail: format!("{needed} compressed entries, the sequence's slots hold {capacity}"),
    }
}

impl CompressorSlots {
    /// An empty state for `c` with room for `capacity_entries` entries.
    pub fn new(gpu: &Gpu, c: &DeviceCompressor, capacity_entries: usize) -> Result<Self, DeviceError> {
        let (ratio, dim, width) = (c.ratio, c.dim, c.width());
        Ok(Self {
            ratio,
            dim,
            width,
            capacity: capacity_entries,
            pending_kv: gpu.zeros(ratio * width)?,
            pending_gate: gpu.zeros(ratio * width)?,
            overlap_kv: gpu.zeros(if c.overlap { ratio * dim } else { 0 })?,
            overlap_gate: gpu.zeros(if c.overlap { ratio * dim } else { 0 })?,
            entries: gpu.zeros(capacity_entries.checked_mul(dim).ok_or(DeviceError::TooLarge(usize::MAX))?)?,
            pending: 0,
            has_overlap: false,
            count: 0,
        })
    }

    /// A state holding a CPU state's contents (the engine's
    /// `CompressorState` fields): `entries` `[n, dim]`, `pending_kv` and
    /// `pending_gate` `[p, width]` with `p < ratio`, the overlap `[ratio,
    /// dim]` each (only for an overlapping compressor); room for `capacity`
    /// entries, an error when `n` is more.
    pub fn upload_from(
        gpu: &Gpu,
        c: &DeviceCompressor,
        entries: &[f32],
        pending_kv: &[f32],
        pending_gate: &[f32],
        overlap: Option<(&[f32], &[f32])>,
        capacity: usize,
    ) -> Result<Self, DeviceError> {
        let (ratio, dim, width) = (c.ratio, c.dim, c.width());
        assert_eq!(entries.len() % dim, 0, "entries of {} values are not rows of dim {dim}", entries.len());
        assert_eq!(pending_kv.len(), pending_gate.len(), "pending kv and gate hold different token counts");
        assert_eq!(
            pending_kv.len() % width,
            0,
            "pending rows of {} values are not rows of width {width}",
            pending_kv.len()
        );
        let pending = pending_kv.len() / width;
        assert!(pending < ratio, "{pending} pending tokens: a window of {ratio} closes at {ratio}");
        let count = entries.len() / dim;
        if count > capacity {
            return Err(capacity_error("compressor_windows", count, capacity));
        }
        let mut st = Self::new(gpu, c, capacity)?;
        gpu.write(&st.entries, 0, entries)?;
        gpu.write(&st.pending_kv, 0, pending_kv)?;
        gpu.write(&st.pending_gate, 0, pending_gate)?;
        if let Some((ok, og)) = overlap {
            assert!(c.overlap, "an overlap for a compressor without overlap");
            assert!(
                ok.len() == ratio * dim && og.len() == ratio * dim,
                "the overlap is [ratio {ratio}, dim {dim}] each"
            );
            gpu.write(&st.overlap_kv, 0, ok)?;
            gpu.write(&st.overlap_gate, 0, og)?;
            st.has_overlap = true;
        }
        st.pending = pending;
        st.count = count;
        Ok(st)
    }

    /// The entries, `[capacity, dim]`: the first [`Self::count`] rows are emitted.
    /// Room for `capacity` entries (at least the current count), the
    /// entries copied on the device.
    pub fn grow(&mut self, gpu: &Gpu, capacity: usize) -> Result<(), DeviceError> {
        if capacity <= self.capacity {
            return Ok(());
        }
        let entries = gpu.zeros::<f32>(capacity * self.dim)?;
        gpu.copy(&self.entries, 0, &entries, 0, self.count * self.dim)?;
        self.entries = entries;
        self.capacity = capacity;
        Ok(())
    }

    pub fn entries(&self) -> &DeviceBuffer<f32> {
        &self.entries
    }

    /// Entries emitted so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Entries the slots hold at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens of the window still open.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Whether a closed window's first series is held (overlap only).
    pub fn has_overlap(&self) -> bool {
        self.has_overlap
    }

    /// The state on the host, shaped like the engine's `CompressorState`.
    pub fn download(&self, gpu: &Gpu) -> Result<CompressorSnapshot, DeviceError> {
        let overlap = if self.has_overlap {
            (Some(gpu.download(&self.overlap_kv)?), Some(gpu.download(&self.overlap_gate)?))
        } else {
            (None, None)
        };
        Ok(CompressorSnapshot {
            entries: gpu.download_range(&self.entries, 0, self.count * self.dim)?,
            pending_kv: gpu.download_range(&self.pending_kv, 0, self.pending * self.width)?,
            pending_gate: gpu.download_range(&self.pending_gate, 0, self.pending * self.width)?,
            overlap_kv: overlap.0,
            overlap_gate: overlap.1,
        })
    }
}

/// Feed `len` tokens of one sequence's chunk, in order, into its compressor
/// state: the engine's `compress_token` on each token (private to the
/// engine; the tests hold this to a copy of it). `kv` and `gate`: the chunk's
/// projected rows (`wkv·x`, `wgate·x`), `width` values each. Every window
/// that closes appends an entry, rotated by `rope` at position
/// `window_index * ratio` on its trailing `2 * rope.inv_freq.len()` channels;
/// `eps` is the entries' RMSNorm epsilon. An error, with the state
/// untouched, when the entries would pass the slots' capacity.
/// `first_position` is the chunk's first token's position: the state must
/// hold every token before it (checked in debug builds).
#[allow(clippy::too_many_arguments)]
pub fn compress_tokens(
    gpu: &Gpu,
    c: &DeviceCompressor,
    st: &mut CompressorSlots,
    kv: Rows,
    gate: Rows,
    len: usize,
    first_position: usize,
    rope: &Rope,
    eps: f32,
) -> Result<(), DeviceError> {
    // An entry rotates by its window's position (the entries before it
    // times the ratio); the chunk's position only checks that the state
    // holds every earlier token of the sequence.
    let (ratio, dim, width) = (c.ratio, c.dim, c.width());
    assert!(
        st.ratio == ratio && st.dim == dim && st.width == width,
        "slots of a compressor of ratio {} dim {} width {}, fed one of ratio {ratio} dim {dim} width {width}",
        st.ratio,
        st.dim,
        st.width
    );
    debug_assert_eq!(
        st.count * ratio + st.pending,
        first_position,
        "the compressor state holds {} tokens, the chunk starts at position {first_position}",
        st.count * ratio + st.pending
    );
    let half = rope.inv_freq.len();
    assert!(2 * half <= dim, "a rope of {half} pairs on entries of {dim} channels");
    if len == 0 {
        return Ok(());
    }
    for (name, rows) in [("kv", &kv), ("gate", &gate)] {
        assert!(rows.stride >= width, "{name} rows at stride {} hold no {width} channels", rows.stride);
        assert!(
            rows.offset + (len - 1) * rows.stride + width <= rows.buf.len(),
            "{len} {name} rows of {width} at stride {} from {} pass the buffer's {} values",
            rows.stride,
            rows.offset,
            rows.buf.len()
        );
        assert!(rows.stride <= i32::MAX as usize && len <= i32::MAX as usize, "{name} rows past int indices");
    }
    let windows = (st.pending + len) / ratio;
    if st.count + windows > st.capacity {
        return Err(capacity_error("compressor_windows", st.count + windows, st.capacity));
    }
    let (kv_stride, gate_stride) = (Arg::I32(kv.stride as i32), Arg::I32(gate.stride as i32));
    if windows > 0 {
        let (mut cos, mut sin) = (vec![0.0f32; windows * half], vec![0.0f32; windows * half]);
        if half > 0 {
            for (k, (cs, sn)) in cos.chunks_exact_mut(half).zip(sin.chunks_exact_mut(half)).enumerate() {
                rope.cos_sin((st.count + k) * ratio, cs, sn);
            }
        }
        let (cos, sin) = (gpu.upload(&cos)?, gpu.upload(&sin)?);
        gpu.launch(
            "compressor_windows",
            (windows as u32, 1, 1),
            (THREADS, 1, 1),
            (dim * std::mem::size_of::<f32>()) as u32,
            &[
                st.entries.at(st.count * dim),
                kv.arg(),
                kv_stride,
                gate.arg(),
                gate_stride,
                st.pending_kv.arg(),
                st.pending_gate.arg(),
                (st.pending as i32).into(),
                st.overlap_kv.arg(),
                st.overlap_gate.arg(),
                (st.has_overlap as i32).into(),
                c.ape.arg(),
                c.norm.arg(),
                cos.arg(),
                sin.arg(),
                (ratio as i32).into(),
                (dim as i32).into(),
                (c.overlap as i32).into(),
                (half as i32).into(),
                eps.into(),
            ],
        )?;
    }
    gpu.launch(
        "compressor_save",
        (1, 1, 1),
        (256, 1, 1),
        0,
        &[
            kv.arg(),
            kv_stride,
            gate.arg(),
            gate_stride,
            (len as i32).into(),
            st.pending_kv.arg(),
            st.pending_gate.arg(),
            (st.pending as i32).into(),
            st.overlap_kv.arg(),
            st.overlap_gate.arg(),
            c.ape.arg(),
            (ratio as i32).into(),
            (dim as i32).into(),
            (c.overlap as i32).into(),
            (windows as i32).into(),
        ],
    )?;
    st.count += windows;
    st.pending = (st.pending + len) % ratio;
    st.has_overlap |= c.overlap && windows > 0;
    Ok(())
}
