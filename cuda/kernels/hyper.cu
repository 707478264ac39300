// mHC hyper-connections (engine/src/model/hyper.rs `pre`, `post`, `head`):
// from the raw mixing product `mix.forward(streams)` of each token to its
// post/comb weights and collapsed input, and the post-mix of the streams
// back. Every step in the CPU's order (kernels/src/ops.rs `inv_rms`,
// `sigmoid`, `softmax`, `sinkhorn`, `add_scaled`, `mix_streams`), so the
// bits are the CPU's. One block per token; at least 16 threads a block.
#include "common.cuh"

// Most streams a block handles (its shared arrays are sized for it).
#define HYPER_MAX_HC 16

// `inv_rms(x[..width], eps)`: the 16 lanes of `dot(x, x)` one per thread
// (lane l chains elements l, l + 16, ... with fused multiply-adds, as
// `di_dot16`), then `reduce16` and `1 / sqrt(sum / width + eps)` on thread 0.
// `lanes` is 16 floats of shared memory; the result is valid on thread 0.
static __device__ __forceinline__ float hyper_inv_rms(const float* x, int width, float eps, float* lanes) {
    if (threadIdx.x < 16) {
        float acc = 0.0f;
        for (int c = threadIdx.x; c < width; c += 16) acc = __fmaf_rn(x[c], x[c], acc);
        lanes[threadIdx.x] = acc;
    }
    __syncthreads();
    float inv = 0.0f;
    if (threadIdx.x == 0) {
        float sum_sq = di_reduce16(lanes);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(width)), eps)));
    }
    return inv;
}

// `ops::sigmoid`: 1 / (1 + exp(-x)).
static __device__ __forceinline__ float hyper_sigmoid(float x) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, di_exp(-x)));
}

// `ops::softmax` of `n` values (`softmax_with_sink` with a sink of -inf):
// the maximum (which of equal maxima is found changes no bit), the shifted
// exponentials, their sum in `sum_lanes`' order plus exp(-inf - max), and a
// multiplication by its inverse. `lanes`: 16 floats of scratch (shared
// memory, so that no local array takes a stack frame).
static __device__ void hyper_softmax(float* x, int n, float* lanes) {
    float max = DI_NEG_INF;
    for (int i = 0; i < n; ++i) max = fmaxf(max, x[i]);
    for (int i = 0; i < n; ++i) x[i] = di_exp(__fadd_rn(x[i], -max));
    for (int l = 0; l < 16; ++l) lanes[l] = 0.0f;
    for (int i = 0; i < n; ++i) lanes[i % 16] = __fadd_rn(lanes[i % 16], x[i]);
    float sum = __fadd_rn(di_exp(__fadd_rn(DI_NEG_INF, -max)), di_reduce16(lanes));
    float inv = __fdiv_rn(1.0f, sum);
    for (int i = 0; i < n; ++i) x[i] = __fmul_rn(x[i], inv);
}

// `ops::sinkhorn` of an n x n row-major matrix (its 4 x 4 path has the same
// operations): columns normalised once, then `iters - 1` rounds of rows
// then columns, `eps` added to every divisor. Column sums run from +0.0 in
// row order; row sums as Rust's `Sum` (from -0.0) in column order.
static __device__ void hyper_sinkhorn_columns(float* m, int n, float eps) {
    for (int c = 0; c < n; ++c) {
        float s = 0.0f;
        for (int r = 0; r < n; ++r) s = __fadd_rn(s, m[r * n + c]);
        float divisor = __fadd_rn(s, eps);
        for (int r = 0; r < n; ++r) m[r * n + c] = __fdiv_rn(m[r * n + c], divisor);
    }
}

static __device__ void hyper_sinkhorn(float* m, int n, int iters, float eps) {
    hyper_sinkhorn_columns(m, n, eps);
    for (int it = 1; it < iters; ++it) {
        for (int r = 0; r < n; ++r) {
            float s = -0.0f;
            for (int c = 0; c < n; ++c) s = __fadd_rn(s, m[r * n + c]);
            float divisor = __fadd_rn(s, eps);
            for (int c = 0; c < n; ++c) m[r * n + c] = __fdiv_rn(m[r * n + c], divisor);
        }
        hyper_sinkhorn_columns(m, n, eps);
    }
}

// `collapse`: out[c] = sum_j pre[j] * stream_j[c] from +0.0, each product
// rounded before its sum. All threads over the columns.
static __device__ __forceinline__ void hyper_collapse(const float* pre, const float* s, int hc, int d, float* out) {
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < hc; ++j) acc = __fadd_rn(acc, __fmul_rn(pre[j], s[static_cast<u64>(j) * d + c]));
        out[c] = acc;
    }
}

