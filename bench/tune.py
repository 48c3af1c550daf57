"""Measured GEMM dispatch: time the candidate plans of every GEMM the model runs, keep the fastest.

    python bench/tune.py CONFIG [--key=value ...] [--rounds 7] [--keep 1.6] [--max_candidates 12]
                                [--target_ms 0.5] [--only SUBSTRING] [--dry_run] [--no_save] [--json F]

The command line over gptcuda/ops/cuda/gemm/tune.py, which a training run also uses at its setup
(config gemm_tune: auto) to measure the shapes its GPU's table lacks; this measures every shape of
the config again (an entry already there is replaced), with longer windows, and prints each
candidate. The shapes come from the config (model/products.py products): N = batch_size * block_size tokens,
C, 3C, 4C and the vocabulary V (every matmul of model.py's forward and backward with its
transposes, epilogue and bias, the eval forward's residual epilogue, the MLP backward both as
"none" and fused "dgelu", and the unfused attention's batched GEMMs); in bf16 then the pairs (products.py
pairs: a layer's dW and dX as one gemm_wgmma_dual launch), whose candidates are every dual tile and split
count and APART, the two products by the table's plans, which are saved before the pairs are timed. For
each shape:

  1. candidates: every tile of the precision's kernel family x every split-K count that fits the
     workspace memory.py plans (gemm.workspace(cfg)) (gemm/plan.py tune_candidates); on sm_90 the wgmma
     tiles too, through the planned scratch where a layout needs it (B^T in gemm_bT; the weight
     gradients' register-A families with X^T or dY^T in gemm_aT);
  2. pruned by the cost model (roofline + occupancy + waves, gemm/plan.py estimate_s): those within
     --keep x the best estimate, at most --max_candidates, plus the cost model's own choice;
  3. timed paired in one window: each candidate's launches are captured back to back in a CUDA
     graph (enough of them for ~--target_ms), then --rounds rounds replay every graph once, in
     an order rotated each round, between CUDA events; a candidate's time is its median;
  4. checked: every candidate's output is compared with the cost model's choice (a candidate that
     disagrees is reported and never wins);
  5. the fastest wins; the table {key: plan} is written under the compile cache
     (<GPTCUDA_CACHE>/tune/<gpu>-<source hash>.json, gemm/table.py table_path), where gemm.matmul finds it.

Printed per shape: every candidate's time, its distance from the roofline floor (time / floor,
floor = max(flops / peak, bytes / bandwidth), peaks 495 TF32 / 67 fp32 TFLOP/s dense, 4.2 TB/s),
and the winner; at the end the step's GEMM time with the cost model's plans and the winners.
--dry_run lists the shapes and the pruned candidates without a GPU.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gptcuda.runtime import execution  # noqa: E402
from gptcuda.model.products import Pair  # noqa: E402
from gptcuda.ops.cuda.gemm.table import save_table, table_path  # noqa: E402
from gptcuda.ops.cuda.gemm.tune import (KEEP, MAX_CANDIDATES, EventTimer, candidates_for, estimate_ms,  # noqa: E402
                                        first_pair, floor_s, label, op_candidates, step_ms, table_entries, tune_op,
                                        tuned_ops, workspace_floats)


# ---------------------------------------------------------------------------------------
# printing
# ---------------------------------------------------------------------------------------
def _shape(op) -> str:
    """A product's shape, layout and epilogue; a pair's: its weight gradient's and its input gradient's."""
    if isinstance(op, Pair):
        return f"pair: dW {_shape(op.w)}{' +colsum' if op.w.colsum else ''} | dX {_shape(op.x)}"
    return (f"{op.M}x{op.N}x{op.K}" + (f" batch {op.batch}" if op.batch > 1 else "") +
            f" {op.layout} {op.epilogue}{'+bias' if op.bias else ''}")


def print_result(r, file=sys.stdout):
    op = r["op"]
    head = f"{op.label}: {_shape(op)}  floor {r['floor_ms']:.4f} ms  x{op.count}/step"
    print(head, file=file)
    for i, p in enumerate(r["plans"]):
        t = r["times_ms"][i]
        mark = " <- winner" if i == r["winner"] else ""
        if i == 0:
            mark += " (cost model)"
        if r["ok"] is not None and not r["ok"][i]:
            mark += " MISMATCH"
        ts = f"{t:9.4f} ms {t / r['floor_ms']:6.2f}x floor" if math.isfinite(t) else f"{'-':>9}    {'':>13}"
        print(f"    {label(p):<26} model {r['est_ms'][i]:8.4f} ms  {ts}{mark}", file=file)


def print_summary(results, file=sys.stdout):
    base, tuned = step_ms(results)
    floor = sum(r["op"].count * r["floor_ms"] for r in results if not isinstance(r["op"], Pair))
    print(f"\nGEMMs of one training step: cost model {base:.3f} ms, tuned {tuned:.3f} ms "
          f"({(1 - tuned / base) * 100 if base else 0:.1f}% less), roofline floor {floor:.3f} ms", file=file)


# ---------------------------------------------------------------------------------------
def vocab_of(cfg) -> int:
    """The model's vocabulary, as train.py resolves it (the data's tokenizer, vocab_multiple)."""
    if cfg.vocab_size:
        return cfg.vocab_size
    from gptcuda.training.trainer import open_run_data
    return open_run_data(cfg)[1]


def run(cfg, ops, ex, timer, sm_count, workspaces, keep, max_n, out=sys.stdout, save=None):
    """Time every op's candidates under execution plan ex with the GEMM workspaces {name: floats}; print
    each and the step's summary. save(results): called with the products' results before the first pair
    (a pair's APART candidate runs its products by the table)."""
    results = []
    for op in ops:
        if save is not None and first_pair(op, results):
            save(results)
        r = tune_op(op, ex, timer, sm_count, workspaces, keep, max_n)
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
    keep = float(opts.get("keep", KEEP))
    max_n = int(opts.get("max_candidates", MAX_CANDIDATES))
    ex = execution.resolve(cfg, arch="sm_90")         # as on an H200 (GPTCUDA_WGMMA=0: without wgmma)
    ops = tuned_ops(cfg, vocab, True, ex)             # the products, then the pairs (bf16)
    if "only" in opts:
        ops = [o for o in ops if opts["only"] in o.label]
    ws = workspace_floats(cfg, vocab, ex)
    print(f"{path}: {ex.table_tag}, {len(ops)} GEMM shapes and pairs, tokens {cfg.batch_size * cfg.block_size}, "
          f"C {cfg.n_embd}, V {vocab}, split-K workspace {ws.get('gemm_splitk', 0)} floats")
    if "dry_run" in flags:
        for op in ops:
            plans = op_candidates(op, ex, 132, ws, keep, max_n)       # as on an H200
            if isinstance(op, Pair):
                print(f"{op.label}: {_shape(op)} floor {floor_s(op, ex) * 1e3:.4f} ms")
            else:
                print(f"{op.label}: {op.M}x{op.N}x{op.K} b{op.batch} {op.layout} {op.epilogue}"
                      f"{'+bias' if op.bias else ''}{' +colsum' if op.colsum else ''} floor "
                      f"{floor_s(op, ex) * 1e3:.4f} ms")
            for p in plans:
                print(f"    {label(p):<26} model {estimate_ms(p, op, ex, 132):8.4f} ms")
        return 0

    from bench.common import ClockWatch
    from gptcuda.runtime import Runtime
    rt = Runtime(cfg.device, seed=cfg.seed, cfg=cfg)
    print(f"{rt.info.name}, {rt.info.sm_count} SMs; table {table_path(rt.info.name)}")
    timer = EventTimer(rt, ws, rounds=int(opts.get("rounds", 7)),
                       target_ms=float(opts.get("target_ms", 0.5)), check="no_check" not in flags)
    watch = ClockWatch(cfg.device)
    def save(results):
        if "no_save" not in flags:
            save_table(rt.info.name, table_entries(results, rt.exec), meta={"config": path, "overrides": overrides})
    try:
        results = run(cfg, ops, rt.exec, timer, rt.info.sm_count, ws, keep, max_n, save=save)
    finally:
        timer.close()
    print(watch.stop())
    entries = table_entries(results, rt.exec)
    if "no_save" not in flags:
        p = save_table(rt.info.name, entries, meta={"config": path, "overrides": overrides})
        print(f"wrote {len(entries)} entries to {p}")
    if "json" in opts:
        with open(opts["json"], "w") as f:
            json.dump(entries, f, indent=1)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
