"""End to end on the float64 reference backend (what CI can run): train, resume bitwise,
non-finite loss, checkpoints, sampling, gradcheck and its deliberate failure, CLI errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gptcuda.model.checkpoint import load_checkpoint
from gptcuda.config import load_config
from gptcuda.training.trainer import NonFiniteLoss, Trainer
from resume_check import quiet, resume_matches_full

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--backend=reference", "--max_iters=12", "--eval_interval=6", "--log_interval=1", "--dropout=0.1"]


def run(*args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def history(out_dir):
    arrays, meta = load_checkpoint(os.path.join(out_dir, "last.ckpt"))
    return arrays["history"][:meta["step"]], meta


def test_train_loss_falls_and_resume_is_bitwise(tmp_path):
    full, part = resume_matches_full(tmp_path, TINY, 12, 6)     # stop at the step-6 evaluation
    h_full, meta = history(full)
    assert meta["step"] == 12 and len(h_full) == 12
    assert h_full[-3:].mean() < h_full[:3].mean() - 0.05             # it learns
    recs = [json.loads(l) for l in open(os.path.join(full, "metrics.jsonl"))]
    assert any("eval_val" in r for r in recs) and any("tok_s" in r for r in recs)
    for f in ("config.yaml", "tokenizer.json", "best.ckpt", "last.ckpt"):
        assert os.path.exists(os.path.join(full, f))
    evals = [[(r["step"], r["eval_train"], r["eval_val"]) for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))
              if "eval_val" in r] for d in (full, part)]
    assert evals[0] == evals[1]                 # the same evaluations, none repeated at the resume step


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    out = str(tmp_path / "nan")
    cfg = load_config("configs/tiny.yaml", TINY + [f"--out_dir={out}", "--max_iters=8", "--eval_interval=4"])
    t = Trainer(cfg, log=quiet)
    real_step = t.eng.train_step
    calls = []

    def poisoned_step():
        calls.append(1)
        if len(calls) == 6:                  # after the step-4 checkpoint, make the weights non-finite
            p = t.eng.params()
            p["lnf.w"] = p["lnf.w"] * np.nan
            t.eng.set_params(p)
        real_step()

    t.eng.train_step = poisoned_step
    with pytest.raises(NonFiniteLoss):
        t.train(bar=False)
    arrays, meta = load_checkpoint(os.path.join(out, "last.ckpt"))
    assert meta["step"] == 4 and np.all(np.isfinite(arrays["params"]))


def test_cli_train_resume_sample_gradcheck(tmp_path):
    out = str(tmp_path / "cli")
    run("train.py", "configs/tiny.yaml", *TINY, "--max_iters=4", "--eval_interval=2", f"--out_dir={out}")
    p = run("train.py", "configs/tiny.yaml", *TINY, "--max_iters=6", "--eval_interval=2", f"--out_dir={out}",
            "--resume")
    assert "resumed from" in p.stdout
    s = run("sample.py", "--out_dir", out, "--max_new_tokens", "20", "--num_samples", "2", "--prompt", "ROMEO:",
            "--backend", "reference")
    lines = [l for l in s.stdout.splitlines() if l.startswith("ROMEO:")]
    assert len(lines) == 2
    bad = run("sample.py", "--out_dir", out, "--prompt", "naïve", "--backend", "reference", check=False)
    assert bad.returncode == 2 and "'ï'" in bad.stderr and "Traceback" not in bad.stderr

    g = run("gradcheck.py", "configs/tiny.yaml", "--backend=reference", "--dropout=0.1")
    assert "gradcheck PASSED" in g.stdout and " FAIL" not in g.stdout
    b = run("gradcheck.py", "configs/tiny.yaml", "--backend=reference", "--break=layernorm", check=False)
    assert b.returncode == 1 and "gradcheck FAILED" in b.stdout
    verdict = {l.split()[0]: l.split()[-1] for l in b.stdout.splitlines() if l.startswith(("h0.", "h1.", "wte", "wpe", "lnf"))}
    assert verdict["lnf.w"] == "pass" and verdict["lnf.b"] == "pass"
    for upstream in ("wte", "wpe", "h0.attn.w", "h1.fc.w", "h0.ln1.w"):
        assert verdict[upstream] == "FAIL", upstream


def test_cli_errors_are_one_line(tmp_path):
    p = run("train.py", "configs/tiny.yaml", "--n_layr=3", check=False)
    assert p.returncode == 2 and "n_layr" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = run("train.py", "configs/tiny.yaml", "--n_embd=30", check=False)
    assert p.returncode == 2 and "n_embd" in p.stderr and "Traceback" not in p.stderr
    p = run("train.py", "configs/tiny.yaml", "--plan")
    assert "memory plan" in p.stdout and "total" in p.stdout


def test_train_without_gpu_stops_with_one_line(tmp_path):
    from conftest import has_gpu
    if has_gpu():
        pytest.skip("a GPU is present: the no-GPU message cannot be shown here")
    p = run("train.py", "configs/tiny.yaml", f"--out_dir={tmp_path / 'x'}", check=False)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "no NVIDIA GPU" in p.stderr, p.stderr


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_changes_memory_not_results(precision):
    """recompute false, 1 (of tiny's 2 layers: the first rebuilds, the second stores) and true: the same
    losses bit for bit, each rebuilt layer's GELU output (one [B, T, 4C] slice of fc_act) fewer bytes."""
    from gptcuda.data.text import TextDataset
    from gptcuda.training.engine import Engine
    data = TextDataset("data/tinyshakespeare/input.txt")
    hist = {}
    for rc in ("false", "1", "true"):
        cfg = load_config("configs/tiny.yaml", ["--backend=reference", "--dropout=0.1", "--max_iters=4",
                                                f"--precision={precision}", f"--recompute={rc}"])
        e = Engine(cfg, data.train, data.val, data.vocab_size, programs=("train",))
        for _ in range(4):
            e.train_step()
        fc_act = e.bufs.acts.get("fc_act")
        hist[rc] = (e.loss_history(4), e.plan.total_bytes, 0 if fc_act is None else fc_act.shape[0])
    assert np.array_equal(hist["false"][0], hist["1"][0]) and np.array_equal(hist["false"][0], hist["true"][0])
    assert [hist[rc][2] for rc in ("false", "1", "true")] == [2, 1, 0]
    layer = cfg.batch_size * cfg.block_size * 4 * cfg.n_embd * (2 if precision == "bf16" else 4)
    assert hist["false"][1] - hist["1"][1] >= layer and hist["1"][1] - hist["true"][1] >= layer


@pytest.mark.parametrize("arch,wgmma_env,over,peak", [
    ("sm_90", "1", ["--precision=tf32"], "tf32"),
    ("sm_90", "1", [], "3xtf32"),                    # three tensor-core products a multiply: above FMA's
    ("sm_90", "1", ["--fp32_gemm=ffma"], "ffma"),
    ("sm_90", "0", [], "ffma"),                      # GPTCUDA_WGMMA=0: fp32 multiplies on the FMA units
    ("sm_80", "1", [], "ffma"),                      # no warpgroup MMA on the device
    ("sm_90", "0", ["--precision=tf32"], "tf32"),
])
def test_mfu_peak_is_that_of_what_multiplies(arch, wgmma_env, over, peak):
    """The MFU denominator is the execution plan's: the peak of the kernels that actually run."""
    from gptcuda.config import load_config
    from gptcuda.runtime import execution
    cfg = load_config("configs/tiny.yaml", over)
    ex = execution.resolve(cfg, arch=arch, env={"GPTCUDA_WGMMA": wgmma_env})
    assert ex.peak_tflops == execution.PEAK_TFLOPS[peak]
    assert execution.PEAK_TFLOPS["3xtf32"] == execution.PEAK_TFLOPS["tf32"] / 3 > execution.PEAK_TFLOPS["ffma"]


def test_eval_only_reads_and_writes_nothing_of_the_run(tmp_path, capsys):
    """--eval_only: the losses of the weights as set up (fresh, --resume, init_from) on the batches of
    a run's first evaluation, printed; no file written, no run directory made; refused beside
    --profile or --overwrite."""
    import train
    data = f"--data={ROOT / 'data' / 'tinyshakespeare' / 'input.txt'}"
    base = ["configs/tiny.yaml", "--backend=reference", data, "--eval_iters=2"]
    run_dir = tmp_path / "run"
    assert train.main(base + ["--max_iters=12", "--eval_interval=6", f"--out_dir={run_dir}", "--no-bar"]) == 0
    step0 = next(json.loads(l) for l in open(run_dir / "metrics.jsonl") if '"eval_val"' in l)
    files = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir()}
    capsys.readouterr()

    def losses(args):
        assert train.main(base + args + ["--eval_only"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        step, rest = last.split(": train loss ")
        tr, va = rest.split(", val loss ")
        return int(step.split()[1]), float(tr), float(va)

    fresh = losses([f"--out_dir={tmp_path / 'none'}"])
    assert fresh == (0, round(step0["eval_train"], 4), round(step0["eval_val"], 4))   # a run's step-0 evaluation
    assert not (tmp_path / "none").exists()
    resumed = losses([f"--out_dir={run_dir}", "--resume"])
    assert resumed[0] == 12 and resumed[2] < fresh[2] - 0.05
    assert losses([f"--out_dir={run_dir}", "--resume"]) == resumed                    # the same batches again
    init = losses([f"--out_dir={tmp_path / 'other'}", f"--init_from={run_dir}"])
    assert init[0] == 0 and init[2] < fresh[2] - 0.05 and not (tmp_path / "other").exists()
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in run_dir.iterdir()} == files
    for other in ("--profile", "--overwrite"):
        assert train.main(base + ["--eval_only", other]) == 2
        assert f"--eval_only and {other}: pass one" in capsys.readouterr().err
