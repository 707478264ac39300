// DeepSeek-V4.1's defined arithmetic on rows (engine/src/v41/ops.rs,
// kernels/src/act_quant.rs) on the device, bit for bit: the element-wise
// maps, the FP8/FP4 quantisers and round trips, RMSNorm, softmax and RoPE.
// (The linears and dot products are in v41_linear.cu, the model's steps in
// v41_model.cu and v41_indexer.cu.)
// - bf16 rounding as `half::bf16::from_f32` (ties to even, NaN kept quiet);
// - FP8 e4m3 activations per 32 with a power-of-two scale
//   (`fp8_quantize_row`, `fp8_round_trip`), FP4 e2m1 round trips
//   (`fp4_round_trip`, UE8M0 or e4m3 scales);
// - RMSNorm, softmax and the element-wise transcendentals in f64: sums in
//   element order on one thread, `exp` the CPU's own (glibc's, ported below
//   operation for operation), `sqrt`/division IEEE; `log1p` (softplus only)
//   is the device's libm, which may differ from glibc's in the last f64 bit;
// - RoPE from host cos/sin tables (the CPU's libm `cos`/`sin` of the f32
//   angle), rotated in f64 and rounded to f32 then bf16.
#include "common.cuh"
#include "v41.cuh"
#include "libm_exp.cuh"

// `power_of_two_scale`: 2^ceil(log2(amax · max_inv)) from the product's bits.
static __device__ __forceinline__ float v41_power_of_two_scale(float amax, float max_inv) {
    int bits = __float_as_int(__fmul_rn(amax, max_inv));
    int exponent = (bits >> 23) & 0xff;
    int mantissa = bits & ((1 << 23) - 1);
    int log2_ceil = exponent - 127 + (mantissa != 0 ? 1 : 0);
    return __uint_as_float(static_cast<u32>(log2_ceil + 127) << 23);
}

// `e4m3_round`: the nearest FP8 e4m3 value (ties to even), saturated at ±448.
static __device__ __forceinline__ float v41_e4m3_round(float x) {
    x = v41_clamp(x, -448.0f, 448.0f);
    float magnitude = fabsf(x);
    float rounded;
    if (magnitude < 0.015625f) {
        const float rounder = 8388608.0f;
        rounded = __fdiv_rn(__fadd_rn(__fadd_rn(__fmul_rn(magnitude, 512.0f), rounder), -rounder), 512.0f);
    } else {
        u32 bits = __float_as_uint(magnitude);
        u32 lsb = (bits >> 20) & 1u;
        rounded = __uint_as_float((bits + 0x7ffffu + lsb) & ~0xfffffu);
    }
    return copysignf(rounded, x);
}

// `f32_to_fp4_e2m1`: the nearest e2m1 code (ties to the even code), the
// magnitude saturated at 6, the sign bit kept (NaN: ±0).
static __device__ __forceinline__ u32 v41_fp4_code(float value) {
    u32 sign = (__float_as_uint(value) >> 31) ? 8u : 0u;
    float magnitude = isnan(value) ? 0.0f : fminf(fabsf(value), 6.0f);
    u32 best = 0;
    float best_err = DI_INF;
    for (u32 code = 0; code < 8u; ++code) {
        float err = fabsf(__fadd_rn(v41_fp4_value(code), -magnitude));
        if (err < best_err || (err == best_err && code % 2u == 0u)) {
            best = code;
            best_err = err;
        }
    }
    return sign | best;
}

// ---- Element-wise ----------------------------------------------------------

// What `v41_map_rows` applies (the Rust `Unary`'s discriminants).
#define V41_OP_ROUND_BF16 0
#define V41_OP_EXP 1
#define V41_OP_SIGMOID 2
#define V41_OP_SILU 3
#define V41_OP_SOFTPLUS 4
#define V41_OP_RSQRT 5

