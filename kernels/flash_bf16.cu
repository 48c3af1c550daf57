// The bf16 flash kernels (precision bf16's fused attention, head sizes 64 and 128): flash_fwd_bf16,
// flash_bwd_dq_bf16, flash_bwd_dkv_bf16, on warpgroup MMA (sm_90a) with TMA and a producer warpgroup
// (the structure of FlashAttention-3). Arguments and results are flash_common.cuh's, except that qkv, y,
// dy and dqkv are bf16, the kernels read qkv and dy through TMA tensor maps and take B * H last (their
// grids are one-dimensional: work items, fb_walk), and that flash_bwd_dq_bf16 makes D = rowsum(dO * O)
// itself (from dy and y) for flash_bwd_dkv_bf16 after it; lse and D stay fp32, every sum is fp32 (the
// tensor cores' accumulators), scores are exponentiated in fp32.
//
// A block is CW = BM / 64 consumer warpgroups and one producer warpgroup (THREADS = 128 (CW + 1)); the
// producer gives registers back to the consumers (setmaxnreg: FaBf16's split), which hold a 64 x BN
// score tile, its second product's tile and their outputs. A work item is BM rows of a head (queries in
// fwd and dq, keys in dkv): its resident tiles (fwd: Q; dq: Q, dO; dkv: K, V) are loaded once; the other
// side streams through a ring of NS stages of BN rows (fwd and dq: K and V; dkv: Q and dO). A block takes
// one item, or walks several where its loop is pipelined (fb_walk). Lane 0 of the producer's first warp
// issues the copies: a stage's two tiles complete on full[s] (the copy engine's byte count), the
// consumers release it on empty[s] (one arrival a thread) once their products that read it are done.
//
// Tiles in shared memory: R rows x HS bf16 as HS / 64 boxes of [R rows][128 bytes] in the 128-byte
// swizzle, as the copy engine writes boxes of {64 columns, R rows}. The same bytes are a K-major
// operand (k = the head's columns: k step s at box s / 4, 32 (s % 4) bytes into each row; wg_desc) and
// an MN-major one (k = the rows: k step s 2048 s bytes on, N = the columns, its boxes of 64 R * 128
// bytes apart; wg_desc_mn), so no tile is transposed:
//   fwd   S = Q K^T (K-major Q, K); O += P V (P from registers, V MN-major)
//   dq    S = Q K^T, dP = dO V^T (K-major); dQ += dS K (dS from registers, K MN-major)
//   dkv   S^T = K Q^T, dP^T = V dO^T (K-major); dV += Pd^T dO, dK += dS^T Q (registers; dO, Q MN-major)
// The accumulators of warp w of a consumer warpgroup hold rows 16 w + g and 16 w + g + 8 (g = lane / 4)
// and columns 8 j + 2 q, 8 j + 2 q + 1 (q = lane % 4): the mma.sync layout of flash_tc.cuh, so the
// dropout words and row reductions are the tf32 kernels'; a product's columns 16 s .. 16 s + 15 rounded
// in pairs are the register-A fragment of k step s of the next product (WgBf16Rs).
//
// Scores are S * scale * log2 e in fp32 (the operands are not rescaled: bf16 Q stays exact); the
// backward rebuilds P = exp2(S * scale * log2 e - lse * log2 e) from the forward's lse. The causal mask
// and the keys and queries past T (the copy engine reads zeros there; a 3-d map [B][T][cols] keeps a
// tile inside its sequence) are masked where a warp's tile can reach them.
//
// With NS >= 3 every kernel runs its loop pipelined (FlashAttention-3's overlap within a warpgroup): tile
// it + 1's first products (fwd: S; dq: S, dP; dkv: S^T, dP^T) are issued before tile it's second ones, and
// tile it + 1's softmax (or its gradient) runs on the CUDA cores while those compute; two stages are read
// at once and a third loads. The causal mask runs only on the tiles that reach a warp's diagonal.
//
// The launcher (gptcuda/ops/cuda/flash.py flash_bf16_plan) chooses <HS, DROP, THREADS, BM, BN, NS, SMEM>:
// SMEM = the resident tiles + NS stages + 1 KB to align the base to 1024 bytes.
#include "flash_common.cuh"
#include "bf16.cuh"
#include "wgmma.cuh"

// Bytes of a stage's slot for BN fp32 values copied from the 16-byte boundary at or before the first of them
// (a box of BN + 4), 128-byte aligned
__host__ __device__ constexpr int fb_xslot(int bn) { return ((bn + 4) * 4 + 127) / 128 * 128; }

// The plan's layout: the resident tiles of BM rows (NR an item, in two buffers where the block walks work
// items), a ring of NS stages of two BN-row tiles, then each stage's XS bytes more.
template <int HS, int THREADS, int BM, int BN, int NS, int SMEM, int NR, int XS = 0>
struct FaBf16 {
    // a block walks several work items where its loop is pipelined (NS >= 3: head size 64, and for the
    // forward and dQ T >= 1024); the a-tile-at-a-time loop (head size 128) has no registers to spare for
    // the walk (dK/dV's spilled)
    static constexpr bool WALK = NS >= 3;
    static constexpr int HS_ = HS, BM_ = BM, BN_ = BN, NS_ = NS, NR_ = NR, NRES_ = WALK ? 2 * NR : NR;
    static constexpr int CW = BM / 64;                 // consumer warpgroups
    static constexpr int KB = HS / 64;                 // boxes of 64 columns a row
    static constexpr int RT = BM * HS * 2;             // bytes of a resident tile
    static constexpr int ST = BN * HS * 2;             // bytes of a streamed tile
    static constexpr int STAGE = 2 * ST;
    // XS: bytes a stage brings besides its tiles, after the ring (dK/dV: its queries' lse and D, fp32, two
    // slots of fb_xslot(BN) bytes, each a box of BN + 4 values: the copy engine starts a box on 16 bytes)
    static constexpr int XS_ = XS, XV = BN + 4;
    static constexpr int SMEM_NEED = NRES_ * RT + NS * (STAGE + XS) + 1024;
    // where stage s's XS bytes sit: after the ring's NS stages, in stage order
    static __device__ __forceinline__ unsigned xslots(unsigned ring, int s) { return ring + NS * STAGE + s * XS; }
    // the register file split (setmaxnreg). ptxas gives a kernel that changes its count the launch's cap,
    // REGS = 65536 / THREADS to a multiple of 8 (2 warpgroups 168, 3: 128, 4: 96), and the block's
    // registers are THREADS * REGS: what the producer gives back (REGS - PRODUCER_REGS a thread) is all the
    // consumers can take (2 warpgroups 232, 3: 160, 4: 112 a thread; an increase past it never returns)
    static constexpr int REGS = wg_launch_regs(THREADS);
    static constexpr int PRODUCER_REGS = CW == 2 ? 40 : 24;
    static constexpr int CONSUMER_REGS = wg_consumer_regs(THREADS, CW, PRODUCER_REGS);
    static_assert(HS == 64 || HS == 128, "head sizes 64 and 128 (rows of 128-byte boxes)");
    static_assert(BM % 64 == 0 && THREADS == 128 * (CW + 1), "a consumer warpgroup per 64 rows, and the producer");
    static_assert(BN % 16 == 0 && BN <= 128 && BM <= 256, "k16 steps over a streamed tile, boxes of at most 256 rows");
    static_assert(CW * (CONSUMER_REGS - REGS) <= REGS - PRODUCER_REGS && CONSUMER_REGS <= 240,
                  "the consumers take no more registers than the producer gave back");
    static_assert(NS >= 2, "a ring");
};

