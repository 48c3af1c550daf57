// Fused softmax + cross-entropy (+ its gradient) per row, and the deterministic mean loss.
//
//   crossentropy_warp<GRAD>   one warp per row (small vocabularies)
//   crossentropy_block<GRAD>  one 256-thread block per row (large vocabularies)
//       losses[n] = logsumexp(logits[n, :Vr]) - logits[n, target[n]]
//       GRAD: dlogits[n, i] = (softmax(logits[n, :Vr])_i - [i == target[n]]) * grad_scale for i < Vr,
//             0 for Vr <= i < V (a padded vocabulary: rows V = Vr rounded up, masked out here)
//       dlogits may be logits: every element is read (and the target logit fetched) before
//       any element of the row is overwritten.
//   loss_reduce               st->loss = mean(losses), history[st->step] = it (one block)
//
// An out-of-range target (>= Vr) gives a NaN loss (and no one-hot term) instead of reading outside the row.
#include "common.cuh"

#define CE_WARPS 8
#define CE_THREADS (CE_WARPS * 32)
#define CE_LOWEST (-3.402823466e+38f)
#define LR_THREADS 1024

// Merge two (max, sum of exp(x - max)) pairs. Symmetric in its arguments, so both lanes of a
// butterfly exchange compute the same bits.
__device__ __forceinline__ void ce_merge(float& m, float& s, float mo, float so) {
    const float mn = fmaxf(m, mo);
    s = __fadd_rn(__fmul_rn(s, expf(m - mn)), __fmul_rn(so, expf(mo - mn)));   // no fma contraction
    m = mn;
}

__device__ __forceinline__ void ce_push(float& m, float& s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else {
        s += expf(v - m);
    }
}

// One row of the logits and its target; this thread's elements are first, first + STRIDE, ...
template <int STRIDE>
struct CeRow {
    const float* lr;     // logits[row, :]
    int tg;
    bool valid;          // 0 <= tg < Vr: an out-of-range target reads no logit
    float xt;            // logits[row, tg] (0 when not valid)
    float m, s;          // (max, sum of exp(x - max)): this thread's, then merged

    __device__ __forceinline__ CeRow(const float* logits, const int* __restrict__ targets, int row, int V, int Vr,
                                     int first)
        : lr(logits + (long long)row * V), tg(targets[row]), valid((unsigned)tg < (unsigned)Vr),
          xt(valid ? lr[tg] : 0.f), m(CE_LOWEST), s(0.f) {
        for (int i = first; i < Vr; i += STRIDE) ce_push(m, s, lr[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {      // merged over the warp
            const float mo = __shfl_xor_sync(0xffffffffu, m, o);
            const float so = __shfl_xor_sync(0xffffffffu, s, o);
            ce_merge(m, s, mo, so);
        }
    }

    __device__ __forceinline__ float loss() const { return valid ? (m + logf(s)) - xt : __int_as_float(0x7fc00000); }

    // dr [V] = (softmax - one-hot) * grad_scale, 0 past Vr; dr may be lr (each element is read before
    // it is written)
    __device__ __forceinline__ void grad(float* dr, int V, int Vr, float grad_scale, int first) const {
        const float rs = 1.0f / s;
        int i = first;
        for (; i < Vr; i += STRIDE) {
            const float p = expf(lr[i] - m) * rs;
            dr[i] = (p - (i == tg ? 1.0f : 0.0f)) * grad_scale;
        }
        for (; i < V; i += STRIDE) dr[i] = 0.0f;
    }
};

#define CE_ARGS                                                                           \
    float* __restrict__ losses,     /* losses  [N] */                                     \
    float* dlogits,                 /* dlogits [N, V] (GRAD only; may be logits) */       \
    const float* logits,            /* logits  [N, V] */                                  \
    const int* __restrict__ targets,/* targets [N] */                                     \
    int N, int V, int Vr, float grad_scale  /* V: row length; Vr <= V: the real vocabulary */

template <bool GRAD>
__global__ void __launch_bounds__(CE_THREADS) crossentropy_warp(CE_ARGS) {
    const int row = blockIdx.x * CE_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const CeRow<32> r(logits, targets, row, V, Vr, lane);
    if (lane == 0) losses[row] = r.loss();
    if constexpr (GRAD) {
        __syncwarp();                              // every lane's reads precede any write
        r.grad(dlogits + (long long)row * V, V, Vr, grad_scale, lane);
    }
}

template <bool GRAD>
__global__ void __launch_bounds__(CE_THREADS) crossentropy_block(CE_ARGS) {
    __shared__ float sm_m[CE_WARPS], sm_s[CE_WARPS];
    const int row = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    CeRow<CE_THREADS> r(logits, targets, row, V, Vr, threadIdx.x);
    if (lane == 0) { sm_m[warp] = r.m; sm_s[warp] = r.s; }
    __syncthreads();                               // also orders all reads before the writes
    r.m = sm_m[0];
    r.s = sm_s[0];
#pragma unroll
    for (int w = 1; w < CE_WARPS; ++w) ce_merge(r.m, r.s, sm_m[w], sm_s[w]);
    if (threadIdx.x == 0) losses[row] = r.loss();
    if constexpr (GRAD) r.grad(dlogits + (long long)row * V, V, Vr, grad_scale, threadIdx.x);
}

// One block: thread t sums losses t, t + 1024, ... in double, then a fixed tree.
__global__ void __launch_bounds__(LR_THREADS)
loss_reduce(StepState* st,
            const float* __restrict__ losses,   // losses  [N]
            int N,
            float* __restrict__ history,        // history [hist_len] (may be null)
            int hist_len) {
    __shared__ double red[LR_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < N; i += LR_THREADS) s += (double)losses[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = LR_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const float mean = (float)(red[0] / (double)N);
        st->loss = mean;
        const int step = st->step;
        if (history && step >= 0 && step < hist_len) history[step] = mean;
    }
}
