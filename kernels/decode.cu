// Generation with a KV cache: one new position for each of S sequences per step, and the next
// token drawn on the device. Everything a step reads lives in device memory (the position, each
// sequence's window of tokens, the sampling options), so one recorded step is replayed unchanged
// for every token and the host only reads back what was drawn.
//
// Per-sequence state (int32; gptcuda/model/memory.py plan_decode):
//   ctx   [S, T+1]  the tokens of the cache window: the prompt, then what was drawn
//   fill  [S]       how many entries of ctx are known: the step at position pos draws a token
//                   only when pos + 1 >= fill (before that it reads the prompt)
//   out   [S, N]    the tokens drawn, in order (N = the most new tokens)
//   n_out [S]       how many were drawn
//   done  [S]       1 once N tokens or the stop sequence were drawn
//   emit  [2, S]    this step's draw (-1: none) and done, copied to the host after every step
// and shared: pos [1] (the position decoded), opts [8] (GenOpts), stop [STOP_MAX].
//
// Element types (template arguments, type codes of bf16.cuh: 0 fp32, 1 bf16): decode_linear's
// operands (DT: the activation a and the weights w) and its output (OUT), the attention's KV cache
// (KT) and output (YT). A bf16 generation reads the weights from their bf16 working copy and keeps
// the cache, and what the products read, in bf16; every sum, the softmax, the residual stream,
// qkv and the logits stay fp32.
#include "common.cuh"
#include "gemm_epilogue.cuh"

#define STOP_MAX 16
#define SITE_SAMPLE 7u                  // gptcuda/model/rng.py SITE_SAMPLE

// The options of a generation, as the words of opts [8].
struct GenOpts {
    unsigned seed;
    int top_k;          // 0: every token
    float inv_temp;     // 0: greedy (argmax)
    float top_p;        // 1: every token
    int max_new;        // N
    int n_stop;         // tokens in stop[] (0: none)
    int pad[2];
};

// Blocks, decode_linear's columns a block and the attention's keys a chunk are template arguments
// chosen in gptcuda/ops/cuda/decode.py; a kernel asserts what its code fixes.

// out[s, c] = wte[ctx[s, pos], c] + wpe[pos, c]
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
decode_embed(float* __restrict__ out,          // out [S, C]
             const int* __restrict__ ctx,      // ctx [S, T+1]
             const float* __restrict__ wte,    // wte [V, C]
             const float* __restrict__ wpe,    // wpe [Tmax, C]
             const int* __restrict__ pos,      // pos [1]
             int S, int C, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S * C) return;
    int s = i / C, c = i - s * C, t = *pos;
    int tok = ctx[(long long)s * (T + 1) + t];
    out[i] = wte[(long long)tok * C + c] + wpe[(long long)t * C + c];
}

// out[m, n] = epilogue(sum_k a[m, k] w[n, k] + bias[n]) for the M <= MT rows of a decode step
// (x @ W^T with W [N, K] as stored), memory bound: each weight is read once. A block's warps
// form LinearShape<MT, WARPS>::groups groups of ksplit warps; a group takes NPW output columns, its warps
// interleaved slices of k, 16 bytes of a row a lane (128 values of fp32 a warp, 256 of bf16), for every
// row of a at once; the block adds the slices' sums in order. Epilogues as the GEMMs' (gemm_epilogue.cuh):
// none, GELU (aux = the pre-activation), residual (out = aux + ..., aux may be out). a and w of type
// code DT, out and aux of OUT (bf16: rounded once when stored; GELU's output from the pre-activation as
// stored, as the bf16 GEMM computes it), the bias fp32; fp32 FMA, deterministic.
template <int MT, int WARPS>
struct LinearShape {
    static constexpr int npw = MT == 1 ? 1 : 2;             // columns a warp
    static constexpr int ksplit = MT == 16 ? 8 : 4;         // warps sharing a column's k
    static constexpr int groups = WARPS / ksplit;           // column groups a block
};

