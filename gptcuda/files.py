"""Writing files so that a crash never leaves half of one: `atomic_open`, the one way every file is
written atomically here (checkpoints, configs, metrics, tokenizers, shards, llm.c exports, compile
cache entries, the GEMM tune table, the rendezvous file), its leftovers (`temp_files`), and the umask
(`current_umask`) that gives new files the permissions a plain open() would."""
from __future__ import annotations

import contextlib
import os
import re
import tempfile


def current_umask() -> int:
    """The process's umask, read without changing it where /proc allows (threads may be creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.[A-Za-z0-9_]{6,}\.tmp$")   # atomic_open's temporary files


def temp_files(directory: str, names) -> list[str]:
    """atomic_open's leftover temporary files (".NAME.XXXXXXXX.tmp") of the given names in directory:
    what a killed writer (SIGKILL, a power cut) leaves behind."""
    names = set(names)
    try:
        entries = os.listdir(directory)
    except OSError:
        return []
    out = []
    for n in sorted(entries):
        m = TEMP_PATTERN.match(n)
        if m and m.group("name") in names and os.path.isfile(os.path.join(directory, n)):
            out.append(os.path.join(directory, n))
    return out


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", sync_dir: bool = False):
    """A file to write `path` through: a temp file beside it, fsync'd and renamed over it on success.

    The file gets the permissions a plain open() would (0o666 less the umask; mkstemp makes 0600).
    On any failure (an OSError such as ENOSPC, an interrupt) the temp file is removed and `path` is
    left as it was; an OSError is re-raised naming `path` (not the temp file)."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    except OSError as e:
        raise type(e)(e.errno, e.strerror, path) from None
    try:
        try:
            os.fchmod(fd, 0o666 & ~current_umask())
        except OSError:
            pass
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise type(e)(e.errno, e.strerror, path) from None
        raise
    if sync_dir:
        try:  # make the rename itself durable
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass
