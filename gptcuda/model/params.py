"""The one table of parameters: names, shapes, initialisers, weight decay.

Offsets in the flat buffer, initialisation, the optimizer's decay boundary and the
checkpoint's tensor list all come from `param_table(cfg, vocab_size)`. The 2-D weights
(which take weight decay) come first and contiguously, so AdamW decays the elements
[0, n_decay) of the flat buffer and nothing else.

Linear weights are stored [out, in] (a linear is x @ W^T); the head is tied to wte.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALIGN = 4  # elements: every tensor starts on a 16-byte boundary for float4 access


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple
    init: str          # "normal" | "normal_scaled" (residual projections) | "zeros" | "ones"
    decay: bool
    comment: str
    offset: int = 0    # element offset in each flat region (params, grads, m, v)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape))


@dataclass
class ParamTable:
    specs: list
    n_decay: int       # elements [0, n_decay) take weight decay
    total: int         # padded number of elements of one region

    def __iter__(self):
        return iter(self.specs)

    def __getitem__(self, name: str) -> ParamSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def n_params(self) -> int:
        """Parameters counted once (wte serves as the head too)."""
        return sum(s.numel for s in self.specs)

    def shapes(self) -> dict:
        return {s.name: tuple(s.shape) for s in self.specs}


def _pad(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def param_table(cfg, vocab_size: int) -> ParamTable:
    C, L, T, V = cfg.n_embd, cfg.n_layer, cfg.block_size, vocab_size
    decay, other = [], []
    decay.append(("wte", (V, C), "normal", f"token embedding and tied head [V={V}, C={C}]"))
    decay.append(("wpe", (T, C), "normal", f"position embedding [T={T}, C]"))
    for l in range(L):
        decay += [
            (f"h{l}.attn.w", (3 * C, C), "normal", "qkv projection [3C, C]"),
            (f"h{l}.proj.w", (C, C), "normal_scaled", "attention output projection [C, C]"),
            (f"h{l}.fc.w", (4 * C, C), "normal", "mlp up [4C, C]"),
            (f"h{l}.fcproj.w", (C, 4 * C), "normal_scaled", "mlp down [C, 4C]"),
        ]
    for l in range(L):
        other.append((f"h{l}.ln1.w", (C,), "ones", "layernorm 1 weight [C]"))
        if cfg.bias:
            other.append((f"h{l}.ln1.b", (C,), "zeros", "layernorm 1 bias [C]"))
            other.append((f"h{l}.attn.b", (3 * C,), "zeros", "qkv bias [3C]"))
            other.append((f"h{l}.proj.b", (C,), "zeros", "attention output bias [C]"))
        other.append((f"h{l}.ln2.w", (C,), "ones", "layernorm 2 weight [C]"))
        if cfg.bias:
            other.append((f"h{l}.ln2.b", (C,), "zeros", "layernorm 2 bias [C]"))
            other.append((f"h{l}.fc.b", (4 * C,), "zeros", "mlp up bias [4C]"))
            other.append((f"h{l}.fcproj.b", (C,), "zeros", "mlp down bias [C]"))
    other.append(("lnf.w", (C,), "ones", "final layernorm weight [C]"))
    if cfg.bias:
        other.append(("lnf.b", (C,), "zeros", "final layernorm bias [C]"))

    specs, off = [], 0
    for group, is_decay in ((decay, True), (other, False)):
        for name, shape, init, comment in group:
            specs.append(ParamSpec(name, shape, init, is_decay, comment, off))
            off += _pad(int(np.prod(shape)))
        if is_decay:
            n_decay = off
    return ParamTable(specs, n_decay, _pad(off))


def init_params(table: ParamTable, cfg, seed: int) -> np.ndarray:
    """The flat float32 parameter region, initialised like nanoGPT (normal 0.02; residual
    projections scaled by 1/sqrt(2 n_layer); biases 0; layernorm weights 1). Padding is 0."""
    rng = np.random.default_rng(seed)
    flat = np.zeros(table.total, dtype=np.float32)
    std = cfg.init_std
    for s in table:
        if s.init == "normal":
            x = rng.normal(0.0, std, s.shape)
        elif s.init == "normal_scaled":
            x = rng.normal(0.0, std / math.sqrt(2 * cfg.n_layer), s.shape)
        elif s.init == "ones":
            x = np.ones(s.shape)
        else:
            x = np.zeros(s.shape)
        flat[s.offset:s.offset + s.numel] = x.reshape(-1)
    return flat


def flatten(table: ParamTable, named: dict) -> np.ndarray:
    """The flat float64 parameter region of named arrays (the backend stores it at its own
    precision); padding is 0."""
    flat = np.zeros(table.total, np.float64)
    for s in table:
        flat[s.offset:s.offset + s.numel] = np.asarray(named[s.name], np.float64).reshape(-1)
    return flat


def unflatten(table: ParamTable, flat: np.ndarray) -> dict:
    """name -> array view of a flat region (params, grads, m or v)."""
    return {s.name: flat[s.offset:s.offset + s.numel].reshape(s.shape) for s in table}
