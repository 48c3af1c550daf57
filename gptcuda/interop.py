"""Checkpoints others can read and write: Hugging Face GPT-2 directories and llm.c model files.

Export (export.py) turns a run directory's checkpoint into

    hf    a directory GPT2LMHeadModel.from_pretrained() loads: config.json, model.safetensors (fp32, HF's
          names; Conv1D weights stored [in, out], so ours [out, in] are transposed; the head tied to wte
          and not stored, as save_pretrained does) and, for a gpt2 / bpe:N run, the tokenizer files
    llmc  llm.c's model file (train_gpt2.cu's gpt2_write_to_checkpoint): 256 int32 header [20240326,
          3 (fp32), maxT, V, L, H, C, Vp], then the 16 tensors of fill_in_parameter_sizes in that order,
          each stacked over the layers, Linear weights [out, in] like ours

Import (train.py / sample.py --init_from=...):

    named, overrides = load_init("hf:DIR" | "llmc:FILE" | RUN_DIR, cfg)

gives the parameters in our names and layouts (gptcuda/params.py) and the model settings the weights imply
(n_layer, n_head, n_embd, block_size, bias, vocab_size and, where the vocabulary is GPT-2's 50257, tokenizer
"gpt2"). The model's vocabulary is cfg.vocab_size when set, else the rows the source stores (hf: the
tokenizer's; llmc: Vp; a run: its padded vocabulary) rounded up to cfg.vocab_multiple. Rows past the
source's are zero (padding: masked out of the loss and of sampling, and no gradient ever reaches them).

Every problem is an `InteropError` (a ValueError) whose message is one line naming the tensor or setting
and both values. Nothing here imports torch or transformers: safetensors' numpy API reads and writes.

Numerics match on both sides: layernorm eps 1e-5 (kernels/layernorm.cu, llm.c's layernorm.cuh, GPT-2's
layer_norm_epsilon), GELU tanh approximation (HF "gelu_new"), attention scaled by 1/sqrt(head size).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np

from .checkpoint import CheckpointError, atomic_open, load_checkpoint
from .config import Config, ConfigError, validate
from .params import param_table, unflatten

__all__ = ["InteropError", "load_init", "export_run", "load_run", "Run",
           "hf_tensors", "hf_config", "write_hf", "read_hf", "from_hf",
           "llmc_header", "llmc_tensors", "write_llmc", "read_llmc", "from_llmc",
           "LLMC_MAGIC", "LLMC_FP32", "LLMC_BF16", "LLMC_ORDER", "LN_EPS", "GPT2_EOT", "check_expressible"]

LN_EPS = 1e-5            # kernels/layernorm.cu LN_EPS, reference/ops.py layernorm_forward
GPT2_VOCAB = 50257
GPT2_EOT = 50256
ENDOFTEXT = "<|endoftext|>"
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")   # the tanh approximation, as ours
LLMC_MAGIC = 20240326
LLMC_FP32 = 3            # all tensors fp32, padded vocabulary
LLMC_BF16 = 5            # all tensors bf16 (read only)
LLMC_HEADER_INTS = 256
LLMC_VP_MULTIPLE = 128   # llm.c pads its vocabulary to a multiple of 128 (train_gpt2.py pad_vocab)

# llm.c's parameter tensors in file order (train_gpt2.cu fill_in_parameter_sizes): its name, ours (with {l}
# for a per-layer tensor, stacked over l), and the per-layer shape in terms of C (Vp / maxT for the embeddings)
LLMC_ORDER = [
    ("wte", "wte"), ("wpe", "wpe"),
    ("ln1w", "h{l}.ln1.w"), ("ln1b", "h{l}.ln1.b"),
    ("qkvw", "h{l}.attn.w"), ("qkvb", "h{l}.attn.b"),
    ("attprojw", "h{l}.proj.w"), ("attprojb", "h{l}.proj.b"),
    ("ln2w", "h{l}.ln2.w"), ("ln2b", "h{l}.ln2.b"),
    ("fcw", "h{l}.fc.w"), ("fcb", "h{l}.fc.b"),
    ("fcprojw", "h{l}.fcproj.w"), ("fcprojb", "h{l}.fcproj.b"),
    ("lnfw", "lnf.w"), ("lnfb", "lnf.b"),
]


class InteropError(ValueError):
    """A model or file that cannot be converted; str(err) is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def _fmt(shape) -> str:
    shape = tuple(int(s) for s in shape)
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _round_up(n: int, m: int) -> int:
    m = max(int(m), 1)
    return (int(n) + m - 1) // m * m


