// DeepSeek-V4's attention core (engine/src/model/attention.rs `forward`):
// the lightning indexer's scores (`index_scores`) and their top-k
// (kernels/src/ops.rs `top_k`), then each query's attention over its window
// of keys and its compressed entries (`attend_token`): 16-lane dots
// (`dot_rows_of`), `softmax_with_sink`, `add_weighted_rows_heads` and the
// inverse interleaved RoPE. Every output has the CPU's bits; nothing depends
// on the number of queries or the block size.
#include "common.cuh"

// Threads of a top-k block (the static arrays below are sized by it).
#define DI_TOPK_THREADS 128

// `di_dot16` (the CPU's `dot`: column c into lane c % 16 as a fused chain,
// then the fixed tree 8, 4, 2, 1) with its lanes as named registers:
// di_dot16's `acc[c % 16]` array lands in a local-memory stack frame.
#define DI_ATTN_LANE(l) a##l = __fmaf_rn(a[c + l], b[c + l], a##l)
#define DI_ATTN_TAIL(l) if (c + l < n) DI_ATTN_LANE(l)
__device__ __forceinline__ float di_attn_dot16(const float* a, const float* b, int n) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
    float a8 = 0.0f, a9 = 0.0f, a10 = 0.0f, a11 = 0.0f, a12 = 0.0f, a13 = 0.0f, a14 = 0.0f, a15 = 0.0f;
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        DI_ATTN_LANE(0);
        DI_ATTN_LANE(1);
        DI_ATTN_LANE(2);
        DI_ATTN_LANE(3);
        DI_ATTN_LANE(4);
        DI_ATTN_LANE(5);
        DI_ATTN_LANE(6);
        DI_ATTN_LANE(7);
        DI_ATTN_LANE(8);
        DI_ATTN_LANE(9);
        DI_ATTN_LANE(10);
        DI_ATTN_LANE(11);
        DI_ATTN_LANE(12);
        DI_ATTN_LANE(13);
        DI_ATTN_LANE(14);
        DI_ATTN_LANE(15);
    }
    DI_ATTN_TAIL(0);
    DI_ATTN_TAIL(1);
    DI_ATTN_TAIL(2);
    DI_ATTN_TAIL(3);
    DI_ATTN_TAIL(4);
    DI_ATTN_TAIL(5);
    DI_ATTN_TAIL(6);
    DI_ATTN_TAIL(7);
    DI_ATTN_TAIL(8);
    DI_ATTN_TAIL(9);
    DI_ATTN_TAIL(10);
    DI_ATTN_TAIL(11);
    DI_ATTN_TAIL(12);
    DI_ATTN_TAIL(13);
    DI_ATTN_TAIL(14);
    DI_ATTN_TAIL(15);
    a0 = __fadd_rn(a0, a8); a1 = __fadd_rn(a1, a9); a2 = __fadd_rn(a2, a10); a3 = __fadd_rn(a3, a11);
    a4 = __fadd_rn(a4, a12); a5 = __fadd_rn(a5, a13); a6 = __fadd_rn(a6, a14); a7 = __fadd_rn(a7, a15);
    a0 = __fadd_rn(a0, a4); a1 = __fadd_rn(a1, a5); a2 = __fadd_rn(a2, a6); a3 = __fadd_rn(a3, a7);
    a0 = __fadd_rn(a0, a2); a1 = __fadd_rn(a1, a3);
    a0 = __fadd_rn(a0, a1);
    return a0;
}
#undef DI_ATTN_TAIL
#undef DI_ATTN_LANE

