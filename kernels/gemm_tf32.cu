// TF32 tensor-core GEMM: C = alpha * op(A) op(B) (+ bias) (+ epilogue), row-major, fp32 in and out.
// Same arguments, transpose cases, epilogues, batching and split-K as gemm_simt (the epilogue
// helpers come from gemm_epilogue.cuh; split-K partials are reduced by gemm_simt.cu's
// gemm_splitk_reduce).
//
// Instruction: mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32, operands rounded with
// cvt.rna.tf32.f32. Fragment ownership (lane = 4 g + t; PTX ISA, checked by mma_probe):
//   A (16x8): a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)
//   B (8x8):  b0 (k=t, n=g)  b1 (k=t+4, n=g)
//   C (16x8): c0 (g, 2t)  c1 (g, 2t+1)  c2 (g+8, 2t)  c3 (g+8, 2t+1)
//
// Index permutations (free, because they are applied consistently):
//   k:  within a 16-wide k block kb of the 32-wide k tile, mma step j (0, 1), the logical
//       fragment column t (hi = 0) or t+4 (hi = 1) is the physical k = 16 kb + 4 t + 2 j + hi;
//   m:  the fragment rows g (h = 0) / g+8 (h = 1) of m16 tile mi of a warp are the physical row
//       32 (mi / 2) + 4 g + 2 (mi % 2) + h of the warp tile;
//   n:  the fragment column c of n8 tile ni is the physical column 32 (ni / 4) + 4 c + ni % 4.
// So every fragment load is one 128-bit shared load holding 4 useful values:
//   k-contiguous operand (A !TA, B TB): row r, k = 16 kb + 4 t .. +3 -> both mma steps j, hi
//   m/n-contiguous (A TA, B !TB):       k row, 4 consecutive m (n) -> 2 m16 tiles x h (4 n8 tiles)
// and every thread's accumulators for 4 n8 tiles are 4 consecutive columns (16-byte stores).
//
// Shared layout per stage (floats; 16-byte chunks XOR-swizzled; tools/smem_banks.py proves it):
//   K-major  [R][32]:  (r, k) -> r*32 + ((k/4) ^ (((r/4) & 1) * 4)) * 4 + k%4
//   MN-major [32][R]:  (k, c) -> k*R + ((c/4) ^ (((k/4) & 3) * 2)) * 4 + c%4
// Fragment loads are conflict-free (each quarter warp covers the 8 chunk positions of 128
// bytes); cp.async staging stores of a quarter warp are 8 consecutive chunks of one row, so
// conflict-free too. The unaligned fallback (VEC = false) stages element by element with 4-byte
// cp.async (32 consecutive floats per warp: conflict-free) and guards every element.
//
// Pipeline: STAGES-deep cp.async ring, one __syncthreads per 32-wide k tile. Each thread's 16-byte
// copies are planned once (Tf32Stager: one global address and one shared offset, a constant step
// per k tile); tiles entirely inside the matrix are copied with no guard, edge tiles zero-fill
// (cp.async src-size) what lies outside. After the barrier a warp issues the shared loads of its
// first fragments, then the copies of the tile STAGES-1 ahead, then the mma.sync of the tile.
// Epilogue: blocks entirely inside C with 16-byte aligned rows store with no guard.
// Epilogue codes as in gemm_epilogue.cuh (0 none, 1 bias, 2 GELU, 3 residual, 4 GELU backward).
#include "gemm_epilogue.cuh"

#define GEMM_TF32_BK 32

// Must match gptcuda/ops/cuda/gemm/families.py (TF32 layouts are mirrored in tools/smem_banks.py).
__device__ __forceinline__ int tf32_off_kmajor(int r, int k) {
    return r * 32 + ((((k >> 2) ^ (((r >> 2) & 1) << 2))) << 2) + (k & 3);
}
template <int R>
__device__ __forceinline__ int tf32_off_mnmajor(int k, int c) {
    return k * R + ((((c >> 2) ^ (((k >> 2) & 3) << 1))) << 2) + (c & 3);
}

