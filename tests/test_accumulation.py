"""Gradient accumulation, the padded vocabulary and token data on the float64 reference backend."""
import json
import os

import numpy as np
import pytest

from gptcuda.config import ConfigError, accum_steps, load_config, model_vocab
from gptcuda.training.engine import Engine
from resume_check import resume_matches_full

TOKS = (np.arange(4000) * 7919 % 65).astype(np.int32)


def _engine(accum, batch, vocab=65, n_vocab=None, dropout=0.0):
    cfg = load_config("configs/tiny.yaml", ["--backend=reference", f"--batch_size={batch}", f"--dropout={dropout}",
                                            "--max_iters=4"])
    return Engine(cfg, TOKS, TOKS[:500], vocab, programs=("train",), n_vocab=n_vocab, accum=accum)


def test_accumulated_step_equals_one_big_batch():
    """Two micro-batches of 2 rows read the rows of one batch of 4 and, without dropout, give the same
    mean loss, gradient and update (up to float64 summation order)."""
    big, acc = _engine(1, 4), _engine(2, 2)
    for _ in range(3):
        big.train_step()
        acc.train_step()
        sb, sa = big.state(), acc.state()
        assert sa["step"] == sb["step"]
        assert abs(sa["loss"] - sb["loss"]) < 1e-12 and abs(sa["grad_norm"] - sb["grad_norm"]) < 1e-11
    pb, pa = big.params(), acc.params()
    assert max(float(np.abs(pb[k] - pa[k]).max()) for k in pb) < 1e-11
    assert np.allclose(big.loss_history(3), acc.loss_history(3), rtol=0, atol=1e-12)


def test_micro_batches_draw_their_own_dropout():
    """Each micro-batch's dropout (forward and backward alike) uses its own random sites; micro-batch 0
    keeps the sites of a run without accumulation."""
    from gptcuda.model import rng
    e = _engine(3, 2, dropout=0.2)
    calls = []

    class Ops:                                    # records the model's op calls
        def __getattr__(self, name):
            return lambda *a, **k: calls.append((name, a))

    m = e.model
    m.ops = Ops()
    m.record_train_step()
    sites = [[], [], []]
    k = -1
    for name, a in calls:
        if name == "encoder_fwd":
            k += 1
        if name in ("dropout_fwd", "residual_dropout", "attention_fwd"):
            sites[k].append(a[-1])
    assert len(sites[0]) == len(sites[1]) == len(sites[2]) > 0
    assert not set(sites[0]) & set(sites[1]) and not set(sites[1]) & set(sites[2])
    assert rng.DROPOUT_EMB in sites[0] and rng.dropout_site(0, 0) in sites[0]


def test_padded_vocabulary_is_masked():
    """A model of 128 rows over a 65-token vocabulary: the loss is the 65-way loss and the padded
    rows of wte get no gradient (so they only decay)."""
    plain, padded = _engine(1, 4), _engine(1, 4, vocab=128, n_vocab=65)
    # the same initial weights for the shared rows: copy plain's into padded's first 65 rows
    pp = padded.params()
    for k, v in plain.params().items():
        if k == "wte":
            pp[k][:65] = v
        else:
            pp[k][...] = v
    padded.set_params(pp)
    for e in (plain, padded):
        e.train_step()
    assert abs(plain.state()["loss"] - padded.state()["loss"]) < 1e-12
    g = padded.grads()["wte"]
    assert np.all(g[65:] == 0) and np.abs(g[:65]).max() > 0


def test_config_accumulation_and_vocab_rules():
    cfg = load_config("configs/tiny.yaml", ["--total_batch_tokens=256"])        # 4 x 16 x 4
    assert accum_steps(cfg) == 4 and accum_steps(cfg, world=2) == 2
    with pytest.raises(ConfigError, match="total_batch_tokens.*multiple of batch_size x block_size x 3 GPUs"):
        accum_steps(cfg, world=3)
    assert accum_steps(load_config("configs/tiny.yaml")) == 1
    assert model_vocab(load_config("configs/tiny.yaml", ["--vocab_multiple=128"]), 50257) == 50304
    assert model_vocab(load_config("configs/tiny.yaml", ["--vocab_multiple=128"]), 65) == 128
    assert model_vocab(load_config("configs/tiny.yaml"), 65) == 65
    assert model_vocab(load_config("configs/tiny.yaml", ["--vocab_size=100"]), 65) == 100
    for bad, key in (("--tokenizer=bpe", "tokenizer"), ("--tokenizer=gpt3", "tokenizer"),
                     ("--vocab_multiple=0", "vocab_multiple"), ("--total_batch_tokens=-1", "total_batch_tokens")):
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny.yaml", [bad])
        assert e.value.key == key and "\n" not in str(e.value)


def test_gpt2_bpe_training_with_accumulation_resumes_bitwise(tmp_path):
    """A tiny GPT on GPT-2 BPE tokens of a text file (vocabulary 50257 padded to 50304), two
    micro-batches a step, trains and resumes bit for bit."""
    text = tmp_path / "t.txt"
    with open("data/tinyshakespeare/input.txt", encoding="utf-8") as f:
        text.write_text(f.read()[:20000], encoding="utf-8")
    over = ["--backend=reference", f"--data={text}", "--tokenizer=gpt2", "--max_iters=6", "--eval_interval=3",
            "--eval_iters=1", "--batch_size=2", "--block_size=16", "--total_batch_tokens=64", "--n_embd=32",
            "--n_head=2", "--n_layer=1", "--vocab_multiple=128"]

    def inspect(t):
        assert t.accum == 2 and t.eng.table["wte"].shape == (50304, 32) and t.eng.n_vocab == 50257

    full, _ = resume_matches_full(tmp_path, over, 6, 3, inspect)
    tok = json.load(open(os.path.join(full, "tokenizer.json")))
    assert tok["type"] == "gpt2"
