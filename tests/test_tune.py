"""Measured GEMM dispatch without a GPU: the table's keys, its file per GPU and kernel-source hash,
matmul's lookup and its fallbacks, candidate generation and pruning, and bench/tune.py's
selection driven by a fake timing function."""
import json
import math

import pytest

from bench import tune
from gptcuda.model.products import Product, products
from gptcuda.config import load_config
from gptcuda.ops.cuda import elementwise, gemm
from gptcuda.ops.cuda.gemm import table
from gptcuda.ops.cuda.gemm.families import EPI_BIAS, EPI_NONE, FAMILIES, SIMT_TILES, SPLIT_ALIGN, \
    TF32_FALLBACK_TILES, TF32_TILES
from gptcuda.ops.cuda.gemm.plan import (_BYTES_PER_S, WGMMA_WORKSPACES, estimate_s, make_plan, plan,
                                        prune_candidates, split_chunk, tune_candidates, wave_candidates)
from gptcuda.ops.cuda.gemm.table import load_table, plan_to_json, save_table, table_key, table_path
from gptcuda.runtime.profile import fastest
from tests.conftest import FakeGemmRT, fake_view, plan_of

GPU = "NVIDIA H200 (test)"


@pytest.fixture
def cache(table_cache):
    return table_cache


FakeRT, _v = FakeGemmRT, fake_view


def tf32_name(tile, ta, tb, epi, hb, vec):
    return FAMILIES["tf32"].kernel(tile, ta, tb, epi, hb, vec)


def _run(rt, M, N, K, ta=False, tb=True, epilogue="none", bias=False, a_ptr=1 << 30, colsum=False):
    rt.launches.clear()
    a = _v((K, M) if ta else (M, K), a_ptr)
    b = _v((N, K) if tb else (K, N), 1 << 31)
    aux = _v((M, N), 1 << 33) if epilogue != "none" else None
    gemm.matmul(rt, _v((M, N), 1 << 32), a, b, ta, tb, bias=_v((N,), 1 << 34) if bias else None,
                epilogue=epilogue, aux=aux, a_colsum=_v((M,), 1 << 35) if colsum else None)
    return [name for name, *_ in rt.launches]


# ---- keys and the table file ------------------------------------------------------------
def key_of(tag, ta, tb, epilogue, bias, M, N, K, batch=1):
    return table_key(tag, Product(M, N, K, ta, tb, epilogue, bias, batch))


def test_key_names_every_field():
    base = ("tf32", False, True, "gelu", True, 16384, 1536, 384, 1)
    k = key_of(*base)
    assert k == "tf32:NT:gelu+bias:16384x1536x384:b1"
    variants = {k, table_key("tf32", Product(16384, 1536, 384, False, True, "gelu", True, colsum=True))}
    for i, alt in enumerate(["fp32", True, False, "none", False, 16383, 1535, 385, 2]):
        args = list(base)
        args[i] = alt
        variants.add(key_of(*args))
    assert len(variants) == 11                       # every field changes the key


def test_table_path_per_gpu_and_source(cache):
    p = table_path(GPU)
    assert p.parent == cache / "tune"
    assert p.name.startswith("NVIDIA-H200-test-") and p.name.endswith(table.source_hash()[:16] + ".json")
    assert table_path("other") != p
    assert table_path(GPU, "0" * 64) != p
    assert len(table.source_hash()) == 64


def test_save_load_roundtrip_and_merge(cache):
    p1 = make_plan("tf32", (192, 128, 32, 3, 2, 3), 1, 384)
    p2 = make_plan("tf32", (128, 128, 32, 2, 2, 3), 8, 16384)
    k1 = key_of("tf32", False, True, "none", True, 16384, 384, 384)
    k2 = key_of("tf32", True, False, "none", False, 384, 384, 16384)
    path = save_table(GPU, {k1: {**plan_to_json(p1), "ms": 0.04}})
    assert path.exists()
    save_table(GPU, {k2: plan_to_json(p2)})                  # merged with k1
    table.forget_tables()
    t = load_table(GPU)
    assert t == {k1: p1, k2: p2}
    assert p2.k_chunk == 2048 and p2.splits == 8
    # another GPU, other kernel sources: no table
    assert load_table("NVIDIA A100") == {}
    assert load_table(GPU, "f" * 64) == {}
    # a document written for another source hash under this name is ignored
    doc = json.loads(path.read_text())
    doc["source_hash"] = "0" * 64
    path.write_text(json.dumps(doc))
    assert load_table(GPU, refresh=True) == {}
    # a corrupt file is no table (and no crash)
    path.write_text("{not json")
    assert load_table(GPU, refresh=True) == {}


