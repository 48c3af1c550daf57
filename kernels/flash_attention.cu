// Fused causal self-attention ("flash" attention): the T x T scores never reach global memory.
//
//   flash_fwd*       one block per (query tile of 64 rows, b*H + h); loops over the key tiles up to
//                    the diagonal (causality is the loop bound; only tiles that cross the diagonal
//                    are masked), online softmax (running max m and sum l per row, O rescaled when
//                    the max rises, divided by l once at the end). Reads q, k, v straight from
//                    qkv [B,T,3C], writes y [B,T,C] and lse [B,H,T] = m + log(l) (scaled scores).
//   flash_rowsum_do  D[b,h,t] = sum_d dy * y over the head's columns (= rowsum(P * dP), also with dropout)
//   flash_bwd_dq*    one block per (query tile, b*H + h): P = exp(S*scale - lse) rebuilt per key tile,
//                    dS = P * (dP - D) * scale, dQ += dS K.
//   flash_bwd_dkv*   one block per (key tile, b*H + h): S^T = K Q^T computed directly, loops over the
//                    query tiles from the diagonal down: dV += Pd^T dO, dK += dS^T Q.
//   No atomics: every output element is written by exactly one thread; deterministic.
//
// Dropout (DROP): the keep bit of probability (b,h,i,j) is gc_keep(gc_key(seed, step, site), idx),
// idx = ((b*H + h)*T + i)*T + j mod 2^32, the same as the unfused path and rng.dropout_mask.
// The forward applies it to P before P V (the row sum l is of the undropped P); the backward
// uses Pd = P*keep/(1-p) for dV and dP = dPd*keep/(1-p) for dS.
//
// Two compute policies share the kernel bodies:
//   FaSimt  fp32 FMAs. 128 threads = 16 row groups x 8 column groups; a thread owns RM rows
//           (g*RM + rr) and RN columns (c + 8*jj) of a tile product; P goes through a per-warp
//           slice of shared memory for P V.
//   FaTc    TF32 tensor cores, mma.sync.m16n8k8 (operands rounded with cvt.rna.tf32.f32: tiles once
//           when they are stored to shared memory, P in registers before each P V). 4 warps
//           of 16 rows; a thread owns the accumulator fragment (rows g, g+8; columns 8n + 2t + {0,1}).
//           The S accumulator is the A operand of P V straight from registers: the k index of the
//           A fragment is permuted (k = t <-> column 2t, k = t+4 <-> column 2t+1) and the V
//           fragment is read with the same permutation, so no data moves between lanes at all
//           (a zero-shuffle register transpose); P never touches shared memory.
// Tiles live in shared memory row-major with a row stride of HS+4 floats: conflict-free for the
// access patterns of both policies. Rows past T are zero-filled and their scores masked.
// Exponentials run in base 2 (scores pre-multiplied by scale*log2(e)); lse is stored in natural log.
#include "common.cuh"

#define FA_THREADS 128
#define FA_BR 64            // rows of a block's tile (queries in fwd/dq, keys in dkv)

// ------------------------------------------------------------------------------- helpers

__device__ __forceinline__ u32 fa_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// d += a * b on a 16x8x8 tile (row.col, tf32 inputs, f32 accumulate)
__device__ __forceinline__ void fa_mma(float& d0, float& d1, float& d2, float& d3,
                                       u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void fa_check_smem(unsigned need_bytes) {
    unsigned have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need_bytes) __trap();      // launcher and kernel disagree on the tile plan
}

