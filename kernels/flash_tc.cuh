// The mma.sync tensor-core flash kernels' bodies, shared by flash_tc.cu (TF32: the _tc kernels) and
// flash_x3.cu (fp32 as 3xTF32: the _x3 kernels, X3 = true).
//
//   _tc (tf32)   mma.sync.m16n8k8 tensor cores: 4 warps of 16*MT rows, streamed tiles through a 2-3
//           stage cp.async ring, ldmatrix fragments, resident operands in registers where they fit.
//   _x3 (fp32 as 3xTF32, the fp32 precision's path where its GEMMs run as 3xTF32)   the same bodies
//           with every product as three TF32 mma of hi / lo splits made at fragment load (see
//           "3xTF32 helpers"); the split fragments take twice the registers, so the launcher's plans
//           give them fewer rows a warp, shorter key tiles and resident operands split from shared
//           memory per tile.
#pragma once
#include "flash_common.cuh"

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

#define FA_RESCALE_LOG2 8.f   // fwd: O and l move to a new row max only when it grows by > 2^8

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
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_THREADS / V, N = ROWS / RPI;
    static_assert(FA_THREADS % V == 0 && ROWS % RPI == 0, "tile chunks");
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

// the same thread's chunks of a landed tile: x -> tf32(x * mul) (SCALE) or tf32(x) in place, in the
// mma-only form of fa_tf32_mma (every tile that goes through here is read by mma only)
template <int ROWS, int HS, bool SCALE>
__device__ __forceinline__ void fa_round_tile(float* dst, float mul) {
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_THREADS / V, N = ROWS / RPI;
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
    constexpr int V = HS / 4, LD = HS + 4, RPI = FA_THREADS / V, N = ROWS / RPI;
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

// ------------------------------------------------------------------------------- the launcher's plans

// The kernels' template arguments after <HS, DROP> are the launcher's plan (attention.py flash_tc_plan):
// the block's threads, MT m16 row tiles a warp (rows of the block: 4 warps x 16 MT), BC rows of a
// streamed tile (keys in fwd / dq, queries in dkv), NS ring stages, AREG: the resident operands'
// fragments in registers (staged through ring stages 1..), dkv's VREG: V's fragments in registers,
// and the shared memory in bytes, which must be what the layout of those tiles takes.
#define FA_TILES_OK ((MT == 1 || MT == 2) && BC % 8 == 0 && (NS == 2 || NS == 3) && FA_THREADS == 4 * 32)
#define FA_TC_PLAN int THREADS, int MT, int BC, int NS, bool AREG, int SMEM
#define FA_TC_DKV_PLAN int THREADS, int MT, int BQ, int NS, bool AREG, bool VREG, int SMEM
#define FA_TC_CHECK static_assert(THREADS == FA_THREADS && SMEM == 4 * F::SMEM, \
                                  "the launcher's plan: FA_THREADS threads, the layout's shared memory")

// The layout of the query-tile kernels (the forward: NR = 1 resident tile, Q; dQ: NR = 2, Q and dO): 4 warps
// x WR = 16 MT query rows, key tiles of BC through a ring of NS K/V stages, the resident tiles' fragments
// in registers (AREG: staged through ring stages 1..) or the tiles kept in a buffer of their own.
template <int HS, bool X3_, int MT_, int BC_, int NS_, bool AREG_, int NR> struct FaQueryTc {
    static constexpr bool X3 = X3_;     // 3xTF32: hi and lo fragments
    static constexpr int MT = MT_;
    static constexpr int WR = 16 * MT;
    static constexpr int BR = 4 * WR;
    static constexpr int BC = BC_;
    static constexpr bool AREG = AREG_;
    static constexpr int NS = NS_;
    static_assert(FA_TILES_OK, "tiles");
    static constexpr int LD = HS + 4;
    static constexpr int STAGE = 2 * BC * LD;                   // K, V
    static constexpr int QBUF = NR * BR * LD;                   // Q (, dO)
    static constexpr int QOFF = AREG ? STAGE : NS * STAGE;
    static constexpr int SMEM = AREG ? (NS * STAGE > STAGE + QBUF ? NS * STAGE : STAGE + QBUF) : NS * STAGE + QBUF;
};

