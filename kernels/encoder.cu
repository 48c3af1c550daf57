// Token + position embedding: forward gather and deterministic backward scatter.
//
//   encoder_fwd<VEC, TW, TO>  out[n, :] = wte[idx[n], :] + wpe[n % T, :]
//   encoder_bwd_wte<VEC, TD>  dwte[v, :] += sum of dout[n, :] over the tokens n with idx[n] == v
//                             ("scan": small vocabularies; every block scans every id)
//   encoder_bwd_sort<E>       bucket the token positions by id (one block, a stable radix sort in
//                             shared memory) into the workspace: runs of equal id, positions increasing
//   encoder_bwd_wte_long<VEC, TD> the sums of the long runs' pieces (runs of more than ENC_LONG rows)
//   encoder_bwd_wte_seg<VEC, TD>  dwte[v, :] += the sum of one run's dout rows ("sort": large vocabularies)
//   encoder_bwd_wpe<VEC, TD>  dwpe[t, :]  = sum over b of dout[b, t, :] (t < T), 0 for t >= T
//
// Element types (bf16.cuh's codes: 0 fp32, 1 bf16): TW of wte and wpe (the fp32 parameters or their
// bf16 working copy), TO of out, TD of dout; dwte and dwpe are fp32. Values are added in fp32 and
// rounded once where stored in bf16 (out); bf16 inputs are widened exactly, so the backward's sums and
// their order are those of fp32 dout holding the same values.
// VEC is 4 (4 values a load / store: needs C % 4 == 0 and pointers aligned to 4 elements, 16 bytes
// of fp32, 8 of bf16) or 1.
// The backward uses no float atomics and sums in an order fixed by the inputs alone, so it is
// bitwise reproducible whatever the scheduling:
//   * scan (grid (V, C / (32*VEC))): a block owns one (vocabulary row, column tile) of dwte and
//     scans every token id; warp w sums the matches of its token chunks, then the warps' partials
//     are added in warp order. Costs V * tiles * N id reads: fine for V = 65, not for 50K.
//   * sort: encoder_bwd_sort sorts the keys (id << nbits) | n (n < 2^nbits, (V+1) << nbits <= 2^32;
//     ids outside [0, V) are dropped) of all N tokens by id in one block, stably (so n increases
//     within an id), and writes the workspace (i32)
//         pos[N]        token positions, grouped by id (ids increasing), n increasing in a group
//         seg_id[N]     the id of run u (u < U; runs of equal id = the ids present)
//         seg_start[N+1] where run u starts in pos; seg_start[U] = the number of valid tokens
//         nseg[1]       U
//         ends[2, K]    the runs of each 32-entry chunk's first and last valid entries (K = ceil(N/32))
//         (to a 16-byte boundary)
//         pieces[2, K, C]  fp32: encoder_bwd_wte_long's sums
//     (at ws[0], ws[N], ws[2N], ws[3N+1], ws[3N+2], then 4-word aligned: EncLayout, and the launcher's
//     workspace_ints). encoder_bwd_wte_seg then gives one warp to each (run, 32*VEC-column tile): it
//     sums the run's dout rows sequentially in increasing n (acc = 0; acc += dout[n0]; acc += dout[n1];
//     ...) and does dwte[v] = dwte[v] + acc once.
//     A run of more than ENC_LONG rows (text's newline, " the", ","; thousands of rows in a GPT-2
//     batch) would keep its warps for thousands of dependent rounds of loads while the others are
//     done, so it is summed in pieces first: pos is cut into chunks of 32 entries, and
//     encoder_bwd_wte_long gives a warp to each (chunk, column tile), which sums the chunk's entries
//     of the (at most two: ENC_LONG = 32) long runs it meets, each in increasing n from 0, into
//     pieces[0][chunk] (the run began before the chunk, or begins at its first entry) or
//     pieces[1][chunk] (it begins inside the chunk); encoder_bwd_wte_seg's warp for a long run then
//     adds its pieces in chunk order (acc = 0; acc += piece_j0; ...) instead of its rows.
//     Rows of absent ids are never read or written; the cost is N*C floats of dout plus the rows
//     of the ids present, independent of V. The sort (4-bit digits, ceil(bits(V)/4) passes: 4 for
//     GPT-2) is ~100 shared-memory accesses a thread a pass: ~8 us at N = 8192 on one SM.
//     E = 32 (16384 < N <= 32768) spills ~200 bytes a thread (64 registers at 1024 threads).
#include "common.cuh"
#include "bf16.cuh"

