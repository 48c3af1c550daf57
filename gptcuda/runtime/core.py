"""The CUDA runtime of gptcuda: kernels registry, argument blocks, programs and CUDA graphs.

Launchers in gptcuda/ops/cuda/ use three things:

    fn = rt.function("decode.cu", "decode_attention<64,128,64>")      # compiled once, cached
    rt.launch(fn, grid, block, [part, qkv, kc, vc, pos, i32(H), i32(T), f32(scale)])
    rt.workspace("attention_d")                                         # a planned scratch view

and read which kernels to run from `rt.exec` (gptcuda/runtime/execution.py, resolved once); all they may
use of a runtime is protocol.RuntimeProtocol. Arguments are
DeviceViews (passed as pointers), None (a null pointer), typed scalars (i32, u32, f32, u64) or a
Blob (an opaque by-value struct: a TMA tensor map); their sizes are checked against the kernel's
parameters (cuFuncGetParamInfo). `launch` packs the argument block once into a `Launch` and either
runs it now (eager) or appends it to the program being recorded; a program replays its launches
with no packing, or is captured once into a CUDA graph and replayed.
"""
from __future__ import annotations

import contextlib
import ctypes
import time
from dataclasses import dataclass, field

import numpy as np

from gptcuda.runtime import bf16, compiler, execution
from gptcuda.runtime.driver import Device, call

NAN_WORD = 0x7FC00000
POISON_WORDS = {"f32": NAN_WORD, "bf16": 0x7FC07FC0}     # NaN in every element


class Program:
    """A recorded sequence of ops. `items` holds backend-specific launch records."""

    def __init__(self, name: str):
        self.name = name
        self.items = []

    def __len__(self):
        return len(self.items)


@dataclass(frozen=True)
class DeviceView:
    """A typed window into device memory. Only `.shape` matters to model code."""
    ptr: int
    shape: tuple
    dtype: str = "f32"       # f32 | i32 | u8 | bf16 (bit patterns, gptcuda/runtime/bf16.py)
    name: str = ""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    @property
    def itemsize(self) -> int:
        """Bytes of one element (bf16: 2)."""
        return np.dtype(NP_DTYPES[self.dtype]).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __getitem__(self, i: int) -> "DeviceView":
        """Index the leading dimension: a contiguous sub-view."""
        inner = self.numel // int(self.shape[0])
        if not 0 <= i < self.shape[0]:
            raise IndexError(f"{self.name}[{i}] out of range {self.shape}")
        return DeviceView(self.ptr + i * inner * self.itemsize, tuple(self.shape[1:]), self.dtype, f"{self.name}[{i}]")


NP_DTYPES = {"f32": np.float32, "i32": np.int32, "u8": np.uint8, "bf16": np.uint16}


class _Scalar:
    __slots__ = ("value",)
    np_type = None

    def __init__(self, value):
        self.value = value


class i32(_Scalar):
    np_type = np.int32


class u32(_Scalar):
    np_type = np.uint32


class f32(_Scalar):
    np_type = np.float32


class u64(_Scalar):
    np_type = np.uint64


class Blob:
    """An opaque by-value kernel parameter (a CUtensorMap: 128 bytes, 64-byte aligned)."""
    __slots__ = ("data",)
    ALIGN = 64

    def __init__(self, data: bytes):
        if len(data) % 8:
            raise ValueError(f"Blob of {len(data)} bytes: a multiple of 8 expected")
        self.data = bytes(data)


@dataclass
class Function:
    handle: object
    name: str
    file: str
    attrs: dict = field(default_factory=dict)
    max_smem: int = 0
    params: tuple | None = None      # the kernel's parameter sizes in bytes (None: not known)


def arg_size(a) -> int:
    """The bytes a launch argument occupies as a kernel parameter."""
    if isinstance(a, Blob):
        return len(a.data)
    if isinstance(a, _Scalar):
        return np.dtype(a.np_type).itemsize
    return 8                         # a DeviceView or None: a pointer


