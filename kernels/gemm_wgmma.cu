// TF32 and BF16 GEMMs on Hopper's warpgroup MMA (wgmma, sm_90a): C = alpha * A B^T (+ bias) (+ epilogue).
// TF32: A [batch, M, K] and B [batch, N, K] both K-major (row-major with k contiguous): wgmma reads
// 32-bit operands from shared memory only in that orientation, so these kernels serve the x @ W^T
// products (trans_a = false, trans_b = true), the others after a re-layout or through registers
// (gemm_wgmma_ra). BF16 (gemm_wgmma_ws with DT = 1, Bf16Op): any layout as stored, an operand stored
// [K, rows] read MN-major through the instruction's transpose bits; C and aux fp32 or bf16 (OUT).
// Arguments, epilogues, batching and split-K are those of gemm_tf32 / gemm_simt (the epilogue
// helpers come from gemm_epilogue.cuh), so the launcher treats it as one more tile family.
//
// Block: BM / 64 warpgroups of 128 threads; warpgroup w computes rows 64 w .. 64 w + 63 of the
// BM x BN tile with wgmma.mma_async m64nBNk8 (one instruction per 8-wide k step, BN / 2 fp32
// accumulators per thread). Every kernel takes its block (THREADS) and dynamic shared memory (SMEM,
// bytes) as its last template arguments, chosen in gptcuda/ops/cuda/gemm/families.py and asserted. The tensor core reads the operands' top 19 bits (tf32, truncated):
// nothing converts them on the way from global memory to the instruction. Its fp32 accumulation
// truncates too (round toward zero). gemm_wgmma3_ra (below) is the fp32 form (3xTF32): A and B as
// they are stored, split into TF32 hi and lo halves (B in shared memory by the producers, A in the
// consumers' registers), three products per k step, each k tile's partial added into the sum on the
// FMA pipe. gemm_wgmma_ra (TF32) reads a weight gradient's A [K, M] as stored through registers
// (register-A wgmma), with no transposing pass.
//
// Shared layout: per stage, the A tile [BM][32] then the B tile [BN][32] (k contiguous, 128 bytes
// a row), in the 128-byte swizzle the instruction's descriptor names: the 16-byte chunk c of
// row r sits at r * 128 + ((c ^ (r % 8)) * 16), with every tile 1024-byte aligned (the swizzle
// acts on address bits 4-6 xor 7-9). The descriptor of k step s starts 32 s bytes into row 0;
// 8-row groups are 1024 bytes apart (stride byte offset). cp.async stages 16-byte chunks: a
// quarter warp writes the 8 chunks of one row (8 distinct bank groups: conflict-free).
//
// Pipeline: a STAGES-deep ring; at most one wgmma group in flight per warpgroup. Iteration kt:
// wait for tile kt's copies, fence them into the async proxy, barrier; refill the slot of tile
// kt - 2 (every warpgroup's wgmma on it finished before the barrier: each waited for all but its
// newest group) with tile kt + STAGES - 2; issue the 4 wgmma of tile kt; commit; wait for the
// group of tile kt - 1. Epilogue: a lane-pair shuffle turns the accumulator pairs into 4
// consecutive columns per thread, stored with the shared epilogue helpers.
#include "gemm_epilogue.cuh"
#include "wgmma.cuh"

#define GEMM_WG_BK 32

// The number of BK-wide k tiles of the block's k range (GemmBlock, gemm_epilogue.cuh).
template <int BK = GEMM_WG_BK>
__device__ __forceinline__ int wg_k_tiles(int klen) { return klen > 0 ? (klen + BK - 1) / BK : 0; }

// The operand type of the warp-specialized product (ws_gemm's OP): a k tile is 128 bytes of every row
// of a K-major operand tile (TF32: 32 k, BF16: 64 k), consumed by 4 instructions (k8 / k16) whose
// descriptors start 32 bytes apart. TF32 reads K-major operands only; BF16 also MN-major ones
// (Bf16Op's MN_A / MN_B: A [K, M], B [K, N] as stored, in boxes of 64 rows of M or N by 64 k, the
// instruction's transpose bits set), whose k steps start 2048 bytes apart (wg_desc_mn).
struct Tf32Op {
    static constexpr int BK = GEMM_WG_BK;
    static constexpr bool MN_A = false, MN_B = false;
    template <int BN>
    static __device__ __forceinline__ void mma(float (&acc)[BN / 2], unsigned a, unsigned b, int s) {
        wg_mma_tf32<BN>(acc, wg_desc(a + 32 * s), wg_desc(b + 32 * s));
    }
};
template <bool A_MN, bool B_MN>
struct Bf16Op {
    static constexpr int BK = 64;
    static constexpr bool MN_A = A_MN, MN_B = B_MN;
    template <int BN>
    static __device__ __forceinline__ void mma(float (&acc)[BN / 2], unsigned a, unsigned b, int s) {
        WgBf16<BN>::template mma<A_MN, B_MN>(acc, A_MN ? wg_desc_mn(a + 2048 * s) : wg_desc(a + 32 * s),
                                             B_MN ? wg_desc_mn(b + 2048 * s) : wg_desc(b + 32 * s));
    }
};
// gemm_wgmma_ws's DT code (bf16.cuh's element codes): 0 fp32 (TF32 products), 1 bf16
template <int DT, bool MN_A, bool MN_B> struct OpOf { using T = Tf32Op; };
template <bool MN_A, bool MN_B> struct OpOf<1, MN_A, MN_B> { using T = Bf16Op<MN_A, MN_B>; };

// gemm_wgmma_ra's row permutation: accumulator (and register-A fragment) rows 16 w + g and 16 w + g + 8
// of warp w, lane 4 g + q, hold the warpgroup's rows ra_row(w, g) and ra_row(w, g) + 1 of the tile.
// Any bijection would do (a row's products do not mix with other rows'); this one makes the
// fragment loads from the MN-major, 128-byte swizzled A tile 8-byte loads without bank conflicts
// (RaFrags).
__device__ __forceinline__ int ra_row(int w, int g) { return 16 * (g >> 1) + 4 * w + 2 * (g & 1); }

// Epilogue of every kernel here: warpgroup wg_of's accumulators (layout of wg_mma_tf32; -1: the calling
// thread's warpgroup), rows m0 + 64 wg_of .. + 63 of the BM x BN tile at (m0, n0), through the shared
// epilogue helpers. Lanes q and q ^ 1 swap halves so that each thread holds 4 consecutive columns: even
// q keeps row g, columns 2q .. 2q + 3 of each n8 block; odd q gets row g + 8, 2 (q - 1) .. + 3.
// RA (gemm_wgmma_ra): the accumulator rows are the register-A fragments' permuted rows (ra_row).
// TO: C's and aux's element type (fp32 or bf16).
template <int BM, int BN, int EPI, bool HAS_BIAS, bool RA = false, class TO = float>
__device__ __forceinline__ void wg_store_tile(const float (&acc)[BN / 2], TO* C, TO* aux, const float* bias,
                                              int M, int N, int ldc, long long sC, int m0, int n0, float alpha,
                                              int wg_of = -1) {
    const int tid = threadIdx.x;
    const int wg = wg_of < 0 ? tid >> 7 : wg_of, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, q = lane & 3;
    const bool odd = q & 1;
    int r = m0 + wg * 64 + warp * 16 + g + (odd ? 8 : 0);
    if constexpr (RA) r = m0 + wg * 64 + ra_row(warp, g) + (odd ? 1 : 0);
    if constexpr (sizeof(TO) == 2) {
        // bf16: each 32 columns' 4 x 4 (lane q, n8 block b) pairs of each of the thread's two rows
        // transposed among the 4 lanes of a row (two xor-shuffle stages: blocks 2 apart, then 1), so that
        // lane q holds columns 8 q .. 8 q + 7 of the group: one 16-byte store a row, a warp's store 8
        // rows x 64 contiguous bytes (whole sectors) instead of 16 rows x 16.
        static_assert(!RA && BN % 32 == 0, "gemm_wgmma_ws / _pp tiles");
        const int rg = m0 + wg * 64 + warp * 16 + g;
        const bool inside = m0 + BM <= M && n0 + BN <= N;
        const bool vec8 = gemm_epi_vec_ok<EPI, HAS_BIAS, TO, 8>(C, aux, bias, ldc, sC);
        const bool hi = q & 2;
        // dgelu's pre-activations of G column groups' rows loaded before any of them is stored: G load
        // latencies overlap (C's stores may alias aux for the compiler, which then keeps each load after
        // the store before it); G divides NJ; the 256-row tile (96 registers) has no room: 1, the loads
        // still ahead of the shuffles. (The residual epilogue keeps its loads in gemm_store_once: grouped,
        // the 128 x 192 tile's residual product ran 13-15% longer on the H200.)
        constexpr bool PRE = EPI == GEMM_EPI_DGELU || EPI == GEMM_EPI_DGELU_GELU;
        constexpr int NJ = BN / 32, G = !PRE || BM >= 256 ? 1 : NJ % 4 == 0 ? 4 : NJ % 3 == 0 ? 3 : 2;
        static_assert(NJ % G == 0, "whole groups");
#pragma unroll
        for (int J0 = 0; J0 < NJ; J0 += G) {
            float in[G][2][8];
#pragma unroll
            for (int j = 0; j < G; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = rg + 8 * h, c = n0 + 32 * (J0 + j) + 8 * q;
                    if constexpr (PRE)
                        gemm_epi_in<EPI>(aux, row, c, M, N, ldc, vec8 && (inside || (row < M && c + 7 < N)), in[j][h]);
                }
#pragma unroll
            for (int j = 0; j < G; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {     // row g + 8 h
                    const int J = J0 + j;
                    float x[4][2];                // [slot][pair]
#pragma unroll
                    for (int b = 0; b < 4; ++b)
#pragma unroll
                        for (int e = 0; e < 2; ++e) x[b][e] = acc[4 * (4 * J + b) + 2 * h + e];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
#pragma unroll
                        for (int b = 0; b < 2; ++b) {         // slots b, b + 2 across lanes q ^ 2
                            const float t = __shfl_xor_sync(0xffffffffu, hi ? x[b][e] : x[b + 2][e], 2);
                            if (hi) x[b][e] = t; else x[b + 2][e] = t;
                        }
#pragma unroll
                        for (int b = 0; b < 4; b += 2) {      // slots b, b + 1 across lanes q ^ 1
                            const float t = __shfl_xor_sync(0xffffffffu, odd ? x[b][e] : x[b + 1][e], 1);
                            if (odd) x[b][e] = t; else x[b + 1][e] = t;
                        }
                    }
                    const float v[8] = {x[0][0], x[0][1], x[1][0], x[1][1], x[2][0], x[2][1], x[3][0], x[3][1]};
                    const int row = rg + 8 * h, c = n0 + 32 * J + 8 * q;
                    gemm_store_once<EPI, HAS_BIAS, TO, 8, PRE>(C, aux, bias, row, c, M, N, ldc, alpha,
                                                                vec8 && (inside || (row < M && c + 7 < N)), v,
                                                                in[j][h]);
                }
        }
        return;
    }
    const int c0 = n0 + 2 * (q & 2);
    const bool vec = gemm_epi_vec_ok<EPI, HAS_BIAS, TO>(C, aux, bias, ldc, sC);
    const bool interior = vec && m0 + BM <= M && n0 + BN <= N;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const float s0 = odd ? acc[4 * j] : acc[4 * j + 2];
        const float s1 = odd ? acc[4 * j + 1] : acc[4 * j + 3];
        const float r0 = __shfl_xor_sync(0xffffffffu, s0, 1);
        const float r1 = __shfl_xor_sync(0xffffffffu, s1, 1);
        float v[4];
        v[0] = odd ? r0 : acc[4 * j];
        v[1] = odd ? r1 : acc[4 * j + 1];
        v[2] = odd ? acc[4 * j + 2] : r0;
        v[3] = odd ? acc[4 * j + 3] : r1;
        const int c = c0 + 8 * j;
        gemm_store4_once<EPI, HAS_BIAS, TO>(C, aux, bias, r, c, M, N, ldc, alpha,
                                        interior || (vec && r < M && c + 3 < N), v);
    }
}
// The bf16 epilogue through shared memory and the copy engine (gemm_wgmma_ws / _pp with a bf16 C whose
// rows the tensor maps can describe: the launcher's c_tma): one warpgroup's 64 rows of the tile at (m0w,
// n0), BN / 32 boxes of 64 rows x 32 columns. A box's values are computed in the accumulators' own layout
// (no shuffles: thread (w, g, q) holds rows 16 w + g (+ 8), columns 8 k + 2 q (+ 1) of the box's n8
// blocks k), rounded in pairs, written by stmatrix into a 4 KB staging box in the 64-byte swizzle (the
// 16-byte chunk c of row r at r * 64 + ((c ^ (r / 2 % 4)) * 16): the 8 rows of each matrix hit 8
// distinct chunks), and stored by one thread's tensor store, which runs on while the warpgroup goes on
// to the next box or tile (rows and columns outside C are clipped by the copy engine). Staging: two
// boxes at stg (C's and, for GELU / the GELU rebuild, aux's; one output alternates between them). The
// thread that issues the stores waits until the store that last read a buffer is done with it before the
// warpgroup (named barrier `bar`) overwrites it. aux (read: residual, pre-activation) comes from global
// memory in the same layout, a 4-byte pair a thread and n8 block, one box ahead.
// The staging boxes of wg_store_tile_tma after the ring: two of 4 KB a consumer warpgroup, where C is bf16
// (wgs warpgroups' worth; consumer warpgroup wg's start ws_stage_bytes(wg, 1) after the ring)
__host__ __device__ constexpr int ws_stage_bytes(int wgs, int out) { return out == 1 ? wgs * 8192 : 0; }

