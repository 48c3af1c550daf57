"""Backward scratch inside the logits buffer (memory.SHARED_WITH_LOGITS): where it is placed, and that no
value of it meets a live logit, in both backends' programs. No GPU.

The reference backend's arena makes an entry inside another a view of the other's elements, as the
device's offsets do, so a shared plan whose values overlapped in time would change the reference's
gradients: the same runs with and without sharing must agree bit for bit (and do not when dln, which
the head's backward writes while it reads the logits, is shared: the check can fail). The CUDA
backend's recorded programs (its launch order, pairs and held sums included) are checked at the level
of launches: no launch touches the logits and a shared entry, and every stretch of launches that touch
the logits with none of the shared entries between them begins with the head's product, which writes
the logits whole."""
import dataclasses

import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.model import memory
from gptcuda.model.memory import ARENA_ALIGN, plan_memory
from gptcuda.model.params import param_table
from gptcuda.training.engine import Engine, plan_for

TOKS = (np.arange(4000) * 7 % 65).astype(np.int32)


def _plan(cfg, V, act="f32"):
    return plan_memory(dataclasses.replace(cfg, vocab_size=V), param_table(cfg, V), V, 1, {}, {"ws": ((7,), "f32")},
                       cfg.max_iters + 1, act)


@pytest.mark.parametrize("act", ["f32", "bf16"])
def test_shared_scratch_lies_inside_the_logits_apart(act):
    cfg = load_config("configs/tiny.yaml", ["--dropout=0.1"])
    p = _plan(cfg, 1024, act)
    lg = p["logits"]
    inside = [e for e in p.entries if e.within]
    assert [e.name for e in inside] == list(memory.SHARED_WITH_LOGITS)
    ends = []
    for e in inside:
        assert e.within == "logits" and e.dtype == lg.dtype and e.offset % ARENA_ALIGN == 0
        assert lg.offset <= e.offset and e.offset + e.nbytes <= lg.offset + lg.nbytes
        ends.append((e.offset, e.offset + e.nbytes))
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(sorted(ends), sorted(ends)[1:]))    # apart from each other
    assert sum(p.by_kind().values()) == p.arena_bytes
    own = [e for e in p.entries if not e.within]                                  # the rest: one each, in order
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(own, own[1:]))
    memory.SHARED_WITH_LOGITS, keep = (), memory.SHARED_WITH_LOGITS
    try:
        apart = _plan(cfg, 1024, act)
    finally:
        memory.SHARED_WITH_LOGITS = keep
    assert not any(e.within for e in apart.entries)
    assert apart.arena_bytes - p.arena_bytes == sum((e.nbytes + ARENA_ALIGN - 1) // ARENA_ALIGN * ARENA_ALIGN
                                                    for e in inside)
    assert "(inside logits: no bytes of its own)" in p.format(detail=True)


def test_scratch_that_does_not_fit_keeps_its_own_bytes():
    """A char model's logits (65 columns, C 128) hold none of the scratch; a vocabulary of 4C holds dfc alone."""
    cfg = load_config("configs/tiny.yaml", ["--n_embd=128"])
    assert not any(e.within for e in _plan(cfg, 65).entries)
    p = _plan(cfg, 4 * cfg.n_embd)
    assert [e.name for e in p.entries if e.within] == ["dfc"]
    plan = memory.MemoryPlan(p.table)
    plan.add("host", (64,), "bf16")
    with pytest.raises(ValueError, match=r"x \(f32\) inside host \(bf16\)"):
        plan.add("x", (4,), "f32", within="host")


def _reference(over, V, accum=1, shared=memory.SHARED_WITH_LOGITS):
    keep, memory.SHARED_WITH_LOGITS = memory.SHARED_WITH_LOGITS, tuple(shared)
    try:
        cfg = load_config("configs/tiny.yaml", ["--backend=reference", "--max_iters=3", *over])
        eng = Engine(cfg, TOKS, TOKS[:400], V, programs=("train", "eval", "fwdbwd"), n_vocab=65, accum=accum)
    finally:
        memory.SHARED_WITH_LOGITS = keep
    shared_now = [e.name for e in eng.plan.entries if e.within]
    eng.run("fwdbwd")
    grads = eng.grads()
    for _ in range(3):
        eng.train_step()
    return shared_now, grads, eng.loss_history(3), eng.evaluate(), eng.params()


def _same(a, b):
    ga, gb = a[1], b[1]
    return (all(np.array_equal(ga[k], gb[k]) for k in ga) and np.array_equal(a[2], b[2]) and a[3] == b[3]
            and all(np.array_equal(a[4][k], b[4][k]) for k in a[4]))


@pytest.mark.parametrize("over,accum", [([], 1), (["--dropout=0.1", "--recompute=1"], 1),
                                        (["--dropout=0.1", "--recompute=true", "--bias=false"], 2),
                                        (["--attention=fused", "--recompute=1"], 2)],
                         ids=["plain", "dropout-recompute1", "dropout-recompute-accum", "fused-accum"])