def test_invalid_entries_are_dropped(cache):
    good = make_plan("tf32", (256, 128, 32, 4, 2, 4), 1, 384)
    entries = {
        key_of("tf32", False, True, "none", False, 4096, 384, 384): plan_to_json(good),
        key_of("tf32", False, True, "none", False, 4096, 768, 384): {"family": "tf32", "tile": [96, 96, 32, 1, 1, 3],
                                                                          "splits": 1, "k_chunk": 384},
        key_of("tf32", True, False, "none", False, 384, 384, 16384): {"family": "tf32",
                                                                          "tile": [128, 128, 32, 2, 2, 3],
                                                                          "splits": 8, "k_chunk": 999},
        key_of("tf32", True, False, "none", False, 384, 384, 100): {"family": "tf32",
                                                                        "tile": [128, 128, 32, 2, 2, 3],
                                                                        "splits": 40, "k_chunk": 32},
        key_of("fp32", False, False, "none", False, 64, 64, 64): {"tile": [128, 128]},
    }
    save_table(GPU, entries)
    table.forget_tables()
    assert list(load_table(GPU).values()) == [good]


# ---- lookup in matmul ---------------------------------------------------------------------
def test_matmul_uses_the_table_else_the_cost_model(cache, monkeypatch):
    rt = FakeRT("tf32", ws=1 << 24)
    M, N, K = 16384, 384, 1536
    heur = _run(rt, M, N, K, bias=True)
    assert len(heur) == 1
    forced = make_plan("tf32", (192, 128, 32, 3, 2, 3), 1, K)
    assert tf32_name(forced.tile, False, True, EPI_BIAS, True, True) != heur[0]
    key = key_of("tf32", False, True, "none", True, M, N, K)
    save_table(GPU, {key: plan_to_json(forced)})
    assert _run(rt, M, N, K, bias=True) == [tf32_name(forced.tile, False, True, EPI_BIAS, True, True)]
    assert rt.launches[0][2] == (192,) and rt.launches[0][3] == forced.geo.smem
    # other epilogue / no bias / other precision / other GPU: not this entry
    assert _run(rt, M, N, K, bias=False) != [tf32_name(forced.tile, False, True, EPI_NONE, False, True)]
    assert _run(rt, M, N, K, epilogue="residual", bias=True)[0].startswith("gemm_tf32<128,128")
    assert _run(FakeRT("fp32", ws=1 << 24), M, N, K, bias=True)[0].startswith("gemm_simt<")
    assert _run(FakeRT("tf32", ws=1 << 24, name="other"), M, N, K, bias=True) == heur
    # switched off
    monkeypatch.setenv("GPTCUDA_GEMM_TUNE", "0")                # (a runtime's plan reads it when made)
    assert _run(FakeRT("tf32", ws=1 << 24), M, N, K, bias=True) == heur


