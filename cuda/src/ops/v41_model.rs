//! DeepSeek-V4.1's forward pass on the device, the steps beyond the
//! arithmetic primitives of [`super::v41`] (`cuda/kernels/v41_model.cu`, the
//! indexer in `v41_indexer.cu`):
//! mHC mixes, collapse and mix-back, Engram, the compressor's pooling, the
//! two-level indexer, the blockwise sparse attention and the MoE routing,
//! activation and combine. Each function names the CPU function in
//! `engine/src/v41/` whose bits it gives. Buffers are packed rows unless a
//! stride is named; `n = 0` rows does nothing.

use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

const THREADS: u32 = 128;
/// Threads of the selecting kernels (`V41M_SELECT_THREADS`).
const SELECT_THREADS: u32 = 128;
/// Threads of a (query, head) block of the attention (its slots per block).
const ATTENTION_THREADS: u32 = 64;

fn blocks(count: usize) -> u32 {
    let b = count.div_ceil(THREADS as usize).max(1);
    assert!(b <= 65535, "{count} items per row are too many");
    b as u32
}

fn grid_x(n: usize) -> u32 {
    assert!(n <= i32::MAX as usize, "{n} rows are too many");
    n as u32
}

fn need<T: crate::DeviceValue>(what: &str, buf: &DeviceBuffer<T>, len: usize) {
    assert!(buf.len() >= len, "{what} holds {}, needs {len}", buf.len());
}

/// The mHC constants of a sublayer and a model (`ops::MixShape` with the sublayer's `scale`).
#[derive(Clone, Copy, Debug)]
pub struct MixShape {
    pub hc: usize,
    pub dim: usize,
    pub iters: usize,
    pub norm_eps: f32,
    pub hc_eps: f32,
    pub scale: [f32; 3],
}

/// `engine/src/v41/ops.rs` `hc_mixes` of each of `n` tokens: `raw` holds the
/// mixing products `[n][(2 + hc) · hc]` (f32 of `dot_f64_rows(streams, mix)`,
/// what `super::v41::plain_linear` gives with the mix as an F32 weight),
/// `streams` `[n][hc · dim]`; writes `pre` and `post` `[n][hc]`, `comb` `[n][hc · hc]`.
#[allow(clippy::too_many_arguments)]
pub fn hc_mixes(
    gpu: &Gpu,
    raw: &DeviceBuffer<f32>,
    streams: &DeviceBuffer<f32>,
    n: usize,
    shape: MixShape,
    base: &DeviceBuffer<f32>,
    pre: &DeviceBuffer<f32>,
    post: &DeviceBuffer<f32>,
    comb: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    let MixShape { hc, dim, iters, norm_eps, hc_eps, scale } = shape;
    let mixes = (2 + hc) * hc;
    need("hc_mixes raw", raw, n * mixes);
    need("hc_mixes streams", streams, n * hc * dim);
    need("hc_mixes base", base, mixes);
    need("hc_mixes pre", pre, n * hc);
    need("hc_mixes post", post, n * hc);
    need("hc_mixes comb", comb, n * hc * hc);
    let args = [
        raw.arg(),
        (mixes as i32).into(),
        streams.arg(),
        (hc as i32).into(),
        (dim as i32).into(),
        scale[0].into(),
        scale[1].into(),
        scale[2].into(),
        base.arg(),
        (iters as i32).into(),
        norm_eps.into(),
        hc_eps.into(),
        pre.arg(),
        post.arg(),
        comb.arg(),
    ];
    gpu.launch("v41m_hc_mixes", (grid_x(n), 1, 1), (32, 1, 1), 0, &args)
}

/// `ops::hc_pre` of each of `n` tokens: `out` `[n][dim]` from `streams`
/// `[n][hc · dim]` and `pre` `[n][hc]`.
pub fn hc_pre(
    gpu: &Gpu,
    streams: &DeviceBuffer<f32>,
    pre: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    dim: usize,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    need("hc_pre streams", streams, n * hc * dim);
    need("hc_pre pre", pre, n * hc);
    need("hc_pre out", out, n * dim);
    let args = [streams.arg(), pre.arg(), (hc as i32).into(), (dim as i32).into(), out.arg()];
    gpu.launch("v41m_hc_pre", (grid_x(n), blocks(dim), 1), (THREADS, 1, 1), 0, &args)
}

