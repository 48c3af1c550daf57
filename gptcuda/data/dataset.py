"""What the trainer opens: a train and a val token stream and the tokenizer that made them.

`open_dataset(data, tokenizer, saved_tokenizer, val_data)` accepts

    a text file         UTF-8 text, tokenized in memory: first 90% of the tokens train, last 10% val
                        (for "char" exactly the ids and split of data.TextDataset)
    a directory         (a) prepare.py's output: tokenizer.json, prepare.json, train_*.bin, val_*.bin
                        (b) llm.c's shards: *train*.bin and *val*.bin with the shard header, sorted by name
                        (c) nanoGPT's raw train.bin + val.bin (uint16, no header)
    a glob pattern      (any of * ? [) the train shards; val_data (a glob or a file) the val shards, by
                        default the pattern with "train" replaced by "val" (llm.c's convention)
    one shard file      the train split; its val as for a glob

Token data is never loaded whole: each split is a `TokenStream` over read-only memmaps. Its tokenizer is the
`tokenizer.json` beside the shards, else the `tokenizer` spec (which must then be "gpt2": a char or bpe:N
vocabulary cannot be guessed from ids). A run being resumed passes its own tokenizer (`saved_tokenizer`, a
to_dict()); the data's must equal it. Every problem is a one-line DataError (or FileNotFoundError) naming the
file; whether a split is long enough for a block is the caller's check. Token data is checked against its
tokenizer before it is returned (gptcuda/data/checks.py): no id outside the vocabulary, prepare.json's
tokenizer the one beside the shards.
"""
from __future__ import annotations

import glob as globmod
import json
import os

import numpy as np

from gptcuda.data.checks import check_prepared, check_scanned
from gptcuda.data.shards import DataError, is_shard, open_raw, open_shard
from gptcuda.data.tokenizers import load_tokenizer, make_tokenizer, parse_spec, tokenizer_from_dict

__all__ = ["TokenStream", "Dataset", "open_dataset", "DataError", "TRAIN_FRACTION", "PREPARE_MARKER"]

TRAIN_FRACTION = 0.9
PREPARE_MARKER = ".prepare.json.replacing"   # in a directory while prepare.py moves a new output into it
_GLOB_CHARS = "*?["


