// The emulated device: what a `.cu` file of `cuda/kernels/` needs from CUDA,
// for the host's C++ compiler. The build compiles every kernel source twice:
// for the GPU by NVRTC, and for the host with this header force-included, so
// that `cargo test` runs the same kernels without a GPU.
//
// A block runs its threads as fibers on one OS thread, switched only where
// CUDA threads wait for each other (`__syncthreads`, `__syncwarp`, the warp
// shuffles); a block with no barrier runs its threads one after the other.
// `__shared__` variables are thread-local statics: one copy per OS thread,
// which runs one block at a time. Nothing here is fast; it is exact, and the
// kernels it runs are the ones the GPU runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#define DI_EMULATED 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace di_emu {
extern thread_local dim3 block_idx;
extern thread_local dim3 block_dim;
extern thread_local dim3 grid_dim;
extern thread_local dim3 thread_idx;

void sync_block();
void sync_warp();
// Each lane publishes `value` and reads lane `source(lane)`'s (its own when
// the source is outside the warp's `width` segment, as CUDA does).
unsigned long long exchange(unsigned long long value, int mode, int operand, int width);
void* dynamic_shared();
[[noreturn]] void trap(const char* what);

// Runs `body(env)` for every thread of every block of the grid.
void launch(dim3 grid, dim3 block, unsigned int shared_bytes, void (*body)(void*), void* env);

template <class F>
void launch_fn(dim3 grid, dim3 block, unsigned int shared_bytes, F& f) {
    launch(grid, block, shared_bytes, [](void* env) { (*static_cast<F*>(env))(); }, &f);
}

template <class T>
T shuffle(T value, int mode, int operand, int width) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 64 bits");
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    bits = exchange(bits, mode, operand, width);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}
}  // namespace di_emu

#define threadIdx (di_emu::thread_idx)
#define blockIdx (di_emu::block_idx)
#define blockDim (di_emu::block_dim)
#define gridDim (di_emu::grid_dim)
#define warpSize 32

inline void __syncthreads() { di_emu::sync_block(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { di_emu::sync_warp(); }
inline void __trap() { di_emu::trap("__trap"); }

template <class T>
inline T __shfl_xor_sync(unsigned int, T v, int lane_mask, int width = 32) {
    return di_emu::shuffle(v, 0, lane_mask, width);
}
template <class T>
inline T __shfl_down_sync(unsigned int, T v, unsigned int delta, int width = 32) {
    return di_emu::shuffle(v, 1, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_up_sync(unsigned int, T v, unsigned int delta, int width = 32) {
    return di_emu::shuffle(v, 2, static_cast<int>(delta), width);
}
template <class T>
inline T __shfl_sync(unsigned int, T v, int src_lane, int width = 32) {
    return di_emu::shuffle(v, 3, src_lane, width);
}

// Intrinsics with CUDA's rounding: the host's IEEE operations round to nearest
// like the `_rn` forms, and `std::fma` is fused.
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float v) { int i; std::memcpy(&i, &v, 4); return i; }
inline float __uint_as_float(unsigned int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned int __float_as_uint(float v) { unsigned int i; std::memcpy(&i, &v, 4); return i; }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline long long __double_as_longlong(double v) { long long i; std::memcpy(&i, &v, 8); return i; }
inline float __double2float_rn(double v) { return static_cast<float>(v); }
template <class T>
inline T __ldg(const T* p) { return *p; }

using std::fabs;
using std::fmaf;
using std::sqrt;
using std::fma;
using std::isnan;
using std::isinf;
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float fminf(float a, float b) { return std::fmin(a, b); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }

// Dynamic shared memory: `DI_DYNAMIC_SHARED(float, buf);` in a kernel body.
#define DI_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(di_emu::dynamic_shared())
