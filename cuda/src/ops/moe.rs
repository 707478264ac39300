//! Mixture-of-experts routing, dispatch and combine (`cuda/kernels/moe.cu`),
//! the bits of the engine's `model::moe::{route, combine}`.

use super::Rows;
use crate::{Arg, DeviceBuffer, DeviceError, Gpu};

/// Threads per block of the MoE kernels.
const THREADS: u32 = 128;

/// Most experts per token [`combine`] takes (the kernel's static order array).
pub const MAX_EXPERTS_PER_TOKEN: usize = 64;

/// How a layer picks each token's experts.
#[derive(Clone, Copy, Debug)]
pub enum Routing<'a> {
    /// Hash layers: the experts of token id `min(token, vocab - 1)` in
    /// `tid2eid` `[vocab, k]` (each in `0..e`); `tokens` `[n]`.
    Hash { tid2eid: &'a DeviceBuffer<i32>, tokens: &'a DeviceBuffer<u32>, vocab: usize },
    /// Top-k layers: `top_k(score + bias, k)` with `bias` `[e]`.
    TopK { bias: &'a DeviceBuffer<f32> },
}

fn to_i32(v: usize, what: &str) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit a kernel's int"))
}

/// The engine's `model::moe::route` from the gate's `logits` `[n, e]` (`n`
/// packed rows): experts `[n, k]` in the CPU's order (hash table order, or
/// `top_k`'s: larger biased score first, the lower index on ties) and their
/// weights `[n, k]` (the chosen scores, divided by their sum `+ 1e-20` when
/// `norm_topk_prob`, times `scaling`). The CPU's bits.
///
/// The scores are `deepinfer_kernels::ops::sqrt_softplus`, which calls libm
/// (`f32::exp`, `f32::ln_1p`, which differ between libm versions): they are
/// computed on the host, so the logits make one round trip (`n * e` floats)
/// before [`route_scores`] runs on the device.
#[allow(clippy::too_many_arguments)]
pub fn route(
    gpu: &Gpu,
    logits: &DeviceBuffer<f32>,
    n: usize,
    e: usize,
    k: usize,
    mode: Routing,
    norm_topk_prob: bool,
    scaling: f32,
    experts_out: &DeviceBuffer<i32>,
    weights_out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    assert!(logits.len() >= n * e, "route: logits hold {} values, n * e = {}", logits.len(), n * e);
    if n == 0 {
        return Ok(());
    }
    let scores: Vec<f32> =
        gpu.download_range(logits, 0, n * e)?.into_iter().map(deepinfer_kernels::ops::sqrt_softplus).collect();
    let scores = gpu.upload(&scores)?;
    route_scores(gpu, &scores, n, e, k, mode, norm_topk_prob, scaling, experts_out, weights_out)
}

/// [`route`] from the scores `sqrt_softplus(logits)` `[n, e]` already on the device.
#[allow(clippy::too_many_arguments)]
pub fn route_scores(
    gpu: &Gpu,
    scores: &DeviceBuffer<f32>,
    n: usize,
    e: usize,
    k: usize,
    mode: Routing,
    norm_topk_prob: bool,
    scaling: f32,
    experts_out: &DeviceBuffer<i32>,
    weights_out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    assert!(e > 0, "route: no experts");
    assert!(k > 0 && k <= e, "route: {k} experts per token out of {e}");
    assert!(scores.len() >= n * e, "route: scores hold {} values, n * e = {}", scores.len(), n * e);
    assert!(experts_out.len() >= n * k, "route: experts_out holds {}, n * k = {}", experts_out.len(), n * k);
    assert!(weights_out.len() >= n * k, "route: weights_out holds {}, n * k = {}", weights_out.len(), n * k);
    if n == 0 {
        return Ok(());
    }
    let (mode_id, bias, tid2eid, tokens, vocab) = match mode {
        Routing::TopK { bias } => {
            assert!(bias.len() >= e, "route: bias holds {}, e = {e}", bias.len());
            (0, bias.arg(), Arg::Ptr(0), Arg::Ptr(0), 1)
        }
        Routing::Hash { tid2eid, tokens, vocab } => {
            assert!(vocab > 0, "route: hash routing over an empty vocabulary");
            assert!(tid2eid.len() >= vocab * k, "route: tid2eid holds {}, vocab * k = {}", tid2eid.len(), vocab * k);
            assert!(tokens.len() >= n, "route: tokens holds {}, n = {n}", tokens.len());
            (1, Arg::Ptr(0), tid2eid.arg(), tokens.arg(), vocab)
        }
    };
    gpu.launch(
        "moe_route",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            scores.arg(),
            bias,
            tid2eid,
            tokens,
            Arg::I32(mode_id),
            to_i32(e, "e").into(),
            to_i32(k, "k").into(),
            to_i32(vocab, "vocab").into(),
            Arg::I32(norm_topk_prob as i32),
            scaling.into(),
            experts_out.arg(),
            weights_out.arg(),
        ],
    )
}