/// `ops::hc_post` of each of `n` tokens: the sublayer's `output` `[n][dim]`
/// mixed into `streams` `[n][hc · dim]` with `post` `[n][hc]` and `comb`
/// `[n][hc · hc]` (a copy of the streams is taken here as the residual).
#[allow(clippy::too_many_arguments)]
pub fn hc_post(
    gpu: &Gpu,
    streams: &DeviceBuffer<f32>,
    output: &DeviceBuffer<f32>,
    post: &DeviceBuffer<f32>,
    comb: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    dim: usize,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    need("hc_post streams", streams, n * hc * dim);
    need("hc_post output", output, n * dim);
    need("hc_post post", post, n * hc);
    need("hc_post comb", comb, n * hc * hc);
    let residual = gpu.zeros::<f32>(n * hc * dim)?;
    gpu.copy(streams, 0, &residual, 0, n * hc * dim)?;
    let args =
        [residual.arg(), output.arg(), post.arg(), comb.arg(), (hc as i32).into(), (dim as i32).into(), streams.arg()];
    gpu.launch("v41m_hc_post", (grid_x(n), blocks(dim), 1), (THREADS, 1, 1), 0, &args)
}

/// An Engram layer's FP8 table on the device (`v41::engram::EngramTable`).
#[derive(Debug)]
pub struct DeviceEngramTable {
    pub rows: usize,
    pub dim: usize,
    pub values: DeviceBuffer<u8>,
    pub scales: DeviceBuffer<u8>,
}

impl DeviceEngramTable {
    /// `values` `[rows][dim]` e4m3 codes, `scales` `[rows][dim / 32]` UE8M0.
    pub fn upload(gpu: &Gpu, rows: usize, dim: usize, values: &[u8], scales: &[u8]) -> Result<Self, DeviceError> {
        assert!(rows > 0 && dim > 0 && dim.is_multiple_of(32), "an Engram table of {rows} x {dim}");
        assert!(values.len() >= rows * dim, "Engram table of {} codes for {rows} x {dim}", values.len());
        assert!(scales.len() >= rows * dim / 32, "Engram table of {} scales for {rows} x {dim}", scales.len());
        Ok(Self {
            rows,
            dim,
            values: gpu.upload(&values[..rows * dim])?,
            scales: gpu.upload(&scales[..rows * dim / 32])?,
        })
    }
}

/// `EngramTable::row` of `count` rows `rows[i]` (a row past the table reads
/// its last) into `out` `[count][dim]` (bf16 values).
pub fn engram_gather(
    gpu: &Gpu,
    table: &DeviceEngramTable,
    rows: &DeviceBuffer<u32>,
    count: usize,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if count == 0 {
        return Ok(());
    }
    need("engram_gather rows", rows, count);
    need("engram_gather out", out, count * table.dim);
    let args = [
        table.values.arg(),
        table.scales.arg(),
        (table.rows as i32).into(),
        (table.dim as i32).into(),
        rows.arg(),
        out.arg(),
    ];
    gpu.launch("v41m_engram_gather", (grid_x(count), 1, 1), (THREADS, 1, 1), 0, &args)
}

/// The Engram update of `ModelV41::apply_engram` after its `wkv`: for every
/// token and stream `k`, `engram::gate(stream, key_k, weight_k, eps)` and
/// `stream ← bf16(stream + gate · value)`. `kv` `[n][(hc + 1) · dim]` (the
/// hc keys, then the value), `weight` `[hc][dim]`.
#[allow(clippy::too_many_arguments)]
pub fn engram_gate(
    gpu: &Gpu,
    streams: &DeviceBuffer<f32>,
    kv: &DeviceBuffer<f32>,
    weight: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    dim: usize,
    eps: f32,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    need("engram_gate streams", streams, n * hc * dim);
    need("engram_gate kv", kv, n * (hc + 1) * dim);
    need("engram_gate weight", weight, hc * dim);
    let inv_sqrt_d = (dim as f64).powf(-0.5) as f32;
    let args =
        [streams.arg(), kv.arg(), weight.arg(), (hc as i32).into(), (dim as i32).into(), eps.into(), inv_sqrt_d.into()];
    gpu.launch("v41m_engram_gate", (grid_x(n), hc as u32, 1), (THREADS, 1, 1), 0, &args)
}

/// `x[i] = round_bf16(x[i] * factor)` for the first `count` values (the indexer's weights).
pub fn scale_round(gpu: &Gpu, x: &DeviceBuffer<f32>, count: usize, factor: f32) -> Result<(), DeviceError> {
    scale(gpu, x, count, factor, false)
}

