import glob
import os
import re

import pytest
import yaml

from gptcuda.config import Config, ConfigError, format_config, load_config, save_config, validate_against_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def one_line(e):
    s = str(e.value)
    assert "\n" not in s
    return s


def test_defaults_are_nanogpt_shakespeare_char():
    c = load_config(None, [])
    assert (c.n_layer, c.n_head, c.n_embd, c.block_size) == (6, 6, 384, 256)
    assert c.dropout == 0.2 and c.bias is True and c.vocab_size == 0
    assert (c.precision, c.attention, c.backend, c.graph, c.device) == ("fp32", "unfused", "cuda", True, 0)
    assert (c.batch_size, c.max_iters, c.learning_rate, c.min_lr) == (64, 5000, 1e-3, 1e-4)
    assert (c.warmup_iters, c.lr_decay_iters, c.weight_decay) == (100, 5000, 0.1)
    assert (c.beta1, c.beta2, c.eps, c.grad_clip) == (0.9, 0.99, 1e-8, 1.0)
    assert (c.eval_interval, c.eval_iters, c.log_interval, c.seed, c.init_std) == (250, 200, 10, 1337, 0.02)
    assert c.data == "data/tinyshakespeare/input.txt" and c.out_dir == "out/shakespeare_char"
    assert c.checkpoint is True
    assert c == Config()


def test_yaml_then_overrides(tmp_path):
    p = write(tmp_path, "n_layer: 2\nlearning_rate: 3e-3\nmin_lr: 1.0e-4\ngraph: false\nout_dir: out/x\n")
    c = load_config(p, ["--n_layer=3", "max_iters=7", "--out_dir=out/y"])
    assert c.n_layer == 3 and c.max_iters == 7 and c.out_dir == "out/y"
    assert c.learning_rate == 3e-3 and isinstance(c.learning_rate, float)
    assert c.graph is False


def test_int_accepted_for_float(tmp_path):
    c = load_config(write(tmp_path, "weight_decay: 0\ngrad_clip: 2\n"), ["--learning_rate=1", "--min_lr=0"])
    assert c.weight_decay == 0.0 and isinstance(c.weight_decay, float)
    assert c.grad_clip == 2.0 and isinstance(c.grad_clip, float)
    assert c.learning_rate == 1.0 and isinstance(c.learning_rate, float)


def test_exponent_floats_without_dot():
    c = load_config(None, ["--eps=1e-6", "--learning_rate=2E-3", "--min_lr=1e-5"])
    assert c.eps == 1e-6 and c.learning_rate == 2e-3 and c.min_lr == 1e-5


def test_empty_yaml_is_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n"), []) == Config()


@pytest.mark.parametrize("source", ["yaml", "override"])
def test_unknown_key_named_with_suggestion(tmp_path, source):
    if source == "yaml":
        args = (write(tmp_path, "lerning_rate: 0.01\n"), [])
    else:
        args = (None, ["--lerning_rate=0.01"])
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    s = one_line(e)
    assert "lerning_rate" in s and "did you mean 'learning_rate'" in s
    assert e.value.key == "lerning_rate"


def test_unknown_key_without_close_match():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--zzzzzz=1"])
    assert "zzzzzz" in one_line(e) and "did you mean" not in str(e.value)


@pytest.mark.parametrize("override,key", [
    ("--n_layer=2.5", "n_layer"),
    ("--n_layer=abc", "n_layer"),
    ("--n_layer=true", "n_layer"),
    ("--learning_rate=fast", "learning_rate"),
    ("--learning_rate=true", "learning_rate"),
    ("--graph=1", "graph"),
    ("--graph=yes", "graph"),
    ("--bias=on", "bias"),
    ("--precision=32", "precision"),
    ("--out_dir=5", "out_dir"),
    ("--max_iters=", "max_iters"),
    ("--dropout=[0.1]", "dropout"),
    ("--eps=.nan", "eps"),
    ("--recompute=2.0", "recompute"),
    ("--recompute=yes", "recompute"),
    ("--recompute=", "recompute"),
])
def test_bad_type(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert key in one_line(e)
    assert e.value.key == key


def test_bad_type_in_yaml(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "batch_size: '64'\n"), [])
    assert "batch_size" in one_line(e)


