//! DeepSeek-V4.1's block-scaled product (FP8 activations × FP8 or FP4
//! weights) at the machine's speed, with the bits of its definition
//! ([`crate::act_quant::quantized_linear_reference`]).
//!
//! The definition sums each 32-wide K block of `a · w` exactly, rounds the sum
//! to f32, scales it by both block scales and accumulates the blocks in f32 in
//! K order. Because a block sum is exact, any instruction may compute it in any
//! order; only the scaling and the K-order accumulation (the same f32
//! operations on every path) fix the bits. So:
//!
//! - **FP4 weights** use integers: an e4m3 activation times 2^9 is an integer
//!   `A` with `|A| <= 448 · 2^9 < 2^18`, an e2m1 weight times 2 an integer `W`
//!   with `|W| <= 12`, and a block's `Σ A·W` stays below 2^27, so it is exact
//!   in i32. With AVX-512 VNNI, `A` is split into three signed bytes and `W`
//!   stored as the unsigned byte `W + 12`, and `vpdpbusd` adds 64 products a
//!   cycle (the `12 · Σ A` this adds is taken off per block). With NEON's
//!   `sdot` both sides are signed, so `W` is a signed byte and needs no offset.
//! - **FP8 weights** use f64: products of two e4m3 values are exact in f64 and
//!   a block's sum fits 41 bits, so eight f64 lanes sum it exactly. One x row
//!   loads 64 codes at once and moves each quadword's bytes under the f64
//!   exponent in turn (`vpmultishiftqb` where the CPU has VBMI), with x laid
//!   out to match; each block's lanes are added up at the end.
//!   NEON decodes a block once for up to four x rows and sums it in f64 pairs.
//! - **Batches** on AVX-512 (FP8 from two x rows, FP4 from
//!   [`WIDE_FP4_ROWS_MIN`] but never where AVX-512 runs on 256-bit units,
//!   [`BlockPath::Avx512VnniFp4Bytes`]) take [`wide_tiles`]: 24 weight rows decoded once
//!   to f64 per 128 columns, eight weight rows in each vector's lanes, so a
//!   block's sums need no reduction and every multiply-add serves eight
//!   products without decoding (FP4's products and sums are exact in f64 too).
//!
//! Rows holding a non-finite activation, and FP8 weights holding a NaN code,
//! take the definition's own loop instead.

use rayon::prelude::*;

use crate::act_quant::{Fp8Row, ACT_BLOCK};
use crate::dtype::{fp8_e4m3_to_f32, FP4_E2M1_VALUES};
use crate::linear::{Linear, WeightFormat};

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::{fp8_decode8, lane_byte_vbmi, multishift_controls};
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod wide_tiles;

/// Columns per FP4 digit group: one 64-byte line of codes.
#[cfg(target_arch = "x86_64")]
const GROUP_COLS: usize = 128;
/// Bytes of activation digits per group: three digits, even and odd columns.
#[cfg(target_arch = "x86_64")]
const GROUP_DIGIT_BYTES: usize = 6 * 64;
/// Block sums are produced 16 at a time; buffers are padded to this.
const BLOCKS_PER_VECTOR: usize = 16;
/// Twice the e2m1 value of each FP4 code (integers).
const FP4_DOUBLED: [i32; 16] = {
    let mut doubled = [0; 16];
    let mut code = 0;
    while code < 16 {
        doubled[code] = (2.0 * FP4_E2M1_VALUES[code]) as i32;
        code += 1;
    }
    doubled
};
/// Added to [`FP4_DOUBLED`] to make every weight an unsigned byte.
#[cfg(target_arch = "x86_64")]
const FP4_BYTE_OFFSET: i32 = 12;
/// `2 · e2m1 + 12` for every FP4 code: the unsigned weight byte of the VNNI path.
#[cfg(target_arch = "x86_64")]
const FP4_OFFSET_BYTES: [u8; 16] = {
    let mut bytes = [0; 16];
    let mut code = 0;
    while code < 16 {
        bytes[code] = (FP4_DOUBLED[code] + FP4_BYTE_OFFSET) as u8;
        code += 1;
    }
    bytes
};
/// Bytes of activation digits per 32-column block on NEON: three digits,
/// each in column order.
const BLOCK_DIGIT_BYTES: usize = 3 * ACT_BLOCK;
/// 2^1000: the AVX-512 FP8 kernel's activations are scaled by it, so that its
/// weights can be decoded as value · 2^-1016 without a multiply (exact: no
/// e4m3 value times 2^1000 overflows).
#[cfg(target_arch = "x86_64")]
const WIDE_SCALE: f64 = 1.071_508_607_186_267_3e301;
/// Multiply-adds above which a product is spread over threads (each output is
/// computed by one thread alone, so the split changes no bit). Handing work
/// to the pool costs a wake-up, several microseconds.
const PARALLEL_MIN_WORK: usize = 1 << 20;
/// Weight rows per parallel job.
const ROWS_PER_JOB: usize = 16;

