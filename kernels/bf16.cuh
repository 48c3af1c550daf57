// bfloat16 storage and conversion, shared by the kernels that read or write bf16 tensors: a bf16
// value is the top 16 bits of the fp32 value (8 exponent bits, 7 mantissa bits), kept as its bit
// pattern (no header: NVRTC compiles these without cuda_bf16.h). Widening is exact; narrowing rounds
// to nearest, ties to even (cvt.rn), as numpy's reference (gptcuda/runtime/bf16.py) does. val_ld /
// val_st (and the 4-value forms) let a kernel templated on its tensors' element type T (float or
// bf16) compute in fp32 and store in T: for float they are plain loads and stores.
#pragma once

typedef unsigned short bf16;

// The element type of a launcher's type code (a template argument: 0 fp32, 1 bf16; gptcuda/ops/cuda
// DTYPE_CODES), for the kernels whose tensors may be of either type: elem<TO>* out.
template <int CODE> struct ElemOf { using T = float; };
template <> struct ElemOf<1> { using T = bf16; };
template <int CODE> using elem = typename ElemOf<CODE>::T;

__device__ __forceinline__ float bf16_f32(bf16 b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }

// lo into the low half (the lower address), hi into the high half, each rounded to nearest even
__device__ __forceinline__ unsigned bf16x2_rn(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ bf16 bf16_rn(float x) { return static_cast<bf16>(bf16x2_rn(x, 0.f) & 0xFFFFu); }

// One value, and four consecutive ones (aligned: 16 bytes of fp32, 8 of bf16), of a tensor of fp32
// or bf16, widened exactly to fp32; stored from fp32, rounded to nearest even.
__device__ __forceinline__ float val_ld(const float* p) { return *p; }
__device__ __forceinline__ float val_ld(const bf16* p) { return bf16_f32(*p); }
__device__ __forceinline__ void val_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void val_st(bf16* p, float v) { *p = bf16_rn(v); }
__device__ __forceinline__ void val_ld4(const float* p, float (&x)[4]) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
}
__device__ __forceinline__ void val_ld4(const bf16* p, float (&x)[4]) {
    const uint2 t = *reinterpret_cast<const uint2*>(p);
    x[0] = __uint_as_float(t.x << 16); x[1] = __uint_as_float(t.x & 0xFFFF0000u);
    x[2] = __uint_as_float(t.y << 16); x[3] = __uint_as_float(t.y & 0xFFFF0000u);
}
__device__ __forceinline__ void val_st4(float* p, const float (&x)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void val_st4(bf16* p, const float (&x)[4]) {
    *reinterpret_cast<uint2*>(p) = make_uint2(bf16x2_rn(x[0], x[1]), bf16x2_rn(x[2], x[3]));
}

// Eight bf16 as loaded (16 bytes, element 0 in the low half of t.x) widened to fp32 (exactly).
__device__ __forceinline__ void bf16x8_f32(const uint4 t, float (&x)[8]) {
    const unsigned w[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
}
// Eight consecutive bf16 (16-byte aligned) as one access: the bf16 GEMM epilogue's rows.
__device__ __forceinline__ void val_ld8(const bf16* p, float (&x)[8]) {
    bf16x8_f32(*reinterpret_cast<const uint4*>(p), x);
}
__device__ __forceinline__ void val_st8(bf16* p, const float (&x)[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(bf16x2_rn(x[0], x[1]), bf16x2_rn(x[2], x[3]), bf16x2_rn(x[4], x[5]),
                                              bf16x2_rn(x[6], x[7]));
}

// Four consecutive values of a tensor of type code CODE as one access (val_ld4's alignment), the
// registers of the vector kernels: Pack4<CODE> is float4 (fp32) or uint2 (bf16: two bf16x2 words), so
// that a kernel indexes rows of Pack4<CODE> as it indexed rows of float4 (an element address, row + 4 v,
// had given fp32 another address computation). val_ld4p widens one to a float4 (exactly); val_put4
// stores a float4 into one (bf16: rounded to nearest even). val_ldf4 / val_stf4: the same at an
// element's address (4-aligned).
template <int CODE> struct Pack4Of { using T = float4; };
template <> struct Pack4Of<1> { using T = uint2; };
template <int CODE> using Pack4 = typename Pack4Of<CODE>::T;
__device__ __forceinline__ float4 bf16x4_f32(uint2 t) {
    return make_float4(__uint_as_float(t.x << 16), __uint_as_float(t.x & 0xFFFF0000u),
                       __uint_as_float(t.y << 16), __uint_as_float(t.y & 0xFFFF0000u));
}
__device__ __forceinline__ float4 val_ld4p(const float4* p) { return *p; }
__device__ __forceinline__ float4 val_ld4p(const uint2* p) { return bf16x4_f32(*p); }
// val_put / val_put4 leave in v what the tensor now holds, for a kernel that goes on computing with a
// value it stored: v itself in fp32 (taken by value: the fp32 kernels' code is that of a plain store),
// v rounded in bf16.
__device__ __forceinline__ void val_put(float* p, float v) { *p = v; }
__device__ __forceinline__ void val_put(bf16* p, float& v) {
    const bf16 b = bf16_rn(v);
    *p = b;
    v = bf16_f32(b);
}
__device__ __forceinline__ void val_put4(float4* p, float4 v) { *p = v; }
__device__ __forceinline__ void val_put4(uint2* p, float4& v) {
    const uint2 t = make_uint2(bf16x2_rn(v.x, v.y), bf16x2_rn(v.z, v.w));
    *p = t;
    v = bf16x4_f32(t);
}
__device__ __forceinline__ float4 val_ldf4(const float* p) { return val_ld4p(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 val_ldf4(const bf16* p) { return val_ld4p(reinterpret_cast<const uint2*>(p)); }
__device__ __forceinline__ void val_stf4(float* p, float4 v) { val_put4(reinterpret_cast<float4*>(p), v); }
__device__ __forceinline__ void val_stf4(bf16* p, float4 v) { val_put4(reinterpret_cast<uint2*>(p), v); }