// fp32 -> tf32, round to nearest, ties away from zero: the PTX instruction.
__device__ __forceinline__ unsigned tf32_round_cvt(float x) {
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(u) : "f"(x));
    return u;
}

// The same rounding as one integer add (used in the GEMM main loops): adding half a tf32 ulp
// (bit 12) to the sign-magnitude pattern and letting the tensor core ignore the 13 low bits is
// exactly cvt.rna.tf32.f32 for every finite input (overflow rounds to inf, as cvt.rna does) and
// keeps inf and quiet NaN. On sm_90 cvt.rna.tf32.f32 becomes a compare + predicated add + a move
// into the mma operand registers (3 instructions per element, more than the mma themselves);
// tf32_round_probe / tests/gpu/test_gemm.py check the two agree bit for bit in the top 19 bits.
__device__ __forceinline__ unsigned tf32_round(float x) {
    return __float_as_uint(x) + 0x1000u;
}

// d += a (16x8, row) * b (8x8, col)
__device__ __forceinline__ void tf32_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 16-byte staging of one operand tile (R rows of m or n, 32 of k) with cp.async (VEC).
// The tile is R*8 chunks of 4 floats; thread tid copies chunks f = tid + i*THREADS, i < CH:
//   K-major  (element (rc, k) at G[rc*ld + k]): chunk f is row f/8, k 4*(f%8) .. +3
//   MN-major (element (k, rc) at G[k*ld + rc]): chunk f is k row f/CPR, columns 4*(f%CPR) .. +3
// (CPR = R/4). THREADS is a multiple of the chunks per row (8 or CPR), so chunk i of a thread is
// chunk 0 moved STEP rows on: one 64-bit global address and one shared offset per thread are
// computed once, and each k tile adds a constant. Interior tiles (every row and k in range) are
// copied with no guard at all; edge tiles zero-fill what lies outside the matrix.
template <bool KMAJOR, int R, int THREADS>
struct Tf32Stager {
    static constexpr int CHUNKS = R * 8;
    static constexpr int CH = (CHUNKS + THREADS - 1) / THREADS;
    static constexpr bool EXACT = CHUNKS % THREADS == 0;
    static constexpr int CPR = KMAJOR ? 8 : R / 4;
    static constexpr int STEP = THREADS / CPR;       // K-major: m/n rows per pass; MN-major: k rows
    static_assert(THREADS % CPR == 0, "a pass of the block must cover whole rows");
    static_assert(!KMAJOR || STEP % 8 == 0, "K-major passes keep the swizzle bit ((r / 4) & 1)");
    static_assert(R % 32 == 0, "tile rows are whole 32-float groups");

    const float* src;   // this thread's chunk 0 at the next k tile to stage
    long long ld;       // row stride of the operand in global memory (floats)
    int r_t, c_t;       // chunk 0: K-major (row, k); MN-major (k row, column), within the tile
    int soff;           // shared offset of chunk 0 within the operand tile (floats)
    bool last_ok;       // chunk CH-1 exists for this thread (the last pass may be partial)

    __device__ __forceinline__ Tf32Stager(const float* G, int ld_, int rc0, int tid) : ld(ld_) {
        if constexpr (KMAJOR) {
            r_t = tid >> 3;
            c_t = (tid & 7) << 2;
            src = G + (long long)(rc0 + r_t) * ld + c_t;
            soff = tf32_off_kmajor(r_t, c_t);
        } else {
            r_t = tid / CPR;
            c_t = (tid % CPR) << 2;
            src = G + (long long)r_t * ld + (rc0 + c_t);
            soff = tf32_off_mnmajor<R>(r_t, c_t);
        }
        last_ok = EXACT || tid + (CH - 1) * THREADS < CHUNKS;
    }

    // shared offset of chunk i (floats, within the operand tile)
    __device__ __forceinline__ int chunk_off(int i) const {
        if constexpr (KMAJOR) {
            return soff + i * STEP * 32;                 // same swizzle bit: STEP % 8 == 0
        } else if constexpr (STEP % 16 == 0) {
            return soff + i * STEP * R;                  // same swizzle group
        } else {
            const int k = r_t + i * STEP;
            return k * R + (((c_t >> 2) ^ (((k >> 2) & 3) << 1)) << 2);
        }
    }

