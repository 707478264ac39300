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

static __device__ __forceinline__ double v41_as_double(u64 bits) { return __longlong_as_double(static_cast<long long>(bits)); }
static __device__ __forceinline__ u64 v41_as_bits(double v) { return static_cast<u64>(__double_as_longlong(v)); }

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

// The 16 values of FP4 e2m1 by nibble (`FP4_E2M1_VALUES`), by arithmetic.
static __device__ __forceinline__ float v41_fp4_value(u32 code) {
    u32 m = code & 7u;
    float v = m < 4u ? 0.5f * static_cast<float>(m) : m < 6u ? static_cast<float>(m - 2u) : m == 6u ? 4.0f : 6.0f;
    return (code & 8u) ? -v : v;
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

// The CPU's f64::exp: glibc's exp (ARM optimized-routines, the x86-64 FMA
// build), operation for operation; the same port as sampling.cu's
// `di_libm_exp`, kept here because NVRTC inlines no other file. Entry 2k of
// the table holds RN((2^(k/128) - H) / H), entry 2k+1 H minus k << 45.
static __device__ const u64 v41_exp_table[256] = {
    0x0000000000000000ull, 0x3ff0000000000000ull, 0x3c9b3b4f1a88bf6eull, 0x3feff63da9fb3335ull,
    0xbc7160139cd8dc5dull, 0x3fefec9a3e778061ull, 0xbc905e7a108766d1ull, 0x3fefe315e86e7f85ull,
    0x3c8cd2523567f613ull, 0x3fefd9b0d3158574ull, 0xbc8bce8023f98efaull, 0x3fefd06b29ddf6deull,
    0x3c60f74e61e6c861ull, 0x3fefc74518759bc8ull, 0x3c90a3e45b33d399ull, 0x3fefbe3ecac6f383ull,
    0x3c979aa65d837b6dull, 0x3fefb5586cf9890full, 0x3c8eb51a92fdeffcull, 0x3fefac922b7247f7ull,
    0x3c3ebe3d702f9cd1ull, 0x3fefa3ec32d3d1a2ull, 0xbc6a033489906e0bull, 0x3fef9b66affed31bull,
    0xbc9556522a2fbd0eull, 0x3fef9301d0125b51ull, 0xbc5080ef8c4eea55ull, 0x3fef8abdc06c31ccull,
    0xbc91c923b9d5f416ull, 0x3fef829aaea92de0ull, 0x3c80d3e3e95c55afull, 0x3fef7a98c8a58e51ull,
    0xbc801b15eaa59348ull, 0x3fef72b83c7d517bull, 0xbc8f1ff055de323dull, 0x3fef6af9388c8deaull,
    0x3c8b898c3f1353bfull, 0x3fef635beb6fcb75ull, 0xbc96d99c7611eb26ull, 0x3fef5be084045cd4ull,
    0x3c9aecf73e3a2f60ull, 0x3fef54873168b9aaull, 0xbc8fe782cb86389dull, 0x3fef4d5022fcd91dull,
    0x3c8a6f4144a6c38dull, 0x3fef463b88628cd6ull, 0x3c807a05b0e4047dull, 0x3fef3f49917ddc96ull,
    0x3c968efde3a8a894ull, 0x3fef387a6e756238ull, 0x3c875e18f274487dull, 0x3fef31ce4fb2a63full,
    0x3c80472b981fe7f2ull, 0x3fef2b4565e27cddull, 0xbc96b87b3f71085eull, 0x3fef24dfe1f56381ull,
    0x3c82f7e16d09ab31ull, 0x3fef1e9df51fdee1ull, 0xbc3d219b1a6fbffaull, 0x3fef187fd0dad990ull,
    0x3c8b3782720c0ab4ull, 0x3fef1285a6e4030bull, 0x3c6e149289cecb8full, 0x3fef0cafa93e2f56ull,
    0x3c834d754db0abb6ull, 0x3fef06fe0a31b715ull, 0x3c864201e2ac744cull, 0x3fef0170fc4cd831ull,
    0x3c8fdd395dd3f84aull, 0x3feefc08b26416ffull, 0xbc86a3803b8e5b04ull, 0x3feef6c55f929ff1ull,
    0xbc924aedcc4b5068ull, 0x3feef1a7373aa9cbull, 0xbc9907f81b512d8eull, 0x3feeecae6d05d866ull,
    0xbc71d1e83e9436d2ull, 0x3feee7db34e59ff7ull, 0xbc991919b3ce1b15ull, 0x3feee32dc313a8e5ull,
    0x3c859f48a72a4c6dull, 0x3feedea64c123422ull, 0xbc9312607a28698aull, 0x3feeda4504ac801cull,
    0xbc58a78f4817895bull, 0x3feed60a21f72e2aull, 0xbc7c2c9b67499a1bull, 0x3feed1f5d950a897ull,
    0x3c4363ed60c2ac11ull, 0x3feece086061892dull, 0x3c9666093b0664efull, 0x3feeca41ed1d0057ull,
    0x3c6ecce1daa10379ull, 0x3feec6a2b5c13cd0ull, 0x3c93ff8e3f0f1230ull, 0x3feec32af0d7d3deull,
    0x3c7690cebb7aafb0ull, 0x3feebfdad5362a27ull, 0x3c931dbdeb54e077ull, 0x3feebcb299fddd0dull,
    0xbc8f94340071a38eull, 0x3feeb9b2769d2ca7ull, 0xbc87deccdc93a349ull, 0x3feeb6daa2cf6642ull,
    0xbc78dec6bd0f385full, 0x3feeb42b569d4f82ull, 0xbc861246ec7b5cf6ull, 0x3feeb1a4ca5d920full,
    0x3c93350518fdd78eull, 0x3feeaf4736b527daull, 0x3c7b98b72f8a9b05ull, 0x3feead12d497c7fdull,
    0x3c9063e1e21c5409ull, 0x3feeab07dd485429ull, 0x3c34c7855019c6eaull, 0x3feea9268a5946b7ull,
    0x3c9432e62b64c035ull, 0x3feea76f15ad2148ull, 0xbc8ce44a6199769full, 0x3feea5e1b976dc09ull,
    0xbc8c33c53bef4da8ull, 0x3feea47eb03a5585ull, 0xbc845378892be9aeull, 0x3feea34634ccc320ull,
    0xbc93cedd78565858ull, 0x3feea23882552225ull, 0x3c5710aa807e1964ull, 0x3feea155d44ca973ull,
    0xbc93b3efbf5e2228ull, 0x3feea09e667f3bcdull, 0xbc6a12ad8734b982ull, 0x3feea012750bdabfull,
    0xbc6367efb86da9eeull, 0x3fee9fb23c651a2full, 0xbc80dc3d54e08851ull, 0x3fee9f7df9519484ull,
    0xbc781f647e5a3ecfull, 0x3fee9f75e8ec5f74ull, 0xbc86ee4ac08b7db0ull, 0x3fee9f9a48a58174ull,
    0xbc8619321e55e68aull, 0x3fee9feb564267c9ull, 0x3c909ccb5e09d4d3ull, 0x3feea0694fde5d3full,
    0xbc7b32dcb94da51dull, 0x3feea11473eb0187ull, 0x3c94ecfd5467c06bull, 0x3feea1ed0130c132ull,
    0x3c65ebe1abd66c55ull, 0x3feea2f336cf4e62ull, 0xbc88a1c52fb3cf42ull, 0x3feea427543e1a12ull,
    0xbc9369b6f13b3734ull, 0x3feea589994cce13ull, 0xbc805e843a19ff1eull, 0x3feea71a4623c7adull,
    0xbc94d450d872576eull, 0x3feea8d99b4492edull, 0x3c90ad675b0e8a00ull, 0x3feeaac7d98a6699ull,
    0x3c8db72fc1f0eab4ull, 0x3feeace5422aa0dbull, 0xbc65b6609cc5e7ffull, 0x3feeaf3216b5448cull,
    0x3c7bf68359f35f44ull, 0x3feeb1ae99157736ull, 0xbc93091fa71e3d83ull, 0x3feeb45b0b91ffc6ull,
    0xbc5da9b88b6c1e29ull, 0x3feeb737b0cdc5e5ull, 0xbc6c23f97c90b959ull, 0x3feeba44cbc8520full,
    0xbc92434322f4f9aaull, 0x3feebd829fde4e50ull, 0xbc85ca6cd7668e4bull, 0x3feec0f170ca07baull,
    0x3c71affc2b91ce27ull, 0x3feec49182a3f090ull, 0x3c6dd235e10a73bbull, 0x3feec86319e32323ull,
    0xbc87c50422622263ull, 0x3feecc667b5de565ull, 0x3c8b1c86e3e231d5ull, 0x3feed09bec4a2d33ull,
    0xbc91bbd1d3bcbb15ull, 0x3feed503b23e255dull, 0x3c90cc319cee31d2ull, 0x3feed99e1330b358ull,
    0x3c8469846e735ab3ull, 0x3feede6b5579fdbfull, 0xbc82dfcd978e9db4ull, 0x3feee36bbfd3f37aull,
    0x3c8c1a7792cb3387ull, 0x3feee89f995ad3adull, 0xbc907b8f4ad1d9faull, 0x3feeee07298db666ull,
    0xbc55c3d956dcaebaull, 0x3feef3a2b84f15fbull, 0xbc90a40e3da6f640ull, 0x3feef9728de5593aull,
    0xbc68d6f438ad9334ull, 0x3feeff76f2fb5e47ull, 0xbc91eee26b588a35ull, 0x3fef05b030a1064aull,
    0x3c74ffd70a5fddcdull, 0x3fef0c1e904bc1d2ull, 0xbc91bdfbfa9298acull, 0x3fef12c25bd71e09ull,
    0x3c736eae30af0cb3ull, 0x3fef199bdd85529cull, 0x3c8ee3325c9ffd94ull, 0x3fef20ab5fffd07aull,
    0x3c84e08fd10959acull, 0x3fef27f12e57d14bull, 0x3c63cdaf384e1a67ull, 0x3fef2f6d9406e7b5ull,
    0x3c676b2c6c921968ull, 0x3fef3720dcef9069ull, 0xbc808a1883ccb5d2ull, 0x3fef3f0b555dc3faull,
    0xbc8fad5d3ffffa6full, 0x3fef472d4a07897cull, 0xbc900dae3875a949ull, 0x3fef4f87080d89f2ull,
    0x3c74a385a63d07a7ull, 0x3fef5818dcfba487ull, 0xbc82919e2040220full, 0x3fef60e316c98398ull,
    0x3c8e5a50d5c192acull, 0x3fef69e603db3285ull, 0x3c843a59ac016b4bull, 0x3fef7321f301b460ull,
    0xbc82d52107b43e1full, 0x3fef7c97337b9b5full, 0xbc892ab93b470dc9ull, 0x3fef864614f5a129ull,
    0x3c74b604603a88d3ull, 0x3fef902ee78b3ff6ull, 0x3c83c5ec519d7271ull, 0x3fef9a51fbc74c83ull,
    0xbc8ff7128fd391f0ull, 0x3fefa4afa2a490daull, 0xbc8dae98e223747dull, 0x3fefaf482d8e67f1ull,
    0x3c8ec3bc41aa2008ull, 0x3fefba1bee615a27ull, 0x3c842b94c3a9eb32ull, 0x3fefc52b376bba97ull,
    0x3c8a64a931d185eeull, 0x3fefd0765b6e4540ull, 0xbc8e37bae43be3edull, 0x3fefdbfdad9cbe14ull,
    0x3c77893b4d91cd9dull, 0x3fefe7c1819e90d8ull, 0x3c5305c14160cc89ull, 0x3feff3c22b8f71f1ull,
};
// glibc's exp for |x| >= 512 or so: the scale's exponent out of range.
static __device__ double v41_exp_special(double tmp, u64 sbits, u64 ki) {
    if ((ki & 0x80000000ull) == 0) {
        // k > 0: the scale's exponent may have overflowed by <= 460.
        double scale = v41_as_double(sbits - (1009ull << 52));
        return __dmul_rn(__fma_rn(scale, tmp, scale), v41_as_double(0x7f00000000000000ull));  // 0x1p1009
    }
    // k < 0: round once in the normal range before scaling into the subnormals.
    double scale = v41_as_double(sbits + (1022ull << 52));
    double p = __dmul_rn(scale, tmp);
    double y = __dadd_rn(scale, p);
    if (y < 1.0) {
        double lo = __dadd_rn(__dadd_rn(scale, -y), p);
        double hi = __dadd_rn(y, 1.0);
        double t = __dadd_rn(__dadd_rn(1.0, -hi), y);
        t = __dadd_rn(t, lo);
        y = __dadd_rn(__dadd_rn(t, hi), -1.0);
        if (y == 0.0) y = 0.0;
    }
    return __dmul_rn(y, v41_as_double(0x0010000000000000ull));  // 0x1p-1022
}

// The CPU's f64::exp (glibc's exp, FMA build), operation for operation.
static __device__ double v41_exp(double x) {
    const double inv_ln2_n = v41_as_double(0x40671547652b82feull);   // 128 / ln 2
    const double neg_ln2_hi_n = v41_as_double(0xbf762e42fefa0000ull);
    const double neg_ln2_lo_n = v41_as_double(0xbd0cf79abc9e3b3aull);
    const double shift = v41_as_double(0x4338000000000000ull);       // 0x1.8p52
    const double c2 = v41_as_double(0x3fdffffffffffdbdull);
    const double c3 = v41_as_double(0x3fc555555555543cull);
    const double c4 = v41_as_double(0x3fa55555cf172b91ull);
    const double c5 = v41_as_double(0x3f81111167a4d017ull);
    const u64 ux = v41_as_bits(x);
    const u32 abstop = static_cast<u32>(ux >> 52) & 0x7ffu;
    bool special = false;
    // 0x3c9 = top12(0x1p-54), 0x408 = top12(512), 0x409 = top12(1024).
    if (abstop - 0x3c9u >= 0x408u - 0x3c9u) {
        if (abstop - 0x3c9u >= 0x80000000u) return __dadd_rn(x, 1.0);  // tiny x
        if (abstop >= 0x409u) {
            if (ux == 0xfff0000000000000ull) return 0.0;
            if (abstop >= 0x7ffu) return __dadd_rn(x, 1.0);  // +inf, NaN
            return (ux >> 63) ? 0.0 : DI_INF;                 // underflow, overflow
        }
        special = true;
    }
    double kd = __fma_rn(x, inv_ln2_n, shift);
    const u64 ki = v41_as_bits(kd);
    kd = __dadd_rn(kd, -shift);
    double r = __fma_rn(kd, neg_ln2_hi_n, x);
    r = __fma_rn(kd, neg_ln2_lo_n, r);
    const u64 idx = 2 * (ki % 128);
    const u64 top = ki << 45;
    const double tail = v41_as_double(v41_exp_table[idx]);
    const u64 sbits = v41_exp_table[idx + 1] + top;
    const double r2 = __dmul_rn(r, r);
    double tmp = __fma_rn(__fma_rn(r, c3, c2), r2, __dadd_rn(r, tail));
    tmp = __fma_rn(__dmul_rn(r2, r2), __fma_rn(r, c5, c4), tmp);
    if (special) return v41_exp_special(tmp, sbits, ki);
    const double scale = v41_as_double(sbits);
    return __fma_rn(scale, tmp, scale);
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
        case V41_OP_EXP: return static_cast<float>(v41_exp(d));
        case V41_OP_SIGMOID: return static_cast<float>(__ddiv_rn(1.0, __dadd_rn(1.0, v41_exp(-d))));
        case V41_OP_SILU: return static_cast<float>(__ddiv_rn(d, __dadd_rn(1.0, v41_exp(-d))));
        // torch's softplus, linear above 20; log1p is the device's.
        case V41_OP_SOFTPLUS: return static_cast<float>(d > 20.0 ? d : log1p(v41_exp(d)));
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
        for (int c = 0; c < width; ++c) total = __dadd_rn(total, v41_exp(__dadd_rn(static_cast<double>(row[c]), -max)));
        max_total[0] = max;
        max_total[1] = total;
    }
    __syncthreads();
    const double max = max_total[0], total = max_total[1];
    for (int c = threadIdx.x; c < width; c += blockDim.x)
        row[c] = static_cast<float>(__ddiv_rn(v41_exp(__dadd_rn(static_cast<double>(row[c]), -max)), total));
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
