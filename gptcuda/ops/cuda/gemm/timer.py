"""Timing GEMM candidates on the GPU (gemm/tune.py's default timer): per candidate a CUDA graph of
repeated launches, rounds of one replay each in a rotated order between CUDA events, the median; each
candidate's output is checked against the first's (the cost model's)."""
from __future__ import annotations

import math

import numpy as np

from gptcuda.ops.cuda import elementwise
from gptcuda.runtime import DeviceView, bf16
from gptcuda.ops.cuda.gemm.families import AUX_EPILOGUES, FAMILIES
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched
from gptcuda.model.products import Product
from gptcuda.ops.cuda.gemm.plan import estimate_s

# random operands are uploaded as repeats of a block this long (a window of noise drawn once): no
# factor below 2048, so no two rows of a product repeat (a wrong row or k offset shows), and the
# host never holds a whole operand
_BLOCK = (1 << 22) - 3
OUT, COLSUM = 2, 5           # the views `views` makes that a launch writes (the others: inputs)


def views(g: Product, ex, make) -> tuple:
    """(a, b, out, bias, aux, a_colsum) of product g's launch, each make(index, shape, dtype) (None where g
    has none): under execution plan ex, A and B of its base family's operand type, C and aux of the type
    its kernels write for g's layout, the bias and a_colsum fp32."""
    fam = FAMILIES[ex.gemm_family]
    out = (fam.out_dtypes(g.ta, g.tb) or ("f32",))[0]
    lead = (g.batch,) if g.batch > 1 else ()
    specs = ((lead + ((g.K, g.M) if g.ta else (g.M, g.K)), fam.dtype),
             (lead + ((g.N, g.K) if g.tb else (g.K, g.N)), fam.dtype), (lead + (g.M, g.N), out),
             ((g.N,) if g.bias else None, "f32"), ((g.M, g.N) if g.epilogue in AUX_EPILOGUES else None, out),
             ((g.M,) if g.colsum else None, "f32"))
    return tuple(None if shape is None else make(i, shape, dtype) for i, (shape, dtype) in enumerate(specs))


def launch(rt, g: Product, p, a, b, out, bias, aux, colsum):
    """Launch (or record) product g by plan p on these views."""
    if g.batch > 1:
        matmul_batched(rt, out, a, b, g.ta, g.tb, plan=p)
    else:
        matmul(rt, out, a, b, g.ta, g.tb, bias=bias, epilogue=g.epilogue, aux=aux, plan=p, a_colsum=colsum)