/// A code path of the block-scaled product. Every path gives the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockPath {
    /// Plain Rust, any target.
    Portable,
    /// AVX-512F/BW/VL with VNNI: FP4 by `vpdpbusd`, FP8 in f64 lanes, and
    /// batches on the f64 wide tiles (FP4 from [`WIDE_FP4_ROWS_MIN`] rows).
    Avx512Vnni,
    /// [`BlockPath::Avx512Vnni`] with FP4 by `vpdpbusd` at every batch size:
    /// the faster choice where AVX-512 runs on 256-bit units (AMD Zen 4),
    /// whose f64 multiply-adds the wide tiles need come at half the rate
    /// (1,024 × 2,048 FP4, one thread: 51–53 GFLOP/s at 4 to 48 rows against
    /// the wide tiles' 34–46).
    Avx512VnniFp4Bytes,
    /// aarch64 NEON with the dot-product extension: FP4 by `sdot`, FP8 in f64 lanes.
    NeonDotprod,
}

impl BlockPath {
    /// Every path, the fastest last.
    pub const ALL: [BlockPath; 4] =
        [BlockPath::Portable, BlockPath::Avx512Vnni, BlockPath::Avx512VnniFp4Bytes, BlockPath::NeonDotprod];

    pub fn is_available(self) -> bool {
        match self {
            BlockPath::Portable => true,
            #[cfg(target_arch = "x86_64")]
            BlockPath::Avx512Vnni | BlockPath::Avx512VnniFp4Bytes => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            BlockPath::Avx512Vnni | BlockPath::Avx512VnniFp4Bytes => false,
            #[cfg(target_arch = "aarch64")]
            BlockPath::NeonDotprod => {
                std::arch::is_aarch64_feature_detected!("neon") && std::arch::is_aarch64_feature_detected!("dotprod")
            }
            #[cfg(not(target_arch = "aarch64"))]
            BlockPath::NeonDotprod => false,
        }
    }

    /// Whether this path runs the AVX-512 kernels.
    fn is_avx512(self) -> bool {
        matches!(self, BlockPath::Avx512Vnni | BlockPath::Avx512VnniFp4Bytes)
    }

    /// The fastest path this CPU supports (detected once).
    pub fn detect() -> BlockPath {
        static DETECTED: std::sync::OnceLock<BlockPath> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let fastest = BlockPath::ALL.into_iter().rev().find(|p| p.is_available()).unwrap_or(BlockPath::Portable);
            match fastest {
                BlockPath::Avx512VnniFp4Bytes if !avx512_on_256_bit_units() => BlockPath::Avx512Vnni,
                other => other,
            }
        })
    }
}