// ROWS x HS tile, global row-major with row stride `stride` floats, into shared memory with row
// stride HS+4; rows >= nvalid are zero-filled (so masked products stay finite).
// With CVT the values are stored already rounded to tf32 (cvt.rna), so the mma loops only load.
template <int ROWS, int HS, bool CVT>
__device__ __forceinline__ void fa_load_tile(float* __restrict__ dst, const float* __restrict__ src,
                                             long long stride, int nvalid) {
    constexpr int V = HS / 4;
    for (int e = threadIdx.x; e < ROWS * V; e += FA_THREADS) {
        int r = e / V;
        int c = (e - r * V) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r < nvalid) v = __ldg(reinterpret_cast<const float4*>(src + r * stride + c));
        if (CVT) {
            v.x = __uint_as_float(fa_tf32(v.x));
            v.y = __uint_as_float(fa_tf32(v.y));
            v.z = __uint_as_float(fa_tf32(v.z));
            v.w = __uint_as_float(fa_tf32(v.w));
        }
        *reinterpret_cast<float4*>(dst + r * (HS + 4) + c) = v;
    }
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
    static constexpr bool CVT = false;      // tiles stay fp32
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

template <int BR, int BC>
struct FaTc {
    static_assert(BR == 16 * (FA_THREADS / 32) && BC % 8 == 0, "tile");
    static constexpr int RM = 2;
    static constexpr int RN = BC / 4;
    static constexpr bool USES_PBUF = false;
    static constexpr bool CVT = true;       // tiles are stored rounded to tf32
    static constexpr int OCDIV = 4;

    __device__ static int row(int rr) { return (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2) + 8 * rr; }
    __device__ static int col(int jj) { return (jj >> 1) * 8 + 2 * (threadIdx.x & 3) + (jj & 1); }
    __device__ static bool leader() { return (threadIdx.x & 3) == 0; }
    __device__ static float rmax(float x) {
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
        return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    }
    __device__ static float rsum(float x) {
        x += __shfl_xor_sync(0xffffffffu, x, 1);
        return x + __shfl_xor_sync(0xffffffffu, x, 2);
    }

    // acc (16 x BC per warp) += A (warp's 16 rows x HS) * B^T (B: BC x HS); smem stride HS+4
    template <int HS>
    __device__ static void abt(float (&acc)[RM][RN], const float* __restrict__ A, const float* __restrict__ B) {
        constexpr int LD = HS + 4;
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const float* a = A + ((threadIdx.x >> 5) * 16 + g) * LD + t;
        const float* b = B + g * LD + t;
#pragma unroll
        for (int k = 0; k < HS; k += 8) {
            u32 a0 = __float_as_uint(a[k]), a1 = __float_as_uint(a[8 * LD + k]);
            u32 a2 = __float_as_uint(a[k + 4]), a3 = __float_as_uint(a[8 * LD + k + 4]);
#pragma unroll
            for (int n = 0; n < BC / 8; ++n) {
                u32 b0 = __float_as_uint(b[n * 8 * LD + k]), b1 = __float_as_uint(b[n * 8 * LD + k + 4]);
                fa_mma(acc[0][2 * n], acc[0][2 * n + 1], acc[1][2 * n], acc[1][2 * n + 1], a0, a1, a2, a3, b0, b1);
            }
        }
    }

    // acc (16 x HS per warp) += P (16 x BC, this thread's accumulator fragment) * V (BC x HS, smem)
    template <int HS>
    __device__ static void pv(float (&acc)[RM][HS / 4], const float (&p)[RM][RN], float* /*pbuf*/,
                              const float* __restrict__ V) {
        constexpr int LD = HS + 4;
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const float* v = V + (2 * t) * LD + g;
#pragma unroll
        for (int n = 0; n < BC / 8; ++n) {
            // A fragment k = t <-> P column 8n + 2t, k = t + 4 <-> column 8n + 2t + 1
            u32 a0 = fa_tf32(p[0][2 * n]), a1 = fa_tf32(p[1][2 * n]);
            u32 a2 = fa_tf32(p[0][2 * n + 1]), a3 = fa_tf32(p[1][2 * n + 1]);
            const float* vn = v + n * 8 * LD;
#pragma unroll
            for (int d = 0; d < HS / 8; ++d) {
                u32 b0 = __float_as_uint(vn[d * 8]), b1 = __float_as_uint(vn[LD + d * 8]);
                fa_mma(acc[0][2 * d], acc[0][2 * d + 1], acc[1][2 * d], acc[1][2 * d + 1], a0, a1, a2, a3, b0, b1);
            }
        }
    }

