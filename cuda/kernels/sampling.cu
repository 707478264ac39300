// One sampled token per row of logits, the token the engine's
// `sampling::sample` chooses (engine/src/sampling.rs) for the same logits and
// the same (seed, position): sanitize (NaN as -inf; +inf logits share the
// mass), greedy argmax (the lowest id on ties), else f64 weights
// exp((x - max) / T), min-p, top-k and top-p over the rank order (larger
// logit first, the lower id on ties), and the inverse-CDF walk in id order
// against the counter-based uniform draw. Every f64 sum runs on one thread in
// the CPU's order, so the comparisons see the CPU's values.
//
// The weights use the CPU's own `f64::exp`, ported in libm_exp.cuh.
//
// One block of DI_SAMPLE_THREADS threads per row; rows that are not greedy
// use a scratch of 4 * vocab u32 (two key/id buffers for a stable LSD radix
// sort) and vocab doubles (the weights).
#include "common.cuh"

#define DI_SAMPLE_THREADS 256

#include "libm_exp.cuh"

// SplitMix64's output function (the engine's `mix64`).
__device__ __forceinline__ u64 di_mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The engine's `uniform(seed, position)`: [0, 1) from the top 53 bits.
__device__ double di_uniform(u64 seed, u64 position) {
    const u64 start = di_mix64(seed ^ 0x5a3d1f0c8e6b2497ull);
    const u64 bits = di_mix64(start + (position + 1) * 0x9e3779b97f4a7c15ull);
    return __dmul_rn(static_cast<double>(bits >> 11), di_as_double(0x3ca0000000000000ull));  // 2^-53
}

// The engine's `sanitize`, kept in f32 (every value is exact there).
__device__ __forceinline__ float di_sanitized(float l, u32 any_pos_inf) {
    if (isnan(l)) return DI_NEG_INF;
    if (any_pos_inf) return l == DI_INF ? 0.0f : DI_NEG_INF;
    return l;
}

// Ascending sort key of the rank order: larger value first (-0 as +0).
__device__ __forceinline__ u32 di_rank_key(float x) {
    const u32 u = __float_as_uint(__fadd_rn(x, 0.0f));
    const u32 ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ~ordered;
}

// Block reductions and scan over DI_SAMPLE_THREADS threads through `sh`.
__device__ u32 di_block_max_u32(u32 v, u32* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int width = DI_SAMPLE_THREADS / 2; width > 0; width /= 2) {
        if (static_cast<int>(threadIdx.x) < width) sh[threadIdx.x] = max(sh[threadIdx.x], sh[threadIdx.x + width]);
        __syncthreads();
    }
    const u32 out = sh[0];
    __syncthreads();
    return out;
}

__device__ u32 di_block_min_u32(u32 v, u32* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (int width = DI_SAMPLE_THREADS / 2; width > 0; width /= 2) {
        if (static_cast<int>(threadIdx.x) < width) sh[threadIdx.x] = min(sh[threadIdx.x], sh[threadIdx.x + width]);
        __syncthreads();
    }
    const u32 out = sh[0];
    __syncthreads();
    return out;
}

// Exclusive prefix sum of each thread's `v` in thread order; `total` gets the sum.
__device__ u32 di_block_exclusive_scan(u32 v, u32* sh, u32* total) {
    const int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int off = 1; off < DI_SAMPLE_THREADS; off *= 2) {
        const u32 add = t >= off ? sh[t - off] : 0u;
        __syncthreads();
        sh[t] += add;
        __syncthreads();
    }
    const u32 inclusive = sh[t];
    *total = sh[DI_SAMPLE_THREADS - 1];
    __syncthreads();
    return inclusive - v;
}

// The lowest id whose sanitized logit equals `max` (the engine's `argmax`).
__device__ u32 di_argmax(const float* row, int vocab, u32 any_pos_inf, float max_value, u32* sh) {
    u32 best = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += DI_SAMPLE_THREADS)
        if (di_sanitized(row[i], any_pos_inf) == max_value) {
            best = static_cast<u32>(i);
            break;
        }
    return di_block_min_u32(best, sh);
}

