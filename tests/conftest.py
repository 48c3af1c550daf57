"""Shared fixtures. GPU tests carry @pytest.mark.gpu and skip themselves, with the reason, when no GPU is found."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.fakes import RecordingRuntime  # noqa: E402
# The suite reads the GEMM table but never measures one (an Engine on a GPU would otherwise time the
# GEMMs of every test config, into a table the parallel workers share); the autotune tests opt in.
os.environ.setdefault("GPTCUDA_GEMM_TUNE", "table")

_gpu_reason = None


def _gpu_available():
    global _gpu_reason
    try:
        from gptcuda.runtime.driver import Device
        Device(0)
        return True
    except Exception as e:  # NoDeviceError, missing library
        _gpu_reason = str(e).splitlines()[0]
        return False


_HAS_GPU = None


def has_gpu():
    global _HAS_GPU
    if _HAS_GPU is None:
        _HAS_GPU = _gpu_available()
    return _HAS_GPU


PREBUILT = "prebuilt_kernels"
CHECKED = "checked_variants"
# Heaviest first (most of NVRTC's time is ptxas on the GEMM tiles), so the pool's tail is short.
_HEAVY_FIRST = ("gemm_tf32.cu", "gemm_simt.cu", "gemm_wgmma.cu", "flash_tc.cu", "flash_x3.cu", "flash_simt.cu")


def _file_rank(file):
    return {f: i for i, f in enumerate(_HEAVY_FIRST)}.get(file, len(_HEAVY_FIRST))


def _uses_background(item):
    return bool({PREBUILT, CHECKED} & set(getattr(item, "fixturenames", ())))


def pytest_collection_modifyitems(config, items):
    # the marker, not the keyword: "gpu" is also a keyword of everything under tests/gpu/
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if marked and not has_gpu():
        skip = pytest.mark.skip(reason=f"no GPU: {_gpu_reason}")
        for item in marked:
            item.add_marker(skip)
    # Tests on the kernels built in the background (the `prebuilt_kernels` and `checked_variants`
    # fixtures) run last: worker processes compile their variants while the other tests run.
    late = [item for item in items if _uses_background(item)]
    if late:
        ids = {id(item) for item in late}
        late.sort(key=lambda item: _file_rank(getattr(getattr(item, "callspec", None), "params", {}).get("file")))
        items[:] = [item for item in items if id(item) not in ids] + late     # in the order the workers build them


def _variant_param(item):
    """(file, name, defines) of a test parametrized by file, name and defines, else None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return (params["file"], params["name"], params["defines"]) if {"file", "name", "defines"} <= set(params) else None


def _prebuild_jobs(items):
    """(file, name, defines, arch) of the variants the selected `prebuilt_kernels` tests wait for,
    heaviest first."""
    jobs = {}
    for item in items:
        if PREBUILT not in getattr(item, "fixturenames", ()):
            continue
        wanted = [_variant_param(item)] if _variant_param(item) else []
        for mark in item.iter_markers("prebuild"):          # @pytest.mark.prebuild((file, name, defines), ...)
            wanted += mark.args
        for file, name, defines in wanted:
            jobs.setdefault((file, name, tuple(sorted(dict(defines).items())), "sm_90"))
    return sorted(jobs, key=lambda j: _file_rank(j[0]))


def _check_groups(items):
    """{(file, defines, arch): [names]} of the variants the selected `checked_variants` tests check,
    heaviest file first: each group is one NVRTC program (compiler.check_compile)."""
    groups = {}
    for item in items:
        if CHECKED in getattr(item, "fixturenames", ()) and _variant_param(item):
            file, name, defines = _variant_param(item)
            names = groups.setdefault((file, tuple(sorted(dict(defines).items())), "sm_90"), [])
            if name not in names:
                names.append(name)
    return dict(sorted(groups.items(), key=lambda g: _file_rank(g[0][0])))


