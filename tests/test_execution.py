"""The execution plan (gptcuda/runtime/execution.py): its rules, that train.py --plan prints it without a GPU
and a run saves it, and that the recorded step follows it (no kernel outside what it allows)."""
import json

import numpy as np
import pytest

import train
from gptcuda.runtime import execution
from gptcuda.config import load_config


def cfg_of(*over):
    return load_config("configs/tiny.yaml", list(over))


@pytest.mark.parametrize("precision,fp32_gemm,arch,env,family,wgmma,three", [
    ("tf32", "3xtf32", "sm_90", {}, "tf32", True, False),
    ("fp32", "3xtf32", "sm_90", {}, "simt", True, True),
    ("fp32", "ffma", "sm_90", {}, "simt", True, False),
    ("fp32", "3xtf32", "sm_80", {}, "simt", False, False),
    ("tf32", "3xtf32", "sm_90", {"GPTCUDA_WGMMA": "0"}, "tf32", False, False),
])
def test_rules(precision, fp32_gemm, arch, env, family, wgmma, three):
    p = execution.resolve(cfg_of(f"--precision={precision}", f"--fp32_gemm={fp32_gemm}"), arch=arch, env=env)
    assert (p.gemm_family, p.wgmma, p.fp32_as_3xtf32) == (family, wgmma, three)
    assert p.env == tuple(env.items())
    assert p.gemm_table and not execution.resolve(cfg_of(), env={"GPTCUDA_GEMM_TUNE": "0"}).gemm_table


def test_attention_paths_and_precision_switch():
    assert execution.resolve(cfg_of("--attention=unfused")).attention == "unfused"
    assert execution.resolve(cfg_of("--attention=fused")).attention == "flash_3x"       # fp32_gemm 3xtf32, sm_90
    assert execution.resolve(cfg_of("--attention=fused", "--fp32_gemm=ffma")).attention == "flash"
    assert execution.resolve(cfg_of("--attention=fused"), arch="sm_80").attention == "flash"
    p = execution.resolve(cfg_of("--attention=fused", "--precision=tf32"))
    assert p.attention == "flash_tc" and p.with_precision("fp32").attention == "flash_3x"
    assert "3xTF32 (flash_x3.cu)" in p.with_precision("fp32").format()
    assert execution.resolve(cfg_of("--backend=reference")).format().startswith("execution plan\n  reference")


def test_plan_flag_prints_it(capsys):
    assert train.main(["configs/tiny.yaml", "--plan", "--precision=tf32", "--attention=fused"]) == 0
    out = capsys.readouterr().out
    assert "execution plan" in out and "TF32 mma.sync" in out and "flash on tensor cores" in out


def test_plan_without_the_data_where_the_config_fixes_the_vocabulary(tmp_path, capsys):
    """--plan before the shards are downloaded: a gpt2 (or bpe:N, or vocab_size) config still gets
    its plan, the data line says what was not read; a char config needs its text and says so."""
    missing = str(tmp_path / "nowhere_*.bin")
    assert train.main(["configs/gpt2_124m.yaml", "--plan", f"--data={missing}", "--val_data="]) == 0
    out = capsys.readouterr().out
    assert "data: not read (no files match" in out and "gpt2 tokenizer's 50257 tokens" in out
    assert "logits                       [16, 1024, 50304]" in out and "[32, 16, 1024]" in out   # 32 micro-batches
    assert train.main(["configs/tiny.yaml", "--plan", "--tokenizer=bpe:300", f"--data={tmp_path / 'x.txt'}"]) == 0
    assert "bpe:300 tokenizer's 300 tokens" in capsys.readouterr().out
    assert train.main(["configs/tiny.yaml", "--plan", "--vocab_size=96", f"--data={tmp_path / 'x.txt'}"]) == 0
    assert "the plan takes vocab_size 96" in capsys.readouterr().out
    assert train.main(["configs/tiny.yaml", "--plan", f"--data={tmp_path / 'x.txt'}"]) == 2
    assert "data file not found" in capsys.readouterr().err


def test_run_saves_it(tmp_path):
    out = tmp_path / "run"
    assert train.main(["configs/tiny.yaml", "--backend=reference", "--max_iters=1", "--eval_interval=1",
                       "--eval_iters=1", f"--out_dir={out}", "--no-bar"]) == 0
    assert json.loads((out / "execution.json").read_text())["arch"] == "cpu"


@pytest.mark.parametrize("fp32_gemm,env,wgmma_kernels", [("3xtf32", "1", True), ("ffma", "1", False),
                                                          ("3xtf32", "0", False)])