    // global offset of chunk i from chunk 0 (floats)
    __device__ __forceinline__ long long chunk_step(int i) const { return (long long)i * STEP * ld; }

    // Stage the k tile [k0, k0 + 32) into sm; `full`: every row and k of it lies in the matrix.
    // G: the operand base (a safe address for zero-filled chunks); rc0/rcmax: rows of the tile
    // and of the matrix; klen: k extent of this split. Then move on to the next k tile.
    __device__ __forceinline__ void stage(float* sm, bool full, const float* G, int rc0, int rcmax,
                                          int k0, int klen) {
        const unsigned base = smem_u32(sm);
        if (full) {
#pragma unroll
            for (int i = 0; i < CH; ++i)
                if (i < CH - 1 || last_ok)
                    cp_async16_full(base + 4u * chunk_off(i), src + chunk_step(i));
        } else {
#pragma unroll
            for (int i = 0; i < CH; ++i) {
                if (i < CH - 1 || last_ok) {
                    int nb;
                    if constexpr (KMAJOR) {
                        const bool row_ok = rc0 + r_t + i * STEP < rcmax;
                        nb = row_ok ? min(max(klen - (k0 + c_t), 0), 4) * 4 : 0;
                    } else {
                        const bool k_ok = k0 + r_t + i * STEP < klen;
                        nb = k_ok ? min(max(rcmax - (rc0 + c_t), 0), 4) * 4 : 0;
                    }
                    const float* p = nb > 0 ? src + chunk_step(i) : G;
                    cp_async16(base + 4u * chunk_off(i), p, nb);
                }
            }
        }
        src += KMAJOR ? 32LL : 32LL * ld;
    }
};

// Element-by-element staging for unaligned operands (VEC = false): 4-byte cp.async, every element
// guarded; 32 consecutive floats of one row per warp (coalesced, conflict-free).
template <bool KMAJOR, int R, int THREADS>
__device__ __forceinline__ void tf32_stage_scalar(float* sm, const float* __restrict__ G, int ld, int rc0,
                                                  int rcmax, int k0, int klen, int tid) {
    constexpr int EL = R * 32 / THREADS;
    static_assert(EL * THREADS == R * 32, "tile/threads");
#pragma unroll 8
    for (int i = 0; i < EL; ++i) {
        const int idx = tid + i * THREADS;
        if constexpr (KMAJOR) {
            const int rc = idx >> 5, k = idx & 31;
            const bool ok = rc0 + rc < rcmax && k0 + k < klen;
            const float* src = ok ? G + (long long)(rc0 + rc) * ld + (k0 + k) : G;
            cp_async4(smem_u32(sm + tf32_off_kmajor(rc, k)), src, ok ? 4 : 0);
        } else {
            const int k = idx / R, c = idx % R;
            const bool ok = k0 + k < klen && rc0 + c < rcmax;
            const float* src = ok ? G + (long long)(k0 + k) * ld + (rc0 + c) : G;
            cp_async4(smem_u32(sm + tf32_off_mnmajor<R>(k, c)), src, ok ? 4 : 0);
        }
    }
}

// THREADS = WM * WN * 32, SMEM (STAGES x (BM + BN) x BK floats, bytes) and MIN_BLOCKS, the resident
// blocks per SM asked of the register allocator, are the launcher's (families.py tf32_blocks_per_sm):
// the kernel asserts the first two.
template <int BM, int BN, int BK, int WM, int WN, int STAGES, bool TA, bool TB, int EPI, bool HAS_BIAS,
          bool VEC, int THREADS, int SMEM, int MIN_BLOCKS>
