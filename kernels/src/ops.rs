//! Element-wise and row-wise primitives of the DeepSeek-V4 forward pass.
//! All reductions run in a fixed order, so results are batch-invariant.

use crate::exp::{exp, exp_in_place};

/// RMS normalisation of one row in place: `x · rsqrt(mean(x²) + eps) · weight`.
pub fn rms_norm(x: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let inv = inv_rms(x, eps);
    match weight {
        Some(w) => {
            assert_eq!(w.len(), x.len(), "rms_norm weight");
            for (v, w) in x.iter_mut().zip(w) {
                *v = w * (*v * inv);
            }
        }
        None => x.iter_mut().for_each(|v| *v *= inv),
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the factor of [`rms_norm`].
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    // The 16-lane order of `dot`: one multiply-add chain per lane instead of
    // one long serial sum, the same bits on every path.
    let sum_sq = crate::linear::dot(x, x);
    1.0 / (sum_sq / x.len() as f32 + eps).sqrt()
}

/// Rotate consecutive pairs `(x[2i], x[2i+1])` by the angle whose cosine and sine are
/// `cos[i]`, `sin[i]` ("interleaved" RoPE). `x.len() == 2 * cos.len()`.
pub fn rope_interleaved(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    assert_eq!(x.len(), 2 * cos.len(), "rope slice");
    for (i, pair) in x.chunks_exact_mut(2).enumerate() {
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos[i] - b * sin[i];
        pair[1] = b * cos[i] + a * sin[i];
    }
}

/// YaRN parameters (NTK-by-parts frequency interpolation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Multiplies cos and sin (YaRN's "mscale"); DeepSeek-V4 uses 1.
    pub attention_factor: f64,
}

/// Inverse frequencies of a rotary embedding over `dim` channels (dim/2 pairs).
#[derive(Clone, Debug)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    /// Factor on cos and sin (1 but for a YaRN `attention_factor`).
    pub scale: f32,
}

impl Rope {
    pub fn new(dim: usize, theta: f64, yarn: Option<Yarn>) -> Self {
        let half = dim / 2;
        // f32 like the reference: base ** (arange(0, dim, 2) / dim).
        let pos_freqs: Vec<f32> = (0..half).map(|i| (theta as f32).powf((2 * i) as f32 / dim as f32)).collect();
        let inv_freq = match yarn {
            None => pos_freqs.iter().map(|p| 1.0 / p).collect(),
            Some(y) => {
                let correction_dim = |rotations: f64| {
                    (dim as f64 * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * theta.ln())
                };
                let low = correction_dim(y.beta_fast).floor().max(0.0);
                let mut high = correction_dim(y.beta_slow).ceil().min(dim as f64 - 1.0);
                if low == high {
                    high += 0.001;
                }
                (0..half)
                    .map(|i| {
                        let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        let extrapolation = 1.0 / pos_freqs[i];
                        let interpolation = 1.0 / (y.factor as f32 * pos_freqs[i]);
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        };
        Self { inv_freq, scale: yarn.map_or(1.0, |y| y.attention_factor as f32) }
    }

    /// cos and sin of every pair's angle at `position`.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        let p = position as f32;
        for (i, f) in self.inv_freq.iter().enumerate() {
            let angle = p * f;
            cos[i] = angle.cos() * self.scale;
            sin[i] = angle.sin() * self.scale;
        }
    }
}

/// Softmax over `logits` with an extra "sink" logit that takes probability mass but
/// has no value: on return `logits` holds the probabilities of the real entries
/// (they sum to less than one). `-inf` entries get probability 0.
pub fn softmax_with_sink(logits: &mut [f32], sink: f32) {
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F.
        return unsafe { softmax_with_sink_avx512(logits, sink) };
    }
    softmax_with_sink_plain(logits, sink);
}

#[inline(always)]
fn softmax_with_sink_plain(logits: &mut [f32], sink: f32) {
    let max = max_lanes(logits).max(sink);
    logits.iter_mut().for_each(|v| *v -= max);
    exp_in_place(logits);
    let sum = exp(sink - max) + sum_lanes(logits);
    let inv = 1.0 / sum;
    logits.iter_mut().for_each(|v| *v *= inv);
}

/// The plain steps on 16-lane registers: the shift, the exponentials and
/// the lane sums in one pass (the same operations in the same order, so
/// the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_with_sink_avx512(logits: &mut [f32], sink: f32) {
    let max = max_lanes(logits).max(sink);
    let lanes = crate::exp::avx512::exp_shifted_lane_sums(logits, max);
    let sum = exp(sink - max) + crate::simd::reduce16(&lanes);
    let inv = 1.0 / sum;
    logits.iter_mut().for_each(|v| *v *= inv);
}

