"""A worker's control thread: answers the controller while the main thread is busy, even stuck in C code
(a collective waiting for a rank that failed), where no Python signal handler ever runs.

The controller writes a request into this rank's record of the slot file and sends SIGUSR1; the thread
waits for that signal with `sigwait` (the signal is blocked in every other thread), reads the request
and looks at what the main thread is doing:

- RELEASE: if it waits in a torch.distributed collective, shut this worker's connections to the other
  workers down, so that the collective raises here and on its peers; report `Released`;
- REPORT (or RELEASE while not in a collective): report `Busy` with the user's line it is at.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import traceback
from types import FrameType
from typing import Any

from monarch.runtime import protocol

_REQUEST = struct.Struct("<qqq")
_RUNTIME = os.path.dirname(os.path.dirname(__file__))
_WRAPPERS = {"wrapper", "inner", "_fn", "decorated"}


def block_signal() -> None:
    """Block SIGUSR1 in this thread and every thread it starts later (call first thing in a worker):
    only the control thread takes it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


class Control:
    def __init__(self, worker: Any, slots: Any) -> None:
        self.worker = worker
        self.slots = slots
        self.offset = protocol.SLOT * worker.rank + 8
        self.seen = 0
        self.main = threading.main_thread().ident
        threading.Thread(target=self._loop, name="monarch-control", daemon=True).start()

    def _loop(self) -> None:
        while True:
            signal.sigwait({signal.SIGUSR1})
            seq, call_id, kind = _REQUEST.unpack_from(self.slots, self.offset)
            if seq == self.seen:
                continue
            self.seen = seq
            try:
                self._handle(call_id, kind)
            except Exception:  # a bug of ours: say so, keep serving
                traceback.print_exc()

    def _handle(self, call_id: int, kind: int) -> None:
        from monarch.runtime.worker import groups

        w = self.worker
        if call_id and w.call_id != call_id:
            return  # that call is over here (the request crossed its reply)
        collective, where = describe(sys._current_frames().get(self.main))
        if kind == protocol.RELEASE and collective and w.released is None and groups.current is not None:
            w.released = (collective, where)
            # said before it is done: the call's reply (its collective raises at once) must come after this
            w.send(protocol.Released(call_id, collective, where, len(groups.current.users())))
            groups.current.release()
        else:
            w.send(protocol.Busy(w.call_id, where, collective))


def describe(frame: FrameType | None) -> tuple[str, str]:
    """(the torch.distributed function the thread waits in, or "", the user's line it is at)."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    collective, outer = "", 0  # frames[0] is the innermost
    for i, f in enumerate(frames):
        filename = f.f_code.co_filename
        if os.path.join("torch", "distributed") in filename:
            name = f.f_code.co_name
            if name not in _WRAPPERS and not name.startswith("_"):
                collective, outer = name, i
    for f in frames[outer:]:
        filename = f.f_code.co_filename
        if filename.startswith((torch_dir, _RUNTIME)) or filename == threading.__file__:
            continue
        return collective, where(filename, f.f_lineno, f.f_code.co_name)
    return collective, "?"


def where(filename: str, line: int, func: str) -> str:
    """A line as a notebook user reads it: `Cell In[5], line 4` for a %%mesh cell."""
    if filename.startswith("<mesh cell "):
        return f"Cell In[{filename[len('<mesh cell ') : -1]}], line {line}" + (
            "" if func == "<module>" else f" in {func}"
        )
    return f"{filename}:{line} in {func}"