class Launch:
    """One kernel launch with its argument block packed once."""
    __slots__ = ("fn", "grid", "block", "smem", "slots", "ptrs", "params", "label", "blobs")

    def __init__(self, fn: Function, grid, block, args, smem: int, label: str):
        self.fn, self.smem, self.label = fn, int(smem), label
        if fn.params is not None:
            sizes = tuple(arg_size(a) for a in args)
            if sizes != fn.params:
                raise ValueError(f"{label}: {fn.file}:{fn.name} takes {len(fn.params)} parameters of "
                                 f"{list(fn.params)} bytes; the launch passes {len(sizes)} of {list(sizes)}")
        self.grid = tuple(int(g) for g in (tuple(grid) + (1, 1))[:3])
        self.block = tuple(int(b) for b in (tuple(block) + (1, 1))[:3])
        if min(self.grid) < 1 or min(self.block) < 1:
            raise ValueError(f"{label}: empty launch grid={self.grid} block={self.block}")
        self.slots = np.zeros(max(len(args), 1), dtype=np.uint64)    # one 8-byte slot per argument
        raw = self.slots.view(np.uint8)
        self.blobs = {}          # argument index -> (buffer kept alive, aligned address)
        for i, a in enumerate(args):
            if isinstance(a, Blob):
                buf = np.zeros(len(a.data) + Blob.ALIGN, dtype=np.uint8)
                off = (-buf.ctypes.data) % Blob.ALIGN
                buf[off:off + len(a.data)] = np.frombuffer(a.data, dtype=np.uint8)
                self.blobs[i] = (buf, buf.ctypes.data + off)
            elif isinstance(a, DeviceView):
                self.slots[i] = a.ptr
            elif a is None:
                self.slots[i] = 0
            elif isinstance(a, _Scalar):
                b = np.array([a.value], dtype=a.np_type).view(np.uint8)
                raw[8 * i: 8 * i + b.size] = b
            else:
                raise TypeError(f"{label}: argument {i} is {type(a).__name__}; "
                                "pass a DeviceView, None, a typed scalar (i32, u32, f32, u64) or a Blob")
        base = self.slots.ctypes.data
        self.ptrs = np.array([self.blobs[i][1] if i in self.blobs else base + 8 * i for i in range(len(args))]
                             or [0], dtype=np.uint64)
        self.params = self.ptrs.ctypes.data

    def run(self, dev, stream):
        dev.launch(self.fn.handle, self.grid, self.block, self.smem, stream, self.params)


class Memset:
    """Fill a view with one 32-bit word (recorded like a launch; captured as a memset node)."""
    __slots__ = ("ptr", "word", "count", "label")

    def __init__(self, view, word: int, label: str):
        self.ptr, self.word, self.count, self.label = view.ptr, word, view.nbytes // 4, label

    def run(self, dev, stream):
        dev.memset32(self.ptr, self.word, self.count, stream)


def _wait(dev, stream, event):
    call(dev.drv.cuStreamWaitEvent, stream, event, 0)


def _mark(dev, event, stream):
    """Record a timing event; inside a stream capture as a real event-record node (a plain record
    there would only be a dependency marker)."""
    status = call(dev.drv.cuStreamIsCapturing, stream)
    capturing = int(status) != int(dev.drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)
    dev.record(event, stream, external=capturing)


class StreamFork:
    """Everything recorded so far on the main stream happens before what follows on the side stream
    (an event recorded on the main stream, waited for by the side stream). Captured into a graph, the
    wait pulls the side stream into the capture."""
    __slots__ = ("side", "event", "label", "fn")

    def __init__(self, side, event, label: str = "fork"):
        self.side, self.event, self.label = side, event, label
        self.fn = Function(None, label, "stream")          # how profile.phase_table names it

    def run(self, dev, stream):
        dev.record(self.event, stream)
        _wait(dev, self.side, self.event)


class StreamJoin:
    """Everything recorded so far on the side stream happens before what follows on the main stream.
    marks: optional (main, side) timing events recorded when each stream reaches the join."""
    __slots__ = ("side", "event", "label", "marks", "fn")

    def __init__(self, side, event, label: str = "join", marks=None):
        self.side, self.event, self.label, self.marks = side, event, label, marks
        self.fn = Function(None, label, "stream")

    def run(self, dev, stream):
        if self.marks:
            _mark(dev, self.marks[0], stream)
            _mark(dev, self.marks[1], self.side)
        dev.record(self.event, self.side)
        _wait(dev, stream, self.event)


class StreamCall:
    """A library call that enqueues its own work on a stream (an NCCL collective): `call(handle)`
    gets the integer CUstream of the side stream when one is given, else of the main stream.
    marks: optional (start, end) timing events recorded on that stream around the call."""
    __slots__ = ("call", "side", "label", "nbytes", "marks", "fn")

    def __init__(self, call_fn, label: str, side=None, nbytes: int = 0, marks=None):
        self.call, self.side, self.label, self.nbytes, self.marks = call_fn, side, label, int(nbytes), marks
        self.fn = Function(None, label, "nccl")

    def run(self, dev, stream):
        s = self.side if self.side is not None else stream
        if self.marks:
            _mark(dev, self.marks[0], s)
        self.call(int(s))
        if self.marks:
            _mark(dev, self.marks[1], s)