// descriptor of k step s (16 columns) of a K-major operand at t, in a tile of R rows
template <int R>
__device__ __forceinline__ unsigned long long fb_desc_k(unsigned t, int s) {
    return wg_desc(t + (s >> 2) * (R * 128) + 32 * (s & 3));
}
// descriptor of k step s (16 rows) of an MN-major use of a tile of R rows at t
template <int R>
__device__ __forceinline__ unsigned long long fb_desc_mn(unsigned t, int s) {
    return wg_desc_mn(t + 2048 * s, R * 128);
}
// the register-A fragments of every k step of a product whose k runs over d's N columns (16 a k step)
template <int N>
__device__ __forceinline__ void fb_pack(unsigned (&a)[N / 16][4], const float (&d)[N / 2]) {
#pragma unroll
    for (int s = 0; s < N / 16; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[s][i] = bf16x2_rn(d[8 * s + 2 * i], d[8 * s + 2 * i + 1]);
}
// -inf at the scores of a tile across the causal diagonal: the thread's element (j, e) is column
// 8 j + 2 q + (e & 1) of the tile and row 8 (e >> 1) of the thread's first row; x = column - row offset,
// 8 j + (e & 1) - 8 (e >> 1), is masked where x > d (UPPER: rows are queries, columns keys, d = the first
// row's query less the tile's first key of q) or where x < d (rows are keys, columns queries, d = the first
// row's key less the tile's first query of q). Called only on the tiles that reach a warp's diagonal (a
// warp-uniform branch around it), so the others run no compare at all; exp2 of -inf is 0.
template <int BN, bool UPPER>
__device__ __forceinline__ void fb_mask_causal(float (&sc)[BN / 2], int d) {
    const float ninf = __int_as_float(0xff800000);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int x = 8 * j + (e & 1) - 8 * (e >> 1);
            if (UPPER ? x > d : x < d) sc[4 * j + e] = ninf;
        }
}
// the max of each of the thread's two rows (hh) over the tile, in four independent chains a row
template <int BN>
__device__ __forceinline__ void fb_row_max(float (&mx)[2], const float (&sc)[BN / 2]) {
    static_assert(BN % 32 == 0, "four chains of n8 blocks");
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float c[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) c[i] = fmaxf(sc[4 * i + 2 * hh], sc[4 * i + 2 * hh + 1]);
#pragma unroll
        for (int j = 4; j < BN / 8; ++j)
            c[j & 3] = fmaxf(c[j & 3], fmaxf(sc[4 * j + 2 * hh], sc[4 * j + 2 * hh + 1]));
        mx[hh] = fmaxf(fmaxf(c[0], c[1]), fmaxf(c[2], c[3]));
    }
}
// keeps fragments in their registers until the wgmma that read them are waited for
template <int N>
__device__ __forceinline__ void fb_fence_frags(unsigned (&a)[N][4]) {
#pragma unroll
    for (int s = 0; s < N; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}
// d (HS columns) += A B over KS k steps, A from registers (a[s]), B the MN-major use of a tile of R rows at b
template <int HS, int R, int KS>
__device__ __forceinline__ void fb_mma_rs(float (&d)[HS / 2], unsigned (&a)[KS][4], unsigned b) {
    wg_fence_acc(d);
    wg_fence();
#pragma unroll
    for (int s = 0; s < KS; ++s) WgBf16Rs<HS>::template mma<1>(d, a[s], fb_desc_mn<R>(b, s));
}
// fb_mma_rs issued, committed and waited for: d and the fragments a are the thread's again
template <int HS, int R, int KS>
__device__ __forceinline__ void fb_mma_rs_wait(float (&d)[HS / 2], unsigned (&a)[KS][4], unsigned b) {
    fb_mma_rs<HS, R, KS>(d, a, b);
    wg_commit();
    wg_wait<0>();
    wg_fence_acc(d);
    fb_fence_frags(a);
}
// d = A B^T over the head's columns, both K-major: A the warpgroup's 64 rows at a (tile of RA rows), B
// at b (tile of N rows)
template <int HS, int RA, int N>
__device__ __forceinline__ void fb_mma_ss(float (&d)[N / 2], unsigned a, unsigned b) {
    wg_fence_acc(d);
    wg_fence();
#pragma unroll
    for (int s = 0; s < HS / 16; ++s) WgBf16<N>::template mma<0, 0>(d, fb_desc_k<RA>(a, s), fb_desc_k<N>(b, s), s > 0);
}
// row g + 8 hh of a warp's accumulators over the head's columns (HS / 2 of them), times f, as bf16 pairs
// into the row whose column 2q is at r
template <int HS>
__device__ __forceinline__ void fb_store_row(bf16* r, const float (&a)[HS / 2], int hh, float f) {
    unsigned* u = reinterpret_cast<unsigned*>(r);
#pragma unroll
    for (int j = 0; j < HS / 8; ++j) u[4 * j] = bf16x2_rn(a[4 * j + 2 * hh] * f, a[4 * j + 2 * hh + 1] * f);
}

// barriers: full[0..NS), empty[0..NS) (a consumer thread's arrival each), then the resident tiles' two
// buffers' full[0..2) and empty[0..2) (a consumer thread's arrival each)
template <int NS, int CW>
__device__ __forceinline__ void fb_init_bars(unsigned bars) {
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; ++s) {
            mbar_init(bars + 8 * s, 1);
            mbar_init(bars + 8 * (NS + s), CW * 128);
        }
        for (int r = 0; r < 2; ++r) {
            mbar_init(bars + 16 * NS + 8 * r, 1);
            mbar_init(bars + 16 * NS + 16 + 8 * r, CW * 128);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();      // the last block-wide barrier: the producer warpgroup leaves early
}
// the copies of one tile of R rows (KB boxes): columns c0.. of map, rows r0.. of sequence b
template <int R, int KB>
__device__ __forceinline__ void fb_copy_tile(int lane, unsigned bar, unsigned dst, const TmaMap* map, int c0, int r0,
                                             int b) {
#pragma unroll
    for (int j = 0; j < KB; ++j) tma_copy(lane, bar, dst + j * (R * 128), map, c0 + 64 * j, r0, b);
}
// The producer (its first warp; lane 0 issues, converged) of work item j: F::NR_ resident tiles (map ra at
// columns ca, then rb at cb, rows r0) into the item's buffer (j % 2) once the consumers released it (item
// j - 2's), completing on its full barrier, then n stages of the ring, stage it the rows (first + it) BN of
// map sa at columns cs and of map sb at columns ct; g0: the ring's stage count before the first of them
// (it runs on across a block's items). Where F::XS_ > 0, a stage also brings BN values of the flat fp32
// maps xa and xb, from elements xa0 and xb0 on by its first row, into its two slots (dK/dV: lse and D): a
// box of F::XV values from the 16-byte boundary at or before them (the copy engine faults on a box that
// starts elsewhere), so slot values (xa0 + r) % 4 on are the tile's.
template <class F>
__device__ __forceinline__ void fb_produce(unsigned bars, unsigned res, unsigned ring, int j, const TmaMap* ra, int ca,
                                           const TmaMap* rb, int cb, int r0, const TmaMap* sa, int cs,
                                           const TmaMap* sb, int ct, int first, int n, int b, int g0,
                                           const TmaMap* xa = nullptr, int xa0 = 0, const TmaMap* xb = nullptr,
                                           int xb0 = 0) {
    constexpr int NS = F::NS_, BM = F::BM_, BN = F::BN_, KB = F::KB, NR = F::NR_;
    const int lane = threadIdx.x & 31;
    const unsigned rbar = bars + 16 * NS + 8 * (j & 1), dst0 = res + (j & 1) * (NR * F::RT);
    if (j >= 2) mbar_wait(rbar + 16, ((j >> 1) - 1) & 1);     // item j - 2's resident tiles read
    mbar_expect(lane, rbar, NR * F::RT);
    fb_copy_tile<BM, KB>(lane, rbar, dst0, ra, ca, r0, b);
    if (NR == 2) fb_copy_tile<BM, KB>(lane, rbar, dst0 + F::RT, rb, cb, r0, b);
    for (int it = 0; it < n; ++it) {
        const int gs = g0 + it, s = gs % NS;
        if (gs >= NS) mbar_wait(bars + 8 * (NS + s), ((gs / NS) - 1) & 1);
        const unsigned full = bars + 8 * s, dst = ring + s * F::STAGE;
        const int r = (first + it) * BN;
        mbar_expect(lane, full, F::STAGE + (F::XS_ > 0 ? 2 * F::XV * 4 : 0));
        fb_copy_tile<BN, KB>(lane, full, dst, sa, cs, r, b);
        fb_copy_tile<BN, KB>(lane, full, dst + F::ST, sb, ct, r, b);
        if constexpr (F::XS_ > 0) {                        // BN values of the flat fp32 maps xa, xb
            const unsigned x = F::xslots(ring, s);
            tma_copy(lane, full, x, xa, (xa0 + r) & ~3, 0, 0);
            tma_copy(lane, full, x + F::XS_ / 2, xb, (xb0 + r) & ~3, 0, 0);
        }
    }
}

// A block's work items where F::WALK (the launcher's grid: at most one block an SM): one in each round of
// gridDim.x items, block b the b-th of even rounds and the b-th from the end of odd ones (a snake: the
// items come longest first, so a block that took a longer one takes a shorter one next; blocks that
// each took the next item of one list as they freed, as the hardware hands out a grid of one item a
// block, would end no more evenly), so that the next item's resident tiles load under the last one's
// products and its start costs no block launch; otherwise item blockIdx.x alone (a grid of one block an
// item). f(j, item): the block's j-th item. Item = tile * BH + b*H + h: a tile's items for every head,
// then the next tile's.
// (items: a kernel argument, B * H * tiles, that the loop reads where it tests, not a register it keeps)
template <class F, class G>
__device__ __forceinline__ void fb_walk(int items, G&& f) {
#pragma unroll 1
    for (int j = 0; F::WALK || j < 1; ++j) {
        const int item = j * gridDim.x + ((j & 1) ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
        if (item >= items) break;                      // (and every later round's)
        f(j, item);
    }
}
// A work item's head bh = b H + h and its first row r0 of tile item / BH. rev (the forward's and dQ's
// query tiles): tiles counted from the end, the last ending at T rounded up to 64 rows, so that where BM
// does not divide that, the first tile starts before row 0 (whole warpgroups of rows < 0: no tiles, no
// stores; the copy engine reads zeros there) instead of the last one's rows past T idling most of its
// warpgroups for every key; longest first. Otherwise (dK/dV's key tiles) tiles from row 0, the first the
// longest.
struct FbItem {
    int bh, b, h, r0;
    __device__ __forceinline__ FbItem(int item, int BH, int H, int T, int BM, bool rev) {
        bh = item % BH, b = bh / H, h = bh - b * H;
        const int t = item / BH;
        r0 = rev ? ((T + 63) & ~63) - (t + 1) * BM : t * BM;
    }
    // a query tile's (the forward's, dQ's) key tiles of BN: up to its last query
    __device__ __forceinline__ int key_tiles(int T, int BM, int BN) const { return (min(r0 + BM, T) + BN - 1) / BN; }
};
// row i of a sequence of T rows (not before row 0, not past T)
__device__ __forceinline__ bool fb_in(int i, int T) { return (unsigned)i < (unsigned)T; }
// A query tile's work item (the forward's, dQ's) as a consumer warp sees it: the item's key tiles nkt, the
// warp's first query wr0, its warpgroup's last query wg_last (-1: its rows are outside the sequence) and
// tiles (0 .. tiles() - 1: a key tile past the warpgroup's last query has nothing for it), and the thread's
// row g's keep word of keys 2q, 2q + 1, + 8, + 9 (rquad; W words a row)
struct FbQueryItem : FbItem {
    int nkt, wr0, wg_last;
    u32 rquad;
    __device__ __forceinline__ FbQueryItem(int item, int BH, int H, int T, int BM, int BN, int wg, int w, int g,
                                           int q, u32 W)
        : FbItem(item, BH, H, T, BM, true) {
        nkt = key_tiles(T, BM, BN);
        wr0 = r0 + 64 * wg + 16 * w;
        wg_last = fb_in(r0 + 64 * wg, T) ? r0 + 64 * wg + 63 : -1;   // -1: rows outside, no tile
        rquad = (u32)(bh * T + wr0 + g) * W + (u32)q;
    }
    // (a method, taken where the kernels need it: computed in the constructor it moved their machine code)
    __device__ __forceinline__ int tiles(int BN) const { return wg_last < 0 ? 0 : min(nkt, wg_last / BN + 1); }
};

// What every kernel sets up: the aligned base, barriers (the ring's; two full and two empty barriers of
// the resident tiles' buffers), the thread's place; the producer warpgroup is told apart by `producer`.
// g0: the ring's stage count at the current item's first stage (its stages are it = 0.. from there).
template <class F>
struct FbBlock {
    unsigned res, ring, bars;
    int wg, w, g, q, g0 = 0;
    bool producer;
    __device__ __forceinline__ FbBlock(unsigned char* smem, unsigned long long* bar_words) {
        res = (fa_smem_u32(smem) + 1023u) & ~1023u;
        ring = res + F::NRES_ * F::RT;
        bars = fa_smem_u32(bar_words);
        wg = threadIdx.x >> 7;
        w = (threadIdx.x >> 5) & 3;
        g = (threadIdx.x & 31) >> 2;
        q = threadIdx.x & 3;
        producer = wg == F::CW;
        fb_init_bars<F::NS_, F::CW>(bars);
    }
    __device__ __forceinline__ void wait_full(int it) const {
        const int gs = g0 + it;
        mbar_wait(bars + 8 * (gs % F::NS_), (gs / F::NS_) & 1);
    }
    __device__ __forceinline__ void release(int it) const { mbar_arrive(bars + 8 * (F::NS_ + (g0 + it) % F::NS_)); }
    __device__ __forceinline__ unsigned stage(int it) const { return ring + ((g0 + it) % F::NS_) * F::STAGE; }
    // stage it's extra bytes (F::XS_)
    __device__ __forceinline__ unsigned extra(int it) const { return F::xslots(ring, (g0 + it) % F::NS_); }
    // stages it0 .. it1 - 1 waited for and released unread (the ring counts every consumer thread's release)
    __device__ __forceinline__ void skip(int it0, int it1) const {
        for (int it = it0; it < it1; ++it) {
            wait_full(it);
            release(it);
        }
    }
    // item j's resident tiles (F::NR_ of them): their address once loaded; released once the item's
    // products that read them are done (the producer loads item j + 2's there)
    __device__ __forceinline__ unsigned wait_resident(int j) const {
        mbar_wait(bars + 16 * F::NS_ + 8 * (j & 1), (j >> 1) & 1);
        return res + (j & 1) * (F::NR_ * F::RT);
    }
    __device__ __forceinline__ void release_resident(int j) const {
        mbar_arrive(bars + 16 * F::NS_ + 16 + 8 * (j & 1));
    }
    // the ring after an item of n stages
    __device__ __forceinline__ void next_item(int n) { g0 += n; }
};

// The producer's walk of the query-tile kernels (the forward, dQ): item j's resident tiles (map ra at head h's
// columns, and map rb's where F::NR_ is 2) and then head h's K and V tiles of map kv (at columns C + h HS and
// 2C + h HS of qkv) up to the item's last query.
template <class F>
__device__ __forceinline__ void fb_produce_queries(FbBlock<F>& k, int items, int BH, int H, int T, const TmaMap* ra,
                                                   const TmaMap* rb, const TmaMap* kv) {
    constexpr int HS = F::HS_, BM = F::BM_, BN = F::BN_;
    fb_walk<F>(items, [&](int j, int item) {
        const FbItem t(item, BH, H, T, BM, true);
        const int nkt = t.key_tiles(T, BM, BN);
        fb_produce<F>(k.bars, k.res, k.ring, j, ra, t.h * HS, rb, t.h * HS, t.r0, kv, (H * HS) + t.h * HS, kv,
                      2 * (H * HS) + t.h * HS, 0, nkt, t.b, k.g0);
        k.next_item(nkt);
    });
}

#define FB_PLAN int THREADS, int BM, int BN, int NS, int SMEM
// fwd: how far (log2 units) a tile's max may pass the rows' reference max before it moves (fb_online_softmax)
#define FB_RESCALE_LOG2 8.f
#define FB_ARGS_DROP const StepState* __restrict__ st, u32 seed, u32 site, u32 threshold, float inv_keep, float scale, \
                     int T, int H

// The forward's and dQ's walk over a thread's elements of a tile of keys k0..: f(c, hh, jj, keep) for
// element c = 8 jp + 4 jj + 2 hh + e of the accumulators (row g + 8 hh, key k0 + 16 jp + 8 jj + 2q + e)
// with its keep bit (true without DROP): keys 2q, 2q + 1, + 8, + 9 of a 16-key block share the row's
// keep word of quad rquad + 8 hh W + k0 / 4 + 4 jp (gc_keep_att), byte 2 jj + e
template <int BN, bool DROP, class F>
__device__ __forceinline__ void fb_tile_keep(u32 key, u32 rquad, u32 W, u32 threshold, int k0, F&& f) {
#pragma unroll
    for (int jp = 0; jp < BN / 16; ++jp)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            u32 kw = 0;
            if (DROP) kw = gc_keep_word(key, rquad + (u32)(8 * hh) * W + (u32)((k0 >> 2) + 4 * jp));
#pragma unroll
            for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    f(8 * jp + 4 * jj + 2 * hh + e, hh, jj, !DROP || gc_keep_byte(kw, 2 * jj + e, threshold));
        }
}

// What the forward's softmax needs of the thread's rows besides the tile
struct FbFwdRows {
    float sl2;                                             // scale * log2 e
    u32 key, rquad, W, threshold;                          // dropout: row g's keep word of keys 2q, 2q + 1, + 8, + 9
    int warp_row, row, q;                                  // the warp's first query, the thread's; lane % 4
};
// The forward's online softmax of the tile of keys k0.. in place: sc (raw scores S) -> P = exp2(S sl2 - m)
// (0 past the causal diagonal, and where DROP drops it: 1 / (1 - p) goes on O at the end), l += the rows'
// sums of P before dropout. m, the rows' reference max, moves only when a row's max passes it by more than
// 2^FB_RESCALE_LOG2 = 2^8 (always on the first tile: m = -inf), as flash_tc's forward does: P <= 2^8 (bf16
// keeps its relative precision there) and most tiles leave O alone; when it moves (in every row of the warp),
// l is scaled here and alpha, the factor O must be scaled by before it takes this tile, is returned with
// true (warp-uniform).
template <int BN, bool DROP>
__device__ __forceinline__ bool fb_online_softmax(float (&sc)[BN / 2], float (&m)[2], float (&l)[2],
                                                  float (&alpha)[2], int k0, const FbFwdRows& r) {
    if (k0 + BN - 1 > r.warp_row)                          // the tile reaches past the warp's first query
        fb_mask_causal<BN, true>(sc, r.row - k0 - 2 * r.q);
    float mx[2];                                           // the rows' max of the raw scores
    fb_row_max<BN>(mx, sc);
    bool grow = false;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        mx[hh] *= r.sl2;                                   // (finite: every row sees key k0 of a tile it reads)
        grow |= mx[hh] > m[hh] + FB_RESCALE_LOG2;
    }
    const bool grew = __any_sync(0xffffffffu, grow);
    if (grew) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const float mnew = fmaxf(m[hh], mx[hh]);
            alpha[hh] = gc_exp2(m[hh] - mnew);             // 0 on tile 0 (m = -inf)
            m[hh] = mnew;
            l[hh] *= alpha[hh];
        }
    }
    float ls[2][2] = {{0.f, 0.f}, {0.f, 0.f}};              // the rows' sums of P, two chains a row
    fb_tile_keep<BN, DROP>(r.key, r.rquad, r.W, r.threshold, k0, [&](int c, int hh, int jj, bool keep) {
        const float p = gc_exp2(fmaf(sc[c], r.sl2, -m[hh]));   // <= 2^FB_RESCALE_LOG2
        ls[hh][jj] += p;
        sc[c] = keep ? p : 0.f;
    });
    l[0] += ls[0][0] + ls[0][1];
    l[1] += ls[1][0] + ls[1][1];
    return grew;
}
// O (HS columns of the thread's two rows) scaled by the rows' alpha
template <int HS>
__device__ __forceinline__ void fb_rescale(float (&o)[HS / 2], const float (&alpha)[2]) {
#pragma unroll
    for (int j = 0; j < HS / 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            o[4 * j + 2 * hh] *= alpha[hh];
            o[4 * j + 2 * hh + 1] *= alpha[hh];
        }
}

