"""How often does the cost model pick what a measured GEMM table picked? No GPU needed.

    python bench/plan_check.py TABLE.json [--configs a.yaml ...] [--verbose]

TABLE.json is a table file bench/tune.py wrote (<compile cache>/tune/<gpu>-<hash>.json: its "entries",
{key: the winning plan, its time, the cost model's plan then ("heuristic") and its time}). For every
GEMM of the shipped configs (configs/*.yaml at their own settings, the vocabulary the tokenizer's
rounded up to vocab_multiple, plus configs/tiny.yaml in fp32 and tf32, unfused and fused) whose key
the table has, the cost model's plan now (gemm/tune.py candidates_for: the execution plan and
workspaces of that config on an sm_90 H200, no table) is compared with the table's winner: the same
family, the same family and tile, the same plan (tile, split-K, transpose). Where they differ the line
names both, the winner's time and, where the cost model now picks the plan the table timed as its
cost model's, that time. A table measured on other kernel sources is read all the same (its plans
are rebuilt by name).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["GPTCUDA_GEMM_TUNE"] = "off"          # the cost model alone

from gptcuda.config import load_config  # noqa: E402
from gptcuda.ops.cuda import cdiv  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import plan_label  # noqa: E402
from gptcuda.ops.cuda.gemm.table import plan_from_json, table_key  # noqa: E402
from gptcuda.model.products import products  # noqa: E402
from gptcuda.ops.cuda.gemm.tune import candidates_for, workspace_floats  # noqa: E402
from gptcuda.runtime import execution  # noqa: E402


def configs(paths=None):
    """(name, config) of the configs whose GEMMs are checked."""
    if paths:
        for p in paths:
            yield p, load_config(p, [])
        return
    for p in sorted((ROOT / "configs").glob("*.yaml")):
        if p.name != "tiny.yaml":
            yield p.name, load_config(str(p), ["--total_batch_tokens=0"])
    for prec in ("fp32", "tf32"):
        for att in ("unfused", "fused"):
            yield f"tiny {prec} {att}", load_config(str(ROOT / "configs/tiny.yaml"),
                                                    [f"--precision={prec}", f"--attention={att}"])


def check(entries: dict, cfgs, verbose=False, out=sys.stdout) -> dict:
    """Compare the cost model with the table for every op of cfgs the table has; returns the counts."""
    seen, counts = set(), {"shapes": 0, "family": 0, "tile": 0, "plan": 0}
    for name, cfg in cfgs:
        mult = cfg.vocab_multiple
        vocab = cfg.vocab_size or cdiv(50257 if cfg.tokenizer == "gpt2" else 65, mult) * mult
        ex = execution.resolve(cfg, arch="sm_90", env={})
        ws = workspace_floats(cfg, vocab, ex)
        for op in products(cfg, vocab, ex=ex):
            key = table_key(ex.table_tag, op)
            if key in seen or key not in entries:
                continue
            seen.add(key)
            e = entries[key]
            win = plan_from_json(e, op.K)
            heur = candidates_for(op, ex, 132, ws)[0]
            counts["shapes"] += 1
            same = [win is not None and heur.family == win.family, win is not None and
                    (heur.family, heur.tile) == (win.family, win.tile), heur == win]
            for k, s in zip(("family", "tile", "plan"), same):
                counts[k] += s
            if verbose or not same[0]:
                was = f", the cost model then: {e['heuristic']} {e['heuristic_ms']:.4f} ms" \
                    if plan_label(heur) == e.get("heuristic") or not same[0] else ""
                mark = "same plan" if same[2] else "same tile" if same[1] else "same family" if same[0] else "OTHER"
                print(f"{mark:<11} {key:<44} model {plan_label(heur):<26} table {e['family']} "
                      f"{'x'.join(map(str, e['tile']))} s{e['splits']}{' +bT' if e.get('transpose_b') else ''} "
                      f"{e['ms']:.4f} ms{was}  ({name}: {op.label})", file=out)
    print(f"{counts['shapes']} shapes of the table: the cost model picks the winner's family for {counts['family']}, "
          f"its family and tile for {counts['tile']}, its plan for {counts['plan']}", file=out)
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--configs", nargs="*", default=None)
    ap.add_argument("--verbose", action="store_true", help="a line for every shape, not only another family")
    a = ap.parse_args(argv)
    check(json.loads(Path(a.table).read_text())["entries"], configs(a.configs), a.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
