"""Measured GEMM dispatch: time the candidate plans of every GEMM a model runs, keep the fastest.

    summary = autotune(rt, cfg, vocab)    # the Engine's setup does it (config gemm_tune: auto)

Per shape of the config (`model_gemms`, with transposes, epilogue and bias; `tune_op`): the
candidates (`candidates_for`: the base family's tiles x the split-K counts the planned workspace
holds, and the warpgroup-MMA tiles through the planned scratch where they run), pruned by the cost
model (within `keep` x its best, at most `max_n`, its own choice first); timed paired (`EventTimer`:
timer.py: a CUDA graph per candidate, rounds replaying each once in a rotated order between
events, the median); checked against the cost model's choice (one that disagrees never wins); the fastest goes
into the GPU's table (table.py). `autotune` measures only what the table lacks (an entry is never
measured again: a resumed run launches the plans it launched), in a short window, the candidates'
kernels compiled in parallel first; bench/tune.py is the command line over every shape.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

from gptcuda.ops.cuda import elementwise
from gptcuda.runtime import Blob, DeviceView, Function, execution
from gptcuda.ops.cuda.gemm.families import EPI_BIAS, EPI_IO, EPILOGUE_CODES
from gptcuda.ops.cuda.gemm.layout import WGMMA_WORKSPACES, wgmma_layout
from gptcuda.ops.cuda.gemm.timer import EventTimer, _launch, _operand_dtypes, _operand_shapes  # noqa: F401 (EventTimer: bench/tune.py)
from gptcuda.ops.cuda.gemm.plan import (estimate_s, plan_label, prune_candidates, split_room, tune_candidates,
                                        workspace)
from gptcuda.ops.cuda.gemm.plan import plan as model_plan
from gptcuda.ops.cuda.gemm.table import load_table, plan_to_json, save_table, table_path, tune_key

PEAK_BYTES = 4.2e12


@dataclass(frozen=True)
class GemmOp:
    """One GEMM of the model: out[M, N] = op(a) @ op(b) (batched: `batch` of them)."""
    label: str
    M: int
    N: int
    K: int
    ta: bool
    tb: bool
    epilogue: str = "none"
    bias: bool = False
    batch: int = 1
    count: int = 1           # launches per training step (0: evaluation / alternative form only)
    colsum: bool = False     # a weight gradient that also gives its bias gradient (matmul's a_colsum)

    @property
    def epi(self) -> int:
        return EPI_BIAS if (self.epilogue == "none" and self.bias) else EPILOGUE_CODES[self.epilogue]

    @property
    def vec(self) -> bool:
        """16-byte operand loads possible (row strides lda, ldb and batch strides multiples of 4 floats)."""
        strides = [self.M if self.ta else self.K, self.K if self.tb else self.N]
        return all(s % 4 == 0 for s in strides + ([self.M * self.K, self.K * self.N] if self.batch > 1 else []))

    def key(self, tag) -> str:
        """The table key under a plan's table_tag."""
        return tune_key(tag, self.ta, self.tb, self.epilogue, self.bias, self.M, self.N, self.K, self.batch,
                        self.colsum)

    def trans(self) -> str:
        return ("T" if self.ta else "N") + ("T" if self.tb else "N")


def model_gemms(cfg, vocab_size: int, backward: bool = True, ex=None) -> list:
    """Every GEMM model/gpt.py records for this config (one entry per distinct key; counts summed);
    backward False: the forward's alone (a model that only evaluates); ex: the execution plan
    (default the config's)."""
    Ntok, C, V, L = cfg.batch_size * cfg.block_size, cfg.n_embd, vocab_size, cfg.n_layer
    bias, drop = bool(cfg.bias), cfg.dropout > 0
    unfused = (ex or execution.resolve(cfg)).attention == "unfused"
    T, H = cfg.block_size, cfg.n_head
    hs, BH = C // H, cfg.batch_size * H
    ops = []

    def add(*a, **k):
        ops.append(GemmOp(*a, **k))

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
        add("dW fcproj", C, 4 * C, Ntok, True, False, count=L, colsum=bias)
        add("dX fcproj +dgelu", Ntok, 4 * C, C, False, False, "dgelu", count=L)
        add("dX fcproj", Ntok, 4 * C, C, False, False, count=0)          # the unfused form (+ gelu_bwd)
        add("dW fc", 4 * C, C, Ntok, True, False, count=L, colsum=bias)
        add("dX fc", Ntok, C, 4 * C, False, False, count=L)
        add("dX attn proj", Ntok, C, C, False, False, count=L)
        add("dW attn proj", C, C, Ntok, True, False, count=L, colsum=bias)
        add("dX qkv", Ntok, C, 3 * C, False, False, count=L)
        add("dW qkv", 3 * C, C, Ntok, True, False, count=L, colsum=bias)
        if unfused:
            add("att dv", T, hs, T, True, False, batch=BH, count=L)
            add("att dP", T, T, hs, False, True, batch=BH, count=L)
            add("att dq", T, hs, T, False, False, batch=BH, count=L)
            add("att dk", T, hs, T, True, False, batch=BH, count=L)
    merged = {}
    for op in ops:
        old = merged.get(op.key("x"))
        merged[op.key("x")] = op if old is None else dataclasses.replace(old, label=old.label + " / " + op.label,
                                                                         count=old.count + op.count)
    return list(merged.values())