// Lightning-indexer scores of queries `position + i` (i = blockIdx.x) over
// their `visible = (position + i + 1) / ratio` first entries, one entry a
// thread: `Σ_h w_h · (max(dot(q_h, k), 0) · scale)`, summed from -0.0 in head
// order as the CPU's `Iterator::sum`. iq: row i at iq + i * iq_stride, `ih`
// heads of `ihd`; iw: row i at iw + i * iw_stride, `ih` weights; entries:
// [*, ihd]; scores: row i at scores + i * max_visible.
extern "C" __global__ void attn_index_scores(const float* iq, int iq_stride, const float* iw, int iw_stride, int ih,
                                             int ihd, const float* entries, int position, int ratio, int max_visible,
                                             float scale, float* scores) {
    const long long i = blockIdx.x;
    const int visible = (position + static_cast<int>(i) + 1) / ratio;
    const int e = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
    if (e >= visible || e >= max_visible) return;
    const float* q = iq + i * iq_stride;
    const float* w = iw + i * iw_stride;
    const float* k = entries + static_cast<long long>(e) * ihd;
    float s = -0.0f;
    for (int h = 0; h < ih; ++h) {
        float d = di_attn_dot16(q + static_cast<long long>(h) * ihd, k, ihd);
        // f32::max(d, 0.0): NaN gives 0 (the sign of a zero never reaches top_k).
        float relu = d > 0.0f ? d : 0.0f;
        s = __fadd_rn(s, __fmul_rn(w[h], __fmul_rn(relu, scale)));
    }
    scores[i * max_visible + e] = s;
}

