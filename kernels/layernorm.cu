// LayerNorm over the last dimension (biased variance, eps 1e-5), forward and backward.
//
//   layernorm_fwd_reg<NV, BIAS, RD>  one warp per row, the row in registers as NV float4 per lane
//                                 (C % 4 == 0, C <= 128*NV, pointers aligned to 4 elements); RD: the
//                                 row is first made and stored, xw = resid + dropout(branch), as
//                                 elementwise.cu's dropout_apply<4, true, true> makes it
//   layernorm_fwd_loop<BIAS>      one warp per row, any C (three passes over the row)
//   layernorm_bwd_reg<NV, BIAS, DROP>  dx += ; per-block partial sums of dw (and db, and ds) -> partials;
//                                 DROP: also dropped = dropout_bwd(dx) of the branch before it (the
//                                 residual's next use in the backward), as elementwise.cu's
//                                 dropout_apply draws it (flat: element e, half e & 1 of word e >> 1)
//   layernorm_bwd_loop<BIAS, DROP>  the same for any C: one block per row
//   (elementwise.cu's sum_rows then adds the partials over the blocks, in block order: dw, db and ds)
//
// Partials layout (rows 3C apart): partials[g, 0:C] = sum over block g's rows of dout * norm; with BIAS
// partials[g, C:2C] = sum of dout, and partials[g, 2C:3C] = sum of the branch gradient the kernel wrote,
// as stored (dropped with DROP, else dx): the bias gradient of the product whose dropout-added branch
// the residual took there (attention / MLP output projection), so that product's weight gradient sums
// no columns. Every sum runs in a fixed order: bitwise reproducible.
//
// Element types (bf16.cuh's codes, the last template arguments: 0 fp32, 1 bf16): the forward's TX (x,
// and the fused residual's resid and xw: the residual stream), TB (branch), TO (out); the backward's
// TDO (dout), TX (x), TDX (dx, read and accumulated into), TDR (dropped). w, b, mean, rstd and the
// partials are fp32, and so is every computation: bf16 values are widened exactly and rounded once,
// where stored. A value the kernel stores and goes on using (xw, dx) is used as stored, so that the
// fused forms give what the unfused ones do (dropout_apply, then the plain kernel; dropout_bwd of dx).
#include "common.cuh"
#include "bf16.cuh"

// GC_BREAK_LAYERNORM=1 builds the deliberately wrong backward that gradcheck.py --break=layernorm
// must catch: the x_hat * mean(dx_hat * x_hat) term of dx is deleted.
#ifndef GC_BREAK_LAYERNORM
#define GC_BREAK_LAYERNORM 0
#endif

#define LN_EPS 1e-5f
// Every kernel takes WARPS, the warps of its block (rows a block in the warp-per-row kernels), as its
// last template argument (gptcuda/ops/cuda/layernorm.py WARPS); layernorm_bwd_reg also SMEM, its
// dynamic shared memory, asserted to be its layout's size.

__device__ __forceinline__ float4 ln_f4(float a) { return make_float4(a, a, a, a); }
__device__ __forceinline__ float ln_hsum(float4 a) { return (a.x + a.y) + (a.z + a.w); }

// 1 / sqrt(var + eps) from this lane's part q of the row's sum of squared deviations
__device__ __forceinline__ float ln_rstd(float q, int C) { return 1.0f / sqrtf(gc_warp_sum(q) / (float)C + LN_EPS); }

// lane 0 of the row's warp saves the statistics the backward reads (where asked for)
__device__ __forceinline__ void ln_save_stats(float* __restrict__ mean, float* __restrict__ rstd, int row, float mu,
                                              float rs) {
    if ((threadIdx.x & 31) == 0) {
        if (mean) mean[row] = mu;
        if (rstd) rstd[row] = rs;
    }
}

#define LN_ARGS_FWD                                                                       \
    elem<TO>* __restrict__ out,     /* out  [N, C] */                                     \
    float* __restrict__ mean,       /* mean [N]   (may be null) */                        \
    float* __restrict__ rstd,       /* rstd [N]   (may be null) */                        \
    const elem<TX>* __restrict__ x, /* x    [N, C] */                                     \
    const float* __restrict__ w,    /* w    [C] */                                        \
    const float* __restrict__ b,    /* b    [C]   (BIAS only) */                          \
    int N, int C

