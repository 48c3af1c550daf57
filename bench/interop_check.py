"""Interop against the real thing, on the GPU machine (needs torch + transformers + safetensors).

    python bench/interop_check.py                       # (a) + (b) with a freshly trained tiny run + (c)
    python bench/interop_check.py --run out/my_gpt2_run  # (b) and (c) on an existing gpt2-tokenizer run
    python bench/interop_check.py --skip_a --data data/shakespeare_gpt2   # (b) + (c) only

(a) import: a random GPT2LMHeadModel (2 layers, n_embd 64, 4 heads, n_positions 128, vocab 50257, seed 1234,
    biases and layernorms randomised too) is saved with save_pretrained(safe_serialization=True), read with
    gptcuda.interop.load_init("hf:DIR"), and our CUDA forward's logits on a [B, T] batch are compared with
    transformers' (in float64 on the CPU: the ground truth; transformers fp32 on the GPU is printed for
    scale). PASS: max|d| / max|ref| <= 1e-5 for fp32 (3xtf32 and ffma GEMMs, unfused and fused attention);
    the TF32 figure is printed (informative, loose bound 1e-2).
(b) export: a run directory (--run, or a tiny gpt2 run trained here for 50 steps) -> export.py --to hf ->
    GPT2LMHeadModel.from_pretrained + AutoTokenizer -> logits equal ours within 1e-5; the tokenizer's ids equal
    ours on a sample text.
(c) llm.c: the run exported --to llmc, our validation loss over llm.c's first M val batches of
    prepare.py's shards, and the llm.c command line that must print the same `val loss`.
Exit status 0 when every PASS line passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import transformers  # noqa: E402

from gptcuda.config import Config, load_config  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402
from gptcuda.interop import load_init, load_run  # noqa: E402
from gptcuda.runtime.profile import rel_err as rel  # noqa: E402

FP32_TOL = 1e-5
TF32_TOL = 1e-2
failures = []


def verdict(name, err, tol):
    ok = err <= tol
    print(f"  {name:<48s} max|d|/max|ref| = {err:.3e}  (<= {tol:g})  {'PASS' if ok else 'FAIL'}")
    if not ok:
        failures.append(name)


def our_logits(named, overrides, x, n_vocab, **settings):
    """Our CUDA forward's logits [B, T, n_vocab] for ids x [B, T] (T <= block_size: the batch is cropped)."""
    B, T = x.shape
    opts = {"backend": "cuda", "dropout": 0.0, "batch_size": B, "precision": "fp32", **settings}
    ov = {k: v for k, v in overrides.items() if k != "tokenizer"}
    ov["block_size"] = T
    cfg = load_config(None, [f"--{k}={v}" for k, v in {**opts, **ov}.items()])
    named = dict(named, wpe=named["wpe"][:T])
    dummy = np.zeros(T + 1, np.int32)
    eng = Engine(cfg, dummy, dummy, ov["vocab_size"], programs=("forward",), n_vocab=n_vocab)
    eng.set_params(named)
    eng.set_batch(x, x)
    eng.run("forward")
    lg = eng.be.download(eng.bufs.acts["logits"])
    return np.asarray(lg, np.float64).reshape(B, T, -1)[:, :, :n_vocab]


def hf_logits(model, x, dtype, device):
    m = model.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        return m(torch.as_tensor(x, device=device)).logits.double().cpu().numpy()


SETTINGS = [("fp32, 3xtf32 GEMMs, unfused attention", {"fp32_gemm": "3xtf32"}, FP32_TOL),
            ("fp32, ffma GEMMs, unfused attention", {"fp32_gemm": "ffma"}, FP32_TOL),
            ("fp32, 3xtf32 GEMMs, fused attention", {"attention": "fused"}, FP32_TOL),
            ("tf32 (informative)", {"precision": "tf32"}, TF32_TOL)]


