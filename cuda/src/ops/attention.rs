//! DeepSeek-V4's attention core (`cuda/kernels/attention.cu`): the lightning
//! indexer's scores and top-k, and each query's attention over its sliding
//! window plus its compressed entries with a per-head sink, for one
//! sequence's chunk of `len` query tokens at positions
//! `position..position + len`. Every output is the bits of the engine's
//! `engine/src/model/attention.rs` (`index_scores`, `attend_token`).

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Most f32 values of per-launch scratch (scores or probabilities): a long
/// chunk is launched in runs of queries that each fit (one query at least).
const SCRATCH_VALUES: usize = 1 << 24;
/// Threads of a top-k block (`DI_TOPK_THREADS` in attention.cu).
const TOPK_THREADS: u32 = 128;
/// Threads of an attention block (at most 256, attention.cu's `partial`).
const ATTEND_THREADS: u32 = 128;
/// Threads of an indexer-score block (one entry a thread).
const SCORE_THREADS: usize = 128;
/// The largest `topk` whose winners fit the top-k block's dynamic shared memory.
pub const MAX_TOPK: usize = 8192;
/// The most blocks along a grid's y (CUDA's limit).
const MAX_GRID_Y: usize = 65535;

fn int(value: usize, what: &str) -> Arg {
    Arg::I32(i32::try_from(value).unwrap_or_else(|_| panic!("{what} = {value} does not fit an int")))
}

/// Which compressed entries each query attends to after its window.
#[derive(Clone, Copy, Debug)]
pub enum Selection<'a> {
    /// Sliding window only.
    None,
    /// HCA: query at position `pos` takes entries `0..(pos + 1) / ratio`.
    AllVisible { ratio: usize },
    /// CSA: query `i` takes entries `selected[i * stride..][..counts[i]]` in
    /// that order ([`index_topk`]'s output, `stride` its `topk`); `ratio`
    /// bounds the count by `(pos + 1) / ratio` entries.
    Chosen { ratio: usize, selected: &'a DeviceBuffer<i32>, counts: &'a DeviceBuffer<i32>, stride: usize },
}

