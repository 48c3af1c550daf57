// Fused softmax + cross-entropy (+ its gradient) per row, and the deterministic mean loss.
//
//   crossentropy_warp<GRAD, WARPS, TL>   one warp per row (small vocabularies), WARPS rows a block
//   crossentropy_block<GRAD, WARPS, TL>  one block of WARPS warps per row (large vocabularies; any V, any alignment)
//   crossentropy_rows<GRAD, NV4, WARPS, TL>  one block of T = 32 WARPS threads per row, the row held in
//       registers (V <= NV4 * 4T, V % 4 == 0, rows aligned to 4 elements: 16 bytes of fp32, 8 of bf16):
//       thread t holds the 4-value vectors j * T + t, j < NV4, so DRAM sees one read of the row (and one
//       write of its gradient) instead of two reads
//       losses[n] = logsumexp(logits[n, :Vr]) - logits[n, target[n]]
//       GRAD: dlogits[n, i] = (softmax(logits[n, :Vr])_i - [i == target[n]]) * grad_scale for i < Vr,
//             0 for Vr <= i < V (a padded vocabulary: rows V = Vr rounded up, masked out here)
//       dlogits may be logits: every element is read (and the target logit fetched) before
//       any element of the row is overwritten.
//   crossentropy_smem<GRAD, WARPS, TL = bf16>  crossentropy_rows' passes over the row copied into shared
//       memory (V % 8 == 0, rows 16-byte aligned): 2 V bytes a block, so two rows share an SM and one's
//       reductions run under the other's copies and stores (crossentropy_rows holds one row an SM)
//   loss_reduce<THREADS>      st->loss = mean(losses), history[st->step] = it (one block)
// The blocks (WARPS, THREADS) are template arguments, chosen in gptcuda/ops/cuda/loss.py. TL: the element
// type of logits and dlogits (bf16.cuh's codes: 0 fp32, 1 bf16); a bf16 logit is widened exactly, the
// softmax, the loss and every reduction are fp32, a bf16 gradient is rounded once where stored. losses
// are fp32.
//
// An out-of-range target (>= Vr) gives a NaN loss (and no one-hot term) instead of reading outside the row.
#include "common.cuh"
#include "bf16.cuh"

#define CE_LOWEST (-3.402823466e+38f)
#define CE_NEG_INF __int_as_float(0xff800000)

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

// logsumexp - the target's logit from (max, sum of exp(x - max)); NaN for an out-of-range target
__device__ __forceinline__ float ce_loss(bool valid, float m, float s, float xt) {
    return valid ? (m + logf(s)) - xt : __int_as_float(0x7fc00000);
}

// One row of the logits (of fp32 or bf16, T) and its target.
template <class T>
struct CeTarget {
    const T* lr;         // logits[row, :]
    int tg;
    bool valid;          // 0 <= tg < Vr: an out-of-range target reads no logit
    float xt;            // logits[row, tg] (0 when not valid)

    __device__ __forceinline__ CeTarget(const T* logits, const int* __restrict__ targets, int row, int V, int Vr)
        : lr(logits + (long long)row * V), tg(targets[row]), valid((unsigned)tg < (unsigned)Vr),
          xt(valid ? val_ld(lr + tg) : 0.f) {}
};

// CeTarget with this thread's elements first, first + STRIDE, ... pushed into its (max, sum)
template <int STRIDE, class T>
struct CeRow : CeTarget<T> {
    using CeTarget<T>::lr;
    using CeTarget<T>::tg;
    using CeTarget<T>::valid;
    using CeTarget<T>::xt;
    float m, s;          // (max, sum of exp(x - max)): this thread's, then merged

    __device__ __forceinline__ CeRow(const T* logits, const int* __restrict__ targets, int row, int V, int Vr,
                                     int first)
        : CeTarget<T>(logits, targets, row, V, Vr), m(CE_LOWEST), s(0.f) {
        for (int i = first; i < Vr; i += STRIDE) ce_push(m, s, val_ld(lr + i));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {      // merged over the warp
            const float mo = __shfl_xor_sync(0xffffffffu, m, o);
            const float so = __shfl_xor_sync(0xffffffffu, s, o);
            ce_merge(m, s, mo, so);
        }
    }