// the residual-dropout input of layernorm_fwd_reg<..., RD = true> (x is then not read)
#define LN_ARGS_RD                                                                        \
    elem<TX>* __restrict__ xw,              /* xw     [N, C]  (=) resid + dropout(branch) */\
    const elem<TX>* __restrict__ resid,     /* resid  [N, C] */                           \
    const elem<TB>* __restrict__ branch,    /* branch [N, C] */                           \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float scale

// the row a lane holds, as its element type packs it (bf16: uint2, half the registers of a float4), widened
// where a pass reads it: the bf16 forward runs 6 blocks of 8 warps an SM where 62 registers allowed 4
__device__ __forceinline__ float4 ln_w4(float4 p) { return p; }
__device__ __forceinline__ float4 ln_w4(uint2 p) {     // widened anew at every pass (an opaque copy first:
    asm volatile("" : "+r"(p.x), "+r"(p.y));           // ptxas would keep the widened row, 24 registers, alive)
    return bf16x4_f32(p);
}
template <int TX> __device__ __forceinline__ Pack4<TX> ln_pack4(float4 v);
template <> __device__ __forceinline__ float4 ln_pack4<0>(float4 v) { return v; }
template <> __device__ __forceinline__ uint2 ln_pack4<1>(float4 v) {     // v already rounded: exact
    return make_uint2(bf16x2_rn(v.x, v.y), bf16x2_rn(v.z, v.w));
}

template <int NV, bool BIAS, bool RD, int WARPS, int TX, int TB, int TO>
__global__ void __launch_bounds__(WARPS * 32, TX == 1 ? 48 / WARPS : 1) layernorm_fwd_reg(LN_ARGS_FWD, LN_ARGS_RD) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const int C4 = C >> 2;
    Pack4<TX> v[NV];
    float s = 0.f;
    if constexpr (RD) {
        const u32 key = gc_key(seed, (u32)st->step, site);
        const Pack4<TX>* rr = reinterpret_cast<const Pack4<TX>*>(resid + (long long)row * C);
        const Pack4<TB>* br = reinterpret_cast<const Pack4<TB>*>(branch + (long long)row * C);
        Pack4<TX>* xo = reinterpret_cast<Pack4<TX>*>(xw + (long long)row * C);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int k = j * 32 + lane;
            float4 f = ln_f4(0.f);
            if (k < C4) {
                const float4 r = val_ld4p(rr + k), d = gc_dropout4(val_ld4p(br + k), key, (long long)row * C + 4 * k,
                                                                    threshold, scale);
                f = make_float4(r.x + d.x, r.y + d.y, r.z + d.z, r.w + d.w);
                val_put4(xo + k, f);               // f as stored (rounded in bf16)
            }
            v[j] = ln_pack4<TX>(f);
            s += ln_hsum(f);
        }
    } else {
        const Pack4<TX>* xr = reinterpret_cast<const Pack4<TX>*>(x + (long long)row * C);
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int k = j * 32 + lane;
            v[j] = k < C4 ? xr[k] : ln_pack4<TX>(ln_f4(0.f));
            s += ln_hsum(ln_w4(v[j]));
        }
    }
    const float mu = gc_warp_sum(s) / (float)C;
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int k = j * 32 + lane;
        if (k < C4) {
            const float4 x4 = ln_w4(v[j]);
            const float4 d = make_float4(x4.x - mu, x4.y - mu, x4.z - mu, x4.w - mu);
            q += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);
        }
    }
    const float rs = ln_rstd(q, C);
    Pack4<TO>* o = reinterpret_cast<Pack4<TO>*>(out + (long long)row * C);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const float4* b4 = reinterpret_cast<const float4*>(b);
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        const int k = j * 32 + lane;
        if (k < C4) {
            const float4 ww = w4[k], x4 = ln_w4(v[j]);
            float4 r = make_float4((x4.x - mu) * rs * ww.x, (x4.y - mu) * rs * ww.y,
                                   (x4.z - mu) * rs * ww.z, (x4.w - mu) * rs * ww.w);
            if constexpr (BIAS) {
                const float4 bb = b4[k];
                r.x += bb.x; r.y += bb.y; r.z += bb.z; r.w += bb.w;
            }
            val_put4(o + k, r);
        }
    }
    ln_save_stats(mean, rstd, row, mu, rs);
}