# ---------------------------------------------------------------------------------------------------------
# the name maps

def _hf_layer_map(l: int):
    """(HF name, our name, transposed) of layer l; HF's Conv1D stores [in, out], our Linear [out, in]."""
    h, o = f"transformer.h.{l}.", f"h{l}."
    return [
        (h + "ln_1.weight", o + "ln1.w", False), (h + "ln_1.bias", o + "ln1.b", False),
        (h + "attn.c_attn.weight", o + "attn.w", True), (h + "attn.c_attn.bias", o + "attn.b", False),
        (h + "attn.c_proj.weight", o + "proj.w", True), (h + "attn.c_proj.bias", o + "proj.b", False),
        (h + "ln_2.weight", o + "ln2.w", False), (h + "ln_2.bias", o + "ln2.b", False),
        (h + "mlp.c_fc.weight", o + "fc.w", True), (h + "mlp.c_fc.bias", o + "fc.b", False),
        (h + "mlp.c_proj.weight", o + "fcproj.w", True), (h + "mlp.c_proj.bias", o + "fcproj.b", False),
    ]


def hf_name_map(n_layer: int):
    """[(HF name, our name, transposed)] in GPT2LMHeadModel's state_dict order, lm_head.weight (tied) left out."""
    out = [("transformer.wte.weight", "wte", False), ("transformer.wpe.weight", "wpe", False)]
    for l in range(n_layer):
        out += _hf_layer_map(l)
    out += [("transformer.ln_f.weight", "lnf.w", False), ("transformer.ln_f.bias", "lnf.b", False)]
    return out


def _model_shapes(C: int, L: int, T: int, V: int) -> dict:
    """Our parameter shapes of a biased model (params.py's table, without building a Config)."""
    cfg = Config(n_layer=L, n_head=1, n_embd=C, block_size=T, bias=True)
    return param_table(cfg, V).shapes()


# ---------------------------------------------------------------------------------------------------------
# a run directory

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


def _tokenizer_vocab(d: dict) -> int:
    kind = d.get("type", "char" if "chars" in d else None)
    if kind == "gpt2":
        return GPT2_VOCAB
    if kind == "char" and isinstance(d.get("chars"), list):
        return len(d["chars"])
    if kind == "bpe" and isinstance(d.get("vocab_size"), int):
        return d["vocab_size"]
    raise InteropError(f"unknown tokenizer description {str(d)[:80]!r}")


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
        from .config import load_config
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


# ---------------------------------------------------------------------------------------------------------
# what each format can say

def check_expressible(cfg: Config, tokenizer: dict, target: str) -> None:
    """Raise InteropError (one line) when the run cannot be written as `target` ("hf" | "llmc")."""
    what = {"hf": "a Hugging Face GPT-2", "llmc": "an llm.c model file"}[target]
    if not cfg.bias:
        raise InteropError(f"bias is false but {what} has biases in every linear and layernorm "
                           f"(GPT-2's architecture); train with bias=true to export")
    kind = tokenizer.get("type", "char" if "chars" in tokenizer else None)
    if target == "hf" and kind == "char":
        raise InteropError("tokenizer is char but a Hugging Face GPT-2 directory needs a GPT-2 style BPE "
                           "tokenizer (gpt2 or bpe:N); export --to llmc instead, or train with tokenizer=gpt2")
    int32 = 2 ** 31 - 1
    if target == "llmc":
        for k in ("block_size", "n_embd", "n_layer", "n_head", "vocab_size"):
            if getattr(cfg, k) > int32:
                raise InteropError(f"{k} {getattr(cfg, k)} does not fit llm.c's int32 header")


# ---------------------------------------------------------------------------------------------------------
# Hugging Face

def hf_tensors(named: dict, n_layer: int, n_vocab: int) -> dict:
    """HF GPT2LMHeadModel tensors (fp32, C-contiguous) from ours: wte unpadded to the tokenizer's vocabulary,
    Linear weights transposed to Conv1D's [in, out]; lm_head.weight left out (tied to wte)."""
    out = {}
    for hf, ours, tr in hf_name_map(n_layer):
        a = np.asarray(named[ours])
        if ours == "wte":
            a = a[:n_vocab]
        if tr:
            a = a.T
        out[hf] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def hf_config(cfg: Config, n_vocab: int, eot_id: int | None) -> dict:
    """config.json of a GPT2LMHeadModel equal to our model (the GPT2Config fields, defaults spelled out)."""
    d = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(n_vocab),
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": LN_EPS,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "use_cache": True,
        "tie_word_embeddings": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "summary_activation": None,
        "summary_proj_to_labels": True,
        "summary_first_dropout": 0.1,
        "torch_dtype": "float32",
    }
    if eot_id is not None:
        d["bos_token_id"] = d["eos_token_id"] = int(eot_id)
    return d