// wg_store_tile_tma's aux pairs of box b (rows m0w .. + 63, columns n0 + 32 b .. + 31): [n8 block][row g, g + 8]
// of the calling thread (0 outside aux). wg_store_tile_tma takes box 0's from its caller (`first`; read-aux
// epilogues only): gemm_wgmma_ws loads them while the tile's last k tile is still on the tensor cores, so
// that their latency is not the epilogue's.
__device__ __forceinline__ void wg_aux_box(unsigned (&v)[4][2], const bf16* aux, int M, int N, int ldc, int m0w,
                                           int n0, int b) {
    const int wt = threadIdx.x & 127, r0 = m0w + 16 * (wt >> 5) + ((wt & 31) >> 2), q = wt & 3;
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h, c = n0 + 32 * b + 8 * k + 2 * q;
            v[k][h] = r < M && c < N ? *reinterpret_cast<const unsigned*>(aux + (long long)r * ldc + c) : 0u;
        }
}

template <int BN, int EPI, bool HAS_BIAS>
__device__ __forceinline__ void wg_store_tile_tma(const float (&acc)[BN / 2], const bf16* aux, const float* bias,
                                                  int M, int N, int ldc, int z, int m0w, int n0, float alpha,
                                                  const TmaMap* mapC, const TmaMap* mapX, unsigned stg, int bar,
                                                  const unsigned (&first)[4][2]) {
    static_assert(BN % 64 == 0, "whole boxes, an even number: one output's boxes alternate between the two "
                                "staging boxes, so a tile's first reuses the one its last tile's last box did not");
    constexpr bool TWO = EPI == GEMM_EPI_GELU || EPI == GEMM_EPI_DGELU_GELU;   // aux written too
    constexpr bool IN = GEMM_EPI_READS_AUX(EPI);
    constexpr int NB = BN / 32;
    const int wt = threadIdx.x & 127, w = wt >> 5, lane = wt & 31, g = lane >> 2, q = lane & 3;
    // stmatrix: lanes 8 i .. 8 i + 7 address matrix i = rows 0-7 (i even) or 8-15 (odd) of the warp's 16,
    // n8 block 2 p + i / 2 of the pair p
    const int srow = 16 * w + (lane & 7) + 8 * ((lane >> 3) & 1);
    const unsigned soff = srow * 64, sw = (srow >> 1) & 3, sblk = lane >> 4;
    unsigned nxt[4][2];                   // aux pairs of the next box (wg_aux_box)
    if constexpr (IN) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
            for (int h = 0; h < 2; ++h) nxt[k][h] = first[k][h];
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        unsigned in[4][2], oc[4][2], ox[4][2];
        if constexpr (IN) {
#pragma unroll
            for (int k = 0; k < 4; ++k)
#pragma unroll
                for (int h = 0; h < 2; ++h) in[k][h] = nxt[k][h];
            if (b + 1 < NB) wg_aux_box(nxt, aux, M, N, ldc, m0w, n0, b + 1);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float bv[2] = {0.f, 0.f};
            if constexpr (HAS_BIAS) {
                const float2 t = *reinterpret_cast<const float2*>(bias + n0 + 32 * b + 8 * k + 2 * q);
                bv[0] = t.x;
                bv[1] = t.y;
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                if constexpr (EPI == GEMM_EPI_GELU) {       // the pair's pre-activations rounded once, as stored
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        v[e] = gemm_epi_value<GEMM_EPI_NONE, HAS_BIAS>(acc[4 * (4 * b + k) + 2 * h + e], alpha, bv[e],
                                                                      0.f, nullptr);
                    ox[k][h] = bf16x2_rn(v[0], v[1]);
                    oc[k][h] = bf16x2_rn(gemm_gelu_fast(__uint_as_float(ox[k][h] << 16)),
                                         gemm_gelu_fast(__uint_as_float(ox[k][h] & 0xFFFF0000u)));
                    continue;
                }
                float o[2], x[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float a = IN ? __uint_as_float(e ? in[k][h] & 0xFFFF0000u : in[k][h] << 16) : 0.f;
                    o[e] = gemm_epi_value_bf16<EPI, HAS_BIAS>(acc[4 * (4 * b + k) + 2 * h + e], alpha, bv[e], a, &x[e]);
                }
                oc[k][h] = bf16x2_rn(o[0], o[1]);
                if constexpr (TWO) ox[k][h] = bf16x2_rn(x[0], x[1]);
            }
        }
        const unsigned bc = stg + (TWO ? 0u : (b & 1) * 4096u), bx = stg + 4096u;
        if (wt == 0) {
            if constexpr (TWO) tma_store_wait<0>();
            else tma_store_wait<1>();
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            const unsigned a = soff + (((2 * p + sblk) ^ sw) << 4);
            stmatrix_x4(bc + a, oc[2 * p][0], oc[2 * p][1], oc[2 * p + 1][0], oc[2 * p + 1][1]);
            if constexpr (TWO) stmatrix_x4(bx + a, ox[2 * p][0], ox[2 * p][1], ox[2 * p + 1][0], ox[2 * p + 1][1]);
        }
        wg_fence_async_smem();
        asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
        if (wt == 0) {
            tma_store(mapC, bc, n0 + 32 * b, m0w, z);
            if constexpr (TWO) tma_store(mapX, bx, n0 + 32 * b, m0w, z);
            tma_store_commit();
        }
    }
}

// gemm_wgmma_ra with TC: the tile stored transposed, C[c * ldc + r] = alpha * acc(r, c) for r < M, c < N
// (no epilogue: the weight gradient out = P^T of the product P the kernel computes, or its split-K
// partials). A thread holds rows r0 and r0 + 1 (ra_row) of its columns: one 8-byte store per column.
template <int BN>
__device__ __forceinline__ void ra_store_t(const float (&acc)[BN / 2], float* C, int M, int N, int ldc, int m0,
                                           int n0, float alpha) {
    const int tid = threadIdx.x;
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int r0 = m0 + wg * 64 + ra_row(warp, lane >> 2), q = lane & 3;
    const bool pair = ((ldc & 1) | (reinterpret_cast<unsigned long long>(C) & 7)) == 0 && r0 + 1 < M;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = n0 + 8 * j + 2 * q + e;
            if (c >= N) continue;
            float* p = C + (long long)c * ldc + r0;
            const float v0 = alpha * acc[4 * j + e], v1 = alpha * acc[4 * j + 2 + e];
            if (pair) {
                *reinterpret_cast<float2*>(p) = make_float2(v0, v1);
            } else {
                if (r0 < M) p[0] = v0;
                if (r0 + 1 < M) p[1] = v1;
            }
        }
    }
}

// What an epilogue reads besides the accumulators, asked for before the main loop so that it arrives
// under it instead of stalling the epilogue on a load per 4 columns.
// wg_epi_prefetch: the 128-byte lines of aux (residual input, saved pre-activation) under rows
// row0 .. row0 + 63 (a warpgroup's) and columns n0 .. n0 + BN - 1, into the L2 (wt: the thread's place
// in the warpgroup).
template <int BN, int EPI, class TO = float>
__device__ __forceinline__ void wg_epi_prefetch(const TO* aux, int ldc, int M, int N, int row0, int n0, int wt) {
    if constexpr (GEMM_EPI_READS_AUX(EPI)) {
        constexpr int PER = 128 / sizeof(TO);            // elements of a line
        constexpr int LINES = BN / PER;                  // lines of a row's BN values
#pragma unroll
        for (int i = wt; i < 64 * LINES; i += 128) {
            const int r = row0 + i / LINES, c = n0 + (i % LINES) * PER;
            if (r < M && c < N) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(aux + (long long)r * ldc + c));
        }
    }
}
// WgBias: the bias of columns n0 .. n0 + BN - 1, one value per thread and NT columns (thread t of NT
// brings columns n0 + t, n0 + t + NT, ...; 0 beyond N) into registers (fetch, before the main loop);
// put writes them into shared memory at sb (BN floats, 16-byte aligned) and returns the pointer the
// epilogue indexes by column (sb - n0). The caller orders put and the epilogue's reads (a barrier).
template <int BN, int NT, bool HAS_BIAS>
struct WgBias {
    static constexpr int PER = HAS_BIAS ? (BN + NT - 1) / NT : 1;
    float v[PER];
    __device__ __forceinline__ void fetch(const float* bias, int n0, int N, int t) {
        if constexpr (HAS_BIAS) {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const int j = t + NT * i;
                v[i] = j < BN && n0 + j < N ? bias[n0 + j] : 0.f;
            }
        }
    }
    __device__ __forceinline__ const float* put(float* sb, const float* bias, int n0, int t) const {
        if constexpr (HAS_BIAS) {
#pragma unroll
            for (int i = 0; i < PER; ++i)
                if (t + NT * i < BN) sb[t + NT * i] = v[i];
            return sb - n0;
        } else {
            return bias;
        }
    }
};

// 16-byte staging of a K-major operand tile (R rows, 32 k) into the swizzled layout. Thread tid
// copies chunk (tid % 8) of rows tid / 8 + i * STEP (STEP = THREADS / 8, a multiple of 8, so the
// swizzle term r % 8 is the same for all of a thread's rows): one global address and one shared
// offset per thread, a constant step per k tile. Interior tiles copy with no guard; edge tiles
// zero-fill (cp.async src-size) what lies outside the matrix.
template <int R, int THREADS>
struct WgStager {
    static constexpr int STEP = THREADS / 8;
    static constexpr int CH = R / STEP;
    static_assert(R % STEP == 0 && STEP % 8 == 0, "whole passes of the block, swizzle-invariant");

    const float* src;
    long long ld;
    int row, kc;
    unsigned soff;

    __device__ __forceinline__ WgStager(const float* G, int ld_, int rc0, int tid) : ld(ld_) {
        row = tid >> 3;
        kc = (tid & 7) << 2;
        src = G + (long long)(rc0 + row) * ld + kc;
        soff = row * 128 + ((((tid & 7) ^ (row & 7))) << 4);
    }

    // Stage the k tile [k0, k0 + 32) into the tile at shared byte address base; `full`: every row
    // and k of it lies in the matrix. G: a safe address for zero-filled chunks.
    __device__ __forceinline__ void stage(unsigned base, bool full, const float* G, int rc0, int rcmax,
                                          int k0, int klen) {
        if (full) {
#pragma unroll
            for (int i = 0; i < CH; ++i) cp_async16_full(base + soff + i * STEP * 128, src + i * STEP * ld);
        } else {
            const int nk = min(max(klen - (k0 + kc), 0), 4) * 4;
#pragma unroll
            for (int i = 0; i < CH; ++i) {
                const int nb = rc0 + row + i * STEP < rcmax ? nk : 0;
                cp_async16(base + soff + i * STEP * 128, nb > 0 ? src + i * STEP * ld : G, nb);
            }
        }
        src += GEMM_WG_BK;
    }
};

template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, int THREADS, int SMEM>
__global__ void __launch_bounds__(THREADS, 1)
gemm_wgmma(GEMM_ARGS_F32) {
    static_assert(THREADS == BM / 64 * 128 && SMEM == STAGES * (BM + BN) * 128 + 1024,
                  "a warpgroup a 64-row slice; STAGES slots of A and B, 1 KB to align them");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int A_BYTES = BM * 128;
    constexpr int STAGE_BYTES = (BM + BN) * 128;
    static_assert(BM % 64 == 0 && BN % 8 == 0 && BN <= 256, "wgmma m64nBNk8 tiles");
    static_assert(STAGES >= 3, "a slot is refilled two tiles after its wgmma was issued");

    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;   // the launcher adds 1 KB

    const int tid = threadIdx.x, wg = tid >> 7;
    const GemmBlock<BM, BN> blk(K, splits, k_chunk);
    const int m0 = blk.m0, n0 = blk.n0, klen = blk.klen, nk = wg_k_tiles(klen);

    A += blk.batch * sA + blk.kb0;
    B += blk.batch * sB + blk.kb0;
    C += blockIdx.z * sC;
    if constexpr (GEMM_EPI_USES_AUX(EPI)) aux += blockIdx.z * sC;

    __shared__ __align__(16) float s_bias[HAS_BIAS ? BN : 4];
    WgBias<BN, THREADS, HAS_BIAS> tile_bias;
    tile_bias.fetch(bias, n0, N, tid);
    wg_epi_prefetch<BN, EPI>(aux, ldc, M, N, m0 + wg * 64, n0, tid & 127);

    WgStager<BM, THREADS> stA(A, lda, m0, tid);
    WgStager<BN, THREADS> stB(B, ldb, n0, tid);
    const bool a_rows_in = m0 + BM <= M, b_rows_in = n0 + BN <= N;
    auto stage_tiles = [&](int s, int k0) {
        const unsigned sa = smem0 + s * STAGE_BYTES;
        const bool k_in = k0 + GEMM_WG_BK <= klen;
        stA.stage(sa, a_rows_in && k_in, A, m0, M, k0, klen);
        stB.stage(sa + A_BYTES, b_rows_in && k_in, B, n0, N, k0, klen);
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < nk) stage_tiles(s, s * GEMM_WG_BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<STAGES - 3>();      // this thread's copies of tile kt have landed
        wg_fence_async_smem();
        __syncthreads();               // everyone's copies of tile kt; every wgmma on tile kt - 2 done
        {
            const int nxt = kt + STAGES - 2;
            if (nxt < nk) stage_tiles(nxt % STAGES, nxt * GEMM_WG_BK);
            cp_async_commit();
        }
        const unsigned sa = smem0 + (kt % STAGES) * STAGE_BYTES;
        const unsigned a_wg = sa + wg * 64 * 128, b_t = sa + A_BYTES;
        wg_fence_acc(acc);
        wg_fence();
#pragma unroll
        for (int s = 0; s < GEMM_WG_BK / 8; ++s) wg_mma_tf32<BN>(acc, wg_desc(a_wg + 32 * s), wg_desc(b_t + 32 * s));
        wg_commit();
        wg_fence_acc(acc);
        wg_wait<1>();
    }
    wg_wait<0>();
    wg_fence_acc(acc);
    cp_async_wait<0>();

    const float* bias_s = tile_bias.put(s_bias, bias, n0, tid);
    if constexpr (HAS_BIAS) __syncthreads();
    wg_store_tile<BM, BN, EPI, HAS_BIAS>(acc, C, aux, bias_s, M, N, ldc, sC, blk.m0, blk.n0, alpha);
#else
    __trap();   // wgmma exists on sm_90a only; the launcher never picks this kernel elsewhere
#endif
}

