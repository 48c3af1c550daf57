"""Measured GEMM dispatch: time the candidate plans of every GEMM a model runs, keep the fastest.

    summary = autotune(rt, cfg, vocab)    # the Engine's setup does it (config gemm_tune: auto)

Per product of the config (`tune_op`): the candidates the cost model keeps (`candidates_for`), timed paired
on the GPU (`EventTimer`) and checked against the cost model's choice (one that disagrees never wins); the
fastest goes into the GPU's table (table.py). An entry is never measured again, so a resumed run launches the
plans it launched. bench/tune.py is the command line over every shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from gptcuda.model.products import Pair, Product, pairs, products
from gptcuda.ops.cuda import elementwise
from gptcuda.runtime import DeviceView, compiler
from gptcuda.runtime.profile import (Arena, build_ahead, download_ends, fastest, graph_times_ms, rel_err,
                                     reps_for)
from gptcuda.ops.cuda.gemm.families import DUAL_PP_TILES, DUAL_TILES, EPI_IO, FAMILIES, dual_serves, epi_code
from gptcuda.ops.cuda.gemm.launch import matmul, matmul_batched, matmul_pair
from gptcuda.ops.cuda.gemm.plan import (dual_time, estimate_s, make_plan, pair_plan, plan, plan_label, prune_candidates,
                                        split_room, tune_candidates, wave_candidates, workspace)
from gptcuda.ops.cuda.gemm.table import APART, load_table, plan_to_json, save_table, table_key, table_path

PEAK_BYTES = 4.2e12


def floor_s(g: Product | Pair, ex) -> float:
    """Roofline floor (s): max(flops / ex's peak, DRAM bytes / PEAK_BYTES), each operand and [M, N] array once
    (a pair: its two products')."""
    if isinstance(g, Pair):
        return floor_s(g.w, ex) + floor_s(g.x, ex)
    flops = 2.0 * g.M * g.N * g.K * g.batch
    nbytes = 4.0 * g.batch * (g.M * g.K + g.K * g.N + EPI_IO[epi_code(g)] * g.M * g.N)
    return max(flops / (ex.peak_tflops * 1e12), nbytes / PEAK_BYTES)


def workspace_floats(cfg, vocab, ex=None) -> dict:
    """{name: floats} of the GEMM workspaces the memory plan gives this config (plan.workspace)."""
    return {name: math.prod(shape) for name, (shape, _) in
            workspace(dataclasses.replace(cfg, vocab_size=vocab), ex).items()}


def _out_dtype(g: Product, ex) -> str:
    """The dtype of C of product g: its own (Product.out), else the first that ex's base family writes for g's
    layout."""
    return g.out or (FAMILIES[ex.gemm_family].out_dtypes(g.ta, g.tb) or ("f32",))[0]


# the measured candidates of a product: the cost model's ranking only prunes. (It ranks the 128x128 ping-pong
# tile of GPT-2's bf16 qkv weight gradient, the fastest alone on the H200, 9th of 28; measured as the step
# runs it, with its column sums, it still loses to 128x256 split 2.)
KEEP, MAX_CANDIDATES = 1.6, 12


def candidates_for(g: Product, ex, sm_count=132, workspaces=None, keep=KEEP, max_n=MAX_CANDIDATES) -> tuple:
    """(cost-model plan, pruned candidate plans with it first) of product g under execution plan ex, within
    workspaces {name: floats} (workspace_floats): the modelled time within `keep` x the best, at most max_n."""
    workspaces = workspaces or {}
    ws = split_room(_out_dtype(g, ex), workspaces.get("gemm_splitk", 0), g)
    heur = plan(g, ex.gemm_family, ex.wgmma_mode, sm_count, ws, workspaces)
    cands = tune_candidates(g, ex.gemm_family, ex.wgmma_mode, ws, workspaces)
    kept = [heur] + [p for p in prune_candidates(cands, g, sm_count, keep, max_n) if p != heur]
    return heur, kept + [p for p in wave_candidates(cands, g, kept, sm_count) if p not in kept]


PAIR_SPLITS = 4        # a pair's candidates: every tile with dW split 1 .. PAIR_SPLITS ways (within the workspace)


def pair_candidates(pr: Pair, ex, sm_count=132, workspaces=None) -> list:
    """The candidates of a pair: the model's plan (pair_plan) first, the other tiles (the ping-pong ones too) and
    split counts, and APART (its two products as their own plans run them); [] where the kernel cannot pair
    them."""
    room = split_room("f32", (workspaces or {}).get("gemm_splitk", 0))
    model = pair_plan(pr.w, pr.x, sm_count, room)
    if model is None:
        return []
    others = [p for t in DUAL_TILES + DUAL_PP_TILES for s in range(1, PAIR_SPLITS + 1)
              if dual_serves(t, epi_code(pr.x), pr.w.colsum) and (p := make_plan("bf16", t, s, pr.w.K)) is not None
              and p != model and (s == 1 or s * pr.w.M * pr.w.N <= room)]
    return [model] + others + [APART]


def op_candidates(g: Product | Pair, ex, sm_count=132, workspaces=None, keep=KEEP, max_n=MAX_CANDIDATES) -> list:
    """The candidates the tuner times for a product (candidates_for's) or a pair (pair_candidates')."""
    if isinstance(g, Pair):
        return pair_candidates(g, ex, sm_count, workspaces)
    return candidates_for(g, ex, sm_count, workspaces, keep, max_n)[1]


def first_pair(g, results) -> bool:
    """g is the first pair after `results`: the products' winners must be saved before it is timed (its APART
    candidate runs them by the table)."""
    return isinstance(g, Pair) and not any(isinstance(r["op"], Pair) for r in results)


def estimate_ms(p, g: Product | Pair, ex, sm_count) -> float:
    """The model's milliseconds of plan p for a product or a pair (APART: its products by their model plans)."""
    if not isinstance(g, Pair):
        return estimate_s(p, g, sm_count) * 1e3
    if p == APART:
        return sum(estimate_s(plan(h, ex.gemm_family, ex.wgmma_mode, sm_count), h, sm_count) for h in (g.w, g.x)) * 1e3
    return dual_time(g.w, g.x, p.tile, p.splits, p.k_chunk, sm_count) * 1e3


def tune_op(g: Product | Pair, ex, timer, sm_count=132, workspaces=None, keep=KEEP, max_n=MAX_CANDIDATES,
            plans=None) -> dict:
    """Time product (or pair) g's candidates (`plans`, the cost model's first; default candidates_for's or
    pair_candidates') with timer(g, plans) -> (samples per plan [ms lists], ok per plan or None): the plans,
    their median times, which agreed, the winner (profile.fastest: ties go to the cost model's), the floor,
    the model's times."""
    if plans is None:
        plans = op_candidates(g, ex, sm_count, workspaces, keep, max_n)
    samples, ok = timer(g, plans)
    times, winner = fastest(samples, ok)
    return {"op": g, "plans": plans, "times_ms": times, "ok": ok, "winner": winner,
            "floor_ms": floor_s(g, ex) * 1e3, "est_ms": [estimate_ms(p, g, ex, sm_count) for p in plans]}


def table_entries(results, ex) -> dict:
    """{key: entry} of the winners (the plan, its time, the cost model's plan and time, the floor)."""
    return {table_key(ex.table_tag, r["op"]): {**plan_to_json(r["plans"][w]), "ms": round(r["times_ms"][w], 5),
                                               "heuristic_ms": round(r["times_ms"][0], 5),
                                               "heuristic": label(r["plans"][0]),
                                               "floor_ms": round(r["floor_ms"], 5), "label": r["op"].label}
            for r in results if (w := r["winner"]) is not None}


def label(p) -> str:
    """A plan's (or APART's) name in tables."""
    return APART if p == APART else plan_label(p)


def step_ms(results) -> tuple:
    """(cost model, winners): the GEMM milliseconds of one training step over these results' products (a pair's
    products are among them: its time would count them twice)."""
    prods = [r for r in results if not isinstance(r["op"], Pair)]
    return (sum(r["op"].count * r["times_ms"][0] for r in prods if math.isfinite(r["times_ms"][0])),
            sum(r["op"].count * r["times_ms"][r["winner"]] for r in prods if r["winner"] is not None))


# ---- timing candidates on the GPU --------------------------------------------------------
OUT, COLSUM = 2, 5           # the views `_views` makes that a product's launch writes (the others: inputs)
PAIR_OUTS = (3, 4, 5)        # ... a pair's: dx, dw, db


def _written(g) -> tuple:
    return PAIR_OUTS if isinstance(g, Pair) else (OUT, COLSUM)


def _outputs(g, vs) -> list:
    """The views a launch's output is checked by: a product's C, a pair's dx and dw."""
    return [vs[i] for i in PAIR_OUTS[:2]] if isinstance(g, Pair) else [vs[OUT]]


def _views(g: Product | Pair, ex, make) -> tuple:
    """(a, b, out, bias, aux, a_colsum) of g's launch under ex, each make(index, shape, dtype); None: g has none.
    A pair (w: dW = dY^T X, x: dX = dY W): (dy, x, w, dx, dw, db, aux)."""
    if isinstance(g, Pair):
        w, x = g.w, g.x
        specs = (((w.K, w.M), "bf16"), ((w.K, w.N), "bf16"), ((x.K, x.N), "bf16"), ((x.M, x.N), "bf16"),
                 ((w.M, w.N), w.out or "f32"), ((w.M,) if w.colsum else None, w.out or "f32"),
                 ((x.M, x.N) if x.epilogue != "none" else None, "bf16"))
        return tuple(None if shape is None else make(i, shape, dtype) for i, (shape, dtype) in enumerate(specs))
    fam, out = FAMILIES[ex.gemm_family], _out_dtype(g, ex)
    lead = (g.batch,) if g.batch > 1 else ()
    specs = ((lead + ((g.K, g.M) if g.ta else (g.M, g.K)), fam.dtype),
             (lead + ((g.N, g.K) if g.tb else (g.K, g.N)), fam.dtype), (lead + (g.M, g.N), out),
             ((g.N,) if g.bias else None, "f32"), ((g.M, g.N) if g.epilogue != "none" else None, out),
             ((g.M,) if g.colsum else None, g.out or "f32"))
    return tuple(None if shape is None else make(i, shape, dtype) for i, (shape, dtype) in enumerate(specs))


def _launch(rt, g: Product | Pair, p, *vs):
    if isinstance(g, Pair):          # APART: the two products by their own plans (the table's, else the model's)
        dy, x, w, dx, dw, db, aux = vs
        if p == APART:
            matmul(rt, dx, dy, w, False, False, epilogue=g.x.epilogue, aux=aux)
            matmul(rt, dw, dy, x, True, False, a_colsum=db)
        else:
            matmul_pair(rt, dx, dw, dy, x, w, db=db, epilogue=g.x.epilogue, aux=aux, plan=p)
        return
    a, b, out, bias, aux, colsum = vs
    if g.batch > 1:
        matmul_batched(rt, out, a, b, g.ta, g.tb, plan=p)
    else:
        matmul(rt, out, a, b, g.ta, g.tb, bias=bias, epilogue=g.epilogue, aux=aux, plan=p, a_colsum=colsum)


class EventTimer:
    """Times candidate plans of one product on the GPU: per candidate a CUDA graph of ~target_ms of launches,
    `rounds` rounds of one replay each in a rotated order between CUDA events (the same clocks for all),
    then one eager run each whose output is compared with the first's (check_floats: at most that many
    floats, the first and last halves; None: all). Operands are noise (profile.Arena). workspaces: {name:
    floats} lent to the launches."""

    def __init__(self, rt, workspaces: dict, rounds=7, target_ms=0.5, check=True, seed=0, check_floats=None):
        self.rt, self.rounds, self.target_ms, self.check, self.check_floats = rt, rounds, target_ms, check, check_floats
        self.bufs, self.lent = Arena(rt, "tune", seed), Arena(rt, "tune")     # a product's; the workspaces
        self.ws = {name: self.lent.empty((n,)) for name, n in workspaces.items() if n}

    def __call__(self, g: Product, plans):
        """(per plan its samples in ms, per plan whether its output agreed: None without the check)."""
        rt = self.rt
        old = rt.set_workspace({})
        try:
            vs = _views(g, rt.exec, lambda i, shape, dtype: (self.bufs.empty if i in _written(g) else
                                                             self.bufs.noise)(shape, dtype))
            # a colsum product's bias-gradient partials (elementwise.bias_grad's workspace, planned per config)
            w = g.w if isinstance(g, Pair) else g
            parts = {elementwise.WORKSPACE: self.bufs.empty((elementwise.MAX_CHUNKS * w.M,))} if w.colsum else {}
            rt.set_workspace({**old, **self.ws, **parts})
            reps = [reps_for(self.target_ms, estimate_ms(p, g, rt.exec, rt.info.sm_count)) for p in plans]
            samples = graph_times_ms(rt, [functools.partial(_launch, rt, g, p, *vs) for p in plans], reps, self.rounds,
                                     name="tune")
            return samples, self._agree(g, plans, vs) if self.check else None
        finally:
            rt.set_workspace(old)
            self.bufs.free()

    def _agree(self, g, plans, vs) -> list:
        """Whether each plan's output (one eager launch; a pair's two) is the first's within the execution plan's
        check_tolerance."""
        ok, ref = [], None
        for p in plans:
            _launch(self.rt, g, p, *vs)       # (GELU rewrites aux with the same pre-activation)
            got = [download_ends(self.rt, v, self.check_floats) for v in _outputs(g, vs)]
            ref = got if ref is None else ref
            ok.append(all(rel_err(a, b) < self.rt.exec.check_tolerance for a, b in zip(got, ref)))
        return ok

    def close(self):
        self.lent.free()
        self.ws = {}


# ---- the candidates' kernels, compiled in parallel before the timing ------------------------
def _prebuild(rt, ops, cands, workspaces, build, bar):
    """(candidate lists, how many were left out): the kernels the candidates' launches ask for (noted on views
    at fake addresses, nothing runs) compiled at once by `build` (profile.build_ahead); those that did not
    compile are left out, but the cost model's (first), which the run launches anyway (its error shows there)."""
    def fake(i, shape, dtype="f32"):
        return DeviceView((i + 1) << 38, tuple(shape), dtype, "x")

    lend = {**workspaces, elementwise.WORKSPACE: elementwise.MAX_CHUNKS * max((op.w if isinstance(op, Pair) else op).M
                                                                              for op in ops)}
    old = rt.set_workspace({name: fake(15 + i, (n,)) for i, (name, n) in enumerate(lend.items()) if n})
    try:
        runs = [functools.partial(_launch, rt, op, p, *_views(op, rt.exec, fake)) for op, plans in zip(ops, cands)
                for p in plans]
        ok = iter(build_ahead(rt, runs, build, lambda n: bar(total=n, desc=f"GEMM table: compiling {n} kernels",
                                                             leave=False)))
    finally:
        rt.set_workspace(old)
    out = [[p for i, (p, fine) in enumerate(zip(plans, ok)) if fine or i == 0] for plans in cands]
    return out, sum(map(len, cands)) - sum(map(len, out))


# ---- measuring a run's missing shapes ------------------------------------------------------
def tuned_ops(cfg, vocab, backward, ex) -> list:
    """What the table holds for a config: its products, then its pairs (which launch their products apart, so
    those are measured first)."""
    return products(cfg, vocab, backward, ex) + (pairs(cfg, vocab, ex) if backward else [])


def missing_ops(rt, cfg, vocab, backward=True) -> list:
    """The products and pairs of this config the table of rt's GPU lacks under rt's execution plan."""
    tag, have = rt.exec.table_tag, load_table(rt.info.name)
    return [op for op in tuned_ops(cfg, vocab, backward, rt.exec) if table_key(tag, op) not in have]


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


def autotune(rt, cfg, vocab, out=None, *, quiet=False, backward=True, timer=None, build=compiler.build_all,
             rounds=5, target_ms=0.3, keep=KEEP, max_n=MAX_CANDIDATES) -> TuneSummary | None:
    """Measure the GEMM products of this config that the table of rt's GPU lacks under rt's execution plan,
    in the workspaces the memory plan gives, and merge the winners into the table (an entry written
    meanwhile by another process stays). None when gemm_tune is not "auto"; nothing missing: returns at
    once, the GPU untouched. One progress line on `out` (default sys.stderr; quiet: none). timer:
    EventTimer's interface (tests); build: compiler.build_all's (None: each kernel when first launched)."""
    ex = rt.exec
    if ex.gemm_tune != "auto":
        return None
    t0 = time.perf_counter()
    name, sm = rt.info.name, rt.info.sm_count
    missing = missing_ops(rt, cfg, vocab, backward)
    known = len(tuned_ops(cfg, vocab, backward, ex)) - len(missing)
    path = str(table_path(name))
    if not missing:
        return TuneSummary(0, known, time.perf_counter() - t0, 0.0, 0.0, path)
    ws = workspace_floats(cfg, vocab, ex)
    cands = [op_candidates(op, ex, sm, ws, keep, max_n) for op in missing]
    # one progress line: the compiling phase's bar (cleared when done), then the measuring one's
    bar = functools.partial(tqdm, unit="", file=sys.stderr if out is None else out, dynamic_ncols=True, disable=quiet)
    cands, dropped = _prebuild(rt, missing, cands, ws, build, bar) if build is not None else (cands, 0)
    own, results = timer is None, []
    timer = timer or EventTimer(rt, ws, rounds=rounds, target_ms=target_ms, check_floats=1 << 22)
    try:
        with bar(total=len(missing), desc=f"GEMM table: measuring {ex.table_tag} shapes") as line:
            for op, plans in zip(missing, cands):
                if first_pair(op, results):
                    save_table(name, table_entries(results, ex), replace=False)   # (a pair's APART: the products'
                line.set_postfix_str(op.label, refresh=False)                    # winners)
                results.append(tune_op(op, ex, timer, sm, plans=plans))
                line.update()
            base, tuned = step_ms(results)
            line.set_postfix_str(f"cost model {base:.3f} -> tuned {tuned:.3f} ms a step", refresh=False)
    finally:
        if own:
            timer.close()
    save_table(name, table_entries(results, ex), replace=False)
    return TuneSummary(len(results), known, time.perf_counter() - t0, base, tuned, path, dropped)
