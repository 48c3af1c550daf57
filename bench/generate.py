"""Generation speed beside Hugging Face transformers, at GPT-2 small's shape.

    python bench/generate.py                           # batches 1 16 64 256, 128-token prompts -> 256 new
    python bench/generate.py --batches 1,64 --side ours
    python bench/generate.py --init_from hf:DIR        # real weights (default: a random GPT-2 124M, vocab 50304)
    python bench/generate.py --precision fp32          # our fp32 rows alone (default fp32,bf16; tf32 too)

Both sides run the same weights in fp32 (random ones are written as a Hugging Face directory for
transformers), greedy, on the same prompts of random tokens, and draw exactly --new tokens (HF:
min_new_tokens). Ours also runs them in bf16 (the weights rounded into a bf16 working copy, a bf16 KV
cache): a row of its own for each batch, measured the same way. The time is the wall time of a whole
generate() call, prompt included, median of --repeats after a warm-up; ms/token = time / new tokens,
tokens/s = batch x new tokens / time.

The PyTorch side runs in a subprocess (gptcuda never imports torch): transformers' generate with
the default dynamic cache in eager mode, with the static cache that generate() compiles itself
(torch.compile reduce-overhead), and with the static cache and torch.compile(forward) in its default
mode; the table says what ran and what failed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GPT2_VOCAB = 50257


def prompts_for(batch: int, length: int, n_vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + batch).integers(0, n_vocab, (batch, length)).astype(np.int64)


def sm_clock() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


# ---- ours ------------------------------------------------------------------------------------

def our_model(args):
    from gptcuda.config import Config
    from gptcuda.model.params import init_params, param_table, unflatten
    from gptcuda.generate.sampler import Model, load_model
    from gptcuda.data.tokenizers import tokenizer_from_dict
    if args.init_from:
        return load_model(args.init_from)
    cfg = Config(n_layer=12, n_head=12, n_embd=768, block_size=1024, bias=True, dropout=0.0,
                 vocab_size=50304, tokenizer="gpt2", seed=1234)
    table = param_table(cfg, 50304)
    named = unflatten(table, init_params(table, cfg, cfg.seed))
    return Model(cfg, tokenizer_from_dict({"type": "gpt2"}), named, GPT2_VOCAB, "random GPT-2 124M")


def _tag(precision: str) -> str:
    """What names a row of ours in the summary lines: nothing for fp32 (the lines as they were), else
    the precision."""
    return "" if precision == "fp32" else f" ({precision})"


def _precision(row) -> str:
    """The precision of a row of ours (its mode: "graph, <precision>")."""
    return row["mode"].rsplit(", ", 1)[1]


def time_ours(model, batch, args, precision):
    from gptcuda.generate.sampler import Generator, steps_needed
    prompts = prompts_for(batch, args.prompt, model.n_vocab)
    t0 = time.perf_counter()
    gen = Generator(model, batch, args.new, "cuda", precision)
    setup = time.perf_counter() - t0
    out = gen.generate(list(prompts), temp=0.0)                  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = gen.generate(list(prompts), temp=0.0)
        times.append(time.perf_counter() - t)
    steps = steps_needed([args.prompt] * batch, args.new, model.cfg.block_size)
    res = dict(side="gptcuda", mode=f"graph, {precision}", batch=batch, seconds=statistics.median(times),
               all=times, steps=steps, setup_s=setup, plan_bytes=gen.plan.total_bytes,
               tokens=[o[:args.check].tolist() for o in out[:2]])
    if args.profile:                 # where a step's time goes, at the position the last run ended
        from gptcuda.runtime.profile import phase_table
        print(f"batch {batch}{_tag(precision)}: " + phase_table(gen.be.rt, gen.program, top=12), flush=True)
    gen.be.rt.close()
    return res


# ---- PyTorch (subprocess) ----------------------------------------------------------------------

MODES = {"eager": "dynamic cache, eager", "static": "static cache, generate's compile (reduce-overhead)",
         "compile": "static cache, torch.compile(forward)"}


def torch_main(args):
    import torch
    import transformers
    from transformers import GPT2LMHeadModel
    dev = "cuda"
    model = GPT2LMHeadModel.from_pretrained(args.hf_dir, torch_dtype=torch.float32).to(dev).eval()
    info = dict(torch=torch.__version__, transformers=transformers.__version__,
                tf32=torch.backends.cuda.matmul.allow_tf32)
    print(json.dumps(dict(info=info)), flush=True)
    n_vocab = model.config.vocab_size
    modes = [m for m in MODES if m in args.torch_modes.split(",")]   # compile last: it wraps forward
    for mode in modes:
        for batch in [int(b) for b in args.batches.split(",")]:
            ids = torch.tensor(prompts_for(batch, args.prompt, n_vocab), device=dev)
            kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                      pad_token_id=n_vocab - 1, attention_mask=torch.ones_like(ids))
            try:
                # eager: the default dynamic cache; static: the static cache, which generate() compiles
                # itself (its compile_config: torch.compile reduce-overhead, fullgraph); compile: the
                # static cache with generate's compile off and the forward under torch.compile (default
                # mode, no CUDA graphs)
                gc = model.generation_config
                gc.cache_implementation = None if mode == "eager" else "static"
                gc.disable_compile = mode != "static"
                if mode == "compile" and not hasattr(model, "_plain_forward"):
                    model._plain_forward = model.forward
                    model.forward = torch.compile(model.forward, fullgraph=True)
                with torch.no_grad():
                    t = time.perf_counter()
                    out = model.generate(ids, **kw)                 # warm-up (and compile)
                    torch.cuda.synchronize()
                    warm = time.perf_counter() - t
                    times = []
                    for _ in range(args.repeats):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        out = model.generate(ids, **kw)
                        torch.cuda.synchronize()
                        times.append(time.perf_counter() - t)
                new = out[:, args.prompt:]
                assert new.shape[1] == args.new, new.shape
                res = dict(side="pytorch", mode=MODES[mode], batch=batch,
                           seconds=statistics.median(times), all=times, warmup_s=warm,
                           tokens=[r[:args.check].tolist() for r in new[:2].cpu()])
            except Exception as e:                               # report what failed, go on
                res = dict(side="pytorch", mode=mode, batch=batch, error=f"{type(e).__name__}: {e}".splitlines()[0])
            print(json.dumps(res), flush=True)


def run_torch(args, hf_dir) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "torch-child", "--hf_dir", hf_dir,
           "--batches", args.batches, "--prompt", str(args.prompt), "--new", str(args.new),
           "--repeats", str(args.repeats), "--torch_modes", args.torch_modes, "--check", str(args.check)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.torch_timeout)
    rows = []
    for line in p.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        rows.append(dict(side="pytorch", mode="(process)", batch=0, error=f"exit {p.returncode}: {tail}"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--side", default="both", choices=["both", "ours", "torch", "torch-child"])
    ap.add_argument("--torch_modes", default="eager,static,compile", help=f"of {tuple(MODES)}")
    ap.add_argument("--profile", action="store_true", help="print the phase table of our decode step")
    ap.add_argument("--torch_timeout", type=int, default=420)
    ap.add_argument("--precision", default="fp32,bf16", help="ours: fp32, tf32, bf16, comma-separated (a row each)")
    ap.add_argument("--init_from", default=None)
    ap.add_argument("--hf_dir", default=None)
    ap.add_argument("--check", type=int, default=32, help="leading greedy tokens compared between the sides")
    ap.add_argument("--json", default=None, help="write every row here")
    args = ap.parse_args()
    if args.side == "torch-child":
        return torch_main(args)
    precisions = args.precision.split(",")
    bad = [p for p in precisions if p not in ("fp32", "tf32", "bf16")]
    if bad or len(set(precisions)) != len(precisions):
        ap.error(f"--precision: fp32, tf32 or bf16, each at most once, comma-separated; got {args.precision!r}")
    batches = [int(b) for b in args.batches.split(",")]
    rows, clock = [], [sm_clock()]
    model = our_model(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.side in ("both", "torch"):
            from gptcuda.interop import write_hf
            hf_dir = os.path.join(tmp, "hf")
            write_hf(hf_dir, model.named, model.cfg, {"type": "gpt2"})
            rows += run_torch(args, hf_dir)
            clock.append(sm_clock())
        if args.side in ("both", "ours"):
            for b in batches:
                for precision in precisions:
                    rows.append(time_ours(model, b, args, precision))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
            clock.append(sm_clock())
    info = next((r["info"] for r in rows if "info" in r), {})
    print(f"\n# generation: {model.source}, prompt {args.prompt} -> {args.new} new tokens, greedy, fp32 "
          f"(ours: {', '.join(precisions)}); torch {info.get('torch', '-')}, "
          f"transformers {info.get('transformers', '-')}; "
          f"SM clock (MHz) along the run: {' -> '.join(clock)}")
    print(f"{'side':<9} {'mode':<46} {'batch':>5} {'ms/token':>9} {'tokens/s':>10}  note")
    best = {}
    for r in rows:
        if "batch" not in r:
            continue
        if "error" in r:
            print(f"{r['side']:<9} {r['mode']:<46} {r['batch']:>5} {'-':>9} {'-':>10}  FAILED: {r['error'][:90]}")
            continue
        ms = 1e3 * r["seconds"] / args.new
        tps = r["batch"] * args.new / r["seconds"]
        note = (f"setup {r['setup_s']:.1f} s, {r['steps']} steps, device memory {r['plan_bytes'] / 2**30:.2f} GiB"
                if "setup_s" in r else f"first call {r['warmup_s']:.1f} s")
        print(f"{r['side']:<9} {r['mode']:<46} {r['batch']:>5} {ms:>9.3f} {tps:>10.0f}  {note}")
        if r["side"] == "pytorch":
            b = best.get(r["batch"])
            if b is None or r["seconds"] < b["seconds"]:
                best[r["batch"]] = r

    def same_tokens(r, t):
        return (sum(a == b for x, y in zip(r["tokens"], t["tokens"]) for a, b in zip(x, y)),
                sum(len(x) for x in r["tokens"]))

    for r in rows:
        if r.get("side") == "gptcuda" and r["batch"] in best:
            t = best[r["batch"]]
            same, total = same_tokens(r, t)
            print(f"batch {r['batch']:>3}: ours{_tag(_precision(r))} / PyTorch's best ({t['mode']}): "
                  f"time {r['seconds'] / t['seconds']:.3f}x, "
                  f"tokens/s {t['seconds'] / r['seconds']:.2f}x; greedy tokens equal {same}/{total}")
    ours = {(r["batch"], _precision(r)): r for r in rows if r.get("side") == "gptcuda" and "error" not in r}
    for b in batches:
        for p in precisions[1:]:
            if (b, p) in ours and (b, precisions[0]) in ours:
                r, t = ours[(b, p)], ours[(b, precisions[0])]
                same, total = same_tokens(r, t)
                print(f"batch {b:>3}: ours {p} / ours {precisions[0]}: time {r['seconds'] / t['seconds']:.3f}x, "
                      f"tokens/s {t['seconds'] / r['seconds']:.2f}x; greedy tokens equal {same}/{total}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
