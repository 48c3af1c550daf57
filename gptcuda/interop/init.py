"""`load_init`: the parameters and model settings to start training or sampling from, out of a Hugging Face
directory ("hf:DIR"), an llm.c file ("llmc:FILE"), a run directory or a run's .ckpt file."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from gptcuda.config import Config, ConfigError, validate
from gptcuda.model.checkpoint import CheckpointError
from gptcuda.model.params import param_table
from gptcuda.interop.common import GPT2_VOCAB, InteropError, _fmt, _round_up
from gptcuda.interop.hf import from_hf, read_hf
from gptcuda.interop.llmc import from_llmc, read_llmc
from gptcuda.interop.run import load_run


def _parse_spec(spec: str) -> tuple[str, str]:
    spec = os.fspath(spec)
    for kind in ("hf", "llmc"):
        if spec.startswith(kind + ":"):
            rest = spec[len(kind) + 1:]
            if not rest:
                raise InteropError(f"--init_from={spec}: names no {'directory' if kind == 'hf' else 'file'}")
            return kind, rest
    if spec.endswith(".ckpt") and os.path.isfile(spec):
        return "ckpt", spec
    return "run", spec


def run_of(kind: str, where: str, ckpt: str | None = None):
    """The Run a "run" or "ckpt" spec names (_parse_spec): its directory's best.ckpt, else last.ckpt
    (or ckpt), or the .ckpt file itself."""
    if kind == "ckpt":
        return load_run(os.path.dirname(os.path.abspath(where)), ckpt or where)
    return load_run(where, ckpt)


def load_init(spec: str, cfg: Config, block_size: int | None = None) -> tuple[dict, dict]:
    """(named parameters, config overrides) to start a model from.

    spec: "hf:DIR" (a Hugging Face GPT-2 directory), "llmc:FILE" (an llm.c model file), a run directory
    (its best.ckpt, else last.ckpt) or a .ckpt file of a run. named: our names and layouts (params.py), float32
    for hf / llmc (the files' values exactly), the checkpoint's precision for a run; wte has the model's
    vocabulary (see the module docstring), rows past the source's zero. overrides: the Config fields the
    weights fix: n_layer, n_head, n_embd, block_size, bias (true), vocab_size, and tokenizer ("gpt2" for a
    50257-token hf/llmc model, the run's own spec for a run). block_size: crop the position embedding to
    this many positions (at most the source's). A shape or name that disagrees is an InteropError naming
    the tensor and both shapes."""
    named, over, _, _ = _load(spec, cfg, block_size)
    return named, over


def load_weights(spec: str, cfg: Config, block_size: int | None = None) -> tuple[dict, dict, dict | None]:
    """load_init's (named, overrides) and the tokenizer that comes with the weights (a to_dict(): a run's
    own, a Hugging Face directory's tokenizer.json of a bpe:N export, GPT-2's for a 50257-token model;
    None: the weights name none)."""
    named, over, run, tok = _load(spec, cfg, block_size)
    if tok is None and over.get("tokenizer") == "gpt2":
        tok = {"type": "gpt2"}
    return named, over, tok


def _hf_tokenizer(where: str, n: int) -> dict | None:
    """A bpe:N export's tokenizer (DIR/tokenizer.json, the HF `tokenizers` JSON the run trained) as a
    to_dict(); None where DIR has none. One that is not an n-token byte-level BPE ending in
    <|endoftext|> is an InteropError naming it."""
    from gptcuda.data.tokenizers import tokenizer_from_dict
    p = os.path.join(where, "tokenizer.json")
    if not os.path.isfile(p):
        return None
    try:
        with open(p, encoding="utf-8") as f:
            d = {"type": "bpe", "vocab_size": n, "json": f.read()}
        tokenizer_from_dict(d)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InteropError(f"{p}: not the tokenizer of these weights ({' '.join(str(e).split())})") from None
    return d


def _load(spec: str, cfg: Config, block_size: int | None):
    """load_init's (named, overrides), the Run read for a run spec (None for hf / llmc) and the tokenizer
    (a to_dict()) that comes with the weights where it is not GPT-2's (None: GPT-2's, or none)."""
    kind, where = _parse_spec(spec)
    run = None
    if kind == "hf":
        conf, tensors = read_hf(where)
        named, s = from_hf(conf, tensors, where)
        L, H, C, T, n = s["n_layer"], s["n_head"], s["n_embd"], s["block_size"], s["n_vocab"]
        tok_dict = None if n == GPT2_VOCAB else _hf_tokenizer(where, n)
        tok = "gpt2" if n == GPT2_VOCAB else None if tok_dict is None else f"bpe:{n}"
    elif kind == "llmc":
        hdr, tensors = read_llmc(where)
        named = from_llmc(hdr, tensors)
        L, H, C, T, n = hdr["L"], hdr["H"], hdr["C"], hdr["maxT"], hdr["V"]
        tok = "gpt2" if n == GPT2_VOCAB else None
        tok_dict = None
    else:
        run = run_of(kind, where)
        named = run.named
        rc = run.cfg
        L, H, C, T, n = rc.n_layer, rc.n_head, rc.n_embd, rc.block_size, run.n_vocab
        tok, tok_dict = rc.tokenizer, run.tokenizer
        if not rc.bias:
            raise InteropError(f"{where}: bias is false; --init_from a run needs bias true "
                               f"(a bias-free run resumes with --resume)")
    rows = named["wte"].shape[0]
    if cfg.vocab_size:
        if cfg.vocab_size < n:
            raise InteropError(f"{where}: vocab_size {cfg.vocab_size} is smaller than the weights' vocabulary {n}")
        V = cfg.vocab_size
    else:
        V = _round_up(rows, cfg.vocab_multiple)
    if block_size is not None:
        if not 1 <= block_size <= T:
            raise InteropError(f"{where}: block_size {block_size} must be in 1..{T} (the weights' positions)")
        named = dict(named, wpe=named["wpe"][:block_size])
        T = block_size
    overrides = {"n_layer": L, "n_head": H, "n_embd": C, "block_size": T, "bias": True, "vocab_size": V}
    if tok is not None:
        overrides["tokenizer"] = tok
    model = dataclasses.replace(cfg, **overrides)
    try:
        validate(model)
    except ConfigError as e:
        raise InteropError(f"{where}: the weights imply a model this trainer cannot run: {e}") from None
    wte = np.asarray(named["wte"])
    if rows != V:
        w = np.zeros((V, C), dtype=wte.dtype)
        keep = min(rows, V)
        w[:keep] = wte[:keep]
        named = dict(named, wte=w)
    expect = param_table(model, V).shapes()
    for name, shape in expect.items():
        if name not in named:
            raise InteropError(f"{where}: tensor {name} of shape {_fmt(shape)} is missing")
        if tuple(np.shape(named[name])) != tuple(shape):
            raise InteropError(f"{where}: tensor {name} has shape {_fmt(np.shape(named[name]))} but the model "
                               f"expects {_fmt(shape)}")
    extra = [k for k in named if k not in expect]
    if extra:
        raise InteropError(f"{where}: tensor {extra[0]} of shape {_fmt(np.shape(named[extra[0]]))} is not part "
                           f"of the model")
    return {k: np.ascontiguousarray(named[k]) for k in expect}, overrides, run, tok_dict


@dataclasses.dataclass
class Init:
    """What train.py's init_from brings: weights and the config they imply."""
    cfg: Config                # the config with the model settings the weights fix
    named: dict                # the parameters, our names and layouts
    tokenizer: dict | None     # the weights' own tokenizer (a run's ids, a bpe:N export's); None: cfg.tokenizer
    changes: list              # "key config -> weights" for each setting the weights changed


def init_for_training(cfg: Config) -> Init:
    """The weights of cfg.init_from (hf:DIR, llmc:FILE, a run directory or .ckpt) and the config they
    imply: n_layer, n_head, n_embd, bias, vocabulary and tokenizer come from the weights; block_size
    stays the config's and crops the position embedding (at most the weights' positions). Weights whose
    vocabulary is not GPT-2's and that bring no tokenizer are refused (their ids would mean nothing). Errors
    are one-line CheckpointErrors."""
    try:
        named, over, run, tok = _load(cfg.init_from, cfg, cfg.block_size)
        if "tokenizer" not in over:
            raise InteropError(f"{cfg.init_from}: the weights' vocabulary ({named['wte'].shape[0]} rows) is not "
                               f"GPT-2's and no tokenizer comes with them (a Hugging Face directory's "
                               f"tokenizer.json, a run's tokenizer.json)")
    except InteropError as e:
        raise CheckpointError(f"init_from: {e}") from None
    except FileNotFoundError as e:
        raise CheckpointError(f"init_from {cfg.init_from}: {e}") from None
    changes = [f"{k} {getattr(cfg, k)!r} -> {v!r}" for k, v in over.items()
               if k != "vocab_size" and getattr(cfg, k) != v]
    return Init(dataclasses.replace(cfg, **over), named, tok, changes)
