"""Sampling from a trained run (sample.py)."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from .checkpoint import CheckpointError, load_checkpoint
from .cli import UsageError, latest_run
from .config import load_config
from .data import CharTokenizer
from .engine import Engine
from .params import unflatten


def _num(opts, key, cast, default):
    try:
        return cast(opts[key]) if key in opts else default
    except ValueError:
        raise UsageError(f"--{key} expects a {cast.__name__}, got {opts[key]!r}") from None


class Sampler:
    """A forward-only engine at batch num_samples that generates token by token."""

    def __init__(self, run_dir: str, num_samples: int, backend: str | None = None, ckpt: str | None = None):
        cfg = load_config(os.path.join(run_dir, "config.yaml"))
        self.tok = CharTokenizer.load(os.path.join(run_dir, "tokenizer.json"))
        path = ckpt or next((os.path.join(run_dir, f) for f in ("best.ckpt", "last.ckpt")
                             if os.path.exists(os.path.join(run_dir, f))), None)
        if path is None:
            raise CheckpointError(f"no checkpoint in {run_dir}")
        cfg = dataclasses.replace(cfg, batch_size=num_samples, max_iters=0, dropout=0.0,
                                  backend=backend or cfg.backend, graph=False)
        T = cfg.block_size
        dummy = np.zeros(T + 1, np.int32)
        self.eng = Engine(cfg, dummy, dummy, cfg.vocab_size or self.tok.vocab_size, programs=())
        arrays, meta = load_checkpoint(path, None)
        if arrays["params"].shape != (self.eng.table.total,):
            raise CheckpointError(f"{path} is from another model shape")
        self.eng.set_params(unflatten(self.eng.table, arrays["params"]))
        self.cfg, self.path, self.step = self.eng.cfg, path, int(meta["step"])

    def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temp: float, top_k: int | None,
                 rng: np.random.Generator) -> np.ndarray:
        """[S, len(prompt) + max_new_tokens] tokens; the context slides once it exceeds block_size."""
        S, T, V = self.cfg.batch_size, self.cfg.block_size, self.eng.table["wte"].shape[0]
        seqs = np.tile(prompt_ids.astype(np.int64), (S, 1))
        acts = self.eng.bufs.acts
        for _ in range(max_new_tokens):
            ctx = seqs[:, -T:]
            n = ctx.shape[1]
            x = np.zeros((S, T), np.int32)
            x[:, :n] = ctx
            self.eng.set_batch(x, x)
            self.eng.run("forward")
            logits = np.asarray(self.eng.be.download(acts["logits"]), np.float64)[:, n - 1, :V]
            if temp <= 0:
                nxt = logits.argmax(-1)
            else:
                logits = logits / temp
                if top_k:
                    kth = np.sort(logits, axis=-1)[:, -min(top_k, V)][:, None]
                    logits = np.where(logits < kth, -np.inf, logits)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                nxt = np.array([rng.choice(V, p=row) for row in p])
            seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
        return seqs


def sample_main(opts) -> int:
    run_dir = opts.get("out_dir") or latest_run()
    if run_dir is None or not os.path.isdir(run_dir):
        raise UsageError("no trained run found under out/; train one (python train.py CONFIG) or pass --out_dir")
    S = _num(opts, "num_samples", int, 1)
    n_new = _num(opts, "max_new_tokens", int, 500)
    temp = _num(opts, "temp", float, 0.8)
    top_k = _num(opts, "top_k", int, 0) or None
    seed = _num(opts, "seed", int, 1337)
    backend = opts.get("backend")
    if backend not in (None, "cuda", "reference"):
        raise UsageError(f"--backend must be cuda or reference, not {backend!r}")
    if S < 1 or n_new < 0:
        raise UsageError("--num_samples must be >= 1 and --max_new_tokens >= 0")
    s = Sampler(run_dir, S, backend, opts.get("ckpt"))
    prompt = opts.get("prompt", "\n")
    try:
        ids = s.tok.encode(prompt) if prompt else np.zeros(1, np.int32)
    except ValueError as e:
        raise UsageError(f"--prompt: {e}") from None
    if len(ids) == 0:
        ids = np.zeros(1, np.int32)
    out = s.generate(ids, n_new, temp, top_k, np.random.default_rng(seed))
    print(f"# {s.path} (step {s.step}), temperature {temp}, top_k {top_k}, seed {seed}")
    for i, row in enumerate(out):
        print(s.tok.decode(row))
        if i + 1 < len(out):
            print("-" * 40)
    return 0
