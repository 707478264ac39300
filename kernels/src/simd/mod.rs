//! Instruction-set specific inner loops of the linear kernels.
//!
//! Every path computes the same 16 lane accumulators in the same order as the
//! portable reference, so the choice of path never changes a bit of output.

use std::sync::OnceLock;

mod portable;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// A code path of the kernels. All paths give bit-identical results; they differ
/// only in speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Plain Rust, any target.
    Portable,
    /// x86-64 AVX2 + FMA: two 8-lane registers hold the 16 lanes.
    Avx2,
    /// x86-64 AVX-512F: one 16-lane register holds the 16 lanes.
    Avx512,
}

impl Isa {
    /// Every path, fastest last.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// Whether this CPU can run the path.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx2 | Isa::Avx512 => false,
        }
    }

    /// The fastest path this CPU supports (detected once).
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            Isa::ALL.into_iter().rev().find(|isa| isa.is_available()).unwrap_or(Isa::Portable)
        })
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

/// An [`Isa`] known to be supported by this CPU: the only way to reach the
/// `unsafe` SIMD functions, whose sole extra requirement is that support.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Backend(Isa);

impl Backend {
    pub(crate) fn new(isa: Isa) -> Self {
        assert!(isa.is_available(), "{isa:?} is not supported by this CPU");
        Self(isa)
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
            // 3 × 8 accumulators + 1 x + 8 w registers fit the 32 zmm registers.
            Isa::Avx512 => (rows_left.min(3), 8),
            // 1 × 4 × 2 accumulators + 4 w + 1 x fit the 16 ymm registers.
            Isa::Avx2 => (1, 4),
            Isa::Portable => (rows_left.min(2), 4),
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
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!(),
        }
    }

    /// Continue the lane accumulators of every (x row, weight row) pair over one
    /// block of columns that starts at a multiple of 16.
    ///
    /// `acc[i * acc_stride + j * 16..][..16]` holds the lanes of pair `(xs[i], ws[j])`.
    /// All of `xs` and `ws` must have the same length; `(xs.len(), ws.len())` must be
    /// a shape returned by [`Backend::block_shape`].
    pub(crate) fn micro(self, xs: &[&[f32]], ws: &[&[f32]], acc: &mut [f32], acc_stride: usize) {
        let len = xs[0].len();
        assert!(xs.iter().chain(ws).all(|s| s.len() == len), "ragged tile");
        assert!((xs.len() - 1) * acc_stride + ws.len() * 16 <= acc.len(), "accumulators");
        match (self.0, xs.len(), ws.len()) {
            (Isa::Portable, 1, 4) => portable::micro::<1, 4>(arr(xs), arr(ws), acc, acc_stride),
            (Isa::Portable, 2, 4) => portable::micro::<2, 4>(arr(xs), arr(ws), acc, acc_stride),
            // SAFETY (all x86 arms): `Backend::new` checked the CPU features, and the
            // asserts above are exactly the bounds the SIMD loops rely on.
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, 1, 4) => unsafe { avx2::micro::<1, 4>(arr(xs), arr(ws), acc, acc_stride) },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, 1, 8) => unsafe {
                avx512::micro::<1, 8>(arr(xs), arr(ws), acc, acc_stride)
            },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, 2, 8) => unsafe {
                avx512::micro::<2, 8>(arr(xs), arr(ws), acc, acc_stride)
            },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, 3, 8) => unsafe {
                avx512::micro::<3, 8>(arr(xs), arr(ws), acc, acc_stride)
            },
            (isa, m, n) => unreachable!("no {m}x{n} tile for {isa:?}"),
        }
    }

    /// Little-endian bf16 bytes to f32; `src.len() == 2 * dst.len()`.
    pub(crate) fn bf16_span(self, src: &[u8], dst: &mut [f32]) {
        assert_eq!(src.len(), 2 * dst.len(), "bf16 span");
        match self.0 {
            // SAFETY: CPU features checked by `Backend::new`; lengths asserted above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::bf16_span(src, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::bf16_span(src, dst) },
            _ => portable::bf16_span(src, dst),
        }
    }

    /// FP8 e4m3 codes times one `scale`; `src.len() == dst.len()`.
    pub(crate) fn fp8_span(self, src: &[u8], scale: f32, dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "fp8 span");
        match self.0 {
            // SAFETY: CPU features checked by `Backend::new`; lengths asserted above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::fp8_span(src, scale, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::fp8_span(src, scale, dst) },
            _ => portable::fp8_span(src, scale, dst),
        }
    }

    /// Packed FP4 e2m1 pairs (even column in the low nibble) times one `scale`;
    /// `2 * src.len() == dst.len()`.
    pub(crate) fn fp4_span(self, src: &[u8], scale: f32, dst: &mut [f32]) {
        assert_eq!(2 * src.len(), dst.len(), "fp4 span");
        match self.0 {
            // SAFETY: CPU features checked by `Backend::new`; lengths asserted above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::fp4_span(src, scale, dst) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { avx2::fp4_span(src, scale, dst) },
            _ => portable::fp4_span(src, scale, dst),
        }
    }
}

fn arr<'a, const N: usize>(s: &'a [&'a [f32]]) -> &'a [&'a [f32]; N] {
    s.try_into().expect("tile shape")
}
