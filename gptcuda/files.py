"""Writing files so that a crash never leaves half of one: `atomic_open`, the one way every file is
written atomically here (checkpoints, configs, metrics, tokenizers, shards, llm.c exports, compile
cache entries, the GEMM tune table, the rendezvous file), its leftovers (`temp_files`), the umask
(`current_umask`) that gives new files the permissions a plain open() would, and `DirLock`, one process's
exclusive hold on a run or data directory."""
from __future__ import annotations

import contextlib
import os
import re
import tempfile

from gptcuda.errors import RunError


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
    left as it was (and the directories this made for it removed, if empty); an OSError is re-raised naming `path`
    (not the temp file)."""
    d = os.path.dirname(os.path.abspath(path))
    made, p = None, d                      # the topmost directory this makes
    while not os.path.lexists(p):
        made, p = p, os.path.dirname(p)
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
        q = d
        while made is not None and len(q) >= len(made):     # only the empty ones (another writer's stay)
            try:
                os.rmdir(q)
            except OSError:
                break
            q = os.path.dirname(q)
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


class DirLock:
    """An exclusive lock on a directory for the life of a process: fcntl.flock on `path` (a file inside
    the directory, or beside it where the directory may not exist yet), holding the holder's pid.

    The kernel drops the lock when the process dies (kill -9 included), so a dead holder never blocks;
    `release()` removes the file. Taking a lock that another open file holds raises RunError naming the
    holder's pid (`what` names the directory's role in that line). Invariant: a held DirLock's file is
    the one at `path` (a taker that locked a file its releaser had just removed tries again)."""

    def __init__(self, path: str, what: str):
        import fcntl
        self.path, self.fd = path, None
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666 & ~current_umask())
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                os.close(fd)
                raise RunError(f"{what} is in use by another process (pid {pid}; lock {path}): wait for it to "
                               f"end, or choose another directory") from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self.fd = fd
                return
            os.close(fd)                 # the file was removed by a releasing holder: take the new one
        raise RunError(f"cannot lock {path}: it keeps being replaced")

    def release(self):
        """Remove the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        try:
            self.release()
        except Exception:              # at interpreter exit os may be gone: the kernel drops the lock anyway
            pass