__global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
gemm_tf32(GEMM_ARGS_F32) {
    static_assert(BK == GEMM_TF32_BK, "the layouts assume a 32-wide k tile");
    static_assert(THREADS == WM * WN * 32, "one warp a WTM x WTN warp tile");
    static_assert(SMEM == STAGES * (BM + BN) * BK * 4, "a ring of STAGES k tiles of A and B");
    constexpr int WTM = BM / WM, WTN = BN / WN;     // warp tile
    constexpr int MT = WTM / 16, NT = WTN / 8;      // m16 / n8 tiles per warp
    static_assert(WTM % 32 == 0 && WTN % 32 == 0, "warp tile must be a multiple of 32x32");
    constexpr int A_FLOATS = BM * BK;
    constexpr int STAGE = (BM + BN) * BK;

    extern __shared__ __align__(16) float smem[];

    const int tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm0 = (warp / WN) * WTM, wn0 = (warp % WN) * WTN;

    const GemmBlock<BM, BN> blk(K, splits, k_chunk);
    const int z = blockIdx.z, batch = blk.batch, m0 = blk.m0, n0 = blk.n0;
    const int kb0 = blk.kb0, klen = blk.klen;

    A += batch * sA + (TA ? (long long)kb0 * lda : (long long)kb0);
    B += batch * sB + (TB ? (long long)kb0 : (long long)kb0 * ldb);
    C += z * sC;
    if constexpr (GEMM_EPI_USES_AUX(EPI)) aux += z * sC;

    // Staging of the k tiles in order 0, 1, 2, ... (each call moves the stagers on by one tile).
    Tf32Stager<!TA, BM, THREADS> stA(A, lda, m0, tid);
    Tf32Stager<TB, BN, THREADS> stB(B, ldb, n0, tid);
    const bool a_rows_in = m0 + BM <= M, b_rows_in = n0 + BN <= N;
    auto stage_tiles = [&](int s, int k0) {
        float* sa = smem + s * STAGE;
        float* sb = sa + A_FLOATS;
        if constexpr (VEC) {
            const bool k_in = k0 + BK <= klen;
            stA.stage(sa, a_rows_in && k_in, A, m0, M, k0, klen);
            stB.stage(sb, b_rows_in && k_in, B, n0, N, k0, klen);
        } else {
            tf32_stage_scalar<!TA, BM, THREADS>(sa, A, lda, m0, M, k0, klen, tid);
            tf32_stage_scalar<TB, BN, THREADS>(sb, B, ldb, n0, N, k0, klen, tid);
        }
    };

    // Per-thread fragment base offsets (floats, within a stage). With the permutations above the
    // swizzle term is a per-thread constant, so every fragment load is base + immediate:
    //   K-major row r = w0 + 32 a + 4 g + b (b < 4): ((r/4) & 1) = g & 1, so the chunk of
    //     k = 16 kb + 4 t is (4 kb + t) ^ 4 (g & 1) = 4 (kb ^ (g & 1)) + t;
    //   MN-major k = 16 kb + 4 t + 2 j + hi: ((k/4) & 3) = t, so the chunk of c = w0 + 32 p + 4 g
    //     is w0/4 + 8 p + (g ^ 2 t).
    int a_frag0, a_frag1, b_frag0, b_frag1;
    if constexpr (!TA) {
        a_frag0 = (wm0 + 4 * g) * 32 + 16 * (0 ^ (g & 1)) + 4 * t;
        a_frag1 = (wm0 + 4 * g) * 32 + 16 * (1 ^ (g & 1)) + 4 * t;
    } else {
        a_frag0 = a_frag1 = 4 * t * BM + wm0 + 4 * (g ^ (2 * t));
    }
    if constexpr (TB) {
        b_frag0 = (wn0 + 4 * g) * 32 + 16 * (0 ^ (g & 1)) + 4 * t;
        b_frag1 = (wn0 + 4 * g) * 32 + 16 * (1 ^ (g & 1)) + 4 * t;
    } else {
        b_frag0 = b_frag1 = 4 * t * BN + wn0 + 4 * (g ^ (2 * t));
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int nk = klen > 0 ? (klen + BK - 1) / BK : 0;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) stage_tiles(s, s * BK);
        cp_async_commit();
    }

    // Fragments of one 16-wide k block kb of a stage: A [m16 tile][mma step j][a0..a3], B [n8 tile][j][b0, b1].
    auto load_frags = [&](const float* sa, const float* sb, int kb, unsigned (&fa)[MT][2][4],
                          unsigned (&fb)[NT][2][2]) {
        if constexpr (!TA) {     // K-major A: row r, k = 16 kb + 4 t .. +3
            const float* base = sa + (kb == 0 ? a_frag0 : a_frag1);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float4 v = *reinterpret_cast<const float4*>(
                        base + (32 * (mi >> 1) + 2 * (mi & 1) + h) * 32);
                    fa[mi][0][h] = tf32_round(v.x);
                    fa[mi][0][h + 2] = tf32_round(v.y);
                    fa[mi][1][h] = tf32_round(v.z);
                    fa[mi][1][h + 2] = tf32_round(v.w);
                }
        } else {                 // MN-major A: k row, m = 32 p + 4 g .. +3
#pragma unroll
            for (int p = 0; p < MT / 2; ++p)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int hi = 0; hi < 2; ++hi) {
                        const float4 v = *reinterpret_cast<const float4*>(
                            sa + a_frag0 + (16 * kb + 2 * j + hi) * BM + 32 * p);
                        fa[2 * p][j][0 + 2 * hi] = tf32_round(v.x);
                        fa[2 * p][j][1 + 2 * hi] = tf32_round(v.y);
                        fa[2 * p + 1][j][0 + 2 * hi] = tf32_round(v.z);
                        fa[2 * p + 1][j][1 + 2 * hi] = tf32_round(v.w);
                    }
        }
        if constexpr (TB) {      // K-major B: row n, k = 16 kb + 4 t .. +3
            const float* base = sb + (kb == 0 ? b_frag0 : b_frag1);
#pragma unroll
            for (int ni = 0; ni < NT; ++ni) {
                const float4 v = *reinterpret_cast<const float4*>(
                    base + (32 * (ni >> 2) + (ni & 3)) * 32);
                fb[ni][0][0] = tf32_round(v.x);
                fb[ni][0][1] = tf32_round(v.y);
                fb[ni][1][0] = tf32_round(v.z);
                fb[ni][1][1] = tf32_round(v.w);
            }
        } else {                 // MN-major B: k row, n = 32 q + 4 g .. +3 -> n8 tiles 4q..4q+3
#pragma unroll
            for (int q = 0; q < NT / 4; ++q)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int hi = 0; hi < 2; ++hi) {
                        const float4 v = *reinterpret_cast<const float4*>(
                            sb + b_frag0 + (16 * kb + 2 * j + hi) * BN + 32 * q);
                        fb[4 * q + 0][j][hi] = tf32_round(v.x);
                        fb[4 * q + 1][j][hi] = tf32_round(v.y);
                        fb[4 * q + 2][j][hi] = tf32_round(v.z);
                        fb[4 * q + 3][j][hi] = tf32_round(v.w);
                    }
        }
    };
    auto mma_block = [&](const unsigned (&fa)[MT][2][4], const unsigned (&fb)[NT][2][2]) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int mi = 0; mi < MT; ++mi)
