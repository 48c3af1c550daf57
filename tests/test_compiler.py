"""NVRTC: every kernel variant compiles for sm_90; the disk cache hits, misses, and rebuilds a
corrupt entry; a compile error shows file and line; compiles can be forbidden. No GPU needed."""
import os
import re
from pathlib import Path

import pytest

from gptcuda import files
from gptcuda.runtime import compiler
from gptcuda.ops.cuda_backend import FAMILIES

pytest.importorskip("cuda.bindings.nvrtc")


def _family(mod) -> str:
    return mod.__name__.rsplit(".", 1)[-1]           # gptcuda.ops.cuda.gemm -> gemm


def all_variants():
    """The backend's variants, and the teaching kernels bench/gemm.py --ladder launches (gemm_simt.cu's)."""
    from bench.gemm import LADDER, SIMT_FILE
    return [(_family(mod), file, name, dict(defines)) for mod in FAMILIES for file, name, defines in mod.VARIANTS] + \
        [("bench", SIMT_FILE, name, {}) for name, _, _ in LADDER]


VARIANTS = all_variants()


def test_every_family_lists_variants():
    fams = {v[0] for v in VARIANTS}
    assert fams == {_family(mod) for mod in FAMILIES} | {"bench"}


# xdist_group: under pytest-xdist's --dist loadgroup, one worker checks a file's variants, in one program
@pytest.mark.parametrize("fam,file,name,defines", [
    pytest.param(*v, id=f"{v[1]}:{v[2]}:{','.join(f'{k}={x}' for k, x in sorted(v[3].items()))}",
                 marks=pytest.mark.xdist_group(f"check:{v[1]}")) for v in VARIANTS])
def test_variant_compiles_for_sm90(fam, file, name, defines, checked_variants):
    """The variant's source, name expression and defines go through NVRTC's front end, NVVM and ptxas
    to machine code for sm_90 (sm_90a: gemm_wgmma.cu). compiler.check_compile, in the background
    (conftest): all the variants of a file with the same defines in one program, at the fast-compile
    level, so NVVM's and ptxas's optimizations are the runtime compile's only steps left out."""
    cubin, lowered, log = checked_variants.check(file, name, defines)
    assert cubin[:4] == b"\x7fELF" and lowered
    arch = compiler.target_arch(file, "sm_90")
    assert f"Compiling entry function '{lowered}' for '{arch}'" in log, f"ptxas did not build {lowered}"
    report = re.search(rf"Function properties for {re.escape(lowered)}\n.*\n.*Used (\d+) registers", log)
    assert report and int(report[1]) <= 255, f"no resource report for {lowered}"     # ptxas's, of the kernel
    assert _sections(cubin).get(f".text.{lowered}"), f"no machine code for {name} ({lowered})"


def _write_kernel(tmp_path, monkeypatch, text, fname="probe.cu"):
    kdir = tmp_path / "kernels"
    kdir.mkdir(exist_ok=True)
    (kdir / fname).write_text(text)
    monkeypatch.setattr(compiler, "KERNEL_DIR", kdir)
    monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path / "cache"))
    return kdir


SRC = '#include "inc.cuh"\ntemplate <int N> __global__ void k(float* x) { x[threadIdx.x] += N * SCALE; }\n'


def test_cache_miss_hit_and_key_sensitivity(tmp_path, monkeypatch):
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    a = compiler.compile_kernel("probe.cu", ["k<3>"], {"X": 1})
    assert not a.from_cache
    b = compiler.compile_kernel("probe.cu", ["k<3>"], {"X": 1})
    assert b.from_cache and b.cubin == a.cubin and b.key == a.key
    # anything that changes the binary changes the key
    assert compiler.compile_kernel("probe.cu", ["k<3>"], {"X": 2}).key != a.key      # defines
    assert compiler.compile_kernel("probe.cu", ["k<4>"], {"X": 1}).key != a.key      # name expressions
    assert compiler.compile_kernel("probe.cu", ["k<3>"], {"X": 1}, arch="sm_80").key != a.key
    (kdir / "inc.cuh").write_text("#define SCALE 3.0f\n")                           # an included header
    c = compiler.compile_kernel("probe.cu", ["k<3>"], {"X": 1})
    assert c.key != a.key and not c.from_cache
    src = compiler.expand_source("probe.cu")
    opts = compiler.options_for("sm_90", {"X": 1})
    assert compiler.cache_key(src, ["k<3>"], opts, (13, 0), "sm_90") != compiler.cache_key(
        src, ["k<3>"], opts, (13, 1), "sm_90")                                        # the NVRTC version