/// Whether this CPU runs 512-bit instructions on 256-bit units, one half
/// after the other: AMD's family 19h (Zen 3 has no AVX-512, so Zen 4). Zen 5
/// (1Ah) and Intel's cores have full-width units.
fn avx512_on_256_bit_units() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaves 0 and 1 exist on every x86-64 CPU.
        let (vendor, signature) = (std::arch::x86_64::__cpuid(0), std::arch::x86_64::__cpuid(1).eax);
        let amd = (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163);
        let base_family = (signature >> 8) & 0xf;
        let family = if base_family == 0xf { base_family + ((signature >> 20) & 0xff) } else { base_family };
        amd && family == 0x19
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `out[t · rows + r]` before the bf16 rounding: the block-scaled product of
/// quantised rows `acts` with an FP8 or FP4 weight whose scale blocks are 32
/// wide along K, on `path`. `None` when the inputs need the definition's own
/// loop (a non-finite activation, an FP8 NaN code) or the weight is not
/// block-scaled. Panics if this CPU lacks `path`.
pub fn block_scaled_product(path: BlockPath, w: &Linear, acts: &[Fp8Row]) -> Option<Vec<f32>> {
    assert!(path.is_available(), "{path:?} is not supported by this CPU");
    let (rows, cols, n) = (w.rows, w.cols, acts.len());
    assert!(cols.is_multiple_of(ACT_BLOCK), "{cols} columns are not whole blocks of {ACT_BLOCK}");
    assert!(acts.iter().all(|a| a.values.len() == cols && a.scales.len() == cols / ACT_BLOCK), "activation rows");
    let finite = acts.iter().all(|a| a.values.iter().all(|v| v.is_finite()) && a.scales.iter().all(|s| s.is_finite()));
    let weights = match &w.format {
        WeightFormat::Fp4 { data, scales, block_cols } if *block_cols == ACT_BLOCK => {
            assert!(data.len() >= rows * cols / 2 && scales.len() >= rows * (cols / ACT_BLOCK), "fp4 weight size");
            Weights::Fp4 { codes: data, scales }
        }
        WeightFormat::Fp8 { data, scales, block_rows, block_cols, nan_free } if *block_cols == ACT_BLOCK => {
            if !nan_free {
                return None;
            }
            assert!(data.len() >= rows * cols && scales.len() >= rows.div_ceil(*block_rows) * (cols / ACT_BLOCK));
            Weights::Fp8 { codes: data, scales, block_rows: *block_rows }
        }
        _ => return None,
    };
    if !finite {
        return None;
    }
    if n == 0 {
        return Some(Vec::new());
    }
    let wide = takes_wide_tiles(path, &weights, n);
    let prepared = Prepared::new(path, &weights, acts, cols, wide);
    let mut by_row = vec![0.0f32; rows * n];
    let rows_per_job = if wide { WIDE_ROWS_PER_JOB } else { ROWS_PER_JOB };
    // One scratch per worker, not per job.
    let job = |scratch: &mut Scratch, (j, chunk): (usize, &mut [f32])| {
        #[cfg(target_arch = "x86_64")]
        if wide {
            wide_tiles::outputs(&weights, &prepared, j * rows_per_job, chunk);
            return;
        }
        rows_outputs(path, &weights, &prepared, j * rows_per_job, cols, scratch, chunk);
    };
    if rayon::current_num_threads() > 1 && rows * cols * n >= PARALLEL_MIN_WORK {
        by_row.par_chunks_mut(rows_per_job * n).enumerate().for_each_init(|| Scratch::new(cols), job);
    } else {
        let mut scratch = Scratch::new(cols);
        by_row.chunks_mut(rows_per_job * n).enumerate().for_each(|item| job(&mut scratch, item));
    }
    if n == 1 {
        return Some(by_row);
    }
    let mut out = vec![0.0f32; n * rows];
    rows_to_tokens(&by_row, rows, n, &mut out);
    Some(out)
}

/// Weight rows per pass of [`rows_to_tokens`]: their `n` outputs each stay in
/// L1 while every token's run of them is written out contiguously.
const TRANSPOSE_ROWS: usize = 64;