    __device__ __forceinline__ float loss() const { return ce_loss(valid, m, s, xt); }

    // dr [V] = (softmax - one-hot) * grad_scale, 0 past Vr; dr may be lr (each element is read before
    // it is written)
    __device__ __forceinline__ void grad(T* dr, int V, int Vr, float grad_scale, int first) const {
        const float rs = 1.0f / s;
        int i = first;
        for (; i < Vr; i += STRIDE) {
            const float p = expf(val_ld(lr + i) - m) * rs;
            val_st(dr + i, (p - (i == tg ? 1.0f : 0.0f)) * grad_scale);
        }
        for (; i < V; i += STRIDE) val_st(dr + i, 0.0f);
    }
};

#define CE_ARGS                                                                           \
    float* __restrict__ losses,     /* losses  [N] */                                     \
    elem<TL>* dlogits,              /* dlogits [N, V] (GRAD only; may be logits) */       \
    const elem<TL>* logits,         /* logits  [N, V] */                                  \
    const int* __restrict__ targets,/* targets [N] */                                     \
    int N, int V, int Vr, float grad_scale  /* V: row length; Vr <= V: the real vocabulary */

template <bool GRAD, int WARPS, int TL>
__global__ void __launch_bounds__(WARPS * 32) crossentropy_warp(CE_ARGS) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const CeRow<32, elem<TL>> r(logits, targets, row, V, Vr, lane);
    if (lane == 0) losses[row] = r.loss();
    if constexpr (GRAD) {
        __syncwarp();                              // every lane's reads precede any write
        r.grad(dlogits + (long long)row * V, V, Vr, grad_scale, lane);
    }
}

template <bool GRAD, int WARPS, int TL>
__global__ void __launch_bounds__(WARPS * 32) crossentropy_block(CE_ARGS) {
    __shared__ float sm_m[WARPS], sm_s[WARPS];
    const int row = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    CeRow<WARPS * 32, elem<TL>> r(logits, targets, row, V, Vr, threadIdx.x);
    if (lane == 0) { sm_m[warp] = r.m; sm_s[warp] = r.s; }
    __syncthreads();                               // also orders all reads before the writes
    r.m = sm_m[0];
    r.s = sm_s[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) ce_merge(r.m, r.s, sm_m[w], sm_s[w]);
    if (threadIdx.x == 0) losses[row] = r.loss();
    if constexpr (GRAD) r.grad(dlogits + (long long)row * V, V, Vr, grad_scale, threadIdx.x);
}

// v reduced over the block with op: warp butterflies (the same bits in every lane), then the warps'
// values in order 0..WARPS-1, read from sm (WARPS floats) after a block barrier: deterministic,
// and every thread returns the same value.
template <int WARPS, class Op>
__device__ __forceinline__ float cr_block_reduce(float v, float* sm, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sm[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) v = op(v, sm[w]);
    return v;
}

