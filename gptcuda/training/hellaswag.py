"""HellaSwag scored as llm.c's dev/data/hellaswag.py (and build-nanogpt's) score it, with our forward.

    examples = read_examples("hellaswag_val.jsonl")      # llm.c's file: one JSON object a line
    items = render(examples, tok, block=T)                # token rows, 4 per example
    res = score(eng, items)                               # eng: an Engine with the "forward" program
    res.acc, res.acc_norm, res.losses                     # losses [N, 4]: summed ending losses

An example is a context `ctx`, four `endings` and the `label` of the right one. Each ending is appended
to the context as GPT-2 sees it (encode(ctx) + encode(" " + ending)); the cross-entropy of every ending
token given the tokens before it is summed: `acc` picks the ending of least summed loss, `acc_norm` the
one of least mean loss per token (the number GPT-2 reproductions report: 29.55% for GPT-2 124M with
llm.c's script). A tie goes to the first ending, as torch's argmin does.

Rows longer than the model's block (block+1 tokens: block inputs, block targets) lose their context's
first tokens; an ending longer than the block is an error. The forward runs B rows of T positions at a
time (the Engine's batch_size x block_size): the rows of many examples padded into the block, one
forward a batch, the per-position losses (the `losses` the loss kernel writes) read back and summed on
the host over each ending's positions. A causal forward gives a row's positions the same losses whatever
follows them, so the padding changes nothing. With a data-parallel group each rank scores every
world-th example and `summary` sums the counts.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from gptcuda.data.shards import DataError
from gptcuda.training.engine import Engine

ENDINGS = 4


@dataclasses.dataclass
class Example:
    ctx: str
    endings: list
    label: int


@dataclasses.dataclass
class Item:
    """One example as token rows: rows[k] = context + ending k (int32, at most block+1 tokens) and
    start[k], the index in rows[k] of the ending's first token."""
    rows: list
    start: list
    label: int


@dataclasses.dataclass
class Result:
    losses: np.ndarray       # [N, 4] float64: each ending's summed cross-entropy
    counts: np.ndarray       # [N, 4] int: each ending's tokens
    labels: np.ndarray       # [N] int

    @property
    def n(self) -> int:
        return len(self.labels)

    @property
    def pred(self) -> np.ndarray:
        return np.argmin(self.losses, axis=1)

    @property
    def pred_norm(self) -> np.ndarray:
        return np.argmin(self.losses / self.counts, axis=1)

    @property
    def acc(self) -> float:
        return float(np.mean(self.pred == self.labels)) if self.n else 0.0

    @property
    def acc_norm(self) -> float:
        return float(np.mean(self.pred_norm == self.labels)) if self.n else 0.0


def read_examples(path: str, limit: int = 0) -> list:
    """The examples of a HellaSwag .jsonl file (llm.c's / build-nanogpt's hellaswag_val.jsonl: "ctx",
    "endings" (4 strings), "label"); the first `limit` (0: all). DataError naming the file and line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"hellaswag file not found: {path} (README 'Use' says how to get hellaswag_val.jsonl)")
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                d = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where}: not JSON ({e})") from None
            if not isinstance(d, dict):
                raise DataError(f"{where}: expected an object with ctx, endings and label")
            ctx, ends, label = d.get("ctx"), d.get("endings"), d.get("label")
            if not isinstance(ctx, str) or not ctx:
                raise DataError(f"{where}: ctx must be a non-empty string")
            if not (isinstance(ends, list) and len(ends) == ENDINGS and all(isinstance(e, str) and e for e in ends)):
                raise DataError(f"{where}: endings must be {ENDINGS} non-empty strings")
            if isinstance(label, str) and label.isdigit():
                label = int(label)
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < ENDINGS:
                raise DataError(f"{where}: label must be 0..{ENDINGS - 1}, got {label!r}")
            out.append(Example(ctx, list(ends), label))
            if limit and len(out) == limit:
                break
    if not out:
        raise DataError(f"{path} holds no examples")
    return out


def render(examples, tok, block: int) -> list:
    """Items of token rows (see Item) for a model of `block` positions; tok: the model's tokenizer."""
    items = []
    for j, ex in enumerate(examples):
        try:
            ctx = np.asarray(tok.encode(ex.ctx), np.int32)
            ends = [np.asarray(tok.encode(" " + e), np.int32) for e in ex.endings]
        except ValueError as e:          # a character a char tokenizer never saw
            raise DataError(f"hellaswag example {j}: the {tok.name} tokenizer cannot encode it: {e}") from None
        rows, start = [], []
        for k, end in enumerate(ends):
            if len(end) > block:
                raise DataError(f"hellaswag example {j}: ending {k} has {len(end)} tokens, more than block_size "
                                f"{block}")
            keep = min(len(ctx), block + 1 - len(end))      # the context's last tokens that fit
            rows.append(np.concatenate([ctx[len(ctx) - keep:], end]))
            start.append(keep)
        items.append(Item(rows, start, ex.label))
    return items


