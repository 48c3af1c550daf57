"""NVRTC: kernels/*.cu to CUBIN, with a disk cache that is keyed by everything that changes the binary.

    compile_kernel("layernorm.cu", ["layernorm_fwd<4>"], {"BLOCK": 256}, arch="sm_90")
        -> Compiled(cubin, lowered={"layernorm_fwd<4>": "_Z13layernorm_fwd..."})

Key: sha256 over the source with its `#include "..."` files expanded, the name expressions,
the full option list (defines included), the NVRTC version and the target architecture,
and the cache format. Entries are written atomically (temporary file, then rename, with the
permissions the umask gives a new file) and carry a sha256 of the WHOLE entry (the header
with its key, name table and log, and the cubin), so a corrupt entry (a flipped byte anywhere,
a truncated file, an entry filed under another key) is detected, removed and rebuilt. An entry
path that cannot be read or written (a directory, no permission, a full disk) is a miss: the
kernel is compiled and returned all the same, with a CacheWarning saying what was not cached.
Processes sharing a cache (data-parallel ranks, a test session's workers) take a per-key lock
while compiling, so one compiles a kernel and the others wait and read its entry.
`forbid_compiles()` turns any compile (a cache miss) into an error: the training loop runs
under it, so a kernel variant first needed mid-run cannot stall a step.
`check_compile` is for tests without a GPU only: many variants in one program at NVRTC's
fast-compile level, through ptxas to machine code, never cached and never run, in a process of
its own (that level changed the same process's later compiles).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gptcuda.files import atomic_open

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
CACHE_FORMAT = 2
MAGIC = b"GCCUBIN2"   # then: sha256 of everything after it (32 bytes), header length (8), header, cubin
PTXAS_INFO = "--ptxas-options=-v"   # ptxas's per-kernel report in the log; the machine code is unchanged
BASE_OPTIONS = ("-std=c++17", "--device-int128", "-default-device")  # kernels hold no host code
_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel: the message holds its log with file and line."""


class CompileForbidden(RuntimeError):
    """A compile was needed while compiles are forbidden (inside the training loop)."""


class CacheWarning(RuntimeWarning):
    """A compile-cache entry was corrupt, or could not be read or written: the kernel was
    (re)compiled all the same."""


@dataclass
class Compiled:
    cubin: bytes
    lowered: dict        # name expression -> mangled name
    key: str
    from_cache: bool
    log: str = ""        # NVRTC's log (kept in the cache entry, so a hit returns it too)


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


def _warn(msg):
    warnings.warn(msg, CacheWarning, stacklevel=3)


def _discard(path: Path):
    """Take a bad entry out of the way: a file is removed; anything else (a directory) is renamed
    aside, not deleted, so nothing that someone put there is lost."""
    try:
        if path.is_dir() and not path.is_symlink():
            path.rename(path.with_name(f"{path.name}.bad-{uuid.uuid4().hex[:8]}"))
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        _warn(f"compile cache: could not remove the bad entry {path}: {e}")


def _read_entry(path: Path, key: str | None = None, names=None):
    """(cubin, lowered, header) of a valid entry, else None (a miss). Every byte after the magic is
    covered by the checksum; the header must name this key and exactly these name expressions."""
    try:
        blob = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):    # no entry (or no cache directory): a miss
        return None
    except OSError as e:        # a directory, no permission, an I/O error: a miss, rebuilt
        stats["corrupt"] += 1
        _warn(f"compile cache: entry {path} cannot be read ({e.__class__.__name__}: {e}); rebuilding it")
        _discard(path)
        return None
    try:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 40:
            raise ValueError("bad magic or truncated")
        body = blob[len(MAGIC) + 32:]
        if hashlib.sha256(body).digest() != blob[len(MAGIC):len(MAGIC) + 32]:
            raise ValueError("checksum mismatch")
        hlen = int.from_bytes(body[:8], "little")
        header = json.loads(body[8:8 + hlen])
        cubin = body[8 + hlen:]
        lowered = header["lowered"]
        if len(cubin) != header["size"] or not cubin.startswith(b"\x7fELF"):
            raise ValueError("payload size")
        if key is not None and header["key"] != key:
            raise ValueError("entry of another key")
        if not isinstance(lowered, dict) or not all(isinstance(v, str) and v for v in lowered.values()):
            raise ValueError("name table")
        if names is not None and set(lowered) != set(names):
            raise ValueError("name table")
        return cubin, lowered, header
    except Exception as e:
        stats["corrupt"] += 1
        _warn(f"compile cache: entry {path} is corrupt ({e}); rebuilding it")
        _discard(path)
        return None


def _encode_entry(key: str, cubin: bytes, lowered: dict, log: str = "", ptxas_info: bool = False) -> bytes:
    header = json.dumps({"key": key, "size": len(cubin), "lowered": lowered, "log": log,
                         "ptxas_info": bool(ptxas_info)}).encode()
    body = len(header).to_bytes(8, "little") + header + cubin
    return MAGIC + hashlib.sha256(body).digest() + body


