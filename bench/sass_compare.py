"""Is the machine code of every kernel variant the same in two source trees?

    python bench/sass_compare.py OLD_TREE NEW_TREE [--out DIR] [--jobs 2] [--grouped] [--files a.cu ...]
                                 [--dropped KERNEL:INDEX=VALUE ...]

OLD_TREE and NEW_TREE are checkouts of this repository (e.g. `git archive REV | tar -x -C DIR`), of
any package layout: each is imported in its own subprocess (PYTHONPATH = the tree), which collects
the VARIANTS of every op family of the CUDA backend (gptcuda.ops.cuda_backend.FAMILIES, or the older
gptcuda.cuda_backend.FAMILIES + gptcuda.cuda_ops.<family>) and compiles them with that tree's own
compiler.compile_kernel(use_cache=False): the runtime's options (options_for, ptxas report, no
fast-compile level), the runtime's target for sm_90 (target_arch: sm_90a for gemm_wgmma.cu), and
that tree's kernels/ as the include path. One NVRTC program per variant, as the runtime builds them
(core.py: compile_kernel(file, [name], ...)). --grouped: one program per (file, defines) with all its
name expressions, faster, but NOT a sound basis: in a 198-kernel gemm_tf32.cu program ptxas gave a
few kernels other code than the same kernels compiled alone (seen on NVRTC 13.5), so a grouped
difference must be confirmed per variant.

Each kernel is read out of its cubin (a plain ELF64 parse: no disassembler needed) and matched by
defines and name expression, in whichever file it lives (a kernel that moved between files is compared
with itself), or with the new tree's expression that only appends template arguments to the old one
(geometry passed by the launcher: flash_fwd_tc<64,false> -> flash_fwd_tc<64,false,128,...>; its mangled
name then differs, its code must not). --dropped KERNEL:INDEX=VALUE names a template parameter the new
tree's KERNEL no longer has (its other values went with the code they chose): an old variant whose
argument INDEX (from 0) is VALUE is compared with the new one that lacks it (gemm_wgmma_tma:5=1: the
TF32 form of a kernel that had a 3xTF32 one); old variants with another value there are old-only.
Identical means: the same bytes of .text.<mangled> (the machine
code), the same register count (ptxas's report in the compile log), static shared memory
(.nv.shared.<mangled>) and parameter bank size (.nv.constant0.<mangled>). Differences of
.nv.info.<mangled> (attributes, which hold symbol indices that shift with the module's other
kernels) are counted but not failures. No line info or debug sections are requested by the runtime,
so paths do not enter the comparison. Variants of one tree only are reported as missing, not as
differences. One line per kernel file.

NVRTC is not deterministic for some large kernels (seen on NVRTC 13.5 with gemm_tf32.cu: the same
tree, variant and options compiled three times gave two PTX texts and two machine codes, 183 vs 185
registers). So each kernel whose code differs is rechecked (--retries, default 4): compiled again that
many times in each tree with the tree's options (the runtime's), keeping every machine code and every
PTX seen (the module's PTX less the other kernels' entries, with labels and .weak/.globl comments
normalised). A kernel of which one machine code came out of both trees is the same kernel, varying
from run to run (reported, not a failure). A kernel whose expression is the same but whose mangled name
is not (a defaulted template argument added) is compared by its code and counted as renamed. Exit status
1 if a kernel's codes never met or a compile failed. Cubins and per-tree results go under --out.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import pickle
import re
import struct
import subprocess
import sys
import time
from pathlib import Path


def sections(elf: bytes) -> dict:
    """{name: (bytes, sh_info)} of an ELF64 little-endian file's sections (NOBITS: its size, an int)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    s = heads[shstrndx]
    strtab = elf[s[4]:s[4] + s[5]]
    name = lambda off: strtab[off:strtab.index(b"\0", off)].decode()          # noqa: E731
    return {name(h[0]): (elf[h[4]:h[4] + h[5]] if h[1] != 8 else h[5], h[7]) for h in heads}


# ---- worker side: runs with PYTHONPATH = one tree ------------------------------------------------
def _tree_api():
    """(compiler module, [(file, name, defines)]) of the tree on sys.path, whichever layout it has."""
    try:
        from gptcuda.ops.cuda_backend import FAMILIES
        from gptcuda.runtime import compiler
        mods = list(FAMILIES)
    except ImportError:
        from gptcuda.cuda_backend import FAMILIES
        from gptcuda import compiler
        mods = [importlib.import_module(f"gptcuda.cuda_ops.{f}") for f in FAMILIES]
    return compiler, [(f, n, dict(d)) for m in mods for f, n, d in m.VARIANTS]


