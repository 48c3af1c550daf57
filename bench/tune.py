"""Measured GEMM dispatch: time the candidate plans of every GEMM the model runs, keep the fastest.

    python bench/tune.py CONFIG [--key=value ...] [--rounds 7] [--keep 1.6] [--max_candidates 6]
                                [--target_ms 0.5] [--only SUBSTRING] [--dry_run] [--no_save] [--json F]

The shapes come from the config: N = batch_size * block_size tokens, C, 3C, 4C and the vocabulary
V (every matmul of model.py's forward and backward with its transposes, epilogue and bias, the
eval forward's residual epilogue, the MLP backward both as "none" and fused "dgelu", and the
unfused attention's batched GEMMs). For each shape:

  1. candidates: every tile of the precision's kernel family x every split-K count that fits the
     workspace memory.py plans (gemm.workspace(cfg)) (gemm.tune_candidates); on sm_90 the wgmma
     tiles too, through the planned scratch where a layout needs it (B^T in gemm_bT; the weight
     gradients' A^T and B^T in gemm_aT, in k slabs where it cannot hold all of K);
  2. pruned by the cost model (roofline + occupancy + waves, gemm.estimate_s): those within
     --keep x the best estimate, at most --max_candidates, plus the cost model's own choice;
  3. timed paired in one window: each candidate's launches are captured back to back in a CUDA
     graph (enough of them for ~--target_ms), then --rounds rounds replay every graph once, in
     an order rotated each round, between CUDA events; a candidate's time is its median;
  4. checked: every candidate's output is compared with the cost model's choice (a candidate that
     disagrees is reported and never wins);
  5. the fastest wins; the table {key: plan} is written under the compile cache
     (<GPTCUDA_CACHE>/tune/<gpu>-<source hash>.json, gemm.table_path), where gemm.matmul finds it.

Printed per shape: every candidate's time, its distance from the roofline floor (time / floor,
floor = max(flops / peak, bytes / bandwidth), peaks 495 TF32 / 67 fp32 TFLOP/s dense, 4.2 TB/s),
and the winner; at the end the step's GEMM time with the cost model's plans and the winners.
--dry_run lists the shapes and the pruned candidates without a GPU.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gptcuda.ops.cuda import gemm  # noqa: E402

PEAK_FLOPS = {"tf32": 495e12, "fp32": 67e12}     # H200 dense
PEAK_BYTES = 4.2e12
FAMILY = {"tf32": "tf32", "fp32": "simt"}


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

    @property
    def epi(self) -> int:
        return gemm.EPI_BIAS if (self.epilogue == "none" and self.bias) else gemm.EPILOGUE_CODES[self.epilogue]

    @property
    def lda(self):
        return self.M if self.ta else self.K

    @property
    def ldb(self):
        return self.K if self.tb else self.N

    @property
    def vec(self) -> bool:
        """16-byte operand loads possible (row and batch strides multiples of 4 floats)."""
        strides = [self.lda, self.ldb] + ([self.M * self.K, self.K * self.N] if self.batch > 1 else [])
        return all(s % 4 == 0 for s in strides)

    def key(self, precision) -> str:
        return gemm.tune_key(precision, self.ta, self.tb, self.epilogue, self.bias, self.M, self.N, self.K,
                             self.batch)

    def trans(self) -> str:
        return ("T" if self.ta else "N") + ("T" if self.tb else "N")


def model_gemms(cfg, vocab_size: int) -> list:
    """Every GEMM model.py records for this config (one entry per distinct key; counts summed)."""
    Ntok, C, V, L = cfg.batch_size * cfg.block_size, cfg.n_embd, vocab_size, cfg.n_layer
    bias, drop = bool(cfg.bias), cfg.dropout > 0
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
    # backward
    add("dX head", Ntok, C, V, False, False, count=1)
    add("dW wte", V, C, Ntok, True, False, count=1)
    add("dW fcproj", C, 4 * C, Ntok, True, False, count=L)
    add("dX fcproj +dgelu", Ntok, 4 * C, C, False, False, "dgelu", count=L)
    add("dX fcproj", Ntok, 4 * C, C, False, False, count=0)          # the unfused form (+ gelu_bwd)
    add("dW fc", 4 * C, C, Ntok, True, False, count=L)
    add("dX fc", Ntok, C, 4 * C, False, False, count=L)
    add("dX attn proj", Ntok, C, C, False, False, count=L)
    add("dW attn proj", C, C, Ntok, True, False, count=L)
    add("dX qkv", Ntok, C, 3 * C, False, False, count=L)
    add("dW qkv", 3 * C, C, Ntok, True, False, count=L)
    if getattr(cfg, "attention", "unfused") == "unfused":
        T, H = cfg.block_size, cfg.n_head
        hs, BH = C // H, cfg.batch_size * H
        add("att scores", T, T, hs, False, True, batch=BH, count=L)
        add("att y", T, hs, T, False, False, batch=BH, count=L)
        add("att dv", T, hs, T, True, False, batch=BH, count=L)
        add("att dP", T, T, hs, False, True, batch=BH, count=L)
        add("att dq", T, hs, T, False, False, batch=BH, count=L)
        add("att dk", T, hs, T, True, False, batch=BH, count=L)
    merged = {}
    for op in ops:
        k = op.key("x")
        if k in merged:
            old = merged[k]
            merged[k] = GemmOp(old.label + " / " + op.label, old.M, old.N, old.K, old.ta, old.tb, old.epilogue,
                               old.bias, old.batch, old.count + op.count)
        else:
            merged[k] = op
    return list(merged.values())


def floor_s(op: GemmOp, precision: str) -> float:
    """Roofline floor: max(flops / peak, DRAM bytes / bandwidth), each operand and [M, N] array once."""
    flops = 2.0 * op.M * op.N * op.K * op.batch
    io = gemm.EPI_IO[op.epi]
    nbytes = 4.0 * op.batch * (op.M * op.K + op.K * op.N + io * op.M * op.N)
    return max(flops / PEAK_FLOPS[precision], nbytes / PEAK_BYTES)


def candidates_for(op: GemmOp, precision: str, sm_count: int, ws_floats: int, keep=1.6, max_n=6,
                   wgmma=False, scratch=None):
    """(cost-model plan, pruned candidate plans with it first); wgmma: the device runs the
    warpgroup-MMA kernels (sm_90), so they compete for the ops they can run (scratch: floats of
    the planned workspaces they need, {name: floats})."""
    mode = wgmma and gemm.wgmma_layout_mode(precision, op.ta, op.tb, op.vec, op.M, op.N, op.K, op.batch,
                                            scratch or {})
    if op.batch > 1 and mode != "direct":      # matmul_batched re-lays nothing out
        mode = False
    slab = 0                                   # transpose_a: k rows per slab of "gemm_aT" (0: all of K)
    if mode in ("transpose_ab", "transpose_a"):
        slab = gemm.transpose_a_slab(op.M, op.N, op.K, op.tb, (scratch or {}).get("gemm_aT", 0))
        slab = 0 if slab >= op.K else slab
    fam = FAMILY[precision]
    heur = gemm.plan(op.M, op.N, op.K, op.batch, sm_count, fam, max_ws=ws_floats if op.batch == 1 else 0,
                     allow_split=op.batch == 1, vec=op.vec, epi=op.epi, wgmma=mode, k_slab=slab)
    cands = gemm.tune_candidates(op.M, op.N, op.K, op.batch, fam, op.vec, ws_floats, wgmma=mode, epi=op.epi,
                                 k_slab=slab)
    pruned = gemm.prune_candidates(cands, op.M, op.N, op.K, op.batch, op.epi, sm_count, keep=keep,
                                   max_n=max_n, always=[heur])
    return heur, [heur] + [p for p in pruned if p != heur]


def rounds_median(samples: list) -> float:
    return statistics.median(samples) if samples else math.inf


def pick_winner(plans, times_ms, ok=None):
    """Index of the fastest candidate whose output agreed (ties: the earlier, i.e. the cost model's)."""
    best = None
    for i, t in enumerate(times_ms):
        if ok is not None and not ok[i]:
            continue
        if not math.isfinite(t):
            continue
        if best is None or t < times_ms[best]:
            best = i
    return best


def tune_op(op: GemmOp, precision: str, timer, sm_count=132, ws_floats=0, keep=1.6, max_n=6, wgmma=False,
            scratch=None):
    """Time one op's candidates with timer(op, plans) -> (samples per plan [ms lists], ok per plan
    or None); returns a result dict."""
    heur, plans = candidates_for(op, precision, sm_count, ws_floats, keep, max_n, wgmma, scratch)
    samples, ok = timer(op, plans)
    times = [rounds_median(s) for s in samples]
    w = pick_winner(plans, times, ok)
    return {"op": op, "plans": plans, "times_ms": times, "ok": ok, "winner": w,
            "floor_ms": floor_s(op, precision) * 1e3,
            "est_ms": [gemm.estimate_s(p, op.M, op.N, op.K, op.batch, op.epi, sm_count) * 1e3 for p in plans]}


def table_entries(results, precision) -> dict:
    out = {}
    for r in results:
        if r["winner"] is None:
            continue
        op, p = r["op"], r["plans"][r["winner"]]
        e = gemm.plan_to_json(p)
        e.update({"ms": round(r["times_ms"][r["winner"]], 5), "heuristic_ms": round(r["times_ms"][0], 5),
                  "heuristic": gemm.plan_label(r["plans"][0]), "floor_ms": round(r["floor_ms"], 5),
                  "label": op.label})
        out[op.key(precision)] = e
    return out


# ---------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------
def print_result(r, file=sys.stdout):
    op = r["op"]
    head = (f"{op.label}: {op.M}x{op.N}x{op.K}" + (f" batch {op.batch}" if op.batch > 1 else "") +
            f" {op.trans()} {op.epilogue}{'+bias' if op.bias else ''}"
            f"  floor {r['floor_ms']:.4f} ms  x{op.count}/step")
    print(head, file=file)
    for i, p in enumerate(r["plans"]):
        t = r["times_ms"][i]
        mark = " <- winner" if i == r["winner"] else ""
        if i == 0:
            mark += " (cost model)"
        if r["ok"] is not None and not r["ok"][i]:
            mark += " MISMATCH"
        ts = f"{t:9.4f} ms {t / r['floor_ms']:6.2f}x floor" if math.isfinite(t) else f"{'-':>9}    {'':>13}"
        print(f"    {gemm.plan_label(p):<26} model {r['est_ms'][i]:8.4f} ms  {ts}{mark}", file=file)


def print_summary(results, file=sys.stdout):
    base = sum(r["op"].count * r["times_ms"][0] for r in results if math.isfinite(r["times_ms"][0]))
    tuned = sum(r["op"].count * r["times_ms"][r["winner"]] for r in results if r["winner"] is not None)
    floor = sum(r["op"].count * r["floor_ms"] for r in results)
    print(f"\nGEMMs of one training step: cost model {base:.3f} ms, tuned {tuned:.3f} ms "
          f"({(1 - tuned / base) * 100 if base else 0:.1f}% less), roofline floor {floor:.3f} ms", file=file)


# ---------------------------------------------------------------------------------------
# the device timer
# ---------------------------------------------------------------------------------------
class EventTimer:
    """Times candidate plans of one op on the GPU: per candidate a CUDA graph of `reps` launches,
    `rounds` rounds of one replay each in a rotated order between CUDA events (so every candidate
    sees the same clocks and temperature), then one eager run each whose output is compared."""

    def __init__(self, rt, ws_floats, rounds=7, target_ms=0.5, check=True, seed=0, scratch=None):
        self.rt, self.rounds, self.target_ms, self.check = rt, rounds, target_ms, check
        self.rng = np.random.default_rng(seed)
        self.ws = self._alloc((max(ws_floats, 1),)) if ws_floats else None
        self.scratch = {name: self._alloc((n,)) for name, n in (scratch or {}).items() if n}
        self.ws_floats = ws_floats

    def _alloc(self, shape):
        from gptcuda.runtime import DeviceView
        n = max(1, int(np.prod(shape)))
        ptr = self.rt.dev.malloc(4 * n)
        return DeviceView(ptr, tuple(int(s) for s in shape), "f32", "tune")

    def _upload(self, shape, scale=1.0):
        v = self._alloc(shape)
        self.rt.write(v, self.rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * np.float32(scale))
        return v

    def __call__(self, op: GemmOp, plans):
        rt = self.rt
        lead = (op.batch,) if op.batch > 1 else ()
        bufs = []
        try:
            a = self._upload(lead + ((op.K, op.M) if op.ta else (op.M, op.K)))
            b = self._upload(lead + ((op.N, op.K) if op.tb else (op.K, op.N)))
            out = self._alloc(lead + (op.M, op.N))
            bufs += [a, b, out]
            bias = aux = None
            if op.bias:
                bias = self._upload((op.N,))
                bufs.append(bias)
            if op.epilogue in gemm.AUX_EPILOGUES:
                aux = self._upload((op.M, op.N))
                bufs.append(aux)
            old_ws = dict(rt._workspace)
            ws = dict(old_ws)
            if self.ws is not None:
                ws["gemm_splitk"] = self.ws
            ws.update(self.scratch)
            rt.set_workspace(ws)

            def record(p):
                if op.batch > 1:
                    gemm.matmul_batched(rt, out, a, b, op.ta, op.tb, plan=p)
                else:
                    gemm.matmul(rt, out, a, b, op.ta, op.tb, bias=bias, epilogue=op.epilogue, aux=aux, plan=p)

            est = [gemm.estimate_s(p, op.M, op.N, op.K, op.batch, op.epi, rt.info.sm_count) * 1e3 for p in plans]
            graphs, reps = [], []
            for p, e in zip(plans, est):
                n = int(min(64, max(1, math.ceil(self.target_ms / max(e, 1e-4)))))
                prog = rt.begin("tune")
                try:
                    for _ in range(n):
                        record(p)
                finally:
                    rt.end()
                graphs.append(rt.capture(prog))
                reps.append(n)
            dev = rt.dev
            for g in graphs:                       # warm-up (module load, clocks)
                g.launch()
            rt.synchronize()
            evs = []
            for r in range(self.rounds):
                order = [(i + r) % len(plans) for i in range(len(plans))]
                for i in order:
                    e0, e1 = dev.event(), dev.event()
                    dev.record(e0, rt.stream)
                    graphs[i].launch()
                    dev.record(e1, rt.stream)
                    evs.append((i, e0, e1))
            rt.synchronize()
            samples = [[] for _ in plans]
            destroy = getattr(getattr(dev, "drv", None), "cuEventDestroy", None)
            for i, e0, e1 in evs:
                samples[i].append(dev.elapsed_ms(e0, e1) / reps[i])
                if destroy is not None:
                    destroy(e0)
                    destroy(e1)
            for g in graphs:
                g.destroy()
            ok = None
            if self.check:
                ok, ref = [], None
                for p in plans:
                    record(p)                      # (GELU rewrites aux with the same pre-activation)
                    got = rt.download(out)
                    if ref is None:
                        ref = got.astype(np.float64)
                        scale = max(float(np.max(np.abs(ref))), 1e-30)
                    err = float(np.max(np.abs(got - ref))) / scale if np.all(np.isfinite(got)) else math.inf
                    # TF32: the wgmma kernel truncates operands to tf32 where mma.sync rounds them,
                    # so two correct candidates differ by up to ~1e-3 (tests/gpu/test_gemm.py TOL);
                    # fp32: SIMT and 3xTF32 agree to ~1e-7
                    ok.append(err < (2e-3 if rt.precision == "tf32" else 1e-5))
            rt.set_workspace(old_ws)
            return samples, ok
        finally:
            rt.synchronize()
            for v in bufs:
                rt.dev.free(v.ptr)

    def close(self):
        for v in [self.ws, *self.scratch.values()]:
            if v is not None:
                self.rt.dev.free(v.ptr)
        self.ws, self.scratch = None, {}


# ---------------------------------------------------------------------------------------
def vocab_of(cfg) -> int:
    """The model's vocabulary, as train.py resolves it (the data's tokenizer, vocab_multiple)."""
    if cfg.vocab_size:
        return cfg.vocab_size
    from gptcuda.training.trainer import open_run_data
    return open_run_data(cfg)[1]


def ws_floats_of(cfg, vocab, name="gemm_splitk") -> int:
    """Floats of the GEMM workspace `name` memory.py plans for this config (0: none)."""
    import dataclasses
    ws = gemm.workspace(dataclasses.replace(cfg, vocab_size=vocab))
    return int(np.prod(ws[name][0])) if name in ws else 0


def run(cfg, ops, precision, timer, sm_count, ws_floats, keep, max_n, out=sys.stdout, wgmma=False,
        scratch=None):
    results = []
    for op in ops:
        r = tune_op(op, precision, timer, sm_count, ws_floats, keep, max_n, wgmma, scratch)
        print_result(r, file=out)
        out.flush()
        results.append(r)
    print_summary(results, file=out)
    return results


def main(argv=None):
    from gptcuda.cli import split_args
    from gptcuda.config import load_config
    argv = sys.argv[1:] if argv is None else argv
    path, overrides, flags, opts = split_args(
        argv, flags=("dry_run", "no_save", "no_check"),
        options=("rounds", "keep", "max_candidates", "target_ms", "only", "json"))
    if path is None:
        print(__doc__)
        return 2
    cfg = load_config(path, overrides)
    vocab = vocab_of(cfg)
    ops = model_gemms(cfg, vocab)
    if "only" in opts:
        ops = [o for o in ops if opts["only"] in o.label]
    keep = float(opts.get("keep", 1.6))
    max_n = int(opts.get("max_candidates", 6))
    ws_floats = ws_floats_of(cfg, vocab)
    scratch = {name: ws_floats_of(cfg, vocab, name) for name in gemm.WGMMA_WORKSPACES}
    precision = cfg.precision
    print(f"{path}: {precision}, {len(ops)} GEMM shapes, tokens {cfg.batch_size * cfg.block_size}, "
          f"C {cfg.n_embd}, V {vocab}, split-K workspace {ws_floats} floats")
    if "dry_run" in flags:
        for op in ops:
            heur, plans = candidates_for(op, precision, 132, ws_floats, keep, max_n,   # as on an H200
                                         wgmma=os.environ.get("GPTCUDA_WGMMA", "1") != "0", scratch=scratch)
            print(f"{op.label}: {op.M}x{op.N}x{op.K} b{op.batch} {op.trans()} {op.epilogue}"
                  f"{'+bias' if op.bias else ''} floor {floor_s(op, precision) * 1e3:.4f} ms")
            for p in plans:
                est = gemm.estimate_s(p, op.M, op.N, op.K, op.batch, op.epi, 132) * 1e3
                print(f"    {gemm.plan_label(p):<26} model {est:8.4f} ms")
        return 0

    from bench.common import ClockWatch
    from gptcuda.runtime import Runtime
    rt = Runtime(cfg.device, precision=precision, seed=cfg.seed)
    print(f"{rt.info.name}, {rt.info.sm_count} SMs; table {gemm.table_path(rt.info.name)}")
    timer = EventTimer(rt, ws_floats, rounds=int(opts.get("rounds", 7)), scratch=scratch,
                       target_ms=float(opts.get("target_ms", 0.5)), check="no_check" not in flags)
    watch = ClockWatch(cfg.device)
    try:
        results = run(cfg, ops, precision, timer, rt.info.sm_count, ws_floats, keep, max_n,
                      wgmma=gemm.wgmma_device(rt), scratch=scratch)
    finally:
        timer.close()
    print(watch.stop())
    entries = table_entries(results, precision)
    if "no_save" not in flags:
        p = gemm.save_table(rt.info.name, entries, meta={"config": path, "overrides": overrides})
        print(f"wrote {len(entries)} entries to {p}")
    if "json" in opts:
        with open(opts["json"], "w") as f:
            json.dump(entries, f, indent=1)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