/// `by_row[r * n + t]` laid out as `out[t * rows + r]`, a band of weight rows
/// at a time: one store per output row-by-row would touch a new cache line
/// (and, for long rows, a new page) on every store.
pub(crate) fn rows_to_tokens(by_row: &[f32], rows: usize, n: usize, out: &mut [f32]) {
    assert!(by_row.len() == rows * n && out.len() == rows * n, "{rows} rows of {n} outputs");
    for r0 in (0..rows).step_by(TRANSPOSE_ROWS) {
        let band = TRANSPOSE_ROWS.min(rows - r0);
        let src = &by_row[r0 * n..(r0 + band) * n];
        for t in 0..n {
            for (i, o) in out[t * rows + r0..][..band].iter_mut().enumerate() {
                *o = src[i * n + t];
            }
        }
    }
}

/// The weight as stored.
enum Weights<'a> {
    Fp4 { codes: &'a [u8], scales: &'a [f32] },
    Fp8 { codes: &'a [u8], scales: &'a [f32], block_rows: usize },
}

impl Weights<'_> {
    /// Row `r`'s scale of every K block.
    fn scale_row(&self, r: usize, blocks: usize) -> &[f32] {
        match self {
            Weights::Fp4 { scales, .. } => &scales[r * blocks..][..blocks],
            Weights::Fp8 { scales, block_rows, .. } => &scales[(r / block_rows) * blocks..][..blocks],
        }
    }
}

/// The activations in the form the path reads, made once per call.
struct Prepared<'a> {
    acts: &'a [Fp8Row],
    /// FP4: `A = a · 2^9` per column (portable), its digits per group (VNNI)
    /// or per block (NEON).
    ints: Vec<Vec<i32>>,
    digits: Vec<Vec<i8>>,
    /// FP4 with VNNI: `12 · Σ A` per block, padded to whole vectors.
    #[cfg(target_arch = "x86_64")]
    offsets: Vec<Vec<i32>>,
    /// FP8: the values in f64, a row each (on AVX-512 times [`WIDE_SCALE`]
    /// and in the one-row kernel's lane-byte order); on the wide tiles (FP8
    /// and FP4) groups of eight rows interleaved column by column instead.
    wide: Vec<Vec<f64>>,
    /// Each row's block scales, padded with zeros to whole vectors (every path reads these).
    a_scales: Vec<Vec<f32>>,
}

impl<'a> Prepared<'a> {
    fn new(path: BlockPath, weights: &Weights, acts: &'a [Fp8Row], cols: usize, wide_tiles: bool) -> Self {
        // Only AVX-512 has the wide tiles.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = wide_tiles;
        let blocks = padded_blocks(cols);
        let a_scales = acts
            .iter()
            .map(|a| {
                let mut padded = a.scales.clone();
                padded.resize(blocks, 0.0);
                padded
            })
            .collect();
        let mut prepared = Self {
            acts,
            ints: vec![],
            digits: vec![],
            #[cfg(target_arch = "x86_64")]
            offsets: vec![],
            wide: vec![],
            a_scales,
        };
        match weights {
            // The wide tiles decode FP4 weights to their values: x's own values meet them.
            #[cfg(target_arch = "x86_64")]
            Weights::Fp4 { .. } if wide_tiles => prepared.wide = wide_tiles::interleaved(acts, 1.0),
            #[cfg(target_arch = "x86_64")]
            Weights::Fp8 { .. } if wide_tiles => prepared.wide = wide_tiles::interleaved(acts, WIDE_SCALE),
            #[cfg(target_arch = "x86_64")]
            Weights::Fp4 { .. } if path.is_avx512() => {
                // SAFETY: the path's features (AVX-512F and BW among them) were checked.
                let (digits, offsets) = acts.iter().map(|a| unsafe { avx512::fp4_digits(&a.values) }).unzip();
                (prepared.digits, prepared.offsets) = (digits, offsets);
            }
            Weights::Fp4 { .. } => {
                prepared.ints = acts.iter().map(|a| a.values.iter().map(|&v| (v * 512.0) as i32).collect()).collect();
                if path == BlockPath::NeonDotprod {
                    prepared.digits = prepared.ints.iter().map(|a| block_digits(a)).collect();
                }
            }
            #[cfg(target_arch = "x86_64")]
            Weights::Fp8 { .. } if path.is_avx512() => {
                prepared.wide = acts.iter().map(|a| avx512::lane_bytes_x(&a.values, WIDE_SCALE)).collect();
            }
            Weights::Fp8 { .. } => {
                prepared.wide = acts.iter().map(|a| a.values.iter().map(|&v| v as f64).collect()).collect();
            }
        }
        prepared
    }
}

