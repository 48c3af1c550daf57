// Hopper warpgroup MMA (wgmma, sm_90a): the shared-memory descriptors of the 128-byte swizzled
// layouts (K-major; MN-major for 16-bit operands), the fences and group waits, the m64nNk8 TF32
// instructions with both operands in shared memory (wg_mma_tf32) or A in registers (wg_mma_tf32_rs),
// and the m64nNk16 BF16 ones (WgBf16). Used by gemm_wgmma.cu and flash_wg.cu; only valid where
// __CUDA_ARCH_FEAT_SM90_ALL is defined.
#pragma once

// Shared-memory matrix descriptor of a K-major tile in the 128-byte swizzle (PTX ISA, "Matrix
// Descriptor Format"): start address / 16 in bits 0-13, leading byte offset / 16 in bits 16-29
// (not used by swizzled K-major layouts: 1), stride byte offset / 16 in bits 32-45 (1024: the
// next 8 rows), base offset 0 (tiles are 1024-byte aligned), swizzle mode 1 (128 B) in bits 62-63.
// The start address is the low field: d + (bytes >> 4) is the descriptor of the address `bytes` on
// (no carry out of the field below 256 KB of shared memory).
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    return static_cast<unsigned long long>((addr & 0x3FFFFu) >> 4) | (1ull << 16) |
           (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

// The descriptor of an MN-major tile of 16-bit elements in the 128-byte swizzle, as the copy engine
// writes boxes of {64 (M or N, contiguous), k rows}: each k row of a box is 128 bytes (64 elements),
// 8 k rows (1024 bytes) are one swizzle atom, and the instruction's 16 k rows span two atoms: stride
// byte offset 1024 (the next 8 k rows), leading byte offset 8192 (the next 64 columns of M or N: the
// next box of 64 k rows, for instructions with n > 64). The k step s of a 64-row box starts 2048 s
// bytes on.
// (lbo: another stride between the boxes of 64 columns, for boxes of other than 64 k rows)
__device__ __forceinline__ unsigned long long wg_desc_mn(unsigned addr, unsigned lbo = 8192) {
    return static_cast<unsigned long long>((addr & 0x3FFFFu) >> 4) | (static_cast<unsigned long long>(lbo >> 4) << 16) |
           (static_cast<unsigned long long>(1024 >> 4) << 32) | (1ull << 62);
}

// Pins the accumulators across the asynchronous section: without it the compiler may copy them
// between the wgmma of a group (ptxas then serializes every wgmma: warning C7514).
template <int N>
__device__ __forceinline__ void wg_fence_acc(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// A warp-specialized kernel's register split (setmaxnreg: the producer warpgroup gives registers back,
// the consumers take them; multiples of 8, the block's total within the SM's 64K)
template <int N>
__device__ __forceinline__ void wg_regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void wg_regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N) : "memory"); }
// The registers a consumer thread may take: ptxas gives a kernel that changes its count the launch's cap,
// 65536 / threads to a multiple of 8, and setmaxnreg.inc waits for registers the block released, so the
// consumer warpgroups share what the producer's gave back (launch cap - producer_regs a thread)
__host__ __device__ constexpr int wg_launch_regs(int threads) { return 65536 / threads / 8 * 8; }
__host__ __device__ constexpr int wg_consumer_regs(int threads, int consumer_wgs, int producer_regs) {
    return (wg_launch_regs(threads) + (wg_launch_regs(threads) - producer_regs) / consumer_wgs) / 8 * 8;
}
// this thread's completed cp.async writes, made visible to the async proxy wgmma reads through
__device__ __forceinline__ void wg_fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d[BN/2] += A (64 x 8, descriptor da) * B^T (8 x BN, descriptor db): one wgmma of the warpgroup.
// Accumulator ownership (thread t of the warpgroup, warp w = t / 32, lane = 4 g + q): d[4 j + e]
// is row 16 w + g + 8 (e / 2), column 8 j + 2 q + e % 2 (the mma.sync C layout per n8 block).
// An asm operand list cannot be an array: the BN / 2 accumulators are named one by one, through
// the macros below (register numbers in groups of 32, operands in groups of 8).
// scale_d = 0: d = A B^T (the accumulators' old values are ignored).
template <int BN>
__device__ __forceinline__ void wg_mma_tf32(float (&d)[BN / 2], unsigned long long da, unsigned long long db,
                                            int scale_d = 1);

#define WG_REGS_16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_REGS_0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_REGS_1 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_REGS_2 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_REGS_3 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), \
                   "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define WG_ACC32(i) WG_ACC8(i), WG_ACC8(i + 8), WG_ACC8(i + 16), WG_ACC8(i + 24)
