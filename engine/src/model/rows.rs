//! Per-token steps spread over the pool's threads for long passes; each
//! token's arithmetic is the same either way, so no bit moves.

use deepinfer_kernels::ops::rms_norm;
use rayon::prelude::*;

/// Tokens from which a pass spreads its per-token steps over threads.
const SPREAD_TOKENS_MIN: usize = 16;

/// Whether `n` tokens' per-token steps are spread over the pool's threads.
pub(crate) fn spread_tokens(n: usize) -> bool {
    n >= SPREAD_TOKENS_MIN && rayon::current_num_threads() > 1
}

/// Floats from which a fresh buffer is zeroed by every thread (1 MiB): the
/// allocator zeroes reused memory on the calling thread while the others wait.
const SPREAD_ZEROS_MIN: usize = 1 << 18;

/// `len` zeros, written by every thread when the buffer is large.
pub(crate) fn zeros(len: usize) -> Vec<f32> {
    if len >= SPREAD_ZEROS_MIN && rayon::current_num_threads() > 1 {
        (0..len).into_par_iter().map(|_| 0.0f32).collect()
    } else {
        vec![0.0f32; len]
    }
}

/// `step(t, row)` for every `width`-wide row `t` of `rows`.
pub(crate) fn each_token(rows: &mut [f32], width: usize, step: impl Fn(usize, &mut [f32]) + Sync) {
    if spread_tokens(rows.len() / width.max(1)) {
        rows.par_chunks_exact_mut(width).enumerate().for_each(|(t, row)| step(t, row));
    } else {
        rows.chunks_exact_mut(width).enumerate().for_each(|(t, row)| step(t, row));
    }
}

/// RMSNorm of every `width`-wide row of `rows`.
pub(crate) fn norm_rows(rows: &mut [f32], width: usize, weight: Option<&[f32]>, eps: f32) {
    each_token(rows, width, |_, row| rms_norm(row, weight, eps));
}