// ---------------------------------------------------------------------------------------------
// The same product with the operand tiles brought in by the bulk tensor copy engine (TMA):
// gemm_wgmma_tma. One thread issues two cp.async.bulk.tensor per k tile (the copy engine writes
// the 128-byte swizzled layout above by itself and zero-fills what lies outside the tensor), so no
// thread spends issue slots or registers on staging, and a slot is refilled as soon as every
// warpgroup has released it instead of at a block-wide barrier.
//
// Tensor maps (host: cuTensorMapEncodeTiled, passed by value as __grid_constant__ parameters):
// rank 3, dims {K, rows, batch}, box {32, BM or BN, 1}, 128-byte swizzle, out-of-bounds zeros.
// Barriers per slot s: full[s] (1 arrival: the issuing lane's expect_tx; completes when the copy
// engine has delivered the tile's bytes) and empty[s] (one arrival per consumer thread once its
// warpgroup's wgmma on the slot have completed). Use u of slot s waits for parity u & 1 of each.
//
// Iteration kt (slot s = kt % STAGES): every thread waits for full[s]; the warpgroup issues the 4
// wgmma of tile kt, commits, and waits for its group of tile kt - 1, then every thread releases
// that tile's slot (empty); warp 0 waits for the slot to be released by everyone and its lane 0
// refills it with tile kt - 1 + STAGES. Nothing diverges inside a warp while a wgmma is in flight. Split-K chunks are multiples of 32 (the launcher's
// SPLIT_ALIGN), so a tile never spans two splits; the last tile's k beyond K reads zeros.
// Lane 0 of the calling warp only (a predicate inside the asm, not a branch: the warp stays
// converged, which keeps ptxas from serializing the wgmma in flight around it):
// expect `bytes` on bar, then the boxes at coordinates {a0, a1, batch} of tensor map a and
// {b0, b1, batch} of b into shared memory at dsta / dstb, completing on bar. The K-major maps'
// coordinates are (k0, first row); the maps over MN-major operands as stored, (first row, k0).
__device__ __forceinline__ void tma_load_pair(int lane, unsigned bar, unsigned bytes, unsigned dsta,
                                              const TmaMap* mapa, int a0, int a1, unsigned dstb, const TmaMap* mapb,
                                              int b0, int b1, int batch) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, %0, 0;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n"
        "@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%3], [%4, {%5, %6, %11}], [%1];\n"
        "@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%7], [%8, {%9, %10, %11}], [%1];\n}\n"
        ::"r"(lane), "r"(bar), "r"(bytes), "r"(dsta), "l"(reinterpret_cast<unsigned long long>(mapa)), "r"(a0),
          "r"(a1), "r"(dstb), "l"(reinterpret_cast<unsigned long long>(mapb)), "r"(b0), "r"(b1), "r"(batch)
        : "memory");
}
// gemm_wgmma_ra's copies (lane 0 only): expect `bytes` on bar, then the NA boxes {32 m, 32 k} of the
// MN-major A map (128-byte swizzle) at (m0 + 32 j, k0) into dsta + 4096 j, then the box of map b at
// {b0, b1} into dstb.
template <int NA>
__device__ __forceinline__ void tma_load_ra(int lane, unsigned bar, unsigned bytes, unsigned dsta, const TmaMap* mapa,
                                            int m0, int k0, unsigned dstb, const TmaMap* mapb, int b0, int b1,
                                            int batch) {
    mbar_expect(lane, bar, bytes);
#pragma unroll
    for (int j = 0; j < NA; ++j) tma_copy(lane, bar, dsta + 4096 * j, mapa, m0 + 32 * j, k0, batch);
    tma_copy(lane, bar, dstb, mapb, b0, b1, batch);
}

template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, int THREADS, int SMEM>
__global__ void __launch_bounds__(THREADS, 1)
gemm_wgmma_tma(float* C,                           // C [batch*splits, M, N], row stride ldc, matrix stride sC
               float* aux,                         // aux: as in gemm_wgmma
               const __grid_constant__ TmaMap mapA,  // A [batch, M, K] (K-major)
               const __grid_constant__ TmaMap mapB,  // B [batch, N, K] (K-major)
               const float* __restrict__ bias,     // bias [N] or null
               int M, int N, int K, int ldc, long long sC,
               float alpha, int splits, int k_chunk) {
    static_assert(THREADS == BM / 64 * 128 && SMEM == STAGES * (BM + BN) * 128 + 1024,
                  "a warpgroup a 64-row slice; STAGES slots of A and B, 1 KB to align them");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int WG = BM / 64;
    constexpr int A_BYTES = BM * 128;
    constexpr int STAGE_BYTES = (BM + BN) * 128;
    static_assert(BM % 64 == 0 && BM <= 256 && BN % 8 == 0 && BN <= 256, "wgmma m64nBNk8 tiles, TMA boxes <= 256");
    static_assert(STAGES >= 2, "a ring");

    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];     // full[0..S), empty[0..S)
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;   // the launcher adds 1 KB
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;

    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const GemmBlock<BM, BN> blk(K, splits, k_chunk);
    const int nk = wg_k_tiles(blk.klen);
    C += blockIdx.z * sC;
    if constexpr (GEMM_EPI_USES_AUX(EPI)) aux += blockIdx.z * sC;
    __shared__ __align__(16) float s_bias[HAS_BIAS ? BN : 4];
    WgBias<BN, WG * 128, HAS_BIAS> tile_bias;
    tile_bias.fetch(bias, blk.n0, N, tid);
    wg_epi_prefetch<BN, EPI>(aux, ldc, M, N, blk.m0 + wg * 64, blk.n0, tid & 127);

    auto issue = [&](int kt) {      // warp 0 (lane 0 acts): tile kt into its slot
        const int s = kt % STAGES;
        const unsigned sa = smem0 + s * STAGE_BYTES;
        tma_load_pair(lane, full0 + 8 * s, STAGE_BYTES, sa, &mapA, blk.kb0 + kt * GEMM_WG_BK, blk.m0, sa + A_BYTES,
                      &mapB, blk.kb0 + kt * GEMM_WG_BK, blk.n0, blk.batch);
    };
    if (tid == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full0 + 8 * s, 1);
            mbar_init(empty0 + 8 * s, WG * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid < 32) {
        for (int kt = 0; kt < STAGES && kt < nk; ++kt) issue(kt);
    }

    // Tile kt's wgmma into d, commit, then wait for the group before (tile kt - 1, whose slot is then
    // released and refilled).
    auto mma_tile = [&](int kt, float (&d)[BN / 2]) {
        const int s = kt % STAGES;
        mbar_wait(full0 + 8 * s, (kt / STAGES) & 1);
        const unsigned sa = smem0 + s * STAGE_BYTES;
        const unsigned a_wg = sa + wg * 64 * 128, b_t = sa + A_BYTES;
        wg_fence_acc(d);
        wg_fence();
#pragma unroll
        for (int k8 = 0; k8 < GEMM_WG_BK / 8; ++k8) wg_mma_tf32<BN>(d, wg_desc(a_wg + 32 * k8), wg_desc(b_t + 32 * k8));
        wg_commit();
        wg_fence_acc(d);
        wg_wait<1>();
        const int kr = kt - 1;                          // every wgmma of this warpgroup on tile kr is done
        if (kr >= 0) {
            const int sp = kr % STAGES;
            mbar_arrive(empty0 + 8 * sp);
            if (tid < 32 && kr + STAGES < nk) {
                mbar_wait(empty0 + 8 * sp, (kr / STAGES) & 1);
                issue(kr + STAGES);
            }
        }
    };

    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;

    for (int kt = 0; kt < nk; ++kt) mma_tile(kt, acc);
    wg_wait<0>();
    wg_fence_acc(acc);

    const float* bias_s = tile_bias.put(s_bias, bias, blk.n0, tid);
    if constexpr (HAS_BIAS) __syncthreads();
    wg_store_tile<BM, BN, EPI, HAS_BIAS>(acc, C, aux, bias_s, M, N, ldc, sC, blk.m0, blk.n0, alpha);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// gemm_wgmma_ws: the TMA product, warp-specialized and persistent. One more warpgroup than
// gemm_wgmma_tma, the last, only loads: its first warp loops over the block's tiles and their k
// tiles, waits for a slot to be released (empty) and has lane 0 issue the two tensor copies into
// it (full). The BM / 64 consumer warpgroups never issue a copy: they wait for full, run the 4
// wgmma of the k tile, and release the slot of the tile before as soon as its group is done. The
// grid is at most one block per SM (ws_grid in the launcher); block b takes output tiles b,
// b + gridDim.x, ... of WsTile's order, so while the consumers store one tile the producer is
// already loading the next one's first STAGES k tiles: the pipeline fill of every tile after the
// first is hidden, and no consumer stalls on a refill the way warp 0 of gemm_wgmma_tma does. Slot
// and parity run on one counter `it` over all k tiles of the block, the same in producer and
// consumers. The epilogue is wg_store_tile's.
// zs: batch * splits (the z extent of the non-persistent kernels' grid).
//
// WsStride: the tile walk of a persistent kernel, block b taking tiles b, b + gridDim.x, ... of the
// list; `it` counts the ring's k tiles over the block's tiles (slot it % STAGES, parity it / STAGES),
// the same in producer and consumers. ws_produce / ws_consume take the walk (gemm_wgmma_dual's walks
// its tiles from a counter: WsDynWalk), first() and next() giving tiles of the list, next() past its
// end (total) once the block has no more.
struct WsStride {
    int t = 0, it = 0;
    __device__ __forceinline__ int first() { return t = blockIdx.x; }
    __device__ __forceinline__ int next() { return t += gridDim.x; }
    __device__ __forceinline__ bool more(int total) const { return t + gridDim.x < total; }   // a tile after t
};

// WsTile: tile t of the order z = batch * splits + split slowest; within a z, n fastest (the blocks of
// a wave share A's row panels and read B's column panels once each), or m fastest where C is wider
// than tall (tiles_n * bn > tiles_m * bm, B the larger operand: the head's logits, whose B is the
// 77 MB embedding table). Either way a wave reads the larger operand's panels once and keeps the
// smaller one in the L2; n fastest over the logits read all of B again for each 256-row panel of A.
// The order changes which block computes a tile, never a tile's arithmetic.
struct WsTile {
    int z, split, batch, m0, n0, kb0, klen;
    __device__ __forceinline__ WsTile(int t, int per_z, int tiles_n, int bm, int bn, int K, int splits, int k_chunk) {
        z = t / per_z;
        const int r = t - z * per_z;
        // tiles_n * bn > tiles_m * bm, per_z = tiles_n * tiles_m (selects, not a branch the loops split on)
        const bool mf = (long long)tiles_n * tiles_n * bn > (long long)per_z * bm;
        const int inner = mf ? per_z / tiles_n : tiles_n, o = r / inner, i = r - o * inner;
        m0 = (mf ? i : o) * bm;
        n0 = (mf ? o : i) * bn;
        split = z % splits;
        batch = z / splits;
        kb0 = split * k_chunk;
        klen = min(K, kb0 + k_chunk) - kb0;
    }
};

