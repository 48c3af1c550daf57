// flash_bwd_dkv_wg: the tf32 flash backward's dK/dV on warpgroup MMA (sm_90a, head sizes up to 64).
#include "flash_common.cuh"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"
#endif

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
// The launcher's plan (attention.py flash_dkv_wg_plan) after <HS, DROP>: the block's threads, BK keys
// of a block, BQ queries of a ring stage, NS ring stages, the shared memory (bytes): one warpgroup,
// one m64 tile of keys, query tiles of one 128-byte slab (the transposes), and the layout's bytes.
template <int HS, int BK_, int BQ_, int NS_> struct FaDkvWg {
    static_assert(HS <= 64, "head sizes up to 64 (three blocks an SM)");
    static constexpr int BK = BK_;                             // keys of a block: one m64 tile
    static constexpr int BQ = BQ_;                             // queries of a ring stage
    static constexpr int NS = NS_;
    static_assert(BK == 64 && BQ == 32 && (NS == 2 || NS == 3), "one m64 tile of keys, 32 queries a stage");
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
    static constexpr int V = HS / 4, RPI = FA_THREADS / V, N = R / RPI;
    static_assert(FA_THREADS % V == 0 && R % RPI == 0, "whole passes of the block");
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
            for (int i = 0; i < N; ++i) cp_async16(dst + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_THREADS), src + i * step, 16);
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const bool ok = r0 + i * RPI < nvalid;
                cp_async16(dst + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_THREADS), ok ? src + i * step : src, ok ? 16 : 0);
            }
        }
    }
};

// the chunks this thread copied (FaWgStager), rounded in place: x -> tf32(x * mul) or tf32(x); all
// loads first (the stores could alias them as far as the compiler knows)
template <int R, int HS, bool SCALE>
__device__ __forceinline__ void fa_wg_round_tile(char* tile, float mul) {
    constexpr int N = R * (HS / 4) / FA_THREADS;
    float4 v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = *reinterpret_cast<const float4*>(tile + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_THREADS));
#pragma unroll
    for (int i = 0; i < N; ++i) {
        if (SCALE) { v[i].x *= mul; v[i].y *= mul; v[i].z *= mul; v[i].w *= mul; }
        v[i].x = __uint_as_float(fa_tf32_mma(v[i].x));
        v[i].y = __uint_as_float(fa_tf32_mma(v[i].y));
        v[i].z = __uint_as_float(fa_tf32_mma(v[i].z));
        v[i].w = __uint_as_float(fa_tf32_mma(v[i].w));
        *reinterpret_cast<float4*>(tile + fa_wg_chunk<R, HS>(threadIdx.x + i * FA_THREADS)) = v[i];
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

template <int HS, bool DROP, int THREADS, int BK_, int BQ_, int NS_, int SMEM>
__global__ void __launch_bounds__(THREADS, FaDkvWg<HS, BK_, BQ_, NS_>::MINB) flash_bwd_dkv_wg(FA_ARGS_BWD) {
    using F = FaDkvWg<HS, BK_, BQ_, NS_>;
    static_assert(THREADS == FA_THREADS && SMEM == F::SMEM, "the launcher's plan: one warpgroup, the layout's bytes");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
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
    const u32 W = gc_att_words(T);                             // keep words a row of the [B*H*T, T] mask
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
        fa_wg_round_tile<BQ, HS, true>(cur, scale * GC_LOG2E);
        fa_wg_round_tile<BQ, HS, false>(cur + F::QT, 1.f);
        if (threadIdx.x < 2 * BQ) nv[threadIdx.x] *= threadIdx.x < BQ ? -GC_LOG2E : -1.f;
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
            // keys g, g + 8 (row g) and g ^ 1, g ^ 1 + 8 (row g ^ 1: lane ^ 4) take bytes of one keep
            // word of query iq0 = q0 + 8nt + 2t (and one of iq0 + 1), as in flash_bwd_dkv_tc
            u32 kw[2] = {0, 0};
            if (DROP) {
                gc_att_pair_words(gc_keep_word(key, (u32)(bhT + q0 + 8 * nt + 2 * t + (g & 1)) * W +
                                                        gc_att_quad((u32)(wk0 + g))), (u32)(g & 1), kw);
            }
            float pv[4], sv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[4 * nt + e];
                if (edge) {
                    const int iq = q0 + 8 * nt + 2 * t + (e & 1);
                    if (wk0 + g + 8 * (e >> 1) > iq || iq >= T) x = ninf;
                }
                const float pe = gc_exp2(x);
                float gv = dp[4 * nt + e];
                float pd = pe;
                if (DROP) {
                    const bool kp = gc_keep_byte(kw[e & 1], 2u * (e >> 1), threshold);
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