def _compile_group(job):
    filename, defines, names, cubin_dir = job
    compiler, _ = _tree_api()
    t = time.time()
    try:
        c = compiler.compile_kernel(filename, list(names), dict(defines), arch="sm_90", use_cache=False)
    except Exception as e:                                      # CompileError: keep its message
        return filename, defines, {n: {"error": f"{e.__class__.__name__}: {e}"[:2000]} for n in names}, [], 0.0
    tag = hashlib.sha1(repr((defines, names)).encode()).hexdigest()[:10]
    Path(cubin_dir, f"{filename}.{tag}.cubin").write_bytes(c.cubin)
    sec = sections(c.cubin)
    out = {}
    for n in names:
        low = c.lowered[n]
        regs = re.search(rf"Function properties for {re.escape(low)}\n.*\n.*Used (\d+) registers", c.log)
        shared = sec.get(f".nv.shared.{low}", (0, 0))[0]                 # NOBITS: its size
        out[n] = {"lowered": low, "text": sec.get(f".text.{low}", (None, 0))[0], "regs": regs and int(regs[1]),
                  "shared": shared if isinstance(shared, int) else len(shared),
                  "param": len(sec.get(f".nv.constant0.{low}", (b"", 0))[0]),
                  "nvinfo": sec.get(f".nv.info.{low}", (b"", 0))[0]}
    extra = sorted(k[6:] for k in sec if k.startswith(".text.") and k[6:] not in c.lowered.values())
    return filename, defines, out, extra, time.time() - t


def worker(tree: Path, out: Path, jobs: int, grouped: bool, files):
    import multiprocessing
    compiler, variants = _tree_api()
    assert Path(compiler.__file__).resolve().is_relative_to(tree.resolve()), compiler.__file__
    (out / "cubins").mkdir(parents=True, exist_ok=True)
    groups = {}
    for f, n, d in variants:
        if not files or f in files:
            names = groups.setdefault((f, tuple(sorted(d.items()))), [])
            if n not in names:
                names.append(n)
    work = [(f, d, tuple(g), str(out / "cubins")) for (f, d), names in groups.items()
            for g in ([names] if grouped else [[n] for n in names])]
    work.sort(key=lambda j: -len(j[2]))                          # the largest programs first
    results, extras = {}, {}
    t0 = time.time()
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        for i, (f, d, res, extra, dt) in enumerate(pool.imap_unordered(_compile_group, work), 1):
            results.update({(f, d, n): r for n, r in res.items()})
            extras.setdefault(f, set()).update(extra)
            if i % 50 == 0 or i == len(work) or len(res) > 1:
                print(f"  [{tree.name}] {i}/{len(work)} {f} {dict(d) or ''} {len(res)} names {dt:.0f}s "
                      f"(total {time.time() - t0:.0f}s)", flush=True)
    (out / "results.pkl").write_bytes(pickle.dumps({"results": results, "extras": extras}))


# ---- driver side ---------------------------------------------------------------------------------
def _entry_ptx(ptx: str, low: str) -> str:
    """The module's PTX without the other kernels' entries, the .globl/.weak comments and the function
    numbers in labels (which depend on the kernel's place in the module)."""
    out, skip = [], False
    ptx = re.sub(r"(\$L__BB|__local_depot)\d+", r"\1", ptx)
    for line in ptx.splitlines():
        m = re.match(r"(\.\w+\s+)*\.entry\s+(\w+)", line)
        if m:
            skip = m[2] != low
        if re.match(r"\s*// \.(globl|weak)", line):
            continue
        if not skip:
            out.append(line)
        elif line == "}":
            skip = False
    return "\n".join(out)


def _recheck_one(job):
    """Compile one variant `retries` times as the runtime does (the tree's options_for, target_arch and
    include path, ptxas report): {"ptx": set of PTX digests, "text": set of .text digests}."""
    (filename, defines, name), retries = job
    from cuda.bindings import nvrtc
    compiler, _ = _tree_api()
    opts = [o.encode() for o in compiler.options_for(compiler.target_arch(filename, "sm_90"), dict(defines))
            + [compiler.PTXAS_INFO]]
    seen = {"ptx": set(), "text": set()}
    for _ in range(retries):
        _, prog = nvrtc.nvrtcCreateProgram((compiler.KERNEL_DIR / filename).read_bytes(),
                                           f"kernels/{filename}".encode(), 0, [], [])
        nvrtc.nvrtcAddNameExpression(prog, name.encode())
        assert nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS, name
        low = nvrtc.nvrtcGetLoweredName(prog, name.encode())[1].decode()
        bufs = {}
        for what, size_of, get in (("ptx", nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX),
                                   ("cubin", nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)):
            bufs[what] = bytearray(size_of(prog)[1])
            get(prog, bufs[what])
        nvrtc.nvrtcDestroyProgram(prog)
        text = sections(bytes(bufs["cubin"]))[f".text.{low}"][0]
        seen["ptx"].add(hashlib.sha1(_entry_ptx(bytes(bufs["ptx"]).rstrip(b"\0").decode(), low).encode()).hexdigest())
        seen["text"].add(hashlib.sha1(text).hexdigest())
    return (filename, defines, name), seen


