"""Sampling from a trained run (sample.py)."""
from __future__ import annotations

import dataclasses
import math
import os

import numpy as np

from .checkpoint import CheckpointError, load_checkpoint
from .cli import UsageError, latest_run
from .config import load_config
from . import compiler
from .engine import Engine
from .memory import plan_decode
from .params import unflatten
from .tokenizers import load_tokenizer


MIN_TEMP = 1e-3     # below this (but above 0) logits / temp can overflow; 0 is greedy
SEED_LIMIT = 2 ** 32


def _num(opts, key, cast, default, ok, allowed):
    """opts[key] as cast (else default), checked by ok(value); a UsageError naming the key and `allowed`."""
    if key not in opts:
        return default
    raw = opts[key]
    try:
        v = cast(raw)
    except (TypeError, ValueError, OverflowError):
        v = None
    if v is None or not ok(v):
        raise UsageError(f"--{key} must be {allowed}, got {raw!r}")
    return v


def parse_options(opts) -> dict:
    """The checked sampling options: num_samples, max_new_tokens, temp, top_k (None: all), seed, backend."""
    out = dict(
        num_samples=_num(opts, "num_samples", int, 1, lambda v: v >= 1, "an integer >= 1"),
        max_new_tokens=_num(opts, "max_new_tokens", int, 500, lambda v: v >= 0, "an integer >= 0"),
        temp=_num(opts, "temp", float, 0.8, lambda v: v == 0 or (math.isfinite(v) and v >= MIN_TEMP),
                  f"0 (greedy) or a finite number >= {MIN_TEMP}"),
        top_k=_num(opts, "top_k", int, 0, lambda v: v >= 0, "an integer >= 0 (0: every token)") or None,
        seed=_num(opts, "seed", int, 1337, lambda v: 0 <= v < SEED_LIMIT, "an integer in [0, 2**32)"),
        backend=opts.get("backend"),
    )
    if out["backend"] not in (None, "cuda", "reference"):
        raise UsageError(f"--backend must be cuda or reference, got {out['backend']!r}")
    return out


