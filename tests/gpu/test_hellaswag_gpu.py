"""HellaSwag on the GPU: our CUDA forward's per-ending losses equal the float64 reference backend's."""
from pathlib import Path

import numpy as np
import pytest

from gptcuda.config import load_config
from gptcuda.data.tokenizers import CharTokenizer
from gptcuda.training import hellaswag
from gptcuda.training.engine import Engine

ROOT = Path(__file__).resolve().parent.parent.parent
FILE = ROOT / "tests" / "fixtures" / "hellaswag_tiny.jsonl"


@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention,tol", [("fp32", "unfused", 1e-5), ("fp32", "fused", 1e-5),
                                                     ("tf32", "fused", 2e-3)])
def test_cuda_scores_equal_the_reference(precision, attention, tol):
    tok = CharTokenizer.from_text((ROOT / "data" / "tinyshakespeare" / "input.txt").read_text()[:200000])
    base = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=128", "--batch_size=1", "--dropout=0.0",
            "--init_std=0.3", f"--precision={precision}", f"--attention={attention}"]
    ref_cfg = load_config(None, base + ["--backend=reference"])
    dummy = np.zeros(129, np.int32)
    named = Engine(ref_cfg, dummy, dummy, tok.vocab_size, programs=()).params()
    items = hellaswag.render(hellaswag.read_examples(FILE), tok, 128)
    ref = hellaswag.score(hellaswag.scoring_engine(ref_cfg, named, tok.vocab_size, items, 5), items)
    cfg = load_config(None, base + ["--backend=cuda"])
    got = hellaswag.score(hellaswag.scoring_engine(cfg, named, tok.vocab_size, items, 5), items)
    # relative to the largest mean loss (TF32 operands round to 10 bits: ~1e-3 of the logits' scale)
    mean, want = got.losses / got.counts, ref.losses / ref.counts
    err = np.max(np.abs(mean - want)) / np.max(np.abs(want))
    assert err <= tol, err
    assert (got.counts == ref.counts).all()
    if precision == "fp32":
        assert (got.pred == ref.pred).all() and (got.pred_norm == ref.pred_norm).all()
