"""HellaSwag on the CPU: the file format, the rows, the scores against an independent float64 GPT-2 forward
(llm.c's dev/data/hellaswag.py arithmetic written out in numpy), eval.py, and the training loop's record."""
import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from gptcuda.config import ConfigError, load_config
from gptcuda.data.shards import DataError, write_shard
from gptcuda.data.tokenizers import CharTokenizer, make_tokenizer, tokenizer_from_dict
from gptcuda.interop import hf_config, hf_tensors
from gptcuda.training import hellaswag
from gptcuda.training.engine import Engine
from gptcuda.training.trainer import Trainer
from test_interop import hf_gpt2_forward

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "tests" / "fixtures" / "hellaswag_tiny.jsonl"
TEXT = ROOT / "data" / "tinyshakespeare" / "input.txt"
MODEL = ["--backend=reference", "--n_layer=2", "--n_head=2", "--n_embd=16", "--dropout=0.0", "--init_std=0.3"]


def quiet(*a, **k):
    pass


def char_tok():
    return CharTokenizer.from_text(TEXT.read_text()[:200000])


def test_read_examples_names_the_bad_line(tmp_path):
    ex = hellaswag.read_examples(FILE)
    assert len(ex) == 6 and ex[4].label == 0 and ex[1].endings[1] == "speak."
    assert len(hellaswag.read_examples(FILE, limit=2)) == 2
    good = FILE.read_text().splitlines()[0]
    for bad, msg in [("{nope", ":2: not JSON"), ('{"ctx": "a", "endings": ["b"], "label": 0}', ":2: endings"),
                     ('{"ctx": "a", "endings": ["b", "c", "d", "e"], "label": 4}', ":2: label"),
                     ('{"ctx": "", "endings": ["b", "c", "d", "e"], "label": 1}', ":2: ctx")]:
        p = tmp_path / "bad.jsonl"
        p.write_text(good + "\n" + bad + "\n")
        with pytest.raises(DataError, match=msg):
            hellaswag.read_examples(p)
    with pytest.raises(DataError, match="not found"):
        hellaswag.read_examples(tmp_path / "none.jsonl")


def test_render_crops_the_context_and_keeps_the_ending():
    tok = char_tok()
    ex = hellaswag.read_examples(FILE)
    for block in (64, 52):
        for e, it in zip(ex, hellaswag.render(ex, tok, block)):
            ctx = tok.encode(e.ctx)
            for k, (row, s) in enumerate(zip(it.rows, it.start)):
                end = tok.encode(" " + e.endings[k])
                assert len(row) <= block + 1 and s >= 1
                assert list(row[s:]) == list(end) and list(row[:s]) == list(ctx[len(ctx) - s:])
                assert s == min(len(ctx), block + 1 - len(end))
    with pytest.raises(DataError, match="example 0: ending 2 has 22 tokens, more than block_size 16"):
        hellaswag.render(ex[:1], tok, 16)


def float64_losses(named, cfg, n_vocab, items):
    """[N, 4] summed ending losses, each row alone through an independent numpy GPT-2 forward."""
    t = hf_tensors(named, cfg.n_layer, n_vocab)
    conf = hf_config(cfg, n_vocab, None)
    out = np.zeros((len(items), 4))
    for i, it in enumerate(items):
        for k, (row, s) in enumerate(zip(it.rows, it.start)):
            logits = hf_gpt2_forward(t, conf, np.asarray(row[:-1])[None])[0]
            m = logits.max(-1, keepdims=True)
            logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
            tgt = np.asarray(row[1:])
            out[i, k] = -sum(logp[p, tgt[p]] for p in range(s - 1, len(row) - 1))
    return out


@pytest.mark.parametrize("block,rows", [(64, 3), (52, 8)])
def test_scores_equal_a_float64_forward(block, rows):
    """Rows of several examples padded into batches of `rows` (3: an example's endings split over two
    batches), some contexts cropped (block 52): every ending's summed loss equals the numpy forward's."""
    tok = char_tok()
    cfg = load_config(None, MODEL + [f"--block_size={block}", "--batch_size=1"])
    dummy = np.zeros(block + 1, np.int32)
    named = Engine(cfg, dummy, dummy, tok.vocab_size, programs=()).params()
    items = hellaswag.render(hellaswag.read_examples(FILE), tok, block)
    eng = hellaswag.scoring_engine(cfg, named, tok.vocab_size, items, rows)
    res = hellaswag.score(eng, items)
    ref = float64_losses(named, cfg, tok.vocab_size, items)
    assert np.max(np.abs(res.losses - ref)) <= 1e-10 * np.max(np.abs(ref))
    counts = np.array([[len(r) - s for r, s in zip(it.rows, it.start)] for it in items])
    assert (res.counts == counts).all()
    labels = np.array([it.label for it in items])
    assert res.acc == np.mean(ref.argmin(1) == labels)
    assert res.acc_norm == np.mean((ref / counts).argmin(1) == labels)
    # split over two ranks, each rank's share is its own examples'
    half = hellaswag.score(eng, items, rank=1, world=2)
    assert np.array_equal(half.losses, res.losses[1::2])


