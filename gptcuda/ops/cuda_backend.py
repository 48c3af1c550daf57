"""The `cuda` backend: the op interface of backend.py (`Ops`), recorded as kernel launches.

Each op forwards to its family's launcher in gptcuda/ops/cuda/ (the kernels live in
kernels/<family>.cu). Launches are packed once into the open program; nothing is compiled
when a recorded program runs (every variant was built while recording), and a program can be
captured as a CUDA graph.
"""
from __future__ import annotations

import numpy as np

from gptcuda.runtime import execution
from gptcuda.model import state
from gptcuda.ops.backend import Buffers, Program
from gptcuda.ops.cuda import attention, decode, elementwise, encoder, gemm, layernorm, loss, optim
from gptcuda.runtime import POISON_WORDS, DeviceView, Runtime

FAMILIES = (encoder, layernorm, elementwise, loss, optim, gemm, attention, decode)


def workspaces(cfg, ex=None) -> dict:
    """Scratch of every op family for this config, merged (a name planned twice keeps the larger); ex:
    the execution plan (default: the config's on sm_90, as train.py --plan plans)."""
    ex = ex or execution.resolve(cfg)
    out = {}
    for fam in FAMILIES:
        ws = getattr(fam, "workspace", None)          # (decode plans its own: memory.plan_decode)
        for name, (shape, dtype) in (ws(cfg, ex) if ws else {}).items():
            if name in out and int(np.prod(out[name][0])) >= int(np.prod(shape)):
                continue
            out[name] = (tuple(shape), dtype)
    return out


def attention_saved(cfg, ex=None) -> dict:
    return attention.saved_shapes(cfg, ex)