    template <int HS>
    __device__ static void store_row(float* __restrict__ dst, const float (&acc)[HS / 4], float s) {
        const int t = threadIdx.x & 3;
#pragma unroll
        for (int d = 0; d < HS / 8; ++d)
            *reinterpret_cast<float2*>(dst + d * 8 + 2 * t) = make_float2(acc[2 * d] * s, acc[2 * d + 1] * s);
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

// ------------------------------------------------------------------------------- forward

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_fwd_body(float* __restrict__ y, float* __restrict__ lse,
                                            const float* __restrict__ qkv, const StepState* __restrict__ st,
                                            u32 seed, u32 site, u32 threshold, float inv_keep, float scale,
                                            int T, int H) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BKF, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    fa_check_smem(FaSmem<HS, P::USES_PBUF>::fwd * 4);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* Ks = Qs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const int C = H * HS;
    const long long rs = 3LL * C;
    const int qt = gridDim.x - 1 - blockIdx.x;        // the longest (most key tiles) first
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int q0 = qt * BR;
    const float* qb = qkv + (long long)b * T * rs + h * HS;
    const float* kb = qb + C;
    const float* vb = qb + 2 * C;
    const float ninf = __int_as_float(0xff800000);
    const float sl2 = scale * FA_LOG2E;

    fa_load_tile<BR, HS, P::CVT>(Qs, qb + q0 * rs, rs, T - q0);

    float m[RM], l[RM], o[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        m[rr] = ninf;
        l[rr] = 0.f;
        rbase[rr] = (u32)(bh * T + q0 + P::row(rr)) * (u32)T;
#pragma unroll
        for (int e = 0; e < OC; ++e) o[rr][e] = 0.f;
    }
    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);

    const int qlast = min(q0 + BR, T) - 1;             // keys beyond the last query row are never visited
    for (int k0 = 0; k0 <= qlast; k0 += BC) {
        __syncthreads();
        fa_load_tile<BC, HS, P::CVT>(Ks, kb + k0 * rs, rs, T - k0);
        fa_load_tile<BC, HS, P::CVT>(Vs, vb + k0 * rs, rs, T - k0);
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
                if (DROP) pe = gc_keep(key, rbase[rr] + (u32)(k0 + P::col(jj)), threshold) ? pe * inv_keep : 0.f;
                s[rr][jj] = pe;
            }
            l[rr] = l[rr] * alpha + rowsum;           // thread-partial sum, reduced once at the end
#pragma unroll
            for (int e = 0; e < OC; ++e) o[rr][e] *= alpha;
        }
        P::template pv<HS>(o, s, Pb, Vs);
    }

    const int C1 = H * HS;
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const float L = P::rsum(l[rr]);
        const int i = q0 + P::row(rr);
        if (i < T) {
            P::template store_row<HS>(y + ((long long)b * T + i) * C1 + h * HS, o[rr], 1.f / L);
            if (P::leader()) lse[(long long)bh * T + i] = m[rr] * FA_LN2 + logf(L);
        }
    }
}

