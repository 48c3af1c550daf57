"""The element types of the encoder, cross-entropy and AdamW launchers, on the recording fake runtime (no
GPU): each dtype combination with a kernel launches that variant (listed in VARIANTS; its arguments
checked against the kernel's parameters), any other is one ValueError line, and the 4-value paths
follow the alignment of 4 elements of each view's type (16 bytes of fp32, 8 of bf16)."""
import pytest

from gptcuda.ops.cuda import DTYPE_CODES as CODE
from gptcuda.ops.cuda import encoder as enc
from gptcuda.ops.cuda import loss as L
from gptcuda.ops.cuda import optim
from tests.conftest import shifted_view as view      # (rt, shape, dtype, bytes into its allocation)
from tests.fakes import RecordingRuntime

pytest.importorskip("cuda.bindings.nvrtc")

@pytest.fixture
def rt():
    r = RecordingRuntime("fp32")
    r.state = r.empty((16,), "i32")
    return r


def launched(rt):
    """The kernel names launched since the last call."""
    names = [rec.fn.name for rec in rt.launched]
    rt.launched.clear()
    return names


def refused(match, fn, *args, **kw):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


# ---- encoder --------------------------------------------------------------------------------

@pytest.mark.parametrize("w,out", [("f32", "f32"), ("bf16", "bf16"), ("bf16", "f32")])
@pytest.mark.parametrize("shift,vec", [(0, 4), (8, 4), (4, 1)])
def test_encoder_fwd_types(rt, w, out, shift, vec):
    B, T, C, V = 2, 16, 64, 65
    if w == "f32" and shift == 8:
        vec = 1                                  # fp32 4-value loads need 16 bytes
    idx = view(rt, (B, T), "i32")
    enc.encoder_fwd(rt, view(rt, (B, T, C), out), idx, view(rt, (V, C), w, shift), view(rt, (T, C), w))
    assert launched(rt) == [enc.enc_name("encoder_fwd", vec, (CODE[w], CODE[out]))]


@pytest.mark.parametrize("wte,wpe,out", [("f32", "f32", "bf16"), ("bf16", "f32", "bf16"), ("f32", "bf16", "f32"),
                                         ("bf16", "bf16", "i32")])
def test_encoder_fwd_refuses_types_without_a_kernel(rt, wte, wpe, out):
    B, T, C, V = 2, 16, 64, 65
    refused(f"encoder_fwd: no kernel for wte {wte}, wpe {wpe}, out {out}", enc.encoder_fwd, rt,
            view(rt, (B, T, C), out), view(rt, (B, T), "i32"), view(rt, (V, C), wte), view(rt, (T, C), wpe))
    assert not launched(rt)


@pytest.mark.parametrize("method", ["scan", "sort"])
@pytest.mark.parametrize("dout", ["f32", "bf16"])
@pytest.mark.parametrize("shift,vec", [(0, 4), (8, 4), (4, 1)])
def test_encoder_bwd_types(rt, dout, method, shift, vec):
    B, T, C, V, Tmax = 2, 64, 128, 1000, 64
    if dout == "f32" and shift == 8:
        vec = 1
    rt.set_workspace({enc.WORKSPACE: rt.empty((enc.workspace_ints(B * T),), "i32")})
    enc.encoder_bwd(rt, view(rt, (V, C)), view(rt, (Tmax, C)), view(rt, (B, T, C), dout, shift),
                    view(rt, (B, T), "i32"), method=method)
    wte = (["encoder_bwd_wte"] if method == "scan" else [enc.sort_plan(B * T, V)[0], "encoder_bwd_wte_seg"])
    assert launched(rt) == [k if k.startswith("encoder_bwd_sort") else enc.enc_name(k, vec, (CODE[dout],))
                            for k in wte + ["encoder_bwd_wpe"]]


@pytest.mark.parametrize("dwte,dwpe", [("bf16", "f32"), ("f32", "bf16")])
def test_encoder_bwd_refuses_bf16_parameter_gradients(rt, dwte, dwpe):
    B, T, C, V = 2, 16, 64, 65
    refused(f"encoder_bwd: no kernel for dwte {dwte}, dwpe {dwpe}, dout bf16", enc.encoder_bwd, rt,
            view(rt, (V, C), dwte), view(rt, (T, C), dwpe), view(rt, (B, T, C), "bf16"), view(rt, (B, T), "i32"))


# ---- cross-entropy ----------------------------------------------------------------------------