// ------------------------------------------------------------------------------------------- forward
// Work items (b*H + h, query tile of BM), item = tile * BH + b*H + h, the last query tiles (the most keys)
// first (fb_walk: a block walks several where F::WALK); an item: Q resident, K and V streamed up to the
// tile's last query.
template <int HS, bool DROP, FB_PLAN>
__global__ void __launch_bounds__(THREADS, 1)
flash_fwd_bf16(bf16* __restrict__ y,                        // [B,T,C]
               float* __restrict__ lse,                     // [B,H,T]
               const __grid_constant__ TmaMap map_q,        // qkv [B][T][3C], boxes {64, BM}
               const __grid_constant__ TmaMap map_kv,       // qkv, boxes {64, BN}
               FB_ARGS_DROP, int BH, int items) {           // B * H; B * H * tiles of BM
    using F = FaBf16<HS, THREADS, BM, BN, NS, SMEM, 1>;
    static_assert(SMEM == F::SMEM_NEED, "the plan's shared memory is Q (twice where F::WALK) and NS stages of K, V, "
                                        "+ 1 KB");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char fb_smem[];
    __shared__ __align__(8) unsigned long long fb_bars[2 * NS + 4];
    FbBlock<F> k(fb_smem, fb_bars);
    if (k.producer) {
        wg_regs_dec<F::PRODUCER_REGS>();
        if (threadIdx.x < F::CW * 128 + 32)                // its first warp
            fb_produce_queries<F>(k, items, BH, H, T, &map_q, &map_q, &map_kv);
        return;
    }
    wg_regs_inc<F::CONSUMER_REGS>();
    const float sl2 = scale * GC_LOG2E, ninf = __int_as_float(0xff800000);
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 W = gc_att_words(T);
    fb_walk<F>(items, [&](int j, int item) {
        const FbQueryItem t(item, BH, H, T, BM, BN, k.wg, k.w, k.g, k.q, W);
        const int nkt = t.nkt, wr0 = t.wr0;
        float o[HS / 2], m[2] = {ninf, ninf}, l[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < HS / 2; ++i) o[i] = 0.f;
        const FbFwdRows r{sl2, key, t.rquad, W, threshold, wr0, wr0 + k.g, k.q};
        // the warpgroup's tiles are 0 .. nl - 1; the others are waited for and released all the same (the ring
        // counts every consumer thread)
        const int nl = t.tiles(BN);
        const unsigned qa = k.wait_resident(j) + k.wg * 64 * 128;      // the warpgroup's rows of Q
        if constexpr (NS >= 3) {
            // pipelined (a third ring stage): tile it's S = Q K^T is issued before tile it - 1's O += P V, and
            // tile it's softmax runs while that product computes; O is rescaled once it is done
            if (nl > 0) {
                float sc[BN / 2], alpha[2];
                unsigned pa[BN / 16][4];
                k.wait_full(0);
                fb_mma_ss<HS, BM, BN>(sc, qa, k.stage(0));
                wg_commit();
                wg_wait<0>();
                wg_fence_acc(sc);
                fb_online_softmax<BN, DROP>(sc, m, l, alpha, 0, r);      // (O is 0: nothing to rescale)
                fb_pack<BN>(pa, sc);
                for (int it = 1; it < nl; ++it) {
                    k.wait_full(it);
                    fb_mma_ss<HS, BM, BN>(sc, qa, k.stage(it));
                    wg_commit();
                    fb_mma_rs<HS, BN, BN / 16>(o, pa, k.stage(it - 1) + F::ST);
                    wg_commit();
                    wg_wait<1>();
                    wg_fence_acc(sc);
                    const bool grew = fb_online_softmax<BN, DROP>(sc, m, l, alpha, it * BN, r);
                    wg_wait<0>();
                    wg_fence_acc(o);
                    fb_fence_frags(pa);
                    k.release(it - 1);
                    if (grew) fb_rescale<HS>(o, alpha);
                    fb_pack<BN>(pa, sc);
                }
                fb_mma_rs_wait<HS, BN, BN / 16>(o, pa, k.stage(nl - 1) + F::ST);
                k.release(nl - 1);
            }
        } else {                                               // a tile at a time
            for (int it = 0; it < nl; ++it) {
                k.wait_full(it);
                const unsigned kt = k.stage(it);
                float sc[BN / 2], alpha[2];
                fb_mma_ss<HS, BM, BN>(sc, qa, kt);
                wg_commit();
                wg_wait<0>();
                wg_fence_acc(sc);
                if (fb_online_softmax<BN, DROP>(sc, m, l, alpha, it * BN, r)) fb_rescale<HS>(o, alpha);
                unsigned pa[BN / 16][4];
                fb_pack<BN>(pa, sc);
                fb_mma_rs_wait<HS, BN, BN / 16>(o, pa, kt + F::ST);
                k.release(it);
            }
        }
        k.release_resident(j);                                 // Q read: its buffer may take item j + 2's
        k.skip(nl, nkt);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float L = l[hh];
            L += __shfl_xor_sync(0xffffffffu, L, 1);
            L += __shfl_xor_sync(0xffffffffu, L, 2);
            const int i = wr0 + k.g + 8 * hh;
            if (fb_in(i, T)) {
                fb_store_row<HS>(y + ((long long)t.b * T + i) * (H * HS) + t.h * HS + 2 * k.q, o, hh,
                                 (DROP ? inv_keep : 1.f) / L);
                if (k.q == 0) lse[(long long)t.bh * T + i] = m[hh] * FA_LN2 + logf(L);
            }
        }
        k.next_item(nkt);
    });