def test_corrupt_entry_is_detected_and_rebuilt(tmp_path, monkeypatch):
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    a = compiler.compile_kernel("probe.cu", ["k<1>"])
    path = Path(os.environ["GPTCUDA_CACHE"]) / f"{a.key}.cubin"
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    before = compiler.stats["corrupt"]
    with pytest.warns(compiler.CacheWarning, match="corrupt"):
        b = compiler.compile_kernel("probe.cu", ["k<1>"])
    assert compiler.stats["corrupt"] == before + 1
    assert not b.from_cache and b.cubin == a.cubin
    assert compiler.compile_kernel("probe.cu", ["k<1>"]).from_cache
    assert not list(path.parent.glob(".*.tmp"))        # atomic writes leave no temporaries


def test_compile_error_shows_file_and_line(tmp_path, monkeypatch):
    _write_kernel(tmp_path, monkeypatch, "__global__ void bad(float* x) {\n  x[0] = undefined_name;\n}\n", "bad.cu")
    with pytest.raises(compiler.CompileError) as e:
        compiler.compile_kernel("bad.cu", ["bad"])
    msg = str(e.value)
    assert "kernels/bad.cu(2)" in msg and "undefined_name" in msg


def test_forbid_compiles(tmp_path, monkeypatch):
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    compiler.compile_kernel("probe.cu", ["k<2>"])
    with compiler.forbid_compiles():
        assert compiler.compile_kernel("probe.cu", ["k<2>"]).from_cache     # a hit is fine
        with pytest.raises(compiler.CompileForbidden):
            compiler.compile_kernel("probe.cu", ["k<5>"])


def _wgmma_pipeline_names():
    from gptcuda.ops.cuda.gemm.families import EPI_GELU, EPI_NONE, FAMILIES
    names = [FAMILIES["wgmma"].kernel(t, False, True, EPI_GELU, True) for t in FAMILIES["wgmma"].tiles]  # every loader
    # A through registers (two fragment buffers): B K-major with column sums, B turned, C stored transposed
    names += [FAMILIES["wgmma_ra"].kernel(t, True, True, EPI_NONE, False, colsum=True) for t in FAMILIES["wgmma_ra"].tiles]
    names += [FAMILIES[f].kernel(t, True, False, EPI_NONE, False) for f in ("wgmma_ra_mn", "wgmma_ra_t")
              for t in FAMILIES[f].tiles]
    # 3xTF32 split in the kernel (A in registers, B in shared memory): both operands K-major, and both as
    # stored (the weight gradient's TN takes no epilogue: its plain kernel)
    return names + [FAMILIES["wgmma3_ra"].kernel(t, ta, tb, epi, hb, True)
                    for t in FAMILIES["wgmma3_ra"].tiles
                    for ta, tb, epi, hb in ((False, True, EPI_GELU, True), (True, False, EPI_NONE, False))]


def _bf16_pipeline_names():
    from gptcuda.ops.cuda.gemm.families import EPI_DGELU_GELU, EPI_GELU, EPI_NONE, FAMILIES
    fam = FAMILIES["bf16"]      # per tile the widest epilogues it serves: GELU with a bias, the GELU rebuild; TN's sums
    return [fam.kernel(t, ta, tb, epi, hb, out=out, colsum=cs) for t in fam.tiles for ta, tb, epi, hb, out, cs in
            ((False, True, EPI_GELU, True, "bf16", False), (False, False, EPI_DGELU_GELU, False, "bf16", False),
             (True, False, EPI_NONE, False, "f32", True)) if fam.serves(t, epi, cs)]


def _flash_wgmma_kernels():
    """(file, name) of the flash kernels on warpgroup MMA: flash_tc's dK / dV, every flash_bf16 kernel."""
    from gptcuda.ops.cuda import attention, flash
    dkv = [flash.flash_kernel("dkv", "flash_tc", hs, d, wg=True) for hs in flash.FLASH_WG_HEAD_SIZES
           for d in (False, True)]
    return [(k.file, k.name) for k in dkv] + [(f, n) for f, n, _ in attention.VARIANTS if f == "flash_bf16.cu"]


@pytest.mark.parametrize("file,name,defines", [("gemm_wgmma.cu", n, {}) for n in _wgmma_pipeline_names()] +
                         [("gemm_wgmma.cu", n, {}) for n in _bf16_pipeline_names()] +
                         [(f, n, {}) for f, n in _flash_wgmma_kernels()],
                         ids=lambda v: v if isinstance(v, str) and "<" in v else "")
