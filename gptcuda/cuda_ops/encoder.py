"""Launchers of kernels/encoder.cu: token + position embedding forward and backward.

    encoder_fwd(rt, out[B,T,C], idx[B,T] i32, wte[V,C], wpe[Tmax,C])     out = wte[idx] + wpe[t]
    encoder_bwd(rt, dwte[V,C], dwpe[Tmax,C], dout[B,T,C], idx[B,T])      dwte += ; dwpe = (t >= T zeroed)

The backward is deterministic without atomics (see the kernel file); no workspace.
"""
from __future__ import annotations

from ..runtime import i32

FILE = "encoder.cu"
THREADS = 256
BWD_WARPS = 16        # ENC_BWD_WARPS in the kernel

VARIANTS = [(FILE, f"{k}<{vec}>", {}) for k in ("encoder_fwd", "encoder_bwd_wte", "encoder_bwd_wpe")
            for vec in (4, 1)]


def workspace(cfg) -> dict:
    return {}


def _aligned(*views) -> bool:
    return all(v is None or v.ptr % 16 == 0 for v in views)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_idx(idx, out_lead):
    if idx.dtype != "i32":
        raise TypeError(f"encoder: token ids must be i32, got {idx.dtype}")
    if len(idx.shape) != 2 or tuple(idx.shape) != tuple(out_lead):
        raise ValueError(f"encoder: idx {idx.shape} does not match the leading dims {tuple(out_lead)}")


def encoder_fwd(rt, out, idx, wte, wpe):
    B, T = int(idx.shape[0]), int(idx.shape[1])
    V, C = int(wte.shape[0]), int(wte.shape[1])
    Tmax = int(wpe.shape[0])
    _check_idx(idx, out.shape[:-1])
    if int(out.shape[-1]) != C or int(wpe.shape[1]) != C:
        raise ValueError(f"encoder_fwd: widths differ: out {out.shape}, wte {wte.shape}, wpe {wpe.shape}")
    if T > Tmax:
        raise ValueError(f"encoder_fwd: sequence length {T} exceeds wpe rows {Tmax}")
    N = B * T
    vec = 4 if C % 4 == 0 and _aligned(out, wte, wpe) else 1
    fn = rt.function(FILE, f"encoder_fwd<{vec}>")
    total = N * (C // vec)
    rt.launch(fn, (_cdiv(total, THREADS),), (THREADS,),
              [out, idx, wte, wpe, i32(N), i32(T), i32(C), i32(V)], label="encoder_fwd")


def encoder_bwd(rt, dwte, dwpe, dout, idx):
    B, T = int(idx.shape[0]), int(idx.shape[1])
    V, C = int(dwte.shape[0]), int(dwte.shape[1])
    Tmax = int(dwpe.shape[0])
    _check_idx(idx, dout.shape[:-1])
    if int(dout.shape[-1]) != C or int(dwpe.shape[1]) != C:
        raise ValueError(f"encoder_bwd: widths differ: dout {dout.shape}, dwte {dwte.shape}, dwpe {dwpe.shape}")
    if T > Tmax:
        raise ValueError(f"encoder_bwd: sequence length {T} exceeds wpe rows {Tmax}")
    N = B * T
    vec = 4 if C % 4 == 0 and _aligned(dwte, dout) else 1
    fn = rt.function(FILE, f"encoder_bwd_wte<{vec}>")
    rt.launch(fn, (V, _cdiv(C, 32 * vec)), (BWD_WARPS * 32,),
              [dwte, dout, idx, i32(N), i32(C)], label="encoder_bwd_wte")
    vec = 4 if C % 4 == 0 and _aligned(dwpe, dout) else 1
    fn = rt.function(FILE, f"encoder_bwd_wpe<{vec}>")
    total = Tmax * (C // vec)
    rt.launch(fn, (_cdiv(total, THREADS),), (THREADS,),
              [dwpe, dout, i32(B), i32(T), i32(Tmax), i32(C)], label="encoder_bwd_wpe")
