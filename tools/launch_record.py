"""Fingerprint every recorded launch of the training and evaluation programs, on a machine without a GPU.

    python tools/launch_record.py --out before.json       # record, write {case: fingerprint}
    python tools/launch_record.py --compare before.json   # record again; name every case that differs
    python tools/launch_record.py --files gemm --compare before.json --key no_ptrs   # the GEMM launches alone,
                                                          # device addresses left out (another memory plan)
    python tools/launch_record.py --compare before.json --dropped gemm_transpose:0=false   # a kernel lost
                                                          # a template parameter (bench/sass_compare.py's)

The cases: configs/tiny.yaml over precision x attention x dropout x bias x recompute (32 configs, the
train and eval programs of each: 64), and every shipped config at its own settings (its batch and
context; the GPT-2 vocabulary where its tokenizer is gpt2). Each program is recorded through
tests/fakes.py's RecordingRuntime (an sm_90 device of 132 SMs, no measured GEMM table: the
cost model plans every product), and a launch is fingerprinted by its kernel (file, name), grid, block,
shared memory, packed argument bytes (tensor maps included) and label. A refactor of the launchers
that changes no launch leaves every fingerprint as it was. The file also keeps each program's launches
one by one (kernel name, and a hash of the rest without label and device addresses): --compare names
the kernels whose launches a differing program lost and gained, and with --dropped (the old record's
kernel names less a template argument the kernel no longer has, as in bench/sass_compare.py) a
program whose launches differ by those names and device addresses alone counts as unchanged.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["GPTCUDA_GEMM_TUNE"] = "off"          # the cost model: what a machine without a table runs

import numpy as np  # noqa: E402

from gptcuda.config import load_config  # noqa: E402
from gptcuda.ops.cuda_backend import CudaBackend  # noqa: E402
from gptcuda.runtime import Blob, Launch, Memset  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402

TINY = [(p, a, d, b, r) for p, a, d, b in itertools.product(["fp32", "tf32"], ["unfused", "fused"], [0.0, 0.1],
                                                            [True, False]) for r in (False, True)]
SHIPPED = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if p.name != "tiny.yaml")


def cases():
    """(name, config path, overrides) of every recorded configuration."""
    for p, a, d, b, r in TINY:
        yield (f"tiny:{p}:{a}:d{d}:bias{int(b)}:rc{int(r)}", "configs/tiny.yaml",
               [f"--precision={p}", f"--attention={a}", f"--dropout={d}", f"--bias={str(b).lower()}",
                f"--recompute={str(r).lower()}"])
    for name in SHIPPED:
        yield name, f"configs/{name}", ["--total_batch_tokens=0"]


def _no_ptrs(words: np.ndarray) -> np.ndarray:
    """64-bit words with the fake device addresses (>= 2**32) as 0."""
    return np.where(words >= np.uint64(1 << 32), np.uint64(0), words)


def _hash_launch(h, rec, labels=True, ptrs=True, name=True):
    """Feed a launch to hash h: its kernel, geometry, label, argument slots and blobs (labels / ptrs /
    name False: without its label / device addresses / kernel name)."""
    h.update(repr((rec.fn.file, rec.fn.name if name else "", rec.grid, rec.block, rec.smem,
                   rec.label if labels else "")).encode())
    h.update((rec.slots if ptrs else _no_ptrs(rec.slots)).tobytes())
    for i in sorted(rec.blobs):                  # the blob's bytes, not its alignment padding
        buf, addr = rec.blobs[i]
        off = addr - buf.ctypes.data
        blob = bytes(buf[off:off + len(buf) - Blob.ALIGN])
        h.update(blob if ptrs or len(blob) % 8 else _no_ptrs(np.frombuffer(blob, np.uint64)).tobytes())


def fingerprint(items, labels=True, ptrs=True, files="") -> str:
    """A launch sequence's hash; labels / ptrs False: without the launches' labels / device addresses
    (a slot, or a 64-bit word of an argument blob such as sum_rows' SumBatch, holding a fake device
    address, >= 2**32, hashes as 0); files: only launches of kernel files whose names start with this."""
    h = hashlib.sha256()
    for rec in items:
        if isinstance(rec, Launch) and not rec.fn.file.startswith(files):
            continue
        if isinstance(rec, Launch):
            _hash_launch(h, rec, labels, ptrs)
        elif files:
            continue
        elif isinstance(rec, Memset):
            h.update(repr(("memset", rec.label if labels else "")).encode())
        else:
            h.update(type(rec).__name__.encode())
    return h.hexdigest()[:16]


def launches(items, files="") -> list:
    """[[kernel name, hash of the rest of the launch without label and device addresses]] of a program."""
    out = []
    for rec in items:
        if isinstance(rec, Launch) and rec.fn.file.startswith(files):
            h = hashlib.sha256()
            _hash_launch(h, rec, labels=False, ptrs=False, name=False)
            out.append([rec.fn.name, h.hexdigest()[:12]])
    return out


def launch_diff(old: list, new: list, dropped=()) -> str:
    """The kernels whose launches a program lost (-) and gained (+), counted ('' when none)."""
    import collections
    import difflib
    from bench.sass_compare import without_dropped
    a = [json.dumps([without_dropped(n, dropped), k]) for n, k in old]
    b = [json.dumps(x) for x in new]
    count = collections.Counter()
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        for sign, lines in (("-", a[i1:i2]), ("+", b[j1:j2])) if op != "equal" else ():
            for line in lines:
                count[sign, json.loads(line)[0]] += 1
    return "; ".join(f"{sign}{n} {name}" for (sign, name), n in sorted(count.items(), key=lambda x: (x[0][1], x[0][0])))


def record(path, overrides):
    from tests.fakes import RecordingRuntime
    cfg = load_config(str(ROOT / path), overrides)
    vocab = cfg.vocab_size or (50304 if cfg.tokenizer == "gpt2" else -(-65 // cfg.vocab_multiple) * cfg.vocab_multiple)
    n_vocab = 50257 if cfg.tokenizer == "gpt2" and not cfg.vocab_size else min(vocab, 65)
    try:
        rt = RecordingRuntime(cfg)
    except TypeError:                    # (a tree whose recording runtime takes the precision)
        rt = RecordingRuntime(cfg.precision)
    be = CudaBackend(cfg, rt=rt)
    toks = np.arange(cfg.batch_size * cfg.block_size * 2 + 8, dtype=np.int32) % n_vocab
    eng = Engine(cfg, toks, toks, vocab, backend=be, programs=("train", "eval"), n_vocab=n_vocab)
    return {name: prog.items for name, prog in eng.programs.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the fingerprints here (JSON)")
    ap.add_argument("--compare", help="compare with fingerprints written earlier; exit 1 on a difference")
    ap.add_argument("--key", default="", help="compare this fingerprint only (with_labels, no_labels, no_ptrs)")
    ap.add_argument("--only", default="", help="record only cases whose name contains this")
    ap.add_argument("--files", default="", help="fingerprint only launches of kernel files starting with this")
    ap.add_argument("--dropped", nargs="*", default=[], metavar="KERNEL:INDEX=VALUE",
                    help="compare the recorded launches one by one, the old kernel names less this argument")
    a = ap.parse_args(argv)
    dropped = [(k, int(i), v) for k, rest in (d.split(":", 1) for d in a.dropped) for i, v in [rest.split("=", 1)]]
    got = {}
    for name, path, overrides in cases():
        if a.only and a.only not in name:
            continue
        for prog, items in record(path, overrides).items():
            got[f"{name}:{prog}"] = {"launches": sum(isinstance(r, Launch) and r.fn.file.startswith(a.files)
                                                     for r in items),
                                     "with_labels": fingerprint(items, files=a.files),
                                     "no_labels": fingerprint(items, False, files=a.files),
                                     "no_ptrs": fingerprint(items, False, False, files=a.files),
                                     "kernels": launches(items, a.files)}
    print(f"{len(got)} programs, {sum(v['launches'] for v in got.values())} launches")
    if a.out:
        Path(a.out).write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    if a.compare:
        want = json.loads(Path(a.compare).read_text())
        pick = (lambda v: v and v.get(a.key)) if a.key else \
            (lambda v: v and {k: x for k, x in v.items() if k != "kernels"})
        keys = set(got) if a.only else set(want) | set(got)          # (--only: the cases recorded now)
        bad = [k for k in sorted(keys) if pick(want.get(k)) != pick(got.get(k))]
        if dropped:
            bad = [k for k in bad if "kernels" not in (want.get(k) or {}) or k not in got or
                   launch_diff(want[k]["kernels"], got[k]["kernels"], dropped)]
        for k in bad:
            old, new = want.get(k) or {}, got.get(k) or {}
            diff = launch_diff(old["kernels"], new["kernels"], dropped) if "kernels" in old and "kernels" in new else ""
            print(f"DIFFERS {k}: {pick(old)} -> {pick(new)}" + (f"\n    {diff}" if diff else ""))
        print(f"{len(got) - len(bad)} of {len(got)} identical")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
