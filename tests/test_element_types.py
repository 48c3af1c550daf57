"""The element types of the encoder, cross-entropy, AdamW, layernorm and elementwise launchers, on the
recording fake runtime (no GPU): each dtype combination with a kernel launches that variant (listed in
VARIANTS; its arguments checked against the kernel's parameters), any other is one ValueError line, and
the 4-value paths follow the alignment of 4 elements of each view's type (16 bytes of fp32, 8 of bf16)."""
import pytest

from gptcuda.config import config_of
from gptcuda.ops.cuda import DTYPE_CODES as CODE
from gptcuda.ops.cuda import elementwise as ew
from gptcuda.ops.cuda import encoder as enc
from gptcuda.ops.cuda import layernorm as ln
from gptcuda.ops.cuda import loss as L
from gptcuda.ops.cuda import optim
from gptcuda.runtime import DeviceView
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
    rt.set_workspace({enc.WORKSPACE: rt.empty((enc.workspace_ints(B * T, C),), "i32")})
    enc.encoder_bwd(rt, view(rt, (V, C)), view(rt, (Tmax, C)), view(rt, (B, T, C), dout, shift),
                    view(rt, (B, T), "i32"), method=method)
    wte = (["encoder_bwd_wte"] if method == "scan" else
           [enc.sort_plan(B * T, V)[0], "encoder_bwd_wte_long", "encoder_bwd_wte_seg"])
    assert launched(rt) == [k if k.startswith("encoder_bwd_sort") else enc.enc_name(k, vec, (CODE[dout],))
                            for k in wte + ["encoder_bwd_wpe"]]


@pytest.mark.parametrize("dwte,dwpe", [("bf16", "f32"), ("f32", "bf16")])
def test_encoder_bwd_refuses_bf16_parameter_gradients(rt, dwte, dwpe):
    B, T, C, V = 2, 16, 64, 65
    refused(f"encoder_bwd: no kernel for dwte {dwte}, dwpe {dwpe}, dout bf16", enc.encoder_bwd, rt,
            view(rt, (V, C), dwte), view(rt, (T, C), dwpe), view(rt, (B, T, C), "bf16"), view(rt, (B, T), "i32"))


# ---- cross-entropy ----------------------------------------------------------------------------

# (row length, bytes into the allocation, the kernel for fp32, for bf16)
CE_KINDS = [(65, 0, "warp", "warp"), (1025, 0, "block", "block"), (50304, 0, "rows", "smem"),
            (1028, 0, "rows", "rows"), (50304, 8, "block", "rows"), (50304, 4, "block", "block"),
            (50304, 2, None, "block")]


@pytest.mark.parametrize("mode", ["grad", "inplace", "nograd"])
@pytest.mark.parametrize("dtype,V,shift,kind", [(t, V, s, k[t == "bf16"]) for V, s, *k in CE_KINDS
                                                for t in ("f32", "bf16") if k[t == "bf16"]])
def test_crossentropy_types(rt, dtype, mode, V, shift, kind):
    """The kernel for bf16 logits as for fp32 ones, but for the register kernel's alignment: 4
    elements, 8 bytes of bf16 (an 8-byte offset keeps it for bf16, not for fp32); and bf16 rows of V % 8
    == 0, 16-byte aligned, in shared memory (crossentropy_smem)."""
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


# ---- layernorm -----------------------------------------------------------------------------------

F, B = "f32", "bf16"


def planned(rt, C=1024):
    """rt with the layernorm and elementwise workspaces of a model of width C."""
    cfg = config_of(check=False, batch_size=1, block_size=1, n_embd=C, n_head=1, n_layer=1, vocab_size=4 * C,
                    attention="unfused")
    rt.set_workspace({n: rt.empty(shape, dtype, name=n)
                      for fam in (ln, ew) for n, (shape, dtype) in fam.workspace(cfg).items()})
    return rt


