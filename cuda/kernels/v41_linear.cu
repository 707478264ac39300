// DeepSeek-V4.1's linears and dot products on the device
// (kernels/src/act_quant.rs), bit for bit:
// - the quantised linear (`quantized_linear_reference`): each 32-wide K block
//   of e4m3 activations × FP8/FP4 weight codes summed exactly (every product
//   is exact in f32 and a block's sum fits 41 bits, so an f64 sum in any
//   order is the exact sum), rounded to f32, times the activation scale, times
//   the weight scale, accumulated in f32 in K order from +0.0, then bf16;
// - `plain_linear` and `dot_f64`: f64 products accumulated in the CPU's eight
//   lanes (column c into lane c % 8 over the whole octets), the lanes folded
//   ((0+4)+(1+5))+((2+6)+(3+7)), plus the tail's products summed in order.
// The activations' FP8 quantiser is in v41_rows.cu.
#include "common.cuh"
#include "v41.cuh"

// Outputs and x rows a block of the linear kernels computes, and the K tile.
#define V41_LIN_OUTS 128
#define V41_LIN_ROWS 4
#define V41_LIN_COLS 32
#define V41_LIN_PITCH (V41_LIN_OUTS + 1)

// ---- Linear -----------------------------------------------------------------

// Weight values W[o][c] by format: dequantised (the plain product) or the
// bare code values (the block-scaled product).
struct V41F32 {
    const float* w;
    int cols;
    __device__ __forceinline__ float operator()(int o, int c) const { return w[static_cast<u64>(o) * cols + c]; }
};
struct V41Bf16 {
    const u16* w;
    int cols;
    __device__ __forceinline__ float operator()(int o, int c) const {
        return di_bf16_to_f32(w[static_cast<u64>(o) * cols + c]);
    }
};
// FP8 codes, times the scale of their `block_rows × block_cols` block when `scaled`.
struct V41Fp8 {
    const u8* codes;
    const float* scales;
    int cols;
    int block_rows;
    int block_cols;
    bool scaled;
    __device__ __forceinline__ float operator()(int o, int c) const {
        float v = di_fp8_e4m3_to_f32(codes[static_cast<u64>(o) * cols + c]);
        if (!scaled) return v;
        int per_row = (cols + block_cols - 1) / block_cols;
        return __fmul_rn(v, scales[static_cast<u64>(o / block_rows) * per_row + c / block_cols]);
    }
};
// FP4 code pairs (even column in the low nibble), times the row's block scale when `scaled`.
struct V41Fp4 {
    const u8* codes;
    const float* scales;
    int cols;
    int block_cols;
    bool scaled;
    __device__ __forceinline__ float operator()(int o, int c) const {
        u32 byte = codes[(static_cast<u64>(o) * cols + c) / 2];
        float v = v41_fp4_value((c & 1) ? byte >> 4 : byte & 0xfu);
        if (!scaled) return v;
        return __fmul_rn(v, scales[static_cast<u64>(o) * (cols / block_cols) + c / block_cols]);
    }
};

// Loads the tile of columns k0..k0+kc: weights (outputs o0.. by columns,
// `sw[k * PITCH + o]`) and x rows r0.. (`sx[j * COLS + k]`), zeros outside.
template <class W>
static __device__ __forceinline__ void v41_load_tile(W weight, const float* x, int x_stride, int n, int rows, int o0,
                                              int r0, int k0, int kc, float* sw, float* sx) {
    const int tid = threadIdx.x;
    for (int i = tid; i < V41_LIN_OUTS * V41_LIN_COLS; i += blockDim.x) {
        int ol = i / V41_LIN_COLS, k = i % V41_LIN_COLS;
        int og = o0 + ol;
        sw[k * V41_LIN_PITCH + ol] = og < rows && k < kc ? weight(og, k0 + k) : 0.0f;
    }
    for (int i = tid; i < V41_LIN_ROWS * V41_LIN_COLS; i += blockDim.x) {
        int j = i / V41_LIN_COLS, k = i % V41_LIN_COLS;
        int r = r0 + j;
        sx[i] = r < n && k < kc ? x[static_cast<u64>(r) * x_stride + k0 + k] : 0.0f;
    }
}

