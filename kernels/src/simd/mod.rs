//! Instruction-set specific inner loops of the kernels.
//!
//! `dot` and `dot_rows` keep 16 lane accumulators in the portable reference's
//! order on every path; the linears' column-order tiles (`avx512_panels`,
//! `panels_generic`) keep one chain per output. Either way the choice of path
//! never changes a bit of output.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_panels;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_quantize;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod panels_generic;
mod portable;

/// A code path of the kernels. All paths give bit-identical results; they differ
/// only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any target.
    Portable,
    /// x86-64 AVX2 + FMA: two 8-lane registers hold the 16 lanes.
    Avx2,
    /// x86-64 AVX-512F and BW (every AVX-512 CPU since Skylake): one 16-lane
    /// register holds the 16 lanes.
    Avx512,
    /// AArch64 NEON (every 64-bit ARM CPU): four 4-lane registers hold the 16
    /// lanes.
    Neon,
}

impl Isa {
    /// Every path, fastest last (the x86-64 and AArch64 ones never both run).
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(not(target_arch = "aarch64"))]
            Isa::Neon => false,
        }
    }

    /// The fastest path this CPU supports (detected once).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| Isa::ALL.into_iter().rev().find(|isa| isa.is_available()).unwrap_or(Isa::Portable))
    }
}

/// Fixed pairwise tree over the 16 lane accumulators: lane l += lane l+8, then
/// +4, +2, +1. Shared by every path so the final reduction is the same code.
#[inline]
pub(crate) fn reduce16(acc: &[f32]) -> f32 {
    let mut a: [f32; 16] = acc.try_into().expect("16 lanes");
    let mut width = 16;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            a[l] += a[l + width];
        }
    }
    a[0]
}

/// How far ahead of the chunk they decode the streaming kernels (the
/// regrouped FP8/FP4 kernels, V4.1's block-scaled ones) fetch. Their weights
/// are one sequential stream, but a core's prefetchers stop at every 4 KiB
/// page and keep too few lines in flight for one core to draw its share of
/// memory bandwidth; fetching 8 KiB ahead made batch-1 decode 1.4× faster on
/// a core with 15 GB/s of its own.
#[cfg(target_arch = "x86_64")]
const FETCH_AHEAD_BYTES: usize = 8192;

/// Fetch into L1 the `count` lines that start [`FETCH_AHEAD_BYTES`] past
/// `lines`. Safe for any address: a prefetch never faults, and the pointer
/// is never read.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn fetch_ahead(lines: *const u8, count: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let base = lines.wrapping_add(FETCH_AHEAD_BYTES);
    for l in 0..count {
        // SAFETY: SSE is part of x86-64, and a prefetch of any address is harmless.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(l * 64).cast()) };
    }
}

/// An [`Isa`] known to be supported by this CPU: the only way to reach the
/// `unsafe` SIMD functions, whose sole extra requirement is that support.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backend(Isa);

impl Backend {
    pub(crate) fn new(isa: Isa) -> Self {
        assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
        Self(isa)
    }

    pub(crate) fn isa(self) -> Isa {
        self.0
    }

    /// The path of [`Isa::detect`], which only returns supported paths.
    #[inline]
    pub(crate) fn detected() -> Self {
        Self(Isa::detect())
    }

    /// Shape `(x rows, weight rows)` of the register tile used when `rows_left`
    /// input rows remain. Weight-row counts divide [`crate::linear`]'s tile height.
    pub(crate) fn block_shape(self, rows_left: usize) -> (usize, usize) {
        match self.0 {
            // Up to 24 accumulators + the w and x registers within the 32 zmm
            // registers; 6 × 4 needs the fewest loads per multiply-add.
            Isa::Avx512 if rows_left <= 3 => (rows_left, 8),
            Isa::Avx512 => (rows_left.min(6), 4),
            // 3 × 2 × 2 accumulators + 2 w + 1 x fit the 16 ymm registers.
            Isa::Avx2 if rows_left >= 3 => (3, 2),
            Isa::Avx2 if rows_left == 2 => (2, 2),
            Isa::Avx2 => (1, 4),
            // 3 × 2 × 4 accumulators + 2 w + 1 x of the 32 q registers.
            Isa::Neon if rows_left >= 3 => (3, 2),
            Isa::Neon if rows_left == 2 => (2, 2),
            Isa::Neon => (1, 4),
            Isa::Portable => (rows_left.min(2), 4),
        }
    }