// ------------------------------------------------------------------------------- TC forward

// 4 warps x WR = 16*MT query rows; key tiles of BC through the K/V ring. The Q tile (scaled by
// scale*log2 e) is staged through ring stages 1.. before the loop and then held in registers (AREG;
// 3xTF32 at head size 128: Q keeps its own buffer and is split from there per key tile).
// Online softmax with a lazily moved reference max m per row: p = exp2(s - m) <= 2^FA_RESCALE_LOG2,
// O and l are rescaled only when some row of the warp outgrows its m by more than that.
template <int HS, bool X3, int MT, int BC, int NS, bool AREG> using FaFwdTc = FaQueryTc<HS, X3, MT, BC, NS, AREG, 1>;

template <int HS, bool DROP, class F>
__device__ __forceinline__ void fa_fwd_tc_body(FA_ARGS_FWD) {
    constexpr bool X3 = F::X3;
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
        fa_scale_tile<BR, HS>(Qb, scale * GC_LOG2E);
    } else {
        fa_round_tile<BR, HS, true>(Qb, scale * GC_LOG2E);
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
    const u32 W = gc_att_words(T);                     // keep words a row of the [B*H*T, T] mask
    const u32 rquad = (u32)(bh * T + wr0 + g) * W + (u32)t;    // row g's word of keys 2t, 2t + 1, + 8, + 9

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
                    const float alpha = gc_exp2(m[mt][hh] - mnew);
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
                for (int np = 0; np < NT / 2; ++np) {
                    u32 kw = 0;                        // keys k0 + 16np + 2t, + 1, + 8, + 9 share one keep word
                    if (DROP) kw = gc_keep_word(key, rquad + (u32)(16 * mt + 8 * hh) * W + (u32)((k0 >> 2) + 4 * np));
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float p = gc_exp2(s[mt][2 * np + jj][2 * hh + e]);   // exp2(S - m) <= 2^FA_RESCALE_LOG2
                            rsum += p;
                            if (DROP && !gc_keep_byte(kw, 2 * jj + e, threshold)) p = 0.f;   // 1/(1-p): on O at the end
                            s[mt][2 * np + jj][2 * hh + e] = p;
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

// ------------------------------------------------------------------------------- TC backward: dQ

// 4 warps x WR = 16*MT query rows; key tiles of BC through the K/V ring. Q (scaled by scale*log2 e)
// and dO are A operands: in registers (AREG; staged through ring stages 1..) or a resident tile.
template <int HS, bool X3, int MT, int BC, int NS, bool AREG> using FaDqTc = FaQueryTc<HS, X3, MT, BC, NS, AREG, 2>;

template <int HS, bool DROP, class F>
__device__ __forceinline__ void fa_dq_tc_body(FA_ARGS_BWD) {
    constexpr bool X3 = F::X3;
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
            nl[mt][hh] = i < T ? -lse[(long long)bh * T + i] * GC_LOG2E : 0.f;
            nd[mt][hh] = i < T ? -Dg[(long long)bh * T + i] : 0.f;
            rbase[mt][hh] = (u32)(bh * T + i) * gc_att_words(T);
        }
    float cl[MT][NT][4], cd[MT][NT][4];
    fa_rows_frag(cl, nl);
    if (DROP) fa_zero(cd);
    else fa_rows_frag(cd, nd);
    const u32 key = fa_drop_key<DROP>(st, seed, site);

    fa_cp_wait<0>();
    if constexpr (X3) {
        fa_scale_tile<BR, HS>(Qb, scale * GC_LOG2E);
    } else {
        fa_round_tile<BR, HS, true>(Qb, scale * GC_LOG2E);
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
            for (int np = 0; np < NT / 2; ++np) {
                u32 kw[2] = {0, 0};                    // rows g, g + 8: keys k0 + 16np + 2t, + 1, + 8, + 9 share a word
                if (DROP) {
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh)
                        kw[hh] = gc_keep_word(key, rbase[mt][hh] + (u32)((k0 >> 2) + 4 * np + t));
                }
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int nt = 2 * np + jj;
                        const float pe = gc_exp2(s[mt][nt][e]);
                        float gv = dp[mt][nt][e];
                        if (DROP) {
                            const bool kp = gc_keep_byte(kw[e >> 1], (u32)(2 * jj + (e & 1)), threshold);
                            gv = (kp ? gv * inv_keep : 0.f) + nd[mt][(e >> 1)];
                        }
                        s[mt][nt][e] = pe * gv;            // dS / scale
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

// ------------------------------------------------------------------------------- TC backward: dK, dV

// 4 warps x WR = 16*MT key rows; query tiles of BQ (Q scaled by scale*log2 e, dO, -lse*log2 e, -D)
// through the ring, from the diagonal to the end. K and V are A operands: in registers (AREG; staged
// through ring stages 1..) or a resident tile (V's fragments still go to registers when VREG).
// dK and dV accumulate in registers. The scores are
// tf32(Q*scale*log2 e) . tf32(K) as in the forward and dQ kernels, so P matches the saved lse.
template <int HS, bool X3_, int MT_, int BQ_, int NS_, bool AREG_, bool VREG_> struct FaDkvTc {
    static constexpr bool X3 = X3_;
    static constexpr int MT = MT_;
    static constexpr int WR = 16 * MT;
    static constexpr int BK = 4 * WR;
    static constexpr int BQ = BQ_;
    static constexpr bool AREG = AREG_;                         // K and V fragments in registers
    static constexpr bool VREG = VREG_;                         // V fragments in registers (K's too if AREG)
    static constexpr int NS = NS_;
    static constexpr int BC = BQ;
    static_assert(FA_TILES_OK && (VREG || !AREG), "tiles");
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
    if (threadIdx.x < 2 * BQ) stg[2 * BQ * LD + threadIdx.x] *= threadIdx.x < BQ ? -GC_LOG2E : -1.f;
}

template <int HS, bool DROP, class F>
__device__ __forceinline__ void fa_dkv_tc_body(FA_ARGS_BWD) {
    constexpr bool X3 = F::X3;
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
    fa_dkv_round<HS, BQ, X3>(sm, scale * GC_LOG2E);
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
    const u32 W = gc_att_words(T);                     // keep words a row of the [B*H*T, T] mask

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
                // Keys jk = wk0 + 16mt + g, jk + 8 (rows g, g + 8) and jk ^ 1, jk ^ 1 + 8 (row g ^ 1: lane
                // ^ 4) take bytes 2 hh + (g & 1) of one keep word of query iq0 = q0 + 8nt + 2t (and one of
                // iq0 + 1). This lane draws the word of query iq0 + (g & 1) and takes the other from its
                // partner.
                u32 kw[2] = {0, 0};                    // [query iq0 + c]
                if (DROP) {
                    gc_att_pair_words(gc_keep_word(key, (u32)(bhT + q0 + 8 * nt + 2 * t + (g & 1)) * W +
                                                            gc_att_quad((u32)(wk0 + 16 * mt + g))), (u32)(g & 1), kw);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float pe = gc_exp2(s[mt][nt][e]);
                    float gv = dp[mt][nt][e];
                    float pd = pe;
                    if (DROP) {
                        const bool kp = gc_keep_byte(kw[e & 1], 2u * (e >> 1), threshold);
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
            fa_dkv_round<HS, BQ, X3>(cur, scale * GC_LOG2E);
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