def test_recorded_step_follows_the_plan(fp32_gemm, env, wgmma_kernels, monkeypatch):
    """fp32: the warpgroup-MMA kernels run (as 3xTF32) only where the plan allows them."""
    from tests.fakes import RecordingRuntime
    from gptcuda.ops.cuda_backend import CudaBackend
    from gptcuda.training.engine import Engine
    from gptcuda.runtime import Launch
    monkeypatch.setenv("GPTCUDA_WGMMA", env)
    cfg = cfg_of("--precision=fp32", f"--fp32_gemm={fp32_gemm}")
    be = CudaBackend(cfg, rt=RecordingRuntime(cfg))
    toks = np.arange(1000, dtype=np.int32) % 65
    eng = Engine(cfg, toks, toks[:200], 65, backend=be, programs=("train",))
    files = {r.fn.file for r in eng.programs["train"].items if isinstance(r, Launch)}
    assert ("gemm_wgmma.cu" in files) == wgmma_kernels
    assert eng.exec.fp32_as_3xtf32 == wgmma_kernels


@pytest.mark.parametrize("attention", [None, "fused"])
def test_derived_decisions(attention):
    """What the plan derives: the warpgroup-MMA mode and scratch, the dK / dV kernel (a runtime's plan
    without an attention path too: where its precision's fused path is flash_tc), the table's tag."""
    def plan(precision, arch="sm_90", wgmma="1", fp32_gemm="3xtf32"):
        return execution.resolve(arch=arch, precision=precision, attention=attention, fp32_gemm=fp32_gemm,
                                 env={"GPTCUDA_WGMMA": wgmma})
    assert (plan("tf32").wgmma_mode, plan("fp32").wgmma_mode) == ("tf32", "3xtf32")
    assert plan("fp32", fp32_gemm="ffma").wgmma_mode is None and plan("tf32", wgmma="0").wgmma_mode is None
    assert plan("tf32", arch="sm_80").wgmma_scratch                     # planned without the GPU, as --plan
    assert not plan("fp32", fp32_gemm="ffma").wgmma_scratch and not plan("fp32").wgmma_scratch
    assert plan("tf32").dkv_on_wgmma(64) and plan("tf32").dkv_on_wgmma(32) and not plan("tf32").dkv_on_wgmma(128)
    assert not plan("tf32", wgmma="0").dkv_on_wgmma(64) and not plan("fp32").dkv_on_wgmma(64)
    assert plan("tf32").fused_path() == "flash_tc" and plan("fp32").fused_path() == "flash_3x"
    assert not execution.resolve(arch="sm_90", precision="tf32", attention="unfused", env={}).dkv_on_wgmma(64)
    assert plan("fp32", fp32_gemm="ffma").fused_path() == "flash" and plan("tf32").table_tag == "tf32"


def test_precision_round_trip_keeps_fp32_gemm():
    p = execution.resolve(cfg_of("--precision=fp32", "--fp32_gemm=ffma"))
    assert p.with_precision("tf32").with_precision("fp32") == p and not p.fp32_as_3xtf32


@pytest.mark.parametrize("precision,fp32_gemm,env,suffix", [("fp32", "3xtf32", "1", "_x3"), ("fp32", "ffma", "1", ""),
                                                            ("fp32", "3xtf32", "0", ""), ("tf32", "3xtf32", "1", "_tc")])
def test_recorded_fused_attention_follows_the_plan(precision, fp32_gemm, env, suffix, monkeypatch):
    """attention: fused runs the kernels of the plan's path: fp32 as 3xTF32 (flash_*_x3) where its GEMMs
    are 3xTF32, the FFMA kernels otherwise, tf32 the _tc kernels (dK/dV: _wg at head size 32)."""
    from tests.fakes import RecordingRuntime
    from gptcuda.ops.cuda_backend import CudaBackend
    from gptcuda.training.engine import Engine
    from gptcuda.runtime import Launch
    monkeypatch.setenv("GPTCUDA_WGMMA", env)
    cfg = cfg_of(f"--precision={precision}", f"--fp32_gemm={fp32_gemm}", "--attention=fused", "--dropout=0.1")
    be = CudaBackend(cfg, rt=RecordingRuntime(cfg))
    toks = np.arange(1000, dtype=np.int32) % 65
    eng = Engine(cfg, toks, toks[:200], 65, backend=be, programs=("train",))
    names = {r.fn.name.split("<")[0] for r in eng.programs["train"].items
             if isinstance(r, Launch) and r.fn.file.startswith("flash_")}
    dkv = "flash_bwd_dkv_wg" if suffix == "_tc" else f"flash_bwd_dkv{suffix}"
    assert names == {f"flash_fwd{suffix}", f"flash_bwd_dq{suffix}", dkv, "flash_rowsum_do"}
    assert eng.exec.attention == {"_x3": "flash_3x", "": "flash", "_tc": "flash_tc"}[suffix]