# (row length, bytes into the allocation, the kernel for fp32, for bf16)
CE_KINDS = [(65, 0, "warp", "warp"), (1025, 0, "block", "block"), (50304, 0, "rows", "rows"),
            (50304, 8, "block", "rows"), (50304, 4, "block", "block"), (50304, 2, None, "block")]


@pytest.mark.parametrize("mode", ["grad", "inplace", "nograd"])
@pytest.mark.parametrize("dtype,V,shift,kind", [(t, V, s, k[t == "bf16"]) for V, s, *k in CE_KINDS
                                                for t in ("f32", "bf16") if k[t == "bf16"]])
def test_crossentropy_types(rt, dtype, mode, V, shift, kind):
    """The kernel for bf16 logits as for fp32 ones, but for the register kernel's alignment: 4
    elements, 8 bytes of bf16 (an 8-byte offset keeps it for bf16, not for fp32)."""
    N = 3
    logits = view(rt, (N, V), dtype, shift)
    dlogits = {"grad": view(rt, (N, V), dtype, shift), "inplace": logits, "nograd": None}[mode]
    grad = mode != "nograd"
    L.crossentropy(rt, view(rt, (N,)), dlogits, logits, view(rt, (N,), "i32"), 0.5 if grad else 0.0)
    nv4 = L.rows_nv4(V) if kind == "rows" else 0
    assert launched(rt) == [L.ce_name(kind, grad, nv4, dtype)]


@pytest.mark.parametrize("V", [65, 50304])
def test_crossentropy_refuses_mixed_types(rt, V):
    N = 3
    args = (view(rt, (N,)), view(rt, (N, V), "bf16"), view(rt, (N, V)), view(rt, (N,), "i32"), 0.5)
    refused("crossentropy: no kernel for logits f32, dlogits bf16", L.crossentropy, rt, *args)
    refused("crossentropy: no kernel for logits bf16, dlogits f32", L.crossentropy, rt, args[0], args[2], args[1],
            *args[3:])
    refused("crossentropy: no kernel for logits i32", L.crossentropy, rt, args[0], None, view(rt, (N, V), "i32"),
            args[3], 0.0)
    refused("crossentropy: losses must be f32", L.crossentropy, rt, view(rt, (N,), "bf16"), None, args[1], args[3],
            0.0)
    assert not launched(rt)


# ---- AdamW and the working copy ------------------------------------------------------------------

@pytest.mark.parametrize("fshift,wshift,vec", [(0, 0, 4), (0, 8, 4), (4, 0, 1), (0, 2, 1), (0, 4, 1)])
def test_adamw_working_copy(rt, fshift, wshift, vec):
    P = 4099
    bufs = [view(rt, (P,), "f32", fshift) for _ in range(4)]
    tail = (100, 0.9, 0.95, 1e-8, 0.1, 1.0)
    optim.adamw(rt, *bufs, *tail, work=view(rt, (P,), "bf16", wshift))
    optim.adamw(rt, *bufs, *tail)
    assert launched(rt) == [optim.adamw_name(vec, copy=True), optim.adamw_name(4 if not fshift else 1)]


def test_adamw_refuses_other_copies(rt):
    P = 4099
    bufs = [view(rt, (P,)) for _ in range(4)]
    tail = (100, 0.9, 0.95, 1e-8, 0.1, 1.0)
    refused("adamw: no kernel for params f32, grads f32, m f32, v f32, work f32", optim.adamw, rt, *bufs, *tail,
            work=view(rt, (P,)))
    refused("adamw: no kernel for params bf16", optim.adamw, rt, view(rt, (P,), "bf16"), *bufs[1:], *tail)
    refused(r"adamw: sizes differ: .* \(work \(4098,\)\)", optim.adamw, rt, *bufs, *tail,
            work=view(rt, (P - 1,), "bf16"))
    assert not launched(rt)


@pytest.mark.parametrize("oshift,sshift,vec", [(0, 0, 4), (8, 0, 4), (2, 0, 1), (0, 8, 1)])
def test_optim_to_bf16(rt, oshift, sshift, vec):
    P = 1001
    optim.to_bf16(rt, view(rt, (P,), "bf16", oshift), view(rt, (P,), "f32", sshift))
    assert launched(rt) == [optim.to_bf16_name(vec)]
    refused("to_bf16: no kernel for out f32, src bf16", optim.to_bf16, rt, view(rt, (P,)), view(rt, (P,), "bf16"))
    refused("to_bf16: sizes differ", optim.to_bf16, rt, view(rt, (P,), "bf16"), view(rt, (P + 1,)))
