"""Launchers of kernels/decode.cu: generation with a KV cache, the next token drawn on the device.

    decode_embed(rt, out[S,C], ctx[S,T+1], wte[V,C], wpe[Tmax,C], pos[1])   out = wte[ctx[:, pos]] + wpe[pos]
    decode_attention(rt, y[S,C], qkv[S,3C], kcache, vcache, n_head, pos, part)
        kcache/vcache [S,H,Tmax,hs]: this position's k, v are appended at pos, then y is the
        softmax(q k^T / sqrt(hs)) v over keys 0..pos (the causal row of the full attention), in
        chunks of ATT_CHUNK keys whose partial results (part [S,H,chunks,hs+2]) a second kernel merges.
    decode_sample(rt, g, logits[S,Vp], pos, n_vocab)
        g: the generation state of memory.plan_decode (ctx, fill, out, n_out, done, emit, opts, stop);
        draws each sequence's next token from logits[:, :n_vocab] (the rules in kernels/decode.cu)
    decode_advance(rt, pos, T)                                           pos = (pos + 1) % T
    decode_linear(rt, out[M,N], a[M,K], w[N,K], bias, epilogue, aux)   matmul(out, a, w, trans_b=True, ...)
        up to LINEAR_ROWS rows: a warp a column, each weight read once (a decode step is memory bound);
        more rows: the GEMM (gemm.matmul)

Element types, chosen by the views' dtypes: fp32 throughout, or a bf16 generation's (memory.plan_decode
dtype bf16): the weights (the bf16 working copy) and the activations the products read (a) bf16, the
products' outputs fp32 (qkv, the residual stream, the logits) or bf16 (the GELU output and its saved
pre-activation), the KV cache and the attention's output y bf16, qkv and the partial results fp32. The
bias, the layernorm parameters, the embeddings and every sum stay fp32.
"""
from __future__ import annotations

import math

from gptcuda.ops.cuda import cdiv, expression, fp32_only, gemm, kernel_types, type_codes
from gptcuda.model.memory import DECODE_ATT_CHUNK as ATT_CHUNK
from gptcuda.runtime import RuntimeProtocol, f32, i32

FILE = "decode.cu"
HEAD_SIZES = (16, 32, 64, 128)
# The kernels' geometry, passed as their template arguments (the names below); each kernel asserts
# what its code fixes.
EMBED_THREADS = 256
SAMPLE_THREADS = 1024                  # the radix select: two of its 2048 bins a thread (asserted)
ATT_THREADS = 128                      # the split attention's block; ATT_CHUNK keys a block
LINEAR_ROWS = (1, 4, 16)                # decode_linear's row tiles (MT); more rows go to the GEMM
LINEAR_BLOCK_COLS = {1: 2, 4: 4, 16: 2}  # columns a block (its LinearShape: npw * groups, asserted)
LINEAR_WARPS = 8
LINEAR_EPILOGUES = {"none": 0, "gelu": 2, "residual": 3}    # gemm_epilogue.cuh GEMM_EPI_*
EMBED_NAME = expression("decode_embed", EMBED_THREADS)
SAMPLE_NAME = expression("decode_sample", SAMPLE_THREADS)
# The dtypes each kernel is compiled for, in the order of its views: decode_linear (a, w, out; aux is
# out's type): fp32, or bf16 operands into fp32 (qkv, the residual stream, the logits) or into bf16 (the
# GELU output); the attention (qkv, kcache, vcache, y): fp32, or qkv fp32 with a bf16 cache and output.
LINEAR_TYPES = (("f32", "f32", "f32"), ("bf16", "bf16", "f32"), ("bf16", "bf16", "bf16"))
ATT_TYPES = (("f32", "f32", "f32", "f32"), ("f32", "bf16", "bf16", "bf16"))


def attention_names(hs: int, types=ATT_TYPES[0]) -> tuple:
    """decode_attention<HS, ATT_THREADS, ATT_CHUNK, KT> and decode_attention_combine<HS, THREADS,
    ATT_CHUNK, YT> (a thread a dimension, a warp at least) for the dtypes `types` (ATT_TYPES: the cache's
    KT, y's YT), and the combine's threads."""
    threads = max(hs, 32)
    _, kt, _, yt = type_codes(types)
    return (expression("decode_attention", hs, ATT_THREADS, ATT_CHUNK, kt),
            expression("decode_attention_combine", hs, threads, ATT_CHUNK, yt), threads)


def linear_name(mt: int, epi: int, types=LINEAR_TYPES[0]) -> str:
    """decode_linear<MT, EPI, WARPS, COLS, DT, OUT> for the dtypes (a, w, out) of LINEAR_TYPES."""
    dt, _, out = type_codes(types)
    return expression("decode_linear", mt, epi, LINEAR_WARPS, LINEAR_BLOCK_COLS[mt], dt, out, sep=", ")


