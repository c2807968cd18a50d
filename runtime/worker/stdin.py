"""Stdin on workers: `input()`, `sys.stdin` and pdb ask the controller for each line.

The controller answers from its own stdin: the notebook's input box in a kernel, the terminal in
a script. `breakpoint()` and `pdb.set_trace()` open a pdb whose prompt is served that way, one
paused rank at a time (in a script, by the `monarch debug` client, any rank in any order).

Post-mortem, as Monarch does it: user code (an actor endpoint, a live function, a `%%mesh` cell) that
raises after a pdb prompt of this rank was answered while it ran stops once more, in pdb at the frame
that raised (`post_mortem_if_debugged`, called by the worker where it catches the error); `c` or `q`
there lets the error go on to the caller. Code that never stopped in pdb is never held: an error goes
straight to the caller, as it always did.
"""

from __future__ import annotations

import asyncio
import bdb
import builtins
import concurrent.futures
import io
import multiprocessing
import os
import pdb
import sys
import threading
from typing import Any

from monarch.runtime.common.errors import cell_frame, cell_name
from monarch.runtime.wire import debug as debugwire


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


answered = 0
"""How many times a pdb prompt on this worker was answered with a command that resumed the code (`c`, `n`,
...). The worker reads it as user code starts; a different count when that code raises means that someone
debugged it, and it stops post-mortem (`post_mortem_if_debugged`). An actor message puts back the count it
started with as it ends, so that a message served while another waits (an actor calling an actor) does not
count as the waiting one's debugging."""


class WorkerPdb(pdb.Pdb):
    """pdb for workers: an interrupt while paused ends the debugged code instead of re-prompting."""

    def __init__(self, failure: BaseException | None = None) -> None:
        super().__init__(nosigint=True)  # the worker's SIGINT handler raises KeyboardInterrupt
        self.failure = failure
        """The error this pdb is the post-mortem of; None at a breakpoint."""

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

    def do_clear_continue(self, arg: str) -> bool | None:
        """clear_continue
        Clear every breakpoint, then continue: what 'continue' at monarch debug's prompt sends each
        paused rank (as Monarch's does)."""
        self.clear_all_breaks()
        return self.do_continue(arg)

    def _cmdloop(self) -> None:
        global _active, answered
        _active = self
        if _worker is not None:
            _worker.in_debugger = True
        try:
            self.cmdloop()
            answered += 1  # (after the command that resumed: a prompt that failed, or was interrupted, is not)
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
_RUNNERS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (asyncio, concurrent.futures)) + (
    os.path.abspath(threading.__file__),
)
"""What runs an `async def` endpoint below its code: the actors' event loop, its thread, the future waited on."""


def _plumbing(filename: str) -> bool:
    """Whether a frame of `filename` is the worker's machinery (the fork server, the runtime, what runs an async
    endpoint), not user code."""
    return filename == "<string>" or filename.startswith((_RUNTIME + os.sep, _MULTIPROCESSING + os.sep, *_RUNNERS))


def paused_at() -> str:
    """Where this worker's pdb stopped (the frame `up`/`down` selected): ``Cell In[5], line 4`` in a
    `%%mesh` cell, else ``file.py:12``, followed by ``(post-mortem: ValueError: bad rank)`` in a post-mortem
    (`debugwire.post_mortem_note`); "" when it is not paused."""
    frame = getattr(_active, "curframe", None)
    if frame is None:
        return ""
    line = _active.tb_lineno.get(frame, frame.f_lineno) if _active is not None else frame.f_lineno
    filename = frame.f_code.co_filename
    cell = cell_name(filename)
    where = f"{cell}, line {line}" if cell else f"{os.path.basename(filename)}:{line}"
    failure = getattr(_active, "failure", None)
    if failure is not None:
        where += " " + debugwire.post_mortem_note(f"{type(failure).__name__}: {failure}")
    return where


_POST_MORTEM = "_monarch_post_mortem"
"""Set on an error once its post-mortem ran: the worker's outer catch (a call that ran an endpoint) skips it."""


def post_mortem_if_debugged(error: Exception, seen: int) -> None:
    """Where the worker catches an error of user code: if a pdb prompt of this worker was answered since that
    code started (`answered` was `seen` then), stop in pdb post-mortem at the frame that raised, as Monarch
    does after a breakpoint; return once it is continued (`c`, `q`), for the error to go on to the caller.
    `q` at a breakpoint (`BdbQuit`) and code nobody debugged return at once."""
    if answered == seen or isinstance(error, bdb.BdbQuit) or getattr(error, _POST_MORTEM, False):
        return
    try:
        setattr(error, _POST_MORTEM, True)
    except Exception:  # (an error class that takes no attributes: an outer catch may stop once more)
        pass
    sys.settrace(None)  # a pdb still stepping (`n` past the raise) must not trace this one's code
    debugger = WorkerPdb(failure=error)
    debugger.message(f"post-mortem: {type(error).__name__}: {error} ('c' or 'q' lets the error go on)")
    debugger.reset()
    try:
        debugger.interaction(None, error.__traceback__)
    except Exception:  # no prompt can be served now (no stdin, the mesh stopping): the error goes on
        pass


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
