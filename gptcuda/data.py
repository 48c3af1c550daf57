"""Character-level data: a tokenizer, a train/val split of one text file, and batches.

Batches are a pure function of (seed, counter, site): `get_batch` draws its window
starts with `rng.batch_offsets`, so a resumed run (or the reference backend) sees
exactly the same batches as the original run.
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import rng
from .checkpoint import atomic_open

__all__ = ["CharTokenizer", "TextDataset", "get_batch"]


class CharTokenizer:
    """Maps each of a fixed list of characters to its index."""

    def __init__(self, chars: list[str]):
        chars = list(chars)
        seen: dict[str, int] = {}
        for i, c in enumerate(chars):
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"tokenizer entry {i} must be a single character, got {c!r}")
            if c in seen:
                raise ValueError(f"tokenizer character {c!r} appears twice (entries {seen[c]} and {i})")
            seen[c] = i
        if not chars:
            raise ValueError("tokenizer needs at least one character")
        self.chars = chars
        self.stoi = seen
        # code point -> id lookup table (-1: not in the vocabulary)
        cps = np.array([ord(c) for c in chars], dtype=np.int64)
        self._lut = np.full(int(cps.max()) + 1, -1, dtype=np.int32)
        self._lut[cps] = np.arange(len(chars), dtype=np.int32)
        self._chars_arr = np.array(chars, dtype="<U1")

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of text; a character outside the vocabulary raises ValueError."""
        if not text:
            return np.zeros(0, dtype=np.int32)
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4")
        in_range = cps < len(self._lut)
        ids = np.where(in_range, self._lut[np.where(in_range, cps, 0)], -1).astype(np.int32)
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            pos = int(bad[0])
            raise ValueError(
                f"character {text[pos]!r} at position {pos} is not in the tokenizer's vocabulary "
                f"({self.vocab_size} characters)")
        return ids

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size == 0:
            return ""
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"token id {int(ids[i])} at position {i} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        return "".join(self._chars_arr[ids].tolist())

    # --- serialisation
    def to_dict(self) -> dict:
        return {"type": "char", "chars": list(self.chars)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, obj) -> "CharTokenizer":
        """From to_json()'s string (or the equivalent dict)."""
        d = json.loads(obj) if isinstance(obj, (str, bytes)) else obj
        if not isinstance(d, dict) or d.get("type", "char") != "char" or not isinstance(d.get("chars"), list):
            raise ValueError("not a character tokenizer description")
        return cls(d["chars"])

    def save(self, path: str | os.PathLike) -> None:
        with atomic_open(os.fspath(path)) as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(f.read())
        except FileNotFoundError:
            raise FileNotFoundError(f"tokenizer file not found: {path}") from None
        except (ValueError, json.JSONDecodeError) as e:
            raise ValueError(f"bad tokenizer file {path}: {' '.join(str(e).split())}") from None


class TextDataset:
    """One UTF-8 text file, tokenized by characters: first 90% train, last 10% val.

    Attributes: text, tokenizer, train, val (int32 arrays), path.
    A tokenizer may be passed (e.g. restored from a checkpoint); otherwise it is
    built from the text's sorted unique characters.
    """

    TRAIN_FRACTION = 0.9

    def __init__(self, path: str | os.PathLike, tokenizer: CharTokenizer | None = None):
        self.path = os.fspath(path)
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"data file not found: {self.path}") from None
        except IsADirectoryError:
            raise IsADirectoryError(f"data path is a directory, not a text file: {self.path}") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"data file {self.path} is not valid UTF-8 (byte {e.start})") from None
        if not text:
            raise ValueError(f"data file {self.path} is empty")
        self.text = text
        self.tokenizer = tokenizer if tokenizer is not None else CharTokenizer.from_text(text)
        ids = self.tokenizer.encode(text)
        n = int(self.TRAIN_FRACTION * len(ids))
        self.train = np.ascontiguousarray(ids[:n])
        self.val = np.ascontiguousarray(ids[n:])

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