def compare(named, ov, model, x, n_vocab, label):
    from gptcuda.ops.cuda.attention import FLASH_HEAD_SIZES
    ref = hf_logits(model, x, torch.float64, "cpu")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"  (transformers fp32 on the GPU vs its float64: {rel(hf_logits(model, x, torch.float32, 'cuda'), ref):.3e})")
        model.to("cpu")
    for name, s, tol in SETTINGS:
        if s.get("attention") == "fused" and ov["n_embd"] // ov["n_head"] not in FLASH_HEAD_SIZES:
            print(f"  {label}: {name}: skipped (fused attention takes head sizes {FLASH_HEAD_SIZES})")
            continue
        verdict(f"{label}: {name}", rel(our_logits(named, ov, x, n_vocab, **s), ref), tol)


def part_a(out):
    for n_head in (4, 2):                     # head size 16, and 32 for the fused attention
        part_a_model(out, n_head)


def part_a_model(out, n_head):
    print(f"(a) transformers -> gptcuda: a random GPT2LMHeadModel (n_head {n_head}), save_pretrained, "
          f"load_init('hf:...')")
    torch.manual_seed(1234)
    conf = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=n_head, n_positions=128, vocab_size=50257,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(conf).eval()
    with torch.no_grad():                     # biases 0 and layernorms 1/0 would hide a wrong mapping
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    d = os.path.join(out, f"hf_random_h{n_head}")
    model.save_pretrained(d, safe_serialization=True)
    print(f"  saved {d}: {sorted(os.listdir(d))}")
    named, ov = load_init(f"hf:{d}", Config(vocab_multiple=128))
    print(f"  overrides {ov}")
    rng = np.random.default_rng(0)
    for T in (128, 37, 5):                    # several lengths: whole rows of each, no padding
        x = rng.integers(0, 50257, (4, T))
        compare(named, ov, model, x, 50257, f"random model, B=4 T={T}")


def train_tiny(out):
    run = os.path.join(out, "run")
    from gptcuda.training.trainer import Trainer
    cfg = load_config(os.path.join(ROOT, "configs", "tiny.yaml"),
                      ["--tokenizer=gpt2", "--vocab_multiple=128", "--n_head=4", "--block_size=64",
                       "--batch_size=8", "--max_iters=50", "--eval_interval=50", "--lr_decay_iters=50",
                       f"--out_dir={run}"])
    Trainer(cfg, log=lambda *a, **k: None).train(bar=False)
    return run


def export(run, to, dest):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), run, "--to", to, dest, "--overwrite"],
                       capture_output=True, text=True)
    print("  " + (p.stdout or p.stderr).strip())
    if p.returncode:
        failures.append(f"export --to {to}")
        return False
    return True


def part_b(run, out):
    print(f"(b) gptcuda -> transformers: export.py {run} --to hf")
    d = os.path.join(out, "run_hf")
    if not export(run, "hf", d):
        return
    r = load_run(run)
    named, ov = load_init(run, Config())          # the run's own parameters (fp32 from a CUDA run)
    model = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
    T = r.cfg.block_size
    x = np.random.default_rng(1).integers(0, r.n_vocab, (4, T))
    compare(named, ov, model, x, r.n_vocab, f"exported run, B=4 T={T}")
    if r.tokenizer.get("type") == "gpt2":
        from gptcuda.data.tokenizers import GPT2Tokenizer
        tok = transformers.AutoTokenizer.from_pretrained(d)
        text = open(os.path.join(ROOT, "data", "tinyshakespeare", "input.txt"), encoding="utf-8").read()[:5000]
        same = tok(text)["input_ids"] == GPT2Tokenizer().encode(text).tolist()
        print(f"  tokenizer ({type(tok).__name__}) ids equal ours on 5000 characters: {'PASS' if same else 'FAIL'}")
        if not same:
            failures.append("tokenizer ids")


