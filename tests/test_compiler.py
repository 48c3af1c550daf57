"""NVRTC: every kernel variant compiles for sm_90; the disk cache hits, misses, and rebuilds a
corrupt entry; a compile error shows file and line; compiles can be forbidden. No GPU needed."""
import importlib
import os
from pathlib import Path

import pytest

from gptcuda import compiler
from gptcuda.cuda_backend import FAMILIES

pytest.importorskip("cuda.bindings.nvrtc")


def all_variants():
    out = []
    for fam in FAMILIES:
        mod = importlib.import_module(f"gptcuda.cuda_ops.{fam}")
        for file, name, defines in mod.VARIANTS:
            out.append((fam, file, name, dict(defines)))
    return out


VARIANTS = all_variants()


def test_every_family_lists_variants():
    fams = {v[0] for v in VARIANTS}
    assert fams == set(FAMILIES)


@pytest.mark.parametrize("fam,file,name,defines", VARIANTS,
                         ids=[f"{v[1]}:{v[2]}:{','.join(f'{k}={x}' for k, x in sorted(v[3].items()))}"
                              for v in VARIANTS])
def test_variant_compiles_for_sm90(fam, file, name, defines):
    c = compiler.compile_kernel(file, [name], defines, arch="sm_90")
    assert c.cubin[:4] == b"\x7fELF"
    assert c.lowered[name]


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
    b = compiler.compile_kernel("probe.cu", ["k<1>"])
    assert compiler.stats["corrupt"] == before + 1
    assert not b.from_cache and b.cubin == a.cubin
    assert compiler.compile_kernel("probe.cu", ["k<1>"]).from_cache
    assert not list(path.parent.glob(".tmp-*"))        # atomic writes leave no temporaries


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


def test_wgmma_kernels_keep_their_pipeline():
    """ptxas's report for every wgmma tile (each loader, TF32 and 3xTF32, the widest epilogue): the wgmma stay
    asynchronous (no C7514 "wgmma ... serialized" note: accumulators pinned by wg_fence_acc), no
    spills, and sm_90a is the target."""
    from gptcuda.cuda_ops import gemm
    names = [gemm.wgmma_name(t, gemm.EPI_GELU, True) for t in gemm.WGMMA_TILES]
    names += [gemm.wgmma_name(t, gemm.EPI_GELU, True, 3) for t in gemm.WGMMA3_TILES]       # 3xTF32
    arch = compiler.target_arch(gemm.WGMMA_FILE, "sm_90")
    assert arch == "sm_90a"
    options = compiler.options_for(arch, None) + ["--ptxas-options=-v"]
    _, lowered, log = compiler._nvrtc_compile(gemm.WGMMA_FILE, compiler.expand_source(gemm.WGMMA_FILE),
                                              names, options)
    assert set(lowered) == set(names)
    assert "C7514" not in log and "serialized" not in log, log
    spills = [ln for ln in log.splitlines() if "spill" in ln]
    assert spills and all(" 0 bytes spill stores, 0 bytes spill loads" in ln for ln in spills), log


def test_compile_leaves_python_objects_alone(tmp_path, monkeypatch):
    """A compile with an empty log (NVRTC's log size is 1: the NUL) must not write into a shared
    Python object: b" " * 1 is CPython's cached b" ", and writing the NUL there once turned every
    later space of the process into a NUL."""
    _write_kernel(tmp_path, monkeypatch, "__global__ void quiet(float* x) { x[threadIdx.x] = 1.f; }\n",
                  "quiet.cu")
    c = compiler.compile_kernel("quiet.cu", ["quiet"], arch="sm_90", use_cache=False)
    assert c.cubin[:4] == b"\x7fELF"
    assert b" "[0] == 32 and bytes([32]).decode() == " " and b"a b".split() == [b"a", b"b"]
