// Split-K linear layers: the speed-first variant of linear.cu, kept to
// measure what batch invariance costs. NOT batch-invariant, NOT the CPU's
// bits (except with one split): `out[r][o] = Σ_c x[r][c] · W[o][c]`
// computed as
// - pass 1 (`linear_splitk_*`): split `s = blockIdx.z` runs the portable
//   kernel's chain `acc = fma(x[c], w[c], acc)` from +0.0 over its slice of
//   columns `[s·slice, min((s+1)·slice, cols))` only, into
//   `part[s·split_stride + r·part_stride + o]`;
// - pass 2 (`linear_splitk_reduce`): `out[r][o] = part[0] + part[1] + ...`
//   left to right in split order (no atomics: a fixed order, so a given
//   split count always gives the same bits, but another split count, which
//   the host picks from the batch size, rounds differently).
// With one split, pass 1 writes `out` directly and its chain is the
// portable kernel's, so the bits are linear.cu's (and the CPU's).
//
// The block shape, tiling and shared-memory layout are linear.cu's (128
// outputs × 4 rows a block, 128 × 32 weight tiles decoded into shared
// memory), so that timing the two compares the split alone.
#include "common.cuh"
#include "linear.cuh"

#define DI_SK_REDUCE_THREADS 128

// Pass 1 for outputs blockIdx.y * 128 + threadIdx.x, x rows blockIdx.x * 4 + 0..4,
// columns of slice blockIdx.z.
template <class W>
__device__ __forceinline__ void di_splitk_tiles(W weight, const float* x, int x_stride, float* part, int part_stride,
                                                long long split_stride, int n, int rows, int cols, int slice,
                                                float* sw, float* sx) {
    const int tid = threadIdx.x;
    const int o0 = blockIdx.y * DI_LIN_OUTS;
    const int r0 = blockIdx.x * DI_LIN_ROWS;
    const int o = o0 + tid;
    const long long begin_ll = static_cast<long long>(blockIdx.z) * slice;
    const int begin = begin_ll < cols ? static_cast<int>(begin_ll) : cols;
    const int end = cols - begin < slice ? cols : begin + slice;
    float acc[DI_LIN_ROWS];
    for (int j = 0; j < DI_LIN_ROWS; ++j) acc[j] = 0.0f;
    for (int k0 = begin; k0 < end; k0 += DI_LIN_COLS) {
        const int kc = min(DI_LIN_COLS, end - k0);
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
            for (int j = 0; j < DI_LIN_ROWS; ++j) acc[j] = __fmaf_rn(sx[j * DI_LIN_COLS + k], w, acc[j]);
        }
    }
    if (o >= rows) return;
    float* dst = part + static_cast<long long>(blockIdx.z) * split_stride;
    for (int j = 0; j < DI_LIN_ROWS; ++j) {
        int r = r0 + j;
        if (r < n) dst[static_cast<u64>(r) * part_stride + o] = acc[j];
    }
}

#define DI_SK_SHARED                                  \
    __shared__ float sw[DI_LIN_COLS * DI_LIN_PITCH];    \
    __shared__ float sx[DI_LIN_ROWS * DI_LIN_COLS]

// w: [rows][cols] f32. part: split s, row r, output o at s·split_stride + r·part_stride + o.
extern "C" __global__ void linear_splitk_f32(const float* w, const float* x, int x_stride, float* part,
                                             int part_stride, long long split_stride, int n, int rows, int cols,
                                             int slice) {
    DI_SK_SHARED;
    di_splitk_tiles(DiLinF32{w, cols}, x, x_stride, part, part_stride, split_stride, n, rows, cols, slice, sw, sx);
}

// w: [rows][cols] bf16 bits.
extern "C" __global__ void linear_splitk_bf16(const u16* w, const float* x, int x_stride, float* part,
                                              int part_stride, long long split_stride, int n, int rows, int cols,
                                              int slice) {
    DI_SK_SHARED;
    di_splitk_tiles(DiLinBf16{w, cols}, x, x_stride, part, part_stride, split_stride, n, rows, cols, slice, sw, sx);
}

// codes: [rows][cols] e4m3; scales: [ceil(rows / block_rows)][ceil(cols / block_cols)].
extern "C" __global__ void linear_splitk_fp8(const u8* codes, const float* scales, int block_rows, int block_cols,
                                             const float* x, int x_stride, float* part, int part_stride,
                                             long long split_stride, int n, int rows, int cols, int slice) {
    DI_SK_SHARED;
    DiLinFp8 weight{codes, scales, cols, block_rows, block_cols};
    di_splitk_tiles(weight, x, x_stride, part, part_stride, split_stride, n, rows, cols, slice, sw, sx);
}

// Pass 2: out row blockIdx.x, output blockIdx.y * 128 + threadIdx.x =
// part[0] + part[1] + ... + part[splits - 1], added left to right.
extern "C" __global__ void linear_splitk_reduce(const float* part, int part_stride, long long split_stride,
                                                int splits, float* out, int out_stride, int rows) {
    const int o = blockIdx.y * DI_SK_REDUCE_THREADS + threadIdx.x;
    if (o >= rows) return;
    const float* src = part + static_cast<u64>(blockIdx.x) * part_stride + o;
    float acc = src[0];
    for (int s = 1; s < splits; ++s) acc = __fadd_rn(acc, src[static_cast<long long>(s) * split_stride]);
    out[static_cast<u64>(blockIdx.x) * out_stride + o] = acc;
}
