"""The training step on the GPU: graph replay and eager launches give bitwise-identical losses,
two runs with one seed are bitwise identical (no atomics), resume reproduces the run, the
loss falls."""
import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.data.text import TextDataset
from gptcuda.training.engine import Engine
from resume_check import resume_matches_full

pytestmark = pytest.mark.gpu
DATA = TextDataset("data/tinyshakespeare/input.txt")


def run_steps(overrides, steps=20, vocab=None, accum=1):
    """(loss history, engine) of `steps` training steps of the tiny config; vocab: a padded vocabulary."""
    cfg = load_config("configs/tiny.yaml", overrides + [f"--max_iters={steps}"])
    e = Engine(cfg, DATA.train, DATA.val, vocab or DATA.vocab_size, programs=("train",), n_vocab=DATA.vocab_size,
               accum=accum)
    for _ in range(steps):
        e.train_step()
    return e.loss_history(steps), e


def losses(overrides, steps=20):
    return run_steps(overrides, steps)[0]


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("attention", ["unfused", "fused"])
def test_graph_equals_eager_and_runs_repeat(precision, attention):
    base = [f"--precision={precision}", f"--attention={attention}", "--dropout=0.1"]
    g1 = losses(base + ["--graph=true"])
    g2 = losses(base + ["--graph=true"])
    e1 = losses(base + ["--graph=false"])
    assert np.all(np.isfinite(g1))
    assert np.array_equal(g1, g2), "two seeded runs differ: something is non-deterministic"
    assert np.array_equal(g1, e1), "graph replay and eager launches differ"
    assert g1[-5:].mean() < g1[:5].mean()


def test_resume_is_bitwise_on_gpu(tmp_path):
    resume_matches_full(tmp_path, ["--max_iters=16", "--eval_interval=8", "--dropout=0.1", "--eval_iters=2"], 16, 8)


def test_accumulation_and_padded_vocab_on_gpu(tmp_path):
    """Two micro-batches of 2 rows equal one batch of 4 (float32 summation order aside), graph and eager
    launches agree bit for bit, and a padded vocabulary (65 -> 128) trains like the unpadded one."""
    def hist(over, accum, vocab=None):
        return run_steps(over + ["--dropout=0.0"], 8, vocab, accum)
    big, _ = hist(["--batch_size=4"], 1)
    acc, eng = hist(["--batch_size=2"], 2)
    acc_eager, _ = hist(["--batch_size=2", "--graph=false"], 2)
    assert np.array_equal(acc, acc_eager)
    assert np.allclose(acc, big, rtol=2e-4, atol=0)
    padded, pe = hist(["--batch_size=4"], 1, vocab=128)
    assert pe.table["wte"].shape[0] == 128
    assert np.allclose(padded[:1], big[:1], rtol=0, atol=0.2)        # other init rows, similar start
    assert np.all(pe.grads()["wte"][65:] == 0)


def test_resume_with_accumulation_and_bpe_on_gpu(tmp_path):
    common = ["--max_iters=8", "--eval_interval=4", "--dropout=0.1", "--eval_iters=2", "--tokenizer=gpt2",
              "--vocab_multiple=128", "--total_batch_tokens=192", "--batch_size=4", "--block_size=16",
              "--precision=tf32", "--attention=fused"]

    def inspect(t):
        assert t.accum == 3 and t.eng.table["wte"].shape[0] == 50304

    resume_matches_full(tmp_path, common, 8, 4, inspect)


BF16 = ["--precision=bf16", "--attention=fused", "--vocab_multiple=8"]