/// The lightning indexer of `engine/src/model/attention.rs`: for query `i`,
/// `visible = (position + i + 1) / ratio`, its scores
/// `index_scores` = `Σ_h w_h · (max(dot(q_h, k), 0) · ihd^-0.5)` (each dot
/// the bits of `deepinfer_kernels::linear::dot_rows`, the heads summed in
/// order from -0.0 as `Iterator::sum`) over entries `0..visible`, then
/// `deepinfer_kernels::ops::top_k(scores, min(topk, visible))`. The CPU's
/// bits and order (ties to the lower index, NaN last).
///
/// - `iq`: `len` rows of `ih * ihd` queries, already roped;
/// - `iw`: `len` rows of `ih` head weights, already scaled by `ih^-0.5`;
/// - `entries`: `[count, ihd]` indexer entries, `count >= (position + len) / ratio`;
/// - `selected` (out): `[len, topk]`, row `i`'s first `selected_count[i]`
///   values the chosen entries best first, the rest `-1`;
/// - `selected_count` (out): `[len]`, `min(topk, visible)`.
#[allow(clippy::too_many_arguments)]
pub fn index_topk(
    gpu: &Gpu,
    iq: Rows,
    iw: Rows,
    ih: usize,
    ihd: usize,
    entries: &DeviceBuffer<f32>,
    position: usize,
    len: usize,
    ratio: usize,
    topk: usize,
    selected: &DeviceBuffer<i32>,
    selected_count: &DeviceBuffer<i32>,
) -> Result<(), DeviceError> {
    assert!(ratio > 0, "index_topk: a compress ratio of 0");
    assert!(topk <= MAX_TOPK, "index_topk: topk {topk} above {MAX_TOPK}");
    assert!(
        selected.len() >= len * topk,
        "index_topk: selected holds {} of len × topk = {}",
        selected.len(),
        len * topk
    );
    assert!(selected_count.len() >= len, "index_topk: selected_count holds {} of len {len}", selected_count.len());
    if len == 0 {
        return Ok(());
    }
    assert!(ih > 0 && ihd > 0, "index_topk: {ih} heads of {ihd}");
    assert!(iq.stride >= ih * ihd, "index_topk: iq rows {} apart hold {ih} heads of {ihd}", iq.stride);
    assert!(iq.offset + (len - 1) * iq.stride + ih * ihd <= iq.buf.len(), "index_topk: iq holds fewer than {len} rows");
    assert!(iw.stride >= ih, "index_topk: iw rows {} apart hold {ih} weights", iw.stride);
    assert!(iw.offset + (len - 1) * iw.stride + ih <= iw.buf.len(), "index_topk: iw holds fewer than {len} rows");
    let max_visible = (position + len) / ratio;
    assert!(
        entries.len() >= max_visible * ihd,
        "index_topk: entries hold {} values, the last query sees {max_visible} entries of {ihd}",
        entries.len()
    );
    let scale = (ihd as f32).powf(-0.5);
    let row_values = max_visible.max(1);
    let per_launch = (SCRATCH_VALUES / row_values).clamp(1, len);
    let scores = gpu.zeros::<f32>(per_launch * row_values)?;
    for q0 in (0..len).step_by(per_launch) {
        let n = per_launch.min(len - q0);
        let p0 = position + q0;
        let visible_last = (p0 + n) / ratio;
        if visible_last > 0 {
            let blocks = visible_last.div_ceil(SCORE_THREADS);
            assert!(blocks <= MAX_GRID_Y, "index_topk: {visible_last} entries");
            gpu.launch(
                "attn_index_scores",
                (n as u32, blocks as u32, 1),
                (SCORE_THREADS as u32, 1, 1),
                0,
                &[
                    iq.row(q0),
                    int(iq.stride, "iq stride"),
                    iw.row(q0),
                    int(iw.stride, "iw stride"),
                    int(ih, "ih"),
                    int(ihd, "ihd"),
                    entries.arg(),
                    int(p0, "position"),
                    int(ratio, "ratio"),
                    int(row_values, "visible entries"),
                    scale.into(),
                    scores.arg(),
                ],
            )?;
        }
        gpu.launch(
            "attn_index_topk",
            (n as u32, 1, 1),
            (TOPK_THREADS, 1, 1),
            (topk * 4) as u32,
            &[
                scores.arg(),
                int(row_values, "visible entries"),
                int(p0, "position"),
                int(ratio, "ratio"),
                int(topk, "topk"),
                selected.at(q0 * topk),
                int(topk, "topk"),
                selected_count.at(q0),
            ],
        )?;
    }
    Ok(())
}

