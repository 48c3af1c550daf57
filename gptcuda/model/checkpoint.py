"""Single-file checkpoints: named numpy arrays plus JSON metadata, checksummed. The training loop writes
them (gptcuda/training/trainer.py); interop and generation read them (gptcuda/interop/run.py).

Layout (all integers little-endian):

    b"GPTCUDA\\0"                       8 bytes magic
    header_len                         uint64
    header                             header_len bytes of UTF-8 JSON:
        {"version": 1, "meta": {...},
         "arrays": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],
         "sha256": hex}
    zero padding, then each array's raw bytes at its `offset` (from the start
    of the file, 64-byte aligned), zero padding between arrays.

The sha256 covers the header (serialised canonically without its "sha256" field)
and every byte from the data start to the end of the file, so any flipped bit, in the metadata or the
tensors, and any truncation is reported as corruption. Files are written to a
temporary file in the same directory, fsync'd and renamed over the target, so a
crash never leaves a half-written checkpoint under the real name (gptcuda/files.py atomic_open).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any, Mapping

import numpy as np

from gptcuda.files import atomic_open

__all__ = ["FORMAT_VERSION", "MAGIC", "CheckpointError", "save_checkpoint", "load_checkpoint",
           "read_checkpoint_meta"]

FORMAT_VERSION = 1
MAGIC = b"GPTCUDA\0"
ALIGN = 64
_PREFIX = len(MAGIC) + 8


class CheckpointError(Exception):
    """A checkpoint that cannot be written or read; str(err) is one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _canonical(header: dict) -> bytes:
    """Compact key-sorted JSON: the header as stored, and (without "sha256") what the checksum covers."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _layout(arrays: Mapping[str, np.ndarray]):
    """Contiguous arrays and their table entries; offsets relative to the data start."""
    items, table, pos = [], [], 0
    for name, a in arrays.items():
        if not isinstance(name, str):
            raise CheckpointError(f"array names must be strings, got {name!r}")
        a = np.asarray(a)
        if not a.flags.c_contiguous:
            a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise CheckpointError(f"array {name!r} has unsupported dtype {a.dtype}")
        pos = _align(pos)
        table.append({"name": name, "dtype": a.dtype.str, "shape": list(a.shape),
                      "offset": pos, "nbytes": int(a.nbytes)})
        items.append(a)
        pos += a.nbytes
    return items, table, pos


def _data_start(header_len: int) -> int:
    return _align(_PREFIX + header_len)


def _bytes(a: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array, as a flat uint8 view (any dtype)."""
    return a.reshape(-1).view(np.uint8)


def _serialise(arrays: Mapping[str, np.ndarray], meta: dict):
    """Returns (header bytes, data start, array list, table with absolute offsets)."""
    items, table, _ = _layout(arrays)
    try:
        json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint meta is not JSON-serialisable: {e}") from None
    rel = [e["offset"] for e in table]
    # Absolute offsets depend on the header length, which depends on the offsets:
    # iterate to a fixed point with a placeholder digest (a hex sha256 is always 64 chars).
    base = 0
    for _ in range(16):
        for e, r in zip(table, rel):
            e["offset"] = base + r
        body = {"version": FORMAT_VERSION, "meta": meta, "arrays": table}
        start = _data_start(len(_canonical({**body, "sha256": "0" * 64})))
        if start == base:
            break
        base = start
    else:  # pragma: no cover
        raise CheckpointError("could not lay out checkpoint header")
    h = hashlib.sha256(_canonical(body))
    for chunk in _data_chunks(items, table, start):
        h.update(chunk)
    header = _canonical({**body, "sha256": h.hexdigest()})
    assert _data_start(len(header)) == start
    return header, start, items, table


def _data_chunks(items, table, start: int):
    """The file's bytes from the data start on: each array's zero padding, then its bytes."""
    pos = start
    for a, e in zip(items, table):
        if e["offset"] > pos:
            yield b"\0" * (e["offset"] - pos)
        if a.nbytes:
            yield _bytes(a)
        pos = e["offset"] + e["nbytes"]


def save_checkpoint(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], meta: dict) -> None:
    """Write arrays and meta to `path` atomically (temp file, fsync, os.replace)."""
    path = os.fspath(path)
    header, start, items, table = _serialise(arrays, meta)
    with atomic_open(path, "wb", sync_dir=True) as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        f.write(b"\0" * (start - _PREFIX - len(header)))
        for chunk in _data_chunks(items, table, start):
            f.write(chunk)


