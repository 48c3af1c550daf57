"""Launchers of kernels/optim.cu: learning-rate schedule, step counters, gradient norm, AdamW.

    lr_schedule(rt, learning_rate, min_lr, warmup_iters, lr_decay_iters)   state.lr = lr_at(state.step)
    step_advance(rt)                                                      state.step += 1
    eval_advance(rt)                                                      state.eval_draws += 1
    grad_norm(rt, grads[P])                       state.grad_norm = ||grads||_2 (deterministic; fp32 or bf16 grads)
        = grad_norm_partial (NORM_BLOCKS-bounded partials) then grad_norm_final (gptcuda/dist
        all-reduces the partials of ZeRO-1 shards in between)
    adamw(rt, params, grads, m, v, n_decay, beta1, beta2, eps, weight_decay, grad_clip, work=None)
        one launch over the flat buffers [P] (grads fp32 or bf16, the rest fp32); clip scale
        min(1, clip / (state.grad_norm + 1e-6)) when grad_clip > 0; decoupled decay on elements < n_decay;
        bias correction t = step + 1.
        work (a bf16 view of P elements: a bf16 model's working copy of the parameters): also
        written, the updated parameters rounded to nearest even (adamw_copy; the fp32 update the same
        bits as without it)
    to_bf16(rt, out, src)                         out = src rounded to bf16 (the working copy at init / load)

The norm is two launches: NORM_BLOCKS (fixed, not device dependent) blocks write double
partials into the workspace "optim_partials", then one block sums them in a fixed order.
"""
from __future__ import annotations

import numpy as np

from gptcuda.runtime import RuntimeProtocol, f32, i32, u64
from gptcuda.ops.cuda import aligned4, cdiv, element_types, expression, optional_code, sm_count

FILE = "optim.cu"
NORM_THREADS = 512         # the kernels' blocks: their last template argument
NORM_BLOCKS = 264          # 2 x 132 SMs; a constant so the sum order never depends on the device
FINAL_THREADS = 256        # (a power of two: grad_norm_final's tree)
ADAM_THREADS = 256
ADAM_BLOCKS_PER_SM = 8
WORKSPACE = "optim_partials"

FINAL_NAME = expression("grad_norm_final", FINAL_THREADS)
GRAD_TYPES = ("f32", "bf16")     # the gradients' element types the norm and AdamW read (the rest is fp32)


def norm_name(vec: int, grads: str = "f32") -> str:
    return expression("grad_norm_partial", vec, NORM_THREADS, *optional_code(grads))


def adamw_name(vec: int, copy: bool = False, grads: str = "f32") -> str:
    """adamw <VEC, ADAM_THREADS[, TG]>, or adamw_copy (the bf16 working copy written too); TG: bf16 gradients."""
    return expression("adamw_copy" if copy else "adamw", vec, ADAM_THREADS, *optional_code(grads))


def to_bf16_name(vec: int) -> str:
    return expression("to_bf16", vec, ADAM_THREADS)


VARIANTS = (
    [(FILE, n, {}) for n in ("lr_schedule", "step_advance", "eval_advance", FINAL_NAME)]
    + [(FILE, norm_name(v, g), {}) for g in GRAD_TYPES for v in (4, 1)]
    + [(FILE, adamw_name(v, c, g), {}) for g in GRAD_TYPES for c in (False, True) for v in (4, 1)]
    + [(FILE, to_bf16_name(v), {}) for v in (4, 1)]
)


def workspace(cfg, ex=None) -> dict:
    """NORM_BLOCKS double partials (stored as 2 * NORM_BLOCKS f32 words)."""
    return {WORKSPACE: ((2 * NORM_BLOCKS,), "f32")}


def _f64_bits(x: float) -> u64:
    """A double kernel argument: its 8 bytes travel in a u64 slot."""
    return u64(int(np.array([float(x)], dtype=np.float64).view(np.uint64)[0]))


def _state(rt: RuntimeProtocol, label):
    if rt.state is None:
        raise RuntimeError(f"{label}: rt.state (the StepState) is not set")
    return rt.state


