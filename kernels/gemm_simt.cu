// fp32 SIMT GEMM (CUDA cores): C = alpha * op(A) op(B) (+ bias) (+ epilogue), row-major.
//
//   op(A) is [M, K]: A stored [M, K], or [K, M] when TA (read transposed in place)
//   op(B) is [K, N]: B stored [K, N], or [N, K] when TB
//
// Template parameters (launcher: gptcuda/ops/cuda/gemm/):
//   BM, BN    block tile (128x128 / 128x64 / 64x64); BK = 8; every thread owns an 8x8 tile of C
//             made of 2x2 sub-tiles of 4x4 (rows tr*4.. and BM/2 + tr*4.., same for columns),
//             so its shared-memory fragment reads are 128-bit and a warp's reads are broadcasts.
//   TA, TB    transpose flags (the four cases share one body; only the staging differs).
//   EPI       0 none, 1 bias, 2 GELU(tanh) (aux = pre-activation, C = gelu(pre)),
//             3 residual (C = aux + result; aux may alias C),
//             4 GELU backward (C = result * gelu_tanh'(aux); aux = the saved pre-activation, read
//               only; C must not alias aux: the MLP backward dfc = (d @ W) * gelu'(fc_pre)).
//   HAS_BIAS  add bias[n] (EPI 1 requires it; optional for 0 is meaningless, for 2 and 3 allowed;
//             the launcher never pairs it with 4).
//   VEC       128-bit global loads of A and B: requires lda, ldb, the batch strides, k_chunk and the
//             base pointers to be multiples of 4 floats / 16 bytes. Tails are still guarded
//             element by element, so any M, N, K works on both paths.
//
// Batching and split-K share gridDim.z: z = batch * splits + split. Block (x, y, z) computes the
// tile (n0 = x*BN, m0 = y*BM) of batch z / splits over k in [split*k_chunk, min(K, +k_chunk)) and
// writes C + z*sC (split-K partials land in a workspace [splits, M, N] with EPI 0, and
// gemm_splitk_reduce sums them in a fixed order and applies the epilogue: deterministic).
//
// Pipeline: two shared-memory stages; the global loads of tile k+1 are issued into registers
// before the FMAs of tile k and stored to the other stage after them; one barrier per tile.
// Shared layout: As[stage][k][m] (+4 floats of padding per row so that the transposing scalar
// stores of the k-contiguous cases hit 32 distinct banks), Bs[stage][k][n] likewise.
#include "gemm_epilogue.cuh"

// Load the 4 consecutive elements p[0], p[s], p[2s], p[3s] ... here always unit stride: p[0..3],
// element e valid when e < n_valid (n_valid <= 0: all zero). VEC: one 16-byte load when all 4 valid.
template <bool VEC>
__device__ __forceinline__ float4 gemm_ld4(const float* __restrict__ p, bool row_ok, int n_valid) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!row_ok) return v;
    if (VEC && n_valid >= 4) {
        v = __ldg(reinterpret_cast<const float4*>(p));
    } else {
        if (n_valid > 0) v.x = __ldg(p);
        if (n_valid > 1) v.y = __ldg(p + 1);
        if (n_valid > 2) v.z = __ldg(p + 2);
        if (n_valid > 3) v.w = __ldg(p + 3);
    }
    return v;
}