    /// [`reduce16`] of each of 16 rows of lane accumulators (`acc[j * 16..][..16]`
    /// for row `j`), with the same bits.
    pub(crate) fn reduce_tile(self, acc: &[f32; 256]) -> [f32; 16] {
        match self.0 {
            // SAFETY: `Backend::new` checked that the CPU has AVX-512F.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::reduce_tile(acc) },
            _ => std::array::from_fn(|j| reduce16(&acc[j * 16..][..16])),
        }
    }

    /// [`crate::linear::dot`] on this path. `b` must be at least as long as `a`.
    pub(crate) fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let b = &b[..a.len()];
        match self.0 {
            Isa::Portable => portable::dot(a, b),
            // SAFETY: `Backend::new` checked that the CPU has AVX2 and FMA; lengths are equal.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::dot(a, b) },
            // SAFETY: `Backend::new` checked that the CPU has AVX-512F; lengths are equal.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::dot(a, b) },
            // SAFETY: `Backend::new` checked that the CPU has NEON; lengths are equal.
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => unsafe { neon::dot(a, b) },
            _ => unreachable!("{:?} on this target", self.0),
        }
    }

    /// Continue the lane accumulators of every (x row, weight row) pair of
    /// `xs` and the first `tile` rows of `ws` over one block of columns that
    /// starts at a multiple of 16, in the register tiles of
    /// [`Backend::block_shape`].
    ///
    /// `acc[i * acc_stride + j * 16..][..16]` holds the lanes of pair `(xs[i], ws[j])`.
    /// All of `xs` and `ws` must have the same length (checked once here, not
    /// per register tile: attention's 128-column tiles have only eight steps
    /// to spread per-call checks over).
    ///
    /// With `fresh` the pairs start from zero instead of `acc`'s values (the
    /// first column block of a tile, which then needs no zeroed buffer).
    pub(crate) fn micro_tiles(
        self,
        xs: &[&[f32]],
        ws: &[&[f32]; 16],
        tile: usize,
        acc: &mut [f32],
        acc_stride: usize,
        fresh: bool,
    ) {
        let Some(len) = xs.first().map(|x| x.len()) else { return };
        assert!(xs.iter().chain(ws).all(|s| s.len() == len), "ragged tile");
        assert!(tile <= 16 && acc_stride >= 16 * 16, "tile of 16 weight rows");
        assert!((xs.len() - 1) * acc_stride + 16 * 16 <= acc.len(), "accumulators");
        // The x rows of a register tile go through the weight rows 1024
        // columns at a time: 6 x rows × 4 KiB stay in L1 across the tile's
        // weight-row groups, where 4096-column rows streamed both sides from
        // L2 (a 4096² matmul at n = 256, 4–5% faster). The accumulators are
        // carried over, so every lane's chain is unchanged.
        const SUB_BLOCK_COLS: usize = 1024;
        let mut i0 = 0;
        while i0 < xs.len() {
            let (mr, nr) = self.block_shape(xs.len() - i0);
            for s0 in (0..len).step_by(SUB_BLOCK_COLS) {
                let sl = SUB_BLOCK_COLS.min(len - s0);
                let fresh = fresh && s0 == 0;
                let mut xsub: [&[f32]; 8] = [&[]; 8];
                for (d, x) in xsub.iter_mut().zip(&xs[i0..i0 + mr]) {
                    *d = &x[s0..s0 + sl];
                }
                for g in (0..tile).step_by(nr) {
                    let mut wsub: [&[f32]; 8] = [&[]; 8];
                    for (d, w) in wsub.iter_mut().zip(&ws[g..g + nr]) {
                        *d = &w[s0..s0 + sl];
                    }
                    // SAFETY: lengths and the accumulator room were checked above
                    // for every x row and all 16 weight rows, and sub-blocks cut
                    // them all alike; `g + nr <= 16` because `nr` divides 16;
                    // `(mr, nr)` comes from `block_shape`.
                    unsafe {
                        self.micro(&xsub[..mr], &wsub[..nr], &mut acc[i0 * acc_stride + g * 16..], acc_stride, fresh)
                    };
                }
            }
            i0 += mr;
        }
    }

    /// One register tile of [`Backend::micro_tiles`].
    ///
    /// # Safety
    /// All of `xs` and `ws` have the same length; `(xs.len(), ws.len())` is a
    /// shape returned by [`Backend::block_shape`];
    /// `(xs.len() - 1) * acc_stride + ws.len() * 16 <= acc.len()`.
    #[inline]
    unsafe fn micro(self, xs: &[&[f32]], ws: &[&[f32]], acc: &mut [f32], acc_stride: usize, fresh: bool) {
        debug_assert!(xs.iter().chain(ws).all(|s| s.len() == xs[0].len()), "ragged tile");
        debug_assert!((xs.len() - 1) * acc_stride + ws.len() * 16 <= acc.len(), "accumulators");
        #[cfg(target_arch = "x86_64")]
        if matches!(self.0, Isa::Avx512) {
            macro_rules! avx512_tiles {
                ($(($mr:literal, $nr:literal))*) => {
                    match (xs.len(), ws.len(), fresh) {
                        // SAFETY: `Backend::new` checked the CPU has AVX-512F; the
                        // caller guarantees the bounds the loops rely on.
                        $(($mr, $nr, true) => unsafe { avx512::micro::<$mr, $nr, true>(arr(xs), arr(ws), acc, acc_stride) },
                        ($mr, $nr, false) => unsafe { avx512::micro::<$mr, $nr, false>(arr(xs), arr(ws), acc, acc_stride) },)*
                        (m, n, _) => unreachable!("no {m}x{n} tile for {:?}", self.0),
                    }
                };
            }
            return avx512_tiles!((1, 8)(2, 8)(3, 8)(4, 4)(5, 4)(6, 4));
        }
        if fresh {
            for row in acc.chunks_mut(acc_stride).take(xs.len()) {
                row[..ws.len() * 16].fill(0.0);
            }
        }
        match (self.0, xs.len(), ws.len()) {
            (Isa::Portable, 1, 4) => portable::micro::<1, 4>(arr(xs), arr(ws), acc, acc_stride),
            (Isa::Portable, 2, 4) => portable::micro::<2, 4>(arr(xs), arr(ws), acc, acc_stride),
            // SAFETY: `Backend::new` checked the CPU features; the caller
            // guarantees the bounds the SIMD loops rely on.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, 1, 4) => unsafe { avx2::micro::<1, 4>(arr(xs), arr(ws), acc, acc_stride) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, 2, 2) => unsafe { avx2::micro::<2, 2>(arr(xs), arr(ws), acc, acc_stride) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, 3, 2) => unsafe { avx2::micro::<3, 2>(arr(xs), arr(ws), acc, acc_stride) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, 1, 4) => unsafe { neon::micro::<1, 4>(arr(xs), arr(ws), acc, acc_stride) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, 2, 2) => unsafe { neon::micro::<2, 2>(arr(xs), arr(ws), acc, acc_stride) },
            // SAFETY: as above.
            #[cfg(target_arch = "aarch64")]
            (Isa::Neon, 3, 2) => unsafe { neon::micro::<3, 2>(arr(xs), arr(ws), acc, acc_stride) },
            (isa, m, n) => unreachable!("no {m}x{n} tile for {isa:?}"),
        }
    }
}

fn arr<T, const N: usize>(s: &[T]) -> &[T; N] {
    s.try_into().expect("tile shape")
}
