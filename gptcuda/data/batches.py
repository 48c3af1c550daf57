"""Which token windows a step or an evaluation batch reads, gathered on the host.

No dataset is uploaded to the GPU: before each replay of a recorded program the host gathers
that program's windows from the (memory-mapped) token stream into a pinned buffer, and the
backend copies them into the plan's `idx` / `targets` asynchronously on the training stream
(cuda_backend.BatchFeeder), while the previous step still runs.

Every window is a pure function of (seed, counter, site, row):

    start = rng.batch_offsets(seed, counter, site, rows, n_tokens, T)[row]

counter is the optimizer step for training batches and the evaluation draw for evaluation
batches. A training step reads A x W x B rows (A micro-batches of gradient accumulation,
W data-parallel ranks, B = batch_size); micro-batch k of rank r is rows (k*W + r)*B .. +B. So
a run with accumulation A, or on W GPUs, reads exactly the rows of one GPU with batch A*W*B,
and a resumed run reads what the original would have. An evaluation batch of rank r is rows
r*B .. r*B+B of the W*B rows of its draw.
"""
from __future__ import annotations

import numpy as np

from gptcuda.model import rng

SITES = {"train": rng.SITE_BATCH_TRAIN, "eval_train": rng.SITE_BATCH_EVAL_TRAIN, "eval_val": rng.SITE_BATCH_VAL}


class ArrayStream:
    """An in-memory token array with the TokenStream interface (gather, len)."""

    def __init__(self, tokens, name: str = "<memory>"):
        self.tokens = np.asarray(tokens)
        self.paths = [name]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def gather(self, starts, length: int, out) -> None:
        idx = np.asarray(starts, np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]
        out[...] = self.tokens[idx]


def as_stream(tokens):
    """A TokenStream (anything with gather and len) as it is; a numpy array wrapped."""
    return tokens if hasattr(tokens, "gather") else ArrayStream(tokens)


class Batches:
    """The host half of the batch pipeline of one rank."""

    def __init__(self, train, val, batch: int, block: int, seed: int, accum: int = 1, world: int = 1,
                 rank: int = 0):
        self.streams = {"train": as_stream(train), "eval_train": as_stream(train), "eval_val": as_stream(val)}
        self.B, self.T, self.seed = int(batch), int(block), int(seed)
        self.accum, self.world, self.rank = int(accum), int(world), int(rank)
        for name, s in self.streams.items():
            if len(s) < self.T + 1:
                raise ValueError(f"the {name.replace('eval_', '')} split has {len(s)} tokens; a window needs "
                                 f"block_size+1 = {self.T + 1}")
        self._win = {k: np.empty((self.rows(k), self.T + 1), np.int32) for k in ("train", "eval_train")}
        self._win["eval_val"] = self._win["eval_train"]

    def rows(self, program: str) -> int:
        """Rows this rank reads for one run of the program (train: A*B, evaluation: B)."""
        return self.accum * self.B if program == "train" else self.B

    def starts(self, program: str, counter: int) -> np.ndarray:
        """int64 [rows(program)]: this rank's window starts, micro-batch after micro-batch."""
        B, W, r = self.B, self.world, self.rank
        A = self.accum if program == "train" else 1
        offs = rng.batch_offsets(self.seed, counter, SITES[program], A * W * B, len(self.streams[program]), self.T)
        return np.concatenate([offs[(k * W + r) * B:(k * W + r + 1) * B] for k in range(A)])

    def fill(self, program: str, counter: int, x: np.ndarray, y: np.ndarray) -> None:
        """x, y int32 [rows, T] (a pinned buffer's halves): the inputs and the targets (shifted by one)."""
        win = self._win[program]
        self.streams[program].gather(self.starts(program, counter), self.T + 1, win)
        x[...] = win[:, :-1]
        y[...] = win[:, 1:]