template <bool BIAS, int WARPS, int TX, int TO>
__global__ void __launch_bounds__(WARPS * 32) layernorm_fwd_loop(LN_ARGS_FWD) {
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= N) return;
    const elem<TX>* xr = x + (long long)row * C;
    float s = 0.f;
    for (int c = lane; c < C; c += 32) s += val_ld(xr + c);
    const float mu = gc_warp_sum(s) / (float)C;
    float q = 0.f;
    for (int c = lane; c < C; c += 32) {
        const float d = val_ld(xr + c) - mu;
        q += d * d;
    }
    const float rs = ln_rstd(q, C);
    elem<TO>* o = out + (long long)row * C;
    for (int c = lane; c < C; c += 32) {
        float r = (val_ld(xr + c) - mu) * rs * w[c];
        if constexpr (BIAS) r += b[c];
        val_st(o + c, r);
    }
    ln_save_stats(mean, rstd, row, mu, rs);
}

#define LN_ARGS_BWD                                                                       \
    elem<TDX>* __restrict__ dx,          /* dx       [N, C]   (+=) */                     \
    float* __restrict__ partials,        /* partials [G, 3C] */                           \
    const elem<TDO>* __restrict__ dout,  /* dout     [N, C] */                            \
    const elem<TX>* __restrict__ x,      /* x        [N, C] */                            \
    const float* __restrict__ mean,      /* mean     [N] */                               \
    const float* __restrict__ rstd,      /* rstd     [N] */                               \
    const float* __restrict__ w,         /* w        [C] */                               \
    int N, int C,                                                                         \
    elem<TDR>* __restrict__ dropped,     /* dropped  [N, C]   (DROP only) */              \
    const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float scale

