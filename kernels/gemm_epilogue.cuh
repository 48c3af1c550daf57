// The GEMM epilogue, shared by the GEMM kernels (gemm_simt.cu, gemm_tf32.cu, gemm_wgmma.cu): the
// epilogue codes (GEMM_EPI_*, the launchers' EPI_* in gptcuda/ops/cuda/gemm/families.py), GELU
// and its derivative, the value and store helpers (4 consecutive columns of a row, 16-byte
// accesses where aligned), and GemmBlock, a block's place in the grid (batching and split-K).
#pragma once
#include "common.cuh"
#include "bf16.cuh"

#define GEMM_EPI_NONE 0
#define GEMM_EPI_BIAS 1
#define GEMM_EPI_GELU 2
#define GEMM_EPI_RESID 3
#define GEMM_EPI_DGELU 4
// DGELU that also rebuilds the GELU output over the pre-activation it read (aux := gelu(aux)): a bf16
// C only (recompute's backward: the GELU output for the weight gradient after it, no separate pass)
#define GEMM_EPI_DGELU_GELU 5

// The fp32-operand GEMM kernels' arguments (gemm_simt, gemm_tf32, gemm_wgmma: its TF32 form reads A [batch, M, K]
// and B [batch, N, K] only). Split-K: `splits` partial products of k_chunk columns each, into C's
// [batch*splits] matrices (the reduction sums them).
#define GEMM_ARGS_F32                                                                                          \
    float* C,                        /* C [batch*splits, M, N], row stride ldc, matrix stride sC */           \
    float* aux,                      /* same layout as C (GELU: pre out; RESID: in, may be C; DGELU: */      \
                                     /*   pre-activation in, not C) */                                       \
    const float* __restrict__ A,     /* A [batch, M, K] or [batch, K, M] (TA), row stride lda, stride sA */  \
    const float* __restrict__ B,     /* B [batch, K, N] or [batch, N, K] (TB), row stride ldb, stride sB */  \
    const float* __restrict__ bias,  /* bias [N] or null */                                                  \
    int M, int N, int K, int lda, int ldb, int ldc, long long sA, long long sB, long long sC, float alpha,   \
    int splits, int k_chunk

// Epilogues that read aux (residual input, saved pre-activation) / that touch aux at all.
#define GEMM_EPI_READS_AUX(E) ((E) == GEMM_EPI_RESID || (E) == GEMM_EPI_DGELU || (E) == GEMM_EPI_DGELU_GELU)
#define GEMM_EPI_USES_AUX(E) ((E) == GEMM_EPI_GELU || GEMM_EPI_READS_AUX(E))

// GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as
// x * sigmoid(2u) (the same function) which keeps full relative accuracy where tanh(u) -> -1.
__device__ __forceinline__ float gemm_gelu(float x) {
    const float s = 0.7978845608028654f;   // sqrt(2/pi)
    float u = s * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

// d/dx of gemm_gelu (the tanh form's exact derivative): with s = sigmoid(2u) = 0.5 (1 + tanh u)
// and e = exp(-2u), 1 - tanh^2 u = 4 s (1 - s) and 1 - s = e s, so
//   gelu'(x) = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u' = s (1 + 2 x u' e s),
//   u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
// No cancellation where tanh u -> +-1. Beyond |u| = 40 the result is 1 (u > 0) or 0 (u < 0) to
// fp32 precision (the remainder is below 1e-32); selecting those keeps e = exp(-2u) <= e^80
// finite, so e * s never becomes inf * 0 (x^3 overflowing to -inf gives 0, NaN stays NaN).
__device__ __forceinline__ float gemm_gelu_grad(float x) {
    const float k = 0.7978845608028654f;   // sqrt(2/pi)
    const float x2 = x * x;
    const float u = k * (x + 0.044715f * x2 * x);
    const float du = k * (1.0f + 3.0f * 0.044715f * x2);
    const float e = expf(-2.0f * fmaxf(fminf(u, 40.0f), -40.0f));
    const float s = 1.0f / (1.0f + e);
    const float g = s * (1.0f + 2.0f * x * du * e * s);
    return u > 40.0f ? 1.0f : (u < -40.0f ? 0.0f : g);
}

// gemm_gelu and gemm_gelu_grad for a bf16 C, on one MUFU operation an element: t = tanh(u) as
// tanh.approx.f32 (MUFU.TANH, absolute error below ~1.2e-5 over the whole range: test_gemm_bf16's
// exhaustive GELU tests bound every bf16 input), then GELU = h + h t with h = x / 2 and
// gelu' = (1 + t) / 2 + h u' (1 - t^2). The GELU's error is |h| times t's, the derivative's at most
// (1/2 + 2 |h u'|) times it: against a bf16 C's rounding (2^-9 of a value) only the tails where the
// GELU and gelu' are small (x below ~-3) carry more than that, absolutely below 2^-16 |x| (GELU) and
// 2^-15 (1 + |x|^3) (gelu'). The two-MUFU forms before (ex2 then rcp, relative accuracy everywhere)
// kept the epilogue MUFU- and issue-bound at ~1.5 times the instructions. Limits: h is taken of
// max(x, -40) (GELU there is 0 to fp32: x -> -inf gives 0, not -inf + inf), h u' of x clamped to
// [-40, 40] (finite; t is +-1 there and gelu' 0 or 1 to fp32), so +inf stays +inf (gelu' 1), NaN stays
// NaN (through t).
__device__ __forceinline__ float gemm_tanh_fast(float u) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
    return t;
}
// t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3): one expression for gemm_gelu_fast and
// gemm_gelu_grad_fast, so that the forward's GELU and the backward's rebuilt one read the same bits
__device__ __forceinline__ float gemm_gelu_t(float x) {
    return gemm_tanh_fast(x * fmaf(0.7978845608028654f * 0.044715f, x * x, 0.7978845608028654f));
}
__device__ __forceinline__ float gemm_gelu_of(float x, float t) {
    const float h = 0.5f * fmaxf(x, -40.0f);
    return fmaf(h, t, h);
}
__device__ __forceinline__ float gemm_gelu_fast(float x) { return gemm_gelu_of(x, gemm_gelu_t(x)); }
// the derivative from the GELU's own t (the GELU, where `gelu` asks for it, costs two operations more:
// gemm_gelu_fast's bits)
__device__ __forceinline__ float gemm_gelu_grad_fast(float x, float* gelu = nullptr) {
    const float t = gemm_gelu_t(x);
    if (gelu) *gelu = gemm_gelu_of(x, t);
    const float xd = fminf(fmaxf(x, -40.0f), 40.0f);
    const float du = fmaf(0.7978845608028654f * 3.0f * 0.044715f, xd * xd, 0.7978845608028654f);
    return fmaf(0.5f * xd * du, fmaf(-t, t, 1.0f), fmaf(0.5f, t, 0.5f));
}

// The 3xTF32 split (gemm_wgmma.cu: ws_prepare of B, ra3_step of A's fragments):
// x = hi + lo with hi = tf32(x) and lo = tf32(x - hi), both rounded to nearest (ties away from
// zero, as cvt.rna.tf32.f32) and stored with the 13 low mantissa bits cleared, so the tensor core,
// which reads only the top 19 bits, sees them exactly. x - hi is exact in fp32; hi and lo together
// carry 22 of x's 24 significand bits (the rest: |x - hi - lo| <= 2^-22 |x|). Then
// a b = ahi bhi + ahi blo + alo bhi + alo blo, and the 3xTF32 product drops the last term
// (<= 2^-22 |a b|). Non-finite x give non-finite halves; |x| within half a tf32 ulp of FLT_MAX
// rounds hi to inf (as cvt.rna does), so its lo is -inf and products with it are NaN.
__device__ __forceinline__ float tf32_hi(float x) {
    return __uint_as_float((__float_as_uint(x) + 0x1000u) & 0xFFFFE000u);
}