@pytest.mark.parametrize("types", ln.FWD_TYPES)
@pytest.mark.parametrize("C", [768, 770])                     # register path (NV 6), loop kernels
@pytest.mark.parametrize("fused", [False, True])
def test_layernorm_fwd_types(rt, types, C, fused):
    tx, tb, to = types
    x, out = view(rt, (4, C), tx), view(rt, (4, C), to)
    w, b, mean, rstd = view(rt, (C,)), view(rt, (C,)), view(rt, (4,)), view(rt, (4,))
    residual = (view(rt, (4, C), tx), view(rt, (4, C), tb), 0.1, 7) if fused else None
    ln.layernorm_fwd(rt, out, mean, rstd, x, w, b, residual)
    nv = 6 if C == 768 else 0
    want = [ln.fwd_name(nv, True, fused, types)]
    if fused and not nv:             # the loop kernels: the residual add made first, into x
        want.insert(0, ew.ew_name("dropout_apply", 4, True, True, types=(tx, tx, tb)))
    assert launched(rt) == want
    codes = [CODE[t] for t in ((tx, tb, to) if nv else (tx, to))]          # the last template arguments
    assert want[-1].endswith(", ".join(map(str, codes)) + ">")


@pytest.mark.parametrize("types", ln.BWD_TYPES)
@pytest.mark.parametrize("C", [768, 770])
@pytest.mark.parametrize("drop", [False, True])
def test_layernorm_bwd_types(rt, types, C, drop):
    tdo, tx, tdx, tdr = types
    planned(rt)
    dx, dout, x = view(rt, (4, C), tdx), view(rt, (4, C), tdo), view(rt, (4, C), tx)
    dw, db, mean, rstd, w = (view(rt, s) for s in ((C,), (C,), (4,), (4,), (C,)))
    ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, (view(rt, (4, C), tdr), 0.1, 7) if drop else None)
    assert launched(rt) == [ln.bwd_name(6 if C == 768 else 0, True, drop, types), ew.SUM_ROWS]


def test_layernorm_alignment_counts_elements(rt):
    """The register kernels need views aligned to 4 elements: 8 bytes of bf16 do, 8 bytes of fp32 don't."""
    C = 256
    planned(rt)
    w, mean, rstd, dw = view(rt, (C,)), view(rt, (4,)), view(rt, (4,)), view(rt, (C,))
    for shift, dtype, nv in ((8, B, 2), (2, B, 0), (8, F, 0), (16, F, 2)):
        ln.layernorm_fwd(rt, view(rt, (4, C), dtype), mean, rstd, view(rt, (4, C), dtype, shift), w, None)
        assert launched(rt) == [ln.fwd_name(nv, False, False, (dtype,) * 3)], (shift, dtype)
    for shift, nv in ((8, 2), (4, 0)):
        ln.layernorm_bwd(rt, view(rt, (4, C), B), dw, None, view(rt, (4, C), B, shift), view(rt, (4, C), B), mean,
                         rstd, w)
        assert launched(rt) == [ln.bwd_name(nv, False, False, (B,) * 4), ew.SUM_ROWS]


