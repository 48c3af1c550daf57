"""The op interface the model is written against, once, for both backends.

Every op is destination-passing: outputs are views the memory plan allocated, never
returned arrays. A backend does not run an op when it is called; it *records* it into the
open `Program`, and the program is run (eagerly, or as a replayed CUDA graph) later. So
model.py builds a step's launch sequence once, and the `cuda` backend's argument blocks
are packed once, at record time.

Tensors are the backend's views: numpy float64 arrays for `reference`, `DeviceView` for
`cuda`. Model code only reads `.shape`. A view's leading dimensions flatten into rows
where an op says [N, C] (N = B*T).

The ops, with their shapes and meaning, are the methods of `Ops` below (a Protocol: both backends
implement every one with the same parameters; tests/test_ops_protocol.py checks it). "+=" means an op
accumulates into its destination, "=" that it overwrites.

Batches are not an op: `batch_feeder(x, y, rows, T)` returns an object whose `put(rows, fill)` has
fill(x_host, y_host) write [rows, T] ids and queues them into x / y ahead of the next run
(gptcuda/data/batches.py decides which windows).

Each backend also provides: `allocate(plan, table)` -> Buffers, `allocate_arena(plan)` -> views,
`upload`/`download`, `read_state`/`write_state`, `begin()`/`end()` -> Program, `run(program)`,
`capture(program)`, `synchronize()`, and the plan's inputs `attention_saved(cfg)`, `workspaces(cfg)`.
"""
from __future__ import annotations

from typing import Protocol

from gptcuda.runtime.core import Program  # noqa: F401  (a backend's recorded ops; defined with the launches)

ATTENTION_KINDS = ("unfused", "fused")
EPILOGUES = ("none", "gelu", "residual", "dgelu", "dgelu_gelu")


def rows(shape) -> int:
    """Leading dimensions of a view, flattened (the N of an op written for [N, C])."""
    n = 1
    for d in shape[:-1]:
        n *= int(d)
    return n


