"""Broadcasts to actors (`broadcast()`), batched: they answer nothing, so a burst of them travels as a few
`Cast` messages (up to `BATCH` each, or what came within `DELAY` seconds) instead of one signed message each.

Order is kept: whatever else the controller sends a mesh (a call, tensor commands, its exit) first sends the
broadcasts queued for it (`Controller.send` calls `flush`), and a broadcast to other ranks than those queued
sends the queue first. Each broadcast's arguments are pickled when it is made, so changing them afterwards
changes nothing.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from monarch.runtime.wire import codec, protocol

if TYPE_CHECKING:
    from monarch.runtime.controller.state import SpawnedMesh

BATCH = 256
"""Broadcasts in one `Cast` at most."""
DELAY = 0.0005
"""Seconds a lone broadcast waits for others to travel with (then a thread of ours sends it)."""

Send = Callable[["SpawnedMesh", "tuple[int, ...] | None", Any, "list[bytes | memoryview] | None"], None]


class Casts:
    """The broadcasts not sent yet, per mesh, and the thread that sends a queue `DELAY` after it started."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._lock = threading.Condition()
        self.pending: dict[int, tuple[SpawnedMesh, tuple[int, ...], list[tuple[Any, ...]]]] = {}
        """Mesh id -> (mesh, the ranks its queue goes to, the queued broadcasts)."""
        self._closed = False
        threading.Thread(target=self._sender, name="monarch-casts", daemon=True).start()

    def add(self, mesh: SpawnedMesh, ranks: tuple[int, ...], item: tuple[Any, ...]) -> None:
        """Queue one broadcast (`protocol.Cast`'s item) to `ranks` of `mesh`."""
        with self._lock:
            queued = self.pending.get(mesh.mesh_id)
            if queued is not None and queued[1] != ranks:
                self._flush(mesh.mesh_id)
                queued = None
            if queued is None:
                queued = self.pending[mesh.mesh_id] = (mesh, ranks, [])
                self._lock.notify()
            queued[2].append(item)
            if len(queued[2]) >= BATCH:
                self._flush(mesh.mesh_id)

    def flush(self, mesh_id: int) -> None:
        """Send `mesh_id`'s queued broadcasts now (before anything else goes to that mesh)."""
        with self._lock:
            self._flush(mesh_id)

    def drop(self, mesh_id: int) -> None:
        """Forget a mesh's queue (it failed: nothing can be delivered)."""
        with self._lock:
            self.pending.pop(mesh_id, None)

    def _flush(self, mesh_id: int) -> None:
        queued = self.pending.pop(mesh_id, None)
        if queued is not None:
            mesh, ranks, items = queued
            self._send(mesh, ranks, protocol.Cast(), codec.dumps(items))

    def _sender(self) -> None:
        with self._lock:
            while not self._closed:
                if not self.pending:
                    self._lock.wait()
                    continue
                self._lock.wait(DELAY)  # (others queued meanwhile travel together)
                for mesh_id in list(self.pending):
                    try:
                        self._flush(mesh_id)
                    except Exception:  # a bug of ours: said, and the thread goes on
                        traceback.print_exc(file=sys.__stderr__)

    def close(self) -> None:
        with self._lock:
            for mesh_id in list(self.pending):
                self._flush(mesh_id)
            self._closed = True
            self._lock.notify()