def test_bool_from_true_false_only(tmp_path):
    c = load_config(write(tmp_path, "bias: false\ncheckpoint: False\n"), ["--graph=FALSE"])
    assert c.bias is False and c.checkpoint is False and c.graph is False
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "bias: no\n"), [])


def test_recompute_takes_a_switch_or_a_count(tmp_path):
    """recompute: true (every layer), false (none) or how many layers, the first ones, rebuild the GELU
    output; the value is kept as written (a saved config reads back the same)."""
    from gptcuda.config import recompute_layers
    for text, value, n in (("true", True, 6), ("false", False, 0), ("0", 0, 0), ("4", 4, 4), ("6", 6, 6)):
        c = load_config(write(tmp_path, f"recompute: {text}\n"), [])
        assert c.recompute == value and type(c.recompute) is type(value) and recompute_layers(c) == n
    assert recompute_layers(load_config(None, ["--recompute=3", "--n_layer=3"])) == 3


def test_resume_compare_tells_recompute_true_from_one():
    """A checkpoint's recompute true (every layer) against an override of 1 (the first layer) is a change."""
    from gptcuda.config import compare_for_resume
    cfg = load_config(None, ["--recompute=1"])
    saved = {**cfg.to_dict(), "vocab_size": 65}
    assert compare_for_resume({**saved, "recompute": True}, cfg, 65) == ([], ["recompute True -> 1"])
    assert compare_for_resume({**saved, "recompute": 1}, cfg, 65) == ([], [])


def test_override_without_equals():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--max_iters"])
    assert "max_iters" in one_line(e)


def test_hyphenated_override_key():
    assert load_config(None, ["--max-iters=3"]).max_iters == 3


@pytest.mark.parametrize("overrides,key", [
    (["--n_head=5"], "n_embd"),  # 384 % 5
    (["--n_embd=36", "--n_head=6"], "n_embd"),  # head size 6, not a multiple of 4
    (["--n_layer=0"], "n_layer"),
    (["--n_head=0"], "n_head"),
    (["--block_size=0"], "block_size"),
    (["--batch_size=-1"], "batch_size"),
    (["--max_iters=-1"], "max_iters"),
    (["--eval_iters=0"], "eval_iters"),
    (["--eval_interval=0"], "eval_interval"),
    (["--log_interval=0"], "log_interval"),
    (["--dropout=1.0"], "dropout"),
    (["--dropout=-0.1"], "dropout"),
    (["--precision=fp16"], "precision"),
    (["--attention=flash"], "attention"),
    (["--fp32_gemm=tf32x3"], "fp32_gemm"),
    (["--backend=cpu"], "backend"),
    (["--learning_rate=1e-5"], "learning_rate"),  # below min_lr
    (["--min_lr=-1", "--learning_rate=0"], "min_lr"),
    (["--warmup_iters=6000"], "warmup_iters"),
    (["--beta1=1"], "beta1"),
    (["--beta2=-0.5"], "beta2"),
    (["--eps=0"], "eps"),
    (["--weight_decay=-0.1"], "weight_decay"),
    (["--grad_clip=-1"], "grad_clip"),
    (["--recompute=7"], "recompute"),       # more than n_layer (6)
    (["--recompute=-1"], "recompute"),
])
def test_bad_values(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in one_line(e)
    assert e.value.key == key


def test_valid_edge_values():
    c = load_config(None, ["--max_iters=0", "--dropout=0", "--grad_clip=0", "--learning_rate=1e-4",
                           "--warmup_iters=5000", "--n_head=1", "--n_embd=4"])
    assert c.max_iters == 0 and c.grad_clip == 0.0 and c.n_embd == 4


def test_yaml_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "- 1\n- 2\n"), [])
    assert "mapping" in one_line(e)