def _tokenizer_files(tokenizer: dict, block_size: int) -> dict:
    """name -> bytes of the HF tokenizer files for a gpt2 or bpe:N tokenizer."""
    kind = tokenizer.get("type")
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    files = {"special_tokens_map.json": special}
    if kind == "gpt2":
        from .tokenizers import _gpt2_files
        paths = _gpt2_files()           # sha256-checked
        with open(paths["encoder.json"], "rb") as f:
            files["vocab.json"] = f.read()
        with open(paths["vocab.bpe"], "rb") as f:
            files["merges.txt"] = f.read()
        files["tokenizer_config.json"] = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size,
                                          "add_prefix_space": False, "add_bos_token": False, "errors": "replace",
                                          **special}
    elif kind == "bpe":
        # the HF `tokenizers` JSON the run trained; PreTrainedTokenizerFast loads it as is
        files["tokenizer.json"] = tokenizer["json"].encode("utf-8")
        files["tokenizer_config.json"] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                          "model_max_length": block_size, **special}
    else:
        raise InteropError(f"tokenizer {kind} has no Hugging Face form")
    return {k: v if isinstance(v, bytes) else (json.dumps(v, indent=2) + "\n").encode() for k, v in files.items()}


def _write_dir_atomic(dest: str, files: dict, overwrite: bool) -> None:
    """Write {name: bytes | callable(path)} into a temp directory beside dest, then rename it to dest."""
    dest = os.path.abspath(dest)
    if os.path.exists(dest):
        if not os.path.isdir(dest):
            raise InteropError(f"{dest} exists and is not a directory")
        if os.listdir(dest) and not overwrite:
            raise InteropError(f"{dest} exists and is not empty (pass --overwrite to replace it)")
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(dest) + ".", suffix=".tmp")
    old = None
    try:
        for name, data in files.items():
            p = os.path.join(tmp, name)
            if callable(data):
                data(p)
            else:
                with open(p, "wb") as f:
                    f.write(data)
            os.chmod(p, 0o644)
            with open(p, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        if os.path.isdir(dest):
            old = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(dest) + ".", suffix=".old")
            os.rename(dest, os.path.join(old, "x"))
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.exists(dest) and os.path.isdir(os.path.join(old, "x")):
            os.rename(os.path.join(old, "x"), dest)          # put the previous one back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_hf(dest: str, named: dict, cfg: Config, tokenizer: dict, overwrite: bool = False) -> dict:
    """A Hugging Face GPT-2 directory at dest (atomically); returns its config.json dict."""
    check_expressible(cfg, tokenizer, "hf")
    from safetensors.numpy import save_file
    n_vocab = _tokenizer_vocab(tokenizer)
    eot = GPT2_EOT if tokenizer.get("type") == "gpt2" else (n_vocab - 1 if tokenizer.get("type") == "bpe" else None)
    conf = hf_config(cfg, n_vocab, eot)
    tensors = hf_tensors(named, cfg.n_layer, n_vocab)
    files = {"config.json": (json.dumps(conf, indent=2) + "\n").encode(),
             # transformers refuses a safetensors file whose metadata lacks format "pt"
             "model.safetensors": lambda p: save_file(tensors, p, metadata={"format": "pt"})}
    files.update(_tokenizer_files(tokenizer, cfg.block_size))
    _write_dir_atomic(dest, files, overwrite)
    return conf


def _load_safetensors(path: str) -> dict:
    """name -> numpy array; BF16 (which numpy lacks) is widened to float32 exactly."""
    from safetensors.numpy import load_file
    try:
        return load_file(path)
    except Exception as e:            # noqa: BLE001 - a bf16 tensor, or a damaged file
        first = e
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            data = f.read()
    except (OSError, ValueError):
        raise InteropError(f"{path} is not a safetensors file: {first}") from None
    dtypes = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BF16": "<u2"}
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if e.get("dtype") not in dtypes:
            raise InteropError(f"{path} tensor {name} has dtype {e.get('dtype')}, not a float type")
        a, b = e["data_offsets"]
        x = np.frombuffer(data[a:b], dtype=dtypes[e["dtype"]]).reshape(e["shape"])
        if e["dtype"] == "BF16":
            x = (x.astype(np.uint32) << 16).view(np.float32)
        out[name] = x
    return out