def test_table_entry_that_cannot_run_falls_back(cache):
    M, N, K = 384, 384, 16384
    split = make_plan("tf32", (128, 128, 32, 2, 2, 3), 24, K)
    key = key_of("tf32", True, False, "none", False, M, N, K)
    save_table(GPU, {key: plan_to_json(split)})
    big = FakeRT("tf32", ws=24 * M * N)
    names = _run(big, M, N, K, ta=True, tb=False)
    assert len(names) == 2 and "splitk_reduce" in names[1] and big.launches[0][1][2] == 24
    small = FakeRT("tf32", ws=8 * M * N)                     # workspace too small for 24 splits
    names = _run(small, M, N, K, ta=True, tb=False)
    assert small.launches[0][1][2] != 24
    # an aligned-only tile for a misaligned operand: the cost model's fallback tile instead
    M, N, K = 4096, 384, 384
    key = key_of("tf32", False, True, "none", False, M, N, K)
    save_table(GPU, {key: plan_to_json(make_plan("tf32", (256, 128, 32, 4, 2, 4), 1, K))})
    rt = FakeRT("tf32")
    assert _run(rt, M, N, K)[0].startswith("gemm_tf32<256,128,32,4,2,4,")
    assert _run(rt, M, N, K, a_ptr=(1 << 30) + 4)[0] == tf32_name((64, 64, 32, 2, 2, 4), False, True, EPI_NONE, False,
                                                               False)


def test_batched_lookup(cache):
    rt = FakeRT("tf32")
    p = make_plan("tf32", (64, 64, 32, 2, 2, 4), 1, 64)
    save_table(GPU, {key_of("tf32", False, True, "none", False, 256, 256, 64, 24): plan_to_json(p)})
    gemm.matmul_batched(rt, _v((24, 256, 256)), _v((24, 256, 64)), _v((24, 256, 64), 1 << 31), False, True)
    assert rt.launches[-1][0].startswith("gemm_tf32<64,64,") and rt.launches[-1][1][2] == 24


def test_forced_plan_is_checked():
    rt = FakeRT("tf32", ws=1 << 20)
    p = make_plan("tf32", (128, 128, 32, 2, 2, 3), 8, 16384)
    with pytest.raises(ValueError, match="workspace"):
        gemm.matmul(rt, _v((384, 384)), _v((16384, 384)), _v((16384, 384), 1 << 31), True, False, plan=p)
    with pytest.raises(ValueError, match="family"):
        gemm.matmul(FakeRT("fp32"), _v((64, 64)), _v((64, 64)), _v((64, 64), 1 << 31),
                    plan=make_plan("tf32", (128, 128, 32, 2, 2, 3), 1, 64))


# ---- candidates and pruning -----------------------------------------------------------------
def test_candidates_respect_alignment_workspace_and_batch():
    c = tune_candidates(Product(384, 384, 16384), "tf32", max_ws=8 * 384 * 384)
    assert {p.tile for p in c} == set(TF32_TILES)
    assert max(p.splits for p in c) == 8 and all(p.splits * 384 * 384 <= 8 * 384 * 384 for p in c)
    assert all(p.k_chunk == split_chunk(16384, p.splits) and p.k_chunk % SPLIT_ALIGN == 0 for p in c)
    assert {p.tile for p in tune_candidates(Product(384, 384, 16384, vec=False), "tf32", max_ws=1 << 24)} == \
        set(TF32_FALLBACK_TILES)
    assert all(p.splits == 1 for p in tune_candidates(Product(256, 256, 64, batch=24), "tf32", max_ws=1 << 24))
    simt = tune_candidates(Product(16384, 384, 384), "simt")
    assert {p.tile for p in simt} == set(SIMT_TILES) and all(p.splits == 1 for p in simt)


def test_prune_keeps_the_close_ones_and_the_cost_model_choice():
    g = Product(384, 1152, 16384)
    cands = tune_candidates(g, "tf32", max_ws=1 << 24)
    est = {p: estimate_s(p, g) for p in cands}
    best = min(est.values())
    kept = prune_candidates(cands, g, keep=1.3, max_n=100)
    assert kept == sorted((p for p in cands if est[p] <= 1.3 * best), key=lambda p: est[p])
    assert len(kept) < len(cands)
    top3 = prune_candidates(cands, g, keep=10, max_n=3)
    assert top3 == kept[:3]
    assert prune_candidates([], g) == []
    # the cost model's choice is timed first, whether the pruning keeps it or not; then the pruned ones, then
    # the split counts that fill the waves best where those were pruned (test_split_counts_that_fill_...)
    ws = {"gemm_splitk": 1 << 24}
    for keep, max_n, pruned in ((1.0, 1, prune_candidates(cands, g, keep=1.0, max_n=1)), (1.3, 100, kept)):
        heur, plans = tune.candidates_for(g, plan_of("tf32"), 132, ws, keep=keep, max_n=max_n)
        base = [heur] + [p for p in pruned if p != heur]
        assert plans[:len(base)] == base
        assert all(p.splits > 1 and p not in base for p in plans[len(base):])


