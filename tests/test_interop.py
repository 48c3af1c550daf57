"""Interop on the CPU: export.py --to hf / llmc, gptcuda.interop.load_init, the formats' bytes and names.

A tiny GPT-2-tokenizer run (2 layers, n_embd 16, vocab 50257 padded to 50304) is trained 2 steps on the
float64 reference backend; its export read back must equal its checkpoint bit for bit after the float32 cast,
and an independent numpy GPT-2 forward in HF's layout (Conv1D: x @ W + b) over the exported safetensors must
give the reference backend's logits."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file  # noqa: E402

from gptcuda.model.checkpoint import load_checkpoint  # noqa: E402
from gptcuda.config import Config, load_config  # noqa: E402
from gptcuda.training.engine import Engine  # noqa: E402
from gptcuda.interop import InteropError, load_init, load_run, read_llmc, write_llmc  # noqa: E402
from gptcuda.model.params import param_table, unflatten  # noqa: E402
from gptcuda.training.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIX))
import make_llmc_tiny  # noqa: E402

TINY = ["--backend=reference", "--n_layer=2", "--n_head=2", "--n_embd=16", "--block_size=8", "--batch_size=2",
        "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--dropout=0.0",
        "--warmup_iters=0", "--lr_decay_iters=2"]


def quiet(*a, **k):
    pass


def train(tmp, name, extra):
    text = tmp / "small.txt"
    if not text.exists():
        text.write_text((ROOT / "data" / "tinyshakespeare" / "input.txt").read_text()[:20000])
    out = tmp / name
    cfg = load_config(None, TINY + [f"--data={text}", f"--out_dir={out}"] + extra)
    Trainer(cfg, log=quiet).train(bar=False)
    return out


def export(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "export.py"), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interop")
    run = train(tmp, "gpt2", ["--tokenizer=gpt2", "--vocab_multiple=128"])
    p = export(run, "--to", "hf", tmp / "hf")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("wrote ") and not p.stderr
    p = export(run, "--to", "llmc", tmp / "model.bin")
    assert p.returncode == 0, p.stderr
    arrays, meta = load_checkpoint(run / "best.ckpt")
    cfg = load_config(run / "config.yaml")
    named = unflatten(param_table(cfg, cfg.vocab_size), arrays["params"])
    return {"run": run, "hf": tmp / "hf", "llmc": tmp / "model.bin", "named": named, "cfg": cfg, "tmp": tmp}


@pytest.fixture(scope="module")
def char_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("interop_char")
    base = ["--tokenizer=char", "--max_iters=0", "--vocab_multiple=8"]
    return {"bias": train(tmp, "char", base), "nobias": train(tmp, "nobias", base + ["--bias=false"]), "tmp": tmp}


# ---------------------------------------------------------------------------------------------- round trips

def test_hf_round_trip_is_exact(gpt2_run):
    cfg = gpt2_run["cfg"]
    assert cfg.vocab_size == 50304
    named, ov = load_init(f"hf:{gpt2_run['hf']}", Config(vocab_multiple=128))
    assert ov == {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8, "bias": True, "vocab_size": 50304,
                  "tokenizer": "gpt2"}
    ref = gpt2_run["named"]
    assert set(named) == set(ref)
    for k, v in ref.items():
        want = v.astype(np.float32)
        got = named[k]
        assert got.dtype == np.float32 and got.shape == want.shape, k
        if k == "wte":                  # HF holds the tokenizer's 50257 rows; the padding comes back zero
            assert np.array_equal(got[:50257], want[:50257])
            assert not got[50257:].any()
        else:
            assert np.array_equal(got, want), k


def test_llmc_round_trip_is_exact(gpt2_run):
    named, ov = load_init(f"llmc:{gpt2_run['llmc']}", Config())       # Vp = 50304 rows, kept
    assert ov["vocab_size"] == 50304 and ov["tokenizer"] == "gpt2" and ov["block_size"] == 8
    for k, v in gpt2_run["named"].items():
        assert np.array_equal(named[k], v.astype(np.float32)), k      # padded wte rows included


def test_llmc_bf16_export(gpt2_run):
    """--to llmc --dtype bf16: llm.c's version 5 file, half the fp32 file's tensor bytes, every tensor the
    checkpoint's fp32 master weights rounded to nearest even (reads back as bf16.round_f32 of them); the
    Hugging Face target refuses --dtype bf16 in one line."""
    from gptcuda.runtime import bf16
    out = gpt2_run["tmp"] / "model_bf16.bin"
    p = export(gpt2_run["run"], "--to", "llmc", out, "--dtype", "bf16")
    assert p.returncode == 0 and "llm.c bf16 model" in p.stdout, p.stderr
    raw, fp32 = out.read_bytes(), gpt2_run["llmc"].read_bytes()
    assert np.frombuffer(raw[:8], "<i4").tolist() == [20240326, 5]
    assert len(raw) - 1024 == (len(fp32) - 1024) // 2
    named, _ = load_init(f"llmc:{out}", Config())
    for k, v in gpt2_run["named"].items():
        want = bf16.round_f32(v.astype(np.float32))
        assert np.array_equal(named[k][:want.shape[0]], want), k
    p = export(gpt2_run["run"], "--to", "hf", gpt2_run["tmp"] / "hf16", "--dtype", "bf16")
    assert p.returncode == 2 and "llm.c files only" in p.stderr and len(p.stderr.splitlines()) == 1
    p = export(gpt2_run["run"], "--to", "llmc", gpt2_run["tmp"] / "x.bin", "--dtype", "fp16")
    assert p.returncode == 2 and "--dtype must be f32 or bf16" in p.stderr


def test_run_dir_init(gpt2_run):
    named, ov = load_init(str(gpt2_run["run"]), Config())
    assert ov["tokenizer"] == "gpt2" and ov["vocab_size"] == 50304
    for k, v in gpt2_run["named"].items():
        assert np.array_equal(named[k], v), k                         # the checkpoint's own precision
    named, ov = load_init(str(gpt2_run["run"] / "last.ckpt"), Config(vocab_size=50400), block_size=4)
    assert named["wte"].shape == (50400, 16) and not named["wte"][50304:].any()
    assert named["wpe"].shape == (4, 16) and ov["block_size"] == 4


def test_llmc_header_and_size(gpt2_run):
    raw = gpt2_run["llmc"].read_bytes()
    h = np.frombuffer(raw[:1024], "<i4")
    assert h[:8].tolist() == [20240326, 3, 8, 50257, 2, 2, 16, 50304] and not h[8:].any()
    C, L, T, Vp = 16, 2, 8, 50304
    n = Vp * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    assert len(raw) == 1024 + 4 * n


def test_safetensors_names_and_shapes_match_gpt2lmheadmodel(gpt2_run):
    want = {}
    for line in (FIX / "gpt2_lmhead_2layer_state_dict.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, *shape = line.split()
            want[name] = tuple(map(int, shape))
    want.pop("lm_head.weight")                       # tied: save_pretrained leaves it out
    t = load_file(str(gpt2_run["hf"] / "model.safetensors"))
    assert {k: v.shape for k, v in t.items()} == want
    assert all(v.dtype == np.float32 for v in t.values())
    from safetensors import safe_open
    with safe_open(str(gpt2_run["hf"] / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}      # transformers refuses an archive without it
    ref = gpt2_run["named"]
    assert np.array_equal(t["transformer.h.1.attn.c_attn.weight"], ref["h1.attn.w"].astype(np.float32).T)
    assert np.array_equal(t["transformer.h.0.mlp.c_proj.weight"], ref["h0.fcproj.w"].astype(np.float32).T)


def test_hf_config_and_tokenizer_files(gpt2_run):
    d = gpt2_run["hf"]
    conf = json.loads((d / "config.json").read_text())
    for k, v in {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257,
                 "n_positions": 8, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_inner": None,
                 "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                 "bos_token_id": 50256, "eos_token_id": 50256, "resid_pdrop": 0.0, "scale_attn_weights": True,
                 }.items():
        assert conf[k] == v, k
    assert (d / "vocab.json").read_bytes() == (ROOT / "data/gpt2/encoder.json").read_bytes()
    assert (d / "merges.txt").read_bytes() == (ROOT / "data/gpt2/vocab.bpe").read_bytes()
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert tc["tokenizer_class"] == "GPT2Tokenizer" and tc["model_max_length"] == 8
    assert tc["eos_token"] == tc["bos_token"] == tc["unk_token"] == "<|endoftext|>"
    assert json.loads((d / "special_tokens_map.json").read_text())["eos_token"] == "<|endoftext|>"
    assert not [p for p in d.parent.iterdir() if p.name.startswith(".hf.")]      # no temp dir left


# ---------------------------------------------------------------------------------------------- logits

def _ln(x, w, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def hf_gpt2_forward(t, conf, idx):
    """GPT2LMHeadModel's forward in numpy float64, written from transformers' modeling_gpt2.py."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    B, T = idx.shape
    H, C = conf["n_head"], conf["n_embd"]
    hs = C // H
    x = t["transformer.wte.weight"][idx] + t["transformer.wpe.weight"][np.arange(T)]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(conf["n_layer"]):
        p = f"transformer.h.{i}."
        a = _ln(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"], conf["layer_norm_epsilon"])
        qkv = a @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]            # Conv1D: x @ W + b
        q, k, v = (z.reshape(B, T, H, hs).transpose(0, 2, 1, 3) for z in np.split(qkv, 3, axis=-1))
        w = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs)
        w = np.where(mask, w, np.finfo(np.float64).min)
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        y = (w @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        a = _ln(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"], conf["layer_norm_epsilon"])
        f = a @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"]
        f = 0.5 * f * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (f + 0.044715 * f ** 3)))   # gelu_new
        x = x + f @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    x = _ln(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], conf["layer_norm_epsilon"])
    return x @ t["transformer.wte.weight"].T                                          # tied lm_head


