// DeepSeek-V4.1's forward pass on the device: the model-level steps of
// engine/src/v41/ (forward.rs, attention.rs, ffn.rs, engram.rs, ops.rs)
// that the arithmetic primitives of v41_rows.cu and v41_linear.cu do not
// cover, each in the CPU's order of f32 operations, f64 sums and bf16
// roundings, so a step gives the CPU engine's bits:
// - mHC: the mixes of a token (`ops::hc_mixes`: sigmoid, row softmax,
//   Sinkhorn), the collapse (`hc_pre`) and the mix back (`hc_post`);
// - Engram: the FP8 table rows gathered and the gate added into the streams;
// - the compressor's gated pooling of a closed group (`attention::compress`);
// - the blockwise online-softmax attention over the window and the chosen
//   entries (`ops::sparse_attention`; the indexer that chooses them is in
//   v41_indexer.cu);
// - MoE routing (`ffn::route`), the weighted clamped SwiGLU
//   (`ffn::expert_forward`) and the combine (`ffn::combine`).
// Sums that the CPU takes with Rust's `Iterator::sum::<f64>` start from
// -0.0 as it does. `exp` is glibc's, ported as in v41_rows.cu (NVRTC inlines
// no other file, so the port is repeated here).
#include "common.cuh"

#define V41M_SLOTS 64

static __device__ __forceinline__ double v41m_as_double(u64 bits) { return __longlong_as_double(static_cast<long long>(bits)); }
static __device__ __forceinline__ u64 v41m_as_bits(double v) { return static_cast<u64>(__double_as_longlong(v)); }

// `round_bf16`: ties to even; a NaN keeps its high bits, quiet.
static __device__ __forceinline__ float v41m_round_bf16(float x) {
    u32 b = __float_as_uint(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((b >> 16) | 0x40u) << 16);
    u32 h = b >> 16;
    if ((b & 0x8000u) != 0 && (b & (3u * 0x8000u - 1u)) != 0) h += 1;
    return __uint_as_float(h << 16);
}

// Rust's `f32::clamp`: NaN stays NaN.
static __device__ __forceinline__ float v41m_clamp(float x, float lo, float hi) {
    if (x < lo) x = lo;
    if (x > hi) x = hi;
    return x;
}

