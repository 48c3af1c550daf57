"""The GEMM table measured at a run's setup (gptcuda/ops/cuda/gemm/tune.py autotune), without a GPU:
what it measures (only the shapes the table lacks, never an entry already there), what it saves,
when it runs (the config's gemm_tune, GPTCUDA_GEMM_TUNE, the Engine on a real device only, never
in a data-parallel run or for an Engine without programs), that model/products.py lists exactly the
products the recorded programs look up, and that the device timer frees what it allocates."""
import dataclasses
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest

from gptcuda.model.products import Pair, Product, pairs, products
from gptcuda.config import ConfigError, load_config
from gptcuda.ops.cuda.gemm import tune
from gptcuda.ops.cuda.gemm.families import WGMMA_FILE
from gptcuda.ops.cuda.gemm.table import forget_tables, load_table, plan_to_json, save_table, table_key, table_path
from gptcuda.runtime import driver, execution
from gptcuda.training.engine import Engine
from tests.conftest import fake_view, plan_of
from tests.fakes import FakeDev, RecordingRuntime
from gptcuda.runtime import bf16

GPU = "NVIDIA H200 (test)"
TOKS = (np.arange(1000) % 65).astype(np.int32)


def cfg_of(*over):
    return load_config("configs/tiny.yaml", list(over))


def FakeRT(cfg, name=GPU):
    """The fake device's runtime at cfg's plan (an sm_90 device of 132 SMs called `name`): what autotune
    reads of a runtime is its execution plan, the device's name and SMs, the arch."""
    return RecordingRuntime(cfg, name=name)


class FakeTimer:
    """Every candidate's time: 1 ms, less 0.1 ms per position after the first (the last wins)."""

    def __init__(self):
        self.ops = []

    def __call__(self, op, plans):
        self.ops.append((op, list(plans)))
        return [[1.0 - 0.1 * i] * 3 for i in range(len(plans))], [True] * len(plans)


def no_build(jobs, progress):
    progress(len(jobs))
    return set()


def run(rt, cfg, timer, **kw):
    return tune.autotune(rt, cfg, 65, out=io.StringIO(), timer=timer, build=kw.pop("build", no_build), **kw)


BF16 = ("--attention=fused", "--vocab_multiple=8")      # what a bf16 config needs (vocab 65 -> 72)


def _precision_cfg(precision):
    return (cfg_of(f"--precision={precision}", "--dropout=0.1", *(BF16 if precision == "bf16" else ())),
            72 if precision == "bf16" else 65)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_measures_what_is_missing_and_saves_it(table_cache, precision):
    cfg, vocab = _precision_cfg(precision)
    rt, timer = FakeRT(cfg), FakeTimer()
    keys = [table_key(precision, op) for op in products(cfg, vocab) + pairs(cfg, vocab, rt.exec)]
    assert (len(keys) > len(products(cfg, vocab))) == (precision == "bf16")      # the pairs: bf16's
    s = tune.autotune(rt, cfg, vocab, out=io.StringIO(), timer=timer, build=no_build)
    assert s.measured == len(keys) and s.known == 0 and s.dropped == 0
    assert [table_key(precision, op) for op, _ in timer.ops] == keys
    doc = json.loads(table_path(GPU).read_text())
    assert set(doc["entries"]) == set(keys) and str(table_path(GPU)) == s.path
    table = load_table(GPU, refresh=True)
    for op, plans in timer.ops:
        assert table[table_key(precision, op)] == plans[-1]            # the fastest
    assert "measured" in s.format() and "cost model" in s.format()
    # nothing missing: nothing timed, nothing written
    mtime = table_path(GPU).stat().st_mtime_ns
    again = FakeTimer()
    s2 = tune.autotune(rt, cfg, vocab, out=io.StringIO(), timer=again, build=no_build)
    assert again.ops == [] and s2.measured == 0 and s2.known == len(keys)
    assert table_path(GPU).stat().st_mtime_ns == mtime
    assert str(len(keys)) in s2.format()


