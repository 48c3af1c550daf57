"""RuntimeProtocol (gptcuda/runtime/protocol.py) is what code above the runtime may use of one: the real
Runtime and the tests' fakes (tests/fakes.py) have every member it declares, with its signature, and
nothing in gptcuda/ above the runtime reaches for a member it does not declare."""
import inspect
import re
from pathlib import Path

import pytest

from gptcuda.runtime import Runtime, RuntimeProtocol
from tests.conftest import FakeGemmRT
from tests.fakes import FakeDev, RecordingRuntime

ROOT = Path(__file__).resolve().parent.parent
ABOVE = ("ops", "model", "data", "dist", "interop", "training", "generate")     # the layers above runtime/


def members(proto=RuntimeProtocol):
    """The names a protocol declares: its attributes, properties and methods."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {k for k, v in vars(proto).items() if not k.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def methods(proto=RuntimeProtocol):
    return sorted(k for k in members(proto) if inspect.isfunction(vars(proto).get(k)))


def _signature(fn):
    """(name, kind, default) of each parameter after self."""
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]


RUNTIMES = {"Runtime": lambda: Runtime(precision="tf32", seed=3, dev=FakeDev()),
            "RecordingRuntime": lambda: RecordingRuntime("fp32"),
            "FakeGemmRT": lambda: FakeGemmRT("tf32", ws=64, arch="sm_90")}


def test_protocol_declares_what_the_launchers_call():
    assert {"exec", "info", "arch", "seed", "state", "precision", "function", "launch", "memset", "tensor_map",
            "workspace", "set_workspace", "empty", "upload", "download", "begin", "end", "run", "capture",
            "synchronize"} <= members()


@pytest.mark.parametrize("kind", sorted(RUNTIMES))
def test_runtime_and_fakes_have_every_member(kind):
    rt = RUNTIMES[kind]()
    assert isinstance(rt, RuntimeProtocol)
    missing = sorted(m for m in members() if not hasattr(rt, m))
    assert not missing, f"{kind} lacks {missing}"
    for m in methods():
        assert _signature(getattr(type(rt), m)) == _signature(getattr(RuntimeProtocol, m)), (kind, m)
    assert rt.precision == rt.exec.precision and rt.held_sums is None


def test_a_runtime_without_a_member_is_not_one():
    class Partial:
        pass
    rt = Partial()
    for m in members() - {"tensor_map"}:
        setattr(rt, m, lambda *a: None)
    assert not isinstance(rt, RuntimeProtocol)
    rt.tensor_map = lambda *a: None
    assert isinstance(rt, RuntimeProtocol)


def test_code_above_the_runtime_uses_only_declared_members():
    used = {}
    for layer in ABOVE:
        for path in sorted((ROOT / "gptcuda" / layer).rglob("*.py")):
            for name in re.findall(r"\brt\.(\w+)", path.read_text()):
                used.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert used, "no runtime use found: the scan is broken"
    undeclared = {n: sorted(files) for n, files in used.items() if n not in members()}
    assert not undeclared, f"used of a runtime but not in RuntimeProtocol: {undeclared}"


def test_noting_notes_the_kernels_and_compiles_records_runs_nothing():
    """Inside rt.noting() a launch only notes its kernel (file, name, sorted defines, arch): the real
    Runtime compiles nothing (no NVRTC), records nothing into an open program and runs nothing (FakeDev
    has no launch), and a tensor map is blank."""
    from gptcuda.runtime import DeviceView, i32
    rt = Runtime(precision="tf32", seed=3, dev=FakeDev())
    view = DeviceView(1 << 32, (64, 64), "f32", "x")
    prog = rt.begin("p")
    with rt.noting() as noted:
        fn = rt.function("gemm_simt.cu", "k<1>", {"D": 1})
        rt.launch(fn, (1,), (32,), [view, i32(3), rt.tensor_map(view, (64, 64, 1), (256, 16384), (32, 32, 1))],
                  smem=100_000)
    rt.end()
    assert noted == [("gemm_simt.cu", "k<1>", (("D", 1),), "sm_90")] and prog.items == []
    assert rt._noted is None and not rt._functions                    # (and none cached for later)
