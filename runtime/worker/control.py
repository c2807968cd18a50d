"""A worker's control thread: answers the controller while the main thread is busy, even stuck in C code
(a collective waiting for a rank that failed), where no Python signal handler ever runs.

The controller writes a request into this rank's record of the slot file and sends SIGUSR1; the thread
waits for that signal with `sigwait` (the signal is blocked in every other thread), reads the request
and looks at what the main thread is doing:

- RELEASE: if it waits in a torch.distributed collective, shut this worker's connections to the other
  workers down, so that the collective raises here and on its peers; report `Released`;
- REPORT (or RELEASE while not in a collective): report `Busy` with the user's line it is at;
- DISCONNECT (this rank answered a call others still wait in): shut its groups' connections, silently;
- STACKS: send every thread's stack (`Stacks`), for `mesh.stacks()`.

A rank whose peer was released first sees its collective fail (the connections shut) perhaps before its
own control thread has run: the main thread then claims the release itself (`claim_release`).
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import threading
import time
import traceback
from types import CodeType, FrameType, TracebackType
from typing import Any

from monarch.runtime.common import log
from monarch.runtime.common.errors import PEER_GONE
from monarch.runtime.common.stacks import thread_stacks, where
from monarch.runtime.wire import protocol

_log = log.get("worker")
_REQUEST = struct.Struct("<qqq")
_RUNTIME = os.path.dirname(os.path.dirname(__file__))
_WRAPPERS = {"wrapper", "inner", "_fn", "decorated"}
anywhere: tuple[int, str] | None = None
"""(call id, what it runs) of a call whose every wait is on its peers, wherever its main thread is (a torchrun
script run by `SPMDActor.main`: DDP waits in C++, with no torch.distributed frame on the stack): asked to
RELEASE, it is released from wherever it is, as torchrun ends every rank when one fails."""
PEER_WAIT = 2.0
"""Seconds a rank whose collective failed on a closed connection waits for the controller to say it was released.
On one host the request is there before any peer can close a connection (`WorkerProcs.control` writes every
rank's before it wakes any); across hosts it comes through each host's agent, at once. The bound is reached only
where the peer really died, which the controller tells anyway."""


def _groups() -> Any:
    """This worker's process groups (`groups.current`), or None (torch not set up here: a worker that has run
    only actors)."""
    module = sys.modules.get("monarch.runtime.worker.groups")
    return module.current if module is not None else None


def _code_groups() -> list[Any] | None:
    """Where the mesh's groups were never set up here (a worker of actors): the groups code made itself
    (torchrun-style), [] if it made none; None where torch is not even imported (no collective to leave)."""
    if "torch.distributed" not in sys.modules:
        return None
    from monarch.runtime.worker import groups  # (torch is imported already: cheap)

    return groups.users_groups()


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
        self._claim = threading.Lock()
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
        groups = _groups()
        w = self.worker
        if kind == protocol.Control.STACKS:  # (its "call id" is the request's number)
            threads = thread_stacks(skip=threading.get_ident())
            if threads and threads[0][0] == "MainThread":
                if w.call_id is None:
                    threads[0] = ("MainThread", [])  # idle: waiting for the controller
                elif not threads[0][1]:
                    threads[0] = ("MainThread", [("in monarch's runtime, starting or ending a call", "")])
            w.send(protocol.Stacks(call_id, threads))
            return
        if kind == protocol.Control.DISCONNECT:  # (its "call id" is the groups' generation the request is for)
            if groups is not None:
                groups.release_generation(call_id)
            return
        # The groups' generation before the call is seen running: the main thread re-forms them only after
        # the call ended here, so while it runs this is the call's (a release that comes late must not
        # break the groups re-formed since).
        generation = groups.generation if groups is not None else 0
        if call_id and w.call_id != call_id:
            return  # that call is over here (the request crossed its reply)
        collective, where = describe(sys._current_frames().get(self.main))
        if kind == protocol.Control.RELEASE and not collective and anywhere is not None and anywhere[0] == call_id:
            collective = anywhere[1]
        releasable = groups is not None or _code_groups() is not None
        released = kind == protocol.Control.RELEASE and collective and releasable
        if not (released and self._release(call_id, collective, where, generation)):
            w.send(protocol.Busy(w.call_id, where, collective))

    def _release(self, call_id: int, collective: str, where: str, generation: int) -> bool:
        """Release this rank from `collective`, once per call: the control thread and the main thread
        (`claim_release`) may both come here. False where the other already did."""
        groups = _groups()
        with self._claim:
            if self.worker.released is not None:
                return False
            self.worker.released = (collective, where)
        _log.info("call %d: released from %s at %s (another rank failed)", call_id, collective, where)
        made = groups.users() if groups is not None else _code_groups() or []
        # said before it is done: the call's reply (its collective raises at once) must come after this
        self.worker.send(protocol.Released(call_id, collective, where, name_groups(made)))
        if groups is not None:
            groups.release_generation(generation)
        else:
            from monarch.runtime.worker import groups as module

            module.shut(made)
        return True

    def claim_release(self, call_id: int, error: BaseException, wait: float = PEER_WAIT) -> bool:
        """The main thread's call failed in a collective: if the controller asked this rank to leave it (a
        peer, released first, shut its connections before this rank's control thread ran), it was released,
        not failed. A collective that failed because a peer's connection closed waits for the request (the
        controller asks every busy rank in one step; across hosts it comes through each host's agent) up to
        `wait` seconds, which only a peer that really died uses up; any other error is this rank's own."""
        groups = _groups()
        collective, where = describe_traceback(error.__traceback__)
        if not collective and anywhere is not None and anywhere[0] == call_id:
            collective = anywhere[1]
        if not collective or self.worker.released is not None or (groups is None and _code_groups() is None):
            return False
        generation = groups.generation if groups is not None else 0
        deadline = time.monotonic() + (wait if PEER_GONE.search(str(error)) else 0.0)
        pause = 0.001
        while True:
            _, asked, kind = _REQUEST.unpack_from(self.slots, self.offset)
            if asked == call_id and kind == protocol.Control.RELEASE:
                return self._release(call_id, collective, where, generation) or self.worker.released is not None
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


