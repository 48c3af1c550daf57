// The TF32 flash kernels (the tf32 precision's fused attention): flash_tc.cuh's bodies, X3 = false.
#include "flash_tc.cuh"

template <int HS, bool DROP, FA_TC_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_fwd_tc(FA_ARGS_FWD) {
    using F = FaFwdTc<HS, false, MT, BC, NS, AREG>;
    FA_TC_CHECK;
    fa_fwd_tc_body<HS, DROP, F>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

template <int HS, bool DROP, FA_TC_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_bwd_dq_tc(FA_ARGS_BWD) {
    using F = FaDqTc<HS, false, MT, BC, NS, AREG>;
    FA_TC_CHECK;
    fa_dq_tc_body<HS, DROP, F>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

template <int HS, bool DROP, FA_TC_DKV_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_bwd_dkv_tc(FA_ARGS_BWD) {
    using F = FaDkvTc<HS, false, MT, BQ, NS, AREG, VREG>;
    FA_TC_CHECK;
    fa_dkv_tc_body<HS, DROP, F>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