// The epilogue of one value: pre = alpha*acc + bias, then the epilogue. `in` is the aux value
// the epilogue reads (residual input, or the saved pre-activation of DGELU). Returns the value
// for C; for GELU, *pre_out gets the pre-activation.
template <int EPI, bool HAS_BIAS>
__device__ __forceinline__ float gemm_epi_value(float acc, float alpha, float b, float in,
                                                float* pre_out) {
    float v = alpha * acc;
    if constexpr (HAS_BIAS) v += b;
    if constexpr (EPI == GEMM_EPI_GELU) {
        *pre_out = v;
        return gemm_gelu(v);
    } else if constexpr (EPI == GEMM_EPI_RESID) {
        return in + v;
    } else if constexpr (EPI == GEMM_EPI_DGELU) {
        return v * gemm_gelu_grad(in);
    } else {
        return v;
    }
}

// One value of a bf16 C's epilogue, the one form of both bf16 store paths (gemm_store_once's and
// gemm_wgmma.cu's wg_store_tile_tma): the value for C from the accumulator acc, the bias b and the aux value
// `in`; *pre: GELU's pre-activation as stored (rounded to bf16, GELU taken of that, so that the backward's
// gelu' at the saved pre-activation is the derivative of what the forward used), or DGELU_GELU's GELU
// rebuilt from the saved pre-activation (gemm_gelu_fast's bits). GELU and its derivative in the _fast forms.
template <int EPI, bool HAS_BIAS>
__device__ __forceinline__ float gemm_epi_value_bf16(float acc, float alpha, float b, float in, float* pre) {
    if constexpr (EPI == GEMM_EPI_GELU) {
        *pre = bf16_f32(bf16_rn(gemm_epi_value<GEMM_EPI_NONE, HAS_BIAS>(acc, alpha, b, 0.f, nullptr)));
        return gemm_gelu_fast(*pre);
    } else if constexpr (EPI == GEMM_EPI_DGELU || EPI == GEMM_EPI_DGELU_GELU) {
        return gemm_epi_value<GEMM_EPI_NONE, HAS_BIAS>(acc, alpha, b, 0.f, nullptr) *
               gemm_gelu_grad_fast(in, EPI == GEMM_EPI_DGELU_GELU ? pre : nullptr);
    } else {
        return gemm_epi_value<EPI, HAS_BIAS>(acc, alpha, b, in, pre);
    }
}

// Four consecutive values v[0..3] stored at C[off .. off+3] (columns c..c+3) with the epilogue
// applied, as 16-byte accesses: the caller has checked the range and the 16-byte alignment.
template <int EPI, bool HAS_BIAS>
__device__ __forceinline__ void gemm_store4_vec(float* C, float* aux, const float* bias, long long off,
                                                int c, float alpha, const float (&v)[4]) {
    float4 b4 = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (HAS_BIAS) b4 = *reinterpret_cast<const float4*>(bias + c);
    float4 res = make_float4(0.f, 0.f, 0.f, 0.f);
    if constexpr (GEMM_EPI_READS_AUX(EPI)) res = *reinterpret_cast<const float4*>(aux + off);
    float4 pre, out;
    out.x = gemm_epi_value<EPI, HAS_BIAS>(v[0], alpha, b4.x, res.x, &pre.x);
    out.y = gemm_epi_value<EPI, HAS_BIAS>(v[1], alpha, b4.y, res.y, &pre.y);
    out.z = gemm_epi_value<EPI, HAS_BIAS>(v[2], alpha, b4.z, res.z, &pre.z);
    out.w = gemm_epi_value<EPI, HAS_BIAS>(v[3], alpha, b4.w, res.w, &pre.w);
    if constexpr (EPI == GEMM_EPI_GELU) *reinterpret_cast<float4*>(aux + off) = pre;
    *reinterpret_cast<float4*>(C + off) = out;
}

