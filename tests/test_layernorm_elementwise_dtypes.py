"""The element types of the layernorm and elementwise launchers, on the recording fake runtime (no GPU):
the views' dtypes pick the kernel (its type codes the last template arguments), 4-value paths need 4
elements of alignment (8 bytes of bf16, 16 of fp32), and a combination without a kernel is one
ValueError line. Every launch is of a listed variant whose parameter sizes the kernel source declares
(RecordingRuntime checks both)."""
import numpy as np
import pytest

from gptcuda.config import config_of
from gptcuda.ops.cuda import elementwise as ew
from gptcuda.ops.cuda import layernorm as ln
from gptcuda.runtime import DeviceView
from tests.fakes import RecordingRuntime

F, B = "f32", "bf16"


@pytest.fixture
def rt():
    r = RecordingRuntime("fp32")
    r.state = r.empty((16,), "i32")
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=1024, n_head=1, n_layer=1, vocab_size=4096,
                    attention="unfused")
    r.set_workspace({n: r.empty(shape, dtype, name=n)
                     for fam in (ln, ew) for n, (shape, dtype) in fam.workspace(cfg).items()})
    return r


def view(rt, shape, dtype, shift=0):
    """A fresh view of dtype, `shift` bytes past an allocation's start."""
    base = rt.empty((int(np.prod(shape)) + 8,), dtype)
    return DeviceView(base.ptr + shift, tuple(shape), dtype, "v")


def names(rt, since=0):
    return [rec.fn.name for rec in rt.launched[since:]]


def one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


# ---- layernorm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("types", ln.FWD_TYPES)
@pytest.mark.parametrize("C", [768, 770])                     # register path (NV 6), loop kernels
@pytest.mark.parametrize("fused", [False, True])
def test_layernorm_fwd_kernel_of_the_dtypes(rt, types, C, fused):
    tx, tb, to = types
    x, out = view(rt, (4, C), tx), view(rt, (4, C), to)
    w, b, mean, rstd = view(rt, (C,), F), view(rt, (C,), F), view(rt, (4,), F), view(rt, (4,), F)
    residual = (view(rt, (4, C), tx), view(rt, (4, C), tb), 0.1, 7) if fused else None
    ln.layernorm_fwd(rt, out, mean, rstd, x, w, b, residual)
    nv = 6 if C == 768 else 0
    want = [ln.fwd_name(nv, True, fused, types)]
    if fused and not nv:             # the loop kernels: the residual add made first, into x
        want.insert(0, ew.ew_name("dropout_apply", 4, True, True, types=(tx, tx, tb)))
    assert names(rt) == want
    codes = [0 if t == F else 1 for t in ((tx, tb, to) if nv else (tx, to))]     # the last template arguments
    assert want[-1].endswith(", ".join(map(str, codes)) + ">")


@pytest.mark.parametrize("types", ln.BWD_TYPES)
@pytest.mark.parametrize("C", [768, 770])
@pytest.mark.parametrize("drop", [False, True])
def test_layernorm_bwd_kernel_of_the_dtypes(rt, types, C, drop):
    tdo, tx, tdx, tdr = types
    dx, dout, x = view(rt, (4, C), tdx), view(rt, (4, C), tdo), view(rt, (4, C), tx)
    dw, db, mean, rstd, w = (view(rt, s, F) for s in ((C,), (C,), (4,), (4,), (C,)))
    ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, (view(rt, (4, C), tdr), 0.1, 7) if drop else None)
    assert names(rt) == [ln.bwd_name(6 if C == 768 else 0, True, drop, types), ew.SUM_ROWS]


def test_layernorm_alignment_counts_elements(rt):
    """The register path needs views aligned to 4 elements: 8 bytes of bf16 do, 8 bytes of fp32 don't."""
    C = 256
    w, mean, rstd = view(rt, (C,), F), view(rt, (4,), F), view(rt, (4,), F)
    for shift, dtype, nv in ((8, B, 2), (2, B, 0), (8, F, 0), (16, F, 2)):
        x, out = view(rt, (4, C), dtype, shift), view(rt, (4, C), dtype)
        ln.layernorm_fwd(rt, out, mean, rstd, x, w, None)
        assert rt.launched[-1].fn.name == ln.fwd_name(nv, False, False, (dtype,) * 3), (shift, dtype)
    dw = view(rt, (C,), F)
    for shift, nv in ((8, 2), (4, 0)):
        v = [view(rt, (4, C), B, shift if i == 1 else 0) for i in range(3)]
        ln.layernorm_bwd(rt, v[0], dw, None, v[1], v[2], mean, rstd, w)
        assert rt.launched[-2].fn.name == ln.bwd_name(nv, False, False, (B,) * 4)


