// Fused causal self-attention ("flash" attention): the T x T scores never reach global memory.
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
// Dropout (DROP): the keep bit of probability (b,h,i,j) is gc_keep(gc_key(seed, step, site), r * ceil(T/2),
// j, threshold), r = (b*H + h)*T + i: keys 2c and 2c + 1 of a row share one keep word (common.cuh), as
// in the unfused path and rng.dropout_mask(cols = T). The tensor-core kernels draw each word once.
// The forward applies it to P before P V (the row sum l is of the undropped P); the backward
// uses Pd = P*keep/(1-p) for dV and dP = dPd*keep/(1-p) for dS.
// Exponentials run in base 2 (scores in units of log2 e); lse is stored in natural log.
//
// Two implementations:
//   flash_fwd, flash_bwd_dq, flash_bwd_dkv (fp32)     FaSimt policy, fp32 FMAs: 128 threads =
//           16 row groups x 8 column groups; a thread owns RM rows (g*RM + rr) and RN columns
//           (c + 8*jj) of a tile product; P goes through a per-warp slice of shared memory for P V.
//           64-row tiles (queries in fwd/dq, keys in dkv), synchronous tile loads; shared-memory
//           tiles are row-major with a row stride of HS+4 floats (conflict-free for its patterns).
//   flash_fwd_tc, flash_bwd_dq_tc, flash_bwd_dkv_tc (tf32)   mma.sync.m16n8k8 tensor cores: 4 warps
//           of 32 rows (16 for head size 128), streamed tiles through a 2-3 stage cp.async ring,
//           ldmatrix fragments, resident operands in registers where they fit; see the
//           "TF32 tensor cores" section below for the tile plan of each kernel.
//   flash_fwd_x3, flash_bwd_dq_x3, flash_bwd_dkv_x3 (fp32 as 3xTF32, the fp32 precision's path where
//           its GEMMs run as 3xTF32)   the _tc kernels' bodies (X3 = true) with every product as three
//           TF32 mma of hi / lo splits made at fragment load (see "3xTF32 helpers"); the split
//           fragments take twice the registers: 16 rows a warp from head size 64 (32 at 32), key
//           tiles of 32 in fwd (16 at head size 128), and the resident operands split from shared
//           memory per tile (Q and dO in dQ, K and V in dK/dV, Q in fwd at head size 128; Q's
//           fragments stay in registers in fwd up to head size 64).
//   flash_bwd_dkv_wg (tf32, sm_90a)   dK/dV on warpgroup MMA, head sizes up to 64 (see its section).
#include "common.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

#define FA_THREADS 128
#define FA_BR 64            // rows of a block's tile (queries in fwd/dq, keys in dkv)

// ------------------------------------------------------------------------------- helpers

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

// ROWS x HS tile, global row-major with row stride `stride` floats, into shared memory with row
// stride HS+4; rows >= nvalid are zero-filled (so masked products stay finite).
template <int ROWS, int HS>
__device__ __forceinline__ void fa_load_tile(float* __restrict__ dst, const float* __restrict__ src,
                                             long long stride, int nvalid) {
    constexpr int V = HS / 4;
    for (int e = threadIdx.x; e < ROWS * V; e += FA_THREADS) {
        int r = e / V;
        int c = (e - r * V) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nvalid) v = __ldg(reinterpret_cast<const float4*>(src + r * stride + c));
        *reinterpret_cast<float4*>(dst + r * (HS + 4) + c) = v;
    }
}

// the ROWS x HS tiles of K and V from key row k0 of the block's head
template <int ROWS, int HS>
__device__ __forceinline__ void fa_load_kv(float* Ks, float* Vs, const FaBlock<HS>& fb, int k0) {
    fa_load_tile<ROWS, HS>(Ks, fb.k(k0), fb.rs, fb.T - k0);
    fa_load_tile<ROWS, HS>(Vs, fb.v(k0), fb.rs, fb.T - k0);
}

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

// ------------------------------------------------------------------------------- policies

template <int BR, int BC>
struct FaSimt {
    static_assert(BR % 16 == 0 && BC % 8 == 0, "tile");
    static constexpr int RM = BR / 16;
    static constexpr int RN = BC / 8;
    static constexpr bool USES_PBUF = true;
    static constexpr int OCDIV = 8;     // accumulator columns of a PV row: HS / OCDIV

    __device__ static int row(int rr) { return (threadIdx.x >> 3) * RM + rr; }
    __device__ static int col(int jj) { return (threadIdx.x & 7) + 8 * jj; }
    __device__ static bool leader() { return (threadIdx.x & 7) == 0; }
    __device__ static float rmax(float x) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
        return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    }
    __device__ static float rsum(float x) {
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        x += __shfl_xor_sync(0xffffffffu, x, 2);
        return x + __shfl_xor_sync(0xffffffffu, x, 4);
    }

    // acc[rr][jj] += sum_k A[row(rr)][k] * B[col(jj)][k]; A: BR x HS, B: BC x HS (smem, stride HS+4)
    template <int HS>
    __device__ static void abt(float (&acc)[RM][RN], const float* __restrict__ A, const float* __restrict__ B) {
        constexpr int LD = HS + 4;
        const float* a = A + (threadIdx.x >> 3) * RM * LD;
        const float* b = B + (threadIdx.x & 7) * LD;
#pragma unroll 2
        for (int k = 0; k < HS; k += 4) {
            float4 av[RM];
#pragma unroll
            for (int rr = 0; rr < RM; ++rr) av[rr] = *reinterpret_cast<const float4*>(a + rr * LD + k);
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                float4 bv = *reinterpret_cast<const float4*>(b + 8 * jj * LD + k);
#pragma unroll
                for (int rr = 0; rr < RM; ++rr) {
                    float s = acc[rr][jj];
                    s = fmaf(av[rr].x, bv.x, s);
                    s = fmaf(av[rr].y, bv.y, s);
                    s = fmaf(av[rr].z, bv.z, s);
                    s = fmaf(av[rr].w, bv.w, s);
                    acc[rr][jj] = s;
                }
            }
        }
    }

    // s = A1 B1^T and dp = A2 B2^T, from zero (the two score products of the backward kernels)
    template <int HS>
    __device__ __forceinline__ static void abt2(float (&s)[RM][RN], float (&dp)[RM][RN], const float* __restrict__ A1,
                                                const float* __restrict__ B1, const float* __restrict__ A2,
                                                const float* __restrict__ B2) {
#pragma unroll
        for (int rr = 0; rr < RM; ++rr)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[rr][jj] = dp[rr][jj] = 0.f;
        abt<HS>(s, A1, B1);
        abt<HS>(dp, A2, B2);
    }

    // acc[rr][o] += sum_j P[row(rr)][j] * V[j][ocol(o)]; P is this thread's part of a BR x BC tile,
    // staged through pbuf (BR x (BC+4), each warp only touches its own rows); V: BC x HS (stride HS+4)
    template <int HS>
    __device__ static void pv(float (&acc)[RM][HS / 8], const float (&p)[RM][RN], float* __restrict__ pbuf,
                              const float* __restrict__ V) {
        constexpr int LDP = BC + 4, LD = HS + 4;
        const int g = threadIdx.x >> 3, c = threadIdx.x & 7;
        __syncwarp();
#pragma unroll
        for (int rr = 0; rr < RM; ++rr)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) pbuf[(g * RM + rr) * LDP + c + 8 * jj] = p[rr][jj];
        __syncwarp();
        const float* prow = pbuf + g * RM * LDP;
        const float* vcol = V + c * 4;
#pragma unroll 2
        for (int j = 0; j < BC; j += 4) {
            float4 pr[RM];
#pragma unroll
            for (int rr = 0; rr < RM; ++rr) pr[rr] = *reinterpret_cast<const float4*>(prow + rr * LDP + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                for (int t = 0; t < HS / 32; ++t) {
                    float4 v = *reinterpret_cast<const float4*>(vcol + (j + jj) * LD + 32 * t);
#pragma unroll
                    for (int rr = 0; rr < RM; ++rr) {
                        float pj = jj == 0 ? pr[rr].x : jj == 1 ? pr[rr].y : jj == 2 ? pr[rr].z : pr[rr].w;
                        acc[rr][4 * t + 0] = fmaf(pj, v.x, acc[rr][4 * t + 0]);
                        acc[rr][4 * t + 1] = fmaf(pj, v.y, acc[rr][4 * t + 1]);
                        acc[rr][4 * t + 2] = fmaf(pj, v.z, acc[rr][4 * t + 2]);
                        acc[rr][4 * t + 3] = fmaf(pj, v.w, acc[rr][4 * t + 3]);
                    }
                }
            }
        }
    }

    // dst[ocol(o)] = acc[o] * s for one row (columns c*4 + 32t + e: float4 stores)
    template <int HS>
    __device__ static void store_row(float* __restrict__ dst, const float (&acc)[HS / 8], float s) {
        const int c = threadIdx.x & 7;
#pragma unroll
        for (int t = 0; t < HS / 32; ++t)
            *reinterpret_cast<float4*>(dst + c * 4 + 32 * t) =
                make_float4(acc[4 * t] * s, acc[4 * t + 1] * s, acc[4 * t + 2] * s, acc[4 * t + 3] * s);
    }
};

// key-tile width of the forward and dQ kernels, query-tile width of the dK/dV kernel
template <int HS> struct FaTiles {
    static constexpr int BKF = HS >= 128 ? 32 : 64;
    static constexpr int BQB = 32;
};

// shared memory (floats) of each kernel; the launcher mirrors these formulas
template <int HS, bool PBUF> struct FaSmem {
    static constexpr int LD = HS + 4;
    static constexpr int BKF = FaTiles<HS>::BKF, BQB = FaTiles<HS>::BQB;
    static constexpr int fwd = (FA_BR + 2 * BKF) * LD + (PBUF ? FA_BR * (BKF + 4) : 0);
    static constexpr int dq = (2 * FA_BR + 2 * BKF) * LD + (PBUF ? FA_BR * (BKF + 4) : 0);
    static constexpr int dkv = (2 * FA_BR + 2 * BQB) * LD + 2 * BQB + (PBUF ? FA_BR * (BQB + 4) : 0);
};

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

