"""The one fake device of the tests: a real Runtime over FakeDev, whose launches are recorded, not run.

    RecordingRuntime(cfg)                 # a Config's execution plan on an sm_90 device of 132 SMs
    RecordingRuntime("tf32", arch=None)   # a precision's plan on a device without the wgmma kernels
    FakeGemmRT("tf32", ws=1 << 20)        # tests/conftest.py: a launcher alone, its workspaces lent

FakeDev hands out fake device addresses (4 KB aligned, never reused) and does nothing else: no memory
behind them, downloads read zeros, tensor maps are 128 bytes holding the tensor's address (their
arguments checked as cuTensorMapEncodeTiled checks them; `pointers(rec)`: every address a launch
passes). Everything above the device is the real Runtime's (argument
packing, the shared-memory limit, workspaces, programs), but for what RecordingRuntime overrides: every
kernel asked for must be a listed variant (a launcher's VARIANTS, all compiled by
tests/test_compiler.py) and gets the parameter sizes its source declares (the check a real runtime
makes with cuFuncGetParamInfo); launches outside a program are recorded in `launched`, never run; a
capture is no graph. A test that needs other behaviour subclasses FakeDev or RecordingRuntime and
overrides a method."""
import ctypes
import functools
import re

from gptcuda.runtime import Function, Launch, Memset, Runtime, compiler
from gptcuda.ops.cuda import elementwise


class FakeInfo:
    """The device's properties (driver.DeviceInfo's that the runtime and launchers read): an H200
    unless told; arch None: a device without arch-specific kernels (no wgmma in the plan)."""
    smem_per_block_optin, smem_per_block, smem_per_sm, l2_bytes = 227 * 1024, 48 * 1024, 228 * 1024, 50 << 20
    total_mem = free_mem = 80 << 30

    def __init__(self, name="fake H200", sm_count=132, arch="sm_90"):
        self.name, self.sm_count, self.arch = name, sm_count, arch
        self.cc = (int(arch[3:-1]), int(arch[-1])) if arch else (0, 0)


class FakeDev:
    """A stand-in for driver.Device: fake addresses, nothing stored, nothing run."""

    def __init__(self, info=None):
        self.info = info or FakeInfo()
        self.next = 1 << 32
        self.host, self.copies, self.destroyed = [], [], []

    def malloc(self, n):
        p = self.next
        self.next += (int(n) + 4095) // 4096 * 4096
        return p

    def mem_info(self):
        return self.info.free_mem, self.info.total_mem

    def stream(self):
        return None

    def free(self, ptr):
        pass

    def memset32(self, *a):
        pass

    def sync(self, *a):
        pass

    def htod(self, *a):
        pass

    def dtoh(self, host, src):
        host[...] = 0

    def set_max_dynamic_smem(self, *a):
        pass

    def graph_destroy(self, graph, exe):
        self.destroyed.append(exe)

    def host_alloc(self, n):
        buf = (ctypes.c_char * max(int(n), 1))()
        self.host.append(buf)                                     # kept alive while the fake runs
        return ctypes.addressof(buf)

    def host_free(self, ptr):
        pass

    def htod_async(self, dst, src, nbytes, stream):
        self.copies.append((dst, nbytes))

    def record(self, *a):
        pass

    def event_destroy(self, *a):
        pass

    def event_sync(self, *a):
        pass

    def tensor_map(self, ptr, dims, strides_bytes, box, swizzle=True, dtype="f32"):
        # what cuTensorMapEncodeTiled refuses: a rank disagreement, a box side over 256, a base or a
        # stride not 16-byte aligned
        assert len(dims) == len(box) == len(strides_bytes) + 1 and all(int(b) <= 256 for b in box), (dims, box)
        assert ptr % 16 == 0 and all(int(s) % 16 == 0 for s in strides_bytes), (ptr, strides_bytes)
        return int(ptr).to_bytes(8, "little") + bytes(120)      # (the tensor's address, for `pointers`)


def pointers(rec) -> set:
    """The device addresses a recorded launch or memset passes: its pointer arguments, the tensors of its
    tensor maps (FakeDev's), the outputs and partials of a SumBatch."""
    from gptcuda.runtime import Launch, Memset
    if isinstance(rec, Memset):
        return {rec.ptr}
    if not isinstance(rec, Launch):
        return set()
    ptrs = {int(v) for v in rec.slots if int(v) >= 1 << 32}
    for i, (buf, addr) in rec.blobs.items():
        data = buf[addr - buf.ctypes.data:][:rec.fn.params[i]].tobytes()
        if len(data) == 128:
            ptrs.add(int.from_bytes(data[:8], "little"))
        else:
            ptrs |= {p for out, part, *_ in elementwise.unpack_sum_batch(data) for p in (out, part)}
    return ptrs


