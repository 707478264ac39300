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

/// Floats a thread keeps between calls of [`with_scratch`] (8 MiB: a
/// 512-token chunk's gate and up at V4-Flash's expert width); a larger
/// buffer is freed after its call.
const SCRATCH_FLOATS_MAX: usize = 1 << 21;

thread_local! {
    static SCRATCH: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `f` on `len` floats this thread used before, for a buffer that `f`
/// writes whole before reading it (a linear's output): no allocation and no
/// zeroing per call. What the floats hold on entry is unspecified. A call
/// nested in `f` on the same thread (a task stolen while `f` waits) gets a
/// fresh buffer. Each thread keeps at most [`SCRATCH_FLOATS_MAX`] floats for
/// its lifetime; a longer buffer is fresh zeros (spread over the threads),
/// freed after the call.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    if len > SCRATCH_FLOATS_MAX {
        return f(&mut zeros(len));
    }
    let mut buffer = SCRATCH.take();
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    let result = f(&mut buffer[..len]);
    SCRATCH.set(buffer);
    result
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
