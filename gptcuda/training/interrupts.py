"""SIGINT and SIGTERM during training: held back inside a step or a checkpoint write (`Signals.critical`),
and, in a data-parallel run, only noted (`deferred`) until every rank agrees at a step boundary to stop."""
from __future__ import annotations

import contextlib
import signal
import threading

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}        # 128 + the signal, as a shell reports it


class Signals:
    """SIGINT and SIGTERM as KeyboardInterrupt, remembering which came first (`signum`).

    Inside `critical()` (a training step with its log record, a checkpoint write) a signal is held back
    and raised when the section ends, so that a step either happened or did not; once `stopping` (the
    interrupt's own checkpoint is being written) further signals are only noted. `deferred` (data
    parallel): a signal is only noted, never raised; the loop asks every rank at each step boundary
    (DataParallel.any_rank) and all stop there together."""

    def __init__(self, deferred: bool = False):
        self.deferred = deferred
        self.signum = None
        self.agreed = False              # every rank voted to stop here (data parallel)
        self.depth = 0
        self.pending = False
        self.stopping = False
        self._old = {}

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handler)

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def _handler(self, signum, frame):
        if self.signum is None:
            self.signum = signum
        if self.stopping or self.depth or self.deferred:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.depth == 0 and self.pending and not self.stopping and not self.deferred:
            self.pending = False
            raise KeyboardInterrupt
