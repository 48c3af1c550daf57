"""Data parallel on the GPU through NCCL (nccl4py; the NCCL tests skip without it).

One GPU: the self-test passes (and a corrupted collective fails it), an all-reduce of a flat buffer
is the identity, the device draws a rank's rows of the world's batch, and the whole data-parallel
step at world size 1 (buckets on the second stream, graph capture, ZeRO-1) gives bit for bit the
single-GPU losses and parameters; train.py runs through the launcher and the rendezvous.
Two GPUs: 2 ranks x batch B match 1 GPU x batch 2B at dropout 0 for 50 steps within 1e-5 relative;
train.py with zero=1 trains, checkpoints on rank 0 and resumes. SIGTERM through the launcher (1 and 2
ranks): every rank stops at the step they agree on, rank 0 saves last.ckpt, and the run resumes.

Run as a script (under gptcuda.launch) this file is the 2-rank worker.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from gptcuda.data import text as data
from gptcuda import dist
from gptcuda.model import rng  # noqa: E402
from gptcuda.config import load_config  # noqa: E402
from gptcuda.data.text import TextDataset  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402

pytestmark = pytest.mark.gpu
BUCKET_MB = 16 * 1024 * 4 / 2 ** 20             # 16K-element buckets: the tiny model has several
TINY = ["--precision=fp32", "--dropout=0.0", "--max_iters=1000"]


def child_env(**extra):
    """os.environ for a launched rank: this checkout first on PYTHONPATH, the rest kept (nccl4py may
    live in a --target directory named there)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def nccl_or_skip():
    try:
        dist.load_nccl()
    except dist.DistError as e:
        pytest.skip(str(e))


def gpu_count() -> int:
    from gptcuda.runtime.driver import _load, call
    drv = _load()
    call(drv.cuInit, 0)
    return int(call(drv.cuDeviceGetCount))


def world1_group(**kw):
    return dist.init_group(dist.DistEnv(force=True, bucket_mb=BUCKET_MB, **kw))


def train(overrides, steps, group=None, batch=None):
    cfg = load_config("configs/tiny.yaml", TINY + list(overrides) + ([f"--batch_size={batch}"] if batch else []))
    if group is not None:
        cfg.device = group.local_rank
    ds = TextDataset(cfg.data)
    eng = Engine(cfg, ds.train, ds.val, ds.vocab_size, programs=("train",), group=group)
    for _ in range(steps):
        eng.train_step()
    return eng, eng.loss_history(steps), eng.be.download(eng.bufs.flat_params)


def test_selftest_and_identity_allreduce_at_world_size_1(rt):
    nccl_or_skip()
    group = world1_group()
    comm = group.connect()
    dist.selftest(rt, comm, 0, 1, zero=True)
    x = np.random.default_rng(0).normal(size=(1 << 20) + 5).astype(np.float32)
    v = rt.upload(x)
    comm.all_reduce(v.ptr, v.ptr, v.numel, "f32", "sum", int(rt.stream))
    assert np.array_equal(rt.download(v), x)
    comm.all_reduce(v.ptr, v.ptr, v.numel, "f32", "avg", int(rt.stream))
    assert np.array_equal(rt.download(v), x)

    class Corrupt:                              # a collective that gets one element wrong
        def __getattr__(self, name):
            return getattr(comm, name)

        def all_reduce(self, send, recv, count, dtype, op, stream):
            comm.all_reduce(send, recv, count, dtype, op, stream)
            rt.dev.memset32(recv + 4 * 7, 0x447A0000, 1, rt.stream)     # 1000.0
    with pytest.raises(dist.DistError) as e:
        dist.selftest(rt, Corrupt(), 0, 1)
    assert "self-test failed on rank 0 of 1" in str(e.value) and "element 7" in str(e.value)
    group.close()


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("graph", ["true", "false"])
def test_world1_data_parallel_step_is_the_single_gpu_step(zero, graph):
    nccl_or_skip()
    over = [f"--graph={graph}", f"--zero={zero}", "--dropout=0.1"]
    _, h1, p1 = train(over, 20)
    group = world1_group()
    eng, h2, p2 = train(over, 20, group=group)
    assert len(eng.dp.buckets) >= 3 or zero
    assert np.all(np.isfinite(h1)) and np.array_equal(h1, h2)
    assert np.array_equal(p1, p2)
    group.close()