def test_pairs_are_measured_after_their_products_and_launch_by_their_entries(table_cache):
    """bf16: a pair is timed after every product, whose winners the table then holds (so its APART candidate
    runs them), its candidates the model's plan first and APART last; matmul_pair launches the pair's entry:
    APART the two products, a plan gemm_wgmma_dual with it, none the model's plan."""
    from gptcuda.ops.cuda import elementwise, gemm
    from gptcuda.ops.cuda.gemm.families import dual_name
    from gptcuda.ops.cuda.gemm.plan import pair_plan
    from gptcuda.ops.cuda.gemm.table import APART
    cfg, vocab = _precision_cfg("bf16")
    rt = FakeRT(cfg)
    seen = []

    class Watch(FakeTimer):
        def __call__(self, op, plans):
            if isinstance(op, Pair):
                have = load_table(GPU, refresh=True)
                seen.append(all(table_key("bf16", g) in have for g in products(cfg, vocab)))
                assert plans[0] == pair_plan(op.w, op.x, 132, tune.workspace_floats(cfg, vocab, rt.exec).get("gemm_splitk", 0))
                assert plans[-1] == APART and len(plans) > 2
            return super().__call__(op, plans)
    timer = Watch()
    tune.autotune(rt, cfg, vocab, out=io.StringIO(), timer=timer, build=no_build)
    prs = pairs(cfg, vocab, rt.exec)
    assert seen == [True] * len(prs) and [op for op, _ in timer.ops][-len(prs):] == prs
    # the launcher and the entries
    from gptcuda.runtime import DeviceView
    pr = prs[0]
    view = lambda i, shape, dtype="f32": DeviceView((i + 1) << 32, shape, dtype, "v")
    dy, x, w = (view(i, s, "bf16") for i, s in enumerate(((pr.w.K, pr.w.M), (pr.w.K, pr.w.N), (pr.x.K, pr.x.N))))
    dx, dw = view(3, (pr.x.M, pr.x.N), "bf16"), view(4, (pr.w.M, pr.w.N))
    aux = view(5, (pr.x.M, pr.x.N), "bf16") if pr.x.epilogue != "none" else None
    db = view(6, (pr.w.M,)) if pr.w.colsum else None
    rt.set_workspace({"gemm_splitk": view(7, (1 << 24,)),
                      elementwise.WORKSPACE: view(8, (elementwise.MAX_CHUNKS * pr.w.M,))})
    key = table_key("bf16", pr)

    def launched(entry):
        if entry is not None:
            save_table(GPU, {key: plan_to_json(entry)})
        rt.launched.clear()
        gemm.matmul_pair(rt, dx, dw, dy, x, w, db=db, epilogue=pr.x.epilogue, aux=aux)
        return [r.fn.name for r in rt.launched if r.fn.name.startswith("gemm_wgmma")]
    assert load_table(GPU)[key] == APART and not any(n.startswith("gemm_wgmma_dual") for n in launched(None))
    other = [p for p in tune.pair_candidates(pr, rt.exec, 132, {"gemm_splitk": 1 << 24})[1:-1] if p.splits == 1][0]
    assert launched(other)[0] == dual_name(other.tile, 4 if pr.x.epilogue == "dgelu" else 0, pr.w.colsum)


def test_entries_already_there_are_never_measured_again(table_cache):
    """A resumed run launches the plans it launched: an entry, once in the table, stays."""
    cfg = cfg_of("--precision=tf32")
    ops = products(cfg, 65)
    held = ops[:3]
    mine = {table_key("tf32", op): plan_to_json(tune.candidates_for(op, plan_of("tf32"), 132, 0)[0]) for op in held}
    save_table(GPU, mine)
    timer = FakeTimer()
    s = run(FakeRT(cfg), cfg, timer)
    assert s.measured == len(ops) - 3 and s.known == 3
    assert {table_key("tf32", op) for op, _ in timer.ops}.isdisjoint(mine)
    entries = json.loads(table_path(GPU).read_text())["entries"]
    assert all(entries[k] == v for k, v in mine.items())     # untouched (no time, label added)
    # another precision's keys are other shapes
    cfg32 = cfg_of("--precision=fp32")
    assert run(FakeRT(cfg32), cfg32, FakeTimer()).measured == len(products(cfg32, 65))


