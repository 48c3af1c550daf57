"""HellaSwag on the GPU beside transformers (needs torch + transformers + safetensors; gptcuda never imports torch).

    python bench/hellaswag_check.py                      # 300 compared examples, the time of 10,042
    python bench/hellaswag_check.py --compare 500 --full 10042 --out /tmp/hellaswag

No network: the examples are synthetic, in hellaswag_val.jsonl's format, cut from tiny Shakespeare (a context
of 20 to 60 words, the true next 5 to 20 words as one ending and three continuations from elsewhere as the
others). The weights are GPT-2 124M-shaped (12 layers, 12 heads, n_embd 768, 1024 positions, GPT-2's 50257
tokens), randomly initialised with init_std --std (0.1: sharper predictions than 0.02's, fewer near-ties),
exported with gptcuda.interop.write_hf and loaded by transformers' GPT2LMHeadModel.

(a) The first --compare examples are scored by gptcuda.training.hellaswag (our forward, fp32, the rows of
    many examples padded into 64-row batches) and by transformers in fp32 (TF32 off) as llm.c's
    dev/data/hellaswag.py does (one example's 4 rows a batch). PASS: every ending's mean loss within 1e-4,
    and acc and acc_norm identical per example wherever the two best endings are further apart than the
    loss error (an example closer than that is counted and printed as a near-tie).
(b) All --full examples scored by our forward alone: the time (the rows rendered once, setup apart).
Exit status 0 when every PASS passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gptcuda.config import Config  # noqa: E402
from gptcuda.data.tokenizers import make_tokenizer  # noqa: E402
from gptcuda.interop import write_hf  # noqa: E402
from gptcuda.model.params import init_params, param_table, unflatten  # noqa: E402
from gptcuda.training import hellaswag  # noqa: E402

TOL = 1e-4


def synthetic(text: str, n: int, seed: int) -> list[dict]:
    """n HellaSwag-format examples cut from text (see the module docstring)."""
    words = text.split()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        c, e = int(rng.integers(20, 61)), int(rng.integers(5, 21))
        at = int(rng.integers(0, len(words) - c - e))
        ends = [" ".join(words[at + c:at + c + e])]
        for _ in range(3):
            o, m = int(rng.integers(0, len(words) - 20)), int(rng.integers(5, 21))
            ends.append(" ".join(words[o:o + m]))
        label = int(rng.integers(0, 4))
        ends[0], ends[label] = ends[label], ends[0]
        out.append({"ind": i, "ctx": " ".join(words[at:at + c]), "label": label, "endings": ends,
                    "split": "val", "source_id": f"synthetic~{i}"})
    return out


def write_jsonl(path: str, examples) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(e) + "\n" for e in examples)
    return path


def hf_scores(model_dir: str, items, torch, transformers) -> hellaswag.Result:
    """llm.c's evaluate(): per example, its 4 rows padded to the longest, cross-entropy per position."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir).float().cuda().eval()
    losses = np.zeros((len(items), 4))
    counts = np.zeros((len(items), 4), np.int64)
    with torch.no_grad():
        for i, it in enumerate(items):
            L = max(len(r) for r in it.rows)
            tok = torch.zeros((4, L), dtype=torch.long)
            mask = torch.zeros((4, L))
            for k, (r, s) in enumerate(zip(it.rows, it.start)):
                tok[k, :len(r)] = torch.tensor(r.astype(np.int64))
                mask[k, s:len(r)] = 1
            tok, mask = tok.cuda(), mask.cuda()
            logits = model(tok).logits
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).double(),
                                                   tok[:, 1:].reshape(-1), reduction="none").view(4, -1)
            m = mask[:, 1:].double()
            losses[i] = (ce * m).sum(1).cpu().numpy()
            counts[i] = m.sum(1).cpu().numpy()
    return hellaswag.Result(losses, counts, np.array([it.label for it in items]))


