//! The support of the `real_shapes_*` tests: V4-Flash's and V4.1-Flash's
//! dimensions, the input generators, the bit-for-bit comparison and the wall
//! time each test prints; in [`v4`] and [`v41`], the CPU references that are
//! private to the engine (which this crate does not depend on), faithful
//! copies of its code, as in the per-op tests (`emulated_*.rs`) they come from.
//!
//! Every test file includes this module and uses part of it: an item that
//! some file leaves unused says `#[allow(dead_code)]`.

use std::time::Instant;

use deepinfer_cuda::ops::linear::{linear_forward, DeviceLinear};
use deepinfer_cuda::ops::Rows;
use deepinfer_cuda::Gpu;
use deepinfer_kernels::act_quant::round_bf16;
use deepinfer_kernels::ops::{Rope, Yarn};
use deepinfer_kernels::quantize::Quantized;
use deepinfer_kernels::Linear;

pub mod v4;
pub mod v41;

// ---- V4-Flash and V4.1-Flash dimensions ------------------------------------

#[allow(dead_code)]
pub const V4_HIDDEN: usize = 4096;
#[allow(dead_code)]
pub const V41_HIDDEN: usize = 5120;
#[allow(dead_code)]
pub const HEADS: usize = 64;
#[allow(dead_code)]
pub const HEAD_DIM: usize = 512;
#[allow(dead_code)]
pub const ROPE_DIM: usize = 64;
#[allow(dead_code)]
pub const V4_Q_LORA: usize = 1024;
#[allow(dead_code)]
pub const V41_Q_LORA: usize = 1280;
#[allow(dead_code)]
pub const WINDOW: usize = 128;
#[allow(dead_code)]
pub const V4_INDEX_HEADS: usize = 64;
#[allow(dead_code)]
pub const V41_INDEX_HEADS: usize = 32;
#[allow(dead_code)]
pub const INDEX_HEAD_DIM: usize = 128;
#[allow(dead_code)]
pub const INDEX_TOPK: usize = 512;
#[allow(dead_code)]
pub const VOCAB: usize = 129_280;
#[allow(dead_code)]
pub const HC: usize = 4;
#[allow(dead_code)]
pub const SINKHORN_ITERS: usize = 20;

// ---- Helpers -----------------------------------------------------------------

/// SplitMix64, a small deterministic generator.
pub struct Gen(pub u64);

impl Gen {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Uniform in [-scale, scale).
    #[allow(dead_code)]
    pub fn vec(&mut self, len: usize, scale: f32) -> Vec<f32> {
        (0..len).map(|_| self.unit() * scale).collect()
    }
    /// [-1, 1) with every 37th value times 300: sums in another order round otherwise.
    #[allow(dead_code)]
    pub fn spiky(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|i| if i % 37 == 0 { 300.0 * self.unit() } else { self.unit() }).collect()
    }
    /// [`Gen::spiky`] rounded to bf16 (V4.1's activations are bf16-valued).
    #[allow(dead_code)]
    pub fn bf16(&mut self, len: usize) -> Vec<f32> {
        self.spiky(len).into_iter().map(round_bf16).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    #[allow(dead_code)]
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

#[allow(dead_code)]
pub fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let differ = got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count();
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: {differ} of {} values differ, the first at {i}: device {:e}, CPU {:e}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Prints a test's wall time when it ends.
#[allow(dead_code)]
pub struct Timer(&'static str, Instant);

impl Timer {
    #[allow(dead_code)]
    pub fn start(name: &'static str) -> Self {
        Timer(name, Instant::now())
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        eprintln!("real_shapes: {} took {:.2} s", self.0, self.1.elapsed().as_secs_f64());
    }
}

/// FP8 e4m3 codes (no NaN) with a UE8M0 scale per `block × block` tile.
#[allow(dead_code)]
pub fn fp8_weight(g: &mut Gen, rows: usize, cols: usize, block: usize) -> Linear {
    let mut codes = g.bytes(rows * cols);
    codes.iter_mut().filter(|c| **c & 0x7f == 0x7f).for_each(|c| *c &= 0xfe);
    let shape = (rows.div_ceil(block), cols.div_ceil(block));
    let scales: Vec<u8> = (0..shape.0 * shape.1).map(|_| 118 + g.below(12) as u8).collect();
    Quantized { codes, scales, scale_shape: shape }.into_fp8_linear(rows, cols, block)
}

/// FP4 e2m1 codes with a UE8M0 scale per 32 columns of each row.
#[allow(dead_code)]
pub fn fp4_weight(g: &mut Gen, rows: usize, cols: usize) -> Linear {
    let codes = g.bytes(rows * cols / 2);
    let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 118 + g.below(12) as u8).collect();
    Quantized { codes, scales, scale_shape: (rows, cols / 32) }.into_fp4_linear(rows, cols, 32)
}

/// `linear_forward` of `n` packed rows of `x`.
#[allow(dead_code)]
pub fn device_linear(gpu: &Gpu, w: &DeviceLinear, x: &[f32], n: usize) -> Vec<f32> {
    let xd = gpu.upload(x).unwrap();
    let od = gpu.upload(&vec![f32::NAN; n * w.rows]).unwrap();
    linear_forward(gpu, w, Rows::packed(&xd, w.cols), n, Rows::packed(&od, w.rows)).unwrap();
    gpu.download(&od).unwrap()
}

#[allow(dead_code)]
pub fn yarn() -> Yarn {
    Yarn {
        factor: 16.0,
        original_max_position_embeddings: 65536.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
        attention_factor: 1.0,
    }
}

/// `rope.cos_sin` of each position, `[positions][half]` each.
#[allow(dead_code)]
pub fn angles(rope: &Rope, positions: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let half = rope.inv_freq.len();
    let (mut cos, mut sin) = (vec![0.0f32; positions.len() * half], vec![0.0f32; positions.len() * half]);
    for (i, &p) in positions.iter().enumerate() {
        rope.cos_sin(p, &mut cos[i * half..][..half], &mut sin[i * half..][..half]);
    }
    (cos, sin)
}