// THREADS = (BM / 8) * (BN / 8) (an 8x8 register tile a thread, asserted) and MIN_BLOCKS, the resident
// blocks per SM asked of the register allocator, are the launcher's (families.py SIMT_BLOCKS_PER_SM).
template <int BM, int BN, bool TA, bool TB, int EPI, bool HAS_BIAS, bool VEC, int THREADS, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemm_simt(GEMM_ARGS_F32) {
    constexpr int BK = 8;
    constexpr int PAD = 4;
    static_assert(THREADS == (BM / 8) * (BN / 8), "a thread computes an 8x8 tile of the block's");
    constexpr int TC = BN / 8;             // thread columns
    constexpr int WARPS_C = TC / 8;        // a warp is 4 thread rows x 8 thread columns
    constexpr int LA = BM * BK / (4 * THREADS);   // float4 loads of A per thread per tile
    constexpr int LB = BN * BK / (4 * THREADS);
    static_assert(BN >= 64 && BM >= 32 && LA >= 1 && LB >= 1, "tile shape");
    static_assert(THREADS % 32 == 0, "whole warps");

    __shared__ __align__(16) float As[2][BK][BM + PAD];
    __shared__ __align__(16) float Bs[2][BK][BN + PAD];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    // A warp is 4 thread rows x 8 thread columns. The row index takes lane bits 1 and 4, the
    // column index lane bits 0, 2, 3: then lanes n and n^1 read the same A fragment address and
    // lanes n and n^2 the same B address, which lets the shared-memory unit pack the broadcast
    // and return an LDS.128 in 2 passes instead of 4 (its return path is 128 B per cycle).
    const int lr = ((lane >> 1) & 1) | ((lane >> 3) & 2);        // lane bits 1, 4
    const int lc = (lane & 1) | ((lane >> 1) & 6);               // lane bits 0, 2, 3
    const int tr = (warp / WARPS_C) * 4 + lr;   // 0 .. BM/8-1
    const int tc = (warp % WARPS_C) * 8 + lc;   // 0 .. BN/8-1

    const GemmBlock<BM, BN> blk(K, splits, k_chunk);
    const int z = blockIdx.z, batch = blk.batch, m0 = blk.m0, n0 = blk.n0;
    const int kb = blk.kb0, klen = blk.klen;             // klen may be <= 0 for an empty last split

    A += batch * sA + (TA ? (long long)kb * lda : (long long)kb);
    B += batch * sB + (TB ? (long long)kb : (long long)kb * ldb);
    C += z * sC;
    if constexpr (GEMM_EPI_USES_AUX(EPI)) aux += z * sC;

    // Per-thread staging coordinates (fixed over the k loop).
    // !TA: A tile is BM rows x BK k (k contiguous): float4 f -> row f/2, k (f%2)*4
    //  TA: A tile is BK k rows x BM m (m contiguous): float4 f -> k f/(BM/4), m (f%(BM/4))*4
    int a_r[LA], a_c[LA];
#pragma unroll
    for (int j = 0; j < LA; ++j) {
        int f = tid + j * THREADS;
        if constexpr (!TA) { a_r[j] = f >> 1; a_c[j] = (f & 1) * 4; }
        else { a_r[j] = f / (BM / 4); a_c[j] = (f % (BM / 4)) * 4; }
    }
    int b_r[LB], b_c[LB];
#pragma unroll
    for (int j = 0; j < LB; ++j) {
        int f = tid + j * THREADS;
        if constexpr (TB) { b_r[j] = f >> 1; b_c[j] = (f & 1) * 4; }        // n row, k col
        else { b_r[j] = f / (BN / 4); b_c[j] = (f % (BN / 4)) * 4; }        // k row, n col
    }

    float4 ra[LA], rb[LB];
    auto load_global = [&](int k0) {
#pragma unroll
        for (int j = 0; j < LA; ++j) {
            if constexpr (!TA) {
                int gm = m0 + a_r[j], gk = k0 + a_c[j];
                ra[j] = gemm_ld4<VEC>(A + (long long)gm * lda + gk, gm < M, klen - gk);
            } else {
                int gk = k0 + a_r[j], gm = m0 + a_c[j];
                ra[j] = gemm_ld4<VEC>(A + (long long)gk * lda + gm, gk < klen, M - gm);
            }
        }
#pragma unroll
        for (int j = 0; j < LB; ++j) {
            if constexpr (TB) {
                int gn = n0 + b_r[j], gk = k0 + b_c[j];
                rb[j] = gemm_ld4<VEC>(B + (long long)gn * ldb + gk, gn < N, klen - gk);
            } else {
                int gk = k0 + b_r[j], gn = n0 + b_c[j];
                rb[j] = gemm_ld4<VEC>(B + (long long)gk * ldb + gn, gk < klen, N - gn);
            }
        }
    };
    auto store_shared = [&](int s) {
#pragma unroll
        for (int j = 0; j < LA; ++j) {
            if constexpr (!TA) {
                As[s][a_c[j] + 0][a_r[j]] = ra[j].x;
                As[s][a_c[j] + 1][a_r[j]] = ra[j].y;
                As[s][a_c[j] + 2][a_r[j]] = ra[j].z;
                As[s][a_c[j] + 3][a_r[j]] = ra[j].w;
            } else {
                *reinterpret_cast<float4*>(&As[s][a_r[j]][a_c[j]]) = ra[j];
            }
        }
#pragma unroll
        for (int j = 0; j < LB; ++j) {
            if constexpr (TB) {
                Bs[s][b_c[j] + 0][b_r[j]] = rb[j].x;
                Bs[s][b_c[j] + 1][b_r[j]] = rb[j].y;
                Bs[s][b_c[j] + 2][b_r[j]] = rb[j].z;
                Bs[s][b_c[j] + 3][b_r[j]] = rb[j].w;
            } else {
                *reinterpret_cast<float4*>(&Bs[s][b_r[j]][b_c[j]]) = rb[j];
            }
        }
    };

    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

    const int nk = klen > 0 ? (klen + BK - 1) / BK : 0;
    if (nk > 0) {
        load_global(0);
        store_shared(0);
        __syncthreads();
    }
    for (int kt = 0; kt < nk; ++kt) {
        const int s = kt & 1;
        const bool more = kt + 1 < nk;
        if (more) load_global((kt + 1) * BK);
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float4 a0 = *reinterpret_cast<const float4*>(&As[s][k][tr * 4]);
            float4 a1 = *reinterpret_cast<const float4*>(&As[s][k][BM / 2 + tr * 4]);
            float4 b0 = *reinterpret_cast<const float4*>(&Bs[s][k][tc * 4]);
            float4 b1 = *reinterpret_cast<const float4*>(&Bs[s][k][BN / 2 + tc * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (more) store_shared(s ^ 1);
        __syncthreads();
    }

    // Epilogue: 16-byte stores when C (and aux, bias) rows are 16-byte aligned.
    const bool vec = gemm_epi_vec_ok<EPI, HAS_BIAS>(C, aux, bias, ldc, sC);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int r = m0 + (i < 4 ? tr * 4 + i : BM / 2 + tr * 4 + (i - 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int c = n0 + h * (BN / 2) + tc * 4;
            const float v[4] = {acc[i][h * 4 + 0], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]};
            gemm_store4<EPI, HAS_BIAS>(C, aux, bias, r, c, M, N, ldc, alpha, vec, v);
        }
    }
}

// Deterministic split-K reduction: C[m, n] = epilogue(alpha * sum_{s=0..splits-1} ws[s, m, n]),
// summed in increasing s for every element. C, aux: [M, N] with row stride ldc. Where N is a multiple
// of 4 (and ws 16-byte aligned) a thread takes 4 consecutive elements of a row: one 16-byte load a
// split, gemm_store4's epilogue and stores (16-byte where C, aux and the bias allow); else one element.
// OUT: C's and aux's element type (0 fp32; 1 bf16: the sum rounded once where stored, gemm_store4_once's
// bf16 epilogue: the weight gradients of a bf16 model that keeps its gradients in bf16).
template <int EPI, bool HAS_BIAS, int THREADS, int OUT = 0>
__global__ void __launch_bounds__(THREADS)
gemm_splitk_reduce(elem<OUT>* C,                    // C [M, N] (row stride ldc)
                   elem<OUT>* aux,                  // aux [M, N] (row stride ldc) or null
                   const float* __restrict__ ws,    // ws [splits, M, N] (contiguous)
                   const float* __restrict__ bias,  // bias [N] or null
                   int M, int N, int ldc, int splits, float alpha) {
    const long long total = (long long)M * N;
    if ((N & 3) == 0 && (reinterpret_cast<unsigned long long>(ws) & 15) == 0) {
        const bool vec = gemm_epi_vec_ok<EPI, HAS_BIAS, elem<OUT>>(C, aux, bias, ldc, 0);
        const float4* w4 = reinterpret_cast<const float4*>(ws);
        for (long long i4 = (long long)blockIdx.x * blockDim.x + threadIdx.x; i4 < (total >> 2);
             i4 += (long long)gridDim.x * blockDim.x) {
            float v[4] = {0.f, 0.f, 0.f, 0.f};
            for (int p0 = 0; p0 < splits; p0 += 4) {     // four splits' loads in flight, added in order
                float4 t[4];
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    if (p0 + q < splits) t[q] = __ldg(w4 + (long long)(p0 + q) * (total >> 2) + i4);
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    if (p0 + q < splits) {
                        v[0] += t[q].x; v[1] += t[q].y; v[2] += t[q].z; v[3] += t[q].w;
                    }
                }
            }
            const int N4 = N >> 2;              // a row's groups; 32-bit division where i4 fits
            const int m = i4 < 0x7fffffffLL ? (int)((unsigned)i4 / (unsigned)N4) : (int)(i4 / N4);
            const int n = (int)(i4 - (long long)m * N4) << 2;
            if constexpr (OUT == 0)
                gemm_store4<EPI, HAS_BIAS>(C, aux, bias, m, n, M, N, ldc, alpha, vec, v);
            else
                gemm_store4_once<EPI, HAS_BIAS, bf16>(C, aux, bias, m, n, M, N, ldc, alpha, vec && m < M && n + 3 < N,
                                                      v);
        }
        return;
    }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        float s = 0.f;
        for (int p = 0; p < splits; ++p) s += __ldg(ws + (long long)p * total + i);
        const int m = (int)(i / N), n = (int)(i - (long long)m * N);
        const long long off = (long long)m * ldc + n;
        float b = 0.f, res = 0.f, pre;
        if constexpr (HAS_BIAS) b = __ldg(bias + n);
        if constexpr (GEMM_EPI_READS_AUX(EPI)) res = val_ld(aux + off);
        float o;
        if constexpr (OUT == 0)
            o = gemm_epi_value<EPI, HAS_BIAS>(s, alpha, b, res, &pre);
        else
            o = gemm_epi_value_bf16<EPI, HAS_BIAS>(s, alpha, b, res, &pre);
        if constexpr (EPI == GEMM_EPI_GELU) val_st(aux + off, pre);
        val_st(C + off, o);
    }
}

