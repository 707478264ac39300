//! What the regrouped weight layouts ([`crate::fp4_groups`],
//! [`crate::fp8_groups`]) share: cache-line storage, and running a kernel
//! over every group of eight weight rows, on threads when the work is large.

/// Weight rows per group in both regrouped layouts.
pub const GROUP_ROWS: usize = 8;
pub(crate) const LINE_BYTES: usize = 64;

/// One cache line; a layout's chunks start on line boundaries.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u8; LINE_BYTES]);

/// `out[i * rows + r]` for `n` x rows from `group_sums(g, sums)`, which
/// writes group `g`'s sums as `sums[i * GROUP_ROWS + j]` (x row `i`, group
/// row `j`). Groups are spread over the pool's threads when `parallel`;
/// every sum is computed by one call either way, so the bits do not change.
/// (The kernels that call it are AVX-512's.)
#[cfg(target_arch = "x86_64")]
pub(crate) fn forward_by_groups(
    rows: usize,
    n: usize,
    out: &mut [f32],
    parallel: bool,
    group_sums: impl Fn(usize, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    assert_eq!(out.len(), n * rows, "grouped forward output");
    let group_count = rows.div_ceil(GROUP_ROWS);
    // Sums of group `g`, x row `i`, group row `j` at `(g * n + i) * GROUP_ROWS + j`.
    let mut sums = vec![0.0f32; group_count * n * GROUP_ROWS];
    let job = |first_group: usize, part: &mut [f32]| {
        for (k, group_part) in part.chunks_exact_mut(n * GROUP_ROWS).enumerate() {
            group_sums(first_group + k, group_part);
        }
    };
    let threads = rayon::current_num_threads();
    if threads > 1 && parallel {
        let per_job = group_count.div_ceil(4 * threads);
        sums.par_chunks_mut(per_job * n * GROUP_ROWS).enumerate().for_each(|(c, part)| job(c * per_job, part));
    } else {
        job(0, &mut sums);
    }
    for (g, group_part) in sums.chunks_exact(n * GROUP_ROWS).enumerate() {
        let here = GROUP_ROWS.min(rows - g * GROUP_ROWS);
        for (i, s) in group_part.chunks_exact(GROUP_ROWS).enumerate() {
            out[i * rows + g * GROUP_ROWS..][..here].copy_from_slice(&s[..here]);
        }
    }
}

/// Rows `rows` split at group boundaries: `visit(g, within, first)` for each
/// group `g` they touch, with its rows among them (`within`, counted in the
/// group) and the position of the first of those in `rows`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn by_group(rows: std::ops::Range<usize>, mut visit: impl FnMut(usize, std::ops::Range<usize>, usize)) {
    let mut r = rows.start;
    while r < rows.end {
        let g = r / GROUP_ROWS;
        let here = r..rows.end.min((g + 1) * GROUP_ROWS);
        visit(g, here.start % GROUP_ROWS..here.start % GROUP_ROWS + here.len(), r - rows.start);
        r = here.end;
    }
}

/// How many x rows the next pass of a grouped kernel takes when `left`
/// remain: up to four, five and six as 3 + 2 and 3 + 3, seven and eight as
/// 4 + 3 and 4 + 4 (more x rows a pass would leave too few registers).
#[cfg(target_arch = "x86_64")]
pub(crate) fn pass_rows(left: usize) -> usize {
    match left {
        5 | 6 => 3,
        7 | 8 => 4,
        left => left.min(4),
    }
}

/// A pass's sums (x rows `i0..`, group rows `j0..`) into a group's
/// `sums[i * GROUP_ROWS + j]`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn store_pass<const MR: usize, const RP: usize>(
    sums: &mut [f32],
    (i0, j0): (usize, usize),
    got: &[[f32; RP]; MR],
) {
    for (i, s) in got.iter().enumerate() {
        sums[(i0 + i) * GROUP_ROWS + j0..][..RP].copy_from_slice(s);
    }
}