/// The largest of `x` that is not NaN (−inf for none), sixteen lanes at a
/// time instead of one serial chain. Which maximum is found first changes
/// nothing the softmaxes compute: the values are the same but for the sign
/// of a zero, and `v − (±0)` and `exp(±0)` do not see it.
#[inline(always)]
fn max_lanes(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &v)| *l = l.max(v));
    }
    lanes.iter_mut().zip(tail).for_each(|(l, &v)| *l = l.max(v));
    lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// Sum in the lane order of [`crate::linear::dot`]: element `i` into lane
/// `i % 16`, then the fixed pairwise tree. Sixteen independent adds per step
/// instead of one serial chain, and the same bits on every path.
pub fn sum_lanes(x: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, &v)| *l += v);
    }
    lanes.iter_mut().zip(tail).for_each(|(l, &v)| *l += v);
    crate::simd::reduce16(&lanes)
}

/// `out[d] += p * v[d]`, the product rounded before the sum (no fused
/// multiply-add), so every path gives the bits of the plain loop.
pub fn add_scaled(out: &mut [f32], p: f32, v: &[f32]) {
    assert_eq!(out.len(), v.len(), "add_scaled lengths");
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F.
        return unsafe { add_scaled_avx512(out, p, v) };
    }
    add_scaled_plain(out, p, v);
}

/// `out[d] = p * v[d]`, the bits of the plain loop on every path.
pub fn scale_into(out: &mut [f32], p: f32, v: &[f32]) {
    assert_eq!(out.len(), v.len(), "scale_into lengths");
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F.
        return unsafe { scale_into_avx512(out, p, v) };
    }
    scale_into_plain(out, p, v);
}

#[inline(always)]
fn scale_into_plain(out: &mut [f32], p: f32, v: &[f32]) {
    out.iter_mut().zip(v).for_each(|(o, v)| *o = p * v);
}

/// The plain loop compiled for 16-lane registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn scale_into_avx512(out: &mut [f32], p: f32, v: &[f32]) {
    scale_into_plain(out, p, v);
}

#[inline(always)]
fn add_scaled_plain(out: &mut [f32], p: f32, v: &[f32]) {
    out.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
}

/// The plain loop compiled for 16-lane registers (Rust never contracts a
/// multiply and an add into one instruction, so the bits are the same).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_scaled_avx512(out: &mut [f32], p: f32, v: &[f32]) {
    add_scaled_plain(out, p, v);
}

