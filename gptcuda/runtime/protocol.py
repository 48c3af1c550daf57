"""What code above the runtime may use of one: the launchers (gptcuda/ops/cuda/), the CUDA backend, the
data-parallel layer and the sampler are written against RuntimeProtocol, not against core.Runtime.

core.Runtime is the one implementation that drives a GPU; the tests' fake device (tests/fakes.py:
RecordingRuntime, FakeGemmRT) is a Runtime over a stand-in device, so it has every member with the same
signature (tests/test_runtime_protocol.py checks both, and that no code above the runtime uses a member
this does not declare). A member used from ops/ is added here first.

Invariants every implementation keeps: `function` returns the same Function for the same (file, name,
defines); `launch`, `memset` and `add` run now outside a program and append to it between `begin` and
`end`, and inside `noting` only note the kernels asked for (compiled, recorded and run: none);
`workspace(name)` raises KeyError naming a workspace that was not planned; `set_workspace` returns the
views it replaces; `download` returns after the stream's work; `exec` is resolved once and `precision`
is `exec.precision`.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from gptcuda.runtime.core import Blob, DeviceView, Function, Graph, Program
from gptcuda.runtime.execution import ExecutionPlan


@runtime_checkable
class RuntimeProtocol(Protocol):
    """One device's runtime as ops/ code sees it (core.Runtime's members of the same names)."""

    exec: ExecutionPlan          # which kernels run (execution.resolve), resolved once
    info: Any                    # the device's properties: name, sm_count, smem_per_block_optin, ... (DeviceInfo)
    arch: str | None             # "sm_90"; None: no arch-specific kernels
    seed: int                    # the dropout RNG's seed
    state: DeviceView | None     # the StepState (step, lr, loss scale, ...), set by the backend
    stream: Any                  # the main stream (a CUstream)
    dev: Any                     # the device below (driver.Device): host copies, events, the timer's memory
    held_sums: Any               # the row sums a backward holds (elementwise.defer_sums), else None

    @property
    def precision(self) -> str: ...

    # ---- kernels
    def function(self, file: str, name: str, defines: dict | None = None) -> Function: ...

    def launch(self, fn: Function, grid, block, args, smem: int = 0, label: str | None = None): ...

    def memset(self, view: DeviceView, word: int = 0, label: str = "memset"): ...

    def add(self, rec): ...

    def tensor_map(self, view, dims, strides_bytes, box, swizzle=True) -> Blob: ...

    def noting(self): ...

    def workspace(self, name: str) -> DeviceView: ...

    def set_workspace(self, views: dict) -> dict: ...

    # ---- programs and graphs
    def begin(self, name: str) -> Program: ...

    def end(self) -> Program: ...

    def run(self, prog: Program): ...

    def capture(self, prog: Program) -> Graph: ...

    def destroy_graphs(self): ...

    def synchronize(self): ...

    def side_stream(self): ...

    def new_event(self, timing: bool = False): ...

    # ---- memory
    def alloc(self, nbytes: int) -> int: ...

    def pinned(self, shape, dtype=np.int32) -> np.ndarray: ...

    def empty(self, shape, dtype: str = "f32", poison: bool = True, name: str = "") -> DeviceView: ...

    def fill(self, view: DeviceView, word: int): ...

    def upload(self, arr, dtype: str | None = None, name: str = "") -> DeviceView: ...

    def write(self, view: DeviceView, arr): ...

    def download(self, view: DeviceView) -> np.ndarray: ...

    def close(self): ...

