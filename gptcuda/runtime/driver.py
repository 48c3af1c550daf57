"""The CUDA driver API, one checked call at a time.

Every driver call goes through `call(fn, *args)`, which raises `CudaError` naming the
call and the CUDA error when the result is not CUDA_SUCCESS, and returns the call's
values. `Device` owns the primary context and reads the device's properties; streams,
events and graph capture live here too. No torch, no runtime API.
"""
from __future__ import annotations

from dataclasses import dataclass


class CudaError(RuntimeError):
    """A driver call failed: carries the call's name and the CUDA error name."""


class NoDeviceError(RuntimeError):
    """No usable NVIDIA driver or GPU on this machine."""


_driver = None


def _load():
    """Import cuda.bindings.driver lazily, so CPU-only code never needs the driver library."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:  # pragma: no cover - install problem
            raise NoDeviceError(f"cuda-bindings is not installed ({e}); run: pip install -e .") from None
        _driver = driver
    return _driver


def _error_name(err) -> str:
    drv = _load()
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS:
            return name.decode()
    except Exception:
        pass
    return str(err)


def call(fn, *args):
    """Call a driver function and check its result. Returns None, one value, or a tuple."""
    out = fn(*args)
    err, vals = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if int(err) != 0:
        raise CudaError(f"{fn.__name__} failed: {_error_name(err)}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


@dataclass
class DeviceInfo:
    ordinal: int
    name: str
    sm_count: int
    cc: tuple[int, int]
    smem_per_block: int          # default limit without opt-in
    smem_per_block_optin: int    # the most a kernel may ask for after raising its attribute
    smem_per_sm: int
    l2_bytes: int
    total_mem: int
    free_mem: int
    driver_version: int

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"


class Device:
    """The primary context of one GPU, made current on this thread."""

    def __init__(self, ordinal: int = 0):
        try:
            drv = _load()
            call(drv.cuInit, 0)
        except NoDeviceError:
            raise
        except Exception as e:  # library missing, or cuInit returned no device
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise NoDeviceError(f"no NVIDIA GPU is usable here ({msg})") from None
        count = call(drv.cuDeviceGetCount)
        if count == 0:
            raise NoDeviceError("no NVIDIA GPU is usable here (cuDeviceGetCount = 0)")
        if not 0 <= ordinal < count:
            raise NoDeviceError(f"device {ordinal} does not exist ({count} GPU(s) found)")
        self.drv = drv
        self.dev = call(drv.cuDeviceGet, ordinal)
        self.ctx = call(drv.cuDevicePrimaryCtxRetain, self.dev)
        call(drv.cuCtxSetCurrent, self.ctx)
        A = drv.CUdevice_attribute

        def attr(a):
            return call(drv.cuDeviceGetAttribute, a, self.dev)

        name = call(drv.cuDeviceGetName, 256, self.dev)
        free, total = call(drv.cuMemGetInfo)
        self.info = DeviceInfo(
            ordinal=ordinal,
            name=name.split(b"\0")[0].decode(),
            sm_count=attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            cc=(attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            smem_per_block=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK),
            smem_per_block_optin=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            smem_per_sm=attr(A.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
            l2_bytes=attr(A.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
            total_mem=int(total),
            free_mem=int(free),
            driver_version=call(drv.cuDriverGetVersion),
        )

    def mem_info(self) -> tuple[int, int]:
        free, total = call(self.drv.cuMemGetInfo)
        return int(free), int(total)

    # ---- memory -------------------------------------------------------------------
    def malloc(self, nbytes: int) -> int:
        return int(call(self.drv.cuMemAlloc, max(int(nbytes), 1)))

    def free(self, ptr: int):
        call(self.drv.cuMemFree, ptr)

    def htod(self, dst: int, host, stream=None):
        """Copy a contiguous numpy array to device address dst; the data is in device memory when
        this returns. (cuMemcpyHtoD from pageable memory may return while its DMA is still in
        flight, and work on a non-blocking stream is not ordered after it: a kernel launched
        next could read, or have its output overwritten by, the copy still landing.)"""
        if stream is None:
            call(self.drv.cuMemcpyHtoD, dst, host.ctypes.data, host.nbytes)
            call(self.drv.cuCtxSynchronize)
        else:
            call(self.drv.cuMemcpyHtoDAsync, dst, host.ctypes.data, host.nbytes, stream)
            call(self.drv.cuStreamSynchronize, stream)

    def htod_async(self, dst: int, src_host: int, nbytes: int, stream):
        """Enqueue a copy from host address src_host (page-locked: host_alloc) to dst on the stream;
        the host memory must stay unchanged until the copy ran (record an event after it)."""
        call(self.drv.cuMemcpyHtoDAsync, dst, src_host, nbytes, stream)

    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory (async copies from it overlap the GPU's work)."""
        return int(call(self.drv.cuMemHostAlloc, max(int(nbytes), 1), 0))

    def host_free(self, ptr: int):
        call(self.drv.cuMemFreeHost, ptr)

    def event_sync(self, event):
        call(self.drv.cuEventSynchronize, event)

    def dtoh(self, host, src: int):
        call(self.drv.cuMemcpyDtoH, host.ctypes.data, src, host.nbytes)

    def dtoh_async(self, dst_host: int, src: int, nbytes: int, stream):
        """Enqueue a copy from src to host address dst_host (page-locked: host_alloc) on the stream;
        the data is there once an event recorded after it has completed."""
        call(self.drv.cuMemcpyDtoHAsync, dst_host, src, nbytes, stream)

    def memset32(self, ptr: int, word: int, count: int, stream=None):
        if stream is None:
            call(self.drv.cuMemsetD32, ptr, word & 0xFFFFFFFF, count)
        else:
            call(self.drv.cuMemsetD32Async, ptr, word & 0xFFFFFFFF, count, stream)

    # ---- streams, events ----------------------------------------------------------
    def stream(self):
        return call(self.drv.cuStreamCreate, self.drv.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def sync(self, stream=None):
        if stream is None:
            call(self.drv.cuCtxSynchronize)
        else:
            call(self.drv.cuStreamSynchronize, stream)

    def event(self):
        return call(self.drv.cuEventCreate, self.drv.CUevent_flags.CU_EVENT_DEFAULT)

    def event_destroy(self, event):
        call(self.drv.cuEventDestroy, event)

    def record(self, event, stream, external: bool = False):
        """Record an event; external=True inside a stream capture makes it a graph node that
        really records (a plain record there is only a dependency marker)."""
        if external:
            call(self.drv.cuEventRecordWithFlags, event, stream,
                 self.drv.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
        else:
            call(self.drv.cuEventRecord, event, stream)

    def elapsed_ms(self, start, end) -> float:
        call(self.drv.cuEventSynchronize, end)
        return float(call(self.drv.cuEventElapsedTime, start, end))

    # ---- modules and launches -----------------------------------------------------
    def load_module(self, cubin: bytes):
        return call(self.drv.cuModuleLoadData, cubin)

    def get_function(self, module, lowered_name: str):
        return call(self.drv.cuModuleGetFunction, module, lowered_name.encode())

    def set_max_dynamic_smem(self, fn, nbytes: int):
        A = self.drv.CUfunction_attribute
        call(self.drv.cuFuncSetAttribute, fn,
             A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))

    def param_sizes(self, fn) -> tuple[int, ...] | None:
        """The byte size of each of a kernel's parameters (cuFuncGetParamInfo), or None where the
        driver cannot say (then launches go unchecked)."""
        get = getattr(self.drv, "cuFuncGetParamInfo", None)
        if get is None:
            return None
        sizes = []
        while True:
            out = get(fn, len(sizes))
            if int(out[0]) != 0:
                # past the last parameter (INVALID_VALUE); none read at all: the driver cannot say
                return tuple(sizes) if sizes and out[0] == self.drv.CUresult.CUDA_ERROR_INVALID_VALUE else None
            sizes.append(int(out[2]))

    def function_attrs(self, fn) -> dict:
        A = self.drv.CUfunction_attribute
        return {
            "registers": call(self.drv.cuFuncGetAttribute, A.CU_FUNC_ATTRIBUTE_NUM_REGS, fn),
            "static_smem": call(self.drv.cuFuncGetAttribute, A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn),
            "local_bytes": call(self.drv.cuFuncGetAttribute, A.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn),
            "max_threads": call(self.drv.cuFuncGetAttribute, A.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn),
        }

    def tensor_map(self, ptr: int, dims, strides_bytes, box, swizzle=True, dtype="f32") -> bytes:
        """The 128 bytes of a TMA tensor map over an fp32 (or bf16) tensor at ptr: dims innermost
        first, strides (bytes) of every dim but the innermost, box (elements per dim). swizzle: the
        128-byte swizzle (True or 128; the innermost box must span 128 bytes or less), the 64-byte one
        (64), else (False) the box lands dense, row after row; out-of-bounds elements read as zero."""
        d = self.drv
        u64, u32 = d.cuuint64_t, d.cuuint32_t
        kind = {"f32": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                "bf16": d.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16}[dtype]
        tm = call(d.cuTensorMapEncodeTiled, kind,
                  len(dims), ptr, [u64(int(x)) for x in dims], [u64(int(x)) for x in strides_bytes],
                  [u32(int(x)) for x in box], [u32(1)] * len(dims),
                  d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
                  d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B if swizzle == 64 else
                  d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else
                  d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                  d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        words = [int(w) for w in tm.opaque]
        return b"".join(w.to_bytes(8, "little") for w in words)

    def launch(self, fn, grid, block, smem, stream, params_ptr: int):
        call(self.drv.cuLaunchKernel, fn, grid[0], grid[1], grid[2],
             block[0], block[1], block[2], smem, stream, params_ptr, 0)

    # ---- graphs -------------------------------------------------------------------
    def begin_capture(self, stream):
        call(self.drv.cuStreamBeginCapture, stream,
             self.drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)

    def end_capture(self, stream):
        graph = call(self.drv.cuStreamEndCapture, stream)
        exe = call(self.drv.cuGraphInstantiate, graph, 0)
        return graph, exe

    def graph_launch(self, exe, stream):
        call(self.drv.cuGraphLaunch, exe, stream)

    def graph_destroy(self, graph, exe):
        call(self.drv.cuGraphExecDestroy, exe)
        call(self.drv.cuGraphDestroy, graph)


def drives_gpu(rt) -> bool:
    """Whether runtime rt (or None) drives a GPU through a Device, not a stand-in device (the tests')."""
    return isinstance(getattr(rt, "dev", None), Device)


def nvml_read(read, ordinal: int = 0):
    """read(pynvml, the device's handle) through NVML when nvidia-ml-py is importable and the board answers,
    else None. Read only."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return read(pynvml, pynvml.nvmlDeviceGetHandleByIndex(ordinal))
    except Exception:
        return None


def sm_clock_mhz(ordinal: int = 0):
    """The SM clock through NVML (nvml_read), else None. Read only."""
    return nvml_read(lambda nv, h: int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)), ordinal)


__all__ = ["CudaError", "NoDeviceError", "Device", "DeviceInfo", "call", "drives_gpu", "nvml_read", "sm_clock_mhz"]
