// What every kernel of deepinfer's NVIDIA device shares: the checkpoint's
// number formats decoded by bits, the engine's `exp`, and the 16-lane
// reduction order the CPU kernels define. Compiled by NVRTC for the GPU and
// by the host's C++ compiler for the emulated device (cuda_emu.h); it uses no
// header of the CUDA toolkit, so the emulated device needs none installed.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define DI_INF __int_as_float(0x7f800000)
#define DI_NEG_INF __int_as_float(0xff800000)
#define DI_NAN __int_as_float(0x7fc00000)

#ifndef DI_EMULATED
#define DI_DYNAMIC_SHARED(type, name) extern __shared__ __align__(16) unsigned char di_dynamic_shared_bytes[]; \
    type* name = reinterpret_cast<type*>(di_dynamic_shared_bytes)
#endif

__device__ __forceinline__ float di_bf16_to_f32(u16 bits) { return __uint_as_float(static_cast<u32>(bits) << 16); }

// FP8 e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities; 0x7f and 0xff are NaN. Every value is exact in f32.
__device__ __forceinline__ float di_fp8_e4m3_to_f32(u8 bits) {
    u32 sign = (bits & 0x80u) << 24;
    u32 exponent = (bits >> 3) & 0xfu;
    u32 mantissa = bits & 0x7u;
    if (exponent == 0xfu && mantissa == 0x7u) return __uint_as_float(sign | 0x7fc00000u);
    if (exponent == 0) {
        // Subnormal: mantissa * 2^-9.
        float v = static_cast<float>(mantissa) * 0.001953125f;
        return sign ? -v : v;
    }
    return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// FP4 e2m1: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
__device__ __forceinline__ float di_fp4_e2m1_to_f32(u32 nibble) {
    u32 magnitude = nibble & 0x7u;
    float v = magnitude < 2u ? 0.5f * static_cast<float>(magnitude)
              : magnitude < 4u ? 0.5f * static_cast<float>(magnitude)
              : magnitude < 6u ? static_cast<float>(magnitude - 2u)
              : magnitude == 6u ? 4.0f : 6.0f;
    return (nibble & 0x8u) ? -v : v;
}

// UE8M0: 2^(bits - 127); 0xff is NaN.
__device__ __forceinline__ float di_ue8m0_to_f32(u8 bits) {
    if (bits == 0xffu) return DI_NAN;
    if (bits == 0) return __uint_as_float(0x00400000u);
    return __uint_as_float(static_cast<u32>(bits) << 23);
}

// The engine's exp (kernels/src/exp.rs): a fixed sequence of IEEE operations.
__device__ __forceinline__ float di_exp(float x) {
    if (isnan(x)) return x;
    if (x > 88.72283f) return DI_INF;
    if (x < -103.97208f) return 0.0f;
    const float log2e = 1.44269504088896340736f;
    const float ln2_hi = __uint_as_float(0x3f317200u);
    const float ln2_lo = __uint_as_float(0x35bfbe8eu);
    float n = rintf(__fmul_rn(x, log2e));
    float r = __fmaf_rn(n, -ln2_lo, __fmaf_rn(n, -ln2_hi, x));
    float p = 1.9875691e-4f;
    p = __fmaf_rn(p, r, 1.3981999e-3f);
    p = __fmaf_rn(p, r, 8.333452e-3f);
    p = __fmaf_rn(p, r, 4.1665796e-2f);
    p = __fmaf_rn(p, r, 0.16666665f);
    p = __fmaf_rn(p, r, 0.5f);
    float y = __fadd_rn(__fmaf_rn(p, __fmul_rn(r, r), r), 1.0f);
    int ni = static_cast<int>(n);
    int n1 = ni >> 1;
    int n2 = ni - n1;
    return __fmul_rn(__fmul_rn(y, __uint_as_float(static_cast<u32>(n1 + 127) << 23)),
                     __uint_as_float(static_cast<u32>(n2 + 127) << 23));
}

// The CPU's reduction of 16 lane accumulators (kernels/src/simd/mod.rs
// `reduce16`): halves folded onto the lower lanes, 8, 4, 2, 1.
__device__ __forceinline__ float di_reduce16(float* acc) {
#pragma unroll
    for (int width = 8; width >= 1; width /= 2)
#pragma unroll
        for (int l = 0; l < width; ++l) acc[l] = __fadd_rn(acc[l], acc[l + width]);
    return acc[0];
}

// The CPU's `dot` (kernels/src/simd/portable.rs): column c feeds lane c % 16
// as a fused multiply-add chain, the tail columns lanes 0.., then reduce16.
// The lanes are unrolled so that they stay in registers (an array indexed
// by `c % 16` would live in local memory).
__device__ __forceinline__ float di_dot16(const float* a, const float* b, int n) {
    float acc[16];
#pragma unroll
    for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
    int c = 0;
    for (; c + 16 <= n; c += 16) {
#pragma unroll
        for (int l = 0; l < 16; ++l) acc[l] = __fmaf_rn(a[c + l], b[c + l], acc[l]);
    }
#pragma unroll
    for (int l = 0; l < 16; ++l)
        if (c + l < n) acc[l] = __fmaf_rn(a[c + l], b[c + l], acc[l]);
    return di_reduce16(acc);
}

// The same with `a` strided (a column of a row-major matrix and the like).
__device__ __forceinline__ float di_dot16_strided(const float* a, int a_stride, const float* b, int n) {
    float acc[16];
#pragma unroll
    for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
    int c = 0;
    for (; c + 16 <= n; c += 16) {
#pragma unroll
        for (int l = 0; l < 16; ++l) acc[l] = __fmaf_rn(a[(c + l) * a_stride], b[c + l], acc[l]);
    }
#pragma unroll
    for (int l = 0; l < 16; ++l)
        if (c + l < n) acc[l] = __fmaf_rn(a[(c + l) * a_stride], b[c + l], acc[l]);
    return di_reduce16(acc);
}
