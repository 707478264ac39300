// What linear.cu and linear_splitk.cu share: the tile shape and the
// dequantised weight W[o][c] of each published format, read from its codes
// as the CPU dequantises it. Included after common.cuh.
#pragma once

#define DI_LIN_OUTS 128
#define DI_LIN_ROWS 4
#define DI_LIN_COLS 32
// Padding of a tile column in shared memory: loads (a warp along one row's
// columns) and reads (a warp along one column's outputs) hit distinct banks.
#define DI_LIN_PITCH (DI_LIN_OUTS + 1)

// The dequantised weight W[o][c] of each format (FP4: unscaled).
struct DiLinF32 {
    const float* w;
    int cols;
    __device__ __forceinline__ float operator()(int o, int c) const { return w[static_cast<u64>(o) * cols + c]; }
};

struct DiLinBf16 {
    const u16* w;
    int cols;
    __device__ __forceinline__ float operator()(int o, int c) const {
        return di_bf16_to_f32(w[static_cast<u64>(o) * cols + c]);
    }
};

// FP8 e4m3 codes with a scale per `block_rows × block_cols` block:
// `scales[(o / block_rows) * ceil(cols / block_cols) + c / block_cols]`.
struct DiLinFp8 {
    const u8* codes;
    const float* scales;
    int cols;
    int block_rows;
    int block_cols;
    __device__ __forceinline__ float operator()(int o, int c) const {
        int blocks_per_row = (cols + block_cols - 1) / block_cols;
        float scale = scales[static_cast<u64>(o / block_rows) * blocks_per_row + c / block_cols];
        return __fmul_rn(di_fp8_e4m3_to_f32(codes[static_cast<u64>(o) * cols + c]), scale);
    }
};

// FP4 e2m1 codes, two a byte (even column in the low nibble), unscaled.
struct DiLinFp4 {
    const u8* codes;
    int cols;
    __device__ __forceinline__ float operator()(int o, int c) const {
        u32 byte = codes[(static_cast<u64>(o) * cols + c) / 2];
        return di_fp4_e2m1_to_f32((c & 1) ? byte >> 4 : byte & 0xfu);
    }
};