class EventTimer:
    """Times candidate plans of one product on the GPU: per candidate a CUDA graph of launches (enough
    for ~target_ms), `rounds` rounds of one replay each in a rotated order between CUDA events (so every
    candidate sees the same clocks and temperature), then one eager run each whose output is compared
    with the first's (check_floats: at most that many floats of it, the first and last halves; None:
    all). workspaces: {name: floats} of the GEMM workspaces to lend the launches (the memory plan's
    sizes); rt's own are restored after each product. close() frees them."""

    def __init__(self, rt, workspaces: dict, rounds=7, target_ms=0.5, check=True, seed=0, check_floats=None):
        self.rt, self.rounds, self.target_ms, self.check, self.check_floats = rt, rounds, target_ms, check, check_floats
        self.rng = np.random.default_rng(seed)
        self.noise = self.rng.standard_normal(2 * _BLOCK, dtype=np.float32)    # drawn once: each operand a window
        self.ws = {name: self._alloc((n,)) for name, n in workspaces.items() if n}

    def _alloc(self, shape, dtype="f32"):
        v = DeviceView(0, tuple(int(s) for s in shape), dtype, "tune")
        return DeviceView(self.rt.dev.malloc(max(1, v.nbytes)), v.shape, dtype, "tune")

    def _upload(self, shape, dtype="f32"):
        v = self._alloc(shape, dtype)
        start = int(self.rng.integers(_BLOCK))
        block = self.noise[start:start + min(v.numel, _BLOCK)]
        block = bf16.bits(block) if dtype == "bf16" else block
        for off in range(0, v.numel, _BLOCK):
            m = min(_BLOCK, v.numel - off)
            self.rt.write(DeviceView(v.ptr + v.itemsize * off, (m,), dtype, "tune"), block[:m])
        return v

    def _result(self, out) -> np.ndarray:
        n, lim = out.numel, self.check_floats
        if lim is None or n <= lim:
            got = self.rt.download(out).reshape(-1)
        else:
            got = np.concatenate([self.rt.download(DeviceView(out.ptr + out.itemsize * at, (lim // 2,), out.dtype,
                                                               "part")) for at in (0, n - lim // 2)])
        return bf16.values(got) if out.dtype == "bf16" else got

    def __call__(self, g: Product, plans):
        """(per plan its samples in ms, per plan whether its output agreed: None without the check)."""
        rt, dev = self.rt, self.rt.dev
        bufs, graphs, evs = [], [], []

        def make(i, shape, dtype):
            bufs.append((self._alloc if i in (OUT, COLSUM) else self._upload)(shape, dtype))
            return bufs[-1]

        old = rt.set_workspace({})
        try:
            vs = views(g, rt.exec, make)
            # a colsum product's bias-gradient partials (elementwise.bias_grad's workspace, planned per config)
            parts = [self._alloc((elementwise.MAX_CHUNKS * g.M,))] if g.colsum else []
            bufs += parts
            rt.set_workspace({**old, **self.ws, **{elementwise.WORKSPACE: v for v in parts}})
            reps = [int(min(64, max(1, math.ceil(self.target_ms / max(estimate_s(p, g, rt.info.sm_count) * 1e3,
                                                                            1e-4))))) for p in plans]
            for p, n in zip(plans, reps):
                prog = rt.begin("tune")
                try:
                    for _ in range(n):
                        launch(rt, g, p, *vs)
                finally:
                    rt.end()
                graphs.append(rt.capture(prog))
            for graph in graphs:                   # warm-up (module load, clocks)
                graph.launch()
            rt.synchronize()
            for r in range(self.rounds):
                for i in [(i + r) % len(plans) for i in range(len(plans))]:
                    e0, e1 = dev.event(), dev.event()
                    evs.append((i, e0, e1))
                    dev.record(e0, rt.stream)
                    graphs[i].launch()
                    dev.record(e1, rt.stream)
            rt.synchronize()
            samples = [[] for _ in plans]
            for i, e0, e1 in evs:
                samples[i].append(dev.elapsed_ms(e0, e1) / reps[i])
            return samples, self._agree(g, plans, vs) if self.check else None
        finally:
            rt.synchronize()
            for graph in graphs:
                graph.destroy()
            for _, e0, e1 in evs:
                dev.event_destroy(e0), dev.event_destroy(e1)
            rt.set_workspace(old)
            for v in [v for v in bufs if v is not None]:
                dev.free(v.ptr)

    def _agree(self, g, plans, vs) -> list:
        """Whether each plan's output, from one eager launch, is the first's to within the execution
        plan's check_tolerance (TF32: the wgmma kernel truncates operands to tf32 where mma.sync rounds
        them, ~1e-3 apart; fp32: SIMT and 3xTF32 ~1e-7)."""
        ok, ref = [], None
        for p in plans:
            launch(self.rt, g, p, *vs)       # (GELU rewrites aux with the same pre-activation)
            got = self._result(vs[OUT])
            if ref is None:
                ref = got.astype(np.float64)
                scale = max(float(np.max(np.abs(ref))), 1e-30)
            err = float(np.max(np.abs(got - ref))) / scale if np.all(np.isfinite(got)) else math.inf
            ok.append(err < self.rt.exec.check_tolerance)
        return ok

    def close(self):
        for v in self.ws.values():
            self.rt.dev.free(v.ptr)
        self.ws = {}
