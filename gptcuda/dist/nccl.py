"""NCCL through nccl4py's low-level bindings (imported here and only here, on first use), and
the start-up self-test of a communicator."""
from __future__ import annotations

import os

import numpy as np

from gptcuda.dist.env import DistError

UID_BYTES = 128             # sizeof(ncclUniqueId)

DTYPES = {"f32": 7, "f64": 8, "i32": 2, "bf16": 9}       # ncclFloat32, ncclFloat64, ncclInt32, ncclBfloat16
OPS = {"sum": 0, "avg": 4}                    # ncclSum, ncclAvg
ITEMSIZE = {"f32": 4, "f64": 8, "i32": 4, "bf16": 2}

_nccl = None


def load_nccl():
    """nccl4py's bindings, imported on first use (the optional extra `dist`)."""
    global _nccl
    if _nccl is None:
        os.environ["NCCL_NVLS_ENABLE"] = "0"           # before NCCL reads its environment
        try:
            from nccl.bindings import nccl as n
        except ImportError as e:
            raise DistError(f"data-parallel training needs nccl4py (pip install 'gptcuda[dist]'): {e}") from None
        try:
            n.get_version()                            # loads libnccl.so.2 (cuda.pathfinder: nvidia-nccl-cu*)
        except Exception as e:
            raise DistError(f"nccl4py found no NCCL library (pip install nvidia-nccl-cu13, or set NCCL_HOME): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        _nccl = n
    return _nccl


def nccl_version() -> str:
    v = int(load_nccl().get_version())
    return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"


class NcclComm:
    """One NCCL communicator. Pointers and streams are plain integers (int(CUstream))."""

    def __init__(self, uid: bytes, world: int, rank: int):
        n = self.n = load_nccl()
        self.world, self.rank = int(world), int(rank)
        try:
            if hasattr(n, "comm_init_rank_scalable"):
                self.comm = n.comm_init_rank_scalable(self.world, self.rank, 1, bytearray(uid), 0)
            else:                                                     # pragma: no cover - older bindings
                self.comm = n.comm_init_rank(self.world, n.UniqueId.from_buffer(bytearray(uid)), self.rank)
        except n.NCCLError as e:
            raise DistError(f"NCCL could not connect rank {rank} of {world}: {e} (NCCL_DEBUG=INFO shows why)") from None
        self._closed = False

    @staticmethod
    def unique_id() -> bytes:
        b = bytes(load_nccl().get_unique_id())
        if len(b) != UID_BYTES:
            raise DistError(f"an NCCL unique id of {len(b)} bytes (expected {UID_BYTES})")
        return b

    def all_reduce(self, send: int, recv: int, count: int, dtype: str, op: str, stream: int):
        self.n.all_reduce(send, recv, count, DTYPES[dtype], OPS[op], self.comm, stream)

    def reduce(self, send: int, recv: int, count: int, dtype: str, op: str, root: int, stream: int):
        self.n.reduce(send, recv, count, DTYPES[dtype], OPS[op], root, self.comm, stream)

    def reduce_scatter(self, send: int, recv: int, recvcount: int, dtype: str, op: str, stream: int):
        self.n.reduce_scatter(send, recv, recvcount, DTYPES[dtype], OPS[op], self.comm, stream)

    def all_gather(self, send: int, recv: int, sendcount: int, dtype: str, stream: int):
        self.n.all_gather(send, recv, sendcount, DTYPES[dtype], self.comm, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: str, root: int, stream: int):
        self.n.broadcast(send, recv, count, DTYPES[dtype], root, self.comm, stream)

    def group_start(self):
        self.n.group_start()

    def group_end(self):
        self.n.group_end()

    def check(self):
        """Raise when NCCL has recorded an asynchronous error on the communicator."""
        err = int(self.n.comm_get_async_error(self.comm))
        if err not in (0, 7):                         # ncclSuccess, ncclInProgress
            raise DistError(f"NCCL error on rank {self.rank}: {self.n.get_error_string(err)}")

    def close(self):
        if not self._closed:
            self._closed = True
            self.n.comm_destroy(self.comm)

    def abort(self):
        if not self._closed:
            self._closed = True
            self.n.comm_abort(self.comm)


# ---------------------------------------------------------------------------------------------
# the self-test

def selftest_vectors(rank: int, world: int, n: int):
    """(this rank's vector, the expected sum over ranks): small integers, exact in float32."""
    k = (np.arange(n) % 13).astype(np.float32)
    mine = k + np.float32(rank + 1)
    want = k * np.float32(world) + np.float32(world * (world + 1) // 2)
    return mine, want


def check_selftest(got, want, what: str, rank: int, world: int, rtol: float = 0.0):
    got, want = np.asarray(got), np.asarray(want)
    bad = np.flatnonzero(~(np.abs(got.astype(np.float64) - want) <= rtol * np.abs(want.astype(np.float64))))
    if got.shape != want.shape or bad.size:
        i = int(bad[0]) if bad.size else -1
        detail = (f"element {i} is {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r} "
                  f"({bad.size} of {want.size} wrong)" if bad.size else f"shape {got.shape} != {want.shape}")
        raise DistError(f"NCCL self-test failed on rank {rank} of {world}: {what} of a known vector is wrong: "
                        f"{detail}. The collective is broken on this machine; stopping before training "
                        "(NCCL_DEBUG=INFO shows the transport; NCCL_P2P_DISABLE=1 or NCCL_SHM_DISABLE=1 "
                        "narrow it down)")


def selftest(rt, comm, rank: int, world: int, zero: bool = False, n: int = (1 << 20) + 3):
    """All-reduce known vectors (sum f32 and f64, average f32; with zero also reduce-scatter and
    all-gather) on rt's stream and check every element; a wrong one raises DistError."""
    dev, W, r = rt.dev, world, rank
    s = int(rt.stream)
    ptr = dev.malloc(8 * n)
    try:
        def roundtrip(host, fn):
            rt.synchronize()
            dev.htod(ptr, np.ascontiguousarray(host))
            fn()
            rt.synchronize()
            out = np.empty_like(host)
            dev.dtoh(out, ptr)
            return out

        mine, want = selftest_vectors(r, W, n)
        got = roundtrip(mine, lambda: comm.all_reduce(ptr, ptr, n, "f32", "sum", s))
        check_selftest(got, want, "all-reduce (sum, float32)", r, W)
        got = roundtrip(mine.astype(np.float64), lambda: comm.all_reduce(ptr, ptr, n, "f64", "sum", s))
        check_selftest(got, want.astype(np.float64), "all-reduce (sum, float64)", r, W)
        got = roundtrip(mine * np.float32(W), lambda: comm.all_reduce(ptr, ptr, n, "f32", "avg", s))
        check_selftest(got, want, "all-reduce (average, float32)", r, W, rtol=1e-6)
        if zero:
            c = n // W
            got = roundtrip(mine, lambda: comm.reduce_scatter(ptr, ptr + 4 * r * c, c, "f32", "sum", s))
            check_selftest(got[r * c:(r + 1) * c], want[r * c:(r + 1) * c], "reduce-scatter", r, W)
            shard = np.full(n, -1.0, np.float32)
            shard[r * c:(r + 1) * c] = np.float32(r)
            got = roundtrip(shard, lambda: comm.all_gather(ptr + 4 * r * c, ptr, c, "f32", s))
            check_selftest(got[:W * c], np.repeat(np.arange(W, dtype=np.float32), c), "all-gather", r, W)
    finally:
        dev.free(ptr)
