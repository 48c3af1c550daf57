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
    loads are possible; out: "bf16" for a weight gradient (trans_a) into a bf16 C (a bf16 model that keeps its
    gradients in bf16), else "" (C as the family writes that layout). label: what it is; count: its launches
    in a training step."""
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
    out: str = ""

    @property
    def layout(self) -> str:
        return layout_code(self.ta, self.tb)


@dataclass(frozen=True)
class Pair:
    """A linear layer's weight gradient w (dY^T X: trans_a, fp32 C, or bf16: w.out) and input gradient x (dY W) over
    one dY: the op interface's linear_bwd, which the bf16 family runs as one launch where ex.grad_pairs
    (gemm.matmul_pair; its measured table has an entry per pair: a plan, or the two products apart). count: its
    launches in a training step."""
    w: Product
    x: Product
    label: str = ""
    count: int = 1


def _vec(M, N, K, ta, tb) -> bool:
    """Whether dense operands of op(a) [M, K] and op(b) [K, N] have row strides of whole 4-element groups (the
    products' `vec`; the launchers also check the addresses)."""
    return all(s % 4 == 0 for s in (M if ta else K, K if tb else N))


def grad_out(ex) -> str:
    """The C dtype of the weight gradients' products (Product.out): "bf16" where the execution plan keeps the
    gradients in bf16, else "" (the family's: fp32)."""
    return "bf16" if ex.grads_bf16 else ""


def pairs(cfg, vocab_size: int, ex=None) -> list:
    """The linear_bwd pairs gpt.py's backward runs as one launch (ex.grad_pairs; else none), one per distinct
    pair: fc's, qkv's (with their bias sums where the model has biases), the attention projection's, and
    fcproj's with the GELU's backward in the layers that store the GELU output."""
    ex = ex or execution.resolve(cfg)
    if not ex.grad_pairs:
        return []
    Ntok, C, L = cfg.batch_size * cfg.block_size, cfg.n_embd, cfg.n_layer
    bias = bool(cfg.bias)
    out = []
    dw = grad_out(ex)

    def add(label, N, K, epilogue="none", colsum=False, count=L):      # a layer y[Ntok, N] = x[Ntok, K] @ w[N, K]^T
        if count:
            out.append(Pair(Product(N, K, Ntok, True, False, colsum=colsum, vec=_vec(N, K, Ntok, True, False),
                                    out=dw),
                            Product(Ntok, K, N, False, False, epilogue, vec=_vec(Ntok, K, N, False, False)),
                            label, count))
    rebuilt = recompute_layers(cfg) if ex.gelu_in_dgelu else 0
    add("fcproj", C, 4 * C, "dgelu", count=L - rebuilt)
    add("fc", 4 * C, C, colsum=bias)
    add("attn proj", C, C)
    add("qkv", 3 * C, C, colsum=bias)
    return _merged(out)


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

    def add(label, M, N, K, ta, tb, epilogue="none", bias=False, batch=1, count=1, colsum=False, out=""):
        vec = _vec(M, N, K, ta, tb) and (batch == 1 or (M * K % 4 == 0 and K * N % 4 == 0))
        ops.append(Product(M, N, K, ta, tb, epilogue, bias, batch, colsum, vec, label, count, out))
    dw = grad_out(ex)

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
        add("dW wte", V, C, Ntok, True, False, count=1, out=dw)
        add("dW fcproj", C, 4 * C, Ntok, True, False, count=L, out=dw)       # (its bias: the layernorm backward's ds)
        rebuilt = recompute_layers(cfg) if ex.gelu_in_dgelu else 0   # else a gelu pass after the dgelu product
        if rebuilt < L:
            add("dX fcproj +dgelu", Ntok, 4 * C, C, False, False, "dgelu", count=L - rebuilt)
        if rebuilt:
            add("dX fcproj +dgelu +gelu", Ntok, 4 * C, C, False, False, "dgelu_gelu", count=rebuilt)
        add("dX fcproj", Ntok, 4 * C, C, False, False, count=0)          # the unfused form (+ gelu_bwd)
        add("dW fc", 4 * C, C, Ntok, True, False, count=L, colsum=bias, out=dw)
        add("dX fc", Ntok, C, 4 * C, False, False, count=L)
        add("dX attn proj", Ntok, C, C, False, False, count=L)
        add("dW attn proj", C, C, Ntok, True, False, count=L, out=dw)        # (likewise)
        add("dX qkv", Ntok, C, 3 * C, False, False, count=L)
        add("dW qkv", 3 * C, C, Ntok, True, False, count=L, colsum=bias, out=dw)
        if unfused:
            add("att dv", T, hs, T, True, False, batch=BH, count=L)
            add("att dP", T, T, hs, False, True, batch=BH, count=L)
            add("att dq", T, hs, T, False, False, batch=BH, count=L)
            add("att dk", T, hs, T, True, False, batch=BH, count=L)
    return _merged(ops)


def _merged(items) -> list:
    """One per distinct product or pair (label and count aside), labels joined and counts summed, in order."""
    merged = {}
    for it in items:
        same = dataclasses.replace(it, label="", count=0)
        old = merged.get(same)
        merged[same] = it if old is None else dataclasses.replace(old, label=old.label + " / " + it.label,
                                                                  count=old.count + it.count)
    return list(merged.values())
