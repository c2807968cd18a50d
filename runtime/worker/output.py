"""A worker's stdout and stderr: everything written to file descriptors 1 and 2 (by Python or C code)
goes to the controller, tagged with the call it was written during."""

from __future__ import annotations

import codecs
import io
import os
import select
import sys
import threading
from typing import Any

from monarch.runtime.wire import protocol


class Output:
    """Forwards file descriptors 1 and 2 to the controller; `flush()` before each reply keeps a call's
    output ahead of its result."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.lock = threading.Lock()
        self.streams: dict[int, tuple[str, Any]] = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.streams[r] = (name, codecs.getincrementaldecoder("utf-8")("replace"))
        sys.stdout, sys.stderr = _Stream(1), _Stream(2)
        self._pending = select.poll()  # is anything written and not yet sent? (one system call)
        for fd in self.streams:
            self._pending.register(fd, select.POLLIN)
        threading.Thread(target=self._loop, name="monarch-output", daemon=True).start()

    def _loop(self) -> None:
        fds = list(self.streams)
        while fds:
            ready, _, _ = select.select(fds, [], [])
            with self.lock:
                fds = [fd for fd in fds if self._drain(fd) or fd not in ready]

    def _drain(self, fd: int) -> bool:
        name, decoder = self.streams[fd]
        chunks = []
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                return False
            chunks.append(data)
        text = decoder.decode(b"".join(chunks)) if chunks else ""
        if text:
            self.worker.send(protocol.Output(self.worker.call_id, name, text))
        return True

    def flush(self) -> None:
        """Send everything written so far; called before each reply so output precedes it (any thread: an
        actor's `async def` endpoint answers from the event loop's)."""
        if not self.streams:
            return
        for f in (sys.stdout, sys.stderr):
            if type(f) is _Stream:  # ours say whether they hold anything; a stream the user set is flushed
                if not f.written:
                    continue
                f.written = False
            try:
                f.flush()
            except (OSError, ValueError, AttributeError):
                pass
        with self.lock:  # even with nothing ready: the output thread may hold text it read but has not sent
            for fd, _ in self._pending.poll(0):  # (under the lock: a poll object takes one caller at a time)
                self._drain(fd)


class _Stream(io.TextIOWrapper):
    """`sys.stdout` / `sys.stderr` on a worker: line-buffered onto file descriptor 1 or 2, and
    remembering whether it was written to, so that a call's end flushes only what needs it."""

    written = False

    def __init__(self, fd: int):
        super().__init__(
            io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
        )

    def write(self, s: str) -> int:
        self.written = True
        return super().write(s)
