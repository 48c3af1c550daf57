"""Run configuration: defaults, a YAML file, then command-line overrides.

    cfg = load_config("configs/tiny.yaml", ["--max_iters=50", "learning_rate=1e-3"])

Precedence is defaults < YAML file < overrides. Every problem is reported as a
`ConfigError` whose message is a single line naming the offending key, so a typo
in a 5000-iteration recipe fails before anything touches the GPU.

YAML values are read with a restricted resolver (YAML 1.2 flavoured): only
true/false are booleans (not yes/no/on/off), and 1e-3 is a float (PyYAML's
default 1.1 rules would read it as a string). Nothing is ever exec'd or eval'd.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Iterable

import yaml

from gptcuda.files import atomic_open

__all__ = [
    "Config", "ConfigError", "load_config", "apply_overrides", "save_config",
    "format_config", "validate", "validate_against_data", "accum_steps", "model_vocab", "recompute_layers",
    "PRECISIONS", "ATTENTIONS", "BACKENDS", "config_keys", "MODEL_KEYS", "compare_for_resume",
]

PRECISIONS = ("fp32", "tf32", "bf16")
GRAD_DTYPES = ("fp32", "bf16")
ATTENTIONS = ("unfused", "fused")
FP32_GEMMS = ("3xtf32", "ffma")
GEMM_TUNES = ("auto", "table", "off")
BACKENDS = ("cuda", "reference")


class ConfigError(ValueError):
    """A configuration problem; str(err) is one line naming the key (err.key)."""

    def __init__(self, message: str, key: str | None = None):
        message = " ".join(str(message).split("\n"))
        super().__init__(message)
        self.key = key


@dataclass
class Config:
    # model
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    block_size: int = 256
    dropout: float = 0.2
    bias: bool = True
    vocab_size: int = 0  # the model's vocabulary; 0: the tokenizer's, rounded up to vocab_multiple
    vocab_multiple: int = 1  # round the tokenizer's vocabulary up to this (GPT-2: 128, 50257 -> 50304)
    # execution
    precision: str = "fp32"  # fp32 | tf32 | bf16 (sm_90: bf16 activations and products, fp32 master weights)
    fp32_gemm: str = "3xtf32"  # fp32's GEMMs: 3xtf32 (three TF32 tensor-core products, sm_90) | ffma (SIMT)
    attention: str = "unfused"  # unfused | fused
    gemm_tune: str = "auto"  # GEMM plans: auto (measure what the GPU's table lacks, at setup) | table | off
    backend: str = "cuda"  # cuda | reference
    graph: bool = True  # capture the training step in a CUDA graph
    grad_dtype: str = "fp32"  # the parameters' gradients: fp32 | bf16 (precision bf16 only, others keep fp32: written rounded once to bf16, half the bytes; micro-batches still add up in fp32)
    recompute: bool | int = False  # rebuild the MLP's GELU output in the backward, not store it: true (every layer) | false | N (the first N layers)
    device: int = 0  # data parallel: each rank takes LOCAL_RANK instead
    zero: int = 0  # data parallel: 1 shards the Adam state over the ranks (ZeRO-1)
    # recipe
    batch_size: int = 64  # sequences per micro-batch and GPU
    total_batch_tokens: int = 0  # tokens per optimizer step; 0: one micro-batch (batch_size x block_size x GPUs)
    max_iters: int = 5000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 5000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 250
    eval_iters: int = 200
    log_interval: int = 10
    seed: int = 1337
    init_std: float = 0.02
    # io
    data: str = "data/tinyshakespeare/input.txt"  # a text file, a directory of token shards, or a glob of them
    val_data: str = ""  # the validation shards (a file or glob); "": from data (see gptcuda/data/dataset.py)
    tokenizer: str = "char"  # char | gpt2 | bpe:N (for a text file; token shards carry their own)
    out_dir: str = "out/shakespeare_char"
    init_from: str = ""  # start from these weights: hf:DIR, llmc:FILE or a run directory (fresh optimizer)
    checkpoint: bool = True  # save checkpoints to out_dir
    # evaluation and dashboards
    hellaswag: str = ""  # a HellaSwag .jsonl (llm.c's hellaswag_val.jsonl) scored at evaluations; "": none
    hellaswag_interval: int = 0  # steps between HellaSwag scorings, a multiple of eval_interval; 0: every evaluation
    log_tensorboard: bool = False  # also log the metrics to TensorBoard event files in out_dir/tensorboard
    wandb_log: bool = False  # also log the metrics to Weights & Biases
    wandb_project: str = "gptcuda"  # the W&B project
    wandb_run_name: str = ""  # the W&B run's name; "": the out_dir's name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


def config_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type name, default, comment) of every Config field, in declaration order; the comment is
    the one beside the field in this file ("" where there is none or the source is unavailable)."""
    import inspect
    try:
        src = inspect.getsource(Config)
    except (OSError, TypeError):  # pragma: no cover - no source (a frozen build)
        src = ""
    comments = {m.group(1): m.group(2).strip()
                for m in re.finditer(r"^\s+(\w+)\s*:[^=\n]*=[^#\n]*#(.*)$", src, re.M)}
    out = []
    for f in fields(Config):
        t = f.type if isinstance(f.type, str) else f.type.__name__
        out.append((f.name, t, f.default, comments.get(f.name, "")))
    return out


