// The FFMA flash kernels: flash_fwd, flash_bwd_dq, flash_bwd_dkv (fp32), the FaSimt policy with
// fp32 FMAs: 128 threads = 16 row groups x 8 column groups; a thread owns RM rows (g*RM + rr) and RN
// columns (c + 8*jj) of a tile product; P goes through a per-warp slice of shared memory for P V.
// BR-row tiles (queries in fwd/dq, keys in dkv) against BC-row tiles of the other side (keys in
// fwd/dq, queries in dkv), synchronous tile loads; shared-memory tiles are row-major with a row
// stride of HS+4 floats (conflict-free for its patterns). What the kernels compute: flash_common.cuh.
#include "flash_common.cuh"

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

// ------------------------------------------------------------------------------- policies

// BR x BC tile products of FA_THREADS = 16 x 8 threads (BR rows: the block's side, BC: the other's)
template <int BR_, int BC_>
struct FaSimt {
    static constexpr int BR = BR_, BC = BC_;
    static_assert(BR % 16 == 0 && BC % 8 == 0 && FA_THREADS == 16 * 8, "tile");
    static constexpr int RM = BR / 16;
    static constexpr int RN = BC / 8;
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

// Shared memory (bytes) of each kernel's layout: BR-row tiles of the block's side (Q in fwd; Q, dO in
// dq; K, V in dkv), two BC-row tiles of the other side (K, V; Q, dO and lse, D in dkv), and the P
// staging buffer, BR x (BC + 4). The kernels static_assert that the launcher's SMEM is this.
template <int HS, int BR, int BC> struct FaSimtSmem {
    static constexpr int LD = HS + 4;
    static constexpr int fwd = 4 * ((BR + 2 * BC) * LD + BR * (BC + 4));
    static constexpr int dq = 4 * ((2 * BR + 2 * BC) * LD + BR * (BC + 4));
    static constexpr int dkv = 4 * ((2 * BR + 2 * BC) * LD + 2 * BC + BR * (BC + 4));
};

// The kernels' template arguments after <HS, DROP> are the launcher's plan (attention.py): the block's
// threads, BR, BC and the shared memory (bytes)
#define FA_SIMT_PLAN int THREADS, int BR, int BC, int SMEM
#define FA_SIMT_CHECK(kind) static_assert(THREADS == FA_THREADS && SMEM == FaSimtSmem<HS, BR, BC>::kind, \
                                          "the launcher's plan: FA_THREADS threads, the layout's shared memory")


// ------------------------------------------------------------------------------- forward

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_fwd_body(FA_ARGS_FWD) {
    constexpr int BR = P::BR, BC = P::BC, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSimtSmem<HS, BR, BC>::fwd);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* Ks = Qs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const float ninf = __int_as_float(0xff800000);
    const float sl2 = scale * GC_LOG2E;

    fa_load_tile<BR, HS>(Qs, fb.q(q0), fb.rs, T - q0);

    float m[RM], l[RM], o[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        m[rr] = ninf;
        l[rr] = 0.f;
        rbase[rr] = (u32)(bh * T + q0 + P::row(rr)) * gc_att_words(T);
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
                if (DROP) pe = gc_keep_att(key, rbase[rr], (u32)(k0 + P::col(jj)), threshold) ? pe * inv_keep : 0.f;
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

template <int HS, bool DROP, FA_SIMT_PLAN>
__global__ void __launch_bounds__(THREADS) flash_fwd(FA_ARGS_FWD) {
    FA_SIMT_CHECK(fwd);
    fa_fwd_body<FaSimt<BR, BC>, HS, DROP>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}
// ------------------------------------------------------------------------------- backward: dQ

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dq_body(FA_ARGS_BWD) {
    constexpr int BR = P::BR, BC = P::BC, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSimtSmem<HS, BR, BC>::dq);
    extern __shared__ float4 fa_smem4[];
    float* Qs = reinterpret_cast<float*>(fa_smem4);
    float* dOs = Qs + BR * LD;
    float* Ks = dOs + BR * LD;
    float* Vs = Ks + BC * LD;
    float* Pb = Vs + BC * LD;

    const FaBlock<HS> fb(qkv, T, H, FaGridY<BR, true>());
    const int bh = fb.bh, q0 = fb.r0;
    const float sl2 = scale * GC_LOG2E;

    fa_load_tile<BR, HS>(Qs, fb.q(q0), fb.rs, T - q0);
    fa_load_tile<BR, HS>(dOs, fb.row(dy, q0), fb.C, T - q0);

    float lr[RM], dr[RM], dq[RM][OC];
    u32 rbase[RM];
#pragma unroll
    for (int rr = 0; rr < RM; ++rr) {
        const int i = q0 + P::row(rr);
        lr[rr] = i < T ? lse[(long long)bh * T + i] * GC_LOG2E : 0.f;     // log2 units
        dr[rr] = i < T ? Dg[(long long)bh * T + i] : 0.f;
        rbase[rr] = (u32)(bh * T + i) * gc_att_words(T);
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
                if (DROP) g = gc_keep_att(key, rbase[rr], (u32)j, threshold) ? g * inv_keep : 0.f;
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

template <int HS, bool DROP, FA_SIMT_PLAN>
__global__ void __launch_bounds__(THREADS) flash_bwd_dq(FA_ARGS_BWD) {
    FA_SIMT_CHECK(dq);
    fa_dq_body<FaSimt<BR, BC>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                          inv_keep, scale, T, H);
}

// ------------------------------------------------------------------------------- backward: dK, dV

template <class P, int HS, bool DROP>
__device__ __forceinline__ void fa_dkv_body(FA_ARGS_BWD) {
    constexpr int BR = P::BR, BC = P::BC, LD = HS + 4, RM = P::RM, RN = P::RN, OC = HS / P::OCDIV;
    gc_check_smem(FaSimtSmem<HS, BR, BC>::dkv);
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
    const float sl2 = scale * GC_LOG2E;

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
            Ls[e] = i < T ? lse[(long long)bh * T + i] * GC_LOG2E : 0.f;     // log2 units
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
                    const bool kp = gc_keep_att(key, (u32)(bh * T + i) * gc_att_words(T), (u32)j, threshold);
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

template <int HS, bool DROP, FA_SIMT_PLAN>
__global__ void __launch_bounds__(THREADS) flash_bwd_dkv(FA_ARGS_BWD) {
    FA_SIMT_CHECK(dkv);
    fa_dkv_body<FaSimt<BR, BC>, HS, DROP>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold,
                                                           inv_keep, scale, T, H);
}