def _write_entry(path: Path, key: str, cubin: bytes, lowered: dict, log: str = "",
                 ptxas_info: bool = False) -> bool:
    """Write atomically (files.atomic_open: the umask's permissions); a cache that cannot be written
    is a warning, not an error (the caller has its kernel). Returns whether the entry was written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            _discard(path)                                    # renamed aside, then replaced
        with atomic_open(os.fspath(path), "wb") as f:
            f.write(_encode_entry(key, cubin, lowered, log, ptxas_info))
        return True
    except OSError as e:
        _warn(f"compile cache: could not write {path} ({e.__class__.__name__}: {e}); "
              "the kernel is compiled but not cached")
        return False


@contextmanager
def _key_lock(path: Path):
    """An exclusive lock on `path`.lock while a key is compiled, so processes sharing the cache
    compile each kernel once. Best effort: without a usable lock file the compile just runs."""
    lock = str(path) + ".lock"
    try:
        import fcntl
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        # Removed before it is released: a process already waiting on it finds the entry; one that
        # races in afterwards locks a new file and at worst compiles the kernel a second time.
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)


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
# of that architecture; their kernels trap elsewhere and the launchers never pick them there. The
# other flash files share flash_wg.cu's headers and take its target too.
ARCH_SPECIFIC = {f: ("sm_90",) for f in ("gemm_wgmma.cu", "flash_wg.cu", "flash_simt.cu", "flash_tc.cu",
                                         "flash_x3.cu", "flash_rowsum.cu", "flash_bf16.cu")}


def target_arch(filename: str, arch: str) -> str:
    """The architecture a file is compiled for on a device of `arch` (sm_90 -> sm_90a for the files
    of ARCH_SPECIFIC)."""
    return arch + "a" if arch in ARCH_SPECIFIC.get(filename, ()) else arch


def compile_kernel(filename: str, names, defines: dict | None = None, arch: str = "sm_90",
                   use_cache: bool = True, ptxas_info: bool = True) -> Compiled:
    """Compile (or fetch from the disk cache) one kernel file with the given name expressions.

    ptxas_info: the log (kept in the entry, returned on a hit too) holds ptxas's report for every
    kernel: registers, stack, spills, notes such as C7514 (wgmma serialized). It leaves the machine
    code alone (only the tool-info note of the cubin records the option), so it is not part of the
    key; an entry written without the report is rebuilt when one is asked for."""
    names = list(names)
    arch = target_arch(filename, arch)
    source = expand_source(filename)
    options = options_for(arch, defines)
    version = nvrtc_version()
    key = cache_key(source, names, options, version, arch)
    path = cache_dir() / f"{key}.cubin"

    def lookup():
        entry = _read_entry(path, key, names)
        if entry is not None and (entry[2].get("ptxas_info") or not ptxas_info):
            stats["hits"] += 1
            return Compiled(entry[0], entry[1], key, True, entry[2].get("log", ""))
        return None

    if use_cache:
        hit = lookup()
        if hit is not None:
            return hit
    if _forbidden:
        raise CompileForbidden(f"kernels/{filename} {names} {defines or {}} needed a compile inside the "
                               "training loop; every variant must be built before the first step")
    nvrtc_options = options + [PTXAS_INFO] if ptxas_info else options
    if not use_cache:
        stats["misses"] += 1
        cubin, lowered, log = _nvrtc_compile(filename, (KERNEL_DIR / filename).read_text(), names, nvrtc_options)
        return Compiled(cubin, lowered, key, False, log)
    with _key_lock(path):
        hit = lookup()                    # another process may have built it while we waited
        if hit is not None:
            return hit
        stats["misses"] += 1
        cubin, lowered, log = _nvrtc_compile(filename, (KERNEL_DIR / filename).read_text(), names, nvrtc_options)
        _write_entry(path, key, cubin, lowered, log, ptxas_info)
    return Compiled(cubin, lowered, key, False, log)


# ---- checking that variants compile, without a GPU ----------------------------------------------
# NVRTC's fast-compile level: NVVM and ptxas leave out their costly optimizations (inlining,
# scheduling), a GEMM tile takes ~0.1 CPU-second instead of ~3. Only check_compile uses it: what
# runs on a GPU is compiled by compile_kernel, with options_for's options alone.
CHECK_OPTIONS = ("--Ofast-compile=max",)


def check_compile(filename: str, names, defines: dict | None = None, arch: str = "sm_90", isolated: bool = True):
    """Compile variants of one file in ONE NVRTC program with CHECK_OPTIONS: the front end
    instantiates every name expression from the file's source and defines, and NVVM and ptxas build
    each to machine code for the file's target architecture, as compile_kernel does, for a fraction
    of the CPU time. For a machine without a GPU (the CPU suite): the cubin is not the runtime's
    binary (other optimizations) and is never cached. Returns (cubin, lowered, log), ptxas's report
    in the log; raises CompileError. isolated (the default): NVRTC runs it in a process of its own
    (_check_process), because after a fast-compile program NVRTC 13.5 builds the larger kernels of the
    same process's later programs differently (other machine code, more spills), which would put
    other binaries under a runtime key (tests/test_compiler.py shows it). isolated=False: here, for a
    process that compiles nothing for the runtime after it (check_in_background's workers)."""
    arch = target_arch(filename, arch)
    options = options_for(arch, defines) + list(CHECK_OPTIONS) + [PTXAS_INFO]
    args = (filename, (KERNEL_DIR / filename).read_text(), list(names), options)
    return _check_process().submit(_nvrtc_compile, *args).result() if isolated else _nvrtc_compile(*args)


_CHECK_POOL = None


def _check_process():
    """The spawned process that runs this process's check compiles (started at the first)."""
    global _CHECK_POOL
    if _CHECK_POOL is None:
        import atexit
        _CHECK_POOL = compile_pool(1)
        atexit.register(_CHECK_POOL.shutdown)     # before the interpreter tears its modules down
    return _CHECK_POOL


def check_group(filename: str, names, defines=(), arch: str = "sm_90", isolated: bool = True) -> dict:
    """check_compile of `names` as one program, for a worker process too (defines: a dict or its
    items). Returns {name: (cubin, lowered name, log), or the error text}: a program that does not
    compile is compiled again a name at a time, so that each variant gets its own verdict and error."""
    def one(group):
        cubin, lowered, log = check_compile(filename, group, dict(defines), arch, isolated)
        return {n: (cubin, lowered[n], log) for n in group}

    try:
        return one(list(names))
    except Exception:
        pass
    out = {}
    for n in names:
        try:
            out.update(one([n]))
        except Exception as e:                   # CompileError: NVRTC's log, for the test to raise
            out[n] = f"{e.__class__.__name__}: {e}"
    return out


# ---- building many variants at once ------------------------------------------------------------
def _compile_job(job):
    """One variant in a worker process: (filename, name, defines, arch, cache dir)."""
    filename, name, defines, arch, cache = job
    os.environ["GPTCUDA_CACHE"] = cache
    try:
        compile_kernel(filename, [name], dict(defines), arch=arch)
        return None
    except Exception as e:                       # CompileError: NVRTC's log, for the caller to raise
        return f"{e.__class__.__name__}: {e}"


def _worker_init(nice: int = 0):
    """A worker dies with the process that started it (Linux), instead of compiling on for nobody;
    nice > 0 lowers its priority (it then uses what the starting process leaves idle)."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))     # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if nice:
        try:
            os.nice(nice)
        except (OSError, AttributeError):
            pass


def default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def compile_pool(workers: int | None = None, nice: int = 0):
    """A pool of `workers` spawned processes for build_in_background and check_in_background. nice > 0:
    the workers run at that lower priority, so they take only the CPU the caller leaves idle.
    pool.shutdown(cancel_futures=True) drops what has not started."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    return ProcessPoolExecutor(max_workers=workers or default_workers(),
                               mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init,
                               initargs=(nice,))


