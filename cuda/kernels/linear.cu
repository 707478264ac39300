// Linear layers (kernels/src/linear.rs `Linear::forward`, defined by
// `Linear::forward_reference`): `out[r][o] = Σ_c x[r][c] · W[o][c]` over a
// weight in its published row-major layout, and the embedding lookup
// (`Linear::dequantize_row`).
//
// Every output is the CPU's one chain, so its bits do not depend on the
// batch or on where a row sits in it:
// - F32, BF16, FP8: `acc = fma(x[c], w[c], acc)` over the columns in order
//   from +0.0, `w[c]` the dequantised weight (FP8: `code * scale` rounded to
//   f32 first);
// - FP4: each block of `block_cols` columns summed as such a chain over the
//   unscaled e2m1 values, then `acc = fma(block sum, scale, acc)` in block
//   order from +0.0.
//
// A block computes 128 outputs (one a thread) of 4 x rows. The weights pass
// through shared memory in tiles of 128 outputs × 32 columns, loaded with
// consecutive threads on consecutive columns of a row, and decoded on the
// way in; each thread then runs its outputs' chains over the tile's columns.
#include "common.cuh"
#include "linear.cuh"

// Outputs blockIdx.y * 128 + threadIdx.x of x rows blockIdx.x * 4 + 0..4.
// `fp4_scales` (FP4 only, `[rows][cols / fp4_block]`) makes the chain the
// block-scaled one; null, the plain one.
template <class W>
__device__ __forceinline__ void di_linear_tiles(W weight, const float* fp4_scales, int fp4_block, const float* x,
                                                int x_stride, float* out, int out_stride, int n, int rows, int cols,
                                                float* sw, float* sx) {
    const int tid = threadIdx.x;
    const int o0 = blockIdx.y * DI_LIN_OUTS;
    const int r0 = blockIdx.x * DI_LIN_ROWS;
    const int o = o0 + tid;
    const bool fp4 = fp4_scales != nullptr;
    float acc[DI_LIN_ROWS];
    float part[DI_LIN_ROWS];
    for (int j = 0; j < DI_LIN_ROWS; ++j) {
        acc[j] = 0.0f;
        part[j] = 0.0f;
    }
    int left = fp4_block;  // columns left in the current FP4 block
    u64 scale_at = fp4 && o < rows ? static_cast<u64>(o) * (cols / fp4_block) : 0;
    for (int k0 = 0; k0 < cols; k0 += DI_LIN_COLS) {
        const int kc = min(DI_LIN_COLS, cols - k0);
        __syncthreads();  // the previous tile is consumed
        for (int i = tid; i < DI_LIN_OUTS * DI_LIN_COLS; i += DI_LIN_OUTS) {
            int ol = i / DI_LIN_COLS, k = i % DI_LIN_COLS;
            int og = o0 + ol;
            sw[k * DI_LIN_PITCH + ol] = og < rows && k < kc ? weight(og, k0 + k) : 0.0f;
        }
        for (int i = tid; i < DI_LIN_ROWS * DI_LIN_COLS; i += DI_LIN_OUTS) {
            int j = i / DI_LIN_COLS, k = i % DI_LIN_COLS;
            int r = r0 + j;
            sx[i] = r < n && k < kc ? x[static_cast<u64>(r) * x_stride + k0 + k] : 0.0f;
        }
        __syncthreads();
        if (o >= rows) continue;
        for (int k = 0; k < kc; ++k) {
            float w = sw[k * DI_LIN_PITCH + tid];
            if (!fp4) {
                for (int j = 0; j < DI_LIN_ROWS; ++j) acc[j] = __fmaf_rn(sx[j * DI_LIN_COLS + k], w, acc[j]);
                continue;
            }
            for (int j = 0; j < DI_LIN_ROWS; ++j) part[j] = __fmaf_rn(sx[j * DI_LIN_COLS + k], w, part[j]);
            if (--left == 0) {
                float scale = fp4_scales[scale_at++];
                for (int j = 0; j < DI_LIN_ROWS; ++j) {
                    acc[j] = __fmaf_rn(part[j], scale, acc[j]);
                    part[j] = 0.0f;
                }
                left = fp4_block;
            }
        }
    }
    if (o >= rows) return;
    for (int j = 0; j < DI_LIN_ROWS; ++j) {
        int r = r0 + j;
        if (r < n) out[static_cast<u64>(r) * out_stride + o] = acc[j];
    }
}

