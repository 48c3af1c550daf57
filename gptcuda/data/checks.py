"""Token data checked against its tokenizer before the first step, so that no run learns from ids its
vocabulary does not have, nor stops at the step whose window first reads one.

    prepare.py's output   prepare.json names the tokenizer (name, vocabulary, sha256 of tokenizer.json), each
                          split's largest id and each shard's size: all must agree with the files.
    other token files     (llm.c's shards, nanoGPT's train.bin / val.bin, an old prepare.json) scanned once
                          for their largest id: memory-mapped, chunk by chunk, vectorised; the result cached in
                          IDS_CACHE beside the file, keyed by its fingerprint (size, mtime and the sha256 of its
                          first and last MiB), so that a later run reads the cache instead.

Every problem is a one-line DataError naming the file; a directory the cache cannot be written to is scanned
again next time, nothing else."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from gptcuda.files import atomic_open
from gptcuda.data.shards import DataError

IDS_CACHE = ".gptcuda-max-ids.json"
SCAN_CHUNK = 1 << 24          # tokens reduced at a time (64 MiB of uint32)
_EDGE = 1 << 20               # bytes of each end of a file in its fingerprint


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def max_id(tokens) -> int:
    """The largest id of a token array (a memmap is read chunk by chunk); -1 when it is empty."""
    m = -1
    for a in range(0, len(tokens), SCAN_CHUNK):
        m = max(m, int(np.max(tokens[a:a + SCAN_CHUNK])))
    return m


def fingerprint(path: str) -> dict:
    st = os.stat(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if st.st_size > _EDGE:
            f.seek(max(_EDGE, st.st_size - _EDGE))
            h.update(f.read(_EDGE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "edges_sha256": h.hexdigest()}


def _read_cache(d: str) -> dict:
    try:
        with open(os.path.join(d, IDS_CACHE), encoding="utf-8") as f:
            c = json.load(f)
        return c if isinstance(c, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_max_ids(paths, arrays) -> list[int]:
    """The largest id of each file (arrays[i]: its tokens), from the cache where its fingerprint matches,
    else scanned (and the cache beside it updated)."""
    out, dirty = [], {}
    caches = {}
    for p, arr in zip(paths, arrays):
        d, name = os.path.split(os.path.abspath(p))
        cache = caches.setdefault(d, _read_cache(d))
        fp = fingerprint(p)
        hit = cache.get(name)
        if isinstance(hit, dict) and {k: hit.get(k) for k in fp} == fp and isinstance(hit.get("max_id"), int):
            out.append(hit["max_id"])
            continue
        m = max_id(arr)
        cache[name] = dict(fp, max_id=m)
        dirty[d] = True
        out.append(m)
    for d in dirty:
        try:
            with atomic_open(os.path.join(d, IDS_CACHE)) as f:
                json.dump(caches[d], f, indent=1)
        except OSError:
            pass                  # a read-only data directory: scanned again next time
    return out


def first_at_least(tokens, v: int) -> int:
    """The position of the first id >= v in a token array (chunk by chunk); -1 when there is none."""
    for a in range(0, len(tokens), SCAN_CHUNK):
        hit = np.flatnonzero(tokens[a:a + SCAN_CHUNK] >= v)
        if hit.size:
            return a + int(hit[0])
    return -1


def check_scanned(stream) -> None:
    """Every file of a TokenStream holds only ids of its vocabulary (scanned, or cached)."""
    V = stream.vocab_size
    for i, m in enumerate(cached_max_ids(stream.paths, stream.pieces)):
        if m >= V:
            pos = first_at_least(stream.pieces[i], V)
            raise DataError(f"{stream.paths[i]}: token id {int(stream.pieces[i][pos])} at position {pos} (largest "
                            f"{m}) is outside the tokenizer's vocabulary (0..{V - 1}): made with another tokenizer?")


def check_prepared(d: str, tok, train, val) -> None:
    """prepare.py's output: prepare.json's tokenizer, split maxima and shard sizes against the files. An
    older prepare.json without the largest ids has its shards scanned instead."""
    prep = os.path.join(d, "prepare.json")
    try:
        with open(prep, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"bad {prep}: {' '.join(str(e).split())}") from None
    tp = os.path.join(d, "tokenizer.json")
    want = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    if want.get("name", tok.name) != tok.name or want.get("vocab_size", tok.vocab_size) != tok.vocab_size:
        raise DataError(f"{tp} is a {tok.name} tokenizer ({tok.vocab_size} tokens) but {prep} says the shards were "
                        f"made with {want.get('name')} ({want.get('vocab_size')} tokens): re-run prepare.py")
    if "sha256" in want and file_sha256(tp) != want["sha256"]:
        raise DataError(f"{tp} is not the tokenizer file {prep} says the shards were made with (another "
                        f"sha256): put the right one back, or re-run prepare.py")
    for split, stream in (("train", train), ("val", val)):
        info = meta["splits"][split]
        for s in info["shards"]:
            p = os.path.join(d, s["file"])
            if "bytes" in s and os.path.getsize(p) != s["bytes"]:
                raise DataError(f"{p} holds {os.path.getsize(p)} bytes but {prep} says {s['bytes']}: it was "
                                f"replaced; re-run prepare.py")
        m = info.get("max_id")
        if not isinstance(m, int):
            check_scanned(stream)
        elif m >= tok.vocab_size:
            raise DataError(f"{prep}: the {split} shards hold token id {m}, outside the tokenizer's vocabulary "
                            f"(0..{tok.vocab_size - 1}): re-run prepare.py")