/// `out[j] = fma(weights[k], rows[k][j], out[j])` for every row in turn:
/// one fused chain per output, in row order (attention's probabilities
/// times its values). AVX-512 keeps 64 columns of `out` in registers across
/// all rows instead of loading and storing them once per row.
pub fn add_weighted_rows(out: &mut [f32], weights: &[f32], rows: &[&[f32]]) {
    assert_eq!(weights.len(), rows.len(), "add_weighted_rows: one weight per row");
    assert!(rows.iter().all(|r| r.len() == out.len()), "add_weighted_rows: row lengths");
    match crate::Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the detected path guarantees AVX-512F; lengths checked above.
        crate::Isa::Avx512 => unsafe { add_weighted_rows_avx512(out, weights, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the detected path guarantees AVX2 and FMA.
        crate::Isa::Avx2 => unsafe { add_weighted_rows_fma(out, weights, rows) },
        _ => add_weighted_rows_plain(out, weights, rows),
    }
}

/// The definition; `mul_add` is one instruction where the CPU fuses (a
/// library call on x86 paths compiled without FMA).
#[inline(always)]
fn add_weighted_rows_plain(out: &mut [f32], weights: &[f32], rows: &[&[f32]]) {
    for (&w, row) in weights.iter().zip(rows) {
        out.iter_mut().zip(*row).for_each(|(o, &v)| *o = w.mul_add(v, *o));
    }
}

/// The definition compiled with FMA, so `mul_add` is one instruction.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn add_weighted_rows_fma(out: &mut [f32], weights: &[f32], rows: &[&[f32]]) {
    add_weighted_rows_plain(out, weights, rows);
}

/// # Safety
/// The CPU must support AVX-512F; every row is `out.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_weighted_rows_avx512(out: &mut [f32], weights: &[f32], rows: &[&[f32]]) {
    use std::arch::x86_64::*;
    const STRIP: usize = 64;
    let d = out.len();
    let po = out.as_mut_ptr();
    let whole = d / STRIP * STRIP;
    for j0 in (0..whole).step_by(STRIP) {
        let mut acc: [__m512; 4] = std::array::from_fn(|u| _mm512_loadu_ps(po.add(j0 + 16 * u)));
        for (&w, row) in weights.iter().zip(rows) {
            let w = _mm512_set1_ps(w);
            for (u, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(w, _mm512_loadu_ps(row.as_ptr().add(j0 + 16 * u)), *a);
            }
        }
        for (u, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(po.add(j0 + 16 * u), *a);
        }
    }
    if whole < d {
        let tails: Vec<&[f32]> = rows.iter().map(|r| &r[whole..]).collect();
        add_weighted_rows_plain(&mut out[whole..], weights, &tails);
    }
}

/// mHC's post-mix of one token, in place: each of the `hc` streams of
/// `streams` (`hc × d`) becomes `post[k] · o`, then `+ comb[j · hc + k] ·
/// stream j` for `j` in order (over the streams as they were), each product
/// rounded before its sum: the bits of [`scale_into`] then [`add_scaled`]
/// per stream. AVX-512 with four streams holds a strip of every stream in
/// registers and writes it back once, where the separate passes loaded and
/// stored each output stream five times.
pub fn mix_streams(streams: &mut [f32], o: &[f32], post: &[f32], comb: &[f32]) {
    let (hc, d) = (post.len(), o.len());
    assert!(streams.len() == hc * d && comb.len() == hc * hc, "mix_streams shapes");
    #[cfg(target_arch = "x86_64")]
    if hc == 4 && matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F; shapes checked above.
        return unsafe { mix_four_streams_avx512(streams, o, post, comb) };
    }
    // Strips of 16 columns: every stream's old values held while each output is made.
    let mut old = vec![[0.0f32; 16]; hc];
    for c0 in (0..d).step_by(16) {
        let width = 16.min(d - c0);
        for (j, strip) in old.iter_mut().enumerate() {
            strip[..width].copy_from_slice(&streams[j * d + c0..][..width]);
        }
        for k in 0..hc {
            let out = &mut streams[k * d + c0..][..width];
            scale_into(out, post[k], &o[c0..c0 + width]);
            for (j, strip) in old.iter().enumerate() {
                add_scaled_plain(out, comb[j * hc + k], &strip[..width]);
            }
        }
    }
}