#pragma unroll
                for (int ni = 0; ni < NT; ++ni) tf32_mma(acc[mi][ni], fa[mi][j], fb[ni][j]);
    };

    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();   // tile kt visible to all; everyone is done with tile kt-1's stage
        const float* sa = smem + (kt % STAGES) * STAGE;
        const float* sb = sa + A_FLOATS;
        unsigned fa[MT][2][4], fb[NT][2][2];
        load_frags(sa, sb, 0, fa, fb);     // first fragments in flight before the copies are issued
        {
            const int nxt = kt + STAGES - 1;
            if (nxt < nk) stage_tiles(nxt % STAGES, nxt * BK);
            cp_async_commit();
        }
        mma_block(fa, fb);
#pragma unroll
        for (int kb = 1; kb < BK / 16; ++kb) {
            load_frags(sa, sb, kb, fa, fb);
            mma_block(fa, fb);
        }
    }
    cp_async_wait<0>();

    // Epilogue: thread (g, t) holds, for m16 tile mi, half h, n8 group q and e in {0, 1}, the four
    // consecutive columns wn0 + 32 q + 8 t + 4 e .. +3 of row wm0 + 32 (mi/2) + 4 g + 2 (mi%2) + h.
    const bool vec = gemm_epi_vec_ok<EPI, HAS_BIAS>(C, aux, bias, ldc, sC);
    if (vec && m0 + BM <= M && n0 + BN <= N) {
        // interior block, aligned rows: 16-byte stores with no guard
#pragma unroll
        for (int mi = 0; mi < MT; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = m0 + wm0 + 32 * (mi >> 1) + 4 * g + 2 * (mi & 1) + h;
                const int c0 = n0 + wn0 + 8 * t;
                const long long row = (long long)r * ldc + c0;
#pragma unroll
                for (int q = 0; q < NT / 4; ++q)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float v[4] = {acc[mi][4 * q + 0][2 * h + e], acc[mi][4 * q + 1][2 * h + e],
                                            acc[mi][4 * q + 2][2 * h + e], acc[mi][4 * q + 3][2 * h + e]};
                        gemm_store4_vec<EPI, HAS_BIAS>(C, aux, bias, row + 32 * q + 4 * e, c0 + 32 * q + 4 * e,
                                                       alpha, v);
                    }
            }
        return;
    }
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = m0 + wm0 + 32 * (mi >> 1) + 4 * g + 2 * (mi & 1) + h;
#pragma unroll
            for (int q = 0; q < NT / 4; ++q)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int c = n0 + wn0 + 32 * q + 8 * t + 4 * e;
                    const float v[4] = {acc[mi][4 * q + 0][2 * h + e], acc[mi][4 * q + 1][2 * h + e],
                                        acc[mi][4 * q + 2][2 * h + e], acc[mi][4 * q + 3][2 * h + e]};
                    gemm_store4<EPI, HAS_BIAS>(C, aux, bias, r, c, M, N, ldc, alpha, vec, v);
                }
        }
}