// `act_quant::dot_f64`: eight f64 lanes (column c into lane c % 8), folded
// ((0+4)+(1+5))+((2+6)+(3+7)), plus the tail's products summed in order.
static __device__ __forceinline__ double v41m_dot_f64(const float* a, const float* b, int n) {
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

// The CPU's f64::exp: glibc's exp (ARM optimized-routines, the x86-64 FMA
// build), operation for operation; the same port as sampling.cu's
// `di_libm_exp`, kept here because NVRTC inlines no other file. Entry 2k of
// the table holds RN((2^(k/128) - H) / H), entry 2k+1 H minus k << 45.
static __device__ const u64 v41m_exp_table[256] = {
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
static __device__ double v41m_exp_special(double tmp, u64 sbits, u64 ki) {
    if ((ki & 0x80000000ull) == 0) {
        // k > 0: the scale's exponent may have overflowed by <= 460.
        double scale = v41m_as_double(sbits - (1009ull << 52));
        return __dmul_rn(__fma_rn(scale, tmp, scale), v41m_as_double(0x7f00000000000000ull));  // 0x1p1009
    }
    // k < 0: round once in the normal range before scaling into the subnormals.
    double scale = v41m_as_double(sbits + (1022ull << 52));
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
    return __dmul_rn(y, v41m_as_double(0x0010000000000000ull));  // 0x1p-1022
}

// The CPU's f64::exp (glibc's exp, FMA build), operation for operation.
static __device__ double v41m_exp(double x) {
    const double inv_ln2_n = v41m_as_double(0x40671547652b82feull);   // 128 / ln 2
    const double neg_ln2_hi_n = v41m_as_double(0xbf762e42fefa0000ull);
    const double neg_ln2_lo_n = v41m_as_double(0xbd0cf79abc9e3b3aull);
    const double shift = v41m_as_double(0x4338000000000000ull);       // 0x1.8p52
    const double c2 = v41m_as_double(0x3fdffffffffffdbdull);
    const double c3 = v41m_as_double(0x3fc555555555543cull);
    const double c4 = v41m_as_double(0x3fa55555cf172b91ull);
    const double c5 = v41m_as_double(0x3f81111167a4d017ull);
    const u64 ux = v41m_as_bits(x);
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
    const u64 ki = v41m_as_bits(kd);
    kd = __dadd_rn(kd, -shift);
    double r = __fma_rn(kd, neg_ln2_hi_n, x);
    r = __fma_rn(kd, neg_ln2_lo_n, r);
    const u64 idx = 2 * (ki % 128);
    const u64 top = ki << 45;
    const double tail = v41m_as_double(v41m_exp_table[idx]);
    const u64 sbits = v41m_exp_table[idx + 1] + top;
    const double r2 = __dmul_rn(r, r);
    double tmp = __fma_rn(__fma_rn(r, c3, c2), r2, __dadd_rn(r, tail));
    tmp = __fma_rn(__dmul_rn(r2, r2), __fma_rn(r, c5, c4), tmp);
    if (special) return v41m_exp_special(tmp, sbits, ki);
    const double scale = v41m_as_double(sbits);
    return __fma_rn(scale, tmp, scale);
}


// `ops::exp` (f32 through f64), `ops::sigmoid`, `ops::silu`, `ops::rsqrt`.
static __device__ __forceinline__ float v41m_expf(float x) { return static_cast<float>(v41m_exp(static_cast<double>(x))); }
static __device__ __forceinline__ float v41m_sigmoid(float x) {
    return static_cast<float>(__ddiv_rn(1.0, __dadd_rn(1.0, v41m_exp(-static_cast<double>(x)))));
}
static __device__ __forceinline__ float v41m_silu(float x) {
    const double d = static_cast<double>(x);
    return static_cast<float>(__ddiv_rn(d, __dadd_rn(1.0, v41m_exp(-d))));
}
static __device__ __forceinline__ float v41m_rsqrt(float x) {
    return static_cast<float>(__ddiv_rn(1.0, __dsqrt_rn(static_cast<double>(x))));
}
// `ops::mean_square`: f32 squares summed in f64 in element order.
static __device__ __forceinline__ float v41m_mean_square(const float* x, int n) {
    double sum = -0.0;
    for (int c = 0; c < n; ++c) sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(x[c], x[c])));
    return static_cast<float>(__ddiv_rn(sum, static_cast<double>(n)));
}

// ---- mHC ---------------------------------------------------------------------