// Whether the epilogue may move W values at once (4, or 8 of bf16): C rows (and aux) aligned to W
// elements of TO, the bias (fp32) to 16 bytes.
template <int EPI, bool HAS_BIAS, class TO = float, int W = 4>
__device__ __forceinline__ bool gemm_epi_vec_ok(const TO* C, const TO* aux, const float* bias, int ldc,
                                                long long sC) {
    constexpr unsigned long long A = W * sizeof(TO) - 1;
    bool vec = ((ldc & (W - 1)) == 0) && ((sC & (W - 1)) == 0) &&
               ((reinterpret_cast<unsigned long long>(C) & A) == 0);
    if constexpr (HAS_BIAS) vec = vec && ((reinterpret_cast<unsigned long long>(bias) & 15) == 0);
    if constexpr (GEMM_EPI_USES_AUX(EPI)) vec = vec && ((reinterpret_cast<unsigned long long>(aux) & A) == 0);
    return vec;
}

// Store four consecutive values v[0..3] of row r at columns c..c+3 with the epilogue applied.
// C, aux rows have stride ldc. vec: 16-byte accesses allowed (alignment checked by the caller).
template <int EPI, bool HAS_BIAS>
__device__ __forceinline__ void gemm_store4(float* C, float* aux, const float* bias, int r, int c,
                                            int M, int N, int ldc, float alpha, bool vec,
                                            const float (&v)[4]) {
    if (r >= M) return;
    long long off = (long long)r * ldc + c;
    if (vec && c + 3 < N) {
        gemm_store4_vec<EPI, HAS_BIAS>(C, aux, bias, off, c, alpha, v);
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (c + e < N) {
                float b = 0.f, res = 0.f, pre;
                if constexpr (HAS_BIAS) b = bias[c + e];
                if constexpr (GEMM_EPI_READS_AUX(EPI)) res = aux[off + e];
                float o = gemm_epi_value<EPI, HAS_BIAS>(v[e], alpha, b, res, &pre);
                if constexpr (EPI == GEMM_EPI_GELU) aux[off + e] = pre;
                C[off + e] = o;
            }
        }
    }
}