def test_bf16_is_deterministic_graph_equals_eager_and_tracks_tf32():
    """precision bf16 (the tiny char model, its vocabulary 65 -> 72): two seeded runs and graph against
    eager launches bit for bit, the loss falling, and within 0.05 of tf32's over the last steps (bf16
    activations: ~2^-9 a stored value, far below what 20 steps of training move)."""
    def hist(over):
        return run_steps(BF16 + ["--dropout=0.1"] + over, 20, vocab=72)[0]
    g1, g2, e1 = hist(["--graph=true"]), hist(["--graph=true"]), hist(["--graph=false"])
    assert np.all(np.isfinite(g1)) and np.array_equal(g1, g2) and np.array_equal(g1, e1)
    assert g1[-5:].mean() < g1[:5].mean()
    tf = run_steps(["--precision=tf32", "--attention=fused", "--vocab_multiple=8", "--dropout=0.1"], 20, vocab=72)[0]
    assert abs(g1[-5:].mean() - tf[-5:].mean()) < 0.05


def test_bf16_resume_is_bitwise_on_gpu(tmp_path):
    """A bf16 run resumes bit for bit: the working copy is made from the fp32 parameters at each
    program's start, so a loaded checkpoint gives the copy the uninterrupted run had."""
    resume_matches_full(tmp_path, BF16 + ["--max_iters=16", "--eval_interval=8", "--dropout=0.1", "--eval_iters=2"],
                        16, 8)


def test_bf16_recompute_trains_bit_for_bit_as_stored():
    """recompute in bf16 rebuilds the GELU output in the dgelu product's epilogue from the stored
    pre-activation with the forward's own GELU: the run's losses and parameters are those of the run
    that stores the GELU output, bit for bit, in less memory. (The product tables are left out: a plan
    measured for each of the two dgelu epilogues may differ, and so may a split of the sums.)"""
    base = BF16 + ["--dropout=0.1", "--gemm_tune=off"]
    h0, e0 = run_steps(base, 6, vocab=72)
    p0 = e0.params()
    assert np.all(np.isfinite(h0))
    last = None
    for rc in ("1", "true"):       # the first layer rebuilds (the second stores), then every layer
        h1, e1 = run_steps(base + [f"--recompute={rc}"], 6, vocab=72)
        assert np.array_equal(h0, h1), rc
        p1 = e1.params()
        assert all(np.array_equal(p0[k], p1[k]) for k in p0), rc
        assert e1.plan.total_bytes < (last or e0.plan.total_bytes), rc
        last = e1.plan.total_bytes
    assert "fc_act" not in e1.bufs.acts


def test_bf16_gradients_are_one_rounding_of_fp32_ones_and_resume_bitwise(tmp_path):
    """grad_dtype bf16: one step's gradients within bf16 rounding of the fp32 gradients' (one rounding: 2^-8 of the
    largest; wte's two, the head's product then the embedding's addition: 2^-7; with room for the plans' other
    summation orders: 3 x 2^-8); 20 steps deterministic, graph equal to eager, the loss
    falling within 0.02 of the fp32 gradients' run over the last steps; with two micro-batches (the fp32 sum)
    likewise; a run resumes bit for bit."""
    base = BF16 + ["--dropout=0.1", "--gemm_tune=off"]
    grads = []
    for gd in ("fp32", "bf16"):
        cfg = load_config("configs/tiny.yaml", base + [f"--grad_dtype={gd}", "--max_iters=1"])
        e = Engine(cfg, DATA.train, DATA.val, 72, programs=("fwdbwd",), n_vocab=DATA.vocab_size)
        x = np.stack([DATA.train[i:i + cfg.block_size] for i in range(0, 64 * cfg.batch_size, 64)])
        y = np.stack([DATA.train[i + 1:i + 1 + cfg.block_size] for i in range(0, 64 * cfg.batch_size, 64)])
        e.set_batch(x, y)
        e.run("fwdbwd")
        grads.append(e.grads())
        assert e.bufs.flat_grads.dtype == {"fp32": "f32", "bf16": "bf16"}[gd]
    for k, g32 in grads[0].items():
        err = np.abs(grads[1][k].astype(np.float64) - g32).max() / max(np.abs(g32).max(), 1e-30)
        assert err <= 3 * 2.0 ** -8, (k, err)
    h = [run_steps(base + ["--grad_dtype=bf16", f"--graph={g}"], 20, vocab=72)[0] for g in ("true", "true", "false")]
    assert np.all(np.isfinite(h[0])) and np.array_equal(h[0], h[1]) and np.array_equal(h[0], h[2])
    assert h[0][-5:].mean() < h[0][:5].mean()
    f = run_steps(base, 20, vocab=72)[0]
    assert abs(h[0][-5:].mean() - f[-5:].mean()) < 0.02
    acc16 = run_steps(base + ["--grad_dtype=bf16", "--batch_size=2"], 8, vocab=72, accum=2)[0]
    acc32 = run_steps(base + ["--batch_size=2"], 8, vocab=72, accum=2)[0]
    assert np.all(np.isfinite(acc16)) and np.abs(acc16 - acc32).max() < 0.02
    resume_matches_full(tmp_path, BF16 + ["--grad_dtype=bf16", "--max_iters=16", "--eval_interval=8", "--dropout=0.1",
                                          "--eval_iters=2"], 16, 8)


