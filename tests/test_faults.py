"""Nothing lost, nothing silent: every user-facing failure of train.py and sample.py is one line on
stderr with exit code 2 and leaves what the user had as it was; interrupts (Ctrl-C, SIGTERM, an
interrupt inside a step, an evaluation or a checkpoint write) save a consistent last.ckpt from which
a resumed run continues bit for bit. CPU only: the reference backend on a tiny model."""
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import sample
import train
from gptcuda import files
from gptcuda.model import checkpoint
from gptcuda.model.checkpoint import load_checkpoint
from gptcuda.training.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "data" / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:3000]


def args(data, out, *extra):
    return ["configs/tiny.yaml", "--backend=reference", "--max_iters=6", "--eval_interval=3", "--eval_iters=1",
            "--log_interval=1", "--dropout=0.1", f"--data={data}", f"--out_dir={out}", "--no-bar", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "small.txt"
    p.write_text(TEXT, encoding="utf-8")
    return str(p)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, data):
    """A finished 6-step run (evaluations at 0, 3, 6)."""
    out = str(tmp_path_factory.mktemp("base") / "run")
    assert train.main(args(data, out)) == 0
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(base_run, out)
    return out


def snapshot(d):
    """{relative path: sha256} of every file under d (hidden ones too); {} when d does not exist."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def call(main, argv, capsys):
    """(exit code, stdout, stderr) of an in-process main(argv)."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:           # nothing should exit this way, but report it as the code
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, *names):
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def records(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"), encoding="utf-8")]


def evals(out):
    return [(r["step"], r["eval_train"], r["eval_val"]) for r in records(out) if "eval_val" in r]


def steps(out):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in records(out) if "loss" in r]


def history(out):
    arrays, meta = load_checkpoint(os.path.join(out, "last.ckpt"))
    return arrays["history"][:meta["step"]], meta


# ---- help ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(flag, capsys, tmp_path):
    rc, out, err = call(train.main, [flag], capsys)
    assert rc == 0 and err == ""
    assert "python train.py" in out and "--resume" in out and "--overwrite" in out
    for key in ("n_layer", "learning_rate", "out_dir", "tokenizer"):     # every config key, with its default
        assert f"--{key}" in out
    assert "0.001" in out and "out/shakespeare_char" in out
    rc, out, err = call(train.main, ["configs/tiny.yaml", flag, f"--out_dir={tmp_path / 'x'}"], capsys)
    assert rc == 0 and not os.path.exists(tmp_path / "x")
    rc, out, err = call(sample.main, [flag], capsys)
    assert rc == 0 and err == "" and "--temp" in out and "greedy" in out and "--top_k" in out


# ---- train.py: data, out_dir and resume errors ---------------------------------------------------

@pytest.mark.parametrize("kind", ["empty", "binary", "not_utf8", "directory"])
def test_bad_data_is_one_line_and_creates_nothing(kind, tmp_path, capsys):
    p = tmp_path / f"data_{kind}"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "binary":
        p.write_bytes(b"abc\0def" * 100)
    elif kind == "not_utf8":
        p.write_bytes(b"abc \xff\xfe def" * 100)
    else:
        p.mkdir()
    out = tmp_path / "out"
    rc, _, err = call(train.main, args(str(p), str(out)), capsys)
    one_line_error(rc, err, str(p))
    assert not out.exists()


def test_no_gpu_error_comes_first_and_creates_nothing(tmp_path, capsys):
    from conftest import has_gpu
    if has_gpu():
        pytest.skip("a GPU is present")
    out = tmp_path / "a" / "b"
    rc, stdout, err = call(train.main, ["configs/tiny.yaml", f"--out_dir={out}"], capsys)
    one_line_error(rc, err, "no NVIDIA GPU")
    assert stdout == "" and not (tmp_path / "a").exists()


def test_failed_resume_creates_nothing(tmp_path, data, capsys):
    out = tmp_path / "a" / "b"
    rc, _, err = call(train.main, args(data, str(out), "--resume"), capsys)
    one_line_error(rc, err, os.path.join(str(out), "last.ckpt"))
    assert not (tmp_path / "a").exists()


def test_resume_with_a_character_the_tokenizer_lacks(run_copy, tmp_path, capsys):
    p = tmp_path / "more.txt"
    p.write_text(TEXT + "ü", encoding="utf-8")
    before = snapshot(run_copy)
    rc, _, err = call(train.main, args(str(p), run_copy, "--resume", "--max_iters=9"), capsys)
    one_line_error(rc, err, str(p), "'ü'")
    assert snapshot(run_copy) == before