def test_bf16_plan_and_config_rules():
    """precision bf16: bf16 activations on the bf16 GEMM family, fused attention on fp32 copies (flash_tc),
    the GEMM table measured as for tf32 (gemm_tune auto stays auto), MFU over the dense BF16 peak;
    refused without the warpgroup-MMA kernels, with unfused attention, or widths that are not 16-byte
    bf16 rows, each in one line."""
    from gptcuda.config import ConfigError
    p = execution.resolve(cfg_of("--precision=bf16", "--attention=fused", "--vocab_multiple=8"), env={})
    assert (p.gemm_family, p.act_dtype, p.attention, p.gemm_tune, p.peak_tflops) == \
        ("bf16", "bf16", "flash_tc", "auto", execution.PEAK_TFLOPS["bf16"])
    assert execution.resolve(cfg_of("--precision=tf32")).act_dtype == "f32"
    assert "BF16 warpgroup MMA" in p.format() and "fp32 copies" in p.format()
    with pytest.raises(ValueError, match="sm_90"):
        execution.resolve(cfg_of("--precision=bf16", "--attention=fused", "--vocab_multiple=8"), arch="sm_80")
    for over, key in ((["--attention=unfused", "--vocab_multiple=8"], "attention"),
                      (["--attention=fused", "--vocab_multiple=8", "--n_embd=68", "--n_head=1"], "n_embd"),
                      (["--attention=fused"], "vocab_multiple")):
        with pytest.raises(ConfigError, match=key):
            cfg_of("--precision=bf16", *over)


def test_grad_dtype_rules():
    """grad_dtype bf16 gives bf16 gradients at precision bf16 only (another precision keeps fp32 ones: a bf16
    run sampled or evaluated --precision=fp32 just works); the plan and its summary say which; an unknown value
    is one line naming the key; a runtime's plan asked for bf16 gradients at another precision is refused."""
    from gptcuda.config import ConfigError
    bf = ("--precision=bf16", "--attention=fused", "--vocab_multiple=8")
    p = execution.resolve(cfg_of(*bf, "--grad_dtype=bf16"), env={})
    assert p.grads_bf16 and p.grad_dtype == "bf16" and "bf16 gradients" in p.format()
    assert p.to_dict()["grad_dtype"] == "bf16"
    q = execution.resolve(cfg_of(*bf), env={})
    assert not q.grads_bf16 and "fp32 gradients" in q.format()
    for prec in ("tf32", "fp32"):
        assert execution.resolve(cfg_of(f"--precision={prec}", "--grad_dtype=bf16"), env={}).grad_dtype == "f32"
    assert execution.resolve(cfg_of(*bf, "--grad_dtype=bf16"), env={}, precision="tf32").grad_dtype == "f32"
    with pytest.raises(ConfigError, match="grad_dtype.*fp32|bf16"):
        cfg_of("--grad_dtype=fp16")
    with pytest.raises(ValueError, match="grad_dtype 'bf16'"):
        execution.resolve(precision="tf32", grad_dtype="bf16", env={})


def test_bf16_attention_path_by_head_size():
    """precision bf16 at head sizes 64 and 128 runs flash_bf16 with no fp32 copies of the attention's
    tensors in the memory plan; at other head sizes the tf32 kernels on copies (attention_f32)."""
    from gptcuda.ops.cuda import attention as attn
    for C, H, path in ((768, 12, "flash_bf16"), (256, 2, "flash_bf16"), (64, 2, "flash_tc"), (384, 4, "flash_tc")):
        cfg = cfg_of("--precision=bf16", "--attention=fused", "--vocab_multiple=8", f"--n_embd={C}", f"--n_head={H}")
        ex = execution.resolve(cfg, arch="sm_90")
        assert ex.attention == path and ex.fused_path() == path
        assert (attn.F32_COPIES in attn.workspace(cfg, ex)) == (path == "flash_tc")
        assert not ex.dkv_on_wgmma(C // H) or path == "flash_tc"
    assert "flash_bf16.cu" in execution.resolve(cfg_of("--precision=bf16", "--attention=fused", "--vocab_multiple=8",
                                                       "--n_embd=128", "--n_head=2")).format()
