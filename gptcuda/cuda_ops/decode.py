"""Launchers of kernels/decode.cu: generation with a KV cache.

    decode_embed(rt, out[S,C], tok[S], wte[V,C], wpe[Tmax,C], pos[1])   out = wte[tok] + wpe[pos]
    decode_attention(rt, y[S,C], qkv[S,3C], kcache, vcache, n_head, pos)
        kcache/vcache [S,H,Tmax,hs]: this position's k, v are appended at pos, then y is the
        softmax(q k^T / sqrt(hs)) v over keys 0..pos (the causal row of the full attention).
    pos_advance(rt, pos)                                                 pos += 1
"""
from __future__ import annotations

import math

from ..runtime import f32, i32

FILE = "decode.cu"
HEAD_SIZES = (16, 32, 64, 128)
VARIANTS = ([(FILE, "decode_embed", {}), (FILE, "pos_advance", {})]
            + [(FILE, f"decode_attention<{hs}>", {}) for hs in HEAD_SIZES])


def decode_embed(rt, out, tok, wte, wpe, pos):
    S, C = int(out.shape[0]), int(out.shape[-1])
    rt.launch(rt.function(FILE, "decode_embed"), (-(-S * C // 256),), (256,),
              [out, tok, wte, wpe, pos, i32(S), i32(C)], label="decode_embed")


def decode_attention(rt, y, qkv, kcache, vcache, n_head, pos):
    S, C = int(y.shape[0]), int(y.shape[-1])
    hs = C // n_head
    if hs not in HEAD_SIZES:
        raise ValueError(f"decode attention supports head sizes {HEAD_SIZES}, got {hs}")
    Tmax = int(kcache.shape[2])
    smem = 4 * (hs + Tmax)
    rt.launch(rt.function(FILE, f"decode_attention<{hs}>"), (n_head, S), (128,),
              [y, qkv, kcache, vcache, pos, i32(n_head), i32(Tmax), f32(1.0 / math.sqrt(hs))],
              smem=smem, label="decode_attention")


def pos_advance(rt, pos):
    rt.launch(rt.function(FILE, "pos_advance"), (1,), (1,), [pos], label="pos_advance")