def recheck(keys_file: Path, out: Path, jobs: int, retries: int):
    import multiprocessing
    keys = pickle.loads(keys_file.read_bytes())
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        res = dict(pool.map(_recheck_one, [(k, retries) for k in keys], chunksize=1))
    (out / "recheck.pkl").write_bytes(pickle.dumps(res))


def run_tree(tree: Path, out: Path, args, extra=()) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(tree), "--out", str(out),
           "--jobs", str(args.jobs)] + (["--grouped"] if args.grouped else []) \
        + (["--files", *args.files] if args.files else []) + list(extra)
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    return pickle.loads((out / ("recheck.pkl" if extra else "results.pkl")).read_bytes())


def describe(a: dict, b: dict) -> str:
    if a["text"] is None or b["text"] is None:
        return "no .text section"
    parts = []
    if a["text"] != b["text"]:
        ta, tb = a["text"], b["text"]
        first = next((i for i in range(min(len(ta), len(tb))) if ta[i] != tb[i]), min(len(ta), len(tb)))
        parts.append(f"text {len(ta) // 16}->{len(tb) // 16} instr, first diff at instr {first // 16}")
    for k in ("regs", "shared", "param"):
        if a[k] != b[k]:
            parts.append(f"{k} {a[k]}->{b[k]}")
    return ", ".join(parts)


def same_kernel(old_name: str, new_name: str) -> bool:
    """Is the new tree's name expression the old tree's kernel? The same expression, or the old one with
    template arguments appended (geometry a launcher now passes): k<64,false> -> k<64,false,128,2>,
    k -> k<8>. The code is then compared as usual; only the mangled name may differ."""
    if old_name == new_name:
        return True
    return new_name.startswith(old_name[:-1] + "," if old_name.endswith(">") else old_name + "<")


def without_dropped(name: str, dropped=()) -> str:
    """The old tree's name expression with the template argument of each (kernel, index, value) of
    `dropped` removed where the expression is that kernel's and has that value there (--dropped)."""
    base, _, args = name.partition("<")
    for kernel, index, value in dropped:
        sep = ", " if ", " in args else ","
        parts = [x.strip() for x in args[:-1].split(",")] if args.endswith(">") else []
        if base == kernel and index < len(parts) and parts[index] == value:
            del parts[index]
            args = sep.join(parts) + ">"
    return f"{base}<{args}" if args else base


def pair(ro: dict, rn: dict, dropped=()) -> list:
    """[(old key, new key)] of the variants compiled in both trees: the same defines and the same kernel
    (same_kernel; the old name less the `dropped` arguments), in whichever file it lives; the same name
    expression first, then appended arguments."""
    pairs, used_o, used_n = [], set(), set()
    old_name = {ko: without_dropped(ko[2], dropped) for ko in ro}
    for exact in (True, False):
        for kn in sorted(rn):
            if kn in used_n:
                continue
            cands = [ko for ko in sorted(ro) if ko not in used_o and ko[1] == kn[1] and
                     (old_name[ko] == kn[2] if exact else same_kernel(old_name[ko], kn[2]))]
            cands.sort(key=lambda ko: ko[0] != kn[0])                   # the same file first
            if cands:
                used_o.add(cands[0])
                used_n.add(kn)
                pairs.append((cands[0], kn))
    return pairs