// `plain_linear`: out[r][o] = f32(dot_f64(x[r], W[o])), bf16-rounded when
// `round` (the unquantised `quantized_linear`). Outputs blockIdx.y * 128 +
// threadIdx.x of x rows blockIdx.x * 4 + 0..4; the lanes run across tiles of
// 32 columns (a multiple of 8, so column c stays in lane c % 8), the tail
// (the last cols % 8 columns) in its own sum.
template <class W>
static __device__ __forceinline__ void v41_plain(W weight, const float* x, int x_stride, float* out, int out_stride, int n,
                                          int rows, int cols, int round) {
    __shared__ float sw[V41_LIN_COLS * V41_LIN_PITCH];
    __shared__ float sx[V41_LIN_ROWS * V41_LIN_COLS];
    const int tid = threadIdx.x;
    const int o0 = blockIdx.y * V41_LIN_OUTS, r0 = blockIdx.x * V41_LIN_ROWS;
    const int o = o0 + tid;
    const int whole = cols / 8 * 8;
    double acc[V41_LIN_ROWS][8];
    double tail[V41_LIN_ROWS];
#pragma unroll
    for (int j = 0; j < V41_LIN_ROWS; ++j) {
#pragma unroll
        for (int l = 0; l < 8; ++l) acc[j][l] = 0.0;
        tail[j] = -0.0;
    }
    for (int k0 = 0; k0 < cols; k0 += V41_LIN_COLS) {
        const int kc = min(V41_LIN_COLS, cols - k0);
        __syncthreads();
        v41_load_tile(weight, x, x_stride, n, rows, o0, r0, k0, kc, sw, sx);
        __syncthreads();
        if (o >= rows) continue;
        // An octet of columns is whole (all below `whole`, lanes 0..8) or the tail.
        for (int k8 = 0; k8 < kc; k8 += 8) {
            if (k0 + k8 < whole) {
#pragma unroll
                for (int l = 0; l < 8; ++l) {
                    const double w = static_cast<double>(sw[(k8 + l) * V41_LIN_PITCH + tid]);
#pragma unroll
                    for (int j = 0; j < V41_LIN_ROWS; ++j)
                        acc[j][l] = __dadd_rn(acc[j][l],
                                              __dmul_rn(static_cast<double>(sx[j * V41_LIN_COLS + k8 + l]), w));
                }
            } else {
                for (int k = k8; k < kc; ++k) {
                    const double w = static_cast<double>(sw[k * V41_LIN_PITCH + tid]);
#pragma unroll
                    for (int j = 0; j < V41_LIN_ROWS; ++j)
                        tail[j] = __dadd_rn(tail[j], __dmul_rn(static_cast<double>(sx[j * V41_LIN_COLS + k]), w));
                }
            }
        }
    }
    if (o >= rows) return;
#pragma unroll
    for (int j = 0; j < V41_LIN_ROWS; ++j) {
        const int r = r0 + j;
        if (r >= n) continue;
        double lo = __dadd_rn(__dadd_rn(acc[j][0], acc[j][4]), __dadd_rn(acc[j][1], acc[j][5]));
        double hi = __dadd_rn(__dadd_rn(acc[j][2], acc[j][6]), __dadd_rn(acc[j][3], acc[j][7]));
        float v = static_cast<float>(__dadd_rn(__dadd_rn(lo, hi), tail[j]));
        out[static_cast<u64>(r) * out_stride + o] = round ? v41_round_bf16(v) : v;
    }
}

extern "C" __global__ void v41_plain_linear_f32(const float* w, const float* x, int x_stride, float* out,
                                                int out_stride, int n, int rows, int cols, int round) {
    v41_plain(V41F32{w, cols}, x, x_stride, out, out_stride, n, rows, cols, round);
}

extern "C" __global__ void v41_plain_linear_bf16(const u16* w, const float* x, int x_stride, float* out,
                                                 int out_stride, int n, int rows, int cols, int round) {
    v41_plain(V41Bf16{w, cols}, x, x_stride, out, out_stride, n, rows, cols, round);
}

extern "C" __global__ void v41_plain_linear_fp8(const u8* codes, const float* scales, int block_rows,
                                                int block_cols, const float* x, int x_stride, float* out,
                                                int out_stride, int n, int rows, int cols, int round) {
    v41_plain(V41Fp8{codes, scales, cols, block_rows, block_cols, true}, x, x_stride, out, out_stride, n, rows, cols,
              round);
}

extern "C" __global__ void v41_plain_linear_fp4(const u8* codes, const float* scales, int block_cols,
                                                const float* x, int x_stride, float* out, int out_stride, int n,
                                                int rows, int cols, int round) {
    v41_plain(V41Fp4{codes, scales, cols, block_cols, true}, x, x_stride, out, out_stride, n, rows, cols, round);
}

