"""Stdin on workers: `input()`, `sys.stdin` and pdb ask the controller for each line.

The controller answers from its own stdin: the notebook's input box in a kernel, the terminal in
a script. `breakpoint()` and `pdb.set_trace()` open a pdb whose prompt is served that way, one
paused rank at a time (in a script, by the `monarch debug` client, any rank in any order).
"""

from __future__ import annotations

import builtins
import io
import os
import pdb
import sys
from typing import Any


class RemoteStdin(io.TextIOBase):
    """`sys.stdin` on a worker: each `readline()` is one request to the controller."""

    def __init__(self, worker: Any):
        self._worker = worker

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return self._worker.request_input("") + "\n"

    def read(self, size: int | None = -1) -> str:
        return self.readline()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


_worker: Any = None
"""The worker whose stdin this is (set by `install`)."""


class WorkerPdb(pdb.Pdb):
    """pdb for workers: an interrupt while paused ends the debugged code instead of re-prompting."""

    def __init__(self) -> None:
        super().__init__(nosigint=True)  # the worker's SIGINT handler raises KeyboardInterrupt

    def _cmdloop(self) -> None:
        global _active
        _active = self
        if _worker is not None:
            _worker.in_debugger = True
        try:
            self.cmdloop()
        except KeyboardInterrupt:
            self.set_quit()  # stop tracing, then let the interrupt end the user's code
            raise
        finally:
            _active = None
            if _worker is not None:
                _worker.in_debugger = False


_active: WorkerPdb | None = None
"""The pdb reading commands on this worker now, if any."""


def paused_at() -> str:
    """Where this worker's pdb stopped, as ``file.py:12`` (the frame `up`/`down` selected), or ""."""
    frame = getattr(_active, "curframe", None)
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def set_trace(*, header: str | None = None) -> None:
    """`pdb.set_trace()` on a worker."""
    debugger = WorkerPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


def breakpointhook(*args: Any, **kwargs: Any) -> None:
    """`breakpoint()` on a worker."""
    WorkerPdb().set_trace(sys._getframe().f_back)


def install(worker: Any) -> None:
    """Route this worker's stdin, `input()` and pdb through the controller."""
    global _worker
    _worker = worker

    def remote_input(prompt: object = "") -> str:
        sys.stdout.flush()
        return worker.request_input(str(prompt))

    sys.stdin = RemoteStdin(worker)
    builtins.input = remote_input
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