def read_hf(src: str) -> tuple[dict, dict]:
    """(config.json dict, tensors) of a Hugging Face model directory (model.safetensors, or the shards of
    model.safetensors.index.json)."""
    src = os.fspath(src)
    cp = os.path.join(src, "config.json")
    try:
        with open(cp, encoding="utf-8") as f:
            conf = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json in {src} (not a Hugging Face model directory)") from None
    except ValueError as e:
        raise InteropError(f"{cp} is not JSON: {e}") from None
    single, index = os.path.join(src, "model.safetensors"), os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(single):
        tensors = _load_safetensors(single)
    elif os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for s in shards:
            tensors.update(_load_safetensors(os.path.join(src, s)))
    elif any(os.path.exists(os.path.join(src, n)) for n in ("pytorch_model.bin", "tf_model.h5", "flax_model.msgpack")):
        raise InteropError(f"{src} has no model.safetensors, only pickled weights (reading them needs torch); "
                           f"re-save with save_pretrained(safe_serialization=True)")
    else:
        raise FileNotFoundError(f"no model.safetensors in {src}")
    return conf, tensors


def _hf_settings(conf: dict, where: str) -> dict:
    """The model settings of a GPT2Config dict; InteropError on anything our model cannot run."""
    def get(k, default=None):
        return conf.get(k, default)

    def refuse(msg):
        raise InteropError(f"{where}: {msg}")

    if get("model_type") != "gpt2":
        refuse(f"model_type is {get('model_type')!r}, only 'gpt2' is read")
    for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        v = get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            refuse(f"{k} must be a positive integer, got {v!r}")
    C = conf["n_embd"]
    act = get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        refuse(f"activation_function is {act!r}; this model computes the tanh GELU ({' or '.join(HF_ACTIVATIONS)})")
    if get("n_inner") not in (None, 4 * C):
        refuse(f"n_inner is {get('n_inner')} but this model's MLP is 4 x n_embd = {4 * C}")
    eps = get("layer_norm_epsilon", LN_EPS)
    if not isinstance(eps, (int, float)) or abs(eps - LN_EPS) > 1e-12:
        refuse(f"layer_norm_epsilon is {eps!r} but this model's layernorm uses {LN_EPS}")
    if get("scale_attn_weights", True) is not True:
        refuse("scale_attn_weights is false but this model scales attention by 1/sqrt(head size)")
    if get("scale_attn_by_inverse_layer_idx", False):
        refuse("scale_attn_by_inverse_layer_idx is true; this model does not scale attention by layer")
    if get("add_cross_attention", False):
        refuse("add_cross_attention is true; this model has no cross-attention")
    if C % conf["n_head"]:
        refuse(f"n_embd {C} is not divisible by n_head {conf['n_head']}")
    return {"n_layer": conf["n_layer"], "n_head": conf["n_head"], "n_embd": C,
            "block_size": conf["n_positions"], "n_vocab": conf["vocab_size"],
            "tied": get("tie_word_embeddings", True) is not False}


def from_hf(conf: dict, tensors: dict, where: str) -> tuple[dict, dict]:
    """(our named tensors as stored, with wte at the config's vocab_size rows; the settings) from an HF GPT-2.
    Accepts GPT2LMHeadModel's names and GPT2Model's (no "transformer." prefix); ignores the causal-mask
    buffers older versions saved (attn.bias, attn.masked_bias)."""
    s = _hf_settings(conf, where)
    L, C, T, n = s["n_layer"], s["n_embd"], s["block_size"], s["n_vocab"]
    have = {}
    for k, v in tensors.items():
        key = k if k.startswith("transformer.") or k.startswith("lm_head.") else "transformer." + k
        if key.endswith(".attn.masked_bias") or (key.endswith(".attn.bias") and np.ndim(v) == 4):
            continue
        have[key] = (k, v)
    ours = _model_shapes(C, L, T, n)
    out = {}
    for hf, name, tr in hf_name_map(L):
        want = ours[name][::-1] if tr else ours[name]
        if hf not in have:
            raise InteropError(f"{where}: tensor {hf} of shape {_fmt(want)} is missing")
        k, a = have.pop(hf)
        if tuple(a.shape) != tuple(want):
            raise InteropError(f"{where}: tensor {k} has shape {_fmt(a.shape)} but config.json implies {_fmt(want)}")
        out[name] = np.ascontiguousarray(a.T) if tr else a
    head = have.pop("lm_head.weight", None)
    if head is not None:
        k, a = head
        if tuple(a.shape) != (n, C):
            raise InteropError(f"{where}: tensor {k} has shape {_fmt(a.shape)} but the head must be {_fmt((n, C))}")
        if not np.array_equal(a, out["wte"]):
            raise InteropError(f"{where}: {k} differs from transformer.wte.weight; this model's head is tied to wte")
    elif not s["tied"]:
        raise InteropError(f"{where}: tie_word_embeddings is false and lm_head.weight is missing; this model's "
                           f"head is tied to wte")
    if have:
        k, a = next(iter(have.values()))
        raise InteropError(f"{where}: tensor {k} of shape {_fmt(a.shape)} is not part of a GPT-2 "
                           f"({len(have)} unexpected)")
    return out, s