def floor_s(op: GemmOp, ex) -> float:
    """Roofline floor: max(flops / peak, DRAM bytes / bandwidth), each operand and [M, N] array once;
    the peak of what multiplies in execution plan ex."""
    flops = 2.0 * op.M * op.N * op.K * op.batch
    nbytes = 4.0 * op.batch * (op.M * op.K + op.K * op.N + EPI_IO[op.epi] * op.M * op.N)
    return max(flops / (ex.peak_tflops * 1e12), nbytes / PEAK_BYTES)


def candidates_for(op: GemmOp, ex, sm_count: int, ws_floats: int, keep=1.6, max_n=6, scratch=None):
    """(cost-model plan, pruned candidate plans with it first) under execution plan ex: its base
    family, and where it runs the warpgroup-MMA kernels (`wgmma_layout`) those too, for the ops they can
    run (scratch: floats of the planned workspaces they re-lay operands out in, {name: floats})."""
    mode = wgmma_layout(ex.wgmma_mode, op.ta, op.tb, op.vec, op.K, op.batch)
    fam, scratch = ex.gemm_family, scratch or {}
    ws_floats = split_room(_operand_dtypes(op, ex)[2], ws_floats)
    heur = model_plan(op.M, op.N, op.K, op.batch, sm_count, fam, max_ws=ws_floats if op.batch == 1 else 0,
                      allow_split=op.batch == 1, vec=op.vec, epi=op.epi, wgmma=mode, colsum=op.colsum, scratch=scratch)
    cands = tune_candidates(op.M, op.N, op.K, op.batch, fam, op.vec, ws_floats, wgmma=mode, epi=op.epi, scratch=scratch)
    pruned = prune_candidates(cands, op.M, op.N, op.K, op.batch, op.epi, sm_count, keep=keep, max_n=max_n,
                              always=[heur], colsum=op.colsum)
    return heur, [heur] + [p for p in pruned if p != heur]


def rounds_median(samples: list) -> float:
    return statistics.median(samples) if samples else math.inf


def pick_winner(plans, times_ms, ok=None):
    """Index of the fastest candidate whose output agreed (ties: the earlier, i.e. the cost model's)."""
    fine = [i for i, t in enumerate(times_ms) if math.isfinite(t) and (ok is None or ok[i])]
    return min(fine, key=lambda i: times_ms[i]) if fine else None


def tune_op(op: GemmOp, ex, timer, sm_count=132, ws_floats=0, keep=1.6, max_n=6, scratch=None, plans=None):
    """Time one op's candidates (`plans`, the cost model's first; default candidates_for's) under
    execution plan ex with timer(op, plans) -> (samples per plan [ms lists], ok per plan or None);
    returns a result dict."""
    if plans is None:
        plans = candidates_for(op, ex, sm_count, ws_floats, keep, max_n, scratch)[1]
    samples, ok = timer(op, plans)
    times = [rounds_median(s) for s in samples]
    w = pick_winner(plans, times, ok)
    return {"op": op, "plans": plans, "times_ms": times, "ok": ok, "winner": w,
            "floor_ms": floor_s(op, ex) * 1e3,
            "est_ms": [estimate_s(p, op.M, op.N, op.K, op.batch, op.epi, sm_count, op.colsum) * 1e3 for p in plans]}


def table_entries(results, ex) -> dict:
    """{key: entry} of the winners (the plan, its time, the cost model's plan and time, the floor)."""
    return {r["op"].key(ex.table_tag): {**plan_to_json(r["plans"][r["winner"]]),
                                     "ms": round(r["times_ms"][r["winner"]], 5),
                                     "heuristic_ms": round(r["times_ms"][0], 5), "heuristic": plan_label(r["plans"][0]),
                                     "floor_ms": round(r["floor_ms"], 5), "label": r["op"].label}
            for r in results if r["winner"] is not None}