/// K blocks rounded up to whole vectors of block sums.
fn padded_blocks(cols: usize) -> usize {
    (cols / ACT_BLOCK).next_multiple_of(BLOCKS_PER_VECTOR)
}

/// `A` split into three signed bytes (`A = d0 + 2^8 d1 + 2^16 d2`), laid out
/// per 128-column group as d0 of the even columns, d0 of the odd ones, then
/// d1 and d2 likewise: byte `i` of each 64 is column `2i` or `2i + 1`, where
/// the weight's low and high nibbles land.
/// (The definition `avx512::fp4_digits` is held to.)
#[cfg(all(test, target_arch = "x86_64"))]
fn group_digits(ints: &[i32], cols: usize) -> Vec<i8> {
    // Whole quads of groups: the kernel reads four at a time.
    let groups = cols.div_ceil(GROUP_COLS).next_multiple_of(4);
    let mut digits = vec![0i8; groups * GROUP_DIGIT_BYTES];
    for (c, &a) in ints.iter().enumerate() {
        let (g, within) = (c / GROUP_COLS, c % GROUP_COLS);
        let (half, byte) = (within % 2, within / 2);
        for (k, d) in signed_digits(a).into_iter().enumerate() {
            digits[g * GROUP_DIGIT_BYTES + (2 * k + half) * 64 + byte] = d;
        }
    }
    digits
}

/// `A` split into three signed bytes as [`group_digits`] does, laid out per
/// 32-column block as d0 of its columns in order, then d1, then d2
/// ([`BLOCK_DIGIT_BYTES`] a block): what NEON's `sdot` meets the weights with.
fn block_digits(ints: &[i32]) -> Vec<i8> {
    let mut digits = vec![0i8; ints.len() / ACT_BLOCK * BLOCK_DIGIT_BYTES];
    for (c, &a) in ints.iter().enumerate() {
        let (b, within) = (c / ACT_BLOCK, c % ACT_BLOCK);
        for (k, d) in signed_digits(a).into_iter().enumerate() {
            digits[b * BLOCK_DIGIT_BYTES + k * ACT_BLOCK + within] = d;
        }
    }
    digits
}

/// `[d0, d1, d2]` with `a = d0 + 2^8 d1 + 2^16 d2`, each in `-128..128`
/// (exact for `|a| < 2^23`).
fn signed_digits(a: i32) -> [i8; 3] {
    let d0 = ((a + 128) & 255) - 128;
    let high = (a - d0) >> 8;
    let d1 = ((high + 128) & 255) - 128;
    let d2 = (high - d1) >> 8;
    [d0 as i8, d1 as i8, d2 as i8]
}

/// Per-job buffers: the block sums of each (weight row, x row) pair of a
/// group, pair `k` at `sums[k * blocks..]` (blocks padded to whole vectors).
struct Scratch {
    sums: Vec<f32>,
    blocks: usize,
}

impl Scratch {
    fn new(cols: usize) -> Self {
        let blocks = padded_blocks(cols);
        Self { sums: vec![0.0; PAIRS * blocks], blocks }
    }
}

/// (weight row, x row) pairs computed together: one vector of outputs.
const PAIRS: usize = 16;
/// x rows whose block sums one kernel call computes from one decoded weight row.
const X_ROWS_AT_ONCE: usize = 4;

