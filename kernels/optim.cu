// Optimizer and step-state kernels.
//
//   lr_schedule          st->lr = nanoGPT warmup + cosine schedule at st->step (float64 math)
//   step_advance         st->step += 1
//   eval_advance         st->eval_draws += 1
//   grad_norm_partial<VEC[, TG]>  per-block sums of squares (double) -> partials[G] (TG 1: bf16 gradients)
//   grad_norm_final      st->grad_norm = sqrt(sum of partials in a fixed order)
//   adamw<VEC[, TG]>     one pass of PyTorch AdamW over the flat buffers, gradient clipping by
//                        st->grad_norm, decoupled weight decay on the first n_decay elements (TG 1:
//                        bf16 gradients, the rest fp32)
//   adamw_copy<VEC>      adamw, and the updated parameters rounded to bf16 into their working copy
//                        (a bf16 model's products read it; the fp32 update is adamw's, bit for bit);
//                        st->work_fresh = 1
//   to_bf16<VEC>         out = in rounded to bf16 (the working copy of fp32 parameters at init / load),
//                        nothing where st (non-null) says the copy is fresh
//
// VEC = 4 needs 16-byte aligned buffers, 8-byte aligned bf16 ones (any n: the last n % 4 elements go
// one per thread).
#include "common.cuh"
#include "bf16.cuh"

// The blocks (THREADS) are template arguments chosen in gptcuda/ops/cuda/optim.py.

__global__ void __launch_bounds__(1)
lr_schedule(StepState* st, double learning_rate, double min_lr, int warmup_iters, int lr_decay_iters) {
    const int it = st->step;
    double lr;
    if (it < warmup_iters) {
        lr = learning_rate * (double)(it + 1) / (double)(warmup_iters + 1);
    } else if (it > lr_decay_iters || lr_decay_iters - warmup_iters <= 0) {
        lr = min_lr;
    } else {
        const double ratio = (double)(it - warmup_iters) / (double)(lr_decay_iters - warmup_iters);
        const double coeff = 0.5 * (1.0 + cos(3.141592653589793 * ratio));
        lr = min_lr + coeff * (learning_rate - min_lr);
    }
    st->lr = (float)lr;
}

__global__ void __launch_bounds__(1) step_advance(StepState* st) { st->step += 1; }

__global__ void __launch_bounds__(1) eval_advance(StepState* st) { st->eval_draws += 1; }

// grid G, block 512. Thread (b, t) takes the vectors b*512 + t + k*G*512 in order; the block
// sum is a fixed butterfly + warp-order sum; partial b goes to partials[b]. TG: the gradients' element
// type (0 fp32, 1 bf16: the values they hold, squared in fp32 as fp32's).
template <int VEC, int NORM_THREADS, int TG = 0>
__global__ void __launch_bounds__(NORM_THREADS)
grad_norm_partial(double* __restrict__ partials,     // partials [G]
                  const elem<TG>* __restrict__ g,    // g        [n]
                  int n) {
    __shared__ double red[NORM_THREADS / 32];
    const long long gt = (long long)blockIdx.x * NORM_THREADS + threadIdx.x;
    const long long stride = (long long)gridDim.x * NORM_THREADS;
    float acc = 0.f;
    if constexpr (VEC == 4) {
        const long long nv = n / 4;
#pragma unroll 4
        for (long long i = gt; i < nv; i += stride) {
            const float4 v = val_ldf4(g + 4 * i);
            acc = fmaf(v.x, v.x, acc);
            acc = fmaf(v.y, v.y, acc);
            acc = fmaf(v.z, v.z, acc);
            acc = fmaf(v.w, v.w, acc);
        }
        if (gt < n - nv * 4) {
            const float v = val_ld(g + nv * 4 + gt);
            acc = fmaf(v, v, acc);
        }
    } else {
#pragma unroll 4
        for (long long i = gt; i < n; i += stride) {
            const float v = val_ld(g + i);
            acc = fmaf(v, v, acc);
        }
    }
    double s = (double)acc;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = red[0];
#pragma unroll
        for (int w = 1; w < NORM_THREADS / 32; ++w) t += red[w];
        partials[blockIdx.x] = t;
    }
}

template <int FINAL_THREADS>
__global__ void __launch_bounds__(FINAL_THREADS)
grad_norm_final(StepState* st, const double* __restrict__ partials /* [G] */, int G) {
    static_assert((FINAL_THREADS & (FINAL_THREADS - 1)) == 0, "the tree halves the block");
    __shared__ double red[FINAL_THREADS];
    double s = 0.0;
    for (int i = threadIdx.x; i < G; i += FINAL_THREADS) s += partials[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int o = FINAL_THREADS / 2; o > 0; o >>= 1) {
        if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) st->grad_norm = (float)sqrt(red[0]);
}

struct AdamCoef {
    float lr, beta1, beta2, omb1, omb2, rbc1, rbc2, eps, decay_mul, gscale;
};

__device__ __forceinline__ void adam_one(float& p, float g, float& m, float& v, bool decay, const AdamCoef& c) {
    g *= c.gscale;
    if (decay) p *= c.decay_mul;
    m = c.beta1 * m + c.omb1 * g;
    v = c.beta2 * v + c.omb2 * (g * g);
    const float mhat = m * c.rbc1;
    const float vhat = v * c.rbc2;
    p -= c.lr * mhat / (sqrtf(vhat) + c.eps);
}