class TokenStream:
    """One split: several token arrays (memmaps or in-memory arrays) viewed as one stream of ids.

    paths[i] names where piece i came from ("<memory>" for tokenized text); len() is the total token count
    (an int: it may exceed 2**32). Ids are checked against vocab_size as they are gathered."""

    def __init__(self, pieces, paths, vocab_size: int):
        if len(pieces) != len(paths):
            raise ValueError(f"{len(pieces)} pieces but {len(paths)} paths")
        keep = [(p, s) for p, s in zip(pieces, paths) if len(p)]     # empty pieces hold no window
        self.pieces = [p for p, _ in keep]
        self.paths = [s for _, s in keep]
        self.vocab_size = int(vocab_size)
        # piece i holds stream positions [bounds[i], bounds[i+1])
        self._bounds = np.zeros(len(self.pieces) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in self.pieces], out=self._bounds[1:])
        self._n = int(self._bounds[-1])

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"TokenStream({len(self.pieces)} pieces, {self._n} tokens)"

    def piece_of(self, pos: int) -> tuple[int, int]:
        """(piece index, position in that piece) of stream position pos."""
        i = int(np.searchsorted(self._bounds, pos, side="right")) - 1
        return i, int(pos - self._bounds[i])

    def gather(self, starts, length: int, out: np.ndarray) -> None:
        """out[i] = stream[starts[i] : starts[i] + length] for each row.

        starts: int64 [R]; out: int32 [R, length], written in place (it may be a pinned host buffer).
        Windows may cross piece boundaries. A gathered id >= vocab_size raises DataError naming its file."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        R, L = starts.size, int(length)
        if out.dtype != np.int32 or out.shape != (R, L):
            raise ValueError(f"out must be int32 [{R}, {L}], got {out.dtype} {list(out.shape)}")
        if R == 0 or L == 0:
            return
        if L < 0 or int(starts.min()) < 0 or int(starts.max()) + L > self._n:
            bad = int(starts[np.argmax((starts < 0) | (starts + L > self._n))])
            raise ValueError(f"window [{bad}, {bad + L}) is outside the stream of {self._n} tokens")
        b = self._bounds
        first = np.searchsorted(b, starts, side="right") - 1
        last = np.searchsorted(b, starts + (L - 1), side="right") - 1
        same = first == last
        # rows inside one piece (nearly all): vectorized per piece, usually a single one
        ps = np.unique(first[same])
        for p in ps.tolist():
            arr = self.pieces[p]
            win = np.lib.stride_tricks.sliding_window_view(arr, L)    # a view: [len - L + 1, L]
            if len(ps) == 1 and same.all():
                # advanced indexing copies only the R rows; np.take(win, ..., out=) would first
                # make the whole strided view contiguous ([len, L]: 0.17 s for tiny Shakespeare)
                out[...] = win[starts - b[p]]
            else:
                rows = np.flatnonzero(same & (first == p))
                out[rows] = win[starts[rows] - b[p]]
        # rows crossing a piece boundary: piece by piece
        for i in np.flatnonzero(~same).tolist():
            pos, col, p = int(starts[i]), 0, int(first[i])
            while col < L:
                lo = pos + col - int(b[p])
                k = min(L - col, len(self.pieces[p]) - lo)
                out[i, col:col + k] = self.pieces[p][lo:lo + k]
                col += k
                p += 1
        lo_id, hi_id = int(out.min()), int(out.max())
        if lo_id < 0 or hi_id >= self.vocab_size:
            self._out_of_vocab(starts, out)

    def _out_of_vocab(self, starts, out):
        flat = int(np.flatnonzero(((out < 0) | (out >= self.vocab_size)).reshape(-1))[0])
        i, j = divmod(flat, out.shape[1])
        pos = int(starts[i]) + j
        p, local = self.piece_of(pos)
        value = int(self.pieces[p][local])    # the stored id (an int32 view wraps ids >= 2**31)
        raise DataError(f"{self.paths[p]}: token id {value} at position {local} (stream position {pos}) is "
                        f"outside the tokenizer's vocabulary (0..{self.vocab_size - 1})")

    def read(self, start: int, length: int) -> np.ndarray:
        """stream[start : start + length] as a new int32 array."""
        out = np.empty((1, length), dtype=np.int32)
        self.gather(np.array([start], dtype=np.int64), length, out)
        return out[0]


class Dataset:
    """train and val TokenStreams, the tokenizer, where they came from (`source`) and what kind of data it is."""

    def __init__(self, train: TokenStream, val: TokenStream, tokenizer, source: str, kind: str):
        self.train, self.val, self.tokenizer, self.source, self.kind = train, val, tokenizer, source, kind

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def describe(self) -> str:
        def split(name, s):
            files = "" if self.kind == "text" else f" in {len(s.pieces)} file{'s' * (len(s.pieces) != 1)}"
            return f"{name} {len(s):,} tokens{files}"
        return (f"{self.kind} data {self.source}: {split('train', self.train)}, {split('val', self.val)}; "
                f"tokenizer {self.tokenizer.name} ({self.vocab_size:,} tokens)")


# --- text

def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"data file not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    if not raw:
        raise DataError(f"data file {path} is empty")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(f"data file {path} looks binary (NUL byte at offset {nul}), not UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not valid UTF-8 (byte {e.start})") from None


def open_text(path: str, spec: str, saved=None) -> Dataset:
    """A text file's Dataset: encoded with `saved` (a tokenizer object) or a new `spec` tokenizer,
    then split 90/10."""
    text = _read_text(path)
    try:
        tok = saved if saved is not None else make_tokenizer(spec, [text])
    except ValueError as e:
        raise DataError(f"data file {path}: {e}") from None
    try:
        ids = tok.encode(text)
    except ValueError as e:
        raise DataError(f"data file {path}: {e}") from None
    n = int(TRAIN_FRACTION * len(ids))
    train = np.ascontiguousarray(ids[:n])
    val = np.ascontiguousarray(ids[n:])
    V = tok.vocab_size
    return Dataset(TokenStream([train], ["<memory>"], V), TokenStream([val], ["<memory>"], V), tok, path, "text")


# --- token files

def _open_tokens(path: str) -> np.ndarray:
    """A shard, or nanoGPT's raw train.bin / val.bin."""
    if not is_shard(path) and os.path.basename(path) in ("train.bin", "val.bin"):
        return open_raw(path)
    return open_shard(path)