VARIANTS = ([(FILE, EMBED_NAME, {}), (FILE, SAMPLE_NAME, {}), (FILE, "decode_advance", {})]
            + [(FILE, n, {}) for types in ATT_TYPES for hs in HEAD_SIZES for n in attention_names(hs, types)[:2]]
            + [(FILE, linear_name(mt, e, types), {}) for types in LINEAR_TYPES for mt in LINEAR_ROWS
               for e in LINEAR_EPILOGUES.values()])


def decode_embed(rt: RuntimeProtocol, out, ctx, wte, wpe, pos):
    S, C = int(out.shape[0]), int(out.shape[-1])
    T = int(ctx.shape[1]) - 1
    fp32_only("decode_embed", out=out, wte=wte, wpe=wpe)       # a row a sequence: the fp32 parameters
    rt.launch(rt.function(FILE, EMBED_NAME), (cdiv(S * C, EMBED_THREADS),), (EMBED_THREADS,),
              [out, ctx, wte, wpe, pos, i32(S), i32(C), i32(T)], label="decode_embed")


def attention_chunks(Tmax: int) -> int:
    """Key chunks of the split attention (ATT_CHUNK keys each)."""
    return cdiv(int(Tmax), ATT_CHUNK)


def decode_attention(rt: RuntimeProtocol, y, qkv, kcache, vcache, n_head, pos, part):
    S, C = int(y.shape[0]), int(y.shape[-1])
    hs = C // n_head
    if hs not in HEAD_SIZES:
        raise ValueError(f"decode attention supports head sizes {HEAD_SIZES}, got {hs}")
    Tmax = int(kcache.shape[2])
    n = attention_chunks(Tmax)
    if tuple(part.shape) != (S, n_head, n, hs + 2):
        raise ValueError(f"decode_attention: part {part.shape}, expected {(S, n_head, n, hs + 2)}")
    types = kernel_types("decode_attention", ATT_TYPES, qkv=qkv, kcache=kcache, vcache=vcache, y=y)
    att, combine, combine_threads = attention_names(hs, types)
    rt.launch(rt.function(FILE, att), (n, n_head, S), (ATT_THREADS,),
              [part, qkv, kcache, vcache, pos, i32(n_head), i32(Tmax), f32(1.0 / math.sqrt(hs))],
              label="decode_attention")
    rt.launch(rt.function(FILE, combine), (n_head, S), (combine_threads,),
              [y, part, pos, i32(n_head), i32(n)], label="decode_attention_combine")


def decode_sample(rt: RuntimeProtocol, g, logits, pos, n_vocab):
    S, Vp = int(logits.shape[0]), int(logits.shape[1])
    T, N = int(g["ctx"].shape[1]) - 1, int(g["out"].shape[1])
    if not 0 < n_vocab <= Vp:
        raise ValueError(f"decode_sample: n_vocab {n_vocab} must be in 1..{Vp}")
    if logits.dtype != "f32":
        raise ValueError(f"decode_sample: logits must be f32 (the draw reads fp32 logits), got {logits.dtype}")
    rt.launch(rt.function(FILE, SAMPLE_NAME), (S,), (SAMPLE_THREADS,),
              [g["ctx"], g["fill"], g["out"], g["n_out"], g["done"], g["emit"], logits, pos, g["opts"], g["stop"],
               i32(S), i32(Vp), i32(n_vocab), i32(T), i32(N)], label="decode_sample")


def decode_advance(rt: RuntimeProtocol, pos, T):
    rt.launch(rt.function(FILE, "decode_advance"), (1,), (1,), [pos, i32(T)], label="decode_advance")


def decode_linear(rt: RuntimeProtocol, out, a, w, bias=None, epilogue="none", aux=None):
    M, K = int(a.shape[0]), int(a.shape[-1])
    N = int(w.shape[0])
    if M > LINEAR_ROWS[-1]:
        gemm.matmul(rt, out, a, w, False, True, bias=bias, epilogue=epilogue, aux=aux)
        return
    if epilogue not in LINEAR_EPILOGUES:
        raise ValueError(f"decode_linear: epilogue {epilogue!r} (one of {tuple(LINEAR_EPILOGUES)})")
    if (epilogue != "none") != (aux is not None) or tuple(out.shape) != (M, N) or int(w.shape[1]) != K:
        raise ValueError(f"decode_linear: out {out.shape}, a {a.shape}, w {w.shape}, epilogue {epilogue}, "
                         f"aux {'given' if aux is not None else 'none'}")
    types = kernel_types("decode_linear", LINEAR_TYPES, a=a, w=w, out=out)
    if aux is not None and aux.dtype != out.dtype:
        raise ValueError(f"decode_linear: aux {aux.dtype} must be of out's type ({out.dtype})")
    fp32_only("decode_linear", bias=bias)
    mt = next(r for r in LINEAR_ROWS if M <= r)
    cols = LINEAR_BLOCK_COLS[mt]
    rt.launch(rt.function(FILE, linear_name(mt, LINEAR_EPILOGUES[epilogue], types)), (cdiv(N, cols),),
              (32 * LINEAR_WARPS,), [out, aux, a, w, bias, i32(M), i32(N), i32(K)], label="decode_linear")