class BackgroundCompiles:
    """Kernel variants compiled by worker processes (niced) in the background, from the session's first
    test on: `prebuild` jobs with compiler.compile_kernel into the session's cache, and `check` groups
    with compiler.check_compile (every variant of a file, with the same defines, in one program).
    Without workers (under pytest-xdist) a check group is compiled in this process when first needed."""

    def __init__(self, prebuild=(), checks=None, cache=None, workers=0):
        from gptcuda.runtime import compiler
        self.cache, self.pool, self.built, self.checks = cache, None, {}, dict(checks or {})
        self.checked = {}           # (file, defines, arch) -> {name: verdict}, or the future of one
        if workers and (prebuild or checks):
            # niced: the tests running meanwhile (numpy's BLAS threads among them) keep the CPU they
            # want, and the workers take the rest; not niced, 3+ busy processes on 2 cores made
            # BLAS-heavy tests many times slower
            self.pool = compiler.compile_pool(workers, nice=19)
            # the real compiles first: a variant costs them ~20x its check
            _, futures = compiler.build_in_background(
                [(f, n, dict(d), arch) for f, n, d, arch in prebuild], cache=cache, pool=self.pool)
            self.built = dict(zip(prebuild, futures))
            groups = [(f, names, dict(d), arch) for (f, d, arch), names in self.checks.items()]
            self.checked = dict(zip(self.checks, compiler.check_in_background(groups, self.pool)))

    def wait(self, file, name, defines=None, arch="sm_90"):
        """Returns once a `prebuild` variant is in the cache, or raises NVRTC's error for one that did not
        compile; the test then compiles it again through compiler.compile_kernel, which reads the entry."""
        from gptcuda.runtime import compiler
        fut = self.built.get((file, name, tuple(sorted((defines or {}).items())), arch))
        if fut is not None:
            err = fut.result()
            if err:
                raise compiler.CompileError(f"(compiled in a worker) {err}")

    def check(self, file, name, defines=None, arch="sm_90"):
        """(cubin, lowered name, log) of the variant's check compile; raises NVRTC's error for a variant
        that did not compile."""
        from gptcuda.runtime import compiler
        key = (file, tuple(sorted((defines or {}).items())), arch)
        got = self.checked.get(key)
        if got is None:
            names = self.checks.get(key) or [name]
            got = self.checked[key] = compiler.check_group(file, names, key[1], arch)
        elif not isinstance(got, dict):
            got = self.checked[key] = got.result()
        if name not in got:             # not among the selected variants: a program of its own
            got.update(compiler.check_group(file, [name], key[1], arch))
        verdict = got[name]
        if isinstance(verdict, str):
            raise compiler.CompileError(verdict)
        return verdict

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session", autouse=True)
def _kernel_prebuild(request, tmp_path_factory):
    """Starts the background compiles at the session's first test when any selected test needs them.
    Not under pytest-xdist: its workers are the parallelism there (each would build everything); a
    `prebuilt_kernels` test then compiles its variants itself, a check group is compiled by the
    first test of the group that a worker runs."""
    from gptcuda.runtime import compiler
    items = request.session.items
    jobs, checks = _prebuild_jobs(items), _check_groups(items)
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        jobs, checks = [], {}
    workers = 0 if os.environ.get("PYTEST_XDIST_WORKER") else (
        int(os.environ.get("GPTCUDA_TEST_COMPILE_WORKERS", 0)) or compiler.default_workers())
    cache = os.environ.get("GPTCUDA_CACHE") or str(tmp_path_factory.getbasetemp() / "kcache")
    pre = BackgroundCompiles(jobs if workers else [], checks, cache, workers)
    yield pre
    pre.close()


@pytest.fixture(scope="session")
def prebuilt_kernels(_kernel_prebuild):
    return _kernel_prebuild


@pytest.fixture(scope="session")
def checked_variants(_kernel_prebuild):
    return _kernel_prebuild


@pytest.fixture(scope="session")
def rt():
    """One Runtime for the whole GPU session (fp32 precision; tests switch rt.precision as needed)."""
    from gptcuda.runtime import Runtime
    r = Runtime(0, precision="fp32", seed=1234)
    yield r
    r.close()


@pytest.fixture
def env(rt):
    """The session runtime for a test that points rt.state at its own StepState (restored after)."""
    saved = rt.state
    yield rt
    rt.state = saved


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test session compiles into its own cache unless GPTCUDA_CACHE is set by the caller."""
    if "GPTCUDA_CACHE" not in os.environ:
        monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path_factory.getbasetemp() / "kcache"))


@pytest.fixture
def table_cache(tmp_path, monkeypatch):
    """A compile cache of the test's own: no measured GEMM table (<cache>/tune/) yet, GPTCUDA_GEMM_TUNE
    unset, and the tables the process read forgotten (before and after). Yields the cache's path."""
    from gptcuda.ops.cuda.gemm.table import forget_tables
    monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path / "kc"))
    monkeypatch.delenv("GPTCUDA_GEMM_TUNE", raising=False)
    forget_tables()
    yield tmp_path / "kc"
    forget_tables()


