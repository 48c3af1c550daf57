"""The runtime on a real GPU: compile + launch + compare with the reference, graph replay equals
eager launches, the planned views do not overlap, the device's properties are sane."""

import numpy as np
import pytest

from conftest import rel_err
from gptcuda.runtime import compiler
from gptcuda.config import load_config
from gptcuda.ops.reference import ops as R

pytestmark = pytest.mark.gpu


def test_device_properties(rt):
    info = rt.info
    assert info.sm_count > 0 and info.cc[0] >= 7
    assert info.smem_per_block_optin >= info.smem_per_block >= 48 * 1024
    assert 0 < info.free_mem <= info.total_mem
    assert rt.arch == f"sm_{info.cc[0]}{info.cc[1]}"


def test_launch_matches_reference_and_graph_equals_eager(rt):
    from gptcuda.ops.cuda import elementwise
    rng = np.random.default_rng(0)
    x = rng.normal(size=(257, 129)).astype(np.float32)
    xv = rt.upload(x)
    out = rt.empty(x.shape)
    elementwise.gelu_fwd(rt, out, xv)
    got = rt.download(out)
    assert rel_err(got, R.gelu_forward(x)) < 1e-6

    # the same launches recorded into a program, replayed eagerly and as a graph
    outs = [rt.empty(x.shape) for _ in range(2)]
    prog = rt.begin("p")
    elementwise.gelu_fwd(rt, outs[0], xv)
    elementwise.gelu_bwd(rt, outs[1], outs[0], xv)
    rt.end()
    assert len(prog) == 2
    rt.run(prog)
    eager = [rt.download(o) for o in outs]
    for o in outs:
        rt.fill(o, 0x7FC00000)
    g = rt.capture(prog)
    g.launch()
    graph = [rt.download(o) for o in outs]
    for a, b in zip(eager, graph):
        assert np.array_equal(a, b) and np.all(np.isfinite(a))


def test_upload_is_complete_before_the_next_launch(rt):
    """An upload has landed before later work on the runtime's stream: a fill right after it must
    win. (A pageable cuMemcpyHtoD may return with its DMA still in flight, unordered with a
    non-blocking stream; a GEMM test whose output was a fresh upload saw the copy land over it.)"""
    x = np.random.default_rng(1).standard_normal(16 << 20).astype(np.float32)    # 64 MB
    v = rt.empty(x.shape, poison=False)
    for i in range(4):
        rt.write(v, x)
        rt.fill(v, 0)
        got = rt.download(v)
        assert not got.any(), f"round {i}: {np.count_nonzero(got)} words of the upload landed after the fill"


def test_function_cache_and_forbidden_compiles(rt):
    from gptcuda.ops.cuda import elementwise
    f1 = rt.function(*elementwise.VARIANTS[0][:2], elementwise.VARIANTS[0][2])
    f2 = rt.function(*elementwise.VARIANTS[0][:2], elementwise.VARIANTS[0][2])
    assert f1 is f2
    with compiler.forbid_compiles():
        rt.function(*elementwise.VARIANTS[0][:2], elementwise.VARIANTS[0][2])     # loaded: fine


def test_engine_views_do_not_overlap(rt):
    from gptcuda.training.engine import Engine
    cfg = load_config("configs/tiny.yaml", ["--max_iters=3"])
    toks = np.random.default_rng(0).integers(0, 65, 4000).astype(np.int32)
    eng = Engine(cfg, toks, toks[:500], 65, backend=None, programs=())
    spans = []
    inside = {e.name: e.within for e in eng.plan.entries if e.within}    # (the backward's scratch in the logits)
    assert inside == {"dres": "logits"}, inside                          # (C 64 fits in 65 columns; dfc does not)
    acts = eng.bufs.acts
    for name, host in inside.items():
        v, h = acts[name], acts[host]
        assert h.ptr <= v.ptr and v.ptr + v.nbytes <= h.ptr + h.nbytes and v.ptr % 16 == 0, name
    for v in list(eng.bufs.params.values()) + list(eng.bufs.grads.values()) + \
            [v for k, v in acts.items() if k not in inside]:
        spans.append((v.ptr, v.ptr + v.nbytes, v.name))
        assert v.ptr % 16 == 0, v.name
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        assert a1 <= b0, f"{an} overlaps {bn}"
    regions = [eng.bufs.flat_params, eng.bufs.flat_grads, eng.bufs.flat_m, eng.bufs.flat_v]
    for r0, r1 in zip(regions, regions[1:]):
        assert r0.ptr + r0.nbytes <= r1.ptr


def test_kernel_parameters_known_and_checked(rt):
    """The driver reports each kernel's parameter sizes; a launch that disagrees fails by name before
    it runs (a pointer and an int: decode_advance(int* pos, int T))."""
    from gptcuda.runtime import i32
    fn = rt.function("decode.cu", "decode_advance")
    assert fn.params == (8, 4)
    pos = rt.upload(np.array([3], np.int32))
    with pytest.raises(ValueError, match="decode.cu:decode_advance takes 2 parameters"):
        rt.launch(fn, (1,), (1,), [pos])
    rt.launch(fn, (1,), (1,), [pos, i32(4)])
    assert rt.download(pos)[0] == 0