def compare(old: dict, new: dict, dropped=()):
    """Prints the per-file summary (by the new tree's file; a kernel that moved counts under its new
    file, its old file named); returns (failed, [(old key, new key)] whose code differs)."""
    ro, rn = old["results"], new["results"]
    pairs = pair(ro, rn, dropped)
    matched_o, matched_n = {o for o, _ in pairs}, {n for _, n in pairs}
    files = sorted({k[0] for k in rn} | {k[0] for k in ro if k not in matched_o})
    failed, retry = False, []
    for f in files:
        fp = [(o, n) for o, n in pairs if n[0] == f]
        same, differ, nvinfo, errors, renamed = 0, [], 0, [], 0
        moved = sorted({o[0] for o, n in fp if o[0] != f})
        for o, n in fp:
            a, b = ro[o], rn[n]
            if "error" in a or "error" in b:
                errors.append(f"{n[2]}: {(a.get('error') or b.get('error')).splitlines()[0]}")
                continue
            if a["lowered"] != b["lowered"]:
                # the same expression under another mangled name: the kernel gained a defaulted template
                # argument (the runtime finds kernels by expression); its code is compared all the same
                renamed += 1
            d = describe(a, b) if a["text"] is None or b["text"] is None or any(
                a[x] != b[x] for x in ("text", "regs", "shared", "param")) else ""
            if d:
                differ.append(f"{o[2]} -> {n[2]} {dict(n[1]) or ''} [{d}]" if o[2] != n[2] else f"{n[2]} {dict(n[1]) or ''} [{d}]")
                retry.append((o, n))
            else:
                same += 1
                nvinfo += a["nvinfo"] != b["nvinfo"]
        only_old = sorted(f"{k[2]} {dict(k[1]) or ''}".strip() for k in ro if k[0] == f and k not in matched_o)
        only_new = sorted(f"{k[2]} {dict(k[1]) or ''}".strip() for k in rn if k[0] == f and k not in matched_n)
        line = (f"{f}: compared {len(fp)}, identical {same}, differing {len(differ)}, "
                f"old-only {len(only_old)}, new-only {len(only_new)}")
        if moved:
            line += f" (moved from {', '.join(moved)})"
        if renamed:
            line += f"; {renamed} renamed (template arguments appended, or --dropped)"
        if nvinfo:
            line += f", .nv.info differs (not a failure) for {nvinfo}"
        ex_o, ex_n = old["extras"].get(f, set()), new["extras"].get(f, set())
        if f in old["extras"] and f in new["extras"] and ex_o != ex_n:
            line += f"; kernels in the cubin beyond the variants: old {len(ex_o)}, new {len(ex_n)}"
        print(line)
        for tag, items in (("DIFFERS", differ), ("ERROR", errors), ("old-only", only_old), ("new-only", only_new)):
            for it in items:
                print(f"    {tag}: {it}")
        failed |= bool(errors)
    print(f"TOTAL: {len(pairs)} variants in both trees; {len(retry)} with other machine code")
    return failed, retry


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="*", type=Path)
    p.add_argument("--out", type=Path, default=Path("/tmp/sass_compare"))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--grouped", action="store_true")
    p.add_argument("--files", nargs="*", default=None)
    p.add_argument("--retries", type=int, default=4)
    p.add_argument("--dropped", nargs="*", default=[], metavar="KERNEL:INDEX=VALUE",
                   help="a template argument the new tree's kernel no longer takes")
    p.add_argument("--worker", type=Path, default=None)
    p.add_argument("--recheck", type=Path, default=None)
    args = p.parse_args()
    args.jobs = max(1, min(args.jobs, os.cpu_count() or 1))      # at most one compiling process a core
    if args.recheck is not None:
        return recheck(args.recheck, args.out, args.jobs, args.retries)
    if args.worker is not None:
        return worker(args.worker, args.out, args.jobs, args.grouped, set(args.files or ()))
    if len(args.trees) != 2:
        p.error("give two trees: OLD_TREE NEW_TREE")
    old_t, new_t = (t.resolve() for t in args.trees)
    res = [run_tree(t, args.out / tag, args) for tag, t in (("old", old_t), ("new", new_t))]
    print(f"\nold: {old_t}\nnew: {new_t}\n")
    dropped = [(k, int(i), v) for k, rest in (d.split(":", 1) for d in args.dropped)
               for i, v in [rest.split("=", 1)]]
    failed, retry = compare(*res, dropped)
    if retry and args.retries > 0:
        print(f"\nRECHECK: each differing kernel compiled {args.retries}x more per tree (PTX and machine code):")
        checked = []
        for side, (tag, t) in enumerate((("old", old_t), ("new", new_t))):    # each tree its own keys
            keys = args.out / f"retry-{tag}.pkl"
            keys.write_bytes(pickle.dumps([k[side] for k in retry]))
            checked.append(run_tree(t, args.out / tag, args, ["--recheck", str(keys), "--retries", str(args.retries)]))
        ro, rn = checked
        for ko, kn in retry:
            o, n = ro[ko], rn[kn]
            first = {"o": {hashlib.sha1(res[0]["results"][ko]["text"]).hexdigest()},
                     "n": {hashlib.sha1(res[1]["results"][kn]["text"]).hexdigest()}}
            codes_o, codes_n = o["text"] | first["o"], n["text"] | first["n"]
            met = bool(codes_o & codes_n)
            print(f"    {kn[0]} {kn[2]} {dict(kn[1]) or ''}: {'same kernel, run-to-run variation' if met else 'DIFFERS'}; "
                  f"distinct machine codes old {len(codes_o)}, new {len(codes_n)}, common {len(codes_o & codes_n)}; "
                  f"distinct PTX old {len(o['ptx'])}, new {len(n['ptx'])}, common {len(o['ptx'] & n['ptx'])}")
            failed |= not met
    elif retry:
        failed = True
    print("RESULT:", "DIFFERENCES in the sources' code" if failed else
          "no difference from the sources (machine code identical, or only ptxas's run-to-run variation)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main() or 0)