// grid G blocks (G <= the workspace rows); warp gw = blockIdx.x*WARPS + warp takes rows gw, gw + WARPS*G, ...
// Registers hold a row's dout, x_hat and dx, all loaded at once; w and the warps' dw (db, ds) sums live in
// dynamic shared memory (SMEM bytes; each thread its own sum slots), so that two
// blocks share an SM up to C = 1024.
template <int NV, bool BIAS, bool DROP, int WARPS, int SMEM, int TDO, int TX, int TDX, int TDR>
__global__ void __launch_bounds__(WARPS * 32, 2) layernorm_bwd_reg(LN_ARGS_BWD) {
    static_assert(SMEM == ((BIAS ? 3 : 1) * WARPS + 1) * NV * 32 * 16, "w and each warp's dw (db, ds) sums");
    gc_check_smem(SMEM);
    extern __shared__ float4 ln_smem4[];
    constexpr int S = WARPS * NV * 32;                      // floats4 of one sum array
    float4* wsm = ln_smem4;                                    // w [NV * 32]
    float4* acc_w = wsm + NV * 32;                             // [warp][NV * 32]: the warp's dw sums
    float4* acc_b = acc_w + S;                                 // [warp][NV * 32]: db sums (BIAS)
    float4* acc_d = acc_b + S;                                 // [warp][NV * 32]: ds sums (BIAS)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int C4 = C >> 2;
    const float4* w4 = reinterpret_cast<const float4*>(w);
    for (int k = threadIdx.x; k < NV * 32; k += WARPS * 32) wsm[k] = k < C4 ? w4[k] : ln_f4(0.f);
    float4* aw = acc_w + warp * NV * 32 + lane;                // this thread's slots aw[32 j] (ab[32 j])
    float4* ab = acc_b + warp * NV * 32 + lane;
    // RS: the thread's dw (db) sums over its warp's rows kept in registers and put in its slots once, where
    // the row's values fit beside them (a bf16 row kept packed, or a short one); else added into the slots
    // row by row. The same additions in the same order either way.
    constexpr bool RS = NV <= 4 || (TDO == 1 && TDX == 1 && NV <= 6);
    float4 sw[NV], sb[BIAS ? NV : 1];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if constexpr (RS) {
            sw[j] = ln_f4(0.f);
            if constexpr (BIAS) sb[j] = ln_f4(0.f);
        } else {
            aw[32 * j] = ln_f4(0.f);
            if constexpr (BIAS) ab[32 * j] = ln_f4(0.f);
        }
        if constexpr (BIAS) aw[2 * S + 32 * j] = ln_f4(0.f);   // ds: in the slots (acc_d), a row at a time
    }
    __syncthreads();
    const float invC = 1.0f / (float)C;
    u32 key = 0;
    if constexpr (DROP) key = gc_key(seed, (u32)st->step, site);
    for (int row = blockIdx.x * WARPS + warp; row < N; row += gridDim.x * WARPS) {
        const float mu = mean[row], rs = rstd[row];
        const Pack4<TDO>* dr = reinterpret_cast<const Pack4<TDO>*>(dout + (long long)row * C);
        const Pack4<TX>* xr = reinterpret_cast<const Pack4<TX>*>(x + (long long)row * C);
        Pack4<TDX>* dxr = reinterpret_cast<Pack4<TDX>*>(dx + (long long)row * C);
        Pack4<TDO> dp[NV];                                      // dout, x and dx as stored (packed bf16),
        Pack4<TX> xp[NV];                                       // widened where used (x_hat made twice)
        Pack4<TDX> gp[NV];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int k = j * 32 + lane;
            if (k < C4) {
                dp[j] = dr[k];
                xp[j] = xr[k];
                gp[j] = dxr[k];
            }
        }
        const auto xhat = [&](int j) {
            const float4 xx = val_ld4p(&xp[j]);
            return make_float4((xx.x - mu) * rs, (xx.y - mu) * rs, (xx.z - mu) * rs, (xx.w - mu) * rs);
        };
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int k = j * 32 + lane;
            if (k >= C4) continue;
            const float4 d = val_ld4p(&dp[j]), nvj = xhat(j);
            const float4 wv = wsm[k];
            const float4 dn = make_float4(d.x * wv.x, d.y * wv.y, d.z * wv.z, d.w * wv.w);
            s1 += ln_hsum(dn);
            s2 += (dn.x * nvj.x + dn.y * nvj.y) + (dn.z * nvj.z + dn.w * nvj.w);
        }
        const float m1 = gc_warp_sum(s1) * invC;
        const float m2 = GC_BREAK_LAYERNORM ? 0.0f : gc_warp_sum(s2) * invC;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            const int k = j * 32 + lane;
            if (k < C4) {
                const float4 wv = wsm[k], d = val_ld4p(&dp[j]), nvj = xhat(j);
                float4 g = val_ld4p(&gp[j]);
                g.x += rs * (d.x * wv.x - m1 - nvj.x * m2);
                g.y += rs * (d.y * wv.y - m1 - nvj.y * m2);
                g.z += rs * (d.z * wv.z - m1 - nvj.z * m2);
                g.w += rs * (d.w * wv.w - m1 - nvj.w * m2);
                val_put4(dxr + k, g);              // g as stored (rounded in bf16)
                float4 br = g;                     // the branch's gradient as stored
                if constexpr (DROP) {
                    br = gc_dropout4(g, key, (long long)row * C + 4 * k, threshold, scale);
                    val_put4(reinterpret_cast<Pack4<TDR>*>(dropped + (long long)row * C) + k, br);
                }
                if constexpr (BIAS) {
                    float4 r = aw[2 * S + 32 * j];
                    r.x += br.x; r.y += br.y; r.z += br.z; r.w += br.w;
                    aw[2 * S + 32 * j] = r;
                }
                float4 q = RS ? sw[j] : aw[32 * j];
                q.x += d.x * nvj.x; q.y += d.y * nvj.y;
                q.z += d.z * nvj.z; q.w += d.w * nvj.w;
                if constexpr (RS) sw[j] = q;
                else aw[32 * j] = q;
                if constexpr (BIAS) {
                    float4 r = RS ? sb[j] : ab[32 * j];
                    r.x += d.x; r.y += d.y; r.z += d.z; r.w += d.w;
                    if constexpr (RS) sb[j] = r;
                    else ab[32 * j] = r;
                }
            }
        }
    }
    if constexpr (RS) {
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            aw[32 * j] = sw[j];
            if constexpr (BIAS) ab[32 * j] = sb[j];
        }
    }
    __syncthreads();
    // the warps' sums of column group k of a sum array, added in warp order 0, 1, ..., 7
    const auto warp_sum = [&](const float4* acc, int k) {
        float4 q = acc[k];
#pragma unroll
        for (int i = 1; i < WARPS; ++i) {
            const float4 r = acc[i * NV * 32 + k];
            q.x += r.x; q.y += r.y; q.z += r.z; q.w += r.w;
        }
        return q;
    };
    float4* pw = reinterpret_cast<float4*>(partials + (long long)blockIdx.x * 3 * C);
    float4* pb = reinterpret_cast<float4*>(partials + (long long)blockIdx.x * 3 * C + C);
    float4* pd = reinterpret_cast<float4*>(partials + (long long)blockIdx.x * 3 * C + 2 * C);
    for (int k = threadIdx.x; k < C4; k += WARPS * 32) {
        pw[k] = warp_sum(acc_w, k);
        if constexpr (BIAS) {
            pb[k] = warp_sum(acc_b, k);
            pd[k] = warp_sum(acc_d, k);
        }
    }
}

