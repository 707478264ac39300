// The mixture-of-experts routing and combine (engine/src/model/moe.rs `route`
// and `combine`) from the router's scores on: experts chosen by hash or by
// `top_k(score + bias, k)` (kernels/src/ops.rs), their weights normalised and
// scaled in the CPU's order; rows gathered for an expert; the routed outputs
// summed per token in ascending (expert, slot) order with `add_scaled`'s
// `o + w * y`, then the shared expert's output. One block per token or row.
//
// The scores are `sqrt_softplus(logit)`, which calls libm (`exp`, `ln_1p`):
// they are computed on the host and uploaded (see cuda/src/ops/moe.rs).
#include "common.cuh"

// Most experts per token `moe_combine` orders (in static shared memory).
#define DI_MOE_MAX_K 64

// The key `top_k` ranks by: NaN as -inf, -0 as +0 (`+ 0.0`).
__device__ __forceinline__ float di_moe_top_k_key(float v) { return isnan(v) ? DI_NEG_INF : __fadd_rn(v, 0.0f); }

// scores: [n, e]; mode 0 (top-k): bias [e], tid2eid/tokens unused; mode 1
// (hash): tid2eid [vocab, k], tokens [n], bias unused. experts_out and
// weights_out: [n, k]. norm: nonzero to normalise the weights.
extern "C" __global__ void moe_route(const float* scores, const float* bias, const int* tid2eid, const u32* tokens,
                                     int mode, int e, int k, int vocab, int norm, float scaling, int* experts_out,
                                     float* weights_out) {
    const u64 t = blockIdx.x;
    const float* s = scores + t * e;
    int* experts = experts_out + t * k;
    float* weights = weights_out + t * k;
    if (mode == 0) {
        // Each expert's place in the order `top_k` sorts by: larger key
        // first, the lower index on equal keys (`total_cmp` on keys that
        // hold no NaN and no -0 is the plain order).
        for (int i = threadIdx.x; i < e; i += blockDim.x) {
            float key = di_moe_top_k_key(__fadd_rn(s[i], bias[i]));
            int rank = 0;
            for (int j = 0; j < e; ++j) {
                float other = di_moe_top_k_key(__fadd_rn(s[j], bias[j]));
                if (other > key || (other == key && j < i)) ++rank;
            }
            if (rank < k) experts[rank] = i;
        }
    } else if (threadIdx.x == 0) {
        u32 id = min(tokens[t], static_cast<u32>(vocab - 1));
        for (int j = 0; j < k; ++j) experts[j] = tid2eid[static_cast<u64>(id) * k + j];
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (norm) {
        // `Iterator::sum` (from -0.0) in slot order, then `+ 1e-20`.
        float sum = -0.0f;
        for (int j = 0; j < k; ++j) sum = __fadd_rn(sum, s[experts[j]]);
        sum = __fadd_rn(sum, 1e-20f);
        for (int j = 0; j < k; ++j) weights[j] = __fmul_rn(__fdiv_rn(s[experts[j]], sum), scaling);
    } else {
        for (int j = 0; j < k; ++j) weights[j] = __fmul_rn(s[experts[j]], scaling);
    }
}

// out[r] = x[rows[r]] for each gathered row r (one block each), d values.
extern "C" __global__ void moe_gather_rows(const float* x, int x_stride, const int* rows, int d, float* out,
                                           int out_stride) {
    const float* src = x + static_cast<u64>(rows[blockIdx.x]) * x_stride;
    float* dst = out + static_cast<u64>(blockIdx.x) * out_stride;
    for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
}

// routed: [n, k, d] (slot j of token t at (t*k + j)*d); experts, weights:
// [n, k]; shared: rows of d (shared_stride apart) or null; out: rows of d.
// One block per token: o = 0, then `o += w * y` for each slot in ascending
// (expert, slot) order, then `o += 1 * shared`.
extern "C" __global__ void moe_combine(const float* routed, const int* experts, const float* weights,
                                       const float* shared, int shared_stride, int k, int d, float* out,
                                       int out_stride) {
    __shared__ int order[DI_MOE_MAX_K];
    const u64 t = blockIdx.x;
    const int* ex = experts + t * k;
    for (int j = threadIdx.x; j < k; j += blockDim.x) {
        int rank = 0;
        for (int i = 0; i < k; ++i)
            if (ex[i] < ex[j] || (ex[i] == ex[j] && i < j)) ++rank;
        order[rank] = j;
    }
    __syncthreads();
    float* o = out + t * out_stride;
    const float* y_shared = shared ? shared + t * shared_stride : nullptr;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int q = 0; q < k; ++q) {
            int slot = order[q];
            float y = routed[(t * k + slot) * d + c];
            acc = __fadd_rn(acc, __fmul_rn(weights[t * k + slot], y));
        }
        if (y_shared) acc = __fadd_rn(acc, __fmul_rn(1.0f, y_shared[c]));
        o[c] = acc;
    }
}