def check_matmul(out, trans_a, bias, epilogue, aux, a_colsum) -> None:
    """The rules of matmul's arguments that both backends keep (Backend.matmul; out [.., N] of M rows):
    a known epilogue, a bias of N, aux exactly where the epilogue has one ([M, N]), no bias with a dgelu,
    a_colsum of M with trans_a. ValueError naming the first broken rule."""
    M, N, size = rows(out.shape), int(out.shape[-1]), lambda v: rows(v.shape) * int(v.shape[-1])
    if epilogue not in EPILOGUES:
        raise ValueError(f"matmul: epilogue {epilogue!r} is not one of {EPILOGUES}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"matmul: bias {tuple(bias.shape)} must be ({N},)")
    if (epilogue != "none") != (aux is not None):
        raise ValueError(f"matmul: epilogue {epilogue!r} {'needs' if aux is None else 'takes no'} aux (only "
                         f"{EPILOGUES[1:]} do)")
    if aux is not None and (size(aux) != M * N or int(aux.shape[-1]) != N):
        raise ValueError(f"matmul: aux {tuple(aux.shape)} must hold [M={M}, N={N}] like out {tuple(out.shape)}")
    if epilogue in ("dgelu", "dgelu_gelu") and bias is not None:
        raise ValueError(f"matmul: the {epilogue!r} epilogue takes no bias")
    if a_colsum is not None and (not trans_a or size(a_colsum) != M):
        raise ValueError(f"matmul: a_colsum needs trans_a and {M} elements, got {tuple(a_colsum.shape)} "
                         f"(trans_a {trans_a})")


class Buffers:
    """The views a model runs on: parameters, gradients and Adam state by name and as flat
    regions, and every arena entry of the memory plan by name."""

    def __init__(self, params, grads, flat_params, flat_grads, flat_m, flat_v, acts, work=None):
        self.params, self.grads = params, grads
        self.flat_params, self.flat_grads, self.flat_m, self.flat_v = flat_params, flat_grads, flat_m, flat_v
        self.acts = acts
        # the views the products and the embedding read the parameters through: the bf16 working copy
        # by name (precision bf16: memory plan entry params_bf16), else the parameters themselves
        self.work = work if work is not None else params

    @classmethod
    def of(cls, regions: dict, named, acts) -> "Buffers":
        """From the flat regions a plan has ({"params": view, ...}: memory.REGIONS, or the
        parameters alone for generation, where the rest are None); named(region) gives the
        region's views by parameter name (and those of the bf16 working copy, acts["params_bf16"])."""
        g = regions.get
        work = named(acts["params_bf16"]) if "params_bf16" in acts else None
        return cls(named(regions["params"]), named(regions["grads"]) if "grads" in regions else None,
                   g("params"), g("grads"), g("adam_m"), g("adam_v"), acts, work)


class Ops(Protocol):
    """The ops of a backend. Views: numpy float64 arrays (reference) or DeviceViews (cuda); the
    step state (StepState) is the backend's own. Shapes as [rows, columns]; [N, C] takes any
    leading dimensions as rows."""

    # ---- the step state -------------------------------------------------------------------------
    def zero(self, view) -> None:
        """view = 0"""

    def lr_schedule(self, learning_rate: float, min_lr: float, warmup_iters: int, lr_decay_iters: int) -> None:
        """state.lr = the warmup-then-cosine schedule at state.step"""

    def step_advance(self) -> None:
        """state.step += 1"""

    def eval_advance(self) -> None:
        """state.eval_draws += 1"""

    # ---- the backward's row sums ----------------------------------------------------------------
    def defer_sums(self, on: bool) -> None:
        """on: the second passes of the bias and layernorm weight gradients (row sums of per-block
        partials) are held until flush_sums and made there together; off: flush_sums, then none is
        held. The values are the same either way."""

    def flush_sums(self) -> None:
        """Every held sum is made: the gradients written so far are final."""

    # ---- the model ------------------------------------------------------------------------------
    def encoder_fwd(self, out, idx, wte, wpe) -> None:
        """out[B,T,C] = wte[idx[B,T]] + wpe[t]"""

    def encoder_bwd(self, dwte, dwpe, dout, idx) -> None:
        """dwte[V,C] += the rows of dout[B,T,C] gathered by idx; dwpe[Tmax,C] = sum over B (rows >= T zeroed)"""

    def dropout_fwd(self, out, x, p: float, site: int) -> None:
        """out = x * keep / (1 - p) (out may be x; with p = 0 it must be)"""

    def dropout_bwd(self, dx, dout, p: float, site: int) -> None:
        """dx = dout * keep / (1 - p) (dx may be dout; with p = 0 it must be)"""

    def residual_dropout(self, out, resid, x, p: float, site: int) -> None:
        """out = resid + dropout(x) (the mask's element index: the row-major index of x)"""

    def layernorm_fwd(self, out, mean, rstd, x, w, b, residual=None) -> None:
        """out[N,C] = (x - mean) * rstd * w + b (b may be None); mean[N], rstd[N] saved; residual =
        (resid, branch, p, site) with p > 0: x = resid + dropout(branch) is made first (residual_dropout)"""

    def layernorm_bwd(self, dx, dw, db, dout, x, mean, rstd, w, drop=None, ds=None) -> None:
        """dx[N,C] += ; dw[C] = ; db[C] = (db may be None); drop = (dropped, p, site) with p > 0: also
        dropped = dropout_bwd(dx) with that p and stream, from the new dx; ds[C] (with db only) = the
        column sums of the branch gradient as stored (dropped, else the new dx): the bias gradient of the
        projection whose dropout-added output the residual took there"""

    def matmul(self, out, a, b, trans_a: bool = False, trans_b: bool = False, bias=None,
               epilogue: str = "none", aux=None, a_colsum=None) -> None:
        """out[M,N] = op(a) @ op(b) + bias; a is [M,K] (stored [K,M] when trans_a), b is [K,N] (stored
        [N,K] when trans_b). "gelu": aux = that pre-activation, out = gelu_tanh(aux); "residual":
        out = aux + op(a) @ op(b) + bias (aux may be out); "dgelu": out = (op(a) @ op(b)) *
        gelu_tanh'(aux) (no bias; the GELU backward folded in); "dgelu_gelu": that, then aux =
        gelu_tanh(aux) (the GELU output rebuilt over its input; exec.gelu_in_dgelu). a_colsum[M] (trans_a only): also
        a_colsum = a.sum(0) of a as stored [K,M], deterministic: a weight gradient's bias gradient."""

    def linear_bwd(self, dx, dw, dy, x, w, db=None, epilogue: str = "none", aux=None) -> None:
        """The gradients of a linear layer y = x @ w^T + b from dy[M,N]: dw[N,K] = dy^T @ x (matmul
        trans_a), db[N] (may be None) = dy.sum(0), dx[M,K] = dy @ w with epilogue "none" or "dgelu" over
        aux (the GELU before the layer: matmul's). The two products are independent (a backend may run
        them as one launch: exec.grad_pairs)."""

    def gelu_fwd(self, out, x) -> None:
        """out = gelu_tanh(x)"""

    def attention_fwd(self, y, qkv, saved, n_head: int, p: float, site: int) -> None:
        """y[B,T,C] = causal softmax attention of qkv[B,T,3C]; `saved` is the dict of views
        memory.attention_saved(cfg) plans for the layer (probabilities or log-sum-exp)"""

    def attention_bwd(self, dqkv, dy, qkv, y, saved, n_head: int, p: float, site: int) -> None:
        """dqkv[B,T,3C] ="""

    def crossentropy(self, losses, dlogits, logits, targets, grad_scale: float, n_vocab: int | None = None) -> None:
        """losses[N] = -log softmax(logits[:, :n_vocab])[target]; dlogits[N,V] = (softmax - onehot) *
        grad_scale, 0 in the padded columns n_vocab.. (dlogits may be logits; grad_scale 0: no gradient)"""

    def accumulate(self, dst, src, first: bool) -> None:
        """dst = src (first) or dst += src (gradient accumulation)"""

    def work_copy(self, work, params) -> None:
        """work = params in the working copy's dtype (bf16: rounded to nearest even), the flat buffers; nothing
        where state.work_fresh (adamw with work wrote the copy, and nothing wrote the parameters since)"""

    def loss_reduce(self, losses, history) -> None:
        """state.loss = mean(losses[N]); history[state.step] = it (history may be None)"""

    def grad_norm(self, grads) -> None:
        """state.grad_norm = ||grads||_2, deterministic"""

    def adamw(self, params, grads, m, v, n_decay: int, beta1: float, beta2: float, eps: float,
              weight_decay: float, grad_clip: float, work=None) -> None:
        """One pass over the flat buffers: g *= min(1, clip / (norm + 1e-6)) when clip > 0; decoupled
        decay lr*wd*p on the first n_decay elements only; bias correction with t = step + 1. work: the
        working copy, written too (work_copy's values), and state.work_fresh = 1."""

    # ---- generation (S sequences, one position a step; `g` the views of memory.plan_decode) ------
    def decode_embed(self, out, ctx, wte, wpe, pos) -> None:
        """out[S,C] = wte[ctx[:, pos]] + wpe[pos] (ctx [S,T+1] the windows, pos [1] a device int)"""

    def decode_attention(self, y, qkv, kcache, vcache, n_head: int, pos, part=None) -> None:
        """k, v of qkv[S,3C] appended to kcache/vcache [S,H,Tmax,hs] at pos; y[S,C] = causal attention
        of q over keys 0..pos (part: scratch of a backend that splits the keys into chunks)"""

    def decode_linear(self, out, a, w, bias=None, epilogue: str = "none", aux=None) -> None:
        """matmul(out[S,N], a[S,K], w[N,K], trans_b=True, ...) for the few rows of a decode step
        (epilogue none, gelu or residual)"""

    def decode_sample(self, g, logits, pos, n_vocab: int) -> None:
        """Each sequence past its prompt draws its next token from logits[S, :n_vocab] (greedy,
        temperature, top-k, top-p: reference/ops.py draw_token) into ctx and out, and is done at
        max_new tokens or the stop sequence; at the end of the window the last T/2 tokens move to
        its start."""

    def decode_advance(self, pos, T: int) -> None:
        """pos = (pos + 1) % T"""
