"""The CUDA backend's launchers, one module per kernels/*.cu file (gemm/ for the GEMM families), and the
arithmetic they share."""
from __future__ import annotations

from gptcuda.runtime import RuntimeProtocol


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0): the blocks or tiles that cover a items b at a time."""
    return -(-a // b)


def expression(base: str, *args, sep: str = ",") -> str:
    """A kernel's name expression: base<args> (bools as true / false), the template arguments through
    which a launcher passes the geometry it chose (the kernels restate none of it)."""
    return f"{base}<{sep.join(('true' if a else 'false') if isinstance(a, bool) else str(int(a)) for a in args)}>"


# The element types a kernel may take as template arguments (kernels/bf16.cuh ElemOf), by view dtype
DTYPE_CODES = {"f32": 0, "bf16": 1}


def sm_count(rt: RuntimeProtocol, default: int = 132) -> int:
    """The GPU's SM count (rt.info.sm_count; `default` where a runtime does not say: a recording fake's)."""
    return int(getattr(getattr(rt, "info", None), "sm_count", default) or default)


def planned(rt: RuntimeProtocol, name: str):
    """The workspace `name` where the memory plan lends it (rt.workspace), else None."""
    try:
        return rt.workspace(name)
    except KeyError:
        return None


def aligned4(*views) -> bool:
    """Whether every view (None: none) starts on 4 of its elements, so that 4 consecutive values move in
    one access: 16 bytes of fp32 or i32, 8 of bf16."""
    return all(v is None or v.ptr % (4 * v.itemsize) == 0 for v in views)


def element_types(label: str, kernels, **views) -> tuple:
    """The views' dtypes (in the order given) as the kernel's type codes (DTYPE_CODES), where `kernels`
    (tuples of dtypes in that order) has a kernel for them; else a ValueError of one line naming what
    was given and what there is."""
    got = tuple(v.dtype for v in views.values())
    if got not in kernels:
        given = ", ".join(f"{k} {d}" for k, d in zip(views, got))
        there = "; ".join(" ".join(c) for c in kernels)
        raise ValueError(f"{label}: no kernel for {given} (there are, in that order: {there})")
    return type_codes(got)


def optional_code(dtype: str) -> tuple:
    """The trailing template argument of an element type whose default is fp32 (a kernel's `int TG = 0`):
    () for fp32 (the name a kernel had before the argument), (its code,) otherwise."""
    return () if dtype == "f32" else (DTYPE_CODES[dtype],)


def type_codes(dtypes) -> tuple:
    """The kernel template arguments of these element types (DTYPE_CODES)."""
    return tuple(DTYPE_CODES[d] for d in dtypes)


def kernel_types(label: str, kernels, **views) -> tuple:
    """The first of `kernels` (tuples of dtypes, one a keyword of views, in that order) that agrees with
    every view given, a view None being a tensor the call has not (any dtype there): the dtypes of the
    kernel to launch, an absent tensor's as that tuple has it. Else element_types' ValueError, over the
    views given."""
    cols = [i for i, v in enumerate(views.values()) if v is not None]
    given = {k: v for k, v in views.items() if v is not None}
    seen = [tuple(t[i] for i in cols) for t in kernels]
    element_types(label, seen, **given)
    got = tuple(v.dtype for v in given.values())
    return next(t for t, s in zip(kernels, seen) if s == got)


def fp32_only(label: str, **views):
    """A ValueError of one line where a view given (None: none) is not fp32: the parameters, their
    gradients, the statistics and the partial sums that every kernel keeps in fp32."""
    for k, v in views.items():
        if v is not None and v.dtype != "f32":
            raise ValueError(f"{label}: {k} must be f32 (parameters, their gradients, statistics and sums are), "
                             f"got {v.dtype}")


def dropout_args(rt: RuntimeProtocol, p: float, site: int, label: str) -> list:
    """The trailing kernel arguments of a dropout of probability p (0 <= p < 1) drawn from stream
    `site`: the StepState, the seed, the site, the keep threshold (rng.keep_threshold) and the scale
    1 / (1 - p); the kernels read the step from the StepState, so a captured graph replays them."""
    from gptcuda.model import rng
    return _dropout_args(rt, float(p), site, label, rng.keep_threshold(p) if p > 0 else 0, float(p))


def attention_dropout_args(rt: RuntimeProtocol, p: float, site: int) -> list:
    """dropout_args of the attention's probabilities: the byte threshold rng.attention_threshold and the
    scale 1 / (1 - rng.attention_rate(p)) of its masks (rng.attention_keep)."""
    from gptcuda.model import rng
    return _dropout_args(rt, float(p), site, "attention", rng.attention_threshold(p) if p > 0 else 0,
                         rng.attention_rate(p) if p > 0 else 0.0)


def _dropout_args(rt: RuntimeProtocol, p: float, site: int, label: str, threshold: int, rate: float) -> list:
    """p: the config's (a kernel draws keep bits where p > 0); threshold and rate: its masks' for p."""
    from gptcuda.runtime import f32, u32
    if p > 0 and rt.state is None:
        raise RuntimeError(f"{label}: rt.state (the StepState) is not set")
    return [rt.state, u32(int(rt.seed) & 0xFFFFFFFF), u32(int(site) & 0xFFFFFFFF), u32(threshold),
            f32(1.0 / (1.0 - rate))]
