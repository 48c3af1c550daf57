"""Data-parallel training on NCCL: one process per GPU, every rank a full copy of the model.

    python -m gptcuda.launch --nproc 2 train.py configs/tiny.yaml       # see gptcuda/launch.py

What a rank does (train.py -> Trainer -> Engine -> DataParallel):

  * parse_env()          RANK, WORLD_SIZE, LOCAL_RANK (and the rendezvous settings) from the launcher,
                         or from mpirun / srun through the same variables (README, "Several GPUs")
  * init_group(env)      rank 0 makes the NCCL unique id; share_unique_id hands it to every rank
                         through a TCP socket that rank 0 serves on MASTER_ADDR:MASTER_PORT, or a
                         file in a shared directory; bounded retries and timeouts, one-line errors
  * DataParallel(...)    the communicator (nccl4py's bindings, imported here and only here), the
                         start-up self-test, and the data-parallel part of the recorded step:
        - rank r reads rows [r*B, (r+1)*B) of each micro-batch of the world's batch (the Engine's
          batches.Batches gets the rank), with its own dropout stream (rt.seed mixed with the
          rank; rank 0 keeps the seed);
        - the loss mean and the gradients are all-reduced (ncclAvg: the sum divided by the world
          size, so each rank keeps grad_scale 1/(B*T)) in buckets on a second stream, each bucket
          as soon as the backward has written its last tensor (plan_buckets; with gradient
          accumulation, after the last micro-batch's backward has added the others'); the main stream
          waits for the communication stream before the gradient norm and AdamW;
        - zero: 1 instead reduce-scatters the gradients after the backward, takes the norm of this
          rank's shard (partial sums all-reduced), updates its shard with its share of the Adam
          state, and all-gathers the parameters (zero_shards).

World size 1 never comes here unless asked (GPTCUDA_DIST=nccl): the single-GPU step is unchanged
and nothing imports NCCL. NCCL_NVLS_ENABLE=0 is forced: no NVLink multicast.
"""
from __future__ import annotations

import os
import socket
import struct
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

__all__ = ["DistError", "DistEnv", "parse_env", "share_unique_id", "init_group", "Group", "NcclComm",
           "Bucket", "tensor_extents", "production_order", "plan_buckets", "ZeroShards", "zero_shards",
           "selftest_vectors", "check_selftest", "selftest", "rank_seed", "DataParallel"]

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_BUCKET_MB = 25.0
ALIGN = 4                   # elements: shard starts stay 16-byte aligned for the float4 kernels
UID_BYTES = 128             # sizeof(ncclUniqueId)
MAGIC = b"GPTCUDA\x01"


