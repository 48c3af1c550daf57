"""Which GEMM kernels the measured table picks: set each config up as training does (gemm_tune auto
measures the shapes its GPU's table lacks), then list every shape's winner by family and tile.

    python bench/tables.py CONFIG[:--key=value,...] ... [--json=FILE]

No training step runs. The table is the one training reads (<compile cache>/tune/); --json writes
{config: {table key: plan label}} and the family / tile counts, for deciding which kernel families
and tiles the shipped configs need.
"""
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gptcuda.config import load_config  # noqa: E402
from gptcuda.model.products import products  # noqa: E402
from gptcuda.ops.cuda.gemm.plan import plan_label  # noqa: E402
from gptcuda.ops.cuda.gemm.table import load_table, plan_from_json, table_key  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402
from gptcuda.training.trainer import open_run_data  # noqa: E402


def picks(cfg, V, ex, table) -> dict:
    """{table key: (family, tile, plan label, the op's label)} of this config's GEMMs the table has,
    under plan ex."""
    out = {}
    for op in products(cfg, V, True, ex):
        e = table.get(table_key(ex.table_tag, op))
        p = plan_from_json(e, op.K) if e is not None else None
        if p is not None:
            out[table_key(ex.table_tag, op)] = (p.family, list(p.tile), plan_label(p), op.label)
    return out


def main(argv):
    args = [a for a in argv if not a.startswith("--json=")]
    jpath = next((a.split("=", 1)[1] for a in argv if a.startswith("--json=")), None)
    result, fams = {}, collections.Counter()
    for spec in args:
        path, _, over = spec.partition(":")
        overrides = [o for o in over.split(",") if o]
        cfg = load_config(path, overrides + ["--max_iters=100000"])
        data, V, accum = open_run_data(cfg)
        eng = Engine(cfg, data.train, data.val, V, programs=("train", "eval"), n_vocab=data.vocab_size, accum=accum)
        table = load_table(eng.be.rt.info.name)
        got = picks(eng.cfg, V, eng.exec, table)
        result[spec] = {k: v[2] for k, v in got.items()}
        for fam, tile, label, what in got.values():
            fams[(fam, tuple(tile))] += 1
        print(f"{spec}: {eng.exec.table_tag}, {len(got)} shapes" + (f" ({eng.tuning.format()})" if eng.tuning else ""))
        for k, (fam, tile, label, what) in sorted(got.items()):
            print(f"    {what:<32} {k:<48} {label}")
        eng.be.rt.close()
    print("\nfamily / tile picked (shapes):")
    for (fam, tile), n in sorted(fams.items()):
        print(f"    {fam:<12} {str(tile):<24} {n}")
    if jpath:
        with open(jpath, "w") as f:
            json.dump({"configs": result, "families": [[f, list(t), n] for (f, t), n in sorted(fams.items())]}, f,
                      indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
