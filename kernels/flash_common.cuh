// What every flash-attention kernel shares: the block's place in the grid, the dropout stream, the
// kernel arguments, base-2 constants, and the cp.async / tf32 primitives of the tensor-core kernels.
//
// Fused causal self-attention ("flash" attention): the T x T scores never reach global memory.
// Four implementations, one file each, with the same arguments, grids and results:
//   flash_simt.cu  flash_fwd, flash_bwd_dq, flash_bwd_dkv            fp32 FMAs (FFMA)
//   flash_tc.cu    flash_fwd_tc, flash_bwd_dq_tc, flash_bwd_dkv_tc   tf32 mma.sync (flash_tc.cuh)
//   flash_x3.cu    flash_fwd_x3, flash_bwd_dq_x3, flash_bwd_dkv_x3   fp32 as 3xTF32 mma.sync (flash_tc.cuh)
//   flash_wg.cu    flash_bwd_dkv_wg                                  tf32 dK/dV on warpgroup MMA (sm_90a)
// and flash_rowsum.cu's flash_rowsum_do (D of these implementations' backward; flash_bf16.cu's dQ kernel
// makes its own).
//
//   flash_fwd*       one block per (b*H + h, query tile); loops over the key tiles up to the diagonal
//                    (causality is the loop bound; only tiles that cross the diagonal are masked),
//                    online softmax (running max m and sum l per row, O rescaled when the max rises,
//                    divided by l once at the end). Reads q, k, v straight from qkv [B,T,3C], writes
//                    y [B,T,C] and lse [B,H,T] = m + log(l) (natural log of the scaled scores).
//   flash_rowsum_do  D[b,h,t] = sum_d dy * y over the head's columns (= rowsum(P * dP), also with dropout)
//   flash_bwd_dq*    one block per (b*H + h, query tile): P = exp(S*scale - lse) rebuilt per key tile,
//                    dS = P * (dP - D) * scale, dQ += dS K.
//   flash_bwd_dkv*   one block per (b*H + h, key tile): S^T = K Q^T computed directly, loops over the
//                    query tiles from the diagonal down: dV += Pd^T dO, dK += dS^T Q.
//   Grids are (B*H, tiles) with the tile index ordered by decreasing work, so the blocks start
//   longest first across all heads (the short diagonal-only blocks fill the tail).
//   No atomics: every output element is written by exactly one thread; deterministic.
//
// Dropout (DROP): the keep bit of probability (b,h,i,j) is gc_keep_att(gc_key(seed, step, site),
// r * gc_att_words(T), j, threshold), r = (b*H + h)*T + i: keys 2c, 2c + 1, 2c + 8, 2c + 9 of a 16-key
// block of a row share one keep word, a byte each (common.cuh), as in the unfused path and
// rng.attention_keep. The tensor-core kernels draw each word once (the forward and dQ: a thread's keys
// 2c, 2c + 1 of 8-key groups 2n and 2n + 1; dK / dV: keys g and g + 8 of a query, shared with the lane
// of key g ^ 1). The forward applies it to P before P V (the row sum l is of the undropped P); the
// backward uses Pd = P*keep/(1-p) for dV and dP = dPd*keep/(1-p) for dS (1/(1-p): inv_keep, the
// launcher's 1 / (1 - rng.attention_rate(p))).
// Exponentials run in base 2 (scores in units of log2 e); lse is stored in natural log.
//
// Geometry: gptcuda/ops/cuda/flash.py chooses each kernel's tiles (rows a block, the other
// side's tile, ring stages, which operands stay in registers) and its shared memory, and passes them
// as template arguments after <HS, DROP>: <..., THREADS, tile geometry..., SMEM bytes>. Each kernel
// static_asserts that THREADS is FA_THREADS and that SMEM is what its layout of those tiles takes
// (and traps at run time if launched with less).
#pragma once
#include "common.cuh"

#define FA_THREADS 128      // every flash kernel's block: 4 warps (one warpgroup)

// How blockIdx.y picks the block's tile of ROWS rows: REV, in reverse (gridDim.y-1-blockIdx.y), so
// that the longest blocks (the last query tiles, which see the most keys) of all heads start first;
// else in order (the first key tiles see the most queries).
template <int ROWS, bool REV> struct FaGridY {};

// One block's place in grids of (B*H, tiles): blockIdx.x = b*H + h. Rows of qkv [B,T,3C] hold q, k, v
// of all heads; head h's q, k and v columns start at h*HS, C + h*HS, 2C + h*HS.
template <int HS>
struct FaBlock {
    int T, C;                // sequence length, H * HS
    long long rs;            // row stride of qkv (and dqkv): 3C
    int bh, b, h;
    int r0;                  // first row of the block's tile (queries in fwd/dq, keys in dkv)
    long long bhT;           // bh * T: the head's row 0 in [B,H,T] (lse, D)
    const float* qb;         // q, k, v of (b, h) at t = 0
    const float* kb;
    const float* vb;