def test_resume_with_a_truncated_tokenizer(run_copy, data, capsys):
    tok = os.path.join(run_copy, "tokenizer.json")
    Path(tok).write_bytes(Path(tok).read_bytes()[:40])
    before = snapshot(run_copy)
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--max_iters=9"), capsys)
    one_line_error(rc, err, tok)
    assert snapshot(run_copy) == before


def test_resume_names_every_model_difference(run_copy, data, capsys):
    before = snapshot(run_copy)
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--n_layer=3", "--n_embd=128", "--n_head=4",
                                       "--vocab_multiple=64", "--learning_rate=1e-3"), capsys)
    line = one_line_error(rc, err, "n_layer 2 -> 3", "n_embd 64 -> 128", "n_head 2 -> 4", "vocab_size 52 -> 64")
    assert "learning_rate" not in line          # a recipe setting may change
    assert snapshot(run_copy) == before


def test_resume_logs_recipe_changes_and_keeps_the_model(run_copy, data, capsys):
    rc, out, err = call(train.main, args(data, run_copy, "--resume", "--max_iters=7", "--learning_rate=1e-3"),
                        capsys)
    assert rc == 0, err
    assert "max_iters 6 -> 7" in out and "learning_rate 0.003 -> 0.001" in out
    cfg = open(os.path.join(run_copy, "config.yaml")).read()
    assert "n_layer: 2" in cfg and "n_embd: 64" in cfg and "max_iters: 7" in cfg
    assert [r["step"] for r in records(run_copy) if "loss" in r] == list(range(1, 8))


def test_out_dir_that_is_a_file_or_under_one(tmp_path, data, capsys):
    f = tmp_path / "file"
    f.write_text("mine")
    for out in (f, f / "sub"):
        rc, _, err = call(train.main, args(data, str(out)), capsys)
        one_line_error(rc, err, str(out))
        assert f.read_text() == "mine"


def test_unwritable_out_dir(tmp_path, data, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:             # root writes anyway: make access() say what it would say to a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, m, **k: False if os.path.abspath(p) == str(ro) else real(p, m, **k))
    for out in (ro, ro / "sub"):
        rc, _, err = call(train.main, args(data, str(out)), capsys)
        one_line_error(rc, err, str(out), "not writable")
    assert list(ro.iterdir()) == []
    ro.chmod(0o755)


def test_a_write_failing_at_start_leaves_nothing(tmp_path, data, capsys, monkeypatch):
    """Past the checks, the first write fails (EACCES from mkstemp): one line naming the file, and the
    directory made for the run is gone again."""
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", k.get("dir"))
    monkeypatch.setattr(files.tempfile, "mkstemp", denied)
    out = tmp_path / "new" / "run"
    rc, _, err = call(train.main, args(data, str(out)), capsys)
    one_line_error(rc, err, str(out), "Permission denied")
    assert not (tmp_path / "new").exists()


def test_existing_run_is_refused_then_overwritten(run_copy, data, capsys):
    before = snapshot(run_copy)
    rc, _, err = call(train.main, args(data, run_copy), capsys)
    one_line_error(rc, err, run_copy, "--resume", "--overwrite")
    assert snapshot(run_copy) == before
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--overwrite"), capsys)
    one_line_error(rc, err, "--resume", "--overwrite")
    assert snapshot(run_copy) == before
    rc, _, err = call(train.main, args(data, run_copy, "--overwrite", "--max_iters=2", "--eval_interval=2"), capsys)
    assert rc == 0, err
    assert [r["step"] for r in records(run_copy)] == [0, 1, 2, 2]       # the old run's records are gone
    assert history(run_copy)[1]["step"] == 2


def test_disk_full_keeps_the_previous_checkpoints(run_copy, data, capsys, monkeypatch):
    kept = {f: h for f, h in snapshot(run_copy).items() if f.endswith(".ckpt")}
    old = open(os.path.join(run_copy, "metrics.jsonl")).read()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint.os, "fsync", full)
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--max_iters=9"), capsys)
    one_line_error(rc, err, "no space left", os.path.join(run_copy, ""))
    now = snapshot(run_copy)
    assert {f: h for f, h in now.items() if f.endswith(".ckpt")} == kept
    assert not [f for f in now if f.endswith(".tmp")]
    assert open(os.path.join(run_copy, "metrics.jsonl")).read().startswith(old)
    monkeypatch.undo()
    # the resumed run redoes the lost steps; metrics.jsonl is cut back first, so no step is there twice
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--max_iters=9"), capsys)
    assert rc == 0, err
    keys = [(r["step"], "eval_val" in r) for r in records(run_copy)]
    assert len(keys) == len(set(keys)) and max(k[0] for k in keys) == 9