def test_layernorm_refuses_combinations_without_a_kernel(rt):
    C = 128
    x, xb, out, outb = view(rt, (2, C), F), view(rt, (2, C), B), view(rt, (2, C), F), view(rt, (2, C), B)
    w, mean, rstd, dw = view(rt, (C,), F), view(rt, (2,), F), view(rt, (2,), F), view(rt, (C,), F)
    msg = one_line_error(lambda: ln.layernorm_fwd(rt, out, mean, rstd, xb, w, None),
                         r"layernorm_fwd: no kernel for x bf16, out f32 \(there are")
    assert "f32 f32; bf16 bf16; f32 bf16" in msg                   # (x, out) of FWD_TYPES
    one_line_error(lambda: ln.layernorm_fwd(rt, outb, mean, rstd, x, w, None, (x, out, 0.1, 3)),
                   "layernorm_fwd: no kernel for x f32, resid f32, branch f32, out bf16")
    one_line_error(lambda: ln.layernorm_fwd(rt, outb, mean, rstd, xb, w, None, (x, xb, 0.1, 3)),
                   "layernorm_fwd: no kernel for x bf16, resid f32, branch bf16")
    one_line_error(lambda: ln.layernorm_fwd(rt, outb, mean, rstd, xb, view(rt, (C,), B), None),
                   "layernorm_fwd: w must be f32")
    one_line_error(lambda: ln.layernorm_fwd(rt, outb, view(rt, (2,), B), rstd, xb, w, None),
                   "layernorm_fwd: mean must be f32")
    one_line_error(lambda: ln.layernorm_bwd(rt, xb, dw, None, outb, x, mean, rstd, w, (x, 0.1, 3)),
                   "layernorm_bwd: no kernel for dout bf16, x f32, dx bf16, dropped f32")
    one_line_error(lambda: ln.layernorm_bwd(rt, x, dw, None, outb, x, mean, rstd, w, (x, 0.1, 3)),
                   r"layernorm_bwd: no kernel for dout bf16, x f32, dx f32, dropped f32 \(.*bf16 f32 f32 bf16\)")
    one_line_error(lambda: ln.layernorm_bwd(rt, xb, view(rt, (C,), B), None, outb, xb, mean, rstd, w),
                   "layernorm_bwd: dw must be f32")
    assert rt.launched == []


def test_layernorm_variants_are_the_tables(rt):
    """VARIANTS: every NV, bias and fusion of each FWD_TYPES / BWD_TYPES entry, not the types' cross
    product; the deliberately wrong backward in fp32 only."""
    plain = {n for f, n, d in ln.VARIANTS if not d}
    fwd = {n for f, n, d in ln.VARIANTS if n.startswith("layernorm_fwd")}
    bwd = [n for f, n, d in ln.VARIANTS if n.startswith("layernorm_bwd") and not d]
    assert len(fwd) == len(ln.FWD_TYPES) * (ln.MAX_NV * 4 + 2) and len(bwd) == len(ln.BWD_TYPES) * (ln.MAX_NV + 1) * 4
    assert all(n.endswith(", 0, 0, 0, 0>") for f, n, d in ln.VARIANTS if d)
    assert len(plain) == len(ln.VARIANTS) - sum(1 for v in ln.VARIANTS if v[2])       # no variant twice


