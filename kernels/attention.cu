// Unfused causal self-attention: the pieces around the batched matmuls (gemm_*.cu).
//
//   forward:  qkv [B,T,3C] --attn_permute_in--> q,k,v [B,H,T,hs]
//             probs = (q k^T) * scale                (gemm, into the saved probs [B,H,T,T])
//             attn_softmax_fwd: causal softmax in place; entries above the diagonal are
//             exactly 0; with dropout also writes pd = probs * keep / (1-p)
//             yh = (pd or probs) v                   (gemm)
//             yh [B,H,T,hs] --attn_permute_out--> y [B,T,C]
//   backward: dy --attn_permute_in--> dyh; q,k,v re-split from qkv (the workspace is shared
//             by all layers); pd rebuilt by attn_dropout_probs; dv = pd^T dyh; dpd = dyh v^T;
//             attn_softmax_bwd: dS = P * (dP - rowsum(P * dP)) * scale, dP = dpd*keep/(1-p),
//             in place on dpd; dq = dS k; dk = dS^T q; dq,dk,dv --attn_permute_out--> dqkv.
//
// The dropout keep bit of probability element (b,h,i,j) is gc_keep_att(key, r * gc_att_words(T), j,
// threshold) with r = (b*H + h)*T + i: four keys of a row share a keep word (common.cuh); the numpy
// reference draws the same bits (rng.attention_keep).
#include "common.cuh"

// Block geometry comes from the launcher (gptcuda/ops/cuda/attention.py) as template arguments: the
// permutes' THREADS (grid-stride loops, any block), the row kernels' ROWS (one warp a row, 32 * ROWS
// threads a block).

// ------------------------------------------------------------------------------ permutes

// x [B,T,nmat*C] (C = H*hs) -> nmat tensors [B,H,T,hs] (out1/out2 unused when nmat == 1).
// VEC = 4 needs hs % 4 == 0 and 16-byte aligned pointers.
template <int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
attn_permute_in(float* __restrict__ out0,        // [B,H,T,hs]
                float* __restrict__ out1,        // [B,H,T,hs] or null
                float* __restrict__ out2,        // [B,H,T,hs] or null
                const float* __restrict__ x,     // [B,T,nmat*C]
                int B, int T, int H, int hs, int nmat) {
    const int C = H * hs;
    const int cv = C / VEC;                      // vectors per head-group row
    const long long total = (long long)B * T * nmat * cv;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        int c = (int)(g % (nmat * cv));          // vector column within the row of x
        long long bt = g / (nmat * cv);
        int t = (int)(bt % T);
        int b = (int)(bt / T);
        int m = c / cv;
        int cc = (c - m * cv) * VEC;             // scalar column inside the matrix
        int h = cc / hs;
        int d = cc - h * hs;
        float* dst = m == 0 ? out0 : (m == 1 ? out1 : out2);
        long long o = (((long long)b * H + h) * T + t) * hs + d;
        if (VEC == 4) {
            *reinterpret_cast<float4*>(dst + o) = reinterpret_cast<const float4*>(x)[g];
        } else {
            dst[o] = x[g];
        }
    }
}

// nmat tensors [B,H,T,hs] -> out [B,T,nmat*C]
template <int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
attn_permute_out(float* __restrict__ out,        // [B,T,nmat*C]
                 const float* __restrict__ in0,  // [B,H,T,hs]
                 const float* __restrict__ in1,  // [B,H,T,hs] or null
                 const float* __restrict__ in2,  // [B,H,T,hs] or null
                 int B, int T, int H, int hs, int nmat) {
    const int C = H * hs;
    const int cv = C / VEC;
    const long long total = (long long)B * T * nmat * cv;
    for (long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        int c = (int)(g % (nmat * cv));
        long long bt = g / (nmat * cv);
        int t = (int)(bt % T);
        int b = (int)(bt / T);
        int m = c / cv;
        int cc = (c - m * cv) * VEC;
        int h = cc / hs;
        int d = cc - h * hs;
        const float* src = m == 0 ? in0 : (m == 1 ? in1 : in2);
        long long o = (((long long)b * H + h) * T + t) * hs + d;
        if (VEC == 4) {
            reinterpret_cast<float4*>(out)[g] = *reinterpret_cast<const float4*>(src + o);
        } else {
            out[g] = src[o];
        }
    }
}

// ------------------------------------------------------------------------------ softmax