// `hyper::pre` per token (block x): raw: [n, (2+hc)*hc] (mix.forward of the
// raw streams), streams: [n, hc*d], base: [(2+hc)*hc]; writes post: [n, hc],
// comb: [n, hc*hc] and collapsed: [n, d].
extern "C" __global__ void hyper_pre(const float* raw, const float* streams, int hc, int d, float scale_pre,
                                     float scale_post, float scale_comb, const float* base, float hc_eps,
                                     float rms_eps, int sinkhorn_iters, float* post_out, float* comb_out,
                                     float* collapsed_out) {
    __shared__ float lanes[16];
    __shared__ float pre[HYPER_MAX_HC];
    __shared__ float comb[HYPER_MAX_HC * HYPER_MAX_HC];
    const u64 t = blockIdx.x;
    const int outputs = (2 + hc) * hc;
    const int width = hc * d;
    const float* s = streams + t * width;
    const float* m = raw + t * outputs;
    float inv = hyper_inv_rms(s, width, rms_eps, lanes);
    if (threadIdx.x == 0) {
        // (`lanes` is free again: thread 0 reduced them.)
        // normed_mix: each raw output times the token's 1/rms.
        for (int j = 0; j < hc; ++j) {
            float v = __fmul_rn(m[j], inv);
            pre[j] = __fadd_rn(hyper_sigmoid(__fadd_rn(__fmul_rn(v, scale_pre), base[j])), hc_eps);
        }
        for (int j = 0; j < hc; ++j) {
            float v = __fmul_rn(m[hc + j], inv);
            post_out[t * hc + j] = __fmul_rn(2.0f, hyper_sigmoid(__fadd_rn(__fmul_rn(v, scale_post), base[hc + j])));
        }
        for (int k = 0; k < hc * hc; ++k) {
            float v = __fmul_rn(m[2 * hc + k], inv);
            comb[k] = __fadd_rn(__fmul_rn(v, scale_comb), base[2 * hc + k]);
        }
        for (int r = 0; r < hc; ++r) {
            hyper_softmax(comb + r * hc, hc, lanes);
            for (int c = 0; c < hc; ++c) comb[r * hc + c] = __fadd_rn(comb[r * hc + c], hc_eps);
        }
        hyper_sinkhorn(comb, hc, sinkhorn_iters, hc_eps);
        for (int k = 0; k < hc * hc; ++k) comb_out[t * hc * hc + k] = comb[k];
    }
    __syncthreads();
    hyper_collapse(pre, s, hc, d, collapsed_out + t * d);
}

// `hyper::head` per token (block x): raw: [n, hc], streams: [n, hc*d],
// base: [hc]; writes out: [n, d].
extern "C" __global__ void hyper_head(const float* raw, const float* streams, int hc, int d, float scale,
                                      const float* base, float hc_eps, float rms_eps, float* out) {
    __shared__ float lanes[16];
    __shared__ float pre[HYPER_MAX_HC];
    const u64 t = blockIdx.x;
    const int width = hc * d;
    const float* s = streams + t * width;
    float inv = hyper_inv_rms(s, width, rms_eps, lanes);
    if (threadIdx.x == 0) {
        for (int j = 0; j < hc; ++j) {
            float v = __fmul_rn(raw[t * hc + j], inv);
            pre[j] = __fadd_rn(hyper_sigmoid(__fadd_rn(__fmul_rn(v, scale), base[j])), hc_eps);
        }
    }
    __syncthreads();
    hyper_collapse(pre, s, hc, d, out + t * d);
}

// `hyper::post` (`ops::mix_streams`) per token (block x) over columns
// (blocks y of blockDim columns): stream k <- post[k] * o, then
// + comb[j*hc + k] * old stream j for j in order, each product rounded
// before its sum. post: [n, hc], comb: [n, hc*hc], output: [n, d],
// streams: [n, hc*d] in place. Dynamic shared memory: hc * blockDim floats
// (each thread's column of the old streams).
extern "C" __global__ void hyper_post(const float* post, const float* comb, const float* output, float* streams,
                                      int hc, int d) {
    DI_DYNAMIC_SHARED(float, old);
    const u64 t = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float* s = streams + t * hc * d;
    const float* p = post + t * hc;
    const float* w = comb + t * hc * hc;
    float* mine = old + threadIdx.x;
    for (int j = 0; j < hc; ++j) mine[j * blockDim.x] = s[static_cast<u64>(j) * d + c];
    const float o = output[t * d + c];
    for (int k = 0; k < hc; ++k) {
        float acc = __fmul_rn(p[k], o);
        for (int j = 0; j < hc; ++j) acc = __fadd_rn(acc, __fmul_rn(w[j * hc + k], mine[j * blockDim.x]));
        s[static_cast<u64>(k) * d + c] = acc;
    }
}