// N: the instruction's n; REGS: the accumulator placeholders %0 .. %(N/2 - 1); IA, IB, IP: the
// placeholder numbers of the two descriptors and of the scale-d flag (N/2, N/2 + 1, N/2 + 2).
#define WG_MMA_TF32(N, REGS, IA, IB, IP, ...)                                                          \
    template <>                                                                                        \
    __device__ __forceinline__ void wg_mma_tf32<N>(float (&d)[N / 2], unsigned long long da,           \
                                                   unsigned long long db, int scale_d) {               \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 "                         \
                     "{" REGS "}, %" #IA ", %" #IB ", p, 1, 1;\n}\n"                                  \
                     : __VA_ARGS__                                                                     \
                     : "l"(da), "l"(db), "r"(scale_d));                                                \
    }
WG_MMA_TF32(32, WG_REGS_16, 16, 17, 18, WG_ACC8(0), WG_ACC8(8))
WG_MMA_TF32(64, WG_REGS_0, 32, 33, 34, WG_ACC32(0))
WG_MMA_TF32(128, WG_REGS_0 ", " WG_REGS_1, 64, 65, 66, WG_ACC32(0), WG_ACC32(32))
WG_MMA_TF32(192, WG_REGS_0 ", " WG_REGS_1 ", " WG_REGS_2, 96, 97, 98, WG_ACC32(0), WG_ACC32(32), WG_ACC32(64))
WG_MMA_TF32(256, WG_REGS_0 ", " WG_REGS_1 ", " WG_REGS_2 ", " WG_REGS_3, 128, 129, 130, WG_ACC32(0),
            WG_ACC32(32), WG_ACC32(64), WG_ACC32(96))

// d[N/2] += A (64 x 8, from registers) * B^T (8 x N, descriptor db): the register-A form. The
// fragment of warp w, lane 4 g + q: a[0] = A[16 w + g][q], a[1] = A[16 w + g + 8][q], a[2] =
// A[16 w + g][q + 4], a[3] = A[16 w + g + 8][q + 4] (tf32 bit patterns; the mma.sync A layout).
// scale_d = 0: d = A B^T.
template <int N>
__device__ __forceinline__ void wg_mma_tf32_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long db,
                                               int scale_d = 1);