# ----------------------------------------------------------------------------
# field types

_TYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}
BOOL_OR_INT = (bool, int)   # a switch that also takes a count (recompute: true, false or a number of layers)


def _field_types() -> dict[str, type | tuple]:
    out = {}
    for f in fields(Config):
        t = f.type
        if isinstance(t, str):  # postponed annotations
            t = BOOL_OR_INT if t == "bool | int" else _TYPE_NAMES[t]
        out[f.name] = t
    return out


_FIELD_TYPES = _field_types()


def _unknown_key(key: str, where: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(_FIELD_TYPES), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}' ({where}){hint}", key)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _coerce(key: str, value: Any, where: str) -> Any:
    """Check `value` against the declared type of `key`; ints are widened to floats."""
    t = _FIELD_TYPES[key]
    if t == BOOL_OR_INT:
        if not isinstance(value, int):   # bool is an int
            raise ConfigError(f"config key '{key}' ({where}) expects true, false or an integer, "
                              f"got {_type_name(value)} {value!r}", key)
        return value
    bad = ConfigError(
        f"config key '{key}' ({where}) expects {t.__name__}, got {_type_name(value)} {value!r}", key)
    if t is bool:
        if not isinstance(value, bool):
            raise ConfigError(
                f"config key '{key}' ({where}) expects true or false, got {_type_name(value)} {value!r}", key)
        return value
    if t is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return int(value)
    if t is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"config key '{key}' ({where}) must be a finite number, got {value!r}", key)
        return value
    if t is str:
        if not isinstance(value, str):
            raise ConfigError(
                f"config key '{key}' ({where}) expects a string, got {_type_name(value)} {value!r}"
                " (quote it)", key)
        return value
    raise AssertionError(f"unsupported field type {t!r} for {key}")


# ----------------------------------------------------------------------------
# YAML with strict scalars