// Blocks (THREADS, WARPS), the sort's digit width and shared memory are template arguments chosen in
// gptcuda/ops/cuda/encoder.py; a kernel asserts what its code fixes.
#define ENC_BWD_UNROLL 4

// VEC consecutive values of fp32 or bf16 (T), in fp32
template <int VEC, class T>
__device__ __forceinline__ void enc_load(float (&r)[VEC], const T* p) {
    if constexpr (VEC == 4) {
        val_ld4(p, r);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = val_ld(p + k);
    }
}

template <int VEC, class T>
__device__ __forceinline__ void enc_store(T* p, const float (&r)[VEC]) {
    if constexpr (VEC == 4) {
        val_st4(p, r);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) val_st(p + k, r[k]);
    }
}

// One thread per VEC consecutive columns of one token.
template <int VEC, int THREADS, int TW, int TO>
__global__ void __launch_bounds__(THREADS)
encoder_fwd(elem<TO>* __restrict__ out,        // out  [N, C]   (N = B*T)
            const int* __restrict__ idx,       // idx  [N]
            const elem<TW>* __restrict__ wte,  // wte  [V, C]
            const elem<TW>* __restrict__ wpe,  // wpe  [Tmax, C]
            int N, int T, int C, int V) {
    const int CV = C / VEC;
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= (long long)N * CV) return;
    const int n = (int)(i / CV);
    const int c = (int)(i - (long long)n * CV) * VEC;
    const int t = n % T;
    const int id = idx[n];
    float r[VEC];
    if ((unsigned)id >= (unsigned)V) {           // an out-of-range id poisons its row
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = __int_as_float(0x7fc00000);
    } else {
        float a[VEC], b[VEC];
        enc_load<VEC>(a, wte + (long long)id * C + c);
        enc_load<VEC>(b, wpe + (long long)t * C + c);
#pragma unroll
        for (int k = 0; k < VEC; ++k) r[k] = a[k] + b[k];
    }
    enc_store<VEC>(out + (long long)n * C + c, r);
}