// The register-A operand of gemm_wgmma_ra: a consumer thread's fragments of one k tile (4 k steps x
// the 4 values of wg_mma_tf32_rs), loaded from the slot's MN-major A tile: BM / 32 boxes of 32 k rows
// x 32 m (128 bytes), box j at 4096 j, element (k, m) at k * 128 + (((m / 4) ^ (k % 8)) * 16) +
// (m % 4) * 4 (the copy engine's 128-byte swizzle). Thread (w, g, q) of warpgroup wg holds rows
// ra_row(w, g) (+ 1) of the warpgroup's 64, at k = 8 s + q (+ 4): one 8-byte load per pair of
// rows, and the 16 lanes of each half warp read 8 distinct 16-byte chunks (4 (g / 2 % 2) + w, xor q
// or q + 4) in 4 rows: no bank conflict. Two buffers a and b (k tiles of even and odd index).
struct RaFrags {
    unsigned a[16], b[16];
    unsigned off, c0, c1;         // the thread's byte offset in a slot's A tile, its chunk terms
    int row;                      // ra_row of the thread, within the warpgroup's 64 rows
    __device__ __forceinline__ void init(int wg, int wt) {
        const int w = wt >> 5, lane = wt & 31, g = lane >> 2, q = lane & 3;
        row = ra_row(w, g);
        const int m = row & 31, box = (wg * 64 + row) >> 5;
        off = box * 4096 + q * 128 + (m & 3) * 4;
        c0 = ((m >> 2) ^ q) << 4;
        c1 = ((m >> 2) ^ (q + 4)) << 4;
    }
    // The 4 fragment values of k step s of the A tile at slot address sa (gemm_wgmma3_ra; k_tile issues
    // the same loads itself: written through load(), ptxas scheduled the TC variants differently from
    // the code measured in bench/NOTES.md).
    __device__ __forceinline__ void load(unsigned (&f)[4], unsigned sa, int s) const {
        const unsigned p = sa + off + 1024 * s;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(f[0]), "=r"(f[1]) : "r"(p + c0));
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(f[2]), "=r"(f[3]) : "r"(p + 512 + c1));
    }
    // k tile at slot address sa (A) and b_t (B, K-major swizzled): the fragments into f, then the 4
    // register-A wgmma into acc, committed as one group (not waited for); SUM: cs[0..1] += the
    // fragments' rows over the tile's k.
    template <int BN, bool SUM>
    __device__ __forceinline__ void k_tile(float (&acc)[BN / 2], unsigned (&f)[16], unsigned sa, unsigned b_t,
                                           bool sum_here, float (&cs)[2]) {
        const unsigned p = sa + off;
#pragma unroll
        for (int s = 0; s < GEMM_WG_BK / 8; ++s) {
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(f[4 * s]), "=r"(f[4 * s + 1]) : "r"(p + 1024 * s + c0));
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n"
                         : "=r"(f[4 * s + 2]), "=r"(f[4 * s + 3]) : "r"(p + 1024 * s + 512 + c1));
        }
        if constexpr (SUM) {
            if (sum_here) {
#pragma unroll
                for (int s = 0; s < GEMM_WG_BK / 8; ++s) {
                    cs[0] += __uint_as_float(f[4 * s]) + __uint_as_float(f[4 * s + 2]);
                    cs[1] += __uint_as_float(f[4 * s + 1]) + __uint_as_float(f[4 * s + 3]);
                }
            }
        }
        wg_fence_acc(acc);
        wg_fence();
#pragma unroll
        for (int s = 0; s < GEMM_WG_BK / 8; ++s) {
            const unsigned fr[4] = {f[4 * s], f[4 * s + 1], f[4 * s + 2], f[4 * s + 3]};
            wg_mma_tf32_rs<BN>(acc, fr, wg_desc(b_t + 32 * s));
        }
        wg_commit();
        wg_fence_acc(acc);
    }
    // The row sums of rows m0 + row (+ 1): the 4 lanes of a row (q) added pairwise (q ^ 1, then q ^ 2),
    // lane q = 0 writing the rows inside M.
    __device__ __forceinline__ void colsum_out(const float (&cs)[2], float* out, int m0, int M) const {
        float s0 = cs[0], s1 = cs[1];
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        if ((threadIdx.x & 3) == 0) {
            if (m0 + row < M) out[m0 + row] = s0;
            if (m0 + row + 1 < M) out[m0 + row + 1] = s1;
        }
    }
};

// The register-A fragments of one k step s of a K-major A tile [BM][32] (128-byte rows in the swizzle
// of gemm_wgmma_tma; gemm_wgmma3_ra without MN_A): thread (w, g, q) of warpgroup wg holds rows
// 16 w + g (+ 8) of the warpgroup's 64 (no permutation), k = 8 s + q (+ 4): four 4-byte loads, the 8
// lanes of a k column in 8 distinct chunks (xor g): no bank conflict.
struct RaFragsK {
    unsigned off;
    int g;
    __device__ __forceinline__ void init(int wg, int wt) {
        const int w = wt >> 5, lane = wt & 31;
        g = lane >> 2;
        off = (wg * 64 + 16 * w + g) * 128 + (lane & 3) * 4;
    }
    __device__ __forceinline__ void load(unsigned (&f)[4], unsigned sa, int s) const {
        const unsigned p = sa + off, c0 = ((2 * s) ^ g) << 4, c1 = ((2 * s + 1) ^ g) << 4;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(f[0]) : "r"(p + c0));
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(f[1]) : "r"(p + 1024 + c0));
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(f[2]) : "r"(p + c1));
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(f[3]) : "r"(p + 1024 + c1));
    }
};

// One k tile of gemm_wgmma3_ra (fp32 as 3xTF32, A through registers) into its partial: per k step s
// the fp32 fragments (F: RaFragsK or RaFrags), split in registers into hi = tf32_hi(x) and lo =
// tf32_hi(x - hi), then three products, smallest terms first: lo x hi, hi x lo, hi x hi (the first of
// the tile with scale-d 0); B's hi tile at bh, its lo tile at bl. A group per k step, two register sets: a step's halves are
// overwritten once the group that read them is done (wg_wait<1> after the next step's). SUM (MN):
// cs[0..1] += the fragments' values (before their split) of the thread's two rows.
template <int BN, bool SUM, class F>
__device__ __forceinline__ void ra3_step(const F& fr, float (&part)[BN / 2], unsigned sa, unsigned bh, unsigned bl,
                                         int s, unsigned (&h)[4], unsigned (&l)[4], bool sum_here, float (&cs)[2]) {
    unsigned f[4];
    fr.load(f, sa, s);
    if constexpr (SUM) {
        if (sum_here) {
            cs[0] += __uint_as_float(f[0]) + __uint_as_float(f[2]);
            cs[1] += __uint_as_float(f[1]) + __uint_as_float(f[3]);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float x = __uint_as_float(f[i]), hi = tf32_hi(x);
        h[i] = __float_as_uint(hi);
        l[i] = __float_as_uint(tf32_hi(x - hi));
    }
    wg_fence_acc(part);
    wg_fence();
    wg_mma_tf32_rs<BN>(part, l, wg_desc(bh + 32 * s), s > 0);
    wg_mma_tf32_rs<BN>(part, h, wg_desc(bl + 32 * s));
    wg_mma_tf32_rs<BN>(part, h, wg_desc(bh + 32 * s));
    wg_commit();
    wg_fence_acc(part);
}
template <int BN, bool SUM, class F>
__device__ __forceinline__ void ra3_k_tile(const F& fr, float (&part)[BN / 2], unsigned sa, unsigned bh, unsigned bl,
                                           bool sum_here, float (&cs)[2]) {
    unsigned h0[4], l0[4], h1[4], l1[4];
    ra3_step<BN, SUM>(fr, part, sa, bh, bl, 0, h0, l0, sum_here, cs);
    ra3_step<BN, SUM>(fr, part, sa, bh, bl, 1, h1, l1, sum_here, cs);
    wg_wait<1>();
    ra3_step<BN, SUM>(fr, part, sa, bh, bl, 2, h0, l0, sum_here, cs);
    wg_wait<1>();
    ra3_step<BN, SUM>(fr, part, sa, bh, bl, 3, h1, l1, sum_here, cs);
    wg_wait<0>();
    wg_fence_acc(part);
}

// The bias gradient of a bf16 weight gradient dW = dY^T X with dY read as stored (A [K, M], MN-major): the
// consumer threads sum A's columns (m) as its k tiles pass through shared memory, after issuing each
// tile's wgmma (under the tensor work; the slot is released after, as before). A box is [64 k][64 m], 128
// bytes a k line, the 16-byte chunk c of line l at c ^ (l & 7) (the 128-byte swizzle). W = 8: thread t of
// a warpgroup sums chunk t & 7 (8 columns) of lines t >> 3 + 16 i, i < 4, of each of its BOXES boxes (8 KB
// apart); W = 4 (half the registers: the 128 x 192 ping-pong tile, whose 192 accumulators leave few): half
// chunk t & 15 (4 columns, 8-byte loads) of lines t >> 4 + 8 i, i < 8. Either way a thread's lines share
// their swizzle term and a warp reads whole lines. out() adds a column's threads in a fixed order (lanes
// xor 8 and xor 16, or xor 16, then the 4 warps in order, through `red` [BOXES][4][64] floats and named
// barrier `bar` of the warpgroup): deterministic.
template <int BOXES, int W = 8>
struct Bf16ColSum {
    static_assert(W == 8 || W == 4, "a chunk or half a chunk a thread");
    static constexpr int TPL = 64 / W;            // threads a line
    float s[BOXES][W];
    unsigned off;
    __device__ __forceinline__ void init(int wt) {
        const int c = wt % TPL, l = wt / TPL;
        off = l * 128 + (((c * W / 8) ^ (l & 7)) << 4) + (W == 4 ? (c & 1) * 8 : 0);
        zero();
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int b = 0; b < BOXES; ++b)
#pragma unroll
            for (int e = 0; e < W; ++e) s[b][e] = 0.f;
    }
    __device__ __forceinline__ void add(unsigned box0) {
#pragma unroll
        for (int b = 0; b < BOXES; ++b)
#pragma unroll
            for (int i = 0; i < TPL / 2; ++i) {         // lines l + (128 / TPL) i: the same swizzle
                const unsigned a = box0 + 8192 * b + off + 128 * (128 / TPL) * i;
                unsigned w[W / 2];
                if constexpr (W == 8)
                    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a));
                else
                    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(a));
#pragma unroll
                for (int j = 0; j < W / 2; ++j) {
                    s[b][2 * j] += __uint_as_float(w[j] << 16);
                    s[b][2 * j + 1] += __uint_as_float(w[j] & 0xFFFF0000u);
                }
            }
    }
    // out[m0 + 64 b + m] (m0 + 64 b + m < M) = the tile's sums of box b; then zero for the next tile
    __device__ __forceinline__ void out(float* o, int m0, int M, float* red, int bar, int wt) {
        const int warp = wt >> 5, lane = wt & 31;
#pragma unroll
        for (int b = 0; b < BOXES; ++b)
#pragma unroll
            for (int e = 0; e < W; ++e) {
                float v = s[b][e];
                if constexpr (W == 8) v += __shfl_xor_sync(0xffffffffu, v, 8);
                v += __shfl_xor_sync(0xffffffffu, v, 16);
                if (lane < TPL) red[(b * 4 + warp) * 64 + W * lane + e] = v;
            }
        asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
        for (int j = wt; j < BOXES * 64; j += 128) {
            const int b = j >> 6, m = j & 63;
            const float* r = red + b * 256 + m;
            const float v = (r[0] + r[64]) + (r[128] + r[192]);
            if (m0 + j < M) o[m0 + j] = v;
        }
        asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
        zero();
    }
};

// The consumers' fragment loader: RaFrags (MN-major A), RaFragsK (K-major A, 3xTF32), none.
template <bool RA, bool A_MN, int PRODUCTS> struct RaOf { using T = RaFrags; };
template <bool A_MN> struct RaOf<false, A_MN, 1> { struct T {}; };   // (no fragments: the other kernels keep their code)
template <> struct RaOf<true, false, 3> { using T = RaFragsK; };

// The consumer warpgroups of the warp-specialized kernels: for each of the block's output tiles,
// wait for each k tile's slot (full), its 4 wgmma, release the slot of the k tile before once its
// group is done (empty), then the epilogue from the accumulators. PRODUCTS = 3 (3xTF32, RA: the slot
// holds A's fp32 tile, then B's hi and lo tiles): each k tile's 12 wgmma go into its own partial (the
// first with scale-d 0), whose group is waited for at once, so the tile's slot is released before
// the partial is added into the sum on the FMA pipe. The tensor core accumulates with truncation
// (round toward zero), which biases a long sum by about an ulp per addition: each 32-wide k tile is
// summed on its own and the partials are added rounded to nearest. (Reading a partial while the
// next tile's wgmma run would be the better pipeline, but ptxas then serializes every wgmma: C7514.)
//
// CSUM without RA (BF16, A MN-major): Bf16ColSum's sums of the warpgroup's box, spread over the first
// G = min(tiles_n, CSG) column tiles of a row of tiles (the one of column tile j sums the k tiles kt = j
// mod G: extra shared-memory reads, which these products are bound by, a G-th each), into row z G + j.
//
// RA (gemm_wgmma_ra): the slot's A tile is MN-major ([BM / 32] boxes of [32 k][32 m], 128-byte
// swizzle); each k tile's fragments come from it by ra_load (two buffers, so the loads of k tile kt
// do not wait for the group of kt - 1 that reads the other) and go to the register-A wgmma. CSUM (RA):
// the consumers also sum A's fragments per row over the tile's k range and, in the tiles of the
// first column tile, write colsum[z, m] (the lanes of a row added in one order: deterministic).
//
// OP (Tf32Op, Bf16Op: PRODUCTS 1, no RA) the operand type and layouts of the plain product; TO: C's and
// aux's element type.
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, int PRODUCTS = 1, bool RA = false, bool CSUM = false,
          bool TC = false, bool A_MN = true, class OP = Tf32Op, class TO = float, int CSG = 1, class WALK = WsStride>
