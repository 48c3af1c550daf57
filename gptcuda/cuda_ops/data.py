"""Launcher of kernels/data.cu: draw a training/evaluation batch on the device.

    get_batch(rt, x[B,T] i32, y[B,T] i32, tokens[n] i32, site, counter)
        counter "step" or "eval_draws": the StepState field that keys the draw;
        row b starts at gc_uniform(gc_key(seed, counter, site), row_offset + b) % (n - T), exactly
        gptcuda.data.get_batch(tokens, seed, counter, site, B, T, row_offset).
        seed is rt.batch_seed when set (a data-parallel rank: the world's seed), else rt.seed;
        row_offset is rt.row_offset (rank * B in a data-parallel run, else 0).
"""
from __future__ import annotations

from ..runtime import i32, u32

FILE = "data.cu"
THREADS = 256
COUNTERS = {"step": "false", "eval_draws": "true"}

VARIANTS = [(FILE, f"get_batch<{e}>", {}) for e in ("false", "true")]


def workspace(cfg) -> dict:
    return {}


def get_batch(rt, x, y, tokens, site, counter):
    if counter not in COUNTERS:
        raise ValueError(f"get_batch: counter must be 'step' or 'eval_draws', got {counter!r}")
    if rt.state is None:
        raise RuntimeError("get_batch: rt.state (the StepState) is not set")
    for name, v in (("x", x), ("y", y), ("tokens", tokens)):
        if v.dtype != "i32":
            raise TypeError(f"get_batch: {name} must be i32, got {v.dtype}")
    if len(x.shape) != 2 or tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"get_batch: x {x.shape} and y {y.shape} must both be [B, T]")
    B, T = int(x.shape[0]), int(x.shape[1])
    n = tokens.numel
    if n < T + 1:
        raise ValueError(f"get_batch: a split of {n} tokens cannot hold a window of {T + 1} tokens")
    if n >= 2 ** 31:
        raise ValueError(f"get_batch: {n} tokens exceed int32")
    if B > 65535:
        raise ValueError(f"get_batch: batch {B} exceeds the grid's y limit")
    seed = getattr(rt, "batch_seed", None)
    seed = rt.seed if seed is None else seed
    row_offset = int(getattr(rt, "row_offset", 0))
    if not (0 <= row_offset and row_offset + B <= 2 ** 32):
        raise ValueError(f"get_batch: row offset {row_offset} outside 0..2**32 - B")
    rt.launch(rt.function(FILE, f"get_batch<{COUNTERS[counter]}>"), (-(-T // THREADS), B), (THREADS,),
              [x, y, tokens, i32(n), i32(T), rt.state, u32(seed & 0xFFFFFFFF), u32(int(site) & 0xFFFFFFFF),
               u32(row_offset)],
              label="get_batch")
