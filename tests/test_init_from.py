"""train.py --init_from (fine-tuning: weights in, fresh optimizer) and sample.py --init_from, on the
reference backend: the weights arrive exactly, the model settings follow them, a resumed fine-tune
continues, and bad sources are one line with exit code 2."""
import numpy as np
import pytest

import sample
import train
from gptcuda.model.checkpoint import load_checkpoint, read_checkpoint_meta

from test_faults import args as fault_args, data  # noqa: F401  (data: the module's text fixture)


def args(data, out, *extra):
    return fault_args(data, out, "--max_iters=2", "--eval_interval=2", "--dropout=0.0", *extra)


@pytest.fixture(scope="module")
def source(tmp_path_factory, data):
    out = str(tmp_path_factory.mktemp("src") / "run")
    assert train.main(args(data, out)) == 0
    return out


def test_weights_arrive_and_settings_follow(source, data, tmp_path, capsys):
    """learning rate 0: the fine-tune's checkpoint holds the source's parameters exactly; n_layer comes
    from the weights (the config says 3); the step count starts afresh."""
    out = str(tmp_path / "ft")
    assert train.main(args(data, out, f"--init_from={source}", "--n_layer=3", "--learning_rate=0",
                           "--min_lr=0", "--max_iters=1")) == 0
    log = capsys.readouterr().out
    assert f"init_from {source} sets n_layer 3 -> 2" in log and f"initialised from {source}" in log
    src, _ = load_checkpoint(f"{source}/last.ckpt")
    ft, meta = load_checkpoint(f"{out}/last.ckpt")
    assert np.array_equal(src["params"], ft["params"])
    assert meta["config"]["n_layer"] == 2 and meta["config"]["init_from"] == source
    assert meta["step"] == 1                                    # a new run: its own step count


def test_finetune_resumes(source, data, tmp_path):
    out = str(tmp_path / "ft")
    assert train.main(args(data, out, f"--init_from={source}", "--max_iters=2")) == 0
    assert train.main(args(data, out, f"--init_from={source}", "--max_iters=4", "--resume")) == 0
    assert read_checkpoint_meta(f"{out}/last.ckpt")["step"] == 4


@pytest.mark.parametrize("spec,extra,msg", [
    ("hf:{tmp}/nothing", (), "no config.json"),
    ("llmc:{tmp}/missing.bin", (), "missing.bin"),
    ("{src}", ("--block_size=64",), "block_size 64"),
])
def test_bad_sources(source, data, tmp_path, capsys, spec, extra, msg):
    out = tmp_path / "ft"
    spec = spec.format(tmp=tmp_path, src=source)
    assert train.main(args(data, str(out), f"--init_from={spec}", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
    assert not out.exists()


def test_sample_from_weights(source, capsys):
    assert sample.main(["--init_from", source, "--backend", "reference", "--max_new_tokens", "8",
                        "--prompt", "ROMEO:", "--temp", "0", "--num_samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("ROMEO:") == 2


@pytest.mark.parametrize("argv,msg", [
    (["--top_p", "0"], "--top_p"),
    (["--top_p", "1.5"], "--top_p"),
    (["--stop", ""], "--stop"),
    (["--stop", "x" * 17], "--stop"),
    (["--precision", "fp16"], "--precision"),
    (["--out_dir", "."], "excludes"),
    (["--prompt", "a", "--prompt_file", "f"], "exclude each other"),
])
def test_sample_bad_options(source, capsys, argv, msg):
    assert sample.main(["--init_from", source, "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