// logits: rows of vocab values, stride apart. params: 4 words per row:
// [temperature bits | top_p bits << 32, min_p bits | top_k << 32, seed,
// position]. scratch: 4 * vocab u32 per row; weights: vocab doubles per row
// (both untouched by greedy rows). tokens: one per row.
extern "C" __global__ void sample_rows(const float* logits, int stride, int vocab, const u64* params, u32* scratch,
                                       double* weights, u32* tokens) {
    __shared__ u32 sh[DI_SAMPLE_THREADS];
    __shared__ float sh_f[DI_SAMPLE_THREADS];
    __shared__ u32 counts[16 * DI_SAMPLE_THREADS];
    __shared__ u32 sh_len;
    const int tid = threadIdx.x;
    const u64 b = blockIdx.x;
    const float* row = logits + b * stride;
    const u64* p = params + 4 * b;
    const float temperature = __uint_as_float(static_cast<u32>(p[0]));
    const float top_p = __uint_as_float(static_cast<u32>(p[0] >> 32));
    const float min_p = __uint_as_float(static_cast<u32>(p[1]));
    const u32 top_k = static_cast<u32>(p[1] >> 32);

    u32 any = 0;
    for (int i = tid; i < vocab; i += DI_SAMPLE_THREADS)
        if (row[i] == DI_INF) any = 1;
    any = di_block_max_u32(any, sh);
    float mx = DI_NEG_INF;
    for (int i = tid; i < vocab; i += DI_SAMPLE_THREADS) {
        const float x = di_sanitized(row[i], any);
        if (x > mx) mx = x;
    }
    sh_f[tid] = mx;
    __syncthreads();
    for (int width = DI_SAMPLE_THREADS / 2; width > 0; width /= 2) {
        if (tid < width && sh_f[tid + width] > sh_f[tid]) sh_f[tid] = sh_f[tid + width];
        __syncthreads();
    }
    mx = sh_f[0];
    __syncthreads();
    if (mx == DI_NEG_INF) {
        // Nothing usable: token 0.
        if (tid == 0) tokens[b] = 0;
        return;
    }
    if (isnan(temperature) || temperature <= 0.0f) {
        const u32 best = di_argmax(row, vocab, any, mx, sh);
        if (tid == 0) tokens[b] = best;
        return;
    }

    // Weights, and the tokens min-p and underflow keep, in id order.
    const double max_d = static_cast<double>(mx);
    const double t_d = static_cast<double>(temperature);
    const double floor_d = static_cast<double>(min_p);
    u32* keys_a = scratch + b * 4 * static_cast<u64>(vocab);
    u32* ids_a = keys_a + vocab;
    u32* keys_b = ids_a + vocab;
    u32* ids_b = keys_b + vocab;
    double* w = weights + b * static_cast<u64>(vocab);
    const int chunk = (vocab + DI_SAMPLE_THREADS - 1) / DI_SAMPLE_THREADS;
    const int lo = min(tid * chunk, vocab);
    const int hi = min(lo + chunk, vocab);
    u32 mine = 0;
    for (int i = lo; i < hi; ++i) {
        const float x = di_sanitized(row[i], any);
        const double wi =
            x == DI_NEG_INF ? 0.0 : di_libm_exp(__ddiv_rn(__dadd_rn(static_cast<double>(x), -max_d), t_d));
        w[i] = wi;
        if (wi > 0.0 && wi >= floor_d) ++mine;
    }
    u32 kept;
    u32 at = di_block_exclusive_scan(mine, sh, &kept);
    for (int i = lo; i < hi; ++i)
        if (w[i] > 0.0 && w[i] >= floor_d) {
            ids_a[at] = static_cast<u32>(i);
            keys_a[at] = di_rank_key(di_sanitized(row[i], any));
            ++at;
        }
    __syncthreads();
    if (kept == 0) {
        // Reachable only with min_p outside [0, 1]: the CPU's fallback.
        const u32 best = di_argmax(row, vocab, any, mx, sh);
        if (tid == 0) tokens[b] = best;
        return;
    }

    const bool use_top_k = top_k > 0 && top_k < kept;
    const double top_p_d = static_cast<double>(top_p);
    const bool use_top_p = top_p_d < 1.0;
    u32 len = kept;
    const u32* chosen = ids_a;
    if (use_top_k || use_top_p) {
        // Stable LSD radix sort of the kept tokens by rank key, 4 bits a
        // pass; each thread keeps a contiguous run, so ties stay in id order.
        const int kchunk = static_cast<int>((kept + DI_SAMPLE_THREADS - 1) / DI_SAMPLE_THREADS);
        const int klo = min(tid * kchunk, static_cast<int>(kept));
        const int khi = min(klo + kchunk, static_cast<int>(kept));
        for (int pass = 0; pass < 8; ++pass) {
            const int shift = pass * 4;
            const u32* ks = pass % 2 == 0 ? keys_a : keys_b;
            const u32* is = pass % 2 == 0 ? ids_a : ids_b;
            u32* kd = pass % 2 == 0 ? keys_b : keys_a;
            u32* id = pass % 2 == 0 ? ids_b : ids_a;
            for (int d = 0; d < 16; ++d) counts[d * DI_SAMPLE_THREADS + tid] = 0;
            for (int j = klo; j < khi; ++j) counts[((ks[j] >> shift) & 15u) * DI_SAMPLE_THREADS + tid] += 1;
            __syncthreads();
            // Offsets in (digit, thread) order: each thread sums 16 consecutive counters.
            u32 own = 0;
            for (int q = 0; q < 16; ++q) own += counts[tid * 16 + q];
            u32 all;
            u32 run = di_block_exclusive_scan(own, sh, &all);
            for (int q = 0; q < 16; ++q) {
                const u32 c = counts[tid * 16 + q];
                counts[tid * 16 + q] = run;
                run += c;
            }
            __syncthreads();
            for (int j = klo; j < khi; ++j) {
                const u32 key = ks[j];
                const u32 slot = ((key >> shift) & 15u) * DI_SAMPLE_THREADS + tid;
                const u32 dst = counts[slot];
                counts[slot] = dst + 1;
                kd[dst] = key;
                id[dst] = is[j];
            }
            __syncthreads();
        }
        if (use_top_k) len = top_k;
        if (use_top_p) {
            if (tid == 0) {
                // The smallest best-ranked prefix whose mass reaches top_p of the whole.
                double total = -0.0;
                for (u32 r = 0; r < len; ++r) total = __dadd_rn(total, w[ids_a[r]]);
                const double threshold = __dmul_rn(top_p_d, total);
                double mass = 0.0;
                u32 n = 0;
                for (u32 r = 0; r < len; ++r) {
                    if (n > 0 && mass >= threshold) break;
                    mass = __dadd_rn(mass, w[ids_a[r]]);
                    ++n;
                }
                sh_len = n;
            }
            __syncthreads();
            len = sh_len;
        }
        // The chosen tokens back in id order: marks, then a compaction.
        u32* marks = keys_b;
        for (int i = tid; i < vocab; i += DI_SAMPLE_THREADS) marks[i] = 0;
        __syncthreads();
        for (u32 r = tid; r < len; r += DI_SAMPLE_THREADS) marks[ids_a[r]] = 1;
        __syncthreads();
        u32 marked = 0;
        for (int i = lo; i < hi; ++i) marked += marks[i];
        u32 unused;
        u32 out = di_block_exclusive_scan(marked, sh, &unused);
        for (int i = lo; i < hi; ++i)
            if (marks[i]) ids_b[out++] = static_cast<u32>(i);
        __syncthreads();
        chosen = ids_b;
    }

    if (tid == 0) {
        // The inverse-CDF walk in id order.
        double total = -0.0;
        for (u32 j = 0; j < len; ++j) total = __dadd_rn(total, w[chosen[j]]);
        const double target = __dmul_rn(di_uniform(p[2], p[3]), total);
        double cumulative = 0.0;
        u32 token = chosen[len - 1];
        for (u32 j = 0; j < len; ++j) {
            cumulative = __dadd_rn(cumulative, w[chosen[j]]);
            if (cumulative > target) {
                token = chosen[j];
                break;
            }
        }
        tokens[b] = token;
    }
}

// y[i] = the CPU's f64::exp(x[i]) (`di_libm_exp`), for checking the port.
extern "C" __global__ void sampling_libm_exp(const double* x, double* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = di_libm_exp(x[i]);
}