# ---------------------------------------------------------------------------------------------------------
# llm.c

def llmc_header(cfg: Config, n_vocab: int, Vp: int, version: int = LLMC_FP32) -> np.ndarray:
    h = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    h[:8] = [LLMC_MAGIC, version, cfg.block_size, n_vocab, cfg.n_layer, cfg.n_head, cfg.n_embd, Vp]
    return h


def llmc_tensors(named: dict, n_layer: int, Vp: int) -> list:
    """[(llm.c name, fp32 array)] in file order: per-layer tensors stacked [L, ...], wte [Vp, C] (rows past
    ours zero)."""
    out = []
    for ln, ours in LLMC_ORDER:
        if "{l}" in ours:
            a = np.stack([np.asarray(named[ours.format(l=l)]) for l in range(n_layer)])
        else:
            a = np.asarray(named[ours])
        if ln == "wte":
            w = np.zeros((Vp, a.shape[1]), dtype=np.float32)
            w[:a.shape[0]] = a
            a = w
        out.append((ln, np.ascontiguousarray(a, dtype="<f4")))
    return out


def write_llmc(path: str, named: dict, cfg: Config, n_vocab: int, overwrite: bool = False) -> np.ndarray:
    """llm.c's fp32 model file at path (atomically); Vp = our vocabulary rounded up to 128. Returns the header."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InteropError(f"{path} is a directory; --to llmc writes one file")
    if os.path.exists(path) and not overwrite:
        raise InteropError(f"{path} exists (pass --overwrite to replace it)")
    V = np.asarray(named["wte"]).shape[0]
    Vp = _round_up(V, LLMC_VP_MULTIPLE)
    header = llmc_header(cfg, n_vocab, Vp)
    with atomic_open(path, "wb", sync_dir=True) as f:
        f.write(header.tobytes())
        for _, a in llmc_tensors(named, cfg.n_layer, Vp):
            f.write(a.tobytes())
    return header


def _llmc_shapes(maxT: int, L: int, C: int, Vp: int) -> list:
    per = {"wte": (Vp, C), "wpe": (maxT, C), "lnfw": (C,), "lnfb": (C,)}
    layer = {"ln1w": (C,), "ln1b": (C,), "qkvw": (3 * C, C), "qkvb": (3 * C,), "attprojw": (C, C),
             "attprojb": (C,), "ln2w": (C,), "ln2b": (C,), "fcw": (4 * C, C), "fcb": (4 * C,),
             "fcprojw": (C, 4 * C), "fcprojb": (C,)}
    return [(n, per[n] if n in per else (L, *layer[n])) for n, _ in LLMC_ORDER]


def read_llmc(path: str) -> tuple[dict, dict]:
    """(header fields, llm.c name -> float32 array) of an llm.c model file (version 3 fp32 or 5 bf16)."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(LLMC_HEADER_INTS * 4)
    except FileNotFoundError:
        raise FileNotFoundError(f"llm.c model file not found: {path}") from None
    if len(raw) < LLMC_HEADER_INTS * 4:
        raise InteropError(f"{path} is not an llm.c model file ({size} bytes, shorter than its 1024-byte header)")
    h = np.frombuffer(raw, dtype="<i4")
    if h[0] != LLMC_MAGIC:
        raise InteropError(f"{path} is not an llm.c model file (magic {int(h[0])}, expected {LLMC_MAGIC})")
    version = int(h[1])
    if version not in (LLMC_FP32, LLMC_BF16):
        raise InteropError(f"{path} has llm.c model version {version}; versions {LLMC_FP32} (fp32) and "
                           f"{LLMC_BF16} (bf16) are read")
    hdr = dict(zip(("maxT", "V", "L", "H", "C", "Vp"), (int(x) for x in h[2:8])))
    hdr["version"] = version
    for k in ("maxT", "V", "L", "H", "C", "Vp"):
        if hdr[k] < 1:
            raise InteropError(f"{path}: header {k} is {hdr[k]}")
    if hdr["V"] > hdr["Vp"]:
        raise InteropError(f"{path}: header vocab_size {hdr['V']} exceeds padded_vocab_size {hdr['Vp']}")
    shapes = _llmc_shapes(hdr["maxT"], hdr["L"], hdr["C"], hdr["Vp"])
    item = 4 if version == LLMC_FP32 else 2
    need = LLMC_HEADER_INTS * 4 + sum(int(np.prod(s)) for _, s in shapes) * item
    if size != need:
        raise InteropError(f"{path} has {size} bytes but its header (maxT {hdr['maxT']}, V {hdr['V']}, "
                           f"Vp {hdr['Vp']}, L {hdr['L']}, H {hdr['H']}, C {hdr['C']}, version {version}) "
                           f"implies {need}")
    flat = np.fromfile(path, dtype="<f4" if item == 4 else "<u2", offset=LLMC_HEADER_INTS * 4)
    if item == 2:
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    out, pos = {}, 0
    for name, s in shapes:
        n = int(np.prod(s))
        out[name] = flat[pos:pos + n].reshape(s)
        pos += n
    return hdr, out