// `top_k`'s order as an unsigned key: NaN ranks as -inf, -0 as +0, and a
// larger key is a larger value.
__device__ __forceinline__ u32 di_topk_key(float v) {
    if (isnan(v)) v = DI_NEG_INF;
    u32 bits = __float_as_uint(__fadd_rn(v, 0.0f));
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// `a` (key ka) goes before `b` (key kb): larger first, equal to the lower index.
__device__ __forceinline__ bool di_topk_before(u32 ka, int a, u32 kb, int b) {
    return ka > kb || (ka == kb && a < b);
}

// `top_k(scores_i, min(topk, visible))` for query i = blockIdx.x (visible =
// (position + i + 1) / ratio): the k-th largest key by a 4-bit radix select,
// the k winners gathered in index order (ties to the lower index), then each
// placed at its rank. selected: row i at selected + i * selected_stride (its
// first `count` values written, the rest of `topk` set to -1); counts[i] =
// count. Dynamic shared memory: topk ints. Blocks of DI_TOPK_THREADS.
extern "C" __global__ void attn_index_topk(const float* scores, int scores_stride, int position, int ratio, int topk,
                                           int* selected, int selected_stride, int* counts) {
    DI_DYNAMIC_SHARED(int, chosen);
    __shared__ int digit_counts[16 * DI_TOPK_THREADS];
    __shared__ int digit_totals[16];
    __shared__ int above_before[DI_TOPK_THREADS];
    __shared__ int equal_before[DI_TOPK_THREADS];
    __shared__ u32 prefix;
    __shared__ int remaining;
    const int t = threadIdx.x;
    const int nt = blockDim.x;
    const long long i = blockIdx.x;
    const int visible = (position + static_cast<int>(i) + 1) / ratio;
    const int k = topk < visible ? topk : visible;
    const float* row = scores + i * scores_stride;
    int* out = selected + i * selected_stride;
    // This thread's entries: one contiguous run, so that runs in thread order are index order.
    const int run = (visible + nt - 1) / nt;
    const int begin = min(t * run, visible);
    const int end = min(begin + run, visible);

    if (t == 0) {
        prefix = 0u;
        remaining = k;
    }
    __syncthreads();
    u32 mask = 0u;
    for (int shift = 28; shift >= 0 && k > 0; shift -= 4) {
        int local[16];
        for (int d = 0; d < 16; ++d) local[d] = 0;
        const u32 p = prefix;
        for (int e = begin; e < end; ++e) {
            u32 key = di_topk_key(row[e]);
            if ((key & mask) == p) {
                u32 d = (key >> shift) & 15u;
                for (int j = 0; j < 16; ++j) local[j] += (static_cast<u32>(j) == d) ? 1 : 0;
            }
        }
        for (int d = 0; d < 16; ++d) digit_counts[d * DI_TOPK_THREADS + t] = local[d];
        __syncthreads();
        if (t < 16) {
            int sum = 0;
            for (int u = 0; u < nt; ++u) sum += digit_counts[t * DI_TOPK_THREADS + u];
            digit_totals[t] = sum;
        }
        __syncthreads();
        if (t == 0) {
            int left = remaining;
            int d = 15;
            for (; d > 0; --d) {
                if (digit_totals[d] >= left) break;
                left -= digit_totals[d];
            }
            remaining = left;
            prefix = p | (static_cast<u32>(d) << shift);
        }
        mask |= 15u << shift;
        __syncthreads();
    }
    // The k-th key is `prefix`; `remaining` of the entries equal to it are taken.
    const u32 kth = prefix;
    const int need = remaining;
    int above = 0, equal = 0;
    for (int e = begin; e < end && k > 0; ++e) {
        u32 key = di_topk_key(row[e]);
        above += key > kth ? 1 : 0;
        equal += key == kth ? 1 : 0;
    }
    above_before[t] = above;
    equal_before[t] = equal;
    __syncthreads();
    if (t == 0) {
        int a = 0, q = 0;
        for (int u = 0; u < nt; ++u) {
            int na = above_before[u], nq = equal_before[u];
            above_before[u] = a;
            equal_before[u] = q;
            a += na;
            q += nq;
        }
    }
    __syncthreads();
    {
        const int taken_above = k - need;
        int a = above_before[t], q = equal_before[t];
        for (int e = begin; e < end && k > 0; ++e) {
            u32 key = di_topk_key(row[e]);
            if (key > kth) {
                chosen[a++] = e;
            } else if (key == kth) {
                if (q < need) chosen[taken_above + q] = e;
                ++q;
            }
        }
    }
    __syncthreads();
    // Each winner at its rank among the winners (its rank among all entries).
    for (int c = t; c < k; c += nt) {
        const int e = chosen[c];
        const u32 key = di_topk_key(row[e]);
        int rank = 0;
        for (int o = 0; o < k; ++o) {
            const int f = chosen[o];
            rank += di_topk_before(di_topk_key(row[f]), f, key, e) ? 1 : 0;
        }
        out[rank] = e;
    }
    for (int c = k + t; c < topk; c += nt) out[c] = -1;
    if (t == 0) counts[i] = k;
}

// The address of key `c` of a query: window rows first, then its entries.
__device__ __forceinline__ const float* di_attn_key(int c, int in_window, const float* window_keys, const float* entries,
                                                    const int* chosen, int hd) {
    if (c < in_window) return window_keys + static_cast<long long>(c) * hd;
    const int e = chosen ? chosen[c - in_window] : c - in_window;
    return entries + static_cast<long long>(e) * hd;
}

// `attend_token` for query i = blockIdx.x (position `position + i`), head
// blockIdx.y. q: row i at q + i * q_stride, `h` heads of `hd`; keys: rows of
// `hd` from position first_key_position on; the window is rows
// max(pos + 1 - window, first_key_position)..=pos. mode 0: no entries; 1:
// entries 0..(pos + 1) / ratio; 2: entries selected[i * sel_stride + j] for
// j < counts[i] (at most max_selected); n_entries bounds every entry index.
// sink: [h]; cos/sin: row i at + i * half (the output's trailing 2 * half
// channels are rotated back); out: row i at out + i * out_stride;
// probabilities: row (i * h + head) at scratch + that * scratch_stride.
extern "C" __global__ void attn_attend(const float* q, int q_stride, int h, int hd, const float* keys,
                                       int first_key_position, int position, int window, const float* entries, int mode,
                                       int ratio, const int* selected, int sel_stride, const int* counts,
                                       int max_selected, int n_entries, const float* sink, float scale,
                                       const float* cos, const float* sin, int half, float* out, int out_stride,
                                       float* scratch, int scratch_stride) {
    __shared__ float partial[256];
    __shared__ float lanes[16];
    __shared__ float shift;
    __shared__ float inv;
    const int t = threadIdx.x;
    const int nt = blockDim.x;
    const long long i = blockIdx.x;
    const int head = blockIdx.y;
    const int pos = position + static_cast<int>(i);
    const int from = pos + 1 - window > first_key_position ? pos + 1 - window : first_key_position;
    const int in_window = pos + 1 - from;
    const float* window_keys = keys + static_cast<long long>(from - first_key_position) * hd;
    int in_entries = 0;
    const int* chosen = nullptr;
    if (mode == 1) {
        in_entries = (pos + 1) / ratio;
    } else if (mode == 2) {
        in_entries = min(counts[i], max_selected);
        chosen = selected + i * sel_stride;
    }
    if (in_entries > max_selected) in_entries = max_selected;
    if (in_entries < 0) in_entries = 0;
    const int nk = in_window + in_entries;
    const float* qh = q + i * q_stride + static_cast<long long>(head) * hd;
    float* probs = scratch + (i * h + head) * static_cast<long long>(scratch_stride);

    // Scores (each the bits of `dot`) times the scale, and this thread's largest.
    float largest = DI_NEG_INF;
    for (int c = t; c < nk; c += nt) {
        if (chosen && c >= in_window) {
            const int e = chosen[c - in_window];
            if (e < 0 || e >= n_entries) __trap();
        }
        float s = __fmul_rn(di_attn_dot16(qh, di_attn_key(c, in_window, window_keys, entries, chosen, hd), hd), scale);
        probs[c] = s;
        largest = fmaxf(largest, s);
    }
    partial[t] = largest;
    __syncthreads();
    if (t == 0) {
        // The largest that is not NaN, then `.max(sink)`: which of equal
        // maxima wins changes no bit the softmax computes (±0 alike).
        float m = DI_NEG_INF;
        for (int u = 0; u < nt; ++u) m = fmaxf(m, partial[u]);
        shift = fmaxf(m, sink[head]);
    }
    __syncthreads();
    const float m = shift;
    for (int c = t; c < nk; c += nt) probs[c] = di_exp(__fadd_rn(probs[c], -m));
    __syncthreads();
    // `sum_lanes`: element c into lane c % 16 from +0, then the fixed tree.
    if (t < 16) {
        float acc = 0.0f;
        for (int c = t; c < nk; c += 16) acc = __fadd_rn(acc, probs[c]);
        lanes[t] = acc;
    }
    __syncthreads();
    if (t == 0) {
        float sum = __fadd_rn(di_exp(__fadd_rn(sink[head], -m)), di_reduce16(lanes));
        inv = __fdiv_rn(1.0f, sum);
    }
    __syncthreads();
    const float scale_p = inv;
    for (int c = t; c < nk; c += nt) probs[c] = __fmul_rn(probs[c], scale_p);
    __syncthreads();
    // `add_weighted_rows`: one fused chain per output from +0, in key order.
    float* o = out + i * out_stride + static_cast<long long>(head) * hd;
    for (int j = t; j < hd; j += nt) {
        float acc = 0.0f;
        for (int c = 0; c < nk; ++c)
            acc = __fmaf_rn(probs[c], di_attn_key(c, in_window, window_keys, entries, chosen, hd)[j], acc);
        o[j] = acc;
    }
    __syncthreads();
    // The inverse RoPE of the trailing 2 * half channels: rope_interleaved with -sin.
    const int tail = hd - 2 * half;
    for (int p = t; p < half; p += nt) {
        const float a = o[tail + 2 * p];
        const float b = o[tail + 2 * p + 1];
        const float c = cos[i * half + p];
        const float s = -sin[i * half + p];
        o[tail + 2 * p] = __fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, s));
        o[tail + 2 * p + 1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}
