//! V4.1's FP8 activation quantisation on every path against its scalar
//! definition, bit for bit: magnitudes spread over the whole f32 range,
//! values at the rounding ties of e4m3's subnormals and normals, zeros of
//! both signs, and blocks holding NaN or an infinity.

mod common;

use common::Rng;
use deepinfer_kernels::act_quant::{e4m3_round, fp8_quantize_row, power_of_two_scale};
use deepinfer_kernels::dtype::FP8_E4M3_MAX;

/// The definition: per 32 values, the power-of-two scale of the largest
/// magnitude (at least 1e-4), then each value divided by it and rounded.
fn definition(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (mut values, mut scales) = (Vec::new(), Vec::new());
    for block in x.chunks_exact(32) {
        let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let s = power_of_two_scale(amax, 1.0 / FP8_E4M3_MAX);
        values.extend(block.iter().map(|&v| e4m3_round(v / s)));
        scales.push(s);
    }
    (values, scales)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn quantised_rows_give_the_definitions_bits() {
    let mut rng = Rng(71);
    let spread = |rng: &mut Rng| rng.uniform() * 2f32.powi((rng.next_u64() % 200) as i32 - 100);
    // Each block of 32 gets its largest value at 448 · 2^k, so its others
    // land on e4m3 values, their midpoints (ties) and the ulps around them.
    let ties = |rng: &mut Rng, b: usize| {
        let k = (b % 40) as i32 - 20;
        let mut block = vec![FP8_E4M3_MAX * 2f32.powi(k)];
        for _ in 1..32 {
            let code_value = (rng.next_u64() % 449) as f32 / 2f32.powi((rng.next_u64() % 17) as i32);
            let tie = code_value + 2f32.powi(-10) * (rng.next_u64() % 3) as f32;
            let sign = if rng.next_u64().is_multiple_of(2) { 1.0 } else { -1.0 };
            block.push(sign * tie * 2f32.powi(k));
        }
        block
    };
    for row in 0..40 {
        let mut x: Vec<f32> = match row % 3 {
            0 => (0..2048).map(|_| spread(&mut rng)).collect(),
            1 => (0..64).flat_map(|b| ties(&mut rng, b)).collect(),
            _ => (0..96).map(|i| if i % 5 == 0 { -0.0 } else { rng.uniform() * 1e-6 }).collect(),
        };
        if row % 4 == 3 {
            let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][row % 3];
            let at = row % x.len();
            x[at] = special;
        }
        let got = fp8_quantize_row(&x);
        let (values, scales) = definition(&x);
        assert_eq!(bits(&got.scales), bits(&scales), "row {row}: scales");
        assert_eq!(bits(&got.values), bits(&values), "row {row}: values");
    }
}