def test_logits_equal_hf_forward(gpt2_run):
    d = gpt2_run["hf"]
    named, ov = load_init(f"hf:{d}", Config(vocab_multiple=128))
    B = 3
    cfg = load_config(None, ["--backend=reference", "--dropout=0.0", f"--batch_size={B}", "--tokenizer=gpt2"]
                      + [f"--{k}={v}" for k, v in ov.items() if k != "tokenizer"])
    dummy = np.zeros(cfg.block_size + 1, np.int32)
    eng = Engine(cfg, dummy, dummy, ov["vocab_size"], programs=("forward",), n_vocab=50257)
    eng.set_params(named)
    x = np.random.default_rng(0).integers(0, 50257, (B, cfg.block_size))
    eng.set_batch(x, x)
    eng.run("forward")
    ours = eng.be.download(eng.bufs.acts["logits"]).reshape(B, cfg.block_size, -1)[:, :, :50257]
    ref = hf_gpt2_forward(load_file(str(d / "model.safetensors")), json.loads((d / "config.json").read_text()), x)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= 1e-12, err


# ---------------------------------------------------------------------------------------------- llm.c fixture

def _fixture_named():
    """The fixture's tensors in our names, from make_llmc_tiny's value rule and llm.c's tensor numbering."""
    f = make_llmc_tiny
    C, L = f.C, f.L
    k_of = {"ln1.w": 2, "ln1.b": 3, "attn.w": 4, "attn.b": 5, "proj.w": 6, "proj.b": 7, "ln2.w": 8, "ln2.b": 9,
            "fc.w": 10, "fc.b": 11, "fcproj.w": 12, "fcproj.b": 13}
    shape = {"ln1.w": (C,), "ln1.b": (C,), "attn.w": (3 * C, C), "attn.b": (3 * C,), "proj.w": (C, C),
             "proj.b": (C,), "ln2.w": (C,), "ln2.b": (C,), "fc.w": (4 * C, C), "fc.b": (4 * C,),
             "fcproj.w": (C, 4 * C), "fcproj.b": (C,)}

    def fill(k, l, s):
        n = int(np.prod(s))
        return np.array([f.value(k, l, j) for j in range(n)], np.float32).reshape(s)

    named = {"wte": fill(0, 0, (f.V_MODEL, C)), "wpe": fill(1, 0, (f.maxT, C)),
             "lnf.w": fill(14, 0, (C,)), "lnf.b": fill(15, 0, (C,))}
    for l in range(L):
        for n, k in k_of.items():
            named[f"h{l}.{n}"] = fill(k, l, shape[n])
    return named