class DistError(RuntimeError):
    """A data-parallel setup or communication failure; str(err) is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# ---------------------------------------------------------------------------------------------
# the environment

@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int = DEFAULT_PORT
    rdzv: str = "tcp"                 # tcp | file
    rdzv_dir: str | None = None
    run_id: str = ""
    timeout: float = DEFAULT_TIMEOUT_S
    bucket_mb: float = DEFAULT_BUCKET_MB
    force: bool = False               # GPTCUDA_DIST=nccl: go through NCCL even at world size 1
    source: str = "default"           # which variables set the rank

    @property
    def enabled(self) -> bool:
        return self.world_size > 1 or self.force

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# (rank, world size, local rank, local world size, who sets them); the first whose rank and size
# variables are both set wins. Slurm's own variables are not read: a batch script that runs one
# python has SLURM_PROCID=0 and SLURM_NTASKS=N too; srun maps them explicitly (README).
_SOURCES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "launcher"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun (Open MPI)"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "mpirun (MPICH)"),
)


def _int(environ, name, lo=None, hi=None) -> int:
    raw = environ[name].strip()
    try:
        v = int(raw)
    except ValueError:
        raise DistError(f"{name}={environ[name]!r} is not an integer") from None
    if lo is not None and v < lo:
        raise DistError(f"{name}={v} must be >= {lo}")
    if hi is not None and v > hi:
        raise DistError(f"{name}={v} must be <= {hi}")
    return v


def _float(environ, name, default: float) -> float:
    if not environ.get(name, "").strip():
        return default
    try:
        v = float(environ[name])
    except ValueError:
        raise DistError(f"{name}={environ[name]!r} is not a number") from None
    if not v > 0 or v != v or v == float("inf"):
        raise DistError(f"{name}={environ[name]!r} must be a positive number")
    return v


def parse_env(environ=None) -> DistEnv:
    """This process's place in the job from its environment (os.environ by default).

    No variables: world size 1. RANK and WORLD_SIZE come together; LOCAL_RANK (the GPU) defaults
    to RANK. The rendezvous: GPTCUDA_RDZV=tcp (default; MASTER_ADDR, MASTER_PORT) or file
    (GPTCUDA_RDZV_DIR, a directory every rank sees, and GPTCUDA_RUN_ID); GPTCUDA_RDZV_TIMEOUT
    seconds; GPTCUDA_BUCKET_MB the gradient bucket size; GPTCUDA_DIST=nccl forces NCCL at size 1."""
    e = os.environ if environ is None else environ
    src = None
    for rank_v, size_v, lrank_v, lsize_v, who in _SOURCES:
        has_rank, has_size = bool(e.get(rank_v, "").strip()), bool(e.get(size_v, "").strip())
        if has_rank and has_size:
            src = (rank_v, size_v, lrank_v, lsize_v, who)
            break
        if who == "launcher" and has_size and not has_rank and e[size_v].strip() == "1":
            break                                     # WORLD_SIZE=1 alone: one GPU
        if has_rank != has_size and who == "launcher":
            missing, present = (size_v, rank_v) if has_rank else (rank_v, size_v)
            raise DistError(f"{present} is set but {missing} is not; set both (or neither, for one GPU)")
    force = e.get("GPTCUDA_DIST", "").strip().lower()
    if force not in ("", "nccl", "none"):
        raise DistError(f"GPTCUDA_DIST={e['GPTCUDA_DIST']!r} must be 'nccl' (force NCCL at world size 1) or unset")
    common = dict(timeout=_float(e, "GPTCUDA_RDZV_TIMEOUT", DEFAULT_TIMEOUT_S),
                  bucket_mb=_float(e, "GPTCUDA_BUCKET_MB", DEFAULT_BUCKET_MB), force=force == "nccl")
    if src is None:
        return DistEnv(**common)
    rank_v, size_v, lrank_v, lsize_v, who = src
    world = _int(e, size_v, lo=1)
    rank = _int(e, rank_v, lo=0)
    if rank >= world:
        raise DistError(f"{rank_v}={rank} must be < {size_v}={world}")
    local_rank = _int(e, lrank_v, lo=0) if e.get(lrank_v, "").strip() else rank
    local_world = _int(e, lsize_v, lo=1) if e.get(lsize_v, "").strip() else world
    if local_rank >= local_world:
        raise DistError(f"{lrank_v}={local_rank} must be < {lsize_v}={local_world}")
    rdzv = e.get("GPTCUDA_RDZV", "").strip().lower() or "tcp"
    if rdzv not in ("tcp", "file"):
        raise DistError(f"GPTCUDA_RDZV={e['GPTCUDA_RDZV']!r} must be 'tcp' or 'file'")
    addr = e.get("MASTER_ADDR", "").strip() or None
    port = _int(e, "MASTER_PORT", lo=1, hi=65535) if e.get("MASTER_PORT", "").strip() else DEFAULT_PORT
    run_id = (e.get("GPTCUDA_RUN_ID", "").strip() or e.get("SLURM_JOB_ID", "").strip())
    rdzv_dir = e.get("GPTCUDA_RDZV_DIR", "").strip() or None
    if world > 1 and rdzv == "tcp" and addr is None:
        raise DistError(f"MASTER_ADDR is not set: the address of rank 0's host, where it serves the NCCL id on "
                        f"MASTER_PORT (127.0.0.1 on one host); WORLD_SIZE={world} came from {who}")
    if world > 1 and rdzv == "file":
        if rdzv_dir is None:
            raise DistError("GPTCUDA_RDZV=file needs GPTCUDA_RDZV_DIR, a directory every rank can read")
        if not run_id:
            raise DistError("GPTCUDA_RDZV=file needs GPTCUDA_RUN_ID (the same on every rank, new for every run)")
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   master_addr=addr, master_port=port, rdzv=rdzv, rdzv_dir=rdzv_dir, run_id=run_id,
                   source=who, **common)


def rank_seed(seed: int, rank: int) -> int:
    """The dropout seed of a rank: the run's seed on rank 0, a different stream on every other."""
    return (int(seed) + int(rank) * 0x9E3779B9) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# the rendezvous: rank 0's NCCL unique id to every rank