def test_an_entry_another_run_wrote_meanwhile_stays(table_cache):
    """Two runs measuring at once: the plan written first stays, and this process launches it too
    (so does a resume of either run)."""
    cfg = cfg_of("--precision=tf32")
    first = products(cfg, 65)[0]
    theirs = tune.candidates_for(first, plan_of("tf32"), 132, 0)[0]

    class Racing(FakeTimer):
        def __call__(self, op, plans):
            if op == first:                   # the other run saves its winner while this one measures
                save_table(GPU, {table_key("tf32", op): plan_to_json(theirs)})
            return super().__call__(op, plans)

    timer = Racing()
    run(FakeRT(cfg), cfg, timer)
    assert timer.ops[0][1][-1] != theirs
    assert load_table(GPU)[table_key("tf32", first)] == theirs
    assert load_table(GPU, refresh=True)[table_key("tf32", first)] == theirs
    # bench/tune.py replaces entries (and a merge keeps the file's meta)
    save_table(GPU, {}, meta={"config": "x"})
    save_table(GPU, {table_key("tf32", first): plan_to_json(timer.ops[0][1][-1])})
    assert load_table(GPU)[table_key("tf32", first)] == timer.ops[0][1][-1]
    assert json.loads(table_path(GPU).read_text())["meta"] == {"config": "x"}


@pytest.mark.parametrize("setting,env", [("table", None), ("off", None), ("auto", "0"), ("auto", "off"),
                                         ("auto", "table")])
def test_table_and_off_never_measure(table_cache, monkeypatch, setting, env):
    if env is not None:
        monkeypatch.setenv("GPTCUDA_GEMM_TUNE", env)
    cfg = cfg_of(f"--gemm_tune={setting}")
    timer = FakeTimer()
    assert run(FakeRT(cfg), cfg, timer) is None and timer.ops == []
    assert not table_path(GPU).exists()


def test_resolved_setting(monkeypatch):
    monkeypatch.delenv("GPTCUDA_GEMM_TUNE", raising=False)
    p = execution.resolve(cfg_of())
    assert p.gemm_tune == "auto" and p.gemm_table
    for setting in ("auto", "table", "off"):
        p = execution.resolve(cfg_of(f"--gemm_tune={setting}"), env={})
        assert p.gemm_tune == setting and p.gemm_table == (setting != "off")
        assert p.to_dict()["gemm_tune"] == setting and p.to_dict()["gemm_table"] == (setting != "off")
        assert f"gemm_tune {setting}" in p.format()
        assert p.with_precision("tf32").gemm_tune == setting
    # the environment overrides the config; 0 has always meant no table; anything else: the config's
    for env, want in [("0", "off"), ("off", "off"), ("table", "table"), ("auto", "auto"), ("1", "table")]:
        p = execution.resolve(cfg_of("--gemm_tune=table"), env={"GPTCUDA_GEMM_TUNE": env})
        assert p.gemm_tune == want and p.env == (("GPTCUDA_GEMM_TUNE", env),)
    # a runtime without a config reads the table (nothing measures for it); the reference backend none
    assert execution.resolve(arch="sm_90", env={}).gemm_tune == "table"
    assert execution.resolve(cfg_of("--backend=reference")).gemm_tune == "off"
    with pytest.raises(ValueError, match="gemm_tune"):
        execution.resolve(cfg_of(), gemm_tune="always")


def test_bad_value_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", ["--gemm_tune=on"])
    assert e.value.key == "gemm_tune" and "\n" not in str(e.value) and "auto|table|off" in str(e.value)
    assert load_config(None, ["--gemm_tune=off"]).gemm_tune == "off"        # YAML's off is a string here


def test_candidates_that_do_not_compile_are_left_out(table_cache):
    cfg = cfg_of("--precision=tf32")
    asked = []

    def build(jobs, progress):
        asked.extend(jobs)
        return {i for i, (file, name, defines, arch) in enumerate(jobs) if file == WGMMA_FILE}

    timer = FakeTimer()
    s = run(FakeRT(cfg), cfg, timer, build=build)
    assert len(asked) == len(set((f, n, tuple(sorted(d.items())), a) for f, n, d, a in asked))   # once each
    assert all(arch == "sm_90" for *_, arch in asked)
    assert s.dropped > 0 and "did not compile" in s.format()
    for op, plans in timer.ops:
        # the warpgroup-MMA candidates are left out, but for the cost model's own, which stays first
        assert all(p.family == "tf32" for p in plans[1:])
        assert plans[0] == tune.candidates_for(op, plan_of("tf32", True), 132, tune.workspace_floats(cfg, 65))[0]