// The block-scaled product over FP8-quantised x (`values` [n][cols] e4m3
// values, `a_scales` [n][cols/32]): per 32-column block b, the exact sum of
// x·W (f32 products, exact; summed in f64, exact) rounded to f32, times
// a_scale, times the weight's scale of (o, b), added to an f32 accumulator in
// K order; the output bf16. `wscale(o, b)` gives the weight scale.
template <class W, class S>
static __device__ __forceinline__ void v41_block_scaled(W weight, S wscale, const float* values, const float* a_scales,
                                                 float* out, int out_stride, int n, int rows, int cols) {
    __shared__ float sw[V41_LIN_COLS * V41_LIN_PITCH];
    __shared__ float sx[V41_LIN_ROWS * V41_LIN_COLS];
    const int tid = threadIdx.x;
    const int o0 = blockIdx.y * V41_LIN_OUTS, r0 = blockIdx.x * V41_LIN_ROWS;
    const int o = o0 + tid;
    const int blocks = cols / 32;
    float acc[V41_LIN_ROWS];
#pragma unroll
    for (int j = 0; j < V41_LIN_ROWS; ++j) acc[j] = 0.0f;
    for (int b = 0; b < blocks; ++b) {
        __syncthreads();
        v41_load_tile(weight, values, cols, n, rows, o0, r0, b * 32, 32, sw, sx);
        __syncthreads();
        if (o >= rows) continue;
        const float ws = wscale(o, b);
#pragma unroll
        for (int j = 0; j < V41_LIN_ROWS; ++j) {
            double s = 0.0;
            for (int k = 0; k < 32; ++k)
                s = __dadd_rn(s, static_cast<double>(__fmul_rn(sx[j * V41_LIN_COLS + k], sw[k * V41_LIN_PITCH + tid])));
            const int r = min(r0 + j, n - 1);
            const float as = a_scales[static_cast<u64>(r) * blocks + b];
            acc[j] = __fadd_rn(acc[j], __fmul_rn(__fmul_rn(static_cast<float>(s), as), ws));
        }
    }
    if (o >= rows) return;
#pragma unroll
    for (int j = 0; j < V41_LIN_ROWS; ++j) {
        const int r = r0 + j;
        if (r < n) out[static_cast<u64>(r) * out_stride + o] = v41_round_bf16(acc[j]);
    }
}

struct V41Fp8Scale {
    const float* scales;
    int cols;
    int block_rows;
    __device__ __forceinline__ float operator()(int o, int b) const {
        return scales[static_cast<u64>(o / block_rows) * (cols / 32) + b];
    }
};
struct V41Fp4Scale {
    const float* scales;
    int cols;
    __device__ __forceinline__ float operator()(int o, int b) const {
        return scales[static_cast<u64>(o) * (cols / 32) + b];
    }
};

// FP8 weights with 32-wide scale blocks along K (block_cols = 32).
extern "C" __global__ void v41_quantized_linear_fp8(const u8* codes, const float* scales, int block_rows,
                                                    const float* values, const float* a_scales, float* out,
                                                    int out_stride, int n, int rows, int cols) {
    v41_block_scaled(V41Fp8{codes, scales, cols, block_rows, 32, false}, V41Fp8Scale{scales, cols, block_rows},
                     values, a_scales, out, out_stride, n, rows, cols);
}

// FP4 weights with a scale per 32 columns of each row.
extern "C" __global__ void v41_quantized_linear_fp4(const u8* codes, const float* scales, const float* values,
                                                    const float* a_scales, float* out, int out_stride, int n,
                                                    int rows, int cols) {
    v41_block_scaled(V41Fp4{codes, scales, cols, 32, false}, V41Fp4Scale{scales, cols}, values, a_scales, out,
                     out_stride, n, rows, cols);
}

// ---- Dot products -----------------------------------------------------------

// out[i * m + j] = dot_f64(a_i, b_j), i = blockIdx.x, j over the threads:
// a_i at a + i * a_stride, b_j at b + (index ? index[j] : j) * b_stride, each
// `cols` long. out64 (f64 sums) and out32 (rounded once) may be null.
extern "C" __global__ void v41_dot_f64_rows(const float* a, int a_stride, const float* b, int b_stride,
                                            int b_rows, const u32* index, int m, int cols, double* out64,
                                            float* out32) {
    const int i = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= m) return;
    // An index past b's rows reads its last row (the host cannot check device indices).
    const u64 row = index ? static_cast<u64>(min(index[j], static_cast<u32>(b_rows - 1))) : static_cast<u64>(j);
    const double d = v41_dot_f64(a + static_cast<u64>(i) * a_stride, b + row * b_stride, cols);
    const u64 at = static_cast<u64>(i) * m + j;
    if (out64) out64[at] = d;
    if (out32) out32[at] = static_cast<float>(d);
}