def test_llmc_bytes_match_fixture(tmp_path):
    f = make_llmc_tiny
    fixture = (FIX / "llmc_tiny.bin").read_bytes()
    assert fixture == f.build()
    cfg = Config(n_layer=f.L, n_head=f.H, n_embd=f.C, block_size=f.maxT)
    out = tmp_path / "tiny.bin"
    write_llmc(str(out), _fixture_named(), cfg, n_vocab=f.V)
    assert out.read_bytes() == fixture


def test_llmc_fixture_reads_back(tmp_path):
    f = make_llmc_tiny
    named, ov = load_init(f"llmc:{FIX / 'llmc_tiny.bin'}", Config(vocab_multiple=8))
    assert ov == {"n_layer": 2, "n_head": 1, "n_embd": 4, "block_size": 3, "bias": True, "vocab_size": 128}
    want = _fixture_named()
    for k, v in want.items():
        got = named[k][:f.V_MODEL] if k == "wte" else named[k]
        assert np.array_equal(got, v), k
    assert not named["wte"][f.V_MODEL:].any()
    named, ov = load_init(f"llmc:{FIX / 'llmc_tiny.bin'}", Config(vocab_size=8))   # llm.c's padding dropped
    assert named["wte"].shape == (8, 4) and np.array_equal(named["wte"], want["wte"])
    # bf16 (llm.c's version 5): each float's top 16 bits
    hdr, t = read_llmc(str(FIX / "llmc_tiny.bin"))
    raw = (FIX / "llmc_tiny.bin").read_bytes()
    h = np.frombuffer(raw[:1024], "<i4").copy()
    h[1] = 5
    top = (np.frombuffer(raw[1024:], "<u4") >> 16).astype("<u2")
    p = tmp_path / "bf16.bin"
    p.write_bytes(h.tobytes() + top.tobytes())
    _, t16 = read_llmc(str(p))
    for k in t:
        assert np.array_equal(t16[k], (t[k].view(np.uint32) & 0xFFFF0000).view(np.float32)), k


