//! The fixed-sequence `exp` against f64, and its paths against each other.

mod common;

use common::Rng;
use deepinfer_kernels::exp::{exp, exp_in_place, exp_in_place_with};
use deepinfer_kernels::ops::{sigmoid, sum_lanes, swiglu_clamped};
use deepinfer_kernels::Isa;

/// Distance in units in the last place between `got` and the f64 value
/// `want` rounded to f32 (0 when they are the same float).
fn ulps(got: f32, want: f64) -> u32 {
    let want = want as f32;
    let key = |v: f32| {
        let b = v.to_bits() as i64;
        if b & (1 << 31) != 0 {
            -(b & 0x7fff_ffff)
        } else {
            b
        }
    };
    (key(got) - key(want)).unsigned_abs() as u32
}

#[test]
fn exp_is_within_two_ulp_of_f64_over_its_whole_range() {
    let mut worst = (0u32, 0.0f32);
    // Every 2^-12 from the underflow bound to the overflow bound, and random inputs.
    let mut rng = Rng(90);
    let steps = (-104.0f32 * 4096.0) as i32..(89.0f32 * 4096.0) as i32;
    let random = (0..200_000).map(|_| rng.uniform() * 100.0);
    for x in steps.map(|i| i as f32 / 4096.0).chain(random) {
        let want = (x as f64).exp();
        let got = exp(x);
        if want > f32::MAX as f64 {
            assert_eq!(got, f32::INFINITY, "exp({x}) overflows");
            continue;
        }
        // Subnormal results carry fewer bits: count their error in the
        // smallest normal's ulp instead.
        let err = if want < f32::MIN_POSITIVE as f64 {
            ((got as f64 - want).abs() / f32::MIN_POSITIVE as f64 * 2f64.powi(23)).ceil() as u32
        } else {
            ulps(got, want)
        };
        if err > worst.0 {
            worst = (err, x);
        }
    }
    assert!(worst.0 <= 2, "{} ulp at exp({})", worst.0, worst.1);
}

#[test]
fn exp_special_values() {
    assert!(exp(f32::NAN).is_nan());
    assert_eq!(exp(f32::INFINITY), f32::INFINITY);
    assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
    assert_eq!(exp(0.0), 1.0);
    assert_eq!(exp(-0.0), 1.0);
    assert_eq!(exp(89.0), f32::INFINITY);
    assert_eq!(exp(-105.0).to_bits(), 0);
    assert!(exp(-100.0) > 0.0, "subnormal results are kept");
}

#[test]
fn every_path_gives_the_bits_of_the_definition() {
    // Random bit patterns cover every exponent, NaNs and infinities; the
    // sweep covers the range that matters; odd lengths cover the masked tail.
    let mut rng = Rng(91);
    let mut inputs: Vec<f32> = (0..100_003).map(|_| f32::from_bits(rng.next_u64() as u32)).collect();
    inputs.extend((-2100..1800).map(|i| i as f32 / 20.0));
    inputs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, f32::MAX, f32::MIN, 88.72283, -103.97208]);
    let want: Vec<f32> = inputs.iter().map(|&x| exp(x)).collect();
    for isa in Isa::ALL.into_iter().filter(|isa| isa.is_available()) {
        let mut got = inputs.clone();
        exp_in_place_with(isa, &mut got);
        for ((x, g), w) in inputs.iter().zip(&got).zip(&want) {
            // NaN payloads are not specified; NaN-ness is.
            assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{isa:?}: exp({x}) = {g}, want {w}");
        }
    }
    let mut detected = inputs.clone();
    exp_in_place(&mut detected);
    assert!(detected.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())));
}

#[test]
fn sum_lanes_follows_the_lane_order() {
    let mut rng = Rng(92);
    for len in [0, 1, 15, 16, 17, 100, 1000] {
        let x = rng.vec(len);
        // The definition written out: lane i % 16, then halves added pairwise.
        let mut lanes = [0.0f32; 16];
        for (i, v) in x.iter().enumerate() {
            lanes[i % 16] += v;
        }
        let mut width = 8;
        while width > 0 {
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
            width /= 2;
        }
        assert_eq!(sum_lanes(&x).to_bits(), lanes[0].to_bits(), "len {len}");
        let exact: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum_lanes(&x) as f64 - exact).abs() <= 1e-5 * x.iter().map(|v| v.abs() as f64).sum::<f64>() + 1e-6);
    }
}

#[test]
fn swiglu_is_silu_times_up_element_by_element() {
    let mut rng = Rng(93);
    let limit = 7.0;
    for len in [1, 255, 256, 257, 1000] {
        let gate: Vec<f32> = rng.vec(len).iter().map(|v| v * 3.0).collect();
        let up = rng.vec(len);
        let mut out = gate.clone();
        swiglu_clamped(&mut out, &up, limit);
        for i in 0..len {
            let g = gate[i].min(limit);
            let want = g * sigmoid(g) * up[i].clamp(-limit, limit);
            assert_eq!(out[i].to_bits(), want.to_bits(), "len {len} [{i}]");
            let exact = g as f64 / (1.0 + (-(g as f64)).exp()) * up[i].clamp(-limit, limit) as f64;
            assert!((out[i] as f64 - exact).abs() <= 1e-5 * exact.abs() + 1e-7, "len {len} [{i}]");
        }
    }
}