def test_split_counts_that_fill_the_waves_are_timed():
    """The tuner also times, per kept tile that leaves SMs idle, the split count whose k loops fill the waves
    best: GPT-2's bf16 dW fc (96 tiles of 128 x 192 on 132 SMs) split 4, which the cost model ranks out of
    its pruned list; none where one split already fills them."""
    ex = plan_of("bf16", True)
    ws = {"gemm_splitk": 1 << 25}
    dw_fc = Product(3072, 768, 8192, True, False, colsum=True)
    heur, plans = tune.candidates_for(dw_fc, ex, 132, ws)
    pruned = prune_candidates(tune_candidates(dw_fc, "bf16", max_ws=1 << 25), dw_fc, 132, tune.KEEP,
                              tune.MAX_CANDIDATES)
    four = make_plan("bf16", (128, 192, 4, 0), 4, 8192)
    assert four in plans and len(set(plans)) == len(plans)
    extra = wave_candidates(tune_candidates(dw_fc, "bf16", max_ws=1 << 25), dw_fc, plans[:1] + pruned)
    assert four in extra and all(p.splits > 1 for p in extra)
    # 256 x 128 over 8192 x 3072: 768 tiles, 5.8 waves of 132 (97% full): nothing added
    fc = Product(8192, 3072, 8192, False, True)
    cands = tune_candidates(fc, "bf16", max_ws=1 << 30)
    assert wave_candidates(cands, fc, [make_plan("bf16", (256, 128, 4, 0), 1, 8192)]) == []


def test_estimate_prefers_hidden_epilogues_and_full_waves():
    # GELU writes two [M, N] arrays: with two resident blocks the stores hide behind the other's main loop
    big = make_plan("tf32", (256, 128, 32, 4, 2, 3), 1, 384)
    two = make_plan("tf32", (128, 128, 32, 2, 2, 3), 1, 384)
    assert big.geo.blocks_per_sm == 1 and two.geo.blocks_per_sm == 2
    e = lambda p, epi: estimate_s(p, Product(16384, 1536, 384, epilogue=epi, bias=True))  # noqa: E731
    assert e(two, "gelu") < e(big, "gelu")
    assert e(big, "gelu") - e(big, "none") > e(two, "gelu") - e(two, "none")
    # never below the DRAM floor
    p = make_plan("tf32", (64, 64, 32, 2, 2, 4), 1, 8)
    assert estimate_s(p, Product(65536, 4096, 8)) >= 4.0 * (65536 * 8 + 8 * 4096 + 65536 * 4096) / _BYTES_PER_S


# ---- bench/tune.py driven by a fake timing function --------------------------------------------
def _cfg(**over):
    return load_config("configs/tiny.yaml", [f"--{k}={v}" for k, v in over.items()])


def test_products_cover_the_model():
    cfg = _cfg(batch_size=8, block_size=32, n_embd=64, n_head=2, dropout=0.1, attention="unfused")
    ops = products(cfg, 65)
    keys = [table_key("tf32", o) for o in ops]
    assert len(keys) == len(set(keys))
    by = {o.label.split(" / ")[0]: o for o in ops}
    N, C, L = 8 * 32, 64, cfg.n_layer
    assert (by["fwd qkv"].M, by["fwd qkv"].N, by["fwd qkv"].K, by["fwd qkv"].tb) == (N, 3 * C, C, True)
    assert by["fwd fc +gelu"].epilogue == "gelu" and by["fwd fc +gelu"].bias
    assert by["dX fcproj +dgelu"].epilogue == "dgelu" and (by["dX fcproj +dgelu"].M, by["dX fcproj +dgelu"].N) == (N, 4 * C)
    assert (by["dW qkv"].M, by["dW qkv"].N, by["dW qkv"].K, by["dW qkv"].ta) == (3 * C, C, N, True)
    assert by["fwd attn proj"].epilogue == "none" and by["eval attn proj"].epilogue == "residual"
    assert not by["dX head"].vec and by["fwd head"].vec                 # V = 65: unaligned lda
    assert by["att scores"].batch == 8 * 2 and (by["att scores"].M, by["att scores"].K) == (32, 32)
    # dX attn proj and fwd attn proj differ in transposes; dX proj (N x C x C NN) merges nothing else
    assert by["dX attn proj"].count == L
    # no dropout: residual fused into the forward, no eval-only shapes; fused attention: no batched GEMMs
    ops2 = products(_cfg(dropout=0.0, attention="fused", bias=False), 65)
    labels = " ".join(o.label for o in ops2)
    assert "eval" not in labels and "att " not in labels
    assert all(not o.bias for o in ops2)
    assert {o.epilogue for o in ops2 if o.label.startswith("fwd attn proj")} == {"residual"}