/// `x[i] = x[i] / divisor` for the first `count` values (`ffn::route`'s temperature).
pub fn divide(gpu: &Gpu, x: &DeviceBuffer<f32>, count: usize, divisor: f32) -> Result<(), DeviceError> {
    scale(gpu, x, count, divisor, true)
}

fn scale(gpu: &Gpu, x: &DeviceBuffer<f32>, count: usize, factor: f32, divide: bool) -> Result<(), DeviceError> {
    if count == 0 {
        return Ok(());
    }
    need("scale", x, count);
    let grid = count.div_ceil(THREADS as usize);
    assert!(grid <= u32::MAX as usize, "{count} values are too many");
    let args = [x.arg(), Arg::I64(count as i64), factor.into(), i32::from(divide).into()];
    gpu.launch("v41m_scale", (grid as u32, 1, 1), (THREADS, 1, 1), 0, &args)
}

/// `attention::compress`'s pooling (ratio > 1) of `groups` closed groups:
/// `kv` and `score` hold their `groups · ratio` rows of `hd` (f32, the
/// plain projections), `out` `[groups][hd]` the pooled rows (bf16, not yet normed).
pub fn compress_pool(
    gpu: &Gpu,
    kv: &DeviceBuffer<f32>,
    score: &DeviceBuffer<f32>,
    groups: usize,
    ratio: usize,
    hd: usize,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if groups == 0 {
        return Ok(());
    }
    need("compress_pool kv", kv, groups * ratio * hd);
    need("compress_pool score", score, groups * ratio * hd);
    need("compress_pool out", out, groups * hd);
    let args = [kv.arg(), score.arg(), (ratio as i32).into(), (hd as i32).into(), out.arg()];
    gpu.launch("v41m_compress_pool", (grid_x(groups), 1, 1), (THREADS, 1, 1), 0, &args)
}

/// One chunk for the indexer: `len` queries from position `start`, entries
/// of `ratio` tokens. Query `t` ranges over `width(t)` entries (`Span::width`).
#[derive(Clone, Copy, Debug)]
pub struct IndexSpan {
    pub start: usize,
    pub len: usize,
    pub ratio: usize,
}

impl IndexSpan {
    /// The widest query's entries: the row stride of the score buffers.
    pub fn max_width(&self) -> usize {
        if self.start == 0 {
            self.len / self.ratio
        } else {
            (self.start + self.len) / self.ratio
        }
    }

    fn args(&self) -> [Arg; 3] {
        [(self.start as i32).into(), (self.len as i32).into(), (self.ratio as i32).into()]
    }
}

/// A candidate source's mask for its consumers: `keep` `[len][stride]`
/// (1 kept), `keep_len` `[len]` (the source query's width).
#[derive(Debug)]
pub struct Candidates {
    pub keep: DeviceBuffer<i32>,
    pub keep_len: DeviceBuffer<i32>,
    pub stride: usize,
}

/// `attention::choose`'s scores: `scores` `[len][stride]` (stride at least
/// `span.max_width()`) from the index keys `[entries][ihd]`, the queries
/// `q` `[len][ih · ihd]` (rotated, FP4 round-tripped) and their weights
/// `w` `[len][ih]`; a consumer passes its source's `candidates`.
#[allow(clippy::too_many_arguments)]
pub fn index_scores(
    gpu: &Gpu,
    keys: &DeviceBuffer<f32>,
    q: &DeviceBuffer<f32>,
    w: &DeviceBuffer<f32>,
    ih: usize,
    ihd: usize,
    span: IndexSpan,
    candidates: Option<&Candidates>,
    scores: &DeviceBuffer<f32>,
    stride: usize,
) -> Result<(), DeviceError> {
    let width = span.max_width();
    if span.len == 0 || width == 0 {
        return Ok(());
    }
    assert!(stride >= width, "index scores of stride {stride} for {width} entries");
    need("index_scores keys", keys, ((span.start + span.len) / span.ratio).min(width) * ihd);
    need("index_scores q", q, span.len * ih * ihd);
    need("index_scores w", w, span.len * ih);
    need("index_scores scores", scores, span.len * stride);
    let (keep, keep_len, keep_stride) = match candidates {
        Some(c) => {
            need("candidate mask", &c.keep, span.len * c.stride);
            need("candidate widths", &c.keep_len, span.len);
            (c.keep.arg(), c.keep_len.arg(), c.stride)
        }
        None => (Arg::Ptr(0), Arg::Ptr(0), 0),
    };
    let [s, l, r] = span.args();
    let args = [
        keys.arg(),
        q.arg(),
        w.arg(),
        (ih as i32).into(),
        (ihd as i32).into(),
        s,
        l,
        r,
        keep,
        keep_len,
        (keep_stride as i32).into(),
        scores.arg(),
        (stride as i32).into(),
    ];
    gpu.launch("v41m_index_scores", (grid_x(span.len), blocks(width), 1), (THREADS, 1, 1), 0, &args)
}