def _tag(run_id: str) -> int:
    return zlib.crc32(run_id.encode()) if run_id else 0


_HELLO = struct.Struct(">8siiI")     # magic, rank, world size, run tag
_REPLY = struct.Struct(">8scI")      # magic, b"K" (payload follows) or b"E" (message follows), length


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _send_reply(conn, kind: bytes, data: bytes):
    conn.sendall(_REPLY.pack(MAGIC, kind, len(data)) + data)


def _serve_tcp(env: DistEnv, payload: bytes, deadline: float):
    """Rank 0: hand payload to ranks 1..W-1, each once, before the deadline."""
    addr = env.master_addr or "127.0.0.1"
    try:
        srv = socket.create_server((addr, env.master_port))
    except OSError as e:
        if e.errno in (98, 48):        # EADDRINUSE (Linux, macOS)
            raise DistError(f"rank 0 cannot serve the rendezvous on {addr}:{env.master_port}: the port is in use "
                            "(another run?); choose another MASTER_PORT") from None
        try:                           # MASTER_ADDR names this host in a way bind() does not take
            srv = socket.create_server(("", env.master_port))
        except OSError as e2:
            raise DistError(f"rank 0 cannot serve the rendezvous on port {env.master_port}: {e2}") from None
    served = set()
    tag = _tag(env.run_id)
    try:
        while len(served) < env.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, env.world_size)) - served)
                raise DistError(f"rendezvous timed out after {env.timeout:.0f} s on {addr}:{env.master_port}: "
                                f"rank(s) {missing} never connected; are they running, with this MASTER_ADDR "
                                "and MASTER_PORT?")
            srv.settimeout(left)
            try:
                conn, _peer = srv.accept()
            except (socket.timeout, TimeoutError):
                continue
            with conn:
                conn.settimeout(max(min(10.0, deadline - time.monotonic()), 0.1))
                try:
                    magic, rank, world, their_tag = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
                    if magic != MAGIC:
                        continue               # not one of ours
                    if world != env.world_size or their_tag != tag:
                        what = (f"WORLD_SIZE {world} != {env.world_size}" if world != env.world_size
                                else "GPTCUDA_RUN_ID differs")
                        _send_reply(conn, b"E", f"rank 0 on {addr}:{env.master_port} belongs to another run "
                                                f"({what})".encode())
                        continue
                    if not 1 <= rank < env.world_size:
                        _send_reply(conn, b"E", f"rank {rank} is outside 1..{env.world_size - 1}".encode())
                        continue
                    _send_reply(conn, b"K", payload)
                    served.add(rank)           # a rank that retries is served again, counted once
                except (OSError, ConnectionError, struct.error):
                    continue
    finally:
        srv.close()


def _fetch_tcp(env: DistEnv, deadline: float) -> bytes:
    """Ranks 1..W-1: connect to rank 0 (retrying while it starts) and read the payload."""
    addr, port = env.master_addr or "127.0.0.1", env.master_port
    hello = _HELLO.pack(MAGIC, env.rank, env.world_size, _tag(env.run_id))
    delay, attempts, last = 0.05, 0, "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DistError(f"rank {env.rank}: no rendezvous at {addr}:{port} after {env.timeout:.0f} s "
                            f"({attempts} attempts, last: {last}); is rank 0 running, with the same "
                            "MASTER_ADDR and MASTER_PORT?")
        attempts += 1
        try:
            with socket.create_connection((addr, port), timeout=min(10.0, left)) as s:
                s.settimeout(min(10.0, max(left, 0.1)))
                s.sendall(hello)
                magic, kind, n = _REPLY.unpack(_recv_exact(s, _REPLY.size))
                if magic != MAGIC or n > 1 << 20:
                    raise ConnectionError("not a gptcuda rendezvous server")
                data = _recv_exact(s, n)
                if kind == b"E":
                    raise DistError(f"rank {env.rank}: rendezvous refused: {data.decode(errors='replace')}")
                return data
        except DistError:
            raise
        except (OSError, ConnectionError, struct.error) as e:
            last = type(e).__name__ if not str(e) else str(e)
        time.sleep(min(delay, max(deadline - time.monotonic(), 0)))
        delay = min(delay * 2, 1.0)