// ------------------------------------------------------------------------------- forward

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_fwd_body(FA_ARGS_FWD) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BKF, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSmem<HS, P::USES_PBUF>::fwd * 4);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* Ks = Qs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const float ninf = __int_as_float(0xff800000);
    const float sl2 = scale * FA_LOG2E;

    fa_load_tile<BR, HS>(Qs, fb.q(q0), fb.rs, T - q0);

    float m[RM], l[RM], o[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        m[rr] = ninf;
        l[rr] = 0.f;
        rbase[rr] = (u32)(bh * T + q0 + P::row(rr)) * (u32)((T + 1) / 2);
#pragma unroll
        for (int e = 0; e < OC; ++e) o[rr][e] = 0.f;
    }
    const u32 key = fa_drop_key<DROP>(st, seed, site);

    const int qlast = min(q0 + BR, T) - 1;             // keys beyond the last query row are never visited
    for (int k0 = 0; k0 <= qlast; k0 += BC) {
        __syncthreads();
        fa_load_kv<BC, HS>(Ks, Vs, fb, k0);
        __syncthreads();

        float s[RM][RN];
#pragma unroll
        for (int rr = 0; rr < RM; ++rr)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[rr][jj] = 0.f;
        P::template abt<HS>(s, Qs, Ks);

        const bool edge = k0 + BC - 1 > q0 || k0 + BC > T;  // tile crosses the diagonal or the end
#pragma unroll
        for (int rr = 0; rr < RM; ++rr) {
            const int i = q0 + P::row(rr);
            float mx = ninf;
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int j = k0 + P::col(jj);
                float v = s[rr][jj] * sl2;           // log2 units: exp(x) = exp2(x * log2 e)
                if (edge && (j > i || j >= T)) v = ninf;
                s[rr][jj] = v;
                mx = fmaxf(mx, v);
            }
            mx = P::rmax(mx);
            const float mnew = fmaxf(m[rr], mx);      // finite: key 0 is visible to every row
            const float alpha = exp2f(m[rr] - mnew);  // 0 on the first tile (m = -inf)
            m[rr] = mnew;
            float rowsum = 0.f;
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                float pe = exp2f(s[rr][jj] - mnew);
                rowsum += pe;
                if (DROP) pe = gc_keep(key, rbase[rr], (u32)(k0 + P::col(jj)), threshold) ? pe * inv_keep : 0.f;
                s[rr][jj] = pe;
            }
            l[rr] = l[rr] * alpha + rowsum;           // thread-partial sum, reduced once at the end
#pragma unroll
            for (int e = 0; e < OC; ++e) o[rr][e] *= alpha;
        }
        P::template pv<HS>(o, s, Pb, Vs);
    }

#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const float L = P::rsum(l[rr]);
        const int i = q0 + P::row(rr);
        if (i < T) {
            P::template store_row<HS>(fb.row(y, i), o[rr], 1.f / L);
            if (P::leader()) lse[(long long)bh * T + i] = m[rr] * FA_LN2 + logf(L);
        }
    }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd(FA_ARGS_FWD) {
    fa_fwd_body<FaSimt<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- D = rowsum(dO * O)

// Row r = (b*T + t)*H + h of dy and y, [B,T,C] with C = H*HS, is the HS contiguous floats at r*HS:
// G = HS/4 lanes take a row, one float4 of each tensor a lane (dy, y 16-byte aligned: the launcher
// checks), a fixed fmaf chain, then an xor butterfly over the G lanes (32 / G rows a warp, one load
// of each tensor in flight per thread: the whole grid keeps the DRAM busy; one warp a row with
// 2 floats a lane reached half the bandwidth).
template <int HS>
__global__ void __launch_bounds__(256)
flash_rowsum_do(float* __restrict__ D,          // [B,H,T]
                const float* __restrict__ dy,   // [B,T,C]
                const float* __restrict__ y,    // [B,T,C]
                int rows, int T, int H) {
    constexpr int G = HS / 4;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a power-of-two lane group within a warp");
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gid / G;
    const int q = (int)(gid % G);
    float acc = 0.f;
    if (r < rows) {
        const float4 a = *reinterpret_cast<const float4*>(dy + r * HS + 4 * q);
        const float4 b = *reinterpret_cast<const float4*>(y + r * HS + 4 * q);
        acc = fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
    }
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (q == 0 && r < rows) {
        const int h = (int)(r % H);
        const long long bt = r / H;
        const int t = (int)(bt % T);
        const long long b = bt / T;
        D[(b * H + h) * T + t] = acc;
    }
}

// ------------------------------------------------------------------------------- backward: dQ

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dq_body(FA_ARGS_BWD) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BKF, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSmem<HS, P::USES_PBUF>::dq * 4);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* dOs = Qs + BR * LD;
    float* Ks = dOs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const float sl2 = scale * FA_LOG2E;

    fa_load_tile<BR, HS>(Qs, fb.q(q0), fb.rs, T - q0);
    fa_load_tile<BR, HS>(dOs, fb.row(dy, q0), fb.C, T - q0);

    float lr[RM], dr[RM], dq[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int i = q0 + P::row(rr);
        lr[rr] = i < T ? lse[(long long)bh * T + i] * FA_LOG2E : 0.f;     // log2 units
        dr[rr] = i < T ? Dg[(long long)bh * T + i] : 0.f;
        rbase[rr] = (u32)(bh * T + i) * (u32)((T + 1) / 2);
#pragma unroll
        for (int e = 0; e < OC; ++e) dq[rr][e] = 0.f;
    }
    const u32 key = fa_drop_key<DROP>(st, seed, site);

    const int qlast = min(q0 + BR, T) - 1;
    for (int k0 = 0; k0 <= qlast; k0 += BC) {
        __syncthreads();
        fa_load_kv<BC, HS>(Ks, Vs, fb, k0);
        __syncthreads();

        float s[RM][RN], dp[RM][RN];
        P::template abt2<HS>(s, dp, Qs, Ks, dOs, Vs);

#pragma unroll
        for (int rr = 0; rr < RM; ++rr) {
            const int i = q0 + P::row(rr);
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int j = k0 + P::col(jj);
                const bool valid = j <= i && j < T && i < T;
                const float pe = valid ? exp2f(fmaf(s[rr][jj], sl2, -lr[rr])) : 0.f;
                float g = dp[rr][jj];
                if (DROP) g = gc_keep(key, rbase[rr], (u32)j, threshold) ? g * inv_keep : 0.f;
                s[rr][jj] = pe * (g - dr[rr]) * scale;
            }
        }
        P::template pv<HS>(dq, s, Pb, Ks);
    }

#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int i = q0 + P::row(rr);
        if (i < T) P::template store_row<HS>(fb.row3(dqkv, i), dq[rr], 1.f);
    }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dq(FA_ARGS_BWD) {
    fa_dq_body<FaSimt<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                          inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- backward: dK, dV

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dkv_body(FA_ARGS_BWD) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BQB, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSmem<HS, P::USES_PBUF>::dkv * 4);
    extern __shared__ float4 fa_smem4[];
    float* Ks = reinterpret_cast<float*>(fa_smem4);
    float* Vs = Ks + BR * LD;
    float* Qs = Vs + BR * LD;
    float* dOs = Qs + BC * LD;
    float* Ls = dOs + BC * LD;
    float* Ds = Ls + BC;
    float* Pb = Ds + BC;

    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, false>());
    const int bh = fb.bh, k0 = fb.r0;
    const float* dob = fb.row0(dy);
    const float sl2 = scale * FA_LOG2E;

    fa_load_kv<BR, HS>(Ks, Vs, fb, k0);

    float dk[RM][OC], dv[RM][OC];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr)
#pragma unroll
        for (int e = 0; e < OC; ++e) dk[rr][e] = dv[rr][e] = 0.f;
    const u32 key = fa_drop_key<DROP>(st, seed, site);

    for (int q0 = (k0 / BC) * BC; q0 < T; q0 += BC) {  // query tiles from the diagonal to the end
        __syncthreads();
        fa_load_tile<BC, HS>(Qs, fb.q(q0), fb.rs, T - q0);
        fa_load_tile<BC, HS>(dOs, dob + (long long)q0 * fb.C, fb.C, T - q0);
        for (int e = threadIdx.x; e < BC; e += FA_THREADS) {
            const int i = q0 + e;
            Ls[e] = i < T ? lse[(long long)bh * T + i] * FA_LOG2E : 0.f;     // log2 units
            Ds[e] = i < T ? Dg[(long long)bh * T + i] : 0.f;
        }
        __syncthreads();

        float s[RM][RN], dp[RM][RN];                   // S^T and dPd^T: rows keys, columns queries
        P::template abt2<HS>(s, dp, Ks, Qs, Vs, dOs);

#pragma unroll
        for (int rr = 0; rr < RM; ++rr) {
            const int j = k0 + P::row(rr);
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int cq = P::col(jj);
                const int i = q0 + cq;
                const bool valid = j <= i && i < T && j < T;
                const float pe = valid ? exp2f(fmaf(s[rr][jj], sl2, -Ls[cq])) : 0.f;
                float g = dp[rr][jj];
                float pd = pe;
                if (DROP) {
                    const bool kp = gc_keep(key, (u32)(bh * T + i) * (u32)((T + 1) / 2), (u32)j, threshold);
                    g = kp ? g * inv_keep : 0.f;
                    pd = kp ? pe * inv_keep : 0.f;
                }
                s[rr][jj] = pd;
                dp[rr][jj] = pe * (g - Ds[cq]) * scale;
            }
        }
        P::template pv<HS>(dv, s, Pb, dOs);            // dV += Pd^T dO
        P::template pv<HS>(dk, dp, Pb, Qs);            // dK += dS^T Q
    }

#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int j = k0 + P::row(rr);
        if (j < T) {
            float* row = fb.row3(dqkv, j);
            P::template store_row<HS>(row + fb.C, dk[rr], 1.f);
            P::template store_row<HS>(row + 2 * fb.C, dv[rr], 1.f);
        }
    }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkv(FA_ARGS_BWD) {
    fa_dkv_body<FaSimt<FA_BR, FaTiles<HS>::BQB>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                           inv_keep, scale, T, H);
}


// =============================================================================== TF32 tensor cores
//
// mma.sync.m16n8k8 (tf32 in, f32 accumulate), fragments as in the PTX ISA (g = lane/4, t = lane%4):
//   A 16x8 row: a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B 8x8 col:  b0 = B[t][g], b1 = B[t+4][g]
//   C 16x8:     c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
// Shared-memory tiles are row-major with a row stride of LD = HS+4 floats (16-byte aligned rows).
// * A tile [n][k] is a ready B operand of X * tile^T: one ldmatrix.x4 (four b16 8x8 matrices = four
//   blocks of 8 rows x 4 floats) hands a lane b0/b1 of two consecutive k-steps; the same instruction
//   loads A fragments (a0..a3). Conflict-free: 8 rows of 16 bytes at LD = 4 mod 32.
// * Products whose A operand is an accumulator (P V, dS K, P^T dO, dS^T Q) permute the k index
//   (k = t <-> column 2t, k = t+4 <-> column 2t+1): the accumulator registers are the A fragment as
//   they are, and the B operand is tile[2t][g], tile[2t+1][g] (scalar loads, conflict-free).
// * The first k-step of a score product takes its C operand from a per-row / per-column offset, so
//   the tensor cores return S - m (fwd), S - lse (dQ, dK/dV) and dP - D directly.
// Streamed tiles go through a ring of NS (2 or 3) cp.async stages with one __syncthreads per tile:
// at step j the block waits for tile j, syncs (so everyone is also done with tile j-1), then issues
// tile j+NS-1 into the stage tile j-1 used. After its copies land, each thread rounds its own
// 16-byte chunks to tf32 in place (applying a scale where one is folded in), so the mma loops only
// load (the 3xTF32 kernels only scale Q there and split every operand at fragment load). The softmax scale
// times log2 e is folded into Q (rounded once, the same way in all three kernels, so the backward's
// P is consistent with the forward's lse): scores come out in log2 units and exponentials are
// single ex2.approx.ftz instructions.
// A warp owns MT m16 tiles of rows (queries in fwd / dQ, keys in dK/dV): every B fragment loaded
// from shared memory feeds MT mma. Warps that cannot see a tile (causality) skip its math; only
// tiles reaching past a warp's first row take the masking path (a separate instantiation).