/// `attention::choose`'s selection: per query the entries of the
/// `min(topk, width)` best `scores` (`ops::top_k_stable`), ascending, those
/// not yet visible dropped: `selected` `[len][topk]`, `counts` `[len]`.
pub fn index_topk(
    gpu: &Gpu,
    scores: &DeviceBuffer<f32>,
    stride: usize,
    span: IndexSpan,
    topk: usize,
    selected: &DeviceBuffer<i32>,
    counts: &DeviceBuffer<i32>,
) -> Result<(), DeviceError> {
    if span.len == 0 {
        return Ok(());
    }
    assert!(topk > 0, "a top-k of none");
    need("index_topk scores", scores, span.len * stride.max(1));
    need("index_topk selected", selected, span.len * topk);
    need("index_topk counts", counts, span.len);
    let [s, l, r] = span.args();
    let args = [scores.arg(), (stride as i32).into(), s, l, r, (topk as i32).into(), selected.arg(), counts.arg()];
    gpu.launch("v41m_index_topk", (grid_x(span.len), 1, 1), (SELECT_THREADS, 1, 1), 0, &args)
}

/// `attention::candidate_blocks` of every query of a candidate source: the
/// mask of the entries its consumers may choose.
pub fn candidate_blocks(
    gpu: &Gpu,
    scores: &DeviceBuffer<f32>,
    stride: usize,
    span: IndexSpan,
    block_size: usize,
    topk_blocks: usize,
) -> Result<Candidates, DeviceError> {
    assert!(block_size > 0, "candidate blocks of no entries");
    let n = span.len;
    let stride = stride.max(1);
    let keep = gpu.zeros::<i32>(n.max(1) * stride)?;
    let keep_len = gpu.zeros::<i32>(n.max(1))?;
    let out = Candidates { keep, keep_len, stride };
    if n == 0 {
        return Ok(out);
    }
    need("candidate_blocks scores", scores, n * stride);
    let best_stride = stride.div_ceil(block_size).max(1);
    let best = gpu.zeros::<f32>(n * best_stride)?;
    let chosen = gpu.zeros::<i32>(n * best_stride)?;
    let [s, l, r] = span.args();
    let args = [
        scores.arg(),
        (stride as i32).into(),
        s,
        l,
        r,
        (block_size as i32).into(),
        (topk_blocks as i32).into(),
        best.arg(),
        (best_stride as i32).into(),
        chosen.arg(),
        out.keep.arg(),
        out.keep_len.arg(),
    ];
    gpu.launch("v41m_candidate_blocks", (grid_x(n), 1, 1), (SELECT_THREADS, 1, 1), 0, &args)?;
    Ok(out)
}

/// The chosen entries of a chunk's queries (`Shared::selection`).
#[derive(Clone, Copy, Debug)]
pub struct Chosen<'a> {
    pub entries: &'a DeviceBuffer<f32>,
    pub selected: &'a DeviceBuffer<i32>,
    pub counts: &'a DeviceBuffer<i32>,
    pub stride: usize,
}

/// One chunk's window for [`sparse_attention`]: `len` queries from `start`,
/// `keys` `[rows][hd]` the window rows of positions `base..`, `win` the window.
#[derive(Clone, Copy, Debug)]
pub struct Window<'a> {
    pub keys: &'a DeviceBuffer<f32>,
    pub base: usize,
    pub start: usize,
    pub len: usize,
    pub win: usize,
}

