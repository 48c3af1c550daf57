"""The matrix products of the model: `Product` describes one (the GEMM layer plans and launches products,
ops/cuda/gemm), `products(cfg, vocab)` lists those a GPT of a config runs: gpt.py's matmuls (forward,
backward, the evaluation forward's residual form) and, with unfused attention, the attention's batched
ones, each with the launches a training step makes of it (the GEMM table measures these)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gptcuda.config import recompute_layers
from gptcuda.runtime import execution


def layout_code(trans_a, trans_b) -> str:
    """"NT", "NN", "TN" or "TT": T where the operand is stored transposed (A [K, M], B [N, K])."""
    return ("T" if trans_a else "N") + ("T" if trans_b else "N")


@dataclass(frozen=True)
class Product:
    """out[M, N] = op(a) @ op(b) (batched: `batch` of them), op transposing an a stored [K, M] (ta) or a b
    stored [N, K] (tb), with an epilogue of the op interface (backend.EPILOGUES) and a
    bias; colsum: it also gives A's column sums (a weight gradient's bias gradient); vec: 16-byte operand
    loads are possible. label: what it is; count: its launches in a training step."""
    M: int
    N: int
    K: int
    ta: bool = False
    tb: bool = False
    epilogue: str = "none"
    bias: bool = False
    batch: int = 1
    colsum: bool = False
    vec: bool = True
    label: str = ""
    count: int = 1

    @property
    def layout(self) -> str:
        return layout_code(self.ta, self.tb)


def products(cfg, vocab_size: int, backward: bool = True, ex=None) -> list:
    """Every product the model's programs launch for this config, one per distinct product (labels
    joined, counts summed; count 0: evaluation or an alternative form only), vec as dense operands allow.
    backward False: the forward's alone (a model that only evaluates); ex: the execution plan (default
    the config's: its attention path)."""
    Ntok, C, V, L = cfg.batch_size * cfg.block_size, cfg.n_embd, vocab_size, cfg.n_layer
    bias, drop = bool(cfg.bias), cfg.dropout > 0
    ex = ex or execution.resolve(cfg)
    unfused = ex.attention == "unfused"
    T, H = cfg.block_size, cfg.n_head
    hs, BH = C // H, cfg.batch_size * H
    ops = []

    def add(label, M, N, K, ta, tb, epilogue="none", bias=False, batch=1, count=1, colsum=False):
        strides = [M if ta else K, K if tb else N] + ([M * K, K * N] if batch > 1 else [])
        ops.append(Product(M, N, K, ta, tb, epilogue, bias, batch, colsum, all(s % 4 == 0 for s in strides), label,
                           count))

    # forward (train): the residual branches go through dropout when there is dropout
    resid_epi = "none" if drop else "residual"
    add("fwd qkv", Ntok, 3 * C, C, False, True, "none", bias, count=L)
    add("fwd attn proj", Ntok, C, C, False, True, resid_epi, bias, count=L)
    add("fwd fc +gelu", Ntok, 4 * C, C, False, True, "gelu", bias, count=L)
    add("fwd fcproj", Ntok, C, 4 * C, False, True, resid_epi, bias, count=L)
    add("fwd head", Ntok, V, C, False, True, count=1)
    if drop:     # evaluation forward: no dropout, residual fused
        add("eval attn proj", Ntok, C, C, False, True, "residual", bias, count=0)
        add("eval fcproj", Ntok, C, 4 * C, False, True, "residual", bias, count=0)
    if unfused:
        add("att scores", T, T, hs, False, True, batch=BH, count=L)
        add("att y", T, hs, T, False, False, batch=BH, count=L)
    if backward:
        add("dX head", Ntok, C, V, False, False, count=1)
        add("dW wte", V, C, Ntok, True, False, count=1)
        add("dW fcproj", C, 4 * C, Ntok, True, False, count=L)       # (its bias: the layernorm backward's ds)
        rebuilt = recompute_layers(cfg) if ex.gelu_in_dgelu else 0   # else a gelu pass after the dgelu product
        if rebuilt < L:
            add("dX fcproj +dgelu", Ntok, 4 * C, C, False, False, "dgelu", count=L - rebuilt)
        if rebuilt:
            add("dX fcproj +dgelu +gelu", Ntok, 4 * C, C, False, False, "dgelu_gelu", count=rebuilt)
        add("dX fcproj", Ntok, 4 * C, C, False, False, count=0)          # the unfused form (+ gelu_bwd)
        add("dW fc", 4 * C, C, Ntok, True, False, count=L, colsum=bias)
        add("dX fc", Ntok, C, 4 * C, False, False, count=L)
        add("dX attn proj", Ntok, C, C, False, False, count=L)
        add("dW attn proj", C, C, Ntok, True, False, count=L)        # (likewise)
        add("dX qkv", Ntok, C, 3 * C, False, False, count=L)
        add("dW qkv", 3 * C, C, Ntok, True, False, count=L, colsum=bias)
        if unfused:
            add("att dv", T, hs, T, True, False, batch=BH, count=L)
            add("att dP", T, T, hs, False, True, batch=BH, count=L)
            add("att dq", T, hs, T, False, False, batch=BH, count=L)
            add("att dk", T, hs, T, True, False, batch=BH, count=L)
    merged = {}
    for op in ops:
        same = dataclasses.replace(op, label="", count=0)
        old = merged.get(same)
        merged[same] = op if old is None else dataclasses.replace(old, label=old.label + " / " + op.label,
                                                                  count=old.count + op.count)
    return list(merged.values())