// The row in registers (fp32): x[j] = logits[row, 4v .. 4v + 3] for the vector v = j * CR_THREADS + t (none past V:
// V % 4 == 0, so a vector is wholly inside the row or wholly outside). Columns >= Vr are set to -inf, so
// they add nothing to the max and exp(-inf - max) = 0 to the sum. Pass 1: the block's max (no exp);
// pass 2: the sum of exp(x - max), kept in x for the gradient; pass 3 (GRAD): the gradient, 4 values a store.
// Both block reductions are cr_block_reduce's: deterministic.
// All reads of the row (the target logit first) precede the first __syncthreads, every write follows the
// second, so dlogits may be logits.
template <bool GRAD, int NV4, int WARPS, int TL>
__global__ void __launch_bounds__(WARPS * 32, 1) crossentropy_rows(CE_ARGS) {
    constexpr int CR_THREADS = WARPS * 32;
    __shared__ float sm_m[WARPS], sm_s[WARPS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const CeTarget<elem<TL>> r(logits, targets, row, V, Vr);
    const elem<TL>* lr = r.lr;
    const int tg = r.tg;
    const int V4 = V >> 2;
    const Pack4<TL>* l4 = reinterpret_cast<const Pack4<TL>*>(lr);

    float4 x[NV4];
#pragma unroll
    for (int j = 0; j < NV4; ++j) {
        const int v = j * CR_THREADS + t;
        float a[4] = {CE_NEG_INF, CE_NEG_INF, CE_NEG_INF, CE_NEG_INF};
        if (v < V4) val_ld4(reinterpret_cast<const elem<TL>*>(l4 + v), a);
        const int i = 4 * v;
        if (i + 3 >= Vr) {                          // padded columns (and vectors past V)
            if (i >= Vr) a[0] = CE_NEG_INF;
            if (i + 1 >= Vr) a[1] = CE_NEG_INF;
            if (i + 2 >= Vr) a[2] = CE_NEG_INF;
            a[3] = CE_NEG_INF;
        }
        x[j] = make_float4(a[0], a[1], a[2], a[3]);
    }

    // pass 1: max (its barrier also orders every read of the row before the writes)
    float m = CE_LOWEST;
#pragma unroll
    for (int j = 0; j < NV4; ++j) m = fmaxf(m, fmaxf(fmaxf(x[j].x, x[j].y), fmaxf(x[j].z, x[j].w)));
    m = cr_block_reduce<WARPS>(m, sm_m, [](float a, float b) { return fmaxf(a, b); });

    // pass 2: sum of exp(x - max), four partial sums per thread
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
    for (int j = 0; j < NV4; ++j) {
        float4 e;
        e.x = expf(x[j].x - m);
        e.y = expf(x[j].y - m);
        e.z = expf(x[j].z - m);
        e.w = expf(x[j].w - m);
        s0 += e.x;
        s1 += e.y;
        s2 += e.z;
        s3 += e.w;
        if constexpr (GRAD) x[j] = e;
    }
    const float s = cr_block_reduce<WARPS>((s0 + s1) + (s2 + s3), sm_s, [](float a, float b) { return a + b; });
    if (t == 0) losses[row] = ce_loss(r.valid, m, s, r.xt);

    if constexpr (GRAD) {                          // pass 3: (softmax - one-hot) * grad_scale, 0 past Vr
        const float rs = 1.0f / s;
        Pack4<TL>* d4 = reinterpret_cast<Pack4<TL>*>(dlogits + (long long)row * V);
#pragma unroll
        for (int j = 0; j < NV4; ++j) {
            const int v = j * CR_THREADS + t;
            if (v < V4) {
                const int i = 4 * v;
                float g[4];
                if (i + 3 < Vr && v != (tg >> 2)) {   // no mask, no target: (x - 0) s, the same bits as below
                    g[0] = x[j].x * rs * grad_scale;
                    g[1] = x[j].y * rs * grad_scale;
                    g[2] = x[j].z * rs * grad_scale;
                    g[3] = x[j].w * rs * grad_scale;
                } else {
                    g[0] = i < Vr ? (x[j].x * rs - (i == tg ? 1.0f : 0.0f)) * grad_scale : 0.0f;
                    g[1] = i + 1 < Vr ? (x[j].y * rs - (i + 1 == tg ? 1.0f : 0.0f)) * grad_scale : 0.0f;
                    g[2] = i + 2 < Vr ? (x[j].z * rs - (i + 2 == tg ? 1.0f : 0.0f)) * grad_scale : 0.0f;
                    g[3] = i + 3 < Vr ? (x[j].w * rs - (i + 3 == tg ? 1.0f : 0.0f)) * grad_scale : 0.0f;
                }
                val_st4(reinterpret_cast<elem<TL>*>(d4 + v), g);
            }
        }
    }
}

// crossentropy_smem: the row (bf16) copied into shared memory by cp.async, 16 bytes (8 columns) a copy,
// chunk v = t, t + T, ... of thread t; every pass reads its chunks from there, widened exactly, columns
// >= Vr as -inf. The passes are crossentropy_rows': the max, the sum of exp(x - max) (8 partial sums a
// thread), the gradient rounded once where stored (16 bytes a store), both block reductions
// cr_block_reduce's: deterministic. Every read of the row (its copies, waited for, and the target
// logit) precedes the first __syncthreads and every write follows the second: dlogits may be logits.
template <bool GRAD, int WARPS, int TL>
__global__ void __launch_bounds__(WARPS * 32, 2) crossentropy_smem(CE_ARGS) {
    static_assert(TL == 1, "bf16 rows (an fp32 row would leave one block an SM, as crossentropy_rows)");
    constexpr int T = WARPS * 32;
    extern __shared__ __align__(16) unsigned char ce_row[];
    __shared__ float sm_m[WARPS], sm_s[WARPS];
    const int row = blockIdx.x;
    const int t = threadIdx.x;
    const CeTarget<elem<TL>> r(logits, targets, row, V, Vr);
    const int V8 = V >> 3;
    const unsigned s0 = smem_u32(ce_row);
    for (int v = t; v < V8; v += T) cp_async16_full(s0 + 16 * v, r.lr + 8 * v);
    cp_async_commit();
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    const uint4* r8 = reinterpret_cast<const uint4*>(ce_row);
    const auto load8 = [&](int v, float (&f)[8]) {      // columns 8 v .. 8 v + 7, -inf from Vr on
        const uint4 u = r8[v];
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
        if (8 * v + 7 >= Vr) {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (8 * v + e >= Vr) f[e] = CE_NEG_INF;
        }
    };

    // pass 1: max (its barrier also orders every read of the row before the writes)
    float m = CE_LOWEST;
    for (int v = t; v < V8; v += T) {
        float f[8];
        load8(v, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) m = fmaxf(m, f[e]);
    }
    m = cr_block_reduce<WARPS>(m, sm_m, [](float a, float b) { return fmaxf(a, b); });

    // pass 2: sum of exp(x - max), 8 partial sums per thread added pairwise; exp(x - max) as
    // exp2(x log2 e - max log2 e): one FFMA and the MUFU's ex2 (expf's range reduction is ~6 more
    // instructions an element, and these passes are bound by issue)
    const float ml2 = m * GC_LOG2E;
    float ps[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int v = t; v < V8; v += T) {
        float f[8];
        load8(v, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ps[e] += gc_exp2(fmaf(f[e], GC_LOG2E, -ml2));
    }
    const float part = ((ps[0] + ps[1]) + (ps[2] + ps[3])) + ((ps[4] + ps[5]) + (ps[6] + ps[7]));
    const float s = cr_block_reduce<WARPS>(part, sm_s, [](float a, float b) { return a + b; });
    if (t == 0) losses[row] = ce_loss(r.valid, m, s, r.xt);

    if constexpr (GRAD) {                          // pass 3: (softmax - one-hot) * grad_scale, 0 past Vr
        const float rs = 1.0f / s;
        elem<TL>* dr = dlogits + (long long)row * V;
        for (int v = t; v < V8; v += T) {
            float f[8], g[8];
            load8(v, f);
            if (8 * v + 7 < Vr && v != (r.tg >> 3)) {   // no mask, no target: (x - 0) s, the same bits as below
#pragma unroll
                for (int e = 0; e < 8; ++e) g[e] = gc_exp2(fmaf(f[e], GC_LOG2E, -ml2)) * rs * grad_scale;
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const int i = 8 * v + e;
                    g[e] = i < Vr ? (gc_exp2(fmaf(f[e], GC_LOG2E, -ml2)) * rs - (i == r.tg ? 1.0f : 0.0f)) * grad_scale
                                  : 0.0f;
                }
            }
            val_st8(dr + 8 * v, g);
        }
    }
}

// One block: thread t sums losses t, t + THREADS, ... in double, then a fixed tree.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
loss_reduce(StepState* st,
            const float* __restrict__ losses,   // losses  [N]
            int N,
            float* __restrict__ history,        // history [hist_len] (may be null)
            int hist_len) {
    static_assert((THREADS & (THREADS - 1)) == 0, "the tree halves the block");
    __shared__ double red[THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < N; i += THREADS) s += (double)losses[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = THREADS / 2; o > 0; o >>= 1) {
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