class Runtime:
    """One GPU: compiled functions, a stream, the program being recorded, graphs, memory."""

    def __init__(self, device: int = 0, precision: str = "fp32", seed: int = 0, cfg=None, dev=None):
        # dev: a stand-in for the driver.Device of GPU `device` (the tests' fake device: tests/fakes.py)
        self.dev = Device(device) if dev is None else dev
        self.info = self.dev.info
        self.arch = self.info.arch
        # which kernels run (gptcuda/runtime/execution.py), resolved once for this device: the config's
        # plan (the CUDA backend's runtime), else that of a precision (a runtime made alone: benchmarks)
        self.exec = execution.resolve(cfg, arch=self.arch, precision=None if cfg is not None else precision)
        self.seed = seed
        self.stream = self.dev.stream()
        self._functions: dict = {}
        self._recording: Program | None = None
        self._workspace: dict = {}
        self._allocs: list = []
        self._graphs: list = []      # captured graphs still alive (destroy_graphs)
        self.state = None            # DeviceView of the StepState, set by the backend
        self.compile_seconds = 0.0
        self._host_allocs: list = []  # page-locked host buffers (pinned)
        self._side = None            # the communication stream, made on first use
        self.held_sums = None        # the row sums a backward holds (ops/cuda/elementwise.defer_sums)
        self._noted = None           # the kernels asked for inside noting(), none compiled

    @property
    def precision(self) -> str:
        """The execution plan's precision (what the products' tolerance depends on)."""
        return self.exec.precision

    # ---- kernels ------------------------------------------------------------------
    def function(self, file: str, name: str, defines: dict | None = None) -> Function:
        key = (file, name, tuple(sorted((defines or {}).items())))
        if self._noted is not None:
            self._noted.append((*key, self.arch))
            return Function(None, name, file)
        fn = self._functions.get(key)
        if fn is None:
            t = time.perf_counter()
            c = compiler.compile_kernel(file, [name], defines, arch=self.arch)
            module = self.dev.load_module(c.cubin)
            handle = self.dev.get_function(module, c.lowered[name])
            fn = Function(handle, name, file, self.dev.function_attrs(handle), params=self.dev.param_sizes(handle))
            self._functions[key] = fn
            self.compile_seconds += time.perf_counter() - t
        return fn

    def tensor_map(self, view, dims, strides_bytes, box, swizzle=True) -> Blob:
        """A TMA tensor map over the tensor at view.ptr, of view's dtype (see Device.tensor_map), as
        the by-value argument of a launch."""
        if self._noted is not None:
            return Blob(bytes(128))
        return Blob(self.dev.tensor_map(view.ptr, dims, strides_bytes, box, swizzle, view.dtype))

    def set_max_smem(self, fn: Function, nbytes: int):
        if nbytes > 48 * 1024 and nbytes > fn.max_smem:
            if nbytes > self.info.smem_per_block_optin:
                raise ValueError(f"{fn.name} asks {nbytes} B of shared memory; the device allows "
                                 f"{self.info.smem_per_block_optin}")
            self.dev.set_max_dynamic_smem(fn.handle, nbytes)
            fn.max_smem = nbytes

    def launch(self, fn: Function, grid, block, args, smem: int = 0, label: str | None = None):
        if self._noted is None:
            self.set_max_smem(fn, smem)
        return self._submit(Launch(fn, grid, block, args, smem, label or fn.name))

    def memset(self, view: DeviceView, word: int = 0, label: str = "memset"):
        """view[:] = word (a 32-bit pattern); recorded into the open program like a launch."""
        return self._submit(Memset(view, word, label))

    def add(self, rec):
        """Record anything with run(dev, stream) (StreamFork, StreamJoin, StreamCall) like a launch."""
        return self._submit(rec)

    def _submit(self, rec):
        if self._noted is not None:
            return rec
        if self._recording is not None:
            self._recording.items.append(rec)
        else:
            rec.run(self.dev, self.stream)
        return rec

    @contextlib.contextmanager
    def noting(self):
        """A block whose launches only note the kernels they ask for, (file, name, sorted defines, arch), in
        the list it yields: nothing is compiled, recorded or run, and tensor maps are blank (the GEMM tuner
        compiles its candidates' kernels in parallel first: ops/cuda/gemm/tune.py)."""
        self._noted = noted = []
        try:
            yield noted
        finally:
            self._noted = None

    # ---- programs and graphs ------------------------------------------------------
    def begin(self, name: str) -> Program:
        if self._recording is not None:
            raise RuntimeError(f"already recording {self._recording.name}")
        self._recording = Program(name)
        return self._recording

    def end(self) -> Program:
        prog, self._recording = self._recording, None
        return prog

    def run(self, prog: Program):
        dev, stream = self.dev, self.stream
        for rec in prog.items:
            rec.run(dev, stream)

    def capture(self, prog: Program) -> "Graph":
        self.dev.begin_capture(self.stream)
        try:
            self.run(prog)
        finally:
            graph, exe = self.dev.end_capture(self.stream)
        g = Graph(self, graph, exe, prog)
        self._graphs.append(g)
        return g

    def destroy_graphs(self):
        """Destroy every graph captured here and still alive. NCCL counts each graph that captured
        one of its collectives and destroying its communicator waits until they are gone, so this
        runs before a communicator is closed (dist.Group.close)."""
        if self._graphs:
            self.synchronize()
        for g in list(self._graphs):
            g.destroy()

    def synchronize(self):
        self.dev.sync(self.stream)

    # ---- a second stream and events (data-parallel communication) ------------------
    def side_stream(self):
        """The communication stream: non-blocking, at the device's highest priority, made once."""
        if self._side is None:
            drv = self.dev.drv
            _least, greatest = call(drv.cuCtxGetStreamPriorityRange)
            self._side = call(drv.cuStreamCreateWithPriority, drv.CUstream_flags.CU_STREAM_NON_BLOCKING,
                              greatest)
        return self._side

    def new_event(self, timing: bool = False):
        drv = self.dev.drv
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return call(drv.cuEventCreate, flags)

    # ---- memory -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        ptr = self.dev.malloc(nbytes)
        self._allocs.append(ptr)
        return ptr

    def pinned(self, shape, dtype=np.int32) -> np.ndarray:
        """A numpy array in page-locked host memory, freed by close()."""
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = self.dev.host_alloc(nbytes)
        self._host_allocs.append(ptr)
        buf = (ctypes.c_char * max(nbytes, 1)).from_address(ptr)
        return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def empty(self, shape, dtype: str = "f32", poison: bool = True, name: str = "") -> DeviceView:
        """A fresh allocation (for tests and tools); poisoned with NaN so unwritten outputs show."""
        shape = tuple(int(s) for s in shape)
        v = DeviceView(0, shape, dtype, name)
        v = DeviceView(self.alloc(-(-v.nbytes // 4) * 4), shape, dtype, name)      # (whole words: fill)
        if poison:
            self.fill(v, POISON_WORDS.get(dtype, 0x7FFFFFFF))
        return v

    def fill(self, view: DeviceView, word: int):
        """Fill now, outside any program (a view of a whole number of words, or one of `empty`'s)."""
        self.dev.memset32(view.ptr, word, -(-view.nbytes // 4), self.stream)

    def upload(self, arr, dtype: str | None = None, name: str = "") -> DeviceView:
        """A new view holding arr (dtype "bf16": float values rounded to bf16, or bit patterns)."""
        arr = np.asarray(arr)
        dtype = dtype or {"f": "f32", "i": "i32", "u": "u8"}[arr.dtype.kind]
        if dtype == "bf16" and arr.dtype.kind == "f":
            arr = bf16.bits(arr)
        v = self.empty(arr.shape, dtype, poison=False, name=name)
        self.write(v, arr)
        return v

    def write(self, view: DeviceView, arr):
        host = np.ascontiguousarray(arr, dtype=NP_DTYPES[view.dtype])
        if host.size != view.numel:
            raise ValueError(f"write {host.shape} into {view.name}{view.shape}")
        self.dev.htod(view.ptr, host, self.stream)     # ordered after the stream's work, complete on return

    def download(self, view: DeviceView) -> np.ndarray:
        host = np.empty(view.shape, dtype=NP_DTYPES[view.dtype])
        self.synchronize()
        self.dev.dtoh(host, view.ptr)
        return host

    def set_workspace(self, views: dict) -> dict:
        """Lend these views as the workspaces, by name; returns the ones they replace."""
        old, self._workspace = self._workspace, dict(views)
        return old

    def workspace(self, name: str) -> DeviceView:
        try:
            return self._workspace[name]
        except KeyError:
            raise KeyError(f"workspace {name!r} was not planned (memory.py plans it from the config)") from None

    def close(self):
        self.destroy_graphs()
        self.synchronize()
        for p in self._allocs:
            self.dev.free(p)
        self._allocs.clear()
        for p in self._host_allocs:
            self.dev.host_free(p)
        self._host_allocs.clear()


class Graph:
    """An instantiated CUDA graph of one program."""

    def __init__(self, rt: Runtime, graph, exe, prog: Program):
        self.rt, self.graph, self.exe, self.program = rt, graph, exe, prog

    def launch(self):
        if self.exe is None:
            raise RuntimeError(f"graph of {self.program.name!r} launched after it was destroyed")
        self.rt.dev.graph_launch(self.exe, self.rt.stream)

    def destroy(self):
        """Free the graph now (it leaves the runtime's list of live graphs); a second call does nothing."""
        if self.exe is not None:
            self.rt.dev.graph_destroy(self.graph, self.exe)
            self.graph = self.exe = None
            self.rt._graphs.remove(self)