#else
    __trap();
#endif
}

// ------------------------------------------------------------------------------------- backward: dQ
// The backward's first two products over a stage (its two tiles at st, the second ST bytes on), both
// K-major, issued and committed as one group: sc = A B1^T and dp = A' B2^T with A, A' the warpgroup's rows
// of the resident tiles at a and a2. dQ: S = Q K^T, dPd = dO V^T; dK/dV: S^T = K Q^T, dPd^T = V dO^T.
template <int HS, int BM, int BN>
__device__ __forceinline__ void fb_scores(float (&sc)[BN / 2], float (&dp)[BN / 2], unsigned a, unsigned a2,
                                          unsigned st) {
    fb_mma_ss<HS, BM, BN>(sc, a, st);
    wg_fence_acc(dp);
#pragma unroll
    for (int s = 0; s < HS / 16; ++s)
        WgBf16<BN>::template mma<0, 0>(dp, fb_desc_k<BM>(a2, s), fb_desc_k<BN>(st + BN * HS * 2, s), s > 0);
    wg_commit();
}
// fb_scores of stage it once it is loaded, waited for: sc and dp are the thread's again
template <int HS, int BM, int BN, class F>
__device__ __forceinline__ void fb_scores_wait(const FbBlock<F>& k, int it, float (&sc)[BN / 2],
                                               float (&dp)[BN / 2], unsigned a, unsigned a2) {
    k.wait_full(it);
    fb_scores<HS, BM, BN>(sc, dp, a, a2, k.stage(it));
    wg_wait<0>();
    wg_fence_acc(sc);
    wg_fence_acc(dp);
}

