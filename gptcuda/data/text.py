"""Character-level data: a tokenizer, a train/val split of one text file, and batches.

Batches are a pure function of (seed, counter, site): `get_batch` draws its window
starts with `rng.batch_offsets`, so a resumed run (or the reference backend) sees
exactly the same batches as the original run.
"""
from __future__ import annotations

import os

import numpy as np

from gptcuda.model import rng
from gptcuda.data.tokenizers import CharTokenizer

__all__ = ["CharTokenizer", "TextDataset", "get_batch"]


class TextDataset:
    """One UTF-8 text file, tokenized by characters, as in-memory arrays (tests, gradcheck): the
    split of dataset.open_dataset for a text file, first 90% train, last 10% val.

    Attributes: tokenizer, train, val (int32 arrays), path. A tokenizer may be passed (e.g.
    restored from a checkpoint); otherwise it is built from the text's sorted unique characters.
    """

    def __init__(self, path: str | os.PathLike, tokenizer: CharTokenizer | None = None):
        from gptcuda.data.dataset import open_text
        ds = open_text(os.fspath(path), "char", tokenizer)
        self.path, self.tokenizer = ds.source, ds.tokenizer
        self.train, self.val = ds.train.pieces[0], ds.val.pieces[0]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def split(self, name: str) -> np.ndarray:
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ValueError(f"unknown split {name!r} (train|val)")


def get_batch(tokens: np.ndarray, seed: int, counter: int, site: int, batch: int, block: int,
              row_offset: int = 0):
    """(x, y) int32 [batch, block]: windows at rng.batch_offsets; y is x shifted by one token.

    row_offset: the first row of a larger batch to draw (rank r of a data-parallel run draws rows
    [r*batch, (r+1)*batch) of the world's batch); 0 draws rows 0..batch-1."""
    tokens = np.asarray(tokens)
    n = len(tokens)
    if n < block + 1:
        raise ValueError(f"a split of {n} tokens cannot hold a window of block_size+1 = {block + 1} tokens")
    if row_offset < 0:
        raise ValueError(f"row_offset must be >= 0, got {row_offset}")
    offs = rng.batch_offsets(seed, counter, site, row_offset + batch, n, block)[row_offset:]
    idx = offs[:, None] + np.arange(block + 1, dtype=np.int64)[None, :]
    win = tokens[idx].astype(np.int32, copy=False)
    x = np.ascontiguousarray(win[:, :-1])
    y = np.ascontiguousarray(win[:, 1:])
    return x, y