def step_ms(results) -> tuple:
    """(cost model, winners): the GEMM milliseconds of one training step over these results."""
    return (sum(r["op"].count * r["times_ms"][0] for r in results if math.isfinite(r["times_ms"][0])),
            sum(r["op"].count * r["times_ms"][r["winner"]] for r in results if r["winner"] is not None))


def ws_floats_of(cfg, vocab, name="gemm_splitk", ex=None) -> int:
    """Floats of the GEMM workspace `name` the memory plan gives this config (0: none)."""
    ws = workspace(dataclasses.replace(cfg, vocab_size=vocab), ex)
    return int(np.prod(ws[name][0])) if name in ws else 0


def scratch_of(cfg, vocab, ex=None) -> dict:
    """{name: floats} of the warpgroup-MMA kernels' planned scratch (WGMMA_WORKSPACES)."""
    return {name: ws_floats_of(cfg, vocab, name, ex) for name in WGMMA_WORKSPACES}


# ---- the candidates' kernels, compiled in parallel before the timing ------------------------
class _Variants:
    """Stands in for the runtime while candidates' launches are planned: notes the kernel variants
    the launch code asks for, launches and allocates nothing."""

    def __init__(self, rt, workspaces: dict):
        self.exec, self.info, self.arch, self.asked = rt.exec, rt.info, rt.arch, []
        self._ws = {name: DeviceView((16 + i) << 38, (n,), "f32", name)
                    for i, (name, n) in enumerate(workspaces.items()) if n}

    def function(self, file, name, defines=None):
        self.asked.append((file, name, tuple(sorted((defines or {}).items())), self.arch))
        return Function(None, name, file)

    def launch(self, *a, **k):
        pass

    def tensor_map(self, *a, **k):
        return Blob(bytes(128))

    def workspace(self, name):
        return self._ws[name]

    def of(self, op: GemmOp, p) -> list:
        """The variants (file, name, sorted define items, arch) op's launch with plan p asks for."""
        self.asked = []
        if op.colsum:            # the bias-gradient partials a colsum op writes (as EventTimer provides)
            self._ws[elementwise.WORKSPACE] = DeviceView(15 << 38, (elementwise.MAX_CHUNKS * op.M,), "f32",
                                                         elementwise.WORKSPACE)
        _launch(self, op, p, *[DeviceView((i + 1) << 38, s, dt, "x") if s else None
                               for i, (s, dt) in enumerate(zip(_operand_shapes(op), _operand_dtypes(op, self.exec)))])
        return self.asked


def build_variants(jobs, progress=None) -> set:
    """Compile jobs, (file, name, defines, arch), into the kernel cache in a pool of worker processes
    (runtime/compiler.py build_in_background); the indices of those that did not compile."""
    from gptcuda.runtime import compiler
    if not jobs:
        return set()
    pool, futures = compiler.build_in_background(jobs, workers=min(len(jobs), compiler.default_workers()))
    failed = set()
    try:
        for i, f in enumerate(futures):
            if f.result():
                failed.add(i)
            if progress is not None:
                progress(i + 1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return failed


def _prebuild(rt, ops, cands, workspaces, build, line):
    """Compile the kernels of every candidate plan at once (`build`); candidates whose kernels did
    not compile are left out (the cost model's, first, stays: the run launches it anyway, and its
    error shows there). Returns the candidate lists and how many were left out."""
    stand_in = _Variants(rt, workspaces)
    needs = [[stand_in.of(op, p) for p in plans] for op, plans in zip(ops, cands)]
    jobs = list(dict.fromkeys(v for per in needs for vs in per for v in vs))
    line.phase(len(jobs), f"GEMM table: compiling {len(jobs)} kernels")
    bad = {jobs[i] for i in build([(f, n, dict(d), a) for f, n, d, a in jobs], line.show)}
    out = [[p for i, (p, vs) in enumerate(zip(plans, per)) if i == 0 or bad.isdisjoint(vs)]
           for plans, per in zip(cands, needs)]
    return out, sum(map(len, cands)) - sum(map(len, out))


# ---- measuring a run's missing shapes ------------------------------------------------------
def on_device(rt) -> bool:
    """rt drives a GPU: its device is the driver's (gptcuda.runtime.driver.Device). A test's stand-in
    runtime (a Runtime over a fake device, or a recording object) has none, and is never timed on."""
    from gptcuda.runtime.driver import Device
    return isinstance(getattr(rt, "dev", None), Device)


def missing_ops(rt, cfg, vocab, backward=True) -> list:
    """The ops of this config (model_gemms) the table of rt's GPU lacks under rt's execution plan."""
    tag, have = rt.exec.table_tag, load_table(rt.info.name)
    return [op for op in model_gemms(cfg, vocab, backward, rt.exec) if op.key(tag) not in have]


@dataclass
class TuneSummary:
    measured: int            # shapes timed now
    known: int               # shapes of the run the table had already
    seconds: float
    model_ms: float          # the measured shapes' GEMM time in a training step: the cost model's plans
    tuned_ms: float          # ... and the winners
    path: str                # the table's file
    dropped: int = 0         # candidates left out: their kernels did not compile

    def format(self) -> str:
        if not self.measured:
            return f"GEMM table: the {self.known} shapes of this run are measured ({self.path})"
        drop = f"; {self.dropped} candidates left out, their kernels did not compile" if self.dropped else ""
        return (f"GEMM table: measured {self.measured} shapes in {self.seconds:.1f} s ({self.known} known); a "
                f"step's GEMMs of those: cost model {self.model_ms:.3f} ms -> tuned {self.tuned_ms:.3f} ms "
                f"({self.path}){drop}")


class _Line:
    """One progress line that updates, phase by phase: tqdm's bar where tqdm is installed, else a
    carriage-return line; nothing when out is None."""

    def __init__(self, out):
        self.out, self.bar, self.total, self.desc = out, None, 0, ""

    def phase(self, total, desc):
        self.total, self.desc = total, desc
        if self.out is not None and self.bar is None:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, desc=desc, unit="", file=self.out, dynamic_ncols=True)
            except ImportError:
                self.bar = False
        elif self.bar:
            self.bar.reset(total=total)
            self.bar.set_description_str(desc)
        self.show(0)

    def show(self, n, note=""):
        if self.bar:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n - self.bar.n)
        elif self.bar is False:
            self.out.write(f"\r{self.desc}: {n}/{self.total} {note}"[:119].ljust(119))
            self.out.flush()

    def close(self, note=""):
        if self.bar is not None:
            self.show(self.total, note)
            self.bar.close() if self.bar else self.out.write("\n")


