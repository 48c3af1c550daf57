"""TF32 weight gradients dW = dY^T @ X (trans_a) on the register-A warpgroup-MMA kernels without a GPU:
the layout decision (`wgmma_layout`), the scratch "gemm_aT" (`workspace`: X^T or dY^T of a layer's
weight gradient, lnf^T of the tied head's), the cost model's choices at GPT-2 small's (B8 T1024 C768
V50304) and the char model's (B64 T256 C384 V65) shapes (the families the H200's measured table
picks), and the launch sequences, driven by the recording stand-in for the runtime and by numpy
stand-ins for the kernels."""
import dataclasses
import struct
import numpy as np
import pytest

from gptcuda.model.products import Product
from gptcuda.ops.cuda import elementwise, gemm
from gptcuda.ops.cuda.gemm.families import EPI_BIAS, EPI_NONE, EPI_RESID, FAMILIES, transpose_name
from gptcuda.ops.cuda.gemm.plan import (_BYTES_PER_S, _LAUNCH_S, WGMMA_WORKSPACES, b_reads, competing,
                                        estimate_s, make_plan, plan, plan_unfit, tune_candidates, wgmma_layout)
from gptcuda.ops.cuda.gemm.table import forget_tables, plan_from_json, plan_to_json, save_table, table_key
from tests.conftest import FakeGemmRT, fake_view as _v
from tests.fakes import FakeDev
from gptcuda.config import config_of

GPT2 = config_of(batch_size=8, block_size=1024, n_embd=768, n_head=12, n_layer=12, vocab_size=50304,
                 precision="tf32", attention="fused")
CHAR = config_of(batch_size=64, block_size=256, n_embd=384, n_head=6, n_layer=6, vocab_size=65,
                 precision="tf32", attention="fused")
TRANSPOSE = transpose_name(True)
COLSUM_TRANSPOSES = (transpose_name(False, True), transpose_name(True, True))


def ra_name(tile, mn_b, epi, has_bias, colsum=False, tc=False):
    """gemm_wgmma_ra's name: the family whose kernel reads B as stored (mn_b), or stores C transposed (tc)."""
    return FAMILIES["wgmma_ra_t" if tc else "wgmma_ra_mn" if mn_b else "wgmma_ra"].kernel(
        tile, True, not mn_b, epi, has_bias, colsum=colsum)


def _floats(cfg):
    return {k: v[0][0] for k, v in gemm.workspace(cfg).items()}


def _rt(cfg, arch="sm_90", at=None):
    """A recording runtime with the workspaces memory.py plans for cfg (at: gemm_aT's floats)."""
    ws = _floats(cfg)
    return FakeGemmRT("tf32", ws=ws["gemm_splitk"], arch=arch, bt=ws["gemm_bT"], at=ws["gemm_aT"] if at is None else at)


@pytest.fixture(autouse=True)
def _no_table(monkeypatch):
    monkeypatch.setenv("GPTCUDA_GEMM_TUNE", "0")
    monkeypatch.delenv("GPTCUDA_WGMMA", raising=False)


def _weight_grads(cfg):
    C, K = cfg.n_embd, cfg.batch_size * cfg.block_size
    return K, [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C), (cfg.vocab_size, C)]


def _plan(cfg, M, N, K, ta=True, tb=False):
    """The cost model's plan on an sm_90 H200 with cfg's workspaces (what matmul picks)."""
    ws = _floats(cfg)
    vec = (M if ta else K) % 4 == 0 and (K if tb else N) % 4 == 0
    return plan(Product(M, N, K, ta, tb, vec=vec), "tf32", "tf32", max_ws=ws["gemm_splitk"],
                scratch={n: ws[n] for n in WGMMA_WORKSPACES})


def _layout(mode, ta, tb, vec, K, batch=1):
    return wgmma_layout(mode, Product(64, 64, K, ta, tb, batch=batch, vec=vec))


def _unfit(p, family, vec, layout):
    """plan_unfit of a 64^3 product of this layout code (False: the warpgroup-MMA kernels off)."""
    code = layout or "NT"
    mode = layout and ("tf32" if family == "tf32" else "3xtf32")
    return plan_unfit(p, Product(64, 64, 64, code[0] == "T", code[1] == "T", vec=vec), family, mode or None)


# ---- the layout decision -----------------------------------------------------------------------
def test_wgmma_layout():
    """TF32: x @ W^T on wgmma (batched too); one product with K % 4 == 0 for the others: dY @ W (wgmma
    after B^T), the weight gradients A^T B and A^T B^T (the register-A families); 16-byte aligned
    operands only. 3xTF32: the op interface's layouts, one product. No mode: never."""
    K = 8192
    assert _layout("tf32", False, True, True, K, 4) == "NT"
    assert _layout("tf32", False, False, True, K) == "NN"
    assert _layout("tf32", True, False, True, K) == "TN"
    assert _layout("tf32", True, True, True, K) == "TT"
    for ta, tb in ((False, False), (True, False), (True, True)):
        assert not _layout("tf32", ta, tb, True, K, 2)               # batched
        assert not _layout("tf32", ta, tb, True, K - 2)              # K % 4: TMA strides
        assert not _layout("tf32", ta, tb, False, K)                 # unaligned
    assert _layout("3xtf32", True, False, True, K) == "TN"
    assert not _layout("3xtf32", True, True, True, K)                # TT: no product
    assert not _layout("3xtf32", False, True, True, K, 4)            # batched
    assert not _layout(None, False, True, True, K)


