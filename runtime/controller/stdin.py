"""Serving workers' input requests (`input()`, pdb prompts) on the controller, one rank at a time.

In a script, pdb prompts go to the script debugger instead (`debugger.DebugServer`, `monarch debug`)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from monarch.runtime.common import load
from monarch.runtime.wire import protocol

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from monarch.runtime.controller.core import Controller
    from monarch.runtime.controller.state import SpawnedMesh


@dataclass
class InputRequest:
    """A worker waiting for a line of input (`input()`, `sys.stdin`, or its pdb prompt)."""

    mesh: SpawnedMesh
    """The `SpawnedMesh` it belongs to."""
    rank: int
    label: str
    call_id: int | None
    req_id: int
    prompt: str
    password: bool
    debugger: bool
    """Asked by pdb: the same rank's next prompt is served before other ranks'."""
    where: str = ""
    """For pdb: where it stopped (``script.py:12``)."""


RESUME_COMMANDS = frozenset({"c", "cont", "continue", "q", "quit", "exit"})
OWNER_GRACE = 1.0
"""Seconds a debugged rank keeps the prompt after a command, before other paused ranks are served (on a quiet
machine; stretched on a busy one: `load.stretched`)."""


def terminal_input(req: InputRequest) -> str:
    """The default answerer: this process's terminal."""
    return input(f"[{req.label}] {req.prompt}")


class _DebugServer(Protocol):
    """What the service needs of the script debugger's server (`debugger.DebugServer`, which imports this
    module)."""

    closed: bool

    def add(self, req: InputRequest) -> bool: ...

    def close(self) -> None: ...


class _Receiver(Protocol):
    """What serving a prompt needs of the controller's `receiving.Receiver` (which imports this module)."""

    def standing_aside(self) -> AbstractContextManager[None]: ...


class StdinService:
    """The controller's part that answers input requests: queued by the receiving thread, served by a
    thread waiting for a call (so a prompt appears where the user waits)."""

    def __init__(self, controller: Controller, debug_server: Callable[[Any], _DebugServer] | None = None) -> None:
        self.controller = controller
        """The `core.Controller` (not named as a type: it imports this module)."""
        self._make_debug_server = debug_server
        """Makes the script debugger's server from the controller (`debugger.DebugServer`); None: no server."""
        self.debug_server: _DebugServer | None = None
        """In a script, the `debugger.DebugServer` that pdb prompts go to (made when a rank first pauses)."""
        self.prompt: Callable[[InputRequest], str] = terminal_input
        """Answers one request (the notebook extension puts the notebook's stdin here)."""
        self.queue: collections.deque[InputRequest] = collections.deque()
        self._lock = threading.Lock()  # held by the thread serving a prompt
        self._owner: tuple[int, int] | None = None
        self._owner_since = 0.0

    def waiting(self) -> list[InputRequest]:
        """Requests not yet served (e.g. other ranks paused in pdb)."""
        return list(self.queue)

    def on_request(self, req: InputRequest) -> None:
        """A worker asked (receiving thread): queue it, or answer at once that no input will come."""
        pending = self.controller.calls.get(req.call_id) if req.call_id is not None else None
        reason = "the call it belongs to is over" if pending is None else pending.no_stdin
        if reason is not None:
            self.answer(req, False, f"input() / pdb on rank {req.rank} ({req.label}) has no stdin: {reason}")
        elif not (req.debugger and self.prompt is terminal_input and self._to_debug_server(req)):
            self.queue.append(req)

    def _to_debug_server(self, req: InputRequest) -> bool:
        """In a script (the prompt is still the terminal), a pdb prompt waits for `monarch debug` to attach,
        so several paused ranks can be looked at in any order. False if the server cannot run (it said why):
        the terminal serves the prompt then, as before."""
        server = self.debug_server
        if server is None or server.closed:
            if self._make_debug_server is None:
                return False
            server = self.debug_server = self._make_debug_server(self.controller)
        return server.add(req)

    def close(self) -> None:
        """The controller shuts down: stop the debug server (its socket is removed)."""
        if self.debug_server is not None:
            self.debug_server.close()

    def echo(self, req: InputRequest, text: str) -> None:
        """Show `text` (a prompt being served, then its answer) in the rank's own output, where a terminal shows
        them (a notebook's input box shows them apart, after the cell's rank areas)."""
        pending = self.controller.calls.get(req.call_id) if req.call_id is not None else None
        if pending is not None:
            self.controller.receiver.notice(pending, req.rank, text, "stdout")

    def answer(self, req: InputRequest, ok: bool, text: str) -> None:
        if req.mesh.state == "running":
            self.controller.send(req.mesh, (req.rank,), protocol.StdinReply(req.req_id, ok, text))

    def _next_request(self) -> InputRequest | None:
        """The next request to serve: the rank being debugged keeps the prompt for a moment."""
        queue = self.queue
        owner = self._owner
        if owner is not None:
            for req in queue:
                if (req.mesh.mesh_id, req.rank) == owner:
                    queue.remove(req)
                    return req
            if time.monotonic() - self._owner_since < load.stretched(OWNER_GRACE):
                return None
            self._owner = None
        return queue.popleft() if queue else None

    def serve(self, receiver: _Receiver) -> bool:
        """Answer one waiting request with `self.prompt`; False if none is ready.

        Called by threads waiting for calls. A `KeyboardInterrupt` in the answerer propagates (the caller
        interrupts the workers); other errors go back to the worker as its error.
        """
        if not self._lock.acquire(blocking=False):
            return False  # another waiting thread is serving a prompt: one prompt at a time
        try:
            req = self._next_request()
            if req is None:
                return False
            with receiver.standing_aside():  # the I/O thread receives other ranks' output meanwhile
                text = self._ask(req)
            if text is None:
                return True
            resumed = not req.debugger or text.strip().split(" ")[0] in RESUME_COMMANDS
            self._owner = None if resumed else (req.mesh.mesh_id, req.rank)
            self._owner_since = time.monotonic()
            self.answer(req, True, text)
            return True
        finally:
            self._lock.release()

    def _ask(self, req: InputRequest) -> str | None:
        try:
            break_line = getattr(self.controller.output, "break_line", None)
            if break_line is not None:
                break_line()
            return self.prompt(req)
        except KeyboardInterrupt:
            self._owner = None
            raise
        except Exception as e:
            self._owner = None
            what = f"input() / pdb on rank {req.rank} ({req.label})"
            self.answer(req, False, f"{what} got no answer: {type(e).__name__}: {e}")
            return None
