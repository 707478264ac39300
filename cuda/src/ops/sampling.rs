//! Next-token sampling on the device (`cuda/kernels/sampling.cu`): the token
//! the engine's `sampling::sample` chooses for the same logits, parameters
//! and (seed, position).

use super::Rows;
use crate::{DeviceBuffer, DeviceError, Gpu};

/// Threads per row (the kernel's `DI_SAMPLE_THREADS`).
const THREADS: u32 = 256;

/// How one row chooses its token: the fields of the engine's
/// `SamplingParams` that decide it, and the row's position.
///
/// Logit bias and the repetition, frequency and presence penalties change
/// the logits before sampling (the engine's `adjust_logits`); they and the
/// reported log-probabilities stay with the caller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// Softmax temperature; 0 (or below, or NaN) is greedy.
    pub temperature: f32,
    /// Keep the `top_k` best-ranked tokens; 0 keeps all.
    pub top_k: usize,
    /// Nucleus mass; 1 (or above, or NaN) keeps all.
    pub top_p: f32,
    /// Drop tokens whose weight is below `min_p` of the best's.
    pub min_p: f32,
    /// Key of the request's random stream.
    pub seed: u64,
    /// The token position the draw is for.
    pub position: u64,
}

impl SampleRow {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0, position: 0 }
    }

    fn words(&self) -> [u64; 4] {
        // A top_k at or above the vocabulary keeps every token, as u32::MAX does.
        let top_k = u32::try_from(self.top_k).unwrap_or(u32::MAX);
        [
            u64::from(self.temperature.to_bits()) | u64::from(self.top_p.to_bits()) << 32,
            u64::from(self.min_p.to_bits()) | u64::from(top_k) << 32,
            self.seed,
            self.position,
        ]
    }

    fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }
}

/// The engine's `sampling::sample(row, params, position).token` for each of
/// `rows.len()` rows of `vocab` logits, into `out_tokens[r]`: the same token
/// for the same logits, parameters and (seed, position).
///
/// Greedy rows take the highest logit, the lowest id on ties. Others follow
/// the engine's chain in f64: weights `exp((x - max) / temperature)` with the
/// CPU's own `exp` (glibc's, FMA build, ported operation for operation),
/// min-p, top-k, top-p over the rank order (larger logit first, lower id on
/// ties), and the inverse-CDF walk in id order against `uniform(seed,
/// position)`. NaN logits count as -inf, +inf logits share the mass, a row
/// with no usable logit gives token 0.
///
/// Non-greedy rows need a scratch of `4 * vocab` u32 and `vocab` f64 per row,
/// allocated here for the call.
pub fn sample(
    gpu: &Gpu,
    logits: Rows,
    vocab: usize,
    rows: &[SampleRow],
    out_tokens: &DeviceBuffer<u32>,
) -> Result<(), DeviceError> {
    let n = rows.len();
    assert!(vocab > 0, "sample: an empty vocabulary");
    let vocab_i32 = i32::try_from(vocab).unwrap_or_else(|_| panic!("sample: vocab = {vocab} does not fit an int"));
    assert!(logits.stride >= vocab, "sample: logits stride {} below vocab = {vocab}", logits.stride);
    assert!(out_tokens.len() >= n, "sample: out_tokens holds {}, {n} rows", out_tokens.len());
    if n == 0 {
        return Ok(());
    }
    assert!(
        logits.offset + (n - 1) * logits.stride + vocab <= logits.buf.len(),
        "sample: logits hold {} values, {n} rows of {vocab} need more",
        logits.buf.len()
    );
    let stride = i32::try_from(logits.stride)
        .unwrap_or_else(|_| panic!("sample: logits stride {} does not fit an int", logits.stride));
    let words: Vec<u64> = rows.iter().flat_map(SampleRow::words).collect();
    let params = gpu.upload(&words)?;
    // Greedy-only batches touch no scratch.
    let scratch_rows = if rows.iter().all(SampleRow::is_greedy) { 0 } else { n };
    let scratch = gpu.zeros::<u32>(scratch_rows * 4 * vocab)?;
    let weights = gpu.zeros::<f64>(scratch_rows * vocab)?;
    gpu.launch(
        "sample_rows",
        (n as u32, 1, 1),
        (THREADS, 1, 1),
        0,
        &[logits.arg(), stride.into(), vocab_i32.into(), params.arg(), scratch.arg(), weights.arg(), out_tokens.arg()],
    )
}

/// `y[i] = f64::exp(x[i])` as [`sample`] computes its weights (the port of
/// glibc's `exp`), for `x.len()` values: how a test holds the port to the
/// host's libm.
pub fn libm_exp(gpu: &Gpu, x: &DeviceBuffer<f64>, y: &DeviceBuffer<f64>) -> Result<(), DeviceError> {
    assert!(y.len() >= x.len(), "libm_exp: y holds {}, x {}", y.len(), x.len());
    if x.is_empty() {
        return Ok(());
    }
    let n = i32::try_from(x.len()).unwrap_or_else(|_| panic!("libm_exp: {} values do not fit an int", x.len()));
    let blocks = x.len().div_ceil(THREADS as usize) as u32;
    gpu.launch("sampling_libm_exp", (blocks, 1, 1), (THREADS, 1, 1), 0, &[x.arg(), y.arg(), n.into()])
}
