"""The parameter table and the memory plan: offsets, alignment, totals, refusal. No GPU."""
import dataclasses

import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.model.memory import ARENA_ALIGN, MemoryPlan, PlanTooLarge, check_fits, plan_decode, plan_memory
from gptcuda.model.params import init_params, param_table


def cfg_small(**kw):
    return dataclasses.replace(load_config("configs/tiny.yaml"), **kw)


def test_param_count_matches_nanogpt_shakespeare():
    cfg = load_config("configs/shakespeare_char_fp32.yaml")
    t = param_table(cfg, 65)
    L, C, V, T = 6, 384, 65, 256
    # per block: 12 C^2 weights + 13 C biases and layernorm parameters; embeddings; final layernorm
    assert t.n_params == 12 * L * C * C + 13 * L * C + (V + T) * C + 2 * C == 10_770_816


@pytest.mark.parametrize("bias", [True, False])
def test_table_offsets_aligned_disjoint_and_decay_first(bias):
    cfg = cfg_small(bias=bias)
    t = param_table(cfg, 65)
    end = 0
    for s in t:
        assert s.offset % 4 == 0 and s.offset >= end      # 16-byte aligned, in order, no overlap
        end = s.offset + s.numel
        assert (s.offset < t.n_decay) == s.decay           # the 2-D weights first, contiguously
        assert s.decay == (len(s.shape) == 2)
    assert end <= t.total and t.total % 4 == 0
    assert any(s.name.endswith(".b") for s in t) == bias


def test_init_statistics():
    cfg = load_config("configs/shakespeare_char_fp32.yaml")
    t = param_table(cfg, 65)
    flat = init_params(t, cfg, 0)
    get = lambda n: flat[t[n].offset:t[n].offset + t[n].numel]
    assert abs(get("h0.attn.w").std() - 0.02) < 1e-3
    assert abs(get("h0.proj.w").std() - 0.02 / np.sqrt(12)) < 5e-4     # residual projections scaled
    assert np.all(get("h0.ln1.w") == 1) and np.all(get("h0.attn.b") == 0)
    assert np.array_equal(flat, init_params(t, cfg, 0)) and not np.array_equal(flat, init_params(t, cfg, 1))


def _plan(cfg, V=65, saved=None, accum=1):
    t = param_table(cfg, V)
    saved = saved or {"probs": ((cfg.batch_size, cfg.n_head, cfg.block_size, cfg.block_size), "f32")}
    return plan_memory(cfg, t, V, accum, saved, {"ws_a": ((7,), "f32")}, cfg.max_iters + 1)


def test_plan_arithmetic():
    cfg = cfg_small()
    p = _plan(cfg)
    B, T, C, L, H = cfg.batch_size, cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.n_head
    assert p.flat_bytes == 4 * 4 * p.table.total
    assert p["qkv"].shape == (L, B, T, 3 * C) and p["qkv"].nbytes == L * B * T * 3 * C * 4
    assert p["saved_probs"].shape == (L, B, H, T, T)
    # entries are aligned and disjoint (but those inside another: tests/test_memory_sharing.py); totals add up
    spans = sorted((e.offset, e.offset + e.nbytes) for e in p.entries if not e.within)
    assert all(e.offset % ARENA_ALIGN == 0 for e in p.entries)
    assert all(p[e.within].offset <= e.offset and e.offset + e.nbytes <= p[e.within].offset + p[e.within].nbytes
               for e in p.entries if e.within)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert sum(p.by_kind().values()) == p.arena_bytes
    assert p.total_bytes == p.flat_bytes + p.arena_bytes
    text = p.format(detail=True)
    for word in ("parameters", "gradients", "adam m", "adam v", "activations", "op workspace", "total", "ws_a",
                 "batch tokens"):
        assert word in text
    assert "grad_acc" not in text and "train_tokens" not in text      # no dataset on the device


def test_plan_with_gradient_accumulation():
    """A micro-batches: ids, targets and losses for each, one accumulation region, activations once."""
    cfg = cfg_small()
    one, four = _plan(cfg), _plan(cfg, accum=4)
    B, T = cfg.batch_size, cfg.block_size
    for name in ("idx", "targets", "losses"):
        assert one[name].shape == (1, B, T) and four[name].shape == (4, B, T)
    assert four["grad_acc"].shape == (four.table.total,) and four["grad_acc"].kind == "backward"
    assert four["qkv"].shape == one["qkv"].shape
    extra = four.arena_bytes - one.arena_bytes
    assert four["grad_acc"].nbytes <= extra <= four["grad_acc"].nbytes + 3 * 3 * B * T * 4 + 6 * 256