def test_wgmma_kernels_keep_their_pipeline(prebuilt_kernels, file, name, defines):
    """ptxas's report for every wgmma tile (each loader, TF32 and 3xTF32, the widest epilogue; the
    weight-gradient kernel reading its operands as stored; the dK / dV flash kernel): the wgmma stay
    asynchronous (no C7514
    "wgmma ... serialized" note: accumulators pinned by wg_fence_acc), no spills, and sm_90a is the
    target. The report is the one the session's compile of the variant left in its cache entry
    (compile_kernel keeps ptxas's report in the log); one test a variant, so that pytest-xdist
    spreads these full-optimization compiles over the workers."""
    from gptcuda.ops.cuda.gemm.families import WGMMA_FILE
    assert WGMMA_FILE == "gemm_wgmma.cu"
    arch = compiler.target_arch(file, "sm_90")
    assert arch == "sm_90a"
    prebuilt_kernels.wait(file, name)
    c = compiler.compile_kernel(file, [name], arch="sm_90", ptxas_info=True)
    assert set(c.lowered) == {name}
    assert f"Compiling entry function '{c.lowered[name]}' for 'sm_90a'" in c.log, c.log
    assert "C7514" not in c.log and "serialized" not in c.log, c.log
    spills = [ln for ln in c.log.splitlines() if "spill" in ln]
    budget = SPILL_BUDGET.get(name, SPILL_BUDGET.get(name.split(",")[0] + ",", 0))
    assert spills and all(int(re.search(r"(\d+) bytes spill stores", ln).group(1)) <= budget and
                          int(re.search(r"(\d+) bytes spill loads", ln).group(1)) <= budget for ln in spills), c.log


# Spill bytes allowed per kernel (none elsewhere): the dK/dV flash kernel at head size 64 is held to
# 168 registers so that three blocks share an SM, and ptxas then spills a few loop-invariant values
# (32-48 bytes; 80 with dropout since its keep words are drawn for four probabilities: one word and one
# shuffle a query column where two of each were); three blocks with these spills ran 3-6% faster than
# two without (bench/NOTES.md).
# A key up to the name's first comma covers every variant of that first template argument.
# gemm_wgmma3_ra (BM 128) holds two accumulator sets and two k steps' hi / lo fragments in 168
# registers; at 128 x 128 ptxas spills
# 4-32 bytes in its bias, residual and GELU variants, which still ran the fp32 step 3% faster than
# the kernel that split both operands in shared memory (bench/NOTES.md).
# flash_bwd_dkv_bf16 at head size 128 holds dK and dV (two 64 x 128 accumulators) beside a tile's S^T and
# dP^T: ptxas spills 16-28 bytes (72-172 before its lse and D loads moved out of the softmax gradient; pipelined,
# with the next tile's beside this one's fragments, it spilled ~270 and serialized the wgmma, so only head
# size 64 is pipelined, which spills nothing).
SPILL_BUDGET = {"flash_bwd_dkv_wg<64,": 96, "gemm_wgmma3_ra<128,": 32, "flash_bwd_dkv_bf16<128,": 32}


def test_compile_leaves_python_objects_alone(tmp_path, monkeypatch):
    """A compile with an empty log (NVRTC's log size is 1: the NUL) must not write into a shared
    Python object: b" " * 1 is CPython's cached b" ", and writing the NUL there once turned every
    later space of the process into a NUL."""
    _write_kernel(tmp_path, monkeypatch, "__global__ void quiet(float* x) { x[threadIdx.x] = 1.f; }\n",
                  "quiet.cu")
    c = compiler.compile_kernel("quiet.cu", ["quiet"], arch="sm_90", use_cache=False, ptxas_info=False)
    assert c.log == ""
    assert c.cubin[:4] == b"\x7fELF"
    assert b" "[0] == 32 and bytes([32]).decode() == " " and b"a b".split() == [b"a", b"b"]


# ---- the cache entry as a whole --------------------------------------------------------------------
def _probe(tmp_path, monkeypatch, names=("k<1>",)):
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    c = compiler.compile_kernel("probe.cu", list(names))
    return c, Path(os.environ["GPTCUDA_CACHE"]) / f"{c.key}.cubin"


def _rebuilt_once(names=("k<1>",)):
    before = dict(compiler.stats)
    with pytest.warns(compiler.CacheWarning):
        b = compiler.compile_kernel("probe.cu", list(names))
    assert compiler.stats["corrupt"] == before["corrupt"] + 1 and compiler.stats["misses"] == before["misses"] + 1
    assert not b.from_cache
    assert compiler.compile_kernel("probe.cu", list(names)).from_cache
    return b