# ---- the workspace -----------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [GPT2, CHAR], ids=["gpt2", "char"])
def test_gemm_aT_holds_what_the_register_a_plans_re_lay_out(cfg):
    """gemm_aT holds the re-laid operand of every layer's weight gradient dW [M, N] (X^T [N, tokens]
    for wgmma_ra, dY^T [M, tokens] for wgmma_ra_t: 4C rows the most) and of the tied head's lnf^T [C,
    tokens], never its dlogits^T [V, tokens] (1.65 GB at GPT-2's V and 8192 tokens): there wgmma_ra_t
    cannot compete."""
    K, shapes = _weight_grads(cfg)
    ws = _floats(cfg)
    assert ws["gemm_aT"] == 4 * cfg.n_embd * K
    for M, N in shapes[:4]:
        assert max(M, N) * K <= ws["gemm_aT"]
    V, C = shapes[4]
    assert C * K <= ws["gemm_aT"] < V * K or V < 4 * C
    assert "gemm_aT" in WGMMA_WORKSPACES
    assert "gemm_aT" not in gemm.workspace(dataclasses.replace(cfg, precision="fp32", fp32_gemm="3xtf32"))


@pytest.mark.parametrize("arch,env", [("sm_90", "1"), ("sm_80", "1"), ("sm_90", "0")])
def test_gemm_aT_only_where_wgmma_runs(arch, env, monkeypatch):
    monkeypatch.setenv("GPTCUDA_WGMMA", env)
    ws = gemm.workspace(GPT2)
    dev = gemm.device_workspaces(ws, FakeGemmRT(arch=arch))
    assert ("gemm_aT" in dev) == (arch == "sm_90" and env == "1")
    # and without the wgmma kernels the weight gradients stay on mma.sync
    rt = _rt(GPT2, arch=arch)
    K = 8192
    gemm.matmul(rt, _v((3072, 768)), _v((K, 3072)), _v((K, 768), 1 << 31), True, False)
    names = [n for n, *_ in rt.launches]
    if arch == "sm_90" and env == "1":
        assert names[0] == TRANSPOSE and names[1].startswith("gemm_wgmma_ra<"), names
    else:
        assert names[0].startswith("gemm_tf32<") and TRANSPOSE not in names, names


# ---- the cost model's choices -------------------------------------------------------------------
# the families the H200's measured table picks for the weight gradients (bench/NOTES.md 2026-12-02)
TABLE_PICKS = {"gpt2": ["wgmma_ra", "wgmma_ra", "wgmma_ra", "wgmma_ra_t", "wgmma_ra"],
               "char": ["wgmma_ra", "wgmma_ra_mn", "wgmma_ra", "wgmma_ra_t", "tf32"]}


@pytest.mark.parametrize("cfg,name", [(GPT2, "gpt2"), (CHAR, "char")], ids=["gpt2", "char"])
def test_weight_grads_choose_what_the_table_picks(cfg, name):
    """Without a table the cost model sends each weight gradient (dW qkv, attn proj, fc, fcproj, the
    tied head's dwte) to the family the H200's measured table picked for it: wgmma_ra after X^T,
    wgmma_ra_t (dY^T first) where X is the wider operand, wgmma_ra_mn for the char model's C x C, and
    mma.sync for the char vocabulary's unaligned 65 rows; each modelled faster than mma.sync."""
    K, shapes = _weight_grads(cfg)
    for (M, N), fam in zip(shapes, TABLE_PICKS[name]):
        p = _plan(cfg, M, N, K)
        assert p.family == fam, (M, N, p)
        old = plan(Product(M, N, K, True, False, vec=M % 4 == 0), "tf32", max_ws=_floats(cfg)["gemm_splitk"])
        assert estimate_s(p, Product(M, N, K)) <= estimate_s(old, Product(M, N, K)), (M, N, p, old)
        assert p.transpose_b == (fam == "wgmma_ra")


def test_gpt2_head_products():
    """logits = lnf @ wte^T (N = V): wte (154 MB) is re-read from DRAM by every row of output
    tiles where the grid runs N tiles fastest, so the persistent 256-row TMA tile, whose walk goes m
    fastest over a C this wide and reads wte once, wins; dlnf = dlogits @ wte (K = V, 192 tiles of
    256x128 = 1.45 waves) splits K in two."""
    Ntok, C, V = 8192, 768, 50304
    p = _plan(GPT2, Ntok, V, C, ta=False, tb=True)
    assert p.family == "wgmma" and p.tile[:2] == (256, 128) and p.tile[3] >= 1 and p.splits == 1, p
    small = make_plan("wgmma", (128, 128, 3, 0), 1, C)
    assert p.geo.persistent and not small.geo.persistent
    assert b_reads(small, Ntok, V, C) == 64 and b_reads(p, Ntok, V, C) == 1
    assert estimate_s(small, Product(Ntok, V, C)) > 1.4 * estimate_s(p, Product(Ntok, V, C))
    d = _plan(GPT2, Ntok, C, V, ta=False, tb=False)
    assert d.family == "wgmma" and d.transpose_b and d.tile[3] >= 1 and d.splits == 2, d
    assert _floats(GPT2)["gemm_splitk"] >= d.splits * Ntok * C


def test_ties_go_to_tma():
    # DRAM-bound: a cp.async tile and its TMA twin model the same time
    M, N, K = 16384, 65, 384
    p = plan(Product(M, N, K, False, True), "tf32", "tf32")
    assert p.family == "wgmma" and p.tile[3] == 1, p