/// Weight rows per parallel job on the wide tiles: two tiles.
const WIDE_ROWS_PER_JOB: usize = 48;
/// Fewest x rows for which FP4 weights take the wide tiles rather than
/// `vpdpbusd` (FP8 takes them from two rows).
const WIDE_FP4_ROWS_MIN: usize = 16;

/// Whether a batch of `n` x rows runs on [`wide_tiles`].
fn takes_wide_tiles(path: BlockPath, weights: &Weights, n: usize) -> bool {
    match weights {
        Weights::Fp4 { .. } => path == BlockPath::Avx512Vnni && n >= WIDE_FP4_ROWS_MIN,
        Weights::Fp8 { .. } => path.is_avx512() && n >= 2,
    }
}

/// Every x row's output for weight rows `first..`, `outputs[i * n + t]` for
/// weight row `first + i` and x row `t`.
fn rows_outputs(
    path: BlockPath,
    weights: &Weights,
    prepared: &Prepared,
    first: usize,
    cols: usize,
    scratch: &mut Scratch,
    outputs: &mut [f32],
) {
    let (blocks, stride, n) = (cols / ACT_BLOCK, scratch.blocks, prepared.acts.len());
    let weight_rows = outputs.len() / n;
    for t0 in (0..n).step_by(X_ROWS_AT_ONCE) {
        let m = X_ROWS_AT_ONCE.min(n - t0);
        // As many weight rows as fill the pairs: each output's K-order sum is
        // a chain of dependent adds, and a vector advances all the chains.
        let group = PAIRS / m;
        for i0 in (0..weight_rows).step_by(group) {
            let rows_here = group.min(weight_rows - i0);
            for i in 0..rows_here {
                let r = first + i0 + i;
                let sums = &mut scratch.sums[i * m * stride..][..m * stride];
                let w_scales = weights.scale_row(r, blocks);
                match weights {
                    Weights::Fp4 { codes, .. } => {
                        let codes = &codes[r * cols / 2..][..cols / 2];
                        fp4_block_sums(path, codes, prepared, t0..t0 + m, w_scales, sums, stride);
                    }
                    Weights::Fp8 { codes, .. } => {
                        let codes = &codes[r * cols..][..cols];
                        fp8_block_sums(path, codes, prepared, t0..t0 + m, w_scales, sums, stride);
                    }
                }
            }
            let sums = chain_sums(path, &scratch.sums, stride, blocks);
            for (k, &sum) in sums[..rows_here * m].iter().enumerate() {
                outputs[(i0 + k / m) * n + t0 + k % m] = sum;
            }
        }
    }
}

/// For each of the 16 rows of `products` (row `k` at `k * stride`), its first
/// `blocks` values added in order in f32 from zero: every row's chain advances
/// in one vector (rows past those filled add stale values and are dropped).
fn chain_sums(path: BlockPath, products: &[f32], stride: usize, blocks: usize) -> [f32; PAIRS] {
    assert!(products.len() >= PAIRS * stride && blocks <= stride && stride.is_multiple_of(BLOCKS_PER_VECTOR));
    #[cfg(target_arch = "x86_64")]
    if path.is_avx512() {
        // SAFETY: the path's features were checked; the assert above bounds every read.
        return unsafe { avx512::chain_sums(products, stride, blocks) };
    }
    let _ = path;
    let mut acc = [0.0f32; PAIRS];
    for b in 0..blocks {
        for (k, a) in acc.iter_mut().enumerate() {
            *a += products[k * stride + b];
        }
    }
    acc
}

/// Rounded block sums of one FP4 weight row (`cols / 2` code bytes) with x
/// rows `ts`: row `ts.start + i`'s at `sums[i * stride..]`.
fn fp4_block_sums(
    path: BlockPath,
    codes: &[u8],
    prepared: &Prepared,
    ts: std::ops::Range<usize>,
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "aarch64")]
    if path == BlockPath::NeonDotprod {
        // SAFETY: `block_scaled_product` checked that the CPU has the path's
        // features; the digits (per block), scales and sums are laid out as the kernel reads them.
        unsafe {
            neon::fp4_block_sums(codes, &prepared.digits[ts.clone()], &prepared.a_scales[ts], w_scales, sums, stride)
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if path.is_avx512() {
        // SAFETY: `block_scaled_product` checked that the CPU has the path's
        // features; the digits, offsets, scales and sums are laid out as the kernel reads them.
        unsafe {
            avx512::fp4_block_sums(
                codes,
                &prepared.digits[ts.clone()],
                &prepared.offsets[ts.clone()],
                &prepared.a_scales[ts],
                w_scales,
                sums,
                stride,
            )
        };
        return;
    }
    let _ = path;
    for (i, t) in ts.enumerate() {
        let a = &prepared.ints[t];
        let a_scales = &prepared.a_scales[t];
        for (b, (block, pairs)) in a.chunks_exact(ACT_BLOCK).zip(codes.chunks_exact(ACT_BLOCK / 2)).enumerate() {
            let mut sum = 0i32;
            for (x, &pair) in block.chunks_exact(2).zip(pairs) {
                sum += x[0] * fp4_doubled(pair & 0xf) + x[1] * fp4_doubled(pair >> 4);
            }
            // Exact: |sum| < 2^27; scaling by 2^-10 commutes with the rounding.
            sums[i * stride + b] = scaled(sum as f32 / 1024.0, a_scales[b], w_scales[b]);
        }
    }
}

/// A rounded block sum times both block scales, in the definition's order.
#[inline(always)]
fn scaled(sum: f32, a_scale: f32, w_scale: f32) -> f32 {
    sum * a_scale * w_scale
}

#[inline(always)]
fn fp4_doubled(code: u8) -> i32 {
    FP4_DOUBLED[code as usize]
}

/// Rounded block sums of one FP8 weight row (`cols` codes, none NaN) with x
/// rows `ts`, times both block scales: row `ts.start + i`'s at `sums[i * stride..]`.
fn fp8_block_sums(
    path: BlockPath,
    codes: &[u8],
    prepared: &Prepared,
    ts: std::ops::Range<usize>,
    w_scales: &[f32],
    sums: &mut [f32],
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if path.is_avx512() {
        // Two or more x rows take the wide tiles.
        assert!(ts.len() == 1, "{} x rows: the wide tiles take these", ts.len());
        let t = ts.start;
        let (x, a_scales) = (&prepared.wide[t], &prepared.a_scales[t]);
        // SAFETY: as in `fp4_block_sums`, and VBMI where it is called for;
        // the wide row is in the lane-byte layout for `codes.len()` columns.
        unsafe {
            if is_x86_feature_detected!("avx512vbmi") {
                avx512::fp8_block_sums_vbmi(codes, x, a_scales, w_scales, sums)
            } else {
                avx512::fp8_block_sums_shifts(codes, x, a_scales, w_scales, sums)
            }
        };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if path == BlockPath::NeonDotprod {
        // SAFETY: `block_scaled_product` checked the path's features and that
        // no code is NaN; the wide rows (unscaled) hold `codes.len()` values.
        unsafe {
            neon::fp8_block_sums(codes, &prepared.wide[ts.clone()], &prepared.a_scales[ts], w_scales, sums, stride)
        };
        return;
    }
    let _ = path;
    for (i, t) in ts.enumerate() {
        let a = &prepared.wide[t];
        let a_scales = &prepared.a_scales[t];
        for (b, (block, bytes)) in a.chunks_exact(ACT_BLOCK).zip(codes.chunks_exact(ACT_BLOCK)).enumerate() {
            let sum: f64 = block.iter().zip(bytes).map(|(&x, &code)| x * fp8_e4m3_to_f32(code) as f64).sum();
            sums[i * stride + b] = scaled(sum as f32, a_scales[b], w_scales[b]);
        }
    }
}
