// Elementwise ops: tanh-GELU forward/backward, dropout (forward, backward, fused residual add),
// the deterministic bias gradient (column sums) and the gradient accumulation dst (+)= src.
//
// Elementwise kernels take VEC = 4 (pointers aligned to 4 elements: 16 bytes of fp32, 8 of bf16; any
// n: thread i < n/4 handles the values 4i .. 4i + 3, the next n % 4 threads one tail element each) or
// VEC = 1 (one element a thread). Outputs may alias inputs of their element type: every thread reads
// its elements before writing them.
// Blocks are the launcher's (gptcuda/ops/cuda/elementwise.py): THREADS of an elementwise kernel,
// WARPS of the column sums, ITEMS of a sum_rows launch, all template arguments.
// Element types (bf16.cuh's codes, the last template arguments: 0 fp32, 1 bf16), one a tensor: the
// values are widened exactly, computed in fp32 and rounded once where stored in bf16. The column sums'
// partials and sum_rows are fp32.
#include "common.cuh"
#include "bf16.cuh"

#define GELU_K0 0.7978845608028654f   // sqrt(2/pi)
#define GELU_K1 0.044715f

__device__ __forceinline__ float gelu_f(float x) {
    const float u = GELU_K0 * (x + GELU_K1 * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float x2 = x * x;
    const float u = GELU_K0 * (x + GELU_K1 * x2 * x);
    const float th = tanhf(u);
    const float du = GELU_K0 * (1.0f + 3.0f * GELU_K1 * x2);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

// Element range of this thread: returns the count (VEC, 1 or 0) and the first element index.
template <int VEC, int THREADS>
__device__ __forceinline__ int ew_slot(long long n, long long& e) {
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if constexpr (VEC == 1) {
        e = i;
        return i < n ? 1 : 0;
    } else {
        const long long nv = n / VEC;
        if (i < nv) { e = i * VEC; return VEC; }
        e = nv * VEC + (i - nv);
        return e < n ? 1 : 0;
    }
}

template <int VEC, int THREADS, int TO, int TX>
__global__ void __launch_bounds__(THREADS)
gelu_fwd(elem<TO>* out,         // out [n]  (may be x)
         const elem<TX>* x,     // x   [n]
         int n) {
    long long e;
    const int cnt = ew_slot<VEC, THREADS>(n, e);
    if (cnt == 4) {
        float4 v = val_ldf4(x + e);
        v.x = gelu_f(v.x); v.y = gelu_f(v.y); v.z = gelu_f(v.z); v.w = gelu_f(v.w);
        val_stf4(out + e, v);
    } else if (cnt == 1) {
        val_st(out + e, gelu_f(val_ld(x + e)));
    }
}

template <int VEC, int THREADS, int TDP, int TDO, int TP>
__global__ void __launch_bounds__(THREADS)
gelu_bwd(elem<TDP>* dpre,       // dpre [n]  (may be dout)
         const elem<TDO>* dout, // dout [n]
         const elem<TP>* pre,   // pre  [n]  (the GELU input)
         int n) {
    long long e;
    const int cnt = ew_slot<VEC, THREADS>(n, e);
    if (cnt == 4) {
        const float4 d = val_ldf4(dout + e);
        const float4 p = val_ldf4(pre + e);
        val_stf4(dpre + e,
                 make_float4(d.x * gelu_grad(p.x), d.y * gelu_grad(p.y), d.z * gelu_grad(p.z), d.w * gelu_grad(p.w)));
    } else if (cnt == 1) {
        val_st(dpre + e, val_ld(dout + e) * gelu_grad(val_ld(pre + e)));
    }
}

// dst = src (FIRST) or dst = dst + src: the gradients of a step's micro-batches summed in
// micro-batch order (gradient accumulation). dst may not alias src.
template <int VEC, bool FIRST, int THREADS, int TD, int TS>
__global__ void __launch_bounds__(THREADS)
accumulate(elem<TD>* __restrict__ dst,        // dst [n]
           const elem<TS>* __restrict__ src,  // src [n]
           int n) {
    long long e;
    const int cnt = ew_slot<VEC, THREADS>(n, e);
    if (cnt == 4) {
        float4 v = val_ldf4(src + e);
        if constexpr (!FIRST) {
            const float4 d = val_ldf4(dst + e);
            v.x = d.x + v.x; v.y = d.y + v.y; v.z = d.z + v.z; v.w = d.w + v.w;
        }
        val_stf4(dst + e, v);
    } else if (cnt == 1) {
        val_st(dst + e, FIRST ? val_ld(src + e) : val_ld(dst + e) + val_ld(src + e));
    }
}

// out = (RESID ? resid : 0) + (DROP ? (keep(e) ? x * scale : 0) : x),
// keep(e): the mask is flat (common.cuh), element e takes half e & 1 of word e >> 1 of the stream
// gc_key(seed, st->step, site).
template <int VEC, bool RESID, bool DROP, int THREADS, int TO, int TR, int TX>
__global__ void __launch_bounds__(THREADS)
dropout_apply(elem<TO>* out,              // out   [n]  (may be x or resid)
              const elem<TR>* resid,      // resid [n]  (RESID only)
              const elem<TX>* x,          // x     [n]
              int n,
              const StepState* st,
              u32 seed, u32 site, u32 threshold, float scale) {
    long long e;
    const int cnt = ew_slot<VEC, THREADS>(n, e);
    if (cnt == 0) return;
    u32 k = 0;
    if constexpr (DROP) k = gc_key(seed, (u32)st->step, site);
    if (cnt == 4) {                                  // e % 4 == 0
        float4 y = val_ldf4(x + e);
        if constexpr (DROP) y = gc_dropout4(y, k, e, threshold, scale);
        if constexpr (RESID) {
            const float4 r = val_ldf4(resid + e);
            y = make_float4(r.x + y.x, r.y + y.y, r.z + y.z, r.w + y.w);
        }
        val_stf4(out + e, y);
    } else {
        float y = val_ld(x + e);
        if constexpr (DROP) y = gc_dropout1(y, k, e, threshold, scale);
        if constexpr (RESID) y = val_ld(resid + e) + y;
        val_st(out + e, y);
    }
}

// Bias gradient, pass 1. grid (ceil(N / (32*VEC)), chunks), block WARPS warps.
// Block (tile, ch) sums rows [ch*rpc, min(M, (ch+1)*rpc)) of its 32*VEC columns: warp w takes
// rows w, w + WARPS, ... of the chunk in order, then the WARPS warp sums are added in warp order.
template <int VEC, int WARPS, int TD>
__global__ void __launch_bounds__(WARPS * 32)
bias_grad_partial(float* __restrict__ partials,        // partials [chunks, N]
                  const elem<TD>* __restrict__ dout,   // dout     [M, N]
                  int M, int N, int rpc) {
    constexpr int TILE = 32 * VEC;
    __shared__ float red[WARPS][TILE];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.x * TILE + lane * VEC;
    const int r0 = blockIdx.y * rpc;
    const int r1 = min(M, r0 + rpc);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
    if (c < N) {
#pragma unroll 4
        for (int r = r0 + warp; r < r1; r += WARPS) {
            const auto* p = dout + (long long)r * N + c;
            if constexpr (VEC == 4) {
                const float4 v = val_ldf4(p);
                acc[0] += v.x; acc[1] += v.y; acc[2] += v.z; acc[3] += v.w;
            } else {
                acc[0] += val_ld(p);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) red[warp][lane * VEC + k] = acc[k];
    __syncthreads();
    for (int k = threadIdx.x; k < TILE; k += WARPS * 32) {
        const int col = blockIdx.x * TILE + k;
        if (col < N) {
            float s = red[0][k];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) s += red[w][k];
            partials[(long long)blockIdx.y * N + col] = s;
        }
    }
}

// Row sums of partials, pass 2 of the bias gradient and of the layernorm weight gradients, up to
// ITEMS of them in one launch: item i is out_i[c] = sum over r < rows_i of in_i[r * ld_i + c]
// (c < cols_i). Blocks first_i .. first_{i+1} - 1 take 32 columns each; warp w sums rows w, w + WARPS,
// ... of its lane's column, then the WARPS warp sums are added in warp order: a fixed order, the same
// for every batching of the items (elementwise.py sum_rows packs SumBatch<ITEMS>).
#define SR_BATCH 16      // rows a warp loads at once (a layernorm's 512 partial rows: 4 batches of a warp's 64)
template <int ITEMS>
struct SumBatch {
    unsigned long long out[ITEMS];       // elem<TO>* out_i [cols_i]  (=)
    unsigned long long in[ITEMS];        // const float* in_i [rows_i, ld_i]
    long long rows[ITEMS], cols[ITEMS], ld[ITEMS];
    long long first[ITEMS + 1];          // first block of each item; first[n] = the grid
};

// TO: the outputs' element type (0 fp32; 1 bf16, the fp32 sum rounded once: bf16 gradients), every item's.
template <int WARPS, int ITEMS, int TO = 0>
__global__ void __launch_bounds__(WARPS * 32) sum_rows(const __grid_constant__ SumBatch<ITEMS> b) {
    __shared__ float red[WARPS][32];
    int i = 0;
#pragma unroll
    for (int j = 1; j < ITEMS; ++j)
        if (blockIdx.x >= b.first[j]) i = j;             // first[] is non-decreasing; past n it is the grid
    const float* in = reinterpret_cast<const float*>(b.in[i]);
    const int rows = (int)b.rows[i], cols = (int)b.cols[i];
    const long long ld = b.ld[i];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int col = (int)(blockIdx.x - b.first[i]) * 32 + lane;
    float s = 0.f;
    if (col < cols) {
        // SR_BATCH rows' loads in flight at once, then added in row order (the same additions as one at a time)
        int g = warp;
        for (; g + (SR_BATCH - 1) * WARPS < rows; g += SR_BATCH * WARPS) {
            float v[SR_BATCH];
#pragma unroll
            for (int u = 0; u < SR_BATCH; ++u) v[u] = in[(long long)(g + u * WARPS) * ld + col];
#pragma unroll
            for (int u = 0; u < SR_BATCH; ++u) s += v[u];
        }
        for (; g < rows; g += WARPS) s += in[(long long)g * ld + col];
    }
    red[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && col < cols) {
        float t = red[0][lane];
#pragma unroll
        for (int k = 1; k < WARPS; ++k) t += red[k][lane];
        val_st(reinterpret_cast<elem<TO>*>(b.out[i]) + col, t);
    }
}