// One m16n8k8 on one warp with the fragment ownership assumed above (tests/gpu/test_gemm.py).
// d [16, 8] = a [16, 8] @ b [8, 8] (row-major, values rounded to tf32);
// raw [32, 4]: the accumulator registers c0..c3 of every lane, as they come out of the mma.
__global__ void __launch_bounds__(32) mma_probe(float* d,              // d [16, 8]
                                                float* raw,            // raw [32, 4]
                                                const float* a,        // a [16, 8]
                                                const float* b) {      // b [8, 8]
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned fa[4] = {tf32_round_cvt(a[g * 8 + t]), tf32_round_cvt(a[(g + 8) * 8 + t]),
                            tf32_round_cvt(a[g * 8 + t + 4]), tf32_round_cvt(a[(g + 8) * 8 + t + 4])};
    const unsigned fb[2] = {tf32_round_cvt(b[t * 8 + g]), tf32_round_cvt(b[(t + 4) * 8 + g])};
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    tf32_mma(c, fa, fb);
#pragma unroll
    for (int i = 0; i < 4; ++i) raw[lane * 4 + i] = c[i];
    d[g * 8 + 2 * t] = c[0];
    d[g * 8 + 2 * t + 1] = c[1];
    d[(g + 8) * 8 + 2 * t] = c[2];
    d[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// Rounding probe: out_cvt[i] = cvt.rna.tf32.f32(x[i]), out_add[i] = tf32_round(x[i]) (raw bits).
__global__ void __launch_bounds__(256) tf32_round_probe(unsigned* out_cvt,       // out_cvt [n]
                                                        unsigned* out_add,       // out_add [n]
                                                        const float* x, int n) { // x [n]
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out_cvt[i] = tf32_round_cvt(x[i]);
        out_add[i] = tf32_round(x[i]);
    }
}