def test_files_get_the_umask_permissions(tmp_path, data, capsys):
    for mask in (0o022, 0o027):
        old = os.umask(mask)
        try:
            out = tmp_path / f"u{mask:o}"
            rc, _, err = call(train.main, args(data, str(out), "--max_iters=1", "--eval_interval=1"), capsys)
        finally:
            os.umask(old)
        assert rc == 0, err
        for f in ("last.ckpt", "best.ckpt", "config.yaml", "tokenizer.json", "metrics.jsonl"):
            assert stat.S_IMODE(os.stat(out / f).st_mode) == 0o666 & ~mask, (f, oct(mask))


def test_stale_temporary_files_are_removed(run_copy, data, capsys):
    stale = [".last.ckpt.k2j3h4g5.tmp", ".config.yaml.abcdefgh.tmp", ".metrics.jsonl.x_y_z_12.tmp"]
    others = [".other.abcdefgh.tmp", "notes.txt"]
    for n in stale + others:
        Path(run_copy, n).write_text("left over")
    rc, _, err = call(train.main, args(data, run_copy, "--resume", "--max_iters=7"), capsys)
    assert rc == 0, err
    names = set(os.listdir(run_copy))
    assert not names & set(stale) and set(others) <= names


# ---- sample.py -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arg,value,allowed", [
    ("seed", "-1", "[0, 2**32)"), ("temp", "nan", "0 (greedy)"), ("temp", "1e-320", ">= 0.001"),
    ("temp", "-1", "0 (greedy)"), ("top_k", "-1", ">= 0"), ("num_samples", "0", ">= 1"),
    ("max_new_tokens", "-1", ">= 0"), ("seed", "x", "integer"),
])
def test_sample_arguments(arg, value, allowed, base_run, capsys):
    before = snapshot(base_run)
    rc, out, err = call(sample.main, ["--out_dir", base_run, "--backend", "reference", f"--{arg}={value}"], capsys)
    one_line_error(rc, err, f"--{arg}", allowed, repr(value))
    assert out == "" and snapshot(base_run) == before


def test_sample_missing_out_dir(tmp_path, capsys):
    rc, _, err = call(sample.main, ["--out_dir", str(tmp_path / "nope"), "--backend", "reference"], capsys)
    one_line_error(rc, err, "--out_dir", str(tmp_path / "nope"), "no such directory")


def test_sample_temp_zero_is_greedy(base_run, capsys):
    outs = []
    for seed in ("1", "2"):
        rc, out, err = call(sample.main, ["--out_dir", base_run, "--backend", "reference", "--temp", "0",
                                          "--max_new_tokens", "12", "--seed", seed], capsys)
        assert rc == 0, err
        outs.append(out.splitlines()[1:])
    assert outs[0] == outs[1]


# ---- interrupts ----------------------------------------------------------------------------------

def _straight(data, tmp_path_factory, cache={}):
    if "out" not in cache:
        out = str(tmp_path_factory.mktemp("straight") / "run")
        calls = []
        real = Engine.run

        def counting(self, name):
            calls.append(name)
            return real(self, name)
        Engine.run = counting
        try:
            assert train.main(args(data, out)) == 0
        finally:
            Engine.run = real
        cache.update(out=out, calls=calls)
    return cache["out"], cache["calls"]


def _cases():
    """(kind, call index, phase): a seeded choice of interrupt points in a step, an evaluation and a
    checkpoint write. The 6-step run makes 6 "train" calls and 2 calls (train split, val split) at each of
    its 3 evaluations, 12 Engine.run calls in all, and writes best.ckpt and last.ckpt at each evaluation."""
    r = random.Random(20261201)
    train_calls = [2, 3, 4, 7, 8, 9]           # indices of "train" in the straight run's calls
    eval_calls = [0, 1, 5, 6, 10, 11]
    s, e, c = r.sample(train_calls, 2), r.sample(eval_calls, 2), r.sample(range(6), 2)
    return [("step", s[0], "before"), ("step", s[1], "after"), ("eval", e[0], "before"), ("eval", e[1], "after"),
            ("ckpt", c[0], "before rename"), ("ckpt", c[1], "before rename")]