def rdzv_path(env: DistEnv) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in env.run_id)
    return os.path.join(env.rdzv_dir, f"gptcuda-rdzv-{safe}-w{env.world_size}.id")


def _write_file(env: DistEnv, payload: bytes):
    path = rdzv_path(env)
    os.makedirs(env.rdzv_dir, exist_ok=True)
    blob = MAGIC + struct.pack(">iII", env.world_size, zlib.crc32(payload), len(payload)) + payload
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_file(env: DistEnv, deadline: float) -> bytes:
    path = rdzv_path(env)
    delay = 0.02
    while True:
        try:
            with open(path, "rb") as f:
                blob = f.read()
            head = len(MAGIC) + 12
            if len(blob) >= head and blob[:len(MAGIC)] == MAGIC:
                world, crc, n = struct.unpack(">iII", blob[len(MAGIC):head])
                data = blob[head:head + n]
                if world != env.world_size:
                    raise DistError(f"rank {env.rank}: {path} was written by a run of {world} ranks, not "
                                    f"{env.world_size}; use a new GPTCUDA_RUN_ID")
                if len(data) == n and zlib.crc32(data) == crc:
                    return data
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            raise DistError(f"rank {env.rank}: no NCCL id at {path} after {env.timeout:.0f} s; is rank 0 running, "
                            "and GPTCUDA_RDZV_DIR the same shared directory on every rank?")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def share_unique_id(env: DistEnv, make_id, timeout: float | None = None) -> bytes:
    """Rank 0 calls make_id() and every rank returns its bytes (a TCP socket or a shared file)."""
    deadline = time.monotonic() + (env.timeout if timeout is None else timeout)
    if env.world_size == 1:
        return bytes(make_id())
    if env.rdzv == "file":
        if env.rank == 0:
            payload = bytes(make_id())
            _write_file(env, payload)
            return payload
        return _read_file(env, deadline)
    if env.rank == 0:
        payload = bytes(make_id())
        _serve_tcp(env, payload, deadline)
        return payload
    return _fetch_tcp(env, deadline)


# ---------------------------------------------------------------------------------------------
# the gradient buckets

@dataclass(frozen=True)
class Bucket:
    index: int
    point: object       # the backward's hook point after which all its tensors are final
    names: tuple        # its tensors, in production order
    spans: tuple        # ((start, stop), ...) element ranges of the flat region, ascending, merged

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.spans)


def tensor_extents(table) -> dict:
    """name -> (start, stop) in the flat region: the tensor and the padding after it (up to the next
    tensor, or the end of the region), so the extents tile [0, table.total) exactly."""
    specs = sorted(table, key=lambda s: s.offset)
    out = {}
    for i, s in enumerate(specs):
        stop = specs[i + 1].offset if i + 1 < len(specs) else table.total
        out[s.name] = (s.offset, stop)
    if specs and specs[0].offset != 0:
        first = specs[0]
        out[first.name] = (0, out[first.name][1])
    return out


_LAYER_ORDER = ("fcproj.w", "fcproj.b", "fc.w", "fc.b", "ln2.w", "ln2.b",
                "proj.w", "proj.b", "attn.w", "attn.b", "ln1.w", "ln1.b")