def build_in_background(jobs, workers: int | None = None, cache: str | Path | None = None, nice: int = 0,
                        pool=None):
    """Compile jobs, each (filename, name, defines, arch), into the disk cache in a compile_pool
    (`pool`, or a new one of `workers`, `nice`), in the order given. Returns (pool, futures), a future
    per job whose result is None, or the error text of a variant that did not compile. A later
    compile_kernel of the same variant, in this process or another, reads its entry (or waits on the
    worker's lock, then reads it)."""
    cache = str(cache if cache is not None else cache_dir())
    pool = pool or compile_pool(workers, nice)
    futures = [pool.submit(_compile_job, (f, n, tuple(sorted((d or {}).items())), arch, cache))
               for f, n, d, arch in jobs]
    return pool, futures


def build_all(jobs, progress=None) -> set:
    """Compile jobs, each (filename, name, defines, arch), into the disk cache in a compile_pool of one
    worker a core (build_in_background), calling progress(n) when the first n are done; returns the
    indices of those that did not compile."""
    if not jobs:
        return set()
    pool, futures = build_in_background(jobs, workers=min(len(jobs), default_workers()))
    failed = set()
    try:
        for i, f in enumerate(futures):
            if f.result():
                failed.add(i)
            if progress is not None:
                progress(i + 1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return failed


def check_in_background(groups, pool):
    """check_compile each group, (filename, names, defines, arch), in `pool` (a compile_pool), in the
    order given, in its workers' own NVRTC (isolated=False): give the pool no runtime compile after
    these (build_in_background's jobs before them are taken first). Returns a future per group whose
    result is check_group's {name: verdict}."""
    return [pool.submit(check_group, f, tuple(names), tuple(sorted((d or {}).items())), arch, False)
            for f, names, d, arch in groups]