def _read_header(path: str, f, size: int) -> dict:
    prefix = f.read(_PREFIX)
    if len(prefix) < len(MAGIC) or prefix[:len(MAGIC)] != MAGIC:
        if len(prefix) < len(MAGIC) and MAGIC.startswith(prefix) and prefix:
            raise CheckpointError(f"checkpoint {path} is corrupt (truncated: {size} bytes)")
        raise CheckpointError(f"{path} is not a gptcuda checkpoint (bad magic bytes)")
    if len(prefix) < _PREFIX:
        raise CheckpointError(f"checkpoint {path} is corrupt (truncated: {size} bytes)")
    (hlen,) = struct.unpack("<Q", prefix[len(MAGIC):])
    if _PREFIX + hlen > size:
        raise CheckpointError(f"checkpoint {path} is corrupt (truncated: header of {hlen} bytes, "
                              f"file of {size} bytes)")
    raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"checkpoint {path} is corrupt (unreadable header)") from None
    if not isinstance(header, dict) or not isinstance(header.get("version"), int):
        raise CheckpointError(f"checkpoint {path} is corrupt (header has no format version)")
    if header["version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {header['version']}, "
                              f"this build reads {FORMAT_VERSION}")
    if not isinstance(header.get("arrays"), list) or not isinstance(header.get("sha256"), str) \
            or "meta" not in header:
        raise CheckpointError(f"checkpoint {path} is corrupt (incomplete header)")
    header["_hlen"] = hlen
    return header


def _open(path: str):
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint not found: {path}") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint path is a directory: {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot open checkpoint {path}: {e.strerror}") from None


def read_checkpoint_meta(path: str | os.PathLike) -> dict:
    """The meta dict only (header checks, no checksum pass over the tensors)."""
    path = os.fspath(path)
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        return _read_header(path, f, size)["meta"]


def load_checkpoint(path: str | os.PathLike, expected: Mapping[str, tuple] | None = None
                    ) -> tuple[dict[str, np.ndarray], Any]:
    """(arrays, meta) from `path`; verifies magic, version, checksum and, if given, shapes.

    `expected` maps every tensor name the caller needs to its shape; a missing or
    extra tensor, or a different shape, raises CheckpointError.
    """
    path = os.fspath(path)
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        header = _read_header(path, f, size)
        hlen = header.pop("_hlen")
        start = _data_start(hlen)
        f.seek(0)
        buf = f.read()
    if len(buf) != size:
        raise CheckpointError(f"checkpoint {path} changed while being read")

    sha = header.pop("sha256")
    canonical = _canonical(header)  # before the table below is normalised
    table = header["arrays"]
    end = start
    try:
        for e in table:
            if not isinstance(e.get("name"), str) or not isinstance(e.get("offset"), int) \
                    or not isinstance(e.get("nbytes"), int):
                raise ValueError
            if np.dtype(e["dtype"]).hasobject:
                raise ValueError
            e["dtype"] = np.dtype(e["dtype"]).str
            e["shape"] = [int(s) for s in e["shape"]]
            if any(s < 0 for s in e["shape"]) or int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(e["dtype"]).itemsize != e["nbytes"] \
                    or e["offset"] < end:
                raise ValueError
            end = e["offset"] + e["nbytes"]
    except (AttributeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint {path} is corrupt (bad array table)") from None
    if size < end:
        raise CheckpointError(f"checkpoint {path} is corrupt (truncated: {size} of {end} bytes)")
    if size > end:
        raise CheckpointError(f"checkpoint {path} is corrupt ({size - end} unexpected trailing bytes)")
    h = hashlib.sha256(canonical)
    h.update(memoryview(buf)[start:])
    if h.hexdigest() != sha:
        raise CheckpointError(f"checkpoint {path} is corrupt (sha256 checksum mismatch)")
    if buf[_PREFIX + hlen:start].strip(b"\0"):
        raise CheckpointError(f"checkpoint {path} is corrupt (garbage after header)")

    names = [e["name"] for e in table]
    if len(set(names)) != len(names):
        raise CheckpointError(f"checkpoint {path} is corrupt (duplicate tensor names)")
    if expected is not None:
        _check_expected(path, {e["name"]: tuple(e["shape"]) for e in table}, expected)

    arrays: dict[str, np.ndarray] = {}
    for e in table:
        dt = np.dtype(e["dtype"])
        if e["nbytes"] == 0:
            a = np.empty(e["shape"], dtype=dt)
        else:
            a = np.frombuffer(buf, dtype=dt, count=e["nbytes"] // dt.itemsize,
                              offset=e["offset"]).reshape(e["shape"]).copy()
        arrays[e["name"]] = a
    return arrays, header["meta"]


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_expected(path: str, have: dict[str, tuple], expected: Mapping[str, tuple]) -> None:
    for name, shape in expected.items():
        if name not in have:
            raise CheckpointError(f"checkpoint {path} lacks tensor {name!r} of shape {_fmt(shape)}: "
                                  f"from another model shape?")
        if tuple(int(s) for s in have[name]) != tuple(int(s) for s in shape):
            raise CheckpointError(f"checkpoint {path} tensor {name!r} has shape {_fmt(have[name])} but "
                                  f"this model expects {_fmt(shape)}: from another model shape")
    extra = [n for n in have if n not in expected]
    if extra:
        raise CheckpointError(f"checkpoint {path} has tensor {extra[0]!r} of shape {_fmt(have[extra[0]])} "
                              f"that this model lacks: from another model shape?")
