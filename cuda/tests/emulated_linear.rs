//! The linear kernels (`cuda/kernels/linear.cu`) on the emulated device
//! against `Linear::forward` and `Linear::dequantize_row`, bit for bit, for
//! every weight format, batch sizes 1, 3 and 17, strided rows, and shapes
//! that leave tails in every tiling (outputs, columns, scale blocks).

use deepinfer_cuda::ops::linear::{gather_rows, linear_forward, DeviceLinear};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::dtype::f32_to_bf16;
use deepinfer_kernels::quantize::{quantize_fp4_rows, quantize_fp8_blocks};
use deepinfer_kernels::{Linear, WeightFormat};

/// SplitMix64 values in [-1, 1), every 37th scaled far out so that scale
/// blocks differ and a sum in another order would differ in its bits.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|i| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let v = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 37 == 0 {
                v * 300.0
            } else {
                v
            }
        })
        .collect()
}

fn f32_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    Linear::from_f32(rows, cols, values(rows * cols, seed))
}

fn bf16_linear(rows: usize, cols: usize, seed: u64) -> Linear {
    let bytes: Vec<u8> = values(rows * cols, seed).iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
    Linear { rows, cols, format: WeightFormat::Bf16(bytes.into()) }
}

fn fp8_linear(rows: usize, cols: usize, block: usize, seed: u64) -> Linear {
    quantize_fp8_blocks(&values(rows * cols, seed), rows, cols, block).into_fp8_linear(rows, cols, block)
}

fn fp4_linear(rows: usize, cols: usize, block: usize, seed: u64) -> Linear {
    quantize_fp4_rows(&values(rows * cols, seed), rows, cols, block).into_fp4_linear(rows, cols, block)
}

/// Every format and shape the tests run: (what, weight).
fn weights() -> Vec<(String, Linear)> {
    let mut all = Vec::new();
    for (rows, cols) in [(1, 1), (7, 17), (100, 33), (200, 300)] {
        all.push((format!("f32 {rows}x{cols}"), f32_linear(rows, cols, 1 + rows as u64)));
        all.push((format!("bf16 {rows}x{cols}"), bf16_linear(rows, cols, 2 + rows as u64)));
    }
    for (rows, cols, block) in [(256, 256, 128), (200, 300, 128), (7, 17, 128), (70, 96, 32), (129, 100, 32)] {
        all.push((format!("fp8 {rows}x{cols} blocks {block}"), fp8_linear(rows, cols, block, 3 + rows as u64)));
    }
    for (rows, cols, block) in [(70, 96, 32), (129, 64, 32), (5, 160, 32), (17, 48, 16)] {
        all.push((format!("fp4 {rows}x{cols} blocks {block}"), fp4_linear(rows, cols, block, 4 + rows as u64)));
    }
    all
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `linear_forward` of `w` (uploaded from `upload`, the same values) over
/// `n` rows of x, with x and out strided inside larger buffers; checks the
/// padding is untouched and returns the outputs packed `[n][rows]`.
fn device_forward(gpu: &Gpu, upload: &Linear, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (upload.rows, upload.cols);
    let dw = DeviceLinear::upload(gpu, upload).unwrap();
    assert_eq!((dw.rows, dw.cols), (rows, cols));
    let (x_off, x_stride) = (5, cols + 3);
    let (o_off, o_stride) = (2, rows + 7);
    let mut xs = vec![-7.5f32; x_off + n * x_stride];
    for i in 0..n {
        xs[x_off + i * x_stride..][..cols].copy_from_slice(&x[i * cols..][..cols]);
    }
    let xd = gpu.upload(&xs).unwrap();
    let sentinel = f32::from_bits(0x7fc0_1234);
    let od = gpu.upload(&vec![sentinel; o_off + n * o_stride]).unwrap();
    linear_forward(gpu, &dw, Rows::new(&xd, x_off, x_stride), n, Rows::new(&od, o_off, o_stride)).unwrap();
    let got = gpu.download(&od).unwrap();
    let mut out = Vec::with_capacity(n * rows);
    for (i, v) in got.iter().enumerate() {
        let inside = i >= o_off && (i - o_off) % o_stride < rows && (i - o_off) / o_stride < n;
        if inside {
            out.push(*v);
        } else {
            assert_eq!(v.to_bits(), sentinel.to_bits(), "element {i} outside the output rows was written");
        }
    }
    out
}

#[test]
fn linear_forward_matches_the_cpu_bit_for_bit_in_every_format() {
    let gpu = Gpu::emulated();
    for (what, w) in weights() {
        for n in [1usize, 3, 17] {
            let x = values(n * w.cols, 99 + n as u64);
            let mut expect = vec![0.0f32; n * w.rows];
            w.forward(&x, n, &mut expect);
            assert_eq!(bits(&expect), bits(&w.forward_reference(&x, n)), "{what}: the CPU's own definition");
            let got = device_forward(&gpu, &w, &x, n);
            assert_eq!(bits(&got), bits(&expect), "{what}, n = {n}");
        }
    }
}

#[test]
fn linear_forward_of_a_decode_layout_weight_matches_the_cpu() {
    let gpu = Gpu::emulated();
    for (what, w) in weights() {
        let panels = w.into_decode_layout();
        assert!(matches!(panels.format, WeightFormat::Panels(_)));
        for n in [1usize, 17] {
            let x = values(n * panels.cols, 7 + n as u64);
            let mut expect = vec![0.0f32; n * panels.rows];
            panels.forward(&x, n, &mut expect);
            let got = device_forward(&gpu, &panels, &x, n);
            assert_eq!(bits(&got), bits(&expect), "{what} (decode layout), n = {n}");
        }
    }
}

#[test]
fn a_row_has_the_same_bits_in_any_batch() {
    let gpu = Gpu::emulated();
    let w = fp8_linear(200, 300, 128, 11);
    let x = values(17 * 300, 12);
    let all = device_forward(&gpu, &w, &x, 17);
    for i in [0usize, 5, 16] {
        let one = device_forward(&gpu, &w, &x[i * 300..][..300], 1);
        assert_eq!(bits(&one), bits(&all[i * 200..][..200]), "row {i}");
    }
}

#[test]
fn nan_fp8_codes_give_nan_outputs_where_the_cpu_does() {
    let gpu = Gpu::emulated();
    let (rows, cols, block) = (130, 100, 32);
    let mut q = quantize_fp8_blocks(&values(rows * cols, 21), rows, cols, block);
    q.codes[3 * cols + 40] = 0x7f;
    q.codes[129 * cols + 99] = 0xff;
    let w = q.into_fp8_linear(rows, cols, block);
    for n in [1usize, 3] {
        let x = values(n * cols, 22);
        let mut expect = vec![0.0f32; n * rows];
        w.forward(&x, n, &mut expect);
        let got = device_forward(&gpu, &w, &x, n);
        let nans = expect.iter().filter(|v| v.is_nan()).count();
        assert_eq!(nans, 2 * n, "the CPU's NaN outputs");
        for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
            if e.is_nan() {
                assert!(g.is_nan(), "output {i}: {g} where the CPU has NaN");
            } else {
                assert_eq!(g.to_bits(), e.to_bits(), "output {i}");
            }
        }
    }
}

