//! Unit tests of the linear kernels' internals: spans and tile reductions.

use super::*;
use crate::dtype::f32_to_bf16;

fn available() -> Vec<Backend> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).map(Backend::new).collect()
}

/// Every span of every row, dequantised by every path, against `dequantize_row`.
fn assert_spans_match(lin: &Linear) {
    let mut row = vec![0.0f32; lin.cols];
    let mut span = vec![0.0f32; lin.cols];
    // FP4 spans cover whole bytes.
    let even = matches!(lin.format, WeightFormat::Fp4 { .. });
    for backend in available() {
        for r in 0..lin.rows {
            lin.dequantize_row(r, &mut row);
            for k0 in (0..lin.cols).step_by(16) {
                for len in [1, 2, 15, 16, 17, 40, lin.cols - k0] {
                    let len = len.min(lin.cols - k0) & if even { !1 } else { !0 };
                    if len == 0 {
                        continue;
                    }
                    lin.dequantize_span(backend, r, k0, &mut span[..len]);
                    for (c, (a, b)) in span[..len].iter().zip(&row[k0..]).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{backend:?} row {r} col {}", k0 + c);
                    }
                }
            }
        }
    }
}

#[test]
fn fp8_spans_match_table_for_every_code_and_scale() {
    // Each row holds all 256 codes (NaNs included) in a rotated order.
    let (rows, cols): (usize, usize) = (4, 256);
    let data: Vec<u8> = (0..rows * cols).map(|i| ((i % cols) as u8).wrapping_add((i / cols * 37) as u8)).collect();
    for scale in [crate::dtype::ue8m0_to_f32(0), 2f32.powi(-120), 2f32.powi(-7), 1.0, 2f32.powi(100)] {
        for block in [(1, 256), (3, 16), (2, 7)] {
            let blocks = rows.div_ceil(block.0) * cols.div_ceil(block.1);
            let scales: Vec<f32> = (0..blocks).map(|b| scale * [1.0, 0.5, 4.0][b % 3]).collect();
            let lin =
                Linear { rows, cols, format: WeightFormat::fp8(Bytes::from(data.clone()), scales, block.0, block.1) };
            assert_spans_match(&lin);
        }
    }
}

#[test]
fn a_tile_reduces_to_each_row_tree_on_every_path() {
    // Magnitudes spread over 2^±40, so a sum in another order differs in its bits.
    let mut state = 7u64;
    let acc: [f32; 256] = std::array::from_fn(|_| {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let mantissa = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        mantissa * 2f32.powi((state >> 33) as i32 % 81 - 40)
    });
    let want: Vec<u32> = (0..16).map(|j| crate::simd::reduce16(&acc[j * 16..][..16]).to_bits()).collect();
    for backend in available() {
        let got: Vec<u32> = backend.reduce_tile(&acc).iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{backend:?}");
    }
}

#[test]
fn fp4_spans_match_table_for_every_code() {
    let (rows, cols) = (3, 96);
    let data: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 7 + i / 16) as u8).collect();
    for block in [32, 6, 3, 2] {
        let scales: Vec<f32> = (0..rows * (cols / block)).map(|b| 2f32.powi(b as i32 % 9 - 4)).collect();
        let lin = Linear {
            rows,
            cols,
            format: WeightFormat::Fp4 { data: Bytes::from(data.clone()), scales, block_cols: block },
        };
        assert_spans_match(&lin);
    }
}

#[test]
fn bf16_spans_match_for_special_bit_patterns() {
    let (rows, cols) = (2, 77);
    let mut bits: Vec<u16> = [0x0000, 0x8000, 0x0001, 0x807f, 0x7f80, 0xff80, 0x7fc0, 0x3f80]
        .into_iter()
        .chain((0..rows * cols).map(|i| f32_to_bf16(i as f32 * 0.37 - 9.0)))
        .collect();
    bits.truncate(rows * cols);
    let data: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let lin = Linear { rows, cols, format: WeightFormat::Bf16(Bytes::from(data)) };
    assert_spans_match(&lin);
}

