// RMSNorm (kernels/src/ops.rs `rms_norm`): the sum of squares in the CPU's
// 16-lane order, then `w * (x * inv)`. One block per row; thread 0 reduces,
// so the order is the CPU's whatever the block size.
#include "common.cuh"

// x: [rows, dim] in place; weight: [dim] or null.
extern "C" __global__ void rms_norm_rows(float* x, const float* weight, int dim, float eps) {
    float* row = x + static_cast<u64>(blockIdx.x) * dim;
    __shared__ float inv;
    if (threadIdx.x == 0) {
        float sum_sq = di_dot16(row, row, dim);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(dim)), eps)));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float v = __fmul_rn(row[c], inv);
        row[c] = weight ? __fmul_rn(weight[c], v) : v;
    }
}
