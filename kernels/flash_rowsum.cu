// D = rowsum(dO * O) of the fp32 flash backward (flash_common.cuh; the bf16 kernels make it in
// flash_bwd_dq_bf16).
#include "flash_common.cuh"

// Row r = (b*T + t)*H + h of dy and y, [B,T,C] with C = H*HS, is the HS contiguous floats at r*HS:
// G = HS/4 lanes take a row, one float4 of each tensor a lane (dy, y 16-byte aligned: the launcher
// checks), a fixed fmaf chain, then an xor butterfly over the G lanes (32 / G rows a warp, one load
// of each tensor in flight per thread: the whole grid keeps the DRAM busy; one warp a row with
// 2 floats a lane reached half the bandwidth).
template <int HS, int THREADS>
__global__ void __launch_bounds__(THREADS)
flash_rowsum_do(float* __restrict__ D,          // [B,H,T]
                const float* __restrict__ dy,   // [B,T,C]
                const float* __restrict__ y,    // [B,T,C]
                int rows, int T, int H) {
    constexpr int G = HS / 4;
    static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a power-of-two lane group within a warp");
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long r = gid / G;
    const int q = (int)(gid % G);
    float acc = 0.f;
    if (r < rows) {
        const float4 a = *reinterpret_cast<const float4*>(dy + r * HS + 4 * q);
        const float4 b = *reinterpret_cast<const float4*>(y + r * HS + 4 * q);
        acc = fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, a.x * b.x)));
    }
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (q == 0 && r < rows) {
        const int h = (int)(r % H);
        const long long bt = r / H;
        const int t = (int)(bt % T);
        const long long b = bt / T;
        D[(b * H + h) * T + t] = acc;
    }
}