// grid (V, ceil(C / (32*VEC))), block WARPS*32.
// Warp w takes the token chunks w, w + WARPS, w + 2*WARPS, ... (32 tokens a chunk, in
// increasing order) and accumulates the matching rows of its 32*VEC columns in registers;
// the warps' sums are then added in warp order. Fixed order everywhere: bitwise reproducible.
// TG (all three dwte / dwpe kernels): the gradients' element type (0 fp32; 1 bf16, the fp32 sum rounded once).
template <int VEC, int WARPS, int TD, int TG = 0>
__global__ void __launch_bounds__(WARPS * 32)
encoder_bwd_wte(elem<TG>* __restrict__ dwte,         // dwte [V, C]   (+=)
                const elem<TD>* __restrict__ dout,   // dout [N, C]
                const int* __restrict__ idx,      // idx  [N]
                int N, int C) {
    constexpr int TILE = 32 * VEC;
    __shared__ float red[WARPS][TILE];
    const int v = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int c = blockIdx.y * TILE + lane * VEC;
    const bool active = c < C;                   // VEC == 4 implies C % 4 == 0: all or nothing
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.f;

    for (int base = warp * 32; base < N; base += WARPS * 32 * ENC_BWD_UNROLL) {
        unsigned hits[ENC_BWD_UNROLL];
#pragma unroll
        for (int u = 0; u < ENC_BWD_UNROLL; ++u) {          // issue the id loads together
            const int n = base + u * WARPS * 32 + lane;
            const bool m = n < N && idx[n] == v;
            hits[u] = __ballot_sync(0xffffffffu, m);
        }
#pragma unroll
        for (int u = 0; u < ENC_BWD_UNROLL; ++u) {
            const int chunk = base + u * WARPS * 32;
            unsigned h = hits[u];
            while (h) {                                      // two rows at a time, in token order
                const int j0 = __ffs(h) - 1;
                h &= h - 1;
                const int j1 = h ? __ffs(h) - 1 : -1;
                if (j1 >= 0) h &= h - 1;
                if (active) {
                    float a[VEC], b[VEC];
                    enc_load<VEC>(a, dout + (long long)(chunk + j0) * C + c);
                    if (j1 >= 0) enc_load<VEC>(b, dout + (long long)(chunk + j1) * C + c);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc[k] += a[k];
                    if (j1 >= 0) {
#pragma unroll
                        for (int k = 0; k < VEC; ++k) acc[k] += b[k];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) red[warp][lane * VEC + k] = acc[k];
    __syncthreads();
    for (int k = threadIdx.x; k < TILE; k += WARPS * 32) {
        const int col = blockIdx.y * TILE + k;
        if (col < C) {
            float s = red[0][k];
#pragma unroll
            for (int w = 1; w < WARPS; ++w) s += red[w][k];
            elem<TG>* d = dwte + (long long)v * C + col;
            val_st(d, val_ld(d) + s);
        }
    }
}

// ---- the sorted path ---------------------------------------------------------------------
#define ENC_SEG_UNROLL 8          // dout rows in flight per lane (a power of two dividing 32)
#define ENC_LONG 32               // a run of more rows is summed in pieces (32: at most two long runs
                                  // meet a chunk, and a short run's positions are one load a lane)

__device__ __forceinline__ int enc_pad(int i) { return i + (i >> 5); }   // a word skipped every 32

// Exclusive scan of x over a block of 1024 threads (all must call); tot[31] is the total after.
__device__ __forceinline__ int enc_block_scan(int x, int* tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) tot[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = tot[lane];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        tot[lane] = w;                                            // inclusive over the warps
    }
    __syncthreads();
    return (warp ? tot[warp - 1] : 0) + incl - x;
}

// The workspace's parts (layout at the top of the file), where encoder_bwd_sort writes them and the run
// kernels read them: EncLayout the places alone, EncRuns also the counts the sort left (U, valid).
struct EncLayout {
    int *pos, *seg_id, *seg_start, *nseg, *ends;
    float* pieces;            // [2][chunks][C]
    int chunks;
    __device__ __forceinline__ EncLayout(int* ws, int N) {
        chunks = (N + 31) / 32;
        pos = ws;
        seg_id = ws + N;
        seg_start = ws + 2 * N;
        nseg = ws + 3 * N + 1;
        ends = ws + 3 * N + 2;
        pieces = reinterpret_cast<float*>(ws + ((3 * N + 2 + 2 * chunks + 3) & ~3));
    }
};
struct EncRuns : EncLayout {
    int U, valid;
    __device__ __forceinline__ EncRuns(int* ws, int N) : EncLayout(ws, N) {
        U = *nseg;
        valid = seg_start[U];
    }
};

// grid 1, block THREADS (= 1024, 32 warps: enc_block_scan), dynamic shared memory SMEM =
// 4 * (enc_pad(E * THREADS) + enc_pad(BINS * THREADS)) bytes, BINS = 2^DIGIT.
// A stable LSD radix sort (DIGIT-bit digits, `passes` of them: bits of V) of the keys
// (id << nbits) | n, n < 2^nbits, by their id (ids outside [0, V) become V: sorted last, dropped).
// Thread t owns the slots [t*E, t*E + E) (E a power of two, E * THREADS >= N): keys in
// registers, digit counters in the column t of cnt[digit][thread], scanned digit-major so that
// a digit's keys keep the order of their slots: stable, so ids increasing and n increasing in an
// id. The padded layouts (enc_pad) keep the column and row accesses free of bank conflicts.
// Then the runs of equal id are compacted into the workspace (layout at the top of the file).
template <int E, int THREADS, int DIGIT, int SMEM>
__global__ void __launch_bounds__(THREADS)
encoder_bwd_sort(int* __restrict__ ws,            // the workspace (pos .. ends: layout at the top)
                 const int* __restrict__ idx,     // idx [N]
                 int N, int V, int nbits, int passes) {
    constexpr int TH = THREADS, BINS = 1 << DIGIT;
    static_assert(TH == 1024, "enc_block_scan: 32 warps");
    static_assert(SMEM == 4 * ((E * TH + (E * TH >> 5)) + (BINS * TH + (BINS * TH >> 5))),
                  "keys and digit counters, padded (enc_pad)");
    extern __shared__ u32 enc_smem[];
    u32* keys = enc_smem;                                         // [enc_pad(E * TH)]
    int* cnt = reinterpret_cast<int*>(enc_smem + enc_pad(E * TH)); // [enc_pad(BINS * TH)]
    __shared__ int tot[32];
    __shared__ int s_valid;
    const int tid = threadIdx.x;
    const int first = tid * E;
    if (tid == 0) s_valid = 0;
    u32 kk[E];
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int i = first + k;
        kk[k] = 0u;
        if (i < N) {
            int id = idx[i];
            if ((unsigned)id >= (unsigned)V) id = V;
            kk[k] = ((u32)id << nbits) | (u32)i;
        }
    }
    for (int pass = 0; pass < passes; ++pass) {
        const int shift = nbits + DIGIT * pass;
#pragma unroll
        for (int d = 0; d < BINS; ++d) cnt[enc_pad(d * TH + tid)] = 0;
#pragma unroll
        for (int k = 0; k < E; ++k)
            if (first + k < N) cnt[enc_pad((int)((kk[k] >> shift) & (BINS - 1)) * TH + tid)] += 1;
        __syncthreads();
        // exclusive scan of cnt in digit-major order: thread t owns the flat entries [t*BINS, t*BINS + BINS)
        int s = 0;
#pragma unroll
        for (int j = 0; j < BINS; ++j) s += cnt[enc_pad(tid * BINS + j)];
        int pre = enc_block_scan(s, tot);
#pragma unroll
        for (int j = 0; j < BINS; ++j) {
            const int f = enc_pad(tid * BINS + j);
            const int c = cnt[f];
            cnt[f] = pre;
            pre += c;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < E; ++k) {
            if (first + k < N) {
                const int f = enc_pad((int)((kk[k] >> shift) & (BINS - 1)) * TH + tid);
                const int p = cnt[f];
                cnt[f] = p + 1;
                keys[enc_pad(p)] = kk[k];
            }
        }
        __syncthreads();
        if (pass + 1 < passes) {
#pragma unroll
            for (int k = 0; k < E; ++k)
                if (first + k < N) kk[k] = keys[enc_pad(first + k)];
        }
    }
    // keys: sorted; runs of equal id start at the heads (read back from shared memory, not kk:
    // fewer live registers)
    const u32 vkey = (u32)V << nbits;                             // keys >= vkey: dropped ids
    int heads = 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int i = first + k;
        const u32 key = i < N ? keys[enc_pad(i)] : vkey;
        if (key < vkey) {
            if (i == 0 || (keys[enc_pad(i - 1)] >> nbits) != (key >> nbits)) ++heads;
            if (i + 1 == N || keys[enc_pad(i + 1)] >= vkey) s_valid = i + 1;   // one writer
        }
    }
    int u = enc_block_scan(heads, tot);
    const EncLayout L(ws, N);
    int *pos = L.pos, *seg_id = L.seg_id, *seg_start = L.seg_start, *ends = L.ends;   // ends [2][chunks]
    const int chunks = L.chunks;
    const u32 mask = (1u << nbits) - 1u;
#pragma unroll
    for (int k = 0; k < E; ++k) {
        const int i = first + k;
        const u32 key = i < N ? keys[enc_pad(i)] : vkey;
        if (key < vkey) {
            pos[i] = (int)(key & mask);
            if (i == 0 || (keys[enc_pad(i - 1)] >> nbits) != (key >> nbits)) {
                seg_id[u] = (int)(key >> nbits);
                seg_start[u] = i;
                ++u;
            }
            if ((i & 31) == 0) ends[i >> 5] = u - 1;
            if ((i & 31) == 31 || i + 1 == N || keys[enc_pad(i + 1)] >= vkey) ends[chunks + (i >> 5)] = u - 1;
        }
    }
    if (tid == 0) {
        const int U = tot[31];
        seg_start[U] = s_valid;
        *L.nseg = U;
    }
}

// acc += the items k0 .. k1 - 1 (warp-uniform) at at(k), VEC values of lane l's columns each (active: inside
// C): ENC_SEG_UNROLL items loaded together (zeros past k1 or outside C), then added in order of k. Every
// lane calls at(k) for every k of a group (it may shuffle). The run kernels' one summing loop: dout rows
// (enc_sum_rows) and a long run's pieces (encoder_bwd_wte_seg).
template <int VEC, class At>
__device__ __forceinline__ void enc_sum_items(float (&acc)[VEC], int k0, int k1, bool active, At at) {
    for (int k = k0; k < k1; k += ENC_SEG_UNROLL) {
        float a[ENC_SEG_UNROLL][VEC];
#pragma unroll
        for (int q = 0; q < ENC_SEG_UNROLL; ++q) {
            const auto p = at(k + q);
            if (active && k + q < k1) {
                enc_load<VEC>(a[q], p);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) a[q][e] = 0.f;
            }
        }
#pragma unroll
        for (int q = 0; q < ENC_SEG_UNROLL; ++q) {
            if (k + q < k1) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] += a[q][e];
            }
        }
    }
}