def _glob(pattern: str) -> list[str]:
    return sorted(p for p in globmod.glob(pattern) if os.path.isfile(p))


def _data_tokenizer(where: str, tok_dirs, spec: str):
    """The tokenizer of token data: a tokenizer.json in one of tok_dirs, else the spec (gpt2 only)."""
    for d in tok_dirs:
        p = os.path.join(d, "tokenizer.json")
        if os.path.isfile(p):
            try:
                tok = load_tokenizer(p)
            except ValueError as e:
                raise DataError(str(e)) from None
            if spec != "char" and spec.strip() != tok.name:
                raise DataError(f"{p} is a {tok.name} tokenizer but tokenizer: {spec} was asked for")
            return tok
    kind, _ = parse_spec(spec)
    if kind == "char":
        raise DataError(f"{where} holds token ids and no tokenizer.json: set tokenizer: gpt2 "
                        f"(or the bpe:N it was made with)")
    if kind == "bpe":
        raise DataError(f"{where} holds token ids and no tokenizer.json: a {spec} tokenizer cannot be rebuilt "
                        f"without the tokenizer.json it was made with")
    return make_tokenizer(spec)


def _streams(train_files, val_files, tok):
    V = tok.vocab_size
    return (TokenStream([_open_tokens(p) for p in train_files], list(train_files), V),
            TokenStream([_open_tokens(p) for p in val_files], list(val_files), V))


def _val_files(pattern_or_file: str, what: str) -> list[str]:
    files = _glob(pattern_or_file) if any(c in pattern_or_file for c in _GLOB_CHARS) else [pattern_or_file]
    if not files:
        raise DataError(f"no val files match {pattern_or_file!r} ({what})")
    for f in files:
        if not os.path.exists(f):
            raise FileNotFoundError(f"val data file not found: {f}")
    return files


def _open_glob(data: str, val_data: str, spec: str) -> tuple:
    """Train files matching data (a glob, or one shard file) and their val files."""
    train = _glob(data) if any(c in data for c in _GLOB_CHARS) else [data]
    if not train:
        raise DataError(f"no files match the data pattern {data!r}")
    if val_data:
        val = _val_files(val_data, "val_data")
    else:
        # llm.c's convention: "train" -> "val", in the file name (else in the directories: train/*.bin)
        head, base = os.path.split(data)
        if "train" in base:
            pattern = os.path.join(head, base.replace("train", "val"))
        elif "train" in head:
            pattern = data.replace("train", "val")
        else:
            raise DataError(f"{data}: no 'train' in the name to replace by 'val': set val_data")
        val = _val_files(pattern, "the data pattern with 'train' replaced by 'val'; set val_data")
    if set(train) & set(val):
        raise DataError(f"{sorted(set(train) & set(val))[0]} is both a train and a val file")
    dirs = sorted({os.path.dirname(p) for p in train})
    tok = _data_tokenizer(data, dirs if len(dirs) == 1 else [], spec)
    return train, val, tok