#define FA_TC_THREADS 128
#define FA_RESCALE_LOG2 8.f   // fwd: O and l move to a new row max only when it grows by > 2^8

template <bool B> struct FaBool { static constexpr bool value = B; };

__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// d += a * b on a 16x8x8 tile (row.col, tf32 inputs, f32 accumulate)
__device__ __forceinline__ void fa_mma4(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// d = a * b + c
__device__ __forceinline__ void fa_mma4c(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1, const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

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

// four 8x8 b16 matrices (= 8 rows x 4 floats each); lane l gives the row address of matrix l/8, row l%8
__device__ __forceinline__ void fa_ldsm4(u32 (&r)[4], const float* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(fa_smem_u32(p)));
}

// lane's row address for A fragments (16 rows x 8 k) of a row-major tile: a0..a3 in one ldmatrix.x4
template <int LD>
__device__ __forceinline__ const float* fa_a_lane(const float* base) {
    const int lane = threadIdx.x & 31;
    return base + ((lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 4 * (lane >> 4);
}
// lane's row address for B fragments of two k-steps (8 rows x 16 k): {b0, b1} of k-step 2kp, 2kp+1
template <int LD>
__device__ __forceinline__ const float* fa_b_lane(const float* base) {
    const int lane = threadIdx.x & 31;
    return base + (lane & 7) * LD + 4 * (lane >> 3);
}

// ROWS x HS floats (global row stride `stride`) -> shared (row stride HS+4) by cp.async; rows >= nvalid
// (nvalid >= 1) are zero-filled. Thread x owns the 16-byte chunks (x / V + it * RPI, x % V).
template <int ROWS, int HS>
__device__ __forceinline__ void fa_cp_tile(float* __restrict__ dst, const float* __restrict__ src,
                                           long long stride, int nvalid) {
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_TC_THREADS / V, N = ROWS / RPI;
    static_assert(FA_TC_THREADS % V == 0 && ROWS % RPI == 0, "tile chunks");
    const int r0 = threadIdx.x / V, c = (threadIdx.x % V) * 4;
    float* d = dst + r0 * LD + c;
    const float* s = src + r0 * stride + c;
    if (nvalid >= ROWS) {
#pragma unroll
        for (int it = 0; it < N; ++it) fa_cp16(d + it * RPI * LD, s + it * RPI * stride, 16);
    } else {
#pragma unroll
        for (int it = 0; it < N; ++it) {
            const bool ok = r0 + it * RPI < nvalid;
            fa_cp16(d + it * RPI * LD, ok ? s + it * RPI * stride : src, ok ? 16 : 0);
        }
    }
}

// cp.async of the ROWS x HS tiles of K (to dst) and V (to dst + ROWS*LD) from key row k0 of the head
template <int ROWS, int HS>
__device__ __forceinline__ void fa_cp_kv(float* dst, const FaBlock<HS>& fb, int k0) {
    fa_cp_tile<ROWS, HS>(dst, fb.k(k0), fb.rs, fb.T - k0);
    fa_cp_tile<ROWS, HS>(dst + ROWS * (HS + 4), fb.v(k0), fb.rs, fb.T - k0);
}

// tf32 rounding for operands that only the tensor cores read: the mma ignores the low 13 mantissa
// bits of a tf32 operand (ptxas itself drops the mask of cvt.rna before an HMMA), so adding half a
// tf32 ulp is all that is left of round-to-nearest (ties away from zero, = cvt.rna.tf32.f32)
__device__ __forceinline__ u32 fa_tf32_mma(float x) { return __float_as_uint(x) + 0x1000u; }

// the same thread's chunks of a landed tile: x -> tf32(x * mul) (SCALE) or tf32(x) in place, in the
// mma-only form of fa_tf32_mma (every tile that goes through here is read by mma only)
template <int ROWS, int HS, bool SCALE>
__device__ __forceinline__ void fa_round_tile(float* dst, float mul) {
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_TC_THREADS / V, N = ROWS / RPI;
    float* d = dst + (threadIdx.x / V) * LD + (threadIdx.x % V) * 4;
#pragma unroll
    for (int it = 0; it < N; ++it) {
        float4* p = reinterpret_cast<float4*>(d + it * RPI * LD);
        float4 v = *p;
        if (SCALE) { v.x *= mul; v.y *= mul; v.z *= mul; v.w *= mul; }
        v.x = __uint_as_float(fa_tf32_mma(v.x));
        v.y = __uint_as_float(fa_tf32_mma(v.y));
        v.z = __uint_as_float(fa_tf32_mma(v.z));
        v.w = __uint_as_float(fa_tf32_mma(v.w));
        *p = v;
    }
}

// N floats by 4-byte cp.async, entries >= nvalid zero-filled; entry e belongs to thread FIRST + e
template <int N, int FIRST>
__device__ __forceinline__ void fa_cp_vec(float* dst, const float* src, int nvalid) {
    static_assert(FIRST + N <= FA_TC_THREADS, "one entry per thread");
    const int e = threadIdx.x - FIRST;
    if (e >= 0 && e < N) fa_cp4(dst + e, e < nvalid ? src + e : src, e < nvalid ? 4 : 0);
}

// acc[mt][nt] (16 x 8 each) = A[mt] (16 x 8*KS) * Bt^T + c[mt][nt], Bt = NT*8 rows x 8*KS (shared,
// row stride LD). A fragments come from registers (AREG: af[mt][ks]) or by ldmatrix from `a` (lane
// address from fa_a_lane, m-tile mt at + 16*mt*LD); `b` is the lane address from fa_b_lane.
template <int MT, int NT, int KS, int LD, bool AREG, int AKS>
__device__ __forceinline__ void fa_mma_abt(float (&acc)[MT][NT][4], const float (&c)[MT][NT][4],
                                           const u32 (&af)[MT][AKS][4], const float* a, const float* b) {
    static_assert(!AREG || AKS == KS, "register A fragments cover every k-step");
#pragma unroll
    for (int kp = 0; kp < KS / 2; ++kp) {
        u32 a0[MT][4], a1[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if constexpr (AREG) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    a0[mt][r] = af[mt][2 * kp][r];
                    a1[mt][r] = af[mt][2 * kp + 1][r];
                }
            } else {
                fa_ldsm4(a0[mt], a + mt * 16 * LD + 16 * kp);
                fa_ldsm4(a1[mt], a + mt * 16 * LD + 16 * kp + 8);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            u32 bb[4];
            fa_ldsm4(bb, b + nt * 8 * LD + 16 * kp);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                if (kp == 0) fa_mma4c(acc[mt][nt], a0[mt], bb[0], bb[1], c[mt][nt]);
                else fa_mma4(acc[mt][nt], a0[mt], bb[0], bb[1]);
                fa_mma4(acc[mt][nt], a1[mt], bb[2], bb[3]);
            }
        }
    }
}

// A fragments of MT m-tiles x KS k-steps of a row-major tile into registers (lane address from fa_a_lane)
template <int MT, int KS, int LD>
__device__ __forceinline__ void fa_load_afrag(u32 (&af)[MT][KS][4], const float* a) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) fa_ldsm4(af[mt][ks], a + mt * 16 * LD + ks * 8);
}

// acc[mt][dt] (16 x 8 each, dt < HS/8) += P[mt] (16 x 8*NK, accumulator fragments p[mt][kk]) * V
// (8*NK rows x HS, shared, row stride LD), permuted k index: the B operand is V[8kk+2t][8dt+g],
// V[8kk+2t+1][8dt+g]. p is rounded to tf32 here (fa_tf32_mma).
template <int MT, int NK, int HS>
__device__ __forceinline__ void fa_mma_pv(float (&acc)[MT][HS / 8][4], const float (&p)[MT][NK][4],
                                          const float* __restrict__ V) {
    constexpr int LD = HS + 4;
    const int lane = threadIdx.x & 31;
    const float* v = V + 2 * (lane & 3) * LD + (lane >> 2);
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            a[mt][0] = fa_tf32_mma(p[mt][kk][0]);
            a[mt][1] = fa_tf32_mma(p[mt][kk][2]);
            a[mt][2] = fa_tf32_mma(p[mt][kk][1]);
            a[mt][3] = fa_tf32_mma(p[mt][kk][3]);
        }
#pragma unroll
        for (int dt = 0; dt < HS / 8; ++dt) {
            const u32 b0 = __float_as_uint(v[kk * 8 * LD + dt * 8]);
            const u32 b1 = __float_as_uint(v[kk * 8 * LD + LD + dt * 8]);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) fa_mma4(acc[mt][dt], a[mt], b0, b1);
        }
    }
}

// ------------------------------------------------------------------------------- 3xTF32 helpers
// The fp32 precision's fused kernels (flash_*_x3) run each product as three TF32 products: every fp32
// operand x is split at fragment load into hi = tf32(x) (round to nearest, ties away: the exact tf32
// value, so lo = x - hi is exact in fp32) and lo, and a*b becomes a_lo*b_hi + a_hi*b_lo + a_hi*b_hi
// (the small terms first) with fp32 accumulation: only a_lo*b_lo (about 2^-22 relative) and the tf32
// rounding of lo are lost. The tensor cores add into their fp32 accumulators with truncation (round
// toward zero, about an ulp per addition: bench/NOTES.md, "fp32 as 3xTF32 on wgmma"), a bias that
// grows with the number of additions, so each k-step's three products are summed on their own from
// zero and that partial is added into the running sum on the FP32 pipe (round to nearest), as the
// wgmma 3xTF32 GEMMs add their per-tile partials. Shared-memory tiles hold fp32 values (Q scaled in
// place, nothing rounded); fa_mma_abt3 / fa_load_afrag3 / fa_mma_pv3 are fa_mma_abt / fa_load_afrag /
// fa_mma_pv with split operands.

