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
// -0.0 as it does. `exp` is glibc's, ported in libm_exp.cuh.
#include "common.cuh"
#include "v41.cuh"
#include "libm_exp.cuh"

#define V41M_SLOTS 64

// `ops::exp` (f32 through f64), `ops::sigmoid`, `ops::silu`, `ops::rsqrt`.
static __device__ __forceinline__ float v41m_expf(float x) { return static_cast<float>(di_libm_exp(static_cast<double>(x))); }
static __device__ __forceinline__ float v41m_sigmoid(float x) {
    return static_cast<float>(__ddiv_rn(1.0, __dadd_rn(1.0, di_libm_exp(-static_cast<double>(x)))));
}
static __device__ __forceinline__ float v41m_silu(float x) {
    const double d = static_cast<double>(x);
    return static_cast<float>(__ddiv_rn(d, __dadd_rn(1.0, di_libm_exp(-d))));
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
    out[t * d + c] = v41_round_bf16(static_cast<float>(sum));
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
            v41_round_bf16(__fadd_rn(__fmul_rn(post[t * hc + j], o), static_cast<float>(mixed)));
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
        out[i * dim + c] = v41_round_bf16(__fmul_rn(v, s));
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
    for (int c = threadIdx.x; c < d; c += blockDim.x) s[c] = v41_round_bf16(__fadd_rn(s[c], __fmul_rn(g, value[c])));
}

// ---- Element-wise ------------------------------------------------------------

// x[i] = bf16(x[i] · factor) (the indexer's weights) or, with `divide`,
// x[i] = x[i] / factor (the router's temperature), for i < count.
extern "C" __global__ void v41m_scale(float* x, long long count, float factor, int divide) {
    const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= count) return;
    x[i] = divide ? __fdiv_rn(x[i], factor) : v41_round_bf16(__fmul_rn(x[i], factor));
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
        for (int i = 0; i < ratio; ++i) total = __dadd_rn(total, di_libm_exp(__dadd_rn(static_cast<double>(s[i * hd]), -max)));
        double sum = -0.0;
        for (int i = 0; i < ratio; ++i) {
            const float w = static_cast<float>(__ddiv_rn(di_libm_exp(__dadd_rn(static_cast<double>(s[i * hd]), -max)), total));
            sum = __dadd_rn(sum, static_cast<double>(__fmul_rn(v[i * hd], w)));
        }
        out[g * hd + ch] = v41_round_bf16(static_cast<float>(sum));
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
            score[i] = row ? __fmul_rn(static_cast<float>(v41_dot_f64(qh, row, hd)), scale) : DI_NEG_INF;
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
                    weighted = __dadd_rn(weighted, __dmul_rn(static_cast<double>(v41_round_bf16(prob[i])),
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
    for (int c = tid; c < hd; c += blockDim.x) o[c] = v41_round_bf16(__fdiv_rn(acc[c], sum_exp));
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
        u = v41_clamp(u, -limit, limit);
    }
    float h = __fmul_rn(v41m_silu(g), u);
    if (weights) h = __fmul_rn(weights[r], h);
    gate[r * inter + c] = v41_round_bf16(h);
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
    out[t * d + c] = v41_round_bf16(__fadd_rn(y, shared[t * d + c]));
}