// 16 bytes of a row widened to fp32, as float4s: one of fp32 (4 values), two of bf16 (8 values)
template <int CODE> struct Row16 { float4 v[CODE == 1 ? 2 : 1]; };
__device__ __forceinline__ Row16<0> row16(const float* p) { return {*reinterpret_cast<const float4*>(p)}; }
__device__ __forceinline__ Row16<1> row16(const bf16* p) {
    const uint4 t = *reinterpret_cast<const uint4*>(p);
    return {bf16x4_f32(make_uint2(t.x, t.y)), bf16x4_f32(make_uint2(t.z, t.w))};
}
template <int CODE> __device__ __forceinline__ Row16<CODE> row16_zero() {
    Row16<CODE> r;
#pragma unroll
    for (int q = 0; q < (CODE == 1 ? 2 : 1); ++q) r.v[q] = make_float4(0.f, 0.f, 0.f, 0.f);
    return r;
}

template <int MT, int EPI, int WARPS, int COLS, int DT, int OUT>
__global__ void __launch_bounds__(32 * WARPS)
decode_linear(elem<OUT>* __restrict__ out,      // out [M, N]
              elem<OUT>* aux,                   // aux [M, N]  (GELU: written; residual: read, may be out)
              const elem<DT>* __restrict__ a,   // a [M, K]
              const elem<DT>* __restrict__ w,   // w [N, K]
              const float* __restrict__ bias,   // bias [N] or null
              int M, int N, int K) {
    using L = LinearShape<MT, WARPS>;
    constexpr int NPW = L::npw, KS = L::ksplit;
    constexpr int P = DT == 1 ? 2 : 1, VW = 4 * P;          // float4s, values a lane loads at once
    static_assert(WARPS % KS == 0 && COLS == L::groups * NPW, "COLS: the block's groups of NPW columns");
    __shared__ float partial[WARPS][NPW][MT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int grp = warp / KS, kpart = warp % KS;
    const int n0 = (blockIdx.x * L::groups + grp) * NPW;
    float acc[NPW][MT];
#pragma unroll
    for (int c = 0; c < NPW; ++c)
#pragma unroll
        for (int m = 0; m < MT; ++m) acc[c][m] = 0.f;
    const bool vec = (K & (VW - 1)) == 0 && ((reinterpret_cast<unsigned long long>(w) | reinterpret_cast<unsigned long long>(a)) & 15) == 0;
    if (n0 < N && vec) {
#pragma unroll 2
        for (int k = (kpart * 32 + lane) * VW; k < K; k += 32 * VW * KS) {
            Row16<DT> wv[NPW];
#pragma unroll
            for (int c = 0; c < NPW; ++c)
                wv[c] = n0 + c < N ? row16(w + (long long)(n0 + c) * K + k) : row16_zero<DT>();
#pragma unroll
            for (int m = 0; m < MT; ++m) {
                if (m < M) {
                    const Row16<DT> av = row16(a + (long long)m * K + k);
#pragma unroll
                    for (int c = 0; c < NPW; ++c) {
#pragma unroll
                        for (int q = 0; q < P; ++q) {
                            acc[c][m] = fmaf(av.v[q].x, wv[c].v[q].x, acc[c][m]);
                            acc[c][m] = fmaf(av.v[q].y, wv[c].v[q].y, acc[c][m]);
                            acc[c][m] = fmaf(av.v[q].z, wv[c].v[q].z, acc[c][m]);
                            acc[c][m] = fmaf(av.v[q].w, wv[c].v[q].w, acc[c][m]);
                        }
                    }
                }
            }
        }
    } else if (n0 < N) {
        for (int k = kpart * 32 + lane; k < K; k += 32 * KS) {
#pragma unroll
            for (int c = 0; c < NPW; ++c) {
                const float wv = n0 + c < N ? val_ld(w + ((long long)(n0 + c) * K + k)) : 0.f;
#pragma unroll
                for (int m = 0; m < MT; ++m)
                    if (m < M) acc[c][m] = fmaf(val_ld(a + ((long long)m * K + k)), wv, acc[c][m]);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < NPW; ++c)
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const float v = gc_warp_sum(acc[c][m]);
            if (lane == 0) partial[warp][c][m] = v;
        }
    __syncthreads();
    if (kpart != 0) return;
    // the group's first warp: lane m finishes row m of each column (the k slices added in order)
#pragma unroll
    for (int c = 0; c < NPW; ++c) {
        const int n = n0 + c;
        if (lane < M && n < N) {
            float v = 0.f;
#pragma unroll
            for (int q = 0; q < KS; ++q) v += partial[warp + q][c][lane < MT ? lane : 0];
            const long long off = (long long)lane * N + n;
            const float b = bias != nullptr ? bias[n] : 0.f;
            float in = 0.f, pre, o;
            if constexpr (GEMM_EPI_READS_AUX(EPI)) in = val_ld(aux + off);
            if constexpr (EPI == GEMM_EPI_GELU && OUT == 1) {
                pre = bf16_f32(bf16_rn(gemm_epi_value<GEMM_EPI_NONE, true>(v, 1.f, b, 0.f, nullptr)));
                o = gemm_gelu(pre);
            } else {
                o = gemm_epi_value<EPI, true>(v, 1.f, b, in, &pre);
            }
            if constexpr (EPI == GEMM_EPI_GELU) val_st(aux + off, pre);
            val_st(out + off, o);
        }
    }
}

// Attention of one new query per (sequence, head) over the cache, split over the keys
// ("flash decoding"): block (chunk, head, sequence) takes keys [chunk * CHUNK, + CHUNK)
// up to pos and writes its partial result (sum_j p_j v_j, max score, sum_j p_j with p_j =
// exp(s_j - max)); decode_attention_combine merges the chunks. The block holding key pos reads
// this position's k and v from qkv and appends them to the cache; no other block reads them. KT:
// the cache's element type; a bf16 cache holds k and v rounded to nearest even, and the block reads
// key pos as the cache holds it (written before the first barrier), so that every step sees a key
// as the same value; an fp32 one reads it from qkv.
template <int HS, int THREADS, int CHUNK, int KT>
__global__ void __launch_bounds__(THREADS)
decode_attention(float* __restrict__ part,         // part [S, H, n_chunks, HS + 2]  o | max | sum
                 const float* __restrict__ qkv,    // qkv [S, 3C]         q | k | v   (C = H * HS)
                 elem<KT>* __restrict__ kcache,    // kcache [S, H, Tmax, HS]
                 elem<KT>* __restrict__ vcache,    // vcache [S, H, Tmax, HS]
                 const int* __restrict__ pos,      // pos [1]
                 int H, int Tmax, float scale) {
    constexpr int G = THREADS / HS > 0 ? THREADS / HS : 1;   // key groups of the output sum
    __shared__ __align__(16) float q[HS];
    __shared__ float p[CHUNK];
    __shared__ float o[G][HS];
    __shared__ float red[THREADS / 32];
    const int c = blockIdx.x, h = blockIdx.y, s = blockIdx.z, C = H * HS, t = *pos;
    const int j0 = c * CHUNK;
    if (j0 > t) return;
    const int n = min(CHUNK, t + 1 - j0);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* row = qkv + (long long)s * 3 * C + h * HS;
    elem<KT>* kc = kcache + ((long long)(s * H + h) * Tmax) * HS;
    elem<KT>* vc = vcache + ((long long)(s * H + h) * Tmax) * HS;
    const bool last = t - j0 < CHUNK;                   // this block holds key t
    for (int d = tid; d < HS; d += THREADS) {
        q[d] = row[d] * scale;
        if (last) {
            const float kt = row[C + d];
            val_st(kc + (long long)t * HS + d, kt);
            const float vt = row[2 * C + d];
            val_st(vc + (long long)t * HS + d, vt);
        }
    }
    __syncthreads();
    // scores: two threads a key, each half of the head's dimensions
    {
        const int i = tid >> 1, half = tid & 1, j = j0 + i;
        float v = 0.f;
        if (i < n) {
            const elem<KT>* k;
            if constexpr (KT == 0) k = j == t ? row + C : kc + (long long)j * HS;
            else k = kc + (long long)j * HS;
#pragma unroll
            for (int d = half * (HS / 2); d < (half + 1) * (HS / 2); d += 4) {
                const float4 kv = val_ldf4(k + d);
                v = fmaf(q[d], kv.x, v); v = fmaf(q[d + 1], kv.y, v);
                v = fmaf(q[d + 2], kv.z, v); v = fmaf(q[d + 3], kv.w, v);
            }
        }
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        if (i < n && half == 0) p[i] = v;
    }
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int i = tid; i < n; i += THREADS) mx = fmaxf(mx, p[i]);
    mx = gc_warp_max(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) mx = fmaxf(mx, red[w]);
    __syncthreads();
    float sum = 0.f;
    for (int i = tid; i < n; i += THREADS) {
        const float e = expf(p[i] - mx);
        p[i] = e;
        sum += e;
    }
    sum = gc_warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    // output: thread (g, d) sums keys g, g + G, ... of column d
    const int d = tid % HS, g = tid / HS;
    if (g < G) {
        float acc = 0.f;
        for (int i = g; i < n; i += G) {
            const int j = j0 + i;
            float vv;
            if constexpr (KT == 0) vv = j == t ? row[2 * C + d] : vc[(long long)j * HS + d];
            else vv = val_ld(vc + (long long)j * HS + d);
            acc = fmaf(p[i], vv, acc);
        }
        o[g][d] = acc;
    }
    __syncthreads();
    float* out = part + ((long long)(s * H + h) * gridDim.x + c) * (HS + 2);
    for (int e = tid; e < HS; e += THREADS) {
        float r = 0.f;
#pragma unroll
        for (int k = 0; k < G; ++k) r += o[k][e];
        out[e] = r;
    }
    if (tid == 0) {
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) l += red[w];
        out[HS] = mx;
        out[HS + 1] = l;
    }
}