def test_tune_picks_the_fastest_agreeing_candidate_and_writes_the_table(cache):
    cfg = _cfg(batch_size=64, block_size=256, n_embd=384, n_head=6, dropout=0.2)
    ops = [o for o in products(cfg, 65) if o.label in ("fwd qkv", "dW qkv", "dX fc")]
    assert len(ops) == 3
    ws = tune.workspace_floats(cfg, 65)
    calls = []

    def fake_timer(op, plans):
        calls.append((op, list(plans)))
        # pretend: split plans fastest with 8 splits, otherwise 192-row tiles, otherwise by index;
        # the very fastest candidate of "dX fc" produces a wrong result
        def ms(i, p):
            t = 1.0 + 0.01 * i
            if p.tile[0] == 192:
                t -= 0.5
            if p.splits == 8:
                t -= 0.7
            return t
        samples = [[ms(i, p) * f for f in (1.0, 3.0, 0.9, 1.1, 1.05)] for i, p in enumerate(plans)]
        ok = [True] * len(plans)
        if op.label == "dX fc":
            fastest = min(range(len(plans)), key=lambda i: ms(i, plans[i]))
            ok[fastest] = False
        return samples, ok

    out = []
    import io
    buf = io.StringIO()
    results = tune.run(cfg, ops, plan_of("tf32"), fake_timer, 132, ws, keep=1.6, max_n=6, out=buf)
    assert [c[0] for c in calls] == ops
    for r in results:
        op, plans, times = r["op"], r["plans"], r["times_ms"]
        assert plans[0] == plan(op, "tf32", max_ws=ws["gemm_splitk"])
        assert len(plans) <= 7 and len(set(plans)) == len(plans)
        assert times[0] == pytest.approx(1.05 * (1.0 - (0.5 if plans[0].tile[0] == 192 else 0)
                                                 - (0.7 if plans[0].splits == 8 else 0)))   # the median
        w = r["winner"]
        assert r["ok"] is None or r["ok"][w]
        assert all(times[w] <= t for i, t in enumerate(times) if r["ok"] is None or r["ok"][i])
        out.append((op, plans[w]))
    wins = {op.label: p for op, p in out}
    assert wins["dW qkv"].splits == 8                 # 8 splits of 16384 are in the candidates
    text = buf.getvalue()
    assert "winner" in text and "x floor" in text and "MISMATCH" in text and "tuned" in text
    entries = tune.table_entries(results, plan_of("tf32"))
    save_table(GPU, entries)
    table.forget_tables()
    got = load_table(GPU)
    for op, p in out:
        assert got[table_key("tf32", op)] == p
    # and matmul launches the winner
    rt = FakeRT("tf32", ws=ws["gemm_splitk"])
    rt._ws["bias_partials"] = _v((256 * 4096,), 1 << 43)
    op = next(o for o in ops if o.label == "dW qkv")
    assert op.colsum                                  # its bias gradient comes with it: a key of its own
    names = _run(rt, op.M, op.N, op.K, op.ta, op.tb, colsum=True)
    assert rt.launches[0][1][2] == 8 and "splitk_reduce" in names[1]
    assert names[-2:] == [elementwise.bias_grad_name(4), elementwise.SUM_ROWS]     # the tf32 plan reads A once more


