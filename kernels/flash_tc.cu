// The TF32 flash kernels (the tf32 precision's fused attention): flash_tc.cuh's bodies, X3 = false.
#include "flash_tc.cuh"

template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_fwd_tc(FA_ARGS_FWD) {
    fa_fwd_tc_body<HS, DROP, false>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}


template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_bwd_dq_tc(FA_ARGS_BWD) {
    fa_dq_tc_body<HS, DROP, false>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}


template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_bwd_dkv_tc(FA_ARGS_BWD) {
    fa_dkv_tc_body<HS, DROP, false>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