def test_llmc_refuses_bad_files(tmp_path):
    raw = (FIX / "llmc_tiny.bin").read_bytes()
    p = tmp_path / "cut.bin"
    p.write_bytes(raw[:-4])
    with pytest.raises(InteropError, match=r"has 5100 bytes but its header .* implies 5104"):
        load_init(f"llmc:{p}", Config())
    p.write_bytes(b"\0" * 1024)
    with pytest.raises(InteropError, match="not an llm.c model file"):
        load_init(f"llmc:{p}", Config())


# ---------------------------------------------------------------------------------------------- refusals

def test_refusals_exit_2_with_one_line(char_runs):
    tmp = char_runs["tmp"]
    for run, to, dest, what in [(char_runs["nobias"], "hf", tmp / "a", "bias is false"),
                                (char_runs["nobias"], "llmc", tmp / "a.bin", "bias is false"),
                                (char_runs["bias"], "hf", tmp / "b", "tokenizer is char")]:
        p = export(run, "--to", to, dest)
        assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and what in lines[0], p.stderr
        assert not os.path.exists(dest)
    p = export("--help")
    assert p.returncode == 0 and "--to hf DIR" in p.stdout
    p = export(char_runs["bias"], "--to", "onnx", tmp / "c")
    assert p.returncode == 2 and "--to must be hf or llmc" in p.stderr


def test_char_run_round_trips_through_llmc(char_runs):
    run = char_runs["bias"]
    dest = char_runs["tmp"] / "char.bin"
    p = export(run, "--to", "llmc", dest, "--ckpt", "last")
    assert p.returncode == 0, p.stderr
    r = load_run(str(run))
    V = r.vocab_size                                     # the char vocabulary rounded up to 8
    h = np.frombuffer(dest.read_bytes()[:32], "<i4")
    assert h.tolist() == [20240326, 3, 8, r.n_vocab, 2, 2, 16, 128]
    named, ov = load_init(f"llmc:{dest}", Config(vocab_size=V))
    assert "tokenizer" not in ov                          # not GPT-2's vocabulary: the caller's tokenizer
    for k, v in r.named.items():
        assert np.array_equal(named[k], v.astype(np.float32)), k