/// # Safety
/// The CPU must support AVX-512F; `streams` is `4 × o.len()`, `post` 4 and `comb` 16 long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn mix_four_streams_avx512(streams: &mut [f32], o: &[f32], post: &[f32], comb: &[f32]) {
    use std::arch::x86_64::*;
    let d = o.len();
    let whole = d / 16 * 16;
    let ps = streams.as_mut_ptr();
    let (post_v, comb_v): ([__m512; 4], [__m512; 16]) =
        (std::array::from_fn(|k| _mm512_set1_ps(post[k])), std::array::from_fn(|i| _mm512_set1_ps(comb[i])));
    for c in (0..whole).step_by(16) {
        let x = _mm512_loadu_ps(o.as_ptr().add(c));
        let old: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(ps.add(j * d + c)));
        for k in 0..4 {
            let mut acc = _mm512_mul_ps(post_v[k], x);
            for (j, s) in old.iter().enumerate() {
                acc = _mm512_add_ps(acc, _mm512_mul_ps(comb_v[j * 4 + k], *s));
            }
            _mm512_storeu_ps(ps.add(k * d + c), acc);
        }
    }
    for c in whole..d {
        let old: [f32; 4] = std::array::from_fn(|j| streams[j * d + c]);
        for k in 0..4 {
            let mut acc = post[k] * o[c];
            for (j, s) in old.iter().enumerate() {
                acc += comb[j * 4 + k] * s;
            }
            streams[k * d + c] = acc;
        }
    }
}

/// `out[d] += weights[k] · (rows[k][d] as f64)` for every row in turn, the
/// product rounded before the sum: the bits of the plain loop on every path.
/// AVX-512 keeps 32 columns of `out` in registers across all rows instead of
/// loading and storing them once per row (V4.1's probabilities times its
/// values, summed in f64).
pub fn add_weighted_rows_f64(out: &mut [f64], weights: &[f64], rows: &[&[f32]]) {
    assert_eq!(weights.len(), rows.len(), "add_weighted_rows_f64: one weight per row");
    assert!(rows.iter().all(|r| r.len() == out.len()), "add_weighted_rows_f64: row lengths");
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F; lengths checked above.
        return unsafe { add_weighted_rows_f64_avx512(out, weights, rows) };
    }
    add_weighted_rows_f64_plain(out, weights, rows);
}

#[inline(always)]
fn add_weighted_rows_f64_plain(out: &mut [f64], weights: &[f64], rows: &[&[f32]]) {
    for (&w, row) in weights.iter().zip(rows) {
        out.iter_mut().zip(*row).for_each(|(o, &v)| *o += w * v as f64);
    }
}

/// # Safety
/// The CPU must support AVX-512F; every row is `out.len()` long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_weighted_rows_f64_avx512(out: &mut [f64], weights: &[f64], rows: &[&[f32]]) {
    use std::arch::x86_64::*;
    const STRIP: usize = 32;
    let d = out.len();
    let po = out.as_mut_ptr();
    let whole = d / STRIP * STRIP;
    for j0 in (0..whole).step_by(STRIP) {
        let mut acc: [__m512d; 4] = std::array::from_fn(|u| _mm512_loadu_pd(po.add(j0 + 8 * u)));
        for (&w, row) in weights.iter().zip(rows) {
            let w = _mm512_set1_pd(w);
            for (u, a) in acc.iter_mut().enumerate() {
                let v = _mm512_cvtps_pd(_mm256_loadu_ps(row.as_ptr().add(j0 + 8 * u)));
                // Product rounded, then the sum: the plain loop's two roundings.
                *a = _mm512_add_pd(*a, _mm512_mul_pd(w, v));
            }
        }
        for (u, a) in acc.iter().enumerate() {
            _mm512_storeu_pd(po.add(j0 + 8 * u), *a);
        }
    }
    if whole < d {
        let tails: Vec<&[f32]> = rows.iter().map(|r| &r[whole..]).collect();
        add_weighted_rows_f64_plain(&mut out[whole..], weights, &tails);
    }
}

