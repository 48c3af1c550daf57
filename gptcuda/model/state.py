"""The step state: the few numbers a captured training step reads and writes on the device.

Kernels read the step, the learning rate and the clipping norm from one device-resident struct
(kernels/common.cuh `StepState`), so a CUDA graph bakes in nothing that changes from step to step.
This is its one definition on the Python side: the CUDA backend reads and writes it through these
offsets, the memory plan sizes it, data parallel averages the loss at its address, and the reference
backend keeps the same fields in a dict. tests/test_state.py checks kernels/common.cuh against it.
"""
from __future__ import annotations

import numpy as np

WORDS = 16        # 32-bit words, padding included (the struct is 64 bytes)

# name -> (word offset, numpy type), in the struct's order
FIELDS = {
    "step": (0, np.int32),          # 0-based index of the step being run; step_advance moves it at its end
    "lr": (1, np.float32),          # learning rate of this step (lr_schedule writes it at the start)
    "loss": (2, np.float32),        # mean loss of the last forward pass
    "grad_norm": (3, np.float32),   # global L2 norm of this step's gradients (before clipping)
    "eval_draws": (4, np.int32),    # evaluation batches drawn so far
    "work_fresh": (5, np.int32),    # 1: the bf16 working copy holds the parameters as they are (adamw_copy
                                    # wrote both); the host sets 0 whenever it writes the parameters
}


def byte_offset(name: str) -> int:
    return 4 * FIELDS[name][0]


def initial() -> dict:
    """Every field at zero (the reference backend's state)."""
    return {k: t(0).item() for k, (_, t) in FIELDS.items()}


def unpack(words: np.ndarray) -> dict:
    """The fields of a downloaded state ([WORDS] int32)."""
    return {k: words[i:i + 1].view(t)[0].item() for k, (i, t) in FIELDS.items()}


def pack_into(words: np.ndarray, **fields) -> np.ndarray:
    """words with the given fields replaced (a KeyError names an unknown field)."""
    for k, v in fields.items():
        i, t = FIELDS[k]
        words[i:i + 1].view(t)[0] = v
    return words