// Causal softmax of each row of att, in place, one warp per row (row r = (b*H+h)*T + i):
// att[r, j] = exp(s_j - max) / sum for j <= i, exactly 0 for j > i. The row is read once
// for an online max/sum, then again to write. With DROP, pd[r, j] = att[r, j] * keep * inv_keep.
template <bool DROP, int ROWS>
__global__ void __launch_bounds__(32 * ROWS)
attn_softmax_fwd(float* __restrict__ att,        // [B,H,T,T] scores in, probabilities out
                 float* __restrict__ pd,         // [B,H,T,T] dropped probabilities (DROP) or null
                 const StepState* __restrict__ st,
                 u32 seed, u32 site, u32 threshold, float inv_keep,
                 int rows, int T) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int i = r % T;                          // query position: keys 0..i are visible
    float* row = att + (long long)r * T;
    const float ninf = __int_as_float(0xff800000);

    float m = ninf, s = 0.f;
    for (int j = lane; j <= i; j += 32) {
        float x = row[j];
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    float M = gc_warp_max(m);
    s = (m == ninf) ? 0.f : s * expf(m - M);
    float S = gc_warp_sum(s);
    float inv = 1.f / S;

    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);
    const u32 base = (u32)r * gc_att_words(T);       // the row's first keep-word quad, mod 2^32
    float* prow = DROP ? pd + (long long)r * T : nullptr;
    for (int j = lane; j < T; j += 32) {
        float v = 0.f;
        if (j <= i) v = expf(row[j] - M) * inv;
        row[j] = v;
        if (DROP) prow[j] = gc_keep_att(key, base, (u32)j, threshold) ? v * inv_keep : 0.f;
    }
}

// pd = probs * keep * inv_keep (rebuilds the forward's dropped probabilities for the backward),
// causal rows: entries above the diagonal are 0 in probs and so in pd.
template <int ROWS>
__global__ void __launch_bounds__(32 * ROWS)
attn_dropout_probs(float* __restrict__ pd,           // [B,H,T,T]
                   const float* __restrict__ probs,  // [B,H,T,T]
                   const StepState* __restrict__ st,
                   u32 seed, u32 site, u32 threshold, float inv_keep,
                   int rows, int T) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int i = r % T;
    const u32 key = gc_key(seed, (u32)st->step, site);
    const u32 base = (u32)r * gc_att_words(T);       // the row's first keep-word quad, mod 2^32
    const float* prow = probs + (long long)r * T;
    float* drow = pd + (long long)r * T;
    for (int j = lane; j < T; j += 32) {
        float v = 0.f;
        if (j <= i && gc_keep_att(key, base, (u32)j, threshold)) v = prow[j] * inv_keep;
        drow[j] = v;
    }
}

// Softmax backward, in place on d: d holds dL/d(pd) (the gradient of the dropped
// probabilities) and becomes dL/d(scores) including the 1/sqrt(hs) scale:
//   dP = d * keep * inv_keep (DROP) or d;   dS = P * (dP - sum_j P*dP) * scale;  0 above the diagonal.
template <bool DROP, int ROWS>
__global__ void __launch_bounds__(32 * ROWS)
attn_softmax_bwd(float* __restrict__ d,              // [B,H,T,T] dpd in, dS out
                 const float* __restrict__ probs,    // [B,H,T,T]
                 const StepState* __restrict__ st,
                 u32 seed, u32 site, u32 threshold, float inv_keep, float scale,
                 int rows, int T) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * ROWS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int i = r % T;
    u32 key = 0;
    if (DROP) key = gc_key(seed, (u32)st->step, site);
    const u32 base = (u32)r * gc_att_words(T);       // the row's first keep-word quad, mod 2^32
    const float* prow = probs + (long long)r * T;
    float* drow = d + (long long)r * T;

    float acc = 0.f;
    for (int j = lane; j <= i; j += 32) {
        float g = drow[j];
        if (DROP) g = gc_keep_att(key, base, (u32)j, threshold) ? g * inv_keep : 0.f;
        acc += prow[j] * g;
    }
    const float dot = gc_warp_sum(acc);
    for (int j = lane; j < T; j += 32) {
        float v = 0.f;
        if (j <= i) {
            float g = drow[j];
            if (DROP) g = gc_keep_att(key, base, (u32)j, threshold) ? g * inv_keep : 0.f;
            v = prow[j] * (g - dot) * scale;
        }
        drow[j] = v;
    }
}