#[test]
fn gather_rows_matches_dequantize_row_bit_for_bit() {
    let gpu = Gpu::emulated();
    for (what, w) in weights() {
        for layout in [w.clone(), w.clone().into_decode_layout()] {
            let (rows, cols) = (layout.rows, layout.cols);
            let n = 17;
            let ids: Vec<u32> = (0..n as u32)
                .map(|i| match i {
                    3 => rows as u32,
                    7 => u32::MAX,
                    _ => (i * 31 + 2) % rows as u32,
                })
                .collect();
            let dw = DeviceLinear::upload(&gpu, &layout).unwrap();
            let idd = gpu.upload(&ids).unwrap();
            let (off, stride) = (3, cols + 5);
            let od = gpu.zeros::<f32>(off + n * stride).unwrap();
            gather_rows(&gpu, &dw, &idd, n, Rows::new(&od, off, stride)).unwrap();
            let got = gpu.download(&od).unwrap();
            let mut row = vec![0.0f32; cols];
            for (i, &id) in ids.iter().enumerate() {
                layout.dequantize_row((id as usize).min(rows - 1), &mut row);
                assert_eq!(bits(&got[off + i * stride..][..cols]), bits(&row), "{what}: row {i} (id {id})");
            }
        }
    }
}

#[test]
fn storage_is_the_published_weight() {
    let gpu = Gpu::emulated();
    for (what, w) in weights() {
        let dw = DeviceLinear::upload(&gpu, &w).unwrap();
        assert_eq!(dw.storage_bytes(), w.storage_bytes(), "{what}");
        let from_panels = DeviceLinear::upload(&gpu, &w.clone().into_decode_layout()).unwrap();
        assert_eq!(from_panels.storage_bytes(), w.clone().into_decode_layout().into_published().storage_bytes());
    }
}

#[test]
fn no_rows_do_nothing() {
    let gpu = Gpu::emulated();
    let w = DeviceLinear::upload(&gpu, &f32_linear(7, 17, 1)).unwrap();
    let x = gpu.zeros::<f32>(0).unwrap();
    let out = gpu.zeros::<f32>(0).unwrap();
    linear_forward(&gpu, &w, Rows::packed(&x, 17), 0, Rows::packed(&out, 7)).unwrap();
    let ids = gpu.zeros::<u32>(0).unwrap();
    gather_rows(&gpu, &w, &ids, 0, Rows::packed(&out, 17)).unwrap();
}