// `ops::hc_mixes` of token blockIdx.x from `raw` (its mixing products,
// f32(dot_f64(streams, mix row)), `[n][(2 + hc) · hc]` at raw_stride) and its
// streams `[hc · d]`: pre [n][hc], post [n][hc], comb [n][hc · hc]. One
// thread: the token's few values in the CPU's order.
extern "C" __global__ void v41m_hc_mixes(const float* raw, int raw_stride, const float* streams, int hc, int d,
                                         float scale0, float scale1, float scale2, const float* base, int iters,
                                         float norm_eps, float hc_eps, float* pre, float* post, float* comb) {
    if (threadIdx.x != 0) return;
    const u64 t = blockIdx.x;
    const float* m = raw + t * raw_stride;
    const float inv = v41m_rsqrt(__fadd_rn(v41m_mean_square(streams + t * hc * d, hc * d), norm_eps));
    float* p = pre + t * hc;
    float* q = post + t * hc;
    float* c = comb + t * hc * hc;
    for (int j = 0; j < hc; ++j) {
        p[j] = __fadd_rn(v41m_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[j], inv), scale0), base[j])), hc_eps);
        q[j] = __fmul_rn(2.0f, v41m_sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(m[hc + j], inv), scale1), base[hc + j])));
    }
    for (int k = 0; k < hc * hc; ++k)
        c[k] = __fadd_rn(__fmul_rn(__fmul_rn(m[2 * hc + k], inv), scale2), base[2 * hc + k]);
    for (int i = 0; i < hc; ++i) {
        float* row = c + i * hc;
        float max = DI_NEG_INF;
        for (int j = 0; j < hc; ++j) max = fmaxf(max, row[j]);
        for (int j = 0; j < hc; ++j) row[j] = v41m_expf(__fadd_rn(row[j], -max));
        double total = -0.0;
        for (int j = 0; j < hc; ++j) total = __dadd_rn(total, static_cast<double>(row[j]));
        const float tf = static_cast<float>(total);
        for (int j = 0; j < hc; ++j) row[j] = __fadd_rn(__fdiv_rn(row[j], tf), hc_eps);
    }
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {
            for (int i = 0; i < hc; ++i) {
                float* row = c + i * hc;
                double total = -0.0;
                for (int j = 0; j < hc; ++j) total = __dadd_rn(total, static_cast<double>(row[j]));
                const float tf = __fadd_rn(static_cast<float>(total), hc_eps);
                for (int j = 0; j < hc; ++j) row[j] = __fdiv_rn(row[j], tf);
            }
        }
        for (int j = 0; j < hc; ++j) {
            double total = -0.0;
            for (int i = 0; i < hc; ++i) total = __dadd_rn(total, static_cast<double>(c[i * hc + j]));
            const float tf = __fadd_rn(static_cast<float>(total), hc_eps);
            for (int i = 0; i < hc; ++i) c[i * hc + j] = __fdiv_rn(c[i * hc + j], tf);
        }
    }
}

// `ops::hc_pre`: out[t][c] = bf16(Σ_i f64(pre[i] · streams[i][c])), the sum
// in stream order. Token blockIdx.x, channels over blockIdx.y and the threads.
extern "C" __global__ void v41m_hc_pre(const float* streams, const float* pre, int hc, int d, float* out) {
    const u64 t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const float* s = streams + t * hc * d;
    double sum = -0.0;
    for (int i = 0; i < hc; ++i) sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(pre[t * hc + i], s[i * d + c])));
    out[t * d + c] = v41m_round_bf16(static_cast<float>(sum));
}

// `ops::hc_post`: streams[j][c] = bf16(post[j] · output[c] + f32(Σ_i
// f64(comb[i][j] · residual[i][c]))), `residual` a copy of the streams.
extern "C" __global__ void v41m_hc_post(const float* residual, const float* output, const float* post,
                                        const float* comb, int hc, int d, float* streams) {
    const u64 t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const float* r = residual + t * hc * d;
    const float o = output[t * d + c];
    for (int j = 0; j < hc; ++j) {
        double mixed = -0.0;
        for (int i = 0; i < hc; ++i)
            mixed = __dadd_rn(mixed, static_cast<double>(__fmul_rn(comb[t * hc * hc + i * hc + j], r[i * d + c])));
        streams[t * hc * d + j * d + c] =
            v41m_round_bf16(__fadd_rn(__fmul_rn(post[t * hc + j], o), static_cast<float>(mixed)));
    }
}

// ---- Engram ------------------------------------------------------------------

// `EngramTable::row` of each looked-up row: out[i][c] = bf16(e4m3(values[r][c])
// · ue8m0(scales[r][c / 32])), r = rows[i] (clamped to the table), i = blockIdx.x.
extern "C" __global__ void v41m_engram_gather(const u8* values, const u8* scales, int table_rows, int dim,
                                              const u32* rows, float* out) {
    const u64 i = blockIdx.x;
    const u64 r = min(rows[i], static_cast<u32>(table_rows - 1));
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        const float v = di_fp8_e4m3_to_f32(values[r * dim + c]);
        const float s = di_ue8m0_to_f32(scales[r * (dim / 32) + c / 32]);
        out[i * dim + c] = v41m_round_bf16(__fmul_rn(v, s));
    }
}