#define FA_ARGS_FWD                                                                                  \
    float* __restrict__ y,               /* [B,T,C] */                                               \
    float* __restrict__ lse,             /* [B,H,T] log-sum-exp of the scaled scores */              \
    const float* __restrict__ qkv,       /* [B,T,3C] */                                              \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float inv_keep, float scale, \
    int T, int H

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd(FA_ARGS_FWD) {
    fa_fwd_body<FaSimt<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_fwd_tc(FA_ARGS_FWD) {
    fa_fwd_body<FaTc<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- D = rowsum(dO * O)

// one warp per (b, t, h) row, in that order (neighbouring warps read neighbouring heads)
__global__ void __launch_bounds__(256)
flash_rowsum_do(float* __restrict__ D,          // [B,H,T]
                const float* __restrict__ dy,   // [B,T,C]
                const float* __restrict__ y,    // [B,T,C]
                int rows, int T, int H, int hs) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int h = r % H;
    const int bt = r / H;
    const int t = bt % T, b = bt / T;
    const long long off = (long long)bt * H * hs + h * hs;
    float acc = 0.f;
    for (int d = lane; d < hs; d += 32) acc = fmaf(dy[off + d], y[off + d], acc);
    acc = gc_warp_sum(acc);
    if (lane == 0) D[((long long)b * H + h) * T + t] = acc;
}

// ------------------------------------------------------------------------------- backward: dQ

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dq_body(float* __restrict__ dqkv, const float* __restrict__ qkv,
                                           const float* __restrict__ dy, const float* __restrict__ lse,
                                           const float* __restrict__ Dg, const StepState* __restrict__ st,
                                           u32 seed, u32 site, u32 threshold, float inv_keep, float scale,
                                           int T, int H) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BKF, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    fa_check_smem(FaSmem<HS, P::USES_PBUF>::dq * 4);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* dOs = Qs + BR * LD;
    float* Ks = dOs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const int C = H * HS;
    const long long rs = 3LL * C;
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const int q0 = qt * BR;
    const float* qb = qkv + (long long)b * T * rs + h * HS;
    const float* kb = qb + C;
    const float* vb = qb + 2 * C;
    const float sl2 = scale * FA_LOG2E;

    fa_load_tile<BR, HS, P::CVT>(Qs, qb + q0 * rs, rs, T - q0);
    fa_load_tile<BR, HS, P::CVT>(dOs, dy + ((long long)b * T + q0) * C + h * HS, C, T - q0);

    float lr[RM], dr[RM], dq[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int i = q0 + P::row(rr);
        lr[rr] = i < T ? lse[(long long)bh * T + i] * FA_LOG2E : 0.f;     // log2 units
        dr[rr] = i < T ? Dg[(long long)bh * T + i] : 0.f;
        rbase[rr] = (u32)(bh * T + i) * (u32)T;
#pragma unroll
        for (int e = 0; e < OC; ++e) dq[rr][e] = 0.f;
    }
    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);

    const int qlast = min(q0 + BR, T) - 1;
    for (int k0 = 0; k0 <= qlast; k0 += BC) {
        __syncthreads();
        fa_load_tile<BC, HS, P::CVT>(Ks, kb + k0 * rs, rs, T - k0);
        fa_load_tile<BC, HS, P::CVT>(Vs, vb + k0 * rs, rs, T - k0);
        __syncthreads();

        float s[RM][RN], dp[RM][RN];
#pragma unroll
        for (int rr = 0; rr < RM; ++rr)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[rr][jj] = dp[rr][jj] = 0.f;
        P::template abt<HS>(s, Qs, Ks);
        P::template abt<HS>(dp, dOs, Vs);

#pragma unroll
        for (int rr = 0; rr < RM; ++rr) {
            const int i = q0 + P::row(rr);
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) {
                const int j = k0 + P::col(jj);
                const bool valid = j <= i && j < T && i < T;
                const float pe = valid ? exp2f(fmaf(s[rr][jj], sl2, -lr[rr])) : 0.f;
                float g = dp[rr][jj];
                if (DROP) g = gc_keep(key, rbase[rr] + (u32)j, threshold) ? g * inv_keep : 0.f;
                s[rr][jj] = pe * (g - dr[rr]) * scale;
            }
        }
        P::template pv<HS>(dq, s, Pb, Ks);
    }

#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int i = q0 + P::row(rr);
        if (i < T) P::template store_row<HS>(dqkv + ((long long)b * T + i) * rs + h * HS, dq[rr], 1.f);
    }
}