def production_order(table) -> list:
    """[(point, [names])] in the order model.backward() finishes them: the final layernorm ("head"),
    layers L-1 .. 0 (point = the layer index), then the embeddings ("embed": wte, which the tied head
    also writes, and wpe, written last by encoder_bwd). A tensor this list does not know is put at
    "embed", the end of the backward, where every gradient is final."""
    names = [s.name for s in table]
    layers = defaultdict(list)
    head, embed, rest = [], [], []
    for n in names:
        if n.startswith("h") and "." in n and n[1:n.index(".")].isdigit():
            layers[int(n[1:n.index(".")])].append(n)
        elif n.startswith("lnf."):
            head.append(n)
        elif n in ("wte", "wpe"):
            embed.append(n)
        else:
            rest.append(n)
    rank = {k: i for i, k in enumerate(_LAYER_ORDER)}
    order = [("head", sorted(head))]
    for l in sorted(layers, reverse=True):
        known = [n for n in layers[l] if n.split(".", 1)[1] in rank]
        unknown = [n for n in layers[l] if n.split(".", 1)[1] not in rank]
        order.append((l, sorted(known, key=lambda n: rank[n.split(".", 1)[1]])))
        rest += unknown
    order.append(("embed", embed + rest))
    return [(p, ns) for p, ns in order if ns]


def _merge(extents) -> tuple:
    spans = []
    for a, b in sorted(extents):
        if spans and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return tuple(spans)


def plan_buckets(table, cap_elems: int) -> list:
    """Buckets of whole tensors in production order, each at most cap_elems elements unless it is a
    single tensor larger than that; together they cover the flat gradient region exactly. A bucket
    is issued at the point of its last tensor, so its all-reduce runs while the backward goes on."""
    if cap_elems < 1:
        raise ValueError(f"bucket cap {cap_elems} must be >= 1 element")
    ext = tensor_extents(table)
    buckets, cur, cur_n, cur_point = [], [], 0, None

    def close():
        buckets.append(Bucket(len(buckets), cur_point, tuple(cur), _merge(ext[n] for n in cur)))

    for point, names in production_order(table):
        for name in names:
            a, b = ext[name]
            if cur and cur_n + (b - a) > cap_elems:
                close()
                cur, cur_n = [], 0
            cur.append(name)
            cur_n += b - a
            cur_point = point
    if cur:
        close()
    return buckets


# ---------------------------------------------------------------------------------------------
# ZeRO-1 shards

@dataclass(frozen=True)
class ZeroShards:
    """Rank r owns [r*shard, (r+1)*shard) of the flat region; the last rank also owns the tail
    [world*shard, total) (fewer than ALIGN*world elements), which it gets by ncclReduce and hands
    back by ncclBroadcast. shard is a multiple of ALIGN, so every owned range starts 16-byte aligned
    and the reduce-scatter / all-gather of [0, world*shard) are in place."""
    total: int
    world: int
    shard: int

    @property
    def even(self) -> int:
        return self.shard * self.world

    @property
    def tail(self) -> int:
        return self.total - self.even

    def owned(self, rank: int) -> tuple:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside 0..{self.world - 1}")
        start = rank * self.shard
        return start, (self.total if rank == self.world - 1 else start + self.shard)


