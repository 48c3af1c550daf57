"""Token shard files: llm.c's data format, read through memory maps.

A shard is a 1024-byte header of 256 little-endian int32, then the tokens, little-endian:

    header[0]   20240520        magic (llm.c's dev/data/data_common.py)
    header[1]   1 or 2          version: 1 = uint16 tokens (llm.c's own, vocabularies up to 65536)
                                         2 = uint32 tokens (our variant, for larger vocabularies)
    header[2]   count           number of tokens that follow (int32: at most 2**31 - 1 a shard)
    header[3:]  0               reserved
    1024 ..     tokens          count x uint16 (v1) or count x uint32 (v2)

So the file size is exactly 1024 + count * itemsize. llm.c's GPT-2 shards (e.g. tiny_shakespeare_train.bin,
fineweb_train_000001.bin) are version 1 and read as they are. (llm.c's Llama 3 shards, magic 20240801, are
not supported.)

nanoGPT's `train.bin` / `val.bin` are raw uint16 tokens with no header (`open_raw`).

Shards are never read whole: `open_shard` and `open_raw` return read-only np.memmap views. Writers go through
a temp file renamed into place (files.atomic_open), so a crash never leaves a half-written shard under
its real name. Every problem with a file is a `DataError` whose message is one line naming the file.
"""
from __future__ import annotations

import os

import numpy as np

from gptcuda.files import atomic_open

__all__ = ["MAGIC", "HEADER_INTS", "HEADER_BYTES", "VERSIONS", "DataError", "write_shard", "open_shard",
           "open_raw", "is_shard", "shard_version"]

MAGIC = 20240520
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {1: np.dtype("<u2"), 2: np.dtype("<u4")}   # version -> token dtype
MAX_COUNT = 2 ** 31 - 1
_WRITE_CHUNK = 1 << 24                                 # tokens converted and written at a time


class DataError(ValueError):
    """Training data that cannot be used; str(err) is one line naming the file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))


def shard_version(vocab_size: int) -> int:
    """1 (uint16) when every id < vocab_size fits 16 bits, else 2 (uint32)."""
    return 1 if vocab_size <= 1 << 16 else 2


def write_shard(path: str | os.PathLike, tokens, vocab_size: int) -> None:
    """Write tokens (any integer array, e.g. a memmap slice) as a shard, atomically.

    Version 1 when vocab_size <= 65536, else 2. Every id must lie in [0, vocab_size)."""
    path = os.fspath(path)
    tokens = np.asarray(tokens).reshape(-1)
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if not 1 <= vocab_size <= 2 ** 32:
        raise DataError(f"{path}: vocab_size {vocab_size} is outside 1..{2 ** 32}")
    n = len(tokens)
    if n > MAX_COUNT:
        raise DataError(f"{path}: {n} tokens is more than a shard's int32 count holds ({MAX_COUNT})")
    version = shard_version(vocab_size)
    dtype = VERSIONS[version]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, version, n
    with atomic_open(path, "wb") as f:
        f.write(header.tobytes())
        for a in range(0, n, _WRITE_CHUNK):
            chunk = tokens[a:a + _WRITE_CHUNK]
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= vocab_size:
                i = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
                raise DataError(f"{path}: token id {int(chunk[i])} at position {a + i} is outside the "
                                f"vocabulary (0..{vocab_size - 1})")
            f.write(chunk.astype(dtype, copy=False).tobytes())


def _size(path: str) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"token file not found: {path}") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file")
    return st.st_size


def is_shard(path: str | os.PathLike) -> bool:
    """Whether the file starts with the shard magic (False for a missing or short file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and int.from_bytes(head, "little", signed=True) == MAGIC


def _memmap(path: str, dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:          # mmap cannot map zero bytes
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def open_shard(path: str | os.PathLike) -> np.ndarray:
    """The shard's tokens as a read-only memmap (uint16 for version 1, uint32 for version 2)."""
    path = os.fspath(path)
    size = _size(path)
    if size < HEADER_BYTES:
        raise DataError(f"{path}: {size} bytes is too small for a shard header ({HEADER_BYTES} bytes)")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, count = (int(x) for x in header[:3])
    if magic != MAGIC:
        raise DataError(f"{path}: wrong magic {magic} (want {MAGIC}): not a token shard")
    if version not in VERSIONS:
        raise DataError(f"{path}: version {version} (known: 1 uint16, 2 uint32)")
    if count < 0:
        raise DataError(f"{path}: header says {count} tokens")
    dtype = VERSIONS[version]
    if size - HEADER_BYTES != count * dtype.itemsize:
        raise DataError(f"{path}: header says {count} tokens ({count * dtype.itemsize} bytes) but the file holds "
                        f"{size - HEADER_BYTES} bytes of tokens")
    return _memmap(path, dtype, HEADER_BYTES, count)


def open_raw(path: str | os.PathLike, dtype=np.uint16) -> np.ndarray:
    """nanoGPT's headerless train.bin / val.bin (uint16 tokens) as a read-only memmap."""
    path = os.fspath(path)
    dtype = np.dtype(dtype).newbyteorder("<")
    size = _size(path)
    if size % dtype.itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype.itemsize}-byte tokens")
    return _memmap(path, dtype, 0, size // dtype.itemsize)