// acc += the dout rows of entries k0 .. k1 - 1 (warp-uniform, 0 <= k0 <= k1 <= 32) of a batch of 32
// entries of pos, lane l holding entry l's token position in `mine`, added in entry order (so in
// increasing n). Lane l's columns c .. c + VEC (active: inside C).
template <int VEC, class TD>
__device__ __forceinline__ void enc_sum_rows(float (&acc)[VEC], const TD* __restrict__ dout, int mine, int k0, int k1,
                                             int C, int c, bool active) {
    enc_sum_items<VEC>(acc, k0, k1, active,
                       [&](int k) { return dout + (long long)__shfl_sync(0xffffffffu, mine, k & 31) * C + c; });
}

// grid G (any; the launcher: a few blocks an SM), block WARPS*32. Warp-items it = j * tiles + tile over
// the chunks j of 32 entries of pos (those holding valid entries), taken grid-stride by the warps: the
// pieces of the long runs (more than ENC_LONG rows) that the chunk meets, each summed in increasing n
// from 0 (enc_sum_rows): the chunk's first entry's run into pieces[0][j], the last entry's into
// pieces[1][j] where that run begins inside the chunk. Lane l owns columns tile*32*VEC + l*VEC .. +VEC.
template <int VEC, int WARPS, int TD>
__global__ void __launch_bounds__(WARPS * 32)
encoder_bwd_wte_long(const elem<TD>* __restrict__ dout,   // dout [N, C]
                     int* __restrict__ ws,                // encoder_bwd_sort's output (its pieces written)
                     int N, int C, int tiles) {
    const EncRuns r(ws, N);
    const int lane = threadIdx.x & 31;
    const long long items = (long long)((r.valid + 31) / 32) * tiles;
    const long long step = (long long)gridDim.x * WARPS;
    for (long long it = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); it < items; it += step) {
        const int j = (int)(it / tiles);
        const int tile = (int)(it - (long long)j * tiles);
        const int i0 = 32 * j, cnt = min(32, r.valid - i0);
        const int mine = lane < cnt ? r.pos[i0 + lane] : 0;
        const int u0 = r.ends[j], u1 = r.ends[r.chunks + j];          // the runs of its first and last entries
        const int a1 = r.seg_start[u0 + 1], b0 = r.seg_start[u1];
        const bool first = a1 - r.seg_start[u0] > ENC_LONG, last = u1 != u0 && r.seg_start[u1 + 1] - b0 > ENC_LONG;
        const int c = tile * 32 * VEC + lane * VEC;
        const bool active = c < C;
        // the chunk's entries k0 .. k1 - 1 summed from 0 into pieces row `row`
        const auto piece = [&](int k0, int k1, long long row) {
            float acc[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
            enc_sum_rows<VEC>(acc, dout, mine, k0, k1, C, c, active);
            if (active) enc_store<VEC>(r.pieces + row * C + c, acc);
        };
        if (first) piece(0, min(cnt, a1 - i0), j);
        if (last) piece(b0 - i0, cnt, (long long)r.chunks + j);
    }
}