def test_bf16_working_copy_follows_every_parameter_write():
    """The bf16 working copy is the parameters rounded, after the training step's AdamW (adamw_copy, which
    leaves the next program's to_bf16 nothing to do) and after the host writes the parameters (set_params:
    the next program makes it)."""
    from gptcuda.model.params import flatten
    from gptcuda.runtime import bf16
    cfg = load_config("configs/tiny.yaml", BF16 + ["--dropout=0.1", "--max_iters=4", "--eval_iters=1"])
    e = Engine(cfg, DATA.train, DATA.val, 72, programs=("train", "eval"), n_vocab=DATA.vocab_size)

    def copy_is_params():
        params = e.be.download(e.bufs.flat_params)
        return np.array_equal(e.be.download(e.bufs.acts["params_bf16"]), bf16.bits(params))

    e.train_step()
    assert e.state()["work_fresh"] == 1 and copy_is_params()
    e.evaluate()
    assert copy_is_params()
    named = {k: v * np.float32(0.5) for k, v in e.params().items()}
    e.set_params(named)
    assert e.state()["work_fresh"] == 0
    e.evaluate()                                   # its program's first launch makes the copy
    assert copy_is_params() and np.array_equal(e.be.download(e.bufs.flat_params), flatten(e.table, named))


@pytest.mark.parametrize("over,accum", [
    (["--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--dropout=0.1", "--recompute=1"], 1),
    (["--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--recompute=true", "--batch_size=2"], 2),
    (["--precision=bf16", "--attention=fused", "--vocab_multiple=8", "--grad_dtype=bf16", "--batch_size=2"], 2),
    (["--precision=tf32", "--attention=fused", "--dropout=0.1", "--recompute=true"], 1)],
    ids=["bf16-dropout", "bf16-accum", "bf16-grads-accum", "tf32-dropout"])
def test_scratch_inside_the_logits_changes_no_bit(monkeypatch, over, accum):
    """The backward's scratch inside the logits buffer (memory.SHARED_WITH_LOGITS) at a vocabulary where it
    fits: 10 steps give the same losses and parameters, bit for bit, as with every entry on its own bytes."""
    from gptcuda.model import memory
    shared_hist, shared = run_steps(over, 10, vocab=1024, accum=accum)
    inside = {e.name for e in shared.plan.entries if e.within}
    assert inside >= {"dfc", "dqkv", "dres"}, inside
    monkeypatch.setattr(memory, "SHARED_WITH_LOGITS", ())
    apart_hist, apart = run_steps(over, 10, vocab=1024, accum=accum)
    assert not any(e.within for e in apart.plan.entries)
    assert np.all(np.isfinite(shared_hist)) and np.array_equal(shared_hist, apart_hist)
    pa, pb = shared.params(), apart.params()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