/// The engine's `Dispatch::gather`: `out` row `r` = `x` row `rows[r]`, for
/// `count` rows of `d` values (`rows` holds token indices into `x`).
pub fn gather_rows(
    gpu: &Gpu,
    x: Rows,
    rows: &DeviceBuffer<i32>,
    count: usize,
    d: usize,
    out: Rows,
) -> Result<(), DeviceError> {
    assert!(rows.len() >= count, "gather_rows: rows holds {}, count = {count}", rows.len());
    assert!(x.stride >= d && out.stride >= d, "gather_rows: strides {} and {} below d = {d}", x.stride, out.stride);
    if count == 0 || d == 0 {
        return Ok(());
    }
    assert!(
        out.offset + (count - 1) * out.stride + d <= out.buf.len(),
        "gather_rows: out holds {} values, {count} rows of {d} need more",
        out.buf.len()
    );
    gpu.launch(
        "moe_gather_rows",
        (count as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            x.arg(),
            to_i32(x.stride, "x stride").into(),
            rows.arg(),
            to_i32(d, "d").into(),
            out.arg(),
            to_i32(out.stride, "out stride").into(),
        ],
    )
}

/// The engine's `model::moe::combine` after the experts ran: for each of
/// `n` tokens, `out` = 0, then `add_scaled(out, weights[t, j], routed[t, j])`
/// for its `k` slots in ascending (expert, slot) order, then
/// `add_scaled(out, 1.0, shared[t])` when there is a shared expert.
/// `routed` is `[n, k, d]` (slot `j` of token `t` at `(t * k + j) * d`),
/// `experts` and `weights` `[n, k]`, `shared` and `out` rows of `d`. The CPU's bits.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    routed: &DeviceBuffer<f32>,
    experts: &DeviceBuffer<i32>,
    weights: &DeviceBuffer<f32>,
    shared: Option<Rows>,
    n: usize,
    k: usize,
    d: usize,
    out: Rows,
) -> Result<(), DeviceError> {
    assert!(k <= MAX_EXPERTS_PER_TOKEN, "combine: {k} experts per token, at most {MAX_EXPERTS_PER_TOKEN}");
    assert!(routed.len() >= n * k * d, "combine: routed holds {}, n * k * d = {}", routed.len(), n * k * d);
    assert!(experts.len() >= n * k, "combine: experts holds {}, n * k = {}", experts.len(), n * k);
    assert!(weights.len() >= n * k, "combine: weights holds {}, n * k = {}", weights.len(), n * k);
    assert!(out.stride >= d, "combine: out stride {} below d = {d}", out.stride);
    if n == 0 || d == 0 {
        return Ok(());
    }
    assert!(
        out.offset + (n - 1) * out.stride + d <= out.buf.len(),
        "combine: out holds {} values, {n} rows of {d} need more",
        out.buf.len()
    );
    let (shared_arg, shared_stride) = match shared {
        Some(s) => {
            assert!(s.stride >= d, "combine: shared stride {} below d = {d}", s.stride);
            assert!(
                s.offset + (n - 1) * s.stride + d <= s.buf.len(),
                "combine: shared holds {} values, {n} rows of {d} need more",
                s.buf.len()
            );
            (s.arg(), s.stride)
        }
        None => (Arg::Ptr(0), 0),
    };
    gpu.launch(
        "moe_combine",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            routed.arg(),
            experts.arg(),
            weights.arg(),
            shared_arg,
            to_i32(shared_stride, "shared stride").into(),
            to_i32(k, "k").into(),
            to_i32(d, "d").into(),
            out.arg(),
            to_i32(out.stride, "out stride").into(),
        ],
    )
}