@pytest.mark.parametrize("kind,at,phase", _cases())
def test_interrupt_anywhere_then_resume_is_bitwise(kind, at, phase, data, tmp_path, tmp_path_factory, capsys,
                                                   monkeypatch):
    straight, calls = _straight(data, tmp_path_factory)
    assert calls == ["eval_train", "eval_val", "train", "train", "train"] * 2 + ["eval_train", "eval_val"]
    out = str(tmp_path / "run")
    count = [0]
    if kind in ("step", "eval"):
        want = "train" if kind == "step" else "eval"
        assert calls[at].startswith(want), (calls, at)
        real = Engine.run

        def run(self, name):
            i = count[0]
            count[0] += 1
            if i == at and phase == "before":
                raise KeyboardInterrupt
            real(self, name)
            if i == at:
                raise KeyboardInterrupt
        monkeypatch.setattr(Engine, "run", run)
    else:
        real_replace = os.replace

        def replace(src, dst):
            if not str(dst).endswith(".ckpt"):
                return real_replace(src, dst)
            i = count[0]
            count[0] += 1
            if i == at:
                raise KeyboardInterrupt        # the temp file is written and fsync'd, not yet renamed
            return real_replace(src, dst)
        monkeypatch.setattr(checkpoint.os, "replace", replace)
    rc, stdout, err = call(train.main, args(data, out), capsys)
    monkeypatch.undo()
    assert rc == 130 and "interrupted at step" in stdout and "best val loss" not in stdout, (rc, stdout[-500:], err)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    rc, stdout, err = call(train.main, args(data, out, "--resume"), capsys)
    assert rc == 0, err
    h_s, m_s = history(straight)
    h_r, m_r = history(out)
    assert m_r["step"] == m_s["step"] == 6 and np.array_equal(h_r, h_s)      # bit for bit
    assert m_r["eval_draws"] == m_s["eval_draws"]
    assert evals(out) == evals(straight)                                        # the same, none twice
    assert steps(out) == steps(straight)
    a, _ = load_checkpoint(os.path.join(out, "last.ckpt"))
    b, _ = load_checkpoint(os.path.join(straight, "last.ckpt"))
    assert all(np.array_equal(a[k], b[k]) for k in ("params", "adam_m", "adam_v"))


def _popen(data, out, *extra):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    argv = args(data, out, "--max_iters=400", "--eval_interval=200", *extra)
    return subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_steps(p, n=2, timeout=60):
    t = time.monotonic()
    lines = []
    while time.monotonic() - t < timeout:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"step\s+(\d+) loss", line)
        if m and int(m.group(1)) >= n:
            return lines
    raise AssertionError(f"no step {n} in the output: {''.join(lines)[-1000:]}")


def test_signals_save_and_exit(tmp_path, data, capsys):
    """SIGINT: last.ckpt and exit 130; SIGTERM: the same, 143; two SIGINTs at once: still one good save.
    Then each run resumes."""
    cases = [("int", [signal.SIGINT], 130), ("term", [signal.SIGTERM], 143),
             ("twice", [signal.SIGINT, signal.SIGINT], 130)]
    procs = [(name, sigs, code, str(tmp_path / name)) for name, sigs, code in cases]
    running = [(name, sigs, code, out, _popen(data, out)) for name, sigs, code, out in procs]
    try:
        for name, sigs, code, out, p in running:
            _wait_for_steps(p)
            for s in sigs:
                p.send_signal(s)
            rest, err = p.communicate(timeout=120)
            assert p.returncode == code, (name, p.returncode, err[-2000:])
            assert "best val loss" not in rest and "Traceback" not in err, (name, rest, err)
            assert "saved" in rest and "last.ckpt" in rest
            arrays, meta = load_checkpoint(os.path.join(out, "last.ckpt"))
            assert meta["step"] >= 2
            assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
            rc, _, err = call(train.main, args(data, out, "--resume", f"--max_iters={meta['step'] + 1}",
                                               "--eval_interval=200"), capsys)
            assert rc == 0, err
    finally:
        for *_, p in running:
            if p.poll() is None:
                p.kill()
                p.wait()
