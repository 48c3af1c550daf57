"""A run directory's model (`load_run`: config, tokenizer and parameters by name), `export_run`, which
writes it as a Hugging Face directory or an llm.c file, and `latest_run`, the most recent run directory."""
from __future__ import annotations

import dataclasses
import glob
import json
import os

from gptcuda.model.checkpoint import CheckpointError, load_checkpoint
from gptcuda.config import Config, ConfigError, validate
from gptcuda.model.params import param_table, unflatten
from gptcuda.interop.common import InteropError, _fmt, _round_up, _tokenizer_vocab, check_expressible
from gptcuda.interop.hf import write_hf
from gptcuda.interop.llmc import write_llmc


@dataclasses.dataclass
class Run:
    cfg: Config                  # the run's config (model vocabulary filled in)
    tokenizer: dict              # its to_dict(): {"type": "gpt2"} | {"type": "char", ...} | {"type": "bpe", ...}
    n_vocab: int                 # the tokenizer's vocabulary (no padding)
    named: dict                  # our name -> array (the checkpoint's precision: float64 for the reference)
    path: str                    # the checkpoint read
    step: int

    @property
    def vocab_size(self) -> int:
        return self.named["wte"].shape[0]


def _config_from_dict(d: dict, where: str) -> Config:
    cfg = Config()
    names = {f.name for f in dataclasses.fields(Config)}
    for k, v in d.items():
        if k in names:
            setattr(cfg, k, v)
    try:
        return validate(cfg)
    except ConfigError as e:
        raise InteropError(f"{where}: {e}") from None


def latest_run(root: str = "out") -> str | None:
    """The most recently written run directory under root (one holding a checkpoint)."""
    runs = [os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "*.ckpt"))]
    if not runs:
        return None
    return max(set(runs), key=lambda d: max(os.path.getmtime(p) for p in glob.glob(os.path.join(d, "*.ckpt"))))


def _pick_ckpt(run_dir: str, ckpt: str | None) -> str:
    if ckpt in (None, "", "best", "last"):
        names = [f"{ckpt}.ckpt"] if ckpt else ["best.ckpt", "last.ckpt"]
        for n in names:
            p = os.path.join(run_dir, n)
            if os.path.exists(p):
                return p
        raise CheckpointError(f"no {' or '.join(names)} in {run_dir}")
    return ckpt


def load_run(run_dir: str, ckpt: str | None = None) -> Run:
    """A run directory's model: config and tokenizer from the checkpoint's metadata (config.yaml and
    tokenizer.json beside it when the metadata lacks them), parameters by name. ckpt: best | last | a path
    (default best.ckpt, else last.ckpt)."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    path = _pick_ckpt(run_dir, ckpt)
    arrays, meta = load_checkpoint(path)
    meta = meta if isinstance(meta, dict) else {}
    if isinstance(meta.get("config"), dict):
        cfg = _config_from_dict(meta["config"], path)
    else:
        from gptcuda.config import load_config
        cfg = load_config(os.path.join(run_dir, "config.yaml"))
    tok = meta.get("tokenizer")
    if isinstance(tok, str):
        tok = json.loads(tok)
    if not isinstance(tok, dict):
        tp = os.path.join(run_dir, "tokenizer.json")
        try:
            with open(tp, encoding="utf-8") as f:
                tok = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} names no tokenizer and {tp} is missing") from None
    n_vocab = _tokenizer_vocab(tok)
    V = cfg.vocab_size or _round_up(n_vocab, cfg.vocab_multiple)
    cfg = dataclasses.replace(cfg, vocab_size=V)
    table = param_table(cfg, V)
    if "params" not in arrays:
        raise CheckpointError(f"{path} holds no params")
    flat = arrays["params"]
    if flat.shape != (table.total,):
        raise CheckpointError(f"{path} params have shape {_fmt(flat.shape)} but its config implies "
                              f"{_fmt((table.total,))}")
    return Run(cfg, tok, n_vocab, unflatten(table, flat), path, int(meta.get("step", 0)))


def export_run(run_dir: str, target: str, dest: str, ckpt: str | None = None, overwrite: bool = False,
               dtype: str = "f32") -> str:
    """Write a run's checkpoint (its fp32 master weights) as `target` ("hf" | "llmc") at dest, in fp32 or
    (dtype "bf16": llm.c files) bf16; a one-line summary."""
    if target not in ("hf", "llmc"):
        raise InteropError(f"--to must be hf or llmc, got {target!r}")
    if dtype != "f32" and target != "llmc":
        raise InteropError(f"--dtype {dtype}: llm.c files only (--to llmc); Hugging Face directories are written "
                           f"in fp32")
    run = load_run(run_dir, ckpt)
    check_expressible(run.cfg, run.tokenizer, target)
    c = run.cfg
    shape = f"{c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, block_size {c.block_size}"
    if target == "hf":
        write_hf(dest, run.named, c, run.tokenizer, overwrite)
        kind = run.tokenizer.get("type")
        return (f"wrote {dest}: Hugging Face GPT-2 ({shape}, vocab {run.n_vocab}, tokenizer {kind}) "
                f"from {run.path} (step {run.step})")
    h = write_llmc(dest, run.named, c, run.n_vocab, overwrite, dtype)
    return (f"wrote {dest}: llm.c {'bf16' if dtype == 'bf16' else 'fp32'} model ({shape}, vocab {run.n_vocab} "
            f"padded to {int(h[7])}) "
            f"from {run.path} (step {run.step})")