class CudaBackend:
    name = "cuda"

    def __init__(self, cfg, rt: Runtime | None = None, seed: int | None = None):
        """seed: the dropout stream's (default cfg.seed; a data-parallel rank's own: the Engine's)."""
        self.cfg = cfg
        self.rt = rt or Runtime(cfg.device, seed=cfg.seed, cfg=cfg)
        if seed is not None:
            self.rt.seed = int(seed)
        self.exec = self.rt.exec                # which kernels run: resolved once, by the runtime
        if self.exec != execution.resolve(cfg, arch=self.rt.arch):
            raise ValueError(f"the runtime's execution plan is not this config's: {self.exec} (build the runtime "
                             "with cfg=)")

    attention_saved = staticmethod(attention_saved)
    workspaces = staticmethod(workspaces)

    def device_workspaces(self, ws: dict) -> dict:
        """The entries of workspaces(cfg) this device reads (gemm.device_workspaces)."""
        return gemm.device_workspaces(ws, self.rt)

    # ---- memory ---------------------------------------------------------------------
    def free_bytes(self) -> int:
        return self.rt.dev.mem_info()[0]

    def allocate(self, plan, table) -> Buffers:
        rt = self.rt
        flat = rt.alloc(plan.flat_bytes)
        regions = {n: DeviceView(flat + plan.offset_of(n), (table.total,), plan.dtype_of(n), n) for n in plan.regions}
        for r in regions.values():
            rt.fill(r, 0)

        def named(region_view):          # (a region, or the bf16 working copy: each view of its dtype)
            e = region_view.itemsize
            return {s.name: DeviceView(region_view.ptr + e * s.offset, s.shape, region_view.dtype, s.name)
                    for s in table}

        acts = self.allocate_arena(plan)
        rt.set_workspace({e.name: acts[e.name] for e in plan.entries if e.kind == "workspace"})
        rt.state = acts["state"]
        rt.fill(rt.state, 0)
        rt.synchronize()
        return Buffers.of(regions, named, acts)

    def allocate_arena(self, plan) -> dict:
        """One allocation holding every entry of the plan; poisoned, so that an op reading what
        nothing wrote shows NaN."""
        rt = self.rt
        arena = rt.alloc(plan.arena_bytes)
        acts = {e.name: DeviceView(arena + e.offset, e.shape, e.dtype, e.name) for e in plan.entries}
        for e in plan.entries:
            rt.fill(acts[e.name], POISON_WORDS.get(e.dtype, 0))
        return acts

    def upload(self, view, arr):
        self.rt.write(view, arr)

    def download(self, view) -> np.ndarray:
        return self.rt.download(view)

    def read_state(self) -> dict:
        return state.unpack(self.rt.download(self.rt.state))

    def write_state(self, **fields):
        self.rt.write(self.rt.state, state.pack_into(self.rt.download(self.rt.state), **fields))

    # ---- programs -------------------------------------------------------------------
    def begin(self, name) -> Program:
        return self.rt.begin(name)

    def end(self) -> Program:
        return self.rt.end()

    def run(self, prog: Program):
        self.rt.run(prog)

    def capture(self, prog: Program):
        return self.rt.capture(prog)

    def synchronize(self):
        self.rt.synchronize()

    # ---- ops (their meaning: backend.Ops) -------------------------------------------
    def zero(self, view):
        self.rt.memset(view, 0, "zero")

    def defer_sums(self, on):
        elementwise.defer_sums(self.rt, on)

    def flush_sums(self):
        elementwise.flush_sums(self.rt)

    def lr_schedule(self, learning_rate, min_lr, warmup_iters, lr_decay_iters):
        optim.lr_schedule(self.rt, learning_rate, min_lr, warmup_iters, lr_decay_iters)

    def step_advance(self):
        optim.step_advance(self.rt)

    def eval_advance(self):
        optim.eval_advance(self.rt)

    def batch_feeder(self, x, y, rows: int, block: int) -> "BatchFeeder":
        return BatchFeeder(self.rt, x, y, rows, block)

    def encoder_fwd(self, out, idx, wte, wpe):
        encoder.encoder_fwd(self.rt, out, idx, wte, wpe)

    def encoder_bwd(self, dwte, dwpe, dout, idx):
        encoder.encoder_bwd(self.rt, dwte, dwpe, dout, idx)

    def dropout_fwd(self, out, x, p, site):
        if p > 0:
            elementwise.dropout_fwd(self.rt, out, x, p, site)
        elif out.ptr != x.ptr:
            raise ValueError("dropout_fwd with p=0 must be in place")

    def dropout_bwd(self, dx, dout, p, site):
        if p > 0:
            elementwise.dropout_bwd(self.rt, dx, dout, p, site)
        elif dx.ptr != dout.ptr:
            raise ValueError("dropout_bwd with p=0 must be in place")

    def residual_dropout(self, out, resid, x, p, site):
        elementwise.residual_dropout(self.rt, out, resid, x, p, site)

    def layernorm_fwd(self, out, mean, rstd, x, w, b, residual=None):
        layernorm.layernorm_fwd(self.rt, out, mean, rstd, x, w, b, residual)

    def layernorm_bwd(self, dx, dw, db, dout, x, mean, rstd, w, drop=None, ds=None):
        layernorm.layernorm_bwd(self.rt, dx, dw, db, dout, x, mean, rstd, w, drop, ds)

    def matmul(self, out, a, b, trans_a=False, trans_b=False, bias=None, epilogue="none", aux=None, a_colsum=None):
        gemm.matmul(self.rt, out, a, b, trans_a, trans_b, bias=bias, epilogue=epilogue, aux=aux, ex=self.exec,
                    a_colsum=a_colsum)

    def linear_bwd(self, dx, dw, dy, x, w, db=None, epilogue="none", aux=None):
        gemm.matmul_pair(self.rt, dx, dw, dy, x, w, db=db, epilogue=epilogue, aux=aux, ex=self.exec)

    def gelu_fwd(self, out, x):
        elementwise.gelu_fwd(self.rt, out, x)

    def attention_fwd(self, y, qkv, saved, n_head, p, site):
        attention.attention_fwd(self.rt, y, qkv, saved, n_head, p, site, self.exec)

    def attention_bwd(self, dqkv, dy, qkv, y, saved, n_head, p, site):
        attention.attention_bwd(self.rt, dqkv, dy, qkv, y, saved, n_head, p, site, self.exec)

    def crossentropy(self, losses, dlogits, logits, targets, grad_scale, n_vocab=None):
        loss.crossentropy(self.rt, losses, dlogits, logits, targets, grad_scale, n_vocab=n_vocab)

    def accumulate(self, dst, src, first):
        elementwise.accumulate(self.rt, dst, src, first)

    def work_copy(self, work, params):
        optim.to_bf16(self.rt, work, params, unless_fresh=True)

    def loss_reduce(self, losses, history):
        loss.loss_reduce(self.rt, losses, history)

    def grad_norm(self, grads):
        optim.grad_norm(self.rt, grads)

    def adamw(self, params, grads, m, v, n_decay, beta1, beta2, eps, weight_decay, grad_clip, work=None):
        optim.adamw(self.rt, params, grads, m, v, n_decay, beta1, beta2, eps, weight_decay, grad_clip, work)

    def decode_embed(self, out, ctx, wte, wpe, pos):
        decode.decode_embed(self.rt, out, ctx, wte, wpe, pos)

    def decode_attention(self, y, qkv, kcache, vcache, n_head, pos, part=None):
        decode.decode_attention(self.rt, y, qkv, kcache, vcache, n_head, pos, part)

    def decode_linear(self, out, a, w, bias=None, epilogue="none", aux=None):
        decode.decode_linear(self.rt, out, a, w, bias, epilogue, aux)

    def decode_sample(self, g, logits, pos, n_vocab):
        decode.decode_sample(self.rt, g, logits, pos, n_vocab)

    def decode_advance(self, pos, T):
        decode.decode_advance(self.rt, pos, T)


