"""The seam between the controller and whatever runs its workers.

A `Backend` starts a mesh's workers, sends them typed messages, hands the controller what they send
back (through `replies`), tells it when a worker is lost, and stops them. The controller keeps calls,
meshes and users' threads; it never touches a process or a socket. `local` runs workers on this
machine; Slurm host agents and the simulator plug in here.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from monarch.runtime.common.shape import Shape
from monarch.runtime.wire.protocol import Control

LostCallback = Callable[[int, int, str], None]
"""``(mesh id, rank, cause)``: a worker of a running mesh exited, froze or stopped taking commands."""


class Replies(Protocol):
    """Where workers' messages arrive. One thread at a time receives, holding `recv_lock`."""

    recv_lock: threading.RLock
    """The controller's receive lock: whoever receives holds it, and so does anything else that touches
    the socket (connecting it to a host agent, closing it)."""

    def recv(self, block: bool) -> Any:
        """An `Envelope` (checked and unpacked), `POKE`, `DROPPED`, or None (timed out / nothing)."""

    def poll_briefly(self, seconds: float) -> Any:
        """Like ``recv(block=False)``, trying for up to `seconds`."""

    def set_timeout(self, ms: int) -> None:
        """How long a blocking `recv` waits."""

    def poke(self) -> None:
        """Wake a thread blocked in `recv`."""

    def log(self, kind: str, detail: str) -> None:
        """Say that a message of `kind` was dropped, and why (rate-limited: `common.log.RateLimitedLog`)."""

    @property
    def reply_fd(self) -> int:
        """A descriptor that becomes readable when messages may be waiting (edge-triggered)."""


class Backend(ABC):
    """Runs workers for one controller. Methods may be called from any thread."""

    replies: Replies

    @abstractmethod
    def start(
        self, mesh_id: int, shape: Shape, labels: list[str], progress: Callable[[int], None] | None = None
    ) -> list[dict]:
        """Start one worker per point of `shape`; return once every one is ready, with each worker's
        ``{"pid", "host", "device"}``. Meanwhile `progress(ready)` is called several times a second with the
        number of workers ready, on the calling thread. Raises (naming the rank) if one fails to start, and
        `TimeoutError` after the spawn timeout; nothing is left running then."""

    @abstractmethod
    def send(self, mesh_id: int, ranks: tuple[int, ...] | None, message: Any, body: list | None = None) -> None:
        """Send a `protocol` message (and its pickled body) to `ranks` of a mesh (None: all); never waits
        for an answer. Messages to one worker arrive in the order sent."""

    @abstractmethod
    def interrupt(self, mesh_id: int, ranks: tuple[int, ...], call_id: int) -> None:
        """Raise KeyboardInterrupt in call `call_id` on `ranks` (a worker busy with another call skips it)."""

    @abstractmethod
    def control(self, mesh_id: int, ranks: tuple[int, ...], call_id: int, kind: Control) -> None:
        """Ask `ranks`, whatever their main thread is doing, to act on call `call_id`: `protocol.Control.RELEASE`
        (leave a collective the call waits in), `protocol.Control.REPORT` (say what you are doing) or
        `protocol.Control.DISCONNECT` (shut your groups' connections; `call_id` holds the groups' generation)."""

    def spans_hosts(self, mesh_id: int) -> bool:
        """Whether the mesh's workers are on more than one host (a release must then reach them all)."""
        return False

    def workers_here(self, mesh_id: int, ranks: tuple[int, ...]) -> int:
        """How many of `ranks` run on this machine, sharing its CPUs with the controller (a caller polling for
        their replies takes a CPU from them)."""
        return len(ranks)

    @abstractmethod
    def stop(self, mesh_id: int, graceful: bool) -> dict[int, int | None]:
        """Stop a mesh's workers (asking first when `graceful`, then killing) and wait until they are gone;
        returns each worker's exit status (0: it exited when asked; negative: killed by that signal)."""

    @abstractmethod
    def kill(self, mesh_id: int) -> None:
        """Kill a mesh's workers now (after a failure); does not wait."""

    def kill_rank(self, mesh_id: int, rank: int) -> None:
        """Kill one worker now (one lost while the rest of its mesh goes on: frozen, or not reading); does not
        wait. By default nothing: a backend that cannot reach one worker leaves it to the mesh's stop."""
        return None

    @abstractmethod
    def mark_gone(self, mesh_id: int) -> None:
        """Tell workers of other meshes that wait to meet one of this mesh's that it will not come."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving: after every mesh was stopped."""