static __device__ __forceinline__ float v41_unary(int op, float x) {
    const double d = static_cast<double>(x);
    switch (op) {
        case V41_OP_ROUND_BF16: return v41_round_bf16(x);
        case V41_OP_EXP: return static_cast<float>(di_libm_exp(d));
        case V41_OP_SIGMOID: return static_cast<float>(__ddiv_rn(1.0, __dadd_rn(1.0, di_libm_exp(-d))));
        case V41_OP_SILU: return static_cast<float>(__ddiv_rn(d, __dadd_rn(1.0, di_libm_exp(-d))));
        // torch's softplus, linear above 20; log1p is the device's.
        case V41_OP_SOFTPLUS: return static_cast<float>(d > 20.0 ? d : log1p(di_libm_exp(d)));
        case V41_OP_RSQRT: return static_cast<float>(__ddiv_rn(1.0, __dsqrt_rn(d)));
        default: return x;
    }
}

// x: rows of `width` at `stride`, in place: row blockIdx.x, columns
// blockIdx.y * blockDim.x + threadIdx.x.
extern "C" __global__ void v41_map_rows(float* x, int stride, int width, int op) {
    float* row = x + static_cast<u64>(blockIdx.x) * stride;
    int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c < width) row[c] = v41_unary(op, row[c]);
}

// ---- FP8 / FP4 --------------------------------------------------------------

// `fp8_quantize_row` of n rows of `cols` (a multiple of 32): one thread per
// group of 32. values: [n][cols] e4m3 values (unscaled); scales: [n][cols/32].
extern "C" __global__ void v41_fp8_quantize_rows(const float* x, int x_stride, float* values, float* scales,
                                                 int cols) {
    const int groups = cols / 32;
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const float* in = x + static_cast<u64>(blockIdx.x) * x_stride + g * 32;
    float* out = values + static_cast<u64>(blockIdx.x) * cols + g * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(in[i]));
    amax = fmaxf(amax, 1e-4f);
    const float s = v41_power_of_two_scale(amax, __fdiv_rn(1.0f, 448.0f));
    for (int i = 0; i < 32; ++i) out[i] = v41_e4m3_round(__fdiv_rn(in[i], s));
    scales[static_cast<u64>(blockIdx.x) * groups + g] = s;
}

// `fp8_round_trip` in place: n rows of `width` (a multiple of 32), a thread a group.
extern "C" __global__ void v41_fp8_round_trip_rows(float* x, int stride, int width) {
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    if (g >= width / 32) return;
    float* v = x + static_cast<u64>(blockIdx.x) * stride + g * 32;
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
    amax = fmaxf(amax, 1e-4f);
    const float s = v41_power_of_two_scale(amax, __fdiv_rn(1.0f, 448.0f));
    for (int i = 0; i < 32; ++i) v[i] = v41_round_bf16(__fmul_rn(v41_e4m3_round(__fdiv_rn(v[i], s)), s));
}

// `fp4_round_trip` in place in groups of `block`: n rows of `width` (a
// multiple of block), a thread a group. e4m3_scale: 1 for Fp4Scale::E4m3
// (scale = e4m3(amax / 6)), 0 for Fp4Scale::Ue8m0 (power of two).
extern "C" __global__ void v41_fp4_round_trip_rows(float* x, int stride, int width, int block, int e4m3_scale) {
    const int g = blockIdx.y * blockDim.x + threadIdx.x;
    if (g >= width / block) return;
    float* v = x + static_cast<u64>(blockIdx.x) * stride + static_cast<u64>(g) * block;
    float amax = 0.0f;
    for (int i = 0; i < block; ++i) amax = fmaxf(amax, fabsf(v[i]));
    const float s = e4m3_scale ? v41_e4m3_round(__fdiv_rn(fmaxf(amax, 6.0f * 0.001953125f), 6.0f))
                               : v41_power_of_two_scale(fmaxf(amax, 6.0f * __uint_as_float(0x00800000u)),
                                                        __fdiv_rn(1.0f, 6.0f));
    for (int i = 0; i < block; ++i) {
        float q = v41_clamp(__fdiv_rn(v[i], s), -6.0f, 6.0f);
        v[i] = v41_round_bf16(__fmul_rn(v41_fp4_value(v41_fp4_code(q)), s));
    }
}

