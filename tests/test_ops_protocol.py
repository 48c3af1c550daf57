"""Both backends implement the op interface (backend.Ops) with its parameters: the same names, in the
same order, with the same defaults; and the model calls no op outside it."""
import inspect
import re
from pathlib import Path

import pytest

from gptcuda.ops.backend import Ops
from gptcuda.ops.cuda_backend import CudaBackend
from gptcuda.ops.reference.backend import ReferenceBackend

OPS = [name for name, fn in vars(Ops).items() if inspect.isfunction(fn) and not name.startswith("_")]


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("backend", [CudaBackend, ReferenceBackend])
@pytest.mark.parametrize("op", OPS)
def test_backend_implements_op(backend, op):
    impl = getattr(backend, op, None)
    assert impl is not None, f"{backend.__name__} lacks {op}"
    assert params(impl) == params(getattr(Ops, op)), f"{backend.__name__}.{op}"


def test_model_calls_only_ops():
    src = (Path(__file__).resolve().parent.parent / "gptcuda" / "model" / "gpt.py").read_text()
    called = set(re.findall(r"\bo\.([a-z_]+)\(", src)) | set(re.findall(r"self\.ops\.([a-z_]+)\(", src))
    assert called and called <= set(OPS) | {"batch_feeder"}, called - set(OPS)
