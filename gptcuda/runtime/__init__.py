"""The CUDA layer: what every op stands on.

    driver.py     checked driver calls (`call`), the device and its properties, streams, events, graphs
    compiler.py   NVRTC and the disk cache of compiled kernels (kernels/*.cu)
    core.py       the Runtime: kernel registry, argument blocks packed once and checked against the
                  kernel, programs (recorded launch sequences), CUDA graphs, memory
    execution.py  the execution plan: which kernels run and why, resolved once
    profile.py    event timing: per launch of a program (the phase table), alternatives paired in rotated
                  rounds of captured graphs, device buffers of a case (noise operands) freed together
    protocol.py   RuntimeProtocol: what code above the runtime may use of one (Runtime and the tests' fake)

The Runtime and its launch vocabulary are importable from here: `from gptcuda.runtime import
Runtime, DeviceView, i32, f32`; launchers take an `rt: RuntimeProtocol`.
"""
from gptcuda.runtime.core import (NAN_WORD, NP_DTYPES, POISON_WORDS, Blob, DeviceView, Function, Graph, Launch, Memset,  # noqa: F401
                                  Program, Runtime, StreamCall, StreamFork, StreamJoin, arg_size, f32, i32, u32, u64)
from gptcuda.runtime.protocol import RuntimeProtocol  # noqa: F401