def _open_dir(d: str, spec: str) -> tuple:
    """(train files, val files, tokenizer, kind) of a data directory."""
    names = sorted(os.listdir(d))
    prep = os.path.join(d, "prepare.json")
    if PREPARE_MARKER in names:
        raise DataError(f"{d} is half-written: prepare.py was interrupted while moving a new output in "
                        f"(or is still at it); run prepare.py again")
    if os.path.isfile(os.path.join(d, "tokenizer.json")) and (
            os.path.isfile(prep) or any(n.startswith("train_") and n.endswith(".bin") for n in names)):
        if os.path.isfile(prep):     # prepare.py's own list of its shards
            try:
                with open(prep, encoding="utf-8") as f:
                    meta = json.load(f)
                train = [os.path.join(d, s["file"]) for s in meta["splits"]["train"]["shards"]]
                val = [os.path.join(d, s["file"]) for s in meta["splits"]["val"]["shards"]]
            except (ValueError, KeyError, TypeError) as e:
                raise DataError(f"bad {prep}: {' '.join(str(e).split())}") from None
            for p in train + val:
                if not os.path.isfile(p):
                    raise DataError(f"{p} is listed in {prep} but missing: re-run prepare.py")
        else:
            train = [os.path.join(d, n) for n in names if n.startswith("train_") and n.endswith(".bin")]
            val = [os.path.join(d, n) for n in names if n.startswith("val_") and n.endswith(".bin")]
        kind = "prepared"
    else:
        train = [os.path.join(d, n) for n in names if "train" in n and n.endswith(".bin")]
        val = [os.path.join(d, n) for n in names if "val" in n and n.endswith(".bin")]
        if names_raw := [n for n in ("train.bin", "val.bin") if n in names and not is_shard(os.path.join(d, n))]:
            if names_raw != ["train.bin", "val.bin"] or len(train) != 1 or len(val) != 1:
                raise DataError(f"{d}: {names_raw[0]} has no shard header but is not one of nanoGPT's "
                                f"train.bin + val.bin pair")
            kind = "nanogpt"
        else:
            kind = "llm.c"
    if not train and not val:
        raise DataError(f"{d} holds no token data: looked for prepare.py's tokenizer.json + train_*.bin, llm.c's "
                        f"*train*.bin + *val*.bin shards and nanoGPT's train.bin + val.bin")
    if not train or not val:
        raise DataError(f"{d} holds {'val' if val else 'train'} files but no "
                        f"{'train' if val else 'val'} files (*{'train' if val else 'val'}*.bin)")
    return train, val, _data_tokenizer(d, [d], spec), kind


def open_dataset(data: str, tokenizer: str = "char", saved_tokenizer: dict | None = None,
                 val_data: str = "", check: bool = True) -> Dataset:
    """The train and val streams of `data` (see the module docstring). check=False: without the up-front
    check of the ids against the tokenizer (train.py --plan, which reads no token and writes no file)."""
    data = os.fspath(data)
    spec = tokenizer
    try:
        parse_spec(spec)
    except ValueError as e:
        raise DataError(str(e)) from None
    saved = None
    if saved_tokenizer is not None:
        try:
            saved = tokenizer_from_dict(saved_tokenizer)
        except ValueError as e:
            raise DataError(f"the saved tokenizer of the run being resumed: {e}") from None
    if any(c in data for c in _GLOB_CHARS) or (os.path.isfile(data) and (data.endswith(".bin") or is_shard(data))):
        train, val, tok = _open_glob(data, val_data, spec)
        kind = "shard"
    elif val_data:
        raise DataError(f"val_data is for shard data (a glob or a shard file), but data is {data}")
    elif os.path.isdir(data):
        train, val, tok, kind = _open_dir(data, spec)
    else:
        if saved is not None and spec.strip() != saved.name:
            raise DataError(f"{data}: the run being resumed used tokenizer {saved.name} but tokenizer: {spec} is set")
        return open_text(data, spec, saved)
    if saved is not None and saved != tok:
        what = tok.name if tok.name != saved.name else f"a different {tok.name}"
        raise DataError(f"{data}: the run being resumed used tokenizer {saved.name} ({saved.vocab_size} tokens) "
                        f"but the data's tokenizer is {what} ({tok.vocab_size} tokens)")
    tr, va = _streams(train, val, tok)
    if not check:
        pass
    elif kind == "prepared" and os.path.isfile(os.path.join(data, "prepare.json")):
        check_prepared(data, tok, tr, va)
    else:                                    # token files from elsewhere: their largest ids, scanned once
        check_scanned(tr)
        check_scanned(va)
    return Dataset(tr, va, tok, data, kind)