// y[s, h*HS + d] = the chunks' partial sums merged: sum_c e^(m_c - M) o_c[d] / sum_c e^(m_c - M) l_c
// (YT: y's element type; bf16: rounded to nearest even)
template <int HS, int THREADS, int CHUNK, int YT>
__global__ void __launch_bounds__(THREADS)
decode_attention_combine(elem<YT>* __restrict__ y,         // y [S, C]
                         const float* __restrict__ part,   // part [S, H, n_chunks, HS + 2]
                         const int* __restrict__ pos,      // pos [1]
                         int H, int n_chunks) {
    static_assert(THREADS >= HS && THREADS % 32 == 0, "thread d merges dimension d; whole warps");
    const int h = blockIdx.x, s = blockIdx.y, d = threadIdx.x, t = *pos;
    const int n = t / CHUNK + 1;                       // the chunks holding keys 0..t
    const float* pp = part + (long long)(s * H + h) * n_chunks * (HS + 2);
    float M = __int_as_float(0xff800000);
    for (int c = 0; c < n; ++c) M = fmaxf(M, pp[c * (HS + 2) + HS]);
    float num = 0.f, den = 0.f;
    for (int c = 0; c < n; ++c) {
        const float w = expf(pp[c * (HS + 2) + HS] - M);
        den = fmaf(w, pp[c * (HS + 2) + HS + 1], den);
        if (d < HS) num = fmaf(w, pp[c * (HS + 2) + d], num);
    }
    if (d < HS) {
        const float r = num / den;
        val_st(y + (long long)s * H * HS + h * HS + d, r);
    }
}

