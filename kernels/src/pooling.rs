//! The compressor's gated pooling: a softmax down each column of a window's
//! gate logits, then the values weighted by it. Row by row over whole rows,
//! so every step runs on a row of columns at once instead of one column's
//! short series at a time, with the bits of the per-column steps.

use crate::exp::{exp, exp_in_place};
use crate::simd::reduce16;

/// Most rows of one window (a compressor's ratio, twice with overlap): a
/// call holds `rows × columns` floats of probabilities, so a configuration
/// cannot make one window take unbounded memory. DeepSeek's compressors pool
/// 4 and 128 slots; loaders refuse ratios past half this.
pub const POOL_ROWS_MAX: usize = 1 << 12;

/// `out[c] = Σ_r softmax(logits[·][c])[r] · values[r][c]` for every column
/// `c`: each column's softmax exactly as [`crate::ops::softmax`] computes it
/// on that column's series, then the products summed in row order from
/// −0.0 (an iterator's `sum`).
pub fn softmax_pool_columns(logits: &[&[f32]], values: &[&[f32]], out: &mut [f32]) {
    let (rows, d) = (logits.len(), out.len());
    assert!(rows == values.len() && rows <= POOL_ROWS_MAX, "softmax_pool_columns rows");
    assert!(logits.iter().chain(values).all(|r| r.len() == d), "softmax_pool_columns widths");
    #[cfg(target_arch = "x86_64")]
    if matches!(crate::Isa::detect(), crate::Isa::Avx512) {
        // SAFETY: the detected path guarantees AVX-512F; shapes checked above.
        return unsafe { softmax_pool_columns_avx512(logits, values, out) };
    }
    softmax_pool_columns_plain(logits, values, out);
}

/// The plain steps compiled for 16-lane registers (element-wise operations
/// and maxima: the same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_pool_columns_avx512(logits: &[&[f32]], values: &[&[f32]], out: &mut [f32]) {
    softmax_pool_columns_plain(logits, values, out);
}

#[inline(always)]
fn softmax_pool_columns_plain(logits: &[&[f32]], values: &[&[f32]], out: &mut [f32]) {
    let d = out.len();
    // Each column's largest logit that is not NaN (−inf for none). Which of
    // two equal zeros is found changes nothing below: `v − (±0)` and
    // `exp(±0)` do not see the sign.
    let mut max = vec![f32::NEG_INFINITY; d];
    for row in logits {
        max.iter_mut().zip(*row).for_each(|(m, &v)| *m = m.max(v));
    }
    // exp(logit − max), row by row; each column's sum in `sum_lanes`' order:
    // row `r` into lane `r % 16` from +0.0, then the fixed pairwise tree.
    let mut probs = vec![0.0f32; logits.len() * d];
    let mut lanes = vec![0.0f32; 16 * d];
    for (r, (row, p)) in logits.iter().zip(probs.chunks_exact_mut(d.max(1))).enumerate() {
        p.iter_mut().zip(*row).zip(&max).for_each(|((p, &l), &m)| *p = l - m);
        exp_in_place(p);
        lanes[(r % 16) * d..][..d].iter_mut().zip(p.iter()).for_each(|(s, &e)| *s += e);
    }
    let mut lane = [0.0f32; 16];
    let inv: Vec<f32> = (0..d)
        .map(|c| {
            lane.iter_mut().enumerate().for_each(|(k, l)| *l = lanes[k * d + c]);
            // The sink of a plain softmax, −inf, adds exp(−inf − max).
            1.0 / (exp(f32::NEG_INFINITY - max[c]) + reduce16(&lane))
        })
        .collect();
    out.fill(-0.0);
    for (p, v) in probs.chunks_exact(d.max(1)).zip(values) {
        for (((o, &p), &v), &inv) in out.iter_mut().zip(p).zip(*v).zip(&inv) {
            *o += (p * inv) * v;
        }
    }
}