# SumBatch<ITEMS>: ITEMS out and in pointers, rows, cols and ld, then ITEMS + 1 first blocks (8 bytes each)
_SIZES = [("CUtensorMap", 128), ("TmaMap", 128), ("SumBatch", 8 * (6 * elementwise.SUM_ITEMS + 1)), ("long long", 8),
          ("size_t", 8), ("u64", 8), ("double", 8), ("int", 4), ("unsigned", 4), ("float", 4), ("u32", 4), ("bool", 1)]


@functools.lru_cache(maxsize=None)
def kernel_param_sizes(file, name):
    """The parameter sizes of __global__ `name` (template arguments dropped) read from its source, as
    the driver would report them (cuFuncGetParamInfo): a pointer 8 bytes, int / float 4, ..."""
    src = compiler.expand_source(file)
    base = name.split("<")[0]
    def declares(m):                        # `__global__ void __launch_bounds__(...) name(`, nothing between
        head = src[:m.start()]
        g = head.rfind("__global__")
        return g >= 0 and not re.search(r"[;{}]", head[g:])
    m = next((m for m in re.finditer(r"\b" + re.escape(base) + r"\s*\(", src) if declares(m)), None)
    assert m, f"{file}: no __global__ {base}"
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    text = re.sub(r"//[^\n]*", "", src[m.end():i - 1])
    macros = {k: v.replace("\\\n", " ") for k, v in
              re.findall(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+((?:[^\n]*\\\n)*[^\n]*)", src, re.M)}
    for _ in range(4):                      # parameter lists written as macros (LN_ARGS_FWD, ...)
        text = re.sub(r"\b(\w+)\b", lambda w: macros.get(w.group(1), w.group(1)), text)
    text = re.sub(r"/\*.*?\*/", "", re.sub(r"//[^\n]*", "", text), flags=re.S)
    sizes = []
    for param in (p.strip() for p in text.split(",") if p.strip()):
        if "*" in param:
            sizes.append(8)
            continue
        size = next((n for t, n in _SIZES if re.search(r"\b" + t + r"\b", param)), None)
        assert size is not None, f"{file}:{base}: parameter {param!r} of unknown size"
        sizes.append(size)
    return tuple(sizes)


@functools.lru_cache(maxsize=None)
def listed():
    """{(file, name, sorted defines)} of every variant in a launcher's VARIANTS."""
    from gptcuda.ops.cuda_backend import FAMILIES
    return frozenset((file, name, tuple(sorted(dict(defines).items())))
                     for fam in FAMILIES for file, name, defines in fam.VARIANTS)


class RecordingRuntime(Runtime):
    """A Runtime over FakeDev whose launches are recorded, not run. `plan`: a Config (its execution
    plan, as the CUDA backend's runtime resolves it) or a precision; arch: the device's (an arch
    without the warpgroup-MMA kernels leaves them out of the plan); info: name, sm_count (FakeInfo)."""

    def __init__(self, plan, seed=0, arch="sm_90", **info):
        cfg = None if isinstance(plan, str) else plan
        super().__init__(precision=plan if cfg is None else None, seed=seed, cfg=cfg,
                         dev=self.make_dev(FakeInfo(arch=arch, **info)))
        self.launched = []                  # launches made outside a program

    def make_dev(self, info):
        """The device under the runtime (a test's own FakeDev subclass: override this)."""
        return FakeDev(info)

    def function(self, file, name, defines=None):
        key = (file, name, tuple(sorted((defines or {}).items())))
        if self._noted is not None:                 # noting: the runtime's own (nothing compiled)
            return super().function(file, name, defines)
        if key not in self._functions:
            # a listed variant (tests/test_compiler.py compiles every one of them)
            assert key in listed(), f"{file}:{name} {defines or ''} is launched but in no launcher's VARIANTS"
            self._functions[key] = Function(None, name, file, params=kernel_param_sizes(file, name))
        return self._functions[key]

    def _submit(self, rec):
        assert isinstance(rec, (Launch, Memset))
        if self._noted is not None:
            return rec
        if self._recording is not None:
            self._recording.items.append(rec)
        else:
            self.launched.append(rec)
        return rec

    def run(self, prog):
        self.launched.extend(prog.items)

    def new_event(self, timing=False):
        return object()

    def capture(self, prog):
        return None