// x -> hi (the tf32 value of x) and lo = x - hi, lo in the mma-only form of fa_tf32_mma
__device__ __forceinline__ void fa_split(u32 x, u32& hi, u32& lo) {
    hi = (x + 0x1000u) & 0xffffe000u;
    lo = fa_tf32_mma(__uint_as_float(x) - __uint_as_float(hi));
}
template <int N>
__device__ __forceinline__ void fa_split_frag(const u32 (&x)[N], u32 (&hi)[N], u32 (&lo)[N]) {
#pragma unroll
    for (int r = 0; r < N; ++r) fa_split(x[r], hi[r], lo[r]);
}

// d += a * b in 3xTF32 (a: hi ah, lo al; b: hi bh0 / bh1, lo bl0 / bl1): the partial of this k-step
// from zero, the small products first, then added into d with round-to-nearest FADDs
__device__ __forceinline__ void fa_mma4x3(float (&d)[4], const u32 (&ah)[4], const u32 (&al)[4], u32 bh0, u32 bh1,
                                          u32 bl0, u32 bl1) {
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    float part[4];
    fa_mma4c(part, al, bh0, bh1, zero);
    fa_mma4(part, ah, bl0, bl1);
    fa_mma4(part, ah, bh0, bh1);
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] += part[e];
}

// two 8x8 b16 matrices: the first half of fa_ldsm4 (lanes 0..15 give the row addresses)
__device__ __forceinline__ void fa_ldsm2(u32 (&r)[2], const float* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(fa_smem_u32(p)));
}

// fa_mma_abt in 3xTF32: acc = c, then each k-step's partial added (fa_mma4x3). A fragments from
// registers (AREG: hi ah[mt][ks], lo al[mt][ks]) or by ldmatrix from `a` and split there; B fragments
// by ldmatrix from `b`, split as loaded. A from shared memory goes one k-step at a time (B by
// ldmatrix.x2), which keeps half the split fragments live.
template <int MT, int NT, int KS, int LD, bool AREG, int AKS>
__device__ __forceinline__ void fa_mma_abt3(float (&acc)[MT][NT][4], const float (&c)[MT][NT][4],
                                            const u32 (&ah)[MT][AKS][4], const u32 (&al)[MT][AKS][4],
                                            const float* a, const float* b) {
    static_assert(!AREG || AKS == KS, "register A fragments cover every k-step");
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = c[mt][nt][e];
    if constexpr (!AREG) {
#pragma unroll 1
        for (int ks = 0; ks < KS; ++ks) {
            u32 sh[MT][4], sl[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 x[4];
                fa_ldsm4(x, a + mt * 16 * LD + 8 * ks);
                fa_split_frag(x, sh[mt], sl[mt]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 bb[2], bh[2], bl[2];
                fa_ldsm2(bb, b + nt * 8 * LD + 8 * ks);
                fa_split_frag(bb, bh, bl);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) fa_mma4x3(acc[mt][nt], sh[mt], sl[mt], bh[0], bh[1], bl[0], bl[1]);
            }
        }
    } else {                                        // A from registers: a k-step pair at a time
#pragma unroll
        for (int kp = 0; kp < KS / 2; ++kp) {
            u32 a0h[MT][4], a0l[MT][4], a1h[MT][4], a1l[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    a0h[mt][r] = ah[mt][2 * kp][r];
                    a0l[mt][r] = al[mt][2 * kp][r];
                    a1h[mt][r] = ah[mt][2 * kp + 1][r];
                    a1l[mt][r] = al[mt][2 * kp + 1][r];
                }
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 bb[4], bh[4], bl[4];
                fa_ldsm4(bb, b + nt * 8 * LD + 16 * kp);
                fa_split_frag(bb, bh, bl);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    fa_mma4x3(acc[mt][nt], a0h[mt], a0l[mt], bh[0], bh[1], bl[0], bl[1]);
                    fa_mma4x3(acc[mt][nt], a1h[mt], a1l[mt], bh[2], bh[3], bl[2], bl[3]);
                }
            }
        }
    }
}

// fa_load_afrag, split: hi into ah, lo into al
template <int MT, int KS, int LD>
__device__ __forceinline__ void fa_load_afrag3(u32 (&ah)[MT][KS][4], u32 (&al)[MT][KS][4], const float* a) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            u32 x[4];
            fa_ldsm4(x, a + mt * 16 * LD + ks * 8);
            fa_split_frag(x, ah[mt][ks], al[mt][ks]);
        }
}

// fa_mma_pv in 3xTF32: p and V split, each k-step's partial added into acc (fa_mma4x3)
template <int MT, int NK, int HS>
__device__ __forceinline__ void fa_mma_pv3(float (&acc)[MT][HS / 8][4], const float (&p)[MT][NK][4],
                                           const float* __restrict__ V) {
    constexpr int LD = HS + 4;
    const int lane = threadIdx.x & 31;
    const float* v = V + 2 * (lane & 3) * LD + (lane >> 2);
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
        u32 ah[MT][4], al[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            fa_split(__float_as_uint(p[mt][kk][0]), ah[mt][0], al[mt][0]);
            fa_split(__float_as_uint(p[mt][kk][2]), ah[mt][1], al[mt][1]);
            fa_split(__float_as_uint(p[mt][kk][1]), ah[mt][2], al[mt][2]);
            fa_split(__float_as_uint(p[mt][kk][3]), ah[mt][3], al[mt][3]);
        }
#pragma unroll
        for (int dt = 0; dt < HS / 8; ++dt) {
            u32 bh0, bl0, bh1, bl1;
            fa_split(__float_as_uint(v[kk * 8 * LD + dt * 8]), bh0, bl0);
            fa_split(__float_as_uint(v[kk * 8 * LD + LD + dt * 8]), bh1, bl1);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) fa_mma4x3(acc[mt][dt], ah[mt], al[mt], bh0, bh1, bl0, bl1);
        }
    }
}

// the same thread's chunks of a landed tile (as fa_round_tile): x -> x * mul in place, not rounded
template <int ROWS, int HS>
__device__ __forceinline__ void fa_scale_tile(float* dst, float mul) {
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_TC_THREADS / V, N = ROWS / RPI;
    float* d = dst + (threadIdx.x / V) * LD + (threadIdx.x % V) * 4;
#pragma unroll
    for (int it = 0; it < N; ++it) {
        float4* p = reinterpret_cast<float4*>(d + it * RPI * LD);
        float4 v = *p;
        v.x *= mul; v.y *= mul; v.z *= mul; v.w *= mul;
        *p = v;
    }
}

// The kernels' products, TF32 (X3 false: A fragments af, tiles rounded in place) or 3xTF32 (X3: A
// fragments hi af, lo al, fp32 tiles split at fragment load)
template <bool X3, int MT, int NT, int KS, int LD, bool AREG, int AKS, int LKS>
__device__ __forceinline__ void fa_abt(float (&acc)[MT][NT][4], const float (&c)[MT][NT][4], const u32 (&af)[MT][AKS][4],
                                       const u32 (&al)[MT][LKS][4], const float* a, const float* b) {
    if constexpr (X3) fa_mma_abt3<MT, NT, KS, LD, AREG>(acc, c, af, al, a, b);
    else fa_mma_abt<MT, NT, KS, LD, AREG>(acc, c, af, a, b);
}
template <bool X3, int MT, int KS, int LD, int LKS>
__device__ __forceinline__ void fa_afrag(u32 (&af)[MT][KS][4], u32 (&al)[MT][LKS][4], const float* a) {
    if constexpr (X3) fa_load_afrag3<MT, KS, LD>(af, al, a);
    else fa_load_afrag<MT, KS, LD>(af, a);
}
template <bool X3, int MT, int NK, int HS>
__device__ __forceinline__ void fa_pv(float (&acc)[MT][HS / 8][4], const float (&p)[MT][NK][4], const float* __restrict__ V) {
    if constexpr (X3) fa_mma_pv3<MT, NK, HS>(acc, p, V);
    else fa_mma_pv<MT, NK, HS>(acc, p, V);
}

template <int MT, int N>
__device__ __forceinline__ void fa_zero(float (&x)[MT][N][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < N; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) x[mt][n][e] = 0.f;
}

// c[mt][n] = {r[mt][0], r[mt][0], r[mt][1], r[mt][1]}: a per-row value as an accumulator fragment
template <int MT, int N>
__device__ __forceinline__ void fa_rows_frag(float (&c)[MT][N][4], const float (&r)[MT][2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < N; ++n) {
            c[mt][n][0] = c[mt][n][1] = r[mt][0];
            c[mt][n][2] = c[mt][n][3] = r[mt][1];
        }
}

// one row's accumulator fragment (columns 8dt + 2t + {0,1}, e = 0: row g, e = 2: row g+8) * s
template <int HS>
__device__ __forceinline__ void fa_store_frag_row(float* __restrict__ dst, const float (&acc)[HS / 8][4], int e,
                                                  float s) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int dt = 0; dt < HS / 8; ++dt)
        *reinterpret_cast<float2*>(dst + dt * 8 + 2 * t) = make_float2(acc[dt][e] * s, acc[dt][e + 1] * s);
}

// causal mask of a score tile of the forward / dQ kernels: s = -inf where the key (column
// k0 + 8nt + 2t + (e&1)) comes after the query (row wr0 + 16mt + g + 8(e>>1))
template <int MT, int NT>
__device__ __forceinline__ void fa_mask_causal(float (&s)[MT][NT][4], int k0, int wr0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float ninf = __int_as_float(0xff800000);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (k0 + 8 * nt + 2 * t + (e & 1) > wr0 + 16 * mt + g + 8 * (e >> 1)) s[mt][nt][e] = ninf;
}

// The K/V ring of the forward and dQ kernels (F: FaFwdTc / FaDqTc): key tiles 0..nkt-1 through NS
// stages of sm, tiles 0 and (NS = 3) 1 already issued. tile(K, V, k0, FaBool<EDGE>) runs on the
// tiles that a row of the warp (wr0..wr0+WR-1) sees, EDGE where the tile reaches past row wr0.
template <class F, int HS, class Tile>
__device__ __forceinline__ void fa_kv_ring(float* sm, const FaBlock<HS>& fb, int nkt, int wr0, Tile& tile) {
    constexpr int BC = F::BC, LD = F::LD, NS = F::NS, STAGE = F::STAGE, WR = F::WR;
    int stage = 0;
    for (int j = 0; j < nkt; ++j) {
        float* cur = sm + stage * STAGE;
        if (j > 0) {
            fa_cp_wait<NS - 2>();
            if constexpr (!F::X3) fa_round_tile<2 * BC, HS, false>(cur, 1.f);   // 3xTF32: split at fragment load
            __syncthreads();                           // tile j visible; everyone is done with tile j-1
        }
        if (j + NS - 1 < nkt)                          // into the stage of tile j-1
            fa_cp_kv<BC, HS>(sm + (stage == 0 ? NS - 1 : stage - 1) * STAGE, fb, (j + NS - 1) * BC);
        fa_cp_commit();
        stage = stage == NS - 1 ? 0 : stage + 1;

        const int k0 = j * BC;
        if (wr0 >= fb.T || k0 > wr0 + WR - 1) continue;   // warp-uniform: no row of the warp sees the tile
        if (k0 + BC - 1 > wr0) tile(cur, cur + BC * LD, k0, FaBool<true>());   // reaches past the first row
        else tile(cur, cur + BC * LD, k0, FaBool<false>());
    }
    fa_cp_wait<0>();
}

