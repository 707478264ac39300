// DeepSeek-V4.1's two-level indexer on the device (engine/src/v41/
// attention.rs, ops.rs), bit for bit: the index scores of the compressed
// entries, the candidate blocks and the top-k (`ops::top_k_stable`: higher
// first, equal values by lower index, here a block-wide 4-bit radix select
// with no atomics), which choose the entries `v41m_sparse_attention`
// (v41_model.cu) attends to. Sums that the CPU takes with Rust's
// `Iterator::sum::<f64>` start from -0.0 as it does.
#include "common.cuh"
#include "v41.cuh"

#define V41M_SELECT_THREADS 128

// The entries query t's top-k ranges over (`Span::width`).
static __device__ __forceinline__ int v41m_width(int start, int len, int ratio, int t) {
    return start == 0 ? len / ratio : (start + t + 1) / ratio;
}

// `attention::choose`'s score of entry j for query t = blockIdx.x (j over
// blockIdx.y and the threads, j < width): -inf at or past the visible
// entries; else bf16(Σ_h f64(bf16(max(bf16(dot_h), 0) · w_h))) with dot_h =
// dot_f64(key_j, q_h). A consumer (keep non-null) sets -inf where the
// candidate source's mask (keep [n][keep_stride], keep_len [n]) is 0.
extern "C" __global__ void v41m_index_scores(const float* keys, const float* q, const float* w, int ih, int ihd,
                                             int start, int len, int ratio, const int* keep, const int* keep_len,
                                             int keep_stride, float* scores, int stride) {
    const int t = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    const int width = v41m_width(start, len, ratio, t);
    if (j >= width) return;
    const int visible = (start + t + 1) / ratio;
    float score = DI_NEG_INF;
    if (j < visible) {
        const float* k = keys + static_cast<u64>(j) * ihd;
        double sum = -0.0;
        for (int h = 0; h < ih; ++h) {
            const double dot = v41_dot_f64(k, q + (static_cast<u64>(t) * ih + h) * ihd, ihd);
            const float s = fmaxf(v41_round_bf16(static_cast<float>(dot)), 0.0f);
            sum = __dadd_rn(sum, static_cast<double>(v41_round_bf16(__fmul_rn(s, w[static_cast<u64>(t) * ih + h]))));
        }
        score = v41_round_bf16(static_cast<float>(sum));
    }
    if (keep && j < keep_len[t] && keep[static_cast<u64>(t) * keep_stride + j] == 0) score = DI_NEG_INF;
    scores[static_cast<u64>(t) * stride + j] = score;
}

