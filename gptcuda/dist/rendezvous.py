"""The rendezvous: rank 0's NCCL unique id to every rank, through a TCP socket rank 0 serves on
MASTER_ADDR:MASTER_PORT or a file in a shared directory (`share_unique_id`), and the Group it
makes (`init_group`)."""
from __future__ import annotations

import os
import socket
import struct
import time
import zlib

from gptcuda.files import atomic_open
from gptcuda.dist.env import DistEnv, DistError, parse_env
from gptcuda.dist.nccl import NcclComm, load_nccl

MAGIC = b"GPTCUDA\x01"


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
    blob = MAGIC + struct.pack(">iII", env.world_size, zlib.crc32(payload), len(payload)) + payload
    with atomic_open(rdzv_path(env), "wb") as f:          # makes rdzv_dir; readers never see a partial file
        f.write(blob)


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