// `engram::gate` of stream k = blockIdx.y of token t = blockIdx.x, then
// s[c] = bf16(s[c] + g · value[c]): kv [n][(hc + 1) · d] (keys of the hc
// streams, then the value), weight [hc][d], inv_sqrt_d = f32(d^-0.5).
extern "C" __global__ void v41m_engram_gate(float* streams, const float* kv, const float* weight, int hc, int d,
                                            float eps, float inv_sqrt_d) {
    const u64 t = blockIdx.x;
    const int k = blockIdx.y;
    float* s = streams + (t * hc + k) * d;
    const float* key = kv + t * (hc + 1) * d + static_cast<u64>(k) * d;
    const float* value = kv + t * (hc + 1) * d + static_cast<u64>(hc) * d;
    const float* w = weight + static_cast<u64>(k) * d;
    __shared__ float gate;
    if (threadIdx.x == 0) {
        const float rstd = __fmul_rn(v41m_rsqrt(__fadd_rn(v41m_mean_square(s, d), eps)),
                                     v41m_rsqrt(__fadd_rn(v41m_mean_square(key, d), eps)));
        double sum = -0.0;
        for (int c = 0; c < d; ++c) sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(__fmul_rn(s[c], w[c]), key[c])));
        const float dot = __fmul_rn(__fmul_rn(static_cast<float>(sum), rstd), inv_sqrt_d);
        gate = v41m_sigmoid(copysignf(__fsqrt_rn(fmaxf(fabsf(dot), 1e-6f)), dot));
    }
    __syncthreads();
    const float g = gate;
    for (int c = threadIdx.x; c < d; c += blockDim.x) s[c] = v41m_round_bf16(__fadd_rn(s[c], __fmul_rn(g, value[c])));
}

// ---- Element-wise ------------------------------------------------------------

// x[i] = bf16(x[i] · factor) (the indexer's weights) or, with `divide`,
// x[i] = x[i] / factor (the router's temperature), for i < count.
extern "C" __global__ void v41m_scale(float* x, long long count, float factor, int divide) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= count) return;
    x[i] = divide ? __fdiv_rn(x[i], factor) : v41m_round_bf16(__fmul_rn(x[i], factor));
}

// ---- Compressor --------------------------------------------------------------

// `attention::compress`'s pooling of closed group blockIdx.x: the group's
// `ratio` rows of kv and score logits (rows g · ratio.. of `kv`/`score`,
// [rows][hd]); per channel the f64 softmax of the logits (`ops::softmax`),
// f32(Σ f64(kv · weight)) (`ops::sum`), bf16. out [groups][hd].
extern "C" __global__ void v41m_compress_pool(const float* kv, const float* score, int ratio, int hd, float* out) {
    const u64 g = blockIdx.x;
    for (int ch = threadIdx.x; ch < hd; ch += blockDim.x) {
        const float* s = score + g * ratio * hd + ch;
        const float* v = kv + g * ratio * hd + ch;
        double max = DI_NEG_INF;
        for (int i = 0; i < ratio; ++i) max = fmax(max, static_cast<double>(s[i * hd]));
        double total = -0.0;
        for (int i = 0; i < ratio; ++i) total = __dadd_rn(total, v41m_exp(__dadd_rn(static_cast<double>(s[i * hd]), -max)));
        double sum = -0.0;
        for (int i = 0; i < ratio; ++i) {
            const float w = static_cast<float>(__ddiv_rn(v41m_exp(__dadd_rn(static_cast<double>(s[i * hd]), -max)), total));
            sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(v[i * hd], w)));
        }
        out[g * hd + ch] = v41m_round_bf16(static_cast<float>(sum));
    }
}

// ---- Indexer -----------------------------------------------------------------
// ---- Attention ---------------------------------------------------------------

