"""Launchers of kernels/encoder.cu: token + position embedding forward and backward.

    encoder_fwd(rt, out[B,T,C], idx[B,T] i32, wte[V,C], wpe[Tmax,C])     out = wte[idx] + wpe[t]
    encoder_bwd(rt, dwte[V,C], dwpe[Tmax,C], dout[B,T,C], idx[B,T])      dwte += ; dwpe = (t >= T zeroed)

Element types (the views' dtypes pick the kernel, FWD_TYPES / BWD_TYPES; another combination is a
ValueError): fp32 throughout, or a bf16 model's: wte and wpe its bf16 working copy, out bf16 or fp32;
dout bf16 (or fp32) into the fp32 dwte, dwpe, or (bf16 gradients) bf16 dout into bf16 dwte, dwpe. The
sums are fp32; a bf16 out is rounded once (dwte's rows: their old value plus the sum, rounded).

The backward is deterministic without float atomics: each (v, column) of dwte is read, added to
and written once, with a summation order fixed by idx alone (see the kernel file). dwte's rows
that no token uses are left bitwise as they were by the sorted path. Two ways (`bwd_wte_method`):
  "scan"  encoder_bwd_wte: a block per (vocabulary row, 32*VEC-column tile) scanning all N ids;
          V * tiles * N id reads, the quicker for small vocabularies (the char model's V = 65).
  "sort"  encoder_bwd_sort (one block radix-sorts the N positions by id in shared memory into the
          workspace WORKSPACE, workspace_ints(N, C) i32: the runs of the ids present), then
          encoder_bwd_wte_long (the runs of more than 32 rows, text's frequent tokens, summed in
          pieces of the sorted order's 32-entry chunks, a warp a chunk and column tile) and
          encoder_bwd_wte_seg (a warp per (run, column tile) sums its dout rows in increasing n, or a
          long run its pieces in order, and adds the sum to dwte once): ~N*C floats read whatever V
          is, and no warp walks a run of thousands of rows. Used when the scan would cost more than
          SCAN_MAX_WORK id reads (GPT-2's V = 50304), N <= SORT_MAX_TOKENS and (V+1) << nbits <= 2^32
          (nbits: the bits of N - 1).
          Needs the workspace `workspace(cfg)` plans (rt.workspace(WORKSPACE)); capturable in a
          CUDA graph (the run count U stays on the device; the grid is sized for U = N).
`method=` forces one ("scan" / "sort") for tests and benchmarks.
"""
from __future__ import annotations

from gptcuda.runtime import RuntimeProtocol, i32
from gptcuda.ops.cuda import aligned4, cdiv, element_types, expression, optional_code, sm_count, type_codes

FILE = "encoder.cu"
# The kernels' geometry, passed as template arguments (the names below): blocks of the elementwise
# kernels, of encoder_bwd_wte (warps) and of the sorted path (the sort's threads, asserted 1024: its
# block scan; the run kernel's warps), and the sort's digit width.
THREADS = 256
BWD_WARPS = 16
SORT_THREADS = 1024
SEG_WARPS = 8
SEG_BLOCKS_PER_SM = 4  # the run kernel's grid: resident blocks (59 registers), warps stride over the runs
SORT_DIGIT = 4        # radix bits a pass
SORT_BINS = 1 << SORT_DIGIT
SORT_KEYS = (1, 2, 4, 8, 16, 32)   # encoder_bwd_sort<E>: E keys a thread, N <= E * SORT_THREADS
SORT_MAX_TOKENS = SORT_KEYS[-1] * SORT_THREADS   # 32768: 203 KB of shared memory
# The scan kernel reads V * tiles * N ids (measured on the H200: ~2.1e6 block-ids a microsecond,
# 1.17 ms at V 50304, 6 tiles, N 8192); above this it loses to the ~15-25 us of the sorted path.
SCAN_MAX_WORK = 1 << 25
WORKSPACE = "encoder_buckets"

_BLOCK = {"encoder_fwd": THREADS, "encoder_bwd_wte": BWD_WARPS, "encoder_bwd_wte_long": SEG_WARPS,
          "encoder_bwd_wte_seg": SEG_WARPS, "encoder_bwd_wpe": THREADS}