def test_accuracies_are_llmc_arithmetic():
    losses = np.array([[4.0, 3.0, 9.0, 9.0], [2.0, 2.0, 5.0, 1.0], [6.0, 6.0, 6.0, 6.0]])
    counts = np.array([[4, 1, 9, 9], [1, 1, 1, 1], [2, 3, 4, 6]])
    r = hellaswag.Result(losses, counts, np.array([0, 3, 0]))
    assert list(r.pred) == [1, 3, 0] and list(r.pred_norm) == [0, 3, 3]    # ties: the first ending
    assert r.acc == pytest.approx(2 / 3) and r.acc_norm == pytest.approx(2 / 3)
    s = hellaswag.summary(r)
    assert (s.n, s.acc, s.acc_norm) == (3, r.acc, r.acc_norm)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A char run whose evaluations score HellaSwag at steps 0, 4 and the last (5)."""
    out = tmp_path_factory.mktemp("hs") / "run"
    cfg = load_config(None, MODEL + [f"--data={TEXT}", f"--out_dir={out}", "--block_size=64", "--batch_size=2",
                                     "--max_iters=5", "--eval_interval=2", "--eval_iters=1", f"--hellaswag={FILE}",
                                     "--hellaswag_interval=4", "--log_interval=1", "--warmup_iters=0"])
    Trainer(cfg, log=quiet).train(bar=False)
    return out


def test_training_records_hellaswag_beside_val_loss(run):
    recs = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if "eval_val" in r]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]
    assert [r["step"] for r in evals if "hellaswag" in r] == [0, 4, 5]
    # the last record's scores are the last checkpoint's weights scored on their own
    from gptcuda.interop import load_run
    r = load_run(str(run), "last")
    items = hellaswag.render(hellaswag.read_examples(FILE), tokenizer_from_dict(r.tokenizer), r.cfg.block_size)
    res = hellaswag.score(hellaswag.scoring_engine(r.cfg, r.named, r.n_vocab, items, 5), items)
    assert (evals[-1]["hellaswag"], evals[-1]["hellaswag_acc"]) == (res.acc_norm, res.acc)


def test_hellaswag_interval_is_a_multiple_of_eval_interval():
    with pytest.raises(ConfigError, match="hellaswag_interval"):
        load_config(None, ["--eval_interval=4", "--hellaswag_interval=6"])


def test_eval_py(run, capsys):
    ev = importlib.import_module("eval")
    assert ev.main([str(run), "--hellaswag", str(FILE), "--backend", "reference", "--limit", "4"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"hellaswag {FILE}: 4 examples, acc ") and "acc_norm" in line
    for argv, msg in [([str(run)], "--hellaswag FILE is required"),
                      (["--hellaswag", str(FILE)], "name the weights"),
                      ([str(run), "--hellaswag", str(FILE), "--limit", "x"], "--limit must be an integer"),
                      ([str(run), "--hellaswag", str(run / "no.jsonl"), "--backend", "reference"], "not found"),
                      ([str(run), "--hellaswag", str(FILE), "--backend", "cpu"], "--backend must be one of"),
                      ([str(run), "--hellaswag", str(FILE), "--precision", "bf16"], "--precision must be one of fp32|tf32")]:
        assert ev.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and msg in err, err


def test_config_names_the_tokenizer_the_shards_carry(tmp_path):
    """Token shards with their tokenizer.json and the default tokenizer (char): the run's config says gpt2,
    and the run resumes with the same command."""
    d = tmp_path / "data"
    d.mkdir()
    tok = make_tokenizer("gpt2")
    ids = tok.encode(TEXT.read_text()[:6000])
    write_shard(d / "train_000000.bin", ids[:1200], tok.vocab_size)
    write_shard(d / "val_000000.bin", ids[1200:], tok.vocab_size)
    tok.save(d / "tokenizer.json")
    argv = MODEL + [f"--data={d}", f"--out_dir={tmp_path / 'run'}", "--block_size=8", "--batch_size=2",
                    "--max_iters=2", "--eval_interval=2", "--eval_iters=1", "--vocab_multiple=128"]
    printed = []
    Trainer(load_config(None, argv), log=printed.append).train(bar=False)
    assert "\ntokenizer:          gpt2\n" in "\n".join(printed)
    assert load_config(tmp_path / "run" / "config.yaml").tokenizer == "gpt2"
    t = Trainer(load_config(None, argv + ["--max_iters=3"]), resume=True, log=quiet)
    assert t.start_step == 2 and t.cfg.tokenizer == "gpt2"
    assert math.isfinite(t.train(bar=False))