// What dQ's softmax gradient needs of the thread's rows besides the tile
struct FbDqRows {
    float sl2, lse2[2], D[2];                              // scale log2 e; the rows' lse (log2 units) and D
    u32 key, rquad, W, threshold;                          // dropout, as FbFwdRows
    float inv_keep;
    int warp_row, row, q;
};
// dQ's softmax gradient of the tile of keys k0.. in place: sc (S) -> dS = P (dP - D), P = exp2(S sl2 - lse
// log2 e) (0 past the causal diagonal), dP = dPd keep / (1 - p) from dp (dPd = dO V^T)
template <int BN, bool DROP>
__device__ __forceinline__ void fb_dq_grads(float (&sc)[BN / 2], const float (&dp)[BN / 2], int k0, const FbDqRows& r) {
    if (k0 + BN - 1 > r.warp_row) fb_mask_causal<BN, true>(sc, r.row - k0 - 2 * r.q);   // P = 0 there
    fb_tile_keep<BN, DROP>(r.key, r.rquad, r.W, r.threshold, k0, [&](int c, int hh, int, bool keep) {
        const float p = gc_exp2(sc[c] * r.sl2 - r.lse2[hh]);
        const float d = DROP ? (keep ? dp[c] * r.inv_keep : 0.f) : dp[c];
        sc[c] = p * (d - r.D[hh]);
    });
}

