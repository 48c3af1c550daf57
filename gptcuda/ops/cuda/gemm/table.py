"""The measured plan table: one JSON file per GPU and kernel sources, <compile cache>/tune/<gpu>-<source
hash>.json, {table_key: plan_to_json}, written by tune.py (`autotune`) and bench/tune.py; `tuned_plan`
answers with an entry a launch can use."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from pathlib import Path

from gptcuda.files import atomic_open
from gptcuda.model.products import Pair, Product
from gptcuda.runtime import compiler
from gptcuda.ops.cuda.gemm.families import FAMILIES
from gptcuda.ops.cuda.gemm.plan import Plan, make_plan, pair_unfit, plan_unfit

TUNE_FORMAT = 1
_tables: dict = {}           # path -> {key: Plan}, each table read once a process


def forget_tables():
    """Drop the tables read so far (tests and benchmarks that write or point at another table file)."""
    _tables.clear()


@functools.cache
def source_hash() -> str:
    """sha256 of the GEMM kernel sources, includes expanded (a table measured on other sources is not used)."""
    files = dict.fromkeys(fam.file for fam in FAMILIES.values())
    return hashlib.sha256(b"".join(f"{f}\0{compiler.expand_source(f)}\0".encode() for f in files)).hexdigest()


APART = "apart"      # a pair's entry (model/products.py Pair): its two products launched apart were faster


def table_key(tag, g: Product | Pair) -> str:
    """A product's key under an execution plan's table_tag: its layout, epilogue (+bias, +colsum; >bf16: a C of
    that dtype, Product.out), shape, batch; a
    pair's: its weight gradient's key | its input gradient's (the first's K: the pair plan's split)."""
    if isinstance(g, Pair):
        return f"{table_key(tag, g.w)}|{table_key(tag, g.x)}"
    return (f"{tag}:{g.layout}:{g.epilogue}{'+bias' if g.bias else ''}{'+colsum' if g.colsum else ''}"
            f"{'>' + g.out if g.out else ''}:{g.M}x{g.N}x{g.K}:b{g.batch}")


def table_path(gpu_name: str, src_hash: str | None = None) -> Path:
    """<compile cache>/tune/<gpu>-<first 16 hex of the source hash>.json"""
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu_name).strip("-") or "gpu"
    return compiler.cache_dir() / "tune" / f"{slug}-{(src_hash or source_hash())[:16]}.json"


def plan_to_json(p: Plan | str) -> dict:
    if p == APART:
        return {APART: True}
    d = {"family": p.family, "tile": list(p.tile), "splits": p.splits, "k_chunk": p.k_chunk}
    return {**d, "transpose_b": True} if p.transpose_b else d


def plan_from_json(d: dict, K: int) -> Plan | str | None:
    """The Plan an entry names, rebuilt for reduction length K (a pair's: APART where it says so); None where this
    tree has no such plan."""
    if d.get(APART) is True:
        return APART
    try:
        tile = tuple(int(x) for x in d["tile"])
        p = make_plan(str(d["family"]), tile, int(d["splits"]), int(K), bool(d.get("transpose_b", False)))
    except (KeyError, TypeError, ValueError):
        return None
    return None if p is None or p.k_chunk != int(d.get("k_chunk", p.k_chunk)) else p


def _read(path: Path, src_hash: str) -> dict:
    """The document of a table file of this format for these kernel sources; {} (none there, unreadable, other)."""
    try:
        doc = json.loads(path.read_text())
        ours = doc.get("format") == TUNE_FORMAT and doc.get("source_hash") == src_hash
        return doc if ours and isinstance(doc.get("entries", {}), dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}


def load_table(gpu_name: str, src_hash: str | None = None, refresh: bool = False) -> dict:
    """{key: Plan} of the table for this GPU and these kernel sources ({} when there is none, or
    it is unreadable, or was written for another GPU / other sources). Read once per process."""
    path = table_path(gpu_name, src_hash)
    if str(path) not in _tables or refresh:
        doc = _read(path, src_hash or source_hash())
        entries = doc.get("entries", {}) if doc.get("gpu") == gpu_name else {}
        try:                                # K: the last of the key's MxNxK
            _tables[str(path)] = {key: p for key, entry in entries.items()
                                  if (p := plan_from_json(entry, int(key.split(":")[3].split("x")[2]))) is not None}
        except (ValueError, IndexError):
            _tables[str(path)] = {}
    return _tables[str(path)]


def save_table(gpu_name: str, entries: dict, src_hash: str | None = None, meta: dict | None = None,
               replace: bool = True) -> Path:
    """Write {key: entry dict (plan_to_json + anything else)} atomically, merged over the entries (and the
    meta) already there (replace False: an entry there stays, so runs that measured a shape at once and their
    resumes launch the plan written first). Refreshes the cached copy."""
    src_hash = src_hash or source_hash()
    path = table_path(gpu_name, src_hash)
    old = _read(path, src_hash)
    doc = {"format": TUNE_FORMAT, "gpu": gpu_name, "source_hash": src_hash, "entries": dict(old.get("entries", {}))}
    doc["entries"].update({k: v for k, v in entries.items() if replace or k not in doc["entries"]})
    if meta or "meta" in old:
        doc["meta"] = meta or old["meta"]
    with atomic_open(os.fspath(path)) as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    load_table(gpu_name, src_hash, refresh=True)
    return path


def tuned_plan(rt, g: Product, ex, ws_floats: int, scratch: dict, out="f32") -> Plan | None:
    """The table's plan for product g under execution plan ex on rt's GPU where `plan_unfit` lets this launch
    (ws_floats of split-K workspace, the scratch {workspace: floats}, C of dtype out) use it, else None."""
    p = load_table(rt.info.name).get(table_key(ex.table_tag, g)) if ex.gemm_table else None   # gemm_tune off: None
    return None if p is None or plan_unfit(p, g, ex.gemm_family, ex.wgmma_mode, ws_floats, scratch, out) else p


def tuned_pair(rt, pair: Pair, ex, ws_floats: int) -> Plan | str | None:
    """The table's entry for a pair under execution plan ex on rt's GPU: APART, or its plan where `pair_unfit`
    lets this launch (ws_floats of split-K workspace) use it; else None."""
    p = load_table(rt.info.name).get(table_key(ex.table_tag, pair)) if ex.gemm_table else None
    return p if p == APART or p is not None and not pair_unfit(p, pair.w, pair.x, ws_floats) else None
