"""The backward's weight gradients beside its main sequence (ops.beside, the bf16 plan's second stream):
every order the two streams may take gives the same gradients, and each hook point comes after its
layer's gradients are written. Checked on the float64 reference backend, whose ops run where they are
recorded (a side block at its earliest) or, in LateBeside, each side block as late as the model's waits
allow: a wait missing before something the block reads is overwritten changes the gradients there."""
import contextlib
import dataclasses

import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.ops.backend import Program
from gptcuda.ops.reference.backend import ReferenceBackend
from gptcuda.training.engine import Engine

TOKS = (np.arange(3000) * 7919 % 65).astype(np.int32)


class LateBeside(ReferenceBackend):
    """The reference backend with its beside blocks held back: a block's ops are recorded where the main
    sequence waits for it (wait_beside, or join_beside), after the blocks before it (the side stream runs
    its blocks in order). exec.beside is set, so the model places its hooks as for the bf16 plan."""

    def __init__(self, cfg, seed=None):
        super().__init__(cfg, seed)
        self.exec = dataclasses.replace(self.exec, beside=True)
        self.pending, self.done, self.blocks = [], [], []

    @contextlib.contextmanager
    def beside(self, label="beside"):
        main, block = self._prog, Program(label)
        assert main is not None, "beside blocks are recorded into a program"
        self._prog = block
        try:
            yield block
        finally:
            self._prog = main
        self.pending.append(block)
        self.blocks.append(label)

    def wait_beside(self, work):
        if work is None:
            return
        if not any(b is work for b in self.pending):
            assert any(b is work for b in self.done), f"{work.name} was never recorded"
            return                  # a wait for a later block ran it already
        while self.pending:
            b = self.pending.pop(0)
            self._prog.items.extend(b.items)
            self.done.append(b)
            if b is work:
                return

    def join_beside(self):
        while self.pending:
            self.done.append(self.pending.pop(0))
            self._prog.items.extend(self.done[-1].items)


def _engine(backend_cls, **over):
    args = ["--backend=reference", "--batch_size=2", "--max_iters=3"] + [f"--{k}={v}" for k, v in over.items()]
    cfg = load_config("configs/tiny.yaml", args)
    return Engine(cfg, TOKS, TOKS[:400], 65, backend=backend_cls(cfg), programs=())


def _layer_of(name):
    return int(name[1:].split(".")[0]) if name.startswith("h") and name[1:2].isdigit() else None


def _forward_backward(e):
    """Record and run one forward and backward; the gradients, and each layer hook's snapshot of the
    layer's gradients taken where the hook runs."""
    m, be, seen = e.model, e.be, {}

    def hook(point):
        if isinstance(point, int):
            names = [n for n in m.g if _layer_of(n) == point]
            be._rec(lambda: seen.__setitem__(point, {n: np.array(m.g[n]) for n in names}))

    a = e.bufs.acts
    a["idx"][0][...] = TOKS[:a["idx"][0].size].reshape(a["idx"][0].shape)
    a["targets"][0][...] = TOKS[1:a["targets"][0].size + 1].reshape(a["targets"][0].shape)
    m.on_grads_ready = hook
    try:
        be.begin("fwd_bwd")
        m.record_forward_backward()
        prog = be.end()
    finally:
        m.on_grads_ready = None
    be.run(prog)
    return {n: np.array(v) for n, v in m.g.items()}, seen


@pytest.mark.parametrize("over", [dict(dropout=0.0, bias="true", recompute="false"),
                                  dict(dropout=0.1, bias="true", recompute="true"),
                                  dict(dropout=0.0, bias="false", recompute="true")])
def test_weight_gradients_beside_in_any_order(over):
    early, late = _engine(ReferenceBackend, **over), _engine(LateBeside, **over)
    g_early, _ = _forward_backward(early)
    g_late, hooks = _forward_backward(late)
    L = early.cfg.n_layer
    # every weight gradient of every layer ran in a beside block, and was waited for by the end
    assert sorted(late.be.blocks) == sorted(["dW fc", "dW qkv"] * L)
    assert not late.be.pending
    for n in g_early:
        assert np.array_equal(g_early[n], g_late[n]), f"{n}: a beside block read something overwritten"
    # each layer's hook came after all of its gradients were written
    assert sorted(hooks) == list(range(L))
    for l, snap in hooks.items():
        assert snap and all(np.array_equal(v, g_late[n]) for n, v in snap.items()), f"hook {l} came too early"


def test_a_missing_wait_is_seen():
    """The check above can fail: without the wait before the layer below's dgelu product (which writes dfc,
    read by dW fc's block) the late order gives other gradients."""
    over = dict(dropout=0.0, bias="true", recompute="false")
    early, late = _engine(ReferenceBackend, **over), _engine(LateBeside, **over)
    skip = {"n": 0}
    wait = LateBeside.wait_beside

    def forgetful(self, work):
        if work is not None and work.name == "dW fc" and skip["n"] == 0:
            skip["n"] += 1          # the first such wait is left out: the block runs at the next one
            return
        wait(self, work)

    late.be.wait_beside = forgetful.__get__(late.be)
    g_early, _ = _forward_backward(early)
    g_late, _ = _forward_backward(late)
    assert skip["n"] == 1
    assert any(not np.array_equal(g_early[n], g_late[n]) for n in g_early)