def compare(ours: hellaswag.Result, ref: hellaswag.Result) -> bool:
    d_mean = np.abs(ours.losses / ours.counts - ref.losses / ref.counts)
    d_sum = np.abs(ours.losses - ref.losses)
    print(f"per-ending losses: max |d mean| {d_mean.max():.2e}, max |d sum| {d_sum.max():.2e} "
          f"(tokens per ending {ours.counts.min()}..{ours.counts.max()})")
    ok = bool((ours.counts == ref.counts).all()) and d_mean.max() <= TOL
    print(f"{'PASS' if ok else 'FAIL'} every ending's mean loss within {TOL} of transformers' (and the same tokens)")
    for what, key, err in (("acc", "pred", d_sum.max()), ("acc_norm", "pred_norm", d_mean.max())):
        a, b = getattr(ours, key), getattr(ref, key)
        score = ours.losses if key == "pred" else ours.losses / ours.counts
        two = np.sort(score, axis=1)[:, :2]
        near = (two[:, 1] - two[:, 0]) <= 2 * max(err, 1e-7)
        differ = a != b
        bad = differ & ~near
        print(f"{what}: ours {getattr(ours, what):.4f}, transformers {getattr(ref, what):.4f}; predictions "
              f"differ on {int(differ.sum())} of {ours.n} examples ({int((differ & near).sum())} of them near-ties, "
              f"{int(near.sum())} near-ties in all)")
        print(f"{'PASS' if not bad.any() else 'FAIL'} {what} identical per example outside near-ties"
              + (f": examples {np.flatnonzero(bad)[:10].tolist()}" if bad.any() else ""))
        ok = ok and not bad.any()
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", type=int, default=300)
    ap.add_argument("--full", type=int, default=10042)
    ap.add_argument("--std", type=float, default=0.1)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--out", default="/tmp/hellaswag")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    text = open(os.path.join(ROOT, "data", "tinyshakespeare", "input.txt"), encoding="utf-8").read()
    examples = synthetic(text, max(args.full, args.compare), args.seed)
    path = write_jsonl(os.path.join(args.out, "synthetic_hellaswag.jsonl"), examples)
    cfg = Config(n_layer=12, n_head=12, n_embd=768, block_size=1024, dropout=0.0, vocab_size=50304,
                 tokenizer="gpt2", init_std=args.std, precision="fp32", attention="unfused")
    named = unflatten(param_table(cfg, 50304), init_params(param_table(cfg, 50304), cfg, args.seed))
    hf_dir = os.path.join(args.out, "hf")
    write_hf(hf_dir, named, cfg, {"type": "gpt2"}, overwrite=True)
    tok = make_tokenizer("gpt2")
    t = time.perf_counter()
    items = hellaswag.render(hellaswag.read_examples(path), tok, cfg.block_size)
    print(f"{len(items)} synthetic examples ({path}), rendered in {time.perf_counter() - t:.1f} s; "
          f"longest row {hellaswag.longest(items)} positions")

    import torch
    import transformers
    few = items[:args.compare]
    eng = hellaswag.scoring_engine(cfg, named, tok.vocab_size, few, args.rows)
    ours = hellaswag.score(eng, few)
    ref = hf_scores(hf_dir, few, torch, transformers)
    ok = compare(ours, ref)
    del eng

    for prec in ("fp32", "tf32"):
        c = dataclasses.replace(cfg, precision=prec)
        eng = hellaswag.scoring_engine(c, named, tok.vocab_size, items, args.rows)
        hellaswag.score(eng, items[:args.rows])            # warm-up: first launches, the GEMM table
        t = time.perf_counter()
        res = hellaswag.score(eng, items)
        secs = time.perf_counter() - t
        print(f"{prec}: {res.n} examples in {secs:.1f} s ({4 * res.n / secs:,.0f} rows/s, block "
              f"{eng.cfg.block_size}, {args.rows} rows a forward): acc {res.acc:.4f}, acc_norm {res.acc_norm:.4f}")
        del eng
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
