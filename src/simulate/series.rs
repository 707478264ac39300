//! Spreading a burst of tokens over the time series' buckets.
//!
//! Tokens reach the driver in bursts: with `decode_steps_per_event` above 1
//! a request's tokens of several decode steps come as one update, and a
//! prefill wave's first tokens come together. Counted where they arrive,
//! 2 s buckets alternate between 0 and twice the rate. Instead a burst of n
//! tokens of one request is spread evenly over the simulated time since
//! that request's previous token (its arrival, for the first), across the
//! buckets that span covers; see [`super::drive`] for which span each count uses.

use super::Bucket;

/// Add `n` tokens spread over `[from_us, to_us]` to `field` of the buckets of `width_us`.
pub fn spread(
    buckets: &mut Vec<Bucket>,
    n: u64,
    (from_us, to_us): (u64, u64),
    width_us: u64,
    field: fn(&mut Bucket) -> &mut u64,
) {
    for (k, got) in apportion(n, from_us, to_us, width_us) {
        if buckets.len() <= k {
            buckets.resize(k + 1, Bucket::default());
        }
        *field(&mut buckets[k]) += got;
    }
}

/// `n` tokens spread evenly over `[from_us, to_us]`, as `(bucket, tokens)`
/// for each bucket of `width_us` the span overlaps; the counts sum to `n`.
/// An empty span puts all of them into `to_us`'s bucket.
pub fn apportion(n: u64, from_us: u64, to_us: u64, width_us: u64) -> Vec<(usize, u64)> {
    let width = width_us.max(1);
    let from = from_us.min(to_us);
    let span = to_us - from;
    if span == 0 || n == 0 {
        return vec![((to_us / width) as usize, n)];
    }
    // Tokens due by time `x`, rounded down: bucket k gets what falls due in it,
    // so the rounding never loses or invents one.
    let due = |x: u64| (n as u128 * (x - from) as u128 / span as u128) as u64;
    let (first, last) = (from / width, to_us / width);
    let mut out = Vec::with_capacity((last - first + 1) as usize);
    for k in first..=last {
        let start = (k * width).max(from);
        let end = ((k + 1) * width).min(to_us);
        let got = if k == last { n - due(start) } else { due(end) - due(start) };
        if got > 0 {
            out.push((k as usize, got));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::apportion;

    #[test]
    fn a_burst_is_spread_evenly_over_its_span_and_keeps_its_total() {
        // 10 tokens over 0..4 s in 1 s buckets (the last one ends at 4 s exactly).
        let got = apportion(10, 0, 4_000_000, 1_000_000);
        assert_eq!(got.iter().map(|x| x.1).sum::<u64>(), 10);
        assert_eq!(got, vec![(0, 2), (1, 3), (2, 2), (3, 3)]);
        // Within one bucket, or with no span, it all stays where it arrived.
        assert_eq!(apportion(7, 1_200_000, 1_900_000, 1_000_000), vec![(1, 7)]);
        assert_eq!(apportion(7, 5_000_000, 5_000_000, 1_000_000), vec![(5, 7)]);
        // A span that starts after it ends is treated as empty.
        assert_eq!(apportion(3, 9_000_000, 2_000_000, 1_000_000), vec![(2, 3)]);
        // Uneven: 100 tokens over 0.5..2.5 s: a quarter, a half, a quarter.
        let got = apportion(100, 500_000, 2_500_000, 1_000_000);
        assert_eq!(got, vec![(0, 25), (1, 50), (2, 25)]);
    }
}
