// The KV compressors of compressed attention (CSA/HCA), the engine's
// `compress_token` (engine/src/model/attention.rs) over one sequence's chunk:
// each window of `ratio` tokens that closes becomes one entry, the gated
// softmax pool of its slots (`softmax_pool_columns`, kernels/src/pooling.rs),
// then `rms_norm` with the compressor's weight, then interleaved RoPE on the
// trailing channels at the window's position (cos/sin computed by the host).
//
// A window's inputs are its own tokens and, with overlap, the previous
// window's first series; both are either the sequence's saved state
// (pending tokens, the saved overlap) or rows of the chunk, so every window
// of a chunk is computed independently (one block each, the CPU's order
// inside it), whatever the chunk's length. `compressor_save` then updates
// the state: the last closed window's first series and the tokens left open.
#include "common.cuh"

// Full unrolling keeps the 16 lane sums in registers on the GPU (the host
// compiler knows no such pragma).
#ifdef DI_EMULATED
#define DI_COMPRESSOR_UNROLL
#else
#define DI_COMPRESSOR_UNROLL _Pragma("unroll")
#endif

// The kv or gate row of slot `j` of the chunk's window `k`: token
// `k * ratio + j - pending` of the chunk, or (for the chunk's first window)
// the sequence's pending row `j` when that index is negative.
__device__ __forceinline__ const float* di_compressor_row(const float* rows, int stride, const float* pending_rows,
                                                         int pending, int width, int ratio, int k, int j) {
    int t = k * ratio + j - pending;
    if (t < 0) return pending_rows + static_cast<u64>(j) * width;
    return rows + static_cast<u64>(t) * stride;
}

// Logit and value of pooled row `r` in column `c` of the chunk's window `k`
// (the CPU's `logit_rows` / `value_rows`): with overlap, rows 0..ratio are the
// previous window's first series (gate with its slot bias), rows ratio..2
// ratio this window's second series; without, this window's rows.
struct DiCompressorInputs {
    const float* kv;
    const float* gate;
    int kv_stride;
    int gate_stride;
    const float* pending_kv;
    const float* pending_gate;
    int pending;
    const float* overlap_kv;
    const float* overlap_gate;
    int has_overlap;
    const float* ape;
    int ratio;
    int dim;
    int overlap;
};

__device__ __forceinline__ void di_compressor_slot(const DiCompressorInputs& in, int k, int r, int c, float* logit,
                                                   float* value) {
    const int width = in.overlap ? 2 * in.dim : in.dim;
    int window = k;
    int j = r;
    int channel = c;
    if (in.overlap) {
        if (r < in.ratio) {
            if (k == 0) {
                // The sequence's saved first series, or (before any window
                // closed) slots that take no weight.
                if (in.has_overlap) {
                    *logit = in.overlap_gate[static_cast<u64>(r) * in.dim + c];
                    *value = in.overlap_kv[static_cast<u64>(r) * in.dim + c];
                } else {
                    *logit = DI_NEG_INF;
                    *value = 0.0f;
                }
                return;
            }
            window = k - 1;
        } else {
            j = r - in.ratio;
            channel = in.dim + c;
        }
    }
    const float* g =
        di_compressor_row(in.gate, in.gate_stride, in.pending_gate, in.pending, width, in.ratio, window, j);
    const float* v = di_compressor_row(in.kv, in.kv_stride, in.pending_kv, in.pending, width, in.ratio, window, j);
    *logit = __fadd_rn(g[channel], in.ape[static_cast<u64>(j) * width + channel]);
    *value = v[channel];
}