def test_fused_plan_is_smaller_and_scales_with_context():
    cfg = load_config("configs/ctx2048_tf32.yaml")
    B, H, T = cfg.batch_size, cfg.n_head, cfg.block_size
    unfused = _plan(cfg, saved={"probs": ((B, H, T, T), "f32")})
    fused = _plan(cfg, saved={"lse": ((B, H, T), "f32")})
    assert unfused.total_bytes - fused.total_bytes >= cfg.n_layer * B * H * T * (T - 1) * 4


def test_plan_refused_when_too_large():
    cfg = load_config("configs/ctx8192_tf32.yaml", ["--attention=unfused"])
    B, H, T = cfg.batch_size, cfg.n_head, cfg.block_size
    p = _plan(cfg, saved={"probs": ((B, H, T, T), "f32")})
    with pytest.raises(PlanTooLarge) as e:
        check_fits(p, 139 * 2**30, cfg)
    msg = str(e.value)
    assert "memory plan" in msg and "--attention=fused" in msg and "--batch_size=8" in msg
    check_fits(_plan(cfg_small()), 139 * 2**30, cfg_small())      # a small one passes


@pytest.mark.parametrize("recompute", ["false", "2"])
def test_plan_refused_names_the_recompute_count_that_fits(recompute):
    """A plan that stores GELU outputs and is too large names the fewest layers whose GELU output, rebuilt
    instead, would make it fit (and that plan does fit); none where even every layer would not do."""
    cfg = load_config("configs/tiny.yaml", [f"--recompute={recompute}", "--n_layer=6"])
    p = _plan(cfg)
    layer = p["fc_act"].nbytes // p["fc_act"].shape[0]
    free = p.total_bytes - 2 * layer - 1                # three layers more have to rebuild it
    with pytest.raises(PlanTooLarge) as e:
        check_fits(p, free, cfg)
    n = {"false": 0, "2": 2}[recompute] + 3
    assert f"--recompute={n} (the GELU output rebuilt in {n} of 6 layers" in str(e.value)
    check_fits(_plan(load_config("configs/tiny.yaml", [f"--recompute={n}", "--n_layer=6"])), free, cfg)
    with pytest.raises(PlanTooLarge) as e:
        check_fits(p, p.total_bytes - 7 * layer, cfg)
    assert "--recompute=" not in str(e.value)


def test_duplicate_entry_rejected():
    p = MemoryPlan(param_table(cfg_small(), 65))
    p.add("x", (2,))
    with pytest.raises(ValueError):
        p.add("x", (3,))


@pytest.mark.parametrize("arch,env", [("sm_90", "1"), ("sm_80", "1"), ("sm_90", "0")])
def test_wgmma_scratch_only_where_the_device_reads_it(arch, env, monkeypatch):
    """train.py --plan shows the sm_90 plan; an Engine's backend leaves out the transposed-B and -A
    scratch where the wgmma kernels cannot run (not sm_90, or GPTCUDA_WGMMA=0); fp32 plans none."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from tests.fakes import RecordingRuntime
    from gptcuda.ops.cuda_backend import CudaBackend
    from gptcuda.training.engine import plan_for
    monkeypatch.setenv("GPTCUDA_WGMMA", env)
    scratch = {"gemm_bT", "gemm_aT"}
    for prec in ("fp32", "tf32"):
        cfg = load_config("configs/tiny.yaml", [f"--precision={prec}"])
        rt = RecordingRuntime(cfg, arch=arch)
        on_device = {e.name for e in plan_for(cfg, 65, CudaBackend(cfg, rt=rt)).entries}
        printed = {e.name for e in plan_for(cfg, 65).entries}
        assert scratch & printed == (scratch if prec == "tf32" else set())
        assert scratch & on_device == (scratch if prec == "tf32" and arch == "sm_90" and env == "1" else set()), \
            (prec, arch, env, on_device)


def test_decode_plan_holds_parameters_scratch_and_state():
    """Generation's plan: the flat buffer is the parameters alone; with workspaces it carries the
    op scratch and the step state too; a plan too large names the hints it is given."""
    cfg = cfg_small()
    table = param_table(cfg, 65)
    bare = plan_decode(cfg, table, 65, 3, 10)
    assert bare.regions == ("params",) and bare.flat_bytes == 4 * table.total
    assert "state" not in {e.name for e in bare.entries}
    ws = {"gemm_partials": ((1000,), "f32"), "a_scratch": ((10, 3), "f32")}
    p = plan_decode(cfg, table, 65, 3, 10, ws)
    assert p["gemm_partials"].kind == "workspace" and p["a_scratch"].shape == (10, 3)
    assert p["state"].kind == "state" and p.arena_bytes > bare.arena_bytes
    text = p.format()
    assert "parameters" in text and "gradients" not in text and "adam" not in text
    assert "gradients" in _plan(cfg).format()
    with pytest.raises(PlanTooLarge, match="fewer sequences"):
        check_fits(p, p.total_bytes - 1, cfg, hints=["fewer sequences"])
    check_fits(p, p.total_bytes, cfg, hints=["fewer sequences"])


def test_plan_bf16_activations():
    """act bf16: the activations and their gradients at 2 bytes, statistics and losses fp32, and the
    parameters' bf16 working copy planned beside them; the flat buffer (fp32 params, grads, Adam) unchanged."""
    cfg = cfg_small()
    t = param_table(cfg, 64)
    saved = {"lse": ((cfg.batch_size, cfg.n_head, cfg.block_size), "f32")}
    f32 = plan_memory(cfg, t, 64, 1, saved, {}, cfg.max_iters + 1)
    b16 = plan_memory(cfg, t, 64, 1, saved, {}, cfg.max_iters + 1, act="bf16")
    assert b16.flat_bytes == f32.flat_bytes
    for name in ("res", "qkv", "fc_pre", "logits", "dres", "dfc"):
        assert b16[name].dtype == "bf16" and 2 * b16[name].nbytes == f32[name].nbytes
    for name in ("ln1_mean", "losses", "saved_lse", "history"):
        assert b16[name].dtype == f32[name].dtype
    assert b16["params_bf16"].numel == t.total and b16["params_bf16"].nbytes == 2 * t.total
    assert "params_bf16" not in [e.name for e in f32.entries]