# The element types there are kernels for: (wte, wpe, out) of the forward, (dwte, dwpe, dout) of the
# backward: fp32, and a bf16 model's (its working copy read; the embedding's output, and so its
# gradient, bf16 or fp32 as the model keeps that tensor)
FWD_TYPES = (("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("bf16", "bf16", "f32"))
BWD_TYPES = (("f32", "f32", "f32"), ("f32", "f32", "bf16"), ("bf16", "bf16", "bf16"))    # (bf16 gradients)


def enc_name(kernel: str, vec: int, codes=None) -> str:
    """encoder_fwd <VEC, THREADS, TW, TO>, encoder_bwd_wpe <VEC, THREADS, TD[, TG]>, encoder_bwd_wte / _seg
    <VEC, WARPS, TD[, TG]>, encoder_bwd_wte_long <VEC, WARPS, TD>: codes the element types' (DTYPE_CODES:
    (TW, TO), or (TD,) and (TD, TG) where the gradients are bf16), fp32 unless given."""
    if codes is None:
        codes = (0, 0) if kernel == "encoder_fwd" else (0,)
    return expression(kernel, vec, _BLOCK[kernel], *codes)


def bwd_codes(kernel: str, types) -> tuple:
    """A backward kernel's element type codes for (dwte, dwpe, dout) types: (TD,), and TG where the
    gradients are bf16 (encoder_bwd_wte_long writes no gradient)."""
    return type_codes(types[2:]) + (() if kernel == "encoder_bwd_wte_long" else optional_code(types[0]))


def _sort_kernel(e: int) -> tuple:
    """(name expression, dynamic shared bytes) of encoder_bwd_sort<E, SORT_THREADS, SORT_DIGIT, SMEM>:
    the keys and the digit counters, each padded a word every 32 (enc_pad)."""
    smem = 4 * (_pad(e * SORT_THREADS) + _pad(SORT_BINS * SORT_THREADS))
    return expression("encoder_bwd_sort", e, SORT_THREADS, SORT_DIGIT, smem), smem


def _pad(i: int) -> int:
    return i + (i >> 5)          # enc_pad


VARIANTS = ([(FILE, enc_name("encoder_fwd", vec, type_codes(t[1:])), {}) for t in FWD_TYPES for vec in (4, 1)]
            + [(FILE, n, {}) for n in dict.fromkeys(enc_name(k, vec, bwd_codes(k, t)) for k in _BLOCK
                                                     if k != "encoder_fwd" for t in BWD_TYPES for vec in (4, 1))]
            + [(FILE, _sort_kernel(e)[0], {}) for e in SORT_KEYS])


def workspace_ints(N: int, C: int) -> int:
    """i32 words of the sorted path's workspace for N tokens of width C: pos[N], seg_id[N], seg_start[N+1],
    U, the runs at the ends of each 32-entry chunk [2, K] (K = ceil(N / 32)), padding to 4 words, then the
    long runs' pieces: fp32 [2, K, C] (encoder.cu EncLayout, which the kernels share)."""
    K = cdiv(N, 32)
    return (3 * N + 2 + 2 * K + 3) // 4 * 4 + 2 * K * C


def workspace(cfg, ex=None) -> dict:
    """The sorted backward's buckets for batch_size * block_size tokens (the vocabulary may not be
    known yet, so planned whenever N allows the sorted path; 1.7 MB at N = 8192, C = 768)."""
    N = int(cfg.batch_size) * int(cfg.block_size)
    if N > SORT_MAX_TOKENS:
        return {}
    return {WORKSPACE: ((workspace_ints(N, int(cfg.n_embd)),), "i32")}


def _key_bits(N: int) -> int:
    return max(N - 1, 0).bit_length()


def _sortable(N: int, V: int) -> bool:
    return 1 <= N <= SORT_MAX_TOKENS and ((V + 1) << _key_bits(N)) <= 2 ** 32


def sort_plan(N: int, V: int):
    """(kernel name, dynamic shared bytes, nbits, passes) of encoder_bwd_sort for N tokens."""
    name, smem = _sort_kernel(next(e for e in SORT_KEYS if e * SORT_THREADS >= N))
    return name, smem, _key_bits(N), cdiv(V.bit_length(), SORT_DIGIT)


def bwd_wte_method(N: int, C: int, V: int, vec: int = 4) -> str:
    """"scan" or "sort" for dwte (see the module docstring)."""
    if not _sortable(N, V):
        return "scan"
    tiles = cdiv(C, 32 * vec)
    return "scan" if V * tiles * N <= SCAN_MAX_WORK else "sort"


def _check_idx(idx, out_lead):
    if idx.dtype != "i32":
        raise TypeError(f"encoder: token ids must be i32, got {idx.dtype}")
    if len(idx.shape) != 2 or tuple(idx.shape) != tuple(out_lead):
        raise ValueError(f"encoder: idx {idx.shape} does not match the leading dims {tuple(out_lead)}")


def encoder_fwd(rt: RuntimeProtocol, out, idx, wte, wpe):
    B, T = int(idx.shape[0]), int(idx.shape[1])
    V, C = int(wte.shape[0]), int(wte.shape[1])
    Tmax = int(wpe.shape[0])
    _check_idx(idx, out.shape[:-1])
    if int(out.shape[-1]) != C or int(wpe.shape[1]) != C:
        raise ValueError(f"encoder_fwd: widths differ: out {out.shape}, wte {wte.shape}, wpe {wpe.shape}")
    if T > Tmax:
        raise ValueError(f"encoder_fwd: sequence length {T} exceeds wpe rows {Tmax}")
    _, tw, to = element_types("encoder_fwd", FWD_TYPES, wte=wte, wpe=wpe, out=out)
    N = B * T
    vec = 4 if C % 4 == 0 and aligned4(out, wte, wpe) else 1
    fn = rt.function(FILE, enc_name("encoder_fwd", vec, (tw, to)))
    total = N * (C // vec)
    rt.launch(fn, (cdiv(total, THREADS),), (THREADS,),
              [out, idx, wte, wpe, i32(N), i32(T), i32(C), i32(V)], label="encoder_fwd")


def _bucket_workspace(rt: RuntimeProtocol, N, V, C):
    need = workspace_ints(N, C)
    try:
        ws = rt.workspace(WORKSPACE)
    except KeyError:
        raise KeyError(f"encoder_bwd: the sorted dwte path (V {V}, N {N}) needs the workspace {WORKSPACE!r} "
                       f"of {need} i32 that encoder.workspace(cfg) plans; it was not planned "
                       f"(rt.set_workspace)") from None
    if ws.dtype != "i32" or ws.numel < need:
        raise ValueError(f"encoder_bwd: workspace {WORKSPACE} {ws.shape} {ws.dtype} must hold {need} i32 "
                         f"for N = {N} tokens of width {C}")
    return ws


def encoder_bwd(rt: RuntimeProtocol, dwte, dwpe, dout, idx, *, method=None):
    B, T = int(idx.shape[0]), int(idx.shape[1])
    V, C = int(dwte.shape[0]), int(dwte.shape[1])
    Tmax = int(dwpe.shape[0])
    _check_idx(idx, dout.shape[:-1])
    if int(dout.shape[-1]) != C or int(dwpe.shape[1]) != C:
        raise ValueError(f"encoder_bwd: widths differ: dout {dout.shape}, dwte {dwte.shape}, dwpe {dwpe.shape}")
    if T > Tmax:
        raise ValueError(f"encoder_bwd: sequence length {T} exceeds wpe rows {Tmax}")
    element_types("encoder_bwd", BWD_TYPES, dwte=dwte, dwpe=dwpe, dout=dout)
    types = (dwte.dtype, dwpe.dtype, dout.dtype)
    N = B * T
    vec = 4 if C % 4 == 0 and aligned4(dwte, dout) else 1
    tiles = cdiv(C, 32 * vec)
    method = method or bwd_wte_method(N, C, V, vec)
    if method == "sort":
        if not _sortable(N, V):
            raise ValueError(f"encoder_bwd: the sorted path takes 1 <= N <= {SORT_MAX_TOKENS} tokens and "
                             f"(V+1) << bits(N-1) <= 2^32 (N {N}, V {V})")
        ws = _bucket_workspace(rt, N, V, C)
        name, smem, nbits, passes = sort_plan(N, V)
        rt.launch(rt.function(FILE, name), (1,), (SORT_THREADS,),
                  [ws, idx, i32(N), i32(V), i32(nbits), i32(passes)], smem=smem, label="encoder_bwd_sort")

        def run_kernel(kernel, items, args):     # a few blocks an SM, their warps striding over `items`
            grid = max(1, min(SEG_BLOCKS_PER_SM * sm_count(rt), cdiv(items, SEG_WARPS)))
            rt.launch(rt.function(FILE, enc_name(kernel, vec, bwd_codes(kernel, types))), (grid,), (SEG_WARPS * 32,),
                      args + [i32(N), i32(C), i32(tiles)], label=kernel)
        run_kernel("encoder_bwd_wte_long", cdiv(N, 32) * tiles, [dout, ws])      # (chunk, tile) items
        run_kernel("encoder_bwd_wte_seg", N * tiles, [dwte, dout, ws])           # (run, tile) items
    elif method == "scan":
        fn = rt.function(FILE, enc_name("encoder_bwd_wte", vec, bwd_codes("encoder_bwd_wte", types)))
        rt.launch(fn, (V, tiles), (BWD_WARPS * 32,),
                  [dwte, dout, idx, i32(N), i32(C)], label="encoder_bwd_wte")
    else:
        raise ValueError(f"encoder_bwd: method {method!r} is not 'scan' or 'sort'")
    vec = 4 if C % 4 == 0 and aligned4(dwpe, dout) else 1
    fn = rt.function(FILE, enc_name("encoder_bwd_wpe", vec, bwd_codes("encoder_bwd_wpe", types)))
    total = Tmax * (C // vec)
    rt.launch(fn, (cdiv(total, THREADS),), (THREADS,),
              [dwpe, dout, i32(B), i32(T), i32(Tmax), i32(C)], label="encoder_bwd_wpe")