def test_name_table_is_covered_by_the_checksum(tmp_path, monkeypatch):
    """A flipped character in the stored kernel-name table (not in the cubin) is a corrupt entry:
    served as a hit it would hand the runtime a name that is not in the module."""
    a, path = _probe(tmp_path, monkeypatch)
    entry = f'"k<1>": "{a.lowered["k<1>"]}"'.encode()
    blob = path.read_bytes()
    assert blob.count(entry) == 1 and blob.index(entry) < len(blob) - len(a.cubin)   # the header's name table
    bad = bytearray(blob)
    bad[blob.index(entry) + len(entry) - 3] ^= 0x01        # a character of the mangled name
    path.write_bytes(bytes(bad))
    b = _rebuilt_once()
    assert b.lowered == a.lowered and b.cubin == a.cubin


@pytest.mark.parametrize("damage", ["log", "key", "truncate", "magic", "empty", "other_key"])
def test_any_damage_to_an_entry_is_a_rebuild(tmp_path, monkeypatch, damage):
    a, path = _probe(tmp_path, monkeypatch)
    blob = path.read_bytes()
    if damage == "log":                      # a byte of the stored log (ptxas's report)
        i = blob.index(b"ptxas info")
        blob = blob[:i] + b"P" + blob[i + 1:]
    elif damage == "key":
        i = blob.index(a.key.encode())
        blob = blob[:i] + (b"0" if blob[i:i + 1] != b"0" else b"1") + blob[i + 1:]
    elif damage == "truncate":
        blob = blob[:-1]
    elif damage == "magic":
        blob = b"GCCUBIN1" + blob[8:]
    elif damage == "empty":
        blob = b""
    else:                                    # a valid entry of another key filed under this one
        other = compiler.compile_kernel("probe.cu", ["k<2>"])
        blob = (path.parent / f"{other.key}.cubin").read_bytes()
    path.write_bytes(blob)
    b = _rebuilt_once()
    assert b.cubin == a.cubin and b.lowered == a.lowered


def test_entry_path_that_is_a_directory_is_a_miss(tmp_path, monkeypatch):
    """No traceback: the kernel is compiled, what was in the directory is kept (renamed aside),
    and the entry is written in its place."""
    a, path = _probe(tmp_path, monkeypatch)
    path.unlink()
    path.mkdir()
    (path / "keep.txt").write_text("mine")
    b = _rebuilt_once()
    assert b.cubin == a.cubin and path.is_file()
    aside = list(path.parent.glob(path.name + ".bad-*"))
    assert len(aside) == 1 and (aside[0] / "keep.txt").read_text() == "mine"


def test_unwritable_cache_still_compiles(tmp_path, monkeypatch):
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("GPTCUDA_CACHE", str(blocker))                  # the cache path is a file
    with pytest.warns(compiler.CacheWarning, match="not cached"):
        c = compiler.compile_kernel("probe.cu", ["k<1>"])
    assert c.cubin[:4] == b"\x7fELF" and not c.from_cache


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_entries_follow_the_umask(tmp_path, monkeypatch, umask):
    old = os.umask(umask)
    try:
        assert files.current_umask() == umask
        _, path = _probe(tmp_path, monkeypatch)
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    assert not list(path.parent.glob(".*.tmp")) and not list(path.parent.glob("*.lock"))


def _sections(elf: bytes) -> dict:
    """{name: bytes} of an ELF64 little-endian file's sections."""
    import struct
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = elf[heads[shstrndx][4]:heads[shstrndx][4] + heads[shstrndx][5]]
    name = lambda off: strtab[off:strtab.index(b"\0", off)].decode()          # noqa: E731
    return {name(h[0]): (elf[h[4]:h[4] + h[5]] if h[1] != 8 else h[5]) for h in heads}


def test_ptxas_report_is_kept_and_leaves_the_code_alone(tmp_path, monkeypatch):
    """compile_kernel keeps ptxas's report in the log and the entry (a hit returns it too); the
    option changes no section of the cubin but the tool-info note that records it."""
    a, _ = _probe(tmp_path, monkeypatch)
    assert f"Function properties for {a.lowered['k<1>']}" in a.log and "spill stores" in a.log
    hit = compiler.compile_kernel("probe.cu", ["k<1>"])
    assert hit.from_cache and hit.log == a.log
    plain = compiler.compile_kernel("probe.cu", ["k<1>"], use_cache=False, ptxas_info=False)
    assert "ptxas info" not in plain.log
    sa, sp = _sections(a.cubin), _sections(plain.cubin)
    assert sa.keys() == sp.keys() and any(k.startswith(".text.") for k in sa)
    assert {k for k in sa if sa[k] != sp[k]} <= {".note.nv.tkinfo"}
    # an entry written without the report is rebuilt when the report is asked for, kept otherwise
    c = compiler.compile_kernel("probe.cu", ["k<3>"], ptxas_info=False)
    assert compiler.compile_kernel("probe.cu", ["k<3>"], ptxas_info=False).from_cache
    d = compiler.compile_kernel("probe.cu", ["k<3>"])
    assert not d.from_cache and "ptxas info" in d.log and d.key == c.key
    assert compiler.compile_kernel("probe.cu", ["k<3>"], ptxas_info=False).from_cache


