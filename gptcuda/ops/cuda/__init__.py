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


def dropout_args(rt: RuntimeProtocol, p: float, site: int, label: str) -> list:
    """The trailing kernel arguments of a dropout of probability p (0 <= p < 1) drawn from stream
    `site`: the StepState, the seed, the site, the keep threshold (rng.keep_threshold) and the scale
    1 / (1 - p); the kernels read the step from the StepState, so a captured graph replays them."""
    from gptcuda.model import rng
    from gptcuda.runtime import f32, u32
    p = float(p)
    if p > 0 and rt.state is None:
        raise RuntimeError(f"{label}: rt.state (the StepState) is not set")
    return [rt.state, u32(int(rt.seed) & 0xFFFFFFFF), u32(int(site) & 0xFFFFFFFF),
            u32(rng.keep_threshold(p) if p > 0 else 0), f32(1.0 / (1.0 - p))]