// gemm_store4 with one copy of the epilogue's arithmetic (wg_store_tile, gemm_wgmma.cu: its loops are
// unrolled over a whole tile, where two copies of GELU per four values doubled the code and stalled
// on instruction fetch), for W = 4 values, or 8 of a bf16 C (one 16-byte access): `wide` (row r and
// columns c .. c + W - 1 in C, W-value accesses allowed) loads and stores W values at once, otherwise
// each element in C on its own; the values, and so C, are gemm_store4's. TO: C's and aux's element type (fp32, or
// bf16: the values rounded once, when stored, and computed by gemm_epi_value_bf16).
// The 8 aux values (bf16) of row r, columns c .. c + 7 that epilogue EPI reads (0 where outside M x N, or
// where it reads none): one 16-byte load where `wide` (in range and aligned, the caller's check).
template <int EPI>
__device__ __forceinline__ void gemm_epi_in(const bf16* aux, int r, int c, int M, int N, int ldc, bool wide,
                                            float (&in)[8]) {
#pragma unroll
    for (int e = 0; e < 8; ++e) in[e] = 0.f;
    if constexpr (GEMM_EPI_READS_AUX(EPI)) {
        const long long off = (long long)r * ldc + c;
        if (wide) {
            val_ld8(aux + off, in);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (r < M && c + e < N) in[e] = val_ld(aux + off + e);
        }
    }
}
// GIVEN: the aux values `given` were loaded by the caller (gemm_epi_in: the bf16 epilogue issues a few
// rows' loads at once instead of one load latency each).
template <int EPI, bool HAS_BIAS, class TO, int W, bool GIVEN = false>
__device__ __forceinline__ void gemm_store_once(TO* C, TO* aux, const float* bias, int r, int c, int M, int N, int ldc,
                                                float alpha, bool wide, const float (&v)[W],
                                                const float* given = nullptr) {
    static_assert(W == 4 || (W == 8 && sizeof(TO) == 2), "4 values, or 8 of a bf16 C (16 bytes)");
    static_assert(EPI != GEMM_EPI_DGELU_GELU || sizeof(TO) == 2, "the GELU rebuild: a bf16 C");
    const long long off = (long long)r * ldc + c;
    float b[W], in[W], out[W], pre[W];
    bool ok[W];
#pragma unroll
    for (int e = 0; e < W; ++e) {
        b[e] = in[e] = 0.f;
        ok[e] = r < M && c + e < N;
    }
    if (wide) {
        if constexpr (W == 4) {
            if constexpr (HAS_BIAS) val_ld4(bias + c, b);
            if constexpr (GEMM_EPI_READS_AUX(EPI)) val_ld4(aux + off, in);
        } else {
            if constexpr (HAS_BIAS) {
                const float4 b0 = *reinterpret_cast<const float4*>(bias + c);
                const float4 b1 = *reinterpret_cast<const float4*>(bias + c + 4);
                b[0] = b0.x; b[1] = b0.y; b[2] = b0.z; b[3] = b0.w;
                b[4] = b1.x; b[5] = b1.y; b[6] = b1.z; b[7] = b1.w;
            }
            if constexpr (GEMM_EPI_READS_AUX(EPI) && !GIVEN) val_ld8(aux + off, in);
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) {
            if (ok[e]) {
                if constexpr (HAS_BIAS) b[e] = bias[c + e];
                if constexpr (GEMM_EPI_READS_AUX(EPI) && !GIVEN) in[e] = val_ld(aux + off + e);
            }
        }
    }
    if constexpr (GIVEN) {
#pragma unroll
        for (int e = 0; e < W; ++e) in[e] = given[e];
    }
#pragma unroll
    for (int e = 0; e < W; ++e) {
        if constexpr (sizeof(TO) == 2)
            out[e] = gemm_epi_value_bf16<EPI, HAS_BIAS>(v[e], alpha, b[e], in[e], &pre[e]);
        else
            out[e] = gemm_epi_value<EPI, HAS_BIAS>(v[e], alpha, b[e], in[e], &pre[e]);
    }
    if (wide) {
        if constexpr (W == 4) {
            if constexpr (EPI == GEMM_EPI_GELU) val_st4(aux + off, pre);
            val_st4(C + off, out);
        } else {
            if constexpr (EPI == GEMM_EPI_GELU || EPI == GEMM_EPI_DGELU_GELU) val_st8(aux + off, pre);
            val_st8(C + off, out);
        }
    } else {
#pragma unroll
        for (int e = 0; e < W; ++e) {
            if (ok[e]) {
                if constexpr (EPI == GEMM_EPI_GELU || EPI == GEMM_EPI_DGELU_GELU) val_st(aux + off + e, pre[e]);
                val_st(C + off + e, out[e]);
            }
        }
    }
}
template <int EPI, bool HAS_BIAS, class TO = float>
__device__ __forceinline__ void gemm_store4_once(TO* C, TO* aux, const float* bias, int r, int c, int M, int N,
                                                 int ldc, float alpha, bool wide, const float (&v)[4]) {
    gemm_store_once<EPI, HAS_BIAS, TO, 4>(C, aux, bias, r, c, M, N, ldc, alpha, wide, v);
}

// The block's place in the grid, shared by the GEMM kernels: batching and split-K share
// gridDim.z (z = batch * splits + split); the block computes the tile at (m0, n0) over k in
// [kb0, kb0 + klen).
template <int BM, int BN>
struct GemmBlock {
    int split, batch, m0, n0, kb0, klen;
    __device__ __forceinline__ GemmBlock(int K, int splits, int k_chunk) {
        const int z = blockIdx.z;
        split = z % splits;
        batch = z / splits;
        m0 = blockIdx.y * BM;
        n0 = blockIdx.x * BN;
        kb0 = split * k_chunk;
        klen = min(K, kb0 + k_chunk) - kb0;
    }
};