def test_a_key_being_compiled_elsewhere_is_waited_for(tmp_path, monkeypatch):
    """Processes (or threads) sharing a cache compile a kernel once: the second waits on the key's
    lock and reads the entry the first wrote."""
    import threading
    import time
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    built = compiler.compile_kernel("probe.cu", ["k<7>"], use_cache=False)
    path = Path(os.environ["GPTCUDA_CACHE"]) / f"{built.key}.cubin"
    out = {}
    with compiler._key_lock(path):
        t = threading.Thread(target=lambda: out.setdefault("c", compiler.compile_kernel("probe.cu", ["k<7>"])))
        misses = compiler.stats["misses"]
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and "c" not in out                 # waiting on the lock
        compiler._write_entry(path, built.key, built.cubin, built.lowered, built.log, True)
    t.join(30)
    assert out["c"].from_cache and out["c"].cubin == built.cubin and compiler.stats["misses"] == misses


def test_worker_job_reports_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path / "cache"))
    err = compiler._compile_job(("no_such_file.cu", "k", (), "sm_90", str(tmp_path / "cache")))
    assert err.startswith("CompileError:") and "no_such_file.cu" in err


def test_check_compile_differs_from_the_runtime_compile_in_optimization_only(tmp_path, monkeypatch):
    """check_compile (the CPU suite's compile of every variant) takes the runtime's source, name
    expressions and options, and adds the fast-compile level; the runtime's compile (compile_kernel)
    never gets that level (its key and cubin say so), and a check caches nothing."""
    kdir = _write_kernel(tmp_path, monkeypatch, SRC)
    (kdir / "inc.cuh").write_text("#define SCALE 2.0f\n")
    cubin, lowered, log = compiler.check_compile("probe.cu", ["k<1>", "k<2>"], {"X": 1})
    assert not Path(os.environ["GPTCUDA_CACHE"]).exists()
    real = compiler.compile_kernel("probe.cu", ["k<1>"], {"X": 1})
    assert lowered["k<1>"] == real.lowered["k<1>"] and lowered["k<2>"]
    assert real.key == compiler.cache_key(compiler.expand_source("probe.cu"), ["k<1>"],
                                          compiler.options_for("sm_90", {"X": 1}), compiler.nvrtc_version(), "sm_90")
    tool_info = lambda elf: _sections(elf)[".note.nv.tkinfo"]          # noqa: E731  (ptxas's options)
    assert b"-Ofc" in tool_info(cubin) and b"-Ofc" not in tool_info(real.cubin)


def test_a_check_compile_leaves_the_process_runtime_compiles_alone():
    """After a check compile (NVRTC's fast level), a runtime compile of a large kernel in the same process
    gives the machine code it gave before: check_compile runs NVRTC in a process of its own (in one
    process, NVRTC 13.5 built the flash kernels of the programs after a fast one differently)."""
    from gptcuda.ops.cuda import attention
    (check, cd), (name, d) = [(n, d) for f, n, d in attention.VARIANTS if f == "flash_bf16.cu"][:2]
    first = compiler.compile_kernel("flash_bf16.cu", [name], d, use_cache=False).cubin
    compiler.check_compile("flash_bf16.cu", [check], cd)
    assert compiler.compile_kernel("flash_bf16.cu", [name], d, use_cache=False).cubin == first


def test_check_group_gives_each_variant_its_verdict(tmp_path, monkeypatch):
    """A variant that does not compile fails alone, with its own error (file and line); the other
    variants of its program still pass."""
    _write_kernel(tmp_path, monkeypatch, "template <int N> __global__ void k(float* x) {\n"
                  "  static_assert(N != 2, \"no two\");\n  x[0] = N;\n}\n", "some.cu")
    got = compiler.check_group("some.cu", ["k<1>", "k<2>", "k<3>"])
    assert isinstance(got["k<2>"], str) and "kernels/some.cu(2)" in got["k<2>"] and "no two" in got["k<2>"]
    for n in ("k<1>", "k<3>"):
        cubin, lowered, log = got[n]
        assert f"Compiling entry function '{lowered}' for 'sm_90'" in log and _sections(cubin).get(f".text.{lowered}")