def longest(items) -> int:
    """The most positions a row of these items needs (its tokens less one)."""
    return max(len(r) - 1 for it in items for r in it.rows)


def score(eng, items, rank: int = 0, world: int = 1) -> Result:
    """Every ending's summed loss, by the Engine's "forward" program over batches of B rows x T
    positions (eng.cfg's batch_size, block_size); rank / world: this rank scores items[rank::world]."""
    B, T = eng.cfg.batch_size, eng.cfg.block_size
    mine = items[rank::world]
    flat = [(i, k) for i in range(len(mine)) for k in range(ENDINGS)]
    losses = np.zeros((len(mine), ENDINGS))
    counts = np.zeros((len(mine), ENDINGS), np.int64)
    x = np.zeros((B, T), np.int32)
    y = np.zeros((B, T), np.int32)
    for b0 in range(0, len(flat), B):
        chunk = flat[b0:b0 + B]
        x[...] = 0
        y[...] = 0
        for r, (i, k) in enumerate(chunk):
            row = mine[i].rows[k]
            x[r, :len(row) - 1] = row[:-1]
            y[r, :len(row) - 1] = row[1:]
        eng.set_batch(x, y)
        eng.run("forward")
        out = np.asarray(eng.be.download(eng.bufs.acts["losses"][0]), np.float64).reshape(B, T)
        for r, (i, k) in enumerate(chunk):
            row, s = mine[i].rows[k], mine[i].start[k]     # s >= 1: a context token is always kept
            losses[i, k] = out[r, s - 1:len(row) - 1].sum()      # target t+1 is predicted at position t
            counts[i, k] = len(row) - s
    return Result(losses, counts, np.array([it.label for it in mine], np.int64))


def scoring_engine(cfg, named: dict, n_vocab: int, items, rows: int = 64) -> Engine:
    """An Engine of these weights with the "forward" program only, for score(): `rows` rows of T
    positions, T the items' longest row rounded up to 64 (at most cfg.block_size; the position
    embedding cropped to T). cfg: the model's config (its backend, precision and attention)."""
    T = min(cfg.block_size, -(-longest(items) // 64) * 64)
    V = named["wte"].shape[0]
    c = dataclasses.replace(cfg, batch_size=rows, block_size=T, dropout=0.0, max_iters=0, vocab_size=V,
                            total_batch_tokens=0)
    dummy = np.zeros(T + 1, np.int32)
    eng = Engine(c, dummy, dummy, V, programs=("forward",), n_vocab=n_vocab)
    eng.set_params(dict(named, wpe=np.asarray(named["wpe"])[:T]))
    return eng


@dataclasses.dataclass
class Summary:
    """Accuracies over n examples (a data-parallel run's: over every rank's)."""
    n: int
    acc: float
    acc_norm: float


def summary(res: Result, dp=None) -> Summary:
    """The accuracies of a Result; with dp (a data-parallel rank's DataParallel) the correct answers
    and the examples are summed over the ranks (every rank must call this)."""
    k = [float(np.sum(res.pred == res.labels)), float(np.sum(res.pred_norm == res.labels)), float(res.n)]
    if dp is not None:
        k = [round(v * dp.world) for v in dp.host_mean(k)]
    right, right_norm, n = (int(v) for v in k)
    return Summary(n, right / max(n, 1), right_norm / max(n, 1))


def at_step(eng, items, step: int, rank: int = 0, world: int = 1) -> dict:
    """The training loop's scoring at an evaluation step: {"hellaswag": acc_norm, "hellaswag_acc": acc} where
    hellaswag_interval (0: every evaluation) or the last step says so, else {}; items None: no file set.
    Runs the Engine's forward program only: no counter moves. Every data-parallel rank calls it."""
    cfg = eng.cfg
    every = cfg.hellaswag_interval or cfg.eval_interval
    if items is None or (step % every and step != cfg.max_iters):
        return {}
    s = summary(score(eng, items, rank, world), eng.dp)
    return {"hellaswag": s.acc_norm, "hellaswag_acc": s.acc}


def describe(losses: dict) -> str:
    """The evaluation log line's HellaSwag part ("" without one)."""
    if "hellaswag" not in losses:
        return ""
    return f", hellaswag acc_norm {losses['hellaswag']:.4f} acc {losses['hellaswag_acc']:.4f}"