// ---- drawing a token ------------------------------------------------------------------------
// Weights are integers, so every sum below is exact and independent of the order of threads:
// w_i = floor(exp((logit_i - max) / temp) * 2^32), at most 2^32 each (the most likely token's),
// 0 for a token less likely than 2^-32 times it (such a token is never drawn). top_k keeps the
// tokens whose logit is at least the k-th largest (ties kept, as HF's top-k); top_p then keeps the
// fewest most likely tokens whose weight reaches top_p of what top_k kept (ties kept). The draw
// takes the first token, in vocabulary order, whose running kept weight exceeds
// floor(r * total / 2^64), r a 64-bit word of the counter RNG at (seed, draw number, sequence).

#define RADIX_BITS 11
#define RADIX_BINS (1 << RADIX_BITS)
typedef unsigned long long u64;

// float -> u32 whose unsigned order is the float order
__device__ __forceinline__ u32 order_key(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// inclusive prefix sum over the block's threads (all of them call it)
__device__ u64 block_scan(u64 v, u64* sw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u64 t = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += t;
    }
    if (lane == 31) sw[warp] = v;
    __syncthreads();
    if (warp == 0) {
        u64 w = lane < nw ? sw[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            u64 t = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += t;
        }
        sw[lane] = w;
    }
    __syncthreads();
    if (warp > 0) v += sw[warp - 1];
    __syncthreads();
    return v;
}

