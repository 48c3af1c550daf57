"""Data parallel without a GPU: environment parsing, the launcher with dummy ranks, the TCP and file
rendezvous across processes on 127.0.0.1, the gradient bucket planner, ZeRO-1 shard arithmetic, the
self-test's check, per-rank batch rows, and the recorded data-parallel step (fake runtime and
communicator): no kernel touches a bucket while it is being all-reduced."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gptcuda import dist, launch
from gptcuda.model import rng
from gptcuda.config import ConfigError, load_config
from gptcuda.data.text import get_batch
from gptcuda.model.params import param_table

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = [sys.executable, "-m", "gptcuda.launch"]


def penv(**extra):
    """The environment of a child process: PYTHONPATH, no inherited rank variables."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GPTCUDA_DIST", "GPTCUDA_RDZV", "GPTCUDA_RDZV_DIR", "GPTCUDA_RUN_ID")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    e.update(extra)
    return e


def script(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def by_rank(text):
    """'[r] line' lines -> {r: [line, ...]}."""
    out = {}
    for line in text.splitlines():
        if line.startswith("[") and "] " in line:
            r, rest = line[1:].split("] ", 1)
            out.setdefault(int(r), []).append(rest)
    return out


# ---- environment --------------------------------------------------------------------------------

BASE = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


def test_env_defaults_to_one_gpu():
    e = dist.parse_env({})
    assert (e.rank, e.world_size, e.local_rank, e.enabled, e.is_main) == (0, 1, 0, False, True)
    assert not dist.parse_env({"WORLD_SIZE": "1"}).enabled
    assert not dist.parse_env({"RANK": "0", "WORLD_SIZE": "1"}).enabled
    assert dist.parse_env({"GPTCUDA_DIST": "nccl"}).enabled          # NCCL at world size 1, on request
    assert dist.init_group(dist.parse_env({})) is None


def test_env_from_launcher_and_mpirun():
    e = dist.parse_env(BASE)
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size) == (1, 4, 1, 2)
    assert (e.master_addr, e.master_port, e.rdzv, e.source, e.enabled) == ("127.0.0.1", 29511, "tcp", "launcher", True)
    o = dist.parse_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "node0"})
    assert (o.rank, o.world_size, o.local_rank, o.master_port, o.source) == (3, 8, 3, 29500, "mpirun (Open MPI)")
    d = dist.parse_env({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "h"})
    assert d.local_rank == 2 and d.local_world_size == 3                      # LOCAL_RANK defaults to RANK
    f = dist.parse_env({**BASE, "GPTCUDA_RDZV": "file", "GPTCUDA_RDZV_DIR": "/tmp/x", "GPTCUDA_RUN_ID": "r1",
                        "GPTCUDA_BUCKET_MB": "4", "GPTCUDA_RDZV_TIMEOUT": "7.5"})
    assert (f.rdzv, f.rdzv_dir, f.run_id, f.bucket_mb, f.timeout) == ("file", "/tmp/x", "r1", 4.0, 7.5)
    assert dist.parse_env({**BASE, "SLURM_JOB_ID": "77", "GPTCUDA_RDZV": "file",
                           "GPTCUDA_RDZV_DIR": "/d"}).run_id == "77"