// One block per window that closes in the chunk (window k of the chunk is
// the sequence's entry `count + k`, written at `entries + k * dim`).
// kv, gate: the chunk's projected rows, `width` = dim·(1+overlap) values each
// at the given row strides; pending_kv/gate: `[ratio, width]`, the first
// `pending` rows held; overlap_kv/gate: `[ratio, dim]`, valid when
// has_overlap; ape `[ratio, width]`; norm `[dim]`; cos, sin `[windows, half]`
// (the trailing 2·half channels rotate). Dynamic shared memory: dim floats.
extern "C" __global__ void compressor_windows(float* entries, const float* kv, int kv_stride, const float* gate,
                                              int gate_stride, const float* pending_kv, const float* pending_gate,
                                              int pending, const float* overlap_kv, const float* overlap_gate,
                                              int has_overlap, const float* ape, const float* norm, const float* cos_table,
                                              const float* sin_table, int ratio, int dim, int overlap, int half, float eps) {
    DI_DYNAMIC_SHARED(float, entry);
    __shared__ float inv_rms;
    DiCompressorInputs in;
    in.kv = kv;
    in.gate = gate;
    in.kv_stride = kv_stride;
    in.gate_stride = gate_stride;
    in.pending_kv = pending_kv;
    in.pending_gate = pending_gate;
    in.pending = pending;
    in.overlap_kv = overlap_kv;
    in.overlap_gate = overlap_gate;
    in.has_overlap = has_overlap;
    in.ape = ape;
    in.ratio = ratio;
    in.dim = dim;
    in.overlap = overlap;
    const int k = blockIdx.x;
    const int rows = overlap ? 2 * ratio : ratio;

    // softmax_pool_columns, one column per thread.
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float logit, value;
        // The largest logit that is not NaN (−inf for none).
        float m = DI_NEG_INF;
        for (int r = 0; r < rows; ++r) {
            di_compressor_slot(in, k, r, c, &logit, &value);
            if (logit > m) m = logit;
        }
        // exp(logit − max) summed into lane r % 16 from +0.0, then reduce16.
        float lanes[16];
DI_COMPRESSOR_UNROLL
        for (int l = 0; l < 16; ++l) lanes[l] = 0.0f;
        for (int base = 0; base < rows; base += 16) {
DI_COMPRESSOR_UNROLL
            for (int l = 0; l < 16; ++l) {
                if (base + l < rows) {
                    di_compressor_slot(in, k, base + l, c, &logit, &value);
                    lanes[l] = __fadd_rn(lanes[l], di_exp(__fadd_rn(logit, -m)));
                }
            }
        }
        float inv = __fdiv_rn(1.0f, __fadd_rn(di_exp(__fadd_rn(DI_NEG_INF, -m)), di_reduce16(lanes)));
        // Σ (p · inv) · v in row order from −0.0 (p recomputed: the same bits).
        float out = -0.0f;
        for (int r = 0; r < rows; ++r) {
            di_compressor_slot(in, k, r, c, &logit, &value);
            float p = di_exp(__fadd_rn(logit, -m));
            out = __fadd_rn(out, __fmul_rn(__fmul_rn(p, inv), value));
        }
        entry[c] = out;
    }
    __syncthreads();

    // rms_norm with the compressor's weight (norm.cu's arithmetic).
    if (threadIdx.x == 0) {
        // di_dot16(entry, entry, dim): channel c into lane c % 16, unrolled
        // so that the lanes stay in registers.
        float acc[16];
        DI_COMPRESSOR_UNROLL
        for (int l = 0; l < 16; ++l) acc[l] = 0.0f;
        for (int base = 0; base < dim; base += 16) {
            DI_COMPRESSOR_UNROLL
            for (int l = 0; l < 16; ++l)
                if (base + l < dim) acc[l] = __fmaf_rn(entry[base + l], entry[base + l], acc[l]);
        }
        float sum_sq = di_reduce16(acc);
        inv_rms = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(dim)), eps)));
    }
    __syncthreads();
    for (int c = threadIdx.x; c < dim; c += blockDim.x) entry[c] = __fmul_rn(norm[c], __fmul_rn(entry[c], inv_rms));
    __syncthreads();

    // rope_interleaved on the trailing 2·half channels.
    float* out = entries + static_cast<u64>(k) * dim;
    const int tail = dim - 2 * half;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        if (c < tail) {
            out[c] = entry[c];
            continue;
        }
        int i = (c - tail) >> 1;
        float a = entry[tail + 2 * i];
        float b = entry[tail + 2 * i + 1];
        float cs = cos_table[static_cast<u64>(k) * half + i];
        float sn = sin_table[static_cast<u64>(k) * half + i];
        out[c] = ((c - tail) & 1) == 0 ? __fadd_rn(__fmul_rn(a, cs), -__fmul_rn(b, sn))
                                       : __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
    }
}

// The state after the chunk, in one block: with overlap and a window closed,
// the last closed window's first series (`[ratio, dim]`, gate plus its slot
// bias); then the tokens still open: with no window closed, the chunk's
// `len` rows appended after the `pending` held, else the last
// `pending + len - windows * ratio` rows of the chunk from pending row 0.
extern "C" __global__ void compressor_save(const float* kv, int kv_stride, const float* gate, int gate_stride, int len,
                                           float* pending_kv, float* pending_gate, int pending, float* overlap_kv,
                                           float* overlap_gate, const float* ape, int ratio, int dim, int overlap,
                                           int windows) {
    const int width = overlap ? 2 * dim : dim;
    if (overlap && windows > 0) {
        const int k = windows - 1;
        for (int idx = threadIdx.x; idx < ratio * dim; idx += blockDim.x) {
            int j = idx / dim;
            int c = idx - j * dim;
            const float* v = di_compressor_row(kv, kv_stride, pending_kv, pending, width, ratio, k, j);
            const float* g = di_compressor_row(gate, gate_stride, pending_gate, pending, width, ratio, k, j);
            overlap_kv[idx] = v[c];
            overlap_gate[idx] = __fadd_rn(g[c], ape[static_cast<u64>(j) * width + c]);
        }
    }
    // The pending rows just read may be overwritten below.
    __syncthreads();
    const int open = windows == 0 ? len : pending + len - windows * ratio;
    const int first = len - open;
    const int dst = windows == 0 ? pending : 0;
    for (int idx = threadIdx.x; idx < open * width; idx += blockDim.x) {
        int t = idx / width;
        int c = idx - t * width;
        pending_kv[static_cast<u64>(dst + t) * width + c] = kv[static_cast<u64>(first + t) * kv_stride + c];
        pending_gate[static_cast<u64>(dst + t) * width + c] = gate[static_cast<u64>(first + t) * gate_stride + c];
    }
}
