"""The StepState has one definition (gptcuda/model/state.py): kernels/common.cuh's struct agrees with it
field by field, and the CUDA backend's pack / unpack round-trips every field."""
import re

import numpy as np

from gptcuda.runtime import compiler
from gptcuda.model import state


def test_cuda_struct_matches_state_py():
    src = compiler.expand_source("common.cuh")
    body = re.search(r"struct StepState \{(.*?)\};", src, re.S).group(1)
    fields = re.findall(r"^\s*(int|float)\s+(\w+)(?:\[(\d+)\])?;", body, re.M)
    ctype = {np.int32: "int", np.float32: "float"}
    want = [(ctype[t], name) for name, (_, t) in sorted(state.FIELDS.items(), key=lambda kv: kv[1][0])]
    assert [(t, n) for t, n, _ in fields[:len(want)]] == want
    assert [i for _, (i, _) in sorted(state.FIELDS.items(), key=lambda kv: kv[1][0])] == list(range(len(want)))
    words = len(want) + sum(int(k) for _, _, k in fields[len(want):] if k)
    assert words == state.WORDS and all(k for _, _, k in fields[len(want):])   # the rest is padding


def test_pack_unpack_round_trip():
    words = np.zeros(state.WORDS, np.int32)
    vals = {"step": 7, "lr": 0.25, "loss": 1.5, "grad_norm": 3.0, "eval_draws": 11, "work_fresh": 1}
    assert state.unpack(state.pack_into(words, **vals)) == vals
    assert state.initial() == dict.fromkeys(vals, 0) and state.byte_offset("loss") == 8