@pytest.mark.parametrize("env,words", [
    ({"RANK": "0"}, ["RANK", "WORLD_SIZE"]),
    ({"WORLD_SIZE": "2"}, ["WORLD_SIZE", "RANK"]),
    ({**BASE, "RANK": "4"}, ["RANK=4", "WORLD_SIZE=4"]),
    ({**BASE, "RANK": "-1"}, ["RANK=-1", ">= 0"]),
    ({**BASE, "WORLD_SIZE": "two"}, ["WORLD_SIZE", "not an integer"]),
    ({**BASE, "WORLD_SIZE": "0"}, ["WORLD_SIZE=0", ">= 1"]),
    ({**BASE, "LOCAL_RANK": "2"}, ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
    ({**BASE, "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    ({k: v for k, v in BASE.items() if k != "MASTER_ADDR"}, ["MASTER_ADDR"]),
    ({**BASE, "GPTCUDA_RDZV": "udp"}, ["GPTCUDA_RDZV"]),
    ({**BASE, "GPTCUDA_RDZV": "file"}, ["GPTCUDA_RDZV_DIR"]),
    ({**BASE, "GPTCUDA_RDZV": "file", "GPTCUDA_RDZV_DIR": "/tmp"}, ["GPTCUDA_RUN_ID"]),
    ({**BASE, "GPTCUDA_BUCKET_MB": "-1"}, ["GPTCUDA_BUCKET_MB"]),
    ({**BASE, "GPTCUDA_RDZV_TIMEOUT": "soon"}, ["GPTCUDA_RDZV_TIMEOUT"]),
    ({"GPTCUDA_DIST": "mpi"}, ["GPTCUDA_DIST"]),
])
def test_env_errors_are_one_line_and_name_the_variable(env, words):
    with pytest.raises(dist.DistError) as e:
        dist.parse_env(env)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


# ---- the launcher ---------------------------------------------------------------------------------

REPORT = """import json, os
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GPTCUDA_RDZV",
        "GPTCUDA_RUN_ID", "NCCL_NVLS_ENABLE", "PYTHONUNBUFFERED"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


def test_launcher_starts_ranks_with_their_environment(tmp_path):
    p = subprocess.run(LAUNCH + ["--nproc", "2", script(tmp_path, "report.py", REPORT)], cwd=ROOT, env=penv(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = by_rank(p.stdout)
    envs = {r: json.loads(lines[r][0]) for r in (0, 1)}
    for r, e in envs.items():
        assert (e["RANK"], e["WORLD_SIZE"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) == (str(r), "2", str(r), "2")
        assert e["NCCL_NVLS_ENABLE"] == "0" and e["PYTHONUNBUFFERED"] == "1" and e["GPTCUDA_RDZV"] == "tcp"
        assert e["MASTER_ADDR"] == "127.0.0.1" and 0 < int(e["MASTER_PORT"]) < 65536
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and envs[0]["GPTCUDA_RUN_ID"] == envs[1]["GPTCUDA_RUN_ID"]
    # those variables are what parse_env reads
    e1 = dist.parse_env({k: v for k, v in envs[1].items() if v is not None})
    assert (e1.rank, e1.world_size, e1.local_rank) == (1, 2, 1)
    # several nodes: this node's ranks
    opts, cmd = launch.parse_args(["--nnodes", "2", "--node_rank", "1", "--master_addr", "h0", "--master_port",
                                   "29400", "--nproc", "4", "x.py", "a"])
    assert cmd == [sys.executable, "x.py", "a"]
    env = launch.rank_env({}, opts, 2, "run")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("6", "8", "2", "h0")


@pytest.mark.parametrize("argv,words", [
    (["train.py"], ["--nproc"]),
    (["--nproc", "0", "train.py"], [">= 1"]),
    (["--nproc", "two", "train.py"], ["--nproc", "int"]),
    (["--nproc", "2"], ["no command"]),
    (["--nproc", "2", "--rdzv", "udp", "t.py"], ["--rdzv"]),
    (["--nproc", "2", "--nnodes", "2", "t.py"], ["--master_addr"]),
    (["--nproc", "2", "--bogus", "1", "t.py"], ["--bogus"]),
])
def test_launcher_usage_errors(argv, words):
    with pytest.raises(launch.LaunchError) as e:
        launch.parse_args(argv)
    for w in words:
        assert w in str(e.value)
    assert launch.main(argv) == 2


EXITS = """import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("rank", os.environ["RANK"], flush=True)
sys.exit(int(sys.argv[1 + int(os.environ["RANK"])]))
"""


def test_launcher_returns_the_worst_exit_code(tmp_path):
    s = script(tmp_path, "exits.py", EXITS)
    for codes, want in (("0 0", 0), ("2 3", 3), ("3 0", 3)):
        p = subprocess.run(LAUNCH + ["--nproc", "2", s, *codes.split()], cwd=ROOT, env=penv(),
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == want, (codes, p.stdout, p.stderr)
        assert set(by_rank(p.stdout)) == {0, 1}


HANG_OR_FAIL = """import os, sys, time
if os.environ["RANK"] == "1":
    print("failing", flush=True)
    sys.exit(5)
time.sleep(120)
"""


def test_launcher_stops_the_others_when_a_rank_fails(tmp_path):
    t = time.monotonic()
    p = subprocess.run(LAUNCH + ["--nproc", "2", "--grace", "5", script(tmp_path, "hang.py", HANG_OR_FAIL)],
                       cwd=ROOT, env=penv(), capture_output=True, text=True, timeout=90)
    assert p.returncode == 5, (p.stdout, p.stderr)
    assert time.monotonic() - t < 30
    assert "stopping rank(s) [0]" in p.stderr


TRAP = """import signal, sys, time
def h(sig, frame):
    print("got signal", sig, flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, h)
print("ready", flush=True)
time.sleep(120)
sys.exit(9)
"""


def test_launcher_forwards_sigint_once(tmp_path):
    proc = subprocess.Popen(LAUNCH + ["--nproc", "2", script(tmp_path, "trap.py", TRAP)], cwd=ROOT, env=penv(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(l) for l in proc.stdout], daemon=True).start()
    seen, deadline = [], time.monotonic() + 60
    while sum("ready" in l for l in seen) < 2 and time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    assert sum("ready" in l for l in seen) == 2, seen
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    time.sleep(0.2)
    while not lines.empty():
        seen.append(lines.get())
    got = [l for l in seen if "got signal 2" in l]
    assert sorted(l.split("]")[0] for l in got) == ["[0", "[1"], seen        # each rank once


# ---- the rendezvous -------------------------------------------------------------------------------

RDZV = """import os, sys
from gptcuda import dist
env = dist.parse_env()
uid = dist.share_unique_id(env, lambda: os.urandom(128), timeout=60)
print("uid", env.rank, len(uid), uid.hex(), flush=True)
"""


@pytest.mark.parametrize("mode", ["tcp", "file"])
def test_rendezvous_hands_rank0s_id_to_every_rank(tmp_path, mode):
    extra = ["--rdzv", "file", "--rdzv_dir", str(tmp_path / "rdzv")] if mode == "file" else []
    p = subprocess.run(LAUNCH + ["--nproc", "3", *extra, script(tmp_path, "rdzv.py", RDZV)], cwd=ROOT, env=penv(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.stdout, p.stderr)
    got = {}
    for r, ls in by_rank(p.stdout).items():
        _, rank, n, hexid = ls[0].split()
        assert int(rank) == r and int(n) == 128
        got[r] = hexid
    assert len(got) == 3 and len(set(got.values())) == 1


def _env(**kw):
    base = dict(rank=0, world_size=2, master_addr="127.0.0.1", master_port=launch.free_port(), timeout=20.0,
                run_id="t")
    base.update(kw)
    return dist.DistEnv(**base)


def test_rendezvous_tcp_in_threads_and_the_retry_while_rank0_starts():
    env0 = _env()
    env1 = dist.DistEnv(**{**env0.__dict__, "rank": 1})
    out = {}
    t = threading.Thread(target=lambda: out.__setitem__(1, dist.share_unique_id(env1, None)))
    t.start()                                  # rank 1 first: it retries until rank 0 listens
    time.sleep(0.5)
    out[0] = dist.share_unique_id(env0, lambda: b"\x07" * 128)
    t.join(30)
    assert out[0] == out[1] == b"\x07" * 128


def test_rendezvous_times_out_with_a_clear_message():
    env1 = _env(rank=1, timeout=1.0)
    t = time.monotonic()
    with pytest.raises(dist.DistError) as e:
        dist.share_unique_id(env1, None)
    assert time.monotonic() - t < 10
    msg = str(e.value)
    assert "rank 1" in msg and "MASTER_ADDR" in msg and str(env1.master_port) in msg and "\n" not in msg
    with pytest.raises(dist.DistError) as e:                       # rank 0 whose peers never come
        dist.share_unique_id(_env(timeout=1.0), lambda: b"x" * 128)
    assert "rank(s) [1] never connected" in str(e.value)


def test_rendezvous_refuses_another_runs_rank():
    env0 = _env(world_size=2)
    stranger = dist.DistEnv(**{**env0.__dict__, "rank": 1, "world_size": 3, "timeout": 5.0})
    err = {}

    def client():
        try:
            dist.share_unique_id(stranger, None)
        except dist.DistError as e:
            err["msg"] = str(e)
    t = threading.Thread(target=client)
    t.start()
    with pytest.raises(dist.DistError):                 # rank 0 still waits for its own rank 1
        dist.share_unique_id(dist.DistEnv(**{**env0.__dict__, "timeout": 3.0}), lambda: b"y" * 128)
    t.join(10)
    assert "another run" in err["msg"] and "WORLD_SIZE 3 != 2" in err["msg"]


def test_file_rendezvous_checks_the_world_size(tmp_path):
    env0 = _env(rdzv="file", rdzv_dir=str(tmp_path), world_size=2)
    dist.share_unique_id(env0, lambda: b"z" * 128)
    assert dist.share_unique_id(dist.DistEnv(**{**env0.__dict__, "rank": 1}), None) == b"z" * 128
    other = dist.DistEnv(**{**env0.__dict__, "rank": 1, "world_size": 4, "timeout": 0.3})
    with pytest.raises(dist.DistError) as e:            # a different file name: nothing there
        dist.share_unique_id(other, None)
    assert "GPTCUDA_RDZV_DIR" in str(e.value)
    os.replace(dist.rdzv_path(env0), dist.rdzv_path(other))          # a stale file of another run
    with pytest.raises(dist.DistError) as e:
        dist.share_unique_id(other, None)
    assert "2 ranks, not 4" in str(e.value)


# ---- the bucket planner -----------------------------------------------------------------------

def _table(path="configs/tiny.yaml", *over):
    cfg = load_config(path, list(over))
    return cfg, param_table(cfg, 65)


TABLES = [("configs/tiny.yaml",), ("configs/tiny.yaml", "--bias=false"), ("configs/gpt2_124m_t1024.yaml",),
          ("configs/shakespeare_char_fp32.yaml", "--bias=false")]


@pytest.mark.parametrize("spec", TABLES, ids=lambda s: " ".join(s))
@pytest.mark.parametrize("cap", [1, 1000, 5000, 25 * 2 ** 20 // 4, 1 << 40])
def test_buckets_cover_the_region_respect_tensors_sizes_and_order(spec, cap):
    cfg, table = _table(*spec)
    buckets = dist.plan_buckets(table, cap)
    ext = dist.tensor_extents(table)
    # cover [0, total) exactly, without overlap
    spans = sorted(s for b in buckets for s in b.spans)
    assert spans[0][0] == 0 and spans[-1][1] == table.total
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert sum(b - a for a, b in spans) == table.total
    # whole tensors, each in exactly one bucket; a bucket's spans are its tensors' extents
    names = [n for b in buckets for n in b.names]
    assert sorted(names) == sorted(s.name for s in table)
    bounds = {a for a, _ in ext.values()} | {table.total}
    for b in buckets:
        assert all(a in bounds and e in bounds for a, e in b.spans)
        assert b.spans == dist._merge(ext[n] for n in b.names)
        # size: within the cap unless a single tensor is larger
        assert b.numel <= cap or len(b.names) == 1
    # order: production order, each bucket issued when its last tensor is final
    order = dist.production_order(table)
    point_of = {n: i for i, (_, ns) in enumerate(order) for n in ns}
    index = {p: i for i, (p, _) in enumerate(order)}
    assert [n for _, ns in order for n in ns] == names
    last = -1
    for i, b in enumerate(buckets):
        assert b.index == i
        assert max(point_of[n] for n in b.names) == index[b.point]
        assert index[b.point] >= last
        last = index[b.point]
    assert order[0][0] == "head" and order[-1][0] == "embed" and "wte" in order[-1][1]
    assert [p for p, _ in order[1:-1]] == list(reversed(range(cfg.n_layer)))
    if cap >= table.total:
        assert len(buckets) == 1 and buckets[0].point == "embed"
    if cap == 1:
        assert len(buckets) == len(table.specs)


def test_bucket_cap_gpt2_small():
    _, table = _table("configs/gpt2_124m_t1024.yaml")
    buckets = dist.plan_buckets(table, 25 * 2 ** 20 // 4)
    assert 12 <= len(buckets) <= 20
    assert buckets[0].point == dist.production_order(table)[1][0] == 11       # the first after the last layer
    with pytest.raises(ValueError):
        dist.plan_buckets(table, 0)


# ---- ZeRO-1 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("total", [0, 3, 4, 100, 1000, 1003, 85_892_352, 124_475_904 + 12])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zero_shards_tile_the_region(total, world):
    sh = dist.zero_shards(total, world)
    owned = [sh.owned(r) for r in range(world)]
    assert owned[0][0] == 0 and owned[-1][1] == total
    for (a0, a1), (b0, b1) in zip(owned, owned[1:]):
        assert a1 == b0
    assert all(a % dist.ALIGN == 0 for a, _ in owned)                      # 16-byte aligned starts
    assert sh.shard % dist.ALIGN == 0 and sh.even == sh.shard * world <= total
    assert 0 <= sh.tail < dist.ALIGN * world
    assert all(b - a == sh.shard for a, b in owned[:-1])
    assert owned[-1][1] - owned[-1][0] == sh.shard + sh.tail
    if world == 1:
        assert owned == [(0, total)] and sh.tail == total % dist.ALIGN
    with pytest.raises(ValueError):
        sh.owned(world)


# ---- the self-test, seeds, batches -----------------------------------------------------------

def test_selftest_check():
    for world in (1, 2, 3, 8):
        parts = [dist.selftest_vectors(r, world, 1003) for r in range(world)]
        total = np.sum([p[0] for p in parts], axis=0, dtype=np.float32)
        for r, (_, want) in enumerate(parts):
            dist.check_selftest(total, want, "all-reduce", r, world)
    mine, want = dist.selftest_vectors(1, 2, 1003)
    bad = want.copy()
    bad[500] += 1
    with pytest.raises(dist.DistError) as e:
        dist.check_selftest(bad, want, "all-reduce (sum, float32)", 1, 2)
    msg = str(e.value)
    assert "rank 1 of 2" in msg and "element 500" in msg and "all-reduce (sum, float32)" in msg and "\n" not in msg
    with pytest.raises(dist.DistError):
        dist.check_selftest(want * np.float32(1 + 1e-5), want, "average", 0, 2, rtol=1e-6)
    dist.check_selftest(want * np.float32(1 + 1e-7), want, "average", 0, 2, rtol=1e-6)
    with pytest.raises(dist.DistError):
        dist.check_selftest(np.full(3, np.nan, np.float32), np.ones(3, np.float32), "x", 0, 1, rtol=1.0)


def test_rank_seed():
    assert dist.rank_seed(1337, 0) == 1337
    seeds = {dist.rank_seed(1337, r) for r in range(64)}
    assert len(seeds) == 64 and all(0 <= s < 2 ** 32 for s in seeds)


def test_rank_rows_are_rows_of_the_world_batch():
    tokens = (np.arange(5000) * 7 % 65).astype(np.int32)
    gx, gy = get_batch(tokens, 1337, 9, rng.SITE_BATCH_TRAIN, 8, 32)
    for r in range(4):
        x, y = get_batch(tokens, 1337, 9, rng.SITE_BATCH_TRAIN, 2, 32, row_offset=2 * r)
        assert np.array_equal(x, gx[2 * r:2 * r + 2]) and np.array_equal(y, gy[2 * r:2 * r + 2])
    a = get_batch(tokens, 1337, 9, rng.SITE_BATCH_TRAIN, 8, 32, row_offset=0)
    assert np.array_equal(a[0], gx)
    with pytest.raises(ValueError):
        get_batch(tokens, 1337, 9, rng.SITE_BATCH_TRAIN, 2, 32, row_offset=-1)


def test_zero_config_key():
    assert load_config("configs/tiny.yaml", ["--zero=1"]).zero == 1
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["--zero=2"])
    assert "zero" in str(e.value)


def test_one_gpu_never_imports_nccl(tmp_path):
    code = ("import sys, runpy; sys.argv = ['train.py', 'configs/tiny.yaml', '--backend=reference', '--max_iters=2', "
            "'--eval_interval=2', '--eval_iters=1', '--out_dir=' + sys.argv[1]]\n"
            "try:\n    runpy.run_path('train.py', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('NCCL', sorted(m for m in sys.modules if m == 'nccl' or m.startswith('nccl.')))\n")
    for i, extra in enumerate(({}, {"RANK": "0", "WORLD_SIZE": "1"})):
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"o{i}")], cwd=ROOT, env=penv(**extra),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert "NCCL []" in p.stdout, p.stdout


# ---- the recorded data-parallel step (fake runtime, fake communicator) --------------------------

class FakeComm:
    def __init__(self):
        self.calls = []

    def all_reduce(self, send, recv, count, dtype, op, stream):
        self.calls.append(("all_reduce", send, recv, count, dtype, op))

    def reduce(self, send, recv, count, dtype, op, root, stream):
        self.calls.append(("reduce", send, recv, count, dtype, op, root))

    def reduce_scatter(self, send, recv, count, dtype, op, stream):
        self.calls.append(("reduce_scatter", send, recv, count, dtype, op))

    def all_gather(self, send, recv, count, dtype, stream):
        self.calls.append(("all_gather", send, recv, count, dtype))

    def broadcast(self, send, recv, count, dtype, root, stream):
        self.calls.append(("broadcast", send, recv, count, dtype, root))

    def group_start(self):
        self.calls.append(("group_start",))

    def group_end(self):
        self.calls.append(("group_end",))

    def close(self):
        pass

    def abort(self):
        pass


def _record_dp(zero, rank=1, world=2, over=(), accum=1):
    pytest.importorskip("cuda.bindings.nvrtc")
    from tests.fakes import RecordingRuntime
    from gptcuda.ops.cuda_backend import CudaBackend
    from gptcuda.training.engine import Engine

    class DPRuntime(RecordingRuntime):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.stream = 1

        def side_stream(self):
            return 2

        def new_event(self, timing=False):
            return object()

        def _submit(self, rec):
            if self._recording is not None:
                self._recording.items.append(rec)
            return rec

    cfg = load_config("configs/tiny.yaml", [f"--zero={zero}", "--dropout=0.1", *over])
    rt = DPRuntime(cfg)
    be = CudaBackend(cfg, rt=rt, seed=dist.rank_seed(cfg.seed, rank))    # as the Engine builds it
    comm = FakeComm()
    env = dist.DistEnv(rank=rank, world_size=world, bucket_mb=16 * 1024 * 4 / 2 ** 20)   # 16K-element buckets
    group = dist.Group(env, b"u" * 128, comm_factory=lambda: comm)
    group.selftest = False
    toks = (np.arange(3000) % 65).astype(np.int32)
    V = 72 if cfg.precision == "bf16" else 65                  # (bf16: a vocabulary of whole 16-byte rows)
    eng = Engine(cfg, toks, toks[:300], V, backend=be, programs=("train",), group=group, accum=accum, n_vocab=65)
    comm.calls.clear()                          # the warm-up's calls
    return eng, rt, comm


@pytest.mark.parametrize("over", [(), ("--precision=tf32", "--attention=fused", "--recompute=true"),
                                  ("--bias=false", "--dropout=0.0")], ids=["fp32", "tf32-fused-recompute", "nobias"])
def test_recorded_step_allreduces_each_bucket_after_its_last_write_and_before_any_reuse(over):
    from gptcuda.runtime import Launch, StreamCall, StreamFork, StreamJoin
    from tests.fakes import pointers
    eng, rt, comm = _record_dp(zero=0, over=over)
    dp, items = eng.dp, eng.programs["train"].items
    b = eng.batches                                                   # rank 1 of 2: the world's seed
    assert (b.rank, b.world, b.seed) == (1, 2, eng.cfg.seed)
    assert rt.seed == dist.rank_seed(eng.cfg.seed, 1)
    assert len(dp.buckets) >= 3                               # the tiny model in 16K-element buckets
    joins = [i for i, r in enumerate(items) if isinstance(r, StreamJoin)]
    assert len(joins) == 1
    join = joins[0]
    labels = [getattr(r, "label", "") for r in items]
    assert labels.index("grad_norm_partial") > join and labels.index("adamw") > join
    hist = [i for i, r in enumerate(items) if isinstance(r, Launch) and r.label == "loss_reduce"]
    assert hist[0] < join < hist[1]                          # history gets the world's mean, after the join
    base = eng.bufs.flat_grads.ptr
    grads = eng.bufs.grads
    covered = []
    for b in dp.buckets:
        at = labels.index(f"allreduce bucket {b.index}")
        call = items[at]
        assert isinstance(call, StreamCall) and call.side == 2 and at < join
        fork = max(i for i in range(at) if isinstance(items[i], StreamFork))
        lo_hi = [(base + 4 * a, base + 4 * e) for a, e in b.spans]
        inside = lambda p: any(lo <= p < hi for lo, hi in lo_hi)
        for i in range(fork + 1, join):                      # nothing touches the bucket in flight
            assert not any(inside(p) for p in pointers(items[i])), (b.index, items[i].label)
        for n in b.names:                                    # ... and each tensor was written before
            assert any(grads[n].ptr in pointers(items[i]) for i in range(fork)), n
        comm.calls.clear()
        call.call(0)
        ar = [c for c in comm.calls if c[0] == "all_reduce"]
        assert [(c[1], c[3], c[4], c[5]) for c in ar] == [(base + 4 * a, e - a, "f32", "avg") for a, e in b.spans]
        assert all(c[1] == c[2] for c in ar)                 # in place
        assert (comm.calls[0][0] == "group_start") == (len(b.spans) > 1)
        covered += [(c[1], c[1] + 4 * c[3]) for c in ar]
    covered.sort()
    assert covered[0][0] == base and covered[-1][1] == base + 4 * eng.table.total
    assert all(a1 == b0 for (_, a1), (b0, _) in zip(covered, covered[1:]))
    loss = items[labels.index("allreduce loss")]
    comm.calls.clear()
    loss.call(0)
    assert comm.calls == [("all_reduce", rt.state.ptr + 8, dp.loss_mean.ptr, 1, "f32", "avg")]
    assert "2 ranks" in dp.describe() and "buckets" in dp.describe()


def test_recorded_step_with_accumulation_reduces_the_sum_once():
    """Gradient accumulation on 2 ranks: the earlier micro-batches add into grad_acc with no
    collective; after the last backward adds grad_acc into the gradients, every bucket is
    all-reduced once (after that add), then the join and one update."""
    from gptcuda.runtime import StreamCall, StreamJoin
    eng, rt, comm = _record_dp(zero=0, accum=3)
    dp, items = eng.dp, eng.programs["train"].items
    labels = [getattr(r, "label", "") for r in items]
    adds = [i for i, lab in enumerate(labels) if lab == "accumulate"]
    assert len(adds) == 3 and labels.count("adamw") == 1 and labels.count("encoder_fwd") == 3
    calls = [i for i, r in enumerate(items) if isinstance(r, StreamCall) and r.label.startswith("allreduce bucket")]
    assert len(calls) == len(dp.buckets) and min(calls) > adds[-1]
    join = next(i for i, r in enumerate(items) if isinstance(r, StreamJoin))
    assert max(calls) < join < labels.index("adamw")
    assert int(items[adds[-1]].slots[0]) == eng.bufs.flat_grads.ptr


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_recorded_zero1_step(rank):
    from gptcuda.runtime import Launch, StreamCall
    eng, rt, comm = _record_dp(zero=1, rank=rank, world=3)
    items, dp = eng.programs["train"].items, eng.dp
    sh = dp.shards
    assert sh.tail and not dp.buckets
    main_calls = [r for r in items if isinstance(r, StreamCall) and r.side is None]
    comm.calls.clear()
    for r in main_calls:
        r.call(0)
    g, p = eng.bufs.flat_grads.ptr, eng.bufs.flat_params.ptr
    part = rt.workspace("optim_partials").ptr
    ops = [c[0] for c in comm.calls]
    assert ops == ["reduce_scatter", "reduce", "all_reduce", "all_gather", "broadcast"]
    assert comm.calls[0] == ("reduce_scatter", g, g + 4 * rank * sh.shard, sh.shard, "f32", "avg")
    t = 4 * sh.even
    assert comm.calls[1] == ("reduce", g + t, g + t, sh.tail, "f32", "avg", 2)
    assert comm.calls[2][1:3] == (part, part) and comm.calls[2][4:] == ("f64", "sum")
    assert comm.calls[3] == ("all_gather", p + 4 * rank * sh.shard, p, sh.shard, "f32")
    assert comm.calls[4] == ("broadcast", p + t, p + t, sh.tail, "f32", 2)
    lo, hi = sh.owned(rank)
    adam = [r for r in items if isinstance(r, Launch) and r.label == "adamw"]
    assert len(adam) == 1
    assert int(adam[0].slots[0]) == p + 4 * lo and int(adam[0].slots[4]) & 0xFFFFFFFF == hi - lo
    n_decay = int(adam[0].slots[5]) & 0xFFFFFFFF
    assert n_decay == min(max(eng.table.n_decay - lo, 0), hi - lo)
    norm = [r for r in items if isinstance(r, Launch) and r.label.startswith("grad_norm")]
    assert [r.label for r in norm] == ["grad_norm_partial", "grad_norm_final"]
    assert int(norm[0].slots[1]) == g + 4 * lo
    assert norm[0].grid == (comm.calls[2][3], 1, 1)          # every rank: as many partials as all-reduced
    assert "ZeRO-1" in dp.describe()


BF16_GRADS = ("--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--grad_dtype=bf16")


@pytest.mark.parametrize("zero,accum", [(0, 1), (0, 2), (1, 1)])
def test_recorded_step_reduces_bf16_gradients_in_their_dtype(zero, accum):
    """grad_dtype bf16 on 2 ranks: one micro-batch's bf16 gradients are reduced as bf16 (2-byte offsets), with
    micro-batches the fp32 sum grad_acc is (the last micro-batch's gradients added into it first); the norm and
    AdamW read what was reduced; ZeRO-1's shards are of the bf16 region."""
    from gptcuda.runtime import Launch, StreamCall
    eng, rt, comm = _record_dp(zero=zero, over=BF16_GRADS, accum=accum)
    dp, items = eng.dp, eng.programs["train"].items
    g = eng.bufs.acts["grad_acc"] if accum > 1 else eng.bufs.flat_grads
    e, dt = (4, "f32") if accum > 1 else (2, "bf16")
    assert dp.grads.ptr == g.ptr and dp.grads.dtype == dt
    comm.calls.clear()
    for r in items:
        if isinstance(r, StreamCall) and "loss" not in r.label and "norm" not in r.label and "params" not in r.label:
            r.call(0)
    grads_calls = [c for c in comm.calls if c[0] in ("all_reduce", "reduce_scatter", "reduce")]
    assert grads_calls and all(dt in c for c in grads_calls)
    if zero:
        sh = dp.shards
        assert grads_calls[0] == ("reduce_scatter", g.ptr, g.ptr + e * 1 * sh.shard, sh.shard, dt, "avg")
        lo, hi = sh.owned(1)
        norm = next(r for r in items if isinstance(r, Launch) and r.label == "grad_norm_partial")
        assert int(norm.slots[1]) == g.ptr + e * lo
    else:
        spans = [(g.ptr + e * a, e_ - a) for b in dp.buckets for a, e_ in b.spans]
        assert sorted((c[1], c[3]) for c in grads_calls) == sorted(spans)
    adam = next(r for r in items if isinstance(r, Launch) and r.label == "adamw")
    assert int(adam.slots[1]) == g.ptr + (e * dp.shards.owned(1)[0] if zero else 0)


@pytest.mark.parametrize("how", ["close", "abort"])
def test_group_destroys_the_captured_graphs_before_the_communicator(how):
    # NCCL's destroy and abort wait for every graph that captured a collective of the communicator:
    # the graphs must go first, or the run hangs at its very end
    order = []

    class Comm(FakeComm):
        def close(self):
            order.append("comm.close")

        def abort(self):
            order.append("comm.abort")

    group = dist.Group(dist.DistEnv(rank=0, world_size=2), b"u" * 128, comm_factory=Comm)
    group.connect()
    group.before_close.append(lambda: order.append("graphs"))
    getattr(group, how)()
    assert order == ["graphs", f"comm.{how}"]
    getattr(group, how)()                          # the hooks run once
    assert order.count("graphs") == 1


def test_data_parallel_registers_its_graphs_for_release():
    eng, rt, comm = _record_dp(0)
    assert rt.destroy_graphs in eng.dp.group.before_close


def test_data_parallel_needs_the_cuda_backend():
    from gptcuda.training.engine import Engine
    cfg = load_config("configs/tiny.yaml", ["--backend=reference"])
    group = dist.Group(dist.DistEnv(rank=0, world_size=2), b"u" * 128, comm_factory=FakeComm)
    toks = (np.arange(3000) % 65).astype(np.int32)
    with pytest.raises(dist.DistError) as e:
        Engine(cfg, toks, toks[:300], 65, programs=("train",), group=group)
    assert "cuda backend" in str(e.value)


def test_resume_refuses_another_world_size(tmp_path):
    from gptcuda.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from gptcuda.training.trainer import Trainer
    out = str(tmp_path / "run")
    cfg = load_config("configs/tiny.yaml", ["--backend=reference", "--max_iters=2", "--eval_interval=2",
                                            "--eval_iters=1", f"--out_dir={out}"])
    Trainer(cfg, log=lambda *a: None).train(bar=False)
    path = os.path.join(out, "last.ckpt")
    arrays, meta = load_checkpoint(path)
    assert "world_size" not in meta                  # a one-GPU checkpoint is as before
    meta["world_size"] = 2
    save_checkpoint(path, arrays, meta)
    with pytest.raises(CheckpointError) as e:
        Trainer(cfg, resume=True, log=lambda *a: None)
    assert "2 GPU(s)" in str(e.value) and "same number" in str(e.value)


def test_stream_records_issue_events_waits_and_the_call_in_order():
    from gptcuda.runtime import StreamCall, StreamFork, StreamJoin

    class Drv:
        class CUstreamCaptureStatus:
            CU_STREAM_CAPTURE_STATUS_NONE = 0

        def __init__(self, log, capturing):
            self.log, self.capturing = log, capturing

        def cuStreamWaitEvent(self, stream, event, flags):
            self.log.append(("wait", stream, event))
            return (0,)

        def cuStreamIsCapturing(self, stream):
            return (0, 1 if self.capturing else 0)

    class Dev:
        def __init__(self, capturing):
            self.log = []
            self.drv = Drv(self.log, capturing)

        def record(self, event, stream, external=False):
            self.log.append(("record", event, stream, external))

    for capturing in (False, True):
        dev = Dev(capturing)
        StreamFork(side=22, event="f").run(dev, 11)
        StreamCall(lambda s: dev.log.append(("call", s)), "c", side=22, marks=("a", "b")).run(dev, 11)
        StreamCall(lambda s: dev.log.append(("call", s)), "m").run(dev, 11)
        StreamJoin(side=22, event="j", marks=("x", "y")).run(dev, 11)
        assert dev.log == [("record", "f", 11, False), ("wait", 22, "f"),
                           ("record", "a", 22, capturing), ("call", 22), ("record", "b", 22, capturing),
                           ("call", 11),
                           ("record", "x", 11, capturing), ("record", "y", 22, capturing),
                           ("record", "j", 22, False), ("wait", 11, "j")]


def test_a_rank_backend_without_its_dropout_stream_is_refused():
    """The Engine builds a rank's backend with rank_seed(seed, rank); DataParallel checks it and
    refuses a backend built with the world's seed on rank 1 (every rank would drop the same units)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from tests.fakes import RecordingRuntime
    from gptcuda.ops.cuda_backend import CudaBackend
    from gptcuda.training.engine import Engine
    cfg = load_config("configs/tiny.yaml", ["--dropout=0.1"])
    env = dist.DistEnv(rank=1, world_size=2)
    group = dist.Group(env, b"u" * 128, comm_factory=lambda: None)
    toks = (np.arange(3000) % 65).astype(np.int32)
    with pytest.raises(dist.DistError, match="dropout seed"):
        Engine(cfg, toks, toks[:300], 65, backend=CudaBackend(cfg, rt=RecordingRuntime(cfg)),
               programs=("train",), group=group)
