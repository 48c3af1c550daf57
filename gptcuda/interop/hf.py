"""Hugging Face GPT-2 directories: our names <-> GPT2LMHeadModel's (`hf_name_map`), `write_hf` (config.json,
model.safetensors, the tokenizer files; atomically), `read_hf` and `from_hf` (a directory's tensors in our
names and layouts, every setting our model cannot run refused)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from gptcuda.errors import describe_os_error
from gptcuda.config import Config
from gptcuda.model.params import param_table
from gptcuda.interop.common import LN_EPS, GPT2_EOT, InteropError, _fmt, _tokenizer_vocab, check_expressible

ENDOFTEXT = "<|endoftext|>"
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")   # the tanh approximation, as ours


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
        from gptcuda.data.tokenizers import _gpt2_files
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
    made, p = None, parent           # the topmost directory above dest that this makes (removed on failure)
    while not os.path.lexists(p):
        made, p = p, os.path.dirname(p)
    tmp = old = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(dest) + ".", suffix=".tmp")
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
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            if not os.path.exists(dest) and os.path.isdir(os.path.join(old, "x")):
                os.rename(os.path.join(old, "x"), dest)      # put the previous one back
            shutil.rmtree(old, ignore_errors=True)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        if isinstance(e, OSError):                           # read-only, disk full: one line naming dest
            raise InteropError(describe_os_error(type(e)(e.errno, e.strerror, dest), "cannot write")) from None
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
