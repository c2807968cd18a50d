"""Stdin on workers: `input()`, `sys.stdin` and pdb ask the controller for each line.

The controller answers from its own stdin: the notebook's input box in a kernel, the terminal in
a script. `breakpoint()` and `pdb.set_trace()` open a pdb whose prompt is served that way, one
paused rank at a time (in a script, by the `monarch debug` client, any rank in any order).
"""

from __future__ import annotations

import builtins
import io
import multiprocessing
import os
import pdb
import sys
from typing import Any

from monarch.runtime.common.errors import cell_frame, cell_name


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

    def setup(self, f: Any, tb: Any) -> Any:
        """As pdb's, with the frames above the user's code (the fork server's, the runtime's) left out of
        `where`, `up` and `down`."""
        done = super().setup(f, tb)
        first = next((i for i, (frame, _) in enumerate(self.stack) if not _plumbing(frame.f_code.co_filename)), 0)
        if 0 < first <= self.curindex:
            del self.stack[:first]
            self.curindex -= first
        return done

    def format_stack_entry(self, frame_lineno: tuple[Any, int], lprefix: str = ": ") -> str:
        """As pdb's, with a frame of a `%%mesh` cell named as IPython names it: ``Cell In[5], line 4`` (``,
        in f()`` inside a function) instead of ``<mesh cell 5>(4)<module>()``."""
        text = super().format_stack_entry(frame_lineno, lprefix)
        frame, line = frame_lineno
        filename, func = self.canonic(frame.f_code.co_filename), frame.f_code.co_name or "<lambda>"
        cell, head = cell_frame(filename, line, func), f"{filename}({line}){func}"
        if cell is None or not text.startswith(head):
            return text
        rest = text[len(head) :]
        return cell + (rest[2:] if func == "<module>" and rest.startswith("()") else rest)

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


_RUNTIME = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MULTIPROCESSING = os.path.dirname(os.path.abspath(multiprocessing.__file__))


def _plumbing(filename: str) -> bool:
    """Whether a frame of `filename` is the worker's machinery (the fork server, the runtime), not user code."""
    return filename == "<string>" or filename.startswith((_RUNTIME + os.sep, _MULTIPROCESSING + os.sep))


def paused_at() -> str:
    """Where this worker's pdb stopped (the frame `up`/`down` selected): ``Cell In[5], line 4`` in a
    `%%mesh` cell, else ``file.py:12``; "" when it is not paused."""
    frame = getattr(_active, "curframe", None)
    if frame is None:
        return ""
    filename, line = frame.f_code.co_filename, frame.f_lineno
    cell = cell_name(filename)
    return f"{cell}, line {line}" if cell else f"{os.path.basename(filename)}:{line}"


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