// ------------------------------------------------------------------------------- TC forward

// 4 warps x WR = 16*MT query rows; key tiles of BC through the K/V ring. The Q tile (scaled by
// scale*log2 e) is staged through ring stages 1.. before the loop and then held in registers (AREG;
// 3xTF32 at head size 128: Q keeps its own buffer and is split from there per key tile).
// Online softmax with a lazily moved reference max m per row: p = exp2(s - m) <= 2^FA_RESCALE_LOG2,
// O and l are rescaled only when some row of the warp outgrows its m by more than that.
template <int HS, bool X3_ = false> struct FaFwdTc {
    static constexpr bool X3 = X3_;     // 3xTF32: hi and lo fragments, so fewer rows a warp and shorter key tiles
    static constexpr int MT = (X3 ? HS <= 32 : HS <= 64) ? 2 : 1;
    static constexpr int WR = 16 * MT;
    static constexpr int BR = 4 * WR;
    static constexpr int BC = X3 ? (HS <= 64 ? 32 : 16) : HS <= 64 ? 64 : 32;
    static constexpr bool AREG = !X3 || HS <= 64;               // Q's fragments in registers, else Q resident
    static constexpr int NS = 3;
    static constexpr int LD = HS + 4;
    static constexpr int STAGE = 2 * BC * LD;                   // K, V
    static constexpr int QBUF = BR * LD;
    static constexpr int QOFF = AREG ? STAGE : NS * STAGE;
    static constexpr int SMEM = AREG ? (NS * STAGE > STAGE + QBUF ? NS * STAGE : STAGE + QBUF) : NS * STAGE + QBUF;
};

