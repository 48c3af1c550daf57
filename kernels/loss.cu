// Fused softmax + cross-entropy (+ its gradient) per row, and the deterministic mean loss.
//
//   crossentropy_warp<GRAD>   one warp per row (small vocabularies)
//   crossentropy_block<GRAD>  one 256-thread block per row (large vocabularies)
//       losses[n] = logsumexp(logits[n]) - logits[n, target[n]]
//       GRAD: dlogits[n, i] = (softmax(logits[n])_i - [i == target[n]]) * grad_scale
//       dlogits may be logits: every element is read (and the target logit fetched) before
//       any element of the row is overwritten.
//   loss_reduce               st->loss = mean(losses), history[st->step] = it (one block)
//
// An out-of-range target gives a NaN loss (and no one-hot term) instead of reading outside the row.
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

template <bool GRAD>
__global__ void __launch_bounds__(CE_THREADS)
crossentropy_warp(float* __restrict__ losses,     // losses  [N]
                  float* dlogits,                 // dlogits [N, V] (GRAD only; may be logits)
                  const float* logits,            // logits  [N, V]
                  const int* __restrict__ targets,// targets [N]
                  int N, int V, float grad_scale) {
    const int row = blockIdx.x * CE_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const float* lr = logits + (long long)row * V;
    const int tg = targets[row];
    const bool valid = (unsigned)tg < (unsigned)V;
    const float xt = valid ? lr[tg] : 0.f;
    float m = CE_LOWEST, s = 0.f;
    for (int i = lane; i < V; i += 32) ce_push(m, s, lr[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o);
        const float so = __shfl_xor_sync(0xffffffffu, s, o);
        ce_merge(m, s, mo, so);
    }
    if (lane == 0) losses[row] = valid ? (m + logf(s)) - xt : __int_as_float(0x7fc00000);
    if constexpr (GRAD) {
        __syncwarp();                              // every lane's reads precede any write
        const float rs = 1.0f / s;
        float* dr = dlogits + (long long)row * V;
        for (int i = lane; i < V; i += 32) {
            const float p = expf(lr[i] - m) * rs;
            dr[i] = (p - (i == tg ? 1.0f : 0.0f)) * grad_scale;
        }
    }
}

template <bool GRAD>
__global__ void __launch_bounds__(CE_THREADS)
crossentropy_block(float* __restrict__ losses,     // losses  [N]
                   float* dlogits,                 // dlogits [N, V] (GRAD only; may be logits)
                   const float* logits,            // logits  [N, V]
                   const int* __restrict__ targets,// targets [N]
                   int N, int V, float grad_scale) {
    __shared__ float sm_m[CE_WARPS], sm_s[CE_WARPS];
    const int row = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* lr = logits + (long long)row * V;
    const int tg = targets[row];
    const bool valid = (unsigned)tg < (unsigned)V;
    const float xt = valid ? lr[tg] : 0.f;
    float m = CE_LOWEST, s = 0.f;
    for (int i = threadIdx.x; i < V; i += CE_THREADS) ce_push(m, s, lr[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, o);
        const float so = __shfl_xor_sync(0xffffffffu, s, o);
        ce_merge(m, s, mo, so);
    }
    if (lane == 0) { sm_m[warp] = m; sm_s[warp] = s; }
    __syncthreads();                               // also orders all reads before the writes
    m = sm_m[0];
    s = sm_s[0];
#pragma unroll
    for (int w = 1; w < CE_WARPS; ++w) ce_merge(m, s, sm_m[w], sm_s[w]);
    if (threadIdx.x == 0) losses[row] = valid ? (m + logf(s)) - xt : __int_as_float(0x7fc00000);
    if constexpr (GRAD) {
        const float rs = 1.0f / s;
        float* dr = dlogits + (long long)row * V;
        for (int i = threadIdx.x; i < V; i += CE_THREADS) {
            const float p = expf(lr[i] - m) * rs;
            dr[i] = (p - (i == tg ? 1.0f : 0.0f)) * grad_scale;
        }
    }
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
