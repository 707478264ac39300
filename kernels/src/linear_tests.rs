//! Unit tests of the linear kernels' internals: tile decoders, tile
//! reductions and the panel layout.

use super::*;
use crate::panels::{decode_tile, lane_slot, Codes, GROUP_ROWS};

fn available() -> Vec<Backend> {
    Isa::ALL.into_iter().filter(|i| i.is_available()).map(Backend::new).collect()
}

/// SplitMix64 values in [-1, 1), some scaled far out so blocks get distinct scales.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|i| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            let v = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 37 == 0 {
                v * 300.0
            } else {
                v
            }
        })
        .collect()
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
fn lane_slots_are_a_permutation_of_the_line() {
    let mut seen = [false; GROUP_ROWS];
    for o in 0..GROUP_ROWS {
        assert!(!seen[lane_slot(o)], "slot {} twice", lane_slot(o));
        seen[lane_slot(o)] = true;
    }
}

/// Every tile a decoder on every path writes, against the panels' own
/// values (`dequantize_row`; FP4 unscaled), for every encoding.
#[test]
fn tiles_decode_to_the_weights_on_every_path() {
    let (rows, cols) = (70, 96);
    let w = values(rows * cols, 3);
    let bf16: Vec<u8> = w.iter().flat_map(|&v| crate::dtype::f32_to_bf16(v).to_le_bytes()).collect();
    let formats = [
        WeightFormat::Bf16(Bytes::from(bf16)),
        crate::quantize::quantize_fp8_blocks(&w, rows, cols, 32).into_fp8_linear(rows, cols, 32).format,
        crate::quantize::quantize_fp4_rows(&w, rows, cols, 32).into_fp4_linear(rows, cols, 32).format,
    ];
    for format in formats {
        let lin = Linear { rows, cols, format }.into_decode_layout();
        let WeightFormat::Panels(panels) = &lin.format else { unreachable!() };
        let fp4 = matches!(panels.codes, Codes::Fp4 { .. });
        let mut row = vec![0.0f32; cols];
        for (k0, kc) in [(0, 96), (32, 64), (64, 32)] {
            for g in 0..panels.groups() {
                let mut want = vec![f32::NAN; kc * GROUP_ROWS];
                decode_tile(&panels.codes, cols, g, k0, kc, &mut want);
                for o in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
                    let r = g * GROUP_ROWS + o;
                    if fp4 {
                        row = panels.fp4_row(r).0;
                    } else {
                        panels.dequantize_row(r, &mut row);
                    }
                    for c in 0..kc {
                        assert_eq!(want[c * GROUP_ROWS + o].to_bits(), row[k0 + c].to_bits(), "row {r} col {}", k0 + c);
                    }
                }
                for backend in available() {
                    let mut got = vec![f32::NAN; kc * GROUP_ROWS];
                    crate::column_order::decode_on(backend, &panels.codes, cols, g, k0, kc, &mut got);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                    assert_eq!(bits(&got), bits(&want), "{backend:?} group {g} columns {k0}+{kc}");
                }
            }
        }
    }
}
