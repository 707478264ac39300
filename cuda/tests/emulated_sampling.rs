//! The sampling kernel's `exp` against the host's `f64::exp`, bit for bit.
//! (The sampled tokens are compared with the engine's `sampling::sample` in
//! `engine/tests/device_sampling.rs`, where the engine is a dependency.)

use deepinfer_cuda::ops::sampling::libm_exp;

/// SplitMix64, a small deterministic generator.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [lo, hi).
    fn f64(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }
}

#[test]
fn the_weights_exp_is_the_hosts_f64_exp_bit_for_bit() {
    let gpu = deepinfer_cuda::test_gpu();
    let mut g = Gen(7);
    let mut x: Vec<f64> = vec![
        0.0,
        -0.0,
        1e-300,
        -1e-300,
        5e-324,
        1e-17,
        -1e-17,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NAN,
        -745.2,
        -745.1332191019411,
        -744.4,
        -708.4,
        -708.3964185322641,
        -709.0,
        -720.5,
        -1000.0,
        -1e30,
        709.78,
        709.8,
        1000.0,
        512.0,
        -512.0,
        f64::MIN,
        f64::MAX,
    ];
    // Where the sampler's weights live ((x - max) / T <= 0) densely, the
    // subnormal results and the rest of the range more thinly.
    x.extend((0..400_000).map(|_| g.f64(-1.0, 0.0)));
    x.extend((0..400_000).map(|_| g.f64(-40.0, 0.0)));
    x.extend((0..200_000).map(|_| g.f64(-760.0, -700.0)));
    x.extend((0..100_000).map(|_| g.f64(-1100.0, 720.0)));
    x.extend((0..100_000).map(|_| f64::from_bits(g.next())));
    let xd = gpu.upload(&x).unwrap();
    let yd = gpu.zeros::<f64>(x.len()).unwrap();
    libm_exp(&gpu, &xd, &yd).unwrap();
    let got = gpu.download(&yd).unwrap();
    let mut bad = Vec::new();
    for (i, (&v, &y)) in x.iter().zip(&got).enumerate() {
        let want = v.exp();
        let same = want.to_bits() == y.to_bits() || (want.is_nan() && y.is_nan());
        if !same && bad.len() < 8 {
            bad.push(format!(
                "exp({v:e}) [{i}]: device {y:e} ({:#x}), host {want:e} ({:#x})",
                y.to_bits(),
                want.to_bits()
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
