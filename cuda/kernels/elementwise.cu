// The small element-wise steps of the forward pass, each the CPU's
// operations in the CPU's order (kernels/src/ops.rs): interleaved RoPE,
// DeepSeek-V4's clamped SwiGLU, row sums and scalings.
#include "common.cuh"

// `rope_interleaved` on the trailing `rope_dim` channels of every head of
// row blockIdx.x: x row r at x + r * stride, `heads` heads of `head_dim`;
// cos_table/sin_table: [rows, rope_dim / 2] (row r's angles at r * rope_dim / 2);
// `inverse` != 0 negates sin (`Angles::apply_inverse`). Threads over the
// (head, pair) couples.
extern "C" __global__ void ew_rope_rows(float* x, long long stride, int heads, int head_dim, int rope_dim,
                                        const float* cos_table, const float* sin_table, int inverse) {
    const u64 r = blockIdx.x;
    const int half = rope_dim / 2;
    float* row = x + r * static_cast<u64>(stride);
    const float* cr = cos_table + r * half;
    const float* sr = sin_table + r * half;
    const int tail = head_dim - rope_dim;
    for (int k = threadIdx.x; k < heads * half; k += blockDim.x) {
        const int h = k / half;
        const int i = k - h * half;
        float* pair = row + static_cast<u64>(h) * head_dim + tail + 2 * i;
        const float a = pair[0];
        const float b = pair[1];
        const float c = cr[i];
        const float s = inverse ? -sr[i] : sr[i];
        pair[0] = __fadd_rn(__fmul_rn(a, c), -__fmul_rn(b, s));
        pair[1] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
}

// Rust's `f32::clamp`: below min is min, above max is max, NaN stays.
static __device__ __forceinline__ float ew_clamp(float v, float lo, float hi) {
    if (v < lo) v = lo;
    if (v > hi) v = hi;
    return v;
}

// `swiglu_clamped` in place on gate[0..len]: g = min(gate, limit),
// gate <- g * (1 / (1 + exp(-g))) * clamp(up, -limit, limit), the product
// left to right. Grid-stride over the elements.
extern "C" __global__ void ew_swiglu_clamped(float* gate, const float* up, long long len, float limit) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < len; i += step) {
        const float g = fminf(gate[i], limit);
        const float e = di_exp(-g);
        const float u = ew_clamp(up[i], -limit, limit);
        gate[i] = __fmul_rn(__fmul_rn(g, __fdiv_rn(1.0f, __fadd_rn(1.0f, e))), u);
    }
}

// out row r += x row r over `width` columns (row r of out at out + r *
// out_stride, of x at x + r * x_stride). One block per row.
extern "C" __global__ void ew_add_rows(float* out, long long out_stride, const float* x, long long x_stride,
                                       int width) {
    float* o = out + static_cast<u64>(blockIdx.x) * static_cast<u64>(out_stride);
    const float* v = x + static_cast<u64>(blockIdx.x) * static_cast<u64>(x_stride);
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = __fadd_rn(o[c], v[c]);
}

// `add_scaled` on each row: out[c] += p * x[c], the product rounded before
// the sum. Layout as `ew_add_rows`.
extern "C" __global__ void ew_add_scaled_rows(float* out, long long out_stride, float p, const float* x,
                                              long long x_stride, int width) {
    float* o = out + static_cast<u64>(blockIdx.x) * static_cast<u64>(out_stride);
    const float* v = x + static_cast<u64>(blockIdx.x) * static_cast<u64>(x_stride);
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = __fadd_rn(o[c], __fmul_rn(p, v[c]));
}

// x[0..len] *= factor. Grid-stride over the elements.
extern "C" __global__ void ew_scale(float* x, long long len, float factor) {
    const long long step = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < len; i += step)
        x[i] = __fmul_rn(x[i], factor);
}