def test_progress_line(table_cache, monkeypatch):
    cfg = cfg_of()
    buf = io.StringIO()
    tune.autotune(FakeRT(cfg), cfg, 65, out=buf, timer=FakeTimer(), build=no_build)
    text = buf.getvalue()
    assert "GEMM table" in text and "cost model" in text and "tuned" in text
    n = len(products(cfg, 65))
    assert "GEMM table: compiling" in text and "GEMM table: measuring fp32 shapes" in text and f"{n}/{n}" in text
    assert tune.autotune(FakeRT(cfg), cfg, 65, out=buf, timer=FakeTimer()).measured == 0
    assert buf.getvalue() == text                                       # nothing to do: silent


# ---- which shapes: the products the recorded programs look up ------------------------------------
def _looked_up(monkeypatch, cfg, programs):
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.ops.cuda.gemm import launch
    from gptcuda.ops.cuda_backend import CudaBackend
    keys = set()
    real = launch.tuned_plan
    monkeypatch.setattr(launch, "tuned_plan",
                        lambda rt, g, ex, *a: keys.add(table_key(ex.table_tag, g)) or real(rt, g, ex, *a))
    Engine(cfg, TOKS, TOKS[:200], 65, backend=CudaBackend(cfg, rt=RecordingRuntime(cfg)),
           programs=programs)
    return keys


@pytest.mark.parametrize("over", [["--precision=tf32", "--dropout=0.1"], ["--attention=fused", "--bias=false"],
                                  ["--precision=tf32", "--recompute=true", "--attention=fused", "--dropout=0.1"],
                                  ["--dropout=0.0"]])
def test_products_are_the_recorded_ones(table_cache, monkeypatch, over):
    cfg = cfg_of(*over)
    ops = products(cfg, 65)
    keys = {table_key(cfg.precision, op) for op in ops}
    got = _looked_up(monkeypatch, cfg, ("train", "eval"))
    assert got <= keys, got - keys
    assert {table_key(cfg.precision, op) for op in ops if op.count} <= got
    fwd = {table_key(cfg.precision, op) for op in products(cfg, 65, backward=False)}
    assert _looked_up(monkeypatch, cfg, ("forward",)) <= fwd < keys


@pytest.mark.parametrize("over", [["--recompute=1"], ["--recompute=false", "--bias=false"], ["--recompute=true"],
                                  ["--dropout=0.1"]])