#define DI_LIN_SHARED                                       \
    __shared__ float sw[DI_LIN_COLS * DI_LIN_PITCH];        \
    __shared__ float sx[DI_LIN_ROWS * DI_LIN_COLS]

// w: [rows][cols] f32.
extern "C" __global__ void linear_f32(const float* w, const float* x, int x_stride, float* out,
                                                             int out_stride, int n, int rows, int cols) {
    DI_LIN_SHARED;
    di_linear_tiles(DiLinF32{w, cols}, nullptr, 1, x, x_stride, out, out_stride, n, rows, cols, sw, sx);
}

// w: [rows][cols] bf16 bits.
extern "C" __global__ void linear_bf16(const u16* w, const float* x, int x_stride, float* out,
                                                              int out_stride, int n, int rows, int cols) {
    DI_LIN_SHARED;
    di_linear_tiles(DiLinBf16{w, cols}, nullptr, 1, x, x_stride, out, out_stride, n, rows, cols, sw, sx);
}

// codes: [rows][cols] e4m3; scales: [ceil(rows / block_rows)][ceil(cols / block_cols)].
extern "C" __global__ void linear_fp8(const u8* codes, const float* scales, int block_rows,
                                                             int block_cols, const float* x, int x_stride, float* out,
                                                             int out_stride, int n, int rows, int cols) {
    DI_LIN_SHARED;
    DiLinFp8 weight{codes, scales, cols, block_rows, block_cols};
    di_linear_tiles(weight, nullptr, 1, x, x_stride, out, out_stride, n, rows, cols, sw, sx);
}

// codes: [rows][cols / 2] packed e2m1; scales: [rows][cols / block_cols].
extern "C" __global__ void linear_fp4(const u8* codes, const float* scales, int block_cols,
                                                             const float* x, int x_stride, float* out, int out_stride,
                                                             int n, int rows, int cols) {
    DI_LIN_SHARED;
    di_linear_tiles(DiLinFp4{codes, cols}, scales, block_cols, x, x_stride, out, out_stride, n, rows, cols, sw, sx);
}

// The embedding lookup: out row blockIdx.x = dequantised weight row
// min(ids[blockIdx.x], rows - 1), threads over the columns.
template <class W>
__device__ __forceinline__ void di_gather(W weight, const u32* ids, float* out, int out_stride, int rows, int cols) {
    u32 id = ids[blockIdx.x];
    int r = id < static_cast<u32>(rows) ? static_cast<int>(id) : rows - 1;
    float* dst = out + static_cast<u64>(blockIdx.x) * out_stride;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = weight(r, c);
}

extern "C" __global__ void linear_gather_f32(const float* w, const u32* ids, float* out, int out_stride, int rows,
                                             int cols) {
    di_gather(DiLinF32{w, cols}, ids, out, out_stride, rows, cols);
}

extern "C" __global__ void linear_gather_bf16(const u16* w, const u32* ids, float* out, int out_stride, int rows,
                                              int cols) {
    di_gather(DiLinBf16{w, cols}, ids, out, out_stride, rows, cols);
}

extern "C" __global__ void linear_gather_fp8(const u8* codes, const float* scales, int block_rows, int block_cols,
                                             const u32* ids, float* out, int out_stride, int rows, int cols) {
    di_gather(DiLinFp8{codes, scales, cols, block_rows, block_cols}, ids, out, out_stride, rows, cols);
}

// FP4 rows dequantised as the CPU does: `e2m1 value * scale`, rounded.
struct DiLinFp4Scaled {
    const u8* codes;
    const float* scales;
    int cols;
    int block_cols;
    __device__ __forceinline__ float operator()(int o, int c) const {
        float scale = scales[static_cast<u64>(o) * (cols / block_cols) + c / block_cols];
        return __fmul_rn(DiLinFp4{codes, cols}(o, c), scale);
    }
};

extern "C" __global__ void linear_gather_fp4(const u8* codes, const float* scales, int block_cols, const u32* ids,
                                             float* out, int out_stride, int rows, int cols) {
    di_gather(DiLinFp4Scaled{codes, scales, cols, block_cols}, ids, out, out_stride, rows, cols);
}