/// [`add_weighted_rows`] for `heads` outputs over the same rows: output `h`
/// (`out[h * d..][..d]`, `d` the rows' length) gets the weights
/// `weights[h * stride..][..rows.len()]`, with exactly the bits of its own
/// call. AVX-512 takes four heads at a time, so each row's values are loaded
/// once for four heads instead of once per head (attention's heads share one
/// key/value head).
pub fn add_weighted_rows_heads(out: &mut [f32], heads: usize, weights: &[f32], stride: usize, rows: &[&[f32]]) {
    let k = rows.len();
    assert!(heads > 0 && out.len().is_multiple_of(heads), "heads");
    assert!(stride >= k && weights.len() >= (heads - 1) * stride + k, "add_weighted_rows_heads weights");
    let d = out.len() / heads;
    assert!(rows.iter().all(|r| r.len() == d), "add_weighted_rows_heads row lengths");
    // Heads done four at a time where the CPU has 16-lane registers.
    let fours = match crate::Isa::detect() {
        #[cfg(target_arch = "x86_64")]
        crate::Isa::Avx512 => heads / 4,
        _ => 0,
    };
    #[cfg(target_arch = "x86_64")]
    for h0 in (0..fours).map(|f| 4 * f) {
        // SAFETY: the detected path guarantees AVX-512F; four heads of `d`
        // outputs start at `h0`, each with `k` weights `stride` apart, and
        // every row is `d` long.
        unsafe { add_weighted_rows_4_avx512(&mut out[h0 * d..][..4 * d], &weights[h0 * stride..], stride, rows) };
    }
    for h in 4 * fours..heads {
        add_weighted_rows(&mut out[h * d..][..d], &weights[h * stride..][..k], rows);
    }
}

/// Four heads of [`add_weighted_rows_heads`]: 64 columns of each head's
/// output in registers (16 of them) across all rows.
///
/// # Safety
/// The CPU must support AVX-512F; `out.len() == 4 * d` for rows `d` long,
/// and `weights` holds four heads of `rows.len()` weights `stride` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn add_weighted_rows_4_avx512(out: &mut [f32], weights: &[f32], stride: usize, rows: &[&[f32]]) {
    use std::arch::x86_64::*;
    const STRIP: usize = 64;
    let k = rows.len();
    let d = out.len() / 4;
    assert!(weights.len() >= 3 * stride + k, "four heads of weights");
    assert!(out.len() == 4 * d && rows.iter().all(|r| r.len() == d), "four heads of rows");
    let (po, pw) = (out.as_mut_ptr(), weights.as_ptr());
    let whole = d / STRIP * STRIP;
    for j0 in (0..whole).step_by(STRIP) {
        let mut acc: [[__m512; 4]; 4] =
            std::array::from_fn(|h| std::array::from_fn(|u| _mm512_loadu_ps(po.add(h * d + j0 + 16 * u))));
        for (r, row) in rows.iter().enumerate() {
            let v: [__m512; 4] = std::array::from_fn(|u| _mm512_loadu_ps(row.as_ptr().add(j0 + 16 * u)));
            for (h, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pw.add(h * stride + r));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(w, *v, *a);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            for (u, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(po.add(h * d + j0 + 16 * u), *a);
            }
        }
    }
    if whole < d {
        let tails: Vec<&[f32]> = rows.iter().map(|r| &r[whole..]).collect();
        for h in 0..4 {
            add_weighted_rows_plain(&mut out[h * d + whole..(h + 1) * d], &weights[h * stride..][..k], &tails);
        }
    }
}

