// What the V4.1 kernel files share: the reference's bf16 rounding, Rust's
// clamp, the e2m1 values and `act_quant::dot_f64`'s lane order. Included
// after common.cuh.
#pragma once

// `round_bf16` (half::bf16::from_f32 then back): ties to even; a NaN keeps
// its high bits with the quiet bit set.
static __device__ __forceinline__ float v41_round_bf16(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((b >> 16) | 0x40u) << 16);
    u32 h = b >> 16;
    if ((b & 0x8000u) != 0 && (b & (3u * 0x8000u - 1u)) != 0) h += 1;
    return __uint_as_float(h << 16);
}

// Rust's `f32::clamp`: NaN stays NaN.
static __device__ __forceinline__ float v41_clamp(float x, float lo, float hi) {
    if (x < lo) x = lo;
    if (x > hi) x = hi;
    return x;
}

// The 16 values of FP4 e2m1 by nibble (`FP4_E2M1_VALUES`), by arithmetic.
static __device__ __forceinline__ float v41_fp4_value(u32 code) {
    u32 m = code & 7u;
    float v = m < 4u ? 0.5f * static_cast<float>(m) : m < 6u ? static_cast<float>(m - 2u) : m == 6u ? 4.0f : 6.0f;
    return (code & 8u) ? -v : v;
}

// The CPU's eight-lane f64 dot product (`dot_f64_lanes` / `combine_lanes`).
static __device__ __forceinline__ double v41_dot_f64(const float* a, const float* b, int n) {
    double acc[8];
#pragma unroll
    for (int l = 0; l < 8; ++l) acc[l] = 0.0;
    const int whole = n / 8 * 8;
    for (int c = 0; c < whole; c += 8)
#pragma unroll
        for (int l = 0; l < 8; ++l)
            acc[l] = __dadd_rn(acc[l], __dmul_rn(static_cast<double>(a[c + l]), static_cast<double>(b[c + l])));
    double tail = -0.0;
    for (int c = whole; c < n; ++c)
        tail = __dadd_rn(tail, __dmul_rn(static_cast<double>(a[c]), static_cast<double>(b[c])));
    double lo = __dadd_rn(__dadd_rn(acc[0], acc[4]), __dadd_rn(acc[1], acc[5]));
    double hi = __dadd_rn(__dadd_rn(acc[2], acc[6]), __dadd_rn(acc[3], acc[7]));
    return __dadd_rn(__dadd_rn(lo, hi), tail);
}