def test_pairs_are_the_recorded_ones(table_cache, monkeypatch, over):
    """bf16: model/products.py pairs lists exactly the pairs the training program looks up (tuned_pair), each
    with its launches a step; the evaluation programs look up none."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.ops.cuda.gemm import launch
    from gptcuda.ops.cuda_backend import CudaBackend
    cfg = cfg_of("--precision=bf16", *BF16, *over)
    seen = []
    real = launch.tuned_pair
    monkeypatch.setattr(launch, "tuned_pair", lambda rt, pr, ex, *a: seen.append(table_key("bf16", pr)) or
                        real(rt, pr, ex, *a))
    Engine(cfg, TOKS, TOKS[:200], 72, backend=CudaBackend(cfg, rt=RecordingRuntime(cfg)), programs=("train",))
    want = pairs(cfg, 72, execution.resolve(cfg))
    assert sorted(set(seen)) == sorted(table_key("bf16", pr) for pr in want)
    assert all(seen.count(table_key("bf16", pr)) == pr.count for pr in want)
    seen.clear()
    Engine(cfg, TOKS, TOKS[:200], 72, backend=CudaBackend(cfg, rt=RecordingRuntime(cfg)), programs=("eval",))
    assert seen == []


# ---- when: the Engine -----------------------------------------------------------------------------
def test_engine_on_a_stand_in_runtime_never_measures(table_cache, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.ops.cuda_backend import CudaBackend
    monkeypatch.setattr(tune, "autotune", lambda *a, **k: pytest.fail("measured on a stand-in runtime"))
    cfg = cfg_of()
    rt = RecordingRuntime(cfg)
    assert not driver.drives_gpu(rt) and not driver.drives_gpu(None)
    eng = Engine(cfg, TOKS, TOKS[:200], 65, backend=CudaBackend(cfg, rt=rt), programs=("train",))
    assert eng.exec.gemm_tune == "auto" and eng.tuning is None


def _engine_stub(cfg, backend="cuda"):
    cfg = cfg_of(f"--backend={backend}", *cfg)
    return SimpleNamespace(be=SimpleNamespace(rt=FakeRT(cfg)), exec=execution.resolve(cfg, arch="sm_90"),
                           cfg=dataclasses.replace(cfg, vocab_size=65))


@pytest.mark.parametrize("names,world,over,backward", [
    (["train"], 1, [], True), (["fwdbwd"], 1, [], True), (["forward"], 1, [], False),
    (["eval_train", "eval_val"], 1, [], False), ([], 1, [], None), (["train"], 2, [], None),
    (["train"], 1, ["--gemm_tune=table"], None), (["train"], 1, ["--gemm_tune=off"], None)])
def test_engine_measures_once_for_its_programs(table_cache, monkeypatch, names, world, over, backward):
    calls = []
    monkeypatch.setattr(driver, "drives_gpu", lambda rt: True)
    monkeypatch.setattr(tune, "autotune", lambda rt, cfg, vocab, **k: calls.append((vocab, k)) or
                        tune.TuneSummary(2, 0, 1.0, 2.0, 1.5, "p"))
    line = Engine._tune_gemms(_engine_stub(over), names, world)
    if backward is None:
        assert calls == []
    else:
        assert calls == [(65, {"backward": backward})] and "measured 2 shapes" in line
    if world > 1:          # data parallel: the table as it is, and a word about what it lacks
        assert "not measured" in line and "data-parallel" in line
    elif backward is None:
        assert line is None


def test_engine_reference_backend_never_measures(table_cache, monkeypatch):
    monkeypatch.setattr(driver, "drives_gpu", lambda rt: True)
    monkeypatch.setattr(tune, "autotune", lambda *a, **k: pytest.fail("measured for the reference backend"))
    assert Engine._tune_gemms(_engine_stub([], backend="reference"), ["train"], 1) is None
    assert Engine(cfg_of("--backend=reference"), TOKS, TOKS[:200], 65, programs=("train",)).tuning is None


# ---- the device timer frees what it allocates -------------------------------------------------------
def _timing_runtime(precision):
    """A recording runtime that also times: every malloc is tracked, graphs replay nothing, events read 1 ms."""
    pytest.importorskip("cuda.bindings.nvrtc")

    class Dev(FakeDev):
        def __init__(self, info):
            super().__init__(info)
            self.live, self.fail_on = set(), None

        def malloc(self, n):
            p = super().malloc(n)
            self.live.add(p)
            return p

        def free(self, p):
            self.live.remove(p)

        def event(self):
            return object()

        def elapsed_ms(self, e0, e1):
            if self.fail_on is not None:
                raise RuntimeError("the device went away")
            return 1.0

    class Graph:
        def __init__(self, rt):
            self.rt = rt

        def launch(self):
            pass

        def destroy(self):
            if self in self.rt._graphs:
                self.rt._graphs.remove(self)

    class TimingRT(RecordingRuntime):
        def make_dev(self, info):
            return Dev(info)

        def capture(self, prog):
            g = Graph(self)
            self._graphs.append(g)
            return g

    return TimingRT(precision)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_event_timer_frees_its_buffers_and_restores_the_workspaces(table_cache, precision):
    cfg, vocab = _precision_cfg(precision)
    rt = _timing_runtime(precision)
    rt.exec = execution.resolve(cfg, arch="sm_90")
    planned = {"gemm_splitk": fake_view((4,))}                   # the planned one, replaced while timing
    rt.set_workspace(planned)
    s = tune.autotune(rt, cfg, vocab, quiet=True, build=no_build)  # the real EventTimer; every candidate's
    assert s.measured == len(tune.tuned_ops(cfg, vocab, True, rt.exec))   # kernels a listed variant (RecordingRuntime)
    # (the runtime keeps one buffer: the pairs' tile counter, made once, freed by rt.close)
    from gptcuda.ops.cuda.gemm import launch
    kept = {launch._COUNTERS[rt].ptr} if precision == "bf16" else set()
    assert rt.dev.live == kept and rt._graphs == [] and rt._workspace == planned
    assert rt._recording is None
    # a failure half-way: still nothing left behind
    table_path(rt.info.name).unlink()
    forget_tables()
    rt.dev.fail_on = True
    with pytest.raises(RuntimeError, match="went away"):
        tune.autotune(rt, cfg, vocab, quiet=True, build=no_build)
    assert rt.dev.live == kept and rt._graphs == [] and rt._workspace == planned


def test_event_timer_checks_part_of_a_large_output():
    rt = _timing_runtime("tf32")
    got = []
    rt.download = lambda v: got.append(v) or np.zeros(v.shape, np.float32)
    timer = tune.EventTimer(rt, {}, rounds=1, check_floats=1000)
    op = Product(64, 64, 8, False, True)
    timer(op, [tune.candidates_for(op, plan_of("tf32"), 132, 0)[0]])
    head, tail = got
    assert head.numel == tail.numel == 500 and tail.ptr - head.ptr == 4 * (64 * 64 - 500)
    assert rt.dev.live == set()


@pytest.mark.parametrize("trans_b,out", [(True, "bf16"), (False, "bf16")])
def test_event_timer_times_bf16_products_on_bf16_operands(trans_b, out):
    """bf16: A and B uploaded as bf16 bit patterns (2 bytes an element, values of the noise rounded),
    C of the dtype the layout's kernels write, read back as values for the check."""
    rt = _timing_runtime("bf16")
    cfg, _ = _precision_cfg("bf16")
    rt.exec = execution.resolve(cfg, arch="sm_90")
    writes, got = [], []
    real_write = rt.write
    rt.write = lambda v, arr: writes.append((v, np.asarray(arr).copy())) or real_write(v, arr)
    rt.download = lambda v: got.append(v) or np.full(v.shape, 0x3F80, np.uint16)     # bf16 1.0
    timer = tune.EventTimer(rt, {}, rounds=1, check_floats=1000)
    op = Product(64, 64, 64, False, trans_b)
    samples, ok = timer(op, [tune.candidates_for(op, rt.exec, 132, 0)[0]])
    assert [v.dtype for v, _ in writes] == ["bf16", "bf16"] and all(a.dtype == np.uint16 for _, a in writes)
    assert all(np.all(np.isfinite(bf16.values(a))) and np.std(bf16.values(a)) > 0.5 for _, a in writes)
    head, tail = got
    assert head.dtype == tail.dtype == out and tail.ptr - head.ptr == 2 * (64 * 64 - 500)
    assert ok == [True] and rt.dev.live == set()
    # the weight gradient's layout writes fp32
    op = Product(64, 64, 64, True, False)
    rt.download = lambda v: got.append(v) or np.ones(v.shape, np.float32)
    timer(op, [tune.candidates_for(op, rt.exec, 132, 0)[0]])
    assert got[-1].dtype == "f32"


def test_bf16_candidates_split_only_into_fp32():
    """GPT-2 124M in bf16: the tuner's candidates (as matmul's plans) split K only where C is fp32 (the
    weight gradients): the split-K reduction writes fp32, a bf16 C is one product."""
    cfg = load_config("configs/gpt2_124m.yaml", ["--batch_size=8", "--total_batch_tokens=0"])
    ex, V = execution.resolve(cfg, arch="sm_90"), 50304
    ws = tune.workspace_floats(cfg, V, ex)
    assert ex.precision == "bf16" and ws["gemm_splitk"] > 0
    seen = set()
    for op in products(cfg, V, ex=ex):
        for p in tune.candidates_for(op, ex, 132, ws)[1]:
            seen.add((op.layout, p.splits > 1))
            assert p.splits == 1 or op.layout == "TN", (op.label, p)
    assert ("TN", True) in seen and ("NN", False) in seen