@pytest.mark.parametrize("total", [4096, 4100, 4104])
def test_plan_bf16_gradients(total):
    """grads bf16 (grad_dtype bf16): the gradient region at 2 bytes an element, rounded up to 16 bytes so that
    Adam's m and v still start on 16-byte boundaries (float4 access); every other region fp32, in order; the
    micro-batches' sum grad_acc fp32; the plan's summary says so."""
    cfg = cfg_small()
    t = dataclasses.replace(param_table(cfg, 64), total=total)
    saved = {"lse": ((cfg.batch_size, cfg.n_head, cfg.block_size), "f32")}
    f32 = plan_memory(cfg, t, 64, 2, saved, {}, cfg.max_iters + 1, act="bf16")
    b16 = plan_memory(cfg, t, 64, 2, saved, {}, cfg.max_iters + 1, act="bf16", grads="bf16")
    assert [f32.offset_of(r) for r in f32.regions] == [i * 4 * total for i in range(4)]    # (as before: 4 alike)
    assert b16.bytes_of("grads") == -(-2 * total // 16) * 16 and b16.dtype_of("grads") == "bf16"
    assert b16.flat_bytes == f32.flat_bytes - 4 * total + b16.bytes_of("grads")
    assert all(b16.offset_of(r) % 16 == 0 for r in b16.regions)
    assert b16.offset_of("adam_v") + 4 * total == b16.flat_bytes
    assert b16["grad_acc"].dtype == "f32" and b16.arena_bytes == f32.arena_bytes
    line = next(x for x in b16.format().splitlines() if "gradients" in x)
    assert line.endswith("(bf16)") and "(bf16)" not in f32.format()


def test_branch_buffer_only_with_dropout():
    """The branch output before dropout (and its gradient) is planned only where there is dropout: without it the
    residual adds are the products' epilogues and nothing reads or writes that buffer."""
    with_drop, without = _plan(cfg_small(dropout=0.1)), _plan(cfg_small(dropout=0.0))
    assert "branch" in [e.name for e in with_drop.entries] and "branch" not in [e.name for e in without.entries]
    assert with_drop.arena_bytes - without.arena_bytes == with_drop["branch"].nbytes


@pytest.mark.parametrize("batch,peak_gib", [(8, 5.11), (16, 8.44)])
def test_gpt2_config_plans_within_pytorchs_peak(batch, peak_gib):
    """configs/gpt2_124m.yaml (bf16) plans no more than torch.compile + bf16 autocast's measured peak at the same
    batch, the lower of the H200's and the H100's (bench/NOTES.md: 5.12 / 5.11 GiB at B8, 8.45 / 8.44 at B16):
    its recompute count is the fewest rebuilt layers that keep B8 there (none, or one layer fewer would not)."""
    from gptcuda.config import recompute_layers
    from gptcuda.training.engine import plan_for
    cfg = load_config("configs/gpt2_124m.yaml", [f"--batch_size={batch}", "--total_batch_tokens=0"])
    gib = plan_for(cfg, 50304).total_bytes / 2**30
    assert gib <= peak_gib, gib
    if batch == 8 and recompute_layers(cfg) > 0:
        fewer = load_config("configs/gpt2_124m.yaml", ["--batch_size=8", "--total_batch_tokens=0",
                                                       f"--recompute={recompute_layers(cfg) - 1}"])
        assert plan_for(fewer, 50304).total_bytes / 2**30 > peak_gib