/// `attend_token` of `engine/src/model/attention.rs` for every query of the
/// chunk: query `i` at `pos = position + i` takes the window keys
/// `lo..=pos` (`lo = max(pos + 1 - window, first_key_position)`), then its
/// entries by `selection` in order; per head the scores are
/// `deepinfer_kernels::linear::dot_rows_of` times `scale`, then
/// `deepinfer_kernels::ops::softmax_with_sink(_, sink[head])`, the output
/// `add_weighted_rows_heads` of the same keys (values = keys) from zeros,
/// and last the inverse RoPE (`rope_interleaved` with `-sin`) of each
/// head's trailing `rope_dim` channels. The CPU's bits.
///
/// - `q`: `len` rows of `h * hd`, normed and roped;
/// - `keys`: `[nkeys, hd]`, the rows of positions `first_key_position..`
///   (the window rows the sequence kept, then this chunk's), at least up
///   to `position + len`;
/// - `entries`: `[*, hd]` compressed entries (needed unless `Selection::None`);
/// - `sink`: `[h]`; `scale`: the scores' factor (`hd^-0.5` in the engine);
/// - `cos`, `sin`: `[len, rope_dim / 2]` host tables of the queries' angles;
/// - `out`: `len` rows of `h * hd`, overwritten.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    gpu: &Gpu,
    q: Rows,
    h: usize,
    hd: usize,
    keys: &DeviceBuffer<f32>,
    first_key_position: usize,
    position: usize,
    len: usize,
    window: usize,
    entries: Option<&DeviceBuffer<f32>>,
    selection: Selection,
    sink: &DeviceBuffer<f32>,
    scale: f32,
    cos: &DeviceBuffer<f32>,
    sin: &DeviceBuffer<f32>,
    rope_dim: usize,
    out: Rows,
) -> Result<(), DeviceError> {
    if len == 0 {
        return Ok(());
    }
    assert!(h > 0 && hd > 0, "attend: {h} heads of {hd}");
    assert!(window > 0, "attend: a window of 0 keys");
    assert!(h <= MAX_GRID_Y, "attend: {h} heads");
    assert!(rope_dim.is_multiple_of(2) && rope_dim <= hd, "attend: rope_dim {rope_dim} of a head of {hd}");
    let half = rope_dim / 2;
    assert!(q.stride >= h * hd, "attend: q rows {} apart hold {h} heads of {hd}", q.stride);
    assert!(q.offset + (len - 1) * q.stride + h * hd <= q.buf.len(), "attend: q holds fewer than {len} rows");
    assert!(out.stride >= h * hd, "attend: out rows {} apart hold {h} heads of {hd}", out.stride);
    assert!(out.offset + (len - 1) * out.stride + h * hd <= out.buf.len(), "attend: out holds fewer than {len} rows");
    assert!(first_key_position <= position, "attend: keys start at {first_key_position}, after query {position}");
    let key_rows = position + len - first_key_position;
    assert!(keys.len() >= key_rows * hd, "attend: keys hold {} values, the chunk needs {key_rows} rows", keys.len());
    assert!(sink.len() >= h, "attend: {} sinks for {h} heads", sink.len());
    assert!(cos.len() >= len * half && sin.len() >= len * half, "attend: cos/sin tables hold fewer than {len} rows");
    let (mode, ratio, max_selected) = match selection {
        Selection::None => (0, 1, 0),
        Selection::AllVisible { ratio } => {
            assert!(ratio > 0, "attend: a compress ratio of 0");
            (1, ratio, (position + len) / ratio)
        }
        Selection::Chosen { ratio, selected, counts, stride } => {
            assert!(ratio > 0, "attend: a compress ratio of 0");
            assert!(selected.len() >= len * stride, "attend: selected holds fewer than {len} rows of {stride}");
            assert!(counts.len() >= len, "attend: counts hold fewer than {len}");
            (2, ratio, stride.min((position + len) / ratio))
        }
    };
    let n_entries = match (entries, mode) {
        (_, 0) => 0,
        (Some(e), _) => e.len() / hd,
        (None, _) => panic!("attend: a selection of entries without entries"),
    };
    if mode == 1 {
        assert!(n_entries >= max_selected, "attend: {n_entries} entries, the last query sees {max_selected}");
    }
    let stride = window.min(key_rows) + max_selected;
    let per_launch = (SCRATCH_VALUES / (h * stride)).clamp(1, len);
    let scratch = gpu.zeros::<f32>(per_launch * h * stride)?;
    let none = Arg::Ptr(0);
    for q0 in (0..len).step_by(per_launch) {
        let n = per_launch.min(len - q0);
        let (selected, sel_stride, counts) = match selection {
            Selection::Chosen { selected, counts, stride, .. } => (selected.at(q0 * stride), stride, counts.at(q0)),
            _ => (none, 0, none),
        };
        gpu.launch(
            "attn_attend",
            (n as u32, h as u32, 1),
            (ATTEND_THREADS, 1, 1),
            0,
            &[
                q.row(q0),
                int(q.stride, "q stride"),
                int(h, "h"),
                int(hd, "hd"),
                keys.arg(),
                int(first_key_position, "first_key_position"),
                int(position + q0, "position"),
                int(window.min(key_rows), "window"),
                entries.map_or(none, DeviceBuffer::arg),
                Arg::I32(mode),
                int(ratio, "ratio"),
                selected,
                int(sel_stride, "selection stride"),
                counts,
                int(max_selected, "selected entries"),
                int(n_entries, "entries"),
                sink.arg(),
                scale.into(),
                cos.at(q0 * half),
                sin.at(q0 * half),
                int(half, "rope_dim / 2"),
                out.row(q0),
                int(out.stride, "out stride"),
                scratch.arg(),
                int(stride, "keys per query"),
            ],
        )?;
    }
    Ok(())
}