// An order-preserving key of a float (larger value, larger key; -0 = +0).
static __device__ __forceinline__ u32 v41m_key(float v) {
    u32 b = __float_as_uint(v);
    if ((b & 0x7fffffffu) == 0) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// `ops::top_k_stable(vals[0..count), k)` in ascending index order into
// out[0..k): the k largest, equal values by lower index. The whole block
// (V41M_SELECT_THREADS threads) runs it: a 4-bit radix select of the k-th
// key (per-thread counts over contiguous ranges, summed in shared memory),
// then the ranges' ranks by prefix sums. No atomics.
static __device__ void v41m_select(const float* vals, int count, int k, int* out, int* hist, int* misc) {
    const int tid = threadIdx.x, threads = blockDim.x;
    const int chunk = (count + threads - 1) / threads;
    const int lo = min(tid * chunk, count), hi = min(lo + chunk, count);
    if (k <= 0) return;
    if (k >= count) {
        for (int i = lo; i < hi; ++i) out[i] = i;
        return;
    }
    u32 prefix = 0, mask = 0;
    int remaining = k;
    for (int shift = 28; shift >= 0; shift -= 4) {
        int cnt[16];
#pragma unroll
        for (int l = 0; l < 16; ++l) cnt[l] = 0;
        for (int i = lo; i < hi; ++i) {
            const u32 key = v41m_key(vals[i]);
            if ((key & mask) != prefix) continue;
            const u32 digit = (key >> shift) & 15u;
#pragma unroll
            for (int l = 0; l < 16; ++l) cnt[l] += digit == static_cast<u32>(l) ? 1 : 0;
        }
#pragma unroll
        for (int l = 0; l < 16; ++l) hist[l * threads + tid] = cnt[l];
        __syncthreads();
        if (tid < 16) {
            int total = 0;
            for (int i = 0; i < threads; ++i) total += hist[tid * threads + i];
            misc[tid] = total;
        }
        __syncthreads();
        if (tid == 0) {
            int d = 15;
            for (; d > 0; --d) {
                if (misc[d] >= remaining) break;
                remaining -= misc[d];
            }
            misc[16] = d;
            misc[17] = remaining;
        }
        __syncthreads();
        prefix |= static_cast<u32>(misc[16]) << shift;
        mask |= 15u << shift;
        remaining = misc[17];
        __syncthreads();
    }
    // `prefix` is the k-th largest key; `remaining` of its equals are taken, lowest index first.
    int greater = 0, equal = 0;
    for (int i = lo; i < hi; ++i) {
        const u32 key = v41m_key(vals[i]);
        greater += key > prefix ? 1 : 0;
        equal += key == prefix ? 1 : 0;
    }
    hist[tid] = equal;
    hist[threads + tid] = greater;
    __syncthreads();
    if (tid == 0) {
        int eq_before = 0, sel_before = 0;
        for (int i = 0; i < threads; ++i) {
            const int e = hist[i], g = hist[threads + i];
            const int take = min(max(remaining - eq_before, 0), e);
            hist[i] = take;
            hist[threads + i] = sel_before;
            eq_before += e;
            sel_before += g + take;
        }
    }
    __syncthreads();
    int take = hist[tid], at = hist[threads + tid];
    for (int i = lo; i < hi; ++i) {
        const u32 key = v41m_key(vals[i]);
        if (key > prefix) {
            out[at++] = i;
        } else if (key == prefix && take > 0) {
            out[at++] = i;
            --take;
        }
    }
    __syncthreads();
}

// `attention::choose`'s top-k of query t = blockIdx.x: the entries of the
// min(topk, width) best scores (scores [n][stride]), ascending, those past
// the visible entries dropped: selected [n][topk], counts [n].
extern "C" __global__ void v41m_index_topk(const float* scores, int stride, int start, int len, int ratio, int topk,
                                           int* selected, int* counts) {
    __shared__ int hist[16 * V41M_SELECT_THREADS];
    __shared__ int misc[18];
    const int t = blockIdx.x;
    const int width = v41m_width(start, len, ratio, t);
    const int k = min(topk, width);
    int* out = selected + static_cast<u64>(t) * topk;
    v41m_select(scores + static_cast<u64>(t) * stride, width, k, out, hist, misc);
    __syncthreads();
    if (threadIdx.x == 0) {
        const int visible = (start + t + 1) / ratio;
        int c = 0;
        while (c < k && out[c] < visible) ++c;
        counts[t] = c;
    }
}

// `attention::candidate_blocks` of query t = blockIdx.x: each block of
// `size` entries' best score (best [n][best_stride]), the newest visible
// block kept, the top min(topk_blocks, blocks) blocks with a finite best
// kept: keep [n][stride] (1 kept, 0 not), keep_len [n] = width.
extern "C" __global__ void v41m_candidate_blocks(const float* scores, int stride, int start, int len, int ratio,
                                                 int size, int topk_blocks, float* best, int best_stride,
                                                 int* chosen, int* keep, int* keep_len) {
    __shared__ int hist[16 * V41M_SELECT_THREADS];
    __shared__ int misc[18];
    const int t = blockIdx.x;
    const int width = v41m_width(start, len, ratio, t);
    const int visible = (start + t + 1) / ratio;
    const int blocks = (width + size - 1) / size;
    const float* s = scores + static_cast<u64>(t) * stride;
    float* b = best + static_cast<u64>(t) * best_stride;
    int* c = chosen + static_cast<u64>(t) * best_stride;
    int* kp = keep + static_cast<u64>(t) * stride;
    for (int i = threadIdx.x; i < blocks; i += blockDim.x) {
        float m = DI_NEG_INF;
        for (int j = i * size; j < min((i + 1) * size, width); ++j) m = fmaxf(m, s[j]);
        b[i] = visible > 0 && i == (visible - 1) / size ? DI_INF : m;
    }
    for (int j = threadIdx.x; j < width; j += blockDim.x) kp[j] = 0;
    __syncthreads();
    const int k = min(topk_blocks, blocks);
    v41m_select(b, blocks, k, c, hist, misc);
    __syncthreads();
    for (int i = 0; i < k; ++i) {
        const int blk = c[i];
        if (!(b[blk] > DI_NEG_INF)) continue;
        for (int j = blk * size + threadIdx.x; j < min((blk + 1) * size, width); j += blockDim.x) kp[j] = 1;
    }
    if (threadIdx.x == 0) keep_len[t] = width;
}