// `ops::sparse_attention` of head blockIdx.y of query t = blockIdx.x (at
// position start + t) over its key list (`attention::attend_projected`):
// the window's slots (a chunk that starts the sequence: its visible rows
// from the oldest, then empty slots up to min(len, win); later: empty slots
// first, then the visible rows, win in all), then the chosen entries.
// Window rows: `keys` [rows][hd], row r at position base + r. Online
// softmax over blocks of 64 slots; dynamic shared memory: hd floats.
extern "C" __global__ void v41m_sparse_attention(const float* q, int heads, int hd, const float* keys, int base,
                                                 int start, int len, int win, const float* entries,
                                                 const int* selected, const int* counts, int sel_stride,
                                                 const float* sink, float scale, float* out) {
    DI_DYNAMIC_SHARED(float, acc);
    __shared__ const float* rows[V41M_SLOTS];
    __shared__ float score[V41M_SLOTS];
    __shared__ float prob[V41M_SLOTS];
    __shared__ float state[3];  // max, rescale, sum_exp
    const int t = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int p = start + t;
    const int oldest = max(p + 1 - win, 0);
    const int visible = p + 1 - oldest;
    const int window_slots = start == 0 ? min(len, win) : win;
    const int chosen = selected ? counts[t] : 0;
    const int total = window_slots + chosen;
    const float* qh = q + (static_cast<u64>(t) * heads + h) * hd;
    for (int c = tid; c < hd; c += blockDim.x) acc[c] = 0.0f;
    if (tid == 0) {
        state[0] = -1e30f;
        state[1] = 1.0f;
        state[2] = 0.0f;
    }
    __syncthreads();
    for (int b0 = 0; b0 < total; b0 += V41M_SLOTS) {
        const int in_block = min(V41M_SLOTS, total - b0);
        for (int i = tid; i < in_block; i += blockDim.x) {
            const int slot = b0 + i;
            const float* row = nullptr;
            if (slot < window_slots) {
                const int v = start == 0 ? slot : slot - (win - visible);
                if (v >= 0 && v < visible) row = keys + static_cast<u64>(oldest + v - base) * hd;
            } else {
                row = entries + static_cast<u64>(selected[static_cast<u64>(t) * sel_stride + slot - window_slots]) * hd;
            }
            rows[i] = row;
            score[i] = row ? __fmul_rn(static_cast<float>(v41m_dot_f64(qh, row, hd)), scale) : DI_NEG_INF;
        }
        __syncthreads();
        if (tid == 0) {
            float new_max = state[0];
            for (int i = 0; i < in_block; ++i) new_max = fmaxf(new_max, score[i]);
            state[1] = v41m_expf(__fadd_rn(state[0], -new_max));
            state[0] = new_max;
        }
        __syncthreads();
        const float max = state[0], rescale = state[1];
        for (int i = tid; i < in_block; i += blockDim.x) prob[i] = v41m_expf(__fadd_rn(score[i], -max));
        __syncthreads();
        if (tid == 0) {
            double sum = -0.0;
            for (int i = 0; i < in_block; ++i) sum = __dadd_rn(sum, static_cast<double>(prob[i]));
            state[2] = __fadd_rn(__fmul_rn(state[2], rescale), static_cast<float>(sum));
        }
        for (int c = tid; c < hd; c += blockDim.x) {
            double weighted = 0.0;
            for (int i = 0; i < in_block; ++i) {
                const float* row = rows[i];
                if (row)
                    weighted = __dadd_rn(weighted, __dmul_rn(static_cast<double>(v41m_round_bf16(prob[i])),
                                                             static_cast<double>(row[c])));
            }
            acc[c] = __fadd_rn(__fmul_rn(acc[c], rescale), static_cast<float>(weighted));
        }
        __syncthreads();
    }
    if (tid == 0) state[2] = __fadd_rn(state[2], v41m_expf(__fadd_rn(sink[h], -state[0])));
    __syncthreads();
    const float sum_exp = state[2];
    float* o = out + (static_cast<u64>(t) * heads + h) * hd;
    for (int c = tid; c < hd; c += blockDim.x) o[c] = v41m_round_bf16(__fdiv_rn(acc[c], sum_exp));
}