def zero_shards(total: int, world: int, align: int = ALIGN) -> ZeroShards:
    if world < 1 or total < 0 or align < 1:
        raise ValueError(f"zero_shards({total}, {world}, {align})")
    return ZeroShards(int(total), int(world), int(total) // (world * align) * align)


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


# ---------------------------------------------------------------------------------------------
# NCCL (nccl4py's low-level bindings: plain integers for pointers and streams)

DTYPES = {"f32": 7, "f64": 8, "i32": 2}       # ncclFloat32, ncclFloat64, ncclInt32
OPS = {"sum": 0, "avg": 4}                    # ncclSum, ncclAvg
ITEMSIZE = {"f32": 4, "f64": 8, "i32": 4}

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


class Group:
    """This process's place in the job (a DistEnv) and the id its communicator is built from.
    `connect()` builds the communicator on the current device, once; options for DataParallel:
    bucket_mb (from GPTCUDA_BUCKET_MB), comm_timing (events around every collective, for
    bench/scaling.py) and selftest (False only in tests with a fake communicator)."""

    def __init__(self, env: DistEnv, uid: bytes, comm_factory=None):
        self.env, self.uid = env, bytes(uid)
        self.rank, self.world_size, self.local_rank = env.rank, env.world_size, env.local_rank
        self.bucket_mb = env.bucket_mb
        self.comm_timing = False
        self.selftest = True
        self._factory = comm_factory or (lambda: NcclComm(self.uid, self.world_size, self.rank))
        self.comm = None
        self.before_close = []         # callables run before the communicator is destroyed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def connect(self):
        if self.comm is None:
            self.comm = self._factory()
            if self.rank == 0 and self.env.rdzv == "file" and self.world_size > 1:
                try:                                   # every rank has read it: the communicator exists
                    os.unlink(rdzv_path(self.env))
                except OSError:
                    pass
        return self.comm

    def _release(self):
        """Run the before_close hooks: DataParallel registers its runtime's destroy_graphs, since
        NCCL's communicator destroy (and abort) waits for every graph that captured one of its
        collectives to be destroyed, and would otherwise hang at the end of a run."""
        while self.before_close:
            self.before_close.pop()()

    def close(self):
        if self.comm is not None:
            self._release()
            self.comm.close()

    def abort(self):
        if self.comm is not None:
            try:
                self._release()
            finally:
                self.comm.abort()


def init_group(env: DistEnv | None = None, make_id=None) -> Group | None:
    """None at world size 1 (unless GPTCUDA_DIST=nccl); else the rendezvous, done: every rank holds
    rank 0's NCCL unique id. The communicator itself is built later, on the rank's GPU."""
    env = parse_env() if env is None else env
    if not env.enabled:
        return None
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if make_id is None:
        load_nccl()
        make_id = NcclComm.unique_id
    return Group(env, share_unique_id(env, make_id))


# ---------------------------------------------------------------------------------------------
# the data-parallel part of the training step

class DataParallel:
    """Everything one rank adds to the training step; made by Engine when it gets a Group.

    Recording (model.record_train_step calls these in order):
        record_loss_mean()        the mean of the ranks' losses into `loss_mean`, on the comm stream
        record_grads_ready(pt)    the buckets whose last tensor the backward finished at point pt
        record_join()             the main stream waits for the comm stream
        record_update(ops)        gradient norm and AdamW (ZeRO-1: on this rank's shard, then
                                  the parameters are all-gathered)
    Eagerly: warmup() before graph capture, host_mean() for evaluation losses,
    gather_optimizer_state() before a checkpoint (ZeRO-1), comm_times() after a timed step."""

    def __init__(self, group: Group, backend, bufs, table, cfg):
        if getattr(backend, "name", "") != "cuda":
            raise DistError(f"data-parallel training needs the cuda backend, not {cfg.backend!r}")
        self.group, self.rt, self.bufs, self.table, self.cfg = group, backend.rt, bufs, table, cfg
        self.rank, self.world = group.rank, group.world_size
        self.zero = int(getattr(cfg, "zero", 0))
        rt = self.rt
        rt.seed = rank_seed(cfg.seed, self.rank)      # dropout; the batches keep the world's seed (Engine)
        self.comm = group.connect()
        group.before_close.append(rt.destroy_graphs)
        self.side = rt.side_stream()
        self.timing = bool(group.comm_timing)
        self.cap = max(int(group.bucket_mb * 2 ** 20) // 4, 1)
        self.buckets = [] if self.zero else plan_buckets(table, self.cap)
        self._by_point = defaultdict(list)
        for b in self.buckets:
            self._by_point[b.point].append(b)
        self.shards = zero_shards(table.total, self.world) if self.zero else None
        self._scratch = rt.alloc(256)                 # [0]: the world's mean loss; [64:]: host means (f64)
        from .runtime import DeviceView
        self.loss_mean = DeviceView(self._scratch, (1,), "f32", "loss_mean")
        self.timed = []                               # (label, start event, end event)
        self.marks = None                             # (main reached the join, comm stream done)
        if group.selftest:
            self.selftest()

    # ---- set-up ---------------------------------------------------------------------------
    def describe(self) -> str:
        try:
            ver = f"NCCL {nccl_version()}"
        except Exception:                              # a fake communicator (tests)
            ver = "NCCL"
        if self.zero:
            s = self.shards
            how = f"ZeRO-1: gradients reduce-scattered, {s.shard:,} parameters of Adam state per rank"
        else:
            big = max(b.numel for b in self.buckets)
            how = (f"{len(self.buckets)} gradient buckets (<= {self.cap * 4 / 2**20:.1f} MiB, largest "
                   f"{big * 4 / 2**20:.1f} MiB) all-reduced during the backward")
        return (f"data parallel: {self.world} ranks over {ver}, global batch {self.world} x "
                f"{self.cfg.batch_size}; {how}; self-test passed")

    def selftest(self):
        selftest(self.rt, self.comm, self.rank, self.world, zero=bool(self.zero))

    # ---- recording ---------------------------------------------------------------------------
    def _marks(self, label):
        if not self.timing:
            return None
        m = (self.rt.new_event(timing=True), self.rt.new_event(timing=True))
        self.timed.append((label,) + m)
        return m

    def _call(self, fn, label, nbytes, side=True):
        from .runtime import StreamCall
        self.rt.add(StreamCall(fn, label, self.side if side else None, nbytes, self._marks(label)))

    def _fork(self, label):
        from .runtime import StreamFork
        self.rt.add(StreamFork(self.side, self.rt.new_event(), label))

    def record_loss_mean(self):
        st, out, comm = self.rt.state.ptr, self.loss_mean.ptr, self.comm
        self._fork("fork loss")
        self._call(lambda s: comm.all_reduce(st + 8, out, 1, "f32", "avg", s), "allreduce loss", 4)

    def record_grads_ready(self, point):
        """Called by model.backward() at each hook point; issues the buckets that became ready."""
        ready = self._by_point.get(point, [])
        if not ready:
            return
        self._fork(f"fork grads@{point}")
        base, comm = self.bufs.flat_grads.ptr, self.comm
        for b in ready:
            def run(s, spans=b.spans):
                if len(spans) > 1:
                    comm.group_start()
                try:
                    for a, e in spans:
                        comm.all_reduce(base + 4 * a, base + 4 * a, e - a, "f32", "avg", s)
                finally:
                    if len(spans) > 1:
                        comm.group_end()
            self._call(run, f"allreduce bucket {b.index}", 4 * b.numel)

    def record_join(self):
        from .runtime import StreamJoin
        if self.timing:
            self.marks = (self.rt.new_event(timing=True), self.rt.new_event(timing=True))
        self.rt.add(StreamJoin(self.side, self.rt.new_event(), "join comm", self.marks))

    def _sub(self, region, a, b):
        from .runtime import DeviceView
        return DeviceView(region.ptr + 4 * a, (b - a,), "f32", f"{region.name}[{a}:{b}]")

    def record_update(self, o):
        """Gradient norm of the reduced gradients, clipping and AdamW (backend op `o`)."""
        cfg, b = self.cfg, self.bufs
        if not self.zero:
            o.grad_norm(b.flat_grads)
            o.adamw(b.flat_params, b.flat_grads, b.flat_m, b.flat_v, self.table.n_decay, cfg.beta1, cfg.beta2,
                    cfg.eps, cfg.weight_decay, cfg.grad_clip)
            return
        sh, r, W, comm = self.shards, self.rank, self.world, self.comm
        g, p = b.flat_grads.ptr, b.flat_params.ptr
        if sh.shard:
            self._call(lambda s: comm.reduce_scatter(g, g + 4 * r * sh.shard, sh.shard, "f32", "avg", s),
                       "reduce-scatter grads", 4 * sh.even, side=False)
        if sh.tail:
            gt = g + 4 * sh.even
            self._call(lambda s: comm.reduce(gt, gt, sh.tail, "f32", "avg", W - 1, s), "reduce grads tail",
                       4 * sh.tail, side=False)
        lo, hi = sh.owned(r)
        self._record_norm(self._sub(b.flat_grads, lo, hi), max(sh.owned(q)[1] - sh.owned(q)[0] for q in range(W)))
        if hi > lo:
            n_decay = min(max(self.table.n_decay - lo, 0), hi - lo)
            o.adamw(*(self._sub(v, lo, hi) for v in (b.flat_params, b.flat_grads, b.flat_m, b.flat_v)), n_decay,
                    cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, cfg.grad_clip)
        if sh.shard:
            self._call(lambda s: comm.all_gather(p + 4 * r * sh.shard, p, sh.shard, "f32", s),
                       "all-gather params", 4 * sh.even, side=False)
        if sh.tail:
            pt = p + 4 * sh.even
            self._call(lambda s: comm.broadcast(pt, pt, sh.tail, "f32", W - 1, s), "broadcast params tail",
                       4 * sh.tail, side=False)

    def _record_norm(self, owned, n_max: int):
        """state.grad_norm of the whole reduced gradient from this rank's shard: the norm kernel's
        per-block partial sums (double) are all-reduced before its final pass. Every rank launches the
        same number of blocks (from the longest shard), so the partials line up."""
        from .cuda_ops import optim
        from .runtime import i32
        rt, comm = self.rt, self.comm
        part = rt.workspace(optim.WORKSPACE)
        vec = 4 if owned.ptr % 16 == 0 else 1
        G = max(1, min(optim.NORM_BLOCKS, -(-max(n_max // 4, 1) // optim.NORM_THREADS)))
        rt.launch(rt.function(optim.FILE, f"grad_norm_partial<{vec}>"), (G,), (optim.NORM_THREADS,),
                  [part, owned, i32(owned.numel)], label="grad_norm_partial")
        self._call(lambda s: comm.all_reduce(part.ptr, part.ptr, G, "f64", "sum", s), "allreduce norm partials",
                   8 * G, side=False)
        rt.launch(rt.function(optim.FILE, "grad_norm_final"), (1,), (256,), [rt.state, part, i32(G)],
                  label="grad_norm_final")

    # ---- eager -------------------------------------------------------------------------------
    def warmup(self, prog):
        """Run the program's collectives once, eagerly, before it is captured: NCCL connects its
        channels on first use, which must not happen inside a capture. Harmless on a fresh engine:
        the gradients are zero, and ZeRO's all-gather returns the parameters every rank already has."""
        from .runtime import StreamCall
        dev, main = self.rt.dev, self.rt.stream
        self.rt.synchronize()
        for rec in prog.items:
            if isinstance(rec, StreamCall):
                stream = rec.side if rec.side is not None else main
                rec.call(int(stream))
                dev.sync(stream)                      # one collective at a time, as in the step

    def host_mean(self, values) -> list:
        """The mean over ranks of a few host numbers (evaluation losses), in float64."""
        a = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        if a.size > 24:
            raise ValueError(f"host_mean takes at most 24 numbers, got {a.size}")
        rt, ptr = self.rt, self._scratch + 64
        rt.synchronize()
        rt.dev.htod(ptr, a)
        self.comm.all_reduce(ptr, ptr, a.size, "f64", "sum", int(rt.stream))
        rt.synchronize()
        rt.dev.dtoh(a, ptr)
        return [float(x) / self.world for x in a]

    def gather_optimizer_state(self):
        """ZeRO-1: every rank gets the whole Adam m and v (before a checkpoint); no-op otherwise."""
        if not self.zero:
            return
        sh, r, W, comm, s = self.shards, self.rank, self.world, self.comm, int(self.rt.stream)
        self.rt.synchronize()
        for region in (self.bufs.flat_m, self.bufs.flat_v):
            if sh.shard:
                comm.all_gather(region.ptr + 4 * r * sh.shard, region.ptr, sh.shard, "f32", s)
            if sh.tail:
                t = region.ptr + 4 * sh.even
                comm.broadcast(t, t, sh.tail, "f32", W - 1, s)
        self.rt.synchronize()

    def comm_times(self) -> dict:
        """After a step ran (and synchronised): ms of every timed collective, their sum ('busy': the
        communication stream's work) and 'exposed': how long the main stream waited at the join."""
        dev = self.rt.dev
        per = {label: dev.elapsed_ms(a, b) for label, a, b in self.timed}
        out = {"per_call": per, "busy": sum(per.values())}
        if self.marks:
            out["exposed"] = max(0.0, dev.elapsed_ms(*self.marks))
        return out

    def abort(self):
        self.group.abort()
