// bfloat16 storage and conversion, shared by the kernels that read or write bf16 tensors: a bf16
// value is the top 16 bits of the fp32 value (8 exponent bits, 7 mantissa bits), kept as its bit
// pattern (no header: NVRTC compiles these without cuda_bf16.h). Widening is exact; narrowing rounds
// to nearest, ties to even (cvt.rn), as numpy's reference (gptcuda/runtime/bf16.py) does.
#pragma once

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_f32(bf16 b) { return __uint_as_float(static_cast<unsigned>(b) << 16); }

// lo into the low half (the lower address), hi into the high half, each rounded to nearest even
__device__ __forceinline__ unsigned bf16x2_rn(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ bf16 bf16_rn(float x) { return static_cast<bf16>(bf16x2_rn(x, 0.f) & 0xFFFFu); }