def test_overwrite(char_runs, gpt2_run):
    run, tmp = gpt2_run["run"], char_runs["tmp"]
    d = tmp / "exists"
    d.mkdir()
    (d / "keep").write_text("x")
    p = export(run, "--to", "hf", d)
    assert p.returncode == 2 and "not empty" in p.stderr and (d / "keep").exists()
    p = export(run, "--to", "hf", d, "--overwrite")
    assert p.returncode == 0 and not (d / "keep").exists() and (d / "model.safetensors").exists()
    assert sorted(x.name for x in tmp.iterdir() if x.name.startswith(".exists")) == []


# ---------------------------------------------------------------------------------------------- import checks

def _hf_copy(src, dst, conf_edit=None, tensor_edit=None):
    dst.mkdir()
    conf = json.loads((src / "config.json").read_text())
    if conf_edit:
        conf_edit(conf)
    (dst / "config.json").write_text(json.dumps(conf))
    t = dict(load_file(str(src / "model.safetensors")))
    if tensor_edit:
        tensor_edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return f"hf:{dst}"


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(activation_function="relu"), "activation_function is 'relu'"),
    (lambda c: c.update(layer_norm_epsilon=1e-6), "layer_norm_epsilon is 1e-06"),
    (lambda c: c.update(n_inner=48), "n_inner is 48"),
    (lambda c: c.update(scale_attn_weights=False), "scale_attn_weights is false"),
    (lambda c: c.update(model_type="gpt_neo"), "model_type is 'gpt_neo'"),
    (lambda c: c.update(n_embd=32), r"transformer.wte.weight has shape \(50257, 16\) but config.json implies "
                                    r"\(50257, 32\)"),
])
def test_hf_config_refusals(gpt2_run, tmp_path, edit, match):
    spec = _hf_copy(gpt2_run["hf"], tmp_path / "m", conf_edit=edit)
    with pytest.raises(InteropError, match=match) as e:
        load_init(spec, Config())
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), r"tensor transformer.h.1.mlp.c_fc.bias of shape \(64,\) "
                                                       r"is missing"),
    (lambda t: t.update({"transformer.h.0.attn.c_attn.weight": np.zeros((48, 16), np.float32)}),
     r"tensor transformer.h.0.attn.c_attn.weight has shape \(48, 16\) but config.json implies \(16, 48\)"),
    (lambda t: t.update({"transformer.h.2.ln_1.weight": np.zeros(16, np.float32)}),
     r"tensor transformer.h.2.ln_1.weight of shape \(16,\) is not part of a GPT-2"),
    (lambda t: t.update({"lm_head.weight": t["transformer.wte.weight"] + 1}), "differs from transformer.wte.weight"),
])
def test_hf_tensor_refusals(gpt2_run, tmp_path, edit, match):
    spec = _hf_copy(gpt2_run["hf"], tmp_path / "m", tensor_edit=edit)
    with pytest.raises(InteropError, match=match):
        load_init(spec, Config())


def test_hf_accepts_old_names_and_mask_buffers(gpt2_run, tmp_path):
    """GPT2Model's names (no "transformer.") with the mask buffers old versions saved, and an untied-looking
    but equal lm_head.weight, as in the hub's gpt2 checkpoint."""
    def edit(t):
        for k in list(t):
            t[k[len("transformer."):]] = t.pop(k)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
        t["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)
        t["lm_head.weight"] = t["wte.weight"].copy()
    spec = _hf_copy(gpt2_run["hf"], tmp_path / "m", tensor_edit=edit)
    named, _ = load_init(spec, Config(vocab_multiple=128))
    assert np.array_equal(named["h0.attn.w"], gpt2_run["named"]["h0.attn.w"].astype(np.float32))


def test_import_config_mismatch_is_one_line(gpt2_run):
    with pytest.raises(InteropError, match="vocab_size 1000 is smaller than the weights' vocabulary 50257"):
        load_init(f"hf:{gpt2_run['hf']}", Config(vocab_size=1000))
    with pytest.raises(InteropError, match=r"block_size 9 must be in 1..8"):
        load_init(f"llmc:{gpt2_run['llmc']}", Config(), block_size=9)