// grid G (any; the launcher: a few blocks an SM), block WARPS*32. Warp-items it = u * tiles + tile over the U runs of the
// workspace, taken grid-stride by the warps. Lane l owns columns tile*32*VEC + l*VEC .. +VEC; the
// run's positions (at most ENC_LONG = 32: one a lane) and enc_sum_rows adds their rows. A long run
// adds its pieces instead, in chunk order, ENC_SEG_UNROLL of them loaded together.
template <int VEC, int WARPS, int TD, int TG = 0>
__global__ void __launch_bounds__(WARPS * 32)
encoder_bwd_wte_seg(elem<TG>* __restrict__ dwte,         // dwte [V, C]   (+=, rows of present ids)
                    const elem<TD>* __restrict__ dout,   // dout [N, C]
                    int* __restrict__ ws,                // encoder_bwd_sort's output, encoder_bwd_wte_long's pieces
                    int N, int C, int tiles) {
    const EncRuns r(ws, N);
    const int lane = threadIdx.x & 31;
    const long long items = (long long)r.U * tiles;
    const long long step = (long long)gridDim.x * WARPS;
    for (long long it = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); it < items; it += step) {
        const int u = (int)(it / tiles);
        const int tile = (int)(it - (long long)u * tiles);
        const int c = tile * 32 * VEC + lane * VEC;
        const bool active = c < C;               // VEC == 4 implies C % 4 == 0: all or nothing
        const int s0 = r.seg_start[u], s1 = r.seg_start[u + 1];
        const int v = r.seg_id[u];
        elem<TG>* d = dwte + (long long)v * C + c;
        float dv[VEC];
        if (active) enc_load<VEC>(dv, d);                        // in flight during the sum
        float acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = 0.f;
        if (s1 - s0 > ENC_LONG) {                                // its pieces: chunk j0's, then j0 + 1 .. j1's firsts
            const int j0 = s0 >> 5, j1 = (s1 - 1) >> 5;
            const float* p0 = r.pieces + ((s0 & 31) ? (long long)r.chunks + j0 : (long long)j0) * C + c;
            enc_sum_items<VEC>(acc, j0, j1 + 1, active,
                               [&](int j) { return j == j0 ? p0 : r.pieces + (long long)j * C + c; });
        } else {                                                 // its rows (at most 32: one load a lane)
            enc_sum_rows<VEC>(acc, dout, s0 + lane < s1 ? r.pos[s0 + lane] : 0, 0, s1 - s0, C, c, active);
        }
        if (active) {
#pragma unroll
            for (int q = 0; q < VEC; ++q) dv[q] = dv[q] + acc[q];
            enc_store<VEC>(d, dv);
        }
    }
}

// One thread per VEC columns of one position t of dwpe; sums the batch in order b = 0..B-1.
template <int VEC, int THREADS, int TD, int TG = 0>
__global__ void __launch_bounds__(THREADS)
encoder_bwd_wpe(elem<TG>* __restrict__ dwpe,         // dwpe [Tmax, C]  (=)
                const elem<TD>* __restrict__ dout,   // dout [B, T, C]
                int B, int T, int Tmax, int C) {
    const int CV = C / VEC;
    const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
    if (i >= (long long)Tmax * CV) return;
    const int t = (int)(i / CV);
    const int c = (int)(i - (long long)t * CV) * VEC;
    float s[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) s[k] = 0.f;
    if (t < T) {
        const long long stride = (long long)T * C;
        const elem<TD>* p = dout + (long long)t * C + c;
        for (int b = 0; b < B; ++b) {
            float a[VEC];
            enc_load<VEC>(a, p + b * stride);
#pragma unroll
            for (int k = 0; k < VEC; ++k) s[k] += a[k];
        }
    }
    enc_store<VEC>(dwpe + (long long)t * C + c, s);
}
