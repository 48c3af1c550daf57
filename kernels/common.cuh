// Shared by every kernel: the step state layout, the counter-based RNG, small helpers.
// The RNG is mirrored bit for bit by gptcuda/model/rng.py; tests/test_rng.py pins it.
#pragma once

// Device-resident step state (one per training run). Kernels read the step, the learning
// rate and the clipping norm from here, so a captured CUDA graph bakes in nothing that
// changes from step to step. Its layout is defined in gptcuda/model/state.py (tests/test_state.py checks
// this struct against it).
struct StepState {
    int   step;        // 0-based index of the step being run; advanced by step_advance at its end
    float lr;          // learning rate of this step (written by lr_schedule at the start)
    float loss;        // mean loss of the last forward pass
    float grad_norm;   // global L2 norm of the gradients of this step (before clipping)
    int   eval_draws;  // counter of evaluation batches drawn so far
    int   work_fresh;  // 1: the bf16 working copy holds the parameters (adamw_copy wrote both); 0 after any other write
    int   pad[10];
};

typedef unsigned int u32;

__device__ __forceinline__ u32 gc_hash32(u32 x) {
    x ^= x >> 16; x *= 0x7feb352du;
    x ^= x >> 15; x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// 2^x as one approximate instruction (ex2.approx.ftz: relative error near 2^-22; -inf gives 0): the flash
// kernels' exponentials, the bf16 GEMM epilogue's GELU, the loss's; exp(x) is gc_exp2(x * GC_LOG2E)
#define GC_LOG2E 1.4426950408889634f
__device__ __forceinline__ float gc_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// key of one random stream: H(H(H(seed) ^ site) + step * golden)
__device__ __forceinline__ u32 gc_key(u32 seed, u32 step, u32 site) {
    return gc_hash32(gc_hash32(gc_hash32(seed) ^ site) + step * 0x9e3779b9u);
}

// random word of element idx in stream k
__device__ __forceinline__ u32 gc_uniform(u32 k, u32 idx) {
    return gc_hash32(gc_hash32(idx ^ k) + k);
}

// Dropout keep bits (rng.dropout_mask). A mask is taken as rows of `cols` elements; the two
// elements of a pair (columns 2c, 2c+1 of a row) share one random word, H(pair ^ k) of the pair's
// index pair = row * ceil(cols / 2) + c (mod 2^32): the even column is kept when the word's low 16
// bits are >= threshold, the odd one on its high 16 bits; threshold = min(floor(p * 2^16), 2^16 - 1).
// A flat mask is one row: element e takes half e & 1 of word e >> 1. One round of the mixer (the
// key k is already three rounds of seed, site and step): the attention kernels draw a word for every
// two probabilities, where a second round was most of dropout's cost.
__device__ __forceinline__ u32 gc_keep_word(u32 k, u32 pair) {
    return gc_hash32(pair ^ k);
}
// the 16-bit half of a keep word that belongs to the odd (odd != 0) or the even column
__device__ __forceinline__ u32 gc_keep_half(u32 w, u32 odd) {
    return odd ? w >> 16 : w & 0xffffu;
}
// Attention dropout (rng.attention_keep): the probability of row R = (b*H + h)*T + i and key j takes
// byte gc_att_byte(j) of the keep word of quad R * gc_att_words(T) + gc_att_quad(j): keys 2c, 2c+1,
// 2c+8 and 2c+9 of a 16-key block (c = 0..3) share one word, so a tensor-core thread that holds keys
// 2c, 2c+1 of two neighbouring 8-key groups (or keys g and g+8) draws one word for them; kept when the
// byte is >= threshold = min(floor(p * 256), 255), scaled by 1 / (1 - threshold / 256).
__device__ __forceinline__ u32 gc_att_words(int T) { return 4u * (u32)((T + 15) >> 4); }
__device__ __forceinline__ u32 gc_att_quad(u32 j) { return ((j >> 4) << 2) | ((j >> 1) & 3u); }
__device__ __forceinline__ u32 gc_att_byte(u32 j) { return ((j >> 2) & 2u) | (j & 1u); }
// byte b of keep word w >= threshold (the byte shifted to the top: one compare for byte 3)
__device__ __forceinline__ bool gc_keep_byte(u32 w, u32 b, u32 threshold) {
    return (w << (24u - 8u * b)) >= (threshold << 24);
}
// keep-test of key j of the row whose first quad is rowq (R * gc_att_words(T))
__device__ __forceinline__ bool gc_keep_att(u32 k, u32 rowq, u32 j, u32 threshold) {
    return gc_keep_byte(gc_keep_word(k, rowq + gc_att_quad(j)), gc_att_byte(j), threshold);
}

// The keep words of the two queries iq0 (even) and iq0 + 1 whose bytes a dK / dV thread of a tensor-core
// fragment needs: this lane drew `mine`, query iq0 + odd's word (odd: the parity of its row g), its neighbour
// lane (lane ^ 4, row g ^ 1) the other; kw[c] is query iq0 + c's word shifted so that this lane's keys are its
// bytes 0 and 2. A shuffle: every lane of the warp calls it.
__device__ __forceinline__ void gc_att_pair_words(u32 mine, u32 odd, u32 (&kw)[2]) {
    const u32 other = __shfl_xor_sync(0xffffffffu, mine, 4);
    kw[0] = (odd ? other : mine) >> (8 * odd);
    kw[1] = (odd ? mine : other) >> (8 * odd);
}
// Dropout of a flat mask's element e (x * scale where kept, else 0), and of its four elements e ..
// e + 3 for e % 4 == 0 (the words of pairs e/2 and e/2 + 1, drawn once each)
__device__ __forceinline__ float gc_dropout1(float x, u32 k, long long e, u32 threshold, float scale) {
    return gc_keep_half(gc_keep_word(k, (u32)(e >> 1)), (u32)(e & 1)) >= threshold ? x * scale : 0.f;
}
__device__ __forceinline__ float4 gc_dropout4(float4 x, u32 k, long long e, u32 threshold, float scale) {
    const u32 w0 = gc_keep_word(k, (u32)(e >> 1)), w1 = gc_keep_word(k, (u32)(e >> 1) + 1u);
    return make_float4(gc_keep_half(w0, 0) >= threshold ? x.x * scale : 0.f,
                       gc_keep_half(w0, 1) >= threshold ? x.y * scale : 0.f,
                       gc_keep_half(w1, 0) >= threshold ? x.z * scale : 0.f,
                       gc_keep_half(w1, 1) >= threshold ? x.w * scale : 0.f);
}

// traps unless the launch gave at least need_bytes of dynamic shared memory (the launcher and the
// kernel disagree on the plan)
__device__ __forceinline__ void gc_check_smem(unsigned need_bytes) {
    unsigned have;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < need_bytes) __trap();
}

__device__ __forceinline__ float gc_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float gc_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---- cp.async (sm_80+): global -> shared copies that bypass registers ------------------------
// Shared addresses are 32-bit shared-window offsets (smem_u32). src_bytes < size zero-fills the
// rest of the destination (0: a pure zero fill; src must still be a valid address).
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16_full(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