// ---- Row-wise ---------------------------------------------------------------

// `ops::rms_norm` in place: bf16(w · (x · inv)), inv = f32(1 / sqrt(f64(mean_sq + eps)))
// with mean_sq = f32(Σ f64(x·x) / dim), the sum in element order by thread 0.
extern "C" __global__ void v41_rms_norm_rows(float* x, int stride, const float* weight, int dim, float eps) {
    float* row = x + static_cast<u64>(blockIdx.x) * stride;
    __shared__ float inv;
    if (threadIdx.x == 0) {
        double sum = -0.0;
        for (int c = 0; c < dim; ++c) sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(row[c], row[c])));
        float mean_sq = static_cast<float>(__ddiv_rn(sum, static_cast<double>(dim)));
        inv = static_cast<float>(__ddiv_rn(1.0, __dsqrt_rn(static_cast<double>(__fadd_rn(mean_sq, eps)))));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += blockDim.x)
        row[c] = v41_round_bf16(__fmul_rn(weight[c], __fmul_rn(row[c], inv)));
}

// `ops::softmax` of each row (in place): max and the f64 exponentials' sum in
// element order by thread 0, then each element f32(e / total).
extern "C" __global__ void v41_softmax_rows(float* x, int stride, int width) {
    float* row = x + static_cast<u64>(blockIdx.x) * stride;
    __shared__ double max_total[2];
    if (threadIdx.x == 0) {
        double max = -__longlong_as_double(0x7ff0000000000000ll);
        for (int c = 0; c < width; ++c) max = fmax(max, static_cast<double>(row[c]));
        double total = -0.0;
        for (int c = 0; c < width; ++c) total = __dadd_rn(total, di_libm_exp(__dadd_rn(static_cast<double>(row[c]), -max)));
        max_total[0] = max;
        max_total[1] = total;
    }
    __syncthreads();
    const double max = max_total[0], total = max_total[1];
    for (int c = threadIdx.x; c < width; c += blockDim.x)
        row[c] = static_cast<float>(__ddiv_rn(di_libm_exp(__dadd_rn(static_cast<double>(row[c]), -max)), total));
}

// `RopeTable::apply` on every head of n rows: the pairs of
// x[r][h * head_stride + offset .. + 2 * half] rotated to the row's position
// (positions[r] when given, else first + r * step; clamped to the table),
// cos/sin from `[positions][half]` host tables (the CPU's f32 of f64 cos/sin
// of the f32 angle), the rotation in f64, the result f32 then bf16.
extern "C" __global__ void v41_rope_rows(float* x, int stride, int heads, int head_stride, int offset, int half,
                                         const float* cos_table, const float* sin_table, int table_positions,
                                         const u32* positions, int first, int step, int inverse) {
    const int r = blockIdx.x;
    long long p = positions ? static_cast<long long>(positions[r])
                            : static_cast<long long>(first) + static_cast<long long>(r) * step;
    p = min(max(p, 0ll), static_cast<long long>(table_positions - 1));
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        const int h = i / half, k = i % half;
        float* pair = x + static_cast<u64>(r) * stride + static_cast<u64>(h) * head_stride + offset + 2 * k;
        const double c = static_cast<double>(cos_table[p * half + k]);
        float sf = sin_table[p * half + k];
        if (inverse) sf = -sf;
        const double s = static_cast<double>(sf);
        const double a = static_cast<double>(pair[0]), b = static_cast<double>(pair[1]);
        pair[0] = v41_round_bf16(static_cast<float>(__dadd_rn(__dmul_rn(a, c), -__dmul_rn(b, s))));
        pair[1] = v41_round_bf16(static_cast<float>(__dadd_rn(__dmul_rn(a, s), __dmul_rn(b, c))));
    }
}