__device__ __forceinline__ void ws_consume(WALK& walk, unsigned smem0, unsigned full0, unsigned empty0, TO* C, TO* aux,
                                           const float* bias, int M, int N, int K, int ldc, long long sC,
                                           float alpha, int splits, int k_chunk, int per_z, int tiles_n,
                                           int total, float* colsum = nullptr, const TmaMap* mapC = nullptr,
                                           const TmaMap* mapX = nullptr, int c_tma = 0, unsigned stg = 0) {
    static_assert(!RA || PRODUCTS == 3 || A_MN, "register A in TF32: MN-major");
    static_assert(RA || PRODUCTS == 1, "3xTF32: A through registers");
    static_assert(!CSUM || (RA && A_MN) || (!RA && OP::MN_A && OP::BK == 64 && EPI == GEMM_EPI_NONE && !HAS_BIAS),
                  "the consumers' column sums: MN-major register-A fragments, or an MN-major bf16 A in shared memory");
    constexpr bool BSUM = CSUM && !RA;
    static_assert(!TC || (RA && EPI == GEMM_EPI_NONE && !HAS_BIAS), "the transposed store: gemm_wgmma_ra, no epilogue");
    static_assert(OP::BK == GEMM_WG_BK || (PRODUCTS == 1 && !RA), "BF16: the plain product");
    static_assert(sizeof(TO) == 4 || !TC, "the transposed store writes fp32");
    constexpr int A_BYTES = BM * 128;
    // 3xTF32: A once (split in registers), B's lo tile after its hi one
    constexpr int STAGE_BYTES = PRODUCTS == 3 ? (BM + 2 * BN) * 128 : (BM + BN) * 128;
    constexpr int WG = BM / 64;
    __shared__ __align__(16) float ws_bias[HAS_BIAS ? 2 * BN : 4];      // a pair of buffers
    const int wg = threadIdx.x >> 7, wt = threadIdx.x & 127;
    float acc[BN / 2];
    float part[PRODUCTS == 3 ? BN / 2 : 1];
    WgBias<BN, WG * 128, HAS_BIAS> tile_bias;
    typename RaOf<RA, A_MN, PRODUCTS>::T ra;
    if constexpr (RA) ra.init(wg, wt);
    __shared__ float ws_red[BSUM ? WG * 256 : 1];
    Bf16ColSum<1> bsum;
    if constexpr (BSUM) bsum.init(wt);
    // a bf16 C read-aux epilogue's first box of aux, loaded under the tile's last k tile (wg_aux_box)
    constexpr bool AUX0 = sizeof(TO) == 2 && GEMM_EPI_READS_AUX(EPI) && !RA && PRODUCTS == 1;
    unsigned aux0[4][2];
    int it = walk.it, tn = 0;
    for (int t = walk.first(); t < total; t = walk.next(), ++tn) {
        const WsTile tl(t, per_z, tiles_n, BM, BN, K, splits, k_chunk);
        const int nk = wg_k_tiles<OP::BK>(tl.klen);
        int tj = 0, G = 1;
        if constexpr (BSUM) tj = tl.n0 / BN, G = min(tiles_n, CSG);
        const bool sum_here = CSUM && (BSUM ? tj < G : tl.n0 == 0);     // (uniform in the block)
        float cs[2] = {0.f, 0.f};
        TO* aux_z = aux;
        if constexpr (GEMM_EPI_USES_AUX(EPI)) aux_z += tl.z * sC;
        tile_bias.fetch(bias, tl.n0, N, threadIdx.x);
        wg_epi_prefetch<BN, EPI, TO>(aux_z, ldc, M, N, tl.m0 + wg * 64, tl.n0, wt);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            const unsigned sa = smem0 + s * STAGE_BYTES;
            const unsigned a_wg = sa + wg * 64 * 128, b_t = sa + A_BYTES;
            if constexpr (PRODUCTS == 3) {
                ra3_k_tile<BN, CSUM>(ra, part, sa, b_t, b_t + BN * 128, sum_here, cs);
                mbar_arrive(empty0 + 8 * s);
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[i] += part[i];
            } else if constexpr (RA) {
                // fragments into the buffer the group before last read (it is done: wg_wait<1> below)
                if (kt & 1)
                    ra.k_tile<BN, CSUM>(acc, ra.b, sa, b_t, sum_here, cs);
                else
                    ra.k_tile<BN, CSUM>(acc, ra.a, sa, b_t, sum_here, cs);
                wg_wait<1>();
                if (kt > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            } else {
                wg_fence_acc(acc);
                wg_fence();
#pragma unroll
                for (int k8 = 0; k8 < GEMM_WG_BK / 8; ++k8) OP::template mma<BN>(acc, a_wg, b_t, k8);
                wg_commit();
                wg_fence_acc(acc);
                if constexpr (BSUM) {
                    if (sum_here && kt % G == tj) bsum.add(a_wg);
                }
                if constexpr (AUX0) {
                    if (kt == nk - 1 && c_tma) wg_aux_box(aux0, aux_z, M, N, ldc, tl.m0 + 64 * wg, tl.n0, 0);
                }
                wg_wait<1>();             // the group of the k tile before is done: release its slot
                if (kt > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
            }
        }
        if constexpr (CSUM && RA) {
            if (sum_here) ra.colsum_out(cs, colsum + (long long)tl.z * M, tl.m0 + wg * 64, M);
        }
        if constexpr (BSUM) {
            if (sum_here) bsum.out(colsum + ((long long)tl.z * G + tj) * M, tl.m0 + wg * 64, M, ws_red + wg * 256, 7 + wg,
                                   wt);
        }
        if constexpr (PRODUCTS == 1) {
            wg_wait<0>();
            wg_fence_acc(acc);
            if (nk > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        }
        // the tile's bias into one of the two buffers (the other may still be read by a consumer
        // finishing the tile before); the consumers' barrier (named barrier 2: the producer warpgroup
        // has its own loop) orders these writes before this epilogue's reads, and that epilogue's
        // reads before the next writes to the buffer. 2 x BN floats: 128x128 s7 (gemm_wgmma_ra with
        // MN_B) leaves no more room than that beside its 224 KB of slots.
        const float* bias_t = tile_bias.put(ws_bias + (tn & 1) * BN, bias, tl.n0, threadIdx.x);
        if constexpr (HAS_BIAS) asm volatile("bar.sync 2, %0;\n" ::"n"(WG * 128) : "memory");
        if constexpr (TC) {
            ra_store_t<BN>(acc, C + tl.z * sC, M, N, ldc, tl.m0, tl.n0, alpha);
        } else {
            if constexpr (sizeof(TO) == 2) {
                if (c_tma) {
                    if constexpr (AUX0) {       // (an empty k range: not loaded in the k loop)
                        if (nk == 0) wg_aux_box(aux0, aux_z, M, N, ldc, tl.m0 + 64 * wg, tl.n0, 0);
                    }
                    wg_store_tile_tma<BN, EPI, HAS_BIAS>(acc, aux_z, bias_t, M, N, ldc, tl.z, tl.m0 + 64 * wg, tl.n0,
                                                         alpha, mapC, mapX, stg + ws_stage_bytes(wg, 1), 11 + wg,
                                                         aux0);
                    continue;
                }
            }
            wg_store_tile<BM, BN, EPI, HAS_BIAS, RA && A_MN, TO>(acc, C + tl.z * sC, aux_z, bias_t, M, N, ldc, sC,
                                                                  tl.m0, tl.n0, alpha);
        }
    }
    walk.it = it;
    if (c_tma && wt == 0) tma_store_wait<0, false>();     // every store written before the block ends
}

// Barrier set-up of the warp-specialized kernels: full[s] (`full_count` producer arrivals, or 1
// with the copy's bytes), empty[s] (one arrival per consumer thread), then `extra` single-arrival
// barriers (the staging ring of the turning kernels).
__device__ __forceinline__ void ws_init_bars(unsigned bars0, int stages, unsigned full_count, unsigned consumers,
                                             int extra) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < stages; ++s) {
            mbar_init(bars0 + 8 * s, full_count);
            mbar_init(bars0 + 8 * (stages + s), consumers);
        }
        for (int s = 0; s < extra; ++s) mbar_init(bars0 + 8 * (2 * stages + s), 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();      // the last block-wide barrier: the producer warpgroup leaves early
}

// The argument list of the persistent kernels (gemm_wgmma_ws, gemm_wgmma_ra, gemm_wgmma3_ra): the
// launcher's contract, checked against its argument block when a launch is recorded. A and B are
// K-major ([batch, M, K], [batch, N, K]) for gemm_wgmma_ws; as stored ([batch, K, M], [batch, K, N])
// where MN_A / MN_B say so for the others. colsum: the bias gradient's partial sums of A as stored
// (the kernels with MN_A, COLSUM: row z = the split's k range, one product).
#define WS_ARGS                                                                                      \
    float* C,                               /* C [zs, M, N], row stride ldc, matrix stride sC */    \
    float* aux,                             /* aux: as in gemm_wgmma */                             \
    WS_ARGS_AB
// (gemm_wgmma_ws: C and aux of its OUT type, then these)
#define WS_ARGS_AB                                                                                   \
    const __grid_constant__ TmaMap mapA,    /* A (see above) */                                     \
    const __grid_constant__ TmaMap mapB,    /* B (see above) */                                     \
    const float* __restrict__ bias,         /* bias [N] or null */                                  \
    int M, int N, int K, int ldc, long long sC, float alpha, int splits, int k_chunk, int zs,      \
    float* colsum                           /* COLSUM (mn, 3_ws with MN_A): [splits, M], else unused */

// (gemm_wgmma_ws and gemm_wgmma_pp, after WS_ARGS_AB) the bf16 epilogue's stores by the copy engine
// (wg_store_tile_tma) where c_tma is set: C's and aux's maps {N, M, zs} (strides ldc, sC), boxes {32, 64, 1}
// in the 64-byte swizzle; an fp32 C, or a bf16 C whose rows the maps cannot describe: c_tma 0, maps unused
#define WS_ARGS_C                                                                                    \
    const __grid_constant__ TmaMap mapC, const __grid_constant__ TmaMap mapX, int c_tma

// BF16 copies of one k tile (lane 0 only, converged): expect `bytes` on bar, then A's and B's boxes: a
// K-major operand (rows R) one box {64 k, R rows} at (k0, row0), an MN-major one R / 64 boxes {64 rows,
// 64 k} at (row0 + 64 j, k0), 8192 bytes apart (the layout wg_desc_mn describes).
template <int R, bool MN>
__device__ __forceinline__ void tma_operand(int lane, unsigned bar, unsigned dst, const TmaMap* map, int k0, int row0,
                                            int batch) {
    if constexpr (MN) {
#pragma unroll
        for (int j = 0; j < R / 64; ++j) tma_copy(lane, bar, dst + 8192 * j, map, row0 + 64 * j, k0, batch);
    } else {
        tma_copy(lane, bar, dst, map, k0, row0, batch);
    }
}

// The producer of the warp-specialized kernels (its first warp; lane 0 issues, converged): the block's
// tiles and their k tiles in the consumers' order, each k tile into the next slot of the ring once the
// consumers released it (empty), its copies completing on full. BF16 (OP::BK 64): tma_operand's boxes;
// TF32: tma_load_ra (RA) or tma_load_pair.
template <int BM, int BN, int STAGES, bool RA, class OP, class WALK = WsStride>
__device__ __forceinline__ void ws_produce(WALK& walk, unsigned smem0, unsigned full0, unsigned empty0,
                                           const TmaMap* mapA, const TmaMap* mapB, int K, int splits, int k_chunk,
                                           int per_z, int tiles_n, int total, int lane) {
    constexpr int A_BYTES = BM * 128, STAGE_BYTES = (BM + BN) * 128;
    int it = walk.it;
    for (int t = walk.first(); t < total; t = walk.next()) {
        const WsTile tl(t, per_z, tiles_n, BM, BN, K, splits, k_chunk);
        const int nk = wg_k_tiles<OP::BK>(tl.klen);
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % STAGES;
            if (it >= STAGES) mbar_wait(empty0 + 8 * s, ((it / STAGES) - 1) & 1);
            const unsigned sa = smem0 + s * STAGE_BYTES;
            const int k0 = tl.kb0 + kt * OP::BK;
            if constexpr (OP::BK != GEMM_WG_BK) {
                mbar_expect(lane, full0 + 8 * s, STAGE_BYTES);
                tma_operand<BM, OP::MN_A>(lane, full0 + 8 * s, sa, mapA, k0, tl.m0, tl.batch);
                tma_operand<BN, OP::MN_B>(lane, full0 + 8 * s, sa + A_BYTES, mapB, k0, tl.n0, tl.batch);
            } else if constexpr (RA)
                tma_load_ra<BM / 32>(lane, full0 + 8 * s, STAGE_BYTES, sa, mapA, tl.m0, k0, sa + A_BYTES, mapB, k0,
                                     tl.n0, tl.batch);
            else
                tma_load_pair(lane, full0 + 8 * s, STAGE_BYTES, sa, mapA, k0, tl.m0, sa + A_BYTES, mapB, k0, tl.n0,
                              tl.batch);
        }
    }
    walk.it = it;
}

