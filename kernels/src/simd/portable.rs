//! Plain-Rust reference loops: 16 lane accumulators updated with `mul_add`.

use super::reduce16;

/// The reference dot product: column `c` of each 16-column chunk feeds lane
/// `c % 16`; the tail columns feed lanes `0..`.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let mut a_chunks = a.chunks_exact(16);
    let mut b_chunks = b.chunks_exact(16);
    for (ca, cb) in a_chunks.by_ref().zip(b_chunks.by_ref()) {
        for l in 0..16 {
            acc[l] = ca[l].mul_add(cb[l], acc[l]);
        }
    }
    for ((acc, &a), &b) in acc.iter_mut().zip(a_chunks.remainder()).zip(b_chunks.remainder()) {
        *acc = a.mul_add(b, *acc);
    }
    reduce16(&acc)
}

/// See `Backend::micro`.
pub(super) fn micro<const MR: usize, const NR: usize>(
    xs: &[&[f32]; MR],
    ws: &[&[f32]; NR],
    acc: &mut [f32],
    acc_stride: usize,
) {
    let len = xs[0].len();
    let mut lanes = [[[0.0f32; 16]; NR]; MR];
    for (i, li) in lanes.iter_mut().enumerate() {
        for (j, lij) in li.iter_mut().enumerate() {
            lij.copy_from_slice(&acc[i * acc_stride + j * 16..][..16]);
        }
    }
    for c in 0..len {
        let l = c % 16;
        for (li, x) in lanes.iter_mut().zip(xs) {
            for (lij, w) in li.iter_mut().zip(ws) {
                lij[l] = x[c].mul_add(w[c], lij[l]);
            }
        }
    }
    for (i, li) in lanes.iter().enumerate() {
        for (j, lij) in li.iter().enumerate() {
            acc[i * acc_stride + j * 16..][..16].copy_from_slice(lij);
        }
    }
}