def name_groups(made: list[Any]) -> list[str]:
    """Groups user code made, as the user knows them: the names they have in the `%%mesh` cells' namespace
    (a group, or a DeviceMesh holding it), else their ranks."""
    import torch.distributed as dist

    from monarch.runtime.common import context
    from monarch.runtime.common.shape import format_ranks

    holders: dict[int, str] = {}
    for name, value in list((context.cell_namespace or {}).items()):
        if isinstance(value, dist.ProcessGroup):
            holders.setdefault(id(value), f"{name} (ranks {format_ranks(dist.get_process_group_ranks(value))})")
        elif type(value).__name__ == "DeviceMesh":
            try:
                mesh_groups = value.get_all_groups()
            except Exception:
                continue
            for g in mesh_groups:
                holders.setdefault(id(g), f"{name} (a DeviceMesh)")
    out: list[str] = []
    for g in made:
        text = holders.get(id(g)) or f"a group of ranks {format_ranks(dist.get_process_group_ranks(g))}"
        if text not in out:
            out.append(text)
    return out


def describe(frame: FrameType | None) -> tuple[str, str]:
    """(the torch.distributed function the thread waits in, or "", the user's line it is at)."""
    frames = []
    while frame is not None:
        frames.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return _describe(frames)


def describe_traceback(tb: TracebackType | None) -> tuple[str, str]:
    """`describe` for where an exception was raised."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    return _describe(frames[::-1])


def _describe(frames: list[tuple[CodeType, int]]) -> tuple[str, str]:
    """`describe` of frames given innermost first, as (code, line)."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    collective, outer = "", 0
    for i, (code, _) in enumerate(frames):
        if os.path.join("torch", "distributed") in code.co_filename:
            name = code.co_name
            if name not in _WRAPPERS and not name.startswith("_"):
                collective, outer = name, i
    for code, line in frames[outer:]:
        filename = code.co_filename
        if filename.startswith((torch_dir, _RUNTIME)) or filename == threading.__file__:
            continue
        return collective, where(filename, line, code.co_name)
    return collective, "?"
