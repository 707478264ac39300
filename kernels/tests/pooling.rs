//! The compressor's gated pooling against its definition written per column:
//! the library's softmax on the column's series, then the weighted values
//! summed in row order (an iterator's `sum`).

mod common;

use common::Rng;
use deepinfer_kernels::ops::softmax;
use deepinfer_kernels::pooling::softmax_pool_columns;

fn per_column(logits: &[Vec<f32>], values: &[Vec<f32>], d: usize) -> Vec<f32> {
    (0..d)
        .map(|c| {
            let mut series: Vec<f32> = logits.iter().map(|row| row[c]).collect();
            softmax(&mut series);
            series.iter().zip(values).map(|(p, row)| p * row[c]).sum()
        })
        .collect()
}

#[test]
fn pooling_gives_each_column_the_bits_of_its_own_softmax_and_sum() {
    let mut rng = Rng(41);
    for rows in [0, 1, 2, 8, 15, 16, 17, 33, 256] {
        for d in [1, 7, 16, 128, 130] {
            // Spread logits, slots that take no weight (−inf), zeros of both
            // signs and a column with a NaN.
            let logits: Vec<Vec<f32>> = (0..rows)
                .map(|r| {
                    (0..d)
                        .map(|c| match (r * 7 + c * 3) % 11 {
                            0 => f32::NEG_INFINITY,
                            1 => 0.0,
                            2 => -0.0,
                            _ if c == 5 && r == 3 => f32::NAN,
                            _ => rng.uniform() * 12.0,
                        })
                        .collect()
                })
                .collect();
            let values: Vec<Vec<f32>> = (0..rows).map(|_| rng.vec(d)).collect();
            let want = per_column(&logits, &values, d);
            let (logit_rows, value_rows): (Vec<&[f32]>, Vec<&[f32]>) =
                logits.iter().zip(&values).map(|(l, v)| (&l[..], &v[..])).unzip();
            let mut got = vec![f32::NAN; d];
            softmax_pool_columns(&logit_rows, &value_rows, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&got), bits(&want), "rows {rows} d {d}");
        }
    }
}

#[test]
#[should_panic(expected = "softmax_pool_columns widths")]
fn pooling_refuses_ragged_rows() {
    let (a, b) = (vec![0.0f32; 4], vec![0.0f32; 3]);
    softmax_pool_columns(&[&a], &[&b], &mut [0.0; 4]);
}