def rel_err(out, ref):
    """max|out - ref| / max|ref| (nan-safe: NaN anywhere gives inf)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))


BF16_ROUNDING = 2.0 ** -8       # one rounding to bf16 (8 significant bits, to nearest): <= 2^-8 |x|


def bf16_err(out, ref, fp32_tol, extra=0.0):
    """The error model of an output stored in bf16, computed in fp32 from inputs exact in both (ref: float64
    of the same inputs): one rounding of each element, 2^-8 |ref|, plus the fp32 computation's error,
    fp32_tol * max|ref|, plus `extra` (each element's own further bound, e.g. an approximate function's).
    Returns the largest |out - ref| over that bound (<= 1: within the model; NaN anywhere: inf); out: values
    (bf16 bit patterns widened with runtime.bf16.values)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    bound = BF16_ROUNDING * np.abs(ref) + fp32_tol * max(np.max(np.abs(ref)), 1e-30) + extra
    return float(np.max(np.abs(out - ref) / bound))


class FakeGemmRT(RecordingRuntime):
    """The fake device's runtime for driving launchers alone: `names` holds the kernels asked for
    ((file, name, sorted defines)), `launches` each launch's (name, grid, block, smem) as the launcher
    passed them; ws, bt, at: the floats of the split-K, transposed-B (gemm_bT) and register-A re-layout
    (gemm_aT) workspaces it lends (0: none); arch None: no arch-specific kernels (wgmma) are candidates."""

    def __init__(self, precision="fp32", ws=0, name="NVIDIA H200 (test)", sm_count=132, arch=None, bt=0, at=0):
        from gptcuda.runtime import DeviceView
        super().__init__(precision, arch=arch, name=name, sm_count=sm_count)
        self.names = set()
        self.launches = []
        for wname, floats, ptr in (("gemm_splitk", ws, 1 << 20), ("gemm_bT", bt, 1 << 40), ("gemm_aT", at, 1 << 43)):
            if floats:
                self._ws[wname] = DeviceView(ptr, (floats,), "f32", wname)

    @property
    def _ws(self):
        """The workspaces lent, by name (the runtime's own dict: a test adds to it or replaces it)."""
        return self._workspace

    @_ws.setter
    def _ws(self, views):
        self._workspace = views

    def function(self, file, name, defines=None):
        self.names.add((file, name, tuple(sorted((defines or {}).items()))))
        return super().function(file, name, defines)

    def launch(self, fn, grid, block, args, smem=0, label=None):
        rec = super().launch(fn, grid, block, args, smem, label)
        self.launches.append((fn.name, tuple(grid), tuple(block), smem))
        return rec


def plan_of(precision, wgmma=False, **kw):
    """The execution plan of a runtime at this precision (wgmma: on an sm_90 device, else none), the
    environment left out."""
    from gptcuda.runtime import execution
    return execution.resolve(arch="sm_90" if wgmma else None, precision=precision, env={}, **kw)


def shifted_view(rt, shape, dtype="f32", shift=0, data=None):
    """A view of `shape` `shift` bytes (a multiple of the element size) past the start of a fresh
    allocation (aligned), to meet or miss a launcher's alignment rule: holding `data` (values, rounded to
    nearest even for bf16) or, without, NaN-poisoned (rt.empty)."""
    from gptcuda.runtime import NP_DTYPES, DeviceView, bf16
    item = np.dtype(NP_DTYPES[dtype]).itemsize
    assert shift % item == 0, (shift, dtype)
    base = rt.empty((int(np.prod(shape)) + shift // item,), dtype)
    v = DeviceView(base.ptr + shift, tuple(int(d) for d in shape), dtype, f"{base.name}+{shift}")
    if data is not None:
        rt.write(v, bf16.bits(data) if dtype == "bf16" else data)
    return v


def fake_view(shape, ptr=1 << 30):
    """A DeviceView at a fake address (16-byte aligned unless ptr says otherwise)."""
    from gptcuda.runtime import DeviceView
    return DeviceView(ptr, tuple(shape), "f32", "v")
