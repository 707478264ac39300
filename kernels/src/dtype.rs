//! Scalar conversions between f32 and the storage dtypes of DeepSeek checkpoints.

/// bf16 (as its raw little-endian u16 bits) to f32.
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits, rounding to nearest even (NaN stays NaN).
#[inline]
pub fn f32_to_bf16(value: f32) -> u16 {
    half::bf16::from_f32(value).to_bits()
}

/// Decode table for FP8 e4m3fn (1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
/// no infinities, 0x7f/0xff are NaN).
pub static FP8_E4M3_TO_F32: [f32; 256] = build_fp8_table();

const fn build_fp8_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        let sign = if i & 0x80 != 0 { -1.0 } else { 1.0 };
        let exponent = ((i >> 3) & 0xf) as i32;
        let mantissa = (i & 0x7) as f32;
        let magnitude = if exponent == 0xf && (i & 0x7) == 0x7 {
            f32::NAN
        } else if exponent == 0 {
            mantissa / 8.0 * (1.0 / 64.0)
        } else {
            (1.0 + mantissa / 8.0) * pow2(exponent - 7)
        };
        table[i] = sign * magnitude;
        i += 1;
    }
    table
}

const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut k = 0;
    if e >= 0 {
        while k < e {
            v *= 2.0;
            k += 1;
        }
    } else {
        while k < -e {
            v *= 0.5;
            k += 1;
        }
    }
    v
}

#[inline]
pub fn fp8_e4m3_to_f32(bits: u8) -> f32 {
    FP8_E4M3_TO_F32[bits as usize]
}

/// Largest finite FP8 e4m3fn magnitude.
pub const FP8_E4M3_MAX: f32 = 448.0;

/// f32 to FP8 e4m3fn, round to nearest (ties to even mantissa), saturating at ±448.
pub fn f32_to_fp8_e4m3(value: f32) -> u8 {
    if value.is_nan() {
        return 0x7f;
    }
    let sign = if value.is_sign_negative() { 0x80u8 } else { 0 };
    let magnitude = value.abs().min(FP8_E4M3_MAX);
    // The 127 non-negative finite codes increase with their value: find the first
    // at or above the magnitude, then the nearer of it and its predecessor; a tie
    // goes to the even code (exactly one of two neighbours is even).
    let codes = &FP8_E4M3_TO_F32[..=0x7e];
    let above = codes.partition_point(|&v| v < magnitude).min(0x7e);
    if above == 0 {
        return sign;
    }
    let below = above - 1;
    let (err_below, err_above) = (magnitude - codes[below], codes[above] - magnitude);
    let best = if err_below < err_above || (err_below == err_above && below % 2 == 0) { below } else { above };
    sign | best as u8
}

/// The 16 values of FP4 e2m1, indexed by the nibble (bit 3 is the sign).
pub const FP4_E2M1_VALUES: [f32; 16] =
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Largest FP4 e2m1 magnitude.
pub const FP4_E2M1_MAX: f32 = 6.0;

/// f32 to an FP4 e2m1 nibble, round to nearest (ties to even code), saturating at ±6.
pub fn f32_to_fp4_e2m1(value: f32) -> u8 {
    let sign = if value.is_sign_negative() { 8u8 } else { 0 };
    let magnitude = if value.is_nan() { 0.0 } else { value.abs().min(FP4_E2M1_MAX) };
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for code in 0u8..8 {
        let err = (FP4_E2M1_VALUES[code as usize] - magnitude).abs();
        if err < best_err || (err == best_err && code % 2 == 0) {
            best = code;
            best_err = err;
        }
    }
    sign | best
}

/// UE8M0 scale byte (a bare biased exponent) to f32: 2^(bits − 127).
#[inline]
pub fn ue8m0_to_f32(bits: u8) -> f32 {
    match bits {
        0xff => f32::NAN,
        // 2^-127 is an f32 subnormal: only the top mantissa bit set.
        0 => f32::from_bits(1 << 22),
        _ => f32::from_bits((bits as u32) << 23),
    }
}

/// The smallest power of two `s` with `max_abs / s <= format_max`, as a UE8M0 byte.
pub fn ue8m0_scale_for(max_abs: f32, format_max: f32) -> u8 {
    if max_abs.is_nan() || max_abs <= 0.0 || max_abs.is_infinite() {
        return 127; // scale 1.0
    }
    let exponent = (max_abs / format_max).log2().ceil() as i32;
    (exponent + 127).clamp(1, 254) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_table_matches_known_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
        assert!(fp8_e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn fp8_round_trip_is_exact_on_codes() {
        for code in 0u8..=255 {
            let v = fp8_e4m3_to_f32(code);
            if v.is_nan() || (v == 0.0 && code == 0x80) {
                continue;
            }
            assert_eq!(f32_to_fp8_e4m3(v), code, "code {code:#x}");
        }
    }

    /// The search gives the same code as an exhaustive nearest-code scan.
    #[test]
    fn fp8_encoding_matches_an_exhaustive_scan() {
        let scan = |value: f32| {
            let sign = if value.is_sign_negative() { 0x80u8 } else { 0 };
            let magnitude = value.abs().min(FP8_E4M3_MAX);
            let mut best = 0u8;
            let mut best_err = f32::INFINITY;
            for code in 0u8..=0x7e {
                let err = (FP8_E4M3_TO_F32[code as usize] - magnitude).abs();
                if err < best_err || (err == best_err && code % 2 == 0) {
                    best = code;
                    best_err = err;
                }
            }
            sign | best
        };
        let mut probes: Vec<f32> = (0..=0x7e)
            .flat_map(|c| {
                let v = FP8_E4M3_TO_F32[c];
                let next = FP8_E4M3_TO_F32[(c + 1).min(0x7e)];
                [v, (v + next) / 2.0, f32::from_bits(v.to_bits() + 1), v * 0.999, -v]
            })
            .collect();
        probes.extend([0.0, -0.0, 1e-9, 500.0, -1e6, f32::INFINITY]);
        let mut x = 0x1234_5678u32;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            probes.push(f32::from_bits(x & 0x43ff_ffff) * if x & 1 == 0 { 1.0 } else { -1.0 });
        }
        for v in probes {
            assert_eq!(f32_to_fp8_e4m3(v), scan(v), "{v:e}");
        }
    }

    #[test]
    fn fp4_round_trip_is_exact_on_codes() {
        for code in 0u8..16 {
            if code == 8 {
                continue;
            }
            assert_eq!(f32_to_fp4_e2m1(FP4_E2M1_VALUES[code as usize]), code);
        }
        assert_eq!(f32_to_fp4_e2m1(100.0), 7);
        assert_eq!(f32_to_fp4_e2m1(2.4), 4);
    }

    #[test]
    fn ue8m0_scales() {
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(128), 2.0);
        assert_eq!(ue8m0_to_f32(126), 0.5);
        assert_eq!(ue8m0_scale_for(448.0, FP8_E4M3_MAX), 127);
        assert_eq!(ue8m0_scale_for(449.0, FP8_E4M3_MAX), 128);
        assert_eq!(ue8m0_scale_for(6.0, FP4_E2M1_MAX), 127);
        assert_eq!(ue8m0_scale_for(1.0, FP4_E2M1_MAX), 125);
    }
}
