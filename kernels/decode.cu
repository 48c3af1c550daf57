// Generation with a KV cache: one new position for each of S sequences per step.
// The position lives in device memory (`pos`), so a recorded decode step is replayed
// unchanged for every token; pos_advance moves it on.
#include "common.cuh"

// out[s, c] = wte[tok[s], c] + wpe[*pos, c]
__global__ void __launch_bounds__(256)
decode_embed(float* __restrict__ out,          // out [S, C]
             const int* __restrict__ tok,      // tok [S]
             const float* __restrict__ wte,    // wte [V, C]
             const float* __restrict__ wpe,    // wpe [Tmax, C]
             const int* __restrict__ pos,      // pos [1]
             int S, int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= S * C) return;
    int s = i / C, c = i - s * C;
    out[i] = wte[(long long)tok[s] * C + c] + wpe[(long long)(*pos) * C + c];
}

// One block per (head, sequence): append this position's k and v to the cache, then attend the
// query over keys 0..pos. Scores live in dynamic shared memory [Tmax] + the query [HS].
template <int HS>
__global__ void __launch_bounds__(128)
decode_attention(float* __restrict__ y,            // y [S, C]            (C = H * HS)
                 const float* __restrict__ qkv,    // qkv [S, 3C]         q | k | v
                 float* __restrict__ kcache,       // kcache [S, H, Tmax, HS]
                 float* __restrict__ vcache,       // vcache [S, H, Tmax, HS]
                 const int* __restrict__ pos,      // pos [1]
                 int H, int Tmax, float scale) {
    extern __shared__ float sm[];
    float* q = sm;              // [HS]
    float* p = sm + HS;         // [Tmax]
    __shared__ float red[2][4];
    __shared__ float acc[128 / HS > 0 ? 128 : HS][1];
    const int h = blockIdx.x, s = blockIdx.y, C = H * HS, t = *pos;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const float* row = qkv + (long long)s * 3 * C + h * HS;
    float* kc = kcache + ((long long)(s * H + h) * Tmax) * HS;
    float* vc = vcache + ((long long)(s * H + h) * Tmax) * HS;
    for (int d = threadIdx.x; d < HS; d += blockDim.x) {
        q[d] = row[d] * scale;
        kc[(long long)t * HS + d] = row[C + d];
        vc[(long long)t * HS + d] = row[2 * C + d];
    }
    __syncthreads();
    // scores: one warp per key
    float mx = __int_as_float(0xff800000);
    for (int j = warp; j <= t; j += nwarps) {
        float v = 0.f;
        for (int d = lane; d < HS; d += 32) v += q[d] * kc[(long long)j * HS + d];
        v = gc_warp_sum(v);
        if (lane == 0) p[j] = v;
        mx = fmaxf(mx, v);
    }
    if (lane == 0) red[0][warp] = mx;
    __syncthreads();
    mx = red[0][0];
    for (int w = 1; w < nwarps; ++w) mx = fmaxf(mx, red[0][w]);
    float sum = 0.f;
    for (int j = threadIdx.x; j <= t; j += blockDim.x) {
        float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = gc_warp_sum(sum);
    if (lane == 0) red[1][warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < nwarps; ++w) sum += red[1][w];
    // output: thread handles column d = tid % HS for keys j = tid / HS, + stride
    const int groups = blockDim.x / HS > 0 ? blockDim.x / HS : 1;
    const int d = threadIdx.x % HS, g = threadIdx.x / HS;
    float o = 0.f;
    if (g < groups)
        for (int j = g; j <= t; j += groups) o += p[j] * vc[(long long)j * HS + d];
    acc[threadIdx.x][0] = o;
    __syncthreads();
    if (threadIdx.x < HS) {
        float r = 0.f;
        for (int k = 0; k < groups; ++k) r += acc[k * HS + threadIdx.x][0];
        y[(long long)s * C + h * HS + threadIdx.x] = r / sum;
    }
}

__global__ void pos_advance(int* pos) { *pos += 1; }
