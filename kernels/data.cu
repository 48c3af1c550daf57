// Batch sampling on the device: windows of block+1 tokens at counter-based random offsets.
//
//   get_batch<EVAL>   k = gc_key(seed, counter, site), counter = st->step (EVAL false) or
//                     st->eval_draws (EVAL true); start_b = gc_uniform(k, row_offset + b) % (n_tokens - T);
//                     x[b, t] = tokens[start_b + t], y[b, t] = tokens[start_b + t + 1].
//                     row_offset: this rank's first row of the global batch (0 on one GPU; rank r
//                     of a data-parallel run draws rows [r*B, (r+1)*B) of the world's batch).
// Bit for bit the same windows as gptcuda.rng.batch_offsets / gptcuda.data.get_batch.
#include "common.cuh"

#define GB_THREADS 256

// grid (ceil(T / 256), B), block 256: thread t of row b copies one position.
template <bool EVAL>
__global__ void __launch_bounds__(GB_THREADS)
get_batch(int* __restrict__ x,              // x      [B, T]
          int* __restrict__ y,              // y      [B, T]
          const int* __restrict__ tokens,   // tokens [n_tokens]
          int n_tokens, int T,
          const StepState* st,
          u32 seed, u32 site, u32 row_offset) {
    const int b = blockIdx.y;
    const int t = blockIdx.x * GB_THREADS + threadIdx.x;
    if (t >= T) return;
    const u32 counter = EVAL ? (u32)st->eval_draws : (u32)st->step;
    const u32 k = gc_key(seed, counter, site);
    const u32 span = (u32)(n_tokens - T);          // valid starts 0 .. n_tokens - T - 1
    const long long start = (long long)(gc_uniform(k, row_offset + (u32)b) % span);
    const long long o = (long long)b * T + t;
    x[o] = tokens[start + t];
    y[o] = tokens[start + t + 1];
}