// The body of gemm_wgmma_ws and of gemm_wgmma_ra with a K-major B (RA: A's k tile as BM / 32 MN-major
// boxes, tma_load_ra; CSUM: the consumers' column sums of A, RaFrags; TC: ra_store_t). OP: the operands'
// type and layouts (Tf32Op, or Bf16Op: copied by tma_operand); TO: C's and aux's element type.
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, bool RA = false, bool CSUM = false, bool TC = false,
          class OP = Tf32Op, class TO = float, int CSG = 1>
__device__ __forceinline__ void ws_gemm(TO* C, TO* aux, const TmaMap* mapA, const TmaMap* mapB,
                                        const float* bias, int M, int N, int K, int ldc, long long sC, float alpha,
                                        int splits, int k_chunk, int zs, float* colsum, const TmaMap* mapC = nullptr,
                                        const TmaMap* mapX = nullptr, int c_tma = 0) {
    constexpr int WG = BM / 64;                         // consumer warpgroups; warpgroup WG loads
    static_assert(BM % 64 == 0 && BM <= 256 && BN % 8 == 0 && BN <= 256, "wgmma m64nBNk8 tiles, TMA boxes <= 256");
    static_assert(STAGES >= 2, "a ring");

    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];     // full[0..S), empty[0..S)
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;   // the launcher adds 1 KB
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;

    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int tiles_n = (N + BN - 1) / BN, tiles_m = (M + BM - 1) / BM;
    const int per_z = tiles_n * tiles_m, total = per_z * zs;
    ws_init_bars(full0, STAGES, 1, WG * 128, 0);

    // BF16: the producer drops to 24 registers and the consumers take what it gave back (wg_consumer_regs):
    // 240 at BM 128, 112 at BM 256
    constexpr bool SPLIT_REGS = OP::BK != GEMM_WG_BK;
    constexpr int CONSUMER_REGS = wg_consumer_regs((WG + 1) * 128, WG, 24);
    if (wg == WG) {       // producer
        if constexpr (SPLIT_REGS) wg_regs_dec<24>();
        if (tid < WG * 128 + 32) {
            WsStride walk;
            ws_produce<BM, BN, STAGES, RA, OP>(walk, smem0, full0, empty0, mapA, mapB, K, splits, k_chunk, per_z,
                                               tiles_n, total, lane);
        }
        return;
    }
    if constexpr (SPLIT_REGS) wg_regs_inc<CONSUMER_REGS>();
    WsStride walk;
    ws_consume<BM, BN, STAGES, EPI, HAS_BIAS, 1, RA, CSUM, TC, true, OP, TO, CSG>(
        walk, smem0, full0, empty0, C, aux, bias, M, N, K, ldc, sC, alpha, splits, k_chunk, per_z, tiles_n, total,
        colsum, mapC, mapX, c_tma, smem0 + STAGES * (BM + BN) * 128);
}

// DT: the operands' type (0: fp32, read as TF32; 1: bf16, A and B K-major unless MN_A / MN_B); OUT: C's
// and aux's (0: fp32, 1: bf16). The bias is fp32. TF32 reads K-major operands only. COLSUM > 0 (bf16, MN_A,
// no epilogue): also the sums of A's columns (the bias gradient's partials), in G = min(tiles_n, COLSUM)
// rows a split (ws_consume's CSG).
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, int THREADS, int SMEM, int DT = 0, bool MN_A = false,
          bool MN_B = false, int OUT = 0, int COLSUM = 0>
__global__ void __launch_bounds__(THREADS, 1)
gemm_wgmma_ws(elem<OUT>* C, elem<OUT>* aux, WS_ARGS_AB, WS_ARGS_C) {
    static_assert(THREADS == (BM / 64 + 1) * 128 &&
                  SMEM == STAGES * (BM + BN) * 128 + 1024 + ws_stage_bytes(BM / 64, OUT),
                  "a consumer warpgroup a 64-row slice and the producer's; STAGES slots, 1 KB to align them, "
                  "a bf16 C's staging boxes");
    static_assert(DT == 1 || (!MN_A && !MN_B), "TF32 operands are K-major");
    static_assert(!MN_A && !MN_B || (BM % 64 == 0 && BN % 64 == 0), "MN-major operands in boxes of 64 rows");
    static_assert(COLSUM == 0 || (DT == 1 && MN_A), "the column sums of an MN-major bf16 A");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ws_gemm<BM, BN, STAGES, EPI, HAS_BIAS, false, (COLSUM > 0), false, typename OpOf<DT, MN_A, MN_B>::T,
            elem<OUT>, COLSUM>(C, aux, &mapA, &mapB, bias, M, N, K, ldc, sC, alpha, splits, k_chunk, zs,
                                     colsum, &mapC, &mapX, OUT == 1 ? c_tma : 0);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// gemm_wgmma_pp: the BF16 product of gemm_wgmma_ws with its two consumer warpgroups in ping-pong
// (FlashAttention-3's schedule): each warpgroup computes whole BM x BN tiles (BM / 64 m64 instructions
// a k step, BM / 64 x BN / 2 accumulators a thread), warpgroup 0 the block's tiles 0, 2, 4, ...,
// warpgroup 1 its tiles 1, 3, 5, .... The producer fills one ring with the block's tiles in order, so
// the two k loops take turns on the tensor cores and one warpgroup's epilogue (the GELU, the stores)
// runs under the other's k loop instead of idling them. A warpgroup starts a tile's k loop once the
// other has waited for the last k tile of the tile before (named barrier 3 + the waiting warpgroup,
// 256 threads: one arrives, the other syncs): every fill of the slots it then waits for before its
// own is complete, so its parity cannot name a fill two phases old. A slot is released by the one
// warpgroup that read it (empty: 128 arrivals). The producer drops to 40 registers, the consumers
// rise to 232 (24 and 240 on 128 x 192, 192 accumulators a thread: families.py BF16_PP_WIDE says why
// that tile has no dgelu kernels). Grid, tile order, split-K, template tail and arguments: gemm_wgmma_ws's.
// The consumer warpgroups of gemm_wgmma_pp (and of gemm_wgmma_dual's ping-pong form): the block's tiles of
// `walk`, warpgroup wg the ones at even (0) or odd (1) positions j of the block's sequence (turn.j, carried
// over the products of one launch, as the ring's walk.it and the bias buffers' turn.mine); walk.more(total):
// whether the block has a tile after this one (the other warpgroup's turn is then passed on).
struct PpTurn {
    int j = 0, mine = 0;
};

template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, class OP, class TO, int COLSUM, class WALK>
__device__ __forceinline__ void pp_consume(WALK& walk, PpTurn& turn, unsigned smem0, unsigned full0, unsigned empty0,
                                           TO* C, TO* aux, const float* bias, int M, int N, int K, int ldc,
                                           long long sC, float alpha, int splits, int k_chunk, int per_z, int tiles_n,
                                           int total, float* colsum, const TmaMap* mapC, const TmaMap* mapX, int c_tma,
                                           float* pp_bias, float* pp_red, int wg, int wt) {
    constexpr int R = BM / 64, A_BYTES = BM * 128, STAGE_BYTES = (BM + BN) * 128;
    float acc[R][BN / 2];
    WgBias<BN, 128, HAS_BIAS> tile_bias;
    Bf16ColSum<R, (BM * BN > 128 * 128 ? 4 : 8)> bsum;     // (4 columns a thread on 128 x 192)
    if constexpr (COLSUM > 0) bsum.init(wt);
    // (aux's first box of a read-aux epilogue loaded just before it, not under the k loop as gemm_wgmma_ws
    // does: beside two tiles' accumulators the registers it would hold through the k loop are not there)
    unsigned aux0[4][2];
    int it = walk.it, j = turn.j, mine = turn.mine;
    for (int t = walk.first(); t < total; t = walk.next(), ++j) {
        const WsTile tl(t, per_z, tiles_n, BM, BN, K, splits, k_chunk);
        const int nk = wg_k_tiles<OP::BK>(tl.klen);
        if ((j & 1) != wg) {      // the other warpgroup's tile
            it += nk;
            continue;
        }
        TO* aux_z = aux;
        if constexpr (GEMM_EPI_USES_AUX(EPI)) aux_z += tl.z * sC;
        const int tj = tl.n0 / BN, G = min(tiles_n, COLSUM > 0 ? COLSUM : 1);   // the column sums (ws_consume's)
        tile_bias.fetch(bias, tl.n0, N, wt);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            wg_epi_prefetch<BN, EPI, TO>(aux_z, ldc, M, N, tl.m0 + 64 * r, tl.n0, wt);
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) acc[r][i] = 0.f;
        }
        if (j > 0) asm volatile("bar.sync %0, 256;\n" ::"r"(3 + wg) : "memory");
        for (int kt = 0; kt < nk; ++kt, ++it) {
            const int s = it % STAGES;
            mbar_wait(full0 + 8 * s, (it / STAGES) & 1);
            const unsigned sa = smem0 + s * STAGE_BYTES, b_t = sa + A_BYTES;
#pragma unroll
            for (int r = 0; r < R; ++r) wg_fence_acc(acc[r]);
            wg_fence();
#pragma unroll
            for (int k16 = 0; k16 < OP::BK / 16; ++k16)
#pragma unroll
                for (int r = 0; r < R; ++r) OP::template mma<BN>(acc[r], sa + 8192 * r, b_t, k16);
            wg_commit();
#pragma unroll
            for (int r = 0; r < R; ++r) wg_fence_acc(acc[r]);
            if constexpr (COLSUM > 0) {                // the tile's R boxes of A (ws_consume's spread)
                if (tj < G && kt % G == tj) bsum.add(sa);
            }
            wg_wait<1>();             // the group of the k tile before is done: release its slot
            if (kt > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        }
        if (walk.more(total)) asm volatile("bar.arrive %0, 256;\n" ::"r"(3 + (wg ^ 1)) : "memory");
        wg_wait<0>();
#pragma unroll
        for (int r = 0; r < R; ++r) wg_fence_acc(acc[r]);
        if (nk > 0) mbar_arrive(empty0 + 8 * ((it - 1) % STAGES));
        if constexpr (COLSUM > 0) {
            if (tj < G) bsum.out(colsum + ((long long)tl.z * G + tj) * M, tl.m0, M, pp_red + wg * R * 256, 7 + wg, wt);
        }
        // the bias into this warpgroup's buffer of the pair its tile before did not use (its own
        // barrier, 5 + wg, orders the writes before the epilogue's reads and those before the next)
        const float* bias_t = tile_bias.put(pp_bias + (2 * wg + (mine++ & 1)) * BN, bias, tl.n0, wt);
        if constexpr (HAS_BIAS) asm volatile("bar.sync %0, 128;\n" ::"r"(5 + wg) : "memory");
        if constexpr (sizeof(TO) == 2) {
            if (c_tma) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if constexpr (GEMM_EPI_READS_AUX(EPI)) wg_aux_box(aux0, aux_z, M, N, ldc, tl.m0 + 64 * r, tl.n0, 0);
                    wg_store_tile_tma<BN, EPI, HAS_BIAS>(acc[r], aux_z, bias_t, M, N, ldc, tl.z, tl.m0 + 64 * r, tl.n0,
                                                         alpha, mapC, mapX,
                                                         smem0 + STAGES * STAGE_BYTES + ws_stage_bytes(wg, 1), 11 + wg,
                                                         aux0);
                }
                continue;
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
            wg_store_tile<64, BN, EPI, HAS_BIAS, false, TO>(acc[r], C + tl.z * sC, aux_z, bias_t, M, N, ldc, sC,
                                                            tl.m0 + 64 * r, tl.n0, alpha, 0);
    }
    walk.it = it;
    turn.j = j;
    turn.mine = mine;
    if (sizeof(TO) == 2 && c_tma && wt == 0) tma_store_wait<0, false>();     // every store written before it ends
}

template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, int THREADS, int SMEM, int DT, bool MN_A, bool MN_B,
          int OUT, int COLSUM = 0>