def autotune(rt, cfg, vocab, out=None, *, quiet=False, backward=True, timer=None, build=build_variants,
             rounds=5, target_ms=0.3, keep=1.6, max_n=6) -> TuneSummary | None:
    """Measure the GEMMs of this config (model_gemms) that the table of rt's GPU lacks, at the
    precision and with the warpgroup-MMA kernels the runtime's execution plan resolved and the
    workspaces the memory plan gives, and merge the winners into the table (an entry written
    meanwhile by another process stays). None when the plan's gemm_tune is not "auto"; with
    nothing missing it returns at once, the GPU untouched. One progress line on `out` (default
    sys.stderr; quiet: none). timer: EventTimer's interface (tests); build: compiles the
    candidates' kernels (build_variants's interface; None: each when first launched). The timing
    buffers are freed and rt's workspaces restored."""
    ex = rt.exec
    if ex.gemm_tune != "auto":
        return None
    t0 = time.perf_counter()
    name, sm = rt.info.name, rt.info.sm_count
    missing = missing_ops(rt, cfg, vocab, backward)
    known = len(model_gemms(cfg, vocab, backward, ex)) - len(missing)
    path = str(table_path(name))
    if not missing:
        return TuneSummary(0, known, time.perf_counter() - t0, 0.0, 0.0, path)
    ws, scratch = ws_floats_of(cfg, vocab, ex=ex), scratch_of(cfg, vocab, ex)
    cands = [candidates_for(op, ex, sm, ws, keep, max_n, scratch)[1] for op in missing]
    line = _Line(None if quiet else sys.stderr if out is None else out)
    results, dropped, own = [], 0, timer is None
    try:
        if build is not None:
            cands, dropped = _prebuild(rt, missing, cands, {"gemm_splitk": ws, **scratch}, build, line)
        line.phase(len(missing), f"GEMM table: measuring {ex.table_tag} shapes")
        if own:
            timer = EventTimer(rt, ws, rounds=rounds, target_ms=target_ms, scratch=scratch, check_floats=1 << 22)
        for i, (op, plans) in enumerate(zip(missing, cands)):
            line.show(i, op.label)
            results.append(tune_op(op, ex, timer, sm, plans=plans))
    finally:
        if own and timer is not None:
            timer.close()
        base, tuned = step_ms(results)
        line.close(f"cost model {base:.3f} -> tuned {tuned:.3f} ms a step" if results else "")
    save_table(name, table_entries(results, ex), merge=True, replace=False)
    return TuneSummary(len(results), known, time.perf_counter() - t0, base, tuned, path, dropped)