template <int HS, bool DROP, bool X3>
__device__ __forceinline__ void fa_fwd_tc_body(FA_ARGS_FWD) {
    using F = FaFwdTc<HS, X3>;
    constexpr int MT = F::MT, WR = F::WR, BR = F::BR, BC = F::BC, LD = F::LD, NS = F::NS;
    constexpr int KS = HS / 8, NT = BC / 8, DT = HS / 8, STAGE = F::STAGE;
    constexpr bool AREG = F::AREG;
    constexpr int AK = AREG ? KS : 1;
    gc_check_smem(F::SMEM * 4);
    extern __shared__ float4 fa_smem4[];
    float* sm = reinterpret_cast<float*>(fa_smem4);
    float* Qb = sm + F::QOFF;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const int wr0 = q0 + w * WR;                       // first query row of this warp
    const float ninf = __int_as_float(0xff800000);
    const int nkt = (min(q0 + BR, T) + BC - 1) / BC;   // key tiles up to the block's last row

    fa_cp_tile<BR, HS>(Qb, fb.q(q0), fb.rs, T - q0);
    fa_cp_commit();
    fa_cp_kv<BC, HS>(sm, fb, 0);
    fa_cp_commit();
    fa_cp_wait<0>();
    if constexpr (X3) {
        fa_scale_tile<BR, HS>(Qb, scale * FA_LOG2E);
    } else {
        fa_round_tile<BR, HS, true>(Qb, scale * FA_LOG2E);
        fa_round_tile<2 * BC, HS, false>(sm, 1.f);
    }
    __syncthreads();
    u32 qf[MT][AK][4], ql[MT][X3 ? AK : 1][4];         // ql: the lo fragments (3xTF32)
    const float* qa = fa_a_lane<LD>(Qb + w * WR * LD);
    if constexpr (AREG) {
        fa_afrag<X3, MT, KS, LD>(qf, ql, qa);
        __syncthreads();                               // Q is read: its space is ring stage 1..
    }
    if (NS == 3) {
        if (nkt > 1) fa_cp_kv<BC, HS>(sm + STAGE, fb, BC);
        fa_cp_commit();
    }

    float m[MT][2], l[MT][2], o[MT][DT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            m[mt][hh] = ninf;                          // the reference max of the row's p, l and O
            l[mt][hh] = 0.f;
        }
    fa_zero(o);
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 Th = (u32)((T + 1) / 2);                 // keep-word pairs per row of the [B*H*T, T] mask
    const u32 rpair = (u32)(bh * T + wr0 + g) * Th + (u32)t;   // row g's word of keys 2t, 2t + 1

    // one key tile: S - m on the tensor cores, (mask), online softmax, O += P V
    auto tile = [&](const float* Ks, const float* Vs, int k0, auto edge_tag) {
        constexpr bool EDGE = decltype(edge_tag)::value;
        float mref[MT][2], c[MT][NT][4], s[MT][NT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) mref[mt][hh] = k0 == 0 ? 0.f : -m[mt][hh];   // m = -inf before tile 0
        fa_rows_frag(c, mref);
        fa_abt<X3, MT, NT, KS, LD, AREG>(s, c, qf, ql, qa, fa_b_lane<LD>(Ks));   // s = S - m (log2 units)
        if (EDGE) fa_mask_causal(s, k0, wr0);
        float mx[MT][2];
        bool grow = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float x = ninf;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) x = fmaxf(x, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
                x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
                mx[mt][hh] = x - mref[mt][hh];         // the row max of S: finite (key k0 <= every row)
                grow |= mx[mt][hh] > m[mt][hh] + FA_RESCALE_LOG2;
            }
        if (__any_sync(0xffffffffu, grow)) {           // move the reference max (always on tile 0)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const float mnew = fmaxf(m[mt][hh], mx[mt][hh]);
                    const float alpha = fa_exp2(m[mt][hh] - mnew);
                    const float shift = mnew + mref[mt][hh];   // s holds S + mref
                    m[mt][hh] = mnew;
                    l[mt][hh] *= alpha;
#pragma unroll
                    for (int dt = 0; dt < DT; ++dt) {
                        o[mt][dt][2 * hh] *= alpha;
                        o[mt][dt][2 * hh + 1] *= alpha;
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        s[mt][nt][2 * hh] -= shift;
                        s[mt][nt][2 * hh + 1] -= shift;
                    }
                }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float rsum = 0.f;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    u32 kw = 0;                        // keys k0 + 8nt + 2t and + 1 share one keep word
                    if (DROP) kw = gc_keep_word(key, rpair + (u32)(16 * mt + 8 * hh) * Th + (u32)((k0 >> 1) + 4 * nt));
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float p = fa_exp2(s[mt][nt][2 * hh + e]);   // exp2(S - m) <= 2^FA_RESCALE_LOG2
                        rsum += p;
                        if (DROP && gc_keep_half(kw, e) < threshold) p = 0.f;   // 1/(1-p) is applied to O at the end
                        s[mt][nt][2 * hh + e] = p;
                    }
                }
                l[mt][hh] += rsum;                     // thread-partial; reduced once at the end
            }
        fa_pv<X3, MT, NT, HS>(o, s, Vs);               // O += P V
    };
    fa_kv_ring<F>(sm, fb, nkt, wr0, tile);

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float L = l[mt][hh];
            L += __shfl_xor_sync(0xffffffffu, L, 1);
            L += __shfl_xor_sync(0xffffffffu, L, 2);
            const int i = wr0 + 16 * mt + g + 8 * hh;
            if (i < T) {
                fa_store_frag_row<HS>(fb.row(y, i), o[mt], 2 * hh, (DROP ? inv_keep : 1.f) / L);
                if (t == 0) lse[(long long)bh * T + i] = m[mt][hh] * FA_LN2 + logf(L);
            }
        }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_fwd_tc(FA_ARGS_FWD) {
    fa_fwd_tc_body<HS, DROP, false>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's forward in 3xTF32 (FaFwdTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_fwd_x3(FA_ARGS_FWD) {
    fa_fwd_tc_body<HS, DROP, true>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- TC backward: dQ

// 4 warps x WR = 16*MT query rows; key tiles of BC through the K/V ring. Q (scaled by scale*log2 e)
// and dO are A operands: in registers (AREG; staged through ring stages 1..) or a resident tile.
template <int HS, bool X3_ = false> struct FaDqTc {
    static constexpr bool X3 = X3_;     // 3xTF32: Q and dO resident in shared memory, 16 rows a warp from head size 64
    static constexpr int MT = (X3 ? HS <= 32 : HS <= 64) ? 2 : 1;
    static constexpr int WR = 16 * MT;
    static constexpr int BR = 4 * WR;
    static constexpr int BC = HS <= 64 ? 32 : 16;
    static constexpr bool AREG = !X3 && HS * MT <= 64;
    static constexpr int NS = X3 ? (HS <= 64 ? 3 : 2) : AREG ? 3 : 2;
    static constexpr int LD = HS + 4;
    static constexpr int STAGE = 2 * BC * LD;                   // K, V
    static constexpr int QBUF = 2 * BR * LD;                    // Q, dO
    static constexpr int QOFF = AREG ? STAGE : NS * STAGE;
    static constexpr int SMEM = AREG ? (NS * STAGE > STAGE + QBUF ? NS * STAGE : STAGE + QBUF) : NS * STAGE + QBUF;
};

template <int HS, bool DROP, bool X3>
__device__ __forceinline__ void fa_dq_tc_body(FA_ARGS_BWD) {
    using F = FaDqTc<HS, X3>;
    constexpr int MT = F::MT, WR = F::WR, BR = F::BR, BC = F::BC, LD = F::LD, NS = F::NS;
    constexpr int KS = HS / 8, NT = BC / 8, DT = HS / 8, STAGE = F::STAGE;
    constexpr bool AREG = F::AREG;
    constexpr int AK = AREG ? KS : 1;
    gc_check_smem(F::SMEM * 4);
    extern __shared__ float4 fa_smem4[];
    float* sm = reinterpret_cast<float*>(fa_smem4);
    float* Qb = sm + F::QOFF;
    float* dOb = Qb + BR * LD;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const int wr0 = q0 + w * WR;
    const int nkt = (min(q0 + BR, T) + BC - 1) / BC;

    fa_cp_tile<BR, HS>(Qb, fb.q(q0), fb.rs, T - q0);
    fa_cp_tile<BR, HS>(dOb, fb.row(dy, q0), fb.C, T - q0);
    fa_cp_commit();
    fa_cp_kv<BC, HS>(sm, fb, 0);
    fa_cp_commit();

    float nl[MT][2], nd[MT][2];                        // -lse (log2 units), -D per row
    u32 rbase[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = wr0 + 16 * mt + g + 8 * hh;
            nl[mt][hh] = i < T ? -lse[(long long)bh * T + i] * FA_LOG2E : 0.f;
            nd[mt][hh] = i < T ? -Dg[(long long)bh * T + i] : 0.f;
            rbase[mt][hh] = (u32)(bh * T + i) * (u32)((T + 1) / 2);
        }
    float cl[MT][NT][4], cd[MT][NT][4];
    fa_rows_frag(cl, nl);
    if (DROP) fa_zero(cd);
    else fa_rows_frag(cd, nd);
    const u32 key = fa_drop_key<DROP>(st, seed, site);

    fa_cp_wait<0>();
    if constexpr (X3) {
        fa_scale_tile<BR, HS>(Qb, scale * FA_LOG2E);
    } else {
        fa_round_tile<BR, HS, true>(Qb, scale * FA_LOG2E);
        fa_round_tile<BR, HS, false>(dOb, 1.f);
        fa_round_tile<2 * BC, HS, false>(sm, 1.f);
    }
    __syncthreads();
    u32 qf[MT][AK][4], df[MT][AK][4], ql[MT][X3 ? AK : 1][4], dl[MT][X3 ? AK : 1][4];   // ql, dl: lo (3xTF32)
    const float* qa = fa_a_lane<LD>(Qb + w * WR * LD);
    const float* da = fa_a_lane<LD>(dOb + w * WR * LD);
    if constexpr (AREG) {
        fa_afrag<X3, MT, KS, LD>(qf, ql, qa);
        fa_afrag<X3, MT, KS, LD>(df, dl, da);
        __syncthreads();                               // Q and dO are read: their space is ring stage 1..
    }
    if (NS == 3) {
        if (nkt > 1) fa_cp_kv<BC, HS>(sm + STAGE, fb, BC);
        fa_cp_commit();
    }

    float dq[MT][DT][4];
    fa_zero(dq);

    // one key tile: S - lse and dPd - D on the tensor cores, (mask), dS, dQ += dS K
    auto tile = [&](const float* Ks, const float* Vs, int k0, auto edge_tag) {
        constexpr bool EDGE = decltype(edge_tag)::value;
        float s[MT][NT][4], dp[MT][NT][4];
        fa_abt<X3, MT, NT, KS, LD, AREG>(s, cl, qf, ql, qa, fa_b_lane<LD>(Ks));    // S - lse (log2 units)
        fa_abt<X3, MT, NT, KS, LD, AREG>(dp, cd, df, dl, da, fa_b_lane<LD>(Vs));   // dPd (- D without dropout)
        if (EDGE) fa_mask_causal(s, k0, wr0);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 kw[2] = {0, 0};                    // rows g, g + 8: keys k0 + 8nt + 2t and + 1 share a word
                if (DROP) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
                        kw[hh] = gc_keep_word(key, rbase[mt][hh] + (u32)((k0 >> 1) + 4 * nt + t));
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pe = fa_exp2(s[mt][nt][e]);
                    float gv = dp[mt][nt][e];
                    if (DROP) {
                        const bool kp = gc_keep_half(kw[e >> 1], e & 1) >= threshold;
                        gv = (kp ? gv * inv_keep : 0.f) + nd[mt][(e >> 1)];
                    }
                    s[mt][nt][e] = pe * gv;                // dS / scale
                }
            }
        fa_pv<X3, MT, NT, HS>(dq, s, Ks);              // dQ += dS K
    };
    fa_kv_ring<F>(sm, fb, nkt, wr0, tile);

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = wr0 + 16 * mt + g + 8 * hh;
            if (i < T) fa_store_frag_row<HS>(fb.row3(dqkv, i), dq[mt], 2 * hh, scale);
        }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_bwd_dq_tc(FA_ARGS_BWD) {
    fa_dq_tc_body<HS, DROP, false>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dQ in 3xTF32 (FaDqTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_bwd_dq_x3(FA_ARGS_BWD) {
    fa_dq_tc_body<HS, DROP, true>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- TC backward: dK, dV

// 4 warps x WR = 16*MT key rows; query tiles of BQ (Q scaled by scale*log2 e, dO, -lse*log2 e, -D)
// through the ring, from the diagonal to the end. K and V are A operands: in registers (AREG; staged
// through ring stages 1..) or a resident tile (V's fragments still go to registers when VREG).
// dK and dV accumulate in registers. The scores are
// tf32(Q*scale*log2 e) . tf32(K) as in the forward and dQ kernels, so P matches the saved lse.
template <int HS, bool X3_ = false> struct FaDkvTc {
    static constexpr bool X3 = X3_;     // 3xTF32: K and V resident in shared memory, 16 rows a warp from head size 64
    static constexpr int MT = (X3 ? HS <= 32 : HS <= 64) ? 2 : 1;
    static constexpr int WR = 16 * MT;
    static constexpr int BK = 4 * WR;
    static constexpr int BQ = 16;
    static constexpr bool AREG = !X3 && HS * MT <= 64;          // K and V fragments in registers
    static constexpr bool VREG = !X3 && HS <= 64;               // V fragments in registers (K's too if AREG)
    static constexpr int NS = HS <= 64 ? 3 : 2;
    static constexpr int LD = HS + 4;
    static constexpr int STAGE = 2 * BQ * LD + 2 * BQ;          // Q, dO, -L, -D
    static constexpr int KBUF = 2 * BK * LD;                    // K, V
    static constexpr int KOFF = AREG ? STAGE : NS * STAGE;
    static constexpr int SMEM = AREG ? (NS * STAGE > STAGE + KBUF ? NS * STAGE : STAGE + KBUF) : NS * STAGE + KBUF;
};

template <int HS, int BQ>
__device__ __forceinline__ void fa_dkv_issue(float* stg, const FaBlock<HS>& fb, const float* dob, const float* lse,
                                             const float* Dg, int q0, long long bhT) {
    constexpr int LD = HS + 4;
    const int T = fb.T;
    fa_cp_tile<BQ, HS>(stg, fb.q(q0), fb.rs, T - q0);
    fa_cp_tile<BQ, HS>(stg + BQ * LD, dob + (long long)q0 * fb.C, fb.C, T - q0);
    fa_cp_vec<BQ, 0>(stg + 2 * BQ * LD, lse + bhT + q0, T - q0);            // threads 0..BQ-1
    fa_cp_vec<BQ, BQ>(stg + 2 * BQ * LD + BQ, Dg + bhT + q0, T - q0);      // threads BQ..2BQ-1
}

template <int HS, int BQ, bool X3 = false>
__device__ __forceinline__ void fa_dkv_round(float* stg, float sl2) {
    constexpr int LD = HS + 4;
    if constexpr (X3) {
        fa_scale_tile<BQ, HS>(stg, sl2);                                   // Q * scale * log2 e, fp32
    } else {
        fa_round_tile<BQ, HS, true>(stg, sl2);                             // Q * scale * log2 e
        fa_round_tile<BQ, HS, false>(stg + BQ * LD, 1.f);                  // dO
    }
    // each thread's own entry (fa_dkv_issue): -lse in log2 units, -D
    if (threadIdx.x < 2 * BQ) stg[2 * BQ * LD + threadIdx.x] *= threadIdx.x < BQ ? -FA_LOG2E : -1.f;
}

template <int HS, bool DROP, bool X3>
__device__ __forceinline__ void fa_dkv_tc_body(FA_ARGS_BWD) {
    using F = FaDkvTc<HS, X3>;
    constexpr int MT = F::MT, WR = F::WR, BK = F::BK, BQ = F::BQ, LD = F::LD, NS = F::NS;
    constexpr int KS = HS / 8, NT = BQ / 8, DT = HS / 8, STAGE = F::STAGE;
    constexpr bool AREG = F::AREG, VREG = F::VREG;
    constexpr int AK = AREG ? KS : 1, VK = VREG ? KS : 1;
    gc_check_smem(F::SMEM * 4);
    extern __shared__ float4 fa_smem4[];
    float* sm = reinterpret_cast<float*>(fa_smem4);
    float* Kb = sm + F::KOFF;
    float* Vb = Kb + BK * LD;

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const FaBlock<HS> fb(qkv, T, H, FaGridY<BK, false>());
    const int k0 = fb.r0;
    const int wk0 = k0 + w * WR;                       // first key row of this warp
    const long long bhT = fb.bhT;
    const float* dob = fb.row0(dy);
    const float ninf = __int_as_float(0xff800000);
    const int nqt = (T - k0 + BQ - 1) / BQ;            // query tiles from the diagonal (q0 = k0) to the end

    fa_cp_kv<BK, HS>(Kb, fb, k0);
    fa_cp_commit();
    fa_dkv_issue<HS, BQ>(sm, fb, dob, lse, Dg, k0, bhT);
    fa_cp_commit();
    fa_cp_wait<0>();
    if constexpr (!X3) {
        fa_round_tile<BK, HS, false>(Kb, 1.f);
        fa_round_tile<BK, HS, false>(Vb, 1.f);
    }
    fa_dkv_round<HS, BQ, X3>(sm, scale * FA_LOG2E);
    __syncthreads();
    u32 kf[MT][AK][4], vf[MT][VK][4], kl[MT][X3 ? AK : 1][4], vl[MT][X3 ? VK : 1][4];   // kl, vl: lo (3xTF32)
    const float* ka = fa_a_lane<LD>(Kb + w * WR * LD);
    const float* va = fa_a_lane<LD>(Vb + w * WR * LD);
    if constexpr (AREG) {
        fa_afrag<X3, MT, KS, LD>(kf, kl, ka);
        fa_afrag<X3, MT, KS, LD>(vf, vl, va);
        __syncthreads();                               // K and V are read: their space is ring stage 1..
    } else if constexpr (VREG) {
        fa_afrag<X3, MT, KS, LD>(vf, vl, va);          // K stays resident in shared memory
    }
    if (NS == 3) {
        if (nqt > 1) fa_dkv_issue<HS, BQ>(sm + STAGE, fb, dob, lse, Dg, k0 + BQ, bhT);
        fa_cp_commit();
    }

    float dk[MT][DT][4], dv[MT][DT][4];
    fa_zero(dk);
    fa_zero(dv);
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 Th = (u32)((T + 1) / 2);                 // keep-word pairs per row of the [B*H*T, T] mask

    // one query tile: S^T - lse and dPd^T - D on the tensor cores, (mask), dV += Pd^T dO, dK += dS^T Q
    auto tile = [&](const float* stg, int q0, auto edge_tag) {
        constexpr bool EDGE = decltype(edge_tag)::value;
        const float* Qs = stg;
        const float* dOs = stg + BQ * LD;
        const float* nLs = stg + 2 * BQ * LD;
        const float* nDs = nLs + BQ;
        float cl[MT][NT][4], cd[MT][NT][4], s[MT][NT][4], dp[MT][NT][4];   // rows keys, columns queries
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float2 l2 = *reinterpret_cast<const float2*>(nLs + 8 * nt + 2 * t);
            const float2 d2 = *reinterpret_cast<const float2*>(nDs + 8 * nt + 2 * t);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                cl[mt][nt][0] = cl[mt][nt][2] = l2.x;
                cl[mt][nt][1] = cl[mt][nt][3] = l2.y;
                cd[mt][nt][0] = cd[mt][nt][2] = DROP ? 0.f : d2.x;
                cd[mt][nt][1] = cd[mt][nt][3] = DROP ? 0.f : d2.y;
            }
        }
        fa_abt<X3, MT, NT, KS, LD, AREG>(s, cl, kf, kl, ka, fa_b_lane<LD>(Qs));    // S^T - lse
        fa_abt<X3, MT, NT, KS, LD, VREG>(dp, cd, vf, vl, va, fa_b_lane<LD>(dOs));  // dPd^T (- D without dropout)
        if (EDGE) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int iq = q0 + 8 * nt + 2 * t + (e & 1);
                        if (wk0 + 16 * mt + g + 8 * (e >> 1) > iq || iq >= T) s[mt][nt][e] = ninf;
                    }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                // Keys jk (row g) and jk ^ 1 (row g ^ 1: lane ^ 4) share the keep words of queries
                // iq0 = q0 + 8nt + 2t and iq0 + 1. This lane draws the word of query iq0 + (g & 1) and
                // takes the other from its partner; an odd key reads the high halves.
                u32 kw[2][2] = {{0, 0}, {0, 0}};       // [row half hh][query iq0 + c]
                if (DROP) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        const int jk = wk0 + 16 * mt + g + 8 * hh;
                        const u32 mine = gc_keep_word(key, (u32)(bhT + q0 + 8 * nt + 2 * t + (g & 1)) * Th + (u32)(jk >> 1));
                        const u32 other = __shfl_xor_sync(0xffffffffu, mine, 4);
                        kw[hh][0] = (g & 1) ? other : mine;
                        kw[hh][1] = (g & 1) ? mine : other;
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pe = fa_exp2(s[mt][nt][e]);
                    float gv = dp[mt][nt][e];
                    float pd = pe;
                    if (DROP) {
                        const bool kp = gc_keep_half(kw[e >> 1][e & 1], g & 1) >= threshold;
                        gv = (kp ? gv * inv_keep : 0.f) + nDs[8 * nt + 2 * t + (e & 1)];
                        pd = kp ? pe * inv_keep : 0.f;
                    }
                    s[mt][nt][e] = pd;
                    dp[mt][nt][e] = pe * gv;               // dS^T / scale
                }
            }
        fa_pv<X3, MT, NT, HS>(dv, s, dOs);             // dV += Pd^T dO
        fa_pv<X3, MT, NT, HS>(dk, dp, Qs);             // dK += dS^T Q
    };

    int stage = 0;
    for (int jq = 0; jq < nqt; ++jq) {
        float* cur = sm + stage * STAGE;
        if (jq > 0) {
            fa_cp_wait<NS - 2>();
            fa_dkv_round<HS, BQ, X3>(cur, scale * FA_LOG2E);
            __syncthreads();
        }
        if (jq + NS - 1 < nqt)
            fa_dkv_issue<HS, BQ>(sm + (stage == 0 ? NS - 1 : stage - 1) * STAGE, fb, dob, lse, Dg,
                                 k0 + (jq + NS - 1) * BQ, bhT);
        fa_cp_commit();
        stage = stage == NS - 1 ? 0 : stage + 1;

        const int q0 = k0 + jq * BQ;
        if (wk0 >= T || q0 + BQ - 1 < wk0) continue;  // no query of the tile sees a key of the warp
        if (q0 < wk0 + WR - 1 || q0 + BQ > T) tile(cur, q0, FaBool<true>());   // a query before a key, or past T
        else tile(cur, q0, FaBool<false>());
    }
    fa_cp_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int j = wk0 + 16 * mt + g + 8 * hh;
            if (j < T) {
                float* row = fb.row3(dqkv, j);
                fa_store_frag_row<HS>(row + fb.C, dk[mt], 2 * hh, FA_LN2);   // scale / (scale*log2 e): Q was scaled
                fa_store_frag_row<HS>(row + 2 * fb.C, dv[mt], 2 * hh, 1.f);
            }
        }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_bwd_dkv_tc(FA_ARGS_BWD) {
    fa_dkv_tc_body<HS, DROP, false>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dK / dV in 3xTF32 (FaDkvTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, 2) flash_bwd_dkv_x3(FA_ARGS_BWD) {
    fa_dkv_tc_body<HS, DROP, true>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- wgmma backward: dK, dV

// flash_bwd_dkv_wg (sm_90a): the dK/dV kernel on warpgroup MMA. The block is one warpgroup and owns
// 64 keys (warp w: key rows 16w + g and 16w + g + 8 of the accumulators); query tiles of 32 stream
// through a cp.async ring from the diagonal to the end. Per query tile:
//   S^T - lse = K Q^T and dPd^T (- D) = V dO^T: wgmma m64n32k8, both operands in shared memory (K, V
//     resident, Q and dO in the ring stage), the accumulators preloaded with -lse (and -D without
//     dropout) per query, as the mma.sync kernels preload theirs;
//   while those run, the threads read Q and dO for their transposes, the B operands of the two
//     products that reduce over queries, and write them over the stage's Q and dO once the products
//     are done: HS rows of 32 queries, the queries of each 8 permuted (position p holds query 2p for
//     p < 4, 2(p - 4) + 1 else) so that the accumulators of S^T serve as A fragments in the order
//     fa_mma_pv uses;
//   P and dS from the accumulators as in flash_bwd_dkv_tc (causal mask, exp2, keep words);
//   dV += Pd^T dO and dK += dS^T Q: wgmma m64nHSk8 with A from registers.
// Shared tiles are K-major in wgmma.cuh's 128-byte swizzle (a row of HS floats as HS/32 slabs, each
// slab [rows][32 floats], 1024-byte aligned); the operands are rounded in place (fa_tf32_mma, Q
// scaled by scale * log2 e) as in the mma.sync kernels, so the scores are the forward's up to the
// order of the sums. Two ring stages and no other buffers keep three blocks on an SM (68 KB, 168
// registers a thread): the warps of one block wait on barriers and wgmma while the others' issue.
template <int HS> struct FaDkvWg {
    static_assert(HS <= 64, "head sizes up to 64 (three blocks an SM)");
    static constexpr int BK = 64;                              // keys of a block: one m64 tile
    static constexpr int BQ = 32;                              // queries of a ring stage
    static constexpr int NS = 2;
    static constexpr int MINB = 3;                             // blocks per SM: 168 registers, 68 KB
    static constexpr int KV = BK * HS * 4;                     // bytes of the K or V tile
    static constexpr int QT = BQ * HS * 4;                     // bytes of a Q or dO tile, and of Q^T or dO^T
    static constexpr int STAGE = 2 * QT + 1024;                // Q (then Q^T), dO (then dO^T), -lse, -D
    static constexpr int OFF_V = KV, OFF_RING = 2 * KV;
    static constexpr int SMEM = OFF_RING + NS * STAGE + 1024;  // + aligning the base to 1024 bytes
};

// byte offset of 16-byte chunk e (row e / (HS/4), chunk e % (HS/4)) of an R x HS tile in the swizzle
template <int R, int HS>
__device__ __forceinline__ unsigned fa_wg_chunk(int e) {
    constexpr int V = HS / 4;
    const int r = e / V, c = e % V;
    return (c >> 3) * (R * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// Copies of R x HS tiles (global row stride `stride` floats) into the swizzled layout by cp.async.
// Thread x copies chunks e = x + 128 i: row x / (HS/4) + i * RPI, chunk x % (HS/4) (a quarter warp
// writes 8 chunks of one row: 8 distinct 16-byte bank groups). src is this thread's first chunk of
// the tile, advanced by the caller from tile to tile; rows >= nvalid are zero-filled.
template <int R, int HS>
struct FaWgStager {
    static constexpr int V = HS / 4, RPI = FA_TC_THREADS / V, N = R / RPI;
    static_assert(FA_TC_THREADS % V == 0 && R % RPI == 0, "whole passes of the block");
    const float* src;
    long long step;                  // RPI rows, in floats
    int r0;

    __device__ __forceinline__ FaWgStager(const float* tile0, long long stride) {
        r0 = threadIdx.x / V;
        src = tile0 + r0 * stride + 4 * (threadIdx.x % V);
        step = RPI * stride;
    }
    __device__ __forceinline__ void copy(unsigned dst, int nvalid) const {
        if (nvalid >= R) {
#pragma unroll
            for (int i = 0; i < N; ++i) cp_async16(dst + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_TC_THREADS), src + i * step, 16);
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const bool ok = r0 + i * RPI < nvalid;
                cp_async16(dst + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_TC_THREADS), ok ? src + i * step : src, ok ? 16 : 0);
            }
        }
    }
};

// the chunks this thread copied (FaWgStager), rounded in place: x -> tf32(x * mul) or tf32(x); all
// loads first (the stores could alias them as far as the compiler knows)
template <int R, int HS, bool SCALE>
__device__ __forceinline__ void fa_wg_round_tile(char* tile, float mul) {
    constexpr int N = R * (HS / 4) / FA_TC_THREADS;
    float4 v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = *reinterpret_cast<const float4*>(tile + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_TC_THREADS));
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (SCALE) { v[i].x *= mul; v[i].y *= mul; v[i].z *= mul; v[i].w *= mul; }
        v[i].x = __uint_as_float(fa_tf32_mma(v[i].x));
        v[i].y = __uint_as_float(fa_tf32_mma(v[i].y));
        v[i].z = __uint_as_float(fa_tf32_mma(v[i].z));
        v[i].w = __uint_as_float(fa_tf32_mma(v[i].w));
        *reinterpret_cast<float4*>(tile + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_TC_THREADS)) = v[i];
    }
}