def test_yaml_duplicate_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "n_layer: 2\nn_layer: 3\n"), [])
    assert "n_layer" in one_line(e)


def test_yaml_syntax_error_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "n_layer: [1, 2\nn_head: 3\n"), [])
    assert "c.yaml" in one_line(e)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "nope.yaml"), [])
    assert "nope.yaml" in one_line(e)


def test_round_trip_save_config(tmp_path):
    c = load_config(None, ["--n_layer=3", "--eps=1e-7", "--graph=false", "--out_dir=out/ü x",
                           "--learning_rate=6e-4", "--min_lr=6e-5", "--data=123.txt"])
    c.data, c.backend = "1e3", "reference"
    c.out_dir = "yes"
    p = tmp_path / "sub" / "config.yaml"
    save_config(c, p)
    assert os.listdir(p.parent) == ["config.yaml"]  # no temporary file left
    assert load_config(str(p), []) == c
    assert yaml.safe_load(p.read_text())["n_layer"] == 3
    assert c.to_dict()["eps"] == 1e-7


def test_format_config_aligned():
    s = format_config(Config())
    lines = s.splitlines()
    assert len(lines) == len(Config().to_dict())
    cols = {len(re.match(r"^\S+:\s+", line).group(0)) for line in lines}
    assert len(cols) == 1  # values start in one column
    assert any(line.startswith("learning_rate:") for line in lines)


def test_validate_against_data():
    c = load_config(None, ["--block_size=16"])
    validate_against_data(c, 100, 17, 65)
    with pytest.raises(ConfigError) as e:
        validate_against_data(c, 100, 16, 65)
    assert e.value.key == "block_size" and "block_size" in one_line(e)
    with pytest.raises(ConfigError) as e:
        validate_against_data(c, 16, 100, 65)
    assert e.value.key == "block_size"
    c = load_config(None, ["--vocab_size=50"])
    with pytest.raises(ConfigError) as e:
        validate_against_data(c, 10**6, 10**5, 65)
    assert e.value.key == "vocab_size" and "vocab_size" in one_line(e)
    validate_against_data(load_config(None, ["--vocab_size=128"]), 10**6, 10**5, 65)


def test_shipped_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"shakespeare_char_fp32.yaml", "tiny.yaml", "ctx256_fp32.yaml", "ctx256_tf32.yaml",
            "ctx1024_tf32.yaml", "ctx2048_tf32.yaml", "ctx8192_tf32.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_shipped_config_loads(path):
    c = load_config(path, [])
    with open(path) as f:
        assert f.readline().startswith("#")
    # every long-context config fits the tiny shakespeare val split (111540 chars)
    validate_against_data(c, 1003854, 111540, 65)
    name = os.path.basename(path)[:-5]
    if name.startswith("ctx"):
        assert c.attention == "fused"
        assert c.precision == name.split("_")[1]
        assert c.block_size == int(name[3:].split("_")[0])
    if name.startswith("ctx") and c.block_size >= 1024:
        assert (c.batch_size, c.max_iters, c.lr_decay_iters, c.eval_iters) == (16, 2000, 2000, 20)
        assert c.out_dir == f"out/{name}"


def test_shakespeare_and_tiny_recipes():
    s = load_config(os.path.join(ROOT, "configs", "shakespeare_char_fp32.yaml"), [])
    assert s == Config(out_dir="out/shakespeare_char_fp32")
    t = load_config(os.path.join(ROOT, "configs", "tiny.yaml"), [])
    assert (t.n_layer, t.n_head, t.n_embd, t.block_size, t.batch_size, t.max_iters) == (2, 2, 64, 16, 4, 20)
    assert (t.eval_interval, t.eval_iters, t.log_interval, t.dropout) == (10, 2, 1, 0.0)
    assert (t.warmup_iters, t.lr_decay_iters, t.learning_rate, t.min_lr) == (2, 20, 3e-3, 3e-4)
    assert t.out_dir == "out/tiny"