__device__ __forceinline__ u64 token_weight(float logit, float mx, float inv_temp) {
    return __float2ull_rz(expf((logit - mx) * inv_temp) * 4294967296.0f);
}

// The largest key t with sum(weight_i : key_i >= t) >= need, over tokens with key_i >= floor
// (weight: 1 when MASS is false, else token_weight). Three radix passes, 11 + 11 + 10 bits.
template <bool MASS>
__device__ u32 radix_select(const float* row, int n_vocab, u32 floor_key, u64 need, float mx, float inv_temp,
                            u64* hist, u64* sw, u64* sel) {
    u32 prefix = 0, mask = 0;
    const int tid = threadIdx.x;
#pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const int nbins = pass == 2 ? (1 << 10) : RADIX_BINS;
        for (int b = tid; b < RADIX_BINS; b += blockDim.x) hist[b] = 0ull;
        __syncthreads();
        for (int i = tid; i < n_vocab; i += blockDim.x) {
            const float l = row[i];
            const u32 k = order_key(l);
            if (k < floor_key || (k & mask) != prefix) continue;
            atomicAdd(&hist[(k >> shift) & (nbins - 1)], MASS ? token_weight(l, mx, inv_temp) : 1ull);
        }
        __syncthreads();
        // thread t holds bins hi = nbins-1-2t and hi-1, so the block's running sum goes down the bins
        const int hi = RADIX_BINS - 1 - 2 * tid;          // two bins a thread: 1024 threads cover 2048
        const u64 h_hi = hi < nbins ? hist[hi] : 0ull, h_lo = hi - 1 < nbins ? hist[hi - 1] : 0ull;
        const u64 incl = block_scan(h_hi + h_lo, sw);
        const u64 above = incl - h_hi - h_lo;              // weight in bins above hi
        if (above < need && need <= above + h_hi) { sel[0] = (u64)hi; sel[1] = above; }
        else if (above + h_hi < need && need <= incl) { sel[0] = (u64)(hi - 1); sel[1] = above + h_hi; }
        __syncthreads();
        prefix |= (u32)sel[0] << shift;
        mask |= (u32)(nbins - 1) << shift;
        need -= sel[1];
        __syncthreads();
    }
    return prefix;
}