class BatchFeeder:
    """Copies each program's batch into x / y [rows, T] on the training stream, from page-locked
    host buffers the host fills while the GPU still runs the previous step.

    SLOTS buffers take turns; before a buffer is refilled the host waits for the event recorded
    after its last copy, so at most SLOTS - 1 batches are in flight and none is overwritten early.
    The copies are stream-ordered with the replays: the step before has finished reading x / y
    when the next copy lands."""

    SLOTS = 2

    def __init__(self, rt: Runtime, x, y, rows: int, block: int):
        if x.dtype != "i32" or y.dtype != "i32" or x.numel < rows * block or y.numel < rows * block:
            raise ValueError(f"batch feeder: x {x.shape} {x.dtype} and y {y.shape} {y.dtype} must hold "
                             f"{rows} x {block} int32 ids")
        self.rt, self.x, self.y, self.T = rt, x, y, int(block)
        self.bufs = [rt.pinned((2, rows, block), np.int32) for _ in range(self.SLOTS)]
        self.events = [rt.new_event() for _ in range(self.SLOTS)]
        self.used = [False] * self.SLOTS
        self.next = 0

    def put(self, rows: int, fill):
        """fill(x, y) writes [rows, T] ids into host arrays; they reach the device's x / y in order
        with the stream's work."""
        s = self.next
        self.next = (s + 1) % self.SLOTS
        dev = self.rt.dev
        if self.used[s]:
            dev.event_sync(self.events[s])
        buf = self.bufs[s]
        fill(buf[0, :rows], buf[1, :rows])
        nbytes = rows * self.T * 4
        dev.htod_async(self.x.ptr, buf[0].ctypes.data, nbytes, self.rt.stream)
        dev.htod_async(self.y.ptr, buf[1].ctypes.data, nbytes, self.rt.stream)
        dev.record(self.events[s], self.rt.stream)
        self.used[s] = True