    // statements in the order the kernels had them before this fold: ptxas's schedule and register
    // allocation depend on it (the SASS stayed the same)
    template <int ROWS, bool REV>
    __device__ __forceinline__ FaBlock(const float* qkv, int T_, int H, FaGridY<ROWS, REV>) {
        T = T_;
        C = H * HS;
        rs = 3LL * C;
        int y;                                     // the tile (REV) or its first row
        if constexpr (REV) y = gridDim.y - 1 - blockIdx.y;
        else y = blockIdx.y * ROWS;
        bh = blockIdx.x, b = bh / H, h = bh - b * H;
        r0 = REV ? y * ROWS : y;
        bhT = (long long)bh * T;
        qb = qkv + (long long)b * T * rs + h * HS;
        kb = qb + C;
        vb = qb + 2 * C;
    }

    // q, k, v of the head's row t
    __device__ __forceinline__ const float* q(int t) const { return qb + t * rs; }
    __device__ __forceinline__ const float* k(int t) const { return kb + t * rs; }
    __device__ __forceinline__ const float* v(int t) const { return vb + t * rs; }
    // the head's columns of row t of a [B,T,3C] tensor (dqkv) / of a [B,T,C] tensor (y, dy)
    __device__ __forceinline__ float* row3(float* x, int t) const { return x + ((long long)b * T + t) * rs + h * HS; }
    template <class F>
    __device__ __forceinline__ F* row(F* x, int t) const { return x + ((long long)b * T + t) * C + h * HS; }
    // row(x, 0) formed as the dK/dV kernels form it (they add q0 * C per query tile)
    __device__ __forceinline__ const float* row0(const float* x) const { return x + (long long)b * T * C + h * HS; }
};

// the dropout stream of this step (unused, and st not read, without DROP)
template <bool DROP>
__device__ __forceinline__ u32 fa_drop_key(const StepState* __restrict__ st, u32 seed, u32 site) {
    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);
    return key;
}

#define FA_LN2 0.6931471805599453f

// arguments of the forward / backward kernels (and of the fp32 kernels' bodies)
#define FA_ARGS_FWD                                                                                  \
    float* __restrict__ y,               /* [B,T,C] */                                               \
    float* __restrict__ lse,             /* [B,H,T] log-sum-exp of the scaled scores */              \
    const float* __restrict__ qkv,       /* [B,T,3C] */                                              \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float inv_keep, float scale, \
    int T, int H

#define FA_ARGS_BWD                                                                                  \
    float* __restrict__ dqkv,            /* [B,T,3C] */                                              \
    const float* __restrict__ qkv,       /* [B,T,3C] */                                              \
    const float* __restrict__ dy,        /* [B,T,C] */                                               \
    const float* __restrict__ lse,       /* [B,H,T] */                                               \
    const float* __restrict__ Dg,        /* [B,H,T] rowsum(dy * y) */                                \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float inv_keep, float scale, \
    int T, int H

// ------------------------------------------------------------------------------- tensor-core primitives
// (flash_tc.cuh's kernels and flash_bwd_dkv_wg)

template <bool B> struct FaBool { static constexpr bool value = B; };


__device__ __forceinline__ u32 fa_smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// 16-byte async copy global -> shared; bytes = 0 zero-fills the destination (the source is not read)
__device__ __forceinline__ void fa_cp16(float* dst, const float* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(fa_smem_u32(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fa_cp4(float* dst, const float* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(fa_smem_u32(dst)), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fa_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fa_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// tf32 rounding for operands that only the tensor cores read: the mma ignores the low 13 mantissa
// bits of a tf32 operand (ptxas itself drops the mask of cvt.rna before an HMMA), so adding half a
// tf32 ulp is all that is left of round-to-nearest (ties away from zero, = cvt.rna.tf32.f32)
__device__ __forceinline__ u32 fa_tf32_mma(float x) { return __float_as_uint(x) + 0x1000u; }

// N floats by 4-byte cp.async, entries >= nvalid zero-filled; entry e belongs to thread FIRST + e
template <int N, int FIRST>
__device__ __forceinline__ void fa_cp_vec(float* dst, const float* src, int nvalid) {
    static_assert(FIRST + N <= FA_THREADS, "one entry per thread");
    const int e = threadIdx.x - FIRST;
    if (e >= 0 && e < N) fa_cp4(dst + e, e < nvalid ? src + e : src, e < nvalid ? 4 : 0);
}

