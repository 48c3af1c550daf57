// Token + position embedding: forward gather and deterministic backward scatter.
//
//   encoder_fwd<VEC>      out[n, :] = wte[idx[n], :] + wpe[n % T, :]
//   encoder_bwd_wte<VEC>  dwte[v, :] += sum of dout[n, :] over the tokens n with idx[n] == v
//   encoder_bwd_wpe<VEC>  dwpe[t, :]  = sum over b of dout[b, t, :] (t < T), 0 for t >= T
//
// VEC is 4 (float4 loads/stores; needs C % 4 == 0 and 16-byte aligned pointers) or 1.
// The backward uses no atomics: a block owns one (vocabulary row, column tile) of dwte and
// scans every token id in a fixed order, so the sum order never depends on scheduling.
#include "common.cuh"

#define ENC_THREADS 256
#define ENC_BWD_WARPS 16
#define ENC_BWD_UNROLL 4

template <int VEC>
__device__ __forceinline__ void enc_load(float (&r)[VEC], const float* p) {
    if constexpr (VEC == 4) {
        float4 t = *reinterpret_cast<const float4*>(p);
        r[0] = t.x; r[1] = t.y; r[2] = t.z; r[3] = t.w;
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = p[k];
    }
}

template <int VEC>
__device__ __forceinline__ void enc_store(float* p, const float (&r)[VEC]) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(r[0], r[1], r[2], r[3]);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) p[k] = r[k];
    }
}

// One thread per VEC consecutive columns of one token.
template <int VEC>
__global__ void __launch_bounds__(ENC_THREADS)
encoder_fwd(float* __restrict__ out,        // out  [N, C]   (N = B*T)
            const int* __restrict__ idx,    // idx  [N]
            const float* __restrict__ wte,  // wte  [V, C]
            const float* __restrict__ wpe,  // wpe  [Tmax, C]
            int N, int T, int C, int V) {
    const int CV = C / VEC;
    const long long i = (long long)blockIdx.x * ENC_THREADS + threadIdx.x;
    if (i >= (long long)N * CV) return;
    const int n = (int)(i / CV);
    const int c = (int)(i - (long long)n * CV) * VEC;
    const int t = n % T;
    const int id = idx[n];
    float r[VEC];
    if ((unsigned)id >= (unsigned)V) {           // an out-of-range id poisons its row
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = __int_as_float(0x7fc00000);
    } else {
        float a[VEC], b[VEC];
        enc_load<VEC>(a, wte + (long long)id * C + c);
        enc_load<VEC>(b, wpe + (long long)t * C + c);
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = a[k] + b[k];
    }
    enc_store<VEC>(out + (long long)n * C + c, r);
}

// grid (V, ceil(C / (32*VEC))), block ENC_BWD_WARPS*32.
// Warp w takes the token chunks w, w + WARPS, w + 2*WARPS, ... (32 tokens a chunk, in
// increasing order) and accumulates the matching rows of its 32*VEC columns in registers;
// the warps' sums are then added in warp order. Fixed order everywhere: bitwise reproducible.
template <int VEC>
__global__ void __launch_bounds__(ENC_BWD_WARPS * 32)
encoder_bwd_wte(float* __restrict__ dwte,         // dwte [V, C]   (+=)
                const float* __restrict__ dout,   // dout [N, C]
                const int* __restrict__ idx,      // idx  [N]
                int N, int C) {
    constexpr int TILE = 32 * VEC;
    __shared__ float red[ENC_BWD_WARPS][TILE];
    const int v = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.y * TILE + lane * VEC;
    const bool active = c < C;                   // VEC == 4 implies C % 4 == 0: all or nothing
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;

    for (int base = warp * 32; base < N; base += ENC_BWD_WARPS * 32 * ENC_BWD_UNROLL) {
        unsigned hits[ENC_BWD_UNROLL];
#pragma unroll
        for (int u = 0; u < ENC_BWD_UNROLL; ++u) {          // issue the id loads together
            const int n = base + u * ENC_BWD_WARPS * 32 + lane;
            const bool m = n < N && idx[n] == v;
            hits[u] = __ballot_sync(0xffffffffu, m);
        }
#pragma unroll
        for (int u = 0; u < ENC_BWD_UNROLL; ++u) {
            const int chunk = base + u * ENC_BWD_WARPS * 32;
            unsigned h = hits[u];
            while (h) {                                      // two rows at a time, in token order
                const int j0 = __ffs(h) - 1;
                h &= h - 1;
                const int j1 = h ? __ffs(h) - 1 : -1;
                if (j1 >= 0) h &= h - 1;
                if (active) {
                    float a[VEC], b[VEC];
                    enc_load<VEC>(a, dout + (long long)(chunk + j0) * C + c);
                    if (j1 >= 0) enc_load<VEC>(b, dout + (long long)(chunk + j1) * C + c);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc[k] += a[k];
                    if (j1 >= 0) {
#pragma unroll
                        for (int k = 0; k < VEC; ++k) acc[k] += b[k];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) red[warp][lane * VEC + k] = acc[k];
    __syncthreads();
    for (int k = threadIdx.x; k < TILE; k += ENC_BWD_WARPS * 32) {
        const int col = blockIdx.y * TILE + k;
        if (col < C) {
            float s = red[0][k];
#pragma unroll
            for (int w = 1; w < ENC_BWD_WARPS; ++w) s += red[w][k];
            float* d = dwte + (long long)v * C + col;
            *d = *d + s;
        }
    }
}

// One thread per VEC columns of one position t of dwpe; sums the batch in order b = 0..B-1.
template <int VEC>
__global__ void __launch_bounds__(ENC_THREADS)
encoder_bwd_wpe(float* __restrict__ dwpe,         // dwpe [Tmax, C]  (=)
                const float* __restrict__ dout,   // dout [B, T, C]
                int B, int T, int Tmax, int C) {
    const int CV = C / VEC;
    const long long i = (long long)blockIdx.x * ENC_THREADS + threadIdx.x;
    if (i >= (long long)Tmax * CV) return;
    const int t = (int)(i / CV);
    const int c = (int)(i - (long long)t * CV) * VEC;
    float s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) s[k] = 0.f;
    if (t < T) {
        const long long stride = (long long)T * C;
        const float* p = dout + (long long)t * C + c;
        for (int b = 0; b < B; ++b) {
            float a[VEC];
            enc_load<VEC>(a, p + b * stride);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s[k] += a[k];
        }
    }
    enc_store<VEC>(dwpe + (long long)t * C + c, s);
}
