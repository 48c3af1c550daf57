// The fp32 precision's flash kernels as 3xTF32 (where its GEMMs run as 3xTF32): flash_tc.cuh's
// bodies, X3 = true.
#include "flash_tc.cuh"

// the fp32 precision's forward in 3xTF32 (FaFwdTc, X3)
template <int HS, bool DROP, FA_TC_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_fwd_x3(FA_ARGS_FWD) {
    using F = FaFwdTc<HS, true, MT, BC, NS, AREG>;
    FA_TC_CHECK;
    fa_fwd_tc_body<HS, DROP, F>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dQ in 3xTF32 (FaDqTc, X3)
template <int HS, bool DROP, FA_TC_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_bwd_dq_x3(FA_ARGS_BWD) {
    using F = FaDqTc<HS, true, MT, BC, NS, AREG>;
    FA_TC_CHECK;
    fa_dq_tc_body<HS, DROP, F>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dK / dV in 3xTF32 (FaDkvTc, X3)
template <int HS, bool DROP, FA_TC_DKV_PLAN>
__global__ void __launch_bounds__(THREADS, 2) flash_bwd_dkv_x3(FA_ARGS_BWD) {
    using F = FaDkvTc<HS, true, MT, BQ, NS, AREG, VREG>;
    FA_TC_CHECK;
    fa_dkv_tc_body<HS, DROP, F>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}
