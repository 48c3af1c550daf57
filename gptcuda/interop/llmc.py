"""llm.c model files (train_gpt2.cu's gpt2_write_to_checkpoint): `write_llmc` (fp32 or bf16, atomically),
`read_llmc` (fp32 or bf16) and `from_llmc` (its tensors in our names)."""
from __future__ import annotations

import os

import numpy as np

from gptcuda.files import atomic_open
from gptcuda.config import Config
from gptcuda.interop.common import InteropError, _round_up
from gptcuda.runtime import bf16

LLMC_MAGIC = 20240326
LLMC_FP32 = 3            # all tensors fp32, padded vocabulary
LLMC_BF16 = 5            # all tensors bf16 (rounded to nearest even when written)
LLMC_HEADER_INTS = 256
LLMC_VP_MULTIPLE = 128   # llm.c pads its vocabulary to a multiple of 128 (train_gpt2.py pad_vocab)

# llm.c's parameter tensors in file order (train_gpt2.cu fill_in_parameter_sizes): its name and ours (with {l}
# for a per-layer tensor, stacked over l); _llmc_shapes gives their shapes
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


def write_llmc(path: str, named: dict, cfg: Config, n_vocab: int, overwrite: bool = False,
               dtype: str = "f32") -> np.ndarray:
    """llm.c's model file at path (atomically): fp32 (version 3) or, dtype "bf16", every tensor rounded to
    bf16 (version 5, llm.c's BF16 build's); Vp = our vocabulary rounded up to 128. Returns the header."""
    if dtype not in ("f32", "bf16"):
        raise InteropError(f"--dtype must be f32 or bf16, got {dtype!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise InteropError(f"{path} is a directory; --to llmc writes one file")
    if os.path.exists(path) and not overwrite:
        raise InteropError(f"{path} exists (pass --overwrite to replace it)")
    V = np.asarray(named["wte"]).shape[0]
    Vp = _round_up(V, LLMC_VP_MULTIPLE)
    header = llmc_header(cfg, n_vocab, Vp, LLMC_BF16 if dtype == "bf16" else LLMC_FP32)
    with atomic_open(path, "wb", sync_dir=True) as f:
        f.write(header.tobytes())
        for _, a in llmc_tensors(named, cfg.n_layer, Vp):
            f.write((bf16.bits(a).astype("<u2") if dtype == "bf16" else a).tobytes())
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
        flat = bf16.values(flat)
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
