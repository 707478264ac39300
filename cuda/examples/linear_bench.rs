//! Throughput of the linear kernels on a device, as JSON: TFLOP/s and the
//! weights' bytes per second at decode and prefill row counts, beside the
//! H100 SXM datasheet (989 dense BF16 TFLOP/s, 1,979 FP8, 3.35 TB/s HBM3).
//!
//! `linear_bench --device cuda|emulated [--quick]` (`tools/gpu/check.sh` runs it).

use std::time::Instant;

use deepinfer_cuda::ops::linear::{linear_forward, DeviceLinear};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::quantize::quantize_fp8_blocks;
use deepinfer_kernels::Linear;

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
            let run = || {
                linear_forward(&gpu, &dw, Rows::packed(&xd, cols), n, Rows::packed(&out, rows)).expect("launch");
                gpu.synchronize().expect("sync");
            };
            run();
            let started = Instant::now();
            let mut iterations = 0u32;
            while iterations < 3 || started.elapsed().as_secs_f64() < 0.3 {
                run();
                iterations += 1;
            }
            let seconds = started.elapsed().as_secs_f64() / iterations as f64;
            let tflops = 2.0 * (n * rows * cols) as f64 / seconds / 1e12;
            let datasheet = if name.starts_with("fp8") { 1979.0 } else { 989.0 };
            results.push(format!(
                "{{\"weight\": \"{name}\", \"rows\": {rows}, \"cols\": {cols}, \"n\": {n}, \"seconds\": {seconds:.6e}, \
                 \"tflops\": {tflops:.4}, \"fraction_of_datasheet\": {:.5}, \"weight_gb_per_s\": {:.3}, \
                 \"fraction_of_hbm\": {:.5}}}",
                tflops / datasheet,
                bytes as f64 / seconds / 1e9,
                bytes as f64 / seconds / 3.35e12
            ));
        }
    }
    println!("{{\"device\": \"{}\", \"results\": [\n{}\n]}}", gpu.name(), results.join(",\n"));
}