// Work items as the forward's (fb_walk, FbItem): Q and dO resident, K and V streamed.
// An item also makes D = rowsum(dO * O) of its rows (the 4 lanes of a row a quarter of the head's columns
// each, read from dy and y; an fma chain, then lanes xor 1, xor 2) and writes it for flash_bwd_dkv_bf16,
// which runs after it: no rowsum pass.
template <int HS, bool DROP, FB_PLAN>
__global__ void __launch_bounds__(THREADS, 1)
flash_bwd_dq_bf16(bf16* __restrict__ dqkv,                  // [B,T,3C]: the q columns
                  const __grid_constant__ TmaMap map_r,     // qkv [B][T][3C], boxes {64, BM}
                  const __grid_constant__ TmaMap map_dy,    // dy [B][T][C], boxes {64, BM}
                  const __grid_constant__ TmaMap map_s,     // qkv, boxes {64, BN}
                  const bf16* __restrict__ dy,              // [B,T,C] (map_dy's), 16-byte aligned
                  const bf16* __restrict__ y,               // [B,T,C] the forward's output, 16-byte aligned
                  const float* __restrict__ lse,            // [B,H,T]
                  float* __restrict__ Dg,                   // [B,H,T] out: rowsum(dy * y)
                  FB_ARGS_DROP, int BH, int items) {        // B * H; B * H * tiles of BM
    using F = FaBf16<HS, THREADS, BM, BN, NS, SMEM, 2>;
    static_assert(SMEM == F::SMEM_NEED, "the plan's shared memory is Q, dO (twice where F::WALK) and NS stages of K, "
                                        "V, + 1 KB");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char fb_smem[];
    __shared__ __align__(8) unsigned long long fb_bars[2 * NS + 4];
    FbBlock<F> k(fb_smem, fb_bars);
    if (k.producer) {
        wg_regs_dec<F::PRODUCER_REGS>();
        if (threadIdx.x < F::CW * 128 + 32)                // its first warp
            fb_produce_queries<F>(k, items, BH, H, T, &map_r, &map_dy, &map_s);
        return;
    }
    wg_regs_inc<F::CONSUMER_REGS>();
    const float sl2 = scale * GC_LOG2E;
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 W = gc_att_words(T);
    fb_walk<F>(items, [&](int j, int item) {
        const FbQueryItem t(item, BH, H, T, BM, BN, k.wg, k.w, k.g, k.q, W);
        const int nkt = t.nkt, wr0 = t.wr0;
        // D's operands (the row's quarter of dy and y, as stored) and lse are loaded first and D is summed once
        // the first tile's products are done, so that the loads' latency runs under the copies and the products
        float lse2[2], Dr[2];                                  // per row: lse in log2 units, D
        uint4 dyr[2][HS / 32], yr[2][HS / 32];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = wr0 + k.g + 8 * hh;
            lse2[hh] = fb_in(i, T) ? lse[(long long)t.bh * T + i] * GC_LOG2E : 0.f;
            const long long off = ((long long)t.b * T + i) * (H * HS) + t.h * HS + (HS / 4) * k.q;
#pragma unroll
            for (int c = 0; c < HS / 32; ++c) {
                const uint4 z = make_uint4(0u, 0u, 0u, 0u);
                dyr[hh][c] = fb_in(i, T) ? *reinterpret_cast<const uint4*>(dy + off + 8 * c) : z;
                yr[hh][c] = fb_in(i, T) ? *reinterpret_cast<const uint4*>(y + off + 8 * c) : z;
            }
        }
        float dq[HS / 2];
#pragma unroll
        for (int i = 0; i < HS / 2; ++i) dq[i] = 0.f;
        const int nl = t.tiles(BN);                            // the warpgroup's tiles (as the forward's)
        auto make_d = [&]() {                                  // D of the rows, written for dK / dV's kernel
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int i = wr0 + k.g + 8 * hh;
                float d = 0.f;
#pragma unroll
                for (int c = 0; c < HS / 32; ++c) {
                    float a[8], o[8];
                    bf16x8_f32(dyr[hh][c], a);
                    bf16x8_f32(yr[hh][c], o);
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(a[e], o[e], d);
                }
                d += __shfl_xor_sync(0xffffffffu, d, 1);
                d += __shfl_xor_sync(0xffffffffu, d, 2);
                Dr[hh] = d;
                if (fb_in(i, T) && k.q == 0) Dg[(long long)t.bh * T + i] = d;
            }
        };
        const unsigned qa = k.wait_resident(j) + k.wg * 64 * 128, da = qa + F::RT;   // the warpgroup's rows of Q, dO
        if (nl == 0) {
            make_d();
        } else {
            float sc[BN / 2], dp[BN / 2];
            unsigned ds[BN / 16][4];
            fb_scores_wait<HS, BM, BN>(k, 0, sc, dp, qa, da);   // S = Q K^T, dPd = dO V^T
            make_d();
            const FbDqRows r{sl2, {lse2[0], lse2[1]}, {Dr[0], Dr[1]}, key, t.rquad, W, threshold, inv_keep, wr0,
                             wr0 + k.g, k.q};
            fb_dq_grads<BN, DROP>(sc, dp, 0, r);
            for (int it = 0; it + 1 < nl; ++it) {
                fb_pack<BN>(ds, sc);
                if constexpr (NS >= 3) {
                    // pipelined (a third ring stage): tile it + 1's S and dP are issued before tile it's
                    // dQ += dS K, and tile it + 1's dS is made while that product computes
                    k.wait_full(it + 1);
                    fb_scores<HS, BM, BN>(sc, dp, qa, da, k.stage(it + 1));
                    fb_mma_rs<HS, BN, BN / 16>(dq, ds, k.stage(it));
                    wg_commit();
                    wg_wait<1>();
                    wg_fence_acc(sc);
                    wg_fence_acc(dp);
                    fb_dq_grads<BN, DROP>(sc, dp, (it + 1) * BN, r);
                    wg_wait<0>();
                    wg_fence_acc(dq);
                    fb_fence_frags(ds);
                    k.release(it);
                } else {                                       // a tile at a time
                    fb_mma_rs_wait<HS, BN, BN / 16>(dq, ds, k.stage(it));   // dQ += dS K
                    k.release(it);
                    fb_scores_wait<HS, BM, BN>(k, it + 1, sc, dp, qa, da);
                    fb_dq_grads<BN, DROP>(sc, dp, (it + 1) * BN, r);
                }
            }
            fb_pack<BN>(ds, sc);                               // the last tile's
            fb_mma_rs_wait<HS, BN, BN / 16>(dq, ds, k.stage(nl - 1));
            k.release(nl - 1);
        }
        k.release_resident(j);                                 // Q and dO read: the buffer may take item j + 2's
        k.skip(nl, nkt);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int i = wr0 + k.g + 8 * hh;
            if (fb_in(i, T))
                fb_store_row<HS>(dqkv + ((long long)t.b * T + i) * 3 * (H * HS) + t.h * HS + 2 * k.q, dq, hh, scale);
        }
        k.next_item(nkt);
    });
