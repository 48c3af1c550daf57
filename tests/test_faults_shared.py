"""Nothing shared, nothing mismatched: a run directory and a prepare.py output are locked for the life of
the process that writes them; a run that saved no checkpoint restarts plainly; tokenizer and data are
checked against each other before the first step; every entry point's OSError is one line. CPU only."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types

import numpy as np
import pytest

import export
import prepare
import sample
import train
from gptcuda.data import checks
from gptcuda.data.dataset import open_dataset
from gptcuda.data.shards import DataError, open_shard, write_shard
from gptcuda.data.tokenizers import GPT2Tokenizer, load_tokenizer
from gptcuda.files import DirLock
from gptcuda.model.checkpoint import load_checkpoint
from gptcuda.training.engine import Engine
from gptcuda.config import load_config
from gptcuda.training.trainer import Trainer
from test_faults import (ROOT, _popen, _wait_for_steps, args, call, data, evals, history, one_line_error,  # noqa: F401
                         snapshot)


# ---- 1. two trainings in one out_dir ------------------------------------------------------------

def _lock_pid(out, timeout=60):
    path = os.path.join(out, ".run.lock")
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            pid = open(path).read().strip()
            if pid:
                return int(pid)
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no lock at {path}")


def test_a_second_run_into_a_locked_out_dir_is_refused(tmp_path, data, capsys):
    out = str(tmp_path / "run")
    p = _popen(data, out)
    try:
        _wait_for_steps(p, 1)
        assert _lock_pid(out) == p.pid
        before = snapshot(out)
        for extra in ((), ("--resume",), ("--overwrite",)):
            rc, _, err = call(train.main, args(data, out, "--max_iters=3", *extra), capsys)
            one_line_error(rc, err, out, f"pid {p.pid}", "in use")
        after = snapshot(out)
        assert set(after) >= set(before) - {"metrics.jsonl"}      # the run goes on; nothing of it removed
        p.send_signal(signal.SIGTERM)
        rest, err = p.communicate(timeout=120)
        assert p.returncode == 143, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not os.path.exists(os.path.join(out, ".run.lock"))    # released with the run
    rc, _, err = call(train.main, args(data, out, "--resume", "--max_iters=3", "--eval_interval=200"), capsys)
    assert rc == 0, err


def test_a_killed_holder_does_not_block(tmp_path, data, capsys):
    out = str(tmp_path / "run")
    p = _popen(data, out)
    try:
        _wait_for_steps(p, 1)
        _lock_pid(out)
    finally:
        p.kill()
        p.wait()
    assert os.path.exists(os.path.join(out, ".run.lock"))        # left by kill -9, but held by no one
    rc, _, err = call(train.main, args(data, out, "--overwrite"), capsys)
    assert rc == 0, err
    assert not os.path.exists(os.path.join(out, ".run.lock"))


# ---- 5. a run that died before its first checkpoint ------------------------------------------

@pytest.mark.parametrize("left", ["metrics", "best0"])
def test_a_run_dir_without_a_checkpoint_restarts_plainly(left, tmp_path, data, capsys, monkeypatch):
    out = str(tmp_path / "run")
    from gptcuda.model import checkpoint
    real = os.replace

    def die(src, dst):                  # killed during the step-0 checkpoint write (best.ckpt first)
        if str(dst).endswith("last.ckpt") or (left == "metrics" and str(dst).endswith(".ckpt")):
            raise KeyboardInterrupt
        return real(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", die)
    with pytest.raises(KeyboardInterrupt):
        Trainer(load_config(args(data, out)[0], args(data, out)[1:-1]),
                      log=lambda *a: None).train(bar=False)
    monkeypatch.undo()
    assert not os.path.exists(os.path.join(out, "last.ckpt"))
    assert os.path.exists(os.path.join(out, "best.ckpt")) == (left == "best0")
    rc, _, err = call(train.main, args(data, out, "--resume"), capsys)
    one_line_error(rc, err, "no checkpoint", "without --resume")
    rc, _, err = call(train.main, args(data, out), capsys)
    assert rc == 0, err
    assert os.path.exists(os.path.join(out, "last.ckpt"))


# ---- 2. the Hugging Face round trip of a bpe:N run --------------------------------------------

@pytest.fixture(scope="module")
def bpe_hf(tmp_path_factory, data):
    tmp = tmp_path_factory.mktemp("bpe_hf")
    run = str(tmp / "run")
    assert train.main(args(data, run, "--tokenizer=bpe:300", "--max_iters=0", "--bias=true")) == 0
    assert export.main([run, "--to", "hf", str(tmp / "hf")]) == 0
    return run, str(tmp / "hf")


def test_hf_export_of_a_bpe_run_brings_its_tokenizer(bpe_hf, data, tmp_path, capsys):
    run, hf = bpe_hf
    rc, out, err = call(sample.main, ["--init_from", f"hf:{hf}", "--backend", "reference", "--prompt", "ROMEO:",
                                      "--max_new_tokens", "4", "--temp", "0"], capsys)
    assert rc == 0, err
    assert out.splitlines()[1].startswith("ROMEO:")
    losses = []
    for extra in (("--resume", f"--out_dir={run}", "--tokenizer=bpe:300"),
                  (f"--init_from=hf:{hf}", f"--out_dir={tmp_path / 'x'}")):
        rc, out, err = call(train.main, [*args(data, run)[:-2], "--no-bar", "--eval_only", *extra], capsys)
        assert rc == 0, err
        assert "tokenizer bpe:300 (300 tokens)" in out
        losses.append([float(x) for x in out.strip().splitlines()[-1].replace(",", "").split()[4::3]])
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)       # the same weights (fp32) on the same ids
    assert not os.path.exists(tmp_path / "x")


def test_weights_of_another_vocabulary_without_a_tokenizer_are_refused(bpe_hf, data, tmp_path, capsys):
    run, hf = bpe_hf
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    os.unlink(bare / "tokenizer.json")
    out = tmp_path / "ft"
    rc, _, err = call(train.main, args(data, str(out), f"--init_from=hf:{bare}", "--eval_only"), capsys)
    one_line_error(rc, err, "300", "no tokenizer comes with them")
    rc, _, err = call(sample.main, ["--init_from", f"hf:{bare}", "--backend", "reference"], capsys)
    one_line_error(rc, err, "no tokenizer")
    (bare / "tokenizer.json").write_text(json.dumps({"type": "gpt2"}))        # not these weights' tokenizer
    rc, _, err = call(train.main, args(data, str(out), f"--init_from=hf:{bare}"), capsys)
    one_line_error(rc, err, "tokenizer.json", "not the tokenizer of these weights")
    assert not out.exists()


# ---- 3. tokenizer and data checked against each other -------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("prep") / "bpe"
    assert prepare.main([data, "--tokenizer", "bpe:300", "--out", str(d), "--workers", "1"]) == 0
    return d


def test_prepare_records_the_tokenizer_and_the_largest_ids(prepared):
    meta = json.loads((prepared / "prepare.json").read_text())
    assert meta["tokenizer"]["sha256"] == checks.file_sha256(str(prepared / "tokenizer.json"))
    for split in ("train", "val"):
        ids = np.concatenate([open_shard(prepared / s["file"]) for s in meta["splits"][split]["shards"]])
        assert meta["splits"][split]["max_id"] == int(ids.max()) < 300


def test_a_foreign_tokenizer_in_a_prepared_dir_is_refused(prepared, tmp_path, capsys):
    d = tmp_path / "d"
    shutil.copytree(prepared, d)
    GPT2Tokenizer().save(str(d / "tokenizer.json"))
    out = tmp_path / "out"
    rc, _, err = call(train.main, args(str(d), str(out)), capsys)
    one_line_error(rc, err, str(d / "tokenizer.json"), "gpt2", "bpe:300", "prepare.py")
    bpe = load_tokenizer(str(prepared / "tokenizer.json")).to_dict()
    bpe["json"] = bpe["json"].replace('"Ġt":', '"Ġt" :', 1)           # the same tokenizer, other bytes
    (d / "tokenizer.json").write_text(json.dumps(bpe))
    rc, _, err = call(train.main, args(str(d), str(out)), capsys)
    one_line_error(rc, err, "sha256")
    assert not out.exists()


def _llmc_dir(tmp_path, bad_at=None):
    d = tmp_path / "llmc"
    d.mkdir()
    ids = (np.arange(5000) * 7919) % 50257
    if bad_at is not None:
        ids[bad_at] = 60000                  # one sparse id no window of a short run may ever read
    write_shard(d / "x_train_000001.bin", ids, 65536)
    write_shard(d / "x_val_000000.bin", ids[:600] % 1000, 65536)
    return d


def test_a_sparse_out_of_vocabulary_id_stops_the_run_before_its_first_step(tmp_path, capsys):
    d = _llmc_dir(tmp_path, bad_at=4321)
    out = tmp_path / "out"
    rc, _, err = call(train.main, args(str(d), str(out), "--tokenizer=gpt2"), capsys)
    one_line_error(rc, err, "x_train_000001.bin", "60000", "position 4321")
    assert not out.exists()


def test_foreign_shards_are_scanned_once(tmp_path, monkeypatch, capsys):
    d = _llmc_dir(tmp_path)
    assert train.main(["configs/tiny.yaml", f"--data={d}", "--tokenizer=gpt2", "--backend=reference", "--plan"]) == 0
    assert not (d / checks.IDS_CACHE).exists()               # --plan reads no token and writes no file
    scans = []
    real = checks.max_id
    monkeypatch.setattr(checks, "max_id", lambda a: scans.append(len(a)) or real(a))
    open_dataset(str(d), "gpt2")
    assert sorted(scans) == [600, 5000]
    cache = json.loads((d / checks.IDS_CACHE).read_text())
    assert cache["x_train_000001.bin"]["max_id"] == int(open_shard(d / "x_train_000001.bin").max())
    assert cache["x_val_000000.bin"]["max_id"] == int(open_shard(d / "x_val_000000.bin").max())
    open_dataset(str(d), "gpt2")
    assert len(scans) == 2                                   # read from the cache
    ids = open_shard(d / "x_val_000000.bin").copy()
    ids[7] = 55555                                           # the same size, another content
    st = os.stat(d / "x_val_000000.bin")
    write_shard(d / "x_val_000000.bin", ids, 65536)
    os.utime(d / "x_val_000000.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match="55555"):
        open_dataset(str(d), "gpt2")


# ---- 4. export.py into a read-only place or onto a full disk ----------------------------------

@pytest.mark.parametrize("target,fault", [("hf", "readonly"), ("hf", "full"), ("llmc", "full")])
def test_export_os_errors_are_one_line_and_leave_nothing(target, fault, bpe_hf, tmp_path, capsys, monkeypatch):
    run, _ = bpe_hf
    dest = tmp_path / "sub" / ("hf" if target == "hf" else "model.bin")
    if fault == "readonly":
        def denied(*a, **k):
            raise OSError(errno.EROFS, "Read-only file system", k.get("dir"))
        monkeypatch.setattr(tempfile, "mkdtemp", denied)
    else:
        def full(fd):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(os, "fsync", full)
    rc, _, err = call(export.main, [run, "--to", target, str(dest)], capsys)
    line = one_line_error(rc, err, str(dest))
    assert ("Read-only" in line) if fault == "readonly" else ("no space left" in line)
    assert not (tmp_path / "sub").exists()


# ---- 6. prepare.py: a killed run's leftovers, and one run at a time ------------------------------

def test_prepare_removes_a_killed_runs_temporary_output_and_is_locked(data, tmp_path, capsys):
    out = tmp_path / "p"
    stale = tmp_path / ".p.k1ll3d.prepare-tmp"
    stale.mkdir()
    (stale / "tokens.u32").write_bytes(b"\0" * 4096)
    with DirLock(str(tmp_path / ".p.prepare.lock"), "x"):
        rc, _, err = call(prepare.main, [data, "--tokenizer", "char", "--out", str(out)], capsys)
        one_line_error(rc, err, f"--out {out}", f"pid {os.getpid()}")
    assert stale.exists() and not out.exists()
    rc, stdout, err = call(prepare.main, [data, "--tokenizer", "char", "--out", str(out)], capsys)
    assert rc == 0, err
    assert not stale.exists() and "removed" in stdout
    assert sorted(os.listdir(tmp_path)) == ["p"]                # no temporary, no lock left


# ---- 7. the smaller ones ------------------------------------------------------------------------

def test_prepare_sees_a_same_size_edit_that_kept_the_mtime(tmp_path, capsys):
    src = tmp_path / "a.txt"
    src.write_text("hello world, " * 200)
    out = tmp_path / "p"
    assert call(prepare.main, [str(src), "--tokenizer", "char", "--out", str(out)], capsys)[0] == 0
    st = os.stat(src)
    src.write_text("hello World, " * 200)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    rc, stdout, err = call(prepare.main, [str(src), "--tokenizer", "char", "--out", str(out)], capsys)
    assert rc == 0 and "up to date" not in stdout, (stdout, err)
    assert "W" in load_tokenizer(str(out / "tokenizer.json")).chars


def test_a_diverging_run_stops_in_one_line(data, tmp_path, capsys):
    rc, out, err = call(train.main, args(data, str(tmp_path / "r"), "--learning_rate=1e9", "--warmup_iters=0",
                                         "--grad_clip=0", "--max_iters=40", "--eval_interval=100"), capsys)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: loss became"), err
    logged = [ln for ln in out.splitlines() if ln.startswith("step")] + [err]
    assert max(len(w) for ln in logged for w in ln.split()) < 20, logged     # 1.4e+67, not 150 digits


@pytest.mark.parametrize("script,argv", [
    ("train.py", ["configs/tiny.yaml"]), ("sample.py", []), ("prepare.py", ["x.txt", "--out", "y"]),
    ("export.py", ["r", "--to", "hf", "d"]), ("gradcheck.py", [])])
def test_ctrl_c_while_the_modules_load(script, argv, tmp_path):
    (tmp_path / "numpy.py").write_text("raise KeyboardInterrupt\n")     # the first heavy import every script makes
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, script, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 130 and "Traceback" not in p.stderr and "interrupted" in p.stderr, (p.returncode, p.stderr)


def test_sample_names_an_unknown_option_and_refuses_a_blank_prompt_line(bpe_hf, tmp_path, capsys):
    run, _ = bpe_hf
    rc, _, err = call(sample.main, ["--out_dir", run, "--foo", "3"], capsys)
    line = one_line_error(rc, err, "unknown option --foo")
    assert "'3'" not in line and "override" not in line
    f = tmp_path / "prompts.txt"
    f.write_text("ROMEO:\n\nJULIET:\n")
    rc, _, err = call(sample.main, ["--out_dir", run, "--backend", "reference", "--prompt_file", str(f)], capsys)
    one_line_error(rc, err, str(f), "line 2 is empty")


def test_key_space_value_is_an_override():
    from gptcuda.cli import split_args
    assert split_args(["--max_iters", "5", "configs/tiny.yaml", "--lr", "-1", "--plan", "--x=1"], flags=("plan",)) \
        == ("configs/tiny.yaml", ["--max_iters=5", "--lr=-1", "--x=1"], {"plan"}, {})
    assert split_args(["--data", "configs/tiny.yaml"])[0:2] == ("configs/tiny.yaml", ["--data"])
    assert split_args(["--seed", "--help"])[1:3] == (["--seed"], {"help"})


# ---- 8. data parallel: SIGTERM on any rank stops every rank at one step, and rank 0 saves --------

class _VotingDP:
    """The Engine's DataParallel as the trainer sees it on rank 0 of 2, the other rank scripted: it is
    sent SIGTERM before the vote of step `remote_at` (None: never)."""

    def __init__(self, remote_at=None):
        self.remote_at, self.votes, self.gathered, self.aborted = remote_at, [], 0, False

    def any_of(self, flags):
        remote = [len(self.votes) == self.remote_at, False]
        self.votes.append(list(flags))
        return [a or b for a, b in zip(flags, remote)]

    def host_mean(self, values):
        return list(values)

    def gather_optimizer_state(self):
        self.gathered += 1

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("where", ["remote", "local"])
def test_data_parallel_sigterm_stops_every_rank_at_a_step_and_saves(where, data, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    cfg = load_config(args(data, out)[0], args(data, out)[1:-1])
    t = Trainer(cfg, log=lambda *a: None)
    dp = t.eng.dp = _VotingDP(remote_at=4 if where == "remote" else None)
    if where == "local":                          # this rank's own SIGTERM, in the middle of step 2
        real, n = Engine.run, [0]

        def run(self, name):
            real(self, name)
            n[0] += name == "train"
            if name == "train" and n[0] == 2:
                os.kill(os.getpid(), signal.SIGTERM)
        monkeypatch.setattr(Engine, "run", run)
    t.train(bar=False)
    stop = 4 if where == "remote" else 2
    assert t.interrupted == signal.SIGTERM and not dp.aborted
    assert len(dp.votes) == stop + 1 and dp.votes[-1] == ([False, False] if where == "remote" else [True, False])
    _, meta = load_checkpoint(os.path.join(out, "last.ckpt"))
    assert meta["step"] == stop and dp.gathered >= 1          # every rank gathers, rank 0 writes
    t.eng.dp = None
    monkeypatch.undo()
    straight = str(tmp_path / "straight")
    assert train.main(args(data, straight)) == 0
    assert train.main(args(data, out, "--resume")) == 0
    a, _ = load_checkpoint(os.path.join(out, "last.ckpt"))
    b, _ = load_checkpoint(os.path.join(straight, "last.ckpt"))
    assert all(np.array_equal(a[k], b[k]) for k in ("params", "adam_m", "adam_v"))
    assert np.array_equal(history(out)[0], history(straight)[0]) and evals(out) == evals(straight)


def test_any_of_is_an_or_over_ranks():
    from gptcuda.dist.parallel import DataParallel
    ranks = [[1.0, 0.0], [0.0, 0.0]]                         # what each of 2 ranks contributes
    fake = types.SimpleNamespace(host_mean=lambda v: [sum(r[i] for r in ranks) / 2 for i in range(len(v))])
    assert DataParallel.any_of(fake, [True, False]) == [True, False]
    ranks[0][0] = 0.0
    assert DataParallel.any_of(fake, [False, False]) == [False, False]