// One block per sequence: draw the token after position pos (or pass, while the prompt is read),
// then at the end of the window (pos + 1 == T) move the last T/2 tokens to its start.
template <int THREADS>
__global__ void __launch_bounds__(THREADS)
decode_sample(int* __restrict__ ctx,               // ctx [S, T+1]
              int* __restrict__ fill,              // fill [S]
              int* __restrict__ out,               // out [S, N]
              int* __restrict__ n_out,             // n_out [S]
              int* __restrict__ done,              // done [S]
              int* __restrict__ emit,              // emit [2, S]
              const float* __restrict__ logits,    // logits [S, Vp]
              const int* __restrict__ pos,         // pos [1]
              const GenOpts* __restrict__ opts,    // opts [1]
              const int* __restrict__ stop,        // stop [STOP_MAX]
              int S, int Vp, int n_vocab, int T, int N) {
    static_assert(2 * THREADS == RADIX_BINS, "radix_select: two bins a thread");
    __shared__ u64 hist[RADIX_BINS];
    __shared__ u64 sw[32];
    __shared__ u64 sel[2];
    __shared__ float fred[32];
    __shared__ int ired[32];
    const int s = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int p = *pos;
    const GenOpts o = *opts;
    int* c = ctx + (long long)s * (T + 1);
    const float* row = logits + (long long)s * Vp;
    const bool was_done = done[s] != 0;
    const bool draw = !was_done && p + 1 >= fill[s];
    if (draw) {
        // the most likely token (lowest index among equals): greedy's answer, and the weights' max
        float best = __int_as_float(0xff800000);
        int arg = 0x7fffffff;
        for (int i = tid; i < n_vocab; i += blockDim.x) {
            const float l = row[i];
            if (l > best) { best = l; arg = i; }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float b2 = __shfl_xor_sync(0xffffffffu, best, off);
            const int a2 = __shfl_xor_sync(0xffffffffu, arg, off);
            if (b2 > best || (b2 == best && a2 < arg)) { best = b2; arg = a2; }
        }
        if (lane == 0) { fred[warp] = best; ired[warp] = arg; }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < nw; ++w)
                if (fred[w] > best || (fred[w] == best && ired[w] < arg)) { best = fred[w]; arg = ired[w]; }
            fred[0] = best; ired[0] = arg;
        }
        __syncthreads();
        const float mx = fred[0];
        int x = ired[0];
        __syncthreads();
        if (o.inv_temp > 0.f) {
            u32 thr = 0;
            if (o.top_k > 0 && o.top_k < n_vocab)
                thr = radix_select<false>(row, n_vocab, 0u, (u64)o.top_k, mx, o.inv_temp, hist, sw, sel);
            if (o.top_p < 1.f) {
                u64 tot = 0;
                for (int i = tid; i < n_vocab; i += blockDim.x) {
                    const float l = row[i];
                    if (order_key(l) >= thr) tot += token_weight(l, mx, o.inv_temp);
                }
                tot = block_scan(tot, sw);
                if (tid == blockDim.x - 1) sel[0] = tot;
                __syncthreads();
                tot = sel[0];
                __syncthreads();
                u64 need = (u64)ceil((double)tot * (double)o.top_p);
                need = need < 1ull ? 1ull : need > tot ? tot : need;
                thr = radix_select<true>(row, n_vocab, thr, need, mx, o.inv_temp, hist, sw, sel);
            }
            // the draw: each thread a contiguous chunk of the vocabulary
            const int chunk = (n_vocab + blockDim.x - 1) / blockDim.x;
            const int i0 = tid * chunk, i1 = min(i0 + chunk, n_vocab);
            u64 mine = 0;
            for (int i = i0; i < i1; ++i) {
                const float l = row[i];
                if (order_key(l) >= thr) mine += token_weight(l, mx, o.inv_temp);
            }
            const u64 incl = block_scan(mine, sw);
            if (tid == blockDim.x - 1) sel[0] = incl;
            __syncthreads();
            const u64 total = sel[0];
            const u32 k = gc_key(o.seed, (u32)n_out[s], SITE_SAMPLE);
            const u64 r = ((u64)gc_uniform(k, 2u * (u32)s) << 32) | (u64)gc_uniform(k, 2u * (u32)s + 1u);
            const u64 target = __umul64hi(r, total);          // in [0, total)
            __syncthreads();
            u64 run = incl - mine;
            if (run <= target && target < incl) {
                for (int i = i0; i < i1; ++i) {
                    const float l = row[i];
                    if (order_key(l) < thr) continue;
                    run += token_weight(l, mx, o.inv_temp);
                    if (target < run) { ired[0] = i; break; }
                }
            }
            __syncthreads();
            x = ired[0];
        }
        if (tid == 0) {
            c[p + 1] = x;
            fill[s] = p + 2;
            const int k = n_out[s];
            int* os = out + (long long)s * N;
            os[k] = x;
            n_out[s] = k + 1;
            bool stopped = o.n_stop > 0 && k + 1 >= o.n_stop;
            for (int j = 0; stopped && j < o.n_stop; ++j) stopped = os[k + 1 - o.n_stop + j] == stop[j];
            const int d = (k + 1 >= N || stopped) ? 1 : 0;
            done[s] = d;
            emit[s] = x;
            emit[S + s] = d;
        }
    } else if (tid == 0) {
        emit[s] = -1;
        emit[S + s] = was_done ? 1 : 0;
    }
    if (p + 1 == T && !was_done) {
        // the window is full: restart it from its last half (positions are absolute, so the
        // cache cannot slide in place; decode_advance sets pos to 0 and the next steps re-read these)
        __syncthreads();
        const int f = fill[s], K = T / 2 > 0 ? T / 2 : 1;   // f = T + 1: this step drew
        for (int i = tid; i < K; i += blockDim.x) c[i] = c[f - K + i];   // f - K >= K: no overlap
        if (tid == 0) fill[s] = K;
    }
}

// pos += 1, back to 0 at the end of the window (decode_sample moved the tokens)
__global__ void decode_advance(int* pos, int T) {
    const int p = *pos + 1;
    *pos = p == T ? 0 : p;
}
