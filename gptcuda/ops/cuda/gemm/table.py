"""The measured plan table: one JSON file per GPU and kernel sources,
<compile cache>/tune/<gpu>-<source hash>.json, {tune_key: plan_to_json}, written by tune.py
(`autotune`, at a run's setup, for the shapes it lacks; bench/tune.py, for every shape of a config);
`tuned_plan` answers with an entry a launch can use (the execution plan's gemm_tune off: never)."""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from gptcuda.files import atomic_open
from gptcuda.ops.cuda.gemm.families import FAMILIES
from gptcuda.ops.cuda.gemm.layout import rt_scratch
from gptcuda.ops.cuda.gemm.plan import Plan, make_plan, plan_unfit
from gptcuda.runtime import RuntimeProtocol

TUNE_FORMAT = 1
_tables: dict = {}           # path -> {key: Plan}


def forget_tables():
    """Drop the tables read so far (each is read once a process; tests and benchmarks that write or
    point at another table file re-read it)."""
    _tables.clear()
_source_hash = None


def source_hash() -> str:
    """sha256 of the GEMM kernel sources with their includes expanded: a table measured on other
    sources is not used."""
    global _source_hash
    if _source_hash is None:
        from gptcuda.runtime import compiler
        h = hashlib.sha256()
        for f in dict.fromkeys(fam.file for fam in FAMILIES.values()):
            h.update(f.encode() + b"\0" + compiler.expand_source(f).encode() + b"\0")
        _source_hash = h.hexdigest()
    return _source_hash


def tune_key(precision, trans_a, trans_b, epilogue, has_bias, M, N, K, batch=1, colsum=False) -> str:
    """Table key: precision, transposes, the op's epilogue (+bias; +colsum: the weight gradient that
    also gives its bias gradient, matmul's a_colsum), the shape and the batch."""
    return (f"{precision}:{'T' if trans_a else 'N'}{'T' if trans_b else 'N'}:"
            f"{epilogue}{'+bias' if has_bias else ''}{'+colsum' if colsum else ''}:"
            f"{int(M)}x{int(N)}x{int(K)}:b{int(batch)}")


def table_path(gpu_name: str, src_hash: str | None = None) -> Path:
    """<compile cache>/tune/<gpu>-<first 16 hex of the source hash>.json"""
    from gptcuda.runtime import compiler
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") or "gpu"
    return compiler.cache_dir() / "tune" / f"{slug}-{(src_hash or source_hash())[:16]}.json"


def plan_to_json(p: Plan) -> dict:
    d = {"family": p.family, "tile": list(p.tile), "splits": p.splits, "k_chunk": p.k_chunk}
    if p.transpose_b:
        d["transpose_b"] = True
    return d


def plan_from_json(d: dict, K: int) -> Plan | None:
    """The Plan an entry names, rebuilt for reduction length K (None if it is not a valid plan: also
    one of a family or a re-layout this tree no longer has)."""
    try:
        tile = tuple(int(x) for x in d["tile"])
        p = make_plan(str(d["family"]), tile, int(d["splits"]), int(K), bool(d.get("transpose_b", False)))
    except (KeyError, TypeError, ValueError):
        return None
    if p is None or p.k_chunk != int(d.get("k_chunk", p.k_chunk)) or d.get("transpose_a"):
        return None
    return p


def _key_K(key: str) -> int:
    return int(key.split(":")[3].split("x")[2])


def load_table(gpu_name: str, src_hash: str | None = None, refresh: bool = False) -> dict:
    """{key: Plan} of the table for this GPU and these kernel sources ({} when there is none, or
    it is unreadable, or was written for another GPU / other sources). Read once per process."""
    path = table_path(gpu_name, src_hash)
    cached = _tables.get(str(path))
    if cached is not None and not refresh:
        return cached
    table = {}
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") == TUNE_FORMAT and doc.get("gpu") == gpu_name and \
                doc.get("source_hash") == (src_hash or source_hash()):
            for key, entry in doc.get("entries", {}).items():
                p = plan_from_json(entry, _key_K(key))
                if p is not None:
                    table[key] = p
    except (OSError, ValueError, AttributeError, IndexError):
        table = {}
    _tables[str(path)] = table
    return table


def save_table(gpu_name: str, entries: dict, src_hash: str | None = None, meta: dict | None = None,
               merge: bool = True, replace: bool = True) -> Path:
    """Write {key: entry dict (plan_to_json + anything else)} atomically, merged over the entries
    (and the meta) already there; replace False: an entry already there stays (two runs that
    measured a shape at once then both launch the plan written first, as will their resumes). The
    process's cached copy is refreshed."""
    src_hash = src_hash or source_hash()
    path = table_path(gpu_name, src_hash)
    doc = {"format": TUNE_FORMAT, "gpu": gpu_name, "source_hash": src_hash, "entries": {}}
    if merge:
        try:
            old = json.loads(path.read_text())
            if old.get("format") == TUNE_FORMAT and old.get("source_hash") == src_hash:
                doc["entries"].update(old.get("entries", {}))
                doc.update({"meta": old["meta"]} if "meta" in old else {})
        except (OSError, ValueError, AttributeError):
            pass
    doc["entries"].update({k: v for k, v in entries.items() if replace or k not in doc["entries"]})
    if meta:
        doc["meta"] = meta
    with atomic_open(os.fspath(path)) as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    _tables.pop(str(path), None)
    load_table(gpu_name, src_hash)
    return path


def tuned_plan(rt: RuntimeProtocol, key: str, vec: bool, ws_floats: int, M: int, N: int, wgmma=False,
               ex=None) -> Plan | None:
    """The table's plan for `key` if there is one this launch can use (its alignment allows the
    tile, the workspace holds its split, wgmma: `wgmma_ok` for this launch, rt's scratch holds what it
    re-lays out), else None."""
    ex = rt.exec if ex is None else ex         # the execution plan (default rt's)
    if not ex.gemm_table:                               # gemm_tune off (GPTCUDA_GEMM_TUNE=0)
        return None
    name = getattr(getattr(rt, "info", None), "name", None)
    if not isinstance(name, str):
        return None
    p = load_table(name).get(key)
    if p is None:
        return None
    if plan_unfit(p, ex.gemm_family, vec, wgmma) or not p.fits(M, N, _key_K(key), rt_scratch(rt)):
        return None
    if p.splits > 1 and p.splits * M * N > ws_floats:
        return None
    return p