// ---------------------------------------------------------------------------------------------
// Operand preparation for the wgmma kernels (gemm_wgmma.cu's TF32 kernels read B, and the swapped
// weight gradient A, K-major).

// out [N, K] = in [K, N] (row-major, dense rows): the B operand of a transpose_b plan, or the A^T of
// a swapped weight gradient. A block of 256 threads moves a 64 (k) x 64 (n) tile through shared
// memory, rows padded to 65 floats (column reads: at most 2-way bank conflicts); each thread loads
// four 4-wide row pieces and stores four 4-wide pieces, so reads and writes are coalesced and
// several loads are in flight per thread.
// VEC: K and N multiples of 4, in and out 16-byte aligned: float4 loads and stores; else the same
// tile with guarded scalar accesses. Grid (ceil(N / 64), ceil(K / 64)).
// COLSUM: also colsum[chunk0 + blockIdx.y, n] = the sum of in[k, n] over the tile's rows k (the
// partial column sums of an A [K, M] whose transpose feeds a weight gradient: its bias gradient,
// finished by elementwise.cu's sum_rows); four 16-row sums added in order: deterministic.
template <bool VEC, bool COLSUM, int TILE, int THREADS>
__global__ void __launch_bounds__(THREADS) gemm_transpose(float* __restrict__ out,       // out [N, K]
                                                      const float* __restrict__ in,  // in [K, N]
                                                      int K, int N,
                                                      float* __restrict__ colsum,    // colsum [chunks, N] (COLSUM)
                                                      int chunk0) {
    static_assert(TILE == 64 && THREADS == 256, "16 x 16 threads move a 64 x 64 tile in 4 passes of 16 rows");
    __shared__ float tile[TILE][TILE + 1];                 // tile[k - k0][n - n0]
    const int n0 = blockIdx.x * TILE, k0 = blockIdx.y * TILE;
    const int row = threadIdx.x >> 4, col = (threadIdx.x & 15) * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {                                // rows k0 + r of in, columns n0 + col ..
        const int r = row + 16 * i, k = k0 + r, n = n0 + col;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (k < K) {
            const float* src = in + (long long)k * N + n;
            if constexpr (VEC) {
                if (n < N) {
                    const float4 q = *reinterpret_cast<const float4*>(src);
                    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
                }
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (n + e < N) v[e] = src[e];
            }
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) tile[r][col + e] = v[e];
    }
    __syncthreads();
    if constexpr (COLSUM) {                                      // rows past K and columns past N are 0
        __shared__ float part[4][TILE];
        const int c = threadIdx.x & (TILE - 1), q = threadIdx.x >> 6;
        float sum = 0.f;
#pragma unroll
        for (int r = 0; r < 16; ++r) sum += tile[16 * q + r][c];
        part[q][c] = sum;
        __syncthreads();
        if (threadIdx.x < TILE && n0 + c < N)
            colsum[(long long)(chunk0 + blockIdx.y) * N + n0 + c] = ((part[0][c] + part[1][c]) + part[2][c]) + part[3][c];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {                                // rows n0 + r of out, columns k0 + col ..
        const int r = row + 16 * i, n = n0 + r, k = k0 + col;
        if (n >= N || k >= K) continue;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = tile[col + e][r];
        float* dst = out + (long long)n * K + k;
        if constexpr (VEC) {
            *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (k + e < K) dst[e] = v[e];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The ladder: teaching kernels for bench/gemm.py --ladder (not used by training). Each is
// C[M, N] = A[M, K] @ B[K, N], row-major, any size; each step fixes the main problem of the last.
// ---------------------------------------------------------------------------------------------

// 1. naive: one thread per output, threadIdx.x walks down a column of C, so neighbouring
//    threads read A rows K apart and write C N apart (uncoalesced). block (16, 16)
__global__ void gemm_ladder_naive(float* C, const float* A, const float* B, int M, int N, int K) {
    const int row = blockIdx.y * 16 + threadIdx.x;
    const int col = blockIdx.x * 16 + threadIdx.y;
    if (row >= M || col >= N) return;
    float s = 0.f;
    for (int k = 0; k < K; ++k) s = fmaf(A[(long long)row * K + k], B[(long long)k * N + col], s);
    C[(long long)row * N + col] = s;
}

// 2. coalesced: threadIdx.x walks along a row of C: B and C accesses are coalesced, A is a
//    broadcast. block (32, 8)
__global__ void gemm_ladder_coalesced(float* C, const float* A, const float* B, int M, int N, int K) {
    const int col = blockIdx.x * 32 + threadIdx.x;
    const int row = blockIdx.y * 8 + threadIdx.y;
    if (row >= M || col >= N) return;
    float s = 0.f;
    for (int k = 0; k < K; ++k) s = fmaf(A[(long long)row * K + k], B[(long long)k * N + col], s);
    C[(long long)row * N + col] = s;
}

// 3. shared-memory tiles: each TS x TS tile of A and B is read from global memory once per
//    block instead of once per thread. block (TS, TS)
template <int TS>
__global__ void __launch_bounds__(TS * TS)
gemm_ladder_smem(float* C, const float* A, const float* B, int M, int N, int K) {
    __shared__ float As[TS][TS];
    __shared__ float Bs[TS][TS + 1];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int row = blockIdx.y * TS + ty, col = blockIdx.x * TS + tx;
    float s = 0.f;
    for (int k0 = 0; k0 < K; k0 += TS) {
        As[ty][tx] = (row < M && k0 + tx < K) ? A[(long long)row * K + k0 + tx] : 0.f;
        Bs[ty][tx] = (k0 + ty < K && col < N) ? B[(long long)(k0 + ty) * N + col] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TS; ++k) s = fmaf(As[ty][k], Bs[k][tx], s);
        __syncthreads();
    }
    if (row < M && col < N) C[(long long)row * N + col] = s;
}

// 4. register tiles: each thread computes TM x TN outputs from TM + TN shared-memory reads per
//    k, so the FMA : shared-load ratio grows from 1:2 to TM*TN : TM+TN. block (BM/TM * BN/TN)
template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
gemm_ladder_regtile(float* C, const float* A, const float* B, int M, int N, int K) {
    constexpr int THREADS = (BM / TM) * (BN / TN);
    __shared__ float As[BK][BM];
    __shared__ float Bs[BK][BN];
    const int tid = threadIdx.x;
    const int tr = tid / (BN / TN), tc = tid % (BN / TN);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    float acc[TM][TN] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = tid; i < BM * BK; i += THREADS) {
            const int r = i / BK, k = i % BK;
            As[k][r] = (m0 + r < M && k0 + k < K) ? A[(long long)(m0 + r) * K + k0 + k] : 0.f;
        }
        for (int i = tid; i < BK * BN; i += THREADS) {
            const int k = i / BN, c = i % BN;
            Bs[k][c] = (k0 + k < K && n0 + c < N) ? B[(long long)(k0 + k) * N + n0 + c] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][tr * TM + i];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tc * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int r = m0 + tr * TM + i, c = n0 + tc * TN + j;
            if (r < M && c < N) C[(long long)r * N + c] = acc[i][j];
        }
}