/// `ops::sparse_attention` of each query of a chunk over the key list
/// `attention::attend_projected` builds (window slots, then the chosen
/// entries): `q` `[len][heads · hd]`, `sink` `[heads]`, `out` `[len][heads · hd]`
/// (bf16, not yet rotated back).
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention(
    gpu: &Gpu,
    q: &DeviceBuffer<f32>,
    heads: usize,
    hd: usize,
    window: Window,
    chosen: Option<Chosen>,
    sink: &DeviceBuffer<f32>,
    scale: f32,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    let Window { keys, base, start, len, win } = window;
    if len == 0 {
        return Ok(());
    }
    assert!(win > 0 && base <= start, "a window of {win} from {base} for queries from {start}");
    need("sparse_attention q", q, len * heads * hd);
    need("sparse_attention keys", keys, (start + len - base) * hd);
    need("sparse_attention sink", sink, heads);
    need("sparse_attention out", out, len * heads * hd);
    let (entries, selected, counts, stride) = match chosen {
        Some(c) => {
            need("sparse_attention selected", c.selected, len * c.stride);
            need("sparse_attention counts", c.counts, len);
            (c.entries.arg(), c.selected.arg(), c.counts.arg(), c.stride)
        }
        None => (Arg::Ptr(0), Arg::Ptr(0), Arg::Ptr(0), 0),
    };
    let args = [
        q.arg(),
        (heads as i32).into(),
        (hd as i32).into(),
        keys.arg(),
        (base as i32).into(),
        (start as i32).into(),
        (len as i32).into(),
        (win as i32).into(),
        entries,
        selected,
        counts,
        (stride as i32).into(),
        sink.arg(),
        scale.into(),
        out.arg(),
    ];
    let shared = (hd * 4) as u32;
    gpu.launch("v41m_sparse_attention", (grid_x(len), heads as u32, 1), (ATTENTION_THREADS, 1, 1), shared, &args)
}

/// How the router's logits become scores (`config::ScoreFunc`), applied by
/// the caller except the square root of `SqrtSoftplus`, which [`route`] takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreSqrt {
    No,
    Yes,
}

/// `ffn::route` from each token's scores `[n][e]` (after the score function;
/// `sqrt`: their square roots are the scores): `experts` and `weights` `[n][k]`.
#[allow(clippy::too_many_arguments)]
pub fn route(
    gpu: &Gpu,
    scores: &DeviceBuffer<f32>,
    bias: &DeviceBuffer<f32>,
    n: usize,
    e: usize,
    k: usize,
    sqrt: ScoreSqrt,
    norm_topk_prob: bool,
    route_scale: f32,
    experts: &DeviceBuffer<i32>,
    weights: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    assert!(k > 0 && k <= e, "{k} of {e} experts");
    need("route scores", scores, n * e);
    need("route bias", bias, e);
    need("route experts", experts, n * k);
    need("route weights", weights, n * k);
    let args = [
        scores.arg(),
        bias.arg(),
        (e as i32).into(),
        (k as i32).into(),
        i32::from(sqrt == ScoreSqrt::Yes).into(),
        i32::from(norm_topk_prob).into(),
        route_scale.into(),
        experts.arg(),
        weights.arg(),
    ];
    gpu.launch("v41m_route", (grid_x(n), 1, 1), (32, 1, 1), 0, &args)
}

/// `ffn::expert_forward`'s activation, in place of `gate` `[rows][inter]`
/// (with `up` the same shape): the clamped SwiGLU times each row's routing
/// weight (`weights` `[rows]`, none for the shared expert), bf16.
pub fn swiglu(
    gpu: &Gpu,
    gate: &DeviceBuffer<f32>,
    up: &DeviceBuffer<f32>,
    weights: Option<&DeviceBuffer<f32>>,
    rows: usize,
    inter: usize,
    limit: f32,
) -> Result<(), DeviceError> {
    if rows == 0 || inter == 0 {
        return Ok(());
    }
    need("swiglu gate", gate, rows * inter);
    need("swiglu up", up, rows * inter);
    if let Some(w) = weights {
        need("swiglu weights", w, rows);
    }
    let args =
        [gate.arg(), up.arg(), weights.map_or(Arg::Ptr(0), DeviceBuffer::arg), (inter as i32).into(), limit.into()];
    gpu.launch("v41m_swiglu", (grid_x(rows), blocks(inter), 1), (THREADS, 1, 1), 0, &args)
}

/// `ffn::combine`: `out` `[n][dim]` = bf16(routed outputs `[n · k][dim]`
/// (by token and slot, weights applied) summed in (expert, slot) order,
/// plus `shared` `[n][dim]`).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    routed: &DeviceBuffer<f32>,
    experts: &DeviceBuffer<i32>,
    shared: &DeviceBuffer<f32>,
    n: usize,
    k: usize,
    dim: usize,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    if n == 0 {
        return Ok(());
    }
    need("moe_combine routed", routed, n * k * dim);
    need("moe_combine experts", experts, n * k);
    need("moe_combine shared", shared, n * dim);
    need("moe_combine out", out, n * dim);
    let args = [routed.arg(), experts.arg(), shared.arg(), (k as i32).into(), (dim as i32).into(), out.arg()];
    gpu.launch("v41m_moe_combine", (grid_x(n), blocks(dim), 1), (THREADS, 1, 1), 0, &args)
}
