"""A rank's place in the job, from its environment (`parse_env`), and the errors of data-parallel
setup and communication (DistError)."""
from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_PORT = 29500
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_BUCKET_MB = 25.0


class DistError(RuntimeError):
    """A data-parallel setup or communication failure; str(err) is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


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