#define FA_ARGS_BWD                                                                                  \
    float* __restrict__ dqkv,            /* [B,T,3C] */                                              \
    const float* __restrict__ qkv,       /* [B,T,3C] */                                              \
    const float* __restrict__ dy,        /* [B,T,C] */                                               \
    const float* __restrict__ lse,       /* [B,H,T] */                                               \
    const float* __restrict__ Dg,        /* [B,H,T] rowsum(dy * y) */                                \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float inv_keep, float scale, \
    int T, int H

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dq(FA_ARGS_BWD) {
    fa_dq_body<FaSimt<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                          inv_keep, scale, T, H);
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dq_tc(FA_ARGS_BWD) {
    fa_dq_body<FaTc<FA_BR, FaTiles<HS>::BKF>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                        inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- backward: dK, dV

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dkv_body(float* __restrict__ dqkv, const float* __restrict__ qkv,
                                            const float* __restrict__ dy, const float* __restrict__ lse,
                                            const float* __restrict__ Dg, const StepState* __restrict__ st,
                                            u32 seed, u32 site, u32 threshold, float inv_keep, float scale,
                                            int T, int H) {
    constexpr int BR = FA_BR, BC = FaTiles<HS>::BQB, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    fa_check_smem(FaSmem<HS, P::USES_PBUF>::dkv * 4);
    extern __shared__ float4 fa_smem4[];
    float* Ks = reinterpret_cast<float*>(fa_smem4);
    float* Vs = Ks + BR * LD;
    float* Qs = Vs + BR * LD;
    float* dOs = Qs + BC * LD;
    float* Ls = dOs + BC * LD;
    float* Ds = Ls + BC;
    float* Pb = Ds + BC;

    const int C = H * HS;
    const long long rs = 3LL * C;
    const int k0 = blockIdx.x * BR;                    // key tiles near the start see the most queries
    const int bh = blockIdx.y, b = bh / H, h = bh - b * H;
    const float* qb = qkv + (long long)b * T * rs + h * HS;
    const float* kb = qb + C;
    const float* vb = qb + 2 * C;
    const float* dob = dy + (long long)b * T * C + h * HS;
    const float sl2 = scale * FA_LOG2E;

    fa_load_tile<BR, HS, P::CVT>(Ks, kb + k0 * rs, rs, T - k0);
    fa_load_tile<BR, HS, P::CVT>(Vs, vb + k0 * rs, rs, T - k0);

    float dk[RM][OC], dv[RM][OC];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr)
#pragma unroll
        for (int e = 0; e < OC; ++e) dk[rr][e] = dv[rr][e] = 0.f;
    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);

    for (int q0 = (k0 / BC) * BC; q0 < T; q0 += BC) {  // query tiles from the diagonal to the end
        __syncthreads();
        fa_load_tile<BC, HS, P::CVT>(Qs, qb + q0 * rs, rs, T - q0);
        fa_load_tile<BC, HS, P::CVT>(dOs, dob + (long long)q0 * C, C, T - q0);
        for (int e = threadIdx.x; e < BC; e += FA_THREADS) {
            const int i = q0 + e;
            Ls[e] = i < T ? lse[(long long)bh * T + i] * FA_LOG2E : 0.f;     // log2 units
            Ds[e] = i < T ? Dg[(long long)bh * T + i] : 0.f;
        }
        __syncthreads();

        float s[RM][RN], dp[RM][RN];                   // S^T and dPd^T: rows keys, columns queries
#pragma unroll
        for (int rr = 0; rr < RM; ++rr)
#pragma unroll
            for (int jj = 0; jj < RN; ++jj) s[rr][jj] = dp[rr][jj] = 0.f;
        P::template abt<HS>(s, Ks, Qs);
        P::template abt<HS>(dp, Vs, dOs);

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
                    const bool kp = gc_keep(key, (u32)(bh * T + i) * (u32)T + (u32)j, threshold);
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
            float* row = dqkv + ((long long)b * T + j) * rs + h * HS;
            P::template store_row<HS>(row + C, dk[rr], 1.f);
            P::template store_row<HS>(row + 2 * C, dv[rr], 1.f);
        }
    }
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkv(FA_ARGS_BWD) {
    fa_dkv_body<FaSimt<FA_BR, FaTiles<HS>::BQB>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                           inv_keep, scale, T, H);
}

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS) flash_bwd_dkv_tc(FA_ARGS_BWD) {
    fa_dkv_body<FaTc<FA_BR, FaTiles<HS>::BQB>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                         inv_keep, scale, T, H);
}