def test_reference_runs_agree_with_and_without_sharing(over, accum):
    shared = _reference(over, 1024, accum)
    apart = _reference(over, 1024, accum, shared=())
    assert shared[0] == [n for n in memory.SHARED_WITH_LOGITS if n != "branch" or "--dropout=0.1" in over]
    assert apart[0] == []
    assert _same(shared, apart)


def test_sharing_a_value_live_with_the_logits_changes_the_reference():
    """The check above has teeth: dln (the head's input gradient, written while the logits are read) inside
    the logits changes the gradients."""
    wrong = _reference([], 1024, shared=("dln",))
    assert wrong[0] == ["dln"]
    assert not _same(wrong, _reference([], 1024, shared=()))


# ---- the CUDA backend's programs, launch by launch ---------------------------------------------------

def _recorded(over, V, accum=1):
    """The CUDA backend's programs over a plan without sharing (each pointer names one entry), its
    arena's spans, and the names the shared plan puts inside the logits."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from gptcuda.ops.cuda_backend import CudaBackend
    from tests.fakes import RecordingRuntime

    cfg = load_config("configs/tiny.yaml", ["--max_iters=3", "--vocab_multiple=8", *over])
    shared = [e.name for e in plan_for(cfg, V, accum=accum).entries if e.within]
    keep, memory.SHARED_WITH_LOGITS = memory.SHARED_WITH_LOGITS, ()
    try:
        rt = RecordingRuntime(cfg)
        eng = Engine(cfg, TOKS, TOKS[:400], V, backend=CudaBackend(cfg, rt=rt),
                     programs=("train", "eval", "fwdbwd", "forward"), n_vocab=65, accum=accum)
    finally:
        memory.SHARED_WITH_LOGITS = keep
    spans = [(v.ptr, v.ptr + v.nbytes, k) for k, v in eng.bufs.acts.items()]
    return eng, spans, shared


def _touched(rec, spans) -> set:
    from gptcuda.runtime import Launch, Memset
    from tests.fakes import pointers
    assert isinstance(rec, (Launch, Memset)), f"{type(rec).__name__} in a single-GPU program"
    return {k for p in pointers(rec) for lo, hi, k in spans if lo <= p < hi}


def _stretches(items, spans, shared):
    """[(labels of a stretch of launches touching the logits with no shared entry between them)]; fails on
    a launch touching both."""
    out, cur = [], None
    for rec in items:
        t = _touched(rec, spans)
        assert not ("logits" in t and t & shared), (rec.label, sorted(t))
        if t & shared:
            cur = None
        elif "logits" in t:
            if cur is None:
                cur = []
                out.append(cur)
            cur.append(rec.label)
    return out


@pytest.mark.parametrize("over,accum", [
    (["--precision=bf16", "--attention=fused", "--recompute=1"], 1),
    (["--precision=bf16", "--attention=fused", "--dropout=0.1", "--recompute=true"], 2),
    (["--precision=bf16", "--attention=fused", "--n_embd=128", "--n_head=2", "--dropout=0.1"], 1),
    (["--precision=bf16", "--attention=fused", "--grad_dtype=bf16", "--dropout=0.1"], 2),
    (["--precision=tf32", "--attention=fused", "--dropout=0.1", "--recompute=true"], 1),
    (["--precision=fp32", "--attention=unfused", "--bias=false"], 2)],
    ids=["bf16-recompute1", "bf16-dropout-accum", "bf16-flash", "bf16-grads-accum", "tf32-dropout-recompute",
         "fp32-unfused-accum"])
def test_recorded_programs_never_touch_shared_scratch_while_the_logits_live(over, accum):
    V = 2048
    eng, spans, shared = _recorded(over, V, accum)
    cfg = eng.cfg
    assert set(shared) == {"dfc", "dqkv", "dres"} | ({"branch"} if cfg.dropout else set())
    head = f"matmul[{cfg.batch_size * cfg.block_size}x{V}x{cfg.n_embd}]"
    for name, prog in eng.programs.items():
        stretches = _stretches(prog.items, spans, set(shared))
        forwards = sum(getattr(r, "label", "") == "encoder_fwd" for r in prog.items)
        assert len(stretches) == forwards, (name, stretches)       # one stretch a forward pass
        for s in stretches:
            assert s[0] == head and "crossentropy" in s, (name, s)


def test_the_launch_check_finds_a_value_live_with_the_logits():
    """Checked as if dln were shared: the head's input-gradient product touches both."""
    eng, spans, _ = _recorded(["--precision=bf16", "--attention=fused"], 1024)
    with pytest.raises(AssertionError):
        _stretches(eng.programs["train"].items, spans, {"dln"})