__global__ void __launch_bounds__(THREADS, 1)
gemm_wgmma_pp(elem<OUT>* C, elem<OUT>* aux, WS_ARGS_AB, WS_ARGS_C) {
    static_assert(THREADS == 3 * 128 && SMEM == STAGES * (BM + BN) * 128 + 1024 + ws_stage_bytes(2, OUT),
                  "two consumer warpgroups and the producer's; STAGES slots, 1 KB to align them, a bf16 C's "
                  "staging boxes");
    static_assert(BM % 64 == 0 && BN % 64 == 0 && BM <= 256 && BN <= 256 && BM * BN <= 128 * 192 && STAGES >= 2,
                  "MN-major boxes of 64 rows; at most 192 accumulators a thread");
    static_assert(DT == 1, "BF16 operands (DT as gemm_wgmma_ws's)");
    static_assert(COLSUM == 0 || (MN_A && EPI == GEMM_EPI_NONE && !HAS_BIAS), "COLSUM as gemm_wgmma_ws's");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using OP = Bf16Op<MN_A, MN_B>;
    using TO = elem<OUT>;
    constexpr int R = BM / 64;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES];
    __shared__ __align__(16) float pp_bias[HAS_BIAS ? 4 * BN : 4];   // a pair of buffers a warpgroup
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, wt = tid & 127;
    const int tiles_n = (N + BN - 1) / BN, tiles_m = (M + BM - 1) / BM;
    const int per_z = tiles_n * tiles_m, total = per_z * zs;
    ws_init_bars(full0, STAGES, 1, 128, 0);

    // the register split: 40 / 232, or 24 / 240 where a thread holds more than 128 accumulators (128 x 192)
    constexpr int PRODUCER_REGS = BM * BN > 128 * 128 ? 24 : 40;
    constexpr int CONSUMER_REGS = wg_consumer_regs(THREADS, 2, PRODUCER_REGS);
    if (wg == 2) {        // producer: as gemm_wgmma_ws's
        wg_regs_dec<PRODUCER_REGS>();
        if (tid < 2 * 128 + 32) {
            WsStride walk;
            ws_produce<BM, BN, STAGES, false, OP>(walk, smem0, full0, empty0, &mapA, &mapB, K, splits, k_chunk, per_z,
                                                  tiles_n, total, lane);
        }
        return;
    }
    wg_regs_inc<CONSUMER_REGS>();
    __shared__ float pp_red[COLSUM > 0 ? 2 * R * 256 : 1];     // Bf16ColSum's, a warpgroup's R boxes
    WsStride walk;
    PpTurn turn;
    pp_consume<BM, BN, STAGES, EPI, HAS_BIAS, OP, TO, COLSUM>(walk, turn, smem0, full0, empty0, C, aux, bias, M, N, K,
                                                              ldc, sC, alpha, splits, k_chunk, per_z, tiles_n, total,
                                                              colsum, &mapC, &mapX, c_tma, pp_bias, pp_red, wg, wt);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// The turning kernels: the warp-specialized persistent product of gemm_wgmma_ws, whose producer
// warpgroup prepares each TMA-staged k tile in shared memory before the consumers (ws_consume)
// read it. Lane 0 of its first warp has the copy engine bring a k tile of A and B as they are
// stored into a slot (staged[s]); the 128 producer threads prepare B in place (its staged bytes are
// exactly its K-major tile's place), fence their stores into the async proxy and arrive on full[s]
// (128 arrivals). A slot's next copy (k tile it + STAGES - 1 goes
// where tile it - 1 was) is issued once the consumers released it: STAGES - 2 copies in flight.
//
// MN (gemm_wgmma_ra's B stored [batch, K, N], gemm_wgmma3_ra's with MN_B): wgmma reads TF32
// operands K-major only, so the producers turn the operand: it arrives as it lies (no swizzle;
// tensor map {rows, K, batch}, box {BN, 32, 1}), [32][R], and is rewritten as the K-major [R][32] in
// the 128-byte swizzle of gemm_wgmma_tma (ws_prepare). (A, read as stored, goes to the consumers'
// registers: the producers leave it as the copy engine wrote it.)
//
// PRODUCTS 3 (fp32 as 3xTF32, gemm_wgmma3_ra's B): B [batch, N, K] or, MN, [batch, K, N], read as
// stored (a K-major operand through the swizzled tensor map of gemm_wgmma_tma). The producers split
// every element x into hi = tf32_hi(x), written where x was (turned first where MN), and lo =
// tf32_hi(x - hi), written HALF = BN * 128 bytes on, in the same layout (the swizzle is a function of
// the address bits below 1024 and HALF is a multiple of 1024).
//
// ws_prepare: one operand of a staged k tile (R rows) at `tile`, by the 128 producer threads
// (pt = 0..127). MN: a warp takes 32 consecutive rows r and one 16-byte chunk c (k 4c .. 4c + 3):
// each lane reads its row's 4 staged values (a staged row is one k: a warp's 32 reads are 32
// consecutive floats, no bank conflict) into registers, the producers meet (named barrier 1), then
// each stores its chunks at r * 128 + ((c ^ (r % 8)) * 16) (the 8 lanes of a store phase hit 8
// distinct bank groups). K-major (SPLIT only): thread pt splits the 16-byte chunks pt, pt + 128, ...
// where they are (consecutive chunks: conflict-free). SPLIT: the hi half in place, the lo half at
// tile + HALF.
template <int R, bool MN, bool SPLIT, int HALF>
__device__ __forceinline__ void ws_prepare(unsigned char* tile, int pt) {
    constexpr int CH = R * 8 / 128;
    static_assert(MN || SPLIT, "a K-major TF32 operand needs no preparation");
    auto put = [&](unsigned char* dst, float4 x) {
        if constexpr (SPLIT) {
            const float4 h = make_float4(tf32_hi(x.x), tf32_hi(x.y), tf32_hi(x.z), tf32_hi(x.w));
            *reinterpret_cast<float4*>(dst) = h;
            *reinterpret_cast<float4*>(dst + HALF) =
                make_float4(tf32_hi(x.x - h.x), tf32_hi(x.y - h.y), tf32_hi(x.z - h.z), tf32_hi(x.w - h.w));
        } else {
            *reinterpret_cast<float4*>(dst) = x;
        }
    };
    if constexpr (MN) {
        static_assert(R % 32 == 0, "whole 32-row groups");
        const float* stg = reinterpret_cast<const float*>(tile);
        float4 v[CH];
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int idx = pt + 128 * i;
            const int c = (idx >> 5) & 7, row = (idx >> 8) * 32 + (idx & 31);
            const float* src = stg + 4 * c * R + row;
            v[i] = make_float4(src[0], src[R], src[2 * R], src[3 * R]);
        }
        asm volatile("bar.sync 1, 128;\n" ::: "memory");       // every read of the staged operand done
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            const int idx = pt + 128 * i;
            const int c = (idx >> 5) & 7, row = (idx >> 8) * 32 + (idx & 31);
            put(tile + row * 128 + ((c ^ (row & 7)) << 4), v[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
            unsigned char* p = tile + 16 * (pt + 128 * i);
            put(p, *reinterpret_cast<const float4*>(p));
        }
    }
}

// The body of the turning kernels (PRODUCTS 1: gemm_wgmma_ra's B, MN_A and MN_B; 3: gemm_wgmma3_ra's
// B). A goes to the consumers' registers as the copy engine brought it (MN_A: gemm_wgmma_ra's boxes).
// COLSUM (MN_A): the consumers also sum A [K, M] as stored (fp32: the values before their split)
// over each tile's k range, the bias gradient of a weight gradient dW = dY^T X (A = dY), written by
// the tiles of the first column tile (n0 = 0) into colsum[split, m] (ws_consume), for elementwise.cu's
// sum_rows to add the splits in order.
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, bool MN_A, bool MN_B, int PRODUCTS,
          bool COLSUM = false>
__device__ __forceinline__ void ws_turn_gemm(float* C, float* aux, const TmaMap* mapA, const TmaMap* mapB,
                                             const float* bias, int M, int N, int K, int ldc, long long sC,
                                             float alpha, int splits, int k_chunk, int zs, float* colsum) {
    constexpr int WG = BM / 64;
    constexpr int A_BYTES = BM * 128;
    constexpr int HALF = (BM + BN) * 128;                       // the staged bytes of a k tile
    // 3xTF32: B's lo tile after them (A is split in the consumers' registers)
    constexpr int STAGE_BYTES = PRODUCTS == 3 ? (BM + 2 * BN) * 128 : HALF;
    constexpr int B_LO = BN * 128;                              // B's lo tile, from its hi tile
    constexpr bool SPLIT = PRODUCTS == 3;
    static_assert(BM % 64 == 0 && BM <= 256 && BN % 16 == 0 && BN <= 256, "wgmma tiles, TMA boxes <= 256");
    static_assert(STAGES >= 3, "a slot is refilled after the consumers issued the k tile after it");
    static_assert(PRODUCTS == 3 || (MN_A && MN_B), "TF32: the as-stored weight gradient only");
    static_assert(!COLSUM || MN_A, "column sums of an MN-major A");

    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long bars[3 * STAGES];    // full, empty, staged
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;
    unsigned char* const base = wg_smem + (smem0 - smem_u32(wg_smem));
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES, staged0 = full0 + 16 * STAGES;

    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int tiles_n = (N + BN - 1) / BN, tiles_m = (M + BM - 1) / BM;
    const int per_z = tiles_n * tiles_m, total = per_z * zs;
    ws_init_bars(full0, STAGES, 128, WG * 128, STAGES);

    if (wg == WG) {
        const int pt = tid - WG * 128;
        // the copy cursor (first producer warp only): tile lt, its k tile lkt of lnk; ld copies issued
        int lt = blockIdx.x, lkt = 0, lnk = 0, lm0 = 0, ln0 = 0, lkb0 = 0, lbatch = 0, ld = 0;
        auto seek = [&]() {               // lt -> the next tile of this block with k tiles
            for (; lt < total; lt += gridDim.x) {
                const WsTile tl(lt, per_z, tiles_n, BM, BN, K, splits, k_chunk);
                lnk = wg_k_tiles(tl.klen);
                if (lnk > 0) {
                    lm0 = tl.m0; ln0 = tl.n0; lkb0 = tl.kb0; lbatch = tl.batch;
                    return;
                }
            }
        };
        auto stage_next = [&]() {         // the cursor's k tile into slot ld % STAGES, once released
            if (lt >= total) return;
            const int s = ld % STAGES;
            if (ld >= STAGES) mbar_wait(empty0 + 8 * s, ((ld / STAGES) - 1) & 1);
            const unsigned st = smem0 + s * STAGE_BYTES;
            const int k0 = lkb0 + lkt * GEMM_WG_BK;     // MN maps' coordinates (row, k); K-major (k, row)
            if constexpr (MN_A)
                tma_load_ra<BM / 32>(lane, staged0 + 8 * s, HALF, st, mapA, lm0, k0, st + A_BYTES, mapB,
                                     MN_B ? ln0 : k0, MN_B ? k0 : ln0, lbatch);
            else
                tma_load_pair(lane, staged0 + 8 * s, HALF, st, mapA, MN_A ? lm0 : k0, MN_A ? k0 : lm0, st + A_BYTES,
                              mapB, MN_B ? ln0 : k0, MN_B ? k0 : ln0, lbatch);
            ++ld;
            if (++lkt == lnk) {
                lkt = 0;
                lt += gridDim.x;
                seek();
            }
        };
        if (pt < 32) {
            seek();
            for (int i = 0; i < STAGES - 1; ++i) stage_next();
        }
        int it = 0;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
            const WsTile tl(t, per_z, tiles_n, BM, BN, K, splits, k_chunk);
            const int nk = wg_k_tiles(tl.klen);
            for (int kt = 0; kt < nk; ++kt, ++it) {
                const int s = it % STAGES;
                mbar_wait(staged0 + 8 * s, (it / STAGES) & 1);
                unsigned char* slot = base + s * STAGE_BYTES;
                if constexpr (MN_B || SPLIT) ws_prepare<BN, MN_B, SPLIT, B_LO>(slot + A_BYTES, pt);
                wg_fence_async_smem();                        // the stores, into the async proxy
                mbar_arrive(full0 + 8 * s);
                if (pt < 32) stage_next();                    // k tile it + STAGES - 1, where it - 1 was
            }
        }
        return;
    }
    WsStride walk;
    ws_consume<BM, BN, STAGES, EPI, HAS_BIAS, PRODUCTS, true, COLSUM, false, MN_A>(
        walk, smem0, full0, empty0, C, aux, bias, M, N, K, ldc, sC, alpha, splits, k_chunk, per_z, tiles_n, total,
        colsum);
}

// ---------------------------------------------------------------------------------------------
// gemm_wgmma_ra: C = A^T B^T with A stored [batch, K, M] (MN-major: a weight gradient's dY as it
// lies) read through registers (register-A wgmma), and B [batch, N, K] K-major (MN_B = false: the
// TMA kernel's swizzled tile; the launcher transposes a B stored [K, N] first) or, MN_B, B stored
// [batch, K, N] turned K-major by the producer warpgroup (ws_turn_gemm). A's k tile arrives as
// BM / 32 boxes {32 m, 32 k} in the 128-byte swizzle (tensor map {M, K, batch}, 128 bytes of m
// inner); the consumers load their fragments from it (RaFrags) with rows permuted (ra_row), which
// the epilogue undoes. No transposing pass over A and no producer work on it. COLSUM: the consumers
// sum A's fragments per row (the bias gradient's partials, colsum[split, m]). TC (no epilogue, B
// K-major): C is stored transposed, C[n * ldc + m] (ra_store_t): the launcher runs a weight gradient
// dW = dY^T X whose X is the larger operand as dW^T = X^T dY, X through registers.
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, bool MN_B, bool COLSUM, bool TC, int THREADS,
          int SMEM>