def part_c(run, out, data, B, M, llmc_bin=None):
    print(f"(c) gptcuda -> llm.c: export.py {run} --to llmc")
    dest = os.path.abspath(os.path.join(out, "run.bin"))
    if not export(run, "llmc", dest):
        return
    r = load_run(run)
    T = r.cfg.block_size
    val = os.path.join(data, "val_000000.bin")
    train = os.path.join(data, "train_000000.bin")
    if not os.path.exists(val):
        print(f"  no {val}: make llm.c shards first with\n    python prepare.py data/tinyshakespeare/input.txt "
              f"--tokenizer gpt2 --out {data}")
        failures.append("llm.c shards missing")
        return
    from gptcuda.data.shards import open_shard
    toks = np.asarray(open_shard(val), np.int64)
    M = min(M, (len(toks) - 1) // (B * T))
    cfg = dataclasses.replace(r.cfg, backend="cuda", dropout=0.0, batch_size=B, precision="fp32")
    dummy = np.zeros(T + 1, np.int32)
    eng = Engine(cfg, dummy, dummy, r.vocab_size, programs=("forward",), n_vocab=r.n_vocab)
    eng.set_params(r.named)
    losses = []
    for i in range(M):                     # llm.c's val loader: consecutive B*T windows from token 0
        w = toks[i * B * T: i * B * T + B * T + 1]
        eng.set_batch(w[:-1].reshape(B, T), w[1:].reshape(B, T))
        eng.run("forward")
        losses.append(eng.state()["loss"])
    ours = float(np.mean(losses))
    print(f"  ours: val loss over llm.c's first {M} val batches of {B} x {T} = {ours:.6f}")
    cmd = [os.path.abspath(llmc_bin) if llmc_bin else "./train_gpt2cu", "-e", dest, "-i", os.path.abspath(train),
           "-j", os.path.abspath(val), "-b", str(B), "-t", str(T), "-x", "1", "-v", "1", "-m", str(M), "-s", "0",
           "-l", "0.0", "-f", "0", "-ge", "0", "-r", "0"]
    if not llmc_bin:
        print("  llm.c (github.com/karpathy/llm.c; fp32 build, no cuDNN, TF32 off, learning rate 0) must print the "
              "same `val loss` at step 0:")
        print("    make train_gpt2cu PRECISION=FP32 USE_CUDNN=0")
        print("    " + " ".join(cmd))
        return
    print("  " + " ".join(cmd))
    p = subprocess.run(cmd, cwd=os.path.dirname(os.path.abspath(llmc_bin)), capture_output=True, text=True,
                       timeout=300)
    vals = [float(ln.split()[-1]) for ln in p.stdout.splitlines() if ln.startswith("val loss")]
    for ln in p.stdout.splitlines():
        if ln.startswith(("precision", "val loss", "num_parameters", "max_seq_len", "padded_vocab_size")):
            print("  llm.c: " + ln)
    if p.returncode != 0 or not vals:
        print(f"  llm.c exited {p.returncode} without a val loss: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
        failures.append("llm.c val loss")
        return
    d = abs(vals[0] - ours)
    ok = d <= 1e-3
    print(f"  llm.c's first val loss {vals[0]:.6f}, ours {ours:.6f}: |d| = {d:.2e} (<= 1e-3)  {'PASS' if ok else 'FAIL'}")
    if not ok:
        failures.append("llm.c val loss")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", help="a run directory trained with tokenizer gpt2 (default: train a tiny one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "interop_check"))
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "shakespeare_gpt2"),
                    help="prepare.py's gpt2 shards for (c)")
    ap.add_argument("--skip_a", action="store_true")
    ap.add_argument("--llmc_batch", type=int, default=4)
    ap.add_argument("--llmc_batches", type=int, default=20)
    ap.add_argument("--llmc_bin", help="llm.c's train_gpt2cu (FP32 build): run it on the export and compare")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    if not a.skip_a:
        part_a(a.out)
    run = a.run or train_tiny(a.out)
    part_b(run, a.out)
    part_c(run, a.out, a.data, a.llmc_batch, a.llmc_batches, a.llmc_bin)
    print("ALL PASS" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
