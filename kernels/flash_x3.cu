// The fp32 precision's flash kernels as 3xTF32 (where its GEMMs run as 3xTF32): flash_tc.cuh's
// bodies, X3 = true.
#include "flash_tc.cuh"

// the fp32 precision's forward in 3xTF32 (FaFwdTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_fwd_x3(FA_ARGS_FWD) {
    fa_fwd_tc_body<HS, DROP, true>(y, lse, qkv, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dQ in 3xTF32 (FaDqTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_bwd_dq_x3(FA_ARGS_BWD) {
    fa_dq_tc_body<HS, DROP, true>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}

// the fp32 precision's dK / dV in 3xTF32 (FaDkvTc<HS, true>)
template <int HS, bool DROP>
__global__ void __launch_bounds__(FA_THREADS, 2) flash_bwd_dkv_x3(FA_ARGS_BWD) {
    fa_dkv_tc_body<HS, DROP, true>(dqkv, qkv, dy, lse, Dg, st, seed, site, threshold, inv_keep, scale, T, H);
}
