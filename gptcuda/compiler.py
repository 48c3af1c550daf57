"""NVRTC: kernels/*.cu to CUBIN, with a disk cache that is keyed by everything that changes the binary.

    compile_kernel("layernorm.cu", ["layernorm_fwd<4>"], {"BLOCK": 256}, arch="sm_90")
        -> Compiled(cubin, lowered={"layernorm_fwd<4>": "_Z13layernorm_fwd..."})

Key: sha256 over the source with its `#include "..."` files expanded, the name expressions,
the full option list (defines included), the NVRTC version and the target architecture,
and the cache format. Entries are written atomically (temporary file, then rename) and
carry a sha256 of their payload, so a corrupt entry is detected, removed and rebuilt.
`forbid_compiles()` turns any compile (a cache miss) into an error: the training loop runs
under it, so a kernel variant first needed mid-run cannot stall a step.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
CACHE_FORMAT = 1
MAGIC = b"GCCUBIN1"
BASE_OPTIONS = ("-std=c++17", "--device-int128", "-default-device")  # kernels hold no host code
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: the message holds its log with file and line."""


class CompileForbidden(RuntimeError):
    """A compile was needed while compiles are forbidden (inside the training loop)."""


@dataclass
class Compiled:
    cubin: bytes
    lowered: dict        # name expression -> mangled name
    key: str
    from_cache: bool
    log: str = ""


_forbidden = 0
stats = {"hits": 0, "misses": 0, "corrupt": 0}


@contextmanager
def forbid_compiles():
    global _forbidden
    _forbidden += 1
    try:
        yield
    finally:
        _forbidden -= 1


def cache_dir() -> Path:
    return Path(os.environ.get("GPTCUDA_CACHE", Path.home() / ".cache" / "gptcuda"))


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def _check(err, what, prog=None):
    from cuda.bindings import nvrtc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        msg = nvrtc.nvrtcGetErrorString(err)[1].decode()
        raise CompileError(f"{what} failed: {msg}")


def expand_source(filename: str, kernel_dir: Path | None = None, _seen=None) -> str:
    """The source with every local include inlined (for the cache key; NVRTC gets the include path)."""
    kernel_dir = KERNEL_DIR if kernel_dir is None else kernel_dir
    seen = set() if _seen is None else _seen
    path = kernel_dir / filename
    if not path.exists():
        raise CompileError(f"kernel source {path} does not exist")
    text = path.read_text()
    if filename in seen:
        return ""
    seen.add(filename)

    def sub(m):
        return f"// <{m.group(1)}>\n" + expand_source(m.group(1), kernel_dir, seen)

    return _INCLUDE.sub(sub, text)


def options_for(arch: str, defines: dict | None) -> list[str]:
    opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS, f"--include-path={KERNEL_DIR}"]
    for k in sorted(defines or {}):
        v = defines[k]
        if isinstance(v, bool):
            v = int(v)
        opts.append(f"-D{k}={v}")
    return opts


def cache_key(source: str, names, options, version, arch) -> str:
    h = hashlib.sha256()
    # The include path is an absolute path: it does not change the binary, so leave it out.
    opts = [o for o in options if not o.startswith("--include-path=")]
    for part in (f"format={CACHE_FORMAT}", f"nvrtc={version}", f"arch={arch}",
                 json.dumps(opts), json.dumps(list(names)), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _read_entry(path: Path):
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        if not blob.startswith(MAGIC):
            raise ValueError("magic")
        hlen = int.from_bytes(blob[8:16], "little")
        header = json.loads(blob[16:16 + hlen])
        payload = blob[16 + hlen:]
        if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("checksum")
        return payload, header["lowered"]
    except Exception:
        stats["corrupt"] += 1
        try:
            path.unlink()
        except OSError:
            pass
        return None


def _write_entry(path: Path, cubin: bytes, lowered: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"size": len(cubin), "sha256": hashlib.sha256(cubin).hexdigest(),
                         "lowered": lowered}).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header + cubin)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _nvrtc_compile(filename: str, source: str, names, options):
    from cuda.bindings import nvrtc
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"kernels/{filename}".encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        for n in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, n.encode())[0], f"nvrtcAddNameExpression({n})")
        opts = [o.encode() for o in options]
        (cerr,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        # NVRTC writes into the buffers: they must be fresh mutable objects. (b" " * size for an
        # empty log, size 1, is CPython's shared one-byte b" ": the NUL written into it turned
        # every later b" " / " " of the process into "\0", and broke PyTorch imported afterwards.)
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = bytes(log).rstrip(b"\0 ").decode(errors="replace")
        if cerr != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"NVRTC could not compile kernels/{filename} "
                               f"[{' '.join(o for o in options if not o.startswith('--include'))}]:\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        lowered = {}
        for n in names:
            err, low = nvrtc.nvrtcGetLoweredName(prog, n.encode())
            _check(err, f"nvrtcGetLoweredName({n})")
            lowered[n] = low.decode()
        return bytes(cubin), lowered, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# Files using instructions of one architecture only (wgmma: sm_90a), compiled for the "a" target
# of that architecture; their kernels trap elsewhere and the launchers never pick them there.
ARCH_SPECIFIC = {"gemm_wgmma.cu": ("sm_90",)}


def target_arch(filename: str, arch: str) -> str:
    """The architecture a file is compiled for on a device of `arch` (sm_90 -> sm_90a for the files
    of ARCH_SPECIFIC)."""
    return arch + "a" if arch in ARCH_SPECIFIC.get(filename, ()) else arch


def compile_kernel(filename: str, names, defines: dict | None = None, arch: str = "sm_90",
                   use_cache: bool = True) -> Compiled:
    """Compile (or fetch from the disk cache) one kernel file with the given name expressions."""
    names = list(names)
    arch = target_arch(filename, arch)
    source = expand_source(filename)
    options = options_for(arch, defines)
    version = nvrtc_version()
    key = cache_key(source, names, options, version, arch)
    path = cache_dir() / f"{key}.cubin"
    if use_cache:
        entry = _read_entry(path)
        if entry is not None:
            stats["hits"] += 1
            return Compiled(entry[0], entry[1], key, True)
    if _forbidden:
        raise CompileForbidden(f"kernels/{filename} {names} {defines or {}} needed a compile inside the "
                               "training loop; every variant must be built before the first step")
    stats["misses"] += 1
    cubin, lowered, log = _nvrtc_compile(filename, (KERNEL_DIR / filename).read_text(), names, options)
    if use_cache:
        _write_entry(path, cubin, lowered)
    return Compiled(cubin, lowered, key, False, log)