def test_estimate_counts_the_relayout():
    """A plan's re-layout pass: wgmma_ra's X^T [N, K] and wgmma_ra_t's dY^T [M, K] (read 4 bytes, write
    4, at DRAM speed, one more launch); wgmma_ra_t's kernel runs the swapped product [N, M]."""
    M, N, K = 3072, 768, 8192
    bt = make_plan("wgmma_ra", (128, 192, 4), 1, K, transpose_b=True)
    stored = make_plan("wgmma_ra", (128, 192, 4), 1, K)
    g = Product(M, N, K, True, False)
    assert estimate_s(bt, g) == pytest.approx(estimate_s(stored, g) + _LAUNCH_S / 3 +
                                                         8.0 * K * N / _BYTES_PER_S)
    swapped = make_plan("wgmma_ra_t", (128, 192, 4), 1, K)
    assert estimate_s(swapped, Product(N, M, K)) == pytest.approx(estimate_s(stored, g) + _LAUNCH_S / 3 +
                                                              8.0 * K * N / _BYTES_PER_S)
    assert bt.relaid(g) == ("gemm_aT", N * K) and swapped.relaid(g) == ("gemm_aT", M * K)
    assert stored.relaid(g) is None and make_plan("wgmma", (128, 128, 3, 1), 1, K, True).relaid(g) == ("gemm_bT", N * K)


def test_make_plan_rules():
    K = 8192
    assert make_plan("wgmma_ra", (128, 192, 4), 4, K, True).splits == 4
    assert make_plan("wgmma_ra_mn", (128, 192, 5), 1, K, True) is None      # transposes nothing
    assert make_plan("wgmma_ra_t", (128, 192, 4), 1, K, True) is None       # (A^T: its own re-layout)
    assert make_plan("wgmma_ra", (128, 192, 5), 1, K) is None               # not its tile
    assert make_plan("tf32", (128, 128, 32, 2, 2, 3), 1, K, True) is None
    assert make_plan("wgmma_ra", (128, 192, 4), 33, K) is None              # past MAX_SPLITS


def test_table_roundtrip_and_fit(tmp_path, monkeypatch):
    """A table entry of a plan that transposes B first comes back as it was written and is launched;
    where rt's gemm_aT cannot hold B^T the cost model plans instead (a plan that re-lays nothing
    out)."""
    monkeypatch.setenv("GPTCUDA_CACHE", str(tmp_path / "kc"))
    monkeypatch.setenv("GPTCUDA_GEMM_TUNE", "1")
    forget_tables()
    try:
        M, N, K = 3072, 768, 8192
        p = make_plan("wgmma_ra", (128, 128, 4), 2, K, True)
        d = plan_to_json(p)
        assert d["transpose_b"] and plan_from_json(d, K) == p
        assert plan_from_json({**d, "family": "wgmma_ta"}, K) is None         # a family this tree does not have
        key = table_key("tf32", Product(M, N, K, True, False))
        save_table("NVIDIA H200 (test)", {key: d})
        rt = _rt(GPT2)
        gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((K, N), 1 << 31), True, False)
        assert [n for n, *_ in rt.launches][:2] == [TRANSPOSE, ra_name((128, 128, 4), False, 0, False)]
        rt = _rt(GPT2, at=N * K - 1)
        gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((K, N), 1 << 31), True, False)
        assert TRANSPOSE not in [n for n, *_ in rt.launches], rt.launches
    finally:
        forget_tables()


# ---- the launches -------------------------------------------------------------------------------
def test_weight_grad_launch_sequence():
    """dW fc [3072, 768] = dY^T @ X: X^T [768, 8192] into gemm_aT (one transpose), then the register-A
    kernel on dY as stored and X^T (split-K: partials + reduction)."""
    rt = _rt(GPT2)
    M, N, K = 3072, 768, 8192
    gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((K, N), 1 << 31), True, False)
    names = [n for n, *_ in rt.launches]
    p = _plan(GPT2, M, N, K)
    assert names[0] == TRANSPOSE and rt.launches[0][1] == (N // 64, K // 64), names
    assert names[1] == ra_name(p.tile, False, EPI_NONE, False)
    assert rt.launches[1][1] == (min(132, N // p.tile[1] * (M // p.tile[0]) * p.splits), 1, 1)    # persistent
    assert len(names) == (3 if p.splits > 1 else 2) and (p.splits == 1 or "splitk_reduce" in names[2])


def test_head_weight_grad():
    """dwte [V, C] = dlogits^T @ lnf: lnf^T [C, tokens] into gemm_aT, then wgmma_ra over dlogits as
    stored; the swapped product would transpose dlogits [tokens, V]: it does not compete."""
    rt = _rt(GPT2)
    M, N, K = 50304, 768, 8192
    gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((K, N), 1 << 31), True, False)
    names = [n for n, *_ in rt.launches]
    assert names[0] == TRANSPOSE and rt.launches[0][1] == (N // 64, K // 64), names
    assert names[1].startswith("gemm_wgmma_ra<") and len(names) == 2, names
    assert "wgmma_ra_t" not in {p.family for p in tune_candidates(
        Product(M, N, K, True, False), "tf32", "tf32", 1 << 24, scratch={"gemm_aT": _floats(GPT2)["gemm_aT"]})}


def test_trans_a_trans_b_reads_b_in_place():
    """A^T @ B^T (B stored [N, K]): wgmma_ra reads both operands as stored, no transpose; a wgmma_ra plan
    that transposes B first does not fit, nor one without the transpose A^T @ B."""
    rt = _rt(GPT2)
    M, N, K = 768, 3072, 8192
    p = make_plan("wgmma_ra", (128, 192, 4), 1, K)
    gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((N, K), 1 << 31), True, True, plan=p)
    assert [n for n, *_ in rt.launches] == [ra_name(p.tile, False, 0, False)]
    assert _plan(GPT2, M, N, K, tb=True).family == "wgmma_ra"
    with pytest.raises(ValueError, match="transpose_b"):
        gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((K, N), 1 << 31), True, False, plan=p)
    with pytest.raises(ValueError, match="transpose_b"):
        gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((N, K), 1 << 31), True, True,
                    plan=make_plan("wgmma_ra", (128, 192, 4), 1, K, True))
    with pytest.raises(ValueError, match="needs"):
        gemm.matmul(rt, _v((M, N)), _v((M, K)), _v((K, N), 1 << 31), False, False, plan=p)


