//! The device's sampling kernel (`deepinfer_cuda::ops::sampling::sample`) on
//! the emulated device against the engine's `sampling::sample`: the same
//! token for every row, parameter set, seed and position.

use deepinfer_cuda::ops::sampling::{sample as device_sample, SampleRow};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_engine::sampling::{sample, uniform, SamplingParams};

/// Deterministic logits: on a coarse grid (ties across tokens) when `grid`,
/// else smooth in [-scale, scale).
fn logits(vocab: usize, seed: u64, scale: f64, grid: bool) -> Vec<f32> {
    (0..vocab as u64)
        .map(|i| {
            let u = uniform(seed ^ 0xabcd, i) * 2.0 - 1.0;
            if grid {
                ((u * 8.0).round() * 0.5) as f32
            } else {
                (u * scale) as f32
            }
        })
        .collect()
}

fn params_of(row: &SampleRow) -> SamplingParams {
    SamplingParams {
        temperature: row.temperature,
        top_k: row.top_k,
        top_p: row.top_p,
        min_p: row.min_p,
        seed: row.seed,
        ..SamplingParams::default()
    }
}

/// Runs `rows` over `logits` (one row of `vocab` each) on the device and
/// checks every token against the engine's.
fn check(gpu: &Gpu, vocab: usize, logits: &[Vec<f32>], rows: &[SampleRow], what: &str) {
    assert_eq!(logits.len(), rows.len());
    // Rows strided inside a larger buffer.
    let stride = vocab + 3;
    let mut flat = vec![0.0f32; 1 + rows.len() * stride];
    for (r, l) in logits.iter().enumerate() {
        flat[1 + r * stride..][..vocab].copy_from_slice(l);
    }
    let buf = gpu.upload(&flat).unwrap();
    let out = gpu.zeros::<u32>(rows.len()).unwrap();
    device_sample(gpu, Rows::new(&buf, 1, stride), vocab, rows, &out).unwrap();
    let got = gpu.download(&out).unwrap();
    for (r, row) in rows.iter().enumerate() {
        let want = sample(&logits[r], &params_of(row), row.position).token;
        assert_eq!(got[r], want, "{what}: row {r} {row:?}");
    }
}

#[test]
fn greedy_takes_the_engines_token_ties_to_the_lower_id() {
    let gpu = deepinfer_cuda::test_gpu();
    for vocab in [1usize, 7, 300, 1000] {
        let mut rows_logits = Vec::new();
        for seed in 0..6u64 {
            rows_logits.push(logits(vocab, seed, 4.0, seed % 2 == 0));
        }
        // Every logit equal; ±0 as equals; the best last.
        rows_logits.push(vec![1.5; vocab]);
        let mut zeros = vec![-1.0f32; vocab];
        zeros[vocab - 1] = 0.0;
        zeros[vocab / 2] = -0.0;
        rows_logits.push(zeros);
        let mut last = vec![0.0f32; vocab];
        last[vocab - 1] = 9.0;
        rows_logits.push(last);
        let rows: Vec<SampleRow> = (0..rows_logits.len())
            .map(|i| SampleRow { temperature: [0.0, -1.0, f32::NAN][i % 3], ..SampleRow::greedy() })
            .collect();
        check(&gpu, vocab, &rows_logits, &rows, &format!("greedy vocab {vocab}"));
    }
}

#[test]
fn temperature_top_k_top_p_min_p_take_the_engines_token() {
    let gpu = deepinfer_cuda::test_gpu();
    for vocab in [300usize, 1000] {
        for temperature in [0.7f32, 1.3] {
            for top_k in [0usize, 1, 5, 50] {
                for top_p in [1.0f32, 0.9, 0.5] {
                    for min_p in [0.0f32, 0.05] {
                        let mut rows = Vec::new();
                        let mut rows_logits = Vec::new();
                        for i in 0..10u64 {
                            let seed = i * 7919 + top_k as u64;
                            rows.push(SampleRow {
                                temperature,
                                top_k,
                                top_p,
                                min_p,
                                seed,
                                position: i * 31 + vocab as u64,
                            });
                            rows_logits.push(logits(vocab, seed + 3, [2.0, 6.0][i as usize % 2], i % 3 == 0));
                        }
                        let what = format!("vocab {vocab} T {temperature} top_k {top_k} top_p {top_p} min_p {min_p}");
                        check(&gpu, vocab, &rows_logits, &rows, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn many_seeds_and_positions_draw_the_engines_tokens() {
    let gpu = deepinfer_cuda::test_gpu();
    let vocab = 300;
    // One row of logits, flat enough that draws spread over many tokens.
    let l = logits(vocab, 42, 1.5, false);
    for (top_k, top_p) in [(0usize, 1.0f32), (50, 0.9)] {
        let rows: Vec<SampleRow> = (0..64u64)
            .map(|i| SampleRow { temperature: 1.3, top_k, top_p, min_p: 0.0, seed: i / 8, position: i % 8 * 1000 + i })
            .collect();
        let rows_logits = vec![l.clone(); rows.len()];
        check(&gpu, vocab, &rows_logits, &rows, &format!("seeds/positions top_k {top_k} top_p {top_p}"));
        let got: std::collections::BTreeSet<u32> =
            rows.iter().map(|r| sample(&l, &params_of(r), r.position).token).collect();
        assert!(got.len() > 16, "the draws spread: {got:?}");
    }
}

#[test]
fn nan_and_infinite_logits_and_odd_params_take_the_engines_token() {
    let gpu = deepinfer_cuda::test_gpu();
    let vocab = 17;
    let base = logits(vocab, 5, 3.0, false);
    let mut with_nan = base.clone();
    with_nan[0] = f32::NAN;
    with_nan[3] = f32::NEG_INFINITY;
    let mut with_inf = base.clone();
    with_inf[4] = f32::INFINITY;
    with_inf[11] = f32::INFINITY;
    with_inf[2] = f32::NAN;
    let dead = vec![f32::NEG_INFINITY; vocab];
    let nans = vec![f32::NAN; vocab];
    let extreme = {
        let mut v = base.clone();
        v[1] = f32::MAX;
        v[6] = f32::MIN;
        v[9] = f32::MAX;
        v
    };
    let cases = [with_nan, with_inf, dead, nans, extreme, base];
    let params: [(f32, usize, f32, f32); 8] = [
        (1.0, 0, 0.9, 0.0),
        (1.0, 3, 1.0, 0.0),
        (1e-30, 0, 0.5, 0.0),
        (f32::INFINITY, 0, 1.0, 0.0),
        (1.0, 0, f32::NAN, 0.0),
        (1.0, 0, 1e-6, 0.0),
        (1.0, 0, 1.0, 1.0),
        (1.0, 0, 1.0, 1.5),
    ];
    for (c, l) in cases.iter().enumerate() {
        let rows: Vec<SampleRow> = (0..40u64)
            .map(|i| {
                let (temperature, top_k, top_p, min_p) = params[i as usize % params.len()];
                SampleRow { temperature, top_k, top_p, min_p, seed: i, position: i * 3 }
            })
            .collect();
        check(&gpu, vocab, &vec![l.clone(); rows.len()], &rows, &format!("case {c}"));
    }
}