// ---- MoE -----------------------------------------------------------------------

// `ffn::route` of token blockIdx.x from its scores (after the score
// function; `sqrt_scores`: the square root of each, SqrtSoftplus): the top
// k of score + bias (ties to the lower expert), their unbiased scores as
// weights, normalised (`norm`) and scaled. experts/weights [n][k].
extern "C" __global__ void v41m_route(const float* scores, const float* bias, int e, int k, int sqrt_scores,
                                      int norm, float route_scale, int* experts, float* weights) {
    if (threadIdx.x != 0) return;
    const u64 t = blockIdx.x;
    const float* s = scores + t * e;
    int* ex = experts + t * k;
    float* w = weights + t * k;
    for (int slot = 0; slot < k; ++slot) {
        int best = -1;
        float best_v = 0.0f;
        for (int i = 0; i < e; ++i) {
            bool taken = false;
            for (int j = 0; j < slot; ++j) taken = taken || ex[j] == i;
            if (taken) continue;
            const float si = sqrt_scores ? __fsqrt_rn(s[i]) : s[i];
            const float v = __fadd_rn(si, bias[i]);
            if (best < 0 || v > best_v) {
                best = i;
                best_v = v;
            }
        }
        ex[slot] = best;
        w[slot] = sqrt_scores ? __fsqrt_rn(s[best]) : s[best];
    }
    if (norm && k > 1) {
        double sum = -0.0;
        for (int j = 0; j < k; ++j) sum = __dadd_rn(sum, static_cast<double>(w[j]));
        const float total = __fadd_rn(static_cast<float>(sum), 1e-20f);
        for (int j = 0; j < k; ++j) w[j] = __fdiv_rn(w[j], total);
    }
    for (int j = 0; j < k; ++j) w[j] = __fmul_rn(w[j], route_scale);
}

// `ffn::expert_forward`'s activation in place of `gate` [rows][inter]:
// bf16(weight[r] · (silu(min(g, limit)) · clamp(u, -limit, limit))), the
// clamps only when limit > 0, `weights` null for the shared expert.
extern "C" __global__ void v41m_swiglu(float* gate, const float* up, const float* weights, int inter, float limit) {
    const u64 r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= inter) return;
    float g = gate[r * inter + c], u = up[r * inter + c];
    if (limit > 0.0f) {
        g = fminf(g, limit);
        u = v41m_clamp(u, -limit, limit);
    }
    float h = __fmul_rn(v41m_silu(g), u);
    if (weights) h = __fmul_rn(weights[r], h);
    gate[r * inter + c] = v41m_round_bf16(h);
}

// `ffn::combine`: out[t][c] = bf16((Σ routed outputs in (expert, slot)
// order, f32 from +0) + shared[t][c]); routed [n · k][d] by (token, slot).
extern "C" __global__ void v41m_moe_combine(const float* routed, const int* experts, const float* shared, int k,
                                            int d, float* out) {
    const u64 t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    const int* ex = experts + t * k;
    float y = 0.0f;
    int prev_e = -1, prev_s = -1;
    for (int n = 0; n < k; ++n) {
        int best_e = 0, best_s = -1;
        for (int s = 0; s < k; ++s) {
            const int e = ex[s];
            const bool after = e > prev_e || (e == prev_e && s > prev_s);
            if (after && (best_s < 0 || e < best_e || (e == best_e && s < best_s))) {
                best_e = e;
                best_s = s;
            }
        }
        y = __fadd_rn(y, routed[(t * k + best_s) * d + c]);
        prev_e = best_e;
        prev_s = best_s;
    }
    out[t * d + c] = v41m_round_bf16(__fadd_rn(y, shared[t * d + c]));
}