def from_llmc(hdr: dict, tensors: dict) -> dict:
    """Our named tensors (wte with all Vp rows) from read_llmc's."""
    out = {}
    for ln, ours in LLMC_ORDER:
        a = tensors[ln]
        if "{l}" in ours:
            for l in range(hdr["L"]):
                out[ours.format(l=l)] = a[l]
        else:
            out[ours] = a
    return out


# ---------------------------------------------------------------------------------------------------------
# export

def export_run(run_dir: str, target: str, dest: str, ckpt: str | None = None, overwrite: bool = False) -> str:
    """Write a run's checkpoint as `target` ("hf" | "llmc") at dest; a one-line summary."""
    if target not in ("hf", "llmc"):
        raise InteropError(f"--to must be hf or llmc, got {target!r}")
    run = load_run(run_dir, ckpt)
    check_expressible(run.cfg, run.tokenizer, target)
    c = run.cfg
    shape = f"{c.n_layer} layers, {c.n_head} heads, n_embd {c.n_embd}, block_size {c.block_size}"
    if target == "hf":
        write_hf(dest, run.named, c, run.tokenizer, overwrite)
        kind = run.tokenizer.get("type")
        return (f"wrote {dest}: Hugging Face GPT-2 ({shape}, vocab {run.n_vocab}, tokenizer {kind}) "
                f"from {run.path} (step {run.step})")
    h = write_llmc(dest, run.named, c, run.n_vocab, overwrite)
    return (f"wrote {dest}: llm.c fp32 model ({shape}, vocab {run.n_vocab} padded to {int(h[7])}) "
            f"from {run.path} (step {run.step})")


# ---------------------------------------------------------------------------------------------------------
# import

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
    kind, where = _parse_spec(spec)
    if kind == "hf":
        conf, tensors = read_hf(where)
        named, s = from_hf(conf, tensors, where)
        L, H, C, T, n = s["n_layer"], s["n_head"], s["n_embd"], s["block_size"], s["n_vocab"]
        tok = "gpt2" if n == GPT2_VOCAB else None
    elif kind == "llmc":
        hdr, tensors = read_llmc(where)
        named = from_llmc(hdr, tensors)
        L, H, C, T, n = hdr["L"], hdr["H"], hdr["C"], hdr["maxT"], hdr["V"]
        tok = "gpt2" if n == GPT2_VOCAB else None
    else:
        if kind == "ckpt":
            run = load_run(os.path.dirname(os.path.abspath(where)), where)
        else:
            run = load_run(where)
        named = run.named
        rc = run.cfg
        L, H, C, T, n = rc.n_layer, rc.n_head, rc.n_embd, rc.block_size, run.n_vocab
        tok = rc.tokenizer
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
    return {k: np.ascontiguousarray(named[k]) for k in expect}, overrides