// adamw's and adamw_copy's body. Grid-stride over vectors: thread gt takes vectors gt, gt + stride, ...;
// element e decays iff e < n_decay. COPY: work[e] = the updated params[e] rounded to bf16. TG: the gradients'
// element type (bf16: widened exactly, the update then as fp32's).
template <int VEC, int ADAM_THREADS, bool COPY, int TG>
__device__ __forceinline__ void
adamw_run(float* __restrict__ params, const elem<TG>* __restrict__ grads, float* __restrict__ m, float* __restrict__ v,
          bf16* __restrict__ work, int n, int n_decay, float beta1, float beta2, float eps, float weight_decay,
          float grad_clip, const StepState* st) {
    AdamCoef c;
    c.lr = st->lr;
    const int t = st->step + 1;
    c.beta1 = beta1;
    c.beta2 = beta2;
    c.omb1 = 1.0f - beta1;
    c.omb2 = 1.0f - beta2;
    c.rbc1 = (float)(1.0 / (1.0 - pow((double)beta1, (double)t)));
    c.rbc2 = (float)(1.0 / (1.0 - pow((double)beta2, (double)t)));
    c.eps = eps;
    c.decay_mul = 1.0f - c.lr * weight_decay;
    c.gscale = grad_clip > 0.f ? fminf(1.0f, grad_clip / (st->grad_norm + 1e-6f)) : 1.0f;

    const long long gt = (long long)blockIdx.x * ADAM_THREADS + threadIdx.x;
    const long long stride = (long long)gridDim.x * ADAM_THREADS;
    if constexpr (VEC == 4) {
        const long long nv = n / 4;
        float4* p4 = reinterpret_cast<float4*>(params);
        float4* m4 = reinterpret_cast<float4*>(m);
        float4* v4 = reinterpret_cast<float4*>(v);
        for (long long i = gt; i < nv; i += stride) {
            float4 p = p4[i], mm = m4[i], vv = v4[i];
            const float4 g = val_ldf4(grads + 4 * i);
            const long long e = i * 4;
            adam_one(p.x, g.x, mm.x, vv.x, e + 0 < n_decay, c);
            adam_one(p.y, g.y, mm.y, vv.y, e + 1 < n_decay, c);
            adam_one(p.z, g.z, mm.z, vv.z, e + 2 < n_decay, c);
            adam_one(p.w, g.w, mm.w, vv.w, e + 3 < n_decay, c);
            p4[i] = p; m4[i] = mm; v4[i] = vv;
            if constexpr (COPY) val_st4(work + e, {p.x, p.y, p.z, p.w});
        }
        if (gt < n - nv * 4) {
            const long long e = nv * 4 + gt;
            adam_one(params[e], val_ld(grads + e), m[e], v[e], e < n_decay, c);
            if constexpr (COPY) val_st(work + e, params[e]);
        }
    } else {
        for (long long e = gt; e < n; e += stride) {
            adam_one(params[e], val_ld(grads + e), m[e], v[e], e < n_decay, c);
            if constexpr (COPY) val_st(work + e, params[e]);
        }
    }
}

#define ADAMW_ARGS                                                                              \
    float* __restrict__ params,        /* params [n] */                                         \
    const elem<TG>* __restrict__ grads, /* grads [n] */                                         \
    float* __restrict__ m,             /* m      [n] */                                         \
    float* __restrict__ v              /* v      [n] */
#define ADAMW_ARGS_TAIL                                                                         \
    int n, int n_decay, float beta1, float beta2, float eps, float weight_decay, float grad_clip, \
    const StepState* st

template <int VEC, int ADAM_THREADS, int TG = 0>
__global__ void __launch_bounds__(ADAM_THREADS) adamw(ADAMW_ARGS, ADAMW_ARGS_TAIL) {
    adamw_run<VEC, ADAM_THREADS, false, TG>(params, grads, m, v, nullptr, n, n_decay, beta1, beta2, eps,
                                            weight_decay, grad_clip, st);
}

template <int VEC, int ADAM_THREADS, int TG = 0>
__global__ void __launch_bounds__(ADAM_THREADS)
adamw_copy(ADAMW_ARGS,
           bf16* __restrict__ work,   /* work [n]: the bf16 working copy of params */
           int n, int n_decay, float beta1, float beta2, float eps, float weight_decay, float grad_clip,
           StepState* st) {
    adamw_run<VEC, ADAM_THREADS, true, TG>(params, grads, m, v, work, n, n_decay, beta1, beta2, eps, weight_decay,
                                           grad_clip, st);
    // the kernels after this one (stream order) see the copy and the flag together; every thread has read
    // st above, and no thread reads work_fresh here
    if (blockIdx.x == 0 && threadIdx.x == 0) st->work_fresh = 1;
}

// Grid-stride over vectors of VEC elements (the last n % 4 one per thread when VEC = 4).
template <int VEC, int THREADS>
__global__ void __launch_bounds__(THREADS)
to_bf16(bf16* __restrict__ out,        // out [n]
        const float* __restrict__ in,  // in  [n]
        int n,
        const StepState* st) {         // null, or the step state: nothing to do where st->work_fresh
    if (st != nullptr && st->work_fresh) return;
    const long long gt = (long long)blockIdx.x * THREADS + threadIdx.x;
    const long long stride = (long long)gridDim.x * THREADS;
    if constexpr (VEC == 4) {
        const long long nv = n / 4;
        for (long long i = gt; i < nv; i += stride) {
            float x[4];
            val_ld4(in + 4 * i, x);
            val_st4(out + 4 * i, x);
        }
        if (gt < n - nv * 4) val_st(out + nv * 4 + gt, in[nv * 4 + gt]);
    } else {
        for (long long e = gt; e < n; e += stride) val_st(out + e, in[e]);
    }
}
