//! Throughput of the linear kernels on a device, as JSON: TFLOP/s and the
//! weights' bytes per second at decode and prefill row counts, beside the
//! H100 SXM datasheet (989 dense BF16 TFLOP/s, 1,979 FP8, 3.35 TB/s HBM3).
//! Beside each, the split-K variant (`ops::linear_splitk`) with the
//! speed-first `split_for_batch(n, rows)` splits (its scratch allocated once,
//! outside the timing): `"split_k"` and `"invariance_cost"` = portable seconds
//! / split seconds (> 1: what batch invariance costs at that batch size), and
//! how many outputs of the split result differ in their bits from the portable.
//!
//! `linear_bench --device cuda|emulated [--quick]` (`tools/gpu/check.sh` runs it).

use std::time::Instant;

use deepinfer_cuda::ops::linear::{linear_forward, DeviceLinear};
use deepinfer_cuda::ops::linear_splitk::{linear_forward_split_with_scratch, scratch_len, split_for_batch};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::quantize::quantize_fp8_blocks;
use deepinfer_kernels::Linear;

/// Seconds a call of `run` takes: one warm-up, then at least 3 calls and 0.3 s.
fn time(run: impl Fn()) -> f64 {
    run();
    let started = Instant::now();
    let mut iterations = 0u32;
    while iterations < 3 || started.elapsed().as_secs_f64() < 0.3 {
        run();
        iterations += 1;
    }
    started.elapsed().as_secs_f64() / iterations as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let device = args.iter().position(|a| a == "--device").and_then(|i| args.get(i + 1)).map_or("emulated", |s| s);
    let quick = args.iter().any(|a| a == "--quick");
    let gpu = match device {
        "cuda" => Gpu::cuda(0).unwrap_or_else(|e| {
            eprintln!("linear_bench: {e}");
            std::process::exit(1)
        }),
        _ => Gpu::emulated(),
    };
    let (rows, cols, batches): (usize, usize, &[usize]) =
        if quick { (256, 256, &[1, 8]) } else { (4096, 4096, &[1, 32, 256]) };
    let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 2654435761usize % 1000) as f32 - 500.0) / 700.0).collect();
    let weights = [
        ("fp8-128x128", quantize_fp8_blocks(&values, rows, cols, 128).into_fp8_linear(rows, cols, 128)),
        ("f32", Linear::from_f32(rows, cols, values)),
    ];
    let mut results = Vec::new();
    for (name, w) in &weights {
        let dw = DeviceLinear::upload(&gpu, w).expect("upload");
        let bytes = dw.storage_bytes();
        for &n in batches {
            let x: Vec<f32> = (0..n * cols).map(|i| (i % 17) as f32 / 17.0).collect();
            let xd = gpu.upload(&x).expect("x");
            let out = gpu.zeros::<f32>(n * rows).expect("out");
            let seconds = time(|| {
                linear_forward(&gpu, &dw, Rows::packed(&xd, cols), n, Rows::packed(&out, rows)).expect("launch");
                gpu.synchronize().expect("sync");
            });
            let tflops = 2.0 * (n * rows * cols) as f64 / seconds / 1e12;
            let splits = split_for_batch(n, rows);
            let scratch = gpu.zeros::<f32>(scratch_len(&dw, n, splits).max(1)).expect("scratch");
            let split_seconds = time(|| {
                linear_forward_split_with_scratch(
                    &gpu,
                    &dw,
                    Rows::packed(&xd, cols),
                    n,
                    Rows::packed(&out, rows),
                    splits,
                    &scratch,
                )
                .expect("launch");
                gpu.synchronize().expect("sync");
            });
            let split_tflops = 2.0 * (n * rows * cols) as f64 / split_seconds / 1e12;
            // The split result (left in `out` by the last run) beside the portable one.
            let split_out = gpu.download(&out).expect("download");
            linear_forward(&gpu, &dw, Rows::packed(&xd, cols), n, Rows::packed(&out, rows)).expect("launch");
            let portable_out = gpu.download(&out).expect("download");
            let differing = split_out.iter().zip(&portable_out).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let max_abs_diff = split_out.iter().zip(&portable_out).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            let datasheet = if name.starts_with("fp8") { 1979.0 } else { 989.0 };
            results.push(format!(
                "{{\"weight\": \"{name}\", \"rows\": {rows}, \"cols\": {cols}, \"n\": {n}, \"seconds\": {seconds:.6e}, \
                 \"tflops\": {tflops:.4}, \"fraction_of_datasheet\": {:.5}, \"weight_gb_per_s\": {:.3}, \
                 \"fraction_of_hbm\": {:.5}, \"split_k\": {{\"splits\": {splits}, \"seconds\": {split_seconds:.6e}, \
                 \"tflops\": {split_tflops:.4}, \"outputs_differing_from_portable\": {differing}, \
                 \"max_abs_diff\": {max_abs_diff:.3e}}}, \"invariance_cost\": {:.4}}}",
                tflops / datasheet,
                bytes as f64 / seconds / 1e9,
                bytes as f64 / seconds / 3.35e12,
                seconds / split_seconds
            ));
        }
    }
    println!("{{\"device\": \"{}\", \"results\": [\n{}\n]}}", gpu.name(), results.join(",\n"));
}