#[test]
fn fp4_grouped_spans_match_their_rows_on_every_path() {
    let (rows, cols) = (11, 384);
    let data: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 7 + i / 16) as u8).collect();
    let scales: Vec<f32> = (0..rows * cols / 32).map(|b| 2f32.powi(b as i32 % 9 - 4)).collect();
    let groups = Fp4Groups::pack(rows, cols, &data, &scales, 32).expect("qualifies");
    let lin = Linear { rows, cols, format: WeightFormat::Fp4Grouped(groups.clone()) };
    assert_grouped_spans_match(&lin);
    let mut row = vec![0.0f32; cols];
    for backend in available() {
        // Rows decoded together, across a group boundary, into strided rows:
        // whole chunks only, partial chunks at either end or both, and spans
        // inside one chunk.
        let (first, count, stride) = (2, 9, cols + 16);
        for (k0, len) in [(0, cols), (0, 256), (16, 240), (48, 288), (144, 224), (80, 16), (128, 128), (272, 96)] {
            let mut tile = vec![f32::NAN; count * stride];
            crate::fp4_groups::decode_rows(&groups, backend, first..first + count, (k0, len), &mut tile, stride);
            for i in 0..count {
                lin.dequantize_row(first + i, &mut row);
                let same = tile[i * stride..][..len].iter().zip(&row[k0..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{backend:?} tile row {i}, columns {k0}..{}", k0 + len);
            }
        }
    }
}

/// Every span (whole 16-column pieces) of every row of a regrouped weight,
/// dequantised by every path, against `dequantize_row`.
fn assert_grouped_spans_match(lin: &Linear) {
    let (rows, cols) = (lin.rows, lin.cols);
    let (mut row, mut span) = (vec![0.0f32; cols], vec![0.0f32; cols]);
    for backend in available() {
        for r in 0..rows {
            lin.dequantize_row(r, &mut row);
            for k0 in (0..cols).step_by(16) {
                for len in (16..=cols - k0).step_by(48) {
                    lin.dequantize_span(backend, r, k0, &mut span[..len]);
                    let same = span[..len].iter().zip(&row[k0..]).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{backend:?} row {r} columns {k0}..{}", k0 + len);
                }
            }
        }
    }
}

#[test]
fn fp8_grouped_spans_match_their_rows_on_every_path() {
    let (rows, cols) = (11, 320);
    // Every code but the two NaNs; scales on x's side of the kernel and not.
    let data: Vec<u8> =
        (0..rows * cols).map(|i| (i * 7 + i / 16) as u8).map(|b| if b & 0x7f == 0x7f { 0 } else { b }).collect();
    let scales: Vec<f32> = (0..2 * 5).map(|b| if b % 3 == 0 { 0.3 } else { 2f32.powi(b - 4) }).collect();
    let groups = Fp8Groups::pack(rows, cols, &data, &scales, (8, 64), true).expect("qualifies");
    let lin = Linear { rows, cols, format: WeightFormat::Fp8Grouped(groups.clone()) };
    assert_grouped_spans_match(&lin);
    let mut row = vec![0.0f32; cols];
    for backend in available() {
        // Rows decoded together, across a group boundary, into strided rows.
        let (first, count, stride) = (3, 7, cols + 16);
        for (k0, len) in [(0, cols), (16, 48), (48, 224), (80, 16)] {
            let mut tile = vec![f32::NAN; count * stride];
            crate::fp8_groups::decode_rows(&groups, backend, first..first + count, (k0, len), &mut tile, stride);
            for i in 0..count {
                lin.dequantize_row(first + i, &mut row);
                let same = tile[i * stride..][..len].iter().zip(&row[k0..]).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{backend:?} tile row {i}, columns {k0}..{}", k0 + len);
            }
        }
    }
}

#[test]
fn input_rows_read_in_place_give_the_bits_of_packed_rows() {
    // Rows that start on a cache line are read where they are (no packed
    // copy); the same rows one float off a line are packed. Both must give
    // every output the bits of its own `dot`, at batch sizes that take the
    // register tiles, the fused tiles and a single row; rows of two column
    // blocks are packed wherever they start.
    for (rows, cols) in [(40, 1000), (20, 4200)] {
        check_in_place_rows(rows, cols);
    }
}

fn check_in_place_rows(rows: usize, cols: usize) {
    let mut state = 11u64;
    let mut value = || {
        state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let w: Vec<f32> = (0..rows * cols).map(|_| value()).collect();
    let f32_weights = Linear::from_f32(rows, cols, w.clone());
    let bf16 = Linear {
        rows,
        cols,
        format: WeightFormat::Bf16(Bytes::from(
            w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect::<Vec<u8>>(),
        )),
    };
    for lin in [&f32_weights, &bf16] {
        for n in [1, 5, 7, 31] {
            let x: Vec<f32> = (0..n * cols).map(|_| value()).collect();
            let mut aligned = AlignedF32::with_capacity(n * cols);
            aligned.extend_from_slice(&x);
            let mut shifted = AlignedF32::with_capacity(n * cols + 1);
            shifted.extend_from_slice(&[0.0]);
            shifted.extend_from_slice(&x);
            assert_eq!(aligned.as_ptr().cast::<u8>().align_offset(64), 0);
            let mut row = vec![0.0f32; cols];
            for backend in available() {
                let (mut in_place, mut packed) = (vec![0.0f32; n * rows], vec![0.0f32; n * rows]);
                lin.forward_on(backend, &aligned, n, &mut in_place);
                lin.forward_on(backend, &shifted[1..], n, &mut packed);
                for (i, (a, b)) in in_place.iter().zip(&packed).enumerate() {
                    lin.dequantize_row(i % rows, &mut row);
                    let want = backend.dot(&x[i / rows * cols..][..cols], &row);
                    assert_eq!(a.to_bits(), want.to_bits(), "{backend:?} n {n} output {i} in place");
                    assert_eq!(b.to_bits(), want.to_bits(), "{backend:?} n {n} output {i} packed");
                }
            }
        }
    }
}