class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML-1.2-like scalars and duplicate-key detection."""


_BOOL_TAG = "tag:yaml.org,2002:bool"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
# floats PyYAML 1.1 misses: 1e-3, 1E5, 2.5e3 (exponent without a sign), .5e-2
_Loader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))




class _Dumper(yaml.SafeDumper):
    """Quotes any string that either PyYAML's rules or _Loader's would read as a non-string."""


_Dumper.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    for key_node, value_node in node.value:
        k = loader.construct_object(key_node, deep=True)
        if k in out:
            line = key_node.start_mark.line + 1
            raise ConfigError(f"duplicate config key '{k}' (line {line})", str(k))
        out[k] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"cannot parse {where}{pos}: {' '.join(str(problem).split())}") from None


# ----------------------------------------------------------------------------
# loading

def _apply(cfg: Config, key: Any, value: Any, where: str) -> None:
    if not isinstance(key, str):
        raise ConfigError(f"config keys must be strings, got {key!r} ({where})", str(key))
    if key not in _FIELD_TYPES:
        raise _unknown_key(key, where)
    setattr(cfg, key, _coerce(key, value, where))


def apply_overrides(cfg: Config, overrides: Iterable[str]) -> Config:
    """Apply `--key=value` / `key=value` strings to cfg in place (no validation)."""
    for item in overrides:
        raw = item
        s = item[2:] if item.startswith("--") else item
        if "=" not in s:
            raise ConfigError(f"override {raw!r} has no value (--key=value or --key value)", s.lstrip("-") or raw)
        key, text = s.split("=", 1)
        key = key.strip().replace("-", "_")
        if not key:
            raise ConfigError(f"override {raw!r} has an empty key", "")
        if key not in _FIELD_TYPES:
            raise _unknown_key(key, f"override {raw!r}")
        where = f"override {raw!r}"
        if text.strip():
            value = _yaml_load(text, where)
        else:                                  # --key= : the empty string for a string key
            value = "" if _FIELD_TYPES[key] is str else None
        _apply(cfg, key, value, where)
    return cfg


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Config:
    """Defaults, then the YAML file at `path` (if any), then overrides; validated."""
    cfg = Config()
    if path is not None:
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {' '.join(str(e).split())}") from None
        doc = _yaml_load(text, path)
        if doc is None:
            doc = {}
        if not isinstance(doc, dict):
            raise ConfigError(f"config file {path} must be a mapping of key: value, got {_type_name(doc)}")
        for k, v in doc.items():
            _apply(cfg, k, v, path)
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def config_of(check: bool = True, **settings) -> Config:
    """The defaults with these settings (keyword arguments, typed as the keys are), validated: a
    config made in code (tests, benchmarks) that is a real Config. check False: each value typed but
    the combination not checked (an op's test at widths no model has, e.g. a head size of 37)."""
    cfg = Config()
    for k, v in settings.items():
        _apply(cfg, k, v, "config_of")
    return validate(cfg) if check else cfg


# ----------------------------------------------------------------------------
# validation

def validate(cfg: Config) -> Config:
    """Raise ConfigError on the first invalid value or impossible combination."""
    for k, t in _FIELD_TYPES.items():  # catch direct attribute assignment of a wrong type
        setattr(cfg, k, _coerce(k, getattr(cfg, k), "value"))

    def err(key: str, msg: str) -> ConfigError:
        return ConfigError(f"config key '{key}' {msg}", key)

    for k in ("n_layer", "n_head", "n_embd", "block_size", "batch_size"):
        if getattr(cfg, k) < 1:
            raise err(k, f"must be a positive integer, got {getattr(cfg, k)}")
    for k in ("eval_iters", "eval_interval", "log_interval"):
        if getattr(cfg, k) < 1:
            raise err(k, f"must be >= 1, got {getattr(cfg, k)}")
    for k in ("max_iters", "warmup_iters", "lr_decay_iters", "vocab_size", "device"):
        if getattr(cfg, k) < 0:
            raise err(k, f"must be >= 0, got {getattr(cfg, k)}")
    if not 0 <= cfg.seed < 2**32:
        raise err("seed", f"must be in [0, 2**32), got {cfg.seed}")
    if cfg.n_embd % cfg.n_head != 0:
        raise err("n_embd", f"({cfg.n_embd}) must be divisible by n_head ({cfg.n_head})")
    if cfg.head_size % 4 != 0:
        raise err("n_embd", f"/ n_head = head size {cfg.head_size} must be a multiple of 4 "
                            f"(n_embd={cfg.n_embd}, n_head={cfg.n_head})")
    if not 0.0 <= cfg.dropout < 1.0:
        raise err("dropout", f"must be in [0, 1), got {cfg.dropout}")
    if cfg.precision not in PRECISIONS:
        raise err("precision", f"must be one of {'|'.join(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.precision == "bf16" and cfg.backend != "reference":
        if cfg.attention == "unfused":
            raise err("attention", "precision bf16 runs fused attention only: --attention=fused")
        if cfg.n_embd % 8:
            raise err("n_embd", f"({cfg.n_embd}) must be a multiple of 8 for precision bf16 (16-byte bf16 rows)")
        if (cfg.vocab_size or cfg.vocab_multiple) % 8:
            raise err("vocab_multiple", "precision bf16 needs a vocabulary that is a multiple of 8 (16-byte bf16 "
                                        "rows of the logits): --vocab_multiple=8 (or 128)")
    if cfg.grad_dtype not in GRAD_DTYPES:
        raise err("grad_dtype", f"must be one of {'|'.join(GRAD_DTYPES)}, got {cfg.grad_dtype!r}")
    if cfg.fp32_gemm not in FP32_GEMMS:
        raise err("fp32_gemm", f"must be one of {'|'.join(FP32_GEMMS)}, got {cfg.fp32_gemm!r}")
    if cfg.attention not in ATTENTIONS:
        raise err("attention", f"must be one of {'|'.join(ATTENTIONS)}, got {cfg.attention!r}")
    if cfg.gemm_tune not in GEMM_TUNES:
        raise err("gemm_tune", f"must be one of {'|'.join(GEMM_TUNES)}, got {cfg.gemm_tune!r}")
    if cfg.backend not in BACKENDS:
        raise err("backend", f"must be one of {'|'.join(BACKENDS)}, got {cfg.backend!r}")
    if not isinstance(cfg.recompute, bool) and not 0 <= cfg.recompute <= cfg.n_layer:
        raise err("recompute", f"must be true, false or a number of layers in [0, n_layer = {cfg.n_layer}], "
                               f"got {cfg.recompute}")
    if cfg.zero not in (0, 1):
        raise err("zero", f"must be 0 (every rank keeps the whole Adam state) or 1 (ZeRO-1: sharded), got {cfg.zero}")
    if cfg.min_lr < 0:
        raise err("min_lr", f"must be >= 0, got {cfg.min_lr}")
    if cfg.learning_rate < cfg.min_lr:
        raise err("learning_rate", f"({cfg.learning_rate}) must be >= min_lr ({cfg.min_lr})")
    if cfg.warmup_iters > cfg.lr_decay_iters:
        raise err("warmup_iters", f"({cfg.warmup_iters}) must be <= lr_decay_iters ({cfg.lr_decay_iters})")
    for k in ("beta1", "beta2"):
        if not 0.0 <= getattr(cfg, k) < 1.0:
            raise err(k, f"must be in [0, 1), got {getattr(cfg, k)}")
    if not cfg.eps > 0:
        raise err("eps", f"must be > 0, got {cfg.eps}")
    if cfg.weight_decay < 0:
        raise err("weight_decay", f"must be >= 0, got {cfg.weight_decay}")
    if cfg.grad_clip < 0:
        raise err("grad_clip", f"must be >= 0 (0 disables clipping), got {cfg.grad_clip}")
    if not cfg.init_std > 0:
        raise err("init_std", f"must be > 0, got {cfg.init_std}")
    if not cfg.data:
        raise err("data", "must name a text file, a directory of token shards or a glob of them")
    if not re.fullmatch(r"char|gpt2|bpe:[1-9][0-9]*", cfg.tokenizer):
        raise err("tokenizer", f"must be char, gpt2 or bpe:N (N a vocabulary size), got {cfg.tokenizer!r}")
    if cfg.vocab_multiple < 1:
        raise err("vocab_multiple", f"must be >= 1, got {cfg.vocab_multiple}")
    if cfg.total_batch_tokens < 0:
        raise err("total_batch_tokens", f"must be >= 0 (0: one micro-batch a step), got {cfg.total_batch_tokens}")
    if not cfg.out_dir:
        raise err("out_dir", "must name a directory")
    if cfg.hellaswag_interval < 0 or cfg.hellaswag_interval % cfg.eval_interval:
        raise err("hellaswag_interval", f"must be 0 or a positive multiple of eval_interval ({cfg.eval_interval}), "
                                        f"got {cfg.hellaswag_interval}")
    if cfg.wandb_log and not cfg.wandb_project:
        raise err("wandb_project", "must name a W&B project when wandb_log is true")
    return cfg


def accum_steps(cfg: Config, world: int = 1) -> int:
    """Micro-batches per optimizer step: total_batch_tokens / (batch_size x block_size x GPUs)."""
    micro = cfg.batch_size * cfg.block_size * world
    if not cfg.total_batch_tokens:
        return 1
    if cfg.total_batch_tokens % micro:
        gpus = f" x {world} GPUs" if world > 1 else ""
        raise ConfigError(
            f"config key 'total_batch_tokens' ({cfg.total_batch_tokens}) must be a multiple of batch_size x "
            f"block_size{gpus} = {micro}", "total_batch_tokens")
    return cfg.total_batch_tokens // micro


def recompute_layers(cfg: Config) -> int:
    """How many layers rebuild their GELU output in the backward instead of storing it: the first
    this many (recompute true: every layer, false: none, an integer: that many)."""
    if isinstance(cfg.recompute, bool):
        return cfg.n_layer if cfg.recompute else 0
    return cfg.recompute


def model_vocab(cfg: Config, tokenizer_vocab: int) -> int:
    """The model's vocabulary: vocab_size when set, else the tokenizer's rounded up to vocab_multiple.
    Rows past the tokenizer's are padding: masked out of the loss and of sampling."""
    if cfg.vocab_size:
        return cfg.vocab_size
    m = cfg.vocab_multiple
    return (tokenizer_vocab + m - 1) // m * m


# what a checkpoint's weights mean: a resumed run must have the same (the tokenizer, and the model's
# vocabulary as resolved from it, included); every other key may change on --resume, and is logged
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "tokenizer")
# where this run happens, not what it is: neither compared nor logged
_PLACE_KEYS = ("out_dir", "device")


def compare_for_resume(saved: dict, cfg: Config, vocab: int) -> tuple[list[str], list[str]]:
    """(model differences, other changes) between a checkpoint's config (saved: a to_dict(), with the
    resolved vocab_size) and cfg, whose model vocabulary resolves to `vocab`; each a "key old -> new"."""
    now = cfg.to_dict()
    now["vocab_size"] = vocab
    model, other = [], []
    for key in now:
        if key in _PLACE_KEYS or key == "vocab_multiple" or key not in saved:
            continue
        old, new = saved[key], now[key]
        same_kind = isinstance(old, bool) == isinstance(new, bool)      # recompute: true is not 1
        if same_kind and (old == new or (isinstance(old, (int, float)) and isinstance(new, (int, float))
                                         and float(old) == float(new))):
            continue
        text = f"{key} {old!r} -> {new!r}" if isinstance(new, str) else f"{key} {old} -> {new}"
        if key == "vocab_size" and cfg.vocab_size == 0:
            text += f" (vocab_multiple {cfg.vocab_multiple})"
        (model if key in MODEL_KEYS else other).append(text)
    return model, other


def validate_against_data(cfg: Config, n_train_tokens: int, n_val_tokens: int, vocab_size: int) -> None:
    """Checks that need the data: each split holds a block_size+1 window; vocab fits."""
    for split, n in (("train", n_train_tokens), ("val", n_val_tokens)):
        if cfg.block_size + 1 > n:
            raise ConfigError(
                f"config key 'block_size' ({cfg.block_size}) needs block_size+1 = {cfg.block_size + 1} "
                f"tokens but the {split} split of {cfg.data} has only {n}", "block_size")
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ConfigError(
            f"config key 'vocab_size' ({cfg.vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({vocab_size}); use 0 to take it from the data", "vocab_size")


# ----------------------------------------------------------------------------
# output

def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write cfg as YAML, atomically (temporary file in the same directory + os.replace)."""
    text = yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True)
    with atomic_open(os.fspath(path)) as f:
        f.write(text)


def format_config(cfg: Config) -> str:
    """Aligned `key: value` lines, in declaration order, for logs."""
    d = cfg.to_dict()
    w = max(len(k) for k in d) + 1
    return "\n".join(f"{k + ':':<{w}} {v}" for k, v in d.items())