def lr_schedule(rt: RuntimeProtocol, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    rt.launch(rt.function(FILE, "lr_schedule"), (1,), (1,),
              [_state(rt, "lr_schedule"), _f64_bits(learning_rate), _f64_bits(min_lr),
               i32(int(warmup_iters)), i32(int(lr_decay_iters))], label="lr_schedule")


def step_advance(rt: RuntimeProtocol):
    rt.launch(rt.function(FILE, "step_advance"), (1,), (1,), [_state(rt, "step_advance")], label="step_advance")


def eval_advance(rt: RuntimeProtocol):
    rt.launch(rt.function(FILE, "eval_advance"), (1,), (1,), [_state(rt, "eval_advance")], label="eval_advance")


def grad_norm(rt: RuntimeProtocol, grads):
    _state(rt, "grad_norm")
    part, G = grad_norm_partial(rt, grads)
    grad_norm_final(rt, part, G)


def norm_blocks(n: int, vec: int = 4) -> int:
    """Blocks of the norm's first pass over n elements read vec at a time (at most NORM_BLOCKS)."""
    return max(1, min(NORM_BLOCKS, cdiv(max(n // vec, 1), NORM_THREADS)))


def grad_norm_partial(rt: RuntimeProtocol, grads, blocks: int | None = None):
    """The norm's first pass: per-block double partial sums of grads^2 into the workspace; `blocks`
    (default `norm_blocks` of grads) fixes their number, e.g. the same on every rank of a
    data-parallel run that all-reduces the partials before `grad_norm_final`. Returns (the
    workspace view, blocks)."""
    n = grads.numel
    if n >= 2 ** 31:
        raise ValueError(f"grad_norm: {n} elements exceed int32")
    part = rt.workspace(WORKSPACE)
    if part.numel < 2 * NORM_BLOCKS or part.ptr % 8:
        raise ValueError(f"workspace {WORKSPACE} {part.shape} must hold {NORM_BLOCKS} doubles (8-byte aligned)")
    element_types("grad_norm", tuple((g,) for g in GRAD_TYPES), grads=grads)
    vec = 4 if aligned4(grads) else 1
    G = norm_blocks(n, vec) if blocks is None else int(blocks)
    rt.launch(rt.function(FILE, norm_name(vec, grads.dtype)), (G,), (NORM_THREADS,),
              [part, grads, i32(n)], label="grad_norm_partial")
    return part, G


def grad_norm_final(rt: RuntimeProtocol, part, blocks: int):
    """The norm's second pass: state.grad_norm = sqrt of the sum of the first `blocks` partials of
    `part`, in a fixed order."""
    rt.launch(rt.function(FILE, FINAL_NAME), (1,), (FINAL_THREADS,), [_state(rt, "grad_norm"), part, i32(blocks)],
              label="grad_norm_final")


# The element types there are AdamW kernels for: (params, grads, m, v), and the same with the working copy;
# each with fp32 or bf16 gradients
ADAM_TYPES = tuple(("f32", g, "f32", "f32") + w for g in GRAD_TYPES for w in ((), ("bf16",)))


def _grid(rt: RuntimeProtocol, n: int, vec: int) -> int:
    """Blocks of a grid-stride pass over n elements, vec at a time (the n % 4 left one a thread)."""
    units = n // 4 + n % 4 if vec == 4 else n
    return max(1, min(cdiv(units, ADAM_THREADS), sm_count(rt) * ADAM_BLOCKS_PER_SM))


def adamw(rt: RuntimeProtocol, params, grads, m, v, n_decay, beta1, beta2, eps, weight_decay, grad_clip, work=None):
    st = _state(rt, "adamw")
    n = params.numel
    if grads.numel != n or m.numel != n or v.numel != n or (work is not None and work.numel != n):
        raise ValueError(f"adamw: sizes differ: {params.shape} {grads.shape} {m.shape} {v.shape}"
                         + ("" if work is None else f" (work {work.shape})"))
    if n >= 2 ** 31:
        raise ValueError(f"adamw: {n} elements exceed int32")
    n_decay = int(n_decay)
    if not 0 <= n_decay <= n:
        raise ValueError(f"adamw: n_decay {n_decay} outside 0..{n}")
    copy = {} if work is None else {"work": work}
    element_types("adamw", ADAM_TYPES, params=params, grads=grads, m=m, v=v, **copy)
    vec = 4 if aligned4(params, grads, m, v, work) else 1
    tail = [i32(n), i32(n_decay), f32(beta1), f32(beta2), f32(eps), f32(weight_decay), f32(grad_clip), st]
    rt.launch(rt.function(FILE, adamw_name(vec, work is not None, grads.dtype)), (_grid(rt, n, vec),), (ADAM_THREADS,),
              [params, grads, m, v, *copy.values(), *tail], label="adamw")


def to_bf16(rt: RuntimeProtocol, out, src, unless_fresh: bool = False):
    """out = src rounded to bf16, nearest even (e.g. the working copy of the fp32 parameters); unless_fresh:
    nothing where the step state's work_fresh says adamw_copy left the copy as the parameters are."""
    n = src.numel
    if out.numel != n:
        raise ValueError(f"to_bf16: sizes differ: out {out.shape}, src {src.shape}")
    if n >= 2 ** 31:
        raise ValueError(f"to_bf16: {n} elements exceed int32")
    element_types("to_bf16", (("bf16", "f32"),), out=out, src=src)
    vec = 4 if aligned4(out, src) else 1
    rt.launch(rt.function(FILE, to_bf16_name(vec)), (_grid(rt, n, vec),), (ADAM_THREADS,),
              [out, src, i32(n), _state(rt, "to_bf16") if unless_fresh else None], label="to_bf16")