def test_train_py_through_the_launcher_at_world_size_1(tmp_path):
    nccl_or_skip()
    env = child_env(GPTCUDA_DIST="nccl", GPTCUDA_BUCKET_MB=str(BUCKET_MB))
    p = subprocess.run([sys.executable, "-m", "gptcuda.launch", "--nproc", "1", "train.py", "configs/tiny.yaml",
                        "--max_iters=10", "--eval_interval=5", "--eval_iters=2", f"--out_dir={tmp_path / 'o'}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "data parallel: 1 ranks" in p.stdout and "self-test passed" in p.stdout
    assert (tmp_path / "o" / "last.ckpt").exists()


# ---- two GPUs -------------------------------------------------------------------------------------

def two_ranks_or_skip():
    nccl_or_skip()
    if gpu_count() < 2:
        pytest.skip("needs 2 GPUs")


def launch2(args, tmp_path, timeout=300):
    env = child_env(GPTCUDA_BUCKET_MB=str(BUCKET_MB))
    return subprocess.run([sys.executable, "-m", "gptcuda.launch", "--nproc", "2", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("zero,graph", [(0, "true"), (0, "false"), (1, "true")])
def test_two_gpus_match_one_gpu_with_twice_the_batch(tmp_path, zero, graph):
    two_ranks_or_skip()
    B, steps = 4, 50
    out = tmp_path / "w.json"
    p = launch2([__file__, "--worker", str(out), str(B), str(steps), str(zero), graph], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = {r: json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)}
    assert res[0]["params_sha"] == res[1]["params_sha"], "the ranks' parameters differ"
    assert res[0]["history"] == res[1]["history"]
    h2 = np.array(res[0]["history"])
    _, h1, _ = train([f"--graph={graph}", f"--zero={zero}"], steps, batch=2 * B)
    rel = np.abs(h2 - h1) / np.abs(h1)
    assert np.all(np.isfinite(h2)) and rel.max() < 1e-5, (rel.max(), int(rel.argmax()))
    assert h1[-5:].mean() < h1[:5].mean()


def test_two_gpus_train_py_zero1_checkpoints_on_rank0_and_resumes(tmp_path):
    two_ranks_or_skip()
    o = tmp_path / "o"
    common = ["train.py", "configs/tiny.yaml", "--zero=1", "--eval_interval=5", "--eval_iters=2", f"--out_dir={o}"]
    p = launch2(common + ["--max_iters=10"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "self-test passed" in p.stdout and "[0] " in p.stdout
    assert not any(l.startswith("[1] ") and "step" in l for l in p.stdout.splitlines())   # rank 0 logs alone
    from gptcuda.model.checkpoint import load_checkpoint
    arrays, meta = load_checkpoint(str(o / "last.ckpt"))
    assert meta["step"] == 10 and meta["world_size"] == 2
    assert np.count_nonzero(arrays["adam_v"]) > 0.9 * np.count_nonzero(arrays["params"])   # every shard's state
    p = launch2(common + ["--max_iters=15", "--resume"], tmp_path)
    assert p.returncode == 0 and "resumed from" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert load_checkpoint(str(o / "last.ckpt"))[1]["step"] == 15


@pytest.mark.parametrize("nproc,zero", [(1, 0), (2, 0), (2, 1)])
def test_sigterm_stops_every_rank_at_one_step_and_rank0_saves(tmp_path, nproc, zero):
    """SIGTERM to the launcher (forwarded to every rank): the ranks agree at a step boundary, rank 0 saves
    last.ckpt there (ZeRO-1: the whole Adam state), every rank exits 143; the run resumes from it."""
    two_ranks_or_skip() if nproc == 2 else nccl_or_skip()
    import signal
    import time
    from gptcuda.model.checkpoint import load_checkpoint
    o = tmp_path / "o"
    argv = [sys.executable, "-m", "gptcuda.launch", "--nproc", str(nproc), "train.py", "configs/tiny.yaml",
            f"--zero={zero}", "--max_iters=100000", "--eval_interval=100000", "--eval_iters=2", "--no-bar",
            f"--out_dir={o}"]
    env = child_env(GPTCUDA_BUCKET_MB=str(BUCKET_MB), PYTHONUNBUFFERED="1",
                    **({"GPTCUDA_DIST": "nccl"} if nproc == 1 else {}))
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen, t0 = [], time.monotonic()
        while time.monotonic() - t0 < 300:
            line = p.stdout.readline()
            seen.append(line)
            if not line or line.startswith("[0] step") and " loss " in line and int(line.split()[2]) >= 20:
                break
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    out = "".join(seen) + rest
    assert p.returncode == 143, out[-3000:]
    assert "saved" in out and "Traceback" not in out, out[-3000:]
    arrays, meta = load_checkpoint(str(o / "last.ckpt"))
    assert meta["step"] >= 20 and meta.get("world_size", 1) == nproc and np.count_nonzero(arrays["adam_v"]) > 0
    env.pop("PYTHONUNBUFFERED")
    q = subprocess.run(argv[:7] + [f"--zero={zero}", f"--max_iters={meta['step'] + 3}", "--eval_interval=100000",
                                   "--eval_iters=2", "--no-bar", f"--out_dir={o}", "--resume"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert q.returncode == 0 and "resumed from" in q.stdout, q.stdout[-3000:] + q.stderr[-3000:]


def worker(out, B, steps, zero, graph):
    group = dist.init_group()
    eng, hist, params = train([f"--graph={graph}", f"--zero={zero}"], steps, group=group, batch=B)
    res = {"history": [float(x) for x in hist], "params_sha": hashlib.sha256(params.tobytes()).hexdigest(),
           "describe": eng.dp.describe()}
    Path(f"{out}.{group.rank}").write_text(json.dumps(res))
    group.close()


if __name__ == "__main__":
    if sys.argv[1] == "--worker":
        out, B, steps, zero, graph = sys.argv[2:7]
        worker(out, int(B), int(steps), int(zero), graph)
