//! mHC hyper-connections (`cuda/kernels/hyper.cu`): the engine's
//! `model::hyper::{pre, post, head}` from the raw mixing product on.
//!
//! The product `mix.forward(streams)` (the linear of the raw, unnormalised
//! streams) is the linear kernel's; these kernels take it as `raw_mixes` and
//! do the rest of `normed_mix` (each token's outputs times `inv_rms` of its
//! streams) and everything after it. Layouts are row-major per token:
//! streams `[n, hc, d]`, mixes `[n, (2 + hc) · hc]` (pre, post, comb).

use crate::{DeviceBuffer, DeviceError, Gpu};

/// Most streams the kernels take (their shared arrays' size).
pub const MAX_HC: usize = 16;

/// Threads per block of the per-token kernels (at least 16: the 16 lanes of
/// the RMS sum are one thread each).
const THREADS: u32 = 128;

fn check_shape(what: &str, buf: &DeviceBuffer<f32>, needed: usize) {
    assert!(buf.len() >= needed, "{what}: a buffer of {} values, {needed} needed", buf.len());
}

fn int(what: &str, v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit a kernel's int"))
}

/// The engine's `hyper::pre` for `n` tokens from the raw mixing product:
/// `normed_mix` (each of `raw_mixes`' rows times `inv_rms` of the token's
/// streams, `rms_eps`), then `pre = sigmoid(m·scale[0] + base) + hc_eps`,
/// `post = 2·sigmoid(m·scale[1] + base)`, `comb` = row softmaxes of
/// `m·scale[2] + base` plus `hc_eps`, then `sinkhorn(comb, hc,
/// sinkhorn_iters, hc_eps)`, and `collapse(pre, streams)`. The CPU's bits.
///
/// - `raw_mixes`: `[n, (2+hc)·hc]`, `mix.forward` of the raw streams;
/// - `streams`: `[n, hc·d]`; `base`: `[(2+hc)·hc]`;
/// - `post_out`: `[n, hc]` (`Mix::post`), `comb_out`: `[n, hc·hc]`
///   (`Mix::comb`, row j = input stream), `collapsed_out`: `[n, d]`.
#[allow(clippy::too_many_arguments)]
pub fn hyper_pre(
    gpu: &Gpu,
    raw_mixes: &DeviceBuffer<f32>,
    streams: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    d: usize,
    scale: [f32; 3],
    base: &DeviceBuffer<f32>,
    hc_eps: f32,
    rms_eps: f32,
    sinkhorn_iters: usize,
    post_out: &DeviceBuffer<f32>,
    comb_out: &DeviceBuffer<f32>,
    collapsed_out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    assert!((1..=MAX_HC).contains(&hc), "hyper_pre: hc = {hc}, the kernels take 1..={MAX_HC}");
    let outputs = (2 + hc) * hc;
    check_shape("hyper_pre raw_mixes [n, (2+hc)*hc]", raw_mixes, n * outputs);
    check_shape("hyper_pre streams [n, hc*d]", streams, n * hc * d);
    check_shape("hyper_pre base [(2+hc)*hc]", base, outputs);
    check_shape("hyper_pre post_out [n, hc]", post_out, n * hc);
    check_shape("hyper_pre comb_out [n, hc*hc]", comb_out, n * hc * hc);
    check_shape("hyper_pre collapsed_out [n, d]", collapsed_out, n * d);
    if n == 0 {
        return Ok(());
    }
    int("hc * d", hc * d);
    gpu.launch(
        "hyper_pre",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            raw_mixes.arg(),
            streams.arg(),
            int("hc", hc).into(),
            int("d", d).into(),
            scale[0].into(),
            scale[1].into(),
            scale[2].into(),
            base.arg(),
            hc_eps.into(),
            rms_eps.into(),
            int("sinkhorn_iters", sinkhorn_iters).into(),
            post_out.arg(),
            comb_out.arg(),
            collapsed_out.arg(),
        ],
    )
}

/// The engine's `hyper::post` (`deepinfer_kernels::ops::mix_streams` per
/// token), in place on `streams`: stream k ← `post[k]·output + Σ_j
/// comb[j·hc + k]·stream j` (old streams, j in order, each product rounded
/// before its sum). The CPU's bits.
///
/// - `post`: `[n, hc]`, `comb`: `[n, hc·hc]` (as [`hyper_pre`] writes them);
/// - `output`: `[n, d]` the sublayer's output; `streams`: `[n, hc·d]`.
#[allow(clippy::too_many_arguments)]
pub fn hyper_post(
    gpu: &Gpu,
    post: &DeviceBuffer<f32>,
    comb: &DeviceBuffer<f32>,
    output: &DeviceBuffer<f32>,
    streams: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    d: usize,
) -> Result<(), DeviceError> {
    assert!((1..=MAX_HC).contains(&hc), "hyper_post: hc = {hc}, the kernels take 1..={MAX_HC}");
    check_shape("hyper_post post [n, hc]", post, n * hc);
    check_shape("hyper_post comb [n, hc*hc]", comb, n * hc * hc);
    check_shape("hyper_post output [n, d]", output, n * d);
    check_shape("hyper_post streams [n, hc*d]", streams, n * hc * d);
    if n == 0 || d == 0 {
        return Ok(());
    }
    int("hc * d", hc * d);
    let column_blocks = d.div_ceil(THREADS as usize);
    assert!(column_blocks <= 65535, "hyper_post: d = {d} needs more than 65535 column blocks");
    let shared = (hc * THREADS as usize * std::mem::size_of::<f32>()) as u32;
    gpu.launch(
        "hyper_post",
        (n as u32, column_blocks as u32, 1),
        (THREADS, 1, 1),
        shared,
        &[post.arg(), comb.arg(), output.arg(), streams.arg(), int("hc", hc).into(), int("d", d).into()],
    )
}

/// The engine's `hyper::head`: `normed_mix` of the head's `hc` outputs
/// (`raw_mixes` times `inv_rms` of the token's streams, `rms_eps`), `pre =
/// sigmoid(m·scale + base) + hc_eps`, then `collapse(pre, streams)`. The
/// CPU's bits.
///
/// - `raw_mixes`: `[n, hc]`, `mix.forward` of the raw streams;
/// - `streams`: `[n, hc·d]`; `base`: `[hc]`; `out`: `[n, d]`.
#[allow(clippy::too_many_arguments)]
pub fn hyper_head(
    gpu: &Gpu,
    raw_mixes: &DeviceBuffer<f32>,
    streams: &DeviceBuffer<f32>,
    n: usize,
    hc: usize,
    d: usize,
    scale: f32,
    base: &DeviceBuffer<f32>,
    hc_eps: f32,
    rms_eps: f32,
    out: &DeviceBuffer<f32>,
) -> Result<(), DeviceError> {
    assert!((1..=MAX_HC).contains(&hc), "hyper_head: hc = {hc}, the kernels take 1..={MAX_HC}");
    check_shape("hyper_head raw_mixes [n, hc]", raw_mixes, n * hc);
    check_shape("hyper_head streams [n, hc*d]", streams, n * hc * d);
    check_shape("hyper_head base [hc]", base, hc);
    check_shape("hyper_head out [n, d]", out, n * d);
    if n == 0 {
        return Ok(());
    }
    int("hc * d", hc * d);
    gpu.launch(
        "hyper_head",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[
            raw_mixes.arg(),
            streams.arg(),
            int("hc", hc).into(),
            int("d", d).into(),
            scale.into(),
            base.arg(),
            hc_eps.into(),
            rms_eps.into(),
            out.arg(),
        ],
    )
}