def test_the_winner_is_the_fastest_agreeing_measured_one():
    assert fastest([[3.0], [1.0, 0.5, 2.0], [2.0]]) == ([3.0, 1.0, 2.0], 1)           # medians
    assert fastest([[3.0], [1.0], [2.0]], ok=[True, False, True])[1] == 2
    assert fastest([[], [2.0]]) == ([math.inf, 2.0], 1)
    assert fastest([[1.0]], ok=[False])[1] is None
    assert fastest([[2.0], [1.0], [1.0]])[1] == 1                                    # ties: the earlier


def test_floor():
    op = Product(4096, 4096, 4096)
    assert tune.floor_s(op, plan_of("tf32")) == pytest.approx(2 * 4096 ** 3 / 495e12)
    op = Product(16384, 1536, 8, False, True, "gelu", True)
    assert tune.floor_s(op, plan_of("fp32")) == pytest.approx(4 * (16384 * 8 + 8 * 1536 + 2 * 16384 * 1536) / 4.2e12)


def test_dry_run_cli(capsys):
    assert tune.main(["configs/tiny.yaml", "--precision=tf32", "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "fwd qkv" in out and "model" in out and "tf32" in out and "pair:" not in out
    # bf16: the pairs after the products, each with the dual tiles' candidates and APART last
    assert tune.main(["configs/tiny.yaml", "--precision=bf16", "--attention=fused", "--vocab_multiple=8",
                      "--dry_run"]) == 0
    out = capsys.readouterr().out
    pairs_at = out.index("pair: dW")
    assert "fwd qkv" in out[:pairs_at] and out.count("pair: dW") == out.count("    apart ") >= 3


def test_candidates_for_weight_grads_on_wgmma():
    """bench/tune.py with the workspaces memory.py plans (sm_90): the weight gradients get the
    register-A candidates beside mma.sync, the cost model's choice first (at GPT-2 small's shapes the
    families the H200's measured table picks: wgmma_ra after X^T, the swapped wgmma_ra_t after dY^T
    where X is the wider operand; the tied head's dwte with lnf^T only: its dlogits^T [V, tokens] is
    never planned); without the wgmma kernels none of them."""
    cfg = _cfg(batch_size=8, block_size=1024, n_embd=768, n_head=12, n_layer=12, precision="tf32",
               attention="fused", dropout=0.0)
    V = 50304
    ws = tune.workspace_floats(cfg, V)
    assert ws["gemm_aT"] == 4 * 768 * 8192 and set(WGMMA_WORKSPACES) <= set(ws)
    ops = {o.label.split(" / ")[0]: o for o in products(cfg, V)}
    want = {"dW wte": "wgmma_ra", "dW fc": "wgmma_ra", "dW qkv": "wgmma_ra", "dW attn proj": "wgmma_ra",
            "dW fcproj": "wgmma_ra_t"}
    for label, fam in want.items():
        heur, plans = tune.candidates_for(ops[label], plan_of("tf32", True), 132, ws)
        assert heur.family == fam and plans[0] == heur, (label, heur)
        every = tune.candidates_for(ops[label], plan_of("tf32", True), 132, ws, keep=100, max_n=1000)[1]
        assert {p.family for p in every} == ({"tf32", "wgmma_ra", "wgmma_ra_mn"} |
                                             (set() if label == "dW wte" else {"wgmma_ra_t"})), label
        assert {p.family for p in tune.candidates_for(ops[label], plan_of("tf32"), 132, ws)[1]} == {"tf32"}
    heur, _ = tune.candidates_for(ops["dX head"], plan_of("tf32", True), 132, ws)
    assert heur.transpose_b and heur.splits == 2 and heur.tile[3] == 1, heur
    # and the dry run lists them (as on an H200)
    assert tune.main(["configs/gpt2_124m_t1024.yaml", "--precision=tf32", f"--vocab_size={V}", "--dry_run",
                      "--only=dW"]) == 0