// Block sum of one float, the same value returned to every thread; fixed order.
template <int WARPS>
__device__ __forceinline__ float ln_block_sum(float v, float* sm /* [WARPS] */) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = gc_warp_sum(v);
    if (lane == 0) sm[warp] = v;
    __syncthreads();
    float s = sm[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) s += sm[i];
    __syncthreads();                               // sm may be rewritten right after
    return s;
}

// grid G blocks; block g takes rows g, g + G, ...; thread tid owns columns tid, tid + 32*WARPS, ...
// and accumulates their dw (db, ds) directly in its partials row (no other thread touches them).
template <bool BIAS, bool DROP, int WARPS, int TDO, int TX, int TDX, int TDR>
__global__ void __launch_bounds__(WARPS * 32) layernorm_bwd_loop(LN_ARGS_BWD) {
    __shared__ float sm[2][WARPS];
    float* pw = partials + (long long)blockIdx.x * 3 * C;
    float* pb = pw + C;
    float* pd = pw + 2 * C;
    for (int c = threadIdx.x; c < C; c += WARPS * 32) {
        pw[c] = 0.f;
        if constexpr (BIAS) pb[c] = pd[c] = 0.f;
    }
    const float invC = 1.0f / (float)C;
    u32 key = 0;
    if constexpr (DROP) key = gc_key(seed, (u32)st->step, site);
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        const float mu = mean[row], rs = rstd[row];
        const elem<TDO>* dr = dout + (long long)row * C;
        const elem<TX>* xr = x + (long long)row * C;
        float s1 = 0.f, s2 = 0.f;
        for (int c = threadIdx.x; c < C; c += WARPS * 32) {
            const float dn = val_ld(dr + c) * w[c];
            s1 += dn;
            s2 += dn * ((val_ld(xr + c) - mu) * rs);
        }
        const float m1 = ln_block_sum<WARPS>(s1, sm[0]) * invC;
        const float m2 = GC_BREAK_LAYERNORM ? 0.0f : ln_block_sum<WARPS>(s2, sm[1]) * invC;
        elem<TDX>* dxr = dx + (long long)row * C;
        for (int c = threadIdx.x; c < C; c += WARPS * 32) {
            const float d = val_ld(dr + c);
            const float n = (val_ld(xr + c) - mu) * rs;
            float g = val_ld(dxr + c) + rs * (d * w[c] - m1 - n * m2);
            val_put(dxr + c, g);                   // g as stored (rounded in bf16)
            float br = g;                          // the branch's gradient as stored
            if constexpr (DROP) {
                const long long e = (long long)row * C + c;
                br = gc_dropout1(g, key, e, threshold, scale);
                val_put(dropped + e, br);
            }
            pw[c] += d * n;
            if constexpr (BIAS) {
                pb[c] += d;
                pd[c] += br;
            }
        }
    }
}