# ---- elementwise -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F, B])
def test_elementwise_kernels_of_the_dtypes(rt, dtype):
    n = 1000
    a, b, c = (view(rt, (n,), dtype) for _ in range(3))
    t2, t3 = (dtype,) * 2, (dtype,) * 3
    ew.gelu_fwd(rt, a, b)
    ew.gelu_bwd(rt, a, b, c)
    ew.dropout_fwd(rt, a, b, 0.1, 3)
    ew.dropout_bwd(rt, a, a, 0.1, 3)
    ew.residual_dropout(rt, a, a, b, 0.1, 3)
    ew.residual_dropout(rt, a, b, c, 0.0, 3)
    ew.accumulate(rt, a, b, True)
    ew.accumulate(rt, a, b, False)
    ew.bias_grad(rt, view(rt, (100,), F), view(rt, (10, 100), dtype))
    assert names(rt) == [ew.ew_name("gelu_fwd", 4, types=t2), ew.ew_name("gelu_bwd", 4, types=t3),
                         ew.ew_name("dropout_apply", 4, False, True, types=t3),
                         ew.ew_name("dropout_apply", 4, False, True, types=t3),
                         ew.ew_name("dropout_apply", 4, True, True, types=t3),
                         ew.ew_name("dropout_apply", 4, True, False, types=t3),
                         ew.ew_name("accumulate", 4, True, types=t2), ew.ew_name("accumulate", 4, False, types=t2),
                         ew.bias_grad_name(4, dtype), ew.SUM_ROWS]


def test_residual_dropout_of_a_bf16_branch_into_fp32(rt):
    out, resid, x = view(rt, (4, 64), F), view(rt, (4, 64), F), view(rt, (4, 64), B, 8)
    ew.residual_dropout(rt, out, resid, x, 0.1, 3)
    ew.residual_dropout(rt, resid, resid, view(rt, (4, 64), B, 2), 0.1, 3)     # out aliases resid; x: 2 bytes off
    assert names(rt) == [ew.ew_name("dropout_apply", 4, True, True, types=(F, F, B)),
                         ew.ew_name("dropout_apply", 1, True, True, types=(F, F, B))]


def test_elementwise_alignment_counts_elements(rt):
    for shift, dtype, vec in ((8, B, 4), (2, B, 1), (8, F, 1), (16, F, 4)):
        ew.gelu_fwd(rt, view(rt, (64,), dtype), view(rt, (64,), dtype, shift))
        ew.bias_grad(rt, view(rt, (64,), F), view(rt, (3, 64), dtype, shift))
        assert names(rt)[-3:] == [ew.ew_name("gelu_fwd", vec, types=(dtype,) * 2), ew.bias_grad_name(vec, dtype),
                                  ew.SUM_ROWS], (shift, dtype)


def test_elementwise_refuses_combinations_without_a_kernel(rt):
    f, b = view(rt, (64,), F), view(rt, (64,), B)
    one_line_error(lambda: ew.gelu_fwd(rt, b, f), r"gelu_fwd: no kernel for out bf16, x f32 \(there are, in that "
                                                  r"order: f32 f32; bf16 bf16\)")
    one_line_error(lambda: ew.gelu_bwd(rt, f, b, f), "gelu_bwd: no kernel for dpre f32, dout bf16, pre f32")
    one_line_error(lambda: ew.dropout_fwd(rt, f, b, 0.1, 3), "dropout_fwd: no kernel for out f32, x bf16")
    one_line_error(lambda: ew.dropout_bwd(rt, b, f, 0.1, 3), "dropout_bwd: no kernel for out bf16, x f32")
    one_line_error(lambda: ew.residual_dropout(rt, b, f, b, 0.1, 3),
                   "residual_dropout: no kernel for out bf16, resid f32, x bf16")
    one_line_error(lambda: ew.accumulate(rt, f, b, False), "accumulate: no kernel for dst f32, src bf16")
    one_line_error(lambda: ew.bias_grad(rt, b, view(rt, (2, 64), B)), "bias_grad: db must be f32")
    one_line_error(lambda: ew.sum_rows(rt, (f, view(rt, (2, 64), B))), "sum_rows: partials must be f32")
    assert rt.launched == []


def test_an_output_aliases_inputs_of_its_own_type_only(rt):
    """A thread writes 4 fp32 values (16 bytes) where it read 4 bf16 (8): out over an input of another
    element type would overwrite other threads' inputs."""
    base = rt.empty((256,), F)
    out = DeviceView(base.ptr, (64,), F, "out")
    x = DeviceView(base.ptr + 128, (64,), B, "x")                # inside out
    one_line_error(lambda: ew.residual_dropout(rt, out, view(rt, (64,), F), x, 0.1, 3),
                   r"residual_dropout: out \(f32\) overlaps x \(bf16\)")
    assert rt.launched == []