/// Plain softmax in place.
pub fn softmax(x: &mut [f32]) {
    // A sink of −inf takes no mass: exp(−inf − max) adds zero to the sum.
    softmax_with_sink(x, f32::NEG_INFINITY);
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// SwiGLU with DeepSeek-V4's clamps, in place of the gate:
/// `gate ← silu(min(gate, limit)) · clamp(up, −limit, limit)` (the gate's
/// buffer is dead once read, so the activation takes it instead of a third).
pub fn swiglu_clamped(gate: &mut [f32], up: &[f32], limit: f32) {
    assert_eq!(gate.len(), up.len(), "swiglu lengths");
    // The exponentials of a chunk at once (vectorised), then the scalar
    // formula of `silu` on each: the bits of `silu(g) · u` element by element.
    const CHUNK: usize = 256;
    let mut e = [0.0f32; CHUNK];
    for (g, u) in gate.chunks_mut(CHUNK).zip(up.chunks(CHUNK)) {
        let e = &mut e[..g.len()];
        e.iter_mut().zip(g.iter()).for_each(|(e, &g)| *e = -g.min(limit));
        exp_in_place(e);
        for ((g, &u), &e) in g.iter_mut().zip(u).zip(e.iter()) {
            let clamped = g.min(limit);
            *g = clamped * (1.0 / (1.0 + e)) * u.clamp(-limit, limit);
        }
    }
}

/// `sqrt(softplus(x))`, the V4 router score; softplus as torch computes it
/// (linear above 20).
#[inline]
pub fn sqrt_softplus(x: f32) -> f32 {
    let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
    softplus.sqrt()
}

/// Indices of the `k` largest values, largest first; equal values (−0 equals +0) go
/// to the lower index, as a stable sort by value gives. NaN sorts below everything.
///
/// Exact ties are common in the lightning indexer (a score is exactly zero wherever
/// every head's ReLU clips), so the rule decides real selections; it depends on
/// nothing but the values and their order, so a prefix's choices never change when
/// entries are appended.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    // `+ 0.0` turns −0 into +0, which `total_cmp` would otherwise rank below it.
    let key = |i: usize| if values[i].is_nan() { f32::NEG_INFINITY } else { values[i] + 0.0 };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Sinkhorn-Knopp projection of an `n × n` positive matrix (row-major) towards a
/// doubly-stochastic one, as mHC does it: one column normalisation, then
/// `iters − 1` rounds of row then column normalisation, each with `eps` added to
/// the divisor.
pub fn sinkhorn(m: &mut [f32], n: usize, iters: usize, eps: f32) {
    assert_eq!(m.len(), n * n);
    if let Ok(four) = <&mut [f32; 16]>::try_from(&mut *m) {
        return sinkhorn4(four, iters, eps);
    }
    let normalize_columns = |m: &mut [f32]| {
        for c in 0..n {
            let mut s = 0.0f32;
            for r in 0..n {
                s += m[r * n + c];
            }
            let d = s + eps;
            for r in 0..n {
                m[r * n + c] /= d;
            }
        }
    };
    normalize_columns(m);
    for _ in 1..iters {
        for r in 0..n {
            let row = &mut m[r * n..(r + 1) * n];
            let d = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= d);
        }
        normalize_columns(m);
    }
}

/// [`sinkhorn`] of a 4 × 4 matrix (mHC's four streams), its rows held as
/// four-lane arrays so that each normalisation divides four lanes at once:
/// every element sees the same sums and divisions in the same order.
fn sinkhorn4(m: &mut [f32; 16], iters: usize, eps: f32) {
    let mut rows: [[f32; 4]; 4] = std::array::from_fn(|r| std::array::from_fn(|c| m[4 * r + c]));
    let normalize_columns = |rows: &mut [[f32; 4]; 4]| {
        // Each column's sum from +0.0 in row order, as the general loop.
        let mut sums = [0.0f32; 4];
        for row in rows.iter() {
            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
        }
        let divisors = sums.map(|s| s + eps);
        for row in rows.iter_mut() {
            row.iter_mut().zip(&divisors).for_each(|(v, d)| *v /= d);
        }
    };
    normalize_columns(&mut rows);
    for _ in 1..iters {
        for row in rows.iter_mut() {
            let divisor = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= divisor);
        }
        normalize_columns(&mut rows);
    }
    for (r, row) in rows.iter().enumerate() {
        m[4 * r..4 * r + 4].copy_from_slice(row);
    }
}
