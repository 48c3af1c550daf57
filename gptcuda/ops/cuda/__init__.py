"""The CUDA backend's launchers, one module per kernels/*.cu file (gemm/ for the GEMM families), and the
arithmetic they share."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0): the blocks or tiles that cover a items b at a time."""
    return -(-a // b)