def test_launched_names_are_in_variants():
    variants = {(f, n) for f, n, _ in gemm.VARIANTS}
    for cfg in (GPT2, CHAR):
        K, shapes = _weight_grads(cfg)
        for at in (None, 5000 * 64):
            rt = _rt(cfg, at=at)
            for M, N in shapes + [(68, 64)]:
                for tb in (False, True):
                    mode = _layout(rt.exec.wgmma_mode, True, tb, M % 4 == 0 and (tb or N % 4 == 0), K)
                    if not mode:
                        continue
                    assert mode == ("TT" if tb else "TN")
                    scratch = {"gemm_aT": rt.workspace("gemm_aT").numel}
                    for p in tune_candidates(Product(M, N, K, True, tb), "tf32", "tf32", _floats(cfg)["gemm_splitk"],
                                             scratch=scratch):
                        if tb and p.family == "tf32":          # (TT is no product of the interface: not compiled)
                            continue
                        for colsum in (None, _v((M,), 1 << 35)):
                            rt._ws["bias_partials"] = _v((256 * M,), 1 << 42)
                            gemm.matmul(rt, _v((M, N)), _v((K, M)), _v((N, K) if tb else (K, N), 1 << 31),
                                        True, tb, plan=p, a_colsum=colsum)
            missing = {(f, n) for f, n, _ in rt.names if f.startswith("gemm_")} - variants   # (not bias_grad's)
            assert not missing, sorted(missing)[:5]
            for name, grid, block, smem in rt.launches:
                assert all(1 <= g <= 65535 for g in grid[1:]) and grid[0] >= 1, (name, grid)