// IA..IA3: the placeholders of a[0..3] (from N/2), IB: the descriptor's, IP: the scale-d flag's
#define WG_MMA_TF32_RS(N, REGS, IA, IA1, IA2, IA3, IB, IP, ...)                                             \
    template <>                                                                                        \
    __device__ __forceinline__ void wg_mma_tf32_rs<N>(float (&d)[N / 2], const unsigned (&a)[4],       \
                                                      unsigned long long db, int scale_d) {            \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k8.f32.tf32.tf32 "                         \
                     "{" REGS "}, {%" #IA ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #IB ", p, 1, 1;\n}\n" \
                     : __VA_ARGS__                                                                     \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));             \
    }
WG_MMA_TF32_RS(32, WG_REGS_16, 16, 17, 18, 19, 20, 21, WG_ACC8(0), WG_ACC8(8))
WG_MMA_TF32_RS(64, WG_REGS_0, 32, 33, 34, 35, 36, 37, WG_ACC32(0))
WG_MMA_TF32_RS(128, WG_REGS_0 ", " WG_REGS_1, 64, 65, 66, 67, 68, 69, WG_ACC32(0), WG_ACC32(32))
WG_MMA_TF32_RS(192, WG_REGS_0 ", " WG_REGS_1 ", " WG_REGS_2, 96, 97, 98, 99, 100, 101, WG_ACC32(0), WG_ACC32(32),
               WG_ACC32(64))
// d[N/2] += A (64 x 16 bf16, descriptor da) * B^T (16 x N bf16, descriptor db), fp32 accumulation:
// WgBf16<N>::mma<TA, TB>. TA / TB = 1: the operand is MN-major in shared memory (wg_desc_mn: A [K, M],
// B [K, N] as a weight gradient's operands are stored), 0: K-major (wg_desc). The accumulators' layout
// is wg_mma_tf32's.
template <int N>
struct WgBf16;
// ITA, ITB: the placeholders of the transpose immediates (after the scale-d flag's IP)
#define WG_MMA_BF16(N, REGS, IA, IB, IP, ITA, ITB, ...)                                               \
    template <>                                                                                        \
    struct WgBf16<N> {                                                                                 \
        template <int TA, int TB>                                                                      \
        static __device__ __forceinline__ void mma(float (&d)[N / 2], unsigned long long da,           \
                                                   unsigned long long db, int scale_d = 1) {          \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "                    \
                         "{" REGS "}, %" #IA ", %" #IB ", p, 1, 1, %" #ITA ", %" #ITB ";\n}\n"          \
                         : __VA_ARGS__                                                                 \
                         : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));                          \
        }                                                                                              \
    };
WG_MMA_BF16(64, WG_REGS_0, 32, 33, 34, 35, 36, WG_ACC32(0))
WG_MMA_BF16(128, WG_REGS_0 ", " WG_REGS_1, 64, 65, 66, 67, 68, WG_ACC32(0), WG_ACC32(32))
WG_MMA_BF16(192, WG_REGS_0 ", " WG_REGS_1 ", " WG_REGS_2, 96, 97, 98, 99, 100, WG_ACC32(0), WG_ACC32(32),
            WG_ACC32(64))
WG_MMA_BF16(256, WG_REGS_0 ", " WG_REGS_1 ", " WG_REGS_2 ", " WG_REGS_3, 128, 129, 130, 131, 132, WG_ACC32(0),
            WG_ACC32(32), WG_ACC32(64), WG_ACC32(96))
// d[N/2] += A (64 x 16 bf16, from registers) * B^T (16 x N bf16, descriptor db): WgBf16Rs<N>::mma<TB>,
// TB as WgBf16's. The fragment of warp w, lane 4 g + q (pairs of bf16, the lower column in the low
// half): a[0] = A[16 w + g][2q, 2q + 1], a[1] = A[16 w + g + 8][2q, 2q + 1], a[2] = A[16 w + g][2q + 8,
// 2q + 9], a[3] = A[16 w + g + 8][2q + 8, 2q + 9]: the accumulators d[8 s .. 8 s + 7] of a product whose
// columns 16 s .. 16 s + 15 are this one's k, rounded in pairs, are its k step s.
template <int N>
struct WgBf16Rs;
// IA: the placeholder of a[0] (a[1..3] follow), then the descriptor's, the scale-d flag's, TB's
#define WG_MMA_BF16_RS(N, REGS, IA, IA1, IA2, IA3, IB, IP, ITB, ...)                                   \
    template <>                                                                                        \
    struct WgBf16Rs<N> {                                                                               \
        template <int TB>                                                                              \
        static __device__ __forceinline__ void mma(float (&d)[N / 2], const unsigned (&a)[4],          \
                                                   unsigned long long db, int scale_d = 1) {          \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                             \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "                    \
                         "{" REGS "}, {%" #IA ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #IB ", p, 1, 1, %" #ITB \
                         ";\n}\n"                                                                     \
                         : __VA_ARGS__                                                                 \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB)); \
        }                                                                                              \
    };
WG_MMA_BF16_RS(64, WG_REGS_0, 32, 33, 34, 35, 36, 37, 38, WG_ACC32(0))
WG_MMA_BF16_RS(128, WG_REGS_0 ", " WG_REGS_1, 64, 65, 66, 67, 68, 69, 70, WG_ACC32(0), WG_ACC32(32))
#undef WG_MMA_BF16_RS
#undef WG_MMA_BF16
#undef WG_MMA_TF32_RS
#undef WG_MMA_TF32
#undef WG_ACC32
#undef WG_ACC8
#undef WG_REGS_16
#undef WG_REGS_0
#undef WG_REGS_1
#undef WG_REGS_2
#undef WG_REGS_3

// TMA and mbarriers (sm_90): a CUtensorMap as a kernel argument, the transaction barriers the copy
// engine completes, and one box's copy.
struct __align__(64) TmaMap {
    unsigned long long v[16];     // CUtensorMap: 128 opaque bytes
};

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// expect `bytes` more on bar (lane 0 of the calling warp only, converged as tma_copy)
__device__ __forceinline__ void mbar_expect(int lane, unsigned bar, unsigned bytes) {
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, %0, 0;\n"
                 "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%1], %2;\n}\n" ::"r"(lane), "r"(bar), "r"(bytes)
                 : "memory");
}
// The other direction (the bf16 GEMM epilogue): the box at src in shared memory into tensor map `map`'s
// box at {c0, c1, batch}, issued by the calling thread alone, in its current bulk group (boxes wholly
// or partly outside the tensor are clipped by the copy engine). The writers of src have fenced their
// stores into the async proxy (wg_fence_async_smem) and synchronized with the issuing thread first.
__device__ __forceinline__ void tma_store(const TmaMap* map, unsigned src, int c0, int c1, int batch) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n"
                 ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(src), "r"(c0), "r"(c1), "r"(batch)
                 : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// wait until at most N of the thread's bulk groups have not finished reading their shared memory (READ)
// or writing global memory (!READ)
template <int N, bool READ = true>
__device__ __forceinline__ void tma_store_wait() {
    if constexpr (READ)
        asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
    else
        asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Four 8 x 8 matrices of 16-bit pairs from the mma fragment layout (lane 4 g + q: row g, columns 2 q,
// 2 q + 1 of matrix i in r[i]) into shared memory, lane l giving the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3) : "memory");
}
// One box of tensor map `map` at coordinates {c0, c1, batch} into shared memory at dst, completing on
// bar (lane 0 only, converged as above).
__device__ __forceinline__ void tma_copy(int lane, unsigned bar, unsigned dst, const TmaMap* map, int c0, int c1,
                                         int batch) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.eq.u32 p, %0, 0;\n"
        "@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3, {%4, %5, %6}], [%1];\n}\n"
        ::"r"(lane), "r"(bar), "r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(batch)
        : "memory");
}