def test_layernorm_refuses_types_without_a_kernel(rt):
    C = 128
    planned(rt)
    x, xb, out, outb = view(rt, (2, C)), view(rt, (2, C), B), view(rt, (2, C)), view(rt, (2, C), B)
    w, mean, rstd, dw = view(rt, (C,)), view(rt, (2,)), view(rt, (2,)), view(rt, (C,))
    refused(r"layernorm_fwd: no kernel for x bf16, out f32 \(there are, in that order: f32 f32; bf16 bf16; f32 bf16\)",
            ln.layernorm_fwd, rt, out, mean, rstd, xb, w, None)
    refused("layernorm_fwd: no kernel for x f32, resid f32, branch f32, out bf16",
            ln.layernorm_fwd, rt, outb, mean, rstd, x, w, None, (x, out, 0.1, 3))
    refused("layernorm_fwd: no kernel for x bf16, resid f32, branch bf16",
            ln.layernorm_fwd, rt, outb, mean, rstd, xb, w, None, (x, xb, 0.1, 3))
    refused("layernorm_fwd: w must be f32", ln.layernorm_fwd, rt, outb, mean, rstd, xb, view(rt, (C,), B), None)
    refused("layernorm_fwd: mean must be f32", ln.layernorm_fwd, rt, outb, view(rt, (2,), B), rstd, xb, w, None)
    refused("layernorm_bwd: no kernel for dout bf16, x f32, dx bf16, dropped f32",
            ln.layernorm_bwd, rt, xb, dw, None, outb, x, mean, rstd, w, (x, 0.1, 3))
    refused(r"layernorm_bwd: no kernel for dout bf16, x f32, dx f32, dropped f32 \(.*bf16 f32 f32 bf16\)",
            ln.layernorm_bwd, rt, x, dw, None, outb, x, mean, rstd, w, (x, 0.1, 3))
    refused("layernorm_bwd: dw must be f32 or bf16 .a gradient., got i32", ln.layernorm_bwd, rt, xb,
            view(rt, (C,), "i32"), None, outb, xb, mean, rstd, w)
    refused("layernorm_bwd: ds .* needs db", ln.layernorm_bwd, rt, xb, dw, None, outb, xb, mean, rstd, w, None, dw)
    refused("layernorm_bwd: ds must be f32 or bf16", ln.layernorm_bwd, rt, xb, dw, dw, outb, xb, mean, rstd, w, None,
            view(rt, (C,), "i32"))
    assert not launched(rt)


def test_layernorm_bwd_sums_ds_with_db(rt):
    """ds (the branch gradient's column sums) comes out of the same launch as dw and db: a third sum over
    the partials' rows, 3C apart."""
    C = 768
    planned(rt)
    dx, dout, x = (view(rt, (4, C), B) for _ in range(3))
    dw, db, ds, mean, rstd, w = (view(rt, s) for s in ((C,), (C,), (C,), (4,), (4,), (C,)))
    ln.layernorm_bwd(rt, dx, dw, db, dout, x, mean, rstd, w, ds=ds)
    rec = rt.launched[-1]
    buf, addr = next(iter(rec.blobs.values()))
    data = buf[addr - buf.ctypes.data:][:8 * (6 * ew.SUM_ITEMS + 1)].tobytes()
    sums = ew.unpack_sum_batch(data)          # (out, partials, rows, cols, ld) of each
    part = sums[0][1]
    assert [(o, p - part, c, ld) for o, p, _, c, ld in sums] == [(dw.ptr, 0, C, 3 * C), (db.ptr, 4 * C, C, 3 * C),
                                                                  (ds.ptr, 8 * C, C, 3 * C)]
    assert launched(rt) == [ln.bwd_name(6, True, False, (B,) * 4), ew.SUM_ROWS]


def test_layernorm_variants_are_the_tables():
    """VARIANTS: every NV, bias and fusion of each FWD_TYPES / BWD_TYPES entry, not the types' cross
    product; the deliberately wrong backward in fp32 and all bf16 (the fp32 / tf32 and the bf16 models')."""
    plain = {n for f, n, d in ln.VARIANTS if not d}
    fwd = {n for n in plain if n.startswith("layernorm_fwd")}
    bwd = {n for n in plain if n.startswith("layernorm_bwd")}
    assert len(fwd) == len(ln.FWD_TYPES) * (ln.MAX_NV * 4 + 2) and len(bwd) == len(ln.BWD_TYPES) * (ln.MAX_NV + 1) * 4
    broken = [n for f, n, d in ln.VARIANTS if d]
    assert all(n.endswith((", 0, 0, 0, 0>", ", 1, 1, 1, 1>")) for n in broken)
    assert len(broken) == len(set(broken)) == 2 * (ln.MAX_NV + 1) * 4
    assert len(plain) == sum(1 for v in ln.VARIANTS if not v[2])                     # no variant twice