# ---- the launch sequence executed by numpy stand-ins for the kernels ------------------------------
class _HeapDev(FakeDev):
    """A fake device with memory: a float32 heap (NaN where nothing was written), allocations 256-byte
    aligned with a gap between them; a tensor map's bytes hold its base and row stride in floats."""
    BASE = 1 << 20

    def __init__(self, floats, info):
        super().__init__(info)
        self.heap = np.full(floats, np.nan, np.float32)
        self.next = self.BASE

    def malloc(self, n):
        p = self.next
        self.next += -(-int(n) // 256) * 256 + 256
        assert self.next - self.BASE <= 4 * self.heap.size, "heap exhausted"
        return p

    def at(self, ptr, n):
        o = (ptr - self.BASE) // 4
        return self.heap[o:o + n]

    def memset32(self, ptr, word, count, stream=None):
        self.at(ptr, count).view(np.uint32)[:] = word

    def htod(self, dst, host, stream=None):
        self.at(dst, host.size).view(host.dtype)[:] = host.ravel()

    def dtoh(self, host, src):
        host.ravel()[:] = self.at(src, host.size).view(host.dtype)

    def tensor_map(self, ptr, dims, strides_bytes, box, swizzle=True, dtype="f32"):
        super().tensor_map(ptr, dims, strides_bytes, box, swizzle, dtype)
        return struct.pack("<QQ", ptr, int(strides_bytes[0]) // 4).ljust(128, b"\0")


class _NumpyRT(FakeGemmRT):
    """FakeGemmRT over a device with memory (_HeapDev) whose launches run: gemm_transpose, the wgmma
    kernels (split-K partials, the none / bias / residual epilogues, the column sums), the split-K
    reduction and the bias gradient's sums, as numpy stand-ins."""

    def __init__(self, floats, **kw):
        self.floats = floats
        super().__init__("tf32", arch="sm_90", **kw)

    def make_dev(self, info):
        return _HeapDev(self.floats, info)

    def at(self, ptr, n):
        return self.dev.at(ptr, n)

    def _mat(self, ptr, rows, cols, ld):
        return np.stack([self.at(ptr + 4 * r * ld, cols) for r in range(rows)]).astype(np.float64)

    def launch(self, fn, grid, block, args, smem=0, label=None):
        super().launch(fn, grid, block, args, smem, label)
        v = [a.value if hasattr(a, "value") else a for a in args]
        name = fn.name
        if name.startswith("gemm_transpose<"):
            out, x, K, N, colsum, chunk0 = v
            xs = self.at(x.ptr, K * N).reshape(K, N)
            self.at(out.ptr, N * K)[:] = xs.T.ravel()
            if name in COLSUM_TRANSPOSES:                      # one row per 64-row tile
                for i in range(-(-K // 64)):
                    self.at(colsum.ptr + 4 * (chunk0 + i) * N, N)[:] = xs[64 * i:64 * i + 64].sum(0)
            else:
                assert colsum is None
        elif name.startswith("bias_grad_partial"):
            part, dout, M, N, rpc = v
            d = self.at(dout.ptr, M * N).reshape(M, N)
            for c in range(-(-M // rpc)):
                self.at(part.ptr + 4 * c * N, N)[:] = d[c * rpc:(c + 1) * rpc].sum(0)
        elif name == elementwise.SUM_ROWS:
            for out, part, nrows, cols, ld in elementwise.unpack_sum_batch(v[0].data):
                self.at(out, cols)[:] = np.stack([self.at(part + 4 * r * ld, cols) for r in range(nrows)]).astype(
                    np.float64).sum(0)
        elif name.startswith("gemm_wgmma"):
            params = name[name.index("<") + 1:-1].split(",")
            mn_a = mn_b = False                               # K-major A and B
            ra = name.startswith("gemm_wgmma_ra")             # A [K, M] as stored; MN_B; COLSUM; TC
            tc = ra and len(params) > 7 and params[7] == "true"
            if name.startswith("gemm_wgmma3_ra"):   # each operand as stored, MN_A / MN_B
                mn_a, mn_b = params[5] == "true", params[6] == "true"
            if ra:
                mn_a, mn_b = True, params[5] == "true"
            epi, hb = int(params[3]), params[4] == "true"
            if name.startswith(("gemm_wgmma_tma", "gemm_wgmma_ws", "gemm_wgmma_pp", "gemm_wgmma_ra", "gemm_wgmma3_ra")):
                C, aux, ma, mb, bias, M, N, K, ldc, sC, alpha, splits, kc = v[:13]
                (pa, lda), (pb, ldb) = struct.unpack_from("<QQ", ma.data), struct.unpack_from("<QQ", mb.data)
            else:
                C, aux, A, B, bias, M, N, K, lda, ldb, ldc, sA, sB, sC, alpha, splits, kc = v
                pa, pb = A.ptr, B.ptr
            a = self._mat(pa, K, M, lda).T if mn_a else self._mat(pa, M, K, lda)
            b = self._mat(pb, K, N, ldb).T if mn_b else self._mat(pb, N, K, ldb)
            persistent = name.startswith(("gemm_wgmma_ws", "gemm_wgmma_pp", "gemm_wgmma_ra", "gemm_wgmma3_ra"))
            colsum = v[14] if persistent else None             # a persistent kernel's last argument
            summed = (name.startswith("gemm_wgmma3_ra") and len(params) > 7 and params[7] == "true") or \
                (ra and len(params) > 6 and params[6] == "true")
            if summed:                                          # COLSUM: A's sums, a row per split
                for z in range(splits):
                    self.at(colsum.ptr + 4 * z * M, M)[:] = a[:, z * kc:(z + 1) * kc].sum(1)
            else:
                assert colsum is None, name
            for z in range(splits):
                acc = a[:, z * kc:(z + 1) * kc] @ b[:, z * kc:(z + 1) * kc].T
                if hb:
                    acc = acc + self.at(bias.ptr, N)
                if epi == EPI_RESID:
                    acc = acc + self._mat(aux.ptr, M, N, ldc)
                assert epi in (EPI_NONE, EPI_BIAS, EPI_RESID), name
                if tc:                                          # C stored transposed: C[c * ldc + r]
                    assert epi == EPI_NONE and not hb, name
                    for c in range(N):
                        self.at(C.ptr + 4 * (z * sC + c * ldc), M)[:] = acc[:, c]
                    continue
                for r in range(M):
                    self.at(C.ptr + 4 * (z * sC + r * ldc), N)[:] = acc[r]
        elif name.startswith("gemm_splitk_reduce"):
            out, aux, ws, bias, M, N, ldc, splits, alpha = v
            params = name[name.index("<") + 1:-1].split(",")
            acc = self.at(ws.ptr, splits * M * N).reshape(splits, M, N).astype(np.float64).sum(0)
            if params[1] == "true":
                acc = acc + self.at(bias.ptr, N)
            if int(params[0]) == EPI_RESID:
                acc = acc + self._mat(aux.ptr, M, N, ldc)
            for r in range(M):
                self.at(out.ptr + 4 * r * ldc, N)[:] = acc[r]
        else:
            raise AssertionError(f"no stand-in for {name}")


@pytest.mark.parametrize("K,partials", [(740, 256 * 68), (64 * 256 + 8, 256 * 68), (740, None)],
                         ids=["whole", "over_max_chunks", "no_workspace"])
def test_a_colsum_is_the_bias_gradient(K, partials):
    """matmul(..., a_colsum=db) of a swapped plan (wgmma_ra_t): its A^T transpose writes the column
    sums of its 64-row tiles and sum_rows adds them: db = a.sum(0). Past MAX_CHUNKS 64-row tiles, the
    product runs as before and bias_grad reads A once more; without the partials workspace the bias
    gradient says it is missing."""
    M, N = 68, 36
    rng = np.random.default_rng(K)
    rt = _NumpyRT(1 << 22)
    rt._ws = {"gemm_aT": rt.empty((M * K,), name="gemm_aT"), "gemm_splitk": rt.empty((M * N,), name="ws")}
    if partials is not None:
        rt._ws["bias_partials"] = rt.empty((partials,), name="bias_partials")
    a, b = rng.standard_normal((K, M)), rng.standard_normal((K, N))
    da, dbv, out, dbias = rt.empty(a.shape), rt.empty(b.shape), rt.empty((M, N)), rt.empty((M,))
    for view, x in ((da, a), (dbv, b)):
        rt.at(view.ptr, x.size)[:] = x.ravel()
    p = make_plan("wgmma_ra_t", (128, 128, 4), 1, K)
    if partials is None:
        with pytest.raises(KeyError, match="bias_partials"):
            gemm.matmul(rt, out, da, dbv, True, False, plan=p, a_colsum=dbias)
        return
    gemm.matmul(rt, out, da, dbv, True, False, plan=p, a_colsum=dbias)
    a32 = a.astype(np.float32).astype(np.float64)
    assert np.abs(rt.at(dbias.ptr, M) - a32.sum(0)).max() < 1e-5 * np.abs(a32).sum(0).max()
    want = a32.T @ b.astype(np.float32).astype(np.float64)
    assert np.abs(rt.at(out.ptr, M * N).reshape(M, N) - want).max() < 1e-4 * np.abs(want).max()
    names = [n for n, *_ in rt.launches]
    fused = K <= 64 * 256
    assert any(n in COLSUM_TRANSPOSES for n in names) == fused
    assert any(n in (elementwise.bias_grad_name(4), elementwise.bias_grad_name(1)) for n in names) == (not fused)
    assert names[-1] == elementwise.SUM_ROWS


def test_a_colsum_reads_the_stored_a():
    """A plan whose kernel does not sum A (SIMT): bias_grad reads the caller's A [K, M]."""
    M, N, K = 68, 36, 740
    rt = FakeGemmRT("fp32", arch="sm_90", ws=1 << 20)
    rt._ws["bias_partials"] = _v((256 * M,), 1 << 43)
    p = make_plan("simt", (128, 128), 1, K)
    gemm.matmul(rt, _v((M, N)), _v((K, M), 1 << 30), _v((K, N), 1 << 31), True, False,
                plan=p, a_colsum=_v((M,), 1 << 35))
    part = [(g, b) for n, g, b, _ in rt.launches if n.startswith("bias_grad_partial")]
    chunks = -(-K // max(32, -(-K // 256)))
    assert part == [((-(-M // 128), chunks), (256,))], rt.launches


def test_a_colsum_needs_trans_a():
    rt = _NumpyRT(1 << 16)
    with pytest.raises(ValueError, match="a_colsum"):
        gemm.matmul(rt, rt.empty((8, 8)), rt.empty((8, 8)), rt.empty((8, 8)), False, True, a_colsum=rt.empty((8,)))


@pytest.mark.parametrize("fam", ["wgmma_ra_mn", "wgmma3_ra"])
@pytest.mark.parametrize("epilogue", ["bias", "residual"])
def test_as_stored_plans_run_only_the_op_interfaces_products(fam, epilogue):
    """A kernel reading the operands as stored is compiled for gemm.PRODUCTS alone: the weight
    gradient's A^T B takes no epilogue, and a plan forced onto another is refused, naming it."""
    M, N, K = 68, 36, 740
    rt = _NumpyRT(1 << 21)
    rt._ws = {"gemm_splitk": rt.empty((M * N,), name="ws"), "gemm_aT": rt.empty(((M + N) * K,), name="gemm_aT")}
    if fam == "wgmma3_ra":
        rt.exec = rt.exec.with_precision("fp32")
    da, db, out = rt.empty((K, M)), rt.empty((K, N)), rt.empty((M, N))
    kw = {"bias": rt.empty((N,))} if epilogue == "bias" else {"epilogue": "residual", "aux": out}
    p = make_plan(fam, FAMILIES[fam].tiles[0], 1, K)
    with pytest.raises(ValueError, match="kernels are not compiled for"):
        gemm.matmul(rt, out, da, db, True, False, plan=p, **kw)
    assert rt.launches == []


RA_PLANS = [("wgmma_ra", t, tb) for t in FAMILIES["wgmma_ra"].tiles for tb in (False, True)] + \
    [("wgmma_ra_mn", t, False) for t in FAMILIES["wgmma_ra_mn"].tiles] + \
    [("wgmma_ra_t", t, False) for t in FAMILIES["wgmma_ra_t"].tiles]


@pytest.mark.parametrize("fam,tile,tb", RA_PLANS, ids=lambda v: v if isinstance(v, str) else
                         "x".join(map(str, v)) if isinstance(v, tuple) else f"tb{int(v)}")
@pytest.mark.parametrize("splits,colsum", [(1, False), (3, False), (1, True), (3, True)])
def test_ra_plan_launches(fam, tile, tb, splits, colsum):
    """The register-A plans of a weight gradient A^T op(B), A [K, M] as stored, run by numpy stand-ins:
    wgmma_ra reads A through the swizzled boxes {32, 32} of a map {M, K} and B K-major ([N, K] as
    stored, or [K, N] transposed into gemm_aT first); wgmma_ra_mn B [K, N] as stored (unswizzled
    boxes); wgmma_ra_t transposes A into gemm_aT (with the column sums) and runs out^T = B^T A with
    B through registers, stored transposed (split-K: partials in out's layout). The bias gradient
    comes from the kernel's consumers (wgmma_ra, wgmma_ra_mn) or the transpose (wgmma_ra_t)."""
    M, N, K = 68, 36, 740
    rng = np.random.default_rng(M + N + K + splits + tb + colsum)
    rt = _NumpyRT(1 << 22)
    rt._ws = {"gemm_splitk": rt.empty((splits * M * N,), name="ws"),
              "gemm_aT": rt.empty(((M + N) * K,), name="gemm_aT"),
              "bias_partials": rt.empty((256 * M,), name="bias_partials")}
    maps = []
    rt.tensor_map = lambda view, dims, strides, box, swizzle=True: (
        maps.append((tuple(dims), tuple(box), swizzle)) or _NumpyRT.tensor_map(rt, view, dims, strides, box, swizzle))
    a, b = rng.standard_normal((K, M)), rng.standard_normal((N, K) if tb else (K, N))
    da, db, out, dbias = rt.empty(a.shape), rt.empty(b.shape), rt.empty((M, N)), rt.empty((M,))
    for view, x in ((da, a), (db, b)):
        rt.at(view.ptr, x.size)[:] = x.ravel()
    p = make_plan(fam, tile, splits, K, transpose_b=fam == "wgmma_ra" and not tb)
    gemm.matmul(rt, out, da, db, True, tb, plan=p, a_colsum=dbias if colsum else None)
    names = [n for n, *_ in rt.launches]
    kern = [n for n in names if n.startswith("gemm_wgmma_ra")]
    assert len(kern) == 1 and len(names) == 1 + (splits > 1) + (fam != "wgmma_ra_mn" and not tb) + colsum, names
    if fam == "wgmma_ra_t":        # A^T first, then out^T = B^T A: B [K, N] through registers
        assert names[0] in (COLSUM_TRANSPOSES if colsum else [transpose_name(vec) for vec in (False, True)]), names
        assert maps == [((N, K, 1), (32, 32, 1), True), ((K, M, 1), (32, tile[1], 1), True)], maps
        assert kern[0] == ra_name(tile, False, 0, False, tc=True)
    else:
        assert maps[0] == ((M, K, 1), (32, 32, 1), True), maps
        assert maps[1] == (((N, K, 1), (tile[1], 32, 1), False) if fam == "wgmma_ra_mn" else
                           ((K, N, 1), (32, tile[1], 1), True)), maps
        assert kern[0] == ra_name(tile, fam == "wgmma_ra_mn", 0, False, colsum=colsum)
        assert names[0] == kern[0] or names[0] == TRANSPOSE, names
    a32 = a.astype(np.float32).astype(np.float64)
    b32 = b.astype(np.float32).astype(np.float64)
    want = a32.T @ (b32.T if tb else b32)
    assert np.abs(rt._mat(out.ptr, M, N, N) - want).max() < 1e-4 * np.abs(want).max()
    if colsum:
        assert names[-1] == elementwise.SUM_ROWS
        assert np.abs(rt.at(dbias.ptr, M) - a32.sum(0)).max() < 1e-5 * np.abs(a32).sum(0).max()


def test_ra_families_compete_for_weight_gradients():
    """The register-A families join the TF32 candidates of A [K, M] products only (TN: all three; TT,
    B [N, K]: wgmma_ra as stored), for the plain product their kernels are compiled for, and plan
    where gemm_aT holds what they re-lay out; a plan is refused elsewhere with its reason."""
    ra = {"wgmma_ra", "wgmma_ra_mn", "wgmma_ra_t"}
    assert set(competing("tf32", "TN")) == {"tf32"} | ra
    assert competing("tf32", "TT") == ["tf32", "wgmma_ra"]
    assert not ra & set(competing("tf32", "NT")) and not ra & set(competing("simt", "TN"))
    assert competing("tf32", "TN", EPI_RESID) == competing("tf32", "TN", EPI_BIAS) == ["tf32"]
    M, N, K = 384, 1536, 8192
    plans = lambda at: {p.family for p in tune_candidates(Product(M, N, K, True, False), "tf32", "tf32",  # noqa: E731
                                                               scratch={"gemm_aT": at})}
    assert plans(N * K) == {"tf32"} | ra and plans(M * K) == {"tf32", "wgmma_ra_mn", "wgmma_ra_t"}
    assert plans(M * K - 1) == {"tf32", "wgmma_ra_mn"} and plans(N * K - 1) == plans(M * K)
    p = make_plan("wgmma_ra", FAMILIES["wgmma_ra"].tiles[0], 1, 64, transpose_b=True)
    assert _unfit(p, "tf32", True, "TN") is None
    assert "transpose_b" in _unfit(p, "tf32", True, "TT")
    assert "needs" in _unfit(p, "tf32", True, "NT")
    assert "needs" in _unfit(p, "tf32", False, "TN")
    assert "rt.precision" in _unfit(p, "simt", True, "TN")
    q = make_plan("wgmma_ra_mn", FAMILIES["wgmma_ra_mn"].tiles[0], 1, 64)
    assert _unfit(q, "tf32", True, "TN") is None
    assert "needs" in _unfit(q, "tf32", True, "TT")
    t = make_plan("wgmma_ra_t", FAMILIES["wgmma_ra_t"].tiles[0], 1, 64)
    assert "not compiled for TT with epilogue code 3" in plan_unfit(t, Product(64, 64, 64, True, False, "residual"),
                                                                    "tf32", "tf32")


@pytest.mark.parametrize("ta,tb", [(False, True), (False, False), (True, False)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fam", ["wgmma3_ra"])
def test_wgmma3_ra_plan_reads_every_layout_as_stored(ta, tb, splits, fam):
    """A wgmma3_ra plan (fp32 as 3xTF32, A split in the consumers' registers, B in shared memory)
    launches one kernel, no split or transpose pass, with a tensor map per operand as it is stored:
    K-major ({K, rows}, swizzled boxes {32, BM or BN}) or MN-major ({rows, K}, unswizzled boxes {BM or
    BN, 32}; wgmma3_ra's A: swizzled boxes {32, 32}), the kernel's MN_A / MN_B naming which; the numpy
    stand-in of the kernel gives op(A) @ op(B)."""
    M, N, K = 68, 36, 740
    tile = FAMILIES[fam].tiles[0]
    rng = np.random.default_rng(M + N + K + splits + 2 * ta + tb)
    rt = _NumpyRT(1 << 21)
    rt.exec = rt.exec.with_precision("fp32")
    rt._ws = {"gemm_splitk": rt.empty((splits * M * N,), name="ws")}
    maps = []
    rt.tensor_map = lambda view, dims, strides, box, swizzle=True: (
        maps.append((tuple(dims), tuple(box), swizzle)) or _NumpyRT.tensor_map(rt, view, dims, strides, box, swizzle))
    a = rng.standard_normal((K, M) if ta else (M, K))
    b = rng.standard_normal((N, K) if tb else (K, N))
    da, db, out = rt.empty(a.shape), rt.empty(b.shape), rt.empty((M, N))
    for view, x in ((da, a), (db, b)):
        rt.at(view.ptr, x.size)[:] = x.ravel()
    p = make_plan(fam, tile, splits, K)
    gemm.matmul(rt, out, da, db, ta, tb, plan=p)
    a_mn = ((M, K, 1), (32, 32, 1), True) if fam == "wgmma3_ra" else ((M, K, 1), (tile[0], 32, 1), False)
    want_maps = [a_mn if ta else ((K, M, 1), (32, tile[0], 1), True),
                 ((K, N, 1), (32, tile[1], 1), True) if tb else ((N, K, 1), (tile[1], 32, 1), False)]
    assert maps == want_maps
    names = [n for n, *_ in rt.launches]
    assert names[0] == FAMILIES[fam].kernel(tile, ta, tb, 0, False)
    assert names[0].startswith(f"gemm_{fam}<{tile[0]},{tile[1]},{tile[2]},0,false,{str(ta).lower()},{str(not tb).lower()},")
    assert len(names) == (2 if splits > 1 else 1) and not any("transpose" in n or "split<" in n for n in names), names
    a32, b32 = a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)
    want = (a32.T if ta else a32) @ (b32.T if tb else b32)
    got = rt._mat(out.ptr, M, N, N)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("fam", ["wgmma3_ra"])
def test_wgmma3_ra_competes_for_aligned_fp32_products(fam):
    """wgmma3_ra joins the fp32 candidates wherever the 3xTF32 kernels may run (the op interface's
    layouts, aligned operands: `wgmma_layout`), and is refused elsewhere with its reason; the cost
    model has its tiles."""
    for mode in ("NT", "NN", "TN"):
        assert competing("simt", mode) == ["simt", fam]
        assert fam not in competing("tf32", mode)
        assert _unfit(make_plan(fam, FAMILIES[fam].tiles[0], 1, 64), "simt", True, mode) is None
    assert competing("simt", False) == ["simt"]
    p = make_plan(fam, FAMILIES[fam].tiles[0], 1, 64)
    assert "needs" in _unfit(p, "simt", False, "NT")
    assert "needs" in _unfit(p, "simt", True, False)
    assert "rt.precision" in _unfit(p, "tf32", True, "NT")
    cands = tune_candidates(Product(384, 1536, 16384, True, False), "simt", "3xtf32", 1 << 24)
    assert {p.family for p in cands} == {"simt", fam}
    unaligned = Product(384, 1536, 16384, True, False, vec=False)
    assert tune_candidates(unaligned, "simt", "3xtf32", 1 << 24) == tune_candidates(unaligned, "simt", None, 1 << 24)


@pytest.mark.parametrize("fam,tile", [("wgmma_ra_mn", t) for t in FAMILIES["wgmma_ra_mn"].tiles] +
                         [("wgmma3_ra", t) for t in FAMILIES["wgmma3_ra"].tiles],
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
@pytest.mark.parametrize("epilogue,splits,partials", [("none", 1, True), ("none", 3, True), ("none", 1, False)],
                         ids=["whole", "split3", "no_workspace"])
def test_as_stored_plan_gives_the_bias_gradient(fam, tile, epilogue, splits, partials):
    """matmul(..., a_colsum=db) of a plan reading A [K, M] as stored (wgmma_ra_mn in TF32, wgmma3_ra
    in fp32): its colsum kernel sums A as it reads it, one row of partials per split, and
    sum_rows adds them (no second read of A). With an epilogue (the kernel's column sums are
    those of a plain product only) bias_grad reads A once more; without the partials workspace the
    bias gradient says it is missing."""
    M, N, K = 68, 36, 740
    rng = np.random.default_rng(M + N + K + splits + len(epilogue))
    rt = _NumpyRT(1 << 22)
    rt._ws = {"gemm_splitk": rt.empty((splits * M * N,), name="ws"),
              "gemm_aT": rt.empty(((M + N) * K,), name="gemm_aT")}
    if fam == "wgmma3_ra":                       # fp32 (3xTF32)
        rt.exec = rt.exec.with_precision("fp32")
    if partials:
        rt._ws["bias_partials"] = rt.empty((256 * M,), name="bias_partials")
    a, b, out0 = rng.standard_normal((K, M)), rng.standard_normal((K, N)), rng.standard_normal((M, N))
    da, db, out, dbias = rt.empty(a.shape), rt.empty(b.shape), rt.empty((M, N)), rt.empty((M,))
    for view, x in ((da, a), (db, b), (out, out0)):
        rt.at(view.ptr, x.size)[:] = x.ravel()
    kw = dict(epilogue="residual", aux=out) if epilogue == "residual_alias" else {}
    p = make_plan(fam, tile, splits, K)
    if not partials:
        with pytest.raises(KeyError, match="bias_partials"):
            gemm.matmul(rt, out, da, db, True, False, plan=p, a_colsum=dbias, **kw)
        return
    gemm.matmul(rt, out, da, db, True, False, plan=p, a_colsum=dbias, **kw)
    a32 = a.astype(np.float32).astype(np.float64)
    assert np.abs(rt.at(dbias.ptr, M) - a32.sum(0)).max() < 1e-5 * np.abs(a32).sum(0).max()
    want = a32.T @ b.astype(np.float32).astype(np.float64) + (out0 if epilogue == "residual_alias" else 0)
    assert np.abs(rt._mat(out.ptr, M, N, N) - want).max() < 1e-4 * np.abs(want).max()
    names = [n for n, *_ in rt.launches]
    fused = epilogue == "none"
    f = FAMILIES[fam]
    assert names[0] == (f.kernel(tile, True, False, EPI_NONE, False, colsum=True) if fused else
                        f.kernel(tile, True, False, EPI_RESID, False, True)), names
    assert any(n.startswith("bias_grad_partial") for n in names) == (not fused), names
    assert names[-1] == elementwise.SUM_ROWS