#else
    __trap();
#endif
}

// ----------------------------------------------------------------------------------- backward: dK dV
// dV += Pd^T dO and dK += dS^T Q of a stage's queries (Q at qt, dO after it) from the fragments pa (of
// Pd^T) and ds (of dS^T), issued and committed as one group
template <int HS, int BN>
__device__ __forceinline__ void fb_dkv_products(float (&dv)[HS / 2], float (&dk)[HS / 2], unsigned (&pa)[BN / 16][4],
                                                unsigned (&ds)[BN / 16][4], unsigned qt) {
    fb_mma_rs<HS, BN, BN / 16>(dv, pa, qt + BN * HS * 2);
    fb_mma_rs<HS, BN, BN / 16>(dk, ds, qt);
    wg_commit();
}
// every product waited for: dV, dK and the fragments they read are the thread's again
template <int HS, int BN>
__device__ __forceinline__ void fb_dkv_wait(float (&dv)[HS / 2], float (&dk)[HS / 2], unsigned (&pa)[BN / 16][4],
                                            unsigned (&ds)[BN / 16][4]) {
    wg_wait<0>();
    wg_fence_acc(dv);
    wg_fence_acc(dk);
    fb_fence_frags(pa);
    fb_fence_frags(ds);
}
// What fb_dkv_grads needs of the warp's rows (keys kw0 + g and + 8) besides the tile
struct FbDkvRow {
    int kw0, g, q, T;
    float sl2;
    u32 key, row0, W, kquad, threshold;                    // row0: b h T, the head's first query; kquad: the
                                                           // quad of keys g and g + 8 within a row of W words
    float inv_keep;
    u32 xl, xd;          // the pipelined loop's: the bytes from a stage's slots to the thread's first column's lse, D
};
// The lse (natural log, as stored) and D of the thread's columns of the tile of queries i0.. (fb_dkv_grads's
// l2, Dq), past T +inf (P = 0) and 0. Where the stage brought them (XS: the slots at x, the thread's first
// column r.xl and r.xd on; the pipelined loop), from there: whatever the copy brought past T (the next
// head's) is masked; otherwise (the a-tile-at-a-time loop, short of registers for the stage's addresses)
// from lse and D in global memory.
template <int BN, bool XS>
__device__ __forceinline__ void fb_dkv_cols(float (&l2)[BN / 4], float (&Dq)[BN / 4], int i0, unsigned x,
                                            const float* lse, const float* D, const FbDkvRow& r) {
    const float inf = __int_as_float(0x7f800000);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int i = i0 + 8 * j + 2 * r.q;                // columns 8 j + 2 q, + 1
        if constexpr (XS) {
            const unsigned a = x + r.xl + 32 * j, b = x + r.xd + 32 * j;   // (4-byte aligned only)
            float2 l, d;
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(l.x) : "r"(a));
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(l.y) : "r"(a + 4));
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(d.x) : "r"(b));
            asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(d.y) : "r"(b + 4));
            l2[2 * j] = i < r.T ? l.x : inf;
            l2[2 * j + 1] = i + 1 < r.T ? l.y : inf;
            Dq[2 * j] = i < r.T ? d.x : 0.f;
            Dq[2 * j + 1] = i + 1 < r.T ? d.y : 0.f;
        } else {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                l2[2 * j + e] = i + e < r.T ? lse[i + e] : inf;
                Dq[2 * j + e] = i + e < r.T ? D[i + e] : 0.f;
            }
        }
    }
}
// The softmax gradient of a tile of queries i0.. in place: sc (S^T) -> Pd^T (P with dropout, for dV), dp
// (dPd^T) -> dS^T = P (dP - D) where dP = dPd keep / (1 - p). P = exp2(S sl2 - lse log2 e) of the thread's
// columns' lse, 0 above the diagonal. The thread's keys g and g + 8 and their neighbours g ^ 1, g ^ 1 + 8
// (lanes 4 apart) take bytes of one keep word of query i (gc_keep_att): of the two queries of a column
// pair, the even lane draws the first's word, the odd lane the second's, and each hands its word to the
// other (gc_att_pair_words).
template <int BN, bool DROP>
__device__ __forceinline__ void fb_dkv_grads(float (&sc)[BN / 2], float (&dp)[BN / 2], int i0, const FbDkvRow& r,
                                             const float (&l2)[BN / 4], const float (&Dq)[BN / 4]) {
    if (i0 < r.kw0 + 15)                                   // a query of the tile precedes a key of the warp
        fb_mask_causal<BN, false>(sc, r.kw0 + r.g - i0 - 2 * r.q);   // P = 0 there
    const u32 odd = (u32)(r.g & 1);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        u32 kws[2] = {0u, 0u};                             // the words of queries i0 + 8j + 2q and + 1
        if (DROP) {
            gc_att_pair_words(gc_keep_word(r.key, (r.row0 + (u32)(i0 + 8 * j + 2 * r.q) + odd) * r.W + r.kquad), odd,
                              kws);
        }
#pragma unroll
        for (int e2 = 0; e2 < 2; ++e2) {
            const float l2i = l2[2 * j + e2] * GC_LOG2E, Di = Dq[2 * j + e2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int c = 4 * j + 2 * hh + e2;         // key kw0 + g + 8 hh: byte 2 hh + (g & 1)
                const float p = gc_exp2(fmaf(sc[c], r.sl2, -l2i));
                float d = dp[c], pd = p;
                if (DROP) {
                    const bool keep = gc_keep_byte(kws[e2], 2u * hh, r.threshold);
                    d = keep ? d * r.inv_keep : 0.f;
                    pd = keep ? p * r.inv_keep : 0.f;
                }
                sc[c] = pd;
                dp[c] = p * (d - Di);
            }
        }
    }
}

// A work item of flash_bwd_dkv_bf16 (FbItem, key tiles from the first): besides FbItem's, the first query
// tile that sees a key of it and the query tiles from there to the end (nqt)
struct FbDkvItem : FbItem {
    int first, nqt;
    __device__ __forceinline__ FbDkvItem(int item, int BH, int H, int T, int BM, int BN)
        : FbItem(item, BH, H, T, BM, false) {
        first = r0 / BN, nqt = (T + BN - 1) / BN - first;
    }
};