// The transpose of a rounded 32 x HS stage tile (Q or dO), written over the tile itself: HS rows of
// one 128-byte slab of 32 positions, position 4 pc + i of row d = tile[query 8 (pc >> 1) + (pc & 1)
// + 2 i][d]. Lane l of warp w handles the chunk pc of row d = 32 dg + l for HS / 16 pairs (dg, pc):
// fa_wg_tr_load reads its values (a warp reads one row of a slab: 32 banks), fa_wg_tr_store writes
// them once every thread's loads are done (a quarter warp: 8 rows with distinct d % 8, distinct
// bank groups).
template <int HS>
__device__ __forceinline__ void fa_wg_tr_load(float (&v)[HS / 16][4], const char* src) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < HS / 16; ++j) {
        const int pr = w * (HS / 16) + j, dg = pr >> 3, pc = pr & 7;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = 8 * (pc >> 1) + (pc & 1) + 2 * i;
            v[j][i] = *reinterpret_cast<const float*>(src + dg * (32 * 128) + q * 128 + (((lane >> 2) ^ (q & 7)) << 4) +
                                                      (lane & 3) * 4);
        }
    }
}
template <int HS>
__device__ __forceinline__ void fa_wg_tr_store(char* dst, const float (&v)[HS / 16][4]) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < HS / 16; ++j) {
        const int pr = w * (HS / 16) + j, dg = pr >> 3, pc = pr & 7, d = 32 * dg + lane;
        *reinterpret_cast<float4*>(dst + d * 128 + ((pc ^ (d & 7)) << 4)) = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
    }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_TC_THREADS, FaDkvWg<HS>::MINB) flash_bwd_dkv_wg(FA_ARGS_BWD) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using F = FaDkvWg<HS>;
    constexpr int BK = F::BK, BQ = F::BQ, NS = F::NS, NT = BQ / 8, KS = HS / 8;
    gc_check_smem(F::SMEM);
    extern __shared__ float4 fa_smem4[];
    const unsigned sraw = smem_u32(fa_smem4);
    const unsigned sb = (sraw + 1023u) & ~1023u;               // 1024-byte aligned tiles (the swizzle)
    char* const gb = reinterpret_cast<char*>(fa_smem4) + (sb - sraw);   // the same bytes, generic

    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const FaBlock<HS> fb(qkv, T, H, FaGridY<BK, false>());
    const int k0 = fb.r0;
    const int wk0 = k0 + 16 * w;                               // this warp's first key row
    const long long bhT = fb.bhT;
    const float* dob = fb.row0(dy);
    const float ninf = __int_as_float(0xff800000);
    const int nqt = (T - k0 + BQ - 1) / BQ;                    // query tiles from the diagonal to the end

    // the copies of query tile q0 into ring stage `stage`: Q, dO, lse (threads 0..BQ-1), D (BQ..2BQ-1);
    // the stagers then move on by one tile
    FaWgStager<BQ, HS> qst(fb.q(k0), fb.rs), dst_(dob + (long long)k0 * fb.C, fb.C);
    auto issue = [&](int stage, int q0) {
        const int off = F::OFF_RING + stage * F::STAGE;
        float* vec = reinterpret_cast<float*>(gb + off + 2 * F::QT);
        qst.copy(sb + off, T - q0);
        dst_.copy(sb + off + F::QT, T - q0);
        qst.src += BQ * fb.rs;
        dst_.src += BQ * fb.C;
        fa_cp_vec<BQ, 0>(vec, lse + bhT + q0, T - q0);
        fa_cp_vec<BQ, BQ>(vec + BQ, Dg + bhT + q0, T - q0);
    };
    FaWgStager<BK, HS>(fb.k(k0), fb.rs).copy(sb, T - k0);
    FaWgStager<BK, HS>(fb.v(k0), fb.rs).copy(sb + F::OFF_V, T - k0);
    issue(0, k0);
    fa_cp_commit();
    if (NS == 3) {
        if (nqt > 1) issue(1, k0 + BQ);
        fa_cp_commit();
    }

    float dk[HS / 2], dv[HS / 2];