# ---- elementwise ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F, B])
def test_elementwise_types(rt, dtype):
    planned(rt)
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
    ew.bias_grad(rt, view(rt, (100,)), view(rt, (10, 100), dtype))
    assert launched(rt) == [ew.ew_name("gelu_fwd", 4, types=t2), ew.ew_name("gelu_bwd", 4, types=t3),
                            ew.ew_name("dropout_apply", 4, False, True, types=t3),
                            ew.ew_name("dropout_apply", 4, False, True, types=t3),
                            ew.ew_name("dropout_apply", 4, True, True, types=t3),
                            ew.ew_name("dropout_apply", 4, True, False, types=t3),
                            ew.ew_name("accumulate", 4, True, types=t2), ew.ew_name("accumulate", 4, False, types=t2),
                            ew.bias_grad_name(4, dtype), ew.SUM_ROWS]


def test_residual_dropout_of_a_bf16_branch_into_fp32(rt):
    out, resid = view(rt, (4, 64)), view(rt, (4, 64))
    ew.residual_dropout(rt, out, resid, view(rt, (4, 64), B, 8), 0.1, 3)
    ew.residual_dropout(rt, resid, resid, view(rt, (4, 64), B, 2), 0.1, 3)     # out aliases resid; x 2 bytes off
    assert launched(rt) == [ew.ew_name("dropout_apply", 4, True, True, types=(F, F, B)),
                            ew.ew_name("dropout_apply", 1, True, True, types=(F, F, B))]


def test_elementwise_alignment_counts_elements(rt):
    planned(rt)
    for shift, dtype, vec in ((8, B, 4), (2, B, 1), (8, F, 1), (16, F, 4)):
        ew.gelu_fwd(rt, view(rt, (64,), dtype), view(rt, (64,), dtype, shift))
        ew.bias_grad(rt, view(rt, (64,)), view(rt, (3, 64), dtype, shift))
        assert launched(rt) == [ew.ew_name("gelu_fwd", vec, types=(dtype,) * 2), ew.bias_grad_name(vec, dtype),
                                ew.SUM_ROWS], (shift, dtype)


def test_elementwise_refuses_types_without_a_kernel(rt):
    planned(rt)
    f, b = view(rt, (64,)), view(rt, (64,), B)
    refused(r"gelu_fwd: no kernel for out bf16, x f32 \(there are, in that order: f32 f32; bf16 bf16\)",
            ew.gelu_fwd, rt, b, f)
    refused("gelu_bwd: no kernel for dpre f32, dout bf16, pre f32", ew.gelu_bwd, rt, f, b, f)
    refused("dropout_fwd: no kernel for out f32, x bf16", ew.dropout_fwd, rt, f, b, 0.1, 3)
    refused("dropout_bwd: no kernel for out bf16, x f32", ew.dropout_bwd, rt, b, f, 0.1, 3)
    refused("residual_dropout: no kernel for out bf16, resid f32, x bf16", ew.residual_dropout, rt, b, f, b, 0.1, 3)
    refused("accumulate: no kernel for dst i32, src bf16", ew.accumulate, rt, view(rt, (64,), "i32"), b, False)
    refused(r"bias_grad: db must be f32 or bf16 \(a gradient\), got i32", ew.bias_grad, rt, view(rt, (64,), "i32"),
            view(rt, (2, 64), B))
    refused("sum_rows: out must be f32 or bf16", ew.sum_rows, rt, (view(rt, (64,), "i32"), view(rt, (2, 64))))
    refused("sum_rows: partials must be f32", ew.sum_rows, rt, (f, view(rt, (2, 64), B)))
    assert not launched(rt)


def test_an_output_aliases_inputs_of_its_own_type_only(rt):
    """A thread writes 4 fp32 values (16 bytes) where it read 4 bf16 (8): out over an input of another
    element type would overwrite other threads' inputs."""
    base = rt.empty((256,))
    out = DeviceView(base.ptr, (64,), F, "out")
    x = DeviceView(base.ptr + 128, (64,), B, "x")                # inside out
    refused(r"residual_dropout: out \(f32\) overlaps x \(bf16\)", ew.residual_dropout, rt, out, view(rt, (64,)),
            x, 0.1, 3)
    assert not launched(rt)