// Work items (b*H + h, key tile of BM), item = key tile * BH + b*H + h: the first key tiles (the most
// queries) first (fb_walk: a block walks several where F::WALK). An item: K and V resident, Q and dO
// streamed from the first query tile that reaches its keys to the end, where the loop is pipelined each
// stage with its queries' lse and D (the copy engine's, from flat maps of [B,H,T]: a tile's values past T
// are the next head's, or zeros, and fb_dkv_cols masks them).
template <int HS, bool DROP, FB_PLAN>
__global__ void __launch_bounds__(THREADS, 1)
flash_bwd_dkv_bf16(bf16* __restrict__ dqkv,                 // [B,T,3C]: the k and v columns
                   const __grid_constant__ TmaMap map_r,    // qkv [B][T][3C], boxes {64, BM}
                   const __grid_constant__ TmaMap map_s,    // qkv, boxes {64, BN}
                   const __grid_constant__ TmaMap map_dy,   // dy [B][T][C], boxes {64, BN}
                   const __grid_constant__ TmaMap map_lse,  // lse [B,H,T] flat (fp32), boxes {BN + 4},
                   int lse0,                                // from lse0 values before lse
                   const __grid_constant__ TmaMap map_D,    // D [B,H,T] flat, boxes {BN + 4}, from D0
                   int D0,
                   const float* __restrict__ lse,           // [B,H,T] (the same)
                   const float* __restrict__ Dg,            // [B,H,T] (the same)
                   FB_ARGS_DROP, int BH, int items) {       // B * H; B * H * tiles of BM
    using F = FaBf16<HS, THREADS, BM, BN, NS, SMEM, 2, NS >= 3 ? 2 * fb_xslot(BN) : 0>;
    static_assert(SMEM == F::SMEM_NEED, "the plan's shared memory is K, V (twice where F::WALK), NS stages of Q, "
                                        "dO, then (pipelined) NS of lse and D, + 1 KB");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char fb_smem[];
    __shared__ __align__(8) unsigned long long fb_bars[2 * NS + 4];
    FbBlock<F> k(fb_smem, fb_bars);
    const int C = H * HS;
    if (k.producer) {
        wg_regs_dec<F::PRODUCER_REGS>();
        if (threadIdx.x < F::CW * 128 + 32) {              // its first warp
            fb_walk<F>(items, [&](int j, int item) {
                const FbDkvItem t(item, BH, H, T, BM, BN);
                fb_produce<F>(k.bars, k.res, k.ring, j, &map_r, C + t.h * HS, &map_r, 2 * C + t.h * HS, t.r0, &map_s,
                              t.h * HS, &map_dy, t.h * HS, t.first, t.nqt, t.b, k.g0, &map_lse, lse0 + t.bh * T,
                              &map_D, D0 + t.bh * T);
                k.next_item(t.nqt);
            });
        }
        return;
    }
    wg_regs_inc<F::CONSUMER_REGS>();
    const float sl2 = scale * GC_LOG2E;
    const u32 key = fa_drop_key<DROP>(st, seed, site);
    const u32 W = gc_att_words(T);
    fb_walk<F>(items, [&](int j, int item) {
        const FbDkvItem t(item, BH, H, T, BM, BN);
        const int bh = t.bh, b = t.b, h = t.h, kb0 = t.r0, first = t.first, nqt = t.nqt;
        const int kw0 = kb0 + 64 * k.wg + 16 * k.w;       // the warp's first key
        const int wg_first = kb0 + 64 * k.wg;
        const float* lse_h = lse + (long long)bh * T;
        const float* D_h = Dg + (long long)bh * T;
        float dk[HS / 2], dv[HS / 2];
#pragma unroll
        for (int i = 0; i < HS / 2; ++i) dk[i] = dv[i] = 0.f;
        const unsigned ka = k.wait_resident(j) + k.wg * 64 * 128, va = ka + F::RT;   // the warpgroup's K, V
        int it0 = 0;                                       // the query tiles before every key of the warpgroup
        while (it0 < nqt && (first + it0) * BN + BN - 1 < wg_first) ++it0;
        k.skip(0, it0);
        if (it0 < nqt) {
            const FbDkvRow r{kw0, k.g, k.q, T, sl2, key, (u32)(bh * T), W, gc_att_quad((u32)(kw0 + k.g)), threshold,
                             inv_keep, (u32)(4 * (((lse0 + bh * T) & 3) + 2 * k.q)),
                             (u32)(F::XS_ / 2 + 4 * (((D0 + bh * T) & 3) + 2 * k.q))};
            float sc[BN / 2], dp[BN / 2], l2[BN / 4], Dq[BN / 4];
            fb_scores_wait<HS, BM, BN>(k, it0, sc, dp, ka, va);
            fb_dkv_cols<BN, F::XS_ != 0>(l2, Dq, (first + it0) * BN, k.extra(it0), lse_h, D_h, r);
            fb_dkv_grads<BN, DROP>(sc, dp, (first + it0) * BN, r, l2, Dq);
            for (int it = it0; it + 1 < nqt; ++it) {
                unsigned pa[BN / 16][4], ds[BN / 16][4];
                if constexpr (NS >= 3) {
                    // pipelined (a third ring stage holds the next tile): tile it's dV += Pd^T dO and dK +=
                    // dS^T Q are issued after tile it + 1's S^T and dP^T, and tile it + 1's softmax gradient
                    // runs while they compute (into sc and dp: the fragments they read stay)
                    fb_pack<BN>(pa, sc);
                    fb_pack<BN>(ds, dp);
                    k.wait_full(it + 1);
                    fb_scores<HS, BM, BN>(sc, dp, ka, va, k.stage(it + 1));
                    fb_dkv_products<HS, BN>(dv, dk, pa, ds, k.stage(it));
                    fb_dkv_cols<BN, F::XS_ != 0>(l2, Dq, (first + it + 1) * BN, k.extra(it + 1), lse_h, D_h, r);
                    wg_wait<1>();
                    wg_fence_acc(sc);
                    wg_fence_acc(dp);
                    fb_dkv_grads<BN, DROP>(sc, dp, (first + it + 1) * BN, r, l2, Dq);
                    fb_dkv_wait<HS, BN>(dv, dk, pa, ds);
                    k.release(it);
                } else {                                   // a tile at a time
                    fb_pack<BN>(pa, sc);
                    fb_pack<BN>(ds, dp);
                    fb_dkv_products<HS, BN>(dv, dk, pa, ds, k.stage(it));
                    fb_dkv_wait<HS, BN>(dv, dk, pa, ds);
                    k.release(it);
                    fb_scores_wait<HS, BM, BN>(k, it + 1, sc, dp, ka, va);
                    fb_dkv_cols<BN, F::XS_ != 0>(l2, Dq, (first + it + 1) * BN, k.extra(it + 1), lse_h, D_h, r);
                    fb_dkv_grads<BN, DROP>(sc, dp, (first + it + 1) * BN, r, l2, Dq);
                }
            }
            unsigned pa[BN / 16][4], ds[BN / 16][4];       // the last tile's
            fb_pack<BN>(pa, sc);
            fb_pack<BN>(ds, dp);
            fb_dkv_products<HS, BN>(dv, dk, pa, ds, k.stage(nqt - 1));
            fb_dkv_wait<HS, BN>(dv, dk, pa, ds);
            k.release(nqt - 1);
        }
        k.release_resident(j);                             // K and V read: the buffer may take item j + 2's
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int kk = kw0 + k.g + 8 * hh;
            if (kk < T) {
                bf16* o = dqkv + ((long long)b * T + kk) * 3 * C + C + h * HS + 2 * k.q;
                fb_store_row<HS>(o, dk, hh, scale);
                fb_store_row<HS>(o + C, dv, hh, 1.f);
            }
        }
        k.next_item(nqt);
    });
#else
    __trap();
#endif
}