#pragma unroll
    for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 Th = (u32)((T + 1) / 2);                         // keep-word pairs per row of the [B*H*T, T] mask
    // descriptors of the tiles' first rows; a k step or a ring stage adds its byte offset / 16
    const unsigned long long dK = wg_desc(sb), dV = wg_desc(sb + F::OFF_V), dRing = wg_desc(sb + F::OFF_RING);

    for (int jq = 0; jq < nqt; ++jq) {
        const int stage = jq % NS, q0 = k0 + jq * BQ;
        const int off = F::OFF_RING + stage * F::STAGE;
        char* cur = gb + off;
        float* nv = reinterpret_cast<float*>(cur + 2 * F::QT);  // -lse * log2 e, then -D
        fa_cp_wait<NS - 2>();                                  // this thread's copies of tile jq
        if (jq == 0) {
            fa_wg_round_tile<BK, HS, false>(gb, 1.f);
            fa_wg_round_tile<BK, HS, false>(gb + F::OFF_V, 1.f);
        }
        fa_wg_round_tile<BQ, HS, true>(cur, scale * FA_LOG2E);
        fa_wg_round_tile<BQ, HS, false>(cur + F::QT, 1.f);
        if (threadIdx.x < 2 * BQ) nv[threadIdx.x] *= threadIdx.x < BQ ? -FA_LOG2E : -1.f;
        wg_fence_async_smem();
        __syncthreads();                                       // tile jq in place; every product of tile jq - 1 done
        if (jq + NS - 1 < nqt) issue((jq + NS - 1) % NS, q0 + (NS - 1) * BQ);   // into tile jq - 1's stage
        fa_cp_commit();

        float s[BQ / 2], dp[BQ / 2];                           // S^T, dPd^T: rows keys, columns queries
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const float2 l2 = *reinterpret_cast<const float2*>(nv + 8 * nt + 2 * t);
            const float2 d2 = *reinterpret_cast<const float2*>(nv + BQ + 8 * nt + 2 * t);
            s[4 * nt] = s[4 * nt + 2] = l2.x;
            s[4 * nt + 1] = s[4 * nt + 3] = l2.y;
            dp[4 * nt] = dp[4 * nt + 2] = DROP ? 0.f : d2.x;
            dp[4 * nt + 1] = dp[4 * nt + 3] = DROP ? 0.f : d2.y;
        }
        wg_fence_acc(s);
        wg_fence_acc(dp);
        wg_fence();
        const unsigned long long dQ = dRing + (unsigned)(stage * (F::STAGE >> 4)), dO = dQ + (F::QT >> 4);
#pragma unroll
        for (int k8 = 0; k8 < KS; ++k8) {
            const unsigned ko = ((k8 >> 2) * (BK * 128) + 32 * (k8 & 3)) >> 4, qo = ((k8 >> 2) * (BQ * 128) + 32 * (k8 & 3)) >> 4;
            wg_mma_tf32<BQ>(s, dK + ko, dQ + qo);                                                // S^T - lse
        }
#pragma unroll
        for (int k8 = 0; k8 < KS; ++k8) {
            const unsigned ko = ((k8 >> 2) * (BK * 128) + 32 * (k8 & 3)) >> 4, qo = ((k8 >> 2) * (BQ * 128) + 32 * (k8 & 3)) >> 4;
            wg_mma_tf32<BQ>(dp, dV + ko, dO + qo);                                               // dPd^T (- D)
        }
        wg_commit();
        wg_fence_acc(s);
        wg_fence_acc(dp);
        float tv[HS / 16][4];                                  // Q^T, then dO^T: read, then written over
        fa_wg_tr_load<HS>(tv, cur);                            // Q (dO) once every warp's products on
        wg_wait<0>();                                          // it and every thread's reads are done
        wg_fence_acc(s);
        wg_fence_acc(dp);
        __syncthreads();
        fa_wg_tr_store<HS>(cur, tv);
        fa_wg_tr_load<HS>(tv, cur + F::QT);
        __syncthreads();
        fa_wg_tr_store<HS>(cur + F::QT, tv);
        wg_fence_async_smem();
        __syncthreads();                                       // Q^T and dO^T written

        const bool edge = q0 < wk0 + 15 || q0 + BQ > T;        // a query before a key of the warp, or past T
        u32 pa[NT][4], sa[NT][4];                              // Pd^T and dS^T / scale as A fragments
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            // keys jk (row g) and jk ^ 1 (row g ^ 1: lane ^ 4) share the keep words of queries
            // iq0 = q0 + 8nt + 2t and iq0 + 1, as in flash_bwd_dkv_tc
            u32 kw[2][2] = {{0, 0}, {0, 0}};
            if (DROP) {
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int jk = wk0 + g + 8 * hh;
                    const u32 mine = gc_keep_word(key, (u32)(bhT + q0 + 8 * nt + 2 * t + (g & 1)) * Th + (u32)(jk >> 1));
                    const u32 other = __shfl_xor_sync(0xffffffffu, mine, 4);
                    kw[hh][0] = (g & 1) ? other : mine;
                    kw[hh][1] = (g & 1) ? mine : other;
                }
            }
            float pv[4], sv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[4 * nt + e];
                if (edge) {
                    const int iq = q0 + 8 * nt + 2 * t + (e & 1);
                    if (wk0 + g + 8 * (e >> 1) > iq || iq >= T) x = ninf;
                }
                const float pe = fa_exp2(x);
                float gv = dp[4 * nt + e];
                float pd = pe;
                if (DROP) {
                    const bool kp = gc_keep_half(kw[e >> 1][e & 1], g & 1) >= threshold;
                    gv = (kp ? gv * inv_keep : 0.f) + nv[BQ + 8 * nt + 2 * t + (e & 1)];
                    pd = kp ? pe * inv_keep : 0.f;
                }
                pv[e] = pd;
                sv[e] = pe * gv;
            }
            // accumulator pairs (query 2t, 2t + 1 of rows g, g + 8) -> k positions t and t + 4
            pa[nt][0] = fa_tf32_mma(pv[0]); pa[nt][1] = fa_tf32_mma(pv[2]);
            pa[nt][2] = fa_tf32_mma(pv[1]); pa[nt][3] = fa_tf32_mma(pv[3]);
            sa[nt][0] = fa_tf32_mma(sv[0]); sa[nt][1] = fa_tf32_mma(sv[2]);
            sa[nt][2] = fa_tf32_mma(sv[1]); sa[nt][3] = fa_tf32_mma(sv[3]);
        }
        wg_fence_acc(dv);
        wg_fence_acc(dk);
        wg_fence();
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            wg_mma_tf32_rs<HS>(dv, pa[nt], dO + 2 * nt);                                       // dV += Pd^T dO
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            wg_mma_tf32_rs<HS>(dk, sa[nt], dQ + 2 * nt);                                       // dK += dS^T Q
        wg_commit();
        wg_wait<0>();
        wg_fence_acc(dv);
        wg_fence_acc(dk);
    }
    fa_cp_wait<0>();

#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int j = wk0 + g + 8 * hh;
        if (j < T) {
            float* row = fb.row3(dqkv, j);
#pragma unroll
            for (int dt = 0; dt < HS / 8; ++dt) {
                const int c = 8 * dt + 2 * t, e = 4 * dt + 2 * hh;
                *reinterpret_cast<float2*>(row + fb.C + c) = make_float2(dk[e] * FA_LN2, dk[e + 1] * FA_LN2);   // Q was scaled
                *reinterpret_cast<float2*>(row + 2 * fb.C + c) = make_float2(dv[e], dv[e + 1]);
            }
        }
    }
#else
    __trap();   // wgmma exists on sm_90a only; the launcher picks this kernel there only
#endif
}
