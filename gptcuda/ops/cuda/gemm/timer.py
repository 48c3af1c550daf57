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
from gptcuda.ops.cuda.gemm.plan import estimate_s

# random operands are uploaded as repeats of a block this long (a window of noise drawn once): no
# factor below 2048, so no two rows of a product repeat (a wrong row or k offset shows), and the
# host never holds a whole operand
_BLOCK = (1 << 22) - 3


def _operand_shapes(op):
    """Shapes of (a, b, out, bias or None, aux or None, a_colsum or None) as the op's launch takes them."""
    lead = (op.batch,) if op.batch > 1 else ()
    return (lead + ((op.K, op.M) if op.ta else (op.M, op.K)), lead + ((op.N, op.K) if op.tb else (op.K, op.N)),
            lead + (op.M, op.N), (op.N,) if op.bias else None,
            (op.M, op.N) if op.epilogue in AUX_EPILOGUES else None, (op.M,) if op.colsum else None)


def _operand_dtypes(op, ex):
    """The dtypes of _operand_shapes' views under execution plan ex: A and B of its base family's
    operand type, C (and aux) of the type its kernels write for the layout, bias and a_colsum fp32."""
    fam = FAMILIES[ex.gemm_family]
    out = (fam.out_dtypes(op.ta, op.tb) or ("f32",))[0]
    return fam.dtype, fam.dtype, out, "f32", out, "f32"


def _launch(rt, op, p, a, b, out, bias, aux, colsum=None):
    """Launch (or record) op with plan p."""
    if op.batch > 1:
        matmul_batched(rt, out, a, b, op.ta, op.tb, plan=p)
    else:
        matmul(rt, out, a, b, op.ta, op.tb, bias=bias, epilogue=op.epilogue, aux=aux, plan=p, a_colsum=colsum)


class EventTimer:
    """Times candidate plans of one op on the GPU: per candidate a CUDA graph of `reps` launches,
    `rounds` rounds of one replay each in a rotated order between CUDA events (so every candidate
    sees the same clocks and temperature), then one eager run each whose output is compared
    (check_floats: at most that many floats of it, the first and last halves; None: all). close()
    frees the workspaces; rt's planned workspaces are restored after each op."""

    def __init__(self, rt, ws_floats, rounds=7, target_ms=0.5, check=True, seed=0, scratch=None, check_floats=None):
        self.rt, self.rounds, self.target_ms, self.check, self.check_floats = rt, rounds, target_ms, check, check_floats
        self.rng = np.random.default_rng(seed)
        self.noise = self.rng.standard_normal(2 * _BLOCK, dtype=np.float32)    # drawn once: each operand a window
        self.ws = self._alloc((max(ws_floats, 1),)) if ws_floats else None
        self.scratch = {name: self._alloc((n,)) for name, n in (scratch or {}).items() if n}

    def _alloc(self, shape, dtype="f32"):
        v = DeviceView(0, tuple(int(s) for s in shape), dtype, "tune")
        return DeviceView(self.rt.dev.malloc(max(1, v.nbytes)), v.shape, dtype, "tune")

    def _upload(self, shape, dtype="f32"):
        v = self._alloc(shape, dtype)
        n = v.numel
        start = int(self.rng.integers(_BLOCK))
        block = self.noise[start:start + min(n, _BLOCK)]
        block = bf16.bits(block) if dtype == "bf16" else block
        for off in range(0, n, _BLOCK):
            m = min(_BLOCK, n - off)
            self.rt.write(DeviceView(v.ptr + v.itemsize * off, (m,), dtype, "tune"), block[:m])
        return v

    def _result(self, out) -> np.ndarray:
        n, lim = out.numel, self.check_floats
        if lim is None or n <= lim:
            parts = [self.rt.download(out).reshape(-1)]
        else:
            h = lim // 2
            parts = [self.rt.download(DeviceView(out.ptr + out.itemsize * at, (h,), out.dtype, "part"))
                     for at in (0, n - h)]
        got = np.concatenate(parts)
        return bf16.values(got) if out.dtype == "bf16" else got

    def __call__(self, op, plans):
        rt, dev = self.rt, self.rt.dev
        bufs, graphs, evs = [], [], []
        old_ws = dict(rt._workspace)
        destroy = getattr(getattr(dev, "drv", None), "cuEventDestroy", None)
        try:
            makes = (self._upload, self._upload, self._alloc, self._upload, self._upload, self._alloc)
            for shape, dtype, make in zip(_operand_shapes(op), _operand_dtypes(op, rt.exec), makes):
                bufs.append(make(shape, dtype) if shape is not None else None)
            views = tuple(bufs)
            # a colsum op's bias-gradient partials (elementwise.bias_grad's workspace, planned per config)
            parts = {}
            if op.colsum:
                bufs.append(self._alloc((elementwise.MAX_CHUNKS * op.M,)))
                parts = {elementwise.WORKSPACE: bufs[-1]}
            rt.set_workspace({**old_ws, **({"gemm_splitk": self.ws} if self.ws is not None else {}), **self.scratch,
                              **parts})
            reps = []
            for p in plans:
                e = estimate_s(p, op.M, op.N, op.K, op.batch, op.epi, rt.info.sm_count, op.colsum) * 1e3
                n = int(min(64, max(1, math.ceil(self.target_ms / max(e, 1e-4)))))
                prog = rt.begin("tune")
                try:
                    for _ in range(n):
                        _launch(rt, op, p, *views)
                finally:
                    rt.end()
                graphs.append(rt.capture(prog))
                reps.append(n)
            for g in graphs:                       # warm-up (module load, clocks)
                g.launch()
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
            ok = None
            if self.check:
                ok, ref = [], None
                for p in plans:
                    _launch(rt, op, p, *views)     # (GELU rewrites aux with the same pre-activation)
                    got = self._result(views[2])
                    if ref is None:
                        ref = got.astype(np.float64)
                        scale = max(float(np.max(np.abs(ref))), 1e-30)
                    err = float(np.max(np.abs(got - ref))) / scale if np.all(np.isfinite(got)) else math.inf
                    # TF32: the wgmma kernel truncates operands to tf32 where mma.sync rounds them,
                    # so two correct candidates differ by up to ~1e-3 (tests/gpu/test_gemm.py TOL);
                    # fp32: SIMT and 3xTF32 agree to ~1e-7
                    ok.append(err < rt.exec.check_tolerance)
            return samples, ok
        finally:
            rt.synchronize()
            for g in graphs:
                g.destroy()
            for _, e0, e1 in evs if destroy is not None else ():
                destroy(e0), destroy(e1)
            rt.set_workspace(old_ws)
            for v in [v for v in bufs if v is not None]:
                dev.free(v.ptr)

    def close(self):
        for v in [v for v in (self.ws, *self.scratch.values()) if v is not None]:
            self.rt.dev.free(v.ptr)
        self.ws, self.scratch = None, {}
