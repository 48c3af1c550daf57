"""Launcher of kernels/data.cu: draw a training/evaluation batch on the device.

    get_batch(rt, x[B,T] i32, y[B,T] i32, tokens[n] i32, site, counter)
        counter "step" or "eval_draws": the StepState field that keys the draw;
        row b starts at gc_uniform(gc_key(seed, counter, site), b) % (n - T), exactly
        gptcuda.rng.batch_offsets(seed, counter, site, B, n, T).
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
    rt.launch(rt.function(FILE, f"get_batch<{COUNTERS[counter]}>"), (-(-T // THREADS), B), (THREADS,),
              [x, y, tokens, i32(n), i32(T), rt.state, u32(rt.seed & 0xFFFFFFFF), u32(int(site) & 0xFFFFFFFF)],
              label="get_batch")