class Sampler:
    """Generation with a KV cache: one recorded decode step (a CUDA graph on the GPU) per token."""

    def __init__(self, run_dir: str, num_samples: int, backend: str | None = None, ckpt: str | None = None):
        cfg = load_config(os.path.join(run_dir, "config.yaml"))
        tok_path = os.path.join(run_dir, "tokenizer.json")
        try:
            self.tok = load_tokenizer(tok_path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        path = ckpt or next((os.path.join(run_dir, f) for f in ("best.ckpt", "last.ckpt")
                             if os.path.exists(os.path.join(run_dir, f))), None)
        if path is None:
            raise CheckpointError(f"no checkpoint in {run_dir}")
        # generation runs in fp32 whatever the run trained in: a few small GEMMs a token, where
        # TF32 would buy nothing and cost accuracy
        cfg = dataclasses.replace(cfg, batch_size=num_samples, max_iters=0, dropout=0.0,
                                  backend=backend or cfg.backend, graph=False, precision="fp32")
        dummy = np.zeros(cfg.block_size + 1, np.int32)
        self.eng = eng = Engine(cfg, dummy, dummy, cfg.vocab_size or self.tok.vocab_size, programs=(),
                                n_vocab=self.tok.vocab_size)
        arrays, meta = load_checkpoint(path, None)
        if arrays["params"].shape != (eng.table.total,):
            raise CheckpointError(f"{path} is from another model shape")
        eng.set_params(unflatten(eng.table, arrays["params"]))
        self.cfg, self.path, self.step = eng.cfg, path, int(meta["step"])
        self.V = eng.table["wte"].shape[0]
        plan = plan_decode(eng.cfg, eng.table, self.V, num_samples)
        self.d = eng.be.allocate_arena(plan)
        eng.be.begin("decode")
        eng.model.record_decode_step(self.d)
        self.program = eng.be.end()
        self.graph = eng.be.capture(self.program) if eng.cfg.backend == "cuda" else None
        self.pos = 0

    def _feed(self, tokens: np.ndarray) -> np.ndarray:
        """Run the decode step over columns of tokens [S, n]; the logits [S, V] after the last."""
        be = self.eng.be
        for j in range(tokens.shape[1]):
            be.upload(self.d["tok"], tokens[:, j].astype(np.int32))
            with compiler.forbid_compiles():
                if self.graph is not None:
                    self.graph.launch()
                else:
                    be.run(self.program)
            self.pos += 1
        logits = np.asarray(be.download(self.d["logits"]), np.float64)
        logits[:, self.tok.vocab_size:] = -np.inf           # a padded vocabulary's rows are no tokens
        return logits

    def _restart(self, context: np.ndarray) -> np.ndarray:
        self.pos = 0
        self.eng.be.upload(self.d["pos"], np.zeros(1, np.int32))
        return self._feed(context)

    def generate(self, prompt_ids: np.ndarray, max_new_tokens: int, temp: float, top_k: int | None,
                 rng: np.random.Generator) -> np.ndarray:
        """[S, len(prompt) + max_new_tokens] tokens. Past block_size positions the cache restarts
        from the last half window (positions are absolute, so a window cannot slide in place)."""
        S, T = self.cfg.batch_size, self.cfg.block_size
        seqs = np.tile(prompt_ids.astype(np.int64), (S, 1))
        logits = self._restart(seqs[:, -T:])
        for i in range(max_new_tokens):
            nxt = sample_logits(logits, temp, top_k, rng)
            seqs = np.concatenate([seqs, nxt[:, None]], axis=1)
            if i + 1 == max_new_tokens:
                break
            logits = self._restart(seqs[:, -(T // 2):]) if self.pos >= T else self._feed(nxt[:, None])
        return seqs


def sample_logits(logits: np.ndarray, temp: float, top_k: int | None, rng: np.random.Generator) -> np.ndarray:
    """One token per row: greedy at temp 0, else softmax(logits / temp) over the top_k (None or 0: all)."""
    if temp == 0:
        return logits.argmax(-1)
    if not (math.isfinite(temp) and temp > 0) or (top_k is not None and top_k < 0):
        raise ValueError(f"temp must be 0 or > 0 and top_k >= 0, got temp {temp}, top_k {top_k}")
    V = logits.shape[-1]
    if top_k:
        kth = np.sort(logits, axis=-1)[:, -min(top_k, V)][:, None]
        logits = np.where(logits < kth, -np.inf, logits)
    z = (logits - logits.max(-1, keepdims=True)) / temp       # <= 0: nothing overflows
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return np.array([rng.choice(V, p=row) for row in p])


def sample_main(opts) -> int:
    o = parse_options(opts)                    # every argument checked before anything is loaded
    run_dir = opts.get("out_dir")
    if run_dir is not None:
        if not os.path.isdir(run_dir):
            raise UsageError(f"--out_dir {run_dir}: " + ("not a directory" if os.path.exists(run_dir)
                                                          else "no such directory"))
    else:
        run_dir = latest_run()
        if run_dir is None:
            raise UsageError("no trained run found under out/; train one (python train.py CONFIG) or pass --out_dir")
    ckpt = opts.get("ckpt")
    if ckpt is not None and not os.path.isfile(ckpt):
        raise UsageError(f"--ckpt {ckpt}: no such file")
    S, n_new, temp, top_k, seed = o["num_samples"], o["max_new_tokens"], o["temp"], o["top_k"], o["seed"]
    s = Sampler(run_dir, S, o["backend"], ckpt)
    prompt = opts.get("prompt", "\n")
    try:
        ids = s.tok.encode(prompt) if prompt else np.zeros(1, np.int32)
    except ValueError as e:
        raise UsageError(f"--prompt: {e}") from None
    if len(ids) == 0:
        ids = np.zeros(1, np.int32)
    out = s.generate(ids, n_new, temp, top_k, np.random.default_rng(seed))
    print(f"# {s.path} (step {s.step}), temperature {temp}{' (greedy)' if temp == 0 else ''}, top_k {top_k}, "
          f"seed {seed}")
    for i, row in enumerate(out):
        print(s.tok.decode(row))
        if i + 1 < len(out):
            print("-" * 40)
    return 0
