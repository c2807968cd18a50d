"""Serving workers' input requests (`input()`, pdb prompts) on the controller, one rank at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from monarch.runtime import wire

if TYPE_CHECKING:
    from monarch.runtime.controller import SpawnedMesh


@dataclass
class InputRequest:
    """A worker waiting for a line of input (`input()`, `sys.stdin`, or its pdb prompt)."""

    mesh: SpawnedMesh
    rank: int
    label: str
    call_id: int | None
    req_id: int
    prompt: str
    password: bool
    debugger: bool
    """Asked by pdb: the same rank's next prompt is served before other ranks'."""


RESUME_COMMANDS = frozenset({"c", "cont", "continue", "q", "quit", "exit"})
OWNER_GRACE = 1.0
"""Seconds a debugged rank keeps the prompt after a command, before other paused ranks are served."""


def _terminal_input(req: InputRequest) -> str:
    return input(f"[{req.label}] {req.prompt}")


class StdinService:
    """The controller's part that answers input requests (mixed into `Controller`)."""

    def _on_input(self, req: InputRequest) -> None:
        pending = self.calls.get(req.call_id) if req.call_id is not None else None
        reason = "the call it belongs to is over" if pending is None else pending.no_stdin
        if reason is not None:
            self._answer(req, False, f"input() / pdb on rank {req.rank} ({req.label}) has no stdin: {reason}")
        else:
            self.stdin_queue.append(req)

    def _answer(self, req: InputRequest, ok: bool, text: str) -> None:
        if req.mesh.state == "running":
            self.send(req.mesh, (req.rank,), wire.encode(self.key, ("stdin", req.req_id, ok, text)))

    def _next_request(self) -> InputRequest | None:
        """The next request to serve: the rank being debugged keeps the prompt for a moment."""
        queue = self.stdin_queue
        owner = self._stdin_owner
        if owner is not None:
            for req in queue:
                if (req.mesh.mesh_id, req.rank) == owner:
                    queue.remove(req)
                    return req
            if time.monotonic() - self._owner_since < OWNER_GRACE:
                return None
            self._stdin_owner = None
        return queue.popleft() if queue else None

    def serve_stdin(self) -> bool:
        """Answer one waiting input request with `self.stdin`; False if none is ready.

        Called by threads waiting for calls. A `KeyboardInterrupt` in the handler propagates (the
        caller interrupts the workers); other errors go back to the worker as its error.
        """
        if not self._stdin_lock.acquire(blocking=False):
            return False  # another waiting thread is serving a prompt: one prompt at a time
        try:
            return self._serve_one()
        finally:
            self._stdin_lock.release()

    def _serve_one(self) -> bool:
        req = self._next_request()
        if req is None:
            return False
        with self._rx_count_lock:
            self._rx_waiters -= 1  # let the I/O thread receive (other ranks' output) meanwhile
        self._wake()
        try:
            break_line = getattr(self.output, "break_line", None)
            if break_line is not None:
                break_line()
            text = self.stdin(req)
        except KeyboardInterrupt:
            self._stdin_owner = None
            raise
        except Exception as e:
            self._stdin_owner = None
            what = f"input() / pdb on rank {req.rank} ({req.label})"
            self._answer(req, False, f"{what} got no answer: {type(e).__name__}: {e}")
            return True
        finally:
            with self._rx_count_lock:
                self._rx_waiters += 1
        resumed = not req.debugger or text.strip().split(" ")[0] in RESUME_COMMANDS
        self._stdin_owner = None if resumed else (req.mesh.mesh_id, req.rank)
        self._owner_since = time.monotonic()
        self._answer(req, True, text)
        return True