__global__ void __launch_bounds__(THREADS, 1) gemm_wgmma_ra(WS_ARGS) {
    static_assert(THREADS == (BM / 64 + 1) * 128 && SMEM == STAGES * (BM + BN) * 128 + 1024,
                  "a consumer warpgroup a 64-row slice and the producer's; STAGES slots, 1 KB to align them");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    static_assert(!(TC && (MN_B || COLSUM)), "the transposed store: B K-major, no column sums");
    if constexpr (TC)
        ws_gemm<BM, BN, STAGES, EPI, HAS_BIAS, true, false, true>(C, aux, &mapA, &mapB, bias, M, N, K, ldc, sC, alpha,
                                                                  splits, k_chunk, zs, colsum);
    else if constexpr (MN_B)
        ws_turn_gemm<BM, BN, STAGES, EPI, HAS_BIAS, true, true, 1, COLSUM>(C, aux, &mapA, &mapB, bias, M, N, K, ldc,
                                                                           sC, alpha, splits, k_chunk, zs, colsum);
    else
        ws_gemm<BM, BN, STAGES, EPI, HAS_BIAS, true, COLSUM>(C, aux, &mapA, &mapB, bias, M, N, K, ldc, sC, alpha,
                                                             splits, k_chunk, zs, colsum);
#else
    __trap();
#endif
}

// gemm_wgmma3_ra: fp32 as 3xTF32 with A through registers: the copy engine brings A as stored (MN_A:
// [K, M] in gemm_wgmma_ra's boxes; else K-major, swizzled), the consumers load its fragments
// (RaFrags, RaFragsK) and split them into hi and lo themselves (ra3_k_tile); the producer warpgroup
// splits (and, MN_B, turns) only B, whose hi and lo tiles follow A's fp32 tile in the slot: (BM + 2 BN)
// x 128 bytes, a third less than both operands' halves, and no shared-memory pass over A. COLSUM
// (MN_A): the consumers' sums of A (the bias gradient's partials).
template <int BM, int BN, int STAGES, int EPI, bool HAS_BIAS, bool MN_A, bool MN_B, bool COLSUM, int THREADS,
          int SMEM>
__global__ void __launch_bounds__(THREADS, 1) gemm_wgmma3_ra(WS_ARGS) {
    static_assert(THREADS == (BM / 64 + 1) * 128 && SMEM == STAGES * (BM + 2 * BN) * 128 + 1024,
                  "a consumer warpgroup a 64-row slice and the producer's; STAGES slots, 1 KB to align them");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    ws_turn_gemm<BM, BN, STAGES, EPI, HAS_BIAS, MN_A, MN_B, 3, COLSUM>(C, aux, &mapA, &mapB, bias, M, N, K, ldc, sC,
                                                                       alpha, splits, k_chunk, zs, colsum);
#else
    __trap();
#endif
}

// ---------------------------------------------------------------------------------------------
// gemm_wgmma_dual: two independent bf16 products in one persistent launch, a layer's weight gradient
// W (dW = dY^T X: A [K, M] and B [K, N] as stored, C fp32, split-K partials or the product itself,
// COLSUM: A's column sums as gemm_wgmma_ws's) and the input gradient X that reads the same dY (dX = dY
// W: A [M, K], B [K, N] as stored, C bf16, EPI_X none or dgelu). Alone, W's 64-96 long tiles (K: the
// tokens) leave a third of the SMs idle or need split-K's partials and reduction, and X's short tiles
// end in a partial wave. Here one list holds W's tiles (longest first) then X's, and the blocks take
// them from a counter as they free up: the SMs W leaves free run X's tiles meanwhile. Each tile is
// computed whole by one block exactly as gemm_wgmma_ws computes it (the same ws_produce / ws_consume),
// so the results are those of the two launches with the same tiles and splits, bit for bit, whichever
// block takes a tile. Both products share the tile (BM, BN: 128 x 192, 128 x 256, 256 x 128 without
// the column sums) and the ring; X's staging boxes follow it.
//
// WsDynWalk: a block's first tile is blockIdx.x, each next one gridDim.x + the old value of the counter
// tiles[0] (an integer atomic: which block takes a tile changes, never its arithmetic), so a block's
// tiles rise through the list: W's, then X's. The producer's first warp takes them (lane 0, broadcast)
// and passes each to the consumers through a ring of D ids in shared memory (full: one arrival by lane
// 0 after its store; empty: one by each consumer thread after its load), the first id past the list
// too, after which the block stops. Every block makes exactly one fetch past the list, the values of
// those fetches being total - gridDim.x .. total - 1: the one that returns total - 1 is the launch's
// last, and resets the counter to 0 for the next launch (the launcher zeroes it once when it is made).
// `base`: the list index of the product being walked (0 for W, W's tile count for X).
// more(): whether the block has a tile after this one, in either product (the consumers of the ping-pong
// form pass the other warpgroup its turn then): the next id read ahead, and kept for next().
template <int D, bool PRODUCER>
struct WsDynWalk {
    int t, it = 0, base = 0, j = 0, ahead = -1;
    int* ctr;
    int total, lane;
    unsigned ids, full0, empty0;
    __device__ __forceinline__ WsDynWalk(int* ctr_, int total_, unsigned ids_, unsigned bars0, int lane_)
        : t(blockIdx.x), ctr(ctr_), total(total_), lane(lane_), ids(ids_), full0(bars0), empty0(bars0 + 8 * D) {}
    __device__ __forceinline__ int first() const { return t - base; }
    __device__ __forceinline__ int take() {          // the consumers' read of id j
        const int s = j % D;
        int id;
        mbar_wait(full0 + 8 * s, (j / D) & 1);
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(id) : "r"(ids + 4 * s) : "memory");
        mbar_arrive(empty0 + 8 * s);
        ++j;
        return id;
    }
    __device__ __forceinline__ bool more(int) {
        if (ahead < 0) ahead = take();
        return ahead < total;
    }
    __device__ __forceinline__ int next() {
        if constexpr (PRODUCER) {
            const int s = j % D;
            int id = 0;
            if (lane == 0) {
                const int c = atomicAdd(ctr, 1);
                if (c == total - 1) atomicExch(ctr, 0);
                id = gridDim.x + c;
            }
            id = __shfl_sync(0xffffffffu, id, 0);
            if (j >= D) mbar_wait(empty0 + 8 * s, ((j / D) - 1) & 1);
            if (lane == 0) {
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ids + 4 * s), "r"(id) : "memory");
                mbar_arrive(full0 + 8 * s);
            }
            t = id;
            ++j;
        } else if (ahead >= 0) {
            t = ahead;
            ahead = -1;
        } else {
            t = take();
        }
        return t - base;
    }
};

#define DUAL_IDS 4
// W: C (fp32, or bf16 where OUT_W: unsplit only) [splits, M, N] (the partials where splits > 1), colsum
// [splits x rows, M] or null; X: C and
// aux (bf16) [M, N], stored through C's and aux's maps (WS_ARGS_C, c_tma as gemm_wgmma_ws's); tiles: the
// counter (one int, zero before the first launch).
#define DUAL_ARGS                                                                                     \
    elem<OUT_W>* Cw, const __grid_constant__ TmaMap mapAw, const __grid_constant__ TmaMap mapBw,   \
    int Mw, int Nw, int Kw, int splits, int k_chunk, float* colsum,                                  \
    bf16* Cx, bf16* aux, const __grid_constant__ TmaMap mapAx, const __grid_constant__ TmaMap mapBx, \
    int Mx, int Nx, int Kx, WS_ARGS_C, int* tiles

// PP: the consumers of gemm_wgmma_pp (pp_consume: each warpgroup whole tiles, alternating, one's epilogue
// under the other's k loop; 128 x 128 and 128 x 192 for X without the GELU's backward) instead of
// gemm_wgmma_ws's, their turn passed on across the two products. OUT_W: W's C element type (0 fp32; 1 bf16,
// the launcher's choice for an unsplit W only: split partials are fp32, reduced by gemm_splitk_reduce).
template <int BM, int BN, int STAGES, int EPI_X, int THREADS, int SMEM, int COLSUM, int PP = 0, int OUT_W = 0>
__global__ void __launch_bounds__(THREADS, 1) gemm_wgmma_dual(DUAL_ARGS) {
    constexpr int WG = PP ? 2 : BM / 64;
    static_assert(THREADS == (WG + 1) * 128 && SMEM == STAGES * (BM + BN) * 128 + 1024 + ws_stage_bytes(WG, 1),
                  "as gemm_wgmma_ws (gemm_wgmma_pp) with a bf16 C");
    static_assert(BM % 64 == 0 && BN % 64 == 0 && BN <= 256 && STAGES >= 2, "MN-major operands in boxes of 64");
    static_assert(EPI_X == GEMM_EPI_NONE || EPI_X == GEMM_EPI_DGELU, "X: dY W, plain or with the GELU's backward");
    static_assert(COLSUM == 0 || WG == 2, "the column sums' buffer (1 KB a consumer warpgroup) does not fit beside "
                                          "four warpgroups' staging boxes and the 256 x 128 ring");
    static_assert(!PP || (BM == 128 && BM * BN <= 128 * 192), "gemm_wgmma_pp's tiles");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using OPW = Bf16Op<true, true>;
    using OPX = Bf16Op<false, true>;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    __shared__ __align__(8) unsigned long long bars[2 * STAGES + 2 * DUAL_IDS];   // ring, then the ids' full, empty
    __shared__ int ids[DUAL_IDS];
    const unsigned smem0 = (smem_u32(wg_smem) + 1023u) & ~1023u;
    const unsigned full0 = smem_u32(bars), empty0 = full0 + 8 * STAGES, idbars = full0 + 16 * STAGES;
    const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31;
    const int tiles_nw = (Nw + BN - 1) / BN, per_zw = tiles_nw * ((Mw + BM - 1) / BM), total_w = per_zw * splits;
    const int tiles_nx = (Nx + BN - 1) / BN, total_x = tiles_nx * ((Mx + BM - 1) / BM);
    if (tid == 0) {       // (ws_init_bars' fence and barrier cover these)
        for (int s = 0; s < DUAL_IDS; ++s) {
            mbar_init(idbars + 8 * s, 1);
            mbar_init(idbars + 8 * (DUAL_IDS + s), WG * 128);
        }
    }
    ws_init_bars(full0, STAGES, 1, PP ? 128 : WG * 128, 0);            // (ping-pong: one warpgroup reads a slot)
    constexpr int PRODUCER_REGS = PP && BM * BN <= 128 * 128 ? 40 : 24;     // (gemm_wgmma_pp's split)
    constexpr int CONSUMER_REGS = wg_consumer_regs(THREADS, WG, PRODUCER_REGS);
    if (wg == WG) {       // producer: W's tiles, then X's
        wg_regs_dec<PRODUCER_REGS>();
        if (tid < WG * 128 + 32) {
            WsDynWalk<DUAL_IDS, true> walk(tiles, total_w + total_x, smem_u32(ids), idbars, lane);
            ws_produce<BM, BN, STAGES, false, OPW>(walk, smem0, full0, empty0, &mapAw, &mapBw, Kw, splits, k_chunk,
                                                   per_zw, tiles_nw, total_w, lane);
            walk.base = total_w;
            ws_produce<BM, BN, STAGES, false, OPX>(walk, smem0, full0, empty0, &mapAx, &mapBx, Kx, 1, max(Kx, 1),
                                                   total_x, tiles_nx, total_x, lane);
        }
        return;
    }
    wg_regs_inc<CONSUMER_REGS>();
    WsDynWalk<DUAL_IDS, false> walk(tiles, total_w + total_x, smem_u32(ids), idbars, lane);
    if constexpr (PP) {
        __shared__ float pp_red[COLSUM > 0 ? 2 * 2 * 256 : 1];
        __shared__ __align__(16) float pp_bias[4];
        PpTurn turn;
        pp_consume<BM, BN, STAGES, GEMM_EPI_NONE, false, OPW, elem<OUT_W>, COLSUM>(
            walk, turn, smem0, full0, empty0, Cw, nullptr, nullptr, Mw, Nw, Kw, Nw, (long long)Mw * Nw, 1.f, splits,
            k_chunk, per_zw, tiles_nw, total_w, colsum, nullptr, nullptr, 0, pp_bias, pp_red, wg, tid & 127);
        walk.base = total_w;
        pp_consume<BM, BN, STAGES, EPI_X, false, OPX, bf16, 0>(
            walk, turn, smem0, full0, empty0, Cx, aux, nullptr, Mx, Nx, Kx, Nx, (long long)Mx * Nx, 1.f, 1, max(Kx, 1),
            total_x, tiles_nx, total_x, nullptr, &mapC, &mapX, c_tma, pp_bias, pp_red, wg, tid & 127);
    } else {
        ws_consume<BM, BN, STAGES, GEMM_EPI_NONE, false, 1, false, (COLSUM > 0), false, true, OPW, elem<OUT_W>,
                   COLSUM>(
            walk, smem0, full0, empty0, Cw, nullptr, nullptr, Mw, Nw, Kw, Nw, (long long)Mw * Nw, 1.f, splits,
            k_chunk, per_zw, tiles_nw, total_w, colsum);
        walk.base = total_w;
        ws_consume<BM, BN, STAGES, EPI_X, false, 1, false, false, false, true, OPX, bf16, 1>(
            walk, smem0, full0, empty0, Cx, aux, nullptr, Mx, Nx, Kx, Nx, (long long)Mx * Nx, 1.f, 1, max(Kx, 1),
            total_x, tiles_nx, total_x, nullptr, &mapC, &mapX, c_tma, smem0 + STAGES * (BM + BN) * 128);
    }
#else
    __trap();
#endif
}